"""Stage faults on CPU deployments: kill each stage mid-decode, measure kill -> StageFailed at the caller
(detection) and kill -> dep.wait_ready() returning (recovery); with --replay, kill -> the interrupted request's
full result instead.

Run: .venv/bin/python benchmarks/faults.py [--stages 2 3] [--replay] [--heartbeat 0.5]
"""
from __future__ import annotations

import argparse
import os
import signal
import threading
import time

import ray

KILLS = ["ray.kill", "os._exit", "SIGKILL", "SIGSTOP"]


def kill(actor, how: str) -> None:
    if how == "ray.kill":
        ray.kill(actor)
    elif how == "os._exit":
        actor.__ray_call__.remote(lambda self: os._exit(3))
    else:
        pid = ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=30)
        os.kill(pid, signal.SIGKILL if how == "SIGKILL" else signal.SIGSTOP)


def one(dep, c, i: int, how: str) -> dict:
    got, end = [], {}

    def run():
        try:
            for ev in c.stream([5, 17, 42], max_new_tokens=48, timeout=120):
                got.extend(ev.token_ids)
            end["outcome"] = "completed"
        except Exception as e:  # noqa: BLE001 - the outcome is what is measured
            end["outcome"] = f"{type(e).__name__}(stage={getattr(e, 'stage', None)})"
        end["t"] = time.monotonic()
    th = threading.Thread(target=run, daemon=True)
    th.start()
    while len(got) < 3:
        time.sleep(0.005)
    t0 = time.monotonic()
    kill(dep.actors[i], how)
    th.join(120)
    dep.wait_ready(120)
    return {"stage": i, "kill": how, "outcome": end["outcome"], "tokens": len(got),
            "caller_s": end["t"] - t0, "ready_s": time.monotonic() - t0,
            "restart_s": dep.supervisor.log[-1].get("recovery_s")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--replay", action="store_true")
    ap.add_argument("--heartbeat", type=float, default=0.5)
    a = ap.parse_args()
    import memra_pp
    from memra_pp.defaults import ensure_tiny
    path = str(ensure_tiny())
    print(f"recover: {'replay' if a.replay else 'error'}, heartbeat_s {a.heartbeat}")
    print("stages stage kill      outcome                     tokens  kill->caller_s  kill->ready_s  restart_s")
    for n in a.stages:
        cfg = {"name": f"faults{n}", "model": {"path": path}, "recover": "replay" if a.replay else "error",
               "stages": [{"device": "cpu", "num_cpus": 0.1}] * n, "timeouts": {"heartbeat_s": a.heartbeat},
               "scheduler": {"max_batch": 8, "max_context": 256, "prefill_chunk": 16}}
        with memra_pp.launch(cfg) as dep:
            c = dep.client()
            for i in range(n):
                for how in KILLS[i % 2::2][:1] if n == 3 else KILLS[i::2]:
                    r = one(dep, c, i, how)
                    print(f"{n:6d} {r['stage']:5d} {r['kill']:9s} {r['outcome']:27s} {r['tokens']:6d} "
                          f"{r['caller_s']:15.2f} {r['ready_s']:14.2f} {r['restart_s']:10.2f}")


if __name__ == "__main__":
    main()
