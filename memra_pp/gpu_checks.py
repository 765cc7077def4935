"""Every GPU-side check of engine, overlay and gpu_slots: the scenario functions the battery runs inside live stage
processes and tests/test_gpu_*.py assert on; `python -u -m memra_pp.gpu_checks --out DIR` runs them all standalone.
"""
from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import pickle
import signal
import sys
import time
import traceback
import types
from concurrent.futures import ProcessPoolExecutor

import torch

from memra_pp import cpu_pinning, cuda, cuda_views, handoff_probe
from memra_pp.engine import ContextId, Engine, EngineCounters, residency_of
from memra_pp.errors import ResidencyError
from memra_pp.overlay import EmbedOverlay, TokenOverlay, TokenOverlaySet, overlay_publications, publish_out
from memra_pp.stages.gpu_slots import RECEIVERS, SENDERS, join_or_kill, probe_p2p, probe_pattern

HOLD_S = 1.5  # the receiver holds both slots this long: a third send must block, not overwrite


def devices() -> tuple[int, int]:
    """(src, dst): two GPUs when there are two, else both on GPU 0 (two processes = two contexts still)."""
    return 0, (1 if torch.cuda.device_count() > 1 else 0)


def refusal(fn) -> str:
    """The ResidencyError message `fn` raised, or 'NOT REFUSED'."""
    try:
        fn()
    except ResidencyError as e:
        return str(e)
    return "NOT REFUSED"


# -- in-process scenarios -------------------------------------------------------------------------------------------
def primary_context(dev: int = 0) -> dict:
    a, b = Engine(f"cuda:{dev}"), Engine(f"cuda:{dev}")
    t = torch.ones(1000, device=f"cuda:{dev}")
    return {"ctx": str(a.ctx), "two_engines_one_ctx": a.ctx == b.ctx,
            "current_is_primary": cuda.context_uid(cuda.current_context()) == a.ctx.uid,
            "torch_tensor_resident": residency_of(t, a) == a.ctx,
            "cpu_tensor_not_resident": residency_of(t.cpu(), a) != a.ctx,
            "owns_torch_tensor": a.owns(t) and b.owns(t), "owns_no_cpu_tensor": not a.owns(t.cpu()),
            "is_current": a.is_current()}


def _wrap_secondary(ptr: int, nbytes: int, dev: int):
    try:
        return cuda_views.dlpack_bytes(ptr, nbytes, 2, dev), "dlpack"
    except Exception as e:  # noqa: BLE001 - fall back, and say which way worked
        first = f"{type(e).__name__}: {e}"
    try:
        return cuda_views.device_bytes(ptr, nbytes, dev), f"cuda_array_interface (dlpack failed: {first})"
    except Exception as e:  # noqa: BLE001
        raise RuntimeError(f"cannot wrap secondary-context memory: dlpack: {first}; CAI: {e}") from e


def secondary_context(dev: int = 0) -> dict:
    eng = Engine(f"cuda:{dev}")
    sec = cuda.create_secondary_context(dev)
    N, H = 8, 16
    with cuda.pushed(sec):
        alloc = cuda.mem_alloc_2mib(N * H * 4)
    try:
        raw, how = _wrap_secondary(alloc.ptr, N * H * 4, dev)
        rows = raw.view(torch.float32).view(N, H)
        real = residency_of(rows, eng)
        spans = [(0, 0, N)]
        stub = types.SimpleNamespace(ctx=real, is_cuda=True, device=eng.device, counters=EngineCounters())
        emb = torch.zeros(N, H, device=eng.device)
        ov = EmbedOverlay(stub, rows, spans)  # honest: the rows do live in the secondary context
        with cuda.pushed(sec):
            current_in_sec = eng.is_current()
        out = {"wrapped_by": how, "secondary_ctx": str(real), "differs": real != eng.ctx,
               "owned": eng.owns(rows), "is_current_under_secondary": current_in_sec,
               "uid_is_secondary": real.uid == cuda.context_uid(sec), "current_restored":
               cuda.context_uid(cuda.current_context()) == eng.ctx.uid,
               "construct": refusal(lambda: EmbedOverlay(eng, rows, spans)),
               "splice": refusal(lambda: ov.splice_into(eng, emb, 0)),
               "publish_source": refusal(lambda: publish_out(eng, rows, spans)),
               # the consumer's other doors: a token overlay's rows, and a splice *into* that context's memory
               "token_overlay": refusal(lambda: TokenOverlaySet.from_slots(
                   eng, {0: TokenOverlay(N, torch.arange(1, device=eng.device), rows[:1])}, 1, False)),
               "splice_target": refusal(lambda: EmbedOverlay(eng, torch.ones(N, H, device=eng.device), spans)
                                        .splice_into(eng, rows, 0)),
               "splice_wrote_nothing": bool(emb.abs().sum().item() == 0), "splices": eng.counters.splices}
        ov = rows = raw = None      # no reference to the secondary context's memory before it is freed
    finally:
        with cuda.pushed(sec):
            alloc.free()
        cuda.destroy_context(sec)
    out["torch_still_works"] = float(torch.ones(4, device=eng.device).sum().item()) == 4.0
    return out


