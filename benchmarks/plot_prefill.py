"""Prefill throughput of each way gpu_engine_step.py --prefill-torch / --prefill-varlen timed side by side in one run
("torch": the norms and conv as torch ops; "s23": the kernels without the merged path; "kernels": as it is;
"groups" / "varlen": the Gated DeltaNet's segments by groups of equal lengths / as one variable-length call), one
panel a run (a model), one bar group a prefill shape (with its length spread and decode rows, where it has them):
tokens/s at each way's fastest step (the decode rows' tokens counted), with its ratio to the first way of WAYS the
shape has ("torch", else "groups").

    python benchmarks/plot_prefill.py docs/results/gpu_engine_step_prefill_27b-....json ..._moe-....json --out p.png
"""
from __future__ import annotations

import argparse
import json

WAYS = ("torch", "s23", "kernels", "groups", "varlen")


def prefill_rows(rep: dict) -> dict[tuple[int, int, int, float], dict[str, float]]:
    """{(prompts, tokens each, decode rows, length spread): {way: tokens/s at its fastest step}} from a
    gpu_engine_step.json."""
    out: dict = {}
    for r in rep["rows"]:
        if "prefill" in r:
            (B, n), D = r["prefill"], r.get("decode_rows", 0)
            tokens = sum(r.get("prompt_lens") or [n] * B) + D
            out.setdefault((B, n, D, r.get("spread", 0.0)), {})[r.get("prefill_ops", "kernels")] = \
                tokens / min(r["step_ms"]) * 1e3
    return out


def label(B: int, n: int, D: int, spread: float = 0.0) -> str:
    return f"{B} x {n}" + (f" (x[{1 - spread:g}, {1 + spread:g}])" if spread else "") + " tokens" + \
        (f"\n+ {D} decode rows" if D else "")


def plot(reps: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(reps), figsize=(6 * len(reps), 4.5), squeeze=False)
    for ax, rep in zip(axes[0], reps, strict=True):
        rows = prefill_rows(rep)
        ways = [w for w in WAYS if any(w in v for v in rows.values())]
        width = 0.8 / max(len(ways), 1)
        for j, way in enumerate(ways):
            xs = [i + (j - (len(ways) - 1) / 2) * width for i in range(len(rows))]
            ys = [v.get(way, 0.0) for v in rows.values()]
            bars = ax.bar(xs, ys, width, label=way)
            for b, (shape, v) in zip(bars, rows.items(), strict=True):
                base = next((w for w in ("torch", "groups") if w in v), None)
                if way in v and base:
                    ax.annotate(f"{v[way] / v[base]:.2f}x", (b.get_x() + b.get_width() / 2, b.get_height()),
                                ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(rows)), [label(*k) for k in rows])
        ax.set_ylabel("prefill tokens / s (fastest step)")
        ax.set_title(f"{rep.get('model', '?')}, {rep.get('gpu', '')}", fontsize=9)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json", nargs="+", help="gpu_engine_step.json files (one panel each)")
    ap.add_argument("--out", required=True, help="PNG path")
    a = ap.parse_args()
    reps = [json.load(open(p)) for p in a.json]
    for p, rep in zip(a.json, reps, strict=True):
        for k, v in prefill_rows(rep).items():
            print(f"{p}: {label(*k)}: ".replace("\n", " ") + ", ".join(f"{w} {v[w]:,.0f} tokens/s" for w in WAYS
                                                                      if w in v))
    plot(reps, a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
