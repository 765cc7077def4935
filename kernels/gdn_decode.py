"""The Gated DeltaNet decode step in place: one new token per sequence, the conv window (conv_step) and each
sequence's fp32 state read from its cache slot and written back to it (no gather and scatter of the 3 MB-per-layer
states: a third of the traffic); the decode graphs' and a mixed step's decode rows' form (gdn_decode_fused: gates
from the raw projections) and eager decode's (gdn_decode).

The recurrent kernel follows flash-linear-attention's fused recurrent kernel (which transformers runs) operation for
operation; with fla's tile (BK = K, BV = 8, one warp: gdn_decode) bf16 results are the ones transformers gets. The
torch references are the slow path on CPU. Runs in stage processes.
"""
from __future__ import annotations

import torch

from memra_pp.kernels.fused_decode import _triton, pdl, triton

if triton is not None:
    import triton.language as tl

    from memra_pp.kernels.fused_decode import pdl_enter

    @triton.jit
    def _conv_step_kernel(u, state, w, slots, y, su, C, K: tl.constexpr, BC: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        n = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        m = c < C
        slot = tl.load(slots + n).to(tl.int64)
        st = state + slot * C * (K - 1) + c * (K - 1)
        x_new = tl.load(u + n * su + c, mask=m, other=0)
        acc = tl.zeros([BC], dtype=tl.float32)
        for j in tl.static_range(K):
            if j < K - 1:
                xj = tl.load(st + j, mask=m, other=0).to(x_new.dtype)
            else:
                xj = x_new
            acc += xj.to(tl.float32) * tl.load(w + c * K + j, mask=m, other=0).to(tl.float32)
            if j >= 1:
                tl.store(st + (j - 1), xj.to(state.dtype.element_ty), mask=m)
        yv = acc.to(x_new.dtype).to(tl.float32)
        tl.store(y + n * C + c, (yv / (1.0 + tl.exp(-yv))).to(x_new.dtype), mask=m)


# the state tile (the step's largest read, 2 MB a layer a sequence at the 35B-A3B's heads) loaded before PDL's wait,
# with the slots. Safe because nothing that can still run writes them: every PDL kernel waits before it lets the next
# one launch (fused_decode.pdl_enter), so when this kernel starts, everything two or more kernels back has finished,
# and the kernel just before it (the conv step in the decode graphs, a torch op in eager decode, the gathers of
# the raw b and a rows in a mixed step's decode rows: linear_attention.GatedDeltaNet.forward) writes neither. A
# layer's state is written only by its own step kernel, in an earlier step or for other slots in the same one, by a
# prompt group's scatter (other slots, and issued after this kernel in a mixed step) and by cache resets, which
# never run inside a step; the slots are the step's input, copied in before its first kernel (the launch asserts
# they need no copy). Padding rows at the scratch slot skip the kernel (skip_slot: decode_graphs.SKIP_PADDING);
# where they do not, they share that slot's state and race inside the kernel as before. H200, 35B-A3B
# engine step with sampling, 2026-12-01, three interleaved pairs of 30 steps: batch 1 2.36 / 2.35 / 2.35 ms against
# 2.40 / 2.37 / 2.36 without it; batch 64 the same (18.98 ms)
STATE_BEFORE_WAIT = True
CALLS = {"state_before_wait": 0}    # launches with it (a captured graph counts once)


def gdn_decode_ref(q_BHK, k_BHK, v_BVD, g_BV, beta_BV, state_NVKD, slots_B, scale: float) -> torch.Tensor:
    """q, k [B, H, K] raw (l2-normalised here); v [B, HV, V]; g (log decay), beta [B, HV]; state_NVKD the slot
    pool [N, HV, K, V] float32, updated in place at rows slots_B. Returns o [B, HV, V] in v's dtype."""
    HV = v_BVD.shape[1]
    r = HV // q_BHK.shape[1]
    q = q_BHK.float().repeat_interleave(r, 1)
    k = k_BHK.float().repeat_interleave(r, 1)
    q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6) * scale
    k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    S = state_NVKD[slots_B].float() * g_BV.float().exp()[..., None, None]
    delta = beta_BV.float()[..., None] * (v_BVD.float() - torch.einsum("bhkv,bhk->bhv", S, k))
    S = S + k[..., :, None] * delta[..., None, :]
    state_NVKD[slots_B] = S
    return torch.einsum("bhkv,bhk->bhv", S, q).to(v_BVD.dtype)


