"""Placement schema and planner: exact splits, every refusal with its message, round-trips, warnings, a property."""
import dataclasses
import itertools
import json
import os
import sys
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings, strategies as st

from memra_pp.errors import ConfigError
from memra_pp.model.config import parse_config
from memra_pp.placement import (Plan, default_head_cost, default_layer_costs, format_plan, load_placement,
                                make_plan, split_layers)

CONFIGS = Path(__file__).parent.parent / "cluster_configs"
TINY = dict(model_type="qwen3_5_text", vocab_size=512, hidden_size=64, num_hidden_layers=6, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention", "full_attention"],
            rope_parameters={"mrope_section": [2, 1, 1]})
MOE = dict(TINY, model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)
B27 = dict(model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, num_hidden_layers=64,
           intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
           linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
           linear_conv_kernel_dim=4)


def model(base=TINY, **over):
    return parse_config(dict(base, **over))


def cfg(*stages, **over):
    return {"name": "t", "model": {"path": "/m", "format": "dummy"},
            "stages": [s if isinstance(s, dict) else {"device": "cpu", "layers": s} for s in stages], **over}


def plan(raw, costs=None, head=None, m=None):
    return make_plan(load_placement(raw), m or model(), costs, head)


def ranges(p):
    return [(s.layer_start, s.layer_end) for s in p.stages]


def refused(fn, *needles):
    with pytest.raises(ConfigError) as e:
        fn()
    for n in needles:
        assert n in str(e.value), f"{n!r} not in {str(e.value)!r}"
    return str(e.value)


# --- the splitter ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("costs,n,first,last,want", [
    ([1, 1, 1, 1], 2, 0, 0, (0, 2, 4)),
    ([4, 1, 1, 1, 1], 2, 0, 0, (0, 1, 5)),      # one heavy layer is a stage by itself
    ([1, 1, 1], 2, 0, 0, (0, 2, 3)),            # tie 2|1 vs 1|2: the earlier stage takes more
    ([1] * 5, 3, 0, 0, (0, 2, 4, 5)),
    ([1] * 4, 2, 0, 2, (0, 3, 4)),              # head cost pushes a layer off the last stage
    ([1] * 4, 2, 2, 0, (0, 1, 4)),              # embedding cost on stage 0 does the same there
    ([3, 1, 2], 3, 0, 0, (0, 1, 2, 3)),         # as many stages as layers: one each
    ([5, 7], 1, 0, 0, (0, 2)),
])
def test_split_layers_exact(costs, n, first, last, want):
    """split_layers must return the hand-computed min-max boundaries, ties to the largest boundaries."""
    assert split_layers(costs, n, first, last) == want


def test_measured_costs_and_head_cost():
    """Measured layer costs must drive the split, and a head cost must move layers off the primary stage."""
    assert ranges(plan(cfg("auto", "auto"), [1, 2, 3, 4, 5, 6])) == [(0, 4), (4, 6)]
    p = plan(cfg("auto", "auto"), [1, 2, 3, 4, 5, 6], head=5)
    assert ranges(p) == [(0, 5), (5, 6)] and [s.cost for s in p.stages] == [15, 11]


def test_default_costs_hand_computed():
    """The byte model must equal the per-tensor sums for the tiny dense model (float32)."""
    c = default_layer_costs(model(), 4)
    state = 2 * 4 * 4 * 16 * 16                   # DeltaNet fp32 state read + written
    linear = 64 * (128 + 64 + 8) + 64 * 64 + 128 * 4 + 16 + 8    # in_proj qkv/z/b/a, out_proj, conv, norm, A, dt
    full = 64 * 32 * (8 + 4 + 4) + 2 * 32                        # q(+gate), k, v, o, q_norm, k_norm
    ffn, norms = 3 * 64 * 128, 2 * 64
    assert c == tuple(float(4 * (m + ffn + norms) + state) for m in [linear] * 3 + [full, linear, full])
    assert default_head_cost(model(), 4) == (512 + 1) * 64 * 4 + 8 * 512    # lm_head, norm; fp32 logits w + r


def test_moe_costs_count_only_what_a_token_reads():
    """A MoE layer must cost router + top-k experts + shared expert: E moves only the router, k adds experts."""
    base, more_e, more_k = (default_layer_costs(model(MOE, **o), 2) for o in
                            ({}, {"num_experts": 64}, {"num_experts_per_tok": 3}))
    assert all(b - a == (64 - 8) * 64 * 2 for a, b in zip(base, more_e))
    assert all(b - a == 3 * 64 * 32 * 2 for a, b in zip(base, more_k))
    dense = default_layer_costs(model(), 2)
    assert all(m < d for m, d in zip(base, dense))     # 2 of 8 small experts read less than one dense FFN
    assert base[0] - base[3] == dense[0] - dense[3]    # linear vs full attention differ by the mixer alone


def test_costs_of_a_decode_step_of_many_sequences():
    """A step of b sequences moves each one's state in every layer and its logits at the head, reads the weights
    once, and reaches E (1 - (1 - k/E)^b) distinct experts of a MoE layer: k at one token, nearly all E at many."""
    from memra_pp.placement import experts_read
    t = model().text
    one, many = default_layer_costs(model(), 2, 1), default_layer_costs(model(), 2, 9)
    assert all(m - o == 8 * 2 * 4 * 4 * 16 * 16 for o, m in zip(one, many))
    assert default_head_cost(model(), 2, 9) - default_head_cost(model(), 2) == 8 * 2 * t.vocab_size * 4
    moe = model(MOE).text
    assert experts_read(moe, 1) == 2 and experts_read(moe, 2) == 8 * (1 - (6 / 8) ** 2)
    assert 7.99 < experts_read(moe, 64) <= 8
    a, b = default_layer_costs(model(MOE), 2, 1), default_layer_costs(model(MOE), 2, 2)
    extra = (experts_read(moe, 2) - 2) * 3 * 64 * 32 * 2 + 4 * 4 * 16 * 16 * 2
    assert all(abs(y - x - extra) < 1e-6 for x, y in zip(a, b))


