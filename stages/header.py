"""Boundary headers: msgpack dicts with int arrays carried as tagged binaries; runs in every stage process.

`decode_header` turns anything malformed into `ProtocolError`, never another exception.
"""

from __future__ import annotations

import math
import struct

import msgpack
import numpy as np
import torch

from memra_pp.errors import ProtocolError

# Ext payload of an array: dtype code (u8), ndim (u8), ndim x dim (u32), then the C-order little-endian bytes.
ARRAY_EXT = 1
_DTYPES = {
    1: (np.dtype("<i1"), torch.int8), 2: (np.dtype("<i2"), torch.int16), 3: (np.dtype("<i4"), torch.int32),
    4: (np.dtype("<i8"), torch.int64), 5: (np.dtype("u1"), torch.uint8), 6: (np.dtype("?"), torch.bool),
    7: (np.dtype("<f4"), torch.float32), 8: (np.dtype("<f8"), torch.float64),
}
_CODE_OF_NP = {np_dt: code for code, (np_dt, _) in _DTYPES.items()}
_CODE_OF_TORCH = {t_dt: code for code, (_, t_dt) in _DTYPES.items()}
_MAX_NDIM = 8

# The only schema the transport imposes; everything else in a header is the runner's business.
REQUIRED = {"kind": str, "mb": int}


def _pack_array(code: int, shape: tuple[int, ...], raw: bytes) -> msgpack.ExtType:
    if len(shape) > _MAX_NDIM:
        raise ValueError(f"header array has {len(shape)} dims, at most {_MAX_NDIM} are carried")
    return msgpack.ExtType(ARRAY_EXT, struct.pack(f"<BB{len(shape)}I", code, len(shape), *shape) + raw)


def _default(obj):
    if isinstance(obj, torch.Tensor):
        code = _CODE_OF_TORCH.get(obj.dtype)
        if code is None:
            raise TypeError(f"header tensor of dtype {obj.dtype} is not carried; use one of "
                            f"{sorted(map(str, _CODE_OF_TORCH))}")
        arr = obj.detach().cpu().contiguous().numpy()
        return _pack_array(code, tuple(arr.shape), arr.astype(_DTYPES[code][0], copy=False).tobytes())
    if isinstance(obj, np.ndarray):
        code = _CODE_OF_NP.get(obj.dtype.newbyteorder("<") if obj.dtype.byteorder == ">" else obj.dtype)
        if code is None:
            raise TypeError(f"header array of dtype {obj.dtype} is not carried")
        arr = np.ascontiguousarray(obj, dtype=_DTYPES[code][0])
        return _pack_array(code, arr.shape, arr.tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"header value of type {type(obj).__name__} is not msgpack-encodable")


def _ext_hook(code: int, data: bytes):
    if code != ARRAY_EXT:
        raise ProtocolError(f"header carries unknown msgpack ext type {code} (only {ARRAY_EXT}: array)")
    if len(data) < 2:
        raise ProtocolError(f"header array ext is {len(data)} bytes, shorter than its 2-byte prefix")
    dcode, ndim = data[0], data[1]
    if dcode not in _DTYPES or ndim > _MAX_NDIM or len(data) < 2 + 4 * ndim:
        raise ProtocolError(f"header array ext has bad prefix: dtype code {dcode}, ndim {ndim}, {len(data)} bytes")
    shape = struct.unpack_from(f"<{ndim}I", data, 2)
    np_dt, t_dt = _DTYPES[dcode]
    off = 2 + 4 * ndim
    count = math.prod(shape)  # Python ints: a corrupt shape must not overflow into a plausible size
    if len(data) - off != count * np_dt.itemsize:
        raise ProtocolError(f"header array of shape {list(shape)} {t_dt} needs {count * np_dt.itemsize} bytes, "
                            f"frame has {len(data) - off}")
    arr = np.frombuffer(data, dtype=np_dt, count=count, offset=off)
    if dcode == 6 and arr.view(np.uint8).max(initial=0) > 1:
        raise ProtocolError("header bool array holds bytes other than 0 and 1")
    # copy: the frame buffer is reused for the next frame and is read-only to torch
    return torch.from_numpy(arr.reshape(shape).copy())


def encode_header(header: dict) -> bytes:
    """msgpack bytes of `header`; torch / numpy int, bool, float arrays travel as tagged binaries."""
    check_schema(header, ValueError)
    return msgpack.packb(header, default=_default, use_bin_type=True)


def decode_header(b) -> dict:
    """Inverse of `encode_header` over any bytes-like; raises `ProtocolError` naming what was wrong."""
    try:
        obj = msgpack.unpackb(b, ext_hook=_ext_hook, raw=False, strict_map_key=True)
    except ProtocolError:
        raise
    except Exception as e:  # the contract is "a dict or ProtocolError": msgpack raises several unrelated types
        raise ProtocolError(f"boundary header did not decode ({len(b)} bytes): {type(e).__name__}: {e}") from e
    check_schema(obj, ProtocolError)
    return obj


def check_schema(obj, error: type[Exception]) -> None:
    """Raise `error` unless `obj` is a dict with str keys holding the REQUIRED keys at their types."""
    if type(obj) is dict and type(obj.get("kind")) is str and type(obj.get("mb")) is int \
            and all(type(k) is str for k in obj):
        return  # the per-frame path: one pass, no message formatting
    if not isinstance(obj, dict):
        raise error(f"boundary header must be a map, got {type(obj).__name__}")
    for key, typ in REQUIRED.items():
        if key not in obj:
            raise error(f"boundary header lacks required key {key!r} (has {sorted(map(str, obj))[:8]})")
        val = obj[key]
        if not isinstance(val, typ) or isinstance(val, bool):
            raise error(f"boundary header key {key!r} must be {typ.__name__}, got {type(val).__name__}")
    bad = [k for k in obj if not isinstance(k, str)]
    if bad:
        raise error(f"boundary header keys must be str, got {bad[:3]!r}")
