"""One decode row's whole MoE block in one persistent kernel: the residual add and input norm, the router and its
routing, the k routed experts and the gated shared expert (kernels/fused_moe.py's three kernels for one row).

At one row those are three dependent kernels, each a few microseconds of ramp and tail around its bytes (H200,
35B-A3B, ninth session: router 6.3 + gate|up 11.4 + down 7.8 us a layer, where the block's 57 MB take 13.5 us at the
copy bandwidth). Here a persistent grid (TILES: two programs of four warps a multiprocessor) runs three phases that
meet at grid barriers in memory:
- before PDL's wait, each program loads what no kernel writes: its experts' router rows, the norm's and the shared
  gate's weights, and its first shared-expert gate|up tile;
- phase A: the residual add and norm (every program, from L2; program 0 writes the new residual), its experts'
  router logits; barrier;
- phase B: every program routes the row itself (the top k of the logits) and computes its gate|up tiles of the
  k + 1 pairs (shared pair first); it then loads its first down tile (the experts are known now) and only then waits
  at the second barrier, so those loads stream while the slowest programs finish;
- phase C: the down tiles, each pair's product rounded, weighted and summed, plus the gated shared expert.

Measured (benchmarks/moe_block_bench.py, H200, 35B-A3B, fourteenth session): 23.7 us a layer against 25.8 for the
three kernels; program by program (medians; %globaltimer stamps, which tick every 0.256 us): 1.0 us norm and router,
1.0 barrier, 2.0 routing (eight rounds of a max across the program's warps), 9.5 gate|up (the slowest program's 11.8
sets the barrier's wait), 4.9 down. In the whole step it gained nothing (ENABLED below).

The barrier (_grid_barrier) is cooperative groups' grid barrier on one int32 the caller keeps per layer, zeroed
once: one atomic add a program, the last one flipping its top bit, so a CUDA graph replays it without a reset, for
ever. Every program must be resident at once: the grid is at most 256 threads a multiprocessor (any register count
fits), and no other block kernel may run on the device at the same time (each fills the register files: two at once,
from another stream or another process under MPS, could each wait for ever on programs that cannot start). With PDL
the next kernel launches once every program has passed the first barrier (a choice: once every program has issued the
trigger, all are resident wherever it stands after the wait).

Rounding is the per-pair kernels' (fused_moe.moe_ref's): router logits rounded to the dtype as F.linear's are; gate
and up rounded, silu rounded, the product rounded; each pair's down product rounded, times its weight rounded, summed
in float32; the shared term as shared_ref rounds it. Under Triton's interpreter, which runs programs one after
another (a barrier would never open), and with split=True, the three phases run as three launches of the one
kernel. Runs in stage processes.
"""
from __future__ import annotations

import os

import torch

from memra_pp.switches import initial
from memra_pp.kernels.fused_decode import _sms, _triton, gdc_launch_dependents, gdc_wait, pdl, triton

if triton is not None:
    import triton.language as tl

    from memra_pp.kernels.fused_moe import _gate_up_rows, _plus_shared, _sigmoid_gate, _silu_mul, _weighted

# layers.MoE.decode_fused takes the block kernel for one row (False: the three kernels; benchmarks compare the two).
# Off: on the H200 the 35B-A3B's step took 2.39-2.40 ms with it against 2.39-2.43 without (fourteenth session,
# docs/PERF.md), though the block alone is 0.92x its three kernels. MEMRA_PP_MOE_BLOCK=1 turns it on (GPU parity)
ENABLED = initial("MEMRA_PP_MOE_BLOCK")
# host-side launches (a captured graph counts once): one kernel, or the three phases as three launches
CALLS = {"block": 0, "block_split": 0}
LAST_KERNEL = None      # the one kernel's last launch (Triton's compiled kernel: benchmarks read its registers)
# the barrier's wait reads with ld.acquire (inline PTX); False: with atomic adds of 0 (acquire), which every
# Triton has (benchmarks compare)
ACQUIRE_ASM = True
# (gate|up rows a tile, down rows a tile, warps a program, programs a multiprocessor, each next tile loaded before
# the current one is reduced). Programs x warps <= 8 a multiprocessor: 256 threads at most, which fit an SM at any
# register count, so every program of the grid is resident at once (the barriers need it)
TILES = (4, 4, 4, 2, False)      # (benchmarks/moe_block_bench.py, H200, 35B-A3B: 23.7 us a layer, 8 warps 27.0)
# the one kernel's registers a thread at most (ptxas's maxnreg; None: as many as it wants, 249 at TILES). Fewer would
# leave room for the next kernel's programs beside the block's, but they spill: 128 took 64.0 us a layer (172
# spilled), 168 took 47.8 (100 spilled), against 23.7 (benchmarks/moe_block_bench.py, fifteenth session)
MAXNREG = None