@pytest.mark.parametrize("base,max_batch,split", [
    (B27, 1, 34), (B27, 64, 33),                 # a full microbatch of 32 moves states the head's layers do not
    ("moe", 1, 24), ("moe", 64, 20)])            # one token reads 8 of 256 experts; 32 tokens about 163
def test_the_cost_optimum_follows_the_microbatch_the_deployment_runs(base, max_batch, split):
    """Two GPU stages (2 microbatches): the cost model is a decode step of max_batch / 2 sequences. At one sequence
    the lm_head's weights outweigh layers (more layers on stage 0); at 32 the layers' states and experts weigh
    more, and the 35B-A3B's 40 layers split evenly where one token's read would put 24 on stage 0. (The plan then
    takes, within 1% of that optimum, the split whose fullest stage holds least: 33 for the 27B either way.)"""
    from memra_pp.model import presets
    m = model(B27) if base is B27 else parse_config(presets.get("qwen3.5-35b-a3b"))
    p = load_placement(cfg(*GPU2, model={"path": "/m", "dtype": "bfloat16"}, scheduler={"max_batch": max_batch}))
    b = max_batch // 2 or 1
    costs = default_layer_costs(m, 2, b)
    embed, head = m.text.hidden_size * 2 * b, default_head_cost(m, 2, b)
    L = m.text.num_hidden_layers
    assert split_layers(costs, 2, embed, head) == (0, split, L)
    pl = make_plan(p, m)
    assert pl.microbatches == 2 and pl.split_batch == b
    assert ranges(pl)[0][1] == (33 if base is B27 else split)


def test_memory_estimate_is_what_a_stage_holds():
    """StagePlan.memory's parts against a real StageModel and StageCache (tiny checkpoints, float32): the weights of
    each slice (a tied lm_head a copy on the primary of two stages, the same tensor on one), the recurrent and conv
    states of max_batch sequences plus the scratch slot, and the KV pages of max_batch sequences at max_context
    plus the two reserved, to the byte."""
    from memra_pp.model.stage_model import StageModel
    from memra_pp.model.weights import SafetensorsSource
    from memra_pp.placement import default_layer_memory, layer_weight_bytes, seq_cache_bytes
    from conftest_models import tiny_checkpoint
    seen_kv = 0
    for kind, tied in (("dense", False), ("moe", True)):
        src = SafetensorsSource(tiny_checkpoint(kind, tied)[1])
        t = src.config.text
        for n, slices in ((1, [(0, 8)]), (2, [(0, 3), (3, 8)])):
            for k, (a, b) in enumerate(slices):
                intake, primary = k == 0, k == n - 1
                sm = StageModel(src.config, a, b, intake=intake, primary=primary).load(src)
                held = sum(x.numel() * x.element_size() for x in sm.tensors())
                want = sum(layer_weight_bytes(t, i, 4) for i in range(a, b)) + (t.hidden_size * 4 if primary else 0)
                want += t.vocab_size * t.hidden_size * 4 * ((intake or primary) + (intake and primary and not tied))
                assert held == want, (kind, n, a, b, held, want)
                cache = sm.new_cache(5, 256)    # 256 positions: 4 pages, all allocated at once (4 a slot at first)
                states = sum(x.numel() * x.element_size() for d in (cache.conv, cache.rec) for x in d.values())
                assert states == 6 * sum(seq_cache_bytes(t, i, 256, 4) for i in range(a, b) if not t.is_full(i))
                kv = sum(x.numel() * x.element_size() for d in (cache.k, cache.v) for x in d.values())
                assert kv == sum(5 * seq_cache_bytes(t, i, 256, 4) + seq_cache_bytes(t, i, 128, 4)   # + 2 reserved
                                 for i in range(a, b) if t.is_full(i))
                seen_kv += kv
                lm = default_layer_memory(src.config, 4, 5, 256)
                assert sum(lm[a:b]) == sum(layer_weight_bytes(t, i, 4) for i in range(a, b)) + states + kv
    assert seen_kv > 0


def test_the_split_holds_memory_balanced_among_the_cheapest():
    """27B on four GPUs at max_batch 32 (8 sequences a microbatch): the cheapest split is 17/17/17/13; 16/17/17/14
    costs under 1% more and holds the memory better: the fullest stage bounds every stage's KV pages. Within
    SPLIT_SLACK of the best cost the plan takes the split whose fullest stage holds least (#9: max/min memory at most
    1.15 with the automatic split; 1.24 on the cheapest)."""
    p = plan(cfg(*[{"device": f"cuda:{i}"} for i in range(4)], model={"path": "/m", "dtype": "bfloat16"},
                 scheduler={"max_batch": 32, "max_context": 1024}), m=model(B27))
    assert ranges(p) == [(0, 16), (16, 33), (33, 50), (50, 64)]
    mem = [s.memory for s in p.stages]
    assert max(mem) / min(mem) < 1.15, mem
    costs, head = default_layer_costs(model(B27), 2, 8), default_head_cost(model(B27), 2, 8)
    assert split_layers(costs, 4, 5120 * 2 * 8, head) == (0, 17, 34, 51, 64)
    assert max(s.cost for s in p.stages) <= 1.01 * max(sum(costs[a:b]) + (head if b == 64 else 0)
                                                       for a, b in ((0, 17), (17, 34), (34, 51), (51, 64)))


