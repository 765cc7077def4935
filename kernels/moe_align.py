"""Pairs (row, routed expert) sorted by expert into blocks of BM rows for kernels/fused_moe.py's grouped GEMM:
one kernel of E + 1 programs for decode batches and short prefills, torch ops (the reference) beyond. Runs in stage
processes."""
from __future__ import annotations

import inspect

import torch

from memra_pp.kernels.fused_decode import _triton, triton

if triton is not None:
    import triton.language as tl

# Up to this many pairs the kernel aligns them, beyond it the torch ops. Each of its E + 1 programs counts all N ids
# itself, CH at a time (registers do not grow with N), then walks them again for its expert's ranks: 2 * N / CH steps
# of a load, a histogram and a scan, so its time grows with N while the torch ops' (a dozen launches, an argsort
# among them) barely do until far beyond. H200, 35B-A3B, 2026-12-01 (benchmarks/moe_kernels.py, device time in a
# CUDA graph): 3.2 us at 512 pairs, 7.0 at 2,048, 40.7 at 16,384, against the torch ops' 73, 78 and 125 us. The
# one-program kernel it replaced took 41 us at 512 pairs and lost to the torch ops at 2,048 (its bound was 768).
# Raised from 16,384 to 65,536 (the pairs of an 8,192-token step at top-8) in the twenty-sixth session: a mixed
# prefill step of the 35B-A3B (8 x 512 tokens + 504 decode rows, 36,800 pairs) was host-bound on an H200 (128-195
# ms a step against 83 ms of device time), and the torch ops cost each of its 40 layers an argsort of 260 us of host
# time (under the profiler) plus a dozen launches. The kernel's time, extrapolated along the line above, stays under
# the torch ops' (about 90 against 190 us at 36,800 pairs, 160 against 290 at 65,536): not yet measured there.
ALIGN_KERNEL_PAIRS = 65536

# tl.histogram takes a mask from Triton 3.4 on; before, the kernel sends ids outside [0, E) to bin 0 and takes them out
_HIST_MASK = triton is not None and "mask" in inspect.signature(tl.histogram).parameters