def parse_tiles(spec: str):
    """TILES from "AxBxCxDxE" (the benchmarks' spelling): gate|up rows, down rows and warps powers of two, programs
    a multiprocessor > 0, prefetch 0 / 1; None where it is not that."""
    v = spec.split("x")
    if len(v) != 5 or not all(x.isdigit() for x in v) or v[4] not in ("0", "1"):
        return None
    n = [int(x) for x in v]
    if not all(x > 0 and not x & (x - 1) for x in n[:3]) or n[3] <= 0:
        return None
    return (*n[:4], bool(n[4]))


def takes(h_TH, m_TH, w_norm, gate_EH, k: int, w_gu, w_d, shared) -> bool:
    """The block kernel serves this MoE step: the fused MoE path on (fused_moe.ENABLED), one row with its residual,
    a shared expert, k a power of two, the hidden size in one step of a program (<= 4,096), contiguous weights."""
    from memra_pp.kernels import fused_moe
    return (ENABLED and fused_moe.ENABLED and _triton(h_TH) and h_TH.shape[0] == 1 and m_TH is not None
            and shared is not None and not k & (k - 1) and k <= gate_EH.shape[0] <= 1024 and h_TH.shape[1] <= 4096
            and h_TH.stride(1) == 1 and m_TH.stride(1) == 1
            and all(t.is_contiguous() for t in (w_norm, gate_EH, w_gu, w_d, *shared)))


def moe_block(h_TH, m_TH, w_norm, eps: float, gate_EH, k: int, w_gu_EIH, w_d_EHI, shared, bar,
              split: bool | None = None, programs: int | None = None, tiles=None, times=None):
    """(s, out, weights, ids) for one row: s = h + m, x = rms_norm(s) (as fused_decode.add_rms_norm rounds both),
    the routing of x (weights [1, k] in x's dtype, ids [1, k] int64: router_route's ids, but where distinct logits
    give equal float32 probabilities; its weights within a float32 ulp) and out = the routed experts plus the
    sigmoid-gated shared expert (fused_moe.moe_ref; shared = (gate|up [2Is, H], down [H, Is], gate [1, H])).
    bar: int32 [1], zeroed once, this layer's alone; one block kernel at a time on a device (the module docstring).
    split: the three phases as three launches (None: under the interpreter only); programs: the grid (None: TILES'
    programs a multiprocessor; at most that many); times: int64 [programs, 8] for each program's clock
    (globaltimer, ns) at the phases' edges (benchmarks/moe_block_bench.py; one kernel only)."""
    T, H = h_TH.shape
    assert T == 1 and bar.dtype == torch.int32 and bar.numel() >= 1
    E = gate_EH.shape[0]
    I = w_d_EHI.shape[2]
    w_sgu, w_sd, w_sg = shared
    Is = w_sd.shape[1]
    dev, dt = h_TH.device, h_TH.dtype
    if split is None:
        split = os.environ.get("TRITON_INTERPRET") == "1" or not h_TH.is_cuda
    BN, BD, warps, per_sm, pref = tiles or TILES
    assert per_sm * warps <= 8, f"{per_sm} programs of {warps} warps a multiprocessor: not all resident at once"
    P = programs or per_sm * _sms(dev)
    assert P >= 2, "the grid barrier's flip needs two programs or more"
    assert split or P <= per_sm * _sms(dev), f"{P} programs: more than {per_sm} a multiprocessor cannot all be resident"
    assert times is None or (not split and times.shape == (P, 8) and times.dtype == torch.int64)
    s = torch.empty(1, H, dtype=dt, device=dev)
    out = torch.empty(1, H, dtype=dt, device=dev)
    logits = torch.empty(E, dtype=torch.float32, device=dev)
    hb = torch.empty(k + 1, max(I, Is), dtype=dt, device=dev)
    w = torch.empty(1, k, dtype=dt, device=dev)
    idx = torch.empty(1, k, dtype=torch.int64, device=dev)
    np2 = triton.next_power_of_2
    args = (h_TH, m_TH, w_norm, s, gate_EH, logits, w_gu_EIH, w_d_EHI, w_sgu, w_sd, w_sg, hb, out, w, idx, bar,
            2 ** 31 - (P - 1), eps, H, E, I, Is, max(I, Is))
    consts = dict(K=k, BE=np2(E), RB=np2(triton.cdiv(E, P)), BH=np2(H), BN=BN, BD=BD, BI=np2(I), BIS=np2(Is),
                  PREF=pref, ASM=ACQUIRE_ASM, num_warps=warps)
    stamps = bar if times is None else times        # (bar where there are no stamps: the kernel never touches it)
    if split:
        CALLS["block_split"] += 1
        for a, b, c in ((True, False, False), (False, True, False), (False, False, True)):
            _block_kernel[(P,)](*args, stamps, A=a, B=b, C=c, SYNC=False, TIME=False, PDL=False, **consts)
    else:
        global LAST_KERNEL
        CALLS["block"] += 1
        regs = {} if MAXNREG is None else {"maxnreg": MAXNREG}
        LAST_KERNEL = _block_kernel[(P,)](*args, stamps, A=True, B=True, C=True, SYNC=True, TIME=times is not None,
                                          **pdl(h_TH), **regs, **consts)
    return s, out, w, idx


