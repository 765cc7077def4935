"""On a GPU, the bf16 engine (fla + SDPA, fp32 recurrent state, decode through the CUDA graphs and fused kernels
a deployment runs) must track transformers run in bf16 on the same GPU. bf16 greedy decoding is chaotic: a one-ulp
difference in a logit (0.03-0.06 at the logits' magnitudes here) can flip a near tie, and every later token follows
it. So transformers reads our tokens (teacher forcing) and at every one of the 16 steps our token must be its greedy
token or a near tie, and our logprob must match its logprob of that token; "near" is calibrated in the same run by
transformers against itself (its generate's decode kernels against its own forward over the same tokens): we may
differ from it by at most twice its own disagreement plus 0.05 nats. Identical greedy sequences against its
generate are printed for the record. The float32 CPU parity (tests/test_decode_graphs.py, 5e-4, the same fused
step through its torch references) and the compiled kernels against those references (test_gpu_decode_graphs.py)
are the exact checks."""
import math
import random

import pytest
import torch

from memra_pp.model.local import LocalPipeline
from memra_pp.model.weights import SafetensorsSource
from tiny_hf import TEXT, build

pytestmark = pytest.mark.gpu

MID = dict(vocab_size=4096, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
           num_key_value_heads=2, head_dim=128, linear_num_key_heads=4, linear_num_value_heads=8,
           linear_key_head_dim=128, linear_value_head_dim=128,
           rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                mrope_section=[6, 5, 5], mrope_interleaved=True))


@pytest.fixture(scope="module")
def cuda():
    assert torch.cuda.is_available(), "this test needs a CUDA GPU (it is selected with -m gpu, never skipped)"
    return torch.device("cuda:0")


def hf_greedy_bf16(model, prompt, n):
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                           output_logits=True, return_dict_in_generate=True, eos_token_id=None, pad_token_id=0)
    toks = g.sequences[0, len(prompt):].tolist()
    return toks, [float(torch.log_softmax(l[0].float(), -1)[t]) for l, t in zip(g.logits, toks, strict=True)]


