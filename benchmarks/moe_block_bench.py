"""One decode row's MoE block at the Qwen3.5-35B-A3B dimensions (256 experts, 8 per token, hidden 2048, expert
width 512, a shared expert of 512), side by side in one run: the block as one persistent kernel
(kernels/moe_block.py) at each tile configuration given, against its three kernels (moe_route.norm_router_route,
fused_moe.moe_experts), each as device time a layer inside a CUDA graph over --layers layers (distinct weights, so
the experts come from memory, not L2), against the floor: the block's bytes (router, k + 1 experts) over the copy
bandwidth measured in the same run. Then each configuration once more with clock stamps at its phases' edges:
where a layer's time goes, program by program.

    python -u benchmarks/moe_block_bench.py --out DIR [--layers 8] [--configs 4x8x8x1x1,4x4x4x2x0,...]

A configuration: gate|up rows a tile x down rows a tile x warps x programs a multiprocessor x prefetch (1/0), and
optionally rN: at most N registers a thread (moe_block.MAXNREG), e.g. 4x4x4x2x0r128.
"""
from __future__ import annotations

import argparse
import json
import os
import re

import torch

from gpu_decode import copy_bandwidth      # benchmarks/ is on the path
from moe_kernels import time_graph_us

PHASES = ("wait", "norm+router", "barrier 1", "routing", "gate|up", "barrier 2", "down")


