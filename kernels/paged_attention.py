"""Paged attention of the decode step (beside kernels/fused_decode.py, whose _triton it uses): the new key and
value written into their pages, and one query per sequence against its pages of the KV pools, read in place (no
gather), gated. Each with its torch reference. Runs in stage processes."""
from __future__ import annotations

import torch

from memra_pp.kernels.fused_decode import _sms, _triton, pdl, triton

if triton is not None:
    import triton.language as tl

    from memra_pp.kernels.fused_decode import _norm_rope_head, pdl_enter


# -- the new key and value into their pages -------------------------------------------------------------------------
def kv_write_ref(k_BHD, v_BHD, kp, vp, table, slots_B, pos_B):
    from memra_pp.model.cache import locate
    blk, off = locate(table, slots_B, pos_B, kp.shape[2])
    kp[blk, :, off] = k_BHD
    vp[blk, :, off] = v_BHD
    return pos_B + 1


def kv_write(k_BHD, v_BHD, kp, vp, table, slots_B, pos_B):
    """kp[blk, :, off] = k and vp[blk, :, off] = v, (blk, off) the page and offset of position pos_B[b] of slot
    slots_B[b] (cache.locate), for decode rows and prefill tokens alike; returns lens = pos + 1 for
    decode_attention. One kernel for the six of the torch ops (the page lookup, a division, a remainder, two
    indexed writes, the add): ~13 us an attention layer."""
    if not _triton(k_BHD):
        return kv_write_ref(k_BHD, v_BHD, kp, vp, table, slots_B, pos_B)
    B, nkv, D = k_BHD.shape
    assert k_BHD.stride(2) == 1 and v_BHD.stride(2) == 1 and kp.stride(3) == 1 and kp.stride() == vp.stride()
    assert table.stride(1) == 1
    lens = torch.empty_like(pos_B)
    _kv_write_kernel[(B, nkv)](k_BHD, v_BHD, kp, vp, table, slots_B, pos_B, lens, k_BHD.stride(0), k_BHD.stride(1),
                               v_BHD.stride(0), v_BHD.stride(1), kp.stride(0), kp.stride(1), kp.stride(2),
                               table.stride(0), D, KVB=kp.shape[2], BD=triton.next_power_of_2(D), num_warps=1,
                               **pdl(k_BHD))
    return lens


# -- the q / k norms, their rotary embedding and the new key and value into their pages, one kernel -----------------
FUSE_QK = True      # False: add_rms_norm for q, for k, then kv_write (three kernels; the benchmarks compare)
CALLS = {"qk_kv_write": 0}


def qk_norm_kv_write(q_BHD, k_BKD, v_BKD, wq, wk, eps: float, cos, sin, kp, vp, table, slots_B, pos_B):
    """The decode step's attention inputs from its merged projection: q normed (weights 1 + wq) and rotated on its
    first r dims (cos, sin [B, r]), returned contiguous [B, nh, D]; k normed (1 + wk) and rotated, and v, written
    into their pages at pos_B (kv_write); returns (q, lens = pos + 1). q, k, v: views with unit last stride (into
    the projection). One kernel, a program a head; else (or FUSE_QK off) add_rms_norm twice then kv_write."""
    from memra_pp.kernels.fused_decode import add_rms_norm
    B, nh, D = q_BHD.shape
    nkv = k_BKD.shape[1]
    if not (FUSE_QK and _triton(q_BHD) and q_BHD.stride(2) == 1 and k_BKD.stride(2) == 1 and v_BKD.stride(2) == 1
            and wq.is_contiguous() and wk.is_contiguous() and cos.is_contiguous() and sin.is_contiguous()
            and kp.stride(3) == 1 and kp.stride() == vp.stride() and table.stride(1) == 1):
        q = add_rms_norm(q_BHD, None, wq, eps, rope=(cos, sin))[1]
        k = add_rms_norm(k_BKD, None, wk, eps, rope=(cos, sin))[1]
        return q, kv_write(k, v_BKD, kp, vp, table, slots_B, pos_B)
    CALLS["qk_kv_write"] += 1
    q = torch.empty(B, nh, D, dtype=q_BHD.dtype, device=q_BHD.device)
    lens = torch.empty_like(pos_B)
    _qk_kv_kernel[(B, nh + nkv)](q_BHD, k_BKD, v_BKD, wq, wk, cos, sin, q, kp, vp, table, slots_B, pos_B, lens,
                                 q_BHD.stride(0), q_BHD.stride(1), k_BKD.stride(0), k_BKD.stride(1), v_BKD.stride(0),
                                 v_BKD.stride(1), kp.stride(0), kp.stride(1), kp.stride(2), table.stride(0), eps,
                                 NH=nh, D=D, BD=triton.next_power_of_2(D), ROPE=cos.shape[-1], KVB=kp.shape[2],
                                 num_warps=1, **pdl(q_BHD))   # add_rms_norm's warps: its bits
    return q, lens