@pytest.mark.parametrize("size", ["tiny", "mid", "moe", "moe-block"])
def test_bf16_engine_tracks_transformers(cuda, tmp_path, size, monkeypatch):
    """moe: the fused routing and expert kernels (kernels/fused_moe.py), in prefill and in the captured decode;
    moe-block: the same with the one-row decode's MoE as one block kernel (kernels/moe_block.py)."""
    from memra_pp.kernels import fused_moe, gemv, moe_block, paged_attention, prefill
    if size == "moe-block":
        monkeypatch.setattr(moe_block, "ENABLED", True)
    over = MID if size == "mid" else {}
    m = build("moe" if size.startswith("moe") else "dense", tied=False, seed=3, **over)
    m.save_pretrained(tmp_path)
    hf = type(m).from_pretrained(tmp_path, dtype=torch.bfloat16).to(cuda).eval()
    V = (over or TEXT)["vocab_size"]
    rng = random.Random(0)
    prompts = [[rng.randrange(4, V) for _ in range(rng.choice([1, 7, 40, 130]))] for _ in range(10)]
    src = SafetensorsSource(tmp_path)
    lp = LocalPipeline(src, [(0, 3), (3, 8)], dtype=torch.bfloat16, device=cuda, max_seqs=10)
    assert lp.stages[0].gdn_backend == "fla", "the GPU path must run the flash-linear-attention kernels"
    rules = {id(layer.mixer.rule): layer.mixer.rule for s in lp.stages for layer in s.layers if not layer.full}
    cfg = {**TEXT, **over}
    assert rules and all(r.gva == (cfg["linear_num_key_heads"] < cfg["linear_num_value_heads"])
                         for r in rules.values()), "q and k must keep their own heads where fla takes them (gva)"
    for s, c in zip(lp.stages, lp.caches, strict=True):
        s.set_decode_graphs(True, c)
    calls = dict(fused_moe.CALLS)      # module-wide, and loading ran them (MoE.warm_up): count the run's calls only
    blocks = moe_block.CALLS["block"]
    gemv_calls, qk_calls = dict(gemv.CALLS), paged_attention.CALLS["qk_kv_write"]
    convs, whole = prefill.CALLS["conv_prefill"] + prefill.CALLS["conv_varlen"], prefill.CALLS["rows_whole"]
    toks, lps = [], []
    for p in prompts:
        t, lg = lp.greedy([p], 16)
        toks.append(t[0])
        lps.append(lg[0])
    assert all(s.graphs.replays >= 150 for s in lp.stages), [s.graphs.stats() for s in lp.stages]
    same, ours, self_ = 0, [0.0, 0.0], [0.0, 0.0]

    def teacher_forced(p, t):
        """Transformers' (greedy gap, logprob) of tokens t after prompt p, read in one forward pass."""
        with torch.no_grad():
            lsm = torch.log_softmax(hf(torch.tensor([p + t], device=cuda)).logits[0, len(p) - 1:len(p) + 15]
                                    .float(), -1)
        lp = lsm[torch.arange(16), torch.tensor(t, device=cuda)]
        return lsm.max(-1).values - lp, lp

    for p, t, l in zip(prompts, toks, lps, strict=True):
        ht, hl = hf_greedy_bf16(hf, p, 16)
        same += t == ht
        gap, lp = teacher_forced(p, t)
        hgap, hlp = teacher_forced(p, ht)
        o = [gap.max().item(), (lp - torch.tensor(l, device=cuda)).abs().max().item()]
        h = [hgap.max().item(), (hlp - torch.tensor(hl, device=cuda)).abs().max().item()]
        assert all(math.isfinite(v) for v in o), (p, o)     # (a NaN would vanish in the max below)
        ours = [max(a, b) for a, b in zip(ours, o, strict=True)]
        self_ = [max(a, b) for a, b in zip(self_, h, strict=True)]
        print(f"prompt {len(p):4d}: identical to generate {t == ht}; greedy gap / logprob diff: ours "
              f"{o[0]:.4f} / {o[1]:.4f}, transformers' generate against itself {h[0]:.4f} / {h[1]:.4f}")
    if size.startswith("moe"):   # prefill (many pairs: grouped GEMM) and decode (one row: router kernel with the
        #                          input norm, per-pair kernels, the tile down kernel; or, moe-block or
        #                          MEMRA_PP_MOE_BLOCK=1, the block kernel) all ran fused
        assert all(fused_moe.CALLS[k] > calls[k] for k in ("route", "router", "small", "down_tile", "grouped")) \
            and (moe_block.CALLS["block"] > blocks) == moe_block.ENABLED \
            and (fused_moe.CALLS["norm_router"] > calls["norm_router"]) != moe_block.ENABLED, \
            (moe_block.ENABLED, calls, fused_moe.CALLS, moe_block.CALLS)
    # one-row decode graphs: out_proj / o_proj / down through kernels/gemv.py, the input projections (and the dense
    # gate|up) with their norm in its prologue (hidden <= 2,048); the q / k norms and the KV write as one kernel
    assert all(gemv.CALLS[k] > gemv_calls[k] for k in ("gemv", "norm_gemv")), (gemv_calls, gemv.CALLS)
    assert paged_attention.CALLS["qk_kv_write"] > qk_calls, "the q / k norms and the KV write ran as one kernel"
    # the prompts' prefill: the Gated DeltaNet's conv as one kernel a step's segments (kernels/prefill.py: its
    # variable-length call, or one a group of equal lengths with MEMRA_PP_PREFILL_VARLEN=0)
    assert prefill.CALLS["conv_prefill"] + prefill.CALLS["conv_varlen"] > convs, "the prefill conv did not run as " \
        "its kernel"
    # and its merged path: one GEMM a layer's projections, the one group's output the layer's (kernels/prefill.MERGED)
    assert prefill.CALLS["rows_whole"] > whole, "the prefill did not take its merged path"
    print(f"{size}: {same}/10 prompts identical to generate; worst greedy gap {ours[0]:.3e} (transformers against "
          f"itself {self_[0]:.3e}), worst logprob diff {ours[1]:.3e} (itself {self_[1]:.3e})")
    assert ours[0] <= 2 * self_[0] + 0.05, "one of our tokens is neither transformers' greedy token nor a near tie"
    assert ours[1] <= 2 * self_[1] + 0.05, "our logprobs stray further from transformers' than it does from itself"


