"""GPU boundary slots on the credit protocol of slots.py: `peer` (receiver-owned cuMemAlloc slots shared by CUDA IPC,
ordered by IPC events) and `host` (pinned shared memory, d2h then h2d). Runs in two neighbouring stage processes.
"""
# Legend: hidden_TD [T tokens, D hidden]. Ordering (peer): sender copies on its stream, records ready[k]; receiver
# waits ready[k] on its stream; on free(k) the receiver records done[k] on its stream and the sender's next write
# of slot k waits done[k] on the sender's stream: no host synchronisation on either hot path.

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import socket
import threading
import time
from multiprocessing.shared_memory import SharedMemory

import torch

from memra_pp import cuda, cuda_views
from memra_pp.engine import ContextId, Engine, residency_of
from memra_pp.errors import ProtocolError, ResidencyError
from memra_pp.shm import segment_name
from memra_pp.stages.channel import ChannelClosed
from memra_pp.stages.shm_slots import _attach_shm
from memra_pp.stages.slots import SlotReceiverBase, SlotSenderBase, _nbytes, _SlotViews

_EVENTS = "_gpu_events"  # sender -> receiver, right after the hello: the sender's ready-event handles


def _engine_for(engine: Engine | None) -> Engine:
    # A stage process makes its device current when it builds its Engine; a second Engine shares that context.
    return engine if engine is not None else Engine(f"cuda:{torch.cuda.current_device()}")


def _ctx_dict(c: ContextId) -> dict:
    return {"node": c.node, "pid": c.pid, "device": c.device, "uid": c.uid}


def _require_current(ctx: ContextId, what: str, engine: Engine, fast: bool = True) -> None:
    """Refuse to dereference `what` unless `ctx` (the context it was opened in) is current on this thread. fast:
    Engine.is_current answers where it passes (one driver call); the full path builds the refusal's message."""
    if fast and ctx == engine.ctx and engine.is_current():
        return
    cur = cuda.current_context()
    if int(cur) == 0 and engine.ctx == ctx:  # a fresh thread has no context yet: give it the engine's
        engine.make_current()
        cur = cuda.current_context()
    uid = cuda.context_uid(cur) if int(cur) else None
    if not ctx.is_local() or uid != ctx.uid:
        raise ResidencyError(f"{what} was opened in {ctx} but this thread runs in ctx#{uid} of pid {os.getpid()}: "
                             f"an IPC pointer means nothing there; use the sender on its engine "
                             f"(engine.make_current())")


def _current_ctx_id(cur) -> ContextId:
    """The ContextId of `cur`, the context current on this thread (for a refusal's message)."""
    dev = cuda.ck(cuda.drv().cuCtxGetDevice(), "cuCtxGetDevice")
    return ContextId(socket.gethostname(), os.getpid(), f"cuda:{int(dev)}", cuda.context_uid(cur))


def _require_engine_context(engine: Engine, what: str) -> None:
    """Construction (law 1): cuMemAlloc, cuIpcOpenMemHandle, events and torch's staging land in the context current
    on this thread, and the endpoint's owner / the sender's _opened_in name the engine's: refuse unless they agree."""
    if engine.is_current():
        return
    cur = cuda.current_context()
    if int(cur) == 0:  # a fresh thread has no context yet: give it the engine's
        engine.make_current()
        return
    raise ResidencyError(f"{what}: this thread's current context is {_current_ctx_id(cur)}, not the engine's "
                         f"{engine.ctx}: the slots would live there while named the engine's; make the engine's "
                         f"context current (engine.make_current())")


def _require_placed(engine: Engine, ptr: int, what: str) -> None:
    """Read back the context `ptr` (an allocation or an IPC mapping just made) lives in and refuse unless it is the
    engine's. Device and uid decide: the pointer is of this process."""
    info = cuda.pointer_info(ptr)
    uid = cuda.context_uid(info.ctx) if int(info.ctx) else None
    if (f"cuda:{info.device_ordinal}", uid) != (engine.ctx.device, engine.ctx.uid):
        real = ContextId(socket.gethostname(), os.getpid(), f"cuda:{info.device_ordinal}", uid)
        raise ResidencyError(f"{what} landed in {real}, not in the engine's {engine.ctx}; make the engine's context "
                             f"current (engine.make_current())")


def _each(fn, items) -> None:
    """fn(item) for every item, the first error raised after the rest ran (a teardown frees what it can)."""
    first = None
    for x in items:
        try:
            fn(x)
        except Exception as e:  # noqa: BLE001
            first = first or e
    if first is not None:
        raise first


