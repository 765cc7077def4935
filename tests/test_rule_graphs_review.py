"""Review tests of the rule graphs (model/prefill_graphs.RuleGraphs), CPU only and uncaptured (capture=False),
through the torch double of fla's variable-length contract (tests/padded_rule.py, which checks each padded layout):
bucket edges, the padded chunk count, stale static buffers, the `holds` layout cache, mixed steps (decode rows,
non-consecutive rows, fresh and continuing segments together), the output alias, a failed capture part-way, and the
stats the runner reports; end to end against the eager pipeline (logits, recurrent and conv states within 1e-4)."""
import json
import warnings

import pytest
import torch
from memra_pp.kernels import prefill as pf
from padded_rule import PaddedRule
from test_rule_graphs import CFG, _merged_on_cpu, batch, inputs, pipelines

from memra_pp.model import prefill_graphs as pg
from memra_pp.model.batch import StepBatch
from memra_pp.model.decode_graphs import CaptureFailed
from memra_pp.model.gdn import chunk_gated_delta_rule_varlen

NAN = float("nan")


def fill_nan(rg):
    for buf in (rg.q, rg.k, rg.v, rg.g, rg.beta, rg.s0, rg.o, rg.s):
        buf.fill_(NAN)


def check_run(rg, rec, slots, starts, counts, gen, fresh_override=None):
    """One rg.run over the step's segments against the torch rule on the unpadded segments."""
    b = batch(slots, starts, counts)
    seg = pf.segments(b, "cpu", 4)
    R, N = sum(seg.lens), len(seg.lens)
    q, k, v, g, beta = inputs(R, gen)
    use_slots = None if seg.fresh else seg.slots
    assert rg.takes(R, N)
    o, s = rg.run(q, k, v, g, beta, rec, use_slots, seg)
    s0 = torch.zeros(N, 4, 8, 8) if seg.fresh else rec[seg.slots]
    o_ref, s_ref = chunk_gated_delta_rule_varlen(q, k, v, g, beta, s0, seg.lens)
    assert o.shape == o_ref.shape and s.shape == s_ref.shape
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    assert torch.allclose(o, o_ref, atol=1e-5) and torch.allclose(s, s_ref, atol=1e-5), \
        ((o - o_ref).abs().max(), (s - s_ref).abs().max())
    return seg


