"""Throughput against concurrency for 1, 2 and 3 CPU stages on the tiny model, measured in one run, with the Ray
actor call beside it; writes JSON and a PNG plot.

    .venv/bin/python benchmarks/cpu_scaling.py --out docs/results
"""
import argparse
import json
import os


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="docs/results")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--new", type=int, default=32)
    a = ap.parse_args()
    import memra_pp
    from memra_pp.bench import run_bench
    from memra_pp.defaults import TINY_PATH, ensure_tiny
    ensure_tiny()
    conc = [int(x) for x in a.concurrency.split(",")]
    runs = []
    for n in (1, 2, 3):
        cfg = {"name": f"scale{n}", "model": {"path": str(TINY_PATH)}, "stages": [{"device": "cpu"}] * n,
               "scheduler": {"max_batch": max(conc)}}
        with memra_pp.launch(cfg) as dep:
            for c in conc:
                r = run_bench(dep, c, 32, a.new)
                r["n_stages"] = n
                runs.append(r)
                print(f"{n} stage(s), {c:3d} concurrent: {r['tokens_per_s']:7.1f} tokens/s, busy "
                      + ", ".join(f"{s['busy']:.0%}" for s in r["stages"]), flush=True)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "cpu_scaling.json"), "w") as f:
        json.dump(runs, f, indent=1)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(6, 4))
    for n in (1, 2, 3):
        pts = [(r["concurrency"], r["tokens_per_s"]) for r in runs if r["n_stages"] == n]
        ax.plot(*zip(*pts), marker="o", label=f"memra_pp, {n} CPU stage{'s' if n > 1 else ''}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("tiny Qwen3.5, 2-core CPU box (32 in, %d out)" % a.new)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(a.out, "cpu_scaling.png"), dpi=110)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
