"""Many streams from one process, two ways side by side in one run: one client shared by every thread, and a client
made per request (as a server handling each request on its own does). Each round starts N streams at once and
reports their latency (submit to last token) p50 and max, and the intake's poll calls per round.

    .venv/bin/python benchmarks/many_clients.py --streams 128 --rounds 2
"""
import argparse
import json
import statistics
import threading
import time


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=128)
    ap.add_argument("--new", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=2, help="each way this many times, alternating")
    ap.add_argument("--json", default="", help="also write the figures here")
    a = ap.parse_args()
    import memra_pp
    from memra_pp.defaults import ensure_tiny
    cfg = {"name": "many-clients", "model": {"path": str(ensure_tiny())},
           "stages": [{"device": "cpu", "num_cpus": 0.5}] * 2,
           "scheduler": {"max_batch": a.streams, "max_context": 64 + a.new}}
    runs = []
    with memra_pp.launch(cfg) as dep:
        dep.client().generate([5, 6, 7], max_new_tokens=4)          # warm
        for mode in ["one client", "a client per request"] * a.rounds:
            shared, lat = dep.client(), []
            polls0 = dep.stats()["stages"][0].get("polls", 0)   # (0: a version without the counter)

            def one():
                c = shared if mode == "one client" else dep.client()
                t0 = time.monotonic()
                for _ in c.stream([5, 6, 7], max_new_tokens=a.new, ignore_eos=True):
                    pass
                lat.append(time.monotonic() - t0)
                if c is not shared:
                    c.close()
            ts = [threading.Thread(target=one) for _ in range(a.streams)]
            t0 = time.monotonic()
            for t in ts:
                t.start()
            for t in ts:
                t.join()
            r = {"mode": mode, "streams": a.streams, "wall_s": time.monotonic() - t0,
                 "latency_p50_s": statistics.median(lat), "latency_max_s": max(lat),
                 "polls": dep.stats()["stages"][0].get("polls", 0) - polls0}
            shared.close()
            runs.append(r)
            print(f"{mode}: {a.streams} streams of {a.new} tokens, wall {r['wall_s']:.2f} s, latency p50 "
                  f"{r['latency_p50_s']:.2f} s, max {r['latency_max_s']:.2f} s, intake polls {r['polls']}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"argv": vars(a), "date": time.strftime("%Y-%m-%d %H:%M"), "runs": runs}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