def test_memory_decides_only_where_each_stage_has_a_gpu_of_its_own():
    """27B at one sequence: on two GPUs 33 / 31 holds less on the fuller card within 1% of the cheapest (34 / 30);
    two stages on one card draw on one pool, as CPU stages draw on the host's, so there the cheapest stands."""
    def split(*devices):
        raw = cfg(*[{"device": d} for d in devices], model={"path": "/m", "dtype": "bfloat16"},
                  scheduler={"max_batch": 1})
        return ranges(plan(raw, m=model(B27)))[0][1]
    assert (split("cuda:0", "cuda:1"), split("cuda:0", "cuda:0"), split("cpu", "cpu")) == (33, 34, 34)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 20)), min_size=1, max_size=7), st.data())
def test_split_by_memory_within_the_slack_is_optimal_property(layers, data):
    """With memory: the split's largest cost is within the slack of the best, its largest memory is the least among
    all such splits (brute force), its largest cost the least among those, with the largest boundaries among
    those."""
    costs, memory = [c for c, _ in layers], [m for _, m in layers]
    n = data.draw(st.integers(1, len(costs)))
    first, last, mf, ml = (data.draw(st.integers(0, 20)) for _ in range(4))
    slack = data.draw(st.sampled_from([0.0, 0.01, 0.25]))
    got = split_layers(costs, n, first, last, memory, mf, ml, slack)

    def worst(b, xs, f, la):
        return max(sum(xs[b[s]:b[s + 1]]) + (f if s == 0 else 0) + (la if s == n - 1 else 0) for s in range(n))
    every = [(0, *mid, len(costs)) for mid in itertools.combinations(range(1, len(costs)), n - 1)]
    top = min(worst(b, costs, first, last) for b in every)
    ok = [b for b in every if worst(b, costs, first, last) <= top * (1 + slack) + 1e-9 * top]
    least = min(worst(b, memory, mf, ml) for b in ok)
    lean = [b for b in ok if worst(b, memory, mf, ml) == least]
    cheapest = min(worst(b, costs, first, last) for b in lean)
    assert got in lean and worst(got, costs, first, last) == cheapest
    assert got == max(b for b in lean if worst(b, costs, first, last) == cheapest)


def test_27b_default_plan_is_balanced():
    """The 27B byte model must split 64 layers so the lm_head's stage holds fewer layers, and the embedding's
    stage too where that holds memory better at no cost beyond the slack."""
    p = plan(cfg(*[{"device": f"cuda:{i}"} for i in range(4)], model={"path": "/m", "dtype": "bfloat16"}),
             m=model(B27))
    assert ranges(p) == [(0, 16), (16, 33), (33, 50), (50, 64)]


# --- explicit and mixed layers -----------------------------------------------------------------------------------

def test_explicit_and_mixed_layers():
    """Explicit ranges must be kept; auto stages must split exactly the gaps between them."""
    assert ranges(plan(cfg([0, 1], [1, 6]))) == [(0, 1), (1, 6)]
    costs = [1] * 6
    assert ranges(plan(cfg("auto", [2, 4], "auto"), costs)) == [(0, 2), (2, 4), (4, 6)]
    assert ranges(plan(cfg([0, 3], "auto", "auto"), costs)) == [(0, 3), (3, 5), (5, 6)]
    assert ranges(plan(cfg("auto", "auto", [5, 6]), costs)) == [(0, 3), (3, 5), (5, 6)]


@pytest.mark.parametrize("stages,needles", [
    ([[0, 2], [3, 6]], ["stages[1].layers starts at 3: layers [2, 3) belong to no stage"]),
    ([[0, 4], [3, 6]], ["stages[1].layers: [3, 6) overlaps stages[0].layers (ends at 4)"]),
    ([[3, 6], [0, 3]], ["stages[0].layers starts at 3: layers [0, 3) belong to no stage"]),   # out of order
    ([[0, 3], [3, 7]], ["stages[1].layers: [3, 7) is out of range: the model has 6 layers"]),
    ([[1, 3], [3, 6]], ["stages[0].layers starts at 1: layers [0, 1) belong to no stage; the first stage must"]),
    ([[0, 3], [3, 5]], ["stages[1].layers ends at 5: layers [5, 6) belong to no stage; the last stage must end "
                        "at num_hidden_layers = 6"]),
    (["auto", "auto", [1, 6]], ["stages[0..1].layers: 2 auto stage(s) but only 1 layer(s) left in [0, 1)"]),
    (["auto"] * 7, ["stages: 7 stages for a model of 6 layers", "use at most 6 stages"]),
])
def test_layer_refusals(stages, needles):
    """Every bad layer layout must be refused naming stages[i].layers and the uncovered or clashing layers."""
    refused(lambda: plan(cfg(*stages)), *needles)