def parse_config(c: str):
    """((BN, BD, warps, programs a multiprocessor, prefetch), registers cap or None) of "AxBxCxDxE[rN]"."""
    from memra_pp.kernels import moe_block as mb
    m = re.fullmatch(r"([0-9x]+)(?:r(\d+))?", c)
    tiles = mb.parse_tiles(m[1]) if m else None
    if tiles is None:
        raise SystemExit(f"config {c!r}: AxBxCxDxE (gate|up rows, down rows, warps: powers of two; programs a "
                         "multiprocessor; prefetch 0 / 1), then optionally rN (at most N registers), e.g. "
                         "4x4x4x2x0r168")
    return tiles, (int(m[2]) if m[2] else None)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--configs", default="4x4x4x2x0,2x4x4x2x1,2x4x4x2x0,4x4x8x1x1,2x2x4x2x1,4x8x8x1x1,2x4x8x1x1")
    ap.add_argument("--spins", default="asm,atomic", help="the barrier's wait: ld.acquire (asm), atomic adds of 0")
    a = ap.parse_args()
    from memra_pp import switches
    switches.check_environment()   # strict: a typo in a MEMRA_PP_* switch must not run the default
    configs = {c: parse_config(c) for c in a.configs.split(",")}     # a typo fails before any device time
    os.makedirs(a.out, exist_ok=True)
    from memra_pp.kernels import fused_moe as fm
    from memra_pp.kernels import moe_block as mb
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    E, H, I, Is, k, L = 256, 2048, 512, 512, 8, a.layers
    layers = []
    for _ in range(L):
        layers.append(dict(
            lw=torch.randn(H, dtype=dt, device=dev) * 0.1, g=torch.randn(E, H, dtype=dt, device=dev) / H ** 0.5,
            gu=torch.randn(E, 2 * I, H, dtype=dt, device=dev) / H ** 0.5,
            d=torch.randn(E, H, I, dtype=dt, device=dev) / I ** 0.5,
            sh=(torch.randn(2 * Is, H, dtype=dt, device=dev) / H ** 0.5, torch.randn(H, Is, dtype=dt, device=dev)
                / Is ** 0.5, torch.randn(1, H, dtype=dt, device=dev) / H ** 0.5),
            h=torch.randn(1, H, dtype=dt, device=dev), m=torch.randn(1, H, dtype=dt, device=dev),
            bar=torch.zeros(1, dtype=torch.int32, device=dev), cnt=torch.zeros(1, dtype=torch.int32, device=dev)))
    bw = copy_bandwidth()
    floor_us = (E * H + (k + 1) * 3 * H * I) * 2 / bw * 1e6
    print(f"copy {bw / 1e12:.2f} TB/s; a layer's bytes {(E * H + (k + 1) * 3 * H * I) * 2 / 1e6:.1f} MB, floor "
          f"{floor_us:.2f} us; {L} layers, {torch.cuda.get_device_properties(dev).multi_processor_count} SMs",
          flush=True)

    def three():
        for ly in layers:
            s, x, w, idx = fm.norm_router_route(ly["h"], ly["m"], ly["lw"], 1e-6, ly["g"], k, dt, counter=ly["cnt"])
            fm.moe_experts(x, ly["gu"], ly["d"], w, idx, ly["sh"])

    rows = []
    base = time_graph_us(three, reps=4) / L
    rows.append({"path": "three kernels", "us": base, "of_floor": floor_us / base})
    print(f"  three kernels                     {base:6.2f} us a layer ({floor_us / base:.0%} of floor)", flush=True)
    for spin, c in [(sp, c) for sp in a.spins.split(",") for c in a.configs.split(",")]:
        mb.ACQUIRE_ASM = spin == "asm"
        tiles, mb.MAXNREG = configs[c]
        per_sm = tiles[3]

        def block(times=None):
            for i, ly in enumerate(layers):
                mb.moe_block(ly["h"], ly["m"], ly["lw"], 1e-6, ly["g"], k, ly["gu"], ly["d"], ly["sh"], ly["bar"],
                             tiles=tiles, times=None if times is None else times[i])

        try:
            us = time_graph_us(block, reps=4) / L
        except Exception as e:     # a configuration that does not compile or cannot be resident: reported, the rest
            #                        run
            print(f"  block {c} {spin:6s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
            rows.append({"path": f"block {c} {spin}", "error": str(e)[:500]})
            continue
        kern = mb.LAST_KERNEL
        regs, spills = getattr(kern, "n_regs", None), getattr(kern, "n_spills", None)
        P = per_sm * torch.cuda.get_device_properties(dev).multi_processor_count
        times = torch.zeros(L, P, 8, dtype=torch.int64, device=dev)
        g = torch.cuda.CUDAGraph()
        block(times)
        torch.cuda.synchronize()
        with torch.cuda.graph(g):
            block(times)
        for _ in range(3):
            g.replay()
        torch.cuda.synchronize()
        t = times[1:].double()          # the first layer waits for the kernel before the graph
        t = t - t[:, :, :1].amin(1, keepdim=True)         # from the layer's first program's start
        d = (t[:, :, 1:] - t[:, :, :-1])                   # [L-1, P, 7] each phase, each program
        med = d.median(1).values.median(0).values.tolist()
        mx = d.amax(1).median(0).values.tolist()
        span = (t[:, :, 7].amax(1) - t[:, :, 0].amin(1)).median().item() / 1e3
        start = t[:, :, 0].amax(1).median().item() / 1e3
        row = {"path": f"block {c} {spin}", "spin": spin, "tiles": tiles, "us": us, "of_floor": floor_us / us,
               "regs": regs, "spills": spills, "phase_median_us": dict(zip(PHASES, [v / 1e3 for v in med])),
               "phase_max_us": dict(zip(PHASES, [v / 1e3 for v in mx])), "span_us": span, "last_start_us": start}
        rows.append(row)
        print(f"  block {c} {spin:6s} {us:6.2f} us a layer ({floor_us / us:.0%} of floor, {us / base:.2f}x the three), "
              f"regs {regs} spills {spills}; stamped span {span:.1f} us, last program starts at {start:.1f}; "
              "phases median/max: " + ", ".join(f"{p} {v / 1e3:.1f}/{w / 1e3:.1f}" for p, v, w in zip(PHASES, med, mx)),
              flush=True)
    mb.MAXNREG = None
    with open(os.path.join(a.out, "moe_block_bench.json"), "w") as f:
        json.dump({"copy_bandwidth_Bps": bw, "floor_us": floor_us, "layers": L, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
