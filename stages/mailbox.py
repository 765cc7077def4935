"""A boundary's header mailbox: a small shared-memory ring the sender writes every header frame into, and the
receiver polls while it waits. Runs in both neighbouring stage processes.

Why: a receiver blocked in poll() on the socket is woken by the kernel, which on the machines measured costs 20 to
30 us per wake-up (an OS pipe round trip is 41 to 60 us); a receiver that polls shared memory sees the header as
soon as it is written, and a sender that knows the receiver polls need not write the socket at all.

Which frames also go by the socket channel (frames are numbered, `_q`; the receiver takes each number once, from
whichever carries it first, and drops the other copy):
- every frame while the receiver says it sleeps in the socket (the control word `sleeping`), or when the sender was
  made with every_frame_on_socket (the protocol before this one, kept for side-by-side runs);
- a frame too large for an entry (its entry says TOO_BIG);
- a frame that went by the mailbox alone and is still unread (the receiver's `read_q` says so) when the sender is
  about to overwrite its entry: it is sent by the socket first, late ("late" in the stats).
So no frame exists only in an entry that is overwritten. The receiver buffers socket frames that arrive ahead of
the one it wants (a late frame arrives after later ones). A sender that writes the ring alone learns that its
receiver is gone when it next writes the socket or waits for a credit: within n_slots data frames (they take
credits) or ENTRIES header-only ones (the late sends), where every send used to write the socket.
Ordering: the receiver stores `sleeping` and then reads the ring once more before it blocks; the sender stores
the entry and then reads `sleeping`. x86-64 may let each read pass the other's store, so both can miss: the
receiver therefore blocks for at most WAKE_S at first (then longer, up to WAKE_MAX_S) and looks at the ring again;
a frame lost to that race costs at most WAKE_S.

Entry layout (little-endian): seq_begin u64 | length u32 | pad u32 | payload [ENTRY_BYTES] | seq_end u64; seq + 1
is stored (0 means never written). The writer stores seq_begin, then the payload and length, then seq_end; the
reader reads seq_end, copies the payload, then re-reads seq_begin: equal to what it wants means no later write
began while it copied (a seqlock). The stores are plain and in program order, which x86-64's total store order
keeps visible in that order to the other process; on other architectures the mailbox is not used. After the
entries, two cache lines of control words: the receiver's `sleeping` and `read_q` (the next frame it wants), then
the sender's `socketed` (frames it wrote to the socket, so the receiver reads the socket only when it holds some).
"""
from __future__ import annotations

import collections
import os
import platform
import time
from multiprocessing.shared_memory import SharedMemory

import numpy as np

from memra_pp.errors import ProtocolError
from memra_pp.shm import segment_name
from memra_pp.stages.channel import ChannelClosed
from memra_pp.stages.header import decode_header, encode_header

