"""Checkpoint reading against transformers (audit): config variants transformers loads must give its logits (missing
rope_theta, rope_scaling beside rope_parameters, a VLM's tying, mrope_interleaved, missing keys), and checkpoint
layouts must be read or refused naming the file and tensor."""
import json
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest_models import tiny_checkpoint
from memra_pp.errors import ConfigError
from memra_pp.model.batch import StepBatch
from memra_pp.model.config import parse_config
from memra_pp.model.local import LocalPipeline
from memra_pp.model.stage_model import StageModel
from memra_pp.model.weights import SafetensorsSource, open_weights
from tiny_hf import TEXT

LM = "model.language_model."
T = 70


def variant(tmp_path, fn, kind="dense", tied=False):
    """A copy of the tiny checkpoint whose config.json went through `fn` (in place)."""
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint(kind, tied)[1], d)
    raw = json.loads((d / "config.json").read_text())
    fn(raw)
    (d / "config.json").write_text(json.dumps(raw))
    return d


def memra_logits(d, pos_3T=None):
    """Last-token logits of a T-token prefill through two stages."""
    pos = StepBatch.text_positions([0], [T]) if pos_3T is None else pos_3T
    lp = LocalPipeline(SafetensorsSource(d), [(0, 3), (3, 8)])
    return lp.step(StepBatch([0], [0], [T], pos, [True]), torch.arange(1, T + 1))[0]


def hf_logits(d, pos_3T=None):
    """transformers' logits, through the class config.json's architectures name (the VLM or *ForCausalLM)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    causal = json.loads((d / "config.json").read_text())["architectures"][0].endswith("ForCausalLM")
    m = (AutoModelForCausalLM if causal else AutoModelForImageTextToText).from_pretrained(d, dtype=torch.float32)
    m.eval()
    with torch.no_grad():
        return m(input_ids=torch.arange(1, T + 1)[None],
                 position_ids=None if pos_3T is None else pos_3T[:, None, :]).logits[0, -1]


def assert_parity(d, pos_3T=None):
    got, want = memra_logits(d, pos_3T), hf_logits(d, pos_3T)
    assert (got - want).abs().max() < 1e-4, f"max |memra - transformers| = {(got - want).abs().max():.3g}"


def drop_rope_theta(raw):
    del raw["text_config"]["rope_parameters"]["rope_theta"]


def rope_scaling_beside(raw):     # transformers reads rope_scaling first (convert_rope_params_to_dict)
    raw["text_config"]["rope_scaling"] = {**raw["text_config"]["rope_parameters"], "rope_theta": 1e4}


def text_tie_only(raw):           # Qwen3_5Config's own tie_word_embeddings (false when absent) decides, not text's
    del raw["tie_word_embeddings"]
    raw["text_config"]["tie_word_embeddings"] = True


def drop_defaulted_keys(raw):     # keys whose transformers default the tiny model happens to use
    for k in ("linear_conv_kernel_dim", "rms_norm_eps"):
        del raw["text_config"][k]


@pytest.mark.parametrize("fn", [drop_rope_theta, rope_scaling_beside, text_tie_only, drop_defaulted_keys])
def test_config_variants_transformers_loads_give_its_logits(tmp_path, fn):
    """A config.json transformers loads must give transformers' logits: rope_theta absent (its default 10000, not
    1e7), rope_scaling beside rope_parameters (rope_scaling wins), a text_config tie_word_embeddings true without a
    top-level one (untied: the checkpoint's lm_head.weight), keys left to their defaults (were refused)."""
    assert_parity(variant(tmp_path, fn))


def test_mrope_interleaved_false_is_ignored_like_transformers(tmp_path):
    """transformers never reads mrope_interleaved: with distinct T/H/W position rows, a config saying false must
    still give its (interleaved) logits, with a warning that the key is ignored."""
    d = variant(tmp_path, lambda raw: raw["text_config"]["rope_parameters"].update(mrope_interleaved=False))
    pos = torch.stack([torch.arange(T), torch.arange(T) * 2 % 7, torch.arange(T) * 3 % 11])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_parity(d, pos)
    with pytest.warns(UserWarning, match=r"mrope_interleaved false is ignored"):
        SafetensorsSource(d)


def test_a_tied_text_config_without_a_top_level_key_needs_lm_head(tmp_path):
    """A VLM checkpoint saved tied (no lm_head.weight) whose config ties only in text_config is untied to
    transformers (which would run a random lm_head): it must be refused naming lm_head.weight and the key to set."""
    d = variant(tmp_path, text_tie_only, tied=True)
    src = open_weights(d)
    assert not src.config.tied
    with pytest.raises(ConfigError, match=r"tensor 'lm_head\.weight' is missing .*set tie_word_embeddings true"):
        StageModel(src.config, 3, 8, intake=False, primary=True).load(src)


def causal_text_tie(raw):        # Qwen3_5ForCausalLM reads text_config alone (Qwen3_5TextConfig.from_pretrained)
    raw.update(architectures=["Qwen3_5ForCausalLM"], tie_word_embeddings=False)
    raw["text_config"]["tie_word_embeddings"] = True


def test_a_causal_lm_config_ties_by_its_text_config(tmp_path):
    """A nested config.json whose architectures name Qwen3_5ForCausalLM is tied by its text_config's key (the
    top-level one is not read): a tied checkpoint (no lm_head.weight) must load tied and give transformers' logits."""
    d = variant(tmp_path, causal_text_tie, tied=True)
    assert open_weights(d).config.tied
    assert_parity(d)


def test_a_tied_config_with_its_own_lm_head_uses_it(tmp_path):
    """A checkpoint whose config ties the head but which holds a distinct lm_head.weight is run untied by transformers
    (it ties only a head the checkpoint lacks): the logits must be its, with a warning naming the key to set."""
    d = variant(tmp_path, lambda raw: None, tied=True)
    sd = load_file(d / "model.safetensors")
    assert "lm_head.weight" not in sd
    sd["lm_head.weight"] = sd[LM + "embed_tokens.weight"] + 0.05 * torch.randn_like(sd[LM + "embed_tokens.weight"])
    save_file(sd, d / "model.safetensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert_parity(d)
    with pytest.warns(UserWarning, match=r"holds its own lm_head\.weight, which is used"):
        assert not SafetensorsSource(d).config.tied


def hf_text_config(raw):
    """transformers' config object for the config.json `raw`."""
    from transformers import AutoConfig
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(raw))
        return AutoConfig.from_pretrained(d)


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_missing_keys_take_transformers_defaults(kind):
    """A config.json that gives only model types (every other key left out) must parse to transformers' values,
    dense and MoE, text, RoPE and vision tower (out_hidden_size kept equal to the text hidden size)."""
    mt = "qwen3_5" if kind == "dense" else "qwen3_5_moe"
    hidden = 4096 if kind == "dense" else 2048
    raw = {"model_type": mt, "text_config": {"model_type": mt + "_text"},
           "vision_config": {"out_hidden_size": hidden}}
    hc = hf_text_config(json.loads(json.dumps(raw)))
    ht, hv, mc = hc.text_config, hc.vision_config, parse_config(raw)
    t = mc.text
    for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
              "linear_value_head_dim", "linear_conv_kernel_dim", "rms_norm_eps") + (
            ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
            if kind == "moe" else ("intermediate_size",)):
        assert getattr(t, f) == getattr(ht, f), f
    assert t.layer_types == tuple(ht.layer_types) and t.moe == (kind == "moe")
    assert t.rope_theta == ht.rope_parameters["rope_theta"] == 10000.0
    assert t.partial_rotary_factor == ht.rope_parameters["partial_rotary_factor"]
    assert mc.tied is hc.tie_word_embeddings is False
    for f in ("depth", "hidden_size", "intermediate_size", "num_heads", "patch_size", "temporal_patch_size",
              "spatial_merge_size", "num_position_embeddings", "in_channels", "hidden_act"):
        assert getattr(mc.vision, f) == getattr(hv, f), f
    for f in ("image_token_id", "video_token_id", "vision_start_token_id", "vision_end_token_id"):
        assert getattr(mc, f) == getattr(hc, f), f