def publication(src: int, dst: int) -> dict:
    tower = Engine(f"cuda:{src}") if src != dst else Engine("cpu")  # one GPU: a CPU tower is another context
    intake = Engine(f"cuda:{dst}")
    bits = torch.randint(-2**15, 2**15, (9, 64), dtype=torch.int16)
    bits[0, 0] = 0x7FC1  # NaN payload survives a host bounce
    rows = bits.view(torch.bfloat16).to(tower.device)
    c0 = overlay_publications()
    same = EmbedOverlay.new_published(intake, intake, "auto", bits.view(torch.bfloat16).to(intake.device), [(0, 0, 9)])
    c1 = overlay_publications()
    across = EmbedOverlay.new_published(tower, intake, "auto", rows, [(3, 0, 9)])
    c2 = overlay_publications()
    forced = EmbedOverlay.new_published(intake, intake, "force", same.rows, [(0, 0, 9)])
    c3 = overlay_publications()
    return {"tower": str(tower.ctx), "intake": str(intake.ctx), "auto_same_ctx_published": c1 - c0,
            "auto_across_published": c2 - c1, "force_published": c3 - c2,
            "across_bit_exact": torch.equal(across.rows.view(torch.int16).cpu(), bits),
            "forced_bit_exact": torch.equal(forced.rows.view(torch.int16).cpu(), bits),
            "across_resident_in_intake": across.resident_in(intake) and residency_of(across.rows, intake) == intake.ctx,
            "wrong_engine_refused": refusal(lambda: EmbedOverlay(tower, across.rows, [(0, 0, 1)]))}


# -- two-process scenarios ------------------------------------------------------------------------------------------
def _child_overlay(dev: int) -> tuple:
    e = Engine(f"cuda:{dev}")
    ov = EmbedOverlay(e, torch.ones(4, 8, device=e.device), [(0, 0, 4)])
    return e.ctx, int(cuda.current_context()), pickle.dumps(ov)


def two_processes(dev: int = 0) -> dict:
    eng = Engine(f"cuda:{dev}")
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn")) as ex:
        theirs, their_handle, blob = ex.submit(_child_overlay, dev).result(timeout=180)
    ov = pickle.loads(blob)  # the rows are rebuilt here, the carried context still names the child
    forged = ContextId(eng.ctx.node, theirs.pid, eng.ctx.device, eng.ctx.uid)
    return {"mine": str(eng.ctx), "theirs": str(theirs), "differ": theirs != eng.ctx,
            "same_uid_value": theirs.uid == eng.ctx.uid,
            "same_handle_value": their_handle == int(cuda.current_context()),
            "forged_equal_uid_not_local": not forged.is_local() and forged != eng.ctx,
            "pickled_overlay": refusal(lambda: ov.require_resident(eng)),
            "pickled_splice": refusal(lambda: ov.splice_into(eng, torch.zeros(4, 8, device=eng.device), 0))}


def _payload(i: int, shape, device) -> torch.Tensor:
    return probe_pattern(math.prod(shape) * 2, device, i).view(torch.bfloat16).view(shape)


def _slot_receiver(transport, dev, max_bytes, n, conn, timeout, fast=True, cpus=None):
    try:
        cpu_pinning.pin_process(cpus)
        r = RECEIVERS[transport]("probe", max_bytes, engine=Engine(f"cuda:{dev}"), fast_checks=fast)
        conn.send(r.endpoint())
        r.accept(timeout)
        bad, seqs, slots, held = 0, [], [], []
        for i in range(n):
            hdr, view = r.recv(timeout)
            seqs.append(hdr["seq"])
            slots.append(hdr["slot"])
            raw = view.reshape(-1).view(torch.uint8)
            bad += not torch.equal(raw, probe_pattern(raw.numel(), raw.device, hdr["seq"]))
            del view, raw
            if i < 2:  # hold the first two slots: the sender's third send must wait for a free
                held.append(hdr["slot"])
                if i == 1:
                    time.sleep(HOLD_S)
                    for k in held:
                        r.free(k)
            else:
                r.free(hdr["slot"])
        conn.send({"ok": True, "bad": bad, "in_order": seqs == list(range(n)), "slots": slots[:6],
                   "cpus": sorted(os.sched_getaffinity(0)), "stats": r.stats()})
        conn.poll(timeout)  # the sender unmaps before the slots are freed
        r.close()
    except Exception:  # noqa: BLE001 - reported to the parent
        conn.send({"ok": False, "error": traceback.format_exc(limit=6)})


