"""The CPU data path of the boundary slots: POSIX shared-memory segments the receiver creates and unlinks, mapped
by the sender. Runs in both neighbouring stage processes; the credit and header protocol is slots.py's.
"""
from __future__ import annotations

import mmap
import os
from multiprocessing.shared_memory import SharedMemory

import _posixshmem
import torch

from memra_pp.shm import segment_name
from memra_pp.errors import ProtocolError, StageFailed
from memra_pp.stages.channel import ChannelClosed
from memra_pp.stages.slots import SlotReceiverBase, SlotSenderBase, _SlotViews, _u8_over


class SlotReceiver(SlotReceiverBase):
    """CPU receiver: each slot is a POSIX shared-memory segment this process creates and unlinks."""

    TRANSPORT = "shm"

    def _allocate(self, n_slots: int, max_bytes: int) -> dict:
        prefix = segment_name("slot", self.name)
        self._shms = []         # filled one by one: a failed second segment leaves the first to _release
        for k in range(n_slots):
            self._shms.append(SharedMemory(name=f"{prefix}_{k}", create=True, size=max_bytes))
        self._views = _SlotViews([_u8_over(shm.buf, max_bytes) for shm in self._shms])
        return {"shm": [s.name for s in self._shms]}

    def _view(self, slot: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        return self._views.get(slot, dtype, shape).detach()  # a fresh alias: callers may not edit the cached one

    def _quiesce(self) -> None:
        # a halt keeps the mappings (freed at the next relink or stop) but not the names: a process killed before
        # then leaves nothing in /dev/shm, and the sender's mapping outlives the unlink
        for shm in getattr(self, "_shms", []):
            try:
                shm.unlink()
            except FileNotFoundError:
                pass

    def _release(self) -> None:
        if hasattr(self, "_views"):
            self._views.clear()
        alive = []
        for shm in getattr(self, "_shms", []):
            try:
                shm.unlink()
            except FileNotFoundError:
                pass  # a second close
            try:
                shm.close()
            except BufferError:
                alive.append(shm.name)
        if alive:
            raise BufferError(f"boundary {self.name}: views from recv() over {alive} are still alive; drop them "
                              f"before close() (the segments are unlinked already)")


class SlotSender(SlotSenderBase):
    """CPU sender: maps the receiver's shared-memory segments and copies hidden_TD into them."""

    def _attach(self, endpoint: dict) -> None:
        self._maps = []         # one by one: a failed second map leaves the first to _detach
        for name in endpoint["shm"]:
            self._maps.append(_attach_shm(name, self.max_bytes, self.name))
        self._views = _SlotViews([_u8_over(m, self.max_bytes) for m in self._maps])

    def _write(self, slot: int, hidden_TD: torch.Tensor) -> None:
        try:
            view = self._views.get(slot, hidden_TD.dtype, hidden_TD.shape)
        except (IndexError, TypeError):
            if not self._maps:          # detached by a close() under this sending thread (a halt gave up its join)
                raise ChannelClosed(f"{self.name}: send on a closed boundary") from None
            raise
        view.copy_(hidden_TD)

    def _detach(self) -> None:
        maps, self._maps = getattr(self, "_maps", []), []   # first: a write that finds no view sees the close
        if hasattr(self, "_views"):                         # (ChannelClosed); absent after a failed _attach
            self._views.clear()
        for m in maps:
            try:
                m.close()
            except BufferError:         # a copy under way still holds a view: the mapping goes with its last view
                pass


def _attach_shm(name: str, size: int, boundary: str) -> mmap.mmap:
    # Not SharedMemory(name): before Python 3.13 it registers the segment with this process's resource_tracker,
    # which unlinks it (with a leak warning) when we exit. Unregistering afterwards is wrong when the creator shares
    # our tracker (multiprocessing children do): it drops the creator's own registration. So never register.
    try:
        fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
    except FileNotFoundError:
        raise StageFailed(f"boundary {boundary}: slot segment {name} does not exist: the receiver closed or died")
    try:
        if os.fstat(fd).st_size < size:
            raise ProtocolError(f"boundary {boundary}: slot segment {name} is {os.fstat(fd).st_size} bytes, "
                                f"the endpoint says {size}")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)