# -- decode attention over the slot pools -------------------------------------------------------------------------
def decode_attention_ref(q_BHD, gate, kp, vp, table, slots_B, lens_B, S: int):
    """attention.attend_decode over the slots' first S positions (gathered from their pages), times
    sigmoid(gate)."""
    from memra_pp.model.attention import attend_decode
    from memra_pp.model.cache import gather_pages
    B = q_BHD.shape[0]
    o = attend_decode(q_BHD, gather_pages(kp, table, slots_B, S), gather_pages(vp, table, slots_B, S), lens_B)
    return o * torch.sigmoid(gate.reshape(B, -1))


def _attention_kernel_takes(t: torch.Tensor, D: int, kvb: int, block: int) -> bool:
    """Whether decode_attention runs its kernel (else its torch reference) for head size D, pages of kvb positions
    and key tiles of `block` (tl.dot: power-of-two dims >= 16; a tile lies in one page)."""
    return _triton(t) and D >= 16 and not D & (D - 1) and kvb % block == 0 and block >= 16


def reads_pools_by_address(kp) -> bool:
    """Whether the decode step's KV kernels take pools like kp [n_blocks, nkv, kv_block, D] by pointer and strides
    alone (the Triton kernels: qk_norm_kv_write or kv_write, and decode_attention), so a CUDA graph over them stays
    valid when the pools grow in place. The torch references index the pools with their size baked into the graph."""
    return _attention_kernel_takes(kp, kp.shape[3], kp.shape[2], min(64, kp.shape[2]))


def decode_attention(q_BHD, gate, kp, vp, table, slots_B, lens_B, S: int, block: int = 64,
                     len_chunks: bool = False, max_splits: int | None = None):
    """One query per sequence against its pages of the paged KV pools [n_blocks, nkv, kv_block, D] (table[slot, j]:
    the block of positions [j * kv_block, (j + 1) * kv_block)), keys s < lens_B[b] visible (lens <= S), output gated
    by sigmoid(gate) ([B, nh * D] or a [B, nh, D] view): [B, nh * D]. The pages are read in place (no gather); a
    long cache is split over programs (flash decoding) when the batch alone would leave the GPU idle, and the
    splits are combined in a second kernel.
    `len_chunks`: the split count still comes from S, but each sequence's chunk from its own length (its blocks
    spread over the splits; splits past its length write nothing, and the combine reads only those it filled), so S
    can be the cache's capacity at no cost in work: one decode graph serves every length
    (decode_graphs.ANY_KV).
    `max_splits`: at most this many splits. The split count is a compile-time constant of the kernels, so an eager
    caller whose rows and lengths change every step (a mixed step's decode rows: max_splits=1) would otherwise
    compile a variant for each new count inside running requests."""
    B, nh, D = q_BHD.shape
    kvb = kp.shape[2]
    block = min(block, kvb)
    if not _attention_kernel_takes(q_BHD, D, kvb, block):
        return decode_attention_ref(q_BHD, gate, kp, vp, table, slots_B, lens_B, S)
    nkv = kp.shape[1]
    g3 = gate.view(B, nh, D) if gate.dim() == 2 else gate
    assert q_BHD.stride(2) == 1 and g3.stride(2) == 1 and kp.stride(3) == 1 and vp.stride(3) == 1
    assert kp.stride() == vp.stride() and table.stride(1) == 1
    group = nh // nkv
    blocks = triton.cdiv(S, block)
    splits = max(1, min(blocks, triton.cdiv(2 * _sms(q_BHD.device), B * nkv), max_splits or blocks))
    chunk = triton.cdiv(blocks, splits) * block
    splits = triton.cdiv(S, chunk)
    out = torch.empty(B, nh * D, dtype=q_BHD.dtype, device=q_BHD.device)
    mid = torch.empty(B, nh, splits, D, dtype=torch.float32, device=q_BHD.device) if splits > 1 else out
    lse = torch.empty(B, nh, splits, dtype=torch.float32, device=q_BHD.device) if splits > 1 else out
    if POISON and splits > 1:
        mid.fill_(float("nan"))
        lse.fill_(float("nan"))
    args = (q_BHD, kp, vp, table, slots_B, lens_B, g3, out, mid, lse, q_BHD.stride(0), q_BHD.stride(1),
            kp.stride(0), kp.stride(1), kp.stride(2), table.stride(0), g3.stride(0), g3.stride(1), D ** -0.5, chunk)
    meta = dict(GROUP=group, GP=max(16, triton.next_power_of_2(group)), D=D, BS=block, KVB=kvb, SPLITS=splits,
                LEN_CHUNKS=len_chunks, IEEE=q_BHD.dtype == torch.float32, num_warps=4, **pdl(q_BHD))
    stages = _ATTN_STAGES.get(q_BHD.device, 2)
    try:
        _decode_attn_kernel[(B, nkv, splits)](*args, **meta, num_stages=stages)
    except triton.runtime.errors.OutOfResources:
        if stages == 1:          # even single-buffered K/V tiles do not fit this GPU's shared memory
            raise
        _ATTN_STAGES[q_BHD.device] = 1   # double-buffered [64, D] K and V tiles: ~4 x 64 x D x 2 B (64 KiB at 256)
        _decode_attn_kernel[(B, nkv, splits)](*args, **meta, num_stages=1)
    if splits > 1:
        _attn_combine_kernel[(B, nh)](mid, lse, g3, out, lens_B, g3.stride(0), g3.stride(1), D=D, BS=block,
                                      SPLITS=splits, SP=triton.next_power_of_2(splits), LEN_CHUNKS=len_chunks,
                                      CH=min(COMBINE_CH, triton.next_power_of_2(splits)), num_warps=4, **pdl(q_BHD))
    return out


