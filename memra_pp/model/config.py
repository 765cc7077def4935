"""Qwen3.5 model configuration read from a Hugging Face ``config.json`` (nested ``text_config`` or flat)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from ..errors import ConfigError

TEXT_TYPES = {"qwen3_5": False, "qwen3_5_text": False, "qwen3_5_moe": True, "qwen3_5_moe_text": True}
LINEAR, FULL = "linear_attention", "full_attention"


@dataclasses.dataclass(frozen=True)
class TextConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    layer_types: tuple[str, ...]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    mrope_section: tuple[int, ...] = (11, 11, 10)
    mrope_interleaved: bool = True
    intermediate_size: int = 0          # dense only
    moe: bool = False
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 262144

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def conv_dim(self) -> int:
        """C = 2*nk*dk + nv*dv, the channels of the depthwise conv."""
        return 2 * self.linear_num_key_heads * self.linear_key_head_dim + \
            self.linear_num_value_heads * self.linear_value_head_dim

    def is_full(self, layer: int) -> bool:
        return self.layer_types[layer] == FULL

    def validate(self, where: str = "config.json") -> "TextConfig":
        def bad(key, msg):
            raise ConfigError(f"{where}: {key} {msg}")
        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                  "head_dim", "linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                  "linear_value_head_dim", "linear_conv_kernel_dim"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) <= 0:
                bad(f, f"must be a positive integer, got {getattr(self, f)!r}")
        if len(self.layer_types) != self.num_hidden_layers:
            bad("layer_types", f"has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        for i, t in enumerate(self.layer_types):
            if t not in (LINEAR, FULL):
                bad(f"layer_types[{i}]", f"is {t!r}; expected {LINEAR!r} or {FULL!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            bad("num_attention_heads", f"({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            bad("linear_num_value_heads", f"({self.linear_num_value_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.linear_num_key_heads})")
        if 2 * sum(self.mrope_section) != self.rotary_dim:
            bad("rope_parameters.mrope_section", f"{list(self.mrope_section)} must sum to rotary_dim/2 = "
                f"{self.rotary_dim // 2} (head_dim {self.head_dim} x partial_rotary_factor "
                f"{self.partial_rotary_factor} / 2)")
        if self.moe:
            for f in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                if getattr(self, f) <= 0:
                    bad(f, f"must be positive for a MoE model, got {getattr(self, f)!r}")
        elif self.intermediate_size <= 0:
            bad("intermediate_size", f"must be positive for a dense model, got {self.intermediate_size!r}")
        return self


@dataclasses.dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    patch_size: int
    temporal_patch_size: int
    spatial_merge_size: int
    out_hidden_size: int
    num_position_embeddings: int
    in_channels: int = 3
    hidden_act: str = "gelu_pytorch_tanh"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything a stage needs to know about the model, independent of where its weights come from."""
    model_type: str
    text: TextConfig
    vision: VisionConfig | None = None
    image_token_id: int | None = None
    video_token_id: int | None = None
    vision_start_token_id: int | None = None
    vision_end_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def tied(self) -> bool:
        return self.text.tie_word_embeddings


def _take(d: dict, cls, where: str, **extra):
    names = {f.name for f in dataclasses.fields(cls)}
    kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}
    kw.update(extra)
    try:
        return cls(**kw)
    except TypeError as e:
        raise ConfigError(f"{where}: {e}") from None


def _eos(v) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(v) if isinstance(v, (list, tuple)) else (int(v),)


# Config keys that choose the text model's math, and the values this runtime implements (DESIGN law 2: a value it
# does not implement is refused, never run as the default): the key, its accepted values
TEXT_MODES = {"hidden_act": ("silu",), "attention_bias": (False,)}
ROPE_TYPES = ("default", "mrope")     # mrope: Qwen2-VL's rope_scaling spelling of the same sections; no YaRN etc.


def _check_modes(text: dict, rope: dict, rope_key: str, prefix: str, where: str) -> None:
    for key, ok in TEXT_MODES.items():
        if text.get(key) is not None and text[key] not in ok:
            raise ConfigError(f"{where}: {prefix}{key} {text[key]!r} is not supported; this runtime implements "
                              f"{' or '.join(map(repr, ok))}")
    kind = rope.get("rope_type", rope.get("type"))
    if kind is not None and kind not in ROPE_TYPES:
        raise ConfigError(f"{where}: {prefix}{rope_key}.rope_type {kind!r} is not supported; this runtime implements "
                          f"{' or '.join(map(repr, ROPE_TYPES))} RoPE (no scaling such as YaRN): remove the scaling "
                          f"or use a checkpoint without it")


def parse_config(raw: dict, where: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from the dict of a Hugging Face config.json; refuses unknown model types."""
    mtype = raw.get("model_type")
    text = raw.get("text_config")
    if text is None:
        text = raw
    ttype = text.get("model_type", mtype)
    if mtype not in TEXT_TYPES and ttype not in TEXT_TYPES:
        raise ConfigError(f"{where}: model_type {mtype!r} is not a Qwen3.5 model; supported: "
                          f"{sorted(TEXT_TYPES)}")
    moe = TEXT_TYPES.get(ttype, TEXT_TYPES.get(mtype))
    prefix = "text_config." if raw.get("text_config") is not None else ""
    text = dict(text)
    rope_key = "rope_parameters" if text.get("rope_parameters") else "rope_scaling"
    rope = text.pop("rope_parameters", None) or text.pop("rope_scaling", None) or {}
    _check_modes(text, rope, rope_key, prefix, where)
    n = text.get("num_hidden_layers")
    if "layer_types" not in text and isinstance(n, int):
        every = text.get("full_attention_interval", 4)
        text["layer_types"] = [FULL if (i + 1) % every == 0 else LINEAR for i in range(n)]
    extra = dict(moe=moe)
    if "rope_theta" in rope or "rope_theta" in text:
        extra["rope_theta"] = float(rope.get("rope_theta", text.get("rope_theta")))
    if "partial_rotary_factor" in rope or "partial_rotary_factor" in text:
        extra["partial_rotary_factor"] = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor")))
    if rope.get("mrope_section"):
        extra["mrope_section"] = tuple(rope["mrope_section"])
    if "mrope_interleaved" in rope:
        extra["mrope_interleaved"] = bool(rope["mrope_interleaved"])
    # The VLM's top-level tie_word_embeddings decides tying (reference/qwen35.md 2.6).
    tie = raw.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    extra["tie_word_embeddings"] = bool(tie)
    for k in ("rope_theta", "partial_rotary_factor", "tie_word_embeddings", "moe"):
        text.pop(k, None)
    tc = _take(text, TextConfig, where, **extra).validate(where)
    vis = raw.get("vision_config")
    vc = _take(vis, VisionConfig, where + " vision_config") if vis else None
    if vc is not None and vc.out_hidden_size != tc.hidden_size:
        raise ConfigError(f"{where}: vision_config.out_hidden_size {vc.out_hidden_size} must equal the text "
                          f"hidden_size {tc.hidden_size}")
    eos = raw.get("eos_token_id", text.get("eos_token_id"))
    return ModelConfig(model_type=mtype or ttype, text=tc, vision=vc,
                       image_token_id=raw.get("image_token_id"), video_token_id=raw.get("video_token_id"),
                       vision_start_token_id=raw.get("vision_start_token_id"),
                       vision_end_token_id=raw.get("vision_end_token_id"), eos_token_ids=_eos(eos))


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir).expanduser() / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json in the model directory") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON ({e})") from None
    return parse_config(raw, str(path))
