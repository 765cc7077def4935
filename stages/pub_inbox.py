"""The data path of overlay publication between two stage processes: the intake owns a few shared-memory slots,
names one in its request to the tower, the tower copies its rows' bytes into that slot (its dtoh lands there) and
answers with the rows' description only; the intake lands the rows from its slot. The Ray call carries control;
the bytes never enter Ray's object store (two host copies of a 5 MiB image instead of four, and no store put/get).

Slots grow to the largest publication seen (a new segment, faulted in once) and are reused; the tower keeps a few
mappings open by name. In a CUDA process each mapping is page-locked once (cuMemHostRegister), so the tower's dtoh
and the intake's htod are DMA copies at full link speed instead of staged pageable copies. Segment names start
with the inbox's `prefix`, which the stage reports at setup, so that whoever outlives a killed intake can unlink
what it left (`memra_pp.shm.unlink_shm`). Runs in the intake
and the tower stage processes.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import threading
from collections import OrderedDict
from multiprocessing import resource_tracker

import _posixshmem

from memra_pp.shm import segment_name
from memra_pp.errors import StageFailed
from memra_pp.stages.shm_slots import _attach_shm
from memra_pp.stages.slots import _u8_over

MIN_BYTES = 1 << 20


class PublicationInbox:
    """Intake side: `n_slots` receiver-owned segments; `slot(nbytes)` lends one (waiting while all are lent)."""

    def __init__(self, name: str, n_slots: int = 4, engine=None):
        self._engine = engine if engine is not None and engine.is_cuda else None   # page-lock slots for it
        self._pinned: dict[int, int] = {}   # slot -> registered address
        self.prefix = segment_name("pub", name)
        self._cv = threading.Condition()
        self._free = list(range(n_slots))
        self._segs: list[tuple[str, int, mmap.mmap] | None] = [None] * n_slots   # (name, size, mapping)
        self._gen = 0
        self.closed = False
        self.landed = 0                     # publications whose rows came through a slot (stats: the path ran)

    @contextlib.contextmanager
    def slot(self, nbytes: int, timeout: float):
        """Yields (segment name, segment size, uint8 tensor over it) for a publication of nbytes. A slot whose
        publication failed (the tower's answer timed out, say) is discarded, not lent again: the tower may still
        write into it late, and must never overwrite another request's rows."""
        with self._cv:
            if not self._cv.wait_for(lambda: self._free or self.closed, timeout):
                raise StageFailed(f"no publication slot came free within {timeout:.0f} s (all "
                                  f"{len(self._segs)} hold images the vision tower is still encoding)")
            if self.closed:
                raise StageFailed("the publication inbox is closed (the stage is stopping)")
            k = self._free.pop()
            try:
                seg = self._segs[k]
                if seg is None or seg[1] < nbytes:
                    self._drop(k)
                    size = max(MIN_BYTES, 1 << (max(nbytes, 1) - 1).bit_length())
                    self._gen += 1
                    seg = self._segs[k] = _create(f"{self.prefix}_{k}_{self._gen}", size)
                    _u8_over(seg[2], size).zero_()           # fault the pages in once, not on every publication
                    if self._engine is not None:
                        self._pinned[k] = _pin(self._engine, seg[2], size)
            except BaseException:
                self._drop(k)
                self._free.append(k)                         # the slot stays usable (no segment yet)
                raise
        name, size, m = seg
        view = _u8_over(m, size)
        ok = False
        try:
            yield name, size, view
            ok = True
        finally:
            del view
            with self._cv:
                if not ok or self.closed:
                    self._drop(k)                            # a late write lands in an orphaned segment
                self._free.append(k)
                self._cv.notify()

    def _drop(self, k: int) -> None:
        """Unlink slot k's segment; its mapping goes when the last view of it does (never closed under one)."""
        seg, self._segs[k] = self._segs[k], None
        if k in self._pinned:       # no copy of ours is in flight: land() waits for its htod
            _unpin(self._engine, self._pinned.pop(k))
        if seg is not None:
            with contextlib.suppress(FileNotFoundError):
                _posixshmem.shm_unlink("/" + seg[0])
            resource_tracker.unregister("/" + seg[0], "shared_memory")

    def close(self) -> None:
        """Drop the free slots now; a lent one goes when its publication returns (never unpinned under a copy)."""
        with self._cv:
            self.closed = True
            for k in self._free:
                self._drop(k)
            self._cv.notify_all()


def _create(name: str, size: int) -> tuple[str, int, mmap.mmap]:
    """A new segment, registered with the resource tracker (which unlinks it should this process die)."""
    fd = _posixshmem.shm_open("/" + name, os.O_CREAT | os.O_EXCL | os.O_RDWR, mode=0o600)
    try:
        os.ftruncate(fd, size)
        m = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    resource_tracker.register("/" + name, "shared_memory")
    return name, size, m


def _pin(engine, m: mmap.mmap, size: int) -> int:
    """Page-lock a mapping for every context of this process; returns its address (for _unpin)."""
    from memra_pp import cuda
    engine.make_current()
    return cuda.host_register(_u8_over(m, size).data_ptr(), size)


def _unpin(engine, addr: int) -> None:
    from memra_pp import cuda
    engine.make_current()
    cuda.host_unregister(addr)


class InboxWriter:
    """Tower side: the intake's slots, mapped by name (a few kept open: slots are reused, and regrow rarely);
    page-locked for a CUDA tower's dtoh. `lease` lends a mapping for one publication: a mapping is unpinned and
    unmapped only once no publication holds it (the actor serves several calls at once)."""

    KEEP = 4

    def __init__(self, engine=None):
        self._engine = engine if engine is not None and engine.is_cuda else None
        self._maps: OrderedDict[str, list] = OrderedDict()   # name -> [mapping, view, pinned address, users]
        self._retired: list[list] = []      # evicted while in use: released when their last user returns
        self._lock = threading.Lock()
        self.closed = False
        self.pinned = 0                     # mappings page-locked (stats and tests: the DMA path ran)

    @contextlib.contextmanager
    def lease(self, name: str, size: int):
        with self._lock:
            if self.closed:
                raise StageFailed("the tower's publication writer is closed (the stage is stopping)")
            e = self._maps.get(name)
            if e is not None:
                self._maps.move_to_end(name)
            else:
                m = _attach_shm(name, size, "overlay publication")
                addr = None
                if self._engine is not None:
                    addr = _pin(self._engine, m, size)
                    self.pinned += 1
                e = self._maps[name] = [m, _u8_over(m, size), addr, 0]
                for old in [k for k in self._maps if k != name][:max(0, len(self._maps) - self.KEEP)]:
                    self._retire(self._maps.pop(old))
            e[3] += 1
        try:
            yield e[1]
        finally:
            with self._lock:
                e[3] -= 1
                k = next((j for j, x in enumerate(self._retired) if x is e), None)   # by identity
                if e[3] == 0 and k is not None:
                    del self._retired[k]
                    self._release(e)

    def _retire(self, e: list) -> None:
        if e[3]:
            self._retired.append(e)          # a publication is copying into it: released when it returns
        else:
            self._release(e)

    def _release(self, e: list) -> None:
        if e[2] is not None:
            _unpin(self._engine, e[2])
        e[0] = e[1] = None                   # unmapped once no view of it is left

    def close(self) -> None:
        with self._lock:
            self.closed = True
            while self._maps:
                self._retire(self._maps.popitem(last=False)[1])
