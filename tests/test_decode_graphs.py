"""The decode step a CUDA graph captures (static buffers, bucketed batch padded onto the scratch slot, bucketed KV
length, the MoE's all-experts form, the in-place Gated DeltaNet step) must decode exactly what the eager step
decodes. On CPU the same static step runs uncaptured (capture=False); tests/test_gpu_decode_graphs.py captures."""
import ast

import pytest
import torch

import interp
from conftest_models import tiny_checkpoint
from memra_pp.kernels.gdn_decode import gdn_decode_ref
from memra_pp.model.decode_graphs import DecodeGraphs, bucket
from memra_pp.model.gdn import recurrent_gated_delta_rule
from memra_pp.model.local import LocalPipeline
from memra_pp.model.weights import SafetensorsSource
from gaps import worst_gap


# the tests that count graphs by (batch, KV-length) key run with ANY_KV off, whatever the environment says (those of
# ANY_KV turn it on themselves)
pytestmark = pytest.mark.usefixtures("graphs_per_kv_bucket")


def pipelines(kind, splits, max_seqs=6, max_context=1024):
    _, path = tiny_checkpoint(kind, False)
    src = SafetensorsSource(path)
    eager = LocalPipeline(src, splits, max_seqs=max_seqs, max_context=max_context)
    static = LocalPipeline(src, splits, max_seqs=max_seqs, max_context=max_context)
    for s, c in zip(static.stages, static.caches, strict=True):
        s.graphs = DecodeGraphs(s, c, max_seqs, capture=False)
    return eager, static


@pytest.mark.parametrize("kind,splits,n", [("dense", [(0, 8)], 3), ("dense", [(0, 3), (3, 8)], 3),
                                           ("moe", [(0, 2), (2, 5), (5, 8)], 3), ("moe", [(0, 4), (4, 8)], 1)])
def test_static_decode_equals_eager(kind, splits, n):
    """3 sequences run bucket 4 with one padding row (the MoE with every expert on every row); 1 sequence runs
    bucket 1 (the MoE copying out its 2 routed experts). The graphs' index block flags the real rows (the fused MoE
    routes the padding row to no expert: tests/fused_step_check.py)."""
    from memra_pp.model.layers import MOE_CALLS, MoE
    eager, static = pipelines(kind, splits)
    prompts = [[5, 6, 7], list(range(20, 45)), [9]][:n]
    te, le = eager.greedy(prompts, 12)
    before = dict(MOE_CALLS)
    ts, ls = static.greedy(prompts, 12)
    forms = {k: MOE_CALLS[k] - before[k] for k in MOE_CALLS}
    if kind == "moe":   # each MoE layer's 11 decode steps took the static form the bucket gives (prefill: routed)
        moe_layers = sum(isinstance(layer.ffn, MoE) for st in static.stages for layer in st.layers)
        assert forms == {"gathered": 11 * moe_layers if n == 1 else 0, "all_experts": 11 * moe_layers if n == 3 else 0,
                         "routed": moe_layers}, (forms, moe_layers)
    assert ts == te
    assert worst_gap(p for x, y in zip(le, ls, strict=True) for p in zip(x, y, strict=True)) < 5e-4
    for s in static.stages:
        st = s.graphs.stats()
        assert st["replays"] == 11 and st["graphs"] == [({3: 4, 1: 1}[n], 256)], st
        assert s.graphs.live[:{3: 4, 1: 1}[n]].tolist() == {3: [1, 1, 1, 0], 1: [1]}[n]


def test_kv_growth_drops_and_recaptures():
    """A sequence that needs a page when none is free grows the paged pools (a reallocation): graphs over the old
    pools are dropped and recaptured; tokens still equal the eager ones. Crossing a page boundary while pages are
    free reallocates nothing."""
    eager, static = pipelines("dense", [(0, 4), (4, 8)], max_seqs=2)
    c = static.caches[0]
    assert (c.n_blocks, c.kv_block) == (10, 64)                # the null page, the scratch's sink + 4 per slot
    prompts = [[4 + i % 200 for i in range(446)], [7, 8]]    # 7 + 1 pages: every free one; 446 + 12 needs an 8th
    te, le = eager.greedy(prompts, 12)
    ts, ls = static.greedy(prompts, 12)
    assert ts == te
    assert worst_gap(p for x, y in zip(le, ls, strict=True) for p in zip(x, y, strict=True)) < 5e-4
    g = static.stages[0].graphs
    assert c.grown == 1 and c.n_blocks == 20 and [len(o) for o in c.owned] == [8, 1, 0]
    assert g.captures == 2 and g.stats()["graphs"] == [(2, 512)], g.stats()


