"""Request and sampling semantics a vLLM user relies on: vLLM's top_k -1 must be off, numpy and 0-d torch scalars
must be the numbers they hold (a bool is never a count), distinct seeds must draw distinct streams, and an abort
must end a request as "abort" also when its microbatch is in flight."""
import types

import numpy as np
import pytest
import torch

import memra_pp
from conftest_models import tiny_checkpoint
from memra_pp.errors import InputError
from memra_pp.model.sampling import SamplingParams, sample
from memra_pp.request import request_dict
from memra_pp.scheduler import Request, Scheduler


def logits(seed=0, n=1, v=50):
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


def draws(p: SamplingParams, steps=range(24), x=None) -> list[int]:
    x = logits(5) if x is None else x
    return [sample(x, [p], [s])[0][0] for s in steps]


def test_top_k_minus_one_is_off_as_in_vllm():
    """vLLM's SamplingParams takes top_k -1 (its old default) as "consider all tokens": it must sample as top_k 0
    (it was refused); below -1 is still refused, naming the value."""
    p = SamplingParams(temperature=1.0, top_k=-1, seed=3).validate()
    assert p.top_k == 0
    assert draws(p) == draws(SamplingParams(temperature=1.0, seed=3).validate())
    assert SamplingParams(top_k=np.int64(-1)).validate().top_k == 0
    with pytest.raises(InputError, match=r"top_k must be an integer >= 0 \(0 = off; -1 is off too, as in vLLM\), "
                                         r"got -2"):
        SamplingParams(top_k=-2).validate()


def test_seeds_that_agree_in_their_low_32_bits_draw_distinct_streams():
    """torch's CPU generator reads only the low 32 bits of its seed, and the generator seed was seed * 1000003 +
    step: seeds 5 and 5 + 2**32 (or 0 and -2**63) drew the same tokens at every step on a CPU stage. The seed's
    high half must reach those bits, and a seed in [0, 2**32) (what users pass) must keep the stream it had."""
    p = lambda seed: SamplingParams(temperature=4.0, seed=seed).validate()   # noqa: E731 (near uniform)
    for a, b in ((5, 5 + 2 ** 32), (0, -2 ** 63), (-1, 2 ** 32 - 1), (7, 7 + 2 ** 40)):
        assert draws(p(a)) != draws(p(b)), (a, b)
    from memra_pp.model.sampling import step_seed
    assert [step_seed(s, n) for s, n in ((0, 0), (7, 3), (2 ** 32 - 1, 99))] == \
        [0, 7 * 1000003 + 3, (2 ** 32 - 1) * 1000003 + 99]
    seeds = [0, 1, -1, 2 ** 63 - 1, -2 ** 63, 5, 5 + 2 ** 32, 12345]
    for step in (0, 1, 2 ** 40):
        assert len({step_seed(s, step) & (2 ** 32 - 1) for s in seeds}) == len(seeds)
    assert all(0 <= step_seed(s, n) < 2 ** 64 for s in seeds for n in (0, 9))     # what manual_seed takes


def test_a_bool_is_no_max_new_tokens():
    """max_new_tokens=torch.tensor(True) went through operator.index as 1 and the request ran with one token; a bool
    of any kind, or a float tensor, must be refused at the call naming what was given. Integers of numpy or 0-d
    torch are counts."""
    for bad, shown in ((torch.tensor(True), "tensor(True) (Tensor)"), (np.True_, "np.True_ (bool)"),
                       (True, "True (bool)"), (torch.tensor(2.0), "tensor(2.) (Tensor)"),
                       (torch.tensor([3, 4]), "tensor([3, 4]) (Tensor)"), (None, "None (NoneType)")):
        with pytest.raises(InputError) as ei:
            request_dict({}, max_new_tokens=bad)
        assert str(ei.value) == f"max_new_tokens must be an integer >= 0, got {shown}", str(ei.value)
    for good in (torch.tensor(5), np.int32(5), np.array(5), 5):
        n = request_dict({}, max_new_tokens=good)["max_new_tokens"]
        assert n == 5 and type(n) is int


def test_sampling_numbers_may_be_numpy_or_0d_torch_scalars():
    """temperature=torch.tensor(0.7) was refused as "temperature must be a finite number, got tensor(0.7000)" (it
    is one), though prompts, stop ids and max_new_tokens take torch values: each sampling number given as a 0-d
    tensor or array must be the Python number it holds; a 0-d bool is still no number, and a 1-d tensor no scalar."""
    kw = dict(temperature=torch.tensor(0.5), top_k=torch.tensor(7), top_p=np.array(0.75), min_p=torch.tensor(0.125),
              seed=torch.tensor(-3))
    req = request_dict(kw, max_new_tokens=4)
    p = SamplingParams(*(req[k] for k in ("temperature", "top_k", "top_p", "min_p", "seed"))).validate()
    assert p == SamplingParams(0.5, 7, 0.75, 0.125, -3) and type(p.seed) is int and type(p.top_k) is int
    with pytest.raises(InputError, match=r"seed must be an integer or None, got True"):
        SamplingParams(temperature=1.0, seed=request_dict({"seed": torch.tensor(True)})["seed"]).validate()
    with pytest.raises(InputError, match=r"temperature must be a finite number, got tensor\(\[0\.5000\]\)"):
        SamplingParams(temperature=request_dict({"temperature": torch.tensor([0.5])})["temperature"]).validate()
    # the wait for each piece too (timeout=torch.tensor(2.0) was refused as "timeout is seconds >= 0 or None")
    from memra_pp.client import Client
    me = types.SimpleNamespace(dep=None)
    assert Client._timeout(me, torch.tensor(2.0)) == 2.0 and Client._timeout(me, np.float32(0.5)) == 0.5
    for bad in (torch.tensor(True), torch.tensor(-1.0), torch.tensor([2.0])):
        with pytest.raises(InputError, match="timeout is seconds >= 0 or None"):
            Client._timeout(me, bad)


