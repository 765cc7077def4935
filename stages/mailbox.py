"""A boundary's header mailbox: a small shared-memory ring the sender writes every header frame into before it also
sends it over the socket channel, and the receiver polls while it waits. Runs in both neighbouring stage processes.

Why: a receiver blocked in poll() on the socket is woken by the kernel, which on the machines measured costs 20 to
30 us per wake-up (an OS pipe round trip is 41 to 60 us); a receiver that polls shared memory sees the header as
soon as it is written. The socket stays the complete, ordered source of every frame: the mailbox only lets the
receiver take a frame early, and the receiver skips the socket's copy of every frame it took that way (frames are
numbered). A frame too large for an entry, or an entry overwritten before the receiver read it, is simply taken
from the socket.

Entry layout (little-endian): seq_begin u64 | length u32 | pad u32 | payload [ENTRY_BYTES] | seq_end u64; seq + 1
is stored (0 means never written). The writer stores seq_begin, then the payload and length, then seq_end; the
reader reads seq_end, copies the payload, then re-reads seq_begin: equal to what it wants means no later write
began while it copied (a seqlock). The stores are plain and in program order, which x86-64's total store order
keeps visible in that order to the other process; on other architectures the mailbox is not used.
"""
from __future__ import annotations

import collections
import os
import platform
import re
import secrets
import time
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from memra_pp.stages.header import decode_header, encode_header

ENTRIES = 8
ENTRY_BYTES = 4096
_HEAD = 16                      # seq_begin u64, length u32, pad u32
_STRIDE = _HEAD + ENTRY_BYTES + 8
SIZE = ENTRIES * _STRIDE
TOO_BIG = 0xFFFFFFFF            # length marker: this frame is on the socket only
FALLBACK = object()             # get(): take this frame from the socket


def supported() -> bool:
    """The seqlock relies on x86-64 store ordering (see the module docstring)."""
    return platform.machine().lower() in ("x86_64", "amd64")


class Mailbox:
    """One direction of one boundary. `create` in the receiver (it owns and unlinks the segment), `attach` in the
    sender; `put` from one thread, `get` from one thread."""

    def __init__(self, name: str, buf, shm: SharedMemory | None = None):
        self.name, self._buf, self._shm = name, buf, shm      # shm: the creator's segment (it unlinks it)
        self._u8 = np.frombuffer(buf, dtype=np.uint8, count=ENTRIES * _STRIDE)
        self._words = [(np.frombuffer(buf, dtype="<u8", count=1, offset=e * _STRIDE),
                        np.frombuffer(buf, dtype="<u4", count=1, offset=e * _STRIDE + 8),
                        np.frombuffer(buf, dtype="<u8", count=1, offset=e * _STRIDE + _HEAD + ENTRY_BYTES))
                       for e in range(ENTRIES)]

    @classmethod
    def create(cls, label: str) -> "Mailbox":
        name = f"mpp_mb_{re.sub(r'[^A-Za-z0-9_]', '_', label)[:40]}_{os.getpid()}_{secrets.token_hex(3)}"
        shm = SharedMemory(name=name, create=True, size=SIZE)
        np.frombuffer(shm.buf, dtype=np.uint8)[:] = 0
        return cls(name, shm.buf, shm)

    @classmethod
    def attach(cls, name: str, boundary: str) -> "Mailbox":
        from memra_pp.stages.shm_slots import _attach_shm
        return cls(name, _attach_shm(name, SIZE, boundary))

    def put(self, seq: int, payload: bytes) -> None:
        e = seq % ENTRIES
        begin, length, end = self._words[e]
        begin[0] = seq + 1
        if len(payload) > ENTRY_BYTES:
            length[0] = TOO_BIG
        else:
            off = e * _STRIDE + _HEAD
            self._u8[off:off + len(payload)] = np.frombuffer(payload, dtype=np.uint8)
            length[0] = len(payload)
        end[0] = seq + 1

    def get(self, seq: int):
        """The payload of frame `seq` (bytes), None while it is not written yet, or FALLBACK (on the socket only:
        too large, or overwritten before it was read)."""
        words, u8 = self._words, self._u8     # locals: close() on another thread drops the attributes
        if words is None or u8 is None:
            from memra_pp.stages.channel import ChannelClosed
            raise ChannelClosed(f"header mailbox {self.name} is closed")
        e = seq % ENTRIES
        begin, length, end = words[e]
        have = int(end[0])
        if have < seq + 1:
            return None
        if have > seq + 1:
            return FALLBACK
        n = int(length[0])
        if n == TOO_BIG:
            return FALLBACK
        off = e * _STRIDE + _HEAD
        data = u8[off:off + n].tobytes()
        return data if int(begin[0]) == seq + 1 else FALLBACK

    def close(self) -> None:
        """Unmap (and, in the creator, unlink); idempotent."""
        if self._buf is None:
            return
        self._u8 = self._words = None
        if self._shm is not None:
            try:
                self._shm.unlink()       # first: the name goes even if a view keeps the mapping alive
            except FileNotFoundError:
                pass
        try:
            (self._shm or self._buf).close()
        except BufferError:   # a view escaped: the mapping goes with the last reference
            pass
        self._buf = None


