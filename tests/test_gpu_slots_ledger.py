"""The GPU boundary slots' teardown on the CPU: memra_pp.cuda's driver wrappers replaced by a ledger of what is
allocated, opened, registered and freed, under the real PeerSlotReceiver / PeerSlotSender / HostSlotSender and the
real halt / relink / stop of a StageRunner. What a GPU run cannot show without racing: every imported IPC event
destroyed, nothing left open by a constructor failing part way, a receiver's slots freed only after the upstream
sender unmapped them, the construction refused under a foreign context. No GPU needed (tests/test_gpu_slots.py runs
the same paths on one)."""
import glob
import itertools
import os
import threading
import types
from multiprocessing.shared_memory import SharedMemory

import pytest
import torch

from memra_pp import cuda, cuda_views
from memra_pp.engine import ContextId
from memra_pp.errors import ResidencyError, StageFailed
from memra_pp.stages import gpu_slots
from memra_pp.stages.channel import ChannelClosed
from memra_pp.stages.runner import StageRunner
from memra_pp.stages.shm_slots import SlotSender

PRIMARY, SECONDARY = 0x1000, 0x2000     # context handles of the fake driver; their cuCtxGetId: 1, 7
UIDS = {PRIMARY: 1, SECONDARY: 7}


class Ledger:
    """What the fake driver holds live, per kind, and the order of every teardown call."""

    def __init__(self):
        self.live = {k: {} for k in ("alloc", "event", "imported_event", "ipc_map", "host_reg")}
        self.log: list[str] = []
        self.current = PRIMARY      # the context current on every thread
        self.fail: dict[str, int] = {}   # wrapper -> the call number (1-based) that raises
        self.calls: dict[str, int] = {}
        self._ids = itertools.count(1)

    def _call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1
        if self.fail.get(name) == self.calls[name]:
            raise cuda.CudaError(f"{name} failed: CUDA_ERROR_TOO_MANY_PEERS (injected)")

    def open_items(self, *kinds) -> dict:
        return {k: len(self.live[k]) for k in (kinds or self.live) if self.live[k]}


@pytest.fixture
def ledger(monkeypatch):
    lg = Ledger()

    class Alloc:
        def __init__(self, n):
            lg._call("mem_alloc_2mib")
            self.base = self.ptr = next(lg._ids) << 21
            self.nbytes = n
            lg.live["alloc"][self.ptr] = lg.current

        def free(self):
            if self.base:
                lg.log.append("cuMemFree")
                del lg.live["alloc"][self.ptr]
                self.base = 0

    def event_create(interprocess=True):
        lg._call("event_create")
        e = ("ev", next(lg._ids))
        lg.live["event"][e] = lg.current
        return e

    def event_destroy(e):
        lg.log.append("cuEventDestroy(imported)" if e in lg.live["imported_event"] else "cuEventDestroy")
        kind = "imported_event" if e in lg.live["imported_event"] else "event"
        assert e in lg.live[kind], f"destroy of an unknown or destroyed event {e}"
        del lg.live[kind][e]

    def ipc_open_event(h):
        lg._call("ipc_open_event")
        e = ("imported", next(lg._ids))
        lg.live["imported_event"][e] = lg.current
        return e

    def ipc_open_mem(h, off):
        lg._call("ipc_open_mem")
        b = next(lg._ids) << 21
        lg.live["ipc_map"][b] = lg.current
        return b, b + off

    def ipc_close_mem(b):
        lg.log.append("cuIpcCloseMemHandle")
        del lg.live["ipc_map"][b]

    def host_register(addr, n):
        lg._call("host_register")
        lg.live["host_reg"][addr] = lg.current
        return addr

    def host_unregister(addr):
        lg.log.append("cuMemHostUnregister")
        del lg.live["host_reg"][addr]

    def pointer_info(ptr):
        return cuda.PointerInfo({**lg.live["alloc"], **lg.live["ipc_map"]}[ptr], 2, 0)    # (offsets are 0)

    fakes = dict(mem_alloc_2mib=Alloc, event_create=event_create, event_destroy=event_destroy,
                 ipc_open_event=ipc_open_event, ipc_export_event=lambda e: b"E" * 64,
                 ipc_export_mem=lambda p: (b"M" * 64, 0), ipc_open_mem=ipc_open_mem, ipc_close_mem=ipc_close_mem,
                 stream_synchronize=lambda s: lg.log.append("cuStreamSynchronize"),
                 event_record=lambda e, s: None, stream_wait_event=lambda s, e: None,
                 memcpy_dtod_async=lambda *a: None, memcpy_dtoh_async=lambda *a: None,
                 event_synchronize=lambda e: None, host_register=host_register, host_unregister=host_unregister,
                 current_stream_handle=lambda i: "stream", current_context=lambda: lg.current,
                 context_uid=lambda c: UIDS[int(c)], pointer_info=pointer_info,
                 drv=lambda: types.SimpleNamespace(cuCtxGetDevice=lambda: (0, 0)))
    for name, fn in fakes.items():
        monkeypatch.setattr(cuda, name, fn)
    monkeypatch.setattr(cuda_views, "device_bytes", lambda ptr, n, idx, owner=None: torch.zeros(n, dtype=torch.uint8))
    return lg