@pytest.mark.parametrize("size", ["tiny", "mid"])
def test_variable_length_prefill_equals_groups(cuda, tmp_path, size, monkeypatch):
    """A prefill step of prompts of many lengths (whole, and in chunks of 48: continuing segments from a state) with
    the Gated DeltaNet's segments, and the fresh ones' attention, each one variable-length call (kernels/prefill
    VARLEN: fla's and flash attention's kernels) must leave every linear layer's conv and recurrent states, and give
    the first tokens, that the calls per group of equal lengths give (MEMRA_PP_PREFILL_VARLEN=0); the counters prove
    which calls ran. mid: fla's grouped value heads."""
    from memra_pp.kernels import prefill as pf
    m = build("dense", tied=False, seed=5, **(MID if size == "mid" else {}))
    m.save_pretrained(tmp_path)
    V = (MID if size == "mid" else TEXT)["vocab_size"]
    rng = random.Random(1)
    # 49 and 50 tokens: in chunks of 48 their second steps are a one-token continuing row (the decode kernels) and a
    # two-token segment (shorter than the conv's K - 1: its new conv state keeps an old input), so those steps' rows
    # are not one run (the output gathered)
    prompts = [[rng.randrange(4, V) for _ in range(n)] for n in (1, 7, 40, 130, 65, 3, 130, 40, 49, 50)]
    lp = LocalPipeline(SafetensorsSource(tmp_path), [(0, 3), (3, 8)], dtype=torch.bfloat16, device=cuda,
                       max_seqs=len(prompts))
    for chunk in (None, 48):
        runs = {}
        for varlen in (True, False):
            monkeypatch.setattr(pf, "VARLEN", varlen)
            before = dict(pf.CALLS)
            toks, lps = lp.greedy(prompts, 1, chunk=chunk)
            ran = {k: pf.CALLS[k] - before[k] for k in ("conv_varlen", "conv_prefill", "attn_varlen")}
            assert (ran["conv_varlen"] > 0) == varlen and (ran["conv_prefill"] > 0) != varlen, (varlen, ran)
            # the fresh prompts (or first chunks) differ in length: their attention one variable-length call a layer
            assert (ran["attn_varlen"] > 0) == varlen, (varlen, chunk, ran)
            states = [t[:len(prompts)].float().clone() for c in lp.caches for t in (*c.conv.values(),
                                                                                    *c.rec.values())]
            runs[varlen] = toks, lps, states
        (t1, l1, s1), (t0, l0, s0) = runs[True], runs[False]
        for a, b in zip(s1, s0, strict=True):
            err = ((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()
            assert err < 2e-2, (chunk, err)
        same = _agree(t1, l1, t0, l0, chunk)
        assert same >= len(prompts) - 2, f"only {same}/{len(prompts)} first tokens identical (chunk {chunk})"
        print(f"{size} chunk {chunk}: states and first tokens agree; {same}/{len(prompts)} first tokens identical")
    # steps as the scheduler mixes them: a decode row, fresh chunks of two lengths and a continuing chunk between
    # them (the fresh segments' one attention call beside other rows, its output gathered into the step's)
    from test_model_parity import mixed_greedy
    mixed, arrive = [prompts[1], prompts[2][:30], prompts[3], prompts[5]], [0, 1, 0, 1]
    runs = {}
    for varlen in (True, False):
        monkeypatch.setattr(pf, "VARLEN", varlen)
        part = pf.CALLS["attn_varlen_part"]
        runs[varlen] = mixed_greedy(lp, mixed, arrive, 4, 16)
        assert (pf.CALLS["attn_varlen_part"] > part) == varlen, (varlen, pf.CALLS)
    same = _agree(*runs[True], *runs[False], "mixed")
    assert same >= len(mixed) - 1, f"only {same}/{len(mixed)} mixed-step sequences identical"
    print(f"{size} mixed steps: {same}/{len(mixed)} sequences' 4 tokens identical")


def _agree(t1, l1, t0, l0, where) -> int:
    """Two bf16 runs' greedy tokens and logprobs, sequence by sequence, position by position: equal tokens with
    logprobs within 0.05, up to a first differing token, which must be a near tie (its logprob within 0.05 of the
    other run's token's: both near the top); after it the sequences differ. Returns the sequences identical
    throughout."""
    same = 0
    for i, (a, b, x, y) in enumerate(zip(t1, t0, l1, l0, strict=True)):
        assert len(a) == len(b) == len(x) == len(y) > 0, (where, i, a, b)
        for k in range(len(a)):
            assert abs(x[k] - y[k]) < 0.05, (where, i, k, a, b, x, y)   # equal tokens, or a near tie at k
            if a[k] != b[k]:
                break
        else:
            same += 1
    return same
