"""Refusals at the edge (DESIGN law 2): every malformed model config, checkpoint, GGUF metadata or placement YAML
must be a ConfigError naming the file and the key, tensor or value; never a raw TypeError / OverflowError / hang,
and never a silently wrong load (a quantized tensor cast to float, "false" read as true, a stale shard winning)."""
import json
import os
import threading

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from memra_pp.errors import ConfigError
from memra_pp.model.config import VisionConfig, load_config, parse_config
from memra_pp.model.gguf_source import GGUFSource
from memra_pp.model.tiny import make_tiny, tiny_config
from memra_pp.model.vision import VisionTower
from memra_pp.model.weights import SafetensorsSource, open_weights
from memra_pp.placement.schema import load_placement
from test_fuzz import FIX

WHERE = "/x/config.json"
LM = "model.language_model."


def vlm(text=None, **top):
    """tiny_config's VLM layout (vision tower included) with text_config keys `text` and top-level keys `top`."""
    raw = tiny_config(vision=True)
    raw["text_config"].update(text or {})
    raw.update(top)
    return raw


def rope(**over):
    return {"rope_parameters": {**tiny_config()["text_config"]["rope_parameters"], **over}}


def no_layer_types(**text):
    raw = vlm(text)
    del raw["text_config"]["layer_types"]
    return raw


def moe(**text):
    raw = tiny_config(moe=True)
    raw["text_config"].update(text)
    return raw


def vision(**over):
    raw = vlm()
    raw["vision_config"].update(over)
    return raw


# ---- config.json -------------------------------------------------------------------------------------------------