class _GpuReceiver(SlotReceiverBase):
    # GPU stages hold a whole host core each (num_cpus 1), and their receiver waits only between microbatches:
    # it polls the header mailbox for up to 2 ms before it sleeps in the socket (mailbox.py says why)
    SPIN_US = 2000.0

    def __init__(self, name: str, max_bytes: int, listen_address: str | None = None, n_slots: int = 2,
                 engine: Engine | None = None, latency_ring: int = 4096, spin_us: float | None = None,
                 fast_checks: bool = True):
        self.engine = _engine_for(engine)
        self.fast_checks = fast_checks      # _require_current's fast path (False: the full one, for the probe)
        _require_engine_context(self.engine, f"boundary {name}: a {self.TRANSPORT} receiver")
        super().__init__(name, max_bytes, listen_address, n_slots, latency_ring, spin_us)

    def _stream(self):
        return cuda.current_stream_handle(self.engine.device.index)

    def free(self, slot: int) -> None:
        if slot in self.held():
            self._before_credit(slot)
        super().free(slot)


class PeerSlotReceiver(_GpuReceiver):
    """Two dedicated 2 MiB-aligned device slots in this engine's context, exported once by CUDA IPC."""

    TRANSPORT = "peer"

    def _allocate(self, n_slots: int, max_bytes: int) -> dict:
        self._allocs, self._done, self._ready = [], [], []
        idx = self.engine.device.index
        for _ in range(n_slots):
            self._allocs.append(cuda.mem_alloc_2mib(max_bytes))
            self._done.append(cuda.event_create(interprocess=True))
        _require_placed(self.engine, self._allocs[0].ptr, f"boundary {self.name}: the receiver's slots")
        self._bytes = [cuda_views.device_bytes(a.ptr, max_bytes, idx, owner=a) for a in self._allocs]
        self._views = _SlotViews(self._bytes)    # typed views cached: building one costs three torch ops (~5 us)
        handles = [list(cuda.ipc_export_mem(a.ptr)) for a in self._allocs]
        return {"owner": _ctx_dict(self.engine.ctx), "slots": handles,
                "done_events": [cuda.ipc_export_event(e) for e in self._done]}

    def accept(self, timeout: float) -> None:
        t0 = time.monotonic()
        super().accept(timeout)
        msg = self._ch.recv(max(timeout - (time.monotonic() - t0), 0.0))
        if msg["kind"] != _EVENTS or len(msg.get("ready", ())) != self.n_slots:
            raise ProtocolError(f"boundary {self.name}: expected the sender's {_EVENTS} frame, got {msg['kind']!r}")
        if ContextId(**msg["ctx"]).is_local():
            raise ResidencyError(f"boundary {self.name}: the peer sender is in this process; CUDA IPC needs two")
        self._ready = []    # one by one: a failed second open leaves the first to _quiesce / _release
        for h in msg["ready"]:
            self._ready.append(cuda.ipc_open_event(h))

    def _view(self, slot: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        _require_current(self.engine.ctx, f"boundary {self.name} slot {slot}", self.engine, self.fast_checks)
        cuda.stream_wait_event(self._stream(), self._ready[slot])  # the copy into the slot precedes what we enqueue
        return self._views.get(slot, dtype, shape).detach()   # a fresh alias: callers may not edit the cached one

    def _before_credit(self, slot: int) -> None:
        # everything the caller enqueued on the slot (on the current stream) precedes the sender's next write
        cuda.event_record(self._done[slot], self._stream())

    def _quiesce(self) -> None:
        # A halt: our waits on the sender's ready events have run before we drop our imports of them (the sender
        # destroys them at its close, after every halt). The slots and done events stay: the sender's process may
        # have them open, a copy queued, until its own halt has returned (importer closes before exporter frees).
        if getattr(self, "_ready", None):
            cuda.stream_synchronize(self._stream())
            ready, self._ready = self._ready, []
            _each(cuda.event_destroy, ready)

    def _release(self) -> None:
        # The sender must have closed its mapping first: at a halt's relink or stop, or as the caller orders it.
        if getattr(self, "_allocs", None) or getattr(self, "_ready", None):
            cuda.stream_synchronize(self._stream())
        self._bytes = []
        if getattr(self, "_views", None) is not None:
            self._views.clear()
        allocs, done, ready = getattr(self, "_allocs", []), getattr(self, "_done", []), getattr(self, "_ready", [])
        self._allocs, self._done, self._ready = [], [], []
        _each(lambda f: f(), [a.free for a in allocs] + [lambda e=e: cuda.event_destroy(e) for e in done + ready])


class HostSlotReceiver(_GpuReceiver):
    """Two shared-memory host slots registered (PORTABLE) here and in the sender; h2d into device staging."""

    TRANSPORT = "host"

    def _allocate(self, n_slots: int, max_bytes: int) -> dict:
        tag = segment_name("host", self.name)
        # built one slot at a time, so that _release frees what a failure part way (the second segment, a pinned
        # registration, device memory) left made
        self._shms, self._cbufs, self._addrs, self._staging, self._h2d = [], [], [], [], []
        for k in range(n_slots):
            self._shms.append(SharedMemory(name=f"{tag}_{k}", create=True, size=max_bytes))
            self._cbufs.append((ctypes.c_char * max_bytes).from_buffer(self._shms[-1].buf))
            self._addrs.append(cuda.host_register(ctypes.addressof(self._cbufs[-1]), max_bytes))
            self._staging.append(torch.empty(max_bytes, dtype=torch.uint8, device=self.engine.device))
            self._h2d.append(cuda.event_create(interprocess=False))
        self._views = _SlotViews(self._staging)
        return {"owner": _ctx_dict(self.engine.ctx), "shm": [s.name for s in self._shms]}

    def _view(self, slot: int, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
        n, s = _nbytes(dtype, shape), self._stream()
        cuda.memcpy_htod_async(self._staging[slot].data_ptr(), self._addrs[slot], n, s)
        cuda.event_record(self._h2d[slot], s)
        return self._views.get(slot, dtype, shape).detach()   # a fresh alias: callers may not edit the cached one

    def _before_credit(self, slot: int) -> None:
        # the sender may overwrite the host slot once our h2d from it has run (usually long done by now)
        cuda.event_synchronize(self._h2d[slot])

    def _quiesce(self) -> None:
        # a halt: our h2d out of the slots has run, and the names go (a process killed before the relink leaves
        # nothing in /dev/shm); the mappings and registrations stay until close(), as the peer slots do
        for s in getattr(self, "_shms", []):
            with contextlib.suppress(FileNotFoundError):
                s.unlink()
        if getattr(self, "_addrs", None):
            cuda.stream_synchronize(self._stream())

    def _release(self) -> None:
        # each step on its own: one that fails (a registration the driver already dropped, a name the driver's
        # unlink_shm took, a close refused while a view lives) must not keep the later ones from being freed
        addrs, events, shms = getattr(self, "_addrs", []), getattr(self, "_h2d", []), getattr(self, "_shms", [])
        self._addrs, self._h2d, self._shms = [], [], []
        if addrs:       # an h2d out of a slot may still run (a view taken, not yet credited): the peer path syncs too
            with contextlib.suppress(Exception):
                cuda.stream_synchronize(self._stream())
        for a in addrs:
            with contextlib.suppress(Exception):
                cuda.host_unregister(a)
        for e in events:
            with contextlib.suppress(Exception):
                cuda.event_destroy(e)
        if getattr(self, "_views", None) is not None:
            self._views.clear()
        self._cbufs, self._staging = [], []
        for s in shms:      # every name first: a close refused while a view is alive must not leave one in /dev/shm
            with contextlib.suppress(FileNotFoundError):
                s.unlink()
        for s in shms:
            with contextlib.suppress(BufferError):
                s.close()


class _GpuSender(SlotSenderBase):
    def __init__(self, endpoint: dict, engine: Engine | None = None, latency_ring: int = 4096,
                 fast_checks: bool = True, every_frame_on_socket: bool = False):
        self.engine = _engine_for(engine)
        # the context and residency checks through Engine.is_current / Engine.owns (one driver call each) where
        # they pass, the full ContextId only for a refusal's message; False: the full path every time (the probe
        # sets both side by side: gpu_checks --handoff-checks)
        self.fast_checks = fast_checks
        self._lock = threading.Lock()   # _write against a _detach on another thread (a halt under a sending loop)
        _require_engine_context(self.engine, f"boundary {endpoint['name']}: a {endpoint['transport']} sender")
        super().__init__(endpoint, latency_ring, every_frame_on_socket)

    def _stream(self):
        return cuda.current_stream_handle(self.engine.device.index)

    def _check_source(self, hidden_TD: torch.Tensor) -> int:
        if self.fast_checks and self.engine.owns(hidden_TD):
            return hidden_TD.numel() * hidden_TD.element_size()
        ctx = residency_of(hidden_TD, self.engine)
        if ctx != self.engine.ctx:
            raise ResidencyError(f"boundary {self.name}: hidden_TD lives in {ctx}, the sender's engine is "
                                 f"{self.engine.ctx}; compute it on the sender's engine")
        return hidden_TD.numel() * hidden_TD.element_size()


class PeerSlotSender(_GpuSender):
    """Opens the receiver's slots (LAZY_ENABLE_PEER_ACCESS) in this engine's context; copies with cuMemcpyDtoDAsync."""

    def _attach(self, endpoint: dict) -> None:
        owner = ContextId(**endpoint["owner"])
        if owner.is_local():
            raise ResidencyError(f"boundary {self.name}: the receiver's slots live in this process ({owner}); "
                                 f"CUDA IPC cannot open them here: use one stage per process")
        self._maps, self._done, self._ready = [], [], []   # one by one: what a failure part way opened, _detach
        self._written: set[int] = set()                     # and _unexport close (SlotSenderBase.__init__)
        for h, off in endpoint["slots"]:
            self._maps.append(cuda.ipc_open_mem(bytes(h), off))
        # every pointer below means something only in the context the mapping was opened in: read it back
        _require_placed(self.engine, self._maps[0][1], f"boundary {self.name}: the sender's mapping of the slots")
        self._opened_in = self.engine.ctx
        for h in endpoint["done_events"]:
            self._done.append(cuda.ipc_open_event(h))
        for _ in self._maps:
            self._ready.append(cuda.event_create(interprocess=True))

    def connect(self, timeout: float) -> None:
        super().connect(timeout)
        self._ch.send({"kind": _EVENTS, "mb": -1, "ctx": _ctx_dict(self.engine.ctx),
                       "ready": [cuda.ipc_export_event(e) for e in self._ready]})

    def _write(self, slot: int, hidden_TD: torch.Tensor) -> None:
        with self._lock:
            if not self._maps:      # detached under this sending thread (a halt gave up its join)
                raise ChannelClosed(f"boundary {self.name}: send on a closed boundary")
            _require_current(self._opened_in, f"boundary {self.name} IPC slot {slot}", self.engine, self.fast_checks)
            n = self._check_source(hidden_TD)
            src = hidden_TD.contiguous()
            s = self._stream()
            if slot in self._written:
                cuda.stream_wait_event(s, self._done[slot])  # the receiver is done with the slot's previous contents
            cuda.memcpy_dtod_async(self._maps[slot][1], src.data_ptr(), n, s)
            cuda.event_record(self._ready[slot], s)
            self._written.add(slot)

    def _detach(self) -> None:
        with self._lock:
            maps, done = getattr(self, "_maps", []), getattr(self, "_done", [])
            if maps or done:
                cuda.stream_synchronize(self._stream())  # our copies into the slots, our waits on done[k] have run
            self._maps, self._done = [], []
            _each(lambda f: f(), [lambda b=b: cuda.ipc_close_mem(b) for b, _ptr in maps]
                  + [lambda e=e: cuda.event_destroy(e) for e in done])

    def _unexport(self) -> None:
        # the ready events the receiver imported: after its halt (which drops its imports) or as the caller orders
        ready, self._ready = getattr(self, "_ready", []), []
        _each(cuda.event_destroy, ready)


class HostSlotSender(_GpuSender):
    """Maps the receiver's shared-memory slots, registers them here too; d2h then waits for the copy."""

    def _attach(self, endpoint: dict) -> None:
        # one slot at a time: what a failure part way mapped and registered, _detach undoes (SlotSenderBase.__init__)
        self._mms, self._cbufs, self._addrs, self._copied = [], [], [], None
        for name in endpoint["shm"]:
            self._mms.append(_attach_shm(name, self.max_bytes, self.name))
            self._cbufs.append((ctypes.c_char * self.max_bytes).from_buffer(self._mms[-1]))
            self._addrs.append(cuda.host_register(ctypes.addressof(self._cbufs[-1]), self.max_bytes))
        self._copied = cuda.event_create(interprocess=False)

    def _write(self, slot: int, hidden_TD: torch.Tensor) -> None:
        with self._lock:
            if not self._addrs:     # detached under this sending thread (a halt gave up its join)
                raise ChannelClosed(f"boundary {self.name}: send on a closed boundary")
            n = self._check_source(hidden_TD)
            s = self._stream()
            cuda.memcpy_dtoh_async(self._addrs[slot], hidden_TD.contiguous().data_ptr(), n, s)
            cuda.event_record(self._copied, s)
            cuda.event_synchronize(self._copied)  # the header must not announce bytes still in flight

    def _detach(self) -> None:
        with self._lock:
            addrs, copied, mms = getattr(self, "_addrs", []), getattr(self, "_copied", None), getattr(self, "_mms", [])
            self._addrs, self._cbufs, self._copied, self._mms = [], [], None, []
            steps = [lambda a=a: cuda.host_unregister(a) for a in addrs]
            if copied is not None:
                steps.append(lambda: cuda.event_destroy(copied))
            _each(lambda f: f(), steps + [m.close for m in mms])    # (the ctypes views over mms dropped above)


RECEIVERS = {"peer": PeerSlotReceiver, "host": HostSlotReceiver}
SENDERS = {"peer": PeerSlotSender, "host": HostSlotSender}


def probe_pattern(nbytes: int, device, seed: int = 0) -> torch.Tensor:
    """A byte pattern that differs per position and per seed (catches stale, shifted and truncated copies)."""
    i = torch.arange(nbytes, dtype=torch.int64, device=device)
    return ((i * 7 + seed * 13 + (i >> 8)) % 251).to(torch.uint8)


def _probe_receiver(dst: int, nbytes: int, conn, timeout: float) -> None:
    try:
        with PeerSlotReceiver("p2p-probe", nbytes, engine=Engine(f"cuda:{dst}")) as r:
            conn.send(r.endpoint())
            r.accept(timeout)
            hdr, view = r.recv(timeout)
            ok = bool(torch.equal(view, probe_pattern(nbytes, view.device, 1)))
            del view
            r.free(hdr["slot"])
            conn.send(("ok" if ok else "mismatch", ""))
            conn.poll(timeout)  # the sender closes its mapping before we free the slots
    except Exception as e:  # reported to the parent, which decides
        conn.send(("error", f"receiver: {type(e).__name__}: {e}"))


def _probe_sender(src: int, endpoint: dict, conn, timeout: float) -> None:
    try:
        eng = Engine(f"cuda:{src}")
        with PeerSlotSender(endpoint, engine=eng) as s:
            s.connect(timeout)
            s.send({"kind": "probe", "mb": 0}, probe_pattern(endpoint["max_bytes"], eng.device, 1), timeout)
            s.drain(timeout)
        conn.send(("ok", ""))
    except Exception as e:
        conn.send(("error", f"sender: {type(e).__name__}: {e}"))


def join_or_kill(procs, timeout: float) -> None:
    """Wait up to `timeout` s for each of the spawned processes of a two-process check to end; kill one that has not."""
    for p in procs:
        p.join(timeout=timeout)
        if p.is_alive():
            p.kill()


def probe_p2p(src_dev: int, dst_dev: int, nbytes: int = 4 << 20, timeout: float = 60.0) -> dict:
    """Copy a pattern from a process on `src_dev` into a peer slot of a process on `dst_dev` and compare there:
    what `transport: auto` trusts (cuDeviceCanAccessPeer alone does not prove the IPC mapping works)."""
    t0, ctx = time.monotonic(), mp.get_context("spawn")
    (rp, rc), (sp, sc) = ctx.Pipe(), ctx.Pipe()
    recv_p = ctx.Process(target=_probe_receiver, args=(dst_dev, nbytes, rc, timeout), daemon=True)
    recv_p.start()
    procs, detail, ok = [recv_p], "", False
    try:
        if not rp.poll(timeout):
            raise TimeoutError("the receiver did not publish its endpoint")
        ep = rp.recv()
        if isinstance(ep, tuple):
            raise RuntimeError(ep[1])
        send_p = ctx.Process(target=_probe_sender, args=(src_dev, ep, sc, timeout), daemon=True)
        send_p.start()
        procs.append(send_p)
        if not rp.poll(timeout) or not sp.poll(timeout):
            raise TimeoutError(f"no verdict within {timeout}s")
        (r_state, r_msg), (s_state, s_msg) = rp.recv(), sp.recv()
        rp.send("close")
        ok = r_state == "ok" and s_state == "ok"
        detail = r_msg or s_msg or r_state
    except Exception as e:
        detail = f"{type(e).__name__}: {e}"
    finally:
        join_or_kill(procs, 10)
    try:
        peer = cuda.can_access_peer(src_dev, dst_dev) if src_dev != dst_dev else True
    except cuda.CudaError:
        peer = None
    return {"ok": ok, "src": src_dev, "dst": dst_dev, "can_access_peer": peer, "detail": detail,
            "seconds": round(time.monotonic() - t0, 3)}
