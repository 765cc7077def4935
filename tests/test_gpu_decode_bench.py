"""benchmarks/hf_baseline.py (gpu_decode.py's transformers baselines) on CPU with the tiny Qwen3.5 text config: the
device-map split, the meta-built model and the rows run_hf records (the GPU numbers come from
scripts/gpu_session.sh); gpu_engine_step.py's modes."""
import os
import sys
import types
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))

import gpu_decode  # noqa: E402
import hf_baseline  # noqa: E402
from memra_pp.model.tiny import tiny_config  # noqa: E402

TEXT = tiny_config(num_layers=8)["text_config"]
ROW_KEYS = {"system", "devices", "layers_per_device", "concurrency", "tokens_per_s", "wall_s",
            "decode_tokens_per_s", "ttft_s"}


def test_device_map_keeps_layers_whole_and_balanced():
    """Over two GPUs the map must place every decoder layer whole, the embedding on the first and lm_head on the
    last, with the layers split about evenly (what device_map="auto" gives from_pretrained)."""
    model = hf_baseline.hf_on_meta(TEXT)
    size = sum(p.numel() * p.element_size() for p in model.parameters())
    dm = hf_baseline.hf_device_map(model, [0, 1], max_memory={0: size, 1: size})
    n = TEXT["num_hidden_layers"]
    assert [k for k in dm if ".layers." in k] == [f"model.layers.{i}" for i in range(n)]
    assert dm["model.embed_tokens"] == 0 and dm["lm_head"] == 1
    on_first = sum(dm[f"model.layers.{i}"] == 0 for i in range(n))
    assert abs(2 * on_first - n) <= 2, dm


def test_one_device_is_the_whole_model():
    """One device must map the whole model there."""
    assert hf_baseline.hf_device_map(hf_baseline.hf_on_meta(TEXT), ["cpu"]) == {"": "cpu"}


def test_materialising_per_entry_matches_whole():
    """Materialising a split map entry by entry must leave nothing on meta and give the same weights, seed for
    seed, as materialising the model whole (init runs over the modules in one order either way)."""
    split = hf_baseline.hf_device_map(hf_baseline.hf_on_meta(TEXT), [0, 1], max_memory={0: 1 << 40, 1: 1 << 40})
    torch.manual_seed(0)
    whole = hf_baseline.build_hf(TEXT, ["cpu"])
    torch.manual_seed(0)
    parts = hf_baseline.build_hf(TEXT, ["cpu"], device_map=dict.fromkeys(split, "cpu"))
    tensors = dict(parts.named_parameters()) | dict(parts.named_buffers())
    assert not [n for n, t in tensors.items() if t.is_meta]
    ref = dict(whole.named_parameters()) | dict(whole.named_buffers())
    assert set(ref) == set(tensors)
    for n, t in tensors.items():
        assert torch.equal(t, ref[n]), n
    w = whole.model.layers[0].mlp.up_proj.weight
    assert w.dtype == torch.bfloat16 and abs(w.float().std().item() - 0.02) < 0.005     # transformers' init ran


def test_run_hf_rows_on_cpu():
    """run_hf must generate on the built model and record one row per concurrency, under the system name it was
    given, into the caller's list, saving after each."""
    rows, saves = [], []
    system = "transformers, device_map over 1 GPUs"
    out = hf_baseline.run_hf([1, 2], prompt_len=8, new=4, devices=["cpu"], text_config=TEXT, system=system,
                            out=rows, save=lambda: saves.append(len(rows)))
    assert out is rows and saves == [1, 2]
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert set(r) == ROW_KEYS
        assert r["system"] == system and r["devices"] == ["cpu"]
        assert r["tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 and 0 < r["ttft_s"] <= r["wall_s"]


def test_generate_returns_new_tokens():
    """The built model's generate must return the prompt followed by `new` in-vocabulary tokens."""
    new = 4
    model = hf_baseline.build_hf(TEXT, ["cpu"])
    ids = torch.randint(4, TEXT["vocab_size"], (2, 8))
    with torch.no_grad():
        got = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                             do_sample=False)
    assert got.shape == (2, 8 + new) and torch.equal(got[:, :8], ids)
    assert int(got.max()) < TEXT["vocab_size"]


