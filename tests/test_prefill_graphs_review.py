"""More checks of the prefill graphs' pieces (model/prefill_graphs.py, uncaptured on the CPU) against the eager layers:
step kinds the first tests leave out (1-token fresh prompts, bucket edges, a smaller step after a larger one in the
same bucket, M-RoPE positions with embeddings in, stages of one mixer kind or one layer, released and reused slots,
steps with no sample row), every cache the cores write, the law-3 counters, and LoRA pools beside the pieces."""
import pytest
import torch

import test_prefill_graphs
from memra_pp.kernels import prefill as pf
from memra_pp.model import linear_attention as la, prefill_graphs as pg, stage_model as sm
from memra_pp.model.batch import StepBatch
from gaps import worst_gap


def pipelines(kind, splits, max_tokens=300, max_seqs=8):
    return test_prefill_graphs.pipelines(kind, splits, max_tokens, max_seqs)


def batch(slots, starts, counts, sample=None, release=None, pos=None):
    sample = [True] * len(slots) if sample is None else sample
    pos = StepBatch.text_positions(starts, counts) if pos is None else pos
    return StepBatch(slots, starts, counts, pos, sample, release=release or [])


def ids_for(counts, seed=0):
    return torch.tensor([3 + (seed + 7 * i) % 300 for i in range(sum(counts))])


def both(eager, pieces, b, ids=None, embeds=None):
    le = eager.step(b, ids, embeds)
    lp = pieces.step(b, ids, embeds)
    assert le.shape == lp.shape, (le.shape, lp.shape)
    return (le - lp).abs().max().item() if le.numel() else 0.0


def caches_agree(eager, pieces, tol=1e-4):
    for c_e, c_p in zip(eager.caches, pieces.caches, strict=True):
        assert c_e.lens == c_p.lens
        for d in ("rec", "conv", "k", "v"):
            for i in getattr(c_e, d):
                a, b = getattr(c_e, d)[i], getattr(c_p, d)[i]
                assert (a - b).abs().max().item() < tol, (d, i)


def replays(p):
    return [s.pgraphs.replays for s in p.stages]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_smaller_step_after_larger_in_same_bucket(kind):
    """A 120-row step fills most of bucket 128; the next steps of the same bucket (10 rows, then 3) leave its rows
    10..127 stale: no real row may see them, whatever the mix (fresh prompt, continuing chunk, decode row)."""
    eager, pieces = pipelines(kind, [(0, 5), (5, 8)])
    steps = [batch([0], [0], [120]),
             batch([1], [0], [10]),
             batch([0, 1, 2], [120, 10, 0], [1, 1, 1]),        # two decode rows beside a 1-token fresh prompt
             batch([2, 0], [1, 121], [5, 1]),
             batch([0, 1, 2], [122, 11, 6], [126, 1, 1])]     # exactly 128 rows
    for j, b in enumerate(steps):
        assert both(eager, pieces, b, ids_for(b.counts, j)) < 1e-4, j
    caches_agree(eager, pieces)
    assert replays(pieces) == [5, 5] and pieces.stages[0].pgraphs.stats()["buckets"] == [128]