# ---- layouts and buckets --------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_rows", [128, 300, 2048, 2100])
def test_chunk_count_never_exceeded(max_rows):
    """For every row bucket and every N <= 15: the layouts with the most chunks (segments of 64 j + 1 rows, the
    rest in one) fit the padded chunk count, cu_seqlens end with empty segments, and padding chunks point at S - 1."""
    rg = pg.RuleGraphs(PaddedRule(), CFG, max_rows, torch.float32, "cpu", capture=False)
    assert rg.rows[-1] >= max_rows
    for nb in rg.rows:
        for N in range(1, 16):
            for R in {nb, max(N, nb - 63), N, min(nb, 65 * N)}:
                if R < N or R > nb:
                    continue
                # as many partial chunks as possible: N - 1 segments of 65 rows (2 chunks each) where they fit
                lens = [1] * N
                left = R - N
                for i in range(N):
                    add = min(left, 64)
                    lens[i] += add
                    left -= add
                lens[0] += left
                assert sum(lens) == R and min(lens) >= 1
                seg = pf.segments(batch(list(range(N)), [0] * N, lens), "cpu", 4)
                key = (pg.bucket(R, rg.rows), pg.bucket(N + 1, pg.SEGMENT_BUCKETS))
                assert key[0] == nb or R <= key[0] < nb
                cu, ch = rg._layout(seg, *key)
                S = key[1]
                assert cu.tolist()[-2:] == [R, R] and len(cu) == S + 1
                real = sum(-(-n // 64) for n in lens)
                assert ch.shape[0] == rg._chunk_count(*key) >= real
                assert ch[real:].tolist() == [[S - 1, 0]] * (ch.shape[0] - real)


def test_bucket_edges_and_declines():
    rg = pg.RuleGraphs(PaddedRule(), CFG, 300, torch.float32, "cpu", capture=False)
    assert rg.rows == (128, 256, 384)
    assert rg.takes(384, 15) and not rg.takes(385, 1) and not rg.takes(1, 16)
    gen = torch.Generator().manual_seed(3)
    rg.capture_all()
    rec = torch.randn(20, 4, 8, 8, generator=gen)
    rule = rg.rule
    for counts in ([1], [128], [129], [384], [127, 1], [64] * 6, [1] * 15, [25] * 15, [3] * 14 + [342]):
        fill_nan(rg)
        n = len(counts)
        check_run(rg, rec, list(range(n)), [0] * n, counts, gen)
    # buckets taken: rows 1 -> 128, 128 -> 128, 129 -> 256, 384 -> 384; segments N + 1
    assert [lens[-1] for lens, _ in rule.layouts] == [0] * 9
    assert [len(lens) for lens, _ in rule.layouts] == [2, 2, 2, 2, 3, 8, 16, 16, 16]


def test_continuing_and_fresh_segments_mixed_with_nan_buffers():
    """Continuing segments (states gathered) beside fresh ones in the same step: the fresh ones' slots hold zero
    (as StageCache.reset leaves them) and their states must come out as the fresh rule's; every static buffer NaN."""
    gen = torch.Generator().manual_seed(4)
    rg = pg.RuleGraphs(PaddedRule(), CFG, 512, torch.float32, "cpu", capture=False)
    rg.capture_all()
    rec = torch.randn(10, 4, 8, 8, generator=gen)
    rec[[2, 5]] = 0         # fresh slots, reset
    for _ in range(2):
        fill_nan(rg)
        seg = check_run(rg, rec, [1, 2, 3, 5, 7], [17, 0, 4, 0, 70], [100, 33, 1, 200, 9], gen)
        assert not seg.fresh and seg.lens == [100, 33, 200, 9]      # (slot 3's one token: a decode row)


def test_larger_then_smaller_steps_every_bucket():
    """A step of the largest bucket (NaN-free results), then smaller ones of every row bucket: nothing stale."""
    gen = torch.Generator().manual_seed(5)
    rg = pg.RuleGraphs(PaddedRule(), CFG, 1024, torch.float32, "cpu", capture=False)
    rg.capture_all()
    rec = torch.randn(16, 4, 8, 8, generator=gen)
    check_run(rg, rec, list(range(15)), [5] * 15, [68] * 15, gen)
    for R in reversed(range(1, 1025, 127)):
        rg.o.fill_(NAN)
        rg.s.fill_(NAN)
        check_run(rg, rec, [3], [9], [R] if R > 1 else [2], gen)


def test_holds_cache():
    """Two Segments with equal layouts but different identities share a bucket; a step reused after another step of
    another bucket, and after one of the same bucket: the graph's layout is always the current step's."""
    gen = torch.Generator().manual_seed(6)
    rg = pg.RuleGraphs(PaddedRule(), CFG, 512, torch.float32, "cpu", capture=False)
    rg.capture_all()
    rec = torch.randn(8, 4, 8, 8, generator=gen)
    a = pf.segments(batch([0, 1], [0, 0], [30, 50]), "cpu", 4)
    a2 = pf.segments(batch([0, 1], [0, 0], [30, 50]), "cpu", 4)
    c = pf.segments(batch([0, 1], [0, 0], [70, 10]), "cpu", 4)
    big = pf.segments(batch([0, 1, 2], [0, 0, 0], [300, 10, 5]), "cpu", 4)
    assert a is not a2
    for seg in (a, big, a, a2, c, a, big, c):
        R = sum(seg.lens)
        q, k, v, g, beta = inputs(R, gen)
        o, s = rg.run(q, k, v, g, beta, rec, None, seg)
        o_ref, s_ref = chunk_gated_delta_rule_varlen(q, k, v, g, beta, torch.zeros(len(seg.lens), 4, 8, 8),
                                                     seg.lens)
        assert torch.allclose(o, o_ref, atol=1e-5) and torch.allclose(s, s_ref, atol=1e-5)
        key = (pg.bucket(R, rg.rows), pg.bucket(len(seg.lens) + 1, pg.SEGMENT_BUCKETS))
        assert rg.holds[key] is seg
        assert rg.meta[key][0].tolist()[:len(seg.lens) + 1] == seg.cu.tolist()


# ---- end to end ---------------------------------------------------------------------------------------------------
def poison_before_each_replay(pieces):
    """Each replay overwrites the rule graphs' static outputs (NaN here first, as the next replay would leave other
    numbers): a caller that kept a view past the next layer's replay would see them."""
    for s in pieces.stages:
        rg = s.pgraphs.rules
        real = rg.run

        def run(*a, _real=real, _rg=rg, **kw):
            fill_nan(_rg)
            return _real(*a, **kw)
        rg.run = run


def compare(eager, pieces, steps):
    with _merged_on_cpu():
        for slots, starts, counts in steps:
            b = StepBatch(slots, starts, counts, StepBatch.text_positions(starts, counts), [True] * len(slots))
            ids = torch.tensor([5 + (7 * i + 3 * len(counts)) % 300 for i in range(sum(counts))])
            le, lp = eager.step(b, ids), pieces.step(b, ids)
            assert torch.isfinite(lp).all(), (slots, starts, counts)
            assert (le - lp).abs().max() < 1e-4, ((le - lp).abs().max(), slots, starts, counts)
    for c_e, c_p in zip(eager.caches, pieces.caches, strict=True):
        for i in c_e.rec:
            assert (c_e.rec[i] - c_p.rec[i]).abs().max() < 1e-4, i
        for i in c_e.conv:
            assert (c_e.conv[i] - c_p.conv[i]).abs().max() < 1e-4, i


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_edges_end_to_end(monkeypatch, kind):
    """R = 1 (a fresh one-token prompt), one segment at a bucket edge (128) and past it (129), 15 fresh segments
    (the largest taken), continuing segments beside decode rows between them (rows not consecutive: span None),
    fresh and continuing segments in one step, a slot reused from start 0 beside continuing ones, then 16 segments
    (declined) and small steps after large ones; static buffers poisoned before every replay."""
    eager, pieces, _ = pipelines(monkeypatch, kind)
    poison_before_each_replay(pieces)
    steps = [
        ([0], [0], [1]),                                                  # R = 1, one segment
        ([1], [0], [128]),                                                # at the row bucket edge
        ([2], [0], [129]),                                                # past it
        (list(range(3, 18)), [0] * 15, [1 + 2 * i for i in range(15)]),   # 15 segments -> S = 16
        ([0, 1, 2, 3], [1, 128, 129, 1], [40, 1, 66, 1]),                 # seg, decode, seg, decode: span None
        ([4, 18, 5, 19, 1], [3, 0, 5, 0, 129], [1, 70, 5, 3, 64]),         # decode, fresh, cont., fresh, cont.
        ([0, 2, 3], [0, 195, 2], [7, 5, 1]),                              # slot 0 again from 0 (reset) + cont.
        ([0, 2], [7, 200], [20, 30]),                                     # continuing both
        (list(range(2, 18)) + [20], [0] * 17, [2 + i for i in range(17)]),  # 17 segments: declined
        ([20], [18], [3]),                                                # small step after it
    ]
    compare(eager, pieces, steps)
    for s in pieces.stages:
        gdn = sum(not L.full for L in s.layers)
        st = s.pgraphs.stats()
        assert st["rule"]["declined"] == gdn and st["rule"]["replays"] == 9 * gdn, st
        json.dumps(st)          # (the runner's stats cross Ray as plain data)


def test_mixed_step_output_alias(monkeypatch):
    """A step with decode rows (the core's out is its own tensor, o written into it) and one without (the core's
    output is a view of the rule graphs' buffer until the prefill graphs copy it): with the outputs poisoned before
    each replay, every layer's consumer must have copied its output already."""
    eager, pieces, _ = pipelines(monkeypatch, "dense", max_tokens=256, max_seqs=8)
    poison_before_each_replay(pieces)
    seen = []
    for s in pieces.stages:
        rg = s.pgraphs.rules
        inner = rg.run

        def run(*a, _inner=inner, _rg=rg, **kw):
            o, st = _inner(*a, **kw)
            assert o.untyped_storage().data_ptr() == _rg.o.untyped_storage().data_ptr()
            seen.append(o.shape[1])
            return o, st
        rg.run = run
    compare(eager, pieces, [([0, 1], [0, 0], [100, 50]), ([0, 1, 2], [100, 50, 0], [1, 1, 90]),
                            ([2, 0], [90, 101], [40, 1])])
    assert seen and set(seen) == {150, 90, 40}


def test_capture_failing_part_way(monkeypatch):
    """The rule graphs' capture failing at its third bucket (largest first): warned once, rules_failed in stats, the
    rule called eagerly (no more replays or declines counted), the pieces as before, results as eager."""
    eager, pieces, _ = pipelines(monkeypatch, "dense", max_tokens=256, max_seqs=8)
    real = pg.RuleGraphs._build
    built = []

    def build(self, key):
        built.append(key)
        if len(built) == 3:
            raise CaptureFailed(f"rule graph capture ({key[0]} rows, {key[1]} segments) failed: boom")
        return real(self, key)
    monkeypatch.setattr(pg.RuleGraphs, "_build", build)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        compare(eager, pieces, [([0, 1], [0, 0], [100, 50]), ([0, 1], [100, 50], [3, 4])])
    msgs = [str(x.message) for x in w if "fla's rule runs eagerly" in str(x.message)]
    assert len(msgs) == 1, msgs         # stage 0's capture failed; stage 1's too? (its own _build count)
    st0 = pieces.stages[0].pgraphs.stats()
    assert st0["rule"] is None and "boom" in st0["rule_failed"]
    st1 = pieces.stages[1].pgraphs.stats()
    assert st1["rule_failed"] is None and st1["rule"]["replays"] == 2 * 3, st1
    assert pieces.stages[0].pgraphs.replays > 0 and built[:2] == [(256, 16), (256, 12)]
    json.dumps(st0)


def test_stats_through_stage_model(monkeypatch):
    """What the runner reads (StageModel.pgraphs.stats()): rule stats with captures, replays and declines, plain
    data; None with the switch off."""
    _, pieces, _ = pipelines(monkeypatch, "dense", max_tokens=128, max_seqs=4)
    st = pieces.stages[0].pgraphs.stats()
    assert st["rule"] == {"captures": 0, "replays": 0, "declined": 0} and st["rule_failed"] is None
    with _merged_on_cpu():
        b = StepBatch([0], [0], [5], StepBatch.text_positions([0], [5]), [True])
        pieces.step(b, torch.arange(5))
    st = pieces.stages[0].pgraphs.stats()
    assert st["rule"]["captures"] == 9 and st["rule"]["replays"] == 3, st
    json.dumps(st)
    _, off, _ = pipelines(monkeypatch, "dense", max_tokens=128, max_seqs=4, on=False)
    assert off.stages[0].pgraphs.stats()["rule"] is None


def test_one_token_fresh_prompts_beside_decode_rows(monkeypatch):
    """Fresh one-token prompts are segments (not decode rows): several of them between decode rows, R = N."""
    eager, pieces, rule = pipelines(monkeypatch, "moe", max_tokens=128, max_seqs=10)
    poison_before_each_replay(pieces)
    compare(eager, pieces, [([0, 1], [0, 0], [5, 6]), ([2, 0, 3, 1, 4], [0, 5, 0, 6, 0], [1, 1, 1, 1, 1]),
                            ([2, 3, 4, 5], [1, 1, 1, 0], [1, 2, 1, 1])])
    assert [lens for lens, _ in rule.layouts][-12:] == [[1, 1, 1, 0]] * 6 + [[2, 1, 0]] * 6   # (both stages)


def test_rule_capture_failing_at_load(monkeypatch):
    """StageModel.capture_prefill_graphs (the runner's load): a failed rule capture keeps the pieces (their bucket
    count returned), warns, and reports rule None / rule_failed; the next steps equal eager."""
    eager, pieces, _ = pipelines(monkeypatch, "dense", max_tokens=256, max_seqs=8)

    def boom(self, key):
        raise CaptureFailed(f"rule graph capture ({key[0]} rows, {key[1]} segments) failed: boom")
    monkeypatch.setattr(pg.RuleGraphs, "_build", boom)
    with pytest.warns(UserWarning, match="fla's rule runs eagerly"):
        n = pieces.stages[0].capture_prefill_graphs()
    assert n == 2 and pieces.stages[0].pgraphs is not None and pieces.stages[0].pgraphs_failed is None
    st = pieces.stages[0].pgraphs.stats()
    assert st["rule"] is None and "(256 rows, 16 segments)" in st["rule_failed"]
    monkeypatch.undo()
    monkeypatch.setattr(pg, "RULE_GRAPHS", True)
    compare(eager, pieces, [([0, 1], [0, 0], [100, 50]), ([0, 1], [100, 50], [3, 1])])
    assert pieces.stages[0].pgraphs.replays == 2 and pieces.stages[1].pgraphs.stats()["rule"]["replays"] == 6
