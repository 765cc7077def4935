"""Test helper: write qwen35 / qwen35moe GGUF files from transformers weights exactly as llama.cpp's converter does
(fixtures/qwen35-tiny/README.md: names, value transforms, metadata including the keys a loader must not trust).
"""
from __future__ import annotations

import re
from pathlib import Path

import gguf
import numpy as np
import torch

from memra_pp.model.config import ModelConfig, load_config, parse_config

Q = gguf.GGMLQuantizationType
QTYPES = {"F32": Q.F32, "F16": Q.F16, "Q8_0": Q.Q8_0}
FILE_TYPES = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
              "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}

# canonical suffix -> (GGUF name, converter transform); written independently of the loader's table on purpose
NAMES = {
    "embed_tokens.weight": "token_embd.weight", "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "post_attention_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight", "self_attn.k_norm.weight": "attn_k_norm.weight",
    "linear_attn.in_proj_qkv.weight": "attn_qkv.weight", "linear_attn.in_proj_z.weight": "attn_gate.weight",
    "linear_attn.in_proj_b.weight": "ssm_beta.weight", "linear_attn.in_proj_a.weight": "ssm_alpha.weight",
    "linear_attn.conv1d.weight": "ssm_conv1d.weight", "linear_attn.A_log": "ssm_a",
    "linear_attn.dt_bias": "ssm_dt.bias", "linear_attn.norm.weight": "ssm_norm.weight",
    "linear_attn.out_proj.weight": "ssm_out.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight", "mlp.gate.weight": "ffn_gate_inp.weight",
    "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp.weight",
    "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp.weight",
    "mlp.shared_expert.up_proj.weight": "ffn_up_shexp.weight",
    "mlp.shared_expert.down_proj.weight": "ffn_down_shexp.weight",
    "mlp.experts.down_proj": "ffn_down_exps.weight", "mlp.experts.gate_up_proj": "ffn_gate_up_exps.weight",
}
PLUS_ONE = ("norm.weight", "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_norm.weight",
            "self_attn.k_norm.weight")
KEEP_F32 = ("ssm_a", "ssm_dt.bias", "ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")


def canonical_state_dict(sd: dict, tied: bool = False) -> dict[str, torch.Tensor]:
    """HF keys -> canonical names: prefix stripped, per-expert keys stacked (E, 2I, H) / (E, H, I), vision dropped."""
    out, experts = {}, {}
    for k, v in sd.items():
        if k.startswith(("model.visual.", "mtp.")):
            continue
        k = re.sub(r"^model\.(language_model\.)?", "", k)
        m = re.fullmatch(r"(layers\.\d+\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight", k)
        if m:
            experts.setdefault(m[1], {})[int(m[2]), m[3]] = v
            continue
        out[k] = v.detach().float()
    for base, d in experts.items():
        n = 1 + max(e for e, _ in d)
        out[base + ".gate_up_proj"] = torch.stack([torch.cat([d[e, "gate"], d[e, "up"]]) for e in range(n)]).float()
        out[base + ".down_proj"] = torch.stack([d[e, "down"] for e in range(n)]).float()
    if tied:
        out.pop("lm_head.weight", None)
    return out