def _refusals(s, transport, dev, hdr, payload, timeout) -> dict:
    """An idle sender's refusals: a foreign context current (peer slots), a source in host memory, one in another
    context's device memory; and whether they left it idle with nothing handed off."""
    before = s.stats()["handoffs"]
    out = {"wrong_ctx": "n/a (host)"}
    sec = cuda.create_secondary_context(dev)
    try:
        if transport == "peer":
            with cuda.pushed(sec):
                out["wrong_ctx"] = refusal(lambda: s.send(hdr, payload, timeout))
        nbytes = payload.numel() * payload.element_size()
        with cuda.pushed(sec):
            alloc = cuda.mem_alloc_2mib(nbytes)
        try:
            foreign = _wrap_secondary(alloc.ptr, nbytes, dev)[0].view(payload.dtype).view(payload.shape)
            out["wrong_source"] = {"cpu": refusal(lambda t=payload.cpu(): s.send(hdr, t, timeout)),
                                   "secondary_ctx": refusal(lambda t=foreign: s.send(hdr, t, timeout))}
            del foreign     # before its memory goes
        finally:
            with cuda.pushed(sec):
                alloc.free()
    finally:
        cuda.destroy_context(sec)
    out["refusals_sent_nothing"] = s.idle() and s.stats()["handoffs"] == before
    return out


def _slot_sender(transport, dev, endpoint, n, shape, conn, timeout, fast=True, split=False, cpus=None,
                 every=False):
    calls = handoff_probe.split_sender_calls() if split else None
    try:
        cpu_pinning.pin_process(cpus)
        eng = Engine(f"cuda:{dev}")
        s = SENDERS[transport](endpoint, engine=eng, fast_checks=fast, every_frame_on_socket=every)
        s.connect(timeout)
        hdr = {"kind": "probe", "mb": 0}
        s.send(dict(hdr, seq=0), _payload(0, shape, eng.device), timeout)
        s.send(dict(hdr, seq=1), _payload(1, shape, eng.device), timeout)
        p2, t = _payload(2, shape, eng.device), time.monotonic()
        try:
            s.send(dict(hdr, seq=2), p2, 0.3)
            blocked = False
        except TimeoutError:
            blocked = True
        s.send(dict(hdr, seq=2), p2, timeout)
        waited = time.monotonic() - t
        payloads = [_payload(i, shape, eng.device) for i in range(3, n)]
        t0 = time.monotonic()
        for i, p in enumerate(payloads[:-1], start=3):
            s.send(dict(hdr, seq=i), p, timeout)
        s.drain(timeout)
        cycle_us = (time.monotonic() - t0) / max(n - 4, 1) * 1e6
        split_us = {k: round(ns / 1e3 / max(c, 1), 2) for k, (ns, c) in calls.items()} if split else None
        refused = _refusals(s, transport, dev, dict(hdr, seq=n - 1), payloads[-1], timeout)
        s.send(dict(hdr, seq=n - 1), payloads[-1], timeout)     # the last handoff after them: the receiver checks it
        s.drain(timeout)
        stats = s.stats()
        s.close()
        conn.send({"ok": True, "blocked_while_held": blocked, "waited_s": round(waited, 3),
                   "cycle_us": round(cycle_us, 1), **refused, "fast_checks": s.fast_checks, "split_us": split_us,
                   "cpus": sorted(os.sched_getaffinity(0)), "stats": stats})
    except Exception:  # noqa: BLE001
        conn.send({"ok": False, "error": traceback.format_exc(limit=6)})