def test_bucket_edges_and_bucket_switches():
    """128 rows (no padding), 129 (bucket 256, one real row past 128), back to 128 and to 256 in turn."""
    eager, pieces = pipelines("dense", [(0, 8)])
    plan = [([0], [0], [128]), ([1, 0], [0, 128], [128, 1]), ([2], [0], [64]), ([3, 2, 1], [0, 64, 128], [200, 1, 1]),
            ([4], [0], [1])]
    for j, (slots, starts, counts) in enumerate(plan):
        b = batch(slots, starts, counts)
        assert both(eager, pieces, b, ids_for(counts, j)) < 1e-4, j
    caches_agree(eager, pieces)
    assert pieces.stages[0].pgraphs.stats()["buckets"] == [128, 256] and replays(pieces) == [5]


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_one_token_fresh_prompts(kind):
    """Steps of 1-token fresh prompts only (not decode-only: they start at 0), then such a prompt beside decode
    rows and a chunk, then greedy decode from the caches the pieces filled."""
    eager, pieces = pipelines(kind, [(0, 3), (3, 8)])
    b = batch([0, 1, 2], [0, 0, 0], [1, 1, 1])
    assert not b.decode_only()
    assert both(eager, pieces, b, ids_for(b.counts)) < 1e-4
    b = batch([0, 3, 1, 2], [1, 0, 1, 1], [1, 1, 7, 1], [True, False, True, True])
    assert both(eager, pieces, b, ids_for(b.counts, 1)) < 1e-4
    caches_agree(eager, pieces)
    assert replays(pieces) == [2, 2]
    te, le = eager.greedy([[5], [9, 8, 7], [1]], 5)
    tp, lp = pieces.greedy([[5], [9, 8, 7], [1]], 5)
    assert tp == te
    assert worst_gap(p for x, y in zip(le, lp, strict=True) for p in zip(x, y, strict=True)) < 5e-4


@pytest.mark.parametrize("kind", ["dense", "moe"])
@pytest.mark.parametrize("splits", [[(3, 4)], [(0, 3)], [(0, 3), (3, 4), (4, 7), (7, 8)], [(2, 4), (4, 5)]])
def test_stage_slices(kind, splits):
    """Stages of one full-attention layer, only Gated DeltaNet layers, one kind after the other: the static buffers
    are made per mixer kind the stage holds."""
    eager, pieces = pipelines(kind, splits)
    for s in pieces.stages:
        assert sorted(s.pgraphs.P) == sorted({layer.full for layer in s.layers})
    for j, (slots, starts, counts) in enumerate([([0, 1], [0, 0], [40, 57]),
                                                 ([0, 1, 2], [40, 57, 0], [33, 1, 150]),
                                                 ([2, 0, 1], [150, 73, 58], [20, 1, 1])]):
        b = batch(slots, starts, counts)
        assert both(eager, pieces, b, ids_for(counts, j)) < 1e-4, j
    caches_agree(eager, pieces)
    assert all(r == 3 for r in replays(pieces))


def test_mrope_positions_and_embeddings_in():
    """A vision step: embeddings passed in (as the image splice gives them) with M-RoPE positions whose T, H, W
    rows differ (an image grid), beside a text prompt; the rotary tables' rows must follow the step's rows."""
    eager, pieces = pipelines("dense", [(0, 4), (4, 8)])
    H = eager.stages[0].mc.text.hidden_size
    g = torch.Generator().manual_seed(0)
    # sequence 0: 4 text tokens, a 2 x 3 x 4 grid (24 rows), 5 text tokens; sequence 1: 20 text tokens
    t, h, w = torch.meshgrid(torch.arange(2), torch.arange(3), torch.arange(4), indexing="ij")
    img = torch.stack([t.reshape(-1), h.reshape(-1), w.reshape(-1)]) + 4
    seq0 = torch.cat([torch.arange(4).expand(3, 4), img, (torch.arange(5) + 8).expand(3, 5)], 1)
    seq1 = torch.arange(20).expand(3, 20)
    pos = torch.cat([seq0, seq1], 1).contiguous()
    b = batch([0, 1], [0, 0], [33, 20], pos=pos)
    embeds = torch.randn(53, H, generator=g)
    assert both(eager, pieces, b, embeds=embeds) < 1e-4
    # continuing with text at the shifted positions (the M-RoPE delta: 33 rows, position 13 next)
    b = batch([0, 1], [33, 20], [6, 1], pos=torch.cat([(torch.arange(6) + 13).expand(3, 6),
                                                       torch.tensor([[20], [20], [20]])], 1).contiguous())
    assert both(eager, pieces, b, ids_for(b.counts, 3)) < 1e-4
    caches_agree(eager, pieces)
    assert replays(pieces) == [2, 2]


