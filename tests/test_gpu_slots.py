"""GPU boundary slots between two spawned processes: bytes arrive bit-exact and in order, a held slot is never
overwritten, and an IPC pointer is refused in a foreign context; a halt frees the receiver's slots only after the
sender unmapped them, a slot end is refused when built under a foreign context, and a sender failing part way
closes what it opened. Needs a CUDA GPU: fails (never skips) without one."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))
from memra_pp import gpu_checks as gpu_probe  # noqa: E402
from memra_pp.stages.gpu_slots import probe_p2p  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _needs_gpu():
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (run it on the GPU machine: pytest -m gpu)"


@pytest.mark.parametrize("transport,same_gpu,fast,every", [("peer", False, True, False), ("host", False, True, False),
                                                           ("peer", True, True, False), ("peer", False, False, False),
                                                           ("peer", False, True, True)],
                         ids=["peer", "host", "peer-same-gpu", "peer-full-checks", "peer-every-header-on-socket"])
def test_slot_transport_moves_bytes_in_order(transport, same_gpu, fast, every):
    """Every handoff must arrive bit-exact and in order through both slots, and a third send must wait while the
    receiver holds both slots (no reuse before free). A foreign context current (peer), host memory and another
    context's memory must be refused with the engine named (the slots' fast checks; and the full ones, on the peer
    path), a refusal must leave the sender idle with nothing handed off, and the handoff after the refusals must
    arrive bit-exact (the last one the receiver checks). The headers go by the receiver's mailbox, and by the socket
    only while it sleeps there (every: by the socket too, the protocol before the mailbox's control words)."""
    src, dst = gpu_probe.devices()
    r = gpu_probe.slots(transport, src, src if same_gpu else dst, n=300, fast=fast, every=every)
    s, rv = r["sender"], r["receiver"]
    assert s.get("ok") and rv.get("ok"), r
    assert rv["bad"] == 0 and rv["in_order"] and sorted(set(rv["slots"])) == [0, 1], r
    assert s["blocked_while_held"] and s["waited_s"] >= gpu_probe.HOLD_S * 0.5, r
    assert s["stats"]["handoffs"] == 300 and rv["stats"]["handoffs"] == 300
    print(f"{transport} same_gpu={same_gpu}: cycle {s['cycle_us']} us, sender p50/p99 "
          f"{s['stats']['handoff_p50_us']}/{s['stats']['handoff_p99_us']} us, receiver p50/p99 "
          f"{rv['stats']['handoff_p50_us']}/{rv['stats']['handoff_p99_us']} us")
    assert s["fast_checks"] is fast, s
    st = s["stats"]
    assert st["mailbox_headers"] == 300 and st["late_headers"] == 0, st
    # the receiver polls its mailbox (GPU receivers do for 2 ms): most headers never touch the socket
    assert st["socket_headers"] == 300 if every else st["socket_headers"] < 150, st
    if transport == "peer":
        assert "an IPC pointer means nothing there" in s["wrong_ctx"], s
    for where in ("cpu", "secondary_ctx"):
        assert "compute it on the sender's engine" in s["wrong_source"][where], s
    assert " cpu ctx#" in s["wrong_source"]["cpu"] and s["refusals_sent_nothing"], s


def test_probe_p2p_copies_a_pattern():
    """probe_p2p must report a real pattern copy through the peer path."""
    src, dst = gpu_probe.devices()
    r = probe_p2p(src, dst, timeout=120)
    assert r["ok"], r


@pytest.mark.parametrize("fail_at", ["host_register", "event_create"])
def test_host_receiver_frees_what_a_failed_allocation_made(monkeypatch, fail_at):
    """A host receiver whose second slot fails part way (its pinned registration; its event, after the slot's
    device staging) must unregister and unlink everything the first slot and the failed one made: no segment of
    the boundary stays in /dev/shm, every registration is undone, and the allocation's own error is raised."""
    import glob

    from memra_pp import cuda
    from memra_pp.stages import gpu_slots

    real, calls = getattr(cuda, fail_at), {"n": 0, "unregistered": []}

    def flaky(*a, **k):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError(f"{fail_at} refused (test)")
        return real(*a, **k)

    real_unregister = cuda.host_unregister

    def unregister(addr):
        calls["unregistered"].append(addr)
        return real_unregister(addr)

    monkeypatch.setattr(cuda, fail_at, flaky)
    monkeypatch.setattr(cuda, "host_unregister", unregister)
    name = "leaktest_" + fail_at
    with pytest.raises(RuntimeError, match=f"{fail_at} refused"):
        gpu_slots.HostSlotReceiver(name, 1 << 20)
    assert calls["n"] == 2, calls        # the second slot's call is the one that failed
    assert len(calls["unregistered"]) == (1 if fail_at == "host_register" else 2), calls
    assert glob.glob(f"/dev/shm/mpp-*-host_{name}_*") == []
    r = gpu_slots.HostSlotReceiver(name, 1 << 20)     # and the next one is made and closed cleanly
    try:
        assert len(glob.glob(f"/dev/shm/mpp-*-host_{name}_*")) == 2
    finally:
        r.close()
    assert glob.glob(f"/dev/shm/mpp-*-host_{name}_*") == []


def test_host_receiver_close_frees_every_slot_when_one_name_is_already_gone():
    """The driver's unlink_shm may take a stage's segment names first (after a kill): closing the receiver then must
    still unlink the other slot's name and free every registration, not stop at the first missing name."""
    import glob

    from memra_pp.stages import gpu_slots
    from multiprocessing.shared_memory import SharedMemory
    name = "gonetest"
    r = gpu_slots.HostSlotReceiver(name, 1 << 20)
    first = sorted(glob.glob(f"/dev/shm/mpp-*-host_{name}_*"))
    assert len(first) == 2
    other = SharedMemory(name=first[0].split("/dev/shm/")[1])    # someone else unlinks the first slot's name
    other.unlink()
    other.close()
    r.close()
    assert glob.glob(f"/dev/shm/mpp-*-host_{name}_*") == [] and r._shms == [] and r._addrs == []


def test_halt_frees_the_receivers_slots_only_after_the_upstream_sender_unmapped():
    """The supervisor halts every survivor at once, so a receiving stage may halt while its upstream neighbour's
    copy into a slot is still queued (here behind a GPU sleep). The receiver's halt must keep its slots (freeing
    them under a live IPC mapping and a queued cuMemcpyDtoDAsync is undefined in CUDA); the sender's halt then
    waits for its copy and unmaps; the receiver frees its slots at the relink. Asserted: the copy was still queued
    when the receiver halted (the race is real), the slots survived that halt, the copy landed in the kept slot, the
    sender saw no error, and memory allocated after the free stays clean (no late write)."""
    import gpu_slot_teardown
    r = gpu_slot_teardown.halt_order(gpu_probe.devices()[0])
    s, h, rv = r.get("sender", {}), r.get("receiver_halt", {}), r.get("receiver", {})
    assert s.get("ok") and rv.get("ok") and "error" not in r, r
    assert s["busy_when_receiver_halted"] and s["halt_waited_s"] > 0.1, r    # the copy was queued across the halt
    assert h["kept_after_halt"] and h["ready_imports_after_halt"] == 0, r
    assert s["unmapped"] and rv["copy_landed_in_kept_slot"] and rv["fresh_clean"], r


@pytest.mark.parametrize("end", ["peer-receiver", "host-receiver", "peer-sender", "host-sender"])
def test_a_slot_end_built_under_a_foreign_context_is_refused(end):
    """Law 1: a slot end built while a non-primary context is current would allocate, open or register in it and
    name the engine's context: construction refuses, naming both contexts and the fix; nothing is made, and the
    same end builds under the engine's context with the engine's context as the slots' owner."""
    import os

    from memra_pp import cuda
    from memra_pp.engine import Engine
    from memra_pp.stages import gpu_slots
    eng = Engine("cuda:0")
    transport, side = end.split("-")
    ep = {"name": "fc", "transport": transport, "max_bytes": 1 << 20, "n_slots": 2, "address": "unix:/nonexistent",
          "owner": {"node": eng.ctx.node, "pid": os.getpid() + 1, "device": "cuda:0", "uid": eng.ctx.uid},
          "slots": [], "done_events": [], "shm": []}     # (the refusal comes before the endpoint is read)
    build = ((lambda: gpu_slots.RECEIVERS[transport]("fc", 1 << 20, engine=eng)) if side == "receiver" else
             (lambda: gpu_slots.SENDERS[transport](ep, engine=eng)))
    sec = cuda.create_secondary_context(0)
    try:
        sec_uid = cuda.context_uid(sec)
        with cuda.pushed(sec):
            assert cuda.context_uid(cuda.current_context()) == sec_uid != eng.ctx.uid
            msg = gpu_probe.refusal(build)
    finally:
        cuda.destroy_context(sec)
    assert f"this thread's current context is cuda:0 ctx#{sec_uid} (pid {os.getpid()}" in msg, msg
    assert f"not the engine's {eng.ctx}" in msg and "make the engine's context current (engine.make_current())" in msg
    if side == "receiver":
        with build() as r:      # the control: under the engine's context it builds, owned by the engine's
            assert r.endpoint()["owner"]["uid"] == eng.ctx.uid
            if transport == "peer":
                assert cuda.context_uid(cuda.pointer_context(r._allocs[0].ptr)) == eng.ctx.uid


def test_a_peer_sender_whose_second_ipc_open_fails_closes_the_first(monkeypatch):
    """A PeerSlotSender whose second cuIpcOpenMemHandle fails must close the first mapping before the constructor
    raises (it returns no object to close); the receiver's slots then open again in a fresh sender."""
    import gpu_slot_teardown

    from memra_pp import cuda
    from memra_pp.engine import Engine
    from memra_pp.stages.gpu_slots import PeerSlotSender
    ep, close = gpu_slot_teardown.endpoint_server(0)
    try:
        assert "error" not in ep, ep
        eng = Engine("cuda:0")
        real_open, real_close = cuda.ipc_open_mem, cuda.ipc_close_mem
        opened, closed = [], []

        def flaky_open(h, off):
            if len(opened) == 1:
                raise cuda.CudaError("cuIpcOpenMemHandle failed: refused by the test")
            opened.append(real_open(h, off))
            return opened[-1]

        def counted_close(base):
            real_close(base)
            closed.append(base)
        monkeypatch.setattr(cuda, "ipc_open_mem", flaky_open)
        monkeypatch.setattr(cuda, "ipc_close_mem", counted_close)
        with pytest.raises(cuda.CudaError, match="refused by the test"):
            PeerSlotSender(ep, engine=eng)
        assert len(opened) == 1 and closed == [opened[0][0]], (opened, closed)
        monkeypatch.setattr(cuda, "ipc_open_mem", real_open)
        with PeerSlotSender(ep, engine=eng) as s:       # the handles open again (nothing half-open left behind)
            assert len(s._maps) == 2
        assert len(closed) == 3
    finally:
        close()