@pytest.mark.parametrize("any_kv", [False, True])
def test_crossing_a_kv_bucket(monkeypatch, any_kv):
    """A sequence whose positions cross 256 mid-decode: a graph per (batch, KV-length) bucket captures a second
    graph there; with decode_graphs.ANY_KV one graph per batch bucket serves every length (its attention over the
    cache's capacity). Tokens equal the eager ones either way."""
    import memra_pp.model.decode_graphs as dg
    monkeypatch.setattr(dg, "ANY_KV", any_kv)
    eager, static = pipelines("dense", [(0, 4), (4, 8)], max_seqs=2)
    prompts = [[4 + i % 200 for i in range(250)], [7, 8]]    # positions 250 .. 261: across 256
    te, le = eager.greedy(prompts, 12)
    ts, ls = static.greedy(prompts, 12)
    assert ts == te
    assert worst_gap(p for x, y in zip(le, ls, strict=True) for p in zip(x, y, strict=True)) < 5e-4
    for st, c in zip(static.stages, static.caches, strict=True):
        want = [(2, c.max_positions)] if any_kv else [(2, 256), (2, 512)]
        assert st.graphs.stats()["graphs"] == want and st.graphs.captures == len(want), st.graphs.stats()


def test_every_graph_writes_one_output_buffer():
    """The step of every bucket writes its rows into the stage's one output buffer (the largest bucket's rows; float32
    logits on the primary) by its last kernel, not into an output of its own that its graph would keep."""
    _, static = pipelines("dense", [(0, 4), (4, 8)], max_seqs=6)
    for s in static.stages:
        g = s.graphs
        assert g.out.shape == (g.buckets[-1], s.lm_head.shape[0] if s.primary else s.mc.text.hidden_size)
        assert g.out.dtype == (torch.float32 if s.primary else s.dtype)
        for nb in g.buckets:
            o = g._step(nb, 256)
            assert o.data_ptr() == g.out.data_ptr() and o.shape[0] == nb and torch.isfinite(o).all(), nb


def test_graphs_outlive_an_in_place_growth_only_over_kernels_that_take_addresses(monkeypatch):
    """A KV pool growth in place (generation unchanged, more blocks) must keep the graphs' key where the step's KV
    kernels take the pools by pointer and strides (Triton's), and must change it where they are the torch references,
    whose indexing bakes the pools' size into a graph."""
    from memra_pp.kernels import fused_decode
    _, static = pipelines("dense", [(0, 8)], max_seqs=2)
    c, g = static.caches[0], static.stages[0].graphs
    key = g._kv_key()
    c.n_blocks += 16                                    # what a growth in place changes
    assert g._kv_key() != key and g._kv_key() == (0, c.n_blocks)         # CPU: the references
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert g._kv_key() == (0, 0)
    monkeypatch.setattr(fused_decode, "USE_TRITON", False)
    assert g._kv_key() == (0, c.n_blocks)


