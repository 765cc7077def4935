"""GGUF `WeightSource` for llama.cpp's qwen35 / qwen35moe files: undoes the converter's transforms (stage process).

The file is memory-mapped; a tensor is dequantized only when `get` asks for it.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..errors import ConfigError
from .config import FULL, LINEAR, ModelConfig, parse_config
from .gguf_check import gguf_field, open_gguf
from .weights import check_finite, check_shape, expected_shape

if TYPE_CHECKING:   # torch where a tensor is read: launch reads the file's config and names without it
    import torch

ARCHS = {"qwen35": "qwen3_5_text", "qwen35moe": "qwen3_5_moe_text"}

# How a canonical tensor is stored, relative to HF: "norm" = 1 + w; "a_log" = -exp(A_log) with tiled V heads;
# "vrows" / "vcols" = V heads tiled along rows / columns (chunk = rows per head); "qkv" / "conv" = tiled V rows
# after the Q and K rows (conv also squeezed to (C, K)).
_TOP = {"embed_tokens.weight": ("token_embd.weight", None), "norm.weight": ("output_norm.weight", "norm"),
        "lm_head.weight": ("output.weight", None)}
_LAYER = {
    "input_layernorm.weight": ("attn_norm.weight", "norm"),
    "post_attention_layernorm.weight": ("post_attention_norm.weight", "norm"),
    "self_attn.q_proj.weight": ("attn_q.weight", None),
    "self_attn.k_proj.weight": ("attn_k.weight", None),
    "self_attn.v_proj.weight": ("attn_v.weight", None),
    "self_attn.o_proj.weight": ("attn_output.weight", None),
    "self_attn.q_norm.weight": ("attn_q_norm.weight", "norm"),
    "self_attn.k_norm.weight": ("attn_k_norm.weight", "norm"),
    "linear_attn.in_proj_qkv.weight": ("attn_qkv.weight", "qkv"),
    "linear_attn.in_proj_z.weight": ("attn_gate.weight", "vrows"),
    "linear_attn.in_proj_b.weight": ("ssm_beta.weight", "vrows"),
    "linear_attn.in_proj_a.weight": ("ssm_alpha.weight", "vrows"),
    "linear_attn.conv1d.weight": ("ssm_conv1d.weight", "conv"),
    "linear_attn.A_log": ("ssm_a", "a_log"),
    "linear_attn.dt_bias": ("ssm_dt.bias", "vrows"),
    "linear_attn.norm.weight": ("ssm_norm.weight", None),
    "linear_attn.out_proj.weight": ("ssm_out.weight", "vcols"),
    "mlp.gate_proj.weight": ("ffn_gate.weight", None),
    "mlp.up_proj.weight": ("ffn_up.weight", None),
    "mlp.down_proj.weight": ("ffn_down.weight", None),
    "mlp.gate.weight": ("ffn_gate_inp.weight", None),
    "mlp.shared_expert_gate.weight": ("ffn_gate_inp_shexp.weight", "row"),
    "mlp.shared_expert.gate_proj.weight": ("ffn_gate_shexp.weight", None),
    "mlp.shared_expert.up_proj.weight": ("ffn_up_shexp.weight", None),
    "mlp.shared_expert.down_proj.weight": ("ffn_down_shexp.weight", None),
    "mlp.experts.down_proj": ("ffn_down_exps.weight", None),
    "mlp.experts.gate_up_proj": ("ffn_gate_up_exps.weight", None),   # or ffn_gate_exps + ffn_up_exps
}


def _f32(v) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-06, not 9.99999997e-07)."""
    return float(str(np.float32(v)))