if triton is not None:
    @triton.jit
    def _gdn_decode_kernel(q, k, v, g, beta, A_log, dt_bias, o, h, slots, skip, scale, sq, sk, sv, sg, sb,
                           H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr,
                           BV: tl.constexpr, RAW_GATES: tl.constexpr, EARLY: tl.constexpr, PDL: tl.constexpr):
        """Rows of q, k, v, g, beta at strides sq .. sb (views into one projection allowed). RAW_GATES: g and beta
        hold the raw a and b projections; the kernel computes beta = sigmoid(b) (rounded to b's dtype, as
        transformers rounds it) and g = -exp(A_log) softplus(a + dt_bias). EARLY: the state tile is loaded before
        PDL's wait (STATE_BEFORE_WAIT). A row whose slot is `skip` (a decode graph's padding rows, the scratch slot;
        -1: none) reads and writes no state and stores no output."""
        if not EARLY:
            pdl_enter(PDL)
        pid = tl.program_id(0).to(tl.int64)
        NV = tl.cdiv(V, BV)
        i_v, i_nh = pid % NV, pid // NV
        i_n, i_hv = i_nh // HV, i_nh % HV
        i_h = i_hv // (HV // H)
        slot = tl.load(slots + i_n).to(tl.int64)
        if slot == skip:
            if EARLY:
                pdl_enter(PDL)
            return
        o_k = tl.arange(0, BK)
        o_v = i_v * BV + tl.arange(0, BV)
        mask_k = o_k < K
        mask_v = o_v < V
        mask_h = mask_k[:, None] & mask_v[None, :]
        p_h = h + (slot * HV + i_hv) * K * V + o_k[:, None] * V + o_v[None, :]
        b_h = tl.zeros([BK, BV], dtype=tl.float32)
        b_h += tl.load(p_h, mask=mask_h, other=0).to(tl.float32)
        if EARLY:
            pdl_enter(PDL)
        b_q = tl.load(q + i_n * sq + i_h * K + o_k, mask=mask_k, other=0).to(tl.float32)
        b_k = tl.load(k + i_n * sk + i_h * K + o_k, mask=mask_k, other=0).to(tl.float32)
        b_v = tl.load(v + i_n * sv + i_hv * V + o_v, mask=mask_v, other=0).to(tl.float32)
        b_q = b_q / tl.sqrt(tl.sum(b_q * b_q) + 1e-6)
        b_k = b_k / tl.sqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale
        if RAW_GATES:
            braw = tl.load(beta + i_n * sb + i_hv)
            bf = braw.to(tl.float32)
            b_beta = (1.0 / (1.0 + tl.exp(-bf))).to(braw.dtype).to(tl.float32)
            x = tl.load(g + i_n * sg + i_hv).to(tl.float32) + tl.load(dt_bias + i_hv).to(tl.float32)
            # softplus as torch computes it (threshold 20, log1p): log1p(e) by its series where 1 + e would round
            e = tl.exp(-tl.abs(x))
            l1p = tl.where(e < 1e-2, e * (1.0 - e * (0.5 - e * (1.0 / 3.0 - 0.25 * e))), tl.log(1.0 + e))
            sp = tl.where(x > 20.0, x, tl.maximum(x, 0.0) + l1p)
            b_g = -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * sp
        else:
            b_beta = tl.load(beta + i_n * sb + i_hv).to(tl.float32)
            b_g = tl.load(g + i_n * sg + i_hv).to(tl.float32)
        b_h *= tl.exp(b_g)
        b_v = b_beta * (b_v - tl.sum(b_h * b_k[:, None], 0))
        b_h += b_k[:, None] * b_v
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(o + (i_n * HV + i_hv) * V + o_v, b_o.to(o.dtype.element_ty), mask=mask_v)
        tl.store(p_h, b_h.to(p_h.dtype.element_ty), mask=mask_h)


def launch_gdn_decode(q, k, v, g, beta, state_NVKD, slots_B, scale: float, H: int, tile: tuple[int, int],
                      raw_gates=None, skip_slot: int = -1) -> torch.Tensor:
    """The kernel over B rows: q, k [B, >= H*K], v [B, >= HV*V], g, beta [B, HV], each with unit last stride
    (views into one projection allowed). `raw_gates` = (A_log, dt_bias): g and beta are the raw a and b
    projections. `tile` = (BV, num_warps). Returns o [B, HV, V] in v's dtype; rows whose slot is `skip_slot` (a
    decode graph's padding rows) touch no state and their output rows are not defined."""
    B = v.shape[0]
    HV, K, V = state_NVKD.shape[1:]
    assert state_NVKD.dtype == torch.float32 and state_NVKD.is_contiguous()
    assert all(t.stride(-1) == 1 for t in (q, k, v, g, beta))
    o = torch.empty(B, HV, V, dtype=v.dtype, device=v.device)
    BK, BV = triton.next_power_of_2(K), min(tile[0], triton.next_power_of_2(V))
    A_log, dt_bias = raw_gates if raw_gates is not None else (g, g)      # unused without raw gates
    if STATE_BEFORE_WAIT:     # read before the wait: a copy made here would be the kernel just before this one
        assert slots_B.is_contiguous(), "the slots must need no copy when the state is read before PDL's wait"
        CALLS["state_before_wait"] += 1
    _gdn_decode_kernel[(triton.cdiv(V, BV) * B * HV,)](
        q, k, v, g, beta, A_log, dt_bias, o, state_NVKD, slots_B.contiguous(), skip_slot, scale, q.stride(0),
        k.stride(0), v.stride(0), g.stride(0), beta.stride(0), H=H, HV=HV, K=K, V=V, BK=BK, BV=BV,
        RAW_GATES=raw_gates is not None, EARLY=STATE_BEFORE_WAIT, num_warps=tile[1], num_stages=3, **pdl(v))
    return o