def engine(lg: Ledger, pid: int):
    """An engine of ANOTHER process (pid), as the two ends of a boundary are; its context is PRIMARY."""
    return types.SimpleNamespace(ctx=ContextId("h", pid, "cuda:0", UIDS[PRIMARY]), device=types.SimpleNamespace(
        index=0), is_current=lambda: lg.current == PRIMARY, owns=lambda t: True, make_current=lambda: None)


def _pair(lg, tmp_path, name="b"):
    r = gpu_slots.PeerSlotReceiver(name, 1 << 20, f"unix:{tmp_path}/{name}.sock", engine=engine(lg, 111), spin_us=0)
    s = gpu_slots.PeerSlotSender(r.endpoint(), engine=engine(lg, 222))
    t = threading.Thread(target=r.accept, args=(10,))
    t.start()
    s.connect(10)
    t.join()
    return r, s


def test_every_imported_ipc_event_is_destroyed_on_close(ledger, tmp_path):
    """Three open/close rounds of a peer boundary must leave nothing live in the driver: the receiver's imports of
    the sender's ready events and the sender's imports of the receiver's done events included. (Before: both were
    only cleared, four imported events leaked a round.)"""
    for k in range(3):
        r, s = _pair(ledger, tmp_path, f"b{k}")
        assert len(ledger.live["imported_event"]) == 4
        s.close()
        r.close()
        assert ledger.open_items() == {}, (k, ledger.open_items())


@pytest.mark.parametrize("fail", ["ipc_open_mem", "ipc_open_event", "event_create"])
def test_a_peer_sender_failing_part_way_leaves_nothing_open(ledger, tmp_path, fail):
    """The sender's constructor whose second cuIpcOpenMemHandle, second cuIpcOpenEventHandle or second ready event
    fails must raise that error and leave nothing of its own open: it returns no object to close. (Before: the
    lists were built by comprehension, so the first mapping / import was lost, still open.)"""
    r = gpu_slots.PeerSlotReceiver("bf", 1 << 20, f"unix:{tmp_path}/bf.sock", engine=engine(ledger, 111), spin_us=0)
    before = {k: set(v) for k, v in ledger.live.items()}     # the receiver's own slots and done events
    ledger.fail[fail] = ledger.calls.get(fail, 0) + 2
    with pytest.raises(cuda.CudaError, match="injected"):
        gpu_slots.PeerSlotSender(r.endpoint(), engine=engine(ledger, 222))
    assert ledger.calls[fail] == ledger.fail[fail]
    assert {k: set(v) for k, v in ledger.live.items()} == before
    r.close()
    assert ledger.open_items() == {}