def align(topi_TK: torch.Tensor, E: int, BM: int):
    """Pairs (t*k + j) sorted by expert into blocks of BM rows, each expert's run padded to a whole block, pairs of
    one expert in their order. Returns (sorted_pairs [P] int32, N where a row is padding; block_expert [P // BM]
    int32, E past the last block). P is the worst case for this many pairs, so every shape is static (CUDA graphs).
    Up to ALIGN_KERNEL_PAIRS: one kernel (align_ref's dozen torch ops cost ~50 us a layer at 64 rows), which skips
    ids outside [0, E); align_ref is the reference and serves long prefills."""
    N = topi_TK.numel()
    if not (_triton(topi_TK) and N <= ALIGN_KERNEL_PAIRS and E <= 1024):
        return align_ref(topi_TK, E, BM)
    P = _padded_rows(N, E, BM)
    sorted_pairs = torch.empty(P, dtype=torch.int32, device=topi_TK.device)
    block_expert = torch.empty(P // BM, dtype=torch.int32, device=topi_TK.device)
    CH = 512 if N <= 512 else 1024          # ids a step: few steps (each one a load's latency), two compiled sizes
    # EB: at least a warp's 32 bins, as tl.histogram's GPU lowering has each lane own whole bins
    _align_kernel[(E + 1,)](topi_TK.reshape(-1), sorted_pairs, block_expert, N, P, E, BM=BM,
                            EB=max(32, triton.next_power_of_2(E)), CH=CH, HIST_MASK=_HIST_MASK,
                            num_warps=4 if CH == 512 else 8)
    return sorted_pairs, block_expert


def _padded_rows(N: int, E: int, BM: int) -> int:
    return (N + min(N, E) * (BM - 1) + BM - 1) // BM * BM


def align_ref(topi_TK: torch.Tensor, E: int, BM: int):
    """align's torch ops (the reference, and the path past ALIGN_KERNEL_PAIRS); ids outside [0, E) (a decode
    graph's padding rows: moe_route.route's `live`) are skipped, as the kernel skips them."""
    N = topi_TK.numel()
    flat = topi_TK.reshape(-1)
    dev = flat.device
    fe = torch.where((flat >= 0) & (flat < E), flat, E)         # bin E: skipped
    counts = torch.zeros(E + 1, dtype=torch.int64, device=dev).scatter_add_(0, fe, torch.ones_like(fe))[:E]
    padded = (counts + BM - 1) // BM * BM
    pend = padded.cumsum(0)
    order = fe.argsort(stable=True)
    se = fe[order]
    order, se = order[se < E], se[se < E]                       # (the skipped ones sort last)
    rank = torch.arange(se.numel(), device=dev) - (counts.cumsum(0) - counts)[se]
    P = _padded_rows(N, E, BM)
    sorted_pairs = torch.full((P,), N, dtype=torch.int32, device=dev)
    sorted_pairs[(pend - padded)[se] + rank] = order.to(torch.int32)
    starts = torch.arange(0, P, BM, device=dev)
    block_expert = torch.searchsorted(pend, starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert


if triton is not None:
    # N and P unspecialised: prefill batches of every size share one binary (Triton compiles a variant per
    # divisibility of an int argument; compiled mid-run, a new variant cost a deployment's first tokens ~0.7 s)
    @triton.jit(do_not_specialize=["N", "P"])
    def _align_kernel(i_ptr, sp_ptr, be_ptr, N, P, E, BM: tl.constexpr, EB: tl.constexpr, CH: tl.constexpr,
                      HIST_MASK: tl.constexpr):
        """Program e < E: expert e's rows (its pairs in their order, then padding to a whole block) and blocks;
        program E: the rows and blocks past the last run. Each program counts every expert's pairs itself (the
        runs' offsets), so the programs write disjoint rows without atomics or waiting on each other."""
        pid = tl.program_id(0)
        ex = tl.arange(0, EB)
        counts = tl.zeros([EB], dtype=tl.int32)
        for c0 in range(0, N, CH):
            j = c0 + tl.arange(0, CH)
            e = tl.load(i_ptr + j, mask=j < N, other=-1)
            ok = (e >= 0) & (e < E)         # before the cast: no id wraps into [0, E)
            e = e.to(tl.int32)
            if HIST_MASK:
                counts += tl.histogram(e, EB, mask=ok)
            else:                           # the histogram takes an id's low bits: out of range must not reach it
                counts += tl.histogram(tl.where(ok, e, 0), EB)
                counts -= tl.where(ex == 0, tl.sum(1 - ok.to(tl.int32), 0), 0)
        padded = (counts + BM - 1) // BM * BM
        pend = tl.cumsum(padded, 0)
        if pid < E:
            cnt = tl.sum(tl.where(ex == pid, counts, 0), 0)
            end = tl.sum(tl.where(ex == pid, pend, 0), 0)
            start = end - tl.sum(tl.where(ex == pid, padded, 0), 0)
            if cnt > 0:
                seen = cnt * 0
                for c0 in range(0, N, CH):
                    j = c0 + tl.arange(0, CH)
                    hot = (tl.load(i_ptr + j, mask=j < N, other=-1) == pid).to(tl.int32)
                    tl.store(sp_ptr + start + seen + tl.cumsum(hot, 0) - 1, j, mask=hot > 0)
                    seen += tl.sum(hot, 0)
                r = start + cnt + tl.arange(0, BM)          # padding: fewer than BM rows
                tl.store(sp_ptr + r, tl.zeros([BM], dtype=tl.int32) + N, mask=r < end)
                for b0 in range(start // BM, end // BM, CH):
                    b = b0 + tl.arange(0, CH)
                    tl.store(be_ptr + b, tl.zeros([CH], dtype=tl.int32) + pid, mask=b < end // BM)
        else:
            total = tl.sum(padded, 0)       # ids outside [0, E) counted nowhere: total <= P
            for r0 in range(total, P, CH):
                r = r0 + tl.arange(0, CH)
                tl.store(sp_ptr + r, tl.zeros([CH], dtype=tl.int32) + N, mask=r < P)
            for b0 in range(total // BM, P // BM, CH):
                b = b0 + tl.arange(0, CH)
                tl.store(be_ptr + b, tl.zeros([CH], dtype=tl.int32) + E, mask=b < P // BM)