def test_released_slots_and_no_sample_rows():
    """A step that releases a slot and reuses it for a new prompt at once, and a primary step with no sample row
    (logits of no rows), through the pieces."""
    eager, pieces = pipelines("dense", [(0, 8)])
    b = batch([0, 1], [0, 0], [30, 20], sample=[False, False])
    assert both(eager, pieces, b, ids_for(b.counts)) == 0.0
    b = batch([0, 1], [30, 0], [10, 12], release=[1])
    assert both(eager, pieces, b, ids_for(b.counts, 2)) < 1e-4
    caches_agree(eager, pieces)
    assert replays(pieces) == [2]


def test_counters_count_as_eager():
    """Law 3's counters (kernels/prefill.CALLS, linear_attention.CALLS, stage_model.CALLS) advance by the same
    amounts a step through the pieces as through the eager layers, the first step of a bucket (its build) too."""
    eager, pieces = pipelines("dense", [(0, 3), (3, 8)])
    plan = [([0, 1], [0, 0], [40, 57]), ([0, 1, 2], [40, 57, 0], [33, 1, 150]), ([2, 0, 1], [150, 73, 58], [20, 1, 1])]

    def run(p):
        before = [dict(pf.CALLS), dict(la.CALLS), dict(sm.CALLS)]
        for j, (slots, starts, counts) in enumerate(plan):
            p.step(batch(slots, starts, counts), ids_for(counts, j))
        return [{k: d[k] - b0[k] for k in d} for d, b0 in zip((pf.CALLS, la.CALLS, sm.CALLS), before, strict=True)]

    assert run(pieces) == run(eager)
    assert replays(pieces) == [3, 3]


def test_stats_without_and_with_pieces():
    """stats() before any step, and a model without prefill graphs (the runner's stats read pgraphs_failed)."""
    eager, pieces = pipelines("dense", [(0, 8)])
    assert eager.stages[0].pgraphs is None and eager.stages[0].pgraphs_failed is None
    assert pieces.stages[0].pgraphs.stats() == {"captures": 0, "replays": 0, "buckets": [], "rule": None,
                                                "rule_failed": None}     # (no rule graphs without fla)
    pieces.stages[0].set_prefill_graphs(False, 300)
    assert pieces.stages[0].pgraphs is None


def test_a_build_failure_runs_the_step_eagerly(monkeypatch):
    """A bucket whose pieces fail to build (CaptureFailed) leaves the stage eager with the cache untouched: the
    step's output is the eager one. The failure path needs no CUDA where nothing was captured (it once called
    torch.cuda.synchronize() regardless: off CUDA that raised, and the step failed instead of running eagerly)."""
    eager, pieces = pipelines("dense", [(0, 8)])
    s = pieces.stages[0]

    real = s.pgraphs._piece

    def boom(nb, j, h):
        if j == 2:
            raise RuntimeError("injected")
        return real(nb, j, h)
    monkeypatch.setattr(s.pgraphs, "_piece", boom)      # the build's third piece fails
    b = batch([0], [0], [20])
    with pytest.warns(UserWarning, match="prompt steps run eagerly"):
        d = both(eager, pieces, b, ids_for(b.counts))
    assert d < 1e-4 and s.pgraphs is None and "injected" in s.pgraphs_failed
    caches_agree(eager, pieces)


def test_lora_pool_beside_the_pieces():
    """A stage with a LoraPool: steps whose sequences use no adapter (None or every slot -1) go through the pieces and
    equal the eager layers; lora.step(b) for them is None. (Steps naming an adapter slot: takes() says no, eager.)"""
    from memra_pp.model.lora import LoraPool
    eager, pieces = pipelines("dense", [(0, 3), (3, 8)])
    for p in (eager, pieces):
        p.loras = [LoraPool(p.stages[0].mc, range(s.start, s.end), 2, 4) for s in p.stages]
    b = StepBatch([0, 1], [0, 0], [9, 14], StepBatch.text_positions([0, 0], [9, 14]), [True, True], [-1, -1])
    assert both(eager, pieces, b, ids_for(b.counts)) < 1e-4
    b = batch([0, 1, 2], [9, 14, 0], [1, 3, 30])
    assert both(eager, pieces, b, ids_for(b.counts, 1)) < 1e-4
    assert replays(pieces) == [2, 2]
    b = StepBatch([3], [0], [10], StepBatch.text_positions([0], [10]), [True], [1])
    assert all(not s.pgraphs.takes(b, 10) for s in pieces.stages)


