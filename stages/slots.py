"""Boundary slots: receiver-owned buffers and their credit protocol over a Channel (data: shm_slots, gpu_slots).

Runs in both neighbouring stage processes. Data-path hooks for other transports (gpu_slots.py): a receiver subclass
implements _allocate/_view/_release, a sender subclass _attach/_write/_detach; the credit protocol stays here.
"""

# Legend: hidden_TD [T tokens, D hidden] in the model dtype; one slot holds one microbatch's hidden_TD.
# Frames on a boundary channel: sender -> receiver: `_hello` once, then one header per microbatch (with slot, dtype,
# shape when a tensor rides along); receiver -> sender: `_credit` naming a freed slot. With a header mailbox
# (mailbox.py: receivers polling it, spin_us > 0, on x86-64) every header also carries its number `_q` and is written
# into the mailbox; it goes by the socket too only where mailbox.py says (the receiver asleep there, a header larger
# than an entry, or one still unread when its entry is reused), and the receiver takes each number once.

from __future__ import annotations

import collections
import math
import threading
import time

import numpy as np
import torch

from memra_pp.errors import InputError, ProtocolError
from memra_pp.stages import mailbox
from memra_pp.stages.channel import ChannelListener, connect

DTYPES = {n: getattr(torch, n) for n in ("float32", "bfloat16", "float16", "float64", "int64", "int32", "uint8")}
RESERVED_KEYS = ("slot", "dtype", "shape", "t_ns", "_q")
_HELLO, _CREDIT = "_hello", "_credit"


def nearest_rank(xs, q: float, unit: float = 1.0):
    """The q-quantile of xs by nearest rank, in units of `unit` (1e3: ns as us), or None where xs is empty."""
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)] / unit if s else None


class _HandoffStats:
    """Counters plus a bounded ring of per-handoff latencies (ns) for p50/p99."""

    def __init__(self, ring: int):
        self.handoffs = self.headers = self.bytes = 0
        self.wait_s = 0.0
        self.lat_ns: collections.deque[int] = collections.deque(maxlen=ring)
        self.write_ns = self.sent_ns = 0     # sender: of all handoffs' time (sent), the data path's (write)

    def as_dict(self) -> dict:
        s = list(self.lat_ns)
        out = {"handoffs": self.handoffs, "headers": self.headers, "bytes": self.bytes, "wait_s": self.wait_s,
               "handoff_p50_us": nearest_rank(s, 0.50, 1e3), "handoff_p99_us": nearest_rank(s, 0.99, 1e3),
               "samples": len(s)}
        if self.write_ns:           # where a sender's handoff goes: the data path, the rest is the header's
            out["write_us_mean"] = self.write_ns / 1e3 / max(self.handoffs, 1)
            out["header_us_mean"] = (self.sent_ns - self.write_ns) / 1e3 / max(self.handoffs, 1)
        return out


def _nbytes(dtype: torch.dtype, shape) -> int:
    return math.prod(shape) * dtype.itemsize


class _SlotViews:
    """Typed views over slots' uint8 bases, cached by (slot, dtype, shape): building one costs three torch ops."""

    def __init__(self, bases: list[torch.Tensor]):
        self.bases, self._cache = bases, {}

    def get(self, slot: int, dtype: torch.dtype, shape) -> torch.Tensor:
        key = (slot, dtype, tuple(shape))
        v = self._cache.get(key)
        if v is None:
            if len(self._cache) >= 64:  # shapes vary with T: keep the cache bounded
                self._cache.clear()
            v = self._cache[key] = self.bases[slot][:_nbytes(dtype, shape)].view(dtype).view(shape)
        return v

    def clear(self) -> None:
        self.bases, self._cache = [], {}


def _u8_over(buf, nbytes: int) -> torch.Tensor:
    # through numpy: the array holds a buffer export, so closing the mapping under a live view raises BufferError
    # instead of leaving a dangling tensor (torch.frombuffer drops its export)
    return torch.from_numpy(np.frombuffer(buf, dtype=np.uint8, count=nbytes))


