"""The prefill step's own kernel, the Gated DeltaNet's causal conv over each group of equal-length segments
(conv_prefill), and the load-time compilation of every kernel a prefill step runs (prefill_warm_up; the norms are
kernels/fused_decode.py's). Torch references off CUDA, as there. Runs in stage processes."""
from __future__ import annotations

import dataclasses
import itertools

import torch

from memra_pp.model.batch import aligned_parts

from memra_pp.switches import initial

from . import fused_decode
from .fused_decode import _triton, add_rms_norm, gated_rms_norm, silu_mul, triton

if triton is not None:
    import triton.language as tl

CONV_TILE = (32, 128)     # (tokens, channels) a program: one binary for every prompt length
# launches, and the merged path's layers and groups (rows a slice or gathered), so a check can assert what ran (law 3)
CALLS = {"conv_prefill": 0, "conv_varlen": 0, "attn_varlen": 0, "attn_varlen_part": 0, "merged": 0, "rows_whole": 0,
         "rows_slice": 0, "rows_gather": 0}
# the prefill's merged input projections (one GEMM for a layer's q|k|v|z|b|a, q|gate|k|v, gate|up; the last two in
# eager decode steps too) with silu-mul as one kernel, the conv writing q, k and v as contiguous tensors, and a
# group's rows as a slice where they are consecutive (no gather or scatter): CUDA only (off it the torch ops stay as
# they were, so the float32 parity with transformers is unchanged bit for bit); MEMRA_PP_PREFILL_MERGED=0 turns it
# off (gpu_decode.py --prefill-merged both: side by side), as does gpu_engine_step.py --prefill-torch ("s23")
MERGED = initial("MEMRA_PP_PREFILL_MERGED")
# on the merged path, a step's prompt segments through the Gated DeltaNet as one variable-length call of the conv and
# of the chunked rule (segments, conv_varlen; the rule's chunk_varlen), not one call per group of equal lengths:
# traffic's prompts differ in length, so a step of 8 of them was 8 groups, each some 20 launches a layer (and with
# fla a compile of chunk_local_cumsum for each new group count). On since the thirtieth session's H200 run
# (tests/test_gpu_fla.py, test_gpu_parity.py; docs/PERF.md: spread prompts' steps 1.2-5.4x faster, end to end 1.39x
# the 27B at 256 and 1.84x the 35B-A3B at 512): MEMRA_PP_PREFILL_VARLEN=0 turns it off
VARLEN = initial("MEMRA_PP_PREFILL_VARLEN")
FLA_CHUNK = 64            # fla's chunk of the gated delta rule (its default): Segments.chunks counts in these


def merged(x: torch.Tensor, lora=None, count: bool = False) -> bool:
    """Whether a step's layer on x takes the merged path above (not with a LoRA hook: it adds per projection).
    The attention's projection and the dense MLP take it in eager decode steps too (more rows than the largest
    decode graph, or no graphs), where it is the same arithmetic; `count`: a prompt step's layer asking (the
    Gated DeltaNet's and the attention's prefill), counted in CALLS["merged"]."""
    on = MERGED and lora is None and _triton(x)
    CALLS["merged"] += on and count
    return on


def row_groups(b, kind: str, device):
    """A step's groups of `kind` (StepBatch.groups: "length" or "start") and its one-token continuing segments
    (StepBatch.single_rows: a mixed step's decode rows, which the mixers take through the decode step's kernels)
    apart from them. That split is part of the merged path's switch on every device: with MERGED off every segment
    is in a group, as before (gpu_decode.py --prefill-merged both: side by side)."""
    if MERGED:
        return b.groups("prompt_" + kind, device), b.single_rows(device)
    return b.groups(kind, device), ([], None, None, None)


def whole(groups: list, T: int, merged: bool) -> bool:
    """On the merged path, whether the step's groups (StepBatch.groups) are one group of all T rows in order: its
    output is then the layer's (no copy into an output tensor)."""
    on = merged and len(groups) == 1 and groups[0][3] == slice(0, T)
    CALLS["rows_whole"] += on
    return on


