"""The rule graphs (model/prefill_graphs.RuleGraphs: fla's chunked rule replayed per row and segment bucket, padded
with empty segments and chunks of the last one) on the CPU, uncaptured, through the torch double of fla's
variable-length call (tests/padded_rule.py, which checks each layout it is given): the padded layouts, the copies
into and out of the static buffers, the states gathered and zeroed, the buckets and what they decline, and a failed
capture. tests/prefill_check.py runs them inside the prefill graphs under Triton's interpreter; on a GPU
tests/test_gpu_prefill_graphs.py captures them over fla."""
import pytest
import torch

from memra_pp.kernels import prefill as pf
from memra_pp.model import prefill_graphs as pg
from memra_pp.model.batch import StepBatch
from memra_pp.model.config import TextConfig
from memra_pp.model.decode_graphs import CaptureFailed
from memra_pp.model.gdn import chunk_gated_delta_rule_varlen
from padded_rule import PaddedRule, attach

CFG = TextConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                 head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                 linear_value_head_dim=8, linear_conv_kernel_dim=4, layer_types=("linear_attention",))


def batch(slots, starts, counts):
    return StepBatch(slots, starts, counts, StepBatch.text_positions(starts, counts), [True] * len(slots))


def inputs(R, gen):
    nv, dk, dv = 4, 8, 8
    r = lambda *s: torch.randn(*s, generator=gen)      # noqa: E731
    return (r(1, R, nv, dk), r(1, R, nv, dk), r(1, R, nv, dv), -torch.rand(1, R, nv, generator=gen),
            torch.rand(1, R, nv, generator=gen))


