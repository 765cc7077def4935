"""fla's variable-length chunked rule as the rule graphs call it (model/prefill_graphs.RuleGraphs), in torch, for the
CPU tests: segments from cu_seqlens, an empty segment's state passed through (as fla does: docs/PERF.md, the
thirty-seventh session), each call's chunk indices checked against cu_seqlens: the real (segment, chunk) pairs in
order, then padding chunks only of a last, empty segment. Rows of no segment are never read (NaN there would show
in nothing). The arithmetic is the torch rule's (model/gdn.py), taking q and k normalised by the caller (normed) as
they are."""
from __future__ import annotations

import torch

from memra_pp.model.gdn import chunk_gated_delta_rule


class PaddedRule:
    """gva: q and k keep their own (fewer) heads, as fla takes them where it has grouped value heads (FlaRule.gva);
    the double repeats them to the value heads for the torch rule, as repeat_interleave maps them."""
    name = "padded-torch"

    def __init__(self, gva: bool = False):
        self.gva = gva
        self.calls = 0
        self.layouts = []       # (lens, padding chunks) of each call

    def chunk_varlen(self, q, k, v, g, beta, state, cu, chunks, normed: bool = False):
        cu, ch = cu.tolist(), chunks.tolist()
        N = len(cu) - 1
        assert state.shape[0] == N, (state.shape, N)
        lens = [b - a for a, b in zip(cu, cu[1:])]
        assert all(n >= 0 for n in lens) and cu[-1] <= q.shape[1], cu
        real = [[s, j] for s, n in enumerate(lens) for j in range(-(-n // 64))]
        assert ch[:len(real)] == real, (ch, real)
        pad = ch[len(real):]
        assert not pad or (lens[-1] == 0 and all(c == [N - 1, 0] for c in pad)), (lens, pad)
        if q.shape[2] != v.shape[2]:
            assert self.gva and v.shape[2] % q.shape[2] == 0, (q.shape, v.shape)
            r = v.shape[2] // q.shape[2]
            q, k = q.repeat_interleave(r, 2), k.repeat_interleave(r, 2)
        o = torch.zeros_like(v)
        states = state.clone().float()
        for s, n in enumerate(lens):
            if n:
                a = cu[s]
                o[:, a:a + n], states[s:s + 1] = chunk_gated_delta_rule(
                    *(x[:, a:a + n] for x in (q, k, v, g, beta)), state[s:s + 1], normed=normed)
        self.calls += 1
        self.layouts.append((lens, len(pad)))
        return o, states


def attach(stages, max_tokens: int, gva: bool = False) -> PaddedRule:
    """One PaddedRule as the rule of every Gated DeltaNet layer of `stages`, then their prefill graphs uncaptured up
    to max_tokens rows (with rule graphs where prefill_graphs.RULE_GRAPHS is on). The stages share the rule: its
    `layouts` interleave their calls."""
    rule = PaddedRule(gva)
    for s in stages:
        for layer in s.layers:
            if not layer.full:
                layer.mixer.rule = rule
        s.set_prefill_graphs(True, max_tokens, capture=False)
    return rule