def untile_v(t: torch.Tensor, nk: int, nv: int, dim: int) -> torch.Tensor:
    """Tiled V heads (GGUF slot j*nk+g) back to grouped (HF head g*r+j) along `dim`, whose size is nv*chunk."""
    if nk == nv:
        return t
    t = t.movedim(dim, 0)
    rest = t.shape[1:]
    t = t.reshape(nv // nk, nk, -1, *rest).transpose(0, 1).reshape(-1, *rest)
    return t.movedim(0, dim).contiguous()


# llama.cpp's end-of-generation tokens (llama-vocab.cpp): the ids these metadata keys name, and tokens of these texts
EOG_KEYS = ("eos", "eot", "eom", "fim_pad", "fim_rep", "fim_sep")
EOG_TEXTS = frozenset({"<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>",
                       "<|endoftext|>", "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>"})


class GGUFSource:
    """Canonical tensors (docs/ARCHITECTURE.md) from one GGUF file written by llama.cpp's converter."""

    def __init__(self, path: str | Path):
        import gguf
        self.path = Path(path).expanduser()
        self._gguf = gguf
        self._reader = open_gguf(self.path)
        self._tensors = {t.name: t for t in self._reader.tensors}
        self.read_names: list[str] = []
        self.config: ModelConfig = self._build_config()

    # ---- metadata -> ModelConfig --------------------------------------------------------------------------
    def _field(self, key: str, default=KeyError):
        return gguf_field(self._reader, self.path, key, default)

    def _eog_ids(self, vocab: int) -> list | None:
        """The tokens that end generation, as llama.cpp takes them (llama-vocab.cpp's special_eog_ids): the eos,
        eot, eom and fill-in-the-middle ids the metadata names, and every token whose text is an end-of-turn marker
        (a Qwen GGUF's eos is <|endoftext|> or <|im_end|>: the other ends a turn too). The eos comes first."""
        ids = []
        for k in EOG_KEYS:
            v = self._field(f"tokenizer.ggml.{k}_token_id", None)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < vocab):
                raise ConfigError(f"{self.path}: tokenizer.ggml.{k}_token_id {v!r} must be a token id (an integer in "
                                  f"[0, vocab_size {vocab}))")
            ids.append(v)
        tokens = self._field("tokenizer.ggml.tokens", None)
        if isinstance(tokens, list):
            ids += [i for i, t in enumerate(tokens[:vocab]) if t in EOG_TEXTS]
        ids = list(dict.fromkeys(i for i in ids if i is not None))
        return ids or None

    def _int(self, key: str, default=KeyError, lo: int = 1) -> int:
        v = self._field(key, default)
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:     # not int(): 2.5 blocks is not 2
            raise ConfigError(f"{self.path}: GGUF metadata key {key!r} must be an integer >= {lo}, got {v!r}")
        return v

    def _real(self, key: str) -> float:
        v = self._field(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)):   # (its range: TextConfig.validate's check)
            raise ConfigError(f"{self.path}: GGUF metadata key {key!r} must be a number, got {v!r}")
        return _f32(v)

    def _check_blocks(self, count: int, key: str) -> None:
        """Every blk.N tensor below block_count, but MTP blocks (blk.N.nextn.*): a smaller count drops layers."""
        mtp = {m[1] for t in self._tensors if (m := re.match(r"blk\.(\d+)\.nextn\.", t))}
        for t in self._tensors:
            m = re.match(r"blk\.(\d+)\.", t)
            if m and int(m[1]) >= count and m[1] not in mtp:
                raise ConfigError(f"{self.path}: tensor {t!r} is past the last block: {key} is {count}; the "
                                  f"metadata undercounts the layers (fix {key})")

    def _build_config(self) -> ModelConfig:
        arch = self._field("general.architecture")
        if not isinstance(arch, str) or arch not in ARCHS:
            raise ConfigError(f"{self.path}: GGUF architecture {arch!r} is not supported; expected one of "
                              f"{sorted(ARCHS)} (Qwen3.5 dense / MoE as written by llama.cpp's converter)")

        def k(key, default=KeyError, lo=1):
            return self._int(f"{arch}.{key}", default, lo)
        # MTP blocks, when written, are appended after the decoder layers (blk.{n_layer}.nextn.*).
        count = k("block_count")
        self._check_blocks(count, f"{arch}.block_count")
        n = count - k("nextn_predict_layers", 0, lo=0)
        layer_types = []
        for i in range(n):  # full_attention_interval is written as 4 whatever the layout: read the tensors
            if f"blk.{i}.attn_q.weight" in self._tensors:
                layer_types.append(FULL)
            elif f"blk.{i}.attn_qkv.weight" in self._tensors or f"blk.{i}.ssm_a" in self._tensors:
                layer_types.append(LINEAR)
            else:
                raise ConfigError(f"{self.path}: block {i} has neither blk.{i}.attn_q.weight (full attention) "
                                  f"nor blk.{i}.attn_qkv.weight / blk.{i}.ssm_a (linear attention)")
        emb = self._tensors.get("token_embd.weight")
        if emb is None:
            raise ConfigError(f"{self.path}: tensor 'token_embd.weight' is missing")
        if len(emb.shape) != 2:
            raise ConfigError(f"{self.path}: tensor 'token_embd.weight' has shape "
                              f"{tuple(int(d) for d in reversed(emb.shape.tolist()))}, expected (vocab, hidden)")
        head_dim, nv = k("attention.key_length"), k("ssm.time_step_rank")
        # rope.dimension_count is computed from a key transformers 5 nests elsewhere: the sections are the truth.
        sections = self._field(f"{arch}.rope.dimension_sections")
        if not isinstance(sections, list) or not all(isinstance(s, int) and not isinstance(s, bool)
                                                      for s in sections):
            raise ConfigError(f"{self.path}: GGUF metadata key '{arch}.rope.dimension_sections' must be an array of "
                              f"integers (T, H, W, 0), got {sections!r}")
        while len(sections) > 3 and sections[-1] == 0:     # llama.cpp pads the three sections with a 0
            sections.pop()
        inner = k("ssm.inner_size")
        if inner % nv:
            raise ConfigError(f"{self.path}: GGUF metadata key '{arch}.ssm.inner_size' ({inner}) must be a multiple "
                              f"of '{arch}.ssm.time_step_rank' ({nv})")
        scaling = str(self._field(f"{arch}.rope.scaling.type", "none"))  # llama.cpp's: none, linear, yarn, ...
        #                                                                  (parse_config refuses any scaling)
        text = dict(
            model_type=ARCHS[arch], vocab_size=int(emb.shape[1]), hidden_size=k("embedding_length"),
            num_hidden_layers=n, num_attention_heads=k("attention.head_count"),
            num_key_value_heads=k("attention.head_count_kv"), head_dim=head_dim,
            linear_num_key_heads=k("ssm.group_count"), linear_num_value_heads=nv,
            linear_key_head_dim=k("ssm.state_size"), linear_value_head_dim=inner // nv,
            linear_conv_kernel_dim=k("ssm.conv_kernel"), layer_types=layer_types,
            rms_norm_eps=self._real(f"{arch}.attention.layer_norm_rms_epsilon"),
            max_position_embeddings=k("context_length", 262144),
            rope_parameters=dict(rope_theta=self._real(f"{arch}.rope.freq_base"), mrope_section=sections,
                                 partial_rotary_factor=2 * sum(sections) / head_dim, mrope_interleaved=True,
                                 rope_type="default" if scaling == "none" else scaling),
            tie_word_embeddings="output.weight" not in self._tensors,
            eos_token_id=self._eog_ids(int(emb.shape[1])))
        if arch == "qwen35moe":
            text.update(num_experts=k("expert_count"), num_experts_per_tok=k("expert_used_count"),
                        moe_intermediate_size=k("expert_feed_forward_length"),
                        shared_expert_intermediate_size=k("expert_shared_feed_forward_length", 0, lo=0))
        else:
            text["intermediate_size"] = k("feed_forward_length")
        return parse_config(text, str(self.path))

    # ---- tensors ----------------------------------------------------------------------------------------
    def _locate(self, name: str) -> tuple[str, str | None, str]:
        """(GGUF tensor name, transform, canonical suffix) for a canonical name; ConfigError if unknown."""
        if name in _TOP:
            return (*_TOP[name], name)
        parts = name.split(".", 2)
        if len(parts) == 3 and parts[0] == "layers" and parts[1].isdigit() and parts[2] in _LAYER:
            gname, how = _LAYER[parts[2]]
            return f"blk.{parts[1]}.{gname}", how, parts[2]
        raise ConfigError(f"{self.path}: no GGUF tensor corresponds to canonical name {name!r}")

    def has(self, name: str) -> bool:
        try:
            gname, _, suffix = self._locate(name)
        except ConfigError:
            return False
        if suffix == "mlp.experts.gate_up_proj" and gname not in self._tensors:
            base = gname.rsplit(".", 2)[0]
            return f"{base}.ffn_gate_exps.weight" in self._tensors and f"{base}.ffn_up_exps.weight" in self._tensors
        return gname in self._tensors

    def _load(self, gname: str, name: str) -> torch.Tensor:
        """One GGUF tensor dequantized to float32, in torch order (GGUF `ne` is the reverse)."""
        t = self._tensors.get(gname)
        if t is None:
            raise ConfigError(f"{self.path}: tensor {gname!r} (canonical {name!r}) is missing from the GGUF file")
        try:
            a = self._gguf.quants.dequantize(t.data, t.tensor_type)
        except NotImplementedError:
            raise ConfigError(f"{self.path}: tensor {gname!r} has type {t.tensor_type.name}, which gguf-py cannot "
                              f"dequantize; re-quantize the model to a supported type (F16, BF16, Q8_0, Q*_K, ...)"
                              ) from None
        import torch
        want = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF ne order is the reverse of torch's
        # F32 dequantizes to a view of the read-only mmap: copy it; other types already produced a new array.
        a = a.copy() if t.tensor_type == self._gguf.GGMLQuantizationType.F32 else np.asarray(a, np.float32)
        return torch.from_numpy(a.reshape(want))

    def get(self, name: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        import torch
        gname, how, suffix = self._locate(name)
        if suffix == "lm_head.weight" and self.config.tied:
            raise ConfigError(f"{self.path}: tensor 'output.weight' (canonical 'lm_head.weight') is missing: the "
                              f"model is tied, use embed_tokens.weight")
        if suffix == "mlp.experts.gate_up_proj" and gname not in self._tensors:
            t = torch.cat([self._half(f"{gname.rsplit('.', 2)[0]}.ffn_{p}_exps.weight", name) for p in ("gate", "up")],
                          dim=1)
        else:
            t = self._load(gname, name)
        try:
            t = self._undo(t, how, name)
        except RuntimeError:  # a view/reshape that does not fit: report it as the shape error it is
            raise ConfigError(f"{self.path}: tensor {gname!r} (canonical {name!r}) has shape {tuple(t.shape)}, "
                              f"the config needs {expected_shape(name, self.config.text)}") from None
        check_shape(name, t, self.config.text, f"{self.path}: GGUF tensor {gname!r}")
        self.read_names.append(name)
        return check_finite(name, t, t.to(device=device, dtype=dtype), f"{self.path}: GGUF tensor {gname!r}")

    def _half(self, gname: str, name: str) -> torch.Tensor:
        """ffn_gate_exps or ffn_up_exps, shape-checked before the two are joined (a 63 + 65 split is not 2 x 64)."""
        c = self.config.text
        t, want = self._load(gname, name), (c.num_experts, c.moe_intermediate_size, c.hidden_size)
        if tuple(t.shape) != want:
            raise ConfigError(f"{self.path}: tensor {gname!r} (half of canonical {name!r}) has shape "
                              f"{tuple(t.shape)}, the config needs {want}")
        return t

    def _undo(self, t: torch.Tensor, how: str | None, name: str) -> torch.Tensor:
        c = self.config.text
        nk, nv = c.linear_num_key_heads, c.linear_num_value_heads
        if how is None:
            return t
        if how == "norm":
            return t - 1.0
        if how == "row":
            return t.reshape(1, -1)
        if how == "a_log":
            if not bool((t < 0).all()):      # (NaN too: it is neither)
                raise ConfigError(f"{self.path}: tensor for {name!r} (ssm_a = -exp(A_log)) has non-negative "
                                  f"or NaN entries; the file is corrupt or not from the llama.cpp converter")
            return untile_v((-t.double()).log().float(), nk, nv, 0)
        if how == "vrows":
            return untile_v(t, nk, nv, 0)
        if how == "vcols":
            return untile_v(t, nk, nv, 1)
        import torch
        qk = 2 * nk * c.linear_key_head_dim   # "qkv" / "conv": Q and K rows as they are, V rows tiled
        if t.shape[0] != c.conv_dim:
            raise RuntimeError("channel count")  # reported by get() as a shape error
        t = torch.cat([t[:qk], untile_v(t[qk:], nk, nv, 0)], 0)
        return t.unsqueeze(1) if how == "conv" else t
