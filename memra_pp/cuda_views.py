"""Raw device bytes as torch tensors: through `__cuda_array_interface__` (slots of the primary context) or a
DLPack capsule (which does not make torch query the pointer, so memory of another context can be wrapped for the
battery's refusal checks). Runs in a stage process."""
from __future__ import annotations

import ctypes

from memra_pp.cuda import CudaError

class _CudaArray:
    """Raw device bytes exposed through `__cuda_array_interface__` (torch keeps this object alive with the tensor)."""

    def __init__(self, ptr: int, nbytes: int, owner=None):
        self._owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "strides": None,
                                          "version": 2}


def device_bytes(ptr: int, nbytes: int, device_index: int, owner=None):
    """A uint8 torch tensor over `nbytes` at `ptr` (no copy); the memory must be usable in torch's context."""
    import torch

    t = torch.as_tensor(_CudaArray(ptr, nbytes, owner), device=f"cuda:{device_index}")
    if t.data_ptr() != ptr:
        raise CudaError(f"torch copied device memory at {ptr:#x} instead of aliasing it")
    return t


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16),
                ("shape", ctypes.POINTER(ctypes.c_int64)), ("strides", ctypes.POINTER(ctypes.c_int64)),
                ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p)]


def dlpack_bytes(ptr: int, nbytes: int, device_type: int, device_id: int):
    """A uint8 tensor over raw memory through a DLPack capsule: torch takes the device from the capsule and never
    queries the pointer, so this wraps memory torch's runtime would refuse (e.g. from a cuCtxCreate context).
    device_type: 1 CPU, 2 CUDA. The 48-byte descriptor is deliberately leaked (torch reads it again at free
    time); the caller keeps the memory alive for the tensor's life."""
    import torch

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    raw = libc.malloc(ctypes.sizeof(_DLManagedTensor) + 8)
    if not raw:
        raise MemoryError("malloc of a DLPack descriptor failed")
    m = _DLManagedTensor.from_address(raw)
    shape = ctypes.cast(raw + ctypes.sizeof(_DLManagedTensor), ctypes.POINTER(ctypes.c_int64))
    shape[0] = nbytes
    m.dl_tensor.data, m.dl_tensor.ndim, m.dl_tensor.shape = ptr, 1, shape
    m.dl_tensor.device = _DLDevice(device_type, device_id)
    m.dl_tensor.code, m.dl_tensor.bits, m.dl_tensor.lanes = 1, 8, 1  # kDLUInt, 8 bits
    m.dl_tensor.strides, m.dl_tensor.byte_offset, m.manager_ctx, m.deleter = None, 0, None, None
    new_capsule = ctypes.pythonapi.PyCapsule_New
    new_capsule.restype = ctypes.py_object
    new_capsule.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    t = torch.from_dlpack(new_capsule(raw, b"dltensor", None))
    if t.data_ptr() != ptr:
        raise CudaError(f"torch copied memory at {ptr:#x} instead of aliasing it")
    return t
