"""Pairs (row, routed expert) sorted by expert into blocks of BM rows for kernels/fused_moe.py's grouped GEMM:
one Triton program for decode batches, torch ops (the reference) beyond. Runs in stage processes."""
from __future__ import annotations

import torch

from memra_pp.kernels.fused_decode import _triton, triton

if triton is not None:
    import triton.language as tl

# Up to this many pairs one kernel (one program) aligns them, beyond it the torch ops. H200, 35B-A3B, 2026-12-01: at
# 64 rows (512 pairs) the kernel took a step from 22.2 to 21.0 ms; at 256 rows (2,048 pairs) from 32.4 to 34.3 ms.
ALIGN_KERNEL_PAIRS = 768


def align(topi_TK: torch.Tensor, E: int, BM: int):
    """Pairs (t*k + j) sorted by expert into blocks of BM rows, each expert's run padded to a whole block, pairs of
    one expert in their order. Returns (sorted_pairs [P] int32, N where a row is padding; block_expert [P // BM]
    int32, E past the last block). P is the worst case for this many pairs, so every shape is static (CUDA graphs).
    Few pairs: one kernel (align_ref's dozen torch ops cost ~50 us a layer at 64 rows); align_ref is the reference
    and serves prefill."""
    N = topi_TK.numel()
    if not (_triton(topi_TK) and N <= ALIGN_KERNEL_PAIRS and E <= 1024):
        return align_ref(topi_TK, E, BM)
    P = _padded_rows(N, E, BM)
    sorted_pairs = torch.empty(P, dtype=torch.int32, device=topi_TK.device)
    block_expert = torch.empty(P // BM, dtype=torch.int32, device=topi_TK.device)
    _align_kernel[(1,)](topi_TK.reshape(-1), sorted_pairs, block_expert, N, P, E, BM=BM,
                        EB=triton.next_power_of_2(E), CH=32, num_warps=8)
    return sorted_pairs, block_expert


def _padded_rows(N: int, E: int, BM: int) -> int:
    return (N + min(N, E) * (BM - 1) + BM - 1) // BM * BM


def align_ref(topi_TK: torch.Tensor, E: int, BM: int):
    N = topi_TK.numel()
    flat = topi_TK.reshape(-1)
    dev = flat.device
    counts = torch.zeros(E, dtype=torch.int64, device=dev).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + BM - 1) // BM * BM
    pend = padded.cumsum(0)
    order = flat.argsort(stable=True)
    se = flat[order]
    rank = torch.arange(N, device=dev) - (counts.cumsum(0) - counts)[se]
    P = _padded_rows(N, E, BM)
    sorted_pairs = torch.full((P,), N, dtype=torch.int32, device=dev)
    sorted_pairs[(pend - padded)[se] + rank] = order.to(torch.int32)
    starts = torch.arange(0, P, BM, device=dev)
    block_expert = torch.searchsorted(pend, starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert


if triton is not None:
    @triton.jit
    def _align_kernel(i_ptr, sp_ptr, be_ptr, N, P, E, BM: tl.constexpr, EB: tl.constexpr, CH: tl.constexpr):
        """One program: expert counts, padded offsets (exclusive cumsum), each pair's place (its expert's offset +
        the pairs of that expert before it, chunk by chunk), and each block's expert."""
        ex = tl.arange(0, EB)
        counts = tl.zeros([EB], dtype=tl.int32)
        for c0 in range(0, N, CH):
            j = c0 + tl.arange(0, CH)
            e = tl.load(i_ptr + j, mask=j < N, other=EB).to(tl.int32)
            counts += tl.sum(((e[:, None] == ex[None, :]) & (ex[None, :] < E)).to(tl.int32), 0)
        padded = (counts + BM - 1) // BM * BM
        pend = tl.cumsum(padded, 0)
        pstart = pend - padded
        for r0 in range(0, P, CH):                      # every row padding first
            r = r0 + tl.arange(0, CH)
            tl.store(sp_ptr + r, tl.zeros([CH], dtype=tl.int32) + N, mask=r < P)
        tl.debug_barrier()
        seen = tl.zeros([EB], dtype=tl.int32)
        for c0 in range(0, N, CH):
            j = c0 + tl.arange(0, CH)
            e = tl.load(i_ptr + j, mask=j < N, other=EB).to(tl.int32)
            hot = ((e[:, None] == ex[None, :]) & (ex[None, :] < E)).to(tl.int32)  # [CH, EB]; ids < E only
            before = tl.sum((tl.cumsum(hot, 0) - hot + seen[None, :] + pstart[None, :]) * hot, 1)
            tl.store(sp_ptr + before, j, mask=(j < N) & (e < E))
            seen += tl.sum(hot, 0)
        for b0 in range(0, P // BM, CH):
            b = b0 + tl.arange(0, CH)
            start = b * BM
            inside = (pstart[None, :] <= start[:, None]) & (start[:, None] < pend[None, :])   # empty runs: never
            owner = tl.sum(tl.where(inside, ex[None, :] + 1, 0), 1)
            tl.store(be_ptr + b, tl.where(owner > 0, owner - 1, E), mask=b < P // BM)
