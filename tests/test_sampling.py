"""Sampling must be greedy at temperature 0, honour its filters, and be reproducible when seeded."""
import pytest
import torch

from memra_pp.errors import InputError
from memra_pp.model.sampling import SamplingParams, _filtered, sample


def logits(seed=0, n=2, v=50):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_and_raw_logprobs():
    """Greedy picks the argmax and logprobs are log_softmax of the raw logits."""
    x = logits()
    t, lp = sample(x, [SamplingParams()] * 2, [0, 0])
    assert t == x.argmax(-1).tolist()
    assert lp == pytest.approx(torch.log_softmax(x, -1).max(-1).values.tolist(), abs=1e-6)


def test_seeded_is_reproducible_and_batch_independent():
    """A seeded request must draw the same tokens whatever its batch neighbours are."""
    x = logits(1, n=3)
    p = SamplingParams(temperature=1.0, seed=7)
    a, _ = sample(x, [p, SamplingParams(temperature=0.5), p], [3, 0, 3])
    b, _ = sample(x[[2]], [p], [3])
    assert a[2] == b[0]
    assert a[0] == sample(x[[0]], [p], [3])[0][0]
    draws = {sample(x[:1], [p], [s])[0][0] for s in range(40)}
    assert len(draws) > 1, "different steps must give different noise"


@pytest.mark.parametrize("kw,msg", [(dict(temperature=-1), "temperature"), (dict(top_k=-2), "top_k"),
                                    (dict(top_p=0), "top_p"), (dict(min_p=1.5), "min_p")])
def test_bad_params_refused(kw, msg):
    """Bad sampling parameters must raise InputError naming the parameter."""
    with pytest.raises(InputError, match=msg):
        SamplingParams(**kw).validate()


@pytest.mark.interpreter("greedy")
def test_greedy_kernel_in_the_interpreter():
    """The greedy sampling kernel (kernels/greedy.py: argmax and logprob over blocks of the vocabulary, combined by
    each row's last program) against the torch ops it replaces, by Triton's CPU interpreter: ties across and within
    blocks, NaN, +inf and all -inf rows, strided rows, 64 rows three times (its counters reset themselves);
    tests/test_gpu_decode_graphs.py runs it compiled at the real vocabulary."""
    import interp
    [(code, out, err)] = interp.results("greedy")
    assert code == 0 and "greedy ok 9" in out, out + err[-3000:]


def test_params_are_normalised_and_a_tiny_temperature_is_greedy():
    """validate returns what every stage samples with: a temperature under 1e-5 is greedy (dividing by 1e-45 sent
    the logits to +-inf and the Gumbel argmax picked the first inf: token 0), numpy integers are Python ints, and
    a bool or a float is no seed."""
    import numpy as np
    p = SamplingParams(temperature=1e-45, seed=np.int64(3), top_k=np.int32(5)).validate()
    assert p.greedy and p.temperature == 0.0 and type(p.seed) is int and type(p.top_k) is int
    assert not SamplingParams(temperature=1e-5).validate().greedy
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    assert sample(logits, [p, p], [0, 0])[0] == logits.argmax(-1).tolist()
    for bad in (True, 1.5, "7"):
        with pytest.raises(InputError, match="seed must be an integer or None"):
            SamplingParams(temperature=1.0, seed=bad).validate()
    with pytest.raises(InputError, match="top_p must be a finite number"):
        SamplingParams(top_p=float("nan")).validate()


def test_a_top_p_below_float32s_least_value_keeps_the_top_token():
    """top_p 1e-50 is in (0, 1], but against float32 probabilities it rounds to 0: every token was dropped and the
    argmax over all -inf picked token 0 with a normal-looking logprob. The top token is always kept."""
    x = logits(3, n=2)
    toks, _ = sample(x, [SamplingParams(temperature=1.0, top_p=1e-50, seed=s).validate() for s in (1, 2)], [0, 0])
    assert toks == x.argmax(-1).tolist()


def test_values_the_boundary_header_cannot_carry_are_refused_or_normalised():
    """A seed past 64 bits is refused (it killed the intake's loop encoding the header); a top_k past any
    vocabulary is the same as no top_k and travels as 2**31 - 1; an int too large for a float is not a finite
    temperature (math.isfinite raised OverflowError, which reached the user as a stage failure)."""
    for bad in (2 ** 63, -2 ** 63 - 1, 2 ** 64):
        with pytest.raises(InputError, match=r"seed must fit in a signed 64-bit integer \[-2\*\*63, 2\*\*63\)"):
            SamplingParams(temperature=1.0, seed=bad).validate()
    assert SamplingParams(seed=-2 ** 63).validate().seed == -2 ** 63
    assert SamplingParams(top_k=2 ** 64).validate().top_k == 2 ** 31 - 1
    x = logits(4, n=1)
    assert sample(x, [SamplingParams(temperature=1.0, top_k=2 ** 64, seed=9).validate()], [0]) == \
        sample(x, [SamplingParams(temperature=1.0, seed=9).validate()], [0])
    for name in ("temperature", "top_p", "min_p"):
        with pytest.raises(InputError, match=fr"{name} must be a finite number, got 10{{19}}\.\.\.0{{8}} "
                                             fr"\(401 characters\)"):
            SamplingParams(**{name: 10 ** 400}).validate()