def test_every_batch_bucket_captured_at_load(monkeypatch):
    """With decode_graphs.ANY_KV a stage captures every batch bucket's graph when it loads (the runner calls
    StageModel.capture_decode_graphs), the largest first, so decoding captures none; a graph per KV bucket is
    captured on first use instead. A capture that fails leaves the stage decoding eagerly, with the reason."""
    import memra_pp.model.decode_graphs as dg
    eager, static = pipelines("dense", [(0, 4), (4, 8)], max_seqs=6)
    assert [s.capture_decode_graphs() for s in static.stages] == [0, 0]    # ANY_KV off (the module's fixture)
    monkeypatch.setattr(dg, "ANY_KV", True)
    order, real = [], dg.DecodeGraphs._capture
    monkeypatch.setattr(dg.DecodeGraphs, "_capture", lambda self, nb, S: (order.append(nb), real(self, nb, S))[1])
    assert [s.capture_decode_graphs() for s in static.stages] == [4, 4]
    assert order == [8, 4, 2, 1] * 2
    prompts = [[5, 6, 7], list(range(20, 45)), [9]]
    te, le = eager.greedy(prompts, 8)
    ts, ls = static.greedy(prompts, 8)
    assert ts == te
    assert worst_gap(p for x, y in zip(le, ls, strict=True) for p in zip(x, y, strict=True)) < 5e-4
    for s, c in zip(static.stages, static.caches, strict=True):
        st = s.graphs.stats()
        assert st == {"captures": 4, "replays": 7, "graphs": [(b, c.max_positions) for b in (1, 2, 4, 8)]}, st

    def fail(self, nb, S):
        raise dg.CaptureFailed(f"decode graph capture (batch {nb}, kv {S}) failed: RuntimeError: no room")
    s0 = static.stages[0]
    s0.graphs.graphs.clear()
    monkeypatch.setattr(dg.DecodeGraphs, "_capture", fail)
    with pytest.warns(UserWarning, match=r"layers \[0, 4\): decode graph capture \(batch 8, kv \d+\) failed: "
                                         r"RuntimeError: no room; decoding eagerly"):
        assert s0.capture_decode_graphs() == 0
    assert s0.graphs is None and "(batch 8," in s0.graphs_failed and "no room" in s0.graphs_failed
    assert static.greedy(prompts, 8)[0] == te          # the stage decodes eagerly, the same tokens


def test_eligibility():
    _, static = pipelines("dense", [(0, 8)], max_seqs=6)
    g = static.stages[0].graphs
    assert g.buckets == (1, 2, 4, 8)
    assert bucket(5, g.buckets) == 8 and bucket(9, g.buckets) is None
    from memra_pp.model.batch import StepBatch
    dec = StepBatch([0, 1], [3, 4], [1, 1], StepBatch.text_positions([3, 4], [1, 1]), [True, True])
    assert g.takes(dec)
    assert not g.takes(StepBatch([0], [0], [3], StepBatch.text_positions([0], [3]), [True]))      # prefill
    assert not g.takes(StepBatch([0, 1], [3, 4], [1, 1], dec.pos_3T, [True, True], [0, -1]))     # adapter
    assert not g.takes(StepBatch([0, 1], [3, 4], [1, 1], dec.pos_3T, [True, False]))             # primary row


def test_gdn_decode_reference_is_the_recurrence():
    """The in-place step (un-repeated q/k heads, state pool indexed by slot) equals the recurrence over gathered
    states with repeated heads, and leaves every other slot untouched."""
    torch.manual_seed(0)
    B, H, HV, K, V, N = 3, 2, 4, 16, 8, 6
    q, k, v = torch.randn(B, H, K), torch.randn(B, H, K), torch.randn(B, HV, V)
    g, beta = -torch.rand(B, HV), torch.rand(B, HV)
    pool = torch.randn(N, HV, K, V)
    slots = torch.tensor([4, 0, 2])
    before = pool.clone()
    o = gdn_decode_ref(q, k, v, g, beta, pool, slots, K ** -0.5)
    ro, rs = recurrent_gated_delta_rule(q.repeat_interleave(2, 1)[:, None], k.repeat_interleave(2, 1)[:, None],
                                        v[:, None], g[:, None], beta[:, None], before[slots])
    assert torch.allclose(o, ro[:, 0], atol=1e-5) and torch.allclose(pool[slots], rs, atol=1e-5)
    assert torch.equal(pool[[1, 3, 5]], before[[1, 3, 5]])


@pytest.mark.interpreter("fused_decode")
def test_fused_decode_kernels_in_the_interpreter():
    """The decode kernels (RMSNorm + residual on strided rows, gated norm, silu-mul, the conv step in place at the
    slots, the Gated DeltaNet step from raw projections with one and several value tiles, and the in-place step of
    kernels/gdn_decode.py) against their torch references, by Triton's CPU interpreter, in float32 and bfloat16 at
    once; tests/test_gpu_decode_graphs.py runs the same check compiled on the GPU."""
    for dtype, (code, out, err) in zip(("float32", "bfloat16"), interp.results("fused_decode"), strict=True):
        assert code == 0 and "fused ok" in out, dtype + ": " + err[-3000:]