CONFIGS = {
    "not an object": ([], r"the top level must be an object of config keys, got list"),
    "text_config a string": ({**vlm(), "text_config": "x"}, r"text_config must be an object .* got 'x'"),
    "model_type a list": (vlm(model_type=[]), r"model_type must be a string, got \[\]"),
    "text model_type a list": (vlm({"model_type": ["qwen3_5_text"]}), r"text_config\.model_type must be a string"),
    "quantization_config": (vlm(quantization_config={"quant_method": "fp8"}),
                            r"quantization_config \('fp8'\) is not supported; this runtime loads float16 / "
                            r"bfloat16 / float32 weights only"),
    "quantization_config in text_config": (vlm({"quantization_config": {"quant_method": "gptq"}}),
                                           r"text_config\.quantization_config \('gptq'\) is not supported"),
    "tie_word_embeddings 'false'": (vlm(tie_word_embeddings="false"),
                                    r"tie_word_embeddings must be true or false, got 'false'"),
    "text tie_word_embeddings 1": (vlm({"tie_word_embeddings": 1}),
                                   r"text_config\.tie_word_embeddings must be true or false, got 1"),
    "mrope_interleaved 'false'": (vlm(rope(mrope_interleaved="false")),
                                  r"text_config\.rope_parameters\.mrope_interleaved must be true or false"),
    "rope_parameters a string": (vlm({"rope_parameters": "x"}), r"text_config\.rope_parameters must be an object"),
    "rope_scaling beside rope_parameters": (vlm({"rope_scaling": {"type": "yarn", "factor": 4.0}}),
                                            r"text_config\.rope_scaling\.rope_type 'yarn' is not supported"),
    "rope_scaling a list beside rope_parameters": (vlm({"rope_scaling": [1]}),
                                                   r"text_config\.rope_scaling must be an object .* got \[1\]"),
    "rope_theta 'abc'": (vlm(rope(rope_theta="abc")),
                         r"text_config\.rope_parameters\.rope_theta must be a number, got 'abc'"),
    "rope_theta null": (vlm(rope(rope_theta=None)),
                        r"text_config\.rope_parameters\.rope_theta must be a number, got None"),
    "rope_theta a list": (vlm(rope(rope_theta=[1e7])),
                          r"text_config\.rope_parameters\.rope_theta must be a number, got \[10000000\.0\]"),
    "rope_theta 0": (vlm(rope(rope_theta=0)), r"rope_theta must be a finite positive number, got 0\.0"),
    "rope_theta past float range": (vlm(rope(rope_theta=10 ** 400)), r"rope_theta must be a finite positive number"),
    "partial_rotary_factor NaN": (vlm(rope(partial_rotary_factor=float("nan"))),
                                  r"partial_rotary_factor must be a finite positive number, got nan"),
    "partial_rotary_factor inf": (vlm(rope(partial_rotary_factor=float("inf"))),
                                  r"partial_rotary_factor must be a finite positive number, got inf"),
    "partial_rotary_factor 1.5": (vlm(rope(partial_rotary_factor=1.5)), r"partial_rotary_factor must be in \(0, 1\]"),
    "rms_norm_eps a string": (vlm({"rms_norm_eps": "1e-6"}), r"text_config\.rms_norm_eps must be a number"),
    "rms_norm_eps negative": (vlm({"rms_norm_eps": -1e-6}), r"rms_norm_eps must be a finite positive number"),
    "mrope_section 5": (vlm(rope(mrope_section=5)),
                        r"rope_parameters\.mrope_section must be three integers >= 0 \(the T, H, W sections\), got 5"),
    "mrope_section of two": (vlm(rope(mrope_section=[3, 1])),
                             r"rope_parameters\.mrope_section must be three integers >= 0 .* got \[3, 1\]"),
    "mrope_section negative": (vlm(rope(mrope_section=[3, 2, -1])),
                               r"rope_parameters\.mrope_section must be three integers >= 0 .* got \[3, 2, -1\]"),
    "full_attention_interval 0": (no_layer_types(full_attention_interval=0),
                                  r"text_config\.full_attention_interval must be an integer >= 1, got 0"),
    "full_attention_interval '4'": (no_layer_types(full_attention_interval="4"),
                                    r"text_config\.full_attention_interval must be an integer >= 1, got '4'"),
    "layer_types null": (vlm({"layer_types": None}), r"layer_types must be a list of 'linear_attention'"),
    "layer_types an int": (vlm({"layer_types": 8}), r"layer_types must be a list .* got 8"),
    "intermediate_size '128'": (vlm({"intermediate_size": "128"}),
                                r"intermediate_size must be an integer >= 0, got '128'"),
    "intermediate_size null": (vlm({"intermediate_size": None}), r"intermediate_size must be an integer >= 0"),
    "hidden_size true": (vlm({"hidden_size": True}), r"hidden_size must be a positive integer, got True"),
    "max_position_embeddings a string": (vlm({"max_position_embeddings": "4096"}),
                                         r"max_position_embeddings must be a positive integer, got '4096'"),
    "max_position_embeddings NaN": (vlm({"max_position_embeddings": float("nan")}),
                                    r"max_position_embeddings must be a positive integer, got nan"),
    "max_position_embeddings null": (vlm({"max_position_embeddings": None}),
                                     r"max_position_embeddings must be a positive integer, got None"),
    "num_experts a string": (moe(num_experts="8"), r"num_experts must be an integer >= 0, got '8'"),
    "moe_intermediate_size null": (moe(moe_intermediate_size=None), r"moe_intermediate_size must be an integer"),
    "shared_expert_intermediate_size a string": (moe(shared_expert_intermediate_size="48"),
                                                 r"shared_expert_intermediate_size must be an integer >= 0"),
    "num_experts_per_tok past num_experts": (moe(num_experts_per_tok=9),
                                             r"num_experts_per_tok \(9\) must be at most num_experts \(8\)"),
    "num_experts_per_tok true": (moe(num_experts_per_tok=True), r"num_experts_per_tok must be an integer >= 0"),
    "eos_token_id 'xyz'": (vlm(eos_token_id="xyz"), r"eos_token_id 'xyz' must be a token id \(an integer in "
                                                    r"\[0, vocab_size 512\)\) or a list of them"),
    "eos_token_id NaN": (vlm(eos_token_id=float("nan")), r"eos_token_id nan must be a token id"),
    "eos_token_id an object": (vlm(eos_token_id={"id": 2}), r"eos_token_id \{'id': 2\} must be a token id"),
    "eos_token_id list with a string": (vlm(eos_token_id=[2, "x"]), r"eos_token_id \[2, 'x'\] must be a token id"),
    "eos_token_id past the vocabulary": (vlm(eos_token_id=512), r"eos_token_id 512 must be a token id"),
    "text eos_token_id negative": ({k: v for k, v in vlm({"eos_token_id": -1}).items() if k != "eos_token_id"},
                                   r"text_config\.eos_token_id -1 must be a token id"),
    "vision_config a string": (vlm(vision_config="x"), r"vision_config must be an object .* got 'x'"),
    "vision num_heads 0": (vision(num_heads=0), r"vision_config\.num_heads must be a positive integer, got 0"),
    "vision num_position_embeddings -1": (vision(num_position_embeddings=-1),
                                          r"vision_config\.num_position_embeddings must be a positive integer"),
    "vision num_position_embeddings not a square": (vision(num_position_embeddings=15),
                                                    r"vision_config\.num_position_embeddings 15 must be a square"),
    "vision depth 0": (vision(depth=0), r"vision_config\.depth must be a positive integer, got 0"),
    "vision patch_size negative": (vision(patch_size=-4), r"vision_config\.patch_size must be a positive integer"),
    "vision spatial_merge_size 0": (vision(spatial_merge_size=0), r"vision_config\.spatial_merge_size must be a"),
    "vision depth a string": (vision(depth="2"), r"vision_config\.depth must be a positive integer, got '2'"),
    "vision patch_size a float": (vision(patch_size=4.0), r"vision_config\.patch_size must be a positive integer"),
    "vision hidden_size null": (vision(hidden_size=None), r"vision_config\.hidden_size must be a positive integer"),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_bad_config_values_are_refused_naming_the_key(case):
    """A config.json value of the wrong type or range must be a ConfigError naming the file and the key at parse,
    not a TypeError / IndexError at stage load or a wrong model."""
    raw, msg = CONFIGS[case]
    with pytest.raises(ConfigError, match=rf"^{WHERE}: {msg}"):
        parse_config(raw, WHERE)


def test_good_configs_still_parse():
    """The values the refusals leave alone must still load: JSON booleans, integer rope_theta, a list of eos ids,
    a rope_scaling block beside rope_parameters that asks for no scaling."""
    c = parse_config(vlm({"rope_scaling": {"type": "mrope", "mrope_section": [2, 1, 1]}}, tie_word_embeddings=True,
                         eos_token_id=[2, 3]))
    assert c.tied is True and c.eos_token_ids == (2, 3) and c.vision.num_heads == 4
    assert parse_config(vlm(rope(rope_theta=10_000_000))).text.rope_theta == 1e7
    assert parse_config(moe(num_experts_per_tok=8)).text.num_experts_per_tok == 8


def test_vision_tower_refuses_a_zero_head_count():
    """A VisionConfig built without parse_config must still be refused by the tower (was a ZeroDivisionError)."""
    vc = parse_config(vlm()).vision
    with pytest.raises(ConfigError, match=r"^vision tower: vision_config\.num_heads must be a positive integer"):
        VisionTower(VisionConfig(**{**vc.__dict__, "num_heads": 0}))


@pytest.mark.parametrize("write,msg", [
    (lambda p: p.write_bytes(b'{"model_type": "qwen3_5\xff"}'), r"config\.json: not valid JSON"),
    (lambda p: p.mkdir(), r"config\.json: not a regular file"),
    (lambda p: p.write_text("[" * 100_000 + "]" * 100_000), r"config\.json: not valid JSON \(nested too deeply\)"),
    (lambda p: p.write_text("[]"), r"config\.json: the top level must be an object of config keys, got list"),
])
def test_unreadable_config_json_is_refused(tmp_path, write, msg):
    """A config.json that is not UTF-8, is a directory, nests past the recursion limit or is no object must be a
    ConfigError naming it."""
    write(tmp_path / "config.json")
    with pytest.raises(ConfigError, match=msg):
        load_config(tmp_path)


# ---- safetensors checkpoints --------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {kind: make_tiny(root / kind, moe=kind == "moe") for kind in ("dense", "moe")}


def edit(src, dst, fn):
    """A copy of checkpoint `src` at `dst` whose state dict went through `fn` (in place)."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    sd = load_file(src / "model.safetensors")
    fn(sd)
    save_file(sd, dst / "model.safetensors")
    return dst


@pytest.mark.parametrize("dtype", [torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.complex64])
def test_a_non_float_tensor_is_refused_not_cast(tiny, tmp_path, dtype):
    """A tensor stored as int8 / uint8 / bool / float8 / complex must be refused naming it and its dtype: a cast
    would load quantized values as if they were the weights."""
    key = LM + "layers.0.linear_attn.out_proj.weight"
    d = edit(tiny["dense"], tmp_path / "q", lambda sd: sd.__setitem__(key, sd[key].to(dtype)))
    name = str(dtype).removeprefix("torch.")
    with pytest.raises(ConfigError, match=rf"model\.safetensors: tensor '{key}' has dtype {name}; this runtime "
                                          r"loads float16 / bfloat16 / float32 / float64 weights only"):
        open_weights(d).get("layers.0.linear_attn.out_proj.weight", torch.float32)
    d64 = edit(tiny["dense"], tmp_path / "f64", lambda sd: sd.__setitem__(key, sd[key].double()))
    assert open_weights(d64).get("layers.0.linear_attn.out_proj.weight", torch.float32).dtype == torch.float32


@pytest.mark.parametrize("value,dtype,says", [
    (float("nan"), torch.float32, r"holds 1 non-finite value\(s\) \(NaN or inf\) of 4096; the checkpoint is corrupt"),
    (float("-inf"), torch.bfloat16, r"holds 1 non-finite value\(s\) \(NaN or inf\) of 4096; the checkpoint is corrupt"),
    (1e6, torch.float16, r"has 1 value\(s\) past float16's range \(finite as stored, float32\): load the model in a "
                         r"wider dtype")])
def test_a_non_finite_weight_is_refused_naming_it(tiny, tmp_path, monkeypatch, value, dtype, says):
    """A NaN or inf in a checkpoint's tensor, or a finite value the load dtype cannot hold, must be a ConfigError
    naming the tensor and which of the two it is (it would make every token it touches NaN), found in any chunk of
    the check's sums (chunks of 1,000 values here: the bad one in the fourth); another tensor of the same file
    loads, and so does one whose float32 sum overflows though every value is finite."""
    from memra_pp.model import weights
    monkeypatch.setattr(weights, "FINITE_CHUNK", 1000)
    key, big = LM + "layers.0.linear_attn.out_proj.weight", LM + "layers.0.linear_attn.in_proj_qkv.weight"

    def poison(sd):
        sd[key] = sd[key].float().clone()
        sd[key].view(-1)[3007] = value
        sd[big] = torch.full_like(sd[big], 3.0e38, dtype=torch.float32)
    d = edit(tiny["dense"], tmp_path / "nf", poison)
    with pytest.raises(ConfigError, match=rf"model\.safetensors: tensor 'layers\.0\.linear_attn\.out_proj\.weight' "
                                          rf"{says}"):
        open_weights(d).get("layers.0.linear_attn.out_proj.weight", dtype)
    assert open_weights(d).get("layers.0.linear_attn.in_proj_z.weight", dtype).dtype == dtype
    if dtype != torch.float16:      # (3e38 is past float16's range)
        assert bool(open_weights(d).get("layers.0.linear_attn.in_proj_qkv.weight", dtype).isfinite().all())


def _experts(fn):
    def apply(sd):
        for e in range(8):
            p = f"{LM}layers.0.mlp.experts.{e}."
            fn(sd, e, p)
    return apply


def _shift_rows(sd, e, p):
    g, u = sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"]
    sd[p + "gate_proj.weight"], sd[p + "up_proj.weight"] = g[:-1].clone(), torch.cat([g[-1:], u])


def _short_expert(sd, e, p):
    if e == 3:
        sd[p + "gate_proj.weight"] = sd[p + "gate_proj.weight"][:-1].clone()


@pytest.mark.parametrize("fn,bad", [(_shift_rows, "0.gate_proj.weight' has shape \\(31, 64\\)"),
                                    (_short_expert, "3.gate_proj.weight' has shape \\(31, 64\\)")])
def test_each_expert_is_shape_checked_before_stacking(tiny, tmp_path, fn, bad):
    """Per-expert tensors must be checked one by one: a 31-row gate and a 33-row up must not pass as 64 rows, and
    one short expert must be a ConfigError naming it (was a RuntimeError from torch.stack)."""
    d = edit(tiny["moe"], tmp_path / "e", _experts(fn))
    with pytest.raises(ConfigError, match=rf"model\.safetensors: tensor '{LM}layers\.0\.mlp\.experts\.{bad}, the "
                                          r"config needs \(32, 64\)"):
        open_weights(d).get("layers.0.mlp.experts.gate_up_proj", torch.float32)


def test_a_tensor_in_two_shards_without_an_index_is_refused(tiny, tmp_path):
    """Without an index, a key in two *.safetensors files (a stale copy) must be refused naming both files, not
    taken from whichever sorts last."""
    d = edit(tiny["dense"], tmp_path / "s", lambda sd: None)
    save_file({k: v * 0 for k, v in load_file(d / "model.safetensors").items()}, d / "model_old.safetensors")
    with pytest.raises(ConfigError, match=r"tensor '[^']+' is in both model\.safetensors and model_old\.safetensors; "
                                          r"remove the stale file"):
        SafetensorsSource(d)


@pytest.mark.parametrize("write,msg", [
    (lambda p: p.write_text('{"weight_map": ["model.safetensors"]}'),
     r"not a safetensors index \(weight_map must map tensor names to shard files, got \['model"),
    (lambda p: p.write_text('{"weight_map": "model.safetensors"}'),
     r"not a safetensors index \(weight_map must map .* got 'model"),
    (lambda p: p.write_text('{"weight_map": null}'),
     r"not a safetensors index \(weight_map must map tensor names to shard files, got None\)"),
    (lambda p: p.write_text('[{"weight_map": {}}]'), r"not a safetensors index \(no weight_map in a JSON list\)"),
    (lambda p: p.write_text('{"weight_map": {"lm_head.weight": 3}}'),
     r"weight_map\['lm_head\.weight'\] must name a shard file, got 3"),
    (lambda p: p.write_text('{"weight_map": {"lm_head.weight": null}}'),
     r"weight_map\['lm_head\.weight'\] must name a shard file, got None"),
    (lambda p: p.write_bytes(b'{"weight_map": {"\xff": "a"}}'), r"not a safetensors index \(.*utf-8"),
    (lambda p: p.mkdir(), r"not a safetensors index \(.*Is a directory"),
    (lambda p: p.write_text("[" * 100_000), r"not a safetensors index \(nested too deeply\)"),
])
def test_malformed_index_is_refused_naming_it(tiny, tmp_path, write, msg):
    """A model.safetensors.index.json of the wrong shape, encoding or kind must be a ConfigError naming it."""
    d = edit(tiny["dense"], tmp_path / "i", lambda sd: None)
    write(d / "model.safetensors.index.json")
    with pytest.raises(ConfigError, match=r"model\.safetensors\.index\.json: " + msg):
        SafetensorsSource(d)


def test_dummy_format_refuses_a_missing_path(tiny, tmp_path):
    """format: dummy with a model.path that does not exist must be refused, not served from the parent directory's
    config.json."""
    with pytest.raises(ConfigError, match=r"model\.path '.*/dense/missing' does not exist"):
        open_weights(tiny["dense"] / "missing", "dummy")


# ---- GGUF ---------------------------------------------------------------------------------------------------------

T = gguf.GGUFValueType
DENSE_GGUF, MOE_GGUF = f"{FIX}/dense_text-f32.gguf", FIX.replace("dense_text-s404", "moe_text-s414") + \
    "/moe_text-f32.gguf"


def rewrite(src, out, kv=None, tensors=None):
    """A copy of F32 GGUF `src` with metadata `kv` ({key: (value, type[, item type])}) and tensors passed through
    `tensors` ({name: fn(array in torch order)})."""
    kv, tensors = kv or {}, tensors or {}
    r = gguf.GGUFReader(src)
    arch = r.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(out), arch if isinstance(kv.get("general.architecture", (arch,))[0], str) else "x")
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture" or k in kv:
            continue
        w.add_key_value(k, f.contents(), f.types[0], sub_type=f.types[-1] if f.types[0] == T.ARRAY else None)
    for k, v in kv.items():
        w.add_key_value(k, v[0], v[1], sub_type=v[2] if len(v) > 2 else None)
    for t in r.tensors:
        a = np.array(t.data).reshape([int(d) for d in reversed(t.shape.tolist())])
        w.add_tensor(t.name, np.ascontiguousarray(tensors.get(t.name, lambda x: x)(a)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


GGUF_META = {
    "ssm.time_step_rank 0": ({"qwen35.ssm.time_step_rank": (0, T.UINT32)},
                             r"GGUF metadata key 'qwen35\.ssm\.time_step_rank' must be an integer >= 1, got 0"),
    "attention.key_length 0": ({"qwen35.attention.key_length": (0, T.UINT32)},
                               r"GGUF metadata key 'qwen35\.attention\.key_length' must be an integer >= 1, got 0"),
    "block_count a string": ({"qwen35.block_count": ("x", T.STRING)},
                             r"GGUF metadata key 'qwen35\.block_count' must be an integer >= 1, got 'x'"),
    "block_count an array": ({"qwen35.block_count": ([6], T.ARRAY, T.UINT32)},
                             r"GGUF metadata key 'qwen35\.block_count' must be an integer >= 1, got \[6\]"),
    "block_count a float": ({"qwen35.block_count": (6.5, T.FLOAT32)},
                            r"GGUF metadata key 'qwen35\.block_count' must be an integer >= 1, got 6\.5"),
    "block_count too small": ({"qwen35.block_count": (5, T.UINT32)},
                              r"tensor 'blk\.5\.[a-z_.]+' is past the last block: qwen35\.block_count is 5"),
    "context_length a string": ({"qwen35.context_length": ("x", T.STRING)},
                                r"GGUF metadata key 'qwen35\.context_length' must be an integer >= 1, got 'x'"),
    "rope.dimension_sections a scalar": ({"qwen35.rope.dimension_sections": (2, T.INT32)},
                                         r"GGUF metadata key 'qwen35\.rope\.dimension_sections' must be an array "
                                         r"of integers \(T, H, W, 0\), got 2"),
    "rope.dimension_sections a string": ({"qwen35.rope.dimension_sections": ("2,1,1", T.STRING)},
                                         r"GGUF metadata key 'qwen35\.rope\.dimension_sections' must be an array "
                                         r"of integers \(T, H, W, 0\), got '2,1,1'"),
    "rope.freq_base a string": ({"qwen35.rope.freq_base": ("1e7", T.STRING)},
                                r"GGUF metadata key 'qwen35\.rope\.freq_base' must be a number, got '1e7'"),
    "rope.freq_base 0": ({"qwen35.rope.freq_base": (0.0, T.FLOAT32)},
                         r"rope_theta must be a finite positive number, got 0\.0"),
    "layer_norm_rms_epsilon negative": ({"qwen35.attention.layer_norm_rms_epsilon": (-1e-6, T.FLOAT32)},
                                        r"rms_norm_eps must be a finite positive number, got -1e-06"),
    "general.architecture an array": ({"general.architecture": (["qwen35"], T.ARRAY, T.STRING)},
                                      r"GGUF architecture \['qwen35'\] is not supported"),
}


@pytest.mark.parametrize("case", list(GGUF_META))
def test_bad_gguf_metadata_is_refused_naming_the_key(tmp_path, case):
    """GGUF metadata of the wrong type or range must be a ConfigError naming the file and the key (was a
    ZeroDivisionError / ValueError / TypeError, a truncated float, or layers silently dropped)."""
    kv, msg = GGUF_META[case]
    with pytest.raises(ConfigError, match=rf"m\.gguf: {msg}"):
        GGUFSource(rewrite(DENSE_GGUF, tmp_path / "m.gguf", kv=kv))


def test_a_one_dimensional_token_embedding_is_refused(tmp_path):
    """token_embd.weight must be 2-D (vocab x hidden); a 1-D one was an IndexError."""
    with pytest.raises(ConfigError, match=r"m\.gguf: tensor 'token_embd\.weight' has shape \(\d+,\), expected "
                                          r"\(vocab, hidden\)"):
        GGUFSource(rewrite(DENSE_GGUF, tmp_path / "m.gguf", tensors={"token_embd.weight": lambda a: a.reshape(-1)}))


@pytest.mark.parametrize("tensors,bad", [
    ({"blk.0.ffn_up_exps.weight": lambda a: a[:7]}, r"'blk\.0\.ffn_up_exps\.weight' .* has shape \(7, 32, 64\)"),
    ({"blk.0.ffn_gate_exps.weight": lambda a: a[:, :31], "blk.0.ffn_up_exps.weight": lambda a: np.concatenate(
        [a[:, :1], a], 1)}, r"'blk\.0\.ffn_gate_exps\.weight' .* has shape \(8, 31, 64\)"),
])
def test_split_expert_halves_are_shape_checked_before_joining(tmp_path, tensors, bad):
    """ffn_gate_exps and ffn_up_exps must each be (experts, moe_intermediate, hidden) before they are joined: a
    different expert count was a RuntimeError from torch.cat, a 31 + 33 row split loaded as 64."""
    src = GGUFSource(rewrite(MOE_GGUF, tmp_path / "m.gguf", tensors=tensors))
    with pytest.raises(ConfigError, match=rf"m\.gguf: tensor {bad}, the config needs \(8, 32, 64\)"):
        src.get("layers.0.mlp.experts.gate_up_proj", torch.float32)


def test_a_corrupt_gguf_message_is_not_nested(tmp_path):
    """The metadata check's refusal must reach the caller once, not wrapped in a copy of itself."""
    f = tmp_path / "cut.gguf"
    f.write_bytes(open(DENSE_GGUF, "rb").read()[:4000])
    with pytest.raises(ConfigError) as e:
        GGUFSource(f)
    assert str(e.value).count("not a readable GGUF file") == 1, str(e.value)


# ---- placement YAML -----------------------------------------------------------------------------------------------

STAGES = "stages: [{device: cpu}]\n"
YAMLS = {
    "not UTF-8": (b"name: t\n" + STAGES.encode() + b"\xff\xfe bad: 1\n",
                  r"cannot read the placement file \(not UTF-8 text"),
    "a mapping as a key": (STAGES + "? {a: 1}\n: 1\n",
                           r"not valid YAML: a mapping key must be a scalar, got a mapping"),
    "a sequence as a key": ("stages: [{device: cpu, ? [x] : 1}]\n",
                            r"not valid YAML: a mapping key must be a scalar, got a sequence"),
    "nested too deeply": (STAGES + "a: " + "[" * 10_000 + "]" * 10_000 + "\n", r"not valid YAML: nested too deeply"),
    "~user of no such user": (STAGES + "model: {path: ~nosuchuser-memra/m}\n",
                              r"model\.path: '~nosuchuser-memra/m': cannot expand '~' \(no such user"),
    "num_cpus past float range": ("stages: [{device: cpu, num_cpus: 1" + "0" * 400 + "}]\n",
                                  r"stages\[0\]\.num_cpus: must be at most 1024, got 10{400}"),
    "num_cpus past the bound": ("stages: [{device: cpu, num_cpus: 4096.0}]\n",
                                r"stages\[0\]\.num_cpus: must be at most 1024, got 4096\.0"),
    "threads 100000": ("stages: [{device: cpu, threads: 100000}]\n",
                       r"stages\[0\]\.threads: must be at most 1024, got 100000"),
    "timeout past float range": (STAGES + "timeouts: {step_s: 1" + "0" * 400 + "}\n",
                                 r"timeouts\.step_s: must be at most 1e\+09, got 10{400}"),
    "timeout past TIMEOUT_MAX": (STAGES + "timeouts: {ready_s: 1.0e+10}\n",
                                 r"timeouts\.ready_s: must be at most 1e\+09, got 10000000000\.0"),
    "max_batch 2**100": (STAGES + f"scheduler: {{max_batch: {2 ** 100}}}\n",
                         rf"scheduler\.max_batch: must be at most 65536, got {2 ** 100}"),
    "max_context 2**100": (STAGES + f"scheduler: {{max_context: {2 ** 100}}}\n",
                           rf"scheduler\.max_context: must be at most 16777216, got {2 ** 100}"),
}


@pytest.mark.parametrize("case", list(YAMLS))
def test_bad_placement_files_are_refused_naming_the_file(tmp_path, case):
    """An undecodable, oddly keyed, too deep or out-of-bounds placement file must be a ConfigError naming the file
    and the key (was UnicodeDecodeError, TypeError, RecursionError, RuntimeError, OverflowError or a torch crash)."""
    text, msg = YAMLS[case]
    f = tmp_path / "p.yaml"
    f.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(ConfigError, match=rf"^{f}(:\d+:\d+)?: (.*: )?{msg}"):   # (YAML errors: line and column)
        load_placement(f)


def test_a_placement_path_that_is_no_regular_file_is_refused_without_blocking(tmp_path):
    """A FIFO (or a directory) given as the placement file must be refused at once; reading a FIFO blocked for
    ever."""
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "dir.yaml").mkdir()
    for f in (tmp_path / "fifo.yaml", tmp_path / "dir.yaml"):
        out = []
        t = threading.Thread(target=lambda: out.append(_error_of(load_placement, f)), daemon=True)
        t.start()
        t.join(10)
        assert out, f"load_placement({f}) blocked"
        assert isinstance(out[0], ConfigError) and str(out[0]) == \
            f"{f}: cannot read the placement file (not a regular file)", out[0]