def hf_kept(x: torch.Tensor, p: SamplingParams) -> set[int]:
    """The tokens transformers' own warpers keep, applied in vLLM's order (temperature, min-p, top-k, then top-p on
    what is left): an implementation independent of memra_pp's."""
    from transformers.generation.logits_process import (MinPLogitsWarper, TemperatureLogitsWarper,
                                                        TopKLogitsWarper, TopPLogitsWarper)
    s = TemperatureLogitsWarper(p.temperature)(None, x[None].clone())
    if p.min_p > 0:
        s = MinPLogitsWarper(p.min_p)(None, s)
    if p.top_k:
        s = TopKLogitsWarper(p.top_k)(None, s)
    if p.top_p < 1:
        s = TopPLogitsWarper(p.top_p)(None, s)
    return set(torch.isfinite(s[0]).nonzero()[:, 0].tolist())


def kept(x: torch.Tensor, p: SamplingParams) -> set[int]:
    return set(torch.isfinite(_filtered(x, p)).nonzero()[:, 0].tolist())


FILTERS = [dict(top_k=1), dict(top_k=3), dict(top_k=7), dict(top_p=0.3), dict(top_p=0.62), dict(top_p=0.9),
           dict(top_p=0.999), dict(min_p=0.05), dict(min_p=0.5), dict(min_p=1.0), dict(top_k=5, top_p=0.7),
           dict(top_k=9, min_p=0.1), dict(top_p=0.8, min_p=0.02), dict(top_k=12, top_p=0.75, min_p=0.01)]


@pytest.mark.parametrize("kw", FILTERS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_filters_keep_exactly_what_transformers_warpers_keep(kw, temperature):
    """Each filter's kept set equals the one transformers' warpers give, in vLLM's order, on 20 random rows: not a
    token more or less. The cases are checked to be away from float32's ties (each top-p cut has a margin), so an
    off-by-one at the token that crosses top_p, or a top-k that keeps k-1, fails here."""
    p = SamplingParams(temperature=temperature, **kw)
    sizes = []
    for seed in range(20):
        x = logits(100 + seed, n=1, v=64)[0]
        if p.top_p < 1:      # the cut's margin: the crossing within 1e-5 of top_p: skipped
            probs = _filtered(x, SamplingParams(temperature=temperature, **{**kw, "top_p": 1.0})).softmax(-1)
            cum = probs.sort(descending=True).values.cumsum(-1)
            k = int((cum < p.top_p).sum())      # the token whose mass crosses top_p
            if min(abs(float(cum[k]) - p.top_p), abs(float(cum[k - 1]) - p.top_p) if k else 1) < 1e-5:
                continue
        want = hf_kept(x, p)
        assert kept(x, p) == want, (seed, sorted(kept(x, p)), sorted(want))
        sizes.append(len(want))
    assert len(sizes) >= 15 and max(sizes) < 64, sizes       # the rows were compared, and each filter cut


@pytest.mark.parametrize("kw,want", [
    (dict(top_p=0.79), {0, 1}), (dict(top_p=0.81), {0, 1, 2}), (dict(top_p=0.49), {0}), (dict(top_p=0.51), {0, 1}),
    (dict(top_k=2), {0, 1, 2}),            # a tie at the k-th logit keeps both (transformers and vLLM do)
    (dict(min_p=0.39), {0, 1, 2}), (dict(min_p=0.41), {0, 1}), (dict(min_p=0.61), {0}),
])
def test_filter_boundaries(kw, want):
    """Hand-made probabilities 0.5, 0.3, 0.2 (0.3 and 0.2 made a tie for top-k): the token whose mass crosses top_p
    is kept and the next one is not; min-p keeps a token at exactly its share of the top token's probability."""
    probs = torch.tensor([0.5, 0.3, 0.2, 0.0]) if "top_k" not in kw else torch.tensor([0.5, 0.25, 0.25, 0.0])
    x = probs.clamp_min(1e-30).log()
    p = SamplingParams(temperature=1.0, **kw)
    assert kept(x, p) == want == hf_kept(x, p)


@pytest.mark.parametrize("kw", [dict(top_k=4), dict(top_p=0.7), dict(min_p=0.2), dict(top_k=6, top_p=0.8)],
                         ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_draws_cover_exactly_the_kept_set_in_proportion(kw):
    """sample() draws every kept token and no other, each about as often as its renormalised probability says
    (3,000 seeded draws; 4 standard deviations)."""
    x = logits(3, n=1, v=40)[0] * 0.5
    p = SamplingParams(temperature=1.0, **kw)
    want = kept(x, p)
    assert want == hf_kept(x, p) and len(want) > 1
    n = 3000
    draws = [sample(x[None], [SamplingParams(temperature=1.0, seed=s, **kw)], [0])[0][0] for s in range(n)]
    assert set(draws) == want
    probs = _filtered(x, p).softmax(-1)
    for t in want:
        q = float(probs[t])
        assert abs(draws.count(t) / n - q) < 4 * (q * (1 - q) / n) ** 0.5 + 1e-3, (t, draws.count(t) / n, q)
