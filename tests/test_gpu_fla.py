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
    from fla.ops.gated_delta_rule import chunk_fwd      # the fused kkt-solve kernel: pinned (fla_rule._pin)
    [cfg] = fla_rule._autotuner(chunk_fwd.chunk_gated_delta_rule_fwd_kkt_solve_kernel).configs
    assert cfg.kwargs.get("BK") == 64 and cfg.num_warps == 1, cfg
    from fla.ops.common import chunk_delta_h            # chunk_h: pinned too (or picked by its grid)
    [cfg] = fla_rule._autotuner(chunk_delta_h.chunk_gated_delta_rule_fwd_kernel_h_blockdim64).configs
    assert rule._chunk_h is not None if fla_rule.CHUNK_H_GRID else \
        (cfg.kwargs.get("BV"), cfg.num_warps, cfg.num_stages) == (64, 4, 4), cfg
    from fla.ops.gated_delta_rule import wy_fast        # recompute_w_u: pinned too
    [cfg] = fla_rule._autotuner(wy_fast.recompute_w_u_fwd_kernel).configs
    assert (cfg.num_warps, cfg.num_stages) == (4, 3), cfg
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


def test_grouped_value_heads_equal_repeated_q_and_k():
    """fla's grouped value attention (q and k with 16 heads, v with 48, the 27B's linear heads) must give what the
    engine's repeated q and k gave (repeat_interleave: value head h reads key head h // 3) and what the torch chunked
    form gives; the load's warm-up turns it on (rule.gva) and tunes its shapes, so a prefill tunes nothing."""
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (run it on the GPU machine: pytest -m gpu)"
    from memra_pp.model import fla_rule
    from memra_pp.model.gdn import chunk_gated_delta_rule
    rule = fla_rule.FlaRule()
    H, HV, D = 16, 48, 128
    rule.warm_up(HV, D, D, torch.bfloat16, torch.device("cuda"), k_heads=H)
    assert rule.gva, "this fla (0.6) takes grouped value heads: the warm-up must have turned gva on"
    first = fla_rule.tuned_keys()
    assert first > 0, "fla's autotuners were not found (or the warm-up tuned nothing): tuned_keys() counts nothing"
    gen = torch.Generator(device="cuda").manual_seed(1)

    def r(*s):
        return torch.randn(*s, device="cuda", generator=gen)
    cases = []
    for G, n in [(1, 300), (3, 40), (2, 1)]:
        q, k, v = r(G, n, H, D).bfloat16(), r(G, n, H, D).bfloat16(), r(G, n, HV, D).bfloat16()
        g, beta = -torch.rand(G, n, HV, device="cuda", generator=gen), \
            torch.rand(G, n, HV, device="cuda", generator=gen).bfloat16()
        s0 = r(G, HV, D, D) * 0.1
        fn = rule.chunk if n > 1 else rule.recurrent
        cases.append((fn, (q, k, v, g, beta, s0), fn(q, k, v, g, beta, s0)))
    assert fla_rule.tuned_keys() == first, "a grouped-head prefill tuned fla's kernels after the warm-up"
    for fn, (q, k, v, g, beta, s0), (o, s) in cases:    # the repeated heads may tune: after the check above
        qr, kr = q.repeat_interleave(HV // H, 2), k.repeat_interleave(HV // H, 2)
        o2, s2 = fn(qr, kr, v, g, beta, s0)
        ro, rs = chunk_gated_delta_rule(qr.float(), kr.float(), v.float(), g, beta.float(), s0)
        for a, b, c in ((o.float(), o2.float(), ro), (s, s2, rs)):
            assert ((a - b).abs().max() / b.abs().max()).item() < 1e-2, (q.shape, fn)
            assert ((a - c).abs().max() / c.abs().max()).item() < 2e-2, (q.shape, fn)


@pytest.mark.parametrize("gva", [False, True])
def test_variable_length_call_equals_one_call_per_segment(gva, monkeypatch):
    """The prefill's variable-length call (FlaRule.chunk_varlen: a step's segments of any lengths packed, fla's
    cu_seqlens with the chunk indices the step made on the host, kernels/prefill.segments) must give each segment the
    output and final state that the per-segment call gives it, from each segment's own starting state; and after the
    load's warm-up it tunes nothing."""
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (run it on the GPU machine: pytest -m gpu)"
    from memra_pp.kernels import prefill as pf
    from memra_pp.model import fla_rule
    from memra_pp.model.batch import StepBatch
    monkeypatch.setattr(pf, "VARLEN", True)        # the load's warm-up tunes the variable-length call too
    rule = fla_rule.FlaRule()
    H, HV, D = (16, 48, 128) if gva else (32, 32, 128)
    rule.warm_up(HV, D, D, torch.bfloat16, torch.device("cuda"), k_heads=H)
    assert rule.gva == gva
    first = fla_rule.tuned_keys()
    assert first > 0, "fla's autotuners were not found (or the warm-up tuned nothing): tuned_keys() counts nothing"
    gen = torch.Generator(device="cuda").manual_seed(2)
    lens = [7, 64, 65, 200, 3, 2]
    step = StepBatch(list(range(len(lens))), [0] * len(lens), lens, StepBatch.text_positions([0] * 6, lens),
                     [True] * len(lens))
    seg = pf.segments(step, torch.device("cuda"), 4)
    assert seg.lens == lens and seg.span == slice(0, sum(lens))
    R, N = sum(lens), len(lens)

    def r(*s):
        return torch.randn(*s, device="cuda", generator=gen)
    q, k, v = r(1, R, H, D).bfloat16(), r(1, R, H, D).bfloat16(), r(1, R, HV, D).bfloat16()
    g, beta = -torch.rand(1, R, HV, device="cuda", generator=gen), \
        torch.rand(1, R, HV, device="cuda", generator=gen).bfloat16()
    s0 = r(N, HV, D, D) * 0.1
    if not gva:
        q, k = q.repeat_interleave(HV // H, 2), k.repeat_interleave(HV // H, 2)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")     # the variable-length call must not wait for the device
    try:
        o, s = rule.chunk_varlen(q, k, v, g, beta, s0, seg.cu, seg.chunks)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert fla_rule.tuned_keys() == first, "a variable-length prefill tuned fla's kernels after the warm-up"
    at = 0
    for i, n in enumerate(lens):
        part = [x[:, at:at + n] for x in (q, k, v, g, beta)]
        fn = rule.chunk if n > 1 else rule.recurrent
        o1, s1 = fn(*part, s0[i:i + 1])
        for a, b in ((o[:, at:at + n].float(), o1.float()), (s[i:i + 1], s1)):
            err = ((a - b).abs().max() / b.abs().max()).item()
            assert err < 1e-2, (i, n, err)
        at += n


def test_prefill_conv_compiles_nothing_in_a_request(monkeypatch):
    """After the load's warm-up (kernels/prefill.prefill_warm_up), the prefill's conv kernel takes every step with
    the binaries it has: groups whose rows start at any offset of the step's index tensor (an odd one after a group
    of an odd row count), fresh and continuing, whole and split into q, k, v, and the variable-length call over
    segments of any lengths, from u of either row stride the engine passes (its own projection, or the merged one's
    first C columns). A second binary would compile inside a request."""
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (run it on the GPU machine: pytest -m gpu)"
    from memra_pp.kernels import prefill as pf
    from memra_pp.model.batch import StepBatch
    from memra_pp.model.config import parse_config
    from memra_pp.model.tiny import tiny_config
    monkeypatch.setattr(pf, "VARLEN", True)
    cfg, dev = parse_config(tiny_config(num_layers=4)).text, torch.device("cuda")
    pf.prefill_warm_up(cfg, True, True, torch.bfloat16, dev)

    def binaries():
        return sum(len(c[0]) for c in pf._conv_prefill_kernel.device_caches.values())
    first = binaries()
    assert first > 0, "the warm-up compiled no conv binary (or this Triton keeps them elsewhere)"
    C, K = cfg.conv_dim, cfg.linear_conv_kernel_dim
    qk = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    counts, starts = [3, 5, 5, 7, 1, 2], [0, 0, 4, 0, 9, 6]
    b = StepBatch(list(range(6)), starts, counts, StepBatch.text_positions(starts, counts), [True] * 6)
    W = C + cfg.linear_num_value_heads * (cfg.linear_value_head_dim + 2)    # the merged projection's width
    assert (C % 16 == 0) != (W % 16 == 0), (C, W)     # the tiny model's two row strides specialize apart
    w = torch.randn(C, K, device=dev).bfloat16()
    groups = b.groups("prompt_length", dev)
    assert any(rows.data_ptr() % 16 for _, rows, _, _ in groups), "no group's rows at an odd offset: the case is lost"
    seg = pf.segments(b, dev, K)
    for u in (torch.randn(sum(counts), C, device=dev).bfloat16(),                 # its own projection
              torch.randn(sum(counts), W, device=dev).bfloat16()[:, :C]):         # the merged projection's columns
        for idx, rows, _, _ in groups:
            G, n = len(idx), counts[idx[0]]
            for state in (None, torch.zeros(G, C, K - 1, device=dev, dtype=torch.bfloat16)):
                for parts in (None, (qk, qk, C - 2 * qk)):
                    pf.conv_prefill(u, rows, w, state, G, n, parts)
        for state in (None, torch.zeros(len(seg.lens), C, K - 1, device=dev, dtype=torch.bfloat16)):
            pf.conv_varlen(u, seg, w, state, (qk, qk, C - 2 * qk))
    torch.cuda.synchronize()
    assert binaries() == first, f"the conv compiled {binaries() - first} binaries after the warm-up"


def test_chunk_h_grid_pick_compiles_at_warm_up_and_matches_the_pin(monkeypatch):
    """MEMRA_PP_CHUNK_H_GRID: the load's warm-up compiles each of chunk_h's picked configs, so variable-length calls
    of 1, 2 and 16 segments after it compile no binary; each call runs the config its grid gives; outputs and final
    states match the pinned config's (the same arithmetic in other tiles)."""
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (run it on the GPU machine: pytest -m gpu)"
    from memra_pp.kernels import prefill as pf
    from memra_pp.model import fla_rule
    monkeypatch.setattr(pf, "VARLEN", True)
    monkeypatch.setattr(fla_rule, "_WARM", {})         # (this process's warm-ups so far compiled the pin only)
    monkeypatch.setattr(fla_rule, "CHUNK_H_GRID", True)
    rule = fla_rule.FlaRule()
    pick, dev = rule._chunk_h, torch.device("cuda")
    assert pick is not None, "this fla has not the chunk_h configs GridPick picks from"
    H, HV, D = 16, 32, 128
    rule.warm_up(HV, D, D, torch.bfloat16, dev, k_heads=H)
    qh = H if rule.gva else HV

    def binaries():
        return sum(len(c[0]) for c in pick.tuner.fn.device_caches.values())
    first = binaries()
    gen = torch.Generator(device="cuda").manual_seed(3)

    def r(*s):
        return torch.randn(*s, device="cuda", generator=gen)
    cases, used = [], []
    for lens in ([1024], [512, 512], [128] * 16):
        R = sum(lens)
        q, k, v = r(1, R, qh, D).bfloat16(), r(1, R, qh, D).bfloat16(), r(1, R, HV, D).bfloat16()
        g, beta = -torch.rand(1, R, HV, device="cuda", generator=gen), r(1, R, HV).sigmoid().bfloat16()
        s0 = r(len(lens), HV, D, D) * 0.1
        cu = torch.tensor([0] + [sum(lens[:i + 1]) for i in range(len(lens))], device="cuda")
        ch = torch.tensor([[i, j] for i, n in enumerate(lens) for j in range(-(-n // 64))], device="cuda")
        args = (q, k, v, g, beta, s0, cu, ch)
        cases.append((args, rule.chunk_varlen(*args)))
        used.append(pick.tuner.configs[0])
        assert used[-1] is pick.choose(len(lens), HV, D, dev)
    torch.cuda.synchronize()
    assert binaries() == first, "a call after the warm-up compiled chunk_h again (a request would wait for it)"
    assert len({id(c) for c in used}) >= 2, [str(c) for c in used]      # (on 132 SMs: all three)
    [pin] = fla_rule._matching(pick.tuner._memra_all, fla_rule.CHUNK_H_CONFIG)
    rule._chunk_h = None
    try:
        for args, (o, st) in cases:
            pick.tuner.configs = [pin]
            o2, st2 = rule.chunk_varlen(*args)
            assert torch.allclose(o.float(), o2.float(), atol=2e-2, rtol=2e-2)
            assert torch.allclose(st, st2, atol=1e-3, rtol=1e-3), (st - st2).abs().max().item()
    finally:
        monkeypatch.setattr(fla_rule, "CHUNK_H_GRID", False)
        fla_rule.FlaRule()          # (the pin back for the tests after)