def test_pieces_steps_interleaved_with_eager_decode_and_long_steps():
    """Prompt steps through the pieces between decode-only steps and steps past the largest bucket (eager): the
    caches stay consistent whichever path wrote them."""
    eager, pieces = pipelines("moe", [(0, 4), (4, 8)], max_tokens=100)
    plan = [([0], [0], [200]),                 # eager (past bucket 128)
            ([1, 0], [0, 200], [50, 1]),        # pieces
            ([0, 1], [201, 50], [1, 1]),        # decode only
            ([2, 1, 0], [0, 51, 202], [130, 1, 1]),   # eager (132 rows)
            ([2, 0], [130, 203], [7, 1])]       # pieces
    for j, (slots, starts, counts) in enumerate(plan):
        b = batch(slots, starts, counts)
        assert both(eager, pieces, b, ids_for(counts, j)) < 1e-4, j
    caches_agree(eager, pieces)
    assert replays(pieces) == [2, 2]


def test_buffers_hold_no_step_state_between_pipelines():
    """Two pipelines sharing no PrefillGraphs: the pieces' static buffers are per stage model. And one stage run
    twice from the same step on fresh caches gives the same output (no state leaks through the buffers)."""
    _, pieces = pipelines("dense", [(0, 8)])
    s = pieces.stages[0]
    b1 = batch([0, 1], [0, 0], [70, 40])
    h1 = s.embed_ids(ids_for(b1.counts, 5))
    c1 = s.new_cache(4, 512)
    out1 = s(b1, h1, c1)
    b2 = batch([0], [0], [11])
    h2 = s.embed_ids(ids_for(b2.counts, 6))
    c2 = s.new_cache(4, 512)
    out2 = s(b2, h2, c2)
    c3 = s.new_cache(4, 512)
    out2b = s(batch([0], [0], [11]), h2, c3)
    assert torch.equal(out2, out2b)
    out1b = s(batch([0, 1], [0, 0], [70, 40]), h1, s.new_cache(4, 512))
    assert torch.equal(out1, out1b)
    assert pg.PrefillGraphs is type(s.pgraphs)


@pytest.mark.parametrize("kind,seed", [("dense", 0), ("dense", 1), ("moe", 2)])
def test_random_step_sequences(kind, seed, monkeypatch):
    """Random steps (fresh prompts of 1-90 tokens, continuing chunks, decode rows, released and reused slots) over
    small buckets (16, 64, 160: several switches and many padding rows), against the eager layers, caches too."""
    import random
    monkeypatch.setattr(pg, "TOKEN_BUCKETS", (16, 64, 160))
    eager, pieces = pipelines(kind, [(0, 3), (3, 6), (6, 8)], max_tokens=160, max_seqs=6)
    rng = random.Random(seed)
    lens = [0] * 6
    taken = 0
    for j in range(14):
        slots = rng.sample(range(6), rng.randint(1, 5))
        release = [s for s in slots if lens[s] and rng.random() < 0.2]
        for s in release:
            lens[s] = 0
        counts = [1 if lens[s] and rng.random() < 0.5 else rng.randint(1, 40) for s in slots]
        starts = [lens[s] for s in slots]
        b = batch(slots, starts, counts, sample=[rng.random() < 0.7 for _ in slots], release=release)
        assert both(eager, pieces, b, ids_for(counts, j)) < 1e-4, (j, slots, starts, counts)
        taken += not b.decode_only() and sum(counts) <= 160
        for s, c in zip(slots, counts):
            lens[s] += c
    caches_agree(eager, pieces)
    assert replays(pieces) == [taken] * 3 and taken >= 8
