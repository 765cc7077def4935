"""GGUF files read here, not by gguf-py's GGUFReader, in one bounds-checked pass over the header and metadata.

The reader looped over every array's count as written: a count corrupted to 2**40 made it build views past the end
of the file until the process ran out of memory. Here every count and length is checked against the bytes left, so
such a file is a ConfigError naming the key, in O(metadata) time; keys and tensor names appear once, and every
tensor's bytes lie aligned inside the file and apart from the others'. The reader also built a numpy view of every
string: a real vocabulary (Qwen3.5's 248,320 tokens and as many merges) took it 16-19 s a parse, and a launch parsed
the file three times. Values here are decoded when asked for, and a process opens each file once (`open_gguf`).
"""
from __future__ import annotations

import mmap
import os
import stat
import struct
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np

from ..errors import ConfigError

# GGUF value types: fixed sizes of the scalars; 8 = string (u64 length + bytes), 9 = array (u32 type, u64 count)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_FORMAT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: np.uint8, 1: np.int8, 2: np.uint16, 3: np.int16, 4: np.uint32, 5: np.int32, 6: np.float32,
          7: np.bool_, 10: np.uint64, 11: np.int64, 12: np.float64}
_STRING, _ARRAY = 8, 9
_OPENED: dict[tuple, "GGUFFile"] = {}       # (path, inode, size, mtime) -> the file as read, the latest two
_OPENED_LOCK = threading.Lock()


def open_gguf(path: Path) -> "GGUFFile":
    """The GGUF file at `path`, checked and read (GGUFFile); a missing, bad or truncated file is a ConfigError
    naming it. A process that opens one file twice (the driver: its config, then its tokenizer) reads it once."""
    path = Path(path)
    try:
        st = os.stat(path)
        key = (str(path.resolve()), st.st_ino, st.st_size, st.st_mtime_ns)
        with _OPENED_LOCK:
            hit = _OPENED.get(key)
        if hit is not None:
            return hit
        f = GGUFFile(path)
    except FileNotFoundError:
        raise ConfigError(f"{path}: GGUF file does not exist") from None
    except ConfigError:     # the scan's own, already naming the file
        raise
    except Exception as e:  # noqa: BLE001 - the OS's (a symlink loop, no permission) or numpy's on a changed file
        raise ConfigError(f"{path}: not a readable GGUF file, truncated or corrupt ({type(e).__name__}: {e})") from None
    with _OPENED_LOCK:
        _OPENED[key] = f
        while len(_OPENED) > 2:
            del _OPENED[next(iter(_OPENED))]
    return f


def is_gguf(path: Path) -> bool:
    """A GGUF file by its first bytes, whatever its name (`Qwen3.5-Q8_0.GGUF`, a file without a suffix); only a
    regular file is opened (a FIFO's open would wait for a writer)."""
    try:
        if not Path(path).is_file():
            return False
        with open(path, "rb") as fh:
            return fh.read(4) == b"GGUF"
    except OSError:
        return False


def gguf_named(path: Path) -> bool:
    """A path to read as GGUF: named `.gguf` (in any case; a missing or bad one is then refused as GGUF), or a
    file that is one by its magic."""
    return path.suffix.lower() == ".gguf" or is_gguf(path)


def gguf_files(directory: Path) -> list[Path]:
    """The GGUF files of a model directory: `*.gguf` in any case, sorted by name."""
    return sorted(f for f in directory.iterdir() if f.suffix.lower() == ".gguf")


class GGUFField:
    """One metadata value, decoded at its first `contents()` (as gguf-py's ReaderField.contents(): a str, an int,
    a float, a bool or a list of them); a string that is not UTF-8 raises UnicodeDecodeError there."""
    __slots__ = ("_file", "name", "vtype", "_at", "_value")

    def __init__(self, file: "GGUFFile", name: str, vtype: int, at: int):
        self._file, self.name, self.vtype, self._at, self._value = file, name, vtype, at, None

    def contents(self):
        if self._value is None:
            self._value = (self._file._decode(self.vtype, self._at)[0],)
        v = self._value[0]
        return list(v) if isinstance(v, list) else v     # (a caller's edit must not reach the next caller)


class GGUFTensor(NamedTuple):
    """One tensor as gguf-py's ReaderTensor gives it: `shape` in GGUF order (ne, the reverse of torch's), `data` a
    read-only view of the file (typed for F16/F32/F64/I*, else the blocks' bytes, as gguf.quants.dequantize reads)."""
    name: str
    tensor_type: object         # gguf.GGMLQuantizationType
    shape: np.ndarray
    data: np.ndarray


