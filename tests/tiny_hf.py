"""Tiny random Qwen3.5 models built with transformers, every weight perturbed (reference/qwen35.md 5)."""
from __future__ import annotations

import torch

TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
            linear_conv_kernel_dim=4, rms_norm_eps=1e-6, max_position_embeddings=512,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2,
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True),
            eos_token_id=None, pad_token_id=0, tie_word_embeddings=False)
VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
MM = dict(image_token_id=300, video_token_id=301, vision_start_token_id=302, vision_end_token_id=303)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)


def perturb(m):
    """HF init leaves norms at 0/1 and dt_bias at 1: randomise every weight so parity tests mean something."""
    with torch.no_grad():
        for n, p in m.named_parameters():
            if n.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 8).log())
            else:
                p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.05))
    return m.eval()


def build(kind: str = "dense", tied: bool = False, seed: int = 0, vision: bool = False, **text_overrides):
    """kind: dense | moe. Returns a perturbed float32 transformers model (VLM class, as released)."""
    from transformers import (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5MoeConfig,
                              Qwen3_5MoeForConditionalGeneration)
    torch.manual_seed(seed)
    text = {**TEXT, **text_overrides, "tie_word_embeddings": tied}
    vis = {**VISION, "out_hidden_size": text["hidden_size"]}   # the tower's rows must be text-sized
    if kind == "moe":
        text = {**{k: v for k, v in text.items() if k != "intermediate_size"}, **MOE}
        cfg = Qwen3_5MoeConfig(text_config=text, vision_config=vis, tie_word_embeddings=tied, **MM)
        m = Qwen3_5MoeForConditionalGeneration(cfg)
    else:
        cfg = Qwen3_5Config(text_config=text, vision_config=vis, tie_word_embeddings=tied, **MM)
        m = Qwen3_5ForConditionalGeneration(cfg)
    return perturb(m.float())


def hf_greedy(model, prompt: list[int], max_new_tokens: int):
    """transformers' own greedy generation: (tokens, logprobs of those tokens under the raw distribution)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                           do_sample=False, output_logits=True, return_dict_in_generate=True,
                           eos_token_id=None, pad_token_id=0)
    toks = g.sequences[0, len(prompt):].tolist()
    lps = [float(torch.log_softmax(l[0].float(), -1)[t]) for l, t in zip(g.logits, toks, strict=True)]
    return toks, lps
