"""Stage slices composed in one process must reproduce transformers' greedy tokens and logprobs (float32)."""
import pytest

from conftest_models import hf_reference, tiny_checkpoint
from memra_pp.model.local import LocalPipeline
from memra_pp.model.weights import SafetensorsSource

PROMPTS = [(5, 17, 42), tuple(range(1, 131)), (7,), tuple(range(200, 265))]
SPLITS = {1: [(0, 8)], 2: [(0, 3), (3, 8)], 3: [(0, 2), (2, 5), (5, 8)]}
NEW = 8


def check(kind, tied, n_stages, chunk, prompts=PROMPTS):
    _, path = tiny_checkpoint(kind, tied)
    lp = LocalPipeline(SafetensorsSource(path), SPLITS[n_stages])
    toks, lps = lp.greedy([list(p) for p in prompts], NEW, chunk=chunk)
    for p, t, l in zip(prompts, toks, lps):
        ht, hl = hf_reference(kind, tied, p, NEW)
        assert t == ht, f"prompt of {len(p)} tokens: {t} != transformers {ht}"
        assert max(abs(a - b) for a, b in zip(l, hl)) < 5e-4


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