_ATTN_STAGES: dict = {}   # device -> software pipelining of the K/V tiles (2; 1 where shared memory is short)
POISON = False     # tests: the split partials start as NaN, so a partial read that nothing wrote shows
COMBINE_CH = 16    # len_chunks' combine sums this many splits at a time (tests take 2: its loop runs on a CPU too)


if triton is not None:
    @triton.jit
    def _store_kv_head(kh, v, kp, vp, table, slots, pos, lens, b, h, svb, svh, spn, sph, sps, stt, d, m,
                       KVB: tl.constexpr):
        """Row b's kv head h: its key kh (a [BD] row) and its value from v stored into the page of position pos[b]
        of slot slots[b]; lens[b] = pos + 1 (by head 0)."""
        p = tl.load(pos + b).to(tl.int64)
        blk = tl.load(table + tl.load(slots + b).to(tl.int64) * stt + p // KVB).to(tl.int64)
        dst = blk * spn + h * sph + (p % KVB) * sps + d
        tl.store(kp + dst, kh.to(kp.dtype.element_ty), mask=m)
        tl.store(vp + dst, tl.load(v + b * svb + h * svh + d, mask=m), mask=m)
        if h == 0:
            tl.store(lens + b, (p + 1).to(lens.dtype.element_ty))

    @triton.jit
    def _kv_write_kernel(k, v, kp, vp, table, slots, pos, lens, skb, skh, svb, svh, spn, sph, sps, stt, D,
                         KVB: tl.constexpr, BD: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, BD)
        m = d < D
        _store_kv_head(tl.load(k + b * skb + h * skh + d, mask=m), v, kp, vp, table, slots, pos, lens, b, h, svb,
                       svh, spn, sph, sps, stt, d, m, KVB)

    @triton.jit
    def _qk_kv_kernel(q, k, v, wq, wk, cos, sin, qo, kp, vp, table, slots, pos, lens, sqb, sqh, skb, skh, svb, svh,
                      spn, sph, sps, stt, eps, NH: tl.constexpr, D: tl.constexpr, BD: tl.constexpr,
                      ROPE: tl.constexpr, KVB: tl.constexpr, PDL: tl.constexpr):
        """Program (b, j): q head j (j < NH) normed and rotated into qo, else kv head j - NH: k normed and rotated,
        and v, stored into the page of position pos[b] of slot slots[b]; lens[b] = pos + 1 (by kv head 0)."""
        pdl_enter(PDL)
        b = tl.program_id(0).to(tl.int64)
        j = tl.program_id(1).to(tl.int64)
        d = tl.arange(0, BD)
        m = d < D
        if j < NH:
            y = _norm_rope_head(q + b * sqb + j * sqh, wq, cos + b * ROPE, sin + b * ROPE, d, m, eps, D, ROPE)
            tl.store(qo + (b * NH + j) * D + d, y, mask=m)
        else:
            h = j - NH
            y = _norm_rope_head(k + b * skb + h * skh, wk, cos + b * ROPE, sin + b * ROPE, d, m, eps, D, ROPE)
            _store_kv_head(y, v, kp, vp, table, slots, pos, lens, b, h, svb, svh, spn, sph, sps, stt, d, m, KVB)

    @triton.jit
    def _decode_attn_kernel(Q, K, V, TABLE, SLOTS, LENS, G, O, MID, LSE, sqb, sqh, skn, skh, sks, stt, sgb, sgh,
                            scale, CHUNK, GROUP: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                            KVB: tl.constexpr, SPLITS: tl.constexpr, LEN_CHUNKS: tl.constexpr,
                            IEEE: tl.constexpr, PDL: tl.constexpr):
        pdl_enter(PDL)
        b = tl.program_id(0).to(tl.int64)
        kh = tl.program_id(1).to(tl.int64)
        sp = tl.program_id(2)
        slot = tl.load(SLOTS + b).to(tl.int64)
        L = tl.load(LENS + b).to(tl.int32)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        gm = g < GROUP
        h = kh * GROUP + g
        if LEN_CHUNKS:      # this sequence's blocks spread over the splits (a multiple of BS: tiles stay in a page)
            CHUNK = tl.cdiv(tl.cdiv(L, BS), SPLITS) * BS
        start = sp * CHUNK
        end = tl.minimum(start + CHUNK, L)
        live = gm & (g * 0 + start < end)     # heads of a split with keys (vector compares: see gemv)
        q = tl.load(Q + b * sqb + h[:, None] * sqh + d[None, :], mask=live[:, None], other=0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for s0 in range(start, end, BS):       # a tile lies in one page: BS divides KVB, tiles start at BS multiples
            blk = tl.load(TABLE + slot * stt + s0 // KVB).to(tl.int64)
            s = s0 + tl.arange(0, BS)
            sm = s < end
            off = blk * skn + kh * skh + (s[:, None] % KVB).to(tl.int64) * sks + d[None, :]
            k = tl.load(K + off, mask=sm[:, None], other=0)
            if IEEE:
                qk = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                qk = tl.dot(q, tl.trans(k))
            qk = tl.where(sm[None, :], qk * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            p = tl.exp(qk - m_new[:, None])
            alpha = tl.exp(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(V + off, mask=sm[:, None], other=0)
            if IEEE:
                pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        if SPLITS == 1:
            o = acc / l_i[:, None]
            gt = tl.load(G + b * sgb + h[:, None] * sgh + d[None, :], mask=gm[:, None], other=0).to(tl.float32)
            o = o * (1.0 / (1.0 + tl.exp(-gt)))
            tl.store(O + b * (GROUP * D) * tl.num_programs(1) + h[:, None] * D + d[None, :],
                     o.to(q.dtype), mask=gm[:, None])
        else:
            nh = GROUP * tl.num_programs(1)
            row = (b * nh + h) * SPLITS + sp
            safe = tl.where(l_i > 0, l_i, 1.0)
            keep = gm
            if LEN_CHUNKS:      # an empty split is never read (the combine reads the live ones): nothing written
                keep = live
            tl.store(MID + row[:, None] * D + d[None, :], acc / safe[:, None], mask=keep[:, None])
            tl.store(LSE + row, tl.where(l_i > 0, m_i + tl.log(safe), float("-inf")), mask=keep)

    @triton.jit
    def _attn_combine_kernel(MID, LSE, G, O, LENS, sgb, sgh, D: tl.constexpr, BS: tl.constexpr,
                             SPLITS: tl.constexpr, SP: tl.constexpr, LEN_CHUNKS: tl.constexpr, CH: tl.constexpr,
                             PDL: tl.constexpr):
        pdl_enter(PDL)
        b = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1).to(tl.int64)
        nh = tl.num_programs(1)
        i = tl.arange(0, SP)
        d = tl.arange(0, D)
        row = (b * nh + h) * SPLITS
        n = SPLITS
        if LEN_CHUNKS:      # the splits the sequence's length filled (_decode_attn_kernel's chunks): a prefix
            blocks = tl.cdiv(tl.load(LENS + b).to(tl.int32), BS)
            n = tl.cdiv(blocks, tl.maximum(tl.cdiv(blocks, SPLITS), 1))
        lse = tl.load(LSE + row + i, mask=i < n, other=float("-inf"))
        mx = tl.max(lse, 0)
        w = tl.exp(lse - mx)
        if LEN_CHUNKS:
            # only the live splits are read (the others were not written: a grid sized by the cache's capacity
            # over a short sequence), CH at a time (a [128, D] tile at once took every register and spilled,
            # compiled for sm_90), the loop as long as the sequence, not the capacity
            acc = tl.zeros([D], tl.float32)
            for c0 in range(0, n, CH):
                j = c0 + tl.arange(0, CH)
                lj = tl.load(LSE + row + j, mask=j < n, other=float("-inf"))
                mj = tl.load(MID + (row + j)[:, None] * D + d[None, :], mask=(j < n)[:, None], other=0)
                acc += tl.sum(mj * tl.exp(lj - mx)[:, None], 0)
            o = acc / tl.sum(w, 0)
        else:
            mid = tl.load(MID + (row + i)[:, None] * D + d[None, :], mask=(i < SPLITS)[:, None], other=0)
            o = tl.sum(mid * w[:, None], 0) / tl.sum(w, 0)
        gt = tl.load(G + b * sgb + h * sgh + d).to(tl.float32)
        o = o * (1.0 / (1.0 + tl.exp(-gt)))
        tl.store(O + (b * nh + h) * D + d, o.to(O.dtype.element_ty))
