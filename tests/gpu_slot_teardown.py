"""Two-process scenarios of the peer slots' teardown for tests/test_gpu_slots.py (spawned children import this
module by name: tests/ is on their sys.path). Needs a CUDA GPU; both processes may share one (two contexts)."""
from __future__ import annotations

import multiprocessing as mp
import time
import traceback

import torch

from memra_pp.engine import Engine
from memra_pp.stages.gpu_slots import PeerSlotReceiver, PeerSlotSender, join_or_kill, probe_pattern

SLEEP_CYCLES = 3_000_000_000   # torch.cuda._sleep ahead of the sender's copy: about 1.5-2 s of GPU clock
NBYTES = 64 << 20


def _receiver(dev: int, conn, timeout: float) -> None:
    try:
        r = PeerSlotReceiver("halt-order", NBYTES, engine=Engine(f"cuda:{dev}"))
        conn.send(r.endpoint())
        r.accept(timeout)
        assert conn.poll(timeout) and conn.recv() == "halt"
        r.halt()                                # what a stage's halt does to its receiving side now
        kept = all(a.base != 0 for a in r._allocs) and len(r._allocs) == r.n_slots
        conn.send({"kept_after_halt": kept, "ready_imports_after_halt": len(r._ready)})
        assert conn.poll(timeout) and conn.recv() == "release"     # the sender's halt has returned
        landed = bool(torch.equal(r._bytes[0], probe_pattern(NBYTES, r._bytes[0].device, 3)))
        r.close()                               # the relink: cuMemFree of the slots
        fresh = torch.zeros(2 * NBYTES, dtype=torch.uint8, device=r.engine.device)   # likely the freed addresses
        torch.cuda.synchronize()
        time.sleep(0.5)                         # a late write by the sender's queued copy would land by now
        conn.send({"ok": True, "copy_landed_in_kept_slot": landed, "fresh_clean": int(fresh.count_nonzero()) == 0})
    except Exception:  # noqa: BLE001 - reported to the parent
        conn.send({"ok": False, "error": traceback.format_exc(limit=8)})


def _sender(dev: int, endpoint: dict, conn, timeout: float) -> None:
    try:
        eng = Engine(f"cuda:{dev}")
        s = PeerSlotSender(endpoint, engine=eng)
        s.connect(timeout)
        payload = probe_pattern(NBYTES, eng.device, 3)
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP_CYCLES)         # the copy below waits behind this on the sender's stream
        s.send({"kind": "probe", "mb": 0}, payload, timeout)
        conn.send("queued")
        assert conn.poll(timeout) and conn.recv() == "halt"     # the receiver has halted
        busy = not torch.cuda.current_stream(eng.device).query()   # the copy still queued: the race is real
        t0 = time.monotonic()
        s.halt()                                # synchronises the stream, then unmaps
        halt_s = time.monotonic() - t0
        torch.cuda.synchronize()                # no sticky error from the copy
        conn.send({"ok": True, "busy_when_receiver_halted": busy, "halt_waited_s": round(halt_s, 3),
                   "unmapped": s._maps == []})
        assert conn.poll(timeout) and conn.recv() == "bye"
        s.close()
    except Exception:  # noqa: BLE001
        conn.send({"ok": False, "error": traceback.format_exc(limit=8)})


def halt_order(dev: int = 0, timeout: float = 120.0) -> dict:
    """A peer boundary between two processes on `dev`, torn down as the supervisor's recovery now orders it: the
    receiver halts (channel only) while the sender's copy into its slot is still queued behind a GPU sleep; the
    sender's halt then synchronises and unmaps; only then does the receiver free its slots (the relink)."""
    ctx = mp.get_context("spawn")
    (rp, rc), (sp, sc) = ctx.Pipe(), ctx.Pipe()
    procs = [ctx.Process(target=_receiver, args=(dev, rc, timeout), daemon=True)]
    procs[0].start()
    out: dict = {}
    try:
        if not rp.poll(timeout):
            return {"error": "the receiver gave no endpoint"}
        ep = rp.recv()
        if "error" in ep:
            return {"receiver": ep}
        procs.append(ctx.Process(target=_sender, args=(dev, ep, sc, timeout), daemon=True))
        procs[1].start()
        for c, want, relay, to in ((sp, "queued", "halt", rp), (rp, None, "halt", sp), (sp, None, "release", rp)):
            if not c.poll(timeout):
                return {**out, "error": f"no answer waiting for {want or relay}"}
            got = c.recv()
            if isinstance(got, dict):
                out.setdefault("sender" if c is sp else "receiver_halt", got)
                if not got.get("ok", True):
                    return out
            elif got != want:
                return {**out, "error": f"expected {want!r}, got {got!r}"}
            to.send(relay)
        out["receiver"] = rp.recv() if rp.poll(timeout) else {"ok": False, "error": "no result (timeout)"}
        sp.send("bye")
        return out
    finally:
        join_or_kill(procs, 15)


def _endpoint_server(dev: int, conn, timeout: float) -> None:
    """A receiver whose endpoint an in-process sender attaches to (no connect): until the parent says close."""
    try:
        r = PeerSlotReceiver("attach-fail", 4 << 20, engine=Engine(f"cuda:{dev}"))
        conn.send(r.endpoint())
        conn.poll(timeout)
        r.close()
    except Exception:  # noqa: BLE001
        conn.send({"error": traceback.format_exc(limit=8)})


def endpoint_server(dev: int = 0, timeout: float = 120.0):
    """(endpoint, close): a peer receiver in a spawned process; close() ends it."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_endpoint_server, args=(dev, child, timeout), daemon=True)
    p.start()
    ep = parent.recv() if parent.poll(timeout) else {"error": "no endpoint"}

    def close():
        parent.send("close")
        join_or_kill([p], 15)
    return ep, close