# --- schema refusals ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("over,needles", [
    ({"stagse": 1}, ["stagse: unknown key 'stagse'; did you mean 'stages'?"]),
    ({"scheduler": {"max_bacth": 4}}, ["scheduler.max_bacth: unknown key", "max_batch"]),
    ({"stages": [{"device": "cpu"}, {"devcie": "cpu"}]}, ["stages[1].devcie: unknown key"]),
    ({"stages": [{"device": "cpu"}, {"device": "gpu0"}]}, ["stages[1].device: 'gpu0' is not a device; use cpu"]),
    ({"stages": [{"device": "cuda:-1"}]}, ["stages[0].device: 'cuda:-1' is not a device"]),
    ({"stages": [{"device": "cuda"}]}, ["stages[0].device: 'cuda' is not a device", "cuda:0"]),
    ({"stages": [{"layers": "auto"}]}, ["stages[0].device: is required"]),
    ({"stages": [{"device": "cpu", "layers": [3, 3]}]}, ["stages[0].layers: [3, 3] must be auto or [start, end)"]),
    ({"stages": [{"device": "cpu", "layers": [-1, 2]}]}, ["stages[0].layers: [-1, 2]"]),
    ({"stages": [{"device": "cpu", "layers": "half"}]}, ["stages[0].layers: 'half' must be auto"]),
    ({"stages": []}, ["stages: must be a list of at least one stage"]),
    ({"stages": None}, ["stages: must be a list"]),
    ({"overlay_publish": "forse"}, ["overlay_publish: 'forse' is not one of auto | force | never"]),
    ({"transport": "p2p"}, ["transport: 'p2p' is not one of auto | peer | host"]),
    ({"recover": "retry"}, ["recover: 'retry' is not one of error | replay"]),
    ({"model": {"format": "onnx"}}, ["model.format: 'onnx' is not one of auto | safetensors | gguf | dummy"]),
    ({"model": {"dtype": "fp16"}}, ["model.dtype: 'fp16' is not one of float32 | bfloat16 | float16"]),
    ({"model": {"path": ""}}, ["model.path: must be a non-empty string"]),
    ({"vision": {"engine": "tower"}}, ["vision.engine: 'tower' is not one of primary | intake | stage:N"]),
    ({"vision": {"engine": "stage:x"}}, ["vision.engine: 'stage:x' is not one of"]),
    ({"vision": {"engine": "stage:9"}}, ["vision.engine: 'stage:9' names no stage; this placement has stages 0..0"]),
    ({"scheduler": {"prefill_chunk": 0}}, ["scheduler.prefill_chunk: must be an integer >= 1, got 0"]),
    ({"scheduler": {"max_batch": -1}}, ["scheduler.max_batch: must be an integer >= 1, got -1"]),
    ({"scheduler": {"max_context": 1.5}}, ["scheduler.max_context: must be an integer >= 1, got 1.5"]),
    ({"scheduler": {"max_batch": True}}, ["scheduler.max_batch: must be an integer >= 1, got True"]),
    ({"scheduler": {"microbatches": 0}}, ["scheduler.microbatches: must be auto or an integer >= 1, got 0"]),
    ({"scheduler": 5}, ["scheduler: must be a mapping, got 5"]),
    ({"scheduler": {"kv_pages": 0}}, ["scheduler.kv_pages: must be an integer >= 1, got 0"]),
    ({"scheduler": {"pipeline_chunks": 0}}, ["scheduler.pipeline_chunks: must be auto or an integer >= 1 (1: "
                                             "prompts keep whole chunks), got 0"]),
    ({"scheduler": {"pipeline_chunks": "many"}}, ["scheduler.pipeline_chunks: must be auto or an integer >= 1"]),
    ({"transport_poll_us": "fast"}, ["transport_poll_us: must be auto or microseconds in [0, 1000000]"]),
    ({"transport_poll_us": -1}, ["transport_poll_us: must be auto or microseconds in [0, 1000000]"]),
    ({"adapters": {"max_loras": 0}}, ["adapters.max_loras: must be an integer >= 1"]),
    ({"timeouts": {"step_s": 0}}, ["timeouts.step_s: must be a positive finite number, got 0"]),
    # a heartbeat too short for any health answer: the supervisor killed healthy stages in a loop
    ({"timeouts": {"heartbeat_s": 0.001}}, ["timeouts.heartbeat_s: must be at least 0.05 s", "got 0.001"]),
    # a step bound shorter than any call to a stage: every request and stats call of the launched deployment timed out
    ({"timeouts": {"step_s": 0.001}}, ["timeouts.step_s: must be at least 0.05 s", "got 0.001"]),
    ({"timeouts": {"ready_s": float("nan")}}, ["timeouts.ready_s: must be a positive finite number"]),
    ({"stages": [{"device": "cpu", "num_cpus": 0}]}, ["stages[0].num_cpus: must be a positive finite number"]),
    ({"stages": [{"device": "cpu", "threads": 0}]}, ["stages[0].threads: must be an integer >= 1, got 0"]),
    ({"ray": {"listen": "localhost"}}, ["ray.listen: 'localhost' is not an IP address; use 127.0.0.1"]),
    ({"ray": {"listen": "0.0.0.0"}}, ["ray.listen: '0.0.0.0' is no address Ray can advertise"]),
    ({"ray": {"namespace": ""}}, ["ray.namespace: must be a non-empty string"]),
    ({"name": "my name"}, ["name: 'my name' must be letters, digits"]),
])
def test_schema_refusals(over, needles):
    """Every bad key or value must be refused once, with its key path, the typo echoed and what is accepted."""
    raw = dict(cfg({"device": "cpu"}), **over)
    msg = refused(lambda: load_placement(raw), *needles)
    assert msg.startswith("placement: ")


def test_missing_stages_and_non_mapping():
    """A placement without stages, or one that is not a mapping, must be refused naming what to write."""
    refused(lambda: load_placement({"name": "x"}), "stages: is required")
    from memra_pp.placement import parse_placement
    refused(lambda: parse_placement([1]), "placement: must be a mapping")


