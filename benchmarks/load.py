"""Load on a 2-CPU-stage deployment: rounds of N concurrent requests (short prompts, few tokens), with throughput,
per-request latency p50/p99 and each stage process's RSS after every round.

Run: .venv/bin/python benchmarks/load.py [--requests 500] [--rounds 5] [--new 4] [--json]
(the embedded tiny checkpoint, written on first use; --model PATH for another checkpoint directory).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import time


def prompts(n: int, distinct: int = 50) -> list[list[int]]:
    """n short prompts, `distinct` different ones cycled (1-6 tokens, ids well inside any tiny vocabulary)."""
    base = [[(7 * k + 3 * j) % 200 + 1 for j in range(1 + k % 6)] for k in range(distinct)]
    return [base[i % distinct] for i in range(n)]


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[max(0, math.ceil(q * len(s)) - 1)]


async def _round(c, ps: list[list[int]], new: int):
    async def one(p):
        t = time.monotonic()
        r = await c.agenerate(p, max_new_tokens=new, timeout=300)
        return r, time.monotonic() - t
    return await asyncio.gather(*[one(p) for p in ps])


def run_round(dep, c, ps: list[list[int]], new: int) -> dict:
    """All of ps at once; the results in order and the round's figures (stage RSS read after the round)."""
    t0 = time.monotonic()
    out = asyncio.run(_round(c, ps, new))
    wall = time.monotonic() - t0
    lat = [x[1] for x in out]
    rss = [s["rss_bytes"] for s in dep.stats()["stages"]]
    toks = sum(len(r.token_ids) for r, _ in out)
    return {"results": [r for r, _ in out], "wall_s": wall, "req_per_s": len(ps) / wall, "tok_per_s": toks / wall,
            "p50_s": pct(lat, 0.5), "p99_s": pct(lat, 0.99), "rss_mib": [x / 2**20 for x in rss]}


def config(path: str, max_batch: int = 32) -> dict:
    return {"name": "load", "model": {"path": path}, "stages": [{"device": "cpu", "num_cpus": 0.1}] * 2,
            "scheduler": {"max_batch": max_batch, "max_context": 64, "prefill_chunk": 256}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--new", type=int, default=4)
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--model", default=None)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    import memra_pp
    from memra_pp.defaults import ensure_tiny
    path = a.model or str(ensure_tiny())
    ps = prompts(a.requests)
    rows = []
    with memra_pp.launch(config(path, a.max_batch)) as dep:
        c = dep.client()
        solo = {tuple(p): c.generate(p, max_new_tokens=a.new).token_ids for p in ps[:50]}
        for k in range(a.rounds):
            r = run_round(dep, c, ps, a.new)
            bad = sum(res.token_ids != solo[tuple(p)] for p, res in zip(ps, r.pop("results")))
            rows.append(dict(r, round=k, mismatches=bad))
    if a.json:
        print(json.dumps(rows, indent=1))
        return
    print(f"{a.requests} concurrent requests x {a.rounds} rounds, {a.new} new tokens each, 2 CPU stages")
    print("round  wall_s  req/s  tok/s  p50_s  p99_s  mismatches  stage RSS MiB")
    for r in rows:
        print(f"{r['round']:5d} {r['wall_s']:7.2f} {r['req_per_s']:6.1f} {r['tok_per_s']:6.1f} {r['p50_s']:6.2f} "
              f"{r['p99_s']:6.2f} {r['mismatches']:11d}  {' '.join(f'{x:.1f}' for x in r['rss_mib'])}")


if __name__ == "__main__":
    main()