class GGUFFile:
    """A GGUF file's metadata (`fields`: key -> GGUFField) and tensors (`tensors`), over a read-only mapping."""

    def __init__(self, path: Path):
        import gguf
        self.path = Path(path)
        if not stat.S_ISREG(os.stat(path).st_mode):
            raise ConfigError(f"{path}: not a regular file (a GGUF model is one file)")
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if size < 24:
                raise ConfigError(f"{path}: not a GGUF file ({size} bytes, shorter than the header)")
            self._m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        fields, infos, data = _scan(self._m, size, path)
        self.fields = {k: GGUFField(self, k, vtype, at) for k, (vtype, at) in fields.items()}
        raw = np.frombuffer(self._m, np.uint8)
        self.tensors = []
        for name, dims, ttype, at in infos:
            qt = gguf.GGMLQuantizationType(ttype)
            block, nbytes = gguf.GGML_QUANT_SIZES[qt]
            n = int(np.prod(dims, dtype=np.int64)) if dims else 1
            np_dims = tuple(reversed(dims))
            item = _TYPED.get(qt.name)
            if item is None:    # quantized (and BF16): the rows' bytes, shaped as gguf-py's reader shapes them
                view = raw[data + at:data + at + n // block * nbytes]
                view = view.reshape(gguf.quant_shape_to_byte_shape(np_dims, qt))
            else:
                view = np.frombuffer(self._m, item, n, data + at).reshape(np_dims)
            self.tensors.append(GGUFTensor(name, qt, np.array(dims, np.uint64), view))

    def _decode(self, vtype: int, at: int):
        """(value, offset past it) of a value of type `vtype` at `at` (its bounds were checked by the scan)."""
        m = self._m
        if vtype in _FORMAT:
            return struct.unpack_from("<" + _FORMAT[vtype], m, at)[0], at + _SCALAR[vtype]
        if vtype == _STRING:
            n = struct.unpack_from("<Q", m, at)[0]
            return str(m[at + 8:at + 8 + n], "utf-8"), at + 8 + n
        itype, count = struct.unpack_from("<IQ", m, at)
        at += 12
        if itype in _NUMPY:
            return np.frombuffer(m, _NUMPY[itype], count, at).tolist(), at + count * _SCALAR[itype]
        out = []
        if itype == _STRING:        # the hot loop of a vocabulary: inline, not _decode per item
            unpack = struct.Struct("<Q").unpack_from
            for _ in range(count):
                n = unpack(m, at)[0]
                out.append(str(m[at + 8:at + 8 + n], "utf-8"))
                at += 8 + n
            return out, at
        for _ in range(count):
            v, at = self._decode(itype, at)
            out.append(v)
        return out, at


_TYPED = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8, "I16": np.int16, "I32": np.int32,
          "I64": np.int64}


def gguf_field(reader, path: Path, key: str, default=KeyError, missing: str = ""):
    """Metadata `key`'s value; absent: `default`, or (none given) a ConfigError naming the key (and `missing`, what
    its absence means); a value that does not decode (a mutated string or array) is a ConfigError too."""
    f = reader.fields.get(key)
    if f is None:
        if default is KeyError:
            raise ConfigError(f"{path}: GGUF metadata key {key!r} is missing{missing}")
        return default
    try:
        return f.contents()
    except (UnicodeDecodeError, ValueError, IndexError) as e:
        raise ConfigError(f"{path}: GGUF metadata key {key!r} does not decode ({type(e).__name__}: {e})") from None