@pytest.mark.parametrize("text,needles", [
    ("stages: [\n", ["not valid YAML"]),
    ("- device: cpu\n", ["the top level must be a mapping", "got list"]),
    ("", ["the top level must be a mapping", "got NoneType"]),
    ("stages: [{device: cpu}]\nstages: [{device: cpu}]\n", ["not valid YAML", "duplicate key 'stages'"]),
    ("stages: [{device: cpu}]\nscheduler: {prefill_chunk: -4}\n", ["scheduler.prefill_chunk: must be"]),
    # YAML 1.1 (PyYAML) reads these as octal and base 60: max_batch 064 was 52, max_context 1:08:16 was 4096
    ("stages: [{device: cpu}]\nscheduler: {max_batch: 064}\n", [":2:24: not valid YAML: 064 is read as 52 (YAML 1.1 "
                                                               "reads a leading 0 as octal): write the number in "
                                                               "decimal without them"]),
    ("stages: [{device: cpu}]\nscheduler: {max_context: 1:08:16}\n", [
        ":2:26: not valid YAML: 1:08:16 is read as 4096 (YAML 1.1 reads colons as base 60)"]),
    ("stages: [{device: cpu}]\ntimeouts: {step_s: 1:30.5}\n", ["1:30.5 is read as 90.5 (YAML 1.1 reads colons"]),
])
def test_yaml_refusals_name_the_file(tmp_path, text, needles):
    """Malformed YAML and bad values in a file must be refused with the file's path first."""
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    assert refused(lambda: load_placement(f), *needles).startswith(str(f))
    refused(lambda: load_placement(tmp_path / "none.yaml"), "none.yaml: cannot read the placement file")


def test_yaml_numbers_written_plainly_still_read(tmp_path):
    """Decimal, hexadecimal, 0 and floats with a leading 0 are read as before."""
    f = tmp_path / "ok.yaml"
    f.write_text("stages: [{device: cpu}]\nscheduler: {max_batch: 0x40, max_context: 4096}\n"
                 "timeouts: {step_s: 0.5, ready_s: 010.5}\n")
    p = load_placement(f)
    assert (p.scheduler.max_batch, p.scheduler.max_context, p.timeouts.step_s, p.timeouts.ready_s) == (64, 4096, 0.5,
                                                                                                       10.5)


def test_a_planner_refusal_of_a_file_names_the_file(tmp_path, capsys):
    """The planner's refusals (layers that overlap, say) named the key but not the file, as the schema's do."""
    from memra_pp import cli
    from memra_pp.model.tiny import make_tiny
    m = tmp_path / "m"
    make_tiny(m)
    f = tmp_path / "overlap.yaml"
    f.write_text(f"model: {{path: {m}}}\nstages: [{{device: cpu, layers: [0, 5]}}, {{device: cpu, layers: [4, 8]}}]\n")
    assert cli.main(["plan", str(f)]) == 2
    err = capsys.readouterr().err
    assert f"ConfigError: {f}: stages[1].layers: [4, 8) overlaps stages[0].layers (ends at 5)" in err


def test_planner_argument_refusals():
    """Bad measured costs, head cost or plan dicts must be refused naming the argument."""
    refused(lambda: plan(cfg("auto"), [1, 2]), "layer_costs: need 6 finite costs >= 0")
    refused(lambda: plan(cfg("auto"), [1, 1, 1, 1, 1, -1]), "layer_costs")
    refused(lambda: plan(cfg("auto"), head=-1.0), "head_cost: must be a finite cost >= 0")
    refused(lambda: Plan.from_dict({"name": "x"}), "plan dict:")


# --- defaults, round-trips, configs ------------------------------------------------------------------------------

def test_partial_sections_take_defaults():
    """A section given in part must take the defaults for the rest; cuda stages reserve a whole CPU."""
    p = load_placement({"stages": [{"device": "cpu"}, {"device": "cuda:1"}], "scheduler": {"max_batch": 4},
                        "model": {"path": "~/m"}})
    assert (p.scheduler.max_batch, p.scheduler.prefill_chunk, p.scheduler.microbatches) == (4, 512, None)
    assert [(s.num_cpus, s.threads, s.layers) for s in p.stages] == [(0.5, 1, None), (1.0, 1, None)]
    assert p.model.path == Path("~/m").expanduser() and "~" not in str(p.model.path)
    assert (p.name, p.transport, p.recover, p.ray.listen, p.timeouts.heartbeat_s) == (
        "memra", "auto", "error", "127.0.0.1", 2.0)


def test_round_trips(tmp_path):
    """to_dict must load back to an equal Placement (dict, YAML file) and Plan.to_dict must survive JSON."""
    raw = cfg({"device": "cpu", "layers": [0, 2], "num_cpus": 0.25, "threads": 2}, "auto", "auto",
              vision={"engine": "stage:1"}, overlay_publish="never", transport="host", recover="replay",
              transport_poll_us=500,
              scheduler={"microbatches": 2, "max_batch": 3, "max_context": 64, "prefill_chunk": 7, "kv_pages": 9,
                         "pipeline_chunks": 3},
              adapters={"max_loras": 1, "max_rank": 8}, ray={"address": "auto", "namespace": "n", "listen": "10.1.2.3"},
              timeouts={"ready_s": 1, "step_s": 2.5, "heartbeat_s": 0.5})
    p = load_placement(raw)
    assert load_placement(p.to_dict()) == p
    (tmp_path / "p.yaml").write_text(yaml.safe_dump(p.to_dict()))
    assert load_placement(tmp_path / "p.yaml") == p
    pl = make_plan(p, model())
    assert Plan.from_dict(json.loads(json.dumps(pl.to_dict()))) == pl


