"""A bounds check of a GGUF file's header and metadata before gguf's reader parses them (any process that opens a
GGUF). The reader loops over every array's count as written: a count corrupted to 2**40 makes it build views past
the end of the file until the process runs out of memory. Here every count and length is checked against the bytes
left, so such a file is a ConfigError naming the key, in O(metadata) time; keys and tensor names appear once,
and every tensor's bytes lie aligned inside the file and apart from the others'.
"""
from __future__ import annotations

import mmap
import os
import stat
import struct
from pathlib import Path

from ..errors import ConfigError

# GGUF value types: fixed sizes of the scalars; 8 = string (u64 length + bytes), 9 = array (u32 type, u64 count)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def open_gguf(path: Path):
    """gguf's reader over the file at `path`, checked first (check_gguf_metadata: a corrupt count must not exhaust
    memory in the reader); a missing, bad or truncated file is a ConfigError naming it."""
    import gguf
    try:
        check_gguf_metadata(path)
        return gguf.GGUFReader(str(path))
    except FileNotFoundError:
        raise ConfigError(f"{path}: GGUF file does not exist") from None
    except ConfigError:     # the metadata check's own, already naming the file
        raise
    except Exception as e:  # GGUFReader raises ValueError/KeyError/IndexError on bad or truncated files
        raise ConfigError(f"{path}: not a readable GGUF file, truncated or corrupt ({type(e).__name__}: {e})") from None


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


def check_gguf_metadata(path: Path) -> None:
    """Refuse a GGUF whose header or metadata claims more bytes than the file has (or an unknown value type), and a
    path that is no regular file (a FIFO's open would wait for a writer forever)."""
    if not stat.S_ISREG(os.stat(path).st_mode):
        raise ConfigError(f"{path}: not a regular file (a GGUF model is one file)")
    with open(path, "rb") as f:
        size = f.seek(0, 2)
        if size < 24:
            raise ConfigError(f"{path}: not a GGUF file ({size} bytes, shorter than the header)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            _scan(m, size, path)


def _scan(m, size: int, path: Path) -> None:
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

    keys, alignment = set(), 32          # GGUF's default alignment of the tensor data
    for i in range(n_kv):
        start = off
        off = string(off, f"metadata key {i}")
        key = bytes(m[start + 8:off]).decode("utf-8", "replace")
        if key in keys:     # two values for one key: which one a reader takes is not the file's to say
            raise bad(f"metadata key {key!r} is written twice")
        keys.add(key)
        vtype, at = u("I", off)
        off = value(vtype, at, key)
        if key == "general.alignment":
            alignment = struct.unpack_from("<I", m, at)[0] if vtype == 4 else 0
            if alignment <= 0 or alignment & (alignment - 1):
                raise bad("metadata key 'general.alignment' must be a uint32 power of two")
    _scan_tensors(m, size, off, n_tensors, alignment, u, string, bad)


def _scan_tensors(m, size: int, off: int, n_tensors: int, alignment: int, u, string, bad) -> None:
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
