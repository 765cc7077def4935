"""The routing of a MoE layer (kernels/fused_moe.py): softmax over the router logits in float32, top-k, weights
renormalised. route() is one program per row; router_route() computes the router GEMV in the same kernel for one
row. Also the MoE kernels' launch counters. Runs in stage processes."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from memra_pp.kernels.fused_decode import _triton, device_counters, pdl, triton

if triton is not None:
    import triton.language as tl

    from memra_pp.kernels.fused_decode import pdl_enter
    from memra_pp.kernels.gemv import _norm_rows

# host-side launches by path (a captured graph counts once)
CALLS = {"route": 0, "router": 0, "norm_router": 0, "small": 0, "grouped": 0, "down_tile": 0, "shared_gate": 0,
         "route_live": 0}


# -- routing --------------------------------------------------------------------------------------------------------
def route_ref(logits_TE: torch.Tensor, k: int, dtype: torch.dtype):
    """(weights [T, k] in dtype, expert ids [T, k] int64): softmax in float32, top-k, renormalised (layers.MoE)."""
    p = logits_TE.float().softmax(-1)
    w, idx = p.topk(k, dim=-1)
    return (w / w.sum(-1, keepdim=True)).to(dtype), idx


def route(logits_TE: torch.Tensor, k: int, dtype: torch.dtype, live: torch.Tensor | None = None):
    """The routing kernel, a program a row. `live` (integers [T] on the logits' device, or None: every row): a row
    whose entry is 0 is a decode graph's padding row, routed to no expert: its ids are E (past every expert: the
    experts' kernels and the alignment skip them) and its weights 0, so it reads no expert's weights. Where the torch
    reference routes (no Triton, more than 1,024 experts, k not a power of two) every row is routed."""
    if not _triton(logits_TE) or logits_TE.shape[1] > 1024 or k & (k - 1):
        return route_ref(logits_TE, k, dtype)
    T, E = logits_TE.shape
    assert logits_TE.stride(1) == 1
    assert live is None or (live.shape == (T,) and live.device == logits_TE.device), "live: one entry a row"
    CALLS["route"] += 1
    CALLS["route_live"] += live is not None
    w = torch.empty(T, k, dtype=dtype, device=logits_TE.device)
    idx = torch.empty(T, k, dtype=torch.int64, device=logits_TE.device)
    _route_kernel[(T,)](logits_TE, w, idx, logits_TE if live is None else live, logits_TE.stride(0), E, K=k,
                        BE=triton.next_power_of_2(E), LIVE=live is not None, num_warps=2, **pdl(logits_TE))
    return w, idx


if triton is not None:
    @triton.jit
    def _route_kernel(l_ptr, w_ptr, i_ptr, v_ptr, stride_l, E, K: tl.constexpr, BE: tl.constexpr,
                      LIVE: tl.constexpr, PDL: tl.constexpr):
        """LIVE: v_ptr holds a flag a row; a row whose flag is 0 gets ids E and weights 0 (route). The flag is loaded
        before PDL's wait (a decode graph's index block, copied in before the graph's first kernel) and tested after
        the logits' load is issued: the two loads are in flight together."""
        t = tl.program_id(0)
        if LIVE:
            alive = tl.load(v_ptr + t)
        pdl_enter(PDL)
        offs = tl.arange(0, BE)
        x = tl.load(l_ptr + t * stride_l + offs, mask=offs < E, other=float("-inf")).to(tl.float32)
        if LIVE:
            if alive == 0:
                ks = tl.arange(0, K)
                tl.store(w_ptr + t * K + ks, tl.zeros([K], dtype=w_ptr.dtype.element_ty))
                tl.store(i_ptr + t * K + ks, tl.zeros([K], dtype=tl.int64) + E)
                return
        _route_row(x, w_ptr + t * K, i_ptr + t * K, offs, E, K, BE)


# -- the router GEMV and the routing in one kernel (few rows) -----------------------------------------------------
# up to this many rows router_route's one kernel, else F.linear and route. H200, 35B-A3B, 2026-12-01 (moe_kernels.py,
# device time in a CUDA graph, the first ROUTER_CFG, (2, 512, 4)): 1 row 7.1 us against 8.4 us for the two; 2 rows
# 10.0 against 8.4, 8 rows 27.8: the last program routes the rows one after another, where route() has a program a
# row. The committed ROUTER_CFG took one row to 5.0 us; more rows were not re-measured with it
ROUTER_ROWS = 1
# device -> int32 [1]: router_route's programs done, reset by the last, for callers that bring none (tests,
# benchmarks). layers.MoE brings its own per layer. Two router kernels must never run at once on one counter: the
# count of one would end the other early, and the counter would stay off zero for good
_COUNTERS: dict = {}


# (experts a program, hidden a step, warps): one warp a program, 256 programs, the whole hidden in one load (H200,
# 35B-A3B, one row: 5.0 us; (2, 512, 4) 7.2 us, the router GEMV and route() as two kernels 8.3 us)
ROUTER_CFG = (1, 2048, 1)
NORM_ROUTER = True    # False: norm_router_route as add_rms_norm then router_route (benchmarks compare the two)


def router_route(x_TH: torch.Tensor, gate_EH: torch.Tensor, k: int, dtype: torch.dtype, cfg=None,
                 counter: torch.Tensor | None = None, live: torch.Tensor | None = None):
    """route(F.linear(x, gate), k, dtype). For few rows one kernel: each program computes a few experts' logits for
    every row (rounded to x's dtype as F.linear's output is), and the last program to finish routes every row (a
    counter in memory, reset by that program, so a CUDA graph replays it). cuBLAS gave the [T, 256] x [256, 2048]
    router four thread blocks (5.3 us at batch 1, the bytes' time is 0.25 us) and the routing was a second launch.
    `counter`: a zeroed int32 [1] on x's device that no other router kernel uses at the same time (None: one per
    device). `live`: route's, where route runs (the one-kernel path routes every row: it takes one row, and a decode
    graph of one row has no padding)."""
    if not _takes(x_TH, gate_EH, k, cfg):
        return route(F.linear(x_TH, gate_EH), k, dtype, live)
    return _launch(x_TH, None, None, 0.0, gate_EH, k, dtype, cfg, counter)[2:]


def norm_router_route(h_TH, res_TH, w_norm, eps: float, gate_EH, k: int, dtype, cfg=None, counter=None,
                      live=None):
    """(s, x, weights, ids) with s = h + res (h when res is None), x = rms_norm(s) (as fused_decode.add_rms_norm
    rounds both) and the routing of x (router_route): the MoE's input norm inside the router kernel, where the row
    fits one step of it; program 0 writes s and x for the expert kernels. Else add_rms_norm, then router_route (with
    `live`, router_route's)."""
    from memra_pp.kernels.fused_decode import add_rms_norm
    H = h_TH.shape[1]
    BK = (cfg or ROUTER_CFG)[1]
    if not (NORM_ROUTER and _takes(h_TH, gate_EH, k, cfg) and triton.next_power_of_2(H) <= BK
            and res_TH is not None and res_TH.stride(1) == 1 and w_norm.is_contiguous()):
        s, x = add_rms_norm(h_TH, res_TH, w_norm, eps)
        return (s, x, *router_route(x, gate_EH, k, dtype, cfg, counter, live))
    CALLS["norm_router"] += 1
    return _launch(h_TH, res_TH, w_norm, eps, gate_EH, k, dtype, cfg, counter)


def _takes(x_TH, gate_EH, k, cfg) -> bool:
    return (_triton(x_TH) and 0 < x_TH.shape[0] <= ROUTER_ROWS and gate_EH.shape[0] <= 1024 and not k & (k - 1)
            and x_TH.stride(1) == 1 and gate_EH.is_contiguous())


def _launch(x_TH, res_TH, w_norm, eps, gate_EH, k, dtype, cfg, counter):
    """The router kernel; with w_norm its input is rms_norm(x + res), written out with x + res: (s, x, w, idx)."""
    T, H = x_TH.shape
    E = gate_EH.shape[0]
    CALLS["route"] += 1
    CALLS["router"] += 1
    dev = x_TH.device
    logits = torch.empty(T, E, dtype=torch.float32, device=dev)
    w = torch.empty(T, k, dtype=dtype, device=dev)
    idx = torch.empty(T, k, dtype=torch.int64, device=dev)
    norm = w_norm is not None
    s = torch.empty(T, H, dtype=x_TH.dtype, device=dev) if norm else x_TH
    xn = torch.empty(T, H, dtype=x_TH.dtype, device=dev) if norm else x_TH
    r = res_TH if norm else x_TH
    BR, BK, warps = cfg or ROUTER_CFG
    cnt = device_counters(_COUNTERS, dev) if counter is None else counter
    _router_route_kernel[(triton.cdiv(E, BR),)](
        x_TH, r, w_norm if norm else gate_EH, s, xn, gate_EH, logits, w, idx, cnt, x_TH.stride(0), r.stride(0), eps,
        T, H, E, K=k, TP=triton.next_power_of_2(T), BR=BR, BK=min(BK, triton.next_power_of_2(H)),
        BE=triton.next_power_of_2(E), NORM=norm, num_warps=warps, **pdl(x_TH))
    return s, xn, w, idx


if triton is not None:
    @triton.jit
    def _route_row(p, w_ptr, i_ptr, offs, E, K: tl.constexpr, BE: tl.constexpr):
        """One row's routing from its float32 logits p [BE] (masked ones -inf): softmax, k rounds of argmax (ties
        to the lowest index), renormalised; a NaN or inf logit makes the row NaN, yet its ids stay k distinct real
        experts (as torch's output is NaN; an id past E would read another expert's weights)."""
        p = tl.exp(p - tl.max(p, 0))
        p = p / tl.sum(p, 0)
        p = tl.where(offs < E, tl.where(p == p, p, 0.0), -1.0)
        ks = tl.arange(0, K)
        vals = tl.zeros([K], dtype=tl.float32)
        ids = tl.zeros([K], dtype=tl.int32)
        for j in tl.static_range(K):
            m = tl.max(p, 0)
            e = tl.minimum(tl.min(tl.where(p == m, offs, BE), 0), E - 1)
            vals = tl.where(ks == j, m, vals)
            ids = tl.where(ks == j, e, ids)
            p = tl.where(offs == e, -2.0, p)       # taken: below every candidate, masked ones included
        tl.store(w_ptr + ks, (vals / tl.sum(vals, 0)).to(w_ptr.dtype.element_ty))
        tl.store(i_ptr + ks, ids.to(tl.int64))

    @triton.jit
    def _router_route_kernel(x_ptr, r_ptr, lw_ptr, s_ptr, xn_ptr, g_ptr, l_ptr, w_ptr, i_ptr, cnt_ptr, stride_x,
                             stride_r, eps, T, H, E, K: tl.constexpr, TP: tl.constexpr, BR: tl.constexpr,
                             BK: tl.constexpr, BE: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr):
        """NORM: the input rows are rms_norm(x + r), each program norming them itself (one step: BK >= H) and
        program 0 writing x + r to s and the normed rows to xn. The gate rows are loaded before PDL's wait."""
        r = tl.program_id(0) * BR + tl.arange(0, BR)
        rm = r < E
        ts = tl.arange(0, TP)
        tm = ts < T
        acc = tl.zeros([TP, BR], dtype=tl.float32)
        if NORM:
            kk = tl.arange(0, BK)
            km = kk < H
            # the gate rows first: their load is in flight while the input row is summed and normed
            g = tl.load(g_ptr + r[:, None] * H + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
            pdl_enter(PDL)
            first = tm & (ts * 0 + tl.program_id(0) == 0)      # program 0 writes s and the normed rows
            xn = _norm_rows(x_ptr, r_ptr, lw_ptr, s_ptr, ts, tm, kk, km, stride_x, stride_r, H, eps, first, True)
            tl.store(xn_ptr + ts[:, None] * H + kk[None, :], xn, mask=first[:, None] & km[None, :])
            acc += tl.sum(xn.to(tl.float32)[:, None, :] * g.to(tl.float32)[None, :, :], 2)
        else:
            pdl_enter(PDL)
            for k0 in range(0, H, BK):
                kk = k0 + tl.arange(0, BK)
                km = kk < H
                g = tl.load(g_ptr + r[:, None] * H + kk[None, :], mask=rm[:, None] & km[None, :], other=0.0)
                xk = tl.load(x_ptr + ts[:, None] * stride_x + kk[None, :], mask=tm[:, None] & km[None, :],
                             other=0.0)
                acc += tl.sum(xk.to(tl.float32)[:, None, :] * g.to(tl.float32)[None, :, :], 2)
        acc = acc.to(x_ptr.dtype.element_ty).to(tl.float32)           # F.linear's output dtype
        tl.store(l_ptr + ts[:, None] * E + r[None, :], acc, mask=tm[:, None] & rm[None, :])
        # CUTLASS's semaphore: the block's stores, a barrier, then one release (acq_rel) at GPU scope; the program
        # that counts last acquires them all, and reads them past L1
        tl.debug_barrier()
        done = tl.atomic_add(cnt_ptr, 1, sem="acq_rel")
        if done == tl.num_programs(0) - 1:
            offs = tl.arange(0, BE)
            for t in range(T):
                p = tl.load(l_ptr + t * E + offs, mask=offs < E, other=float("-inf"), volatile=True)
                _route_row(p, w_ptr + t * K, i_ptr + t * K, offs, E, K, BE)
            tl.atomic_xchg(cnt_ptr, 0)