def test_cluster_configs_load_and_plan():
    """Every cluster config must load, round-trip and plan against a model of its size."""
    files = sorted(CONFIGS.glob("*.yaml"))
    names = {f.stem for f in files}
    assert {"tiny-cpu", "tiny-cpu-3", "1xh200", "2xh200", "2xh200-one-card", "host-bounce", "4gpu"} <= names
    for f in files:
        p = load_placement(f)
        assert load_placement(p.to_dict()) == p
        pl = make_plan(p, model(B27) if p.model.format == "dummy" else model())
        assert pl.stages[-1].layer_end == pl.num_layers and len(pl.stages) == len(p.stages)
    assert load_placement(CONFIGS / "host-bounce.yaml").transport == "host"


def test_tiny_cpu_equals_embedded_default():
    """cluster_configs/tiny-cpu.yaml must be the embedded default memra_pp.defaults.TINY_CPU."""
    from memra_pp.defaults import TINY_CPU
    assert load_placement(CONFIGS / "tiny-cpu.yaml") == load_placement(TINY_CPU)


def test_shipped_configs_name_embedded_checkpoints_written_on_demand(tmp_path, monkeypatch):
    """Every shipped YAML with real weights names one of the project's own tiny checkpoints, so it runs on a fresh
    machine: open_weights writes a missing embedded checkpoint (with make_tiny's arguments for that path) and
    refuses any other missing path."""
    from memra_pp import defaults
    from memra_pp.errors import ConfigError
    from memra_pp.model.weights import open_weights
    for f in sorted(CONFIGS.glob("*.yaml")):
        p = load_placement(f)
        if p.model.format != "dummy":
            assert Path(p.model.path).expanduser() in defaults.EMBEDDED, f.name
    plain, vision = tmp_path / "plain", tmp_path / "vision"
    monkeypatch.setattr(defaults, "EMBEDDED", {plain: {}, vision: {"vision": True}})
    assert open_weights(str(vision), "auto").config.vision is not None and (vision / "config.json").exists()
    plain.mkdir()
    (plain / "model.safetensors").write_bytes(b"cut")        # an interrupted write: no config.json
    assert open_weights(str(plain), "auto").config.vision is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plain", "vision"]     # no .part directory left
    with pytest.raises(ConfigError, match=r"model.path '.*elsewhere' does not exist"):
        open_weights(str(tmp_path / "elsewhere"), "auto")
    assert not (tmp_path / "elsewhere").exists()


# --- roles, microbatches, warnings, format -----------------------------------------------------------------------

@pytest.mark.parametrize("engine,tower", [("primary", 2), ("intake", 0), ("stage:1", 1)])
def test_roles(engine, tower):
    """Intake must be stage 0, primary the last stage, and the tower where vision.engine says."""
    p = plan(cfg("auto", "auto", "auto", vision={"engine": engine}))
    assert (p.intake_index, p.primary_index, p.tower_index) == (0, 2, tower)
    assert [s.roles for s in p.stages][tower][-1] == "tower"
    assert [(s.intake, s.primary) for s in p.stages] == [(True, False), (False, False), (False, True)]


GPU2 = ({"device": "cuda:0"}, {"device": "cuda:1"})


def test_microbatches_resolved():
    """auto must resolve to 1 on one stage, n_stages on an all-GPU pipeline (memory-bound decode: each microbatch
    reads the weights again), n_stages + 1 on CPU stages; an int must be kept."""
    assert plan(cfg("auto")).microbatches == 1
    assert plan(cfg("auto", "auto", "auto")).microbatches == 4
    assert plan(cfg(*GPU2)).microbatches == 2
    assert plan(cfg({"device": "cuda:0"}, "auto")).microbatches == 3      # a CPU stage in the pipeline
    assert plan(cfg("auto", "auto", scheduler={"microbatches": 7})).microbatches == 7


def test_pipeline_chunks_without_a_second_stage_or_microbatch_warn():
    """scheduler.pipeline_chunks > 1 on one stage, or with one microbatch in flight, cannot overlap two pieces: the
    plan says so (the scheduler then sends whole chunks); auto never warns."""
    one = plan(cfg("auto", scheduler={"pipeline_chunks": 4})).warnings
    assert one == ("scheduler.pipeline_chunks: 4 has no effect with a single-stage placement: a prompt's pieces "
                   "could not run on two stages at once, so prompts keep whole chunks",)
    w = plan(cfg("auto", "auto", scheduler={"microbatches": 1, "pipeline_chunks": 4})).warnings
    assert len(w) == 2 and "pipeline_chunks: 4 has no effect with one microbatch in flight" in w[1], w
    assert plan(cfg("auto")).warnings == () and plan(cfg(*GPU2, scheduler={"pipeline_chunks": 4})).warnings == ()


@pytest.mark.parametrize("raw,needle", [
    (cfg("auto", "auto", "auto", scheduler={"microbatches": 2}),
     "scheduler.microbatches: 2 is fewer microbatches than stages (3): stages will idle; use auto (4)"),
    (cfg("auto", overlay_publish="force"), "overlay_publish: force is ineffective here (a single-stage placement)"),
    (cfg(*GPU2, overlay_publish="never", vision={"engine": "intake"}),
     "overlay_publish: never is ineffective here (vision.engine puts the tower on the intake stage)"),
    (cfg("auto", "auto", transport="peer"), "transport: peer has no effect: every stage is on cpu"),
    (cfg({"device": "cuda:0"}, transport="host"), "transport: host has no effect: a single-stage placement"),
    (cfg("auto", scheduler={"max_context": 262145}), "scheduler.max_context: 262145 is more than the model's "
     "max_position_embeddings (262144): sequences longer than 262144 run past the context it was trained for"),
])
def test_warnings(raw, needle):
    """A silently ineffective setting must yield exactly one warning saying why (on a model with a vision tower)."""
    w = plan(raw, m=vision_model()).warnings
    assert len(w) == 1 and needle in w[0], w