def group_rows(rows: torch.Tensor, span: slice | None, merged: bool):
    """A group's rows of the step (StepBatch.groups: its row tensor and span): on the merged path the slice where
    they are consecutive (views of the step's tensors, no gather or scatter kernel), else the row tensor."""
    if merged:
        CALLS["rows_slice" if span else "rows_gather"] += 1
    return span if merged and span else rows


@dataclasses.dataclass
class Segments:
    """A step's prompt segments (all but its one-token continuing ones, StepBatch.single_rows) for one
    variable-length call: segment s is rows[cu[s]:cu[s + 1]] of the step, its cache slot slots[s]. Made once per step
    (segments), every tensor from one host-to-device copy and 16-byte aligned (batch.aligned_parts)."""
    idx: list[int]               # the segments' indices into the batch
    lens: list[int]              # their lengths
    rows: torch.Tensor           # [R] the step's rows of every segment, in order
    slots: torch.Tensor          # [N]
    span: slice | None           # rows as a slice of the step's rows where consecutive (no gather), else None
    cu: torch.Tensor             # [N + 1] each segment's first position in rows, then R (fla's cu_seqlens)
    chunks: torch.Tensor         # [NT, 2] (segment, chunk) of every FLA_CHUNK-token chunk (fla's chunk_indices)
    tiles: torch.Tensor          # [NB, 2] (segment, tile) of every CONV_TILE[0]-token tile (conv_varlen's programs)
    tail: torch.Tensor           # [N, K - 1] the step row of each segment's last K-1 inputs, or -1 - i where it
    short: bool                  # is state column i (some segment shorter than K - 1: short)
    fresh: bool                  # every segment a new sequence's first (its states zero: none read)


def _packed_rows(b, idx: list[int]) -> tuple[list[int], slice | None]:
    """The step's rows of segments idx, in order, and those rows as a slice where consecutive (else None)."""
    offs = b.offsets
    rows = [offs[i] + t for i in idx for t in range(b.counts[i])]
    return rows, (slice(rows[0], rows[0] + len(rows)) if rows == list(range(rows[0], rows[0] + len(rows))) else None)