@pytest.mark.interpreter("fused_step")
def test_one_row_step_through_the_fused_kernels_in_the_interpreter():
    """The decode graphs' one-row step (two stages of the MoE model) through the Triton kernels in Triton's
    interpreter, float32: the GEMVs with and without their norm (kernels/gemv.py), the attention's q / k norms with
    the new key and value's write in one kernel (kernels/paged_attention.py), the GDN, attention and MoE kernels (the
    shared gate computed early; then, in a second process at the same time, the MoE as one block kernel,
    kernels/moe_block.py) must decode what the eager torch step decodes; the counts prove those kinds ran. The first
    process also decodes three sequences at once: the graph of four rows, whose padding row (its input NaN on each
    stage) the MoE routes to no expert in each of the 8 layers at each of the 2 decode steps, and whose Gated
    DeltaNet steps leave the scratch slot's states untouched (decode_graphs.SKIP_PADDING)."""
    for which, (code, out, err) in zip(("noblock", "block"), interp.results("fused_step"), strict=True):
        assert code == 0 and "step ok" in out, which + ": " + out + err[-3000:]
        assert ("padding rows routed to no expert: 16 routings" in out) == (which == "noblock"), out
        calls = ast.literal_eval(out.split("step ok", 1)[1].strip())
        assert calls["gemv"] > 0 and calls["norm_gemv"] > 0 and calls["qk_kv_write"] > 0 \
            and calls["shared_gate"] > 0 and (calls["block"] > 0) == (which == "block"), (which, calls)


@pytest.mark.interpreter("prefill")
def test_prefill_merged_path_in_the_interpreter():
    """The prefill's merged path (one GEMM for each layer's input projections, silu-mul as one kernel, the conv's q,
    k and v written contiguous, a group's rows as a slice, or the layer's output where one group holds every row)
    through the Triton kernels in Triton's interpreter, float32: a chunked prefill of three prompts (its Gated
    DeltaNet segments as one variable-length call, then by groups of equal lengths), and steps mixing
    decode rows (one decode-attention kernel call) with prompt chunks, must decode what the eager torch steps decode;
    the counters prove each row path ran (tests/prefill_check.py). Then the prefill graphs' pieces, uncaptured, with
    their padding rows: the mixed steps, the same with the rule graphs, and two steps of the MoE through its fused
    kernels."""
    (code, out, err), = interp.results("prefill")
    assert code == 0 and "prefill ok" in out, out + err[-3000:]
    ran = [ast.literal_eval(line[line.index("{"):line.index("}") + 1]) for line in out.splitlines()
           if " ok {" in line and not line.startswith(("pieces", "rule graphs"))]
    # the chunked prefill (variable-length, then by groups), the whole prompts (variable-length), the mixed steps
    assert len(ran) == 4, out
    # the mixed steps through the prefill graphs' pieces (uncaptured), and the MoE's padded steps through both of
    # its fused experts' paths
    pieces = {line.split()[1]: ast.literal_eval(line[line.index("{"):line.index("}") + 1])
              for line in out.splitlines() if line.startswith("pieces ")}
    assert pieces["dense"]["replays"] > 0 and pieces["moe"]["small"] > 0 and pieces["moe"]["grouped"] > 0, out
    # and the mixed steps with the rule graphs (uncaptured, over the torch double of fla's call): replayed, and
    # declined where a step had more segments than their buckets hold
    rule = [ast.literal_eval(line[line.index("{"):line.index("}") + 1]) for line in out.splitlines()
            if line.startswith("rule graphs ok")]
    assert len(rule) == 1 and rule[0]["replays"] > 0 and rule[0]["declined"] > 0, out
    assert all(ran[0][k] > 0 for k in ("merged", "conv_varlen", "rows_whole", "rows_slice", "rows_gather")), ran
    assert ran[1]["conv_prefill"] > 0 and ran[1]["conv_varlen"] == 0 and ran[3]["single_rows"] > 0, ran
    # whole prompts of two lengths: one attention call a full-attention layer, every row in one call (no gather)
    assert ran[2]["attn_varlen"] == 2 and ran[2]["rows_gather"] == 0, ran
    # the mixed steps' fresh chunks of two lengths: one attention call, beside a decode row and a continuing chunk
    assert ran[3]["attn_varlen_part"] > 0, ran