def vision_model():
    from memra_pp.model.config import VisionConfig
    vc = VisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4,
                      temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
    return dataclasses.replace(model(), vision=vc, image_token_id=300, video_token_id=301)


@pytest.mark.parametrize("raw", [
    cfg("auto", "auto", "auto", scheduler={"microbatches": 3}), cfg(*GPU2, overlay_publish="force"),
    cfg(*GPU2, transport="host"), cfg("auto", "auto"),
])
def test_no_warnings_when_effective(raw):
    """Effective settings must not warn."""
    assert plan(raw, m=vision_model()).warnings == ()


@pytest.mark.parametrize("over,want", [
    (dict(vision={"engine": "stage:1"}), ["vision.engine: stage:1 has no effect: the model has no vision tower"]),
    (dict(overlay_publish="never"), ["overlay_publish: never has no effect: the model has no vision tower"]),
    (dict(vision={"engine": "intake"}, overlay_publish="force"),
     ["vision.engine: intake has no effect", "overlay_publish: force has no effect: the model has no vision tower"]),
    (dict(), []),
])
def test_vision_settings_on_a_model_without_a_tower_warn(over, want):
    """(Was a defect.) On a text-only model, vision.engine and overlay_publish can do nothing: each set one is said
    to have no effect, once, and the tower-placement warnings (which assume a tower) are not given."""
    w = plan(cfg("auto", "auto", **over)).warnings
    assert model().vision is None and len(w) == len(want) and all(n in x for n, x in zip(want, w, strict=True)), w


def test_format_plan_exact():
    """format_plan must print the header, one aligned row per stage with its cost share and estimated memory (the
    tiny model's 6 layers, float32, 32 sequences' cache at 4,096 positions), then warnings."""
    p = plan(cfg("auto", "auto", scheduler={"microbatches": 1}), [1, 2, 3, 4, 5, 6], head=5)
    assert format_plan(p) == "\n".join([
        "plan t: 2 stage(s), 6 layers, 1 microbatch(es)",
        "stage  device  layers  n  roles          cost %  memory",
        "0      cpu     [0, 5)  5  intake         57.7    65.8 MiB",
        "1      cpu     [5, 6)  1  primary,tower  42.3    64.4 MiB",
        "warning: scheduler.microbatches: 1 is fewer microbatches than stages (2): stages will idle; "
        "use auto (3) or at least 2"])


# --- property ----------------------------------------------------------------------------------------------------

@settings(max_examples=150, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=8), st.data())
def test_split_is_optimal_property(costs, data):
    """Any split must be contiguous, cover every layer, leave no stage empty, and equal the brute-force optimum
    (its largest boundaries among the optima)."""
    n = data.draw(st.integers(1, len(costs)))
    first, last = data.draw(st.integers(0, 20)), data.draw(st.integers(0, 20))
    got = split_layers(costs, n, first, last)

    def worst(b):
        return max(sum(costs[b[s]:b[s + 1]]) + (first if s == 0 else 0) + (last if s == n - 1 else 0)
                   for s in range(n))
    assert got[0] == 0 and got[-1] == len(costs) and all(a < b for a, b in zip(got, got[1:]))
    every = [(0, *mid, len(costs)) for mid in itertools.combinations(range(1, len(costs)), n - 1)]
    best = min(worst(b) for b in every)
    assert worst(got) == best and got == max(b for b in every if worst(b) == best)


