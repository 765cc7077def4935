"""Checked cuda-python driver calls (imported lazily, so CPU-only machines import this module); they run in a
stage process, normally with the device's primary context (torch's) current."""
from __future__ import annotations

import contextlib
import ctypes
import functools
from dataclasses import dataclass

from memra_pp.errors import MemraError

IPC_HANDLE_BYTES = 64  # drv.CU_IPC_HANDLE_SIZE, for memory and event handles alike
SLOT_ALIGN = 2 << 20   # IPC exposes a whole allocation: share only dedicated, 2 MiB-aligned ones


class CudaError(MemraError):
    """A CUDA driver call failed; names the call and the driver's error name."""


@functools.cache
def drv():
    """The `cuda.bindings.driver` module, imported on first use (cached: an import statement per driver call cost a
    microsecond, and a boundary handoff makes half a dozen; a failed import is not cached)."""
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise CudaError("cuda-bindings is not installed; install the gpu extra: pip install 'memra_pp[gpu]'") from e
    return driver


def ck(result, call_name: str):
    """Check a driver result tuple `(CUresult, *values)`; return None, the value, or the tuple of values."""
    err, *rest = result
    if int(err) != 0:
        name_err, name = drv().cuGetErrorName(err)
        label = name.decode() if int(name_err) == 0 and name else f"CUresult {int(err)}"
        raise CudaError(f"{call_name} failed: {label}")
    if not rest:
        return None
    return rest[0] if len(rest) == 1 else tuple(rest)


def init() -> None:
    try:
        ck(drv().cuInit(0), "cuInit")
    except RuntimeError as e:  # cuda-bindings raises RuntimeError when libcuda.so cannot be loaded
        raise CudaError(f"cuInit failed: no CUDA driver on this machine ({e})") from e


def device(index: int):
    init()
    return ck(drv().cuDeviceGet(index), f"cuDeviceGet({index})")


def context_uid(ctx) -> int:
    """cuCtxGetId: unique for the life of the process (handle values can be reused after a destroy)."""
    return int(ck(drv().cuCtxGetId(ctx), "cuCtxGetId"))


def current_context():
    return ck(drv().cuCtxGetCurrent(), "cuCtxGetCurrent")


