"""`memra-pp bench CONFIG`: throughput, request latency, per-stage busy fraction and slot handoff latency under
concurrent load, next to a Ray actor call round trip measured in the same run (driver side)."""
from __future__ import annotations

import asyncio
import json
import random
import time


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def actor_call_us(actor, n: int = 200) -> tuple[float, float]:
    """p50/p99 of a no-op Ray actor call round trip (what a per-microbatch control call would cost)."""
    import ray
    ray.get(actor.ping.remote(), timeout=30)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        ray.get(actor.ping.remote(), timeout=30)
        ts.append((time.perf_counter() - t) * 1e6)
    return _pct(ts, 0.5), _pct(ts, 0.99)


def run_bench(dep, concurrency: int, prompt_len: int, max_new_tokens: int, seed: int = 0) -> dict:
    c = dep.client()
    rng = random.Random(seed)
    V = dep.vocab_size
    prompts = [[rng.randrange(4, V) for _ in range(prompt_len)] for _ in range(concurrency)]
    c.generate(prompts[0][:8], max_new_tokens=2)                       # warm up every stage
    p50, p99 = actor_call_us(dep.stage_actor(0))

    async def one(p):
        t = time.perf_counter()
        r = await c.agenerate(p, max_new_tokens=max_new_tokens, stop_token_ids=[])
        return r, time.perf_counter() - t

    async def all_():
        return await asyncio.gather(*[one(p) for p in prompts])

    dep.stats(reset=True)
    t0 = time.perf_counter()
    out = asyncio.run(all_())
    wall = time.perf_counter() - t0
    st = dep.stats()["stages"]
    toks = sum(len(r.token_ids) for r, _ in out)
    lat = [d for _, d in out]
    c.close()
    return {"concurrency": concurrency, "prompt_len": prompt_len, "max_new_tokens": max_new_tokens,
            "generated_tokens": toks, "wall_s": wall, "tokens_per_s": toks / wall,
            "request_latency_p50_s": _pct(lat, 0.5), "request_latency_p99_s": _pct(lat, 0.99),
            "ray_actor_call_p50_us": p50, "ray_actor_call_p99_us": p99,
            "stages": [{k: s[k] for k in ("index", "device", "layers", "busy", "microbatches", "handoffs",
                                          "handoff_p50_us", "handoff_p99_us")} for s in st]}


def format_report(r: dict) -> str:
    lines = [f"{r['concurrency']} concurrent x ({r['prompt_len']} in, {r['max_new_tokens']} out): "
             f"{r['generated_tokens']} tokens in {r['wall_s']:.2f} s = {r['tokens_per_s']:.1f} tokens/s; "
             f"request latency p50 {r['request_latency_p50_s']:.2f} s, p99 {r['request_latency_p99_s']:.2f} s",
             f"Ray actor call round trip (same run): p50 {r['ray_actor_call_p50_us']:.0f} us, "
             f"p99 {r['ray_actor_call_p99_us']:.0f} us",
             f"{'stage':>5} {'device':>8} {'layers':>9} {'busy':>6} {'microbatches':>12} {'handoffs':>9} "
             f"{'handoff p50 us':>15} {'p99 us':>8}"]
    for s in r["stages"]:
        lines.append(f"{s['index']:>5} {s['device']:>8} {str(tuple(s['layers'])):>9} {s['busy']:>6.1%} "
                     f"{s['microbatches']:>12} {s['handoffs']:>9} {s['handoff_p50_us'] or 0:>15.1f} "
                     f"{s['handoff_p99_us'] or 0:>8.1f}")
    return "\n".join(lines)


def main(args) -> int:
    import memra_pp
    print(f"launching {args.config} ...", flush=True)
    dep = memra_pp.launch(args.config)
    try:
        print(f"running {args.concurrency} concurrent requests ...", flush=True)
        r = run_bench(dep, args.concurrency, args.prompt_len, args.max_new_tokens)
    finally:
        dep.shutdown()
    r["config"] = str(args.config)
    print(json.dumps(r, indent=1) if args.json else format_report(r))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(r, f, indent=1)
    return 0
