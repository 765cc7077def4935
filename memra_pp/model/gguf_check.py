"""A bounds check of a GGUF file's header and metadata before gguf's reader parses them (any process that opens a
GGUF). The reader loops over every array's count as written: a count corrupted to 2**40 makes it build views past
the end of the file until the process runs out of memory. Here every count and length is checked against the bytes
left, so such a file is a ConfigError naming the key, in O(metadata) time.
"""
from __future__ import annotations

import mmap
import struct
from pathlib import Path

from ..errors import ConfigError

# GGUF value types: fixed sizes of the scalars; 8 = string (u64 length + bytes), 9 = array (u32 type, u64 count)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def check_gguf_metadata(path: Path) -> None:
    """Refuse a GGUF whose header or metadata claims more bytes than the file has (or an unknown value type)."""
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

    for i in range(n_kv):
        start = off
        off = string(off, f"metadata key {i}")
        key = bytes(m[start + 8:off]).decode("utf-8", "replace")
        vtype, off = u("I", off)
        off = value(vtype, off, key)