def _scan(m, size: int, path: Path) -> tuple[dict, list, int]:
    """({key: (value type, the value's offset)}, [(tensor name, GGUF dims, type, offset in the data)], the data's
    start), every count and length checked against the file's size."""
    def bad(what: str) -> ConfigError:
        return ConfigError(f"{path}: not a readable GGUF file, truncated or corrupt ({what})")

    def u(fmt: str, off: int) -> tuple[int, int]:
        n = struct.calcsize(fmt)
        if off + n > size:
            raise bad(f"the file ends inside the header at byte {off}")
        return struct.unpack_from("<" + fmt, m, off)[0], off + n

    if m[:4] != b"GGUF":
        raise bad(f"magic {bytes(m[:4])!r} is not b'GGUF'")
    version, off = u("I", 4)
    if version not in (2, 3) and struct.unpack_from(">I", m, 4)[0] in (2, 3):
        raise bad("a big-endian GGUF: only little-endian files are read; convert it with gguf-py's "
                  "gguf-convert-endian (little)")
    if version not in (2, 3):
        raise bad(f"version {version}: only GGUF 2 and 3 are read")
    n_tensors, off = u("Q", off)
    n_kv, off = u("Q", off)
    if n_kv > size // 13 or n_tensors > size // 24:     # the least bytes a key/value pair and a tensor info take
        raise bad(f"{n_kv} metadata keys and {n_tensors} tensors cannot fit in {size} bytes")

    def string(off: int, what: str) -> int:
        n, off = u("Q", off)
        if n > size - off:
            raise bad(f"{what}: a string of {n} bytes where {size - off} remain")
        return off + n

    def value(vtype: int, off: int, key: str) -> int:
        if vtype in _SCALAR:
            if off + _SCALAR[vtype] > size:
                raise bad(f"{key!r}: the file ends inside its value")
            return off + _SCALAR[vtype]
        if vtype == _STRING:
            return string(off, repr(key))
        if vtype == _ARRAY:
            itype, off = u("I", off)
            count, off = u("Q", off)
            least = _SCALAR.get(itype, 8 if itype == _STRING else 12)    # a string or nested array: its length
            if itype not in _SCALAR and itype not in (_STRING, _ARRAY):
                raise bad(f"{key!r}: array of unknown value type {itype}")
            if count * least > size - off:
                raise bad(f"{key!r}: an array of {count} items where {size - off} bytes remain")
            if itype in _SCALAR:
                return off + count * least
            for _ in range(count):
                off = value(itype, off, key)
            return off
        raise bad(f"{key!r}: unknown value type {vtype}")

    keys, alignment = {}, 32          # GGUF's default alignment of the tensor data
    for i in range(n_kv):
        start = off
        off = string(off, f"metadata key {i}")
        key = bytes(m[start + 8:off]).decode("utf-8", "replace")
        if key in keys:     # two values for one key: which one a reader takes is not the file's to say
            raise bad(f"metadata key {key!r} is written twice")
        vtype, at = u("I", off)
        off = value(vtype, at, key)
        keys[key] = (vtype, at)
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", m, at)[0] if vtype == 4 else 0
            if alignment <= 0 or alignment & (alignment - 1):
                raise bad("metadata key 'general.alignment' must be a uint32 power of two")
    infos, data = _scan_tensors(m, size, off, n_tensors, alignment, u, string, bad)
    return keys, infos, data


def _scan_tensors(m, size: int, off: int, n_tensors: int, alignment: int, u, string, bad) -> tuple[list, int]:
    """Every tensor's info (name once, 1..4 dims, a known type, whole blocks per row) and its bytes inside the file,
    so that a bad one is refused by name (the reader would say only "cannot reshape array of size ...")."""
    import gguf
    infos, names = [], set()
    for i in range(n_tensors):
        start = off
        off = string(off, f"tensor info {i}")
        name = bytes(m[start + 8:off]).decode("utf-8", "replace")
        if name in names:
            raise bad(f"tensor {name!r} is listed twice")
        names.add(name)
        n_dims, off = u("I", off)
        if not 1 <= n_dims <= 4:
            raise bad(f"tensor {name!r} has {n_dims} dimensions; GGUF allows 1 to 4")
        dims = []
        for _ in range(n_dims):
            d, off = u("Q", off)
            dims.append(d)
        ttype, off = u("I", off)
        at, off = u("Q", off)
        infos.append((name, dims, ttype, at))
    data = off + -off % alignment
    spans = []
    for name, dims, ttype, at in infos:
        shape = tuple(reversed(dims))       # (torch order: GGUF ne is the reverse)
        try:
            qt = gguf.GGMLQuantizationType(ttype)
            block, nbytes = gguf.GGML_QUANT_SIZES[qt]
        except (ValueError, KeyError):
            raise bad(f"tensor {name!r} has unknown type {ttype}") from None
        if dims[0] % block:
            raise bad(f"tensor {name!r} of shape {shape} is {qt.name}, whose blocks hold {block} values, but its rows "
                      f"hold {dims[0]}")
        n = 1
        for d in dims:
            n *= d
        end = data + at + n // block * nbytes
        if at % alignment or end > size:
            raise bad(f"tensor {name!r} ({qt.name}, shape {shape}) lies at bytes {data + at}..{end} of a file of "
                      f"{size} bytes" + (f", not aligned to {alignment}" if at % alignment else ""))
        spans.append((data + at, end, name))
    spans.sort()
    for (_, end, name), (start, _, other) in zip(spans, spans[1:]):
        if start < end:     # two tensors read from the same bytes: one of them is another's data
            raise bad(f"tensor {other!r} starts at byte {start}, inside tensor {name!r} (which ends at {end})")
    return infos, data