def test_a_receiver_whose_second_ready_event_import_fails_frees_the_first(ledger, tmp_path):
    """accept() opening the sender's ready events one at a time: a failed second one raises, and the receiver's
    close then destroys the first import. (Before: built by comprehension, the first import had no owner.)"""
    r = gpu_slots.PeerSlotReceiver("ba", 1 << 20, f"unix:{tmp_path}/ba.sock", engine=engine(ledger, 111), spin_us=0)
    s = gpu_slots.PeerSlotSender(r.endpoint(), engine=engine(ledger, 222))
    ledger.fail["ipc_open_event"] = ledger.calls["ipc_open_event"] + 2
    err = []
    t = threading.Thread(target=lambda: err.append(pytest.raises(cuda.CudaError, r.accept, 10)))
    t.start()
    s.connect(10)
    t.join()
    assert err and "injected" in str(err[0].value)
    s.close()
    r.close()
    assert ledger.open_items() == {}


def test_a_host_sender_whose_second_registration_fails_leaves_nothing_registered(ledger):
    """HostSlotSender: a failed second cuMemHostRegister raises, and the first slot's registration and mapping are
    undone (the segments can then be closed by their owner). (Before: the first registration stayed, pinned.)"""
    segs = [SharedMemory(create=True, size=1 << 20) for _ in range(2)]
    try:
        ep = {"name": "bh", "transport": "host", "max_bytes": 1 << 20, "n_slots": 2, "address": "unix:/nonexistent",
              "owner": {"node": "h", "pid": 111, "device": "cuda:0", "uid": 1}, "shm": [s.name for s in segs]}
        ledger.fail["host_register"] = 2
        with pytest.raises(cuda.CudaError, match="injected"):
            gpu_slots.HostSlotSender(ep, engine=engine(ledger, 222))
        assert ledger.open_items() == {} and ledger.log == ["cuMemHostUnregister"]
    finally:
        for s in segs:
            s.close()
            s.unlink()


def test_construction_under_a_foreign_context_is_refused(ledger, tmp_path):
    """Law 1: a receiver built while another context is current would cuMemAlloc its slots there and name the
    engine's context as their owner; a sender would open its mappings there. Both refuse, naming both contexts and
    the fix, and leave nothing made. (Before: neither read any context: both were built, mislabelled.)"""
    ledger.current = SECONDARY
    with pytest.raises(ResidencyError) as e:
        gpu_slots.PeerSlotReceiver("bc", 1 << 20, f"unix:{tmp_path}/bc.sock", engine=engine(ledger, 111), spin_us=0)
    msg = str(e.value)
    assert "current context is cuda:0 ctx#7" in msg and "not the engine's cuda:0 ctx#1 (pid 111 on h)" in msg
    assert "make the engine's context current (engine.make_current())" in msg and ledger.open_items() == {}
    ledger.current = PRIMARY
    r = gpu_slots.PeerSlotReceiver("bc", 1 << 20, f"unix:{tmp_path}/bc.sock", engine=engine(ledger, 111), spin_us=0)
    ledger.current = SECONDARY
    with pytest.raises(ResidencyError, match=r"ctx#7 .*not the engine's cuda:0 ctx#1 \(pid 222 on h\)"):
        gpu_slots.PeerSlotSender(r.endpoint(), engine=engine(ledger, 222))
    assert ledger.open_items("ipc_map", "imported_event") == {}
    ledger.current = PRIMARY
    r.close()


def test_a_mapping_read_back_in_another_context_is_refused(ledger, tmp_path, monkeypatch):
    """Where the engine reads current but the IPC mapping reports another context (what the sender's pointers
    would mean nothing in), the sender refuses after reading it back, and closes the mapping it made."""
    r = gpu_slots.PeerSlotReceiver("bm", 1 << 20, f"unix:{tmp_path}/bm.sock", engine=engine(ledger, 111), spin_us=0)
    real_open = cuda.ipc_open_mem

    def open_in_secondary(h, off):
        ledger.current = SECONDARY
        try:
            return real_open(h, off)
        finally:
            ledger.current = PRIMARY
    monkeypatch.setattr(cuda, "ipc_open_mem", open_in_secondary)
    with pytest.raises(ResidencyError, match=r"mapping of the slots landed in cuda:0 ctx#7 .*engine's cuda:0 ctx#1"):
        gpu_slots.PeerSlotSender(r.endpoint(), engine=engine(ledger, 222))
    assert ledger.open_items("ipc_map") == {}
    r.close()


