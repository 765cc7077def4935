"""`Engine` (one device, one context) and `ContextId`, the identity residency is checked against; runs in a stage
process. A CUDA engine uses the device's primary context (torch's); a CPU engine's context is the process."""
from __future__ import annotations

import hashlib
import os
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memra_pp.errors import ConfigError
from memra_pp.shm import proc_stat

if TYPE_CHECKING:   # torch where an engine is made: a driver unpickles ContextIds (setup's infos) without it
    import torch


@dataclass(frozen=True)
class ContextId:
    """Where a pointer means something: host, process, device and the driver's context id (or a per-process id)."""
    node: str
    pid: int
    device: str  # 'cpu' or 'cuda:N' (N in the owning process's numbering)
    uid: int

    def __str__(self) -> str:
        return f"{self.device} ctx#{self.uid} (pid {self.pid} on {self.node})"

    def is_local(self) -> bool:
        """True only in the process that created it: the same uid in another process is another context."""
        return self.node == socket.gethostname() and self.pid == os.getpid()


@dataclass
class EngineCounters:
    """What an engine did, for non-vacuity checks (a path that claims to run must move its counter)."""
    splices: int = 0
    mid_span_splices: int = 0  # splices whose chunk began strictly inside an image span: a prefill chunk cut it
    publications: int = 0  # overlays landed here by host bounce
    # the battery's record (battery_stage.record_rows), None when off: ("published" | "spliced", sha256) of the rows
    # of each overlay published from this engine (before the dtoh) or spliced into it (the rows the splice read)
    row_digests: list[tuple[str, str]] | None = None


@dataclass
class ProcessCounters:
    """The one per-process counter object: publications landed by any engine of this process."""
    publications: int = 0


# The only module-level mutable state: one counters object per process, keyed by pid so a forked child starts at 0.
_PROCESS_COUNTERS: dict[int, ProcessCounters] = {}


def process_counters() -> ProcessCounters:
    return _PROCESS_COUNTERS.setdefault(os.getpid(), ProcessCounters())


def _process_start_ticks(pid: int) -> int:
    """Start time of the process (Linux /proc), so a reused pid gets a different CPU context id."""
    fields = proc_stat(pid)
    try:
        return int(fields[19]) if fields else 0
    except (IndexError, ValueError):
        return 0


def cpu_context() -> ContextId:
    """The calling process's CPU context: every CPU buffer of a process lives in it."""
    pid = os.getpid()
    digest = hashlib.blake2b(f"{pid}:{_process_start_ticks(pid)}".encode(), digest_size=8).digest()
    return ContextId(socket.gethostname(), pid, "cpu", int.from_bytes(digest, "little") >> 1)


def parse_device(device) -> torch.device:
    """'cpu' | 'cuda' | 'cuda:N' | torch.device -> torch.device with an index for CUDA; anything else refused."""
    import torch
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise ConfigError(f"device {device!r} is not a device: use 'cpu' or 'cuda:N'") from e
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        idx = dev.index if dev.index is not None else (torch.cuda.current_device() if n else 0)
        if idx >= n:
            raise ConfigError(f"device {str(device)!r}: this process sees {n} CUDA device(s)"
                              + (f"; use cpu or cuda:0..cuda:{n - 1}" if n else
                                 f" (torch {torch.__version__}: no CUDA build or no driver); use cpu"))
        return torch.device("cuda", idx)
    raise ConfigError(f"device {device!r} is not supported: use 'cpu' or 'cuda:N'")


