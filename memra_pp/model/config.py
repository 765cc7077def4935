"""Qwen3.5 model configuration read from a Hugging Face ``config.json`` (nested ``text_config`` or flat)."""
from __future__ import annotations

import dataclasses
import json
import math
import warnings
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
                  "linear_value_head_dim", "linear_conv_kernel_dim", "max_position_embeddings"):
            if not _is_int(getattr(self, f)) or getattr(self, f) <= 0:
                bad(f, f"must be a positive integer, got {getattr(self, f)!r}")
        for f in ("intermediate_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                  "shared_expert_intermediate_size"):     # 0: unused by this kind of model (dense or MoE)
            if not _is_int(getattr(self, f)) or getattr(self, f) < 0:
                bad(f, f"must be an integer >= 0, got {getattr(self, f)!r}")
        for f in ("rms_norm_eps", "rope_theta", "partial_rotary_factor"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not (math.isfinite(v) and v > 0):
                bad(f, f"must be a finite positive number, got {v!r}")
        if self.partial_rotary_factor > 1:
            bad("partial_rotary_factor", f"must be in (0, 1] (the rotated fraction of head_dim), got "
                f"{self.partial_rotary_factor!r}")
        for f in ("mrope_interleaved", "tie_word_embeddings"):
            if not isinstance(getattr(self, f), bool):
                bad(f, f"must be true or false, got {getattr(self, f)!r}")
        if not isinstance(self.layer_types, tuple):
            bad("layer_types", f"must be a list of {LINEAR!r} / {FULL!r}, one per layer, got {self.layer_types!r}")
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
        sec = self.mrope_section
        if not isinstance(sec, tuple) or len(sec) != 3 or not all(_is_int(x) and x >= 0 for x in sec):
            bad("rope_parameters.mrope_section", f"must be three integers >= 0 (the T, H, W sections), got "
                f"{list(sec) if isinstance(sec, tuple) else sec!r}")
        if 2 * sum(self.mrope_section) != self.rotary_dim:
            bad("rope_parameters.mrope_section", f"{list(self.mrope_section)} must sum to rotary_dim/2 = "
                f"{self.rotary_dim // 2} (head_dim {self.head_dim} x partial_rotary_factor "
                f"{self.partial_rotary_factor} / 2)")
        if self.moe:
            for f in ("num_experts", "num_experts_per_tok", "moe_intermediate_size"):
                if getattr(self, f) <= 0:
                    bad(f, f"must be positive for a MoE model, got {getattr(self, f)!r}")
            if self.num_experts_per_tok > self.num_experts:
                bad("num_experts_per_tok", f"({self.num_experts_per_tok}) must be at most num_experts "
                    f"({self.num_experts})")
        elif self.intermediate_size <= 0:
            bad("intermediate_size", f"must be positive for a dense model, got {self.intermediate_size!r}")
        return self


def _is_int(v) -> bool:
    """A JSON integer: bool is an int to Python (True == 1) but never a count here."""
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


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
    rope_theta: float = 10000.0     # vision_config.rope_parameters.rope_theta (the axial rope's base)

    def validate(self, where: str = "config.json") -> "VisionConfig":
        t = self.rope_theta
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t <= 1:
            raise ConfigError(f"{where}: vision_config.rope_parameters.rope_theta must be a finite number above 1, "
                              f"got {t!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name not in ("hidden_act", "rope_theta") and (not _is_int(v) or v <= 0):
                raise ConfigError(f"{where}: vision_config.{f.name} must be a positive integer, got {v!r}")
        if not isinstance(self.hidden_act, str):
            raise ConfigError(f"{where}: vision_config.hidden_act must be a string, got {self.hidden_act!r}")
        if math.isqrt(self.num_position_embeddings) ** 2 != self.num_position_embeddings:
            raise ConfigError(f"{where}: vision_config.num_position_embeddings {self.num_position_embeddings} must "
                              "be a square (the learned grid is side x side)")
        return self


@dataclasses.dataclass(frozen=True)
class PixelSpec:
    """How an input is sized and normalised. Defaults are Qwen3.5's preprocessor_config.json (Qwen3-VL values); a
    checkpoint's own preprocessor_config.json (video_preprocessor_config.json) gives its values (`from_processor`)."""
    min_pixels: int = 65536             # size.shortest_edge: the resized image has at least this many pixels
    max_pixels: int = 16777216          # size.longest_edge: ... and at most this many (per image, per clip)
    image_mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_std: tuple[float, ...] = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255     # float input in [0, 1] is first rounded to uint8 (x * 255)

    @classmethod
    def from_processor(cls, raw, where: str, default: "PixelSpec", vision: "VisionConfig") -> "PixelSpec":
        """The spec a Hugging Face image processor config gives (Qwen2-VL's min_pixels / max_pixels or Qwen3-VL's
        size.shortest_edge / longest_edge, image_mean, image_std, rescale_factor), `default` for what it leaves
        out. Refused (ConfigError naming the key): a step turned off that this runtime always takes, and a patch,
        temporal patch or merge size other than the vision tower's."""
        if not isinstance(raw, dict):
            raise ConfigError(f"{where}: must hold a JSON object, got {type(raw).__name__}")
        for k in ("do_resize", "do_rescale", "do_normalize", "do_convert_rgb"):
            if raw.get(k) is False:
                raise ConfigError(f"{where}: {k} false is not supported (raw images are always resized, rescaled, "
                                  f"normalised and made RGB, as the model was trained); pass ImageInput rows made "
                                  f"your own way instead")
        for k, mine in (("patch_size", vision.patch_size), ("temporal_patch_size", vision.temporal_patch_size),
                        ("merge_size", vision.spatial_merge_size)):
            if k in raw and raw[k] != mine:
                raise ConfigError(f"{where}: {k} {raw[k]!r} differs from the vision tower's ({mine}, config.json)")
        size = raw.get("size") or {}
        if not isinstance(size, dict):
            raise ConfigError(f"{where}: size must be an object, got {size!r}")

        def first(*vals):
            return next((v for v in vals if v is not None), None)
        mn = first(raw.get("min_pixels"), size.get("shortest_edge"), size.get("min_pixels"), default.min_pixels)
        mx = first(raw.get("max_pixels"), size.get("longest_edge"), size.get("max_pixels"), default.max_pixels)
        for k, v in (("min_pixels (size.shortest_edge)", mn), ("max_pixels (size.longest_edge)", mx)):
            if not _is_int(v) or v <= 0:
                raise ConfigError(f"{where}: {k} must be a positive integer, got {v!r}")
        if mn > mx:
            raise ConfigError(f"{where}: min_pixels {mn} is above max_pixels {mx}")
        n = vision.in_channels

        def channels(k: str, dflt, nonzero: bool) -> tuple:
            v = raw.get(k, dflt)
            v = [v] * n if _is_number(v) else v
            if not isinstance(v, (list, tuple)) or len(v) != n or not all(_is_number(x) and math.isfinite(x) and
                                                                          (x != 0 or not nonzero) for x in v):
                raise ConfigError(f"{where}: {k} must be {n} finite numbers{' (none 0)' if nonzero else ''}, "
                                  f"got {raw.get(k)!r}")
            return tuple(float(x) for x in v)
        r = raw.get("rescale_factor", default.rescale_factor)
        if not _is_number(r) or not math.isfinite(r) or r <= 0:
            raise ConfigError(f"{where}: rescale_factor must be a positive number, got {r!r}")
        return cls(mn, mx, channels("image_mean", default.image_mean, False),
                   channels("image_std", default.image_std, True), float(r))


IMAGE_PIXELS = PixelSpec()
VIDEO_PIXELS = PixelSpec(min_pixels=4096, max_pixels=25165824)   # video_preprocessor_config.json size


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
    image_pixels: PixelSpec = IMAGE_PIXELS      # raw images' sizing and normalisation (preprocessor_config.json)
    video_pixels: PixelSpec = VIDEO_PIXELS      # raw videos' (video_preprocessor_config.json)

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


def _eos(v, key: str, vocab: int, where: str) -> tuple[int, ...]:
    """eos_token_id: null, one token id or a list of them, each in [0, vocab_size)."""
    if v is None:
        return ()
    ids = v if isinstance(v, (list, tuple)) else [v]
    for i in ids:
        if not _is_int(i) or not 0 <= i < vocab:
            raise ConfigError(f"{where}: {key} {v!r} must be a token id (an integer in [0, vocab_size {vocab})) or "
                              f"a list of them")
    return tuple(ids)


def _real(v, key: str, where: str) -> float:
    """A JSON number as a float (its range is TextConfig.validate's check); a string or null is refused here."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{where}: {key} must be a number, got {v!r}")
    try:
        return float(v)
    except OverflowError:       # an integer past float range
        return math.inf


# transformers' values for text config keys a config.json leaves out (Qwen3_5TextConfig / Qwen3_5MoeTextConfig):
# a missing key loads as these there, so here too (by MoE or dense). Not max_position_embeddings (32768 there): it
# changes no math, only the planner's max_context warning, which keeps TextConfig's released-model 262144.
TEXT_DEFAULTS = dict(vocab_size=248320, num_attention_heads=16, head_dim=256, linear_conv_kernel_dim=4,
                     linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                     linear_num_value_heads=32)
TEXT_DEFAULTS_BY_MOE = {False: dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
                                    num_key_value_heads=4),
                        True: dict(hidden_size=2048, num_hidden_layers=40, num_key_value_heads=2, num_experts=256,
                                   num_experts_per_tok=8, moe_intermediate_size=512,
                                   shared_expert_intermediate_size=512)}
# Qwen3_5VisionConfig's and Qwen3_5Config's (the VLM's special tokens) likewise
VISION_DEFAULTS = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, patch_size=16,
                       temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=3584, num_position_embeddings=2304)
VLM_TOKEN_DEFAULTS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                          vision_end_token_id=248054)

# Config keys that choose the text model's math, and the values this runtime implements (DESIGN law 2: a value it
# does not implement is refused, never run as the default): the key, its accepted values
TEXT_MODES = {"hidden_act": ("silu",), "attention_bias": (False,)}
ROPE_TYPES = ("default", "mrope")     # mrope: Qwen2-VL's rope_scaling spelling of the same sections; no YaRN etc.


def _check_modes(raw: dict, text: dict, prefix: str, where: str) -> None:
    for key, ok in TEXT_MODES.items():
        if text.get(key) is not None and text[key] not in ok:
            raise ConfigError(f"{where}: {prefix}{key} {text[key]!r} is not supported; this runtime implements "
                              f"{' or '.join(map(repr, ok))}")
    for key, d in (("quantization_config", raw), (prefix + "quantization_config", text)):
        q = d.get("quantization_config")
        if q is not None:      # its weights (FP8, GPTQ, ...) would load as if they were the real values
            what = q.get("quant_method", q) if isinstance(q, dict) else q
            raise ConfigError(f"{where}: {key} ({what!r}) is not supported; this runtime loads float16 / bfloat16 / "
                              f"float32 weights only: use the unquantized checkpoint or a GGUF file")


def _rope(text: dict, prefix: str, where: str) -> tuple[dict, str]:
    """(the RoPE block, its key): a non-empty rope_scaling (Qwen2-VL's spelling), else rope_parameters, the precedence
    transformers gives them (PreTrainedConfig.convert_rope_params_to_dict); both are checked when both given."""
    found = []
    for key in ("rope_scaling", "rope_parameters"):
        block = text.pop(key, None)
        if block is None:
            continue
        if not isinstance(block, dict):
            raise ConfigError(f"{where}: {prefix}{key} must be an object (rope_theta, mrope_section, ...), got "
                              f"{block!r}")
        kind = block.get("rope_type", block.get("type"))
        if kind is not None and kind not in ROPE_TYPES:
            raise ConfigError(f"{where}: {prefix}{key}.rope_type {kind!r} is not supported; this runtime implements "
                              f"{' or '.join(map(repr, ROPE_TYPES))} RoPE (no scaling such as YaRN): remove the "
                              f"scaling or use a checkpoint without it")
        found.append((block, key))
    return next(((b, k) for b, k in found if b), ({}, "rope_parameters"))


def _text_extra(raw: dict, text: dict, prefix: str, where: str) -> dict:
    """TextConfig fields whose key is not their field name, or that live in the RoPE block / at the top level."""
    rope, rope_key = _rope(text, prefix, where)
    # transformers' defaults where neither the RoPE block nor the text config gives one: rope_theta is
    # RotaryEmbeddingConfigMixin.default_theta (10000, not the released models' 1e7), partial_rotary_factor 0.25
    extra = {"rope_theta": 10000.0}
    for f in ("rope_theta", "partial_rotary_factor"):
        if f in rope or f in text:
            key = f"{prefix}{rope_key}.{f}" if f in rope else prefix + f
            extra[f] = _real(rope[f] if f in rope else text[f], key, where)
    if "rms_norm_eps" in text:
        extra["rms_norm_eps"] = _real(text["rms_norm_eps"], prefix + "rms_norm_eps", where)
    if rope.get("mrope_section") is not None:
        sec = rope["mrope_section"]
        extra["mrope_section"] = tuple(sec) if isinstance(sec, list) else sec
    # Tying is decided as the config's class in transformers decides it (reference/qwen35.md 2.6), false when
    # absent: a VLM (Qwen3_5Config) reads its top-level key alone; a *ForCausalLM reads its text config, the
    # text_config of a nested config.json (Qwen3_5TextConfig.from_pretrained) or the flat config itself.
    for key, d, name in ((f"{prefix}{rope_key}.mrope_interleaved", rope, "mrope_interleaved"),
                         (prefix + "tie_word_embeddings", text, "tie_word_embeddings"),
                         ("tie_word_embeddings", raw, "tie_word_embeddings")):
        if name in d and not isinstance(d[name], bool):   # bool("false") is True: only JSON true / false
            raise ConfigError(f"{where}: {key} must be true or false, got {d[name]!r}")
    arch = raw.get("architectures")
    causal = isinstance(arch, list) and bool(arch) and all(str(a).endswith("ForCausalLM") for a in arch)
    extra["tie_word_embeddings"] = (text if causal or not prefix else raw).get("tie_word_embeddings", False)
    if rope.get("mrope_interleaved") is False:      # transformers never reads the key: Qwen3.5 always interleaves
        warnings.warn(f"{where}: {prefix}{rope_key}.mrope_interleaved false is ignored; Qwen3.5 interleaves its "
                      f"M-RoPE sections (as transformers does)")
    extra["mrope_interleaved"] = True
    n = text.get("num_hidden_layers")
    if "layer_types" not in text and _is_int(n):
        every = text.get("full_attention_interval", 4)
        if not _is_int(every) or every < 1:
            raise ConfigError(f"{where}: {prefix}full_attention_interval must be an integer >= 1, got {every!r}")
        extra["layer_types"] = tuple(FULL if (i + 1) % every == 0 else LINEAR for i in range(n))
    return extra


def parse_config(raw: dict, where: str = "config.json") -> ModelConfig:
    """Build a ModelConfig from the dict of a Hugging Face config.json; refuses unknown model types."""
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}: the top level must be an object of config keys, got {type(raw).__name__}")
    text = raw.get("text_config")
    if text is not None and not isinstance(text, dict):
        raise ConfigError(f"{where}: text_config must be an object of the text model's keys, got {text!r}")
    prefix = "text_config." if text is not None else ""
    text = dict(raw if text is None else text)
    mtype, ttype = raw.get("model_type"), text.get("model_type", raw.get("model_type"))
    for key, v in (("model_type", mtype), (prefix + "model_type", ttype)):
        if v is not None and not isinstance(v, str):
            raise ConfigError(f"{where}: {key} must be a string, got {v!r}")
    if mtype not in TEXT_TYPES and ttype not in TEXT_TYPES:
        raise ConfigError(f"{where}: model_type {mtype!r} is not a Qwen3.5 model; supported: "
                          f"{sorted(TEXT_TYPES)}")
    _check_modes(raw, text, prefix, where)
    moe = TEXT_TYPES.get(ttype, TEXT_TYPES.get(mtype))
    text = {**TEXT_DEFAULTS, **TEXT_DEFAULTS_BY_MOE[moe], **text}
    extra = _text_extra(raw, text, prefix, where)
    names = {f.name for f in dataclasses.fields(TextConfig)}
    fields = {k: v for k, v in text.items() if k in names and k not in extra and k != "moe"}
    tc = _take(fields, TextConfig, where, moe=moe, **extra).validate(where)
    vis = raw.get("vision_config")
    if vis is not None and not isinstance(vis, dict):
        raise ConfigError(f"{where}: vision_config must be an object of the vision tower's keys, got {vis!r}")
    vc = _take({**VISION_DEFAULTS, **vis}, VisionConfig, where + " vision_config",
               **_vision_rope(vis, where)).validate(where) if vis else None
    if vc is not None and vc.out_hidden_size != tc.hidden_size:
        raise ConfigError(f"{where}: vision_config.out_hidden_size {vc.out_hidden_size} must equal the text "
                          f"hidden_size {tc.hidden_size}")
    eos_key = "eos_token_id" if "eos_token_id" in raw or not prefix else prefix + "eos_token_id"
    eos = raw.get("eos_token_id", text.get("eos_token_id"))
    tokens = {k: raw.get(k, VLM_TOKEN_DEFAULTS[k] if vc is not None else None) for k in VLM_TOKEN_DEFAULTS}
    return ModelConfig(model_type=mtype or ttype, text=tc, vision=vc, **tokens,
                       eos_token_ids=_eos(eos, eos_key, tc.vocab_size, where))


def _vision_rope(vis: dict, where: str) -> dict:
    """The vision tower's rope, as transformers reads it: vision_config.rope_parameters, whose rope_type must be
    "axial" (the only one the tower has; transformers refuses another too) and whose rope_theta is the base (10000
    where not given). Returns VisionConfig's keywords for it."""
    rp = vis.get("rope_parameters")
    if rp is None:
        return {}
    if not isinstance(rp, dict):
        raise ConfigError(f"{where}: vision_config.rope_parameters must be an object, got {rp!r}")
    kind = rp.get("rope_type", "axial")
    if kind != "axial":
        raise ConfigError(f"{where}: vision_config.rope_parameters.rope_type {kind!r} is not supported; the vision "
                          f"tower's rope is 'axial'")
    return {"rope_theta": rp["rope_theta"]} if "rope_theta" in rp else {}


def read_json(path: Path, bad: str):
    """A JSON file's value. Text that is not JSON, not UTF-8, or nested too deeply is a ConfigError headed
    "{path}: {bad}"; an OSError is the caller's to name (config.json, the safetensors index, adapter_config.json)."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: {bad} ({e})") from None
    except RecursionError:
        raise ConfigError(f"{path}: {bad} (nested too deeply)") from None


def load_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir).expanduser() / "config.json"
    try:
        if path.exists() and not path.is_file():       # a directory, or a FIFO that would block the read
            raise ConfigError(f"{path}: not a regular file")
        raw = read_json(path, "not valid JSON")
    except FileNotFoundError:
        raise ConfigError(f"{path}: no config.json in the model directory") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read config.json ({e.strerror or e})") from None
    mc = parse_config(raw, str(path))
    # generation_config.json's eos ids end a request too, beside config.json's (transformers' generate and vLLM
    # stop on them; a chat model may list <|im_end|> there only)
    gen = path.with_name("generation_config.json")
    try:
        g = read_json(gen, "not valid JSON") if gen.is_file() else {}
    except OSError as e:
        raise ConfigError(f"{gen}: cannot read generation_config.json ({e.strerror or e})") from None
    if not isinstance(g, dict):
        raise ConfigError(f"{gen}: must be a JSON object, got {type(g).__name__}")
    more = _eos(g.get("eos_token_id"), "eos_token_id", mc.text.vocab_size, str(gen))
    if any(i not in mc.eos_token_ids for i in more):
        mc = dataclasses.replace(mc, eos_token_ids=tuple(dict.fromkeys(mc.eos_token_ids + more)))
    # the image processor's settings, as transformers' AutoImageProcessor (and vLLM) read them beside config.json
    for name, field, default in (("preprocessor_config.json", "image_pixels", IMAGE_PIXELS),
                                 ("video_preprocessor_config.json", "video_pixels", VIDEO_PIXELS)):
        f = path.with_name(name)
        if mc.vision is None or not f.is_file():
            continue
        try:
            raw = read_json(f, "not valid JSON")
        except OSError as e:
            raise ConfigError(f"{f}: cannot read {name} ({e.strerror or e})") from None
        mc = dataclasses.replace(mc, **{field: PixelSpec.from_processor(raw, str(f), default, mc.vision)})
    return mc
