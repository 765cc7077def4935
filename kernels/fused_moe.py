"""Fused MoE kernels: the routed experts of a MoE layer without copying any expert's weights and without running
an expert on a row not routed to it.

- route, router_route, norm_router_route (kernels/moe_route.py): softmax over the router logits, top-k, weights
  renormalised (the router GEMV, and the MoE's input norm, in the same kernel for one row).
- moe_experts: sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = idx[t, j], as two kernels:
  - few (row, expert) pairs (decode batches): one program per pair and output tile, a matrix-vector product that
    reads each routed expert's weights once where they lie (the gathered path copied them out first: 3x the bytes);
    the down kernel sums a row's k pairs in registers, so nothing else runs after it; the shared expert rides
    along as one more pair per row, its sigmoid gate computed once by a gate|up program (SHARED_GATE_EARLY) and
    applied in the down kernel;
  - many pairs (large decode batches, prefill): pairs sorted by expert into blocks of BM rows (every block one
    expert, padded; kernels/moe_align.py), a grouped GEMM per block (tl.dot; kernels/moe_grouped.py), silu-mul
    fused into the gate|up GEMM's epilogue and the routing weight into the down GEMM's. Static shapes throughout:
    a CUDA graph captures it (no host sync).
- a decode graph's padding rows are routed to no expert (ids E, weights 0: route's `live`, which the graphs pass
  where decode_graphs.SKIP_PADDING is on); both paths skip such pairs, so a padding row reads no expert's weights.
  Its output is not defined (its input may be NaN: the Gated DeltaNet's skipped rows leave theirs unwritten) and
  nothing reads it; a real row's program never reads a padding row's input or pairs.

Rounding follows the torch reference (moe_experts_ref, what layers.MoE runs on CPU): gate|up and down outputs
rounded to the activation dtype, silu and the product rounded as torch's two ops round, the weighted pair outputs
rounded before the sum over k, which accumulates in float32. Runs in stage processes.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from memra_pp.kernels.fused_decode import _triton, pdl, triton
from memra_pp.kernels.moe_align import align, align_ref  # noqa: F401 - the alignment and its reference (tests)
from memra_pp.kernels.moe_grouped import grouped_config, moe_grouped  # noqa: F401 - many pairs
from memra_pp.kernels.moe_route import CALLS, norm_router_route, route, route_ref, router_route  # noqa: F401

if triton is not None:
    import triton.language as tl

    from memra_pp.kernels.fused_decode import pdl_enter
    from memra_pp.kernels.moe_grouped import _silu_mul

SMALL_PAIRS = 64       # at most this many (row, expert) pairs: the per-pair kernels, else the grouped GEMM
ENABLED = True         # False: layers.MoE's torch paths on CUDA too (benchmarks compare the two in one run)


# Benchmarks only (gpu_engine_step's norouter / nohop tokens; the MoE's outputs are then wrong): what the router's
# dependent kernel costs in the decode step, the most that moving it into out_proj's tail could save. "fixed": the
# add and norm alone (fused_decode.add_rms_norm) in the router kernel's place, every row routed to experts 0..k-1 at
# equal weights; "skip": no kernel at all, the experts read m as their normed row and h goes on unchanged. At more
# than one row the fixed routing reads fewer experts than a real one would: a premise for batch 1 only.
PREMISE_ROUTE = None
_PREMISE: dict = {}      # (rows, k, dtype, device) -> the fixed (weights, ids), made on the step before capture


def premise_route(h_BH, m_BH, w_norm, eps: float, k: int):
    """norm_router_route's (h, x, weights, ids) under PREMISE_ROUTE (benchmarks only)."""
    if PREMISE_ROUTE not in ("fixed", "skip"):
        raise ValueError(f"fused_moe.PREMISE_ROUTE is 'fixed' or 'skip', not {PREMISE_ROUTE!r}")
    key = (h_BH.shape[0], k, h_BH.dtype, h_BH.device)
    if key not in _PREMISE:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("premise_route's fixed routing is made on the warm-up step before a capture")
        B = h_BH.shape[0]
        _PREMISE[key] = (torch.full((B, k), 1.0 / k, dtype=h_BH.dtype, device=h_BH.device),
                         torch.arange(k, device=h_BH.device).repeat(B, 1))
    w, idx = _PREMISE[key]
    if PREMISE_ROUTE == "skip":
        return h_BH, m_BH, w, idx
    from memra_pp.kernels.fused_decode import add_rms_norm
    return (*add_rms_norm(h_BH, m_BH, w_norm, eps), w, idx)