def _error_of(fn, *a):
    try:
        fn(*a)
    except Exception as e:  # the test asserts its type
        return e
    return None


def test_bounds_leave_real_values_alone(tmp_path):
    """Values at the bounds must load: 1024 threads and CPUs, 1e9 s timeouts, 65536 sequences, 2**24 positions."""
    f = tmp_path / "p.yaml"
    f.write_text("stages: [{device: cpu, threads: 1024, num_cpus: 1024}]\ntimeouts: {step_s: 1.0e+9}\n"
                 f"scheduler: {{max_batch: 65536, max_context: {2 ** 24}}}\n")
    p = load_placement(f)
    assert p.stages[0].threads == 1024 and p.timeouts.step_s == 1e9 and p.scheduler.max_context == 2 ** 24
    assert json.loads(json.dumps(p.to_dict()))["scheduler"]["max_batch"] == 65536


def test_an_empty_placement_path_is_named_as_such():
    """`memra-pp launch ""` was refused as ": cannot read the placement file (not a regular file)": no file named,
    and the working directory taken for it."""
    e = _error_of(load_placement, "")
    assert isinstance(e, ConfigError) and str(e) == \
        "a placement file's path is empty: give the YAML's path (cluster_configs/*.yaml)", e


def test_a_command_whose_reader_has_gone_exits_quietly():
    """`memra-pp plan ... --json | head -c 10` ended with "memra-pp plan: BrokenPipeError: [Errno 32] Broken pipe"
    (exit 1); Unix tools exit quietly there. Here the pipe's reader is gone before the command writes."""
    import subprocess
    import sys
    r, w = os.pipe()
    os.close(r)
    try:
        p = subprocess.run([sys.executable, "-m", "memra_pp.cli", "plan", "cluster_configs/tiny-cpu.yaml", "--json"],
                           stdout=w, stderr=subprocess.PIPE, text=True, timeout=120,
                           cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    finally:
        os.close(w)
    assert p.returncode == 141 and p.stderr == "", (p.returncode, p.stderr[-2000:])


def test_a_stage_refusing_its_device_names_its_key(tmp_path):
    """A launch onto a Ray cluster it did not start cannot check devices in the driver (the stages may run on other
    hosts): the stage's own refusal said "device 'cuda:99': this process sees 0 CUDA device(s)" without the key.
    It now names stages[i].device, as the driver's check does."""
    from memra_pp.defaults import ensure_tiny
    from memra_pp.model.weights import open_weights
    from memra_pp.placement.planner import make_plan
    from memra_pp.stages.runner import StageRunner
    p = load_placement({"model": {"path": str(ensure_tiny())}, "stages": [{"device": "cpu"}, {"device": "cuda:99"}]})
    plan = make_plan(p, open_weights(p.model.path).config)
    with pytest.raises(ConfigError, match=r"^stages\[1\].device: device 'cuda:99': this process sees \d+ CUDA "
                                          r"device\(s\)"):
        StageRunner().setup(p.to_dict(), plan.to_dict(), 1, str(tmp_path), "shm", None)
