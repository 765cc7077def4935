"""Stage slices composed in one process must reproduce transformers' greedy tokens and logprobs (float32)."""
import pytest

from conftest_models import hf_reference, record_pieces, tiny_checkpoint
from memra_pp.model.local import LocalPipeline
from memra_pp.model.weights import SafetensorsSource
from gaps import worst_gap

PROMPTS = [(5, 17, 42), tuple(range(1, 131)), (7,), tuple(range(200, 265))]
SPLITS = {1: [(0, 8)], 2: [(0, 3), (3, 8)], 3: [(0, 2), (2, 5), (5, 8)]}
NEW = 8


def check(kind, tied, n_stages, chunk, prompts=PROMPTS, new=NEW):
    from memra_pp.kernels import prefill as pf
    from memra_pp.model import stage_model
    _, path = tiny_checkpoint(kind, tied)
    lp = LocalPipeline(SafetensorsSource(path), SPLITS[n_stages])
    fresh = stage_model.CALLS["fresh_kv"] + pf.CALLS["attn_varlen"]
    pieces = record_pieces(lp)
    toks, lps = lp.greedy([list(p) for p in prompts], new, chunk=chunk)
    pieces(prompts, chunk)
    # a group's own rows, or (the merged path, fresh prompts of several lengths) one variable-length call over them
    assert stage_model.CALLS["fresh_kv"] + pf.CALLS["attn_varlen"] > fresh, \
        "the fresh prompts' attention read their own rows, not pages"
    for p, t, l in zip(prompts, toks, lps, strict=True):
        ht, hl = hf_reference(kind, tied, p, new)
        assert t == ht, f"prompt of {len(p)} tokens: {t} != transformers {ht}"
        assert worst_gap(zip(l, hl, strict=True)) < 5e-4


@pytest.mark.parametrize("n_stages", [1, 2, 3])
@pytest.mark.parametrize("kind,tied", [("dense", False), ("dense", True), ("moe", False), ("moe", True)])
def test_batched_prefill_and_decode(kind, tied, n_stages):
    """Prompts of 1..130 tokens prefilled together, then decoded as one batch of different lengths, must match."""
    check(kind, tied, n_stages, chunk=None)


@pytest.mark.parametrize("chunk", [1, 50, 70])
@pytest.mark.parametrize("n_stages", [1, 3])
def test_chunked_prefill_carries_state(chunk, n_stages):
    """Chunked prefill continuing from carried conv/recurrent/KV state (chunks crossing 64) must match."""
    check("dense", False, n_stages, chunk=chunk, prompts=PROMPTS[:2])


def test_single_request_paths():
    """One request alone (no batching) must match for the MoE model through 2 stages."""
    for p in PROMPTS:
        check("moe", False, 2, chunk=None, prompts=[p])


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_grouped_prefill_equals_one_at_a_time(kind, monkeypatch):
    """Sequences of one step with the same segment length (and start) prefill as one batched call per layer (the
    conv, the delta rule, the attention): the tokens and logprobs must be those of each prompt alone, and the
    batched calls must have happened (G > 1), fresh prompts and continuing chunks alike."""
    from memra_pp.model.linear_attention import GatedDeltaNet
    _, path = tiny_checkpoint(kind, False)
    src = SafetensorsSource(path)
    prompts = [list(range(10, 30)), list(range(40, 60)), [5, 6, 7, 8, 9, 10, 11], list(range(70, 90)),
               [3, 4, 5, 6, 7, 8, 9]]
    seen = []
    chunk = GatedDeltaNet._chunk
    monkeypatch.setattr(GatedDeltaNet, "_chunk", lambda self, q, *a: seen.append(q.shape[0]) or chunk(self, q, *a))
    lp = LocalPipeline(src, [(0, 3), (3, 8)], max_seqs=len(prompts))
    toks, lps = lp.greedy(prompts, 6, chunk=8)
    assert max(seen) == 3, seen          # three 20-token prompts in chunks of 8, 8, 4 ran together
    for p, t, l in zip(prompts, toks, lps, strict=True):
        alone = LocalPipeline(src, [(0, 8)], max_seqs=1)
        ta, la = alone.greedy([p], 6)
        assert t == ta[0]
        assert worst_gap(zip(l, la[0], strict=True)) < 5e-4