def test_flat_text_config_rope_theta_default():
    """A text-only (Qwen3_5ForCausalLM) config without rope_theta must also take transformers' 10000."""
    rope = {k: v for k, v in TEXT["rope_parameters"].items() if k != "rope_theta"}
    raw = {**TEXT, "model_type": "qwen3_5_text", "rope_parameters": rope}
    assert parse_config(raw).text.rope_theta == hf_text_config(raw).rope_parameters["rope_theta"] == 10000.0


def test_index_naming_the_wrong_shard_says_so(tmp_path):
    """An index that names, for a tensor, a shard not holding it must be refused naming the shard, the tensor and the
    stale index (was reported as a truncated or corrupt file)."""
    d = tmp_path / "sh"
    m, _ = tiny_checkpoint("dense")
    m.save_pretrained(d, max_shard_size="200KB")
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    key = LM + "layers.6.mlp.down_proj.weight"
    wrong = next(f for f in sorted(set(idx["weight_map"].values())) if f != idx["weight_map"][key])
    idx["weight_map"][key] = wrong
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(ConfigError, match=rf"{wrong}: holds no tensor '{key}', but model\.safetensors\.index\.json "
                                          r"names this shard for it; the index is stale"):
        SafetensorsSource(d).get("layers.6.mlp.down_proj.weight", torch.float32)


def test_mtp_tensors_are_ignored(tmp_path):
    """mtp.* tensors (released Qwen3.5 checkpoints carry them; transformers ignores them) must be neither refused nor
    read, and the tokens stay transformers'."""
    d = variant(tmp_path, lambda raw: raw["text_config"].update(mtp_num_hidden_layers=1))
    sd = load_file(d / "model.safetensors")
    H = TEXT["hidden_size"]
    sd.update({"mtp.fc.weight": torch.randn(H, 2 * H), "mtp.norm.weight": torch.randn(H),
               "mtp.layers.0.self_attn.q_proj.weight": torch.randn(7, 3)})
    save_file(sd, d / "model.safetensors")
    src = SafetensorsSource(d)
    assert_parity(d)
    StageModel(src.config, 0, 8, intake=True, primary=True).load(src)
    assert not any(n.startswith("mtp") for n in src.read_names)



def test_generation_config_eos_ids_end_requests_too(tmp_path):
    """generation_config.json's eos ids are stop ids beside config.json's (transformers' generate and vLLM stop on
    them; a chat model may list <|im_end|> there only); one that is not a token id, or a file that is not an
    object, is refused naming generation_config.json."""
    from memra_pp.model.config import load_config
    d = variant(tmp_path, lambda raw: None)
    base = load_config(d).eos_token_ids
    gen = json.loads((d / "generation_config.json").read_text())
    gen["eos_token_id"] = [7, *base]
    (d / "generation_config.json").write_text(json.dumps(gen))
    assert load_config(d).eos_token_ids == (*base, 7)
    for bad, msg in (({"eos_token_id": 10 ** 9}, r"generation_config.json: eos_token_id .* must be a token id"),
                     ([1], r"generation_config.json: must be a JSON object")):
        (d / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=msg):
            load_config(d)
    (d / "generation_config.json").unlink()
    assert load_config(d).eos_token_ids == base