class Engine:
    """One device and its context in this process. Two engines on one device of one process share one context."""

    def __init__(self, device):
        self.device = parse_device(device)
        self.is_cuda = self.device.type == "cuda"
        self.counters = EngineCounters()
        self.stream = None
        if self.is_cuda:
            import torch
            from memra_pp import cuda

            idx = self.device.index
            self._cu_ctx = cuda.primary_context(idx)
            self.ctx = ContextId(socket.gethostname(), os.getpid(), f"cuda:{idx}", cuda.context_uid(self._cu_ctx))
            self.stream = torch.cuda.current_stream(self.device)  # the stream torch (and the model) enqueue on
        else:
            self._cu_ctx = None
            self.ctx = cpu_context()

    def __repr__(self) -> str:
        return f"Engine({self.device}, {self.ctx})"

    def __reduce__(self):
        # An engine is a process-local thing: it never travels (its ContextId may).
        raise TypeError(f"{self!r} cannot be pickled: send its .ctx (a ContextId) instead")

    @property
    def cu_stream(self):
        """The driver handle of `self.stream` (CUDA only)."""
        from memra_pp import cuda

        return cuda.stream_handle(self.stream)

    def is_current(self) -> bool:
        """This engine's context is current on the calling thread: one driver call (a handle the engine retains
        names no other context; nothing here calls cuDevicePrimaryCtxReset, which would keep the handle and change
        the context's id). False for a CPU engine, a closed one, or one inherited across a fork."""
        if not self._holds_context():
            return False
        from memra_pp import cuda

        return int(cuda.current_context()) == int(self._cu_ctx)

    def owns(self, tensor: torch.Tensor) -> bool:
        """residency_of(tensor, self) == self.ctx in one driver call (two for memory of no context), without building
        a ContextId: a boundary send's hot path asks it of every activation. False means ask residency_of where."""
        ptr = tensor.data_ptr()
        if not self._holds_context() or tensor.device.type != "cuda" or ptr == 0:
            return False
        from memra_pp import cuda

        ctx = cuda.pointer_attribute(ptr, "CONTEXT")
        if int(ctx):
            return int(ctx) == int(self._cu_ctx)
        # VMM memory (expandable segments) belongs to no context: residency_of gives it to an engine of its device
        return int(cuda.pointer_attribute(ptr, "DEVICE_ORDINAL")) == self.device.index

    def foreign_context(self, tensor: torch.Tensor) -> ContextId | None:
        """The context a CUDA tensor's bytes live in when it is not this engine's, else None (owns first: one
        driver call where they are ours; a CPU or empty tensor: None, host memory and no bytes)."""
        if not tensor.is_cuda or tensor.numel() == 0 or self.owns(tensor):
            return None
        ctx = residency_of(tensor, self)
        return None if ctx == self.ctx else ctx

    def _holds_context(self) -> bool:
        """This process retains a CUDA context through this engine (not a CPU engine, not closed, not a copy
        inherited across a fork): its handle then names that context and no other."""
        return self._cu_ctx is not None and self.ctx.pid == os.getpid()

    def make_current(self) -> None:
        """Make this engine's context current on the calling thread (a fresh thread has none)."""
        if self.is_cuda:
            import torch
            from memra_pp import cuda

            torch.cuda.set_device(self.device.index)
            cuda.ck(cuda.drv().cuCtxSetCurrent(self._cu_ctx), "cuCtxSetCurrent")

    def close(self) -> None:
        """Release the primary-context reference this engine retained."""
        if self._cu_ctx is not None:
            from memra_pp import cuda

            cuda.release_primary_context(self.device.index)
            self._cu_ctx = None


def residency_of(tensor: torch.Tensor, engine: Engine) -> ContextId:
    """The context `tensor`'s bytes live in, read from the allocation (never from `tensor.device` alone)."""
    if tensor.device.type == "cpu":
        return cpu_context()
    if tensor.device.type != "cuda":
        raise ConfigError(f"residency of a {tensor.device} tensor is not tracked: use cpu or cuda tensors")
    from memra_pp import cuda

    if tensor.data_ptr() == 0:
        raise ConfigError("residency of an empty CUDA tensor cannot be read (it has no allocation); pass a tensor of "
                          "at least one element")
    info = cuda.pointer_info(tensor.data_ptr())
    if int(info.ctx) == 0:
        # VMM memory (expandable segments) belongs to no context; torch maps it for the primary context only.
        idx = info.device_ordinal
        if engine.is_cuda and engine.device.index == idx:
            return engine.ctx
        return ContextId(socket.gethostname(), os.getpid(), f"cuda:{idx}", cuda.primary_context_uid(idx))
    return ContextId(socket.gethostname(), os.getpid(), f"cuda:{info.device_ordinal}", cuda.context_uid(info.ctx))
