"""The prefill's merged path (kernels/prefill.py MERGED: one GEMM for each layer's input projections, silu-mul as one
kernel, the conv writing q, k and v as contiguous tensors, a group's rows as a slice where they are consecutive)
through the Triton kernels (Triton's CPU interpreter, float32), against the eager step through the torch ops: same
greedy tokens, logprobs within 5e-4, for a chunked prefill whose steps are one group of every row, and groups
consecutive (a slice) and scattered (gathered); and steps mixing decode rows with prompt chunks, then the same
through the prefill graphs' pieces (uncaptured, padded), and two padded steps of the MoE's fused kernels. Run under
TRITON_INTERPRET=1 (tests/test_decode_graphs.py does); prints the counters."""
import sys
from pathlib import Path
from gaps import worst_gap

sys.path.insert(0, str(Path(__file__).parent))

import interp  # noqa: E402,F401
from memra_pp.kernels import fused_decode as fd, prefill as pf  # noqa: E402
from test_decode_graphs import pipelines  # noqa: E402

# prompts of 9, 5 and 9 tokens: whole, sequences 0 and 2 are one group (rows 0-8 and 14-22: gathered) and 1 another
# (a slice); in chunks of 3 the first step is one group of every row (its output is the layer's, no copy), the second
# groups 0 and 2 (rows 0-2 and 5-7: gathered) apart from 1 (2 tokens: a slice). Each twice: the Gated DeltaNet's
# segments as one variable-length call (pf.VARLEN: every step one call, of segments of 3 and 2 tokens in the
# second), and by groups of equal lengths
PROMPTS, CHUNK, NEW = [list(range(3, 12)), [40, 41, 42, 43, 44], list(range(60, 69))], 3, 3
# the test runs the dense model in chunks (every row path; a minute) and whole through the variable-length calls;
# `prefill_check.py all` adds whole prompts by groups and the MoE (its layers take the same path but for the MLP)
ALL = sys.argv[1:] == ["all"]
# conv_varlen alone against its reference (segment by segment through conv_prefill_ref): segments shorter than the
# conv's K - 1 (their new state keeps old inputs), longer than a tile, split into q, k, v parts; a one-token
# continuing segment among them is not a segment (the decode kernels take it), so the rows are not consecutive
import torch  # noqa: E402
from memra_pp.model.batch import StepBatch, aligned_parts  # noqa: E402

torch.manual_seed(0)
counts, starts = [2, 1, 70, 5, 33, 1], [0, 9, 0, 4, 7, 0]
step = StepBatch([3, 0, 5, 1, 2, 4], starts, counts, StepBatch.text_positions(starts, counts), [True] * 6)
seg = pf.segments(step, "cpu", 4)
assert seg is pf.segments(step, "cpu", 4) and seg.idx == [0, 2, 3, 4, 5] and seg.lens == [2, 70, 5, 33, 1], seg
assert seg.span is None and seg.short and not seg.fresh and seg.cu.tolist() == [0, 2, 72, 77, 110, 111], seg
assert seg.chunks.tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [3, 0], [4, 0]], seg.chunks
assert seg.tiles.tolist() == [[0, 0], [1, 0], [1, 1], [1, 2], [2, 0], [3, 0], [3, 1], [4, 0]], seg.tiles
assert all(t.data_ptr() % 16 == 0 for t in (seg.rows, seg.slots, seg.cu, seg.chunks, seg.tiles, seg.tail))
u, w, st = torch.randn(step.total, 24), torch.randn(24, 4), torch.randn(5, 24, 3)
before = pf.CALLS["conv_varlen"]
for parts, state in ((None, st), ((8, 8, 8), st), ((8, 8, 8), None)):     # None: every state zero, none read
    y, new = pf.conv_varlen(u, seg, w, state, parts)
    yr, newr = pf.conv_varlen_ref(u, seg, w, state if state is not None else torch.zeros_like(st), parts)
    for a, b in zip(y if parts else [y], yr if parts else [yr], strict=True):
        assert a.is_contiguous() and torch.allclose(a, b, atol=1e-5), (a - b).abs().max()
    assert torch.equal(new, newr), (new - newr).abs().max()
assert pf.CALLS["conv_varlen"] == before + 3
fresh = StepBatch([0, 1], [0, 0], [2, 9], StepBatch.text_positions([0, 0], [2, 9]), [True] * 2)
assert pf.segments(fresh, "cpu", 4).fresh and pf.segments(fresh, "cpu", 4).span == slice(0, 11)
assert [t.tolist() for t in aligned_parts([[1, 2, 3], [], [4]], "cpu")] == [[1, 2, 3], [], [4]]
print("conv_varlen ok")