def enabled(x: torch.Tensor, k: int) -> bool:
    """The fused path serves x (CUDA, or CPU under Triton's interpreter); route() keeps the torch routing where k
    is not a power of two."""
    return ENABLED and _triton(x)


# -- the routed experts ---------------------------------------------------------------------------------------------
def moe_experts_ref(x_TH, w_gu_EIH, w_d_EHI, topw_TK, topi_TK):
    """The torch reference: each pair's expert on its row (the rounding of layers.MoE._gathered)."""
    T, k = topi_TK.shape
    gate_up, down = w_gu_EIH[topi_TK.reshape(-1)], w_d_EHI[topi_TK.reshape(-1)]
    inter = down.shape[-1]
    gu = torch.bmm(gate_up, x_TH.repeat_interleave(k, 0)[:, :, None])[..., 0]
    h = F.silu(gu[:, :inter]) * gu[:, inter:]
    y = torch.bmm(down, h[:, :, None])[..., 0] * topw_TK.reshape(-1, 1)
    return y.view(T, k, -1).sum(1)


def shared_ref(x_TH, shared):
    """The sigmoid-gated shared expert: sigmoid(x . w_gate) * down(silu(gate(x)) * up(x)); shared = (gate|up
    [2Is, H], down [H, Is], gate [1, H])."""
    w_sgu, w_sd, w_sg = shared
    Is = w_sd.shape[1]
    gu = F.linear(x_TH, w_sgu)
    return torch.sigmoid(F.linear(x_TH, w_sg)) * F.linear(F.silu(gu[:, :Is]) * gu[:, Is:], w_sd)


def moe_ref(x_TH, w_gu_EIH, w_d_EHI, topw_TK, topi_TK, shared=None):
    out = moe_experts_ref(x_TH, w_gu_EIH, w_d_EHI, topw_TK, topi_TK)
    return out if shared is None else out + shared_ref(x_TH, shared)


def moe_experts(x_TH, w_gu_EIH, w_d_EHI, topw_TK, topi_TK, shared=None):
    """x [T, H]; gate|up weights [E, 2I, H], down [E, H, I]; routing weights [T, k] (x's dtype), ids [T, k].
    With `shared` (shared_ref's tuple) the shared expert's term is added: in the per-pair kernels as one more pair
    per row (its gate applied in the down kernel), else by torch ops."""
    if not _triton(x_TH):
        return moe_ref(x_TH, w_gu_EIH, w_d_EHI, topw_TK, topi_TK, shared)
    assert x_TH.stride(1) == 1 and w_gu_EIH.is_contiguous() and w_d_EHI.is_contiguous()
    topw_TK, topi_TK = topw_TK.contiguous(), topi_TK.contiguous()
    path = "small" if topi_TK.numel() <= SMALL_PAIRS else "grouped"
    CALLS[path] += 1
    if path == "small":
        return _moe_small(x_TH, w_gu_EIH, w_d_EHI, topw_TK, topi_TK, shared)
    out = moe_grouped(x_TH, w_gu_EIH, w_d_EHI, topw_TK, topi_TK)
    return out if shared is None else out + shared_ref(x_TH, shared)