class HeaderReader:
    """The receiving end of a boundary's headers: the mailbox (polled up to spin_s) and the socket channel, in
    order, each header once. Counts the headers taken from the mailbox in `mailboxed`."""

    def __init__(self, ch, mbox: Mailbox | None, spin_s: float, label: str):
        self.ch, self.mbox, self.spin_s, self.label = ch, mbox, spin_s, label
        self.q = 0                                       # number of the next header
        self.early: collections.deque = collections.deque()   # headers read off the socket ahead of the mailbox
        self.mailboxed = 0

    def next(self, timeout: float | None) -> dict:
        """The next header: from the mailbox if it shows up while we poll, else from the socket, where every
        header also travels (copies of those taken from the mailbox are skipped)."""
        mb = self.mbox
        if mb is not None and not self.early:
            self._skip_copies()      # here, not after a take: the header's latency does not pay for it
        if self.early:
            return self.early.popleft()
        deadline = None if timeout is None else time.monotonic() + timeout    # the poll counts against it
        if mb is not None:
            end = time.perf_counter() + (self.spin_s if timeout is None else min(self.spin_s, timeout))
            while True:
                got = mb.get(self.q)
                if got is None:
                    if time.perf_counter() >= end:
                        break
                    os.sched_yield()     # releases the GIL: the stage's other threads run meanwhile
                    if self.ch._closed:
                        from memra_pp.stages.channel import ChannelClosed
                        raise ChannelClosed(f"{self.label}: recv on a closed channel")
                    continue
                if got is FALLBACK:
                    break
                self.q += 1
                self.mailboxed += 1
                header = decode_header(got)
                header.pop("_q", None)
                return header
        while True:
            h = self.ch.recv(None if deadline is None else max(deadline - time.monotonic(), 0.0))
            if self._fresh(h):
                return h

    def _fresh(self, h: dict) -> bool:
        """A socket frame: False if it is the copy of a header already taken from the mailbox."""
        q = h.pop("_q", None)
        if q is None:
            return True
        if q < self.q:
            return False
        self.q = q + 1
        return True

    def _skip_copies(self) -> None:
        """Read off the socket what is there now without waiting: copies of mailbox headers are dropped (they
        would fill the socket), a later header is kept for the next one."""
        while True:
            h = self.ch.poll()
            if h is None:
                return
            if self._fresh(h):
                self.early.append(h)
                return


class HeaderWriter:
    """The sending end: each header numbered into the receiver's mailbox, then over the socket (or the socket
    alone when the receiver has no mailbox). Counts the headers written into the mailbox in `mailboxed`."""

    def __init__(self, ch, mbox: Mailbox | None):
        self.ch, self.mbox, self.q, self.mailboxed = ch, mbox, 0, 0

    def send(self, header: dict) -> None:
        if self.mbox is None:
            self.ch.send(header)
            return
        payload = encode_header(dict(header, _q=self.q))
        self.mbox.put(self.q, payload)
        self.q += 1
        self.mailboxed += 1
        self.ch.send_payload(payload)
