"""GPU boundary slots between two spawned processes: bytes arrive bit-exact and in order, a held slot is never
overwritten, and an IPC pointer is refused in a foreign context. Needs a CUDA GPU: fails (never skips) without one."""
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