def test_padded_layout():
    """Segments of 2, 70, 5, 33 and 1 rows beside a one-token continuing row (not a segment): 111 rows in 5
    segments pad to 128 rows and 6 segments; cu_seqlens repeats 111 for the empty one, and the chunk indices are the
    6 real chunks then 2 + 6 - 6 padding chunks of segment 5 (empty)."""
    rg = pg.RuleGraphs(PaddedRule(), CFG, 2048, torch.float32, "cpu", capture=False)
    assert rg.rows == tuple(range(128, 2049, 128)) and rg.takes(2048, 15)
    assert not rg.takes(2049, 1) and not rg.takes(100, 16)
    b = batch([3, 0, 5, 1, 2, 4], [0, 9, 0, 4, 7, 0], [2, 1, 70, 5, 33, 1])
    seg = pf.segments(b, "cpu", 4)
    assert seg.lens == [2, 70, 5, 33, 1], seg.lens        # (slot 0's one token continues: a decode row)
    cu, ch = rg._layout(seg, 128, 6)
    assert cu.tolist() == [0, 2, 72, 77, 110, 111, 111]
    assert ch.tolist() == [[0, 0], [1, 0], [1, 1], [2, 0], [3, 0], [4, 0]] + [[5, 0]] * 2
    assert rg._layout(seg, 128, 6) is not None and len(seg.__dict__["_rule_layout"]) == 1     # kept on the step
    # near the most chunks a bucket can need: 2048 rows in 15 segments, 4 rows then 14 of 146 (each ending in a
    # partial chunk): 1 + 14 x 3 = 43 real chunks of 48, the last padding chunk segment 15's (empty)
    lens = [2048 - 14 * 146] + [146] * 14
    seg = pf.segments(batch(list(range(15)), [0] * 15, lens), "cpu", 4)
    cu, ch = rg._layout(seg, 2048, 16)
    assert cu.tolist()[-1] == 2048 and ch.shape == (2048 // 64 + 16, 2) and ch.tolist()[-1] == [15, 0]


@pytest.mark.parametrize("fresh", [False, True])
def test_run_equals_the_rule_on_the_segments(fresh):
    """Two steps of one bucket with other layouts, then a step of a smaller bucket: outputs and final states are the
    torch rule's over the unpadded segments; stale rows and states from the larger step (NaN here) reach nothing;
    the initial states are gathered at the slots (zero for fresh prompts, none read)."""
    gen = torch.Generator().manual_seed(0)
    rule = PaddedRule()
    rg = pg.RuleGraphs(rule, CFG, 1024, torch.float32, "cpu", capture=False)
    assert rg.capture_all() == len(rg.keys()) == 8 * 9 and rg.ready()
    rec = torch.randn(8, 4, 8, 8, generator=gen)
    for counts, slots in (([300, 17, 200], [5, 1, 2]), ([90, 410], [0, 7]), ([3, 40, 1, 9, 2], [1, 2, 3, 4, 6])):
        for buf in (rg.q, rg.k, rg.v, rg.s0, rg.o, rg.s):      # whatever an earlier step left there
            buf.fill_(float("nan"))
        b = batch(slots, [0 if fresh else 11] * len(slots), counts)
        seg = pf.segments(b, "cpu", 4)
        R = sum(seg.lens)       # (a continuing one-token segment is a decode row, not a segment)
        q, k, v, g, beta = inputs(R, gen)
        o, s = rg.run(q, k, v, g, beta, rec, None if fresh else seg.slots, seg)
        s0 = torch.zeros(len(seg.lens), 4, 8, 8) if fresh else rec[seg.slots]
        o_ref, s_ref = chunk_gated_delta_rule_varlen(q, k, v, g, beta, s0, seg.lens)
        assert o.shape == o_ref.shape and s.shape == s_ref.shape
        assert torch.allclose(o, o_ref, atol=1e-5) and torch.allclose(s, s_ref, atol=1e-5), \
            ((o - o_ref).abs().max(), (s - s_ref).abs().max())
    # rows 517 -> 640, 500 -> 512, 55 / 54 -> 128; segments 3 + 1 -> 4, 2 + 1 -> 3, 5 + 1 -> 6 or 4 + 1 -> 5;
    # padding chunks: 640 / 64 + 4 - 10, 512 / 64 + 3 - 9, 128 / 64 + 6 - 5 (fresh) or 128 / 64 + 5 - 4
    last = ([3, 40, 1, 9, 2, 0], 3) if fresh else ([3, 40, 9, 2, 0], 3)
    assert rule.layouts == [([300, 17, 200, 0], 4), ([90, 410, 0], 2), last]
    assert rg.stats() == {"captures": 72, "replays": 3, "declined": 0}


def test_a_layout_is_set_once_a_step():
    """Every layer of a step replays the same bucket's graph: its cu_seqlens and chunk indices are written by the
    first layer only (the graph's tensors hold them until another step takes the bucket)."""
    gen = torch.Generator().manual_seed(1)
    rg = pg.RuleGraphs(PaddedRule(), CFG, 128, torch.float32, "cpu", capture=False)
    rg.capture_all()
    real, written = rg._layout, []
    rg._layout = lambda seg, nb, S: written.append(seg.lens) or real(seg, nb, S)
    rec = torch.zeros(2, 4, 8, 8)
    first, second = (pf.segments(batch([0, 1], [0, 0], lens), "cpu", 4) for lens in ([30, 50], [50, 30]))
    for seg in (first, first, first, second, first):
        rg.run(*inputs(80, gen), rec, None, seg)
        assert rg.holds[(128, 3)] is seg and rg.meta[(128, 3)][0].tolist() == [0, *seg.lens[:1], 80, 80]
    assert written == [[30, 50], [50, 30], [30, 50]]


def pipelines(monkeypatch, kind="dense", max_tokens=300, max_seqs=24, on=True, gva=False):
    """The tiny model (two stages) eagerly, and through uncaptured prefill graphs whose Gated DeltaNet layers call the
    padded torch rule (through rule graphs, switched on here, or with on False eagerly); both on the merged,
    variable-length path (pf.merged forced on the CPU: _merged_on_cpu)."""
    from conftest_models import tiny_checkpoint
    from memra_pp.model.local import LocalPipeline
    from memra_pp.model.weights import SafetensorsSource
    monkeypatch.setattr(pg, "RULE_GRAPHS", on)
    _, path = tiny_checkpoint(kind, False)
    src = SafetensorsSource(path)
    eager, pieces = (LocalPipeline(src, [(0, 4), (4, 8)], max_seqs=max_seqs) for _ in range(2))
    rule = attach(pieces.stages, max_tokens, gva)
    assert all((s.pgraphs.rules is not None) == on for s in pieces.stages)
    return eager, pieces, rule


class _merged_on_cpu:
    """pf.merged is False off CUDA without Triton's interpreter; the core's variable-length branch needs it (the
    merged projection is then F.linear, the conv its torch reference)."""
    def __enter__(self):
        self.real = pf.merged
        pf.merged = lambda x, lora=None, count=False: lora is None
        return self

    def __exit__(self, *exc):
        pf.merged = self.real


@pytest.mark.parametrize("gva", [False, True])
def test_prompt_steps_through_rule_graphs_equal_eager(monkeypatch, gva):
    """Fresh prompts (2 segments), continuing chunks beside a decode row and new prompts (3 segments: replayed), then
    16 one-token-longer prompts (16 segments: the rule called eagerly, declined): logits and the recurrent states
    as the eager layers'. gva: q and k with the key heads only (fla's grouped value heads), in the rule graphs'
    buffers too."""
    eager, pieces, rule = pipelines(monkeypatch, gva=gva)
    t = pieces.stages[0].mc.text
    assert pieces.stages[0].pgraphs.rules.q.shape[2] == (t.linear_num_key_heads if gva else t.linear_num_value_heads)
    steps = [([0, 1], [0, 0], [40, 57]), ([0, 1, 2, 3], [40, 57, 0, 0], [33, 1, 100, 9]),
             (list(range(4, 20)), [0] * 16, [3 + i for i in range(16)])]
    with _merged_on_cpu():
        for slots, starts, counts in steps:
            b = StepBatch(slots, starts, counts, StepBatch.text_positions(starts, counts), [True] * len(slots))
            ids = torch.tensor([5 + (7 * i) % 90 for i in range(sum(counts))])
            le, lp = eager.step(b, ids), pieces.step(b, ids)
            assert (le - lp).abs().max() < 1e-4
    for c_e, c_p in zip(eager.caches, pieces.caches, strict=True):
        for i in c_e.rec:
            assert (c_e.rec[i] - c_p.rec[i]).abs().max() < 1e-4
    for s in pieces.stages:
        gdn = sum(not L.full for L in s.layers)
        assert s.pgraphs.stats()["rule"] == {"captures": 3 * 9, "replays": 2 * gdn, "declined": gdn}
    assert [lens for lens, _ in rule.layouts][:1] == [[40, 57, 0]]


def test_a_failed_capture_leaves_the_rule_eager(monkeypatch):
    """A rule graph that fails to capture leaves the pieces' graphs as they are and the cores calling the rule
    eagerly; said in a warning and in stats."""
    _, pieces, _ = pipelines(monkeypatch)
    p = pieces.stages[0].pgraphs

    def boom(self):
        raise CaptureFailed("rule graph capture (512 rows, 16 segments) failed: boom")
    monkeypatch.setattr(pg.RuleGraphs, "capture_all", boom)
    with pytest.warns(UserWarning, match="fla's rule runs eagerly in prompt steps"):
        p._capture_rules()
    assert p.rules is None and "boom" in p.rules_failed and p.stats()["rule_failed"] == p.rules_failed


def test_no_rule_graphs_without_the_switch(monkeypatch):
    """Off (the default), the prefill graphs make none: the cores call the rule eagerly."""
    assert pg.RULE_GRAPHS is False
    _, pieces, _ = pipelines(monkeypatch, on=False)
    assert all(s.pgraphs.rules is None for s in pieces.stages)


def test_a_whole_prompt_step_output_is_written_in_place(monkeypatch):
    """The rule graphs' output buffer is the prefill graphs' Gated DeltaNet output buffer: a step of prompt rows only
    hands the prefill graphs a view of it (their copy skipped), a step with a decode row its own tensor (copied);
    logits as eager both ways."""
    eager, pieces, _ = pipelines(monkeypatch)
    seen = []
    for s in pieces.stages:
        p = s.pgraphs
        assert p.rules.o.untyped_storage().data_ptr() == p.o[False].untyped_storage().data_ptr()
        for L in s.layers:
            if not L.full:
                inner = L.mix_core

                def core(*a, _inner=inner, _p=p, **kw):
                    o = _inner(*a, **kw)
                    seen.append(o.data_ptr() == _p.o[False].data_ptr())
                    return o
                L.mix_core = core
    gdn = sum(not L.full for s in pieces.stages for L in s.layers)
    with _merged_on_cpu():
        for slots, starts, counts in (([0, 1], [0, 0], [40, 57]), ([0, 1, 2], [40, 57, 0], [1, 1, 100])):
            b = batch(slots, starts, counts)
            ids = torch.tensor([5 + (7 * i) % 90 for i in range(sum(counts))])
            assert (eager.step(b, ids) - pieces.step(b, ids)).abs().max() < 1e-4
    assert seen == [True] * gdn + [False] * gdn