if triton is not None:
    @triton.jit
    def _now(pid):
        """The GPU's global clock (ns; the same on every multiprocessor). pid: a dummy operand."""
        return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [pid], dtype=tl.int64, is_pure=False,
                                         pack=1)

    @triton.jit
    def _stamp(t_ptr, pid, i: tl.constexpr, TIME: tl.constexpr):
        if TIME:
            tl.store(t_ptr + pid * 8 + i, _now(pid))

    @triton.jit
    def _topk_keys(lg, offs, E, K: tl.constexpr, BE: tl.constexpr):
        """moe_route._route_row's routing from float32 logits [BE], returned (weights [K] float32, ids [K] int32):
        the top k taken on the logits themselves (the softmax is monotonic), each logit and its negated index packed
        in one int64 key so one max a round takes the largest with ties to the lowest index (a reduction crosses a
        program's warps: the softmax's two are saved too); weights exp(l - l_max) renormalised over the k, which is
        the softmax's top k renormalised. A NaN logit is taken first and makes the row NaN; ids stay k distinct real
        experts."""
        bits = (lg + 0.0).to(tl.int32, bitcast=True)       # (-0.0 as +0.0, as the softmax has them equal)
        order = tl.where(lg != lg, 0x7FFFFFFF, bits ^ ((bits >> 31) & 0x7FFFFFFF))   # float order; NaN first
        key = tl.where(offs < E, (order.to(tl.int64) << 32) | (BE - 1 - offs), -9223372036854775807 - 1)
        ks = tl.arange(0, K)
        vals = tl.zeros([K], dtype=tl.float32)
        ids = tl.zeros([K], dtype=tl.int32)
        for j in tl.static_range(K):
            m = tl.max(key, 0)
            e = BE - 1 - m.to(tl.int32)         # the low half: truncated
            o = (m >> 32).to(tl.int32)
            vals = tl.where(ks == j, (o ^ ((o >> 31) & 0x7FFFFFFF)).to(tl.float32, bitcast=True), vals)
            ids = tl.where(ks == j, e, ids)
            key = tl.where(offs == e, -9223372036854775807 - 1, key)
        p = tl.exp(vals - tl.max(vals, 0))
        return p / tl.sum(p, 0), ids

    @triton.jit
    def _ld_acquire(ptr):
        """ptr's int32, loaded with acquire semantics at GPU scope (what was stored before its release is seen)."""
        return tl.inline_asm_elementwise("ld.acquire.gpu.global.b32 $0, [$1];", "=r,l", [ptr], dtype=tl.int32,
                                         is_pure=False, pack=1)

    @triton.jit
    def _grid_barrier(bar_ptr, pid, flip, ASM: tl.constexpr):
        """Every program of the grid waits here until all have arrived; their stores before it are visible to all
        after it. Cooperative groups' grid barrier: each program adds 1 (program 0: flip = 2^31 - (programs - 1))
        to one int32 with release semantics, so the last arrival flips its top bit and leaves the rest as they
        were; each then waits, reading with acquire, for the top bit to differ from what its own add returned. One
        atomic a program, no reset: a CUDA graph replays it for ever."""
        tl.debug_barrier()          # the block's stores before its arrival
        old = tl.atomic_add(bar_ptr, tl.where(pid == 0, flip, 1), sem="release")
        cur = _acquire(bar_ptr, ASM)
        while (old ^ cur) >= 0:
            cur = _acquire(bar_ptr, ASM)
        tl.debug_barrier()

    @triton.jit
    def _acquire(ptr, ASM: tl.constexpr):
        if ASM:
            return _ld_acquire(ptr)
        return tl.atomic_add(ptr, 0, sem="acquire")

    @triton.jit
    def _gu_tile(q, NQ, NT, ids, ks, wgu_ptr, sgu_ptr, hh, hm, H, I, Is, BN: tl.constexpr):
        """Gate|up tile q's [BN, BH] gate and up rows: tile q % NT of pair q // NT (0: the shared expert, j + 1: the
        j-th routed), nothing loaded past the last tile."""
        pair = q // NT
        if pair == 0:
            base = sgu_ptr
            width = Is
        else:
            e = tl.sum(tl.where(ks == pair - 1, ids, 0), 0).to(tl.int64)
            base = wgu_ptr + e * (2 * I * H)
            width = I
        n = (q % NT) * BN + tl.arange(0, BN)
        return _gate_up_rows(base, width, n, hh, H, ((n < width) & (n * 0 + q < NQ))[:, None] & hm[None, :])

    @triton.jit
    def _down_tile(d, ids, wd_ptr, sd_ptr, ii, im, jj, jm, H, I, Is, BD: tl.constexpr):
        """Down tile d: the routed pairs' [K, BD, BI] slices of their experts' down rows and the shared expert's
        [BD, BIS] (nothing loaded past the hidden size)."""
        n = d * BD + tl.arange(0, BD)
        nm = n < H
        wd = tl.load(wd_ptr + ids.to(tl.int64)[:, None, None] * (H * I) + n[None, :, None] * I + ii[None, None, :],
                     mask=nm[None, :, None] & im[None, None, :], other=0.0)
        ws = tl.load(sd_ptr + n[:, None] * Is + jj[None, :], mask=nm[:, None] & jm[None, :], other=0.0)
        return wd, ws

    @triton.jit
    def _block_kernel(h_ptr, m_ptr, lw_ptr, s_ptr, g_ptr, l_ptr, wgu_ptr, wd_ptr, sgu_ptr, sd_ptr, sg_ptr, hb_ptr,
                      o_ptr, w_ptr, i_ptr, bar_ptr, flip, eps, H, E, I, Is, IH, t_ptr, K: tl.constexpr,
                      BE: tl.constexpr, RB: tl.constexpr, BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr,
                      BI: tl.constexpr, BIS: tl.constexpr, PREF: tl.constexpr, A: tl.constexpr, B: tl.constexpr,
                      C: tl.constexpr, SYNC: tl.constexpr, TIME: tl.constexpr, ASM: tl.constexpr,
                      PDL: tl.constexpr):
        """Phases A (norm, router logits), B (routing, gate|up), C (down): all three with SYNC (barriers between),
        or the one named (split launches). hb: the pairs' silu(gate) * up rows (routed j at row j, shared at K).
        PREF: each next tile's weights loaded before the current one is reduced (else one tile at a time: other
        programs on the multiprocessor keep loads in flight). TIME: clock stamps to t."""
        pid = tl.program_id(0)
        _stamp(t_ptr, pid, 0, TIME)
        P = tl.num_programs(0)
        dt = o_ptr.dtype.element_ty
        hh = tl.arange(0, BH)
        hm = hh < H
        ks = tl.arange(0, K)
        NT = tl.cdiv(IH, BN)             # gate|up tiles a pair (of the wider of the routed and shared experts)
        NQ = (K + 1) * NT
        # what no kernel writes first: in flight while the kernel before finishes (PDL)
        if A:
            r = pid * RB + tl.arange(0, RB)
            rm = r < E
            g = tl.load(g_ptr + r[:, None] * H + hh[None, :], mask=rm[:, None] & hm[None, :], other=0.0)
        if B:       # tile q = pid is the shared pair's (static weights) where pid < NT
            n0 = pid * BN + tl.arange(0, BN)
            wg, wu = _gate_up_rows(sgu_ptr, Is, n0, hh, H, ((n0 < Is) & (n0 * 0 + pid < NT))[:, None] & hm[None, :])
        if C:
            wsg = tl.load(sg_ptr + hh, mask=hm, other=0.0).to(tl.float32)
        wf = 1.0 + tl.load(lw_ptr + hh, mask=hm, other=0.0).to(tl.float32)
        if PDL:
            gdc_wait()
        _stamp(t_ptr, pid, 1, TIME)
        # s = h + m and rms_norm(s), rounded as fused_decode.add_rms_norm rounds them; program 0 writes s
        xs = (tl.load(h_ptr + hh, mask=hm, other=0.0).to(tl.float32)
              + tl.load(m_ptr + hh, mask=hm, other=0.0).to(tl.float32)).to(dt)
        if A:
            tl.store(s_ptr + hh, xs, mask=hm & (hh * 0 + pid == 0))
        xf = xs.to(tl.float32)
        xf = (xf * (1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)) * wf).to(dt).to(tl.float32)     # [BH]
        if A:
            lg = tl.sum(g.to(tl.float32) * xf[None, :], 1).to(dt).to(tl.float32)    # F.linear's output dtype
            tl.store(l_ptr + r, lg, mask=rm)
        _stamp(t_ptr, pid, 2, TIME)
        if SYNC:
            _grid_barrier(bar_ptr, pid, flip, ASM)
            _stamp(t_ptr, pid, 3, TIME)
            if PDL:     # the next kernel's programs start beside ours only once all of ours have arrived
                gdc_launch_dependents()
        if B or C:    # every program routes the row (one kernel: no program waits for another's routing)
            offs = tl.arange(0, BE)
            p = tl.load(l_ptr + offs, mask=offs < E, other=float("-inf"), volatile=True)
            tw, ids = _topk_keys(p, offs, E, K, BE)
            tw = tw.to(dt)
            if B:
                if pid == 0:
                    tl.store(w_ptr + ks, tw)
                    tl.store(i_ptr + ks, ids.to(tl.int64))
            tw = tw.to(tl.float32)
            _stamp(t_ptr, pid, 4, TIME)
        if B:
            if pid >= NT:       # the program's first tile is a routed pair's: its expert is known only now
                wg, wu = _gu_tile(pid, NQ, NT, ids, ks, wgu_ptr, sgu_ptr, hh, hm, H, I, Is, BN)
            for q in range(pid, NQ, P):
                if PREF:
                    ng, nu = _gu_tile(q + P, NQ, NT, ids, ks, wgu_ptr, sgu_ptr, hh, hm, H, I, Is, BN)
                elif q != pid:
                    wg, wu = _gu_tile(q, NQ, NT, ids, ks, wgu_ptr, sgu_ptr, hh, hm, H, I, Is, BN)
                pair = q // NT
                width = tl.where(pair == 0, Is, I)
                n = (q % NT) * BN + tl.arange(0, BN)
                row = tl.where(pair == 0, K, pair - 1)
                tl.store(hb_ptr + row * IH + n, _silu_mul(tl.sum(wg.to(tl.float32) * xf[None, :], 1),
                                                          tl.sum(wu.to(tl.float32) * xf[None, :], 1), dt),
                         mask=n < width)
                if PREF:
                    wg, wu = ng, nu
            _stamp(t_ptr, pid, 5, TIME)
        if C:
            ii = tl.arange(0, BI)
            im = ii < I
            jj = tl.arange(0, BIS)
            jm = jj < Is
            wd, ws = _down_tile(pid, ids, wd_ptr, sd_ptr, ii, im, jj, jm, H, I, Is, BD)    # before the barrier
            sig = _sigmoid_gate(tl.sum(xf * wsg, 0), dt)
            if SYNC:
                _grid_barrier(bar_ptr, pid, flip, ASM)
                _stamp(t_ptr, pid, 6, TIME)
            hp = tl.load(hb_ptr + ks[:, None] * IH + ii[None, :], mask=im[None, :], other=0.0,
                         volatile=True).to(tl.float32)
            hs = tl.load(hb_ptr + K * IH + jj, mask=jm, other=0.0, volatile=True).to(tl.float32)
            for d in range(pid, tl.cdiv(H, BD), P):
                if PREF:
                    nwd, nws = _down_tile(d + P, ids, wd_ptr, sd_ptr, ii, im, jj, jm, H, I, Is, BD)
                elif d != pid:
                    wd, ws = _down_tile(d, ids, wd_ptr, sd_ptr, ii, im, jj, jm, H, I, Is, BD)
                acc = tl.sum(wd.to(tl.float32) * hp[:, None, :], 2)                        # [K, BD]
                total = tl.sum(_weighted(acc, tw[:, None], dt), 0)
                acc_s = tl.sum(ws.to(tl.float32) * hs[None, :], 1)
                n = d * BD + tl.arange(0, BD)
                tl.store(o_ptr + n, _plus_shared(total, acc_s, sig, dt).to(dt), mask=n < H)
                if PREF:
                    wd, ws = nwd, nws
            _stamp(t_ptr, pid, 7, TIME)
