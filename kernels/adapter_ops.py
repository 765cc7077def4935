"""Adapter token-row kernels: the embedding override (intake) and the lm_head logit recompute (primary), as Triton
kernels on CUDA and torch references elsewhere; both read a TokenOverlaySet's tables. Runs in stage processes.
"""
from __future__ import annotations

import torch

from memra_pp.errors import ConfigError

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch references serve
    triton = None


def _slot_offsets(counts_S: torch.Tensor) -> torch.Tensor:
    """First row of each slot in rows_RH (TokenOverlaySet concatenates the slots' rows in slot order)."""
    c = counts_S.long()
    return torch.cumsum(c, 0) - c


# -- torch references ---------------------------------------------------------------------------------------------
def embed_override_ref(embedded_TD, ids_T, slot_T, map_SV, rows_RH, counts_S):
    """In place: token t with slot s >= 0 whose id has a row r of slot s (map_SV[s, id]) gets rows_RH[r].
    Guards: 0 <= s < S, 0 <= id < V, r within slot s's own rows; anything else keeps its embedding."""
    S, V = map_SV.shape
    s, i = slot_T.long(), ids_T.long()
    t = ((s >= 0) & (s < S) & (i >= 0) & (i < V)).nonzero().squeeze(1)
    if t.numel() == 0:
        return embedded_TD
    s, r = s[t], map_SV[s[t], i[t]].long()
    off = _slot_offsets(counts_S)[s]
    hit = (r >= off) & (r < off + counts_S.long()[s])
    embedded_TD[t[hit]] = rows_RH[r[hit]].to(embedded_TD.dtype)
    return embedded_TD


def lm_head_override_ref(logits_BV, hidden_BD, slot_B, ids_R, rslot_R, rows_RH):
    """In place: for logits row b of slot s >= 0, logits[b, ids_R[r]] = hidden[b] . rows_RH[r] (float32
    accumulate) for every row r of slot s. Guards: 0 <= ids_R[r] < V; slot -1 rows are untouched."""
    V = logits_BV.shape[1]
    s = slot_B.long()
    ok_R = (ids_R >= 0) & (ids_R < V)
    b, r = ((s[:, None] == rslot_R.long()[None, :]) & (s[:, None] >= 0) & ok_R[None, :]).nonzero(as_tuple=True)
    if b.numel() == 0:
        return logits_BV
    dots = (hidden_BD[b].float() * rows_RH[r].float()).sum(-1)
    logits_BV[b, ids_R[r].long()] = dots.to(logits_BV.dtype)
    return logits_BV


# -- Triton kernels -----------------------------------------------------------------------------------------------
if triton is not None:
    @triton.jit
    def _embed_override_kernel(out_ptr, ids_ptr, slot_ptr, map_ptr, rows_ptr, counts_ptr, off_ptr, S, V, D,
                               stride_out, stride_map, stride_rows, BLOCK_D: tl.constexpr):
        t = tl.program_id(0)
        s = tl.load(slot_ptr + t).to(tl.int64)
        i = tl.load(ids_ptr + t).to(tl.int64)
        if (s >= 0) & (s < S) & (i >= 0) & (i < V):
            r = tl.load(map_ptr + s * stride_map + i).to(tl.int64)
            lo = tl.load(off_ptr + s).to(tl.int64)
            n = tl.load(counts_ptr + s).to(tl.int64)
            if (r >= lo) & (r < lo + n):
                for d0 in range(0, D, BLOCK_D):
                    offs = d0 + tl.arange(0, BLOCK_D)
                    m = offs < D
                    v = tl.load(rows_ptr + r * stride_rows + offs, mask=m)
                    tl.store(out_ptr + t * stride_out + offs, v.to(out_ptr.dtype.element_ty), mask=m)

    @triton.jit
    def _lm_head_override_kernel(logits_ptr, hidden_ptr, slot_ptr, ids_ptr, rslot_ptr, rows_ptr, V, D,
                                 stride_l, stride_h, stride_rows, BLOCK_D: tl.constexpr):
        r = tl.program_id(0)
        b = tl.program_id(1)
        s = tl.load(slot_ptr + b).to(tl.int64)
        rs = tl.load(rslot_ptr + r).to(tl.int64)
        i = tl.load(ids_ptr + r).to(tl.int64)
        if (s >= 0) & (rs == s) & (i >= 0) & (i < V):
            acc = tl.zeros([BLOCK_D], dtype=tl.float32)
            for d0 in range(0, D, BLOCK_D):
                offs = d0 + tl.arange(0, BLOCK_D)
                m = offs < D
                h = tl.load(hidden_ptr + b * stride_h + offs, mask=m, other=0.0).to(tl.float32)
                w = tl.load(rows_ptr + r * stride_rows + offs, mask=m, other=0.0).to(tl.float32)
                acc += h * w
            tl.store(logits_ptr + b * stride_l + i, tl.sum(acc, axis=0).to(logits_ptr.dtype.element_ty))