def slots(transport: str, src: int, dst: int, n: int = 500, shape=(64, 5120), timeout: float = 120.0,
          fast: bool = True, split: bool = False, pin: str = "none", every: bool = False) -> dict:
    """n handoffs of `shape` bf16 from a process on src to one on dst, the last after the sender's refusals (a
    foreign context current; a source it does not own); the sender's stats and, with split, its per-call times.
    fast: the slots' fast_checks in both processes; pin: where the two processes run (cpu_pinning.probe_pair);
    every: the sender writes every header to the socket too (the protocol before the mailbox's control words)."""
    rcpus, scpus = cpu_pinning.probe_pair(pin)
    ctx = mp.get_context("spawn")
    (rp, rc), (sp, sc) = ctx.Pipe(), ctx.Pipe()
    max_bytes = math.prod(shape) * 2
    procs = [ctx.Process(target=_slot_receiver, args=(transport, dst, max_bytes, n, rc, timeout, fast, rcpus),
                        daemon=True)]
    procs[0].start()
    try:
        if not rp.poll(timeout):
            return {"ok": False, "error": "receiver gave no endpoint"}
        ep = rp.recv()
        if "error" in ep:
            return {"receiver": ep}
        procs.append(ctx.Process(target=_slot_sender, args=(transport, src, ep, n, shape, sc, timeout, fast, split,
                                                                 scpus, every), daemon=True))
        procs[1].start()
        out = {}
        for name, c in (("sender", sp), ("receiver", rp)):
            out[name] = c.recv() if c.poll(timeout * 2) else {"ok": False, "error": "no result (timeout)"}
        rp.send("close")
        return out
    finally:
        join_or_kill(procs, 15)


