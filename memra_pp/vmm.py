"""Device memory that grows in place (the CUDA virtual memory API through cuda-python): the KV pools' backing in a
stage process (model/cache.py), with the device's primary context (torch's) current."""
from __future__ import annotations

import weakref

from memra_pp.cuda import CudaError, ck, device, drv, init


class DeviceOutOfMemory(CudaError):
    """A driver allocation found the device full (CUDA_ERROR_OUT_OF_MEMORY)."""


def vmm_supported(device_index: int) -> bool:
    d = drv()
    dev = device(device_index)
    attr = d.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED
    return bool(ck(d.cuDeviceGetAttribute(attr, dev), "cuDeviceGetAttribute(VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)"))


def _release(device_index: int, base: int, capacity: int, maps: list) -> None:
    """Free a GrowableBuffer once it is collected: wait for the device's work (a kernel may still read the memory),
    then unmap and release every piece and free the address range, each on its own (one failure leaks only its
    piece). Not at exit: the driver reclaims everything there, and a wedged device must not hang the exit."""
    import torch
    d = drv()
    try:
        torch.cuda.synchronize(device_index)
    except Exception:       # noqa: BLE001 - a finaliser has no caller to tell; unmapping under a running kernel
        return              # would fault it, so leak instead
    for ptr, size, h in reversed(maps):
        for call, args in (("cuMemUnmap", (d.CUdeviceptr(ptr), size)), ("cuMemRelease", (h,))):
            try:
                ck(getattr(d, call)(*args), call)
            except CudaError:
                pass
    maps.clear()
    try:
        ck(d.cuMemAddressFree(d.CUdeviceptr(base), capacity), "cuMemAddressFree")
    except CudaError:
        pass


class _CudaArray:
    """What torch.as_tensor takes for device memory it does not own (__cuda_array_interface__, bytes); the tensor
    keeps this object, and through it the buffer, alive."""

    def __init__(self, owner, ptr: int, nbytes: int):
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False),
                                         "strides": None, "version": 3, "stream": None}


class GrowableBuffer:
    """Device memory at a fixed address that grows in place: one address range reserved for `capacity` bytes,
    physical memory created and mapped onto its front as it grows (cuMemCreate, cuMemMap, cuMemSetAccess). A tensor
    over it (`tensor`) keeps its address through every growth, so CUDA graphs that baked the address in stay valid.
    Physical memory comes in pieces of the device's granularity (2 MiB on the H200); the range and its memory are
    freed when the buffer and every tensor over it are gone. `grow` raises DeviceOutOfMemory when the device cannot
    hold the piece, after emptying torch's cache once (memory it holds unused is free to torch, not to the driver)."""

    def __init__(self, device_index: int, capacity: int):
        init()
        d = drv()
        self.device_index = device_index
        prop = d.CUmemAllocationProp()
        prop.type = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        prop.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        prop.location.id = device_index
        self._prop = prop
        gran = d.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
        self.granularity = int(ck(d.cuMemGetAllocationGranularity(prop, gran), "cuMemGetAllocationGranularity"))
        self.capacity = -(-max(capacity, 1) // self.granularity) * self.granularity
        self.base = int(ck(d.cuMemAddressReserve(self.capacity, self.granularity, d.CUdeviceptr(0), 0),
                           f"cuMemAddressReserve({self.capacity})"))
        acc = d.CUmemAccessDesc()
        acc.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = device_index
        acc.flags = d.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = acc
        self.mapped = 0
        self._maps: list = []          # (address, bytes, handle) of each piece, in address order
        free = weakref.finalize(self, _release, device_index, self.base, self.capacity, self._maps)
        free.atexit = False

    def grow(self, nbytes: int) -> None:
        """Map physical memory until at least `nbytes` from the base are backed (the new memory's contents are
        undefined). A piece that fails to map is released; the buffer stays as it was."""
        if nbytes <= self.mapped:
            return
        if nbytes > self.capacity:
            raise CudaError(f"a buffer of {self.capacity} reserved bytes cannot grow to {nbytes}")
        d = drv()
        size = -(-(nbytes - self.mapped) // self.granularity) * self.granularity
        oom = int(d.CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        res = d.cuMemCreate(size, self._prop, 0)
        if int(res[0]) == oom:
            import torch
            torch.cuda.empty_cache()
            res = d.cuMemCreate(size, self._prop, 0)
            if int(res[0]) == oom:
                raise DeviceOutOfMemory(f"cuMemCreate({size}) on cuda:{self.device_index}: out of memory")
        h = ck(res, f"cuMemCreate({size})")
        ptr = d.CUdeviceptr(self.base + self.mapped)
        mapped = False
        try:
            ck(d.cuMemMap(ptr, size, 0, h, 0), "cuMemMap")
            mapped = True
            ck(d.cuMemSetAccess(ptr, size, [self._access], 1), "cuMemSetAccess")
        except CudaError:
            if mapped:
                ck(d.cuMemUnmap(ptr, size), "cuMemUnmap")
            ck(d.cuMemRelease(h), "cuMemRelease")
            raise
        self._maps.append((self.base + self.mapped, size, h))
        self.mapped += size

    def tensor(self, nbytes: int):
        """A uint8 tensor over the first `nbytes` (mapped) bytes; `.view(dtype).view(shape)` it."""
        import torch
        if nbytes > self.mapped:
            raise CudaError(f"{nbytes} bytes asked of a buffer with {self.mapped} mapped")
        with torch.cuda.device(self.device_index):
            return torch.as_tensor(_CudaArray(self, self.base, nbytes), device=f"cuda:{self.device_index}")
