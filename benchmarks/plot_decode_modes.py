"""Decode throughput against batch size of each mode gpu_engine_step.py timed side by side in one run: tokens/s at
each (mode, batch), the mean of the mode's repeats where --modes named it more than once (each repeat drawn as a
dot), with the batch-size buckets of the decode graphs marked (a batch between two runs the larger one's graph).

    python benchmarks/plot_decode_modes.py docs/results/pad-skip-step-35b-a3b-....json --out p.png
"""
from __future__ import annotations

import argparse
import json


def decode_rows(rep: dict) -> dict[str, dict[int, list[float]]]:
    """{mode: {batch: [tokens/s of each repeat]}} from a gpu_engine_step.json (its decode rows)."""
    out: dict = {}
    for r in rep["rows"]:
        if "prefill" not in r and "batch" in r:
            out.setdefault(r["mode"], {}).setdefault(r["batch"], []).append(r["tokens_per_s"])
    return out


def plot(rep: dict, path: str, name: str = "the report", title: str = "") -> None:
    """The PNG at `path` (`name`: the report's, for the refusal of one with no decode rows)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from memra_pp.model.decode_graphs import BATCH_BUCKETS
    rows = decode_rows(rep)
    if not rows:
        raise SystemExit(f"{name}: no decode rows")
    fig, ax = plt.subplots(figsize=(7, 4.2))
    top = max(b for by in rows.values() for b in by)
    for bkt in BATCH_BUCKETS:
        if bkt <= top:
            ax.axvline(bkt, color="0.85", lw=0.8, zorder=0)
    for mode, by in rows.items():
        bs = sorted(by)
        line, = ax.plot(bs, [sum(by[b]) / len(by[b]) for b in bs], marker="o", label=mode)
        for b in bs:
            ax.scatter([b] * len(by[b]), by[b], s=8, color=line.get_color(), alpha=0.5)
    ax.set_xlabel("sequences decoding (grey: the decode graphs' batch buckets)")
    ax.set_ylabel("tokens/s (one stage's step)")
    ax.set_title(title or f"{rep.get('model', '')} on {rep.get('gpu', '')}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("report", help="gpu_engine_step.json")
    ap.add_argument("--out", required=True)
    ap.add_argument("--title", default="")
    a = ap.parse_args()
    plot(json.load(open(a.report)), a.out, a.report, a.title)
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