# per-pair kernels: gate|up (BN, BK, warps), down (BN, BK, warps); picked by benchmarks/moe_kernels.py (H200,
# 35B-A3B, 2026-12-01, one row's 8 experts, 4 rows, 8: 20.1, 57.2, 101 us with the "loop" down kernel (55, 70, 110
# before these kernels); with the "tile" down kernel and BN 2: 16.8, 51.1, 90.1 us, with the shared expert riding
# along 20.2 us at one row against 23.9). Seventh session: gate|up 4 rows a program, 2 warps, 1,024 wide steps
# (1,152 programs where 288 filled 132 SMs 2.2 times): one row 13.0 us against 16.6, with the shared expert 17.5
# against 20.5. Ninth session, inside the whole step (gpu_engine_step.py -dnAxBxC modes): down 4 rows a program
# (512 programs) where 2 (1,024) took the step from 2.43-2.45 ms to 2.36-2.38 at one row, 6.32-6.35 to 6.15-6.17
# at eight
SMALL_TILES = (4, 1024, 2, 4, 512, 4)
# the down kernel: "loop" reads a row's pairs one after another (each pair a dependent round trip to memory: 12.9
# us for 19 MB a layer at batch 1, 34% of its bytes' time); "tile" loads every routed pair's slice as one
# [K, BN, I] tile, so all K loads are in flight at once (BK is then the widest expert it takes; wider: "loop")
SMALL_DOWN = "tile"
# the shared expert's sigmoid gate computed once, by one gate|up program, for the down kernel to load (False: every
# down program computes it, a 2,048-long dot product after its weights arrive; the benchmarks compare)
SHARED_GATE_EARLY = True
# the shared pair's gate|up programs load their first K step of its (static) weights before PDL's wait, as the down
# kernel loads its shared slice (False: after it). Not yet measured in the step: off until a device run says it pays
SHARED_BEFORE_WAIT = False
# the tile down kernel loads the routed ids and weights before PDL's wait: the router wrote them two kernels back,
# which every kernel has finished once the gate|up kernel has passed its own wait (fused_decode.pdl_enter), so after
# the wait the down slices' loads are issued at once instead of one round trip later. Only the ids: the slices
# themselves before the wait lost (eleventh session, results/down-before-wait-tried-2026-12-01-s11.diff)
DOWN_IDS_BEFORE_WAIT = True
# the tile down kernel's last launch (Triton's compiled kernel: benchmarks read its registers, which set how many of
# its programs a multiprocessor holds: 108 on the H200's Triton at the 35B-A3B's one-row tile, four a multiprocessor,
# every one of the 512 programs resident at once; fifteenth session)
LAST_DOWN = None


def _moe_small(x, w_gu, w_d, topw, topi, shared=None, tiles=None, down=None):
    T, H = x.shape
    k = topi.shape[1]
    E, I2, _ = w_gu.shape
    I = I2 // 2
    BN, BK, warps, BN2, BK2, warps2 = tiles or SMALL_TILES
    S = shared is not None
    w_sgu, w_sd, w_sg = shared if S else (w_gu, w_d, x)         # placeholders when there is no shared expert
    Is = w_sd.shape[1] if S else I
    assert not S or (w_sgu.is_contiguous() and w_sd.is_contiguous() and w_sg.is_contiguous())
    IH = max(I, Is)
    h = torch.empty(T * (k + S), IH, dtype=x.dtype, device=x.device)
    SG = S and SHARED_GATE_EARLY
    sg = torch.empty(T, dtype=x.dtype, device=x.device) if SG else h      # the shared gate a row (SG)
    BH = triton.next_power_of_2(H)
    # topi and topw are written before this launch (a router kernel, torch ops, a copy), never between it and the
    # down kernel's: the down kernel reads them before its PDL wait (DOWN_IDS_BEFORE_WAIT)
    _small_gate_up_kernel[(T * (k + S), triton.cdiv(IH, BN))](
        x, w_gu, w_sgu, w_sg, sg, topi, h, x.stride(0), H, I, Is, IH, E, K=k, S=S, SG=SG,
        SPRE=S and SHARED_BEFORE_WAIT, BN=BN, BK=BK, BH=BH, num_warps=warps, **pdl(x))
    CALLS["shared_gate"] += SG
    out = torch.empty(T, H, dtype=x.dtype, device=x.device)
    BI, BIs = triton.next_power_of_2(I), triton.next_power_of_2(Is)
    if (down or SMALL_DOWN) == "tile" and max(BI, BIs) <= BK2:
        global LAST_DOWN
        CALLS["down_tile"] += 1
        LAST_DOWN = _small_down_tile_kernel[(T, triton.cdiv(H, BN2))](
            h, w_d, w_sd, x, w_sg, sg, topi, topw, out, x.stride(0), H, I, Is, IH, E, K=k,
            KP=triton.next_power_of_2(k), S=S, SG=SG, IDPRE=DOWN_IDS_BEFORE_WAIT, BN=BN2, BI=BI, BIS=BIs, BH=BH,
            num_warps=warps2, **pdl(x))
        return out
    _small_down_kernel[(T, triton.cdiv(H, BN2))](
        h, w_d, w_sd, x, w_sg, sg, topi, topw, out, x.stride(0), H, I, Is, IH, E, K=k, S=S, SG=SG, BN=BN2, BK=BK2,
        BH=BH, num_warps=warps2, **pdl(x))
    return out