def test_a_write_after_the_senders_detach_raises_channel_closed(ledger, tmp_path):
    """A halt may detach the sender under the loop's sending thread: the write then finds no mapping and ends with
    ChannelClosed, never an IndexError or a copy into an unmapped slot. (Before: self._maps[slot] -> IndexError.)"""
    r, s = _pair(ledger, tmp_path, "bw")
    s._detach()
    with pytest.raises(ChannelClosed, match="send on a closed boundary"):
        s._write(0, torch.zeros(4))
    s.close()
    r.close()


# -- halt, relink, stop on StageRunners (no Ray) ---------------------------------------------------------------------
def _runner(lg, index: int, pid: int) -> StageRunner:
    r = StageRunner()
    r.index = index
    r.engine = engine(lg, pid)
    r.spec = types.SimpleNamespace(intake=False)
    sc = types.SimpleNamespace(max_batch=2, max_context=64, prefill_chunk=4)
    r.placement = types.SimpleNamespace(scheduler=sc, timeouts=types.SimpleNamespace(step_s=60.0),
                                        transport_poll_us=0.0, name="ledger")
    r.plan = types.SimpleNamespace(stages=[0, 1])
    r.mc = types.SimpleNamespace(text=types.SimpleNamespace(vocab_size=32, hidden_size=16), eos_token_ids=[])
    r.dtype = torch.float32
    r.model = types.SimpleNamespace(graphs=None, new_cache=lambda *a: types.SimpleNamespace(grown=0))
    r.cache = types.SimpleNamespace(grown=0)
    return r


def _wired(lg, tmp_path, transport: str, run: str = "r0"):
    """Stage 0 (sender) -> stage 1 (receiver), as setup and connect wire them."""
    os.makedirs(tmp_path / run, exist_ok=True)
    up, down = _runner(lg, 0, 222), _runner(lg, 1, 111)
    ep = down.relink(str(tmp_path / run), transport)["endpoint"]
    t = threading.Thread(target=down.receiver.accept, args=(10,))
    t.start()
    up.sender = SlotSender(ep) if transport == "shm" else gpu_slots.SENDERS[transport](ep, engine=up.engine)
    up.sender.connect(10)
    t.join()
    return up, down


def _shm_names(rx) -> list[str]:
    return [s.name for s in rx._shms]


def test_a_halt_keeps_the_receivers_peer_slots_until_relink_after_the_sender_unmapped(ledger, tmp_path):
    """The supervisor halts every survivor at once; here the receiving stage's halt runs first, as it may. That
    halt must only close the receiver's channel (its slots and exported done events stay: the upstream sender may
    still map them, a copy queued); the sender's halt then unmaps; the receiver's slots are freed at the start of
    the next relink, after every cuIpcCloseMemHandle; the sender's exported ready events at its own relink or stop.
    (Before: the receiver's halt ran cuMemFree under the sender's live mapping: undefined behaviour in CUDA.)"""
    up, down = _wired(ledger, tmp_path, "peer")
    rx, tx = down.receiver, up.sender
    down.halt(0, "stage 0 is lost")         # the receiving side first
    assert len(ledger.live["alloc"]) == 2 and len(ledger.live["ipc_map"]) == 2 and "cuMemFree" not in ledger.log
    assert len(ledger.live["imported_event"]) == 2 and rx._ready == []    # its imports of the ready events went
    up.halt(1, "stage 1 is lost")
    assert ledger.live["ipc_map"] == {} and len(ledger.live["alloc"]) == 2     # unmapped; the slots still there
    assert ledger.live["imported_event"] == {} and len(ledger.live["event"]) == 4   # both ends' exports kept
    with pytest.raises(ChannelClosed):
        tx._write(0, torch.zeros(4))
    mark = len(ledger.log)
    os.makedirs(tmp_path / "r1")
    down.relink(str(tmp_path / "r1"), "peer")       # (the supervisor: after every halt returned)
    frees = [c for c in ledger.log[mark:] if c == "cuMemFree"]
    assert len(frees) == 2 and ledger.log.index("cuMemFree") > max(
        i for i, c in enumerate(ledger.log) if c == "cuIpcCloseMemHandle")
    assert rx._allocs == [] and down.receiver is not rx and len(ledger.live["alloc"]) == 2   # the new slots
    down.stop()
    up.stop()
    assert ledger.open_items() == {}, ledger.open_items()