def tile_v(t: torch.Tensor, nk: int, nv: int, dim: int) -> torch.Tensor:
    """The converter's reorder: HF v-head g*r+j goes to GGUF slot j*nk+g along `dim`."""
    t = t.movedim(dim, 0)
    rest = t.shape[1:]
    t = t.reshape(nk, nv // nk, -1, *rest).transpose(0, 1).reshape(-1, *rest)
    return t.movedim(0, dim).contiguous()


def gguf_tensors(canon: dict[str, torch.Tensor], cfg: ModelConfig, fuse_gate_up: bool = False) -> dict:
    """GGUF name -> (float32 array in torch order, must stay F32), with the converter's value transforms applied."""
    c = cfg.text
    nk, nv, qk = c.linear_num_key_heads, c.linear_num_value_heads, 2 * c.linear_num_key_heads * c.linear_key_head_dim
    out = {}
    for name, t in canon.items():
        m = re.fullmatch(r"layers\.(\d+)\.(.+)", name)
        suffix, prefix = (m[2], f"blk.{m[1]}.") if m else (name, "")
        t = t.detach().float().clone()
        if suffix in PLUS_ONE:
            t = t + 1
        elif suffix == "linear_attn.A_log":
            t = -torch.exp(tile_v(t, nk, nv, 0))
        elif suffix in ("linear_attn.dt_bias", "linear_attn.in_proj_z.weight", "linear_attn.in_proj_a.weight",
                        "linear_attn.in_proj_b.weight"):
            t = tile_v(t, nk, nv, 0)
        elif suffix == "linear_attn.out_proj.weight":
            t = tile_v(t, nk, nv, 1)
        elif suffix in ("linear_attn.in_proj_qkv.weight", "linear_attn.conv1d.weight"):
            t = torch.cat([t[:qk], tile_v(t[qk:], nk, nv, 0)]).squeeze(1)
        elif suffix == "mlp.experts.gate_up_proj" and not fuse_gate_up:
            gate, up = t.chunk(2, dim=1)
            out[prefix + "ffn_gate_exps.weight"], out[prefix + "ffn_up_exps.weight"] = (gate.numpy(), False), \
                (up.contiguous().numpy(), False)
            continue
        gname = NAMES[suffix]
        out[prefix + gname] = (t.contiguous().numpy(), t.ndim == 1 or gname in KEEP_F32)
    return out


def _add(w: gguf.GGUFWriter, name: str, a: np.ndarray, keep_f32: bool, qtype: str) -> None:
    if keep_f32 or qtype == "F32":
        w.add_tensor(name, a.astype(np.float32))
    elif qtype == "F16" or a.shape[-1] % 32:  # Q8_0 blocks run along rows: short rows fall back to F16
        w.add_tensor(name, a.astype(np.float16))
    else:
        w.add_tensor(name, gguf.quants.quantize(a, Q.Q8_0), raw_dtype=Q.Q8_0)


def write_gguf(model_or_sd, config, path, qtype: str = "F32", fuse_gate_up: bool = False,
               eos_token_id: int | None = None, tensor_hook=None, rope_scaling: str | None = None) -> Path:
    """Write a GGUF as llama.cpp's converter would. `config`: ModelConfig, HF config object or dict.

    `tensor_hook(gguf_name, array) -> array | (raw, qtype) | None` lets refusal tests reshape a tensor, write it
    as raw bytes of another type, or drop it (None). `rope_scaling`: a rope.scaling.type to write ("yarn", ...).
    """
    if not isinstance(config, ModelConfig):
        config = parse_config(config if isinstance(config, dict) else config.to_dict(), "test config")
    sd = model_or_sd.state_dict() if hasattr(model_or_sd, "state_dict") else model_or_sd
    c, moe = config.text, config.text.moe
    arch = "qwen35moe" if moe else "qwen35"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_type("model")
    w.add_name("memra-test")
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    if not moe:
        w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_sections(list(c.mrope_section) + [0] * (4 - len(c.mrope_section)))
    w.add_rope_freq_base(c.rope_theta)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    if moe:
        w.add_expert_count(c.num_experts)
        w.add_expert_used_count(c.num_experts_per_tok)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_file_type(FILE_TYPES[qtype])
    if moe:
        w.add_expert_feed_forward_length(c.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    w.add_ssm_conv_kernel(c.linear_conv_kernel_dim)
    w.add_ssm_state_size(c.linear_key_head_dim)
    w.add_ssm_group_count(c.linear_num_key_heads)
    w.add_ssm_time_step_rank(c.linear_num_value_heads)
    w.add_ssm_inner_size(c.linear_num_value_heads * c.linear_value_head_dim)
    # The converter's two untrustworthy keys: the interval is 4 whatever layer_types says, and the rotary
    # dim comes from a top-level partial_rotary_factor transformers 5 does not have (so the 0.25 default).
    w.add_full_attention_interval(4)
    w.add_rope_dimension_count(int(c.head_dim * 0.25))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if rope_scaling is not None:
        w.add_rope_scaling_type(gguf.RopeScalingType(rope_scaling))
    eos = eos_token_id if eos_token_id is not None else (config.eos_token_ids or (None,))[0]
    if eos is not None:
        w.add_eos_token_id(int(eos))
    for name, (a, keep) in gguf_tensors(canonical_state_dict(sd, config.tied), config, fuse_gate_up).items():
        if tensor_hook is not None:
            a = tensor_hook(name, a)
            if a is None:
                continue
            if isinstance(a, tuple):  # (raw bytes in byte shape, GGMLQuantizationType): written as given
                w.add_tensor(name, a[0], raw_dtype=a[1])
                continue
        _add(w, name, a, keep, qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def gguf_from_hf_dir(hf_dir, out, qtype: str = "F32", fuse_gate_up: bool = False) -> Path:
    """A checkpoint directory written by save_pretrained (config.json + safetensors) -> one GGUF file at `out`."""
    from safetensors.torch import load_file
    hf_dir = Path(hf_dir)
    sd = {}
    for f in sorted(hf_dir.glob("*.safetensors")):
        sd.update(load_file(f))
    return write_gguf(sd, load_config(hf_dir), out, qtype, fuse_gate_up)