@pytest.mark.interpreter("fused_moe")
def test_fused_moe_kernels_in_the_interpreter():
    """The fused MoE routing and experts (kernels/fused_moe.py: the router kernel, the per-pair kernels with both
    down kernels, with and without the shared expert riding in them, and the grouped GEMM over pairs sorted by
    expert, with its alignment; a decode graph's padding rows routed to no expert, their pairs skipped by the
    kernels and both alignments, a NaN in their inputs reaching no real row) against their torch references, by
    Triton's CPU interpreter, in
    float32 (the interpreter's bfloat16 tl.dot is wrong); tests/test_gpu_decode_graphs.py runs it compiled in both
    dtypes and inside a CUDA graph. The check's two halves run at once (about 1.5 minutes each here)."""
    ran = set()
    for code, out, err in interp.results("fused_moe"):
        assert code == 0 and "moe ok " in out, out + err[-3000:]
        ran |= set(ast.literal_eval(out.split("moe ok ", 1)[1].strip()))
    assert sorted(ran) == ['align', 'down ids after wait', 'down loop', 'down tile', 'grouped16x64', 'grouped64x64',
                           'nan row', 'norm router', 'padding rows grouped', 'padding rows small', 'route', 'router',
                           'router nan and ties', 'shared',
                           'shared before wait', 'shared gate early', 'shared gate late', 'small', 'warm up']


@pytest.mark.interpreter("moe_block")
def test_moe_block_kernel_in_the_interpreter():
    """kernels/moe_block.py's one-row MoE block must match the torch references (the residual and norm, the
    routing, the routed and shared experts), by Triton's CPU interpreter in float32 and bfloat16 (at once), at
    program counts that make every phase loop or leave programs idle, at several tiles; ties must go to the lowest
    expert and a NaN logit of either sign must make the row NaN. Its three phases run as three launches there (the
    interpreter runs programs one after another: a grid barrier would never open). MoE.decode_fused takes it where
    enabled, else the three kernels. tests/test_gpu_decode_graphs.py runs the one kernel with its barriers, compiled
    and in a CUDA graph."""
    for dtype, (code, out, err) in zip(("float32", "bfloat16"), interp.results("moe_block"), strict=True):
        assert code == 0 and "block ok ['block split', 'decode_fused', 'ties and nan']" in out, \
            dtype + ": " + out + err[-3000:]


def test_moe_warm_up_rows_reach_every_variant():
    """MoE.warm_rows: for any top_k, its row counts reach every variant a step can pick, so MoE.warm_up compiles
    them all at load: the per-pair kernels, the grouped GEMM at each block config, its alignment by kernel at both
    chunk sizes (moe_align.align's choice, restated here) and by the torch ops."""
    from memra_pp.kernels import fused_moe as fm
    from memra_pp.kernels.moe_align import ALIGN_KERNEL_PAIRS
    from memra_pp.model.layers import MoE

    def variant(n):
        if n <= fm.SMALL_PAIRS:
            return "small"
        if n > ALIGN_KERNEL_PAIRS:
            return fm.grouped_config(n), "torch"
        return fm.grouped_config(n), 512 if n <= 512 else 1024

    every = {variant(n) for n in range(1, 2 * ALIGN_KERNEL_PAIRS)}
    assert len(every) == 6, every
    for k in (1, 2, 4, 8, 10, 16):
        assert {variant(T * k) for T in MoE(k).warm_rows()} == every, k


@pytest.mark.interpreter("moe_parity")
def test_moe_model_through_the_fused_moe_kernels_matches_transformers():
    """The whole MoE model (two stages, prompts of 1 to 24 tokens prefilled together, then decoded as one batch)
    with every MoE layer through the fused routing and expert kernels, in Triton's interpreter in float32: the same
    greedy tokens as transformers and logprobs within 5e-4 (the GPU runs the same kernels compiled, bf16 parity in
    tests/test_gpu_parity.py). All three kernel paths must have run."""
    [(code, out, err)] = interp.results("moe_parity")
    assert code == 0 and "parity ok" in out, out + err[-3000:]
    calls = ast.literal_eval(out.split("parity ok", 1)[1].strip())     # the CALLS dict, printed
    assert calls["route"] > 0 and calls["small"] > 0 and calls["grouped"] > 0, calls


