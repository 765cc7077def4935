"""The routed experts of one MoE layer at the Qwen3.5-35B-A3B dimensions (256 experts, 8 per token, hidden 2048,
expert width 512), side by side in one run: kernels/fused_moe.py (and its tile choices) against the torch paths
layers.MoE runs without it (the gathered experts for few rows, every expert on every row for more, one expert at a
time with a host sync for prefill), each timed as device time inside a CUDA graph (as a decode step runs it),
against the floor: the routed experts' bytes (each distinct expert once) over the copy bandwidth measured in this
run.

    python -u benchmarks/moe_kernels.py --out DIR [--rows 1,4,16,64,256,1024,4096]
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from gpu_kernels import time_ms


def captured(fn, reps: int = 1):
    """fn called once (compiled, warmed), then `reps` calls of it captured in one CUDA graph, replayed once: the
    graph."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay()
    torch.cuda.synchronize()
    return g


def time_graph_us(fn, reps: int = 20, replays: int = 5) -> float:
    """Device time per call: `reps` calls captured in one CUDA graph (as a decode step runs them), replayed."""
    g = captured(fn, reps)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    del g
    return a.elapsed_time(b) / (reps * replays) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rows", default="1,4,8,16,64,256,1024,4096")
    a = ap.parse_args()
    from memra_pp import switches
    switches.check_environment()   # strict: a typo in a MEMRA_PP_* switch must not run the default
    os.makedirs(a.out, exist_ok=True)
    from gpu_decode import copy_bandwidth
    from memra_pp.kernels import fused_moe as fm
    from memra_pp.kernels import moe_route as mr
    from memra_pp.model.layers import MoE
    bw = copy_bandwidth()
    E, k, H, I, bf = 256, 8, 2048, 512, torch.bfloat16
    torch.manual_seed(0)
    w_gu = torch.randn(E, 2 * I, H, device="cuda", dtype=bf) * 0.02
    w_d = torch.randn(E, H, I, device="cuda", dtype=bf) * 0.02
    moe = MoE(k)
    moe.experts_gate_up_proj, moe.experts_down_proj = w_gu, w_d
    per_expert = (w_gu[0].numel() + w_d[0].numel()) * 2
    shared = (torch.randn(2 * I, H, device="cuda", dtype=bf) * 0.02, torch.randn(H, I, device="cuda", dtype=bf) * 0.02,
              torch.randn(1, H, device="cuda", dtype=bf) * 0.02)
    rows = []
    for T in [int(x) for x in a.rows.split(",")]:
        x = torch.randn(T, H, device="cuda", dtype=bf)
        w, idx = fm.route_ref(torch.randn(T, E, device="cuda"), k, bf)
        distinct = idx.unique().numel()
        floor_us = distinct * per_expert / bw * 1e6
        ref = fm.moe_experts_ref(x, w_gu, w_d, w, idx) if T <= 256 else moe._all_experts(x, w, idx)
        cand = {"fused (default)": lambda: fm.moe_experts(x, w_gu, w_d, w, idx)}
        if T * k <= fm.SMALL_PAIRS:
            cand["torch gathered"] = lambda: moe._gathered(x, w, idx)
            cand["fused + shared expert"] = lambda: fm.moe_experts(x, w_gu, w_d, w, idx, shared)
            cand["torch gathered + shared expert"] = lambda: fm.moe_ref(x, w_gu, w_d, w, idx, shared)
            for tiles in [(16, 256, 4, 16, 128, 4), (8, 2048, 8, 8, 512, 4), (4, 2048, 4, 8, 512, 8),
                          (8, 1024, 4, 16, 512, 4), (16, 512, 4, 4, 512, 4), (8, 512, 4, 8, 256, 4),
                          (4, 1024, 4, 16, 256, 4), (8, 2048, 4, 32, 128, 4)]:
                cand[f"small {tiles}"] = (lambda t: lambda: fm._moe_small(x, w_gu, w_d, w, idx, tiles=t,
                                                                          down="loop"))(tiles)
            # the down kernel's tiles, then the gate|up kernel's (63% of its bytes' time at one row: 288 programs
            # of 16 rows fill 132 SMs 2.2 times over, so the last wave runs a fifth full)
            for tiles in [(16, 512, 4, 1, 512, 4), (16, 512, 4, 2, 512, 4), (16, 512, 4, 4, 512, 4),
                          (16, 512, 4, 2, 512, 8), (16, 512, 4, 4, 512, 8), (16, 512, 4, 8, 512, 8),
                          (8, 512, 2, 2, 512, 4), (8, 1024, 4, 2, 512, 4), (4, 2048, 2, 2, 512, 4),
                          (4, 1024, 2, 2, 512, 4), (32, 256, 8, 2, 512, 4), (8, 256, 2, 2, 512, 4)]:
                cand[f"small tile {tiles}"] = (lambda t: lambda: fm._moe_small(x, w_gu, w_d, w, idx, tiles=t,
                                                                               down="tile"))(tiles)
                cand[f"small tile {tiles} + shared expert"] = (lambda t: lambda: fm._moe_small(
                    x, w_gu, w_d, w, idx, shared, tiles=t, down="tile"))(tiles)
        else:
            cand["torch all experts"] = lambda: moe._all_experts(x, w, idx)
            if T >= 256:
                cand["torch routed (host sync)"] = lambda: moe._routed(x, w, idx)
        if T * k > 16:
            for cfg in [(16, 64, 128), (16, 128, 64), (32, 64, 64), (32, 128, 64), (64, 64, 64), (64, 128, 64),
                        (128, 128, 64)]:
                cand[f"grouped {cfg}"] = (lambda c: lambda: fm.moe_grouped(x, w_gu, w_d, w, idx, c))(cfg)
        ref_shared = fm.moe_ref(x, w_gu, w_d, w, idx, shared) if T * k <= fm.SMALL_PAIRS else None
        for name, fn in cand.items():
            try:
                out = fn()
                want = ref_shared if "shared" in name else ref
                err = (out.float() - want.float()).abs().max().item()
                us = time_ms(fn, iters=20) * 1e3 if "host sync" in name else time_graph_us(fn)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is recorded, the sweep goes on
                print(f"  T={T:5d} {name:32s} failed: {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            r = {"rows": T, "path": name, "us": us, "floor_us": floor_us, "of_floor": floor_us / us,
                 "distinct_experts": distinct, "max_abs_err": err}
            rows.append(r)
            print(f"  T={T:5d} {name:32s} {us:9.1f} us  floor {floor_us:7.1f} us ({floor_us / us:5.1%})  "
                  f"err {err:.1e}", flush=True)
        T1 = torch.randn(T, E, device="cuda", dtype=bf)
        gate = torch.randn(E, H, device="cuda", dtype=bf) * 0.02
        routes = {"route fused": lambda: fm.route(T1, k, bf), "route torch": lambda: fm.route_ref(T1, k, bf),
                  "router GEMV + route kernel": lambda: fm.route(torch.nn.functional.linear(x, gate), k, bf)}
        if T <= mr.ROUTER_ROWS:
            routes["router+route one kernel"] = lambda: fm.router_route(x, gate, k, bf)
            for rc in [(2, 2048, 1), (2, 2048, 2), (1, 2048, 1), (4, 2048, 2), (2, 1024, 2), (8, 2048, 4)]:
                routes[f"router+route one kernel {rc}"] = (lambda c: lambda: fm.router_route(x, gate, k, bf, c))(rc)
        if T * k > fm.SMALL_PAIRS:      # the grouped path's sort: the kernel (up to its bound) and the torch ops
            BM = fm.grouped_config(T * k)[0]
            routes[f"align kernel BM={BM}"] = lambda: fm.align(idx, E, BM)
            routes[f"align torch BM={BM}"] = lambda: fm.align_ref(idx, E, BM)
        for name, fn in routes.items():
            us = time_graph_us(fn)
            rows.append({"rows": T, "path": name, "us": us})
            print(f"  T={T:5d} {name:32s} {us:9.1f} us", flush=True)
        json.dump({"copy_bandwidth_Bps": bw, "gpu": torch.cuda.get_device_name(0), "rows": rows},
                  open(os.path.join(a.out, "moe_kernels.json"), "w"), indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
