"""flash-linear-attention's chunk kernels as the engine calls them (memra_pp/model/fla_rule.py): after the load's
warm-up, prefill steps of any shape (other numbers of equal-length sequences, token counts in other buckets) tune
no kernel again, and the results match the torch chunked form. Needs a CUDA GPU: fails (never skips) without
one."""
import pytest
import torch

pytestmark = pytest.mark.gpu


def test_chunk_calls_of_new_shapes_tune_nothing_and_match_torch():
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (run it on the GPU machine: pytest -m gpu)"
    from memra_pp.model import fla_rule
    from memra_pp.model.gdn import chunk_gated_delta_rule
    assert fla_rule.available(), "the GPU path needs flash-linear-attention"
    rule = fla_rule.FlaRule()
    gen = torch.Generator(device="cuda").manual_seed(0)

    def call(G, n, H=32, D=128):
        def r(*s):
            return torch.randn(*s, device="cuda", generator=gen)
        q, k, v = r(G, n, H, D).bfloat16(), r(G, n, H, D).bfloat16(), r(G, n, H, D).bfloat16()
        g, beta = -torch.rand(G, n, H, device="cuda", generator=gen), torch.rand(G, n, H, device="cuda",
                                                                                 generator=gen).bfloat16()
        s0 = r(G, H, D, D) * 0.1
        o, s = rule.chunk(q, k, v, g, beta, s0)
        ro, rs = chunk_gated_delta_rule(q.float(), k.float(), v.float(), g, beta.float(), s0)
        for a, b in ((o.float(), ro), (s, rs)):
            err = ((a - b).abs().max() / b.abs().max()).item()
            assert err < 2e-2, (G, n, err)

    rule.warm_up(32, 128, 128, torch.bfloat16, torch.device("cuda"))   # as a stage load does: fla tunes here
    first = fla_rule.tuned_keys()
    assert first > 0, "fla's autotuners were not found (or the warm-up tuned nothing): tuned_keys() counts nothing"
    for G, n in [(1, 64), (3, 40), (2, 1100), (5, 130)]:   # new group sizes; 2 x 1,100 x 32 rows: a new l2norm
        call(G, n)                                         # bucket had fla's own l2norm tune again
    assert fla_rule.tuned_keys() == first, "a prefill step of a new shape tuned fla's kernels again"