def test_stage_actors_environment_carries_threads_and_no_switch(monkeypatch):
    """A stage actor's environment carries its thread count and nothing of the driver's: not even the MEMRA_PP_*
    switches, which its setup is given resolved (law 2; test_runtime's switches test runs that)."""
    import types
    from memra_pp.deployment import Deployment
    from memra_pp.stages import actor
    seen = {}

    class Fake:
        @staticmethod
        def options(**o):
            seen.update(o)
            return types.SimpleNamespace(remote=lambda: "actor")

    monkeypatch.setattr(actor, "StageActor", Fake)
    monkeypatch.setenv("MEMRA_PP_ANY_KV_GRAPHS", "1")
    monkeypatch.setenv("SOMETHING_ELSE", "x")
    s = types.SimpleNamespace(threads=2, num_cpus=0.5, index=0, device="cuda:0")
    assert Deployment._make_actor(types.SimpleNamespace(name="p"), s, object(), False) == "actor"
    env = seen["runtime_env"]["env_vars"]
    assert env == {"OMP_NUM_THREADS": "2", "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}, env
    # a CPU stage has no environment of its own (its setup sets torch's threads: test_runtime's three-stage test
    # reads them), so that Ray can give it an idle worker instead of starting one for its runtime_env
    seen.clear()
    cpu = types.SimpleNamespace(**{**vars(s), "device": "cpu"})
    assert Deployment._make_actor(types.SimpleNamespace(name="p"), cpu, object(), False) == "actor"
    assert "runtime_env" not in seen and seen["num_cpus"] == 0.5, seen


def test_a_stage_is_given_every_switch_or_refuses():
    """switches.apply sets each switch where its process reads it, and refuses a partial or unknown set (a missing
    switch would leave the stage's own environment deciding)."""
    from memra_pp import switches
    from memra_pp.kernels import prefill
    before = switches.current()
    try:
        switches.apply({**before, "MEMRA_PP_PREFILL_VARLEN": not before["MEMRA_PP_PREFILL_VARLEN"]})
        assert prefill.VARLEN is (not before["MEMRA_PP_PREFILL_VARLEN"])
        assert switches.current() == {**before, "MEMRA_PP_PREFILL_VARLEN": prefill.VARLEN}
        with pytest.raises(ConfigError, match=r"a stage was given the switches \['MEMRA_PP_KV_IN_PLACE'\]; it needs "
                                              r"exactly \['MEMRA_PP_ANY_KV_GRAPHS'"):
            switches.apply({"MEMRA_PP_KV_IN_PLACE": True})
    finally:
        switches.apply(before)
    assert switches.current() == before


@pytest.mark.parametrize("name,value,message", [
    ("MEMRA_PP_KV_IN_PLACE", "false", "MEMRA_PP_KV_IN_PLACE='false': a switch is 0 or 1 (default 1"),
    ("MEMRA_PP_ANY_KV_GRAPHS", "", "MEMRA_PP_ANY_KV_GRAPHS='': a switch is 0 or 1"),
    ("MEMRA_PP_MOE_BLOK", "1", "MEMRA_PP_MOE_BLOK is not a memra_pp switch (known: MEMRA_PP_ANY_KV_GRAPHS"),
])
def test_runtime_switches_refuse_what_they_do_not_know(monkeypatch, tmp_path, name, value, message):
    """A MEMRA_PP_* variable is a known switch set to 0 or 1; a typo in its name or value is a ConfigError naming
    it, raised by launch before any Ray work (the stages would otherwise run with the default silently), and by
    the switch's own reader. Values 0/1 (with spaces) read as they say."""
    from memra_pp import switches
    import memra_pp
    env = {"MEMRA_PP_KV_IN_PLACE": " 0 ", "MEMRA_PP_MOE_BLOCK": "1"}
    assert switches.check_environment(env) == {"MEMRA_PP_ANY_KV_GRAPHS": True, "MEMRA_PP_KV_IN_PLACE": False,
                                                "MEMRA_PP_MOE_BLOCK": True, "MEMRA_PP_SDPA_CUDNN": False,
                                                "MEMRA_PP_PREFILL_MERGED": True, "MEMRA_PP_PREFILL_VARLEN": True,
                                                "MEMRA_PP_PREFILL_GRAPHS": True, "MEMRA_PP_RULE_GRAPHS": False,
                                                "MEMRA_PP_CHUNK_H_GRID": False, "MEMRA_PP_SKIP_PADDING": True,
                                                "MEMRA_PP_GC_FREEZE": True}
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError) as e:
        switches.check_environment()
    assert message in str(e.value)
    if name in switches.SWITCHES:
        with pytest.raises(ConfigError, match="a switch is 0 or 1"):
            switches.flag(name)
    from memra_pp.defaults import ensure_tiny
    cfg = {"name": "sw", "model": {"path": str(ensure_tiny())}, "stages": [{"device": "cpu"}]}
    import ray

    from memra_pp.deployment import Deployment

    def no_ray(*a, **k):
        raise AssertionError("Ray work began before the switches were checked")
    monkeypatch.setattr(ray, "init", no_ray)
    monkeypatch.setattr(Deployment, "_make_actor", staticmethod(no_ray))
    with pytest.raises(ConfigError) as e:
        memra_pp.launch(cfg)
    assert message in str(e.value)


def test_a_malformed_switch_never_fails_an_import_but_fails_the_strict_readers():
    """A stage's worker may carry a malformed MEMRA_PP_* variable in its own environment (a remote node's), which its
    setup overrides (switches.apply): importing the modules that hold the switches must not raise there; they take
    the default. The strict readers (launch's check_environment, the test session's and the engine-step
    benchmark's start) still refuse it."""
    import subprocess
    code = ("from memra_pp import switches\n"
            "from memra_pp.model import cache, decode_graphs, attention\n"
            "from memra_pp.kernels import prefill, moe_block\n"
            "print(cache.IN_PLACE, prefill.VARLEN)\n"
            "try:\n    switches.check_environment()\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    env = {**os.environ, "MEMRA_PP_KV_IN_PLACE": "false", "MEMRA_PP_PREFILL_VARLEN": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "True False"           # the malformed one its default, the good one as it says
    assert lines[1].startswith("ConfigError environment variable MEMRA_PP_KV_IN_PLACE='false': a switch is 0 or 1")
    here = Path(__file__).parent
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          f"{here / 'test_placement.py'}::test_a_stage_is_given_every_switch_or_refuses"],
                         cwd=here.parent, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "MEMRA_PP_KV_IN_PLACE='false': a switch is 0 or 1" in out.stdout + out.stderr


def test_the_readme_placement_yaml_loads_as_written():
    """The README's annotated YAML is what users copy: it must load, and every value it shows must be the default
    (YAML 1.1 reads a bare `off` as false, say)."""
    import re
    from memra_pp.placement.schema import AdapterSpec, SchedulerSpec, TimeoutSpec
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = re.search(r"## Placement YAML\n\n```yaml\n(.*?)```", readme, re.S).group(1)
    p = load_placement(yaml.safe_load(block))
    assert p.scheduler == SchedulerSpec() and p.adapters == AdapterSpec() and p.timeouts == TimeoutSpec()
    assert [s.device for s in p.stages] == ["cpu", "cpu"] and p.transport == "auto"