CASES = [(k, c, v) for k in (["dense", "moe"] if ALL else ["dense"]) for c in ((None, CHUNK) if ALL else (CHUNK,))
         for v in (True, False)]
if not ALL:     # and the whole prompts as one variable-length call (the fresh segments' attention, whole output)
    CASES.append(("dense", None, True))
for kind, chunk, varlen in CASES:
    pf.VARLEN = varlen      # the Gated DeltaNet's segments as one variable-length call, or by groups
    eager, _ = pipelines(kind, [(0, 8)])
    fd.USE_TRITON = False          # the reference: the eager step through the torch ops
    te, le = eager.greedy(PROMPTS, NEW, chunk=chunk)
    fd.USE_TRITON = True
    before = dict(pf.CALLS)
    tk, lk = eager.greedy(PROMPTS, NEW, chunk=chunk)
    ran = {k: pf.CALLS[k] - before[k] for k in pf.CALLS}
    assert tk == te, (kind, chunk, tk, te)
    d = worst_gap(p for x, y in zip(le, lk, strict=True) for p in zip(x, y, strict=True))
    assert d < 5e-4, (kind, chunk, d)
    assert ran["merged"] > 0 and (ran["conv_varlen"] > 0) == varlen and (ran["conv_prefill"] > 0) != varlen, ran
    # whole prompts of 9 and 5 tokens are fresh segments of two lengths: one variable-length attention call in each
    # of the 2 full-attention layers (in chunks of 3 the fresh segments have one length: a group, as before)
    assert ran["attn_varlen"] == (2 if varlen and chunk is None else 0), ran
    whole = chunk is not None or varlen        # a step's rows all in one group: its output is the layer's
    # gathered rows: the groups of sequences 0 and 2; none where every segment is in one variable-length call
    gathered = not (varlen and chunk is None)
    assert (ran["rows_gather"] > 0) == gathered and ran["rows_slice"] > 0 and (ran["rows_whole"] > 0) == whole, \
        (chunk, ran)
    print(kind, "chunk", chunk, "varlen" if varlen else "groups", "ok", ran, f"logprob diff {d:.1e}")
pf.VARLEN = True        # the mixed steps' prompt chunks too (the switch's default)
# steps mixing decode rows with fresh and continuing prompt chunks (tests/test_model_parity.mixed_greedy): the
# attention's one decode call for the decode rows through its kernel, and the gated norm's many-heads tile inside
# the model (GATED_MANY lowered: the tiny model's steps have few heads)
from memra_pp.model import stage_model  # noqa: E402
from test_model_parity import mixed_greedy  # noqa: E402
# (the second step: a decode row, fresh chunks of 7 and 5 tokens with a continuing one between them: the fresh
# segments' one variable-length attention call beside other rows, gathered)
mixed = [[5, 6, 7], [9, 8, 7, 6, 5, 4, 3], list(range(10, 30)), [40, 41, 42, 43, 44]]
arrive = [0, 1, 0, 1]
eager, _ = pipelines("dense", [(0, 4), (4, 8)])
fd.USE_TRITON = False
te, le = mixed_greedy(eager, mixed, arrive, NEW, 8)
fd.USE_TRITON, many = True, fd.GATED_MANY
fd.GATED_MANY = 8
from memra_pp.model import linear_attention as la  # noqa: E402
before, single, gsingle = dict(pf.CALLS), stage_model.CALLS["single_rows"], la.CALLS["single_rows"]
try:
    tk, lk = mixed_greedy(eager, mixed, arrive, NEW, 8)
finally:
    fd.GATED_MANY = many
