"""Matrix-vector products of the decode step at few rows, and the residual add + RMSNorm that precedes one, fused
into the product's prologue.

At one row a decode layer's projections are GEMVs that read a weight matrix once. cuBLAS picks tiles for the
general case: the input projection of the 35B-A3B (12,352 x 2,048) ran at 80% of its bytes' time, out_proj
(2,048 x 4,096) as a split-K kernel plus a reduce at 44%, each after a 1.9 us add + RMSNorm kernel. Here one program
owns BN output rows for every input row and streams its [BN, K] weight slice in BK-wide steps; with `norm` each
program first recomputes the normed input from the residual stream itself (two reads of a few KB from L2), so the
norm kernel and its launch are gone, and program 0 writes the new residual.

Rounding: the norm as kernels/fused_decode.add_rms_norm rounds (s = x + res rounded to the dtype, the normed row
rounded to the dtype), the product accumulated in float32 and rounded once, as F.linear's output is. The torch
reference (CPU, and shapes without a tile) is add_rms_norm_ref then F.linear. Runs in stage processes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from memra_pp.kernels.fused_decode import _sms, _triton, add_rms_norm, pdl, triton

if triton is not None:
    import triton.language as tl

    from memra_pp.kernels.fused_decode import pdl_enter

# at most this many rows the Triton GEMV (0: never; cuBLAS everywhere)
GEMV_ROWS = 1
# host-side launches (a captured graph counts once): plain products, and those with the norm in their prologue
CALLS = {"gemv": 0, "norm_gemv": 0}
# a persistent grid: programs a launch at most, each looping over row blocks (None: four a multiprocessor of the
# device, 528 on an H200)
PROGRAMS = None
# a persistent program loads its next row block's weights before it reduces the current one (two blocks in flight a
# program; the first two are issued before PDL's wait). False: one block at a time (the benchmarks compare)
PREFETCH = True
# a program of the K-in-steps path (out_proj, o_proj: no norm, K over 2,048) loads its first block's first K step
# before PDL's wait (False: nothing before it). Not yet measured in the step: off until a device run says it pays
PRELOAD = False
PLAIN_BK = 2048       # the plain product's K step (tile(); 4,096 takes the 35B-A3B's out_proj row in one step)


def tile(N: int, K: int, norm: bool = False) -> tuple[int, int, int, int]:
    """(BN, BK, warps, programs; 0: one program a row block, None: four a multiprocessor) for an [N, K] weight
    (benchmarks/gemv_kernels.py, H200, one row: the whole row of K in one 2,048-wide step; with the norm a persistent
    grid of 528 programs, each norming its input once: 15.2 us for the 35B-A3B's input projection where add_rms_norm
    then cuBLAS took 15.8, 9.5 against 10.2 for its attention's)."""
    if norm:
        return 4, 2048, 4, PROGRAMS
    return (4 if N < 4096 else 2), PLAIN_BK, 4, 0


def wins(N: int, K: int, norm: bool) -> bool:
    """Whether the Triton GEMV beats cuBLAS for an [N, K] weight at one row (benchmarks/gemv_kernels.py, H200):
    plain, for the narrow, deep matrices (out_proj, o_proj, down: 5.3 against 7.3 us at the 35B-A3B's 2,048 x
    4,096, 45.3 against 48.7 at the 27B's down); with the norm in its prologue, where the whole input row fits one
    step (K <= 2,048: the 35B-A3B's input projections). Not the wide matrices of the 27B (hidden 5,120), where
    cuBLAS reads at 90-100% of the bytes' time: 47.8 against 46.9 us (input projection), 91.7 against 87.4
    (gate|up)."""
    return K <= 2048 if norm else N <= K


TILE = None    # (BN, BK, warps, programs) for every shape (benchmarks set it); None: tile(N, K)
FORCE = False  # True: the Triton GEMV wherever it can run (benchmarks, tests), not only where it wins


def runs(x: torch.Tensor, W: torch.Tensor) -> bool:
    """The kernel can run on these operands (a tile given by a benchmark or test skips only the choice)."""
    return _triton(x) and 0 < x.shape[0] <= GEMV_ROWS and x.stride(-1) == 1 and W.is_contiguous() \
        and W.shape[1] == x.shape[1]


def takes(x: torch.Tensor, W: torch.Tensor, norm: bool = False) -> bool:
    return runs(x, W) and (FORCE or wins(W.shape[0], W.shape[1], norm))


def linear(x_TK: torch.Tensor, W_NK: torch.Tensor, tile_=None) -> torch.Tensor:
    """F.linear(x, W) (no bias): the Triton GEMV for few rows where it wins, else cuBLAS."""
    if not (takes(x_TK, W_NK) or (tile_ and runs(x_TK, W_NK))):
        return F.linear(x_TK, W_NK)
    CALLS["gemv"] += 1
    return _launch(x_TK, None, None, 0.0, None, W_NK, tile_)


def norm_linear(h_TK, res_TK, w_norm, eps: float, W_NK, tile_=None):
    """(s, F.linear(rms_norm(s), W)) with s = h + res (h when res is None): add_rms_norm then the product, in one
    kernel for few rows where that wins."""
    if (not (takes(h_TK, W_NK, True) or (tile_ and runs(h_TK, W_NK))) or not w_norm.is_contiguous()
            or (res_TK is not None and res_TK.stride(-1) != 1)):
        s, x = add_rms_norm(h_TK, res_TK, w_norm, eps)      # the torch reference where Triton does not run
        return s, F.linear(x, W_NK)
    CALLS["norm_gemv"] += 1
    s = h_TK if res_TK is None else torch.empty(h_TK.shape, dtype=h_TK.dtype, device=h_TK.device)
    return s, _launch(h_TK, res_TK, w_norm, eps, s, W_NK, tile_)


def _launch(x, res, w_norm, eps, s, W, tile_):
    T, K = x.shape
    N = W.shape[0]
    BN, BK, warps, programs = tile_ or TILE or tile(N, K, w_norm is not None)
    if programs is None:
        programs = 4 * _sms(x.device)
    assert BK & (BK - 1) == 0, f"BK {BK} must be a power of two"
    BK = min(BK, triton.next_power_of_2(K))
    y = torch.empty(T, N, dtype=x.dtype, device=x.device)
    norm = w_norm is not None
    blocks = triton.cdiv(N, BN)
    _gemv_kernel[(min(blocks, programs) if programs else blocks,)](
        x, res if res is not None else x, w_norm if norm else W, s if s is not None else y, W, y,
        x.stride(0), res.stride(0) if res is not None else 0, T, N, K, eps, TP=triton.next_power_of_2(T), BN=BN,
        BK=BK, NORM=norm, RES=res is not None, ONE=BK >= K, PREF=PREFETCH and BK >= K and programs > 0,
        PRE=PRELOAD and BK < K and not norm, num_warps=warps, **pdl(x))
    return y


if triton is not None:
    @triton.jit
    def _normed(x_ptr, r_ptr, lw_ptr, s_ptr, ts, tm, kk, km, inv, stride_x, stride_r, K, write,
                RES: tl.constexpr, NORMED: tl.constexpr):
        """The [TP, BK] chunk of x + r (RES; else x) at columns kk, rounded to the dtype, and with NORMED its
        rms_norm (inv: each row's 1 / rms), rounded as add_rms_norm rounds; write: also store the chunk of
        x + r (the new residual) to s at rows where write [TP] holds."""
        m2 = tm[:, None] & km[None, :]
        xv = tl.load(x_ptr + ts[:, None] * stride_x + kk[None, :], mask=m2, other=0.0)
        if RES:
            rv = tl.load(r_ptr + ts[:, None] * stride_r + kk[None, :], mask=m2, other=0.0)
            xv = (xv.to(tl.float32) + rv.to(tl.float32)).to(xv.dtype)
            tl.store(s_ptr + ts[:, None] * K + kk[None, :], xv, mask=write[:, None] & km[None, :])
        if not NORMED:
            return xv
        wf = 1.0 + tl.load(lw_ptr + kk, mask=km, other=0.0).to(tl.float32)
        return (xv.to(tl.float32) * inv[:, None] * wf[None, :]).to(xv.dtype)

    @triton.jit
    def _norm_rows(x_ptr, r_ptr, lw_ptr, s_ptr, ts, tm, kk, km, stride_x, stride_r, K, eps, write,
                   RES: tl.constexpr):
        """rms_norm(x + r) (RES; else x) of whole rows (kk spans K), rounded as add_rms_norm rounds; x + r stored
        to s at rows where write [TP] holds. Also the router kernel's prologue (kernels/moe_route.py)."""
        xv = _normed(x_ptr, r_ptr, lw_ptr, s_ptr, ts, tm, kk, km, tl.zeros([1], dtype=tl.float32), stride_x,
                     stride_r, K, write, RES, False)
        xf = xv.to(tl.float32)
        inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 1) / K + eps)
        wf = 1.0 + tl.load(lw_ptr + kk, mask=km, other=0.0).to(tl.float32)
        return (xf * inv[:, None] * wf[None, :]).to(xv.dtype)

    @triton.jit
    def _row_block(w_ptr, blk, BN: tl.constexpr, kk, N, K):
        """The [BN, BK] weights of row block blk at columns kk (rows past N and columns past K masked: no
        traffic)."""
        n = blk * BN + tl.arange(0, BN)
        return tl.load(w_ptr + n[:, None].to(tl.int64) * K + kk[None, :], mask=(n < N)[:, None] & (kk < K)[None, :],
                       other=0.0)

    @triton.jit
    def _dot_store(y_ptr, x1, w, ts, tm, n, N):
        """y[:, n] = x1 . w for one row block (the whole row of K at once), accumulated in float32 and rounded."""
        acc = tl.sum(x1[:, None, :] * w.to(tl.float32)[None, :, :], 2)
        tl.store(y_ptr + ts[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=tm[:, None] & (n < N)[None, :])

    @triton.jit
    def _gemv_kernel(x_ptr, r_ptr, lw_ptr, s_ptr, w_ptr, y_ptr, stride_x, stride_r, T, N, K, eps,
                     TP: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, NORM: tl.constexpr, RES: tl.constexpr,
                     ONE: tl.constexpr, PREF: tl.constexpr, PRE: tl.constexpr, PDL: tl.constexpr):
        """Program p: y[:, n] for the row blocks p, p + programs, ... (BN rows n of W each), every input row at
        once. NORM: the input rows are rms_norm(x + r) (x + r when RES, else x). ONE (BK >= K): the input rows are
        loaded (and normed) once, after the weights of the program's first row block (issued before PDL's wait: they
        stream while the kernel before finishes); else their mean square is taken in a first pass over K and the
        normed chunks are recomputed inside each row block. PREF (ONE, a persistent grid): the weights of the
        program's next row block are loaded before the current one is reduced, the second block's before the wait
        too. PRE (K in steps, no norm): the first K step of the program's first block is loaded before the wait."""
        pid = tl.program_id(0)
        ts = tl.arange(0, TP)
        tm = ts < T
        k1 = tl.arange(0, BK)
        first = tm & (ts * 0 + pid == 0)        # program 0 writes the new residual
        inv = tl.zeros([TP], dtype=tl.float32)
        start = pid
        if ONE:   # the whole input row at once: x + r, its mean square and the normed row, all in registers
            n = pid * BN + tl.arange(0, BN)
            w = _row_block(w_ptr, pid, BN, k1, N, K)
            if PREF:
                w_next = _row_block(w_ptr, pid + tl.num_programs(0), BN, k1, N, K)
            pdl_enter(PDL)
            if NORM:
                x1 = _norm_rows(x_ptr, r_ptr, lw_ptr, s_ptr, ts, tm, k1, k1 < K, stride_x, stride_r, K, eps, first,
                                RES).to(tl.float32)
            else:
                x1 = tl.load(x_ptr + ts[:, None] * stride_x + k1[None, :], mask=tm[:, None] & (k1 < K)[None, :],
                             other=0.0).to(tl.float32)
            _dot_store(y_ptr, x1, w, ts, tm, n, N)
            start += tl.num_programs(0)
            if PREF:      # two blocks in flight: the next one's load issued before this one is reduced
                for blk in range(start, tl.cdiv(N, BN), tl.num_programs(0)):
                    w = w_next
                    w_next = _row_block(w_ptr, blk + tl.num_programs(0), BN, k1, N, K)
                    _dot_store(y_ptr, x1, w, ts, tm, blk * BN + tl.arange(0, BN), N)
        elif NORM:
            pdl_enter(PDL)
            ss = tl.zeros([TP], dtype=tl.float32)
            for k0 in range(0, K, BK):
                kk = k0 + k1
                xv = _normed(x_ptr, r_ptr, lw_ptr, s_ptr, ts, tm, kk, kk < K, inv, stride_x, stride_r, K, ts < 0,
                             RES, False).to(tl.float32)
                ss += tl.sum(xv * xv, 1)
            inv = 1.0 / tl.sqrt(ss / K + eps)
        else:
            if PRE:
                w0 = _row_block(w_ptr, pid, BN, k1, N, K)      # its first K step (k1 < BK < K)
            pdl_enter(PDL)
        if not PREF:     # (PREF ran every block above)
            for blk in range(start, tl.cdiv(N, BN), tl.num_programs(0)):
                n = blk * BN + tl.arange(0, BN)
                nm = n < N
                acc = tl.zeros([TP, BN], dtype=tl.float32)
                k_lo = pid * 0
                if PRE:
                    if blk == pid:      # the first block: its first K step's weights are in w0
                        xv = _normed(x_ptr, r_ptr, lw_ptr, s_ptr, ts, tm, k1, k1 < K, inv, stride_x, stride_r, K,
                                     ts < 0, RES, NORM).to(tl.float32)
                        acc += tl.sum(xv[:, None, :] * w0.to(tl.float32)[None, :, :], 2)
                        k_lo += BK
                for k0 in range(k_lo, K, BK):
                    kk = k0 + k1
                    km = kk < K
                    w = _row_block(w_ptr, blk, BN, kk, N, K)
                    if ONE:
                        xv = x1
                    else:
                        xv = _normed(x_ptr, r_ptr, lw_ptr, s_ptr, ts, tm, kk, km, inv, stride_x, stride_r, K,
                                     first & (ts * 0 + blk == pid), RES, NORM).to(tl.float32)
                    acc += tl.sum(xv[:, None, :] * w.to(tl.float32)[None, :, :], 2)
                tl.store(y_ptr + ts[:, None] * N + n[None, :], acc.to(y_ptr.dtype.element_ty),
                         mask=tm[:, None] & nm[None, :])