def primary_context(device_index: int):
    """Retain the primary context of `device_index`, make it current, and check that torch allocates in it."""
    import torch

    dev_name = f"cuda:{device_index}"
    torch.cuda.set_device(device_index)
    torch.zeros(1, device=dev_name)  # set_device alone may leave no context current (pytorch#155668)
    dev = device(device_index)
    ctx = ck(drv().cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain({device_index})")
    ck(drv().cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    probe = torch.empty(1, device=dev_name)
    torch_ctx = pointer_info(probe.data_ptr()).ctx
    if context_uid(torch_ctx) != context_uid(ctx):
        raise CudaError(f"torch allocates on {dev_name} in context uid {context_uid(torch_ctx)}, not in the primary "
                        f"context uid {context_uid(ctx)}: a non-primary context was current when torch started")
    return ctx


def release_primary_context(device_index: int) -> None:
    ck(drv().cuDevicePrimaryCtxRelease(device(device_index)), f"cuDevicePrimaryCtxRelease({device_index})")


def primary_context_uid(device_index: int) -> int:
    """cuCtxGetId of the device's primary context, without making it current."""
    dev = device(device_index)
    ctx = ck(drv().cuDevicePrimaryCtxRetain(dev), f"cuDevicePrimaryCtxRetain({device_index})")
    try:
        return context_uid(ctx)
    finally:
        ck(drv().cuDevicePrimaryCtxRelease(dev), f"cuDevicePrimaryCtxRelease({device_index})")


def create_secondary_context(device_index: int):
    """A second, non-primary context on the device (for residency batteries); the previous current is restored."""
    dev = device(device_index)
    ctx = ck(drv().cuCtxCreate(None, 0, dev), f"cuCtxCreate(None, 0, {device_index})")
    ck(drv().cuCtxPopCurrent(), "cuCtxPopCurrent")  # cuCtxCreate pushed it; popping restores the previous one
    return ctx


def destroy_context(ctx) -> None:
    ck(drv().cuCtxDestroy(ctx), "cuCtxDestroy")


@contextlib.contextmanager
def pushed(ctx):
    """Make `ctx` current for the block, then pop back to whatever was current."""
    ck(drv().cuCtxPushCurrent(ctx), "cuCtxPushCurrent")
    try:
        yield ctx
    finally:
        ck(drv().cuCtxPopCurrent(), "cuCtxPopCurrent")


@dataclass(frozen=True)
class PointerInfo:
    ctx: object          # CUcontext the memory was allocated or registered in (NULL for VMM memory)
    memory_type: int     # 1 host, 2 device, 4 unified
    device_ordinal: int  # in this process's numbering


def pointer_info(ptr: int) -> PointerInfo:
    init()  # idempotent; a process that only ran torch has not initialised cuda-bindings' driver table
    d = drv()
    ctx, mt = pointer_attribute(ptr, "CONTEXT"), pointer_attribute(ptr, "MEMORY_TYPE")
    if int(ctx):
        # The device is the owning context's (DEVICE_ORDINAL read 0 for memory of cuda:1 while cuda:0's context
        # was current on the 4xH200 machine, 2026-11-30).
        with pushed(ctx):
            dev = ck(d.cuCtxGetDevice(), "cuCtxGetDevice")
    else:
        dev = pointer_attribute(ptr, "DEVICE_ORDINAL")
    return PointerInfo(ctx, int(mt), int(dev))


def pointer_attribute(ptr: int, name: str):
    """One cuPointerGetAttribute (CU_POINTER_ATTRIBUTE_<name>); the caller has initialised the driver."""
    d = drv()
    return ck(d.cuPointerGetAttribute(getattr(d.CUpointer_attribute, f"CU_POINTER_ATTRIBUTE_{name}"), ptr),
              f"cuPointerGetAttribute({name})")


def pointer_context(ptr: int):
    return pointer_info(ptr).ctx


@dataclass
class DeviceAlloc:
    """A dedicated cuMemAlloc block; `ptr` is 2 MiB aligned, `base` is what cuMemFree takes."""
    base: int
    ptr: int
    nbytes: int

    def free(self) -> None:
        if self.base:
            ck(drv().cuMemFree(drv().CUdeviceptr(self.base)), "cuMemFree")
            self.base = self.ptr = 0


def mem_alloc_2mib(nbytes: int) -> DeviceAlloc:
    """Allocate in the current context, rounded up to 2 MiB, aligned to 2 MiB (over-allocating if the driver did
    not)."""
    size = -(-max(nbytes, 1) // SLOT_ALIGN) * SLOT_ALIGN
    base = int(ck(drv().cuMemAlloc(size), f"cuMemAlloc({size})"))
    if base % SLOT_ALIGN == 0:
        return DeviceAlloc(base, base, size)
    ck(drv().cuMemFree(drv().CUdeviceptr(base)), "cuMemFree")
    base = int(ck(drv().cuMemAlloc(size + SLOT_ALIGN), f"cuMemAlloc({size + SLOT_ALIGN})"))
    return DeviceAlloc(base, -(-base // SLOT_ALIGN) * SLOT_ALIGN, size)


def _handle_bytes(h) -> bytes:
    return ctypes.string_at(h.getPtr(), IPC_HANDLE_BYTES)  # getPtr: works with and without `.reserved` (13.4+)


def _handle_from(data: bytes, cls):
    if len(data) != IPC_HANDLE_BYTES:
        raise CudaError(f"an IPC handle is {IPC_HANDLE_BYTES} bytes, got {len(data)}")
    h = cls()
    ctypes.memmove(h.getPtr(), bytes(data), IPC_HANDLE_BYTES)
    return h


def ipc_export_mem(ptr: int) -> tuple[bytes, int]:
    """(handle bytes of the whole allocation, offset of `ptr` in it): a handle always names the allocation base."""
    d = drv()
    base, _size = ck(d.cuMemGetAddressRange(d.CUdeviceptr(ptr)), "cuMemGetAddressRange")
    h = ck(d.cuIpcGetMemHandle(base), "cuIpcGetMemHandle")
    return _handle_bytes(h), ptr - int(base)


def ipc_open_mem(handle: bytes, offset: int) -> tuple[int, int]:
    """Open another process's allocation in the current context; returns (mapped base, base + offset)."""
    d = drv()
    h = _handle_from(handle, d.CUipcMemHandle)
    flags = int(d.CUipcMem_flags.CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS)
    base = int(ck(d.cuIpcOpenMemHandle(h, flags), "cuIpcOpenMemHandle"))
    return base, base + offset


def ipc_close_mem(base: int) -> None:
    ck(drv().cuIpcCloseMemHandle(drv().CUdeviceptr(base)), "cuIpcCloseMemHandle")


def event_create(interprocess: bool = True):
    d = drv()
    flags = int(d.CUevent_flags.CU_EVENT_DISABLE_TIMING)
    if interprocess:
        flags |= int(d.CUevent_flags.CU_EVENT_INTERPROCESS)
    return ck(d.cuEventCreate(flags), "cuEventCreate")


def event_destroy(ev) -> None:
    ck(drv().cuEventDestroy(ev), "cuEventDestroy")


def ipc_export_event(ev) -> bytes:
    return _handle_bytes(ck(drv().cuIpcGetEventHandle(ev), "cuIpcGetEventHandle"))


def ipc_open_event(handle: bytes):
    d = drv()
    return ck(d.cuIpcOpenEventHandle(_handle_from(handle, d.CUipcEventHandle)), "cuIpcOpenEventHandle")


def stream_handle(torch_stream):
    """The CUstream of a torch stream (torch's streams live in the primary context)."""
    return drv().CUstream(torch_stream.cuda_stream)


def current_stream_handle(device_index: int):
    """The CUstream of torch's current stream on the device, as stream_handle(torch.cuda.current_stream(device))
    but without building a torch Stream and a CUstream per call (measured on the H200 machine: 14-17 us a call the
    long way, inside a boundary send)."""
    import torch

    return _cu_stream(torch._C._cuda_getCurrentRawStream(device_index))


@functools.lru_cache(maxsize=64)
def _cu_stream(raw: int):
    """The CUstream of a raw cudaStream_t (a pure function of the value: a reused address names the same handle)."""
    return drv().CUstream(raw)


def event_record(ev, stream) -> None:
    ck(drv().cuEventRecord(ev, stream), "cuEventRecord")


def stream_wait_event(stream, ev) -> None:
    ck(drv().cuStreamWaitEvent(stream, ev, 0), "cuStreamWaitEvent")


def event_synchronize(ev) -> None:
    ck(drv().cuEventSynchronize(ev), "cuEventSynchronize")


def stream_synchronize(stream) -> None:
    ck(drv().cuStreamSynchronize(stream), "cuStreamSynchronize")


def memcpy_dtod_async(dst: int, src: int, nbytes: int, stream) -> None:
    d = drv()
    ck(d.cuMemcpyDtoDAsync(d.CUdeviceptr(dst), d.CUdeviceptr(src), nbytes, stream), "cuMemcpyDtoDAsync")


def memcpy_dtoh_async(dst_host: int, src: int, nbytes: int, stream) -> None:
    ck(drv().cuMemcpyDtoHAsync(dst_host, drv().CUdeviceptr(src), nbytes, stream), "cuMemcpyDtoHAsync")


def memcpy_htod_async(dst: int, src_host: int, nbytes: int, stream) -> None:
    ck(drv().cuMemcpyHtoDAsync(drv().CUdeviceptr(dst), src_host, nbytes, stream), "cuMemcpyHtoDAsync")


def host_register(addr: int, nbytes: int) -> int:
    """Page-lock host memory (e.g. shared memory) for every context (PORTABLE); returns `addr`."""
    if nbytes <= 0:  # zero bytes fails late and confusingly (torchstore#178)
        raise CudaError(f"cuMemHostRegister of {nbytes} bytes refused: register a non-empty range")
    ck(drv().cuMemHostRegister(addr, nbytes, int(drv().CU_MEMHOSTREGISTER_PORTABLE)), "cuMemHostRegister")
    return addr


def host_unregister(addr: int) -> None:
    ck(drv().cuMemHostUnregister(addr), "cuMemHostUnregister")


def can_access_peer(dev_index: int, peer_index: int) -> bool:
    d = drv()
    return bool(ck(d.cuDeviceCanAccessPeer(device(dev_index), device(peer_index)), "cuDeviceCanAccessPeer"))


def device_count() -> int:
    init()
    return int(ck(drv().cuDeviceGetCount(), "cuDeviceGetCount"))