def raw_copies(src: int, dst: int, shape=(64, 5120), n: int = 500) -> dict:
    """What the payload alone costs, to set beside the handoff figures: a peer copy src -> dst, and the host path's
    d2h into pinned memory + h2d out of it; device time (CUDA events) and host time (issue + synchronize)."""
    a = torch.randn(shape, device=f"cuda:{src}").to(torch.bfloat16)
    b = torch.empty(shape, dtype=torch.bfloat16, device=f"cuda:{dst}")
    pinned = torch.empty(shape, dtype=torch.bfloat16, pin_memory=True)

    def timed(fn, dev):
        ev, host = [], []
        for i in range(n + 20):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t = time.perf_counter()
            with torch.cuda.device(dev):
                e0.record()
                fn()
                e1.record()
                e1.synchronize()
            if i >= 20:
                host.append((time.perf_counter() - t) * 1e6)
                ev.append(e0.elapsed_time(e1) * 1e3)
        ev.sort()
        host.sort()
        return {"device_p50_us": round(ev[n // 2], 2), "device_p99_us": round(ev[int(n * 0.99)], 2),
                "host_p50_us": round(host[n // 2], 2), "host_p99_us": round(host[int(n * 0.99)], 2)}

    out = {"bytes": a.numel() * 2, "peer_copy": timed(lambda: b.copy_(a, non_blocking=True), src),
           "d2h_pinned": timed(lambda: pinned.copy_(a, non_blocking=True), src),
           "h2d_pinned": timed(lambda: b.copy_(pinned, non_blocking=True), dst)}
    out["ok"] = bool(torch.equal(b.cpu(), a.cpu()))
    return out


# -- the standalone run ---------------------------------------------------------------------------------------------
def _short(obj):
    """The table shows a traceback's last line; the JSON keeps it whole."""
    if isinstance(obj, dict):
        return {k: _short(v) for k, v in obj.items()}
    if isinstance(obj, str) and obj.startswith("Traceback"):
        return obj.strip().splitlines()[-1]
    return obj


def _alarm(signum, frame):
    raise TimeoutError("scenario exceeded its time limit")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--handoffs", type=int, default=2000)
    ap.add_argument("--limit-s", type=int, default=240, help="per scenario")
    ap.add_argument("--handoff-checks", type=int, default=0, metavar="N",
                    help="also N interleaved pairs of peer handoffs with the sender's full and fast context checks "
                         "(the slots' fast_checks off / on), then one pair with every call of the send path timed")
    ap.add_argument("--pin", type=int, default=0, metavar="N",
                    help="also N interleaved rounds of same-GPU peer handoffs (fast checks) with the two processes "
                         "where the scheduler puts them, on disjoint physical cores, and on one core's two "
                         "hyperthreads (pin_none_i, pin_apart_i, pin_siblings_i)")
    ap.add_argument("--socket-pairs", type=int, default=0, metavar="N",
                    help="also N interleaved pairs of peer handoffs with every header on the socket too (sock_every_i) "
                         "and with the socket only where the receiver sleeps in it (sock_skip_i, the default path)")
    ap.add_argument("--only", default="", help="comma-separated scenario name prefixes to run (default: all)")
    ap.add_argument("--plot-from", default="", metavar="JSON",
                    help="only draw handoff_split.png into --out from a gpu_probe.json written with --handoff-checks")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    if args.plot_from:
        with open(args.plot_from) as f:
            drawn = handoff_probe.plot_split(json.load(f), os.path.join(args.out, "handoff_split.png"))
        print("handoff_split.png" if drawn else f"{args.plot_from} has no checks_split_* results", flush=True)
        return 0 if drawn else 1
    if not torch.cuda.is_available():
        print("gpu_probe needs a CUDA GPU: torch.cuda.is_available() is False", flush=True)
        return 2
    src, dst = devices()
    print(f"torch {torch.__version__}, {torch.cuda.device_count()} GPU(s); src cuda:{src}, dst cuda:{dst}", flush=True)
    scenarios = [("primary_context", lambda: primary_context(src)),
                 ("secondary_context", lambda: secondary_context(src)),
                 ("publication", lambda: publication(src, dst)), ("two_processes", lambda: two_processes(src)),
                 ("probe_p2p", lambda: probe_p2p(src, dst)), ("raw_copies", lambda: raw_copies(src, dst)),
                 ("host_calls", lambda: handoff_probe.host_calls(src)),
                 ("slots_peer", lambda: slots("peer", src, dst, args.handoffs)),
                 ("slots_host", lambda: slots("host", src, dst, args.handoffs)),
                 ("slots_peer_same_gpu", lambda: slots("peer", src, src, args.handoffs))]
    for i in range(args.handoff_checks):
        for mode, fast in (("full", False), ("fast", True)):
            scenarios.append((f"checks_{mode}_{i}",
                              lambda fast=fast: slots("peer", src, dst, args.handoffs, fast=fast)))
    if args.handoff_checks:
        for mode, fast in (("full", False), ("fast", True)):
            scenarios.append((f"checks_split_{mode}",
                              lambda fast=fast: slots("peer", src, dst, args.handoffs, fast=fast, split=True)))
    pins = ("none", "apart", "siblings")
    for i in range(args.pin):       # the order turns each round: a run's first scenario pays for its start
        for pin in pins[i % 3:] + pins[:i % 3]:
            scenarios.append((f"pin_{pin}_{i}", lambda pin=pin: slots("peer", src, src, args.handoffs, pin=pin)))
    for i in range(args.socket_pairs):     # the order turns each round, as for --pin
        for mode in (("every", "skip") if i % 2 == 0 else ("skip", "every")):
            scenarios.append((f"sock_{mode}_{i}",
                              lambda every=mode == "every": slots("peer", src, dst, args.handoffs, every=every)))
    if args.only:
        scenarios = [(n, f) for n, f in scenarios if n.startswith(tuple(args.only.split(",")))]
    signal.signal(signal.SIGALRM, _alarm)
    results = {}
    for name, fn in scenarios:
        t0 = time.monotonic()
        signal.alarm(args.limit_s)
        try:
            results[name] = fn()
        except Exception:  # noqa: BLE001 - one failing scenario must not hide the others
            results[name] = {"ok": False, "error": traceback.format_exc(limit=8)}
        finally:
            signal.alarm(0)
        line = json.dumps(_short(results[name]), default=str)
        print(f"{name:<22} {time.monotonic() - t0:6.1f}s  {line[:1500]}", flush=True)
    for name, r in results.items():
        if name.startswith(("checks_", "pin_", "sock_")) and r.get("sender", {}).get("ok"):
            st, split = r["sender"]["stats"], r["sender"].get("split_us")
            rst = r.get("receiver", {}).get("stats", {})
            print(f"{name:<22} sender p50 {st['handoff_p50_us']:7.1f} us  p99 {st['handoff_p99_us']:7.1f}  write "
                  f"{st.get('write_us_mean', 0):6.1f}  header {st.get('header_us_mean', 0):6.1f}  receiver p50 "
                  f"{rst.get('handoff_p50_us', float('nan')):7.1f}  headers on the socket "
                  f"{st.get('socket_headers')}" + (f"  calls {split}" if split else ""),
                  flush=True)
    with open(os.path.join(args.out, "gpu_probe.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    try:
        handoff_probe.plot_split(results, os.path.join(args.out, "handoff_split.png"))
    except ImportError as e:       # matplotlib is the test extra's: the JSON above has every figure
        print(f"no handoff_split.png: {e}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
