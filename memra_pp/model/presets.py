"""Config presets of the released Qwen3.5 sizes, for `format: dummy` benchmarks (no checkpoint needed)."""
from __future__ import annotations

from ..errors import ConfigError

_ROPE = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
             mrope_interleaved=True)

PRESETS = {
    "qwen3.5-27b": dict(model_type="qwen3_5", text_config=dict(
        model_type="qwen3_5_text", vocab_size=248320, hidden_size=5120, num_hidden_layers=64,
        intermediate_size=17408, num_attention_heads=24, num_key_value_heads=4, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, rope_parameters=_ROPE, full_attention_interval=4), tie_word_embeddings=False,
        eos_token_id=248044),
    "qwen3.5-35b-a3b": dict(model_type="qwen3_5_moe", text_config=dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
        num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        rope_parameters=_ROPE, full_attention_interval=4), tie_word_embeddings=False, eos_token_id=248044),
}


def get(name: str) -> dict:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"model.path preset:{name} is unknown; presets: {sorted(PRESETS)}") from None