def test_an_abort_of_a_request_in_flight_ends_it_as_abort():
    """A request aborted while its decode microbatch runs ended, when the tokens came back, with that token and
    finish_reason "length"; it must end with "abort" and no token, as one aborted while waiting or idle does."""
    s = Scheduler(max_batch=2, microbatches=2, prefill_chunk=8, max_context=64)
    s.add(Request("r0", "c", [1, 2, 3], 5, SamplingParams()))
    mb, _ = s.next_microbatch()
    assert [(e.tokens, e.finish) for e in s.on_tokens(mb.mb, [9], [-0.1])] == [([9], None)]
    mb, _ = s.next_microbatch()                 # decoding, in flight
    assert s.abort("r0") == [] and s.aborted == 1
    ev = s.on_tokens(mb.mb, [11], [-0.2])
    assert [(e.rid, e.tokens, e.finish) for e in ev] == [("r0", [], "abort")] and s.idle()
    # a continuation cut before the abort: the first return ends it, the continuation's token is dropped
    s.add(Request("r1", "c", [1, 2, 3], 5, SamplingParams()))
    mb, _ = s.next_microbatch()
    nxt = s.continue_microbatch(mb)
    assert nxt is not None and s.abort("r1") == []
    assert [(e.tokens, e.finish) for e in s.on_tokens(mb.mb, [9], [-0.1])] == [([], "abort")]
    assert s.on_tokens(nxt.mb, [10], [-0.1]) == [] and s.idle() and s.free_slots


@pytest.fixture(scope="module")
def dep(ray_cluster):
    _, path = tiny_checkpoint("dense", False)
    d = memra_pp.launch({"name": "sampling-audit", "model": {"path": str(path)},
                         "stages": [{"device": "cpu", "num_cpus": 0.1}] * 2,
                         "scheduler": {"max_batch": 4, "max_context": 64, "prefill_chunk": 16}})
    yield d
    d.shutdown()


def test_vllm_style_values_through_a_deployment(dep):
    """Through two CPU stages: top_k -1 must sample as top_k 0, 0-d torch sampling numbers as the Python ones, and
    max_new_tokens=torch.tensor(True) must be refused (it generated one token); the next request is served."""
    c = dep.client()
    p = [5, 17, 42]
    want = c.generate(p, max_new_tokens=6, temperature=0.9, top_k=0, top_p=0.9, seed=21)
    assert c.generate(p, max_new_tokens=6, temperature=0.9, top_k=-1, top_p=0.9, seed=21).token_ids == want.token_ids
    r = c.generate(p, max_new_tokens=torch.tensor(6), temperature=torch.tensor(0.9), top_k=torch.tensor(-1),
                   top_p=np.float64(0.9), seed=torch.tensor(21))
    assert (r.token_ids, r.logprobs) == (want.token_ids, want.logprobs)
    for call in (lambda: c.generate(p, max_new_tokens=torch.tensor(True)),
                 lambda: list(c.stream(p, max_new_tokens=torch.tensor(True)))):
        with pytest.raises(InputError, match=r"max_new_tokens must be an integer >= 0, got tensor\(True\) \(Tensor\)"):
            call()
    assert len(c.generate(p, max_new_tokens=3, ignore_eos=True).token_ids) == 3


def test_a_stop_id_refusal_names_the_bad_ids():
    """stop_token_ids=[1..9, 999] said "got [1, 2, 3, 4, 5, 6, 7, 8]": eight good ids, not the bad one."""
    from memra_pp.stages.runner import stop_ids
    with pytest.raises(InputError, match=r"stop_token_ids must be token ids in \[0, 100\), got \[999\] among 10$"):
        stop_ids(list(range(1, 10)) + [999], False, [0], 100)
    with pytest.raises(InputError, match=r"got \[-1, True\]$"):
        stop_ids([-1, True], False, [0], 100)
    assert stop_ids([3, 4], False, [0], 100) == {0, 3, 4}


def test_unseeded_draws_use_a_generator_on_the_logits_device_seeded_per_process():
    """The primary's generator for unseeded requests lives on the logits' device and is seeded from the OS. A CPU
    generator was passed for CUDA logits and dropped there for torch's default CUDA generator, which starts at one
    fixed seed in every process: each fresh GPU deployment drew the same "random" tokens. (The GPU half:
    tests/test_gpu_engine.py::test_unseeded_sampling_differs_between_samplers_on_the_gpu.)"""
    import torch
    from memra_pp.model.batch import StepBatch
    from memra_pp.stages.loops import Sampler
    a, b = Sampler(), Sampler()
    cpu = torch.device("cpu")
    assert a.rng(cpu) is a.rng(cpu) and a.rng(cpu).device == cpu
    assert a.rng(cpu).initial_seed() != b.rng(cpu).initial_seed()
    for s in (a, b):
        s.admit([(0, 1.0, 0, 1.0, 0.0, None, -1, 0)], [])
    logits = torch.zeros(1, 50_000)               # uniform: two draws of 20 agree by chance with p ~ 1e-94
    batch = StepBatch([0], [3], [1], StepBatch.text_positions([3], [1]), [True])
    draws = [[s(logits, batch).result()[0][0] for _ in range(20)] for s in (a, b)]
    assert draws[0] != draws[1] and list(a.rngs) == [cpu]