if triton is not None:
    @triton.jit
    def _small_gate_up_kernel(x_ptr, w_ptr, ws_ptr, wsg_ptr, sg_ptr, i_ptr, h_ptr, stride_x, H, I, Is, IH, E,
                              K: tl.constexpr, S: tl.constexpr, SG: tl.constexpr, SPRE: tl.constexpr,
                              BN: tl.constexpr, BK: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
        """Program (row t, pair j, tile of the width): h[t*(K+S) + j, n] = silu(x_t . W[n]) * (x_t . W[I + n]),
        W the j-th routed expert's gate|up, or for j = K (S: a shared expert) the shared expert's. SG: the shared
        pair's first program also stores the row's shared gate sigmoid(x_t . w_gate) to sg[t] (_shared_gate). SPRE:
        the shared pair's programs load their first K step of its weights before PDL's wait. Every program passes
        pdl_enter before it can return: the down kernel after it relies on that (DOWN_IDS_BEFORE_WAIT). A pair whose
        id is E or more (a padding row's: route's `live`) loads no weights (its h row: zeros where x_t is finite)."""
        r = tl.program_id(0)
        t = r // (K + S)
        j = r % (K + S)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        if SPRE:      # static weights: the shared pair's first K step streams while the kernel before finishes
            k0s = tl.arange(0, BK)
            pm = ((n < Is) & (n * 0 + j == K))[:, None] & (k0s < H)[None, :]     # (vector compares: see gemv)
            pg, pu = _gate_up_rows(ws_ptr, Is, n, k0s, H, pm)
        pdl_enter(PDL)
        if SG:
            if (j == K) & (tl.program_id(1) == 0):
                tl.store(sg_ptr + t, _shared_gate(x_ptr + t * stride_x, wsg_ptr, H, h_ptr.dtype.element_ty, BH)
                         .to(sg_ptr.dtype.element_ty))
        if j < K:
            e = tl.load(i_ptr + t * K + j).to(tl.int64)
            w_e = w_ptr + e * (2 * I * H)
            width = I
            lm = (n < width) & (n * 0 + e < E)      # a padding row's pair: no weights loaded, its h row stored
        else:
            w_e = ws_ptr
            width = Is
            lm = n < width
        nm = n < width
        acc_g = tl.zeros([BN], dtype=tl.float32)
        acc_u = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, H, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < H
            xk = tl.load(x_ptr + t * stride_x + kk, mask=km, other=0.0).to(tl.float32)
            m2 = lm[:, None] & km[None, :]
            if SPRE:      # the shared pair's first step was loaded before the wait: its load here is masked off
                load = ((n * 0 + j != K) | (n * 0 + k0 != 0))[:, None]
                wg, wu = _gate_up_rows(w_e, width, n, kk, H, m2 & load)
                wg, wu = tl.where(load, wg, pg), tl.where(load, wu, pu)
            else:
                wg, wu = _gate_up_rows(w_e, width, n, kk, H, m2)
            acc_g += tl.sum(wg.to(tl.float32) * xk[None, :], 1)
            acc_u += tl.sum(wu.to(tl.float32) * xk[None, :], 1)
        tl.store(h_ptr + r * IH + n, _silu_mul(acc_g, acc_u, h_ptr.dtype.element_ty), mask=nm)

    @triton.jit
    def _gate_up_rows(w_e, width, n, kk, H, mask):
        """An expert's gate rows n and up rows width + n at columns kk, in its dtype ([BN, BK] each, masked)."""
        return (tl.load(w_e + n[:, None] * H + kk[None, :], mask=mask, other=0.0),
                tl.load(w_e + (width + n)[:, None] * H + kk[None, :], mask=mask, other=0.0))

    @triton.jit
    def _row_dot(hrow, w, n, nm, width, BN: tl.constexpr, BK: tl.constexpr):
        """[BN] float32: rows n of the [*, width] matrix w dotted with the h row `hrow` (width entries)."""
        acc = tl.zeros([BN], dtype=tl.float32)
        for k0 in range(0, width, BK):
            kk = k0 + tl.arange(0, BK)
            km = kk < width
            hk = tl.load(hrow + kk, mask=km, other=0.0).to(tl.float32)
            wd = tl.load(w + n[:, None] * width + kk[None, :], mask=nm[:, None] & km[None, :], other=0.0)
            acc += tl.sum(wd.to(tl.float32) * hk[None, :], 1)
        return acc

    @triton.jit
    def _small_down_kernel(h_ptr, w_ptr, ws_ptr, x_ptr, wsg_ptr, sg_ptr, i_ptr, tw_ptr, o_ptr, stride_x, H, I, Is,
                           IH, E, K: tl.constexpr, S: tl.constexpr, SG: tl.constexpr, BN: tl.constexpr,
                           BK: tl.constexpr, BH: tl.constexpr, PDL: tl.constexpr):
        """Program (row, tile of H): out[t, n] = sum_j w[t, j] * (h[t, j] . Wd[e_j, n]), each pair's product
        rounded to the dtype before the float32 sum (as moe_experts_ref rounds); S: plus
        sigmoid(x_t . w_gate) * (h[t, K] . Wd_shared[n]), rounded as shared_ref's torch ops round (SG: the gate
        loaded from sg, where the gate|up kernel stored it). A pair whose id is E or more loads nothing (its
        routing weight is 0: route's `live`)."""
        pdl_enter(PDL)
        t = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < H
        dt = o_ptr.dtype.element_ty
        total = tl.zeros([BN], dtype=tl.float32)
        for j in tl.static_range(K):
            e = tl.load(i_ptr + t * K + j).to(tl.int64)
            w_e = w_ptr + e * (H * I)
            acc = _row_dot(h_ptr + (t * (K + S) + j) * IH, w_e, n, nm & (n * 0 + e < E), I, BN, BK)
            tw = tl.load(tw_ptr + t * K + j).to(tl.float32)
            total += _weighted(acc, tw, dt)
        if S:
            acc = _row_dot(h_ptr + (t * (K + S) + K) * IH, ws_ptr, n, nm, Is, BN, BK)
            if SG:
                sig = tl.load(sg_ptr + t).to(tl.float32)
            else:
                sig = _shared_gate(x_ptr + t * stride_x, wsg_ptr, H, dt, BH)
            total = _plus_shared(total, acc, sig, dt)
        tl.store(o_ptr + t * H + n, total.to(dt), mask=nm)

    @triton.jit
    def _shared_gate(xrow, wsg_ptr, H, dt: tl.constexpr, BH: tl.constexpr):
        """sigmoid(x . w_gate) of one row, rounded as shared_ref's torch ops round (the dot, then the sigmoid),
        as float32."""
        hh = tl.arange(0, BH)
        xr = tl.load(xrow + hh, mask=hh < H, other=0.0).to(tl.float32)
        gw = tl.load(wsg_ptr + hh, mask=hh < H, other=0.0).to(tl.float32)
        return _sigmoid_gate(tl.sum(xr * gw, 0), dt)

    @triton.jit
    def _sigmoid_gate(dot, dt: tl.constexpr):
        """sigmoid of the shared gate's float32 dot product, rounded as shared_ref's torch ops round (the dot, then
        the sigmoid), as float32; also the block kernel's (moe_block.py)."""
        gate = dot.to(dt).to(tl.float32)
        return (1.0 / (1.0 + tl.exp(-gate))).to(dt).to(tl.float32)

    @triton.jit
    def _weighted(acc, tw, dt: tl.constexpr):
        """A routed pair's float32 down product rounded, times its routing weight tw (float32), rounded, as float32:
        what moe_experts_ref sums over k (also the block kernel's)."""
        return (acc.to(dt).to(tl.float32) * tw).to(dt).to(tl.float32)

    @triton.jit
    def _plus_shared(total, acc, sig, dt: tl.constexpr):
        """total (the routed pairs' float32 sum) rounded, plus sig * acc (the shared gate times the shared expert's
        down product), rounded as shared_ref's torch ops round."""
        term = (sig * acc.to(dt).to(tl.float32)).to(dt).to(tl.float32)
        return total.to(dt).to(tl.float32) + term

    @triton.jit
    def _small_down_tile_kernel(h_ptr, w_ptr, ws_ptr, x_ptr, wsg_ptr, sg_ptr, i_ptr, tw_ptr, o_ptr, stride_x, H, I,
                                Is, IH, E, K: tl.constexpr, KP: tl.constexpr, S: tl.constexpr, SG: tl.constexpr,
                                IDPRE: tl.constexpr, BN: tl.constexpr, BI: tl.constexpr, BIS: tl.constexpr,
                                BH: tl.constexpr, PDL: tl.constexpr):
        """_small_down_kernel's sum with every routed pair's [BN, I] slice of its expert loaded as one [KP, BN, BI]
        tile (and the shared expert's beside it) before any is reduced: the loads are in flight together. The shared
        expert's slice is loaded before PDL's wait; IDPRE: the routed ids and weights too (the router's, two kernels
        back: DOWN_IDS_BEFORE_WAIT), else after it. SG: the shared gate is loaded (the gate|up kernel computed it),
        else computed here. A pair whose id is E or more loads nothing (a padding row's: route's `live`)."""
        t = tl.program_id(0)
        n = tl.program_id(1) * BN + tl.arange(0, BN)
        nm = n < H
        dt = o_ptr.dtype.element_ty
        if S:
            jj = tl.arange(0, BIS)
            jm = jj < Is
            ws = tl.load(ws_ptr + n[:, None] * Is + jj[None, :], mask=nm[:, None] & jm[None, :], other=0.0)
        ks = tl.arange(0, KP)
        kv = ks < K
        if IDPRE:
            e = tl.load(i_ptr + t * K + ks, mask=kv, other=0).to(tl.int64)
            tw = tl.load(tw_ptr + t * K + ks, mask=kv, other=0.0).to(tl.float32)
        pdl_enter(PDL)
        if SG:
            sig = tl.load(sg_ptr + t).to(tl.float32)       # beside the ids (IDPRE: beside the slices' loads)
        if not IDPRE:
            e = tl.load(i_ptr + t * K + ks, mask=kv, other=0).to(tl.int64)
            tw = tl.load(tw_ptr + t * K + ks, mask=kv, other=0.0).to(tl.float32)
        ii = tl.arange(0, BI)
        im = ii < I
        w = tl.load(w_ptr + e[:, None, None] * (H * I) + n[None, :, None] * I + ii[None, None, :],
                    mask=(kv & (e < E))[:, None, None] & nm[None, :, None] & im[None, None, :], other=0.0)
        hp = tl.load(h_ptr + (t * (K + S) + ks)[:, None] * IH + ii[None, :], mask=kv[:, None] & im[None, :],
                     other=0.0).to(tl.float32)
        acc = tl.sum(w.to(tl.float32) * hp[:, None, :], 2)                                   # [KP, BN]
        y = _weighted(acc, tw[:, None], dt)
        total = tl.sum(tl.where(kv[:, None], y, 0.0), 0)
        if S:
            hs = tl.load(h_ptr + (t * (K + S) + K) * IH + jj, mask=jm, other=0.0).to(tl.float32)
            acc_s = tl.sum(ws.to(tl.float32) * hs[None, :], 1)
            if not SG:
                sig = _shared_gate(x_ptr + t * stride_x, wsg_ptr, H, dt, BH)
            total = _plus_shared(total, acc_s, sig, dt)
        tl.store(o_ptr + t * H + n, total.to(dt), mask=nm)