def test_fused_projections_are_views_of_one_matrix():
    """The decode graphs run one GEMV per merged projection; the named weights are views into it (held once)."""
    eager, _ = pipelines("dense", [(0, 8)])
    st = eager.stages[0]
    for layer in st.layers:
        mx = layer.mixer
        W, names = (mx.qkv, ["q_proj", "k_proj", "v_proj"]) if layer.full else \
            (mx.in_proj, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"])
        parts = [getattr(mx, n + "_weight") for n in names]
        assert all(p.untyped_storage().data_ptr() == W.untyped_storage().data_ptr() for p in parts)
        assert torch.equal(torch.cat(parts), W)
        ffn = layer.ffn
        assert ffn.gate_proj_weight.untyped_storage().data_ptr() == ffn.gate_up.untyped_storage().data_ptr()
    held = sum(t.untyped_storage().nbytes() for t in {t.untyped_storage().data_ptr(): t for t in st.tensors()}
               .values())
    assert sum(t.numel() * t.element_size() for t in st.tensors()) == held


def test_graphs_see_every_pool_replacement(oom_on_new_zeros):
    """Two interrupted growths in a row: the second replaces other pools but not the first one, so neither the block
    count nor the first pool's address changes. The graphs' key must still change (it is the cache's generation,
    bumped whenever any pool tensor is replaced): graphs over the freed pools must never replay."""
    import types
    from memra_pp.errors import InputError
    _, static = pipelines("dense", [(0, 8)], max_seqs=2)
    c = static.caches[0]
    g = DecodeGraphs(types.SimpleNamespace(mc=static.stages[0].mc, dtype=torch.float32, device=torch.device("cpu"),
                                           primary=False),
                     c, 2, capture=False)
    calls = oom_on_new_zeros()
    need = 64 * (len(c.free_blocks) + 1)             # one page more than is free: the pools must grow
    oom = r"could not grow to \d+ blocks .*\(out of memory\)"
    with pytest.raises(InputError, match=oom):       # the first pool grows, the second fails
        c.reserve([0], [need])
    assert g._kv_key() != g.kv_key
    g.kv_key = g._kv_key()                           # (what the next run does: drop, recapture)
    first = next(iter(c.k.values())).data_ptr()
    calls.update(n=0, fail=2)
    with pytest.raises(InputError, match=oom):       # the second pool grows (the first is skipped), the third fails
        c.reserve([0], [need])
    assert next(iter(c.k.values())).data_ptr() == first
    assert g._kv_key() != g.kv_key, "a pool was replaced: the graphs' addresses are stale"


def test_padding_garbage_never_reaches_a_real_row():
    """Padding rows of a decode graph write into the scratch slot, whose table row points at its own sink page; the
    null page, where every real row's unused table entries point, must stay zeros. NaN padding rows (whatever the
    static buffer held) must leave every real row's output equal to eager decode: the reference attention over
    gathered pages multiplies masked positions' values by 0, and 0 * NaN is NaN."""
    eager, static = pipelines("dense", [(0, 3), (3, 8)])
    for s in static.stages:
        s.graphs.h.fill_(float("nan"))               # rows past the batch are never written by run()
    prompts = [[5, 6, 7], list(range(20, 45)), [9]]  # bucket 4: one padding row
    te, le = eager.greedy(prompts, 6)
    ts, ls = static.greedy(prompts, 6)
    assert ts == te
    assert worst_gap(p for x, y in zip(le, ls, strict=True) for p in zip(x, y, strict=True)) < 5e-4
    for c in static.caches:
        sink = c.table[c.scratch, 0].item()
        assert sink != 0 and c.table[c.scratch].eq(sink).all() and sink not in c.free_blocks
        assert all(sink not in o for o in c.owned)
        assert all(t[0].eq(0).all() for d in (c.k, c.v) for t in d.values())     # the null page: zeros
        assert all(t[sink].isnan().any() for d in (c.k, c.v) for t in d.values())  # the padding wrote there
