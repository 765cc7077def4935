"""Throughput of a mixed-adapter batch (adapter A, adapter B, none) against a no-adapter batch, side by side on
one deployment (two CPU stages, the tiny test model with PEFT adapters on every projection).

    .venv/bin/python benchmarks/adapters_bench.py [--concurrency 32] [--new 32] [--rounds 3]
"""
import argparse
import asyncio
import random
import sys
import time

sys.path.insert(0, "tests")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--new", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    import memra_pp
    from conftest_models import tiny_checkpoint
    from test_adapters import adapter
    _, path = tiny_checkpoint("dense", False)
    cfg = {"name": "adbench", "model": {"path": str(path)}, "stages": [{"device": "cpu"}] * 2,
           "adapters": {"max_loras": 2, "max_rank": 8}, "scheduler": {"max_batch": a.concurrency}}
    rng = random.Random(0)
    prompts = [[rng.randrange(4, 300) for _ in range(16)] for _ in range(a.concurrency)]
    with memra_pp.launch(cfg) as dep:
        dep.load_adapter("a", adapter("dense", False, "A")[1])
        dep.load_adapter("b", adapter("dense", False, "B")[1])
        c = dep.client()

        async def batch(names):
            return await asyncio.gather(*[c.agenerate(p, max_new_tokens=a.new, ignore_eos=True, adapter=n)
                                          for p, n in zip(prompts, names)])
        plans = {"no adapter": [None] * a.concurrency,
                 "mixed (A, B, none)": [["a", "b", None][i % 3] for i in range(a.concurrency)]}
        asyncio.run(batch(plans["mixed (A, B, none)"]))     # warm up
        rates = {k: [] for k in plans}
        for _ in range(a.rounds):
            for k, names in plans.items():
                t = time.perf_counter()
                rs = asyncio.run(batch(names))
                rates[k].append(sum(len(r.token_ids) for r in rs) / (time.perf_counter() - t))
    best = {k: max(v) for k, v in rates.items()}
    for k, v in best.items():
        print(f"{k:20s} {v:8.1f} tokens/s (best of {a.rounds}; all: {', '.join(f'{x:.0f}' for x in rates[k])})")
    print(f"mixed / none = {best['mixed (A, B, none)'] / best['no adapter']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