ENTRIES = 8
ENTRY_BYTES = 4096
_HEAD = 16                      # seq_begin u64, length u32, pad u32
_STRIDE = _HEAD + ENTRY_BYTES + 8
_CTRL = ENTRIES * _STRIDE        # receiver: sleeping u64, read_q u64; one cache line on: sender's socketed u64
SIZE = _CTRL + 128
AHEAD_MAX = 2 * ENTRIES          # socket frames a reader holds ahead of the one it wants, taken without waiting
WAKE_S, WAKE_MAX_S = 0.001, 0.05  # a receiver blocked in the socket looks at the ring again after these (see above)
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
        self._mv = memoryview(buf).cast("B")
        self._words = [(np.frombuffer(buf, dtype="<u8", count=1, offset=e * _STRIDE),
                        np.frombuffer(buf, dtype="<u4", count=1, offset=e * _STRIDE + 8),
                        np.frombuffer(buf, dtype="<u8", count=1, offset=e * _STRIDE + _HEAD + ENTRY_BYTES))
                       for e in range(ENTRIES)]
        self._sleeping = np.frombuffer(buf, dtype="<u8", count=1, offset=_CTRL)
        self._read_q = np.frombuffer(buf, dtype="<u8", count=1, offset=_CTRL + 8)
        self._socketed = np.frombuffer(buf, dtype="<u8", count=1, offset=_CTRL + 64)

    @classmethod
    def create(cls, label: str) -> "Mailbox":
        name = segment_name("mb", label)
        shm = SharedMemory(name=name, create=True, size=SIZE)
        np.frombuffer(shm.buf, dtype=np.uint8)[:] = 0
        return cls(name, shm.buf, shm)

    @classmethod
    def attach(cls, name: str, boundary: str) -> "Mailbox":
        from memra_pp.stages.shm_slots import _attach_shm
        return cls(name, _attach_shm(name, SIZE, boundary))

    def put(self, seq: int, payload: bytes) -> None:
        e = seq % ENTRIES
        words, mv = self._words, self._mv       # (locals, as get's: close() may drop them under a sending thread)
        if words is None:
            raise ChannelClosed(f"header mailbox {self.name} is closed")
        begin, length, end = words[e]
        begin[0] = seq + 1
        if len(payload) > ENTRY_BYTES:
            length[0] = TOO_BIG
        else:
            off = e * _STRIDE + _HEAD
            try:
                mv[off:off + len(payload)] = payload      # a memoryview copy: a third of numpy's cost
            except ValueError:                          # released by close() meanwhile
                raise ChannelClosed(f"header mailbox {self.name} is closed") from None
            length[0] = len(payload)
        end[0] = seq + 1

    def get(self, seq: int):
        """The payload of frame `seq` (bytes), None while it is not written yet, or FALLBACK (on the socket only:
        too large, or overwritten before it was read)."""
        words, u8 = self._words, self._u8     # locals: close() on another thread drops the attributes
        if words is None or u8 is None:
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

    # control words: each has one writer (the receiver: sleeping, read_q; the sender: socketed). close() on another
    # thread drops them: a read then raises ChannelClosed, a store is skipped (nothing reads it any more)
    def _word(self, name: str):
        w = getattr(self, name)
        if w is None:
            raise ChannelClosed(f"header mailbox {self.name} is closed")
        return w

    def _store(self, name: str, v: int) -> None:
        w = getattr(self, name)
        if w is not None:
            w[0] = v

    def sleeping(self) -> bool:
        return bool(self._word("_sleeping")[0])

    def set_sleeping(self, on: bool) -> None:
        self._store("_sleeping", 1 if on else 0)

    def read_q(self) -> int:
        return int(self._word("_read_q")[0])

    def set_read_q(self, q: int) -> None:
        self._store("_read_q", q)

    def socketed(self) -> int:
        return int(self._word("_socketed")[0])

    def set_socketed(self, n: int) -> None:
        self._store("_socketed", n)

    def close(self) -> None:
        """Unmap (and, in the creator, unlink); idempotent."""
        if self._buf is None:
            return
        self._u8 = self._words = self._sleeping = self._read_q = self._socketed = None
        self._mv.release()
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
    """The receiving end of a boundary's headers: the mailbox (polled up to spin_s) and the socket channel, each
    numbered header once and in order. Counts the headers taken from the mailbox in `mailboxed`."""

    def __init__(self, ch, mbox: Mailbox | None, spin_s: float, label: str):
        self.ch, self.mbox, self.spin_s, self.label = ch, mbox, spin_s, label
        self.q = 0                                       # number of the next header
        self.ahead: dict[int, dict] = {}                 # numbered headers read off the socket before their turn
        self.plain: collections.deque = collections.deque()   # socket frames without a number: in socket order
        self.mailboxed = 0
        self.seen = 0                                    # numbered frames read off the socket (copies too)
        # the last wait ended in a timeout: the link is idle, so the next wait sleeps in the socket at once. A loop
        # that calls next(0.2) while nothing comes would otherwise poll spin_s of every 0.2 s (all of it where
        # spin_s >= the timeout: transport_poll_us goes up to 1 s); the first header back ends the idleness.
        self.idle = False

    def next(self, timeout: float | None) -> dict:
        """The next header: from the mailbox if it is there or shows up while we poll, else from the socket."""
        if self.mbox is None:
            return self.ch.recv(timeout)
        deadline = None if timeout is None else time.monotonic() + timeout    # the poll counts against it
        self._drain()            # here, not after a take: the header's latency does not pay for it
        h = self._take()
        if isinstance(h, dict):
            self.idle = False
            return h
        if h is None and not self.idle:     # not written yet: poll the ring (FALLBACK: by the socket only)
            end = time.perf_counter() + (self.spin_s if timeout is None else min(self.spin_s, timeout))
            while h is None and time.perf_counter() < end:
                os.sched_yield()     # releases the GIL: the stage's other threads run meanwhile
                if self.ch._closed:
                    raise ChannelClosed(f"{self.label}: recv on a closed channel")
                self._drain()
                h = self._take()
            if isinstance(h, dict):
                return h
        try:
            h = self._block(deadline)
        except TimeoutError:
            self.idle = True
            raise
        self.idle = False
        return h

    def _block(self, deadline: float | None) -> dict:
        """Wait in the socket, saying so to the sender (which then writes the socket too); look at the ring again
        after each frame and after each short wait (the race in the module docstring)."""
        mb, wait = self.mbox, WAKE_S
        mb.set_sleeping(True)
        try:
            while True:
                h = self._take()
                if isinstance(h, dict):
                    return h
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(f"{self.label}: nothing arrived before the timeout")
                limit = remaining if h is FALLBACK else (wait if remaining is None else min(wait, remaining))
                try:
                    frame = self.ch.recv(limit)
                except ChannelClosed:      # the sender's last header may be in the ring alone (a missed flag)
                    h = self._take()
                    if isinstance(h, dict):
                        return h
                    raise
                except TimeoutError:
                    if remaining is not None and remaining <= limit:
                        raise
                    wait = min(2 * wait, WAKE_MAX_S)
                    continue
                if self._absorb(frame):
                    return self.plain.popleft()
        finally:
            mb.set_sleeping(False)

    def _take(self):
        """Header number self.q if we hold it (read ahead off the socket, or in the ring): a dict; else None (not
        written yet) or FALLBACK (it travels by the socket only). A plain socket frame goes first."""
        if self.plain:
            return self.plain.popleft()
        h = self.ahead.pop(self.q, None)
        if h is None:
            got = self.mbox.get(self.q)
            if got is None or got is FALLBACK:
                return got
            h = decode_header(got)
            h.pop("_q", None)
            self.mailboxed += 1
        self.q += 1
        self.mbox.set_read_q(self.q)
        return h

    def _absorb(self, h: dict) -> bool:
        """File a socket frame: True for a plain one (return it), else kept ahead or dropped as a copy."""
        q = h.pop("_q", None)
        if q is None:
            self.plain.append(h)
            return True
        if type(q) is not int:
            raise ProtocolError(f"{self.label}: header of mb {h['mb']} carries number _q {q!r}, not an int")
        self.seen += 1
        if q >= self.q:
            self.ahead[q] = h
        return False

    def _drain(self) -> None:
        """Read off the socket what the sender says it wrote there, without waiting (nothing, usually: then no
        system call). Copies of headers taken from the ring are dropped; later ones are kept ahead, at most
        AHEAD_MAX of them and none once the next one is here: the rest stays in the socket, whose buffer then
        holds the sender back (header-only frames take no credit)."""
        n = self.mbox.socketed()          # once: a fast sender must not keep us here
        while n > self.seen and self.q not in self.ahead and len(self.ahead) < AHEAD_MAX:
            h = self.ch.poll()
            if h is None:
                return
            if self._absorb(h):
                return


