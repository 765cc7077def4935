"""Config parsing (issue 2): nested and flat configs agree, layer kinds follow full_attention_interval when absent,
the VLM's top-level tie_word_embeddings decides tying, and bad configs are refused naming the key."""
import pytest

from memra_pp.errors import ConfigError
from memra_pp.model.config import LINEAR, parse_config
from tiny_hf import TEXT


def flat(**over):
    return {**{k: (list(v) if isinstance(v, (list, tuple)) else v) for k, v in TEXT.items()},
            "model_type": "qwen3_5_text", **over}


def test_nested_and_flat_configs_agree():
    """A nested text_config (VLM) and the same dict flat (text-only) must give the same TextConfig."""
    nested = parse_config({"model_type": "qwen3_5", "text_config": flat(), "tie_word_embeddings": False})
    plain = parse_config(flat())
    assert nested.text == plain.text
    assert nested.model_type == "qwen3_5" and plain.model_type == "qwen3_5_text"
    assert nested.text.mrope_section == (2, 1, 1) and nested.text.rotary_dim == 8
    moe = parse_config({"model_type": "qwen3_5_moe", "text_config": {
        **{k: v for k, v in flat().items() if k != "intermediate_size"}, "model_type": "qwen3_5_moe_text",
        "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32}})
    assert moe.text.moe and not nested.text.moe


@pytest.mark.parametrize("interval,full", [(None, [3, 7]), (4, [3, 7]), (2, [1, 3, 5, 7]), (1, list(range(8)))])
def test_layer_types_from_full_attention_interval(interval, full):
    """Without layer_types, layer i must be full attention iff (i+1) % full_attention_interval == 0 (default 4)."""
    raw = flat()
    del raw["layer_types"]
    if interval is not None:
        raw["full_attention_interval"] = interval
    t = parse_config({"model_type": "qwen3_5", "text_config": raw}).text
    assert [i for i in range(8) if t.is_full(i)] == full and len(t.layer_types) == 8


@pytest.mark.parametrize("top,text,tied", [(True, False, True), (False, True, False), (None, True, False),
                                           (None, False, False)])
def test_top_level_tie_word_embeddings_decides(top, text, tied):
    """In a VLM config the top-level tie_word_embeddings alone decides tying, false when absent, as transformers'
    Qwen3_5Config does (the text_config's is not read: tests/test_weights_audit.py compares logits)."""
    raw = {"model_type": "qwen3_5", "text_config": flat(tie_word_embeddings=text)}
    if top is not None:
        raw["tie_word_embeddings"] = top
    assert parse_config(raw).tied is tied


REFUSED = {
    "mrope sum": (dict(rope_parameters=dict(rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[2, 2, 1])),
                  r"rope_parameters\.mrope_section \[2, 2, 1\] must sum to rotary_dim/2 = 4"),
    "nv % nk": (dict(linear_num_value_heads=3),
                r"linear_num_value_heads \(3\) must be a multiple of linear_num_key_heads \(2\)"),
    "heads % kv": (dict(num_key_value_heads=3), r"num_attention_heads \(4\) must be a multiple of num_key_value_heads"),
    "layer_types length": (dict(layer_types=[LINEAR] * 7), r"layer_types has 7 entries for 8 layers"),
    "layer_types value": (dict(layer_types=[LINEAR] * 7 + ["sliding_attention"]),
                          r"layer_types\[7\] is 'sliding_attention'"),
    "dense needs intermediate": (dict(intermediate_size=0), r"intermediate_size must be positive for a dense model"),
    "zero hidden": (dict(hidden_size=0), r"hidden_size must be a positive integer, got 0"),
    # modes this runtime does not implement: refused, never run as the default (DESIGN law 2)
    "yarn": (dict(rope_parameters=dict(rope_type="yarn", factor=4.0, rope_theta=1e7, partial_rotary_factor=0.25,
                                       mrope_section=[2, 1, 1])),
             r"text_config\.rope_parameters\.rope_type 'yarn' is not supported; this runtime implements 'default' "
             r"or 'mrope' RoPE \(no scaling such as YaRN\)"),
    "linear scaling, old spelling": (dict(rope_parameters=None, rope_scaling=dict(type="linear", factor=2.0)),
                                     r"text_config\.rope_scaling\.rope_type 'linear' is not supported"),
    "activation": (dict(hidden_act="gelu"), r"text_config\.hidden_act 'gelu' is not supported; this runtime "
                                            r"implements 'silu'"),
    "attention bias": (dict(attention_bias=True), r"text_config\.attention_bias True is not supported"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_config_refusals_name_the_key(case):
    """An inconsistent config must be refused with a ConfigError naming the file and the key."""
    over, msg = REFUSED[case]
    with pytest.raises(ConfigError, match=r"^/x/config\.json: " + msg):
        parse_config({"model_type": "qwen3_5", "text_config": flat(**over)}, "/x/config.json")


def test_implemented_modes_are_accepted():
    """The values the runtime implements load: silu, no attention bias, default RoPE (and Qwen2-VL's mrope spelling),
    flat configs naming the key without a text_config prefix."""
    assert parse_config({"model_type": "qwen3_5", "text_config": flat(hidden_act="silu", attention_bias=False)})
    assert parse_config(flat(rope_parameters=None, rope_scaling=dict(type="mrope", mrope_section=[2, 1, 1])))
    with pytest.raises(ConfigError, match=r"^/y: hidden_act 'relu' is not supported"):
        parse_config(flat(hidden_act="relu"), "/y")
