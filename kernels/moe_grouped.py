"""The many-pairs path of kernels/fused_moe.py: (row, expert) pairs sorted by expert into blocks of BM rows
(kernels/moe_align.py), a grouped GEMM per block with silu-mul in the gate|up epilogue and the routing weight in the
down epilogue. Static shapes: a CUDA graph captures it. Runs in stage processes.
"""
from __future__ import annotations

import torch

from memra_pp.kernels.fused_decode import triton
from memra_pp.kernels.moe_align import align

if triton is not None:
    import triton.language as tl


# -- grouped GEMM over pairs sorted by expert -----------------------------------------------------------------------
CONFIG_BOUNDS = (2048, 16384)     # pairs up to which grouped_config picks its first, then its second blocks


def grouped_config(n_pairs: int) -> tuple[int, int, int]:
    """(BM, BN, BK): small blocks where experts see few rows each, larger where they see many (the best of
    benchmarks/moe_kernels.py's sweep on an H200 at 35B-A3B: 64 and 256 rows, 1024, 4096)."""
    if n_pairs <= CONFIG_BOUNDS[0]:
        return 16, 64, 128
    if n_pairs <= CONFIG_BOUNDS[1]:
        return 64, 64, 64
    return 64, 128, 64


def moe_grouped(x, w_gu, w_d, topw, topi, config=None):
    T, H = x.shape
    k = topi.shape[1]
    E, I2, _ = w_gu.shape
    I = I2 // 2
    N = T * k
    BM, BN, BK = config or grouped_config(N)
    sorted_pairs, block_expert = align(topi, E, BM)
    P = sorted_pairs.numel()
    h = torch.empty(P, I, dtype=x.dtype, device=x.device)
    ieee = x.dtype == torch.float32      # fp32 activations: IEEE dots (no TF32), as the reference
    _grouped_gate_up_kernel[(P // BM, triton.cdiv(I, BN))](
        x, w_gu, sorted_pairs, block_expert, h, x.stride(0), N, H, I, E, K=k, BM=BM, BN=BN, BK=BK, IEEE=ieee,
        num_warps=4)
    y = torch.empty(N, H, dtype=x.dtype, device=x.device)
    _grouped_down_kernel[(P // BM, triton.cdiv(H, BN))](
        h, w_d, sorted_pairs, block_expert, topw, y, N, H, I, E, BM=BM, BN=BN, BK=BK, IEEE=ieee, num_warps=4)
    return y.view(T, k, H).sum(1)


if triton is not None:
    @triton.jit
    def _silu_mul(acc_g, acc_u, dt: tl.constexpr):
        """silu(gate) * up in dt from the float32 sums of gate and up, rounded as the torch references round (each
        sum, the silu and the product to dt); also the per-pair and block kernels' (fused_moe.py, moe_block.py)."""
        g = acc_g.to(dt).to(tl.float32)
        u = acc_u.to(dt).to(tl.float32)
        s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
        return (s * u).to(dt)

    @triton.jit
    def _dot(a, b, acc, IEEE: tl.constexpr):
        if IEEE:
            return tl.dot(a, b, acc, input_precision="ieee")
        return tl.dot(a, b, acc)

    # N (the pairs) unspecialised: every prefill size shares one binary per config (a variant compiled mid-run holds
    # up every request waiting on that step)
    @triton.jit(do_not_specialize=["N"])
    def _grouped_gate_up_kernel(x_ptr, w_ptr, sp_ptr, be_ptr, h_ptr, stride_x, N, H, I, E, K: tl.constexpr,
                                BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
        """Program (block, tile of I): h[rows, n] = silu(x[rows] W_e[n]^T) * (x[rows] W_e[I + n]^T)."""
        b = tl.program_id(0)
        e = tl.load(be_ptr + b)
        if e >= E:
            return
        rows = (b * BM + tl.arange(0, BM)).to(tl.int64)     # int64: rows x I passes 2^31 in long prefills
        pair = tl.load(sp_ptr + rows)
        valid = pair < N
        t = (pair // K).to(tl.int64)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < I
        w_e = w_ptr + e.to(tl.int64) * (2 * I * H)
        acc_g = tl.zeros([BM, BN], dtype=tl.float32)
        acc_u = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < H
            xk = tl.load(x_ptr + t[:, None] * stride_x + kk[None, :], mask=valid[:, None] & km[None, :], other=0.0)
            m2 = km[:, None] & nm[None, :]
            wg = tl.load(w_e + n[None, :] * H + kk[:, None], mask=m2, other=0.0)       # [BK, BN]
            wu = tl.load(w_e + (I + n)[None, :] * H + kk[:, None], mask=m2, other=0.0)
            acc_g = _dot(xk, wg, acc_g, IEEE)
            acc_u = _dot(xk, wu, acc_u, IEEE)
        tl.store(h_ptr + rows[:, None] * I + n[None, :], _silu_mul(acc_g, acc_u, h_ptr.dtype.element_ty),
                 mask=valid[:, None] & nm[None, :])

    @triton.jit(do_not_specialize=["N"])
    def _grouped_down_kernel(h_ptr, w_ptr, sp_ptr, be_ptr, tw_ptr, y_ptr, N, H, I, E, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, IEEE: tl.constexpr):
        """Program (block, tile of H): y[pair, n] = w[pair] * (h[rows] Wd_e[n]^T), rounded as the reference."""
        b = tl.program_id(0)
        e = tl.load(be_ptr + b)
        if e >= E:
            return
        rows = (b * BM + tl.arange(0, BM)).to(tl.int64)     # int64: rows x I passes 2^31 in long prefills
        pair = tl.load(sp_ptr + rows)
        valid = pair < N
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < H
        w_e = w_ptr + e.to(tl.int64) * (H * I)
        acc = tl.zeros([BM, BN], dtype=tl.float32)
        for k0 in range(0, I, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < I
            hk = tl.load(h_ptr + rows[:, None] * I + kk[None, :], mask=valid[:, None] & km[None, :], other=0.0)
            wd = tl.load(w_e + n[None, :] * I + kk[:, None], mask=km[:, None] & nm[None, :], other=0.0)
            acc = _dot(hk, wd, acc, IEEE)
        dt = y_ptr.dtype.element_ty
        tw = tl.load(tw_ptr + pair, mask=valid, other=0.0).to(tl.float32)
        y = (acc.to(dt).to(tl.float32) * tw[:, None]).to(dt)
        tl.store(y_ptr + pair.to(tl.int64)[:, None] * H + n[None, :], y, mask=valid[:, None] & nm[None, :])