def mixed_greedy(lp, prompts, arrive, new, chunk):
    """Greedy decoding as the scheduler mixes it: sequence i joins at step arrive[i]; every step carries each
    joined sequence's next prompt chunk (up to `chunk` tokens) or its next decode token, so prompts and decode rows
    share steps. Sequence i lives in cache slot n - 1 - i, so that a slot is never a row's index in the step (a
    mix-up of the two fails). Returns (tokens, logprobs) per sequence."""
    import torch
    from memra_pp.model.batch import StepBatch
    sent, toks, lps = [0] * len(prompts), [[] for _ in prompts], [[] for _ in prompts]
    step = 0
    while any(len(t) < new for t in toks):
        idx = [i for i in range(len(prompts)) if arrive[i] <= step and len(toks[i]) < new]
        step += 1
        if not idx:
            continue
        counts = [min(chunk, len(prompts[i]) - sent[i]) if sent[i] < len(prompts[i]) else 1 for i in idx]
        starts = [sent[i] if sent[i] < len(prompts[i]) else len(prompts[i]) + len(toks[i]) - 1 for i in idx]
        ids = [t for i, c in zip(idx, counts) for t in (prompts[i][sent[i]:sent[i] + c] if sent[i] < len(prompts[i])
                                                        else [toks[i][-1]])]
        sample = [sent[i] >= len(prompts[i]) or sent[i] + c >= len(prompts[i]) for i, c in zip(idx, counts)]
        b = StepBatch([len(prompts) - 1 - i for i in idx], starts, counts, StepBatch.text_positions(starts, counts),
                      sample)
        logits = lp.step(b, torch.tensor(ids))
        r = 0
        for i, c, s in zip(idx, counts, sample):
            if sent[i] < len(prompts[i]):
                sent[i] += c
            if s:
                LocalPipeline._take(logits[r], toks[i], lps[i])
                r += 1
    return toks, lps


@pytest.mark.parametrize("kind,merged", [("dense", True), ("moe", True), ("dense", False)])
def test_mixed_prefill_and_decode_steps(kind, merged, monkeypatch):
    """Prompts arriving while others decode: steps mixing decode rows (the attention takes them in one paged decode
    call, not a group each; the Gated DeltaNet in the decode step's kernels, states in place, not as a group of
    gathered states) with fresh and continuing prompt chunks, over two stages, must match transformers; the decode
    rows of mixed steps must have gone through those calls, and with the merged path off
    (MEMRA_PP_PREFILL_MERGED=0) through a group each."""
    from memra_pp.kernels import prefill as pf
    from memra_pp.model import linear_attention as la, stage_model
    monkeypatch.setattr(pf, "MERGED", merged)
    _, path = tiny_checkpoint(kind, False)
    lp = LocalPipeline(SafetensorsSource(path), SPLITS[2], max_seqs=4)
    prompts = [list(PROMPTS[0]), list(PROMPTS[3]), list(PROMPTS[2]), list(range(100, 141))]
    before, gdn = stage_model.CALLS["single_rows"], la.CALLS["single_rows"]
    toks, lps = mixed_greedy(lp, prompts, arrive=[0, 0, 2, 3], new=6, chunk=16)
    assert (stage_model.CALLS["single_rows"] > before) == merged and (la.CALLS["single_rows"] > gdn) == merged
    for p, t, l in zip(prompts, toks, lps, strict=True):
        ht, hl = hf_reference(kind, False, tuple(p), 6)
        assert t == ht, f"prompt of {len(p)} tokens: {t} != transformers {ht}"
        assert worst_gap(zip(l, hl, strict=True)) < 5e-4
