"""The decode graphs' step at one row through the Triton kernels (Triton's CPU interpreter, float32): the merged
input projections with their norm and out_proj / o_proj (kernels/gemv.py, forced onto the tiny shapes, 3 persistent
programs), the conv and GDN steps, the q / k norms with the new key and value's write in one kernel, attention and the
MoE kernels; the prompt's prefill through the Triton norms and conv (conv_prefill). It must decode what the eager
step decodes through the torch ops: same greedy tokens, logprobs within 5e-4. With decode_graphs.ANY_KV on (the
default: one graph for every length, the attention over the cache's capacity, each sequence's splits from its
length), whatever the environment says; a graph per KV bucket runs the same kernels
but the attention's (tests/fused_decode_check.py checks it both ways). Run under TRITON_INTERPRET=1
(tests/test_decode_graphs.py does, the two MoE ways at once: `fused_step_check.py [all|noblock|block]`); prints the
fused kinds' launch counts."""
import sys
from pathlib import Path
from gaps import worst_gap

sys.path.insert(0, str(Path(__file__).parent))

import interp  # noqa: E402
import torch  # noqa: E402
from memra_pp.kernels import fused_decode as fd, fused_moe, gemv, moe_block, paged_attention as pgd, prefill as pf  # noqa: E402,E501
from memra_pp.model import decode_graphs as dg  # noqa: E402
from test_decode_graphs import pipelines  # noqa: E402

which = sys.argv[1] if len(sys.argv) > 1 else "all"
NEW = 3         # a token from the prefill, then two decode steps (the second reads the first's KV and state)
assert which in ("all", "noblock", "block"), which
gemv.FORCE = True
gemv.PROGRAMS = 3       # persistent GEMVs of several row blocks a program, as at real sizes (PREFETCH's loop runs)
interp.coarse_moe_tiles()
# the MoE as the router, per-pair and down kernels, then as the one block kernel (kernels/moe_block.py; its three
# phases as three launches here)
for kind, splits, any_kv, block in (("moe", [(0, 4), (4, 8)], True, False), ("moe", [(0, 4), (4, 8)], True, True)):
    if which != "all" and block != (which == "block"):
        continue
    dg.ANY_KV, moe_block.ENABLED = any_kv, block
    blocks = moe_block.CALLS["block_split"]
    eager, static = pipelines(kind, splits)
    fd.USE_TRITON = False          # the reference: the eager step through the torch ops
    te, le = eager.greedy([[5, 6, 7, 8]], NEW)
    fd.USE_TRITON = True
    before, qk, sg = dict(gemv.CALLS), pgd.CALLS["qk_kv_write"], fused_moe.CALLS["shared_gate"]
    cp = pf.CALLS["conv_prefill"] + pf.CALLS["conv_varlen"]   # the prompt's prefill: the Triton norms and conv
    ts, ls = static.greedy([[5, 6, 7, 8]], NEW)
    assert ts == te, (kind, ts, te)
    d = worst_gap(p for x, y in zip(le, ls, strict=True) for p in zip(x, y, strict=True))
    assert d < 5e-4, (kind, d)
    ran = {k: gemv.CALLS[k] - before[k] for k in gemv.CALLS}
    ran["qk_kv_write"], ran["shared_gate"] = pgd.CALLS["qk_kv_write"] - qk, fused_moe.CALLS["shared_gate"] - sg
    ran["block"] = moe_block.CALLS["block_split"] - blocks
    ran["conv"] = pf.CALLS["conv_prefill"] + pf.CALLS["conv_varlen"] - cp
    assert all(ran[k] > 0 for k in ("gemv", "norm_gemv", "qk_kv_write", "conv")), (kind, ran)
    assert ran["shared_gate"] > 0 and (ran["block"] > 0) == block, (block, ran)     # (prefill: the per-pair kernels)
    S = static.caches[0].max_positions if any_kv else 256     # the graphs' KV length: the capacity, or the bucket
    assert [s.graphs.stats()["graphs"] for s in static.stages] == [[(1, S)]] * 2, (any_kv, static.stages[0].graphs)
    if not block:
        # three sequences: the graph of 4 rows, its padding row (its input NaN) routed to no expert
        # (decode_graphs.SKIP_PADDING; the router's `live`), the three real rows decoding what the eager step decodes
        lv = fused_moe.CALLS["route_live"]
        prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
        te, le = eager.greedy(prompts, NEW)
        # the scratch slot's recurrent states, where the padding row's Gated DeltaNet steps would write (set to ones:
        # a step from zeros on the padding row's zero input would leave them zeros)
        for c in static.caches:
            for i in c.rec:
                c.rec[i][c.scratch].fill_(1.0)
        scratch = [{i: c.rec[i][c.scratch].clone() for i in c.rec} for c in static.caches]
        assert all(scratch), "no Gated DeltaNet layer"
        for s in static.stages:     # the padding row's input NaN on each stage: nothing of it may reach a real row
            s.graphs.h.fill_(float("nan"))
        ts, ls = static.greedy(prompts, NEW)
        assert ts == te, (kind, ts, te)
        d = worst_gap(p for x, y in zip(le, ls, strict=True) for p in zip(x, y, strict=True))
        assert d < 5e-4, (kind, d)
        assert [s.graphs.stats()["graphs"] for s in static.stages] == [[(1, S), (4, S)]] * 2, static.stages[0].graphs
        # every MoE layer of both stages, each decode step after the prompts' (NEW - 1 of them)
        assert fused_moe.CALLS["route_live"] - lv == 8 * (NEW - 1), fused_moe.CALLS
        # and skipped the Gated DeltaNet's recurrent step: the scratch slot's states untouched
        assert all(torch.equal(c.rec[i][c.scratch], was[i]) for c, was in zip(static.caches, scratch, strict=True)
                   for i in was), "a padding row wrote the scratch slot's recurrent state"
        print("padding rows routed to no expert:", fused_moe.CALLS["route_live"] - lv, "routings")
print("step ok", {**gemv.CALLS, **pgd.CALLS, **pf.CALLS, "shared_gate": fused_moe.CALLS["shared_gate"],
                  "block": moe_block.CALLS["block_split"]})