ran = {k: pf.CALLS[k] - before[k] for k in pf.CALLS}
ran["single_rows"] = stage_model.CALLS["single_rows"] - single
ran["gdn_single_rows"] = la.CALLS["single_rows"] - gsingle         # the decode kernels, states in place
assert tk == te, (tk, te)
d = worst_gap(p for x, y in zip(le, lk, strict=True) for p in zip(x, y, strict=True))
assert d < 5e-4, d
assert ran["single_rows"] > 0 and ran["gdn_single_rows"] > 0 and ran["merged"] > 0, ran
print("mixed ok", ran, f"logprob diff {d:.1e}")
# the same mixed steps through the prefill graphs' pieces (model/prefill_graphs.py, uncaptured: the row-wise parts
# on static buffers padded to a token bucket, the cores eager on the real rows) and the Triton kernels: what the eager
# torch steps decode
from memra_pp.kernels import fused_moe  # noqa: E402
from memra_pp.model import prefill_graphs  # noqa: E402
prefill_graphs.TOKEN_BUCKETS = (8, 16, 32)     # the interpreter's time grows with the rows: small buckets
# and with the programs: the gated norm's many-heads tile here too (16 heads a program, not one; the sections above
# ran both tiles), for this section's and the rule graphs' padded steps
fd.GATED_MANY = 8
eager, pieces = pipelines("dense", [(0, 3), (3, 8)])
fd.USE_TRITON = False
te, le = mixed_greedy(eager, mixed, arrive, NEW, 8)
fd.USE_TRITON = True
for st in pieces.stages:
    st.set_prefill_graphs(True, 32, capture=False)
tk, lk = mixed_greedy(pieces, mixed, arrive, NEW, 8)
assert tk == te, (tk, te)
d = worst_gap(p for x, y in zip(le, lk, strict=True) for p in zip(x, y, strict=True))
replays = [st.pgraphs.replays for st in pieces.stages]
assert d < 5e-4 and all(r > 0 for r in replays), (d, replays)
print("pieces dense ok", {"replays": replays[0]}, f"logprob diff {d:.1e}")
# and with the rule graphs (prefill_graphs.RuleGraphs, uncaptured): the Gated DeltaNet's chunked rule on layouts
# padded to row and segment buckets, through the torch double of fla's call, which checks every layout it is given
# (tests/padded_rule.py); q and k normalised by the l2norm kernel into the graphs' buffers. Steps of 3 segments or
# more call the rule eagerly (declined)
from padded_rule import attach  # noqa: E402
prefill_graphs.RULE_ROW_BUCKETS, prefill_graphs.SEGMENT_BUCKETS = (16, 32), (2, 3)
prefill_graphs.RULE_GRAPHS = True       # (off by default: MEMRA_PP_RULE_GRAPHS)
_, pieces = pipelines("dense", [(0, 3), (3, 8)])
rule = attach(pieces.stages, 32)
tk, lk = mixed_greedy(pieces, mixed, arrive, NEW, 8)
assert tk == te, (tk, te)
d = worst_gap(p for x, y in zip(le, lk, strict=True) for p in zip(x, y, strict=True))
rs = [st.pgraphs.stats()["rule"] for st in pieces.stages]
assert d < 5e-4 and all(r["replays"] > 0 and r["declined"] > 0 for r in rs), (d, rs)
assert any(pad for _, pad in rule.layouts) and any(0 in lens for lens, _ in rule.layouts), rule.layouts
print("rule graphs ok", rs[0], f"logprob diff {d:.1e}")
# the MoE's fused routing and experts with padding rows (the interpreter's grouped GEMM takes seconds a call: two
# steps of the first stage's two layers, not a greedy run): 14 rows padded to 16 (the per-pair kernels, as eager),
# then 25 rows padded to 48 (eager: 50 pairs, the per-pair kernels; padded: 96, the grouped GEMM), against the eager
# torch steps, hidden states out
prefill_graphs.TOKEN_BUCKETS = (16, 48)
eager, pieces = pipelines("moe", [(0, 2), (2, 8)])
(se, ce), (sp, cp) = (eager.stages[0], eager.caches[0]), (pieces.stages[0], pieces.caches[0])
sp.set_prefill_graphs(True, 48, capture=False)
moe0 = dict(fused_moe.CALLS)
d = 0.0
for slots, starts, counts in (([0, 1], [0, 0], [9, 5]), ([0, 1, 2], [9, 5, 0], [4, 1, 20])):
    b = StepBatch(slots, starts, counts, StepBatch.text_positions(starts, counts), [True] * len(slots))
    ids = torch.tensor([3 + (5 * i) % 60 for i in range(sum(counts))])
    fd.USE_TRITON = False
    ref = se(b, se.embed_ids(ids), ce)
    fd.USE_TRITON = True
    d = max(d, (sp(b, sp.embed_ids(ids), cp) - ref).abs().max().item())
moe = {k: v - moe0.get(k, 0) for k, v in fused_moe.CALLS.items() if v - moe0.get(k, 0)}
assert d < 1e-4 and sp.pgraphs.replays == 2 and moe.get("small") and moe.get("grouped"), (d, moe)
print("pieces moe ok", moe, f"logit diff {d:.1e}")
print("prefill ok")