def chunk_pairs(lens: list[int], size: int) -> list[int]:
    """(segment, chunk) of every `size`-row chunk of segments of `lens`, flat (fla's chunk indices at FLA_CHUNK)."""
    return [x for s, n in enumerate(lens) for j in range(-(-n // size)) for x in (s, j)]


def segments(b, device, K: int) -> Segments:
    """The step's Segments (b: a StepBatch with prompt segments; K: the conv's kernel width), made once per step."""
    cache = b.__dict__.setdefault("_segments", {})
    key = (str(device), K)
    if key in cache:
        return cache[key]
    single = set(b.single_rows(device)[0])
    idx = [i for i in range(len(b.slots)) if i not in single]
    lens = [b.counts[i] for i in idx]
    rows, span = _packed_rows(b, idx)
    cu = [0, *itertools.accumulate(lens)]
    # a segment's input at position p = n - (K - 1) + j: its row for p >= 0, else the state's column K - 1 + p
    tail = [rows[cu[s] + p] if p >= 0 else -1 - (K - 1 + p)
            for s, n in enumerate(lens) for p in range(n - (K - 1), n)]
    parts = aligned_parts([rows, [b.slots[i] for i in idx], cu, chunk_pairs(lens, FLA_CHUNK),
                           chunk_pairs(lens, CONV_TILE[0]), tail], device)
    seg = Segments(idx, lens, parts[0], parts[1], span, parts[2], parts[3].view(-1, 2), parts[4].view(-1, 2),
                   parts[5].view(len(lens), K - 1), min(lens) < K - 1, all(b.starts[i] == 0 for i in idx))
    cache[key] = seg
    return seg


@dataclasses.dataclass
class FreshSegments:
    """A step's fresh prompt segments (start 0) for one variable-length attention call (model/attention.py
    attend_varlen): segment s is rows[cu[s]:cu[s + 1]] of the step. Made once per step (fresh_segments)."""
    lens: list[int]
    rows: torch.Tensor           # [R] int64
    span: slice | None           # rows as a slice where consecutive
    cu32: torch.Tensor           # [N + 1] int32 (flash attention's cu_seqlens)


def fresh_segments(b, device, dtype) -> FreshSegments | None:
    """The step's FreshSegments where the variable-length attention replaces groups (VARLEN; fresh segments of more
    than one length, one length being one group already; on CUDA in half precision, where flash attention's
    variable-length kernel takes them: elsewhere on CUDA it would be a call a segment, and off CUDA it is, for the
    interpreter checks), else None."""
    cache = b.__dict__.setdefault("_segments", {})
    key = ("fresh", str(device), VARLEN)     # VARLEN: a benchmark flips it between ways over one StepBatch
    if torch.device(device).type == "cuda" and dtype not in (torch.bfloat16, torch.float16):
        return None
    if key not in cache:
        single = set(b.single_rows(device)[0])
        idx = [i for i in range(len(b.slots)) if i not in single and b.starts[i] == 0]
        lens = [b.counts[i] for i in idx]
        cache[key] = None
        if VARLEN and len(set(lens)) > 1:
            rows, span = _packed_rows(b, idx)
            parts = aligned_parts([rows, [0, *itertools.accumulate(lens)]], device)
            cache[key] = FreshSegments(lens, parts[0], span, parts[1].to(torch.int32))
    return cache[key]


def conv_varlen_ref(u_TC, seg: Segments, w_CK, state_NCK1, parts=None):
    """conv_prefill_ref over the segments, those of one length in one call (state_NCK1: every segment's state,
    fresh ones zero; None: all zero)."""
    from memra_pp.model.gdn import length_groups
    y = u_TC.new_empty(sum(seg.lens), u_TC.shape[1])
    news = u_TC.new_empty(len(seg.lens), u_TC.shape[1], w_CK.shape[1] - 1)
    for n, idx, out in length_groups(seg.lens, u_TC.device):
        g, news[idx] = conv_prefill_ref(u_TC, seg.rows[out], w_CK, None if state_NCK1 is None else state_NCK1[idx],
                                        len(idx), n)
        y[out] = g.reshape(len(idx) * n, -1)
    return (y if parts is None else list(torch.split(y, list(parts), -1))), news


def conv_varlen(u_TC, seg: Segments, w_CK, state_NCK1, parts=None):
    """conv_prefill over segments of any lengths in one kernel (program per (segment, tile): Segments.tiles):
    returns (y [R, C], or with parts a list of contiguous [R, part] tensors; the new states [N, C, K-1]). state_NCK1
    is every segment's state (a fresh sequence's is zero: StageCache.reset), or None where all are zero (seg.fresh:
    none read)."""
    if not _triton(u_TC):
        return conv_varlen_ref(u_TC, seg, w_CK, state_NCK1, parts)
    C, K = u_TC.shape[1], w_CK.shape[1]
    assert state_NCK1 is None or state_NCK1.shape == (len(seg.lens), C, K - 1)
    y, st = _conv_launch(u_TC, seg.rows, state_NCK1, w_CK, 0, seg.tiles.shape[0], parts, seg)
    new = u_TC[seg.tail.clamp(min=0)].transpose(1, 2)            # [N, C, K-1]
    if seg.short:     # a segment shorter than K - 1 keeps some of its old state's inputs (zero: none)
        old = torch.zeros((), dtype=new.dtype, device=new.device) if state_NCK1 is None else \
            st.gather(2, (-1 - seg.tail).clamp(0, K - 2)[:, None, :].expand(-1, C, -1)).to(new.dtype)
        new = torch.where(seg.tail[:, None, :] >= 0, new, old)
    return (y[0] if parts is None else y), new


def conv_prefill_ref(u_TC, rows, w_CK, state_GCK1, G: int, n: int, parts=None):
    """gdn.causal_conv_batch over the segments' rows, gathered (y split into views of `parts` channels)."""
    from memra_pp.model.gdn import causal_conv_batch
    y, new = causal_conv_batch(u_TC[rows].view(G, n, -1), w_CK, state_GCK1)
    return (y if parts is None else list(torch.split(y, list(parts), -1))), new


def _conv_launch(u_TC, rows, state, w_CK, n: int, programs: int, parts, seg: Segments | None = None):
    """The conv kernel over the R rows `rows` of u in `programs` x channel-tile programs: segments of n rows each, or
    (seg) Segments' tiles of any lengths. Returns (y: [R, part] views of one buffer, a part each, or [R, C]; the
    state the kernel read, u itself where there is none)."""
    C, K, R = u_TC.shape[1], w_CK.shape[1], rows.numel()
    assert u_TC.stride(1) == 1 and w_CK.is_contiguous()
    assert (parts is None or (sum(parts) == C and len(parts) <= 3)) and all(p >= 0 for p in (parts or ()))
    ends = list(itertools.accumulate(parts or (C,)))        # each part's channel end; the last is C
    C1, C2 = (ends + [C, C])[:2]
    st = state.contiguous() if state is not None else u_TC
    flat = torch.empty(R * C, dtype=u_TC.dtype, device=u_TC.device)
    BT, BC = CONV_TILE
    CALLS["conv_prefill" if seg is None else "conv_varlen"] += 1
    tiles, cu = (rows, rows) if seg is None else (seg.tiles, seg.cu)
    _conv_prefill_kernel[(programs, triton.cdiv(C, BC))](
        u_TC, rows, st, w_CK, flat, u_TC.stride(0), n, C, C1, C2, R, tiles, cu, K=K, BT=BT, BC=BC,
        HAS_STATE=state is not None, VARLEN=seg is not None, num_warps=4)
    return [flat[R * a:R * b].view(R, b - a) for a, b in zip([0] + ends, ends)], st


def conv_prefill(u_TC, rows, w_CK, state_GCK1, G: int, n: int, parts=None):
    """silu(depthwise causal conv) over G segments of n tokens each: their rows of u [T, C] (unit last stride) are
    `rows` [G * n], segment by segment; the K-1 inputs before each segment come from state [G, C, K-1] (None:
    zeros, fresh prompts). Returns (y [G, n, C], new states [G, C, K-1]: each segment's last K-1 inputs), as
    gdn.causal_conv_batch rounds (the products summed in fp32, rounded, then silu). One kernel in place of the
    eager path's gather, concatenation, transposes, depthwise conv and silu (about 1.5 ms a layer at 4,096 tokens
    of the 27B on an H200). With parts (channel counts, at most three, summing to C: the Gated DeltaNet's q, k,
    v), y is a list of [G, n, part] tensors, each contiguous on CUDA (written so by the kernel: fla then copies
    none of them) and views of one y elsewhere."""
    if not _triton(u_TC):
        return conv_prefill_ref(u_TC, rows, w_CK, state_GCK1, G, n, parts)
    C, K = u_TC.shape[1], w_CK.shape[1]
    assert rows.numel() == G * n
    y, _ = _conv_launch(u_TC, rows, state_GCK1, w_CK, n, G * triton.cdiv(n, CONV_TILE[0]), parts)
    y = [x.view(G, n, -1) for x in y]
    y = y[0] if parts is None else y
    if n >= K - 1:            # each segment's last K-1 inputs, [G, C, K-1]
        new = u_TC[rows.view(G, n)[:, n - (K - 1):]].transpose(1, 2)
    else:
        prev = state_GCK1 if state_GCK1 is not None else u_TC.new_zeros(G, C, K - 1)
        new = torch.cat([prev.to(u_TC.dtype), u_TC[rows].view(G, n, C).transpose(1, 2)], 2)[:, :, -(K - 1):]
    return y, new


def prefill_warm_up(cfg, gdn: bool, full: bool, dtype, device) -> None:
    """Compile, at a stage's load and not in its first request's prefill, the prefill's kernels at the model's
    dimensions (cfg: the text config): the norms (input; residual + post-attention), and where the stage has them
    the Gated DeltaNet's conv (fresh and continuing, whole and split into q, k, v; with VARLEN over segments of any
    lengths) and gated norm (both tiles), the
    attention's q / k norms with their rotary embedding (q's heads a strided view, as in the projection), and a
    dense MLP's silu-mul. (The one-split decode attention of a mixed step's decode rows compiles when a cache is
    made: warm_single_rows, against its own table.)"""
    T, H = 64, cfg.hidden_size

    def z(*shape):
        return torch.zeros(*shape, dtype=dtype, device=device)
    x, w = z(T, H), z(H)
    add_rms_norm(x, None, w, cfg.rms_norm_eps)
    add_rms_norm(x, z(T, H), w, cfg.rms_norm_eps)
    if gdn:
        C, K = cfg.conv_dim, cfg.linear_conv_kernel_dim
        rows = torch.arange(T, device=device)
        qk = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        # u as the engine passes it: its own projection (row stride C) or the merged one's first C columns (row
        # stride C + Z + 2 nv); Triton specializes the stride by its divisibility by 16, so both are compiled here
        W = C + cfg.linear_num_value_heads * (cfg.linear_value_head_dim + 2)
        for u in (z(T, C), z(T, W)[:, :C]):
            for state in (None, z(1, C, K - 1)):    # q, k, v split (whole: the same binary, at these dimensions)
                conv_prefill(u, rows, z(C, K), state, 1, T, (qk, qk, C - 2 * qk))
            if VARLEN:      # and over segments of two lengths, fresh and continuing
                from memra_pp.model.batch import StepBatch
                two = StepBatch([0, 1], [0, 0], [40, T - 40], StepBatch.text_positions([0, 0], [40, T - 40]),
                                [True] * 2)
                for state in (None, z(2, C, K - 1)):
                    conv_varlen(u, segments(two, device, K), z(C, K), state, (qk, qk, C - 2 * qk))
        nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
        many = fused_decode.GATED_MANY      # (read now: a check lowers it for the interpreter)
        for n in (max(1, (many - 1) // nv), -(-many // nv)):     # both of the gated norm's tiles
            gated_rms_norm(z(n, nv, dv), z(n, nv, dv), z(dv), cfg.rms_norm_eps)
    if not cfg.moe:
        silu_mul(z(T, 2 * cfg.intermediate_size))
    if full:
        D, r = cfg.head_dim, cfg.rotary_dim
        cs = (z(T, r), z(T, r))
        q = z(T, cfg.num_attention_heads, 2 * D)[..., :D]
        add_rms_norm(q, None, z(D), cfg.rms_norm_eps, rope=cs)
        add_rms_norm(z(T, cfg.num_key_value_heads, D), None, z(D), cfg.rms_norm_eps, rope=cs)


if triton is not None:
    # one binary for every prompt length, and for rows at any offset into the step's index tensor (a later group's
    # rows start where the one before ended: 8-byte aligned, not always 16); tiles and cu too (the groups path passes
    # rows for them, unread: specialized, a group's alignment would pick a second binary in a request)
    # y: the output's channels [0, C1), [C1, C2), [C2, C) each a contiguous [R, part] block, one after the other
    @triton.jit(do_not_specialize=["n", "rows", "R", "tiles", "cu"])
    def _conv_prefill_kernel(u, rows, state, w, y, su, n, C, C1, C2, R, tiles, cu, K: tl.constexpr,
                             BT: tl.constexpr, BC: tl.constexpr, HAS_STATE: tl.constexpr, VARLEN: tl.constexpr):
        # VARLEN: program i takes tile tiles[i] = (segment, tile) of segments of any lengths, segment s being rows
        # cu[s]:cu[s + 1] of `rows` (n unused); else G segments of n rows each, nb programs a segment
        if VARLEN:
            g = tl.load(tiles + 2 * tl.program_id(0)).to(tl.int64)
            t = tl.load(tiles + 2 * tl.program_id(0) + 1) * BT + tl.arange(0, BT)
            base = tl.load(cu + g)
            n_g = (tl.load(cu + g + 1) - base).to(tl.int32)
        else:
            nb = tl.cdiv(n, BT)
            g = (tl.program_id(0) // nb).to(tl.int64)
            t = (tl.program_id(0) % nb) * BT + tl.arange(0, BT)
            base = g * n
            n_g = n
        c = tl.program_id(1) * BC + tl.arange(0, BC)
        mt, mc = t < n_g, c < C
        acc = tl.zeros([BT, BC], dtype=tl.float32)
        for j in tl.static_range(K):
            tt = t - (K - 1) + j                      # the input this tap reads: < 0 is before the segment
            inseg = mt & (tt >= 0)
            r = tl.load(rows + base + tt, mask=inseg, other=0).to(tl.int64)
            x = tl.load(u + r[:, None] * su + c[None, :], mask=inseg[:, None] & mc[None, :], other=0)
            if HAS_STATE:
                before = mt & (tt < 0)
                s = tl.load(state + g * C * (K - 1) + c[None, :] * (K - 1) + (tt[:, None] + (K - 1)),
                            mask=before[:, None] & mc[None, :], other=0)
                x = tl.where(before[:, None], s.to(x.dtype), x)
            acc += x.to(tl.float32) * tl.load(w + c * K + j, mask=mc, other=0).to(tl.float32)[None, :]
        yv = acc.to(y.dtype.element_ty).to(tl.float32)
        p0, p1 = c < C1, (c >= C1) & (c < C2)
        start = tl.where(p0, 0, tl.where(p1, C1, C2))                  # the part's first channel
        width = tl.where(p0, C1, tl.where(p1, C2 - C1, C - C2))
        at = start.to(tl.int64) * R + (base + t[:, None]).to(tl.int64) * width[None, :] + (c - start)[None, :]
        tl.store(y + at, (yv / (1.0 + tl.exp(-yv))).to(y.dtype.element_ty), mask=mt[:, None] & mc[None, :])


def warm_single_rows(cfg, cache, layers) -> None:
    """Compile what a mixed step's decode rows take against this cache's pools and table (Triton compiles integers
    by divisibility, so the table's row stride must be the real one): the one-split decode attention
    (stage_model.Layer._attention) and the Gated DeltaNet's conv and recurrent steps in place
    (linear_attention.GatedDeltaNet.forward), over two rows of the scratch slot (its pages are the sink block; its
    states are scratch), one position each."""
    from memra_pp.kernels.paged_attention import decode_attention
    full = next((la for la in layers if la.full), None)
    gdn = next((la for la in layers if not la.full), None)
    pool = cache.k[full.i] if full is not None else cache.rec[gdn.i]
    if not _triton(pool):
        return
    slots = torch.full((2,), cache.scratch, dtype=torch.long, device=pool.device)
    if full is not None:
        kp, vp = cache.k[full.i], cache.v[full.i]
        nh, D = cfg.num_attention_heads, cfg.head_dim
        q = torch.zeros(2, nh, D, dtype=kp.dtype, device=kp.device)
        decode_attention(q, q.view(2, nh * D), kp, vp, cache.table, slots, torch.ones_like(slots), 1, max_splits=1)
    if gdn is not None:
        from .gdn_decode import conv_step, gdn_decode_fused
        m = gdn.mixer
        u = torch.zeros(2, cfg.conv_dim, dtype=m.in_proj.dtype, device=pool.device)    # the gathered rows of u,
        ba = torch.zeros(2, cfg.linear_num_value_heads, dtype=u.dtype, device=u.device)   # b and a
        y = conv_step(u, cache.conv[gdn.i], m.conv1d_weight[:, 0, :], slots)
        gdn_decode_fused(y, ba, ba, m.A_log, m.dt_bias, cache.rec[gdn.i], slots, cfg.linear_num_key_heads,
                         cfg.linear_key_head_dim ** -0.5)