class _Link:
    """What both ends of a boundary share: handoff counters, and closing as a context manager."""

    def stats(self, reset: bool = False) -> dict:
        """reset: the handoff counters and latencies start a new window (the header counts below do not).
        Headers taken from (receiver) / written into (sender) the mailbox; a sender also counts those it wrote to
        the socket (every one without a mailbox) and those it sent late (mailbox.py)."""
        h = getattr(self, "_headers", None)
        st = self._stats
        if reset:     # a handoff finishing on the loop's thread meanwhile counts in one window or the other
            self._stats = _HandoffStats(st.lat_ns.maxlen)
        out = {**st.as_dict(), "mailbox_headers": 0 if h is None else h.mailboxed}
        if isinstance(h, mailbox.HeaderWriter):
            out.update(socket_headers=h.socketed, late_headers=h.late)
        return out

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SlotReceiverBase(_Link):
    """Receiver end: owns `n_slots` slots and the listening socket; the transport lives in the hooks."""

    TRANSPORT = "abstract"
    SPIN_US = 0.0       # how long recv polls the header mailbox before it blocks on the socket (0: no mailbox)

    def __init__(self, name: str, max_bytes: int, listen_address: str | None = None, n_slots: int = 2,
                 latency_ring: int = 4096, spin_us: float | None = None):
        if max_bytes <= 0 or n_slots <= 0:
            raise ValueError(f"boundary {name}: max_bytes ({max_bytes}) and n_slots ({n_slots}) must be positive")
        self.name, self.max_bytes, self.n_slots = name, max_bytes, n_slots
        self.spin_s = (self.SPIN_US if spin_us is None else spin_us) / 1e6   # placement.transport_poll_us
        self._listener = ChannelListener(listen_address, label=f"boundary {name}")
        self._mbox = None
        try:
            if self.spin_s > 0 and mailbox.supported():
                self._mbox = mailbox.Mailbox.create(name)
            self._extras = self._allocate(n_slots, max_bytes)
            if self._mbox is not None:
                self._extras["mailbox"] = self._mbox.name
        except BaseException:
            self._listener.close()
            if self._mbox is not None:
                self._mbox.close()
            try:
                self._release()     # the slots _allocate made before it failed (a second one out of memory)
            except Exception:  # noqa: BLE001 - the allocation's own error is the one to raise
                pass
            raise
        self._headers: mailbox.HeaderReader | None = None      # made by accept, over the channel
        self._ch = None
        self._held: dict[int, int] = {}  # slot -> mb: handed to the caller, not yet freed
        self._lock = threading.Lock()  # recv and free may run on different threads
        self._stats = _HandoffStats(latency_ring)

    def endpoint(self) -> dict:
        """Plain-data description of this receiver (msgpack- and pickle-able) for the sender's constructor."""
        return {"name": self.name, "transport": self.TRANSPORT, "max_bytes": self.max_bytes,
                "n_slots": self.n_slots, "address": self._listener.address, **self._extras}

    def accept(self, timeout: float) -> None:
        """Wait for the sender to connect and check it attached to this receiver's slots."""
        deadline = time.monotonic() + timeout
        ch = self._listener.accept(timeout)
        try:
            hello = ch.recv(max(deadline - time.monotonic(), 0.0))
        except BaseException:   # no hello in time, or one that did not decode: the connection goes now, not at GC
            ch.close()
            raise
        if hello["kind"] != _HELLO or hello.get("endpoint") != self.endpoint():
            ch.close()
            raise ProtocolError(f"boundary {self.name}: the connecting sender sent {hello['kind']!r} for endpoint "
                                f"{hello.get('endpoint')}, this receiver is {self.endpoint()}")
        self._ch = ch
        self._headers = mailbox.HeaderReader(ch, self._mbox, self.spin_s, f"boundary {self.name}")
        self._listener.close()  # one sender per boundary: free the socket path now

    def recv(self, timeout: float | None = None) -> tuple[dict, torch.Tensor | None]:
        """Next (header, hidden_TD view). The view aliases the slot: valid until `free(header['slot'])`."""
        assert self._ch is not None, "accept() before recv()"
        t_wait = time.perf_counter_ns()
        header = self._headers.next(timeout)
        t0 = time.perf_counter_ns()
        self._stats.wait_s += (t0 - t_wait) / 1e9
        if header["kind"] in (_HELLO, _CREDIT):
            raise ProtocolError(f"boundary {self.name}: unexpected {header['kind']!r} frame from the sender")
        if header.get("slot") is None:
            self._stats.headers += 1
            return header, None
        slot, dtype, shape = self._check(header)
        with self._lock:
            if slot in self._held:
                raise ProtocolError(f"boundary {self.name}: sender wrote slot {slot} while mb {self._held[slot]} "
                                    f"still holds it; the credit protocol is broken")
            self._held[slot] = header["mb"]
        view_TD = self._view(slot, dtype, shape)
        st = self._stats
        st.handoffs += 1
        st.bytes += _nbytes(dtype, shape)
        # Handoff latency: from the later of (sender took the slot, this receiver started waiting) to the view
        # being ready, so a microbatch queued while the receiver computed counts its parse, not the queueing.
        # perf_counter_ns is CLOCK_MONOTONIC: one clock for every process of the host (neighbours share a node).
        t_sent = header.get("t_ns")
        start = max(t_sent, t_wait) if isinstance(t_sent, int) else t0
        st.lat_ns.append(time.perf_counter_ns() - start)
        return header, view_TD

    def _check(self, h: dict) -> tuple[int, torch.dtype, list[int]]:
        slot, dname, shape = h.get("slot"), h.get("dtype"), h.get("shape")
        bad = None
        if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < self.n_slots:
            bad = f"slot {slot!r} is not in [0, {self.n_slots})"
        elif dname not in DTYPES:
            bad = f"dtype {dname!r} is not one of {sorted(DTYPES)}"
        elif not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
            bad = f"shape {shape!r} is not a list of non-negative ints"
        elif _nbytes(DTYPES[dname], shape) > self.max_bytes:
            bad = f"shape {shape} {dname} needs {_nbytes(DTYPES[dname], shape)} bytes, slots hold {self.max_bytes}"
        if bad:
            raise ProtocolError(f"boundary {self.name}: header of mb {h['mb']}: {bad}")
        return slot, DTYPES[dname], shape

    def free(self, slot: int) -> None:
        """Give `slot` back to the sender (a credit frame); views over it must not be used afterwards."""
        with self._lock:
            if type(slot) is not int or slot not in self._held:    # (0.0 or True would match slot 0 / 1)
                raise InputError(f"boundary {self.name}: free({slot!r}) of a slot not held "
                                 f"(held: {sorted(self._held)})")
            mb = self._held.pop(slot)
        self._ch.send({"kind": _CREDIT, "mb": mb, "slot": slot})

    def held(self) -> list[int]:
        with self._lock:
            return sorted(self._held)

    def halt(self) -> None:
        """A halt's half of close() (stages/recovery.py): close the channel and stop using the slots, but keep them:
        the sender's process may still have them mapped, a copy into them queued, until its own halt has returned.
        close() frees them later (the next relink, or stop)."""
        self._close_channel()
        self._quiesce()

    def close(self) -> None:
        """Close the channel and release (unlink) the slots; drop every view from `recv` first."""
        self._close_channel()
        self._release()

    def _close_channel(self) -> None:
        if self._ch is not None:
            self._ch.close()
        self._listener.close()
        if self._mbox is not None:
            self._mbox.close()

    # Data-path hooks. _allocate: create the slots, return the plain-data endpoint entries a sender attaches with.
    # _view: a tensor of dtype/shape aliasing the first bytes of a slot. _release: free the slots (idempotent).
    # _quiesce (halt): finish this side's use of what the sender exported, unlink names; the slots stay (idempotent).
    def _allocate(self, n_slots: int, max_bytes: int) -> dict:
        raise NotImplementedError

    def _quiesce(self) -> None:
        pass

    def _view(self, slot: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        raise NotImplementedError

    def _release(self) -> None:
        raise NotImplementedError


class SlotSenderBase(_Link):
    """Sender end: fills a slot only after the receiver's credit for it; the transport lives in the hooks."""

    def __init__(self, endpoint: dict, latency_ring: int = 4096, every_frame_on_socket: bool = False):
        self.endpoint = dict(endpoint)
        # every header over the socket too, even while the receiver polls its mailbox: the protocol before the
        # mailbox's control words (mailbox.py), kept for side-by-side runs (slots_bench, gpu_checks)
        self.every_frame_on_socket = every_frame_on_socket
        self.name, self.max_bytes = endpoint["name"], endpoint["max_bytes"]
        self._free = collections.deque(range(endpoint["n_slots"]))
        self._in_flight: set[int] = set()  # written and announced, no credit back yet
        self._ch = self._mbox = self._headers = None
        self._stats = _HandoffStats(latency_ring)
        try:
            self._attach(self.endpoint)
        except BaseException:
            # what _attach opened before it failed (a second mapping refused): no object is returned to close it
            for undo in (self._detach, self._unexport):
                try:
                    undo()
                except Exception:  # noqa: BLE001 - the attach's own error is the one to raise
                    pass
            raise

    def connect(self, timeout: float) -> None:
        self._ch = connect(self.endpoint["address"], timeout, label=f"boundary {self.name}")
        self._ch.send({"kind": _HELLO, "mb": -1, "endpoint": self.endpoint})
        if self.endpoint.get("mailbox"):
            self._mbox = mailbox.Mailbox.attach(self.endpoint["mailbox"], f"boundary {self.name}")
        self._headers = mailbox.HeaderWriter(self._ch, self._mbox, self.every_frame_on_socket)

    def send(self, header: dict, hidden_TD: torch.Tensor | None = None, timeout: float | None = 60.0) -> int | None:
        """Send a copy of `header` and, if given, hidden_TD through a free slot (the transport owns the copy's
        slot, dtype, shape keys). Blocks up to `timeout` s for a freed slot (TimeoutError); returns the slot or None.
        """
        t0 = time.perf_counter_ns()
        deadline = None if timeout is None else time.monotonic() + timeout
        if header.get("kind") in (_HELLO, _CREDIT):
            raise InputError(f"boundary {self.name}: header kind {header['kind']!r} is reserved for the transport")
        if hidden_TD is None:  # keys of the upstream boundary's slot would name a slot here that holds nothing
            self._headers.send({k: v for k, v in header.items() if k not in RESERVED_KEYS}, timeout)
            self._stats.headers += 1
            return None
        nbytes = hidden_TD.numel() * hidden_TD.element_size()
        dname = str(hidden_TD.dtype).removeprefix("torch.")
        if dname not in DTYPES:
            raise InputError(f"boundary {self.name}: hidden_TD dtype {hidden_TD.dtype} is not one of {sorted(DTYPES)}")
        if nbytes > self.max_bytes:
            raise InputError(f"boundary {self.name}: hidden_TD {list(hidden_TD.shape)} {dname} is {nbytes} bytes, "
                             f"a slot holds {self.max_bytes} bytes; raise the slot size or cut the microbatch")
        slot = self._acquire(deadline, timeout)
        assert slot not in self._in_flight, f"slot {slot} is still in flight: never write a slot not freed"
        t0 = time.perf_counter_ns()   # the handoff proper starts once a slot is ours: waiting is back-pressure
        try:
            self._write(slot, hidden_TD)
            t1 = time.perf_counter_ns()
            self._headers.send(dict(header, slot=slot, dtype=dname, shape=list(hidden_TD.shape), t_ns=t0))
        except BaseException:
            self._free.appendleft(slot)  # never announced: the receiver does not know of it
            raise
        self._in_flight.add(slot)
        st = self._stats
        st.handoffs += 1
        st.bytes += nbytes
        t2 = time.perf_counter_ns()
        st.write_ns += t1 - t0
        st.sent_ns += t2 - t0
        st.lat_ns.append(t2 - t0)
        return slot

    def _acquire(self, deadline: float | None, timeout: float | None) -> int:
        t_wait = time.perf_counter_ns()
        while not self._free:
            self._await_credit(deadline, timeout)
        self._stats.wait_s += (time.perf_counter_ns() - t_wait) / 1e9
        return self._free.popleft()

    def _await_credit(self, deadline: float | None, timeout: float | None) -> None:
        remaining = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        try:
            msg = self._ch.recv(remaining)
        except TimeoutError:
            raise TimeoutError(f"boundary {self.name}: no slot freed within {timeout}s; the receiver still "
                               f"holds slots {sorted(self._in_flight)}") from None
        self._on_credit(msg)

    def _on_credit(self, msg: dict) -> None:
        slot = msg.get("slot")
        if msg["kind"] != _CREDIT or type(slot) is not int or slot not in self._in_flight:
            raise ProtocolError(f"boundary {self.name}: expected a credit for one of {sorted(self._in_flight)}, "
                                f"got kind {msg['kind']!r} slot {slot!r}")
        self._in_flight.remove(slot)
        self._free.append(slot)

    def idle(self) -> bool:
        """Every slot free, none written and unanswered: what a refused send must leave as it found (after drain)."""
        return not self._in_flight and len(self._free) == self.endpoint["n_slots"]

    def drain(self, timeout: float) -> None:
        """Wait until the receiver has freed every slot (flush before shutdown; round-trip benchmarks)."""
        deadline = time.monotonic() + timeout
        while self._in_flight:
            self._await_credit(deadline, timeout)

    def halt(self) -> None:
        """A halt's half of close() (stages/recovery.py): close the channel and unmap the receiver's slots (a GPU
        sender's copies into them have run first); what the receiver's process may still use of this side's (a
        peer sender's exported events) stays until close()."""
        self._close_channel()
        self._detach()

    def close(self) -> None:
        self._close_channel()
        self._detach()
        self._unexport()

    def _close_channel(self) -> None:
        if self._ch is not None:
            self._ch.close()
        if self._mbox is not None:
            self._mbox.close()

    # Data-path hooks. _attach: map the slots an endpoint names (a failure part way leaves the rest to _detach).
    # _write: copy hidden_TD into the first bytes of a slot, complete (visible to the receiver) on return. _detach:
    # unmap the slots, tolerating a partial _attach (idempotent). _unexport: free what this side exported to the
    # receiver, once the receiver is done with it (idempotent).
    def _attach(self, endpoint: dict) -> None:
        raise NotImplementedError

    def _write(self, slot: int, hidden_TD: torch.Tensor) -> None:
        raise NotImplementedError

    def _detach(self) -> None:
        raise NotImplementedError

    def _unexport(self) -> None:
        pass
