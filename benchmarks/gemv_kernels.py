"""The decode step's projections at few rows, side by side in one run: kernels/gemv.py (its default tile and a
sweep of others) against cuBLAS (F.linear), and with the norm in the prologue against add_rms_norm then cuBLAS,
at the 35B-A3B and 27B dimensions. Device time per call inside a CUDA graph (as a decode step runs them), against
the floor: the weight's bytes over the copy bandwidth measured in this run.

    python -u benchmarks/gemv_kernels.py --out DIR [--rows 1] [--models qwen3.5-35b-a3b,qwen3.5-27b] [--plot PNG]
    python benchmarks/gemv_kernels.py --from JSON --plot PNG      (the plot of an earlier run)
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from moe_kernels import time_graph_us

# (BN, BK, warps, programs: 0 one a row block, else a persistent grid of that many)
TILES = [(2, 2048, 4, 0), (4, 2048, 4, 0), (8, 2048, 4, 0), (8, 2048, 8, 0), (4, 1024, 4, 0), (8, 1024, 4, 0),
         (4, 2048, 4, 528), (4, 2048, 4, 264), (8, 2048, 8, 264), (8, 2048, 4, 528), (2, 4096, 4, 0),
         (4, 4096, 8, 0), (2, 4096, 8, 528), (16, 2048, 8, 0), (16, 2048, 8, 264)]


def shapes(name: str) -> list[tuple[str, int, int, bool]]:
    """(what, N, K, norm in the prologue) of one layer's projections (the MoE experts are moe_kernels.py's)."""
    from memra_pp.model import presets
    from memra_pp.model.config import parse_config
    c = parse_config(presets.get(name), name).text
    nv, dv = c.linear_num_value_heads, c.linear_value_head_dim
    out = [("gdn in_proj (qkv|z|b|a)", c.conv_dim + nv * dv + 2 * nv, c.hidden_size, True),
           ("attn q|gate|k|v", c.num_attention_heads * 2 * c.head_dim + 2 * c.num_key_value_heads * c.head_dim,
            c.hidden_size, True),
           ("gdn out_proj", c.hidden_size, nv * dv, False),
           ("attn o_proj", c.hidden_size, c.num_attention_heads * c.head_dim, False)]
    if not c.moe:
        out += [("mlp gate|up", 2 * c.intermediate_size, c.hidden_size, True),
                ("mlp down", c.hidden_size, c.intermediate_size, False)]
    return out


def plot(rep: dict, png: str) -> None:
    """One pair of bars per projection (one row): cuBLAS (after add_rms_norm where the Triton kernel fuses the norm)
    and the Triton GEMV's best tile, in percent of the bytes' time (the floor); a star marks the one the committed
    rule (gemv.wins) picks."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from memra_pp.kernels.gemv import wins
    groups: dict = {}
    for r in rep["rows"]:
        if r["rows"] == 1:
            groups.setdefault((r["model"].replace("qwen3.5-", ""), r["what"]), []).append(r)
    names, cub, tri = [], [], []
    for (model, what), rs in groups.items():
        base = [r for r in rs if r["path"] in ("cuBLAS", "add_rms_norm + cuBLAS")]
        best = max((r["of_floor"] for r in rs if r["path"].startswith("gemv")), default=0.0)
        pick = "Triton" if wins(rs[0]["N"], rs[0]["K"], base[0]["path"] != "cuBLAS") else "cuBLAS"
        names.append(f"{model}\n{what}\n* {pick}")
        cub.append(100 * base[0]["of_floor"])
        tri.append(100 * best)
    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(names)), 4.8))
    w = 0.38
    ax.bar([x - w / 2 for x in range(len(names))], cub, w, label="cuBLAS (after add_rms_norm where the norm is fused)")
    ax.bar([x + w / 2 for x in range(len(names))], tri, w, label="Triton GEMV (kernels/gemv.py), best tile")
    ax.set_xticks(range(len(names)), names, fontsize=7)
    ax.set_ylabel("% of the bytes' time (copy bandwidth)")
    ax.set_title(f"One-row projections on {rep.get('gpu', 'GPU')}, device time in a CUDA graph (* the one used)")
    ax.axhline(100, color="gray", lw=0.8)
    ax.set_ylim(0, 110)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--plot", help="a PNG of the one-row results")
    ap.add_argument("--from", dest="src", help="plot this earlier run's JSON instead of running")
    ap.add_argument("--rows", default="1")
    ap.add_argument("--models", default="qwen3.5-35b-a3b,qwen3.5-27b")
    a = ap.parse_args()
    from memra_pp import switches
    switches.check_environment()   # strict: a typo in a MEMRA_PP_* switch must not run the default
    if a.src:
        plot(json.load(open(a.src)), a.plot)
        return 0
    os.makedirs(a.out, exist_ok=True)
    from gpu_decode import copy_bandwidth
    from memra_pp.kernels import fused_decode as fd
    from memra_pp.kernels import gemv
    bw = copy_bandwidth()
    gemv.GEMV_ROWS, gemv.FORCE = 64, True
    bf, rows = torch.bfloat16, []
    torch.manual_seed(0)
    for model in a.models.split(","):
        for what, N, K, norm in shapes(model):
            W = torch.randn(N, K, device="cuda", dtype=bf) * 0.02
            lw = torch.randn(K, device="cuda", dtype=bf) * 0.1
            floor_us = N * K * 2 / bw * 1e6
            for T in [int(x) for x in a.rows.split(",")]:
                h, r = torch.randn(T, K, device="cuda", dtype=bf), torch.randn(T, K, device="cuda", dtype=bf)
                if norm:
                    ref = F.linear(fd.add_rms_norm(h, r, lw, 1e-6)[1], W)
                    cand = {"add_rms_norm + cuBLAS": lambda: F.linear(fd.add_rms_norm(h, r, lw, 1e-6)[1], W),
                            "cuBLAS alone": lambda: F.linear(h, W)}
                    mk = (lambda t: lambda: gemv.norm_linear(h, r, lw, 1e-6, W, t)[1])
                else:
                    ref = F.linear(h, W)
                    cand = {"cuBLAS": lambda: F.linear(h, W)}
                    mk = (lambda t: lambda: gemv.linear(h, W, t))
                cand[f"gemv default {gemv.tile(N, K)}"] = mk(None)
                for t in TILES:
                    cand[f"gemv {t}"] = mk(t)
                for name, fn in cand.items():
                    try:
                        err = (fn().float() - ref.float()).abs().max().item()
                        us = time_graph_us(fn)
                    except Exception as e:  # noqa: BLE001 - a tile that does not compile is recorded, not fatal
                        print(f"  {model} {what} T={T} {name}: failed {type(e).__name__}: {str(e)[:100]}", flush=True)
                        continue
                    rows.append({"model": model, "what": what, "N": N, "K": K, "rows": T, "path": name, "us": us,
                                 "floor_us": floor_us, "of_floor": floor_us / us, "max_abs_err": err})
                    print(f"  {model:16s} {what:26s} T={T} {name:28s} {us:8.2f} us  floor {floor_us:6.2f} "
                          f"({floor_us / us:5.1%})  err {err:.1e}", flush=True)
            json.dump({"copy_bandwidth_Bps": bw, "gpu": torch.cuda.get_device_name(0), "rows": rows},
                      open(os.path.join(a.out, "gemv_kernels.json"), "w"), indent=1)
    if a.plot:
        plot({"gpu": torch.cuda.get_device_name(0), "rows": rows}, a.plot)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