def test_plot_draws_each_system(tmp_path, monkeypatch):
    """plot() must draw the device-map rows as a line of their own next to the one-GPU baseline."""
    import matplotlib.axes
    labels = []
    real = matplotlib.axes.Axes.plot

    def spy(self, *a, **kw):
        labels.append(kw.get("label"))
        return real(self, *a, **kw)

    monkeypatch.setattr(matplotlib.axes.Axes, "plot", spy)
    runs = [{"system": s, "concurrency": c, "tokens_per_s": 1.0 + c, "decode_tokens_per_s": 2.0 + c}
            for s in ("transformers", "transformers, device_map over 2 GPUs") for c in (1, 64)]
    rep = {"model": "preset:qwen3.5-27b", "gpu": "cpu", "step_floor_tokens_per_s": {"1": 40.0, "64": 2000.0},
           "runs": runs + [{"n_stages": 1, "devices": [0], "concurrency": c, "tokens_per_s": 3.0 + c,
                            "decode_tokens_per_s": 4.0 + c, "ttft_p50_s": 0.5, "itl_p99_s": 0.04} for c in (1, 64)]}
    gpu_decode.plot(rep, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").exists()
    assert labels.count("transformers, device_map over 2 GPUs") == 2 and labels.count("transformers") == 2
    # the latency panel: memra_pp's time to first token and inter-token p99 (transformers measures neither)
    mem = "memra_pp, 1 stage(s) on 1 GPU(s)"
    assert labels.count(mem) == 2 and {f"{mem}: TTFT p50", f"{mem}: inter-token p99"} <= set(labels), labels
    assert not any(str(lb).startswith("transformers:") for lb in labels)


def test_moe_baseline_builds_the_moe_class_and_generates():
    """A MoE text_config must build transformers' MoE class (not the dense one with a dense MLP) and run_hf must
    generate on it, as gpu_decode.py --model preset:qwen3.5-35b-a3b --hf does."""
    moe_text = tiny_config(num_layers=4, moe=True)["text_config"]
    model = hf_baseline.hf_on_meta(moe_text)
    assert type(model).__name__ == "Qwen3_5MoeForCausalLM"
    assert any("experts" in n for n, _ in model.named_parameters())
    rows = hf_baseline.run_hf([2], prompt_len=8, new=3, devices=["cpu"], text_config=moe_text, system="hf moe")
    assert [r["concurrency"] for r in rows] == [2] and rows[0]["tokens_per_s"] > 0


def test_moe_floor_reads_the_routed_experts():
    """The floor of a MoE step reads the non-expert weights once and, per layer, the experts the step routes to:
    k of E at one sequence, E (1 - (1 - k/E)^c) at c; a dense model reads every weight at any concurrency."""
    from memra_pp.model import presets
    from memra_pp.model.config import parse_config
    mc = parse_config(presets.get("qwen3.5-35b-a3b"))
    t = mc.text
    E, k, H, I, L = t.num_experts, t.num_experts_per_tok, t.hidden_size, t.moe_intermediate_size, \
        t.num_hidden_layers
    expert = 2 * 3 * H * I                          # gate, up, down of one expert, bf16
    w1, w64 = gpu_decode.weight_bytes_per_token(mc, 1), gpu_decode.weight_bytes_per_token(mc, 64)
    non_expert = w1 - L * k * expert
    assert 4e9 < w1 < 7e9 and 0 < non_expert < w1                    # ~3B active parameters
    assert w64 == pytest.approx(non_expert + L * E * expert * (1 - (1 - k / E) ** 64))
    total = sum(2 * torch.Size(s).numel() for s in _all_shapes(mc))
    assert gpu_decode.weight_bytes_per_token(mc, 10 ** 6) == pytest.approx(total, rel=1e-6)
    dense = parse_config(presets.get("qwen3.5-27b"))
    assert gpu_decode.weight_bytes_per_token(dense, 1) == gpu_decode.weight_bytes_per_token(dense, 256)
    assert gpu_decode.step_bytes(mc, 64, 100)["weights"] == w64


def _all_shapes(mc):
    """Every weight a decode step can read (no embedding: one row), from the weights table."""
    from memra_pp.model.weights import expected_shape
    t = mc.text
    names = [f"layers.{i}.{n}" for i in range(t.num_hidden_layers) for n in (
        ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight"]
        if t.is_full(i) else ["linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight",
                              "linear_attn.in_proj_b.weight", "linear_attn.in_proj_a.weight",
                              "linear_attn.out_proj.weight"])
        + ["mlp.gate.weight", "mlp.shared_expert_gate.weight", "mlp.shared_expert.gate_proj.weight",
           "mlp.shared_expert.up_proj.weight", "mlp.shared_expert.down_proj.weight", "mlp.experts.gate_up_proj",
           "mlp.experts.down_proj"]]
    return [expected_shape(n, t) for n in names] + [(t.vocab_size, t.hidden_size)]


def test_engine_step_modes_set_every_switch_and_refuse_typos(monkeypatch):
    """benchmarks/gpu_engine_step.py's modes: each token sets its switch (and only for that mode), -nofuse is the
    eighth session's step (this session's three changes off and its down tile), a typo or a down K step that would
    send the experts to the other kernel raises instead of timing the default step under the typo's label."""
    import gpu_engine_step as ges
    from memra_pp.kernels import fused_decode, fused_moe, gdn_decode, gemv, greedy, moe_block, paged_attention
    from memra_pp.model import decode_graphs
    text = types.SimpleNamespace(moe_intermediate_size=512, shared_expert_intermediate_size=512)   # the 35B-A3B's
    for mod, name in ((gemv, "GEMV_ROWS"), (gemv, "PROGRAMS"), (gemv, "PLAIN_BK"), (gemv, "PREFETCH"),
                      (gemv, "PRELOAD"), (fused_moe, "SMALL_TILES"), (fused_moe, "SHARED_GATE_EARLY"),
                      (fused_moe, "SHARED_BEFORE_WAIT"), (fused_moe, "DOWN_IDS_BEFORE_WAIT"),
                      (fused_moe, "ENABLED"), (paged_attention, "FUSE_QK"),
                      (fused_decode, "PDL"), (gdn_decode, "STATE_BEFORE_WAIT"), (greedy, "FUSED"),
                      (decode_graphs, "ANY_KV"), (decode_graphs, "SKIP_PADDING"), (moe_block, "ENABLED"),
                      (moe_block, "TILES"),
                      (moe_block, "MAXNREG"), (fused_moe, "PREMISE_ROUTE")):
        monkeypatch.setattr(mod, name, getattr(mod, name))     # every switch set_mode moves: restored after
    defaults = ges.switch_defaults()
    ges.set_mode("graph-nofuse", defaults, text)
    assert not (paged_attention.FUSE_QK or gemv.PREFETCH or fused_moe.SHARED_GATE_EARLY)
    assert fused_moe.SMALL_TILES[3:] == (2, 512, 4) and fused_moe.SMALL_TILES[:3] == defaults[3][:3]
    ges.set_mode("graph-opre-spre-nogdnpre-p264-obk4096-dn8x512x8-nopdl", defaults, text)
    assert gemv.PRELOAD and fused_moe.SHARED_BEFORE_WAIT and gemv.PREFETCH and paged_attention.FUSE_QK
    assert not gdn_decode.STATE_BEFORE_WAIT
    assert (gemv.PROGRAMS, gemv.PLAIN_BK, fused_moe.SMALL_TILES[3:]) == (264, 4096, (8, 512, 8))
    assert not fused_decode.PDL
    ges.set_mode("graph", defaults, text)          # back to the defaults, nothing carried over
    assert (gemv.GEMV_ROWS, gemv.PROGRAMS, gemv.PLAIN_BK, fused_moe.SMALL_TILES) == defaults[:4]
    assert not (gemv.PRELOAD or fused_moe.SHARED_BEFORE_WAIT)
    assert gemv.PREFETCH and fused_moe.ENABLED and gdn_decode.STATE_BEFORE_WAIT
    ges.set_mode("graph-cublas-torchmoe", defaults, text)     # tokens in any order, not only at the end
    assert gemv.GEMV_ROWS == 0 and not fused_moe.ENABLED
    assert fused_moe.DOWN_IDS_BEFORE_WAIT
    ges.set_mode("graph-nodnids", defaults, text)
    assert not fused_moe.DOWN_IDS_BEFORE_WAIT
    ges.set_mode("graph-torchsample", defaults, text)
    assert not greedy.FUSED
    ges.set_mode("graph-sample", defaults, text)
    assert greedy.FUSED and decode_graphs.ANY_KV
    ges.set_mode("graph-kvbuckets", defaults, text)
    assert not decode_graphs.ANY_KV
    ges.set_mode("graph-anykv", defaults, text)
    assert decode_graphs.ANY_KV and decode_graphs.SKIP_PADDING
    ges.set_mode("graph-nopadskip", defaults, text)
    assert not decode_graphs.SKIP_PADDING
    ges.set_mode("graph", defaults, text)
    assert decode_graphs.SKIP_PADDING
    ges.set_mode("graph-block-blk2x16x4x2x0", defaults, text)
    assert moe_block.ENABLED and moe_block.TILES == (2, 16, 4, 2, False)
    assert moe_block.MAXNREG is None
    ges.set_mode("graph-block-reg128", defaults, text)
    assert moe_block.ENABLED and moe_block.MAXNREG == 128 and moe_block.TILES == defaults[4]
    ges.set_mode("graph-noblock", defaults, text)
    assert not moe_block.ENABLED and moe_block.TILES == defaults[4] and moe_block.MAXNREG == defaults[6]
    ges.set_mode("graph", defaults, text)
    assert moe_block.ENABLED == defaults[5] and fused_moe.PREMISE_ROUTE is None
    ges.set_mode("graph-noblock-norouter", defaults, text)
    assert fused_moe.PREMISE_ROUTE == "fixed"
    ges.set_mode("graph-noblock-nohop", defaults, text)
    assert fused_moe.PREMISE_ROUTE == "skip"
    ges.set_mode("graph-noblock", defaults, text)
    assert fused_moe.PREMISE_ROUTE is None
    for bad in ("graph-block-norouter", "graph-noblock-torchmoe-nohop", "graph-noblock-norouter-nohop"):
        with pytest.raises(SystemExit, match="three-kernel MoE path|contradict"):
            ges.set_mode(bad, defaults, text)
    for bad in ("graph-block-steal", "graph-nosgates", "graph-p264x", "graphs", "graph-dn4x256x4", "graph-p0",
                "graph-obk3000", "graph-p264-p396", "graph-gu4x1000x2", "graph-anykv-kvbuckets", "graph-block-noblock",
                "graph-block-blk3x8x8x1x1", "graph-block-blk4x8x8x1", "graph-block-blk4x8x8x1x2",
                "graph-block-blk4x8x8x0x1", "graph-block-blk4x4x8x2x0", "graph-blk4x4x4x2x0",
                "graph-reg128", "graph-block-reg16", "graph-block-reg256", "graph-block-reg128-reg96"):
        with pytest.raises(SystemExit, match="unknown token|eager or graph|loop kernel|given twice|contradict|"
                                             "without the block|resident"):
            ges.set_mode(bad, defaults, text)


def test_critical_path_charges_each_kernel_what_it_adds_to_the_step(tmp_path):
    """step_profile.critical_path: a kernel overlapping others under PDL must be charged only its part past the latest
    end before it, an idle gap must go to the kernel after it apart, exposed plus idle must be the step's span, and
    host events must not count as kernels. plot_critical must draw a panel per profiled row, and nothing without
    one."""
    import step_profile as ges
    from torch.autograd import DeviceType

    def ev(name, start, end, dev=DeviceType.CUDA):
        return types.SimpleNamespace(name=name, device_type=dev, time_range=types.SimpleNamespace(start=start, end=end))

    prof = types.SimpleNamespace(events=lambda: [
        ev("b", 8.0, 20.0), ev("a", 0.0, 10.0), ev("host", 0.0, 100.0, DeviceType.CPU),
        ev("c", 12.0, 15.0),            # wholly inside b: nothing exposed
        ev("a", 25.0, 30.0)])           # after an idle gap of 5
    by = ges.critical_path(prof)
    assert by == {"a": [2, 15.0, 15.0, 5.0], "b": [1, 12.0, 10.0, 0.0], "c": [1, 3.0, 0.0, 0.0]}
    assert sum(v[2] + v[3] for v in by.values()) == 30.0
    assert "4 kernels over 0.030 ms: exposed 0.025 ms, idle 0.005 ms" in ges.critical_text(by)
    assert ges.critical_path(types.SimpleNamespace(events=lambda: [])) == {}
    rows = [{"mode": "graph", "batch": 1, "step_ms": 0.03, "floor_ms": 0.02, "critical": by},
            {"mode": "eager", "batch": 1, "step_ms": 0.05, "floor_ms": 0.02}]
    png = tmp_path / "critical_path.png"
    assert ges.plot_critical(rows, str(png)) and png.stat().st_size > 1000
    assert not ges.plot_critical(rows[1:], str(tmp_path / "none.png"))


def test_smem_preload_window_reference_follows_the_kernels_phases():
    """smem_preload_bench.expected_tick, the reference the kernel's barriers are checked against: phase w reads
    buffer w % 2 (each CTA its right neighbour's value) and writes the other, so an odd window ends in buffer 1 and
    leaves buffer 0 as the phase before it wrote it."""
    import smem_preload_bench as spb
    t0 = torch.arange(8, dtype=torch.float32)
    assert torch.equal(spb.expected_tick(t0, 0), t0)
    one = spb.expected_tick(t0, 1)
    assert one[:4].tolist() == [0, 1, 2, 3] and one[4:].tolist() == [1.5, 2.0, 2.5, 1.0]
    three = spb.expected_tick(t0, 3)
    b1 = torch.tensor([1.5, 2.0, 2.5, 1.0])
    b0 = b1.roll(-1) * 0.5 + 1.0
    assert torch.equal(three[:4], b0) and torch.equal(three[4:], b0.roll(-1) * 0.5 + 1.0)


def test_smem_preload_spans_split_on_the_flush():
    """smem_preload_bench.split_spans: a run of the named kernels is cut by any other kernel (each replay's flush),
    and its span runs from its first start to its latest end, even where an earlier kernel ends last (PDL)."""
    import smem_preload_bench as spb
    ks = [(0, 50, "reduce_kernel"), (55, 56, "_tick"), (57, 58, "_tick"), (57.5, 62, "_gemv_kernel"),
          (70, 120, "reduce_kernel"), (125, 131, "_gemv_kernel"), (126, 133, "_tick"),
          (140, 190, "reduce_kernel")]
    assert spb.split_spans(ks, ("_tick", "_gemv_kernel")) == [7, 8]
    assert spb.split_spans(ks, ("_gemv_kernel",)) == [4.5, 6]
    assert spb.split_spans(ks[:1], ("_tick",)) == []


def test_smem_preload_lead_is_measured_from_the_last_kernel_before():
    """smem_preload_bench.lead_us: each GEMV's start minus the end of the last tiny kernel before it, negative where
    the GEMV started first (PDL); a GEMV with no tiny kernel before it since the last one counts nothing."""
    import smem_preload_bench as spb
    ks = [(0, 50, "reduce_kernel"), (55, 56, "_tick"), (57, 60, "_tick"), (58, 66, "_gemv_kernel"),
          (70, 120, "reduce_kernel"), (125, 126, "_tick"), (127.5, 133, "_gemv_kernel"), (140, 150, "_gemv_kernel")]
    assert spb.lead_us(ks, "_tick", "_gemv_kernel") == [-2, 1.5]
    assert spb.lead_us(ks[:3], "_tick", "_gemv_kernel") == []


def test_smem_preload_stamps_are_read_from_the_first_entry():
    """smem_preload_bench.stamp_table: each stamp's median and latest CTA in us from the earliest entry; a stamp
    some CTA did not write (zero: a mode without that point) is left out."""
    import smem_preload_bench as spb
    st = torch.zeros(3, len(spb.STAMPS), dtype=torch.int64)
    st[:, 0] = torch.tensor([1000, 2000, 1500])
    st[:, 3] = torch.tensor([31000, 30000, 32000])
    st[:2, 1] = 5000
    tab = spb.stamp_table(st)
    assert tab == {"entry": (0.5, 1.0), "window's end": (30.0, 31.0)}


def test_premise_route_fixes_the_routing_and_skips_the_router():
    """fused_moe.premise_route (benchmarks' norouter / nohop only): "fixed" is the add and norm with experts 0..k-1
    at equal weights, "skip" hands m on as the normed row and h unchanged; the fixed routing is made once, outside
    a capture, and the same tensors come back after."""
    from memra_pp.kernels import fused_moe
    from memra_pp.kernels.fused_decode import add_rms_norm_ref
    h, m, wn = torch.randn(2, 16), torch.randn(2, 16), torch.randn(16)
    try:
        fused_moe.PREMISE_ROUTE = "fixed"
        s, x, w, idx = fused_moe.premise_route(h, m, wn, 1e-6, 4)
        rs, rx = add_rms_norm_ref(h, m, wn, 1e-6)
        torch.testing.assert_close(s, rs)
        torch.testing.assert_close(x, rx)
        assert torch.equal(idx, torch.arange(4).repeat(2, 1)) and torch.equal(w, torch.full((2, 4), 0.25))
        fused_moe.PREMISE_ROUTE = "skip"
        s2, x2, w2, idx2 = fused_moe.premise_route(h, m, wn, 1e-6, 4)
        assert s2 is h and x2 is m and w2 is w and idx2 is idx
    finally:
        fused_moe.PREMISE_ROUTE = None
        fused_moe._PREMISE.clear()


def test_prefill_flops_counts_matmuls_and_causal_attention():
    """gpu_engine_step's prefill TFLOP/s figure must count 2 x active parameters a token (no embedding; lm_head on
    each prompt's last row) plus the full layers' causal QK^T and PV, linear in the number of prompts."""
    from gpu_engine_step import prefill_flops
    from memra_pp.model import presets
    from memra_pp.model.config import parse_config
    mc = parse_config(presets.get("qwen3.5-27b"))
    t = mc.text
    head = t.vocab_size * t.hidden_size
    body = gpu_decode.weight_bytes_per_token(mc, 1) - 2 * head          # bf16 bytes = 2 x parameters
    n_full = sum(t.is_full(i) for i in range(t.num_hidden_layers))
    assert n_full == t.num_hidden_layers // 4
    n = 4096
    attn = n_full * 4 * t.num_attention_heads * t.head_dim * n * (n + 1) / 2
    assert prefill_flops(mc, 1, n) == pytest.approx(body * n + 2 * head + attn)
    assert prefill_flops(mc, 3, n) == pytest.approx(3 * prefill_flops(mc, 1, n))
    assert 45e9 < prefill_flops(mc, 1, n) / n < 60e9                   # ~27B parameters, 2 FLOPs each


def test_hf_concurrency_without_transformers_is_refused():
    """--hf-concurrency names transformers' concurrencies: without --hf or --hf-device-map it would be ignored
    silently, so it must be refused before anything runs (no GPU needed to reach the refusal)."""
    import subprocess
    r = subprocess.run([sys.executable, str(Path(__file__).parents[1] / "benchmarks" / "gpu_decode.py"), "--out",
                        "/tmp/unused", "--hf-concurrency", "1,8"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "give --hf or --hf-device-map too" in r.stderr, r.stderr[-2000:]


def test_prefill_ways_plot(tmp_path):
    """benchmarks/plot_prefill.py: each way's tokens/s at its fastest step, a bar group a shape, a panel a run."""
    import plot_prefill
    rows = [{"mode": "graph", "batch": 1, "step_ms": 13.0}]      # a decode row: not a prefill
    rows += [{"mode": "graph", "prefill": [B, n], "prefill_ops": way, "step_ms": [ms * 2, ms]}
             for B, n in ((1, 4096), (8, 512)) for way, ms in (("kernels", 340.0), ("s23", 370.0), ("torch", 475.0))]
    rows += [{"mode": "graph", "prefill": [8, 512], "decode_rows": 248, "prefill_ops": way, "step_ms": [ms]}
             for way, ms in (("kernels", 400.0), ("s23", 500.0))]      # a mixed step: its own group
    rows += [{"mode": "graph", "prefill": [2, 512], "spread": 0.5, "prompt_lens": [256, 768], "decode_rows": 8,
              "prefill_ops": way, "step_ms": [ms]} for way, ms in (("groups", 100.0), ("varlen", 80.0))]  # spread
    rep = {"model": "preset:qwen3.5-27b", "gpu": "cpu", "rows": rows}
    got = plot_prefill.prefill_rows(rep)
    assert list(got) == [(1, 4096, 0, 0.0), (8, 512, 0, 0.0), (8, 512, 248, 0.0), (2, 512, 8, 0.5)]
    assert got[(1, 4096, 0, 0.0)]["kernels"] == pytest.approx(4096 / 0.340)
    assert got[(8, 512, 248, 0.0)] == pytest.approx({"kernels": 4344 / 0.4, "s23": 4344 / 0.5})
    assert got[(2, 512, 8, 0.5)] == pytest.approx({"groups": 1032 / 0.1, "varlen": 1032 / 0.08})
    plot_prefill.plot([rep, rep], str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_decode_modes_plot(tmp_path):
    """benchmarks/plot_decode_modes.py: each mode's tokens/s at each batch, its repeats kept apart (the prefill rows
    left out), drawn; a report with no decode rows is refused."""
    import plot_decode_modes
    rows = [{"mode": m, "batch": b, "tokens_per_s": t} for m, b, t in
            (("graph", 3, 620.0), ("graph", 5, 790.0), ("graph-nopadskip", 3, 540.0), ("graph", 3, 610.0))]
    rows.append({"mode": "graph", "prefill": [1, 4096], "step_ms": [90.0]})
    rep = {"model": "preset:qwen3.5-35b-a3b", "gpu": "cpu", "rows": rows}
    assert plot_decode_modes.decode_rows(rep) == {"graph": {3: [620.0, 610.0], 5: [790.0]},
                                                  "graph-nopadskip": {3: [540.0]}}
    plot_decode_modes.plot(rep, str(tmp_path / "d.png"))
    assert (tmp_path / "d.png").stat().st_size > 10_000
    with pytest.raises(SystemExit, match="no decode rows"):
        plot_decode_modes.plot({"rows": rows[-1:]}, str(tmp_path / "e.png"), "r.json")


def test_engine_step_mixed_prefill_runs_again_and_again():
    """gpu_engine_step.py --prefill BxN+D: B fresh prompts and D decode rows at --ctx in one step, run as often as the
    timing needs (the decode rows' sequences put back at ctx each time, the prompts starting over: their logits the
    same each time; the decode rows' recurrent states move on, which changes no work), through the decode rows'
    kernels (counted), with a logits row for every sequence."""
    from gpu_engine_step import prefill_batch, prefill_shape, prefill_step
    from conftest_models import tiny_checkpoint
    from memra_pp.model import linear_attention as la, stage_model
    from memra_pp.model.stage_model import StageModel
    from memra_pp.model.weights import SafetensorsSource
    assert prefill_shape("8x512") == (8, 512, 0, 0.0) and prefill_shape("8x512+248") == (8, 512, 248, 0.0)
    assert prefill_shape("8x512~0.5+56") == (8, 512, 56, 0.5) and prefill_batch(3, 10, 1, 9, 0.5).counts == [5, 10,
                                                                                                           15, 1]
    with pytest.raises(SystemExit, match="a spread is in"):
        prefill_shape("8x512~1.5")
    _, path = tiny_checkpoint("dense", False)
    src = SafetensorsSource(path)
    model = StageModel(src.config, 0, src.config.text.num_hidden_layers, True, True).load(src)
    B, n, D, ctx = 2, 5, 3, 9
    cache = model.new_cache(B + D, ctx + 64)
    b = prefill_batch(B, n, D, ctx)
    ids = torch.randint(4, 100, (B * n + D,))
    before, gdn = stage_model.CALLS["single_rows"], la.CALLS["single_rows"]
    outs = [prefill_step(model, cache, b, ids) for _ in range(3)]
    assert all(o.shape[0] == B + D for o in outs) and torch.equal(outs[0][:B], outs[2][:B])
    assert cache.lens[:B + D] == [n] * B + [ctx + 1] * D       # (the scratch slot after them)
    full = sum(layer.full for layer in model.layers)
    assert stage_model.CALLS["single_rows"] - before == 3 * D * full                  # each attention layer, each run
    assert la.CALLS["single_rows"] - gdn == 3 * D * (len(model.layers) - full)       # each Gated DeltaNet layer


def test_prefill_host_counts_the_launches_of_each_way(tmp_path):
    """benchmarks/prefill_host.py (a prefill step's host work, kernels as no-ops, on the CPU): with four prompts of
    four lengths the groups path makes a conv and rule call per group and layer, the variable-length path one a
    layer; with equal lengths both make one. Its JSON has every step's time."""
    import json
    import subprocess
    out = tmp_path / "ph.json"
    r = subprocess.run([sys.executable, "-u", str(Path(__file__).parents[1] / "benchmarks" / "prefill_host.py"),
                        "--prompts", "4x8~0.5,4x8", "--layers", "4", "--steps", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = {(tuple(x["lens"]), x["way"]): x for x in json.loads(out.read_text())["rows"]}
    gdn = 3                                   # of the 4 layers
    spread, equal = (4, 7, 9, 12), (8, 8, 8, 8)
    assert rows[(spread, "groups")]["rule_calls"] == 4 * gdn and rows[(spread, "varlen")]["rule_calls"] == gdn
    assert rows[(spread, "groups")]["conv_calls"] == 4 * gdn and rows[(spread, "varlen")]["conv_calls"] == gdn
    assert rows[(equal, "groups")]["rule_calls"] == rows[(equal, "varlen")]["rule_calls"] == gdn
    assert rows[(spread, "varlen")]["triton_launches"] < rows[(spread, "groups")]["triton_launches"]
    assert all(len(x["step_ms"]) == 2 for x in rows.values())


def test_switch_arguments_name_known_switches_and_combine(monkeypatch, capsys):
    """gpu_decode's off|on|both switch arguments: each an option of its command line and a known MEMRA_PP_* switch;
    their combinations off before on, the first argument outermost; each combination set in the environment the
    stages read, the sides of "both" arguments said."""
    import argparse
    from memra_pp import switches
    monkeypatch.setattr(sys, "argv", ["gpu_decode.py", "--help"])
    with pytest.raises(SystemExit):
        gpu_decode.main()
    help_text = capsys.readouterr().out
    for name, env, *_ in gpu_decode.SWITCH_ARGS:
        assert f"--{name.replace('_', '-')}" in help_text and env in switches.SWITCHES, name
        monkeypatch.setenv(env, "1")        # (restored after the test)
    # each argument's default is the runtime's: no argument sets a switch the run did not ask for
    class Parsed(Exception):
        pass

    def parse(self, *args):         # main's parser, stopped where it has parsed a plain command line
        raise Parsed(self.parse_known_args(["--out", "x"])[0])
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse)
    with pytest.raises(Parsed) as got:
        gpu_decode.main()
    for name, env, *_ in gpu_decode.SWITCH_ARGS:
        assert getattr(got.value.args[0], name) == ("on" if switches.SWITCHES[env][0] else "off"), name
    a = argparse.Namespace(**{n: "on" for n, *_ in gpu_decode.SWITCH_ARGS})
    a.prefill_graphs, a.rule_graphs, a.any_kv = "both", "both", "off"
    combos = gpu_decode.switch_sides(a)
    assert [(c["prefill_graphs"], c["rule_graphs"]) for c in combos] == [(False, False), (False, True),
                                                                         (True, False), (True, True)]
    assert all(not c["any_kv"] and c["kv_in_place"] for c in combos)
    gpu_decode.set_switches(a, combos[1])
    assert os.environ["MEMRA_PP_PREFILL_GRAPHS"] == "0" and os.environ["MEMRA_PP_RULE_GRAPHS"] == "1"
    assert os.environ["MEMRA_PP_ANY_KV_GRAPHS"] == "0" and os.environ["MEMRA_PP_KV_IN_PLACE"] == "1"
    said = capsys.readouterr().out.splitlines()
    assert said == ["  prompt steps through prefill graphs: False", "  fla's rule through the rule graphs: True"]


def test_engine_step_chunk_h_way_lends_the_grid_pick_then_restores_the_pin(monkeypatch):
    """gpu_engine_step.py --chunk-h-grid: chunk_h_pick makes fla_rule's GridPick over the pinned autotuner and puts
    the pin back; the "-chunkh" way lends the pick to every Gated DeltaNet rule for the step (inside the way before
    it) and takes it back after, the autotuner pinned again: the other ways keep the pin."""
    import triton
    from triton.runtime.autotuner import Autotuner

    import gpu_engine_step as ges
    from memra_pp.model import fla_rule

    class Tuner(Autotuner):
        def __init__(self, configs):
            self.configs, self.cache = configs, {}
    every = [triton.Config({"BV": bv}, num_warps=w, num_stages=s) for w in (2, 4) for s in (2, 3, 4)
             for bv in (32, 64)]
    tuner = Tuner(list(every))
    assert fla_rule._pin(tuner, fla_rule.CHUNK_H_CONFIG)
    pinned = list(tuner.configs)
    monkeypatch.setattr(fla_rule, "_kernel", lambda mod, name: tuner)
    got = ges.chunk_h_pick()
    assert got is not None and got[1] == pinned and tuner.configs == pinned
    pick = got[0]
    assert pick.tuner is tuner and pick.many.num_stages == 2
    monkeypatch.setattr(ges, "CHUNKH", got)
    rule = types.SimpleNamespace(_chunk_h="its own")
    model = types.SimpleNamespace(layers=[types.SimpleNamespace(mixer=types.SimpleNamespace(rule=rule)),
                                          types.SimpleNamespace(mixer=types.SimpleNamespace())])
    from memra_pp.kernels import prefill as pf
    varlen = pf.VARLEN
    with ges.torch_prefill("kernels-chunkh", model):
        assert rule._chunk_h is pick and pf.VARLEN == varlen
        tuner.configs = [pick.many]         # (as a call would set it)
    assert rule._chunk_h == "its own" and tuner.configs == pinned      # (MEMRA_PP_CHUNK_H_GRID=1's, put back)
    monkeypatch.setattr(fla_rule, "_kernel", lambda mod, name: None)
    assert ges.chunk_h_pick() is None