class HeaderWriter:
    """The sending end: each header numbered into the receiver's mailbox, and over the socket when the module
    docstring says so (always when every_frame_on_socket; the socket alone when the receiver has no mailbox).
    Counts headers written into the mailbox (`mailboxed`), onto the socket (`socketed`) and sent late (`late`)."""

    def __init__(self, ch, mbox: Mailbox | None, every_frame_on_socket: bool = False):
        self.ch, self.mbox, self.q = ch, mbox, 0
        self.mailboxed = self.socketed = self.late = 0
        self.every = every_frame_on_socket
        self._unsent: list[bytes | None] = [None] * ENTRIES   # entry -> its frame, while only the ring holds it

    def send(self, header: dict, timeout: float | None = None) -> None:
        """`timeout`: how long a socket write may wait for a live receiver that reads nothing (Channel.send_payload:
        TimeoutError)."""
        mb = self.mbox
        if mb is None:
            self.ch.send_payload(encode_header(header), timeout)
            self.socketed += 1
            return
        q, e = self.q, self.q % ENTRIES
        payload = encode_header(dict(header, _q=q))
        self.ch.check_frame(payload)   # refused before it takes a number: a gap would stall the reader
        old = self._unsent[e]
        if old is not None and mb.read_q() <= q - ENTRIES:    # about to overwrite a frame the receiver never read
            self._socket(old, timeout)
            self.late += 1
        mb.put(q, payload)
        self.q += 1
        self.mailboxed += 1
        self._unsent[e] = payload       # (until the socket has it too: a write that times out leaves it owed)
        if self.every or len(payload) > ENTRY_BYTES or mb.sleeping():
            self._socket(payload, timeout)
            self._unsent[e] = None

    def _socket(self, payload: bytes, timeout: float | None = None) -> None:
        self.ch.send_payload(payload, timeout)
        self.socketed += 1
        self.mbox.set_socketed(self.socketed)