def _need_triton(what: str) -> None:
    if triton is None:
        raise ConfigError(f"{what} on CUDA needs Triton, which is not installed: install the torch CUDA wheel's "
                          f"triton package")


def embed_override_triton(embedded_TD, ids_T, slot_T, map_SV, rows_RH, counts_S):
    _need_triton("the adapter embedding override")
    T, D = embedded_TD.shape
    if T == 0 or rows_RH.shape[0] == 0:
        return embedded_TD
    assert embedded_TD.stride(1) == 1 and rows_RH.is_contiguous() and map_SV.is_contiguous()
    S, V = map_SV.shape
    _embed_override_kernel[(T,)](embedded_TD, ids_T.contiguous(), slot_T.contiguous(), map_SV, rows_RH,
                                 counts_S.contiguous(), _slot_offsets(counts_S), S, V, D, embedded_TD.stride(0),
                                 map_SV.stride(0), rows_RH.stride(0), BLOCK_D=min(1024, triton.next_power_of_2(D)))
    return embedded_TD


def lm_head_override_triton(logits_BV, hidden_BD, slot_B, ids_R, rslot_R, rows_RH):
    _need_triton("the adapter lm_head recompute")
    B, V = logits_BV.shape
    R, D = rows_RH.shape
    if B == 0 or R == 0:
        return logits_BV
    assert logits_BV.stride(1) == 1 and hidden_BD.stride(1) == 1 and rows_RH.is_contiguous()
    _lm_head_override_kernel[(R, B)](logits_BV, hidden_BD, slot_B.contiguous(), ids_R.contiguous(),
                                     rslot_R.contiguous(), rows_RH, V, D, logits_BV.stride(0), hidden_BD.stride(0),
                                     rows_RH.stride(0), BLOCK_D=min(1024, triton.next_power_of_2(D)))
    return logits_BV


# -- dispatch by device over a TokenOverlaySet ----------------------------------------------------------------------
def apply_token_embedding(tos, ids_T, slot_T, embedded_TD):
    """Intake: override the embedded rows of adapter-trained ids per token slot (in place; returns embedded_TD)."""
    if not tos.any_active():
        return embedded_TD
    fn = embed_override_triton if embedded_TD.is_cuda else embed_override_ref
    return fn(embedded_TD, ids_T, slot_T, tos.embed_map_SV, tos.embed_rows_RH, tos.embed_counts_S)


def apply_token_lm_head(tos, hidden_BD, slot_B, logits_BV):
    """Primary: recompute the logits of each row's slot-overridden ids as hidden . row (in place)."""
    if not tos.any_active() or tos.lm_rows_RH.shape[0] == 0:
        return logits_BV
    fn = lm_head_override_triton if logits_BV.is_cuda else lm_head_override_ref
    return fn(logits_BV, hidden_BD, slot_B, tos.lm_ids_R, tos.lm_slot_R, tos.lm_rows_RH)
