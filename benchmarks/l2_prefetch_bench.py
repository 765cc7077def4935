"""Would the next layer's weights, pulled into L2 from a side branch of the decode graph, make its input projection
faster? (issue 7, MoE target 1: the fifteenth session's critical path leaves 0.48 ms of latency with no bytes behind
it; docs/PERF.md). Side by side in one run, each a CUDA graph replayed, on the 35B-A3B's GDN input projection
([12352, 2048] bf16, its norm in the GEMV's prologue, as the step runs it):

- the GEMV on a weight that L2 already holds against the same GEMV after L2 was flushed: what L2 is worth to it;
- flush, a window of n dependent tiny kernels (the router's and the small kernels' latency), then the GEMV; against
  the same with a side stream that prefetches the weight's first F MB into L2 during the window (evict_last loads,
  P programs), joined after the GEMV so nothing on the main stream waits for it.

    python -u benchmarks/l2_prefetch_bench.py --out DIR [--window 0,2,4,8] [--mb 8,16,24,32] [--programs 16,32]

Every figure is device time per replay minus the flush's own time, measured in the same run.
"""
from __future__ import annotations

import argparse
import json
import os

import torch

from gpu_decode import copy_bandwidth      # benchmarks/ is on the path
from moe_kernels import time_graph_us

try:
    import triton
    import triton.language as tl
except ImportError:         # the CPU machine: the module imports, main() refuses without CUDA
    triton = None


def graph_us(fn) -> float:
    """Device time of one call of fn, captured once in a CUDA graph and replayed 200 times."""
    return time_graph_us(fn, reps=1, replays=200)


if triton is not None:
    @triton.jit
    def _tick(v_ptr, BLOCK: tl.constexpr):
        """One program reads and writes a small vector: a dependent kernel with almost no bytes (the window)."""
        o = tl.arange(0, BLOCK)
        tl.store(v_ptr + o, tl.load(v_ptr + o) * 0.5 + 1.0)

    @triton.jit
    def _prefetch(w_ptr, out_ptr, n, per, BLOCK: tl.constexpr):
        """Program p reads elements [p * per, (p + 1) * per) of w (below n) with evict_last, so the lines stay in
        L2; the sum it stores keeps the loads from being dropped."""
        p = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for s in range(p * per, tl.minimum((p + 1) * per, n), BLOCK):
            o = s + tl.arange(0, BLOCK)
            acc += tl.load(w_ptr + o, mask=o < n, other=0.0, eviction_policy="evict_last").to(tl.float32)
        tl.store(out_ptr + p, tl.sum(acc, 0))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--window", default="0,2,4,8", help="dependent tiny kernels before the GEMV")
    ap.add_argument("--mb", default="8,16,24,32", help="MB of the weight prefetched on the side stream")
    ap.add_argument("--programs", default="16,32", help="the prefetch kernel's programs")
    ap.add_argument("--flush-mb", type=int, default=192, help="written before each replay to empty L2")
    a = ap.parse_args()
    windows = [int(v) for v in a.window.split(",")]
    mbs = [int(v) for v in a.mb.split(",")]
    progs = [int(v) for v in a.programs.split(",")]
    if not torch.cuda.is_available() or triton is None:
        print("l2_prefetch_bench needs a CUDA GPU and Triton", flush=True)
        return 2
    os.makedirs(a.out, exist_ok=True)
    from memra_pp.kernels import gemv
    torch.manual_seed(0)
    dev, dt = torch.device("cuda"), torch.bfloat16
    N, K = 12352, 2048
    W = torch.randn(N, K, dtype=dt, device=dev) / K ** 0.5
    small = W[: 24 * 2 ** 20 // (2 * K)].contiguous()       # 24 MB of rows: fits L2 with room to spare
    h, res = torch.randn(1, K, dtype=dt, device=dev), torch.randn(1, K, dtype=dt, device=dev)
    lw = torch.randn(K, dtype=dt, device=dev) * 0.1
    scratch = torch.empty(a.flush_mb * 2 ** 20 // 4, dtype=torch.float32, device=dev)
    tick = torch.ones(256, dtype=torch.float32, device=dev)
    sums = torch.empty(max(progs), dtype=torch.float32, device=dev)
    side = torch.cuda.Stream()
    bw = copy_bandwidth()
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size

    def flush():
        scratch.fill_(1.0)

    def window(n):
        for _ in range(n):
            _tick[(1,)](tick, BLOCK=256)

    def proj(w):
        return gemv.norm_linear(h, res, lw, 1e-6, w)

    def prefetch(mb, p):
        n = min(mb * 2 ** 20 // 2, W.numel())
        _prefetch[(p,)](W, sums, n, triton.cdiv(triton.cdiv(n, p), 4096) * 4096, BLOCK=4096, num_warps=4)

    def with_side(n, mb, p):
        def run():
            flush()
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                prefetch(mb, p)
            window(n)
            proj(W)
            cur.wait_stream(side)       # joined after the GEMV: the main stream never waits for the prefetch
        return run

    rows = []

    def row(name, us, **kw):
        rows.append({"case": name, "us": us, **kw})
        print(f"  {name:58s} {us:8.2f} us", flush=True)

    flush_us = graph_us(flush)
    print(f"{torch.cuda.get_device_name(dev)}: copy {bw / 1e12:.2f} TB/s, L2 {l2 / 2 ** 20:.0f} MB; the weight "
          f"{W.numel() * 2 / 1e6:.1f} MB ({W.numel() * 2 / bw * 1e6:.2f} us at the copy bandwidth); flush of "
          f"{a.flush_mb} MB: {flush_us:.2f} us (subtracted below)", flush=True)
    row("24 MB GEMV, weight in L2 (replayed back to back)", graph_us(lambda: proj(small)), kind="l2_hot")
    row("24 MB GEMV after a flush (from memory)", graph_us(lambda: (flush(), proj(small))) - flush_us, kind="cold")
    for n in windows:
        base = graph_us(lambda: (flush(), window(n), proj(W))) - flush_us
        row(f"window {n}, then the GEMV", base, kind="base", window=n)
        for mb in mbs:
            for p in progs:
                us = graph_us(with_side(n, mb, p)) - flush_us
                row(f"window {n}, {mb} MB prefetched by {p} programs beside it, then the GEMV", us, kind="side",
                    window=n, mb=mb, programs=p, gain_us=base - us)
    with open(os.path.join(a.out, "l2_prefetch_bench.json"), "w") as f:
        json.dump({"copy_bandwidth_Bps": bw, "l2_bytes": l2, "flush_us": flush_us, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
