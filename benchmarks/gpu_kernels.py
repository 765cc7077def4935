"""Tile sweep of the fused Gated DeltaNet decode kernel at the 27B head shapes: time per call against the bytes it
must move (each sequence's fp32 state read and written), so GDN_TILE in kernels/gdn_decode.py is picked by
measurement.

    python -u benchmarks/gpu_kernels.py --out DIR [--batches 1,64,256]
"""
from __future__ import annotations

import argparse
import json
import os

import torch


def time_ms(fn, iters: int = 50) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / iters


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--batches", default="1,64,256")
    a = ap.parse_args()
    from memra_pp import switches
    switches.check_environment()   # strict: a typo in a MEMRA_PP_* switch must not run the default
    os.makedirs(a.out, exist_ok=True)
    from gpu_decode import copy_bandwidth
    from memra_pp.kernels.gdn_decode import gdn_decode_fused
    bw = copy_bandwidth()
    H, HV, K, V = 16, 48, 128, 128
    rows = []
    for B in [int(x) for x in a.batches.split(",")]:
        N = B + 1
        dev, bf = "cuda", torch.bfloat16
        y = torch.randn(B, 2 * H * K + HV * V, device=dev, dtype=bf)
        P = torch.randn(B, 2 * HV, device=dev, dtype=bf)
        A_log, dtb = torch.randn(HV, device=dev, dtype=bf), torch.randn(HV, device=dev, dtype=bf)
        pool = torch.randn(N, HV, K, V, device=dev)
        slots = torch.randperm(N, device=dev)[:B]
        floor_us = B * HV * K * V * 4 * 2 / bw * 1e6
        for bv in (8, 16, 32):
            for warps in (1, 2, 4):
                try:
                    ms = time_ms(lambda: gdn_decode_fused(y, P[:, :HV], P[:, HV:], A_log, dtb, pool, slots, H,
                                                          K ** -0.5, tile=(bv, warps)))
                except Exception as e:  # noqa: BLE001 - a tile that does not compile is reported, not fatal
                    print(f"  B {B} BV {bv} warps {warps}: {type(e).__name__}", flush=True)
                    continue
                rows.append({"batch": B, "BV": bv, "warps": warps, "us": ms * 1e3, "floor_us": floor_us})
                print(f"  B {B:4d} BV {bv:3d} warps {warps}: {ms * 1e3:8.1f} us (state floor {floor_us:7.1f} us, "
                      f"{floor_us / (ms * 1e3):.0%})", flush=True)
    json.dump({"copy_bandwidth_Bps": bw, "rows": rows}, open(os.path.join(a.out, "gpu_kernels.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
