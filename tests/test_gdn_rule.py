"""The torch gated delta rule's chunked forms equal its step-by-step recurrence: a segment shorter than the chunk
(computed in a chunk of its own size), one spanning several chunks, and the variable-length form with segments of
repeated and distinct lengths (batched by length), from zero and from carried states; and the decode's one-token
step is the recurrence's first step, bit for bit."""
import pytest
import torch

from memra_pp.model.gdn import (chunk_gated_delta_rule, chunk_gated_delta_rule_varlen, recurrent_gated_delta_rule,
                                recurrent_step)

H, DK, DV = 4, 16, 8


def inputs(B, T, seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)     # noqa: E731
    return (r(B, T, H, DK), r(B, T, H, DK), r(B, T, H, DV), -torch.rand(B, T, H, generator=g),
            torch.rand(B, T, H, generator=g), r(B, H, DK, DV))


@pytest.mark.parametrize("T", [1, 2, 3, 5, 31, 64, 65, 130])
def test_chunked_equals_the_recurrence(T):
    q, k, v, gg, beta, s0 = inputs(3, T, T)
    o, s = chunk_gated_delta_rule(q, k, v, gg, beta, s0)
    ro, rs = recurrent_gated_delta_rule(q, k, v, gg, beta, s0)
    assert o.shape == ro.shape and s.shape == rs.shape
    torch.testing.assert_close(o, ro, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(s, rs, atol=2e-5, rtol=1e-4)


def test_varlen_batches_equal_lengths_and_keeps_each_segments_rows_and_state():
    lens = [3, 5, 3, 70, 1, 5, 3]
    q, k, v, gg, beta, _ = inputs(1, sum(lens), 7)
    s0 = inputs(len(lens), 1, 8)[5]
    o, s = chunk_gated_delta_rule_varlen(q, k, v, gg, beta, s0, lens)
    assert o.shape == (1, sum(lens), H, DV) and s.shape == s0.shape
    at = 0
    for i, n in enumerate(lens):
        ro, rs = recurrent_gated_delta_rule(*(x[:, at:at + n] for x in (q, k, v, gg, beta)), s0[i:i + 1])
        torch.testing.assert_close(o[:, at:at + n], ro, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(s[i:i + 1], rs, atol=2e-5, rtol=1e-4)
        at += n


@pytest.mark.parametrize("B", [1, 3, 16])
def test_the_decode_step_is_the_recurrence_bit_for_bit(B):
    """recurrent_step (the eager decode off fla) gives the recurrence's output and state for one token exactly, and
    leaves the state it read as it was (the decode scatters the new one back into the cache itself)."""
    q, k, v, gg, beta, s0 = inputs(B, 1, 100 + B)
    keep = s0.clone()
    ro, rs = recurrent_gated_delta_rule(q, k, v, gg, beta, s0)
    o, s = recurrent_step(q[:, 0], k[:, 0], v[:, 0], gg[:, 0], beta[:, 0], s0)
    assert torch.equal(o, ro[:, 0]) and torch.equal(s, rs) and torch.equal(s0, keep)