def test_a_stage_stopped_after_a_halt_without_a_relink_frees_what_the_halt_kept(ledger, tmp_path):
    """A deployment shut down between halt and relink: stop() must free what the halts kept (the receiver's slots
    and done events, the sender's ready events). (Before: the halt freed the slots at once, whatever the order, and
    stop left the four imported events open.)"""
    up, down = _wired(ledger, tmp_path, "peer")
    up.halt(1, "stage 1 is lost")
    down.halt(0, "stage 0 is lost")
    assert ledger.live["alloc"] and ledger.live["event"]
    down.stop()
    up.stop()
    assert ledger.open_items() == {}, ledger.open_items()


def test_a_halt_keeps_the_shm_slots_mapped_but_unlinked_until_relink(ledger, tmp_path):
    """The CPU slots the same way: the receiving stage's halt unlinks its segments' names (a process killed before
    the relink leaves nothing in /dev/shm) but keeps its mappings; the upstream halt unmaps the sender's; the
    relink unmaps the old receiver's before it makes new segments; stop after that leaves nothing. (Before: the
    halt closed the receiver's mappings at once, so rx's first segment had no buffer after the halt.)"""
    up, down = _wired(ledger, tmp_path, "shm")
    rx, tx = down.receiver, up.sender
    names = _shm_names(rx)
    assert all(os.path.exists(f"/dev/shm/{n}") for n in names)
    down.halt(0, "stage 0 is lost")
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)
    assert rx._shms[0].buf is not None and tx._maps     # both ends still mapped: the receiver's slots kept
    up.halt(1, "stage 1 is lost")
    assert tx._maps == [] and rx._shms[0].buf is not None
    os.makedirs(tmp_path / "r1")
    down.relink(str(tmp_path / "r1"), "shm")
    assert all(s.buf is None for s in rx._shms) and down.receiver is not rx
    new = _shm_names(down.receiver)
    assert all(os.path.exists(f"/dev/shm/{n}") for n in new)
    down.stop()
    up.stop()
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names + new)


def test_a_shm_stage_stopped_after_a_halt_leaves_nothing(ledger, tmp_path):
    """shm: halt then stop, no relink: the mappings the halt kept are closed and no segment of the boundary
    remains. (Before: the halt closed the receiver's mappings at once: nothing was kept.)"""
    up, down = _wired(ledger, tmp_path, "shm")
    rx = down.receiver
    names = _shm_names(rx)
    down.halt(0, "stage 0 is lost")
    up.halt(1, "stage 1 is lost")
    assert rx._shms[0].buf is not None and not any(os.path.exists(f"/dev/shm/{n}") for n in names)
    down.stop()
    up.stop()
    assert all(s.buf is None for s in rx._shms) and down._halted == () and up._halted == ()
    assert not any(os.path.exists(f"/dev/shm/{n}") for n in names)
    assert glob.glob(f"/dev/shm/{names[0].rsplit('_', 2)[0]}*") == []


def test_a_halt_whose_loop_is_stuck_still_fails_and_keeps_the_receivers_slots(ledger, tmp_path):
    """A halt whose loop thread is still inside a step raises StageFailed (the supervisor restarts the stage) as
    before; the slots that thread may still read are kept, not freed under it."""
    up, down = _wired(ledger, tmp_path, "peer")
    from test_recovery import stuck_loop
    gate = threading.Event()
    down.loop = stuck_loop("memra-stage-1", gate)
    down.HALT_JOIN_S = 0.2
    try:
        with pytest.raises(StageFailed, match="memra-stage-1 was still inside a step"):
            down.halt(0, "stage 0 is lost")
    finally:
        gate.set()
    assert "cuMemFree" not in ledger.log and len(ledger.live["alloc"]) == 2
    up.stop()
    down.stop()
    assert ledger.open_items() == {}