def gdn_decode(q_BHK, k_BHK, v_BVD, g_BV, beta_BV, state_NVKD, slots_B, scale: float) -> torch.Tensor:
    """The in-place decode step: the Triton kernel on CUDA, the torch reference elsewhere (same contract)."""
    if triton is None or not v_BVD.is_cuda:
        return gdn_decode_ref(q_BHK, k_BHK, v_BVD, g_BV, beta_BV, state_NVKD, slots_B, scale)
    return gdn_decode_triton(q_BHK, k_BHK, v_BVD, g_BV, beta_BV, state_NVKD, slots_B, scale)


def gdn_decode_triton(q_BHK, k_BHK, v_BVD, g_BV, beta_BV, state_NVKD, slots_B, scale: float) -> torch.Tensor:
    B, H, K = k_BHK.shape
    HV, V = v_BVD.shape[1], v_BVD.shape[2]
    assert tuple(state_NVKD.shape[1:]) == (HV, K, V), f"state pool {tuple(state_NVKD.shape)} vs {(HV, K, V)}"
    return launch_gdn_decode(q_BHK.reshape(B, H * K), k_BHK.reshape(B, H * K), v_BVD.reshape(B, HV * V),
                             g_BV.float().contiguous(), beta_BV.contiguous(), state_NVKD, slots_B, scale, H,
                             tile=(8, 1))   # fla's tile: bf16 results equal to the fla kernel transformers runs


# -- causal conv step -----------------------------------------------------------------------------------------------
def conv_step_ref(u_BC, state_NCK1, w_CK, slots_B):
    """gdn.causal_conv_step over the slot pool: y = silu(conv([state, u])), the state window shifted in place."""
    from memra_pp.model.gdn import causal_conv_step
    y, state_NCK1[slots_B] = causal_conv_step(u_BC, w_CK, state_NCK1[slots_B])
    return y


def conv_step(u_BC, state_NCK1, w_CK, slots_B):
    """u [B, C] with unit last stride (a view into the projection); state pool [N, C, K-1]; w [C, K]."""
    if not _triton(u_BC):
        return conv_step_ref(u_BC, state_NCK1, w_CK, slots_B)
    B, C = u_BC.shape
    K = w_CK.shape[1]
    assert state_NCK1.is_contiguous() and w_CK.is_contiguous() and u_BC.stride(1) == 1
    y = torch.empty(B, C, dtype=u_BC.dtype, device=u_BC.device)
    BC = 256
    _conv_step_kernel[(B, triton.cdiv(C, BC))](u_BC, state_NCK1, w_CK, slots_B, y, u_BC.stride(0), C, K=K, BC=BC,
                                               num_warps=2, **pdl(u_BC))
    return y


# -- the Gated DeltaNet step from raw projections ---------------------------------------------------------------------
GDN_TILE = {1: (32, 2)}   # batch -> (BV, num_warps), the nearest batch at or below applies (benchmarks/gpu_kernels.py)


def gdn_decode_fused(y_BC, b_BV, a_BV, A_log, dt_bias, state_NVKD, slots_B, nk: int, scale: float,
                     tile: tuple[int, int] | None = None, skip_slot: int = -1):
    """y [B, C] = q | k | v after the conv (q, k [nk * K], v [HV * V]); b, a [B, HV] raw projections (views).
    Returns o [B, HV, V] in y's dtype; the fp32 state pool is updated in place at slots_B. `skip_slot`: a slot
    whose rows (a decode graph's padding rows, at the scratch slot) the Triton kernel skips (-1: none; the torch
    reference runs every row)."""
    from memra_pp.model.gdn import gdn_gates
    B = y_BC.shape[0]
    HV, K, V = state_NVKD.shape[1:]
    if not _triton(y_BC):
        g, beta = gdn_gates(b_BV, a_BV, A_log, dt_bias)
        q, k, v = torch.split(y_BC, [nk * K, nk * K, HV * V], -1)
        return gdn_decode_ref(q.reshape(B, nk, K), k.reshape(B, nk, K), v.reshape(B, HV, V), g, beta, state_NVKD,
                              slots_B, scale)
    assert y_BC.stride(1) == 1
    tile = tile or GDN_TILE[max(k for k in GDN_TILE if k <= B) if B >= min(GDN_TILE) else min(GDN_TILE)]
    return launch_gdn_decode(y_BC, y_BC[:, nk * K:], y_BC[:, 2 * nk * K:], a_BV, b_BV, state_NVKD, slots_B, scale,
                             nk, tile, raw_gates=(A_log, dt_bias), skip_slot=skip_slot)
