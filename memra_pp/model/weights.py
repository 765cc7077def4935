"""Weight sources: canonical tensor names (docs/ARCHITECTURE.md) served lazily from safetensors, GGUF or random.

A stage asks only for the tensors of its own layers; `read_names` records what was handed out.
"""
from __future__ import annotations

import dataclasses
import math
import re
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from ..errors import ConfigError
from .config import ModelConfig, TextConfig, load_config, parse_config, read_json
from .gguf_check import gguf_files, gguf_named
from . import presets

if TYPE_CHECKING:
    import torch


class WeightSource(Protocol):
    config: ModelConfig
    read_names: list[str]

    def has(self, name: str) -> bool: ...

    def get(self, name: str, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor: ...


def expected_shape(name: str, cfg: TextConfig) -> tuple[int, ...] | None:
    """The shape a canonical text tensor must have under `cfg` (None for names this table does not know)."""
    H, V, D = cfg.hidden_size, cfg.vocab_size, cfg.head_dim
    nv, dv = cfg.linear_num_value_heads, cfg.linear_value_head_dim
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return (V, H)
    if name == "norm.weight":
        return (H,)
    parts = name.split(".")
    if parts[0] != "layers" or len(parts) < 4:
        return None
    rest = ".".join(parts[2:])
    E, I, Im, Is = cfg.num_experts, cfg.intermediate_size, cfg.moe_intermediate_size, \
        cfg.shared_expert_intermediate_size
    table = {
        "input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (2 * cfg.num_attention_heads * D, H),
        "self_attn.k_proj.weight": (cfg.num_key_value_heads * D, H),
        "self_attn.v_proj.weight": (cfg.num_key_value_heads * D, H),
        "self_attn.o_proj.weight": (H, cfg.num_attention_heads * D),
        "self_attn.q_norm.weight": (D,), "self_attn.k_norm.weight": (D,),
        "linear_attn.in_proj_qkv.weight": (cfg.conv_dim, H), "linear_attn.in_proj_z.weight": (nv * dv, H),
        "linear_attn.in_proj_b.weight": (nv, H), "linear_attn.in_proj_a.weight": (nv, H),
        "linear_attn.conv1d.weight": (cfg.conv_dim, 1, cfg.linear_conv_kernel_dim),
        "linear_attn.A_log": (nv,), "linear_attn.dt_bias": (nv,), "linear_attn.norm.weight": (dv,),
        "linear_attn.out_proj.weight": (H, nv * dv),
        "mlp.gate_proj.weight": (I, H), "mlp.up_proj.weight": (I, H), "mlp.down_proj.weight": (H, I),
        "mlp.gate.weight": (E, H), "mlp.shared_expert_gate.weight": (1, H),
        "mlp.shared_expert.gate_proj.weight": (Is, H), "mlp.shared_expert.up_proj.weight": (Is, H),
        "mlp.shared_expert.down_proj.weight": (H, Is),
        "mlp.experts.gate_up_proj": (E, 2 * Im, H), "mlp.experts.down_proj": (E, H, Im),
    }
    return table.get(rest)


# dtypes a checkpoint's tensors may have: any other (int8, uint8, float8_*, bool, complex) is quantized or not
# weights at all, and a cast to float would load it as if its stored values were the real ones. FLOAT_DTYPES is made
# on first use (module __getattr__): torch is imported by what reads weights, not by what plans a placement (`memra-pp
# plan` and `launch`'s own process: 1.2 s of a 1.65 s `plan`)


def float_dtypes() -> tuple:
    """FLOAT_DTYPES, made (and kept in the module's globals) at the first call."""
    value = globals().get("FLOAT_DTYPES")
    if value is None:
        import torch
        globals()["FLOAT_DTYPES"] = value = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    return value


def __getattr__(name: str):
    if name == "FLOAT_DTYPES":
        return float_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def check_shape(name: str, t: torch.Tensor, cfg: TextConfig, where: str) -> torch.Tensor:
    want = expected_shape(name, cfg)
    if want is not None and tuple(t.shape) != want:
        raise ConfigError(f"{where}: tensor {name!r} has shape {tuple(t.shape)}, the config needs {want}")
    return t


FINITE_CHUNK = 1 << 24      # values a float32 sum of check_finite's covers (64 MB of float32 on a CPU at most)


def check_finite(name: str, stored: torch.Tensor, loaded: torch.Tensor, where: str) -> torch.Tensor:
    """A weight with NaN or inf (a corrupt download, a bad conversion, a value past the load dtype's range) makes
    every token it touches NaN, silently: refused at load, naming the tensor (llama.cpp checks only under
    --check-tensors; here always). Float32 sums (NaN and inf carry through them) of chunks of FINITE_CHUNK values,
    summed on the device with one host sync a tensor (on a CPU a whole tensor's sum would first copy it to float32),
    counted exactly only when the total is not finite. `stored`: the tensor as read, `loaded`: after the cast to the
    load dtype (the same tensor where nothing was cast), so an overflow of the cast is told from a checkpoint that
    holds the values."""
    import torch
    flat = loaded.reshape(-1)
    if flat.numel() == 0 or bool(torch.isfinite(torch.stack([c.sum(dtype=torch.float32)
                                                             for c in flat.split(FINITE_CHUNK)]).sum())):
        return loaded
    bad = sum(int((~torch.isfinite(c)).sum()) for c in flat.split(FINITE_CHUNK))
    if bad == 0:      # the sum itself overflowed float32: every value is finite
        return loaded
    held = sum(int((~torch.isfinite(c)).sum()) for c in stored.reshape(-1).split(FINITE_CHUNK)) \
        if stored is not loaded else bad
    dt = str(loaded.dtype).removeprefix("torch.")
    if held:
        raise ConfigError(f"{where}: tensor {name!r} holds {held} non-finite value(s) (NaN or inf) of "
                          f"{stored.numel()}; the checkpoint is corrupt or was converted wrongly: a model with them "
                          f"would give NaN for every token they touch")
    raise ConfigError(f"{where}: tensor {name!r} has {bad} value(s) past {dt}'s range (finite as stored, "
                      f"{str(stored.dtype).removeprefix('torch.')}): load the model in a wider dtype (model.dtype: "
                      f"bfloat16 or float32)")


class SafetensorsSource:
    """Hugging Face checkpoint directory: single or sharded safetensors, VLM or text-only prefixes."""

    def __init__(self, model_dir: str | Path, config: ModelConfig | None = None):
        from safetensors import safe_open
        self.dir = Path(model_dir).expanduser()
        self.config = config or load_config(self.dir)
        self.read_names: list[str] = []
        self._safe_open = safe_open
        index = self.dir / "model.safetensors.index.json"
        if index.exists():
            self._file_of = {k: self.dir / f for k, f in _weight_map(index).items()}
        else:
            files = sorted(self.dir.glob("*.safetensors"))
            if not files:
                raise ConfigError(f"{self.dir}: no *.safetensors files and no model.safetensors.index.json")
            self._file_of = {}
            for f in files:
                for k in self._open(f, "numpy").keys():     # (the header alone: "pt" would import torch)
                    if k in self._file_of:      # which copy is current is not ours to guess (a stale shard?)
                        raise ConfigError(f"{self.dir}: tensor {k!r} is in both {self._file_of[k].name} and "
                                          f"{f.name}; remove the stale file, or add a model.safetensors.index.json "
                                          f"naming the shard of each tensor")
                    self._file_of[k] = f
        self._handles: dict[Path, object] = {}
        keys = self._file_of.keys()
        self._prefix = "model.language_model." if any(k.startswith("model.language_model.") for k in keys) \
            else "model."
        n = self.config.text.num_hidden_layers
        layer = re.compile(re.escape(self._prefix) + r"layers\.(\d+)\.")
        for k in keys:      # a config that undercounts the layers would run a shorter model without a word
            if (m := layer.match(k)) and int(m[1]) >= n:
                raise ConfigError(f"{self.dir}: tensor {k!r} is past the last layer: config.json's num_hidden_layers "
                                  f"is {n}; the config undercounts the layers (fix num_hidden_layers and layer_types)")
        if self.config.tied and "lm_head.weight" in keys:
            # transformers ties only a head the checkpoint lacks: its own lm_head.weight is loaded and used
            # (modeling_utils tie_weights; one equal to the embedding gives the same logits either way)
            warnings.warn(f"{self.dir}: config.json ties lm_head to the embedding, but the checkpoint holds its own "
                          f"lm_head.weight, which is used (as transformers does); set tie_word_embeddings false to say "
                          f"so, or remove lm_head.weight to share the embedding")
            c = self.config
            self.config = dataclasses.replace(c, text=dataclasses.replace(c.text, tie_word_embeddings=False))

    def _open(self, f: Path, framework: str = "pt"):
        try:
            return self._safe_open(str(f), framework=framework)
        except Exception as e:  # safetensors raises its own SafetensorError / OSError for bad headers
            raise ConfigError(f"{f}: cannot read safetensors header ({e})") from None

    def _key(self, name: str) -> str:
        if name == "lm_head.weight":
            return name
        if name.startswith("visual."):
            return "model." + name
        return self._prefix + name

    def _raw(self, key: str) -> torch.Tensor:
        f = self._file_of[key]
        h = self._handles.get(f)
        if h is None:
            if not f.exists():
                raise ConfigError(f"{f}: shard named by the index is missing")
            h = self._handles[f] = self._open(f)
        try:
            t = h.get_tensor(key)
        except Exception as e:
            if key not in h.keys():     # the index names a shard that does not hold it: not a corrupt file
                raise ConfigError(f"{f}: holds no tensor {key!r}, but model.safetensors.index.json names this shard "
                                  f"for it; the index is stale or belongs to another checkpoint") from None
            raise ConfigError(f"{f}: cannot read tensor {key!r} (truncated or corrupt file?): {e}") from None
        if t.dtype not in float_dtypes():
            raise ConfigError(f"{f}: tensor {key!r} has dtype {str(t.dtype).removeprefix('torch.')}; this runtime "
                              f"loads float16 / bfloat16 / float32 / float64 weights only (a quantized checkpoint: "
                              f"use the unquantized one or a GGUF file)")
        return t

    def has(self, name: str) -> bool:
        if self._key(name) in self._file_of:
            return True
        return name.endswith(("experts.gate_up_proj", "experts.down_proj")) and \
            self._key(name.rsplit(".", 1)[0] + ".0.down_proj.weight") in self._file_of

    def get(self, name: str, dtype: torch.dtype, device="cpu") -> torch.Tensor:
        key = self._key(name)
        if key in self._file_of:
            t, where = self._raw(key), str(self._file_of[key])   # name the shard that holds the tensor
        elif name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            t, where = self._stack_experts(name), str(self.dir)
        elif name == "lm_head.weight":     # (a tied model never asks for it)
            raise ConfigError(f"{self.dir}: tensor 'lm_head.weight' is missing from the checkpoint and config.json "
                              f"does not tie it to the embedding (tie_word_embeddings false or absent where "
                              f"transformers reads it: a VLM config's top level, a *ForCausalLM's text_config): set "
                              f"tie_word_embeddings true there if this model's lm_head is its embedding")
        else:
            raise ConfigError(f"{self.dir}: tensor {key!r} (canonical {name!r}) is missing from the checkpoint")
        self.read_names.append(name)
        check_shape(name, t, self.config.text, where)
        return check_finite(name, t, t.to(device=device, dtype=dtype), where)

    def _stack_experts(self, name: str) -> torch.Tensor:
        """Per-expert keys, as save_pretrained writes them, stacked into the canonical fused 3-D form."""
        import torch
        base = self._key(name.rsplit(".", 1)[0])
        c = self.config.text
        E, want = c.num_experts, {"gate_proj": (c.moe_intermediate_size, c.hidden_size),
                                  "up_proj": (c.moe_intermediate_size, c.hidden_size),
                                  "down_proj": (c.hidden_size, c.moe_intermediate_size)}
        out = []
        for e in range(E):
            def one(p):     # each expert's shape, before stacking: a short gate and a long up must not add up
                k = f"{base}.{e}.{p}.weight"
                if k not in self._file_of:
                    raise ConfigError(f"{self.dir}: tensor {k!r} is missing from the checkpoint")
                t = self._raw(k)
                if tuple(t.shape) != want[p]:
                    raise ConfigError(f"{self._file_of[k]}: tensor {k!r} has shape {tuple(t.shape)}, the config "
                                      f"needs {want[p]}")
                return t
            out.append(torch.cat([one("gate_proj"), one("up_proj")], 0) if name.endswith("gate_up_proj")
                       else one("down_proj"))
        return torch.stack(out)


def _weight_map(index: Path) -> dict[str, str]:
    """model.safetensors.index.json's weight_map: tensor name -> shard file name."""
    try:
        idx = read_json(index, "not a safetensors index")
    except OSError as e:
        raise ConfigError(f"{index}: not a safetensors index ({e})") from None
    if not isinstance(idx, dict) or "weight_map" not in idx:
        raise ConfigError(f"{index}: not a safetensors index (no weight_map in "
                          f"{'the object' if isinstance(idx, dict) else 'a JSON ' + type(idx).__name__})")
    wm = idx["weight_map"]
    if not isinstance(wm, dict):
        raise ConfigError(f"{index}: not a safetensors index (weight_map must map tensor names to shard files, got "
                          f"{wm!r:.80})")
    for k, f in wm.items():
        if not isinstance(f, str) or not f:
            raise ConfigError(f"{index}: weight_map[{k!r}] must name a shard file, got {f!r}")
    return wm


class DummySource:
    """Random weights for a real config, created directly on the stage's device (benchmarks; no files)."""

    def __init__(self, config: ModelConfig, seed: int = 0):
        self.config = config
        self.seed = seed
        self.read_names: list[str] = []

    def has(self, name: str) -> bool:
        return name != "lm_head.weight" or not self.config.tied

    def get(self, name: str, dtype: torch.dtype, device="cpu") -> torch.Tensor:
        shape = expected_shape(name, self.config.text)
        if shape is None:
            raise ConfigError(f"dummy weights: no shape known for tensor {name!r}")
        self.read_names.append(name)
        import torch
        g = torch.Generator(device=device).manual_seed(self.seed + sum(map(ord, name)))
        if name.endswith("A_log"):
            return torch.empty(shape, device=device).uniform_(0.5, 8, generator=g).log().to(dtype)
        if len(shape) == 1 or name.endswith("conv1d.weight"):
            t = torch.randn(shape, device=device, generator=g) * 0.1
            return (t + 1 if name.endswith("linear_attn.norm.weight") else t).to(dtype)
        fan_in = shape[-1]
        return (torch.randn(shape, device=device, generator=g, dtype=torch.float32) / math.sqrt(fan_in)).to(dtype)


def gguf_file_of(path: str | Path, fmt: str = "auto") -> Path | None:
    """The GGUF file that open_weights reads for `model: {path, format}` (weights, or with format dummy the
    dimensions), or None where it reads no GGUF (or would refuse the path: open_weights says why)."""
    p = Path(str(path)).expanduser()
    if p.is_file():
        return p if fmt == "gguf" or (fmt in ("auto", "dummy") and gguf_named(p)) else None
    if not p.is_dir() or fmt == "dummy" or (fmt == "auto" and any(p.glob("*.safetensors*"))):
        return None
    found = gguf_files(p) if fmt in ("auto", "gguf") else []
    return found[0] if len(found) == 1 else None


def open_weights(path: str | Path, fmt: str = "auto") -> WeightSource:
    """Pick the weight source for a placement's `model: {path, format}`."""
    p = Path(str(path)).expanduser()
    if fmt == "dummy":
        if str(path).startswith("preset:"):
            return DummySource(parse_config(presets.get(str(path)[7:]), str(path)))
        if not p.exists():      # not its parent's config.json instead
            raise ConfigError(f"model.path {str(path)!r} does not exist")
        if gguf_file_of(p, fmt) is not None:    # the file's own dimensions, not a config.json beside it
            from .gguf_source import GGUFSource
            return DummySource(GGUFSource(p).config)
        return DummySource(load_config(p if p.is_dir() else p.parent))
    if str(path).startswith("preset:") and not p.exists():
        raise ConfigError(f"model.path {str(path)!r} names a preset, which has no weights: set model.format: dummy "
                          f"(random weights with the preset's dimensions)")
    if fmt == "gguf" or (fmt == "auto" and (gguf_named(p) or (
            p.is_dir() and not any(p.glob("*.safetensors*")) and gguf_files(p)))):
        from .gguf_source import GGUFSource
        if p.is_dir():
            found = gguf_files(p)
            if len(found) != 1:     # which quantisation, or a split file's shards: not ours to guess
                raise ConfigError(f"model.path {str(path)!r}: " + (
                    f"holds {len(found)} .gguf files ({', '.join(f.name for f in found)}); name one file"
                    if found else "holds no .gguf file for model.format gguf"))
            p = found[0]
        if re.search(r"-\d{5}-of-\d{5}\.gguf$", p.name, re.IGNORECASE):
            raise ConfigError(f"model.path {str(path)!r}: one shard of a split GGUF; merge the shards into one file "
                              f"first (llama.cpp: llama-gguf-split --merge)")
        return GGUFSource(p)
    if fmt == "safetensors" and p.is_file() and gguf_named(p):
        raise ConfigError(f"model.path {str(path)!r} is a GGUF file but model.format is safetensors; use gguf or auto")
    if fmt in ("auto", "safetensors"):
        from ..defaults import ensure_embedded
        if not ensure_embedded(p) and not p.exists():     # (an embedded checkpoint: written where missing)
            raise ConfigError(f"model.path {str(path)!r} does not exist")
        if not p.is_dir():
            raise ConfigError(f"model.path {str(path)!r} is a file, not a checkpoint: give a Hugging Face checkpoint "
                              f"directory (config.json and *.safetensors) or a .gguf file")
        return SafetensorsSource(p)
    raise ConfigError(f"model.format {fmt!r} is not one of auto, safetensors, gguf, dummy")
