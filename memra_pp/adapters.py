"""PEFT LoRA adapters read from disk into canonical per-layer A/B and trainable-token rows (`AdapterWeights`).
Runs wherever an adapter is loaded (driver or stage process); every refusal is a ConfigError naming the problem.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .errors import ConfigError
from .model.config import ModelConfig, read_json
from .model.lora import layer_modules
from .model.weights import FLOAT_DTYPES, expected_shape
from .overlay import TokenOverlay, TokenOverlaySet

_PREFIX = r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?"
_LORA_KEY = re.compile(_PREFIX + r"layers\.(\d+)\.(.+)\.lora_([AB])\.weight$")
_TOKEN_KEY = re.compile(r"^(?:base_model\.model\.)?(?:model\.)?(?:language_model\.)?(embed_tokens|lm_head)"
                        r"\.token_adapter\.trainable_tokens_delta$")
_FULL_KEY = re.compile(_PREFIX + r"(embed_tokens|lm_head)\.(?:base_layer\.)?weight$")
# Config switches whose effect this runtime does not reproduce: refused rather than silently ignored.
_UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) is not supported; merge it or train plain LoRA",
    "lora_bias": "LoRA bias (lora_bias) is not supported",
    "target_parameters": "LoRA on parameters (target_parameters, e.g. MoE routed experts mlp.experts.*) is not "
                         "supported; target the attention, linear-attention, dense MLP or shared-expert projections",
    "modules_to_save": "modules_to_save (fully retrained modules) is not supported; use trainable_token_indices "
                       "for embedding rows",
    "alpha_pattern": "alpha_pattern (per-module lora_alpha) is not supported",
    "layer_replication": "layer_replication is not supported",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens: the adapter applies only from its invocation "
                               "tokens on) is not supported",
    "arrow_config": "Arrow routing between LoRA experts (arrow_config) is not supported",
    "use_bdlora": "block-diagonal LoRA (use_bdlora) is not supported",
    "monteclora_config": "MonteCLoRA (monteclora_config) is not supported",
    "kasa_config": "KaSA (kasa_config) is not supported",
}
# init_lora_weights whose adapter is relative to base weights PEFT rewrites when it loads one (W - B0 A0 or a
# quantized residual): on the unmodified base this runtime serves, its LoRA would compute something else
_BASE_REWRITING_INITS = ("pissa", "corda", "olora", "loftq", "lora_ga")


@dataclass(frozen=True)
class LoraModule:
    a_RI: torch.Tensor   # lora_A [r, in]
    b_OR: torch.Tensor   # lora_B [out, r]
    scale: float         # lora_alpha / r (or / sqrt(r) with use_rslora)


@dataclass(frozen=True)
class AdapterWeights:
    """One adapter: LoRA per canonical module ('layers.{i}.self_attn.q_proj') and trainable-token rows (full
    replacement rows, as PEFT's `trainable_tokens_delta` holds). Token rows are kept by `for_layers`: the intake
    needs the embedding rows, the primary the lm_head rows (the embedding rows when tied)."""
    name: str
    vocab_size: int
    tied: bool
    rank: int
    lora: dict[str, LoraModule] = field(default_factory=dict)
    embed_ids: torch.Tensor | None = None     # (K,) long
    embed_rows: torch.Tensor | None = None    # (K, H)
    lm_head_ids: torch.Tensor | None = None   # (L,) long, untied models only
    lm_head_rows: torch.Tensor | None = None  # (L, H)
    digest: str = ""    # sha256 of what was read (adapter_config.json's values and every tensor): `content_digest`

    def for_layers(self, start: int, end: int) -> AdapterWeights:
        """The LoRA of layers [start, end) only (what one stage holds), token rows unchanged."""
        keep = {m: w for m, w in self.lora.items() if start <= int(m.split(".")[1]) < end}
        return AdapterWeights(self.name, self.vocab_size, self.tied, self.rank, keep, self.embed_ids,
                              self.embed_rows, self.lm_head_ids, self.lm_head_rows, self.digest)

    def token_overlay(self) -> TokenOverlay | None:
        """This adapter's rows for `TokenOverlaySet.from_slots`, or None when it trains no token rows."""
        if self.embed_ids is None and self.lm_head_ids is None:
            return None
        H = (self.embed_rows if self.embed_rows is not None else self.lm_head_rows).shape[1]
        ids = self.embed_ids if self.embed_ids is not None else torch.zeros(0, dtype=torch.long)
        rows = self.embed_rows if self.embed_rows is not None else torch.zeros(0, H, dtype=self.lm_head_rows.dtype)
        return TokenOverlay(self.vocab_size, ids, rows, self.lm_head_ids, self.lm_head_rows)


def token_overlay_set(engine, slots: dict, max_loras: int, tied: bool) -> TokenOverlaySet:
    """The TokenOverlaySet of an engine from {slot: AdapterWeights}; rebuild it after every load/unload."""
    return TokenOverlaySet.from_slots(engine, {s: a.token_overlay() for s, a in slots.items()}, max_loras, tied)


def content_digest(cfg: dict, tensors: dict[str, torch.Tensor]) -> str:
    """sha256 of an adapter as read: its config's values and each tensor's name, dtype, shape and bytes. Every stage
    reads the adapter's files itself, so this is how they are known to hold the same adapter (a load whose files
    changed while the stages read them, a restarted stage reading files rewritten since the others read them)."""
    import hashlib
    import json
    h = hashlib.sha256(json.dumps(cfg, sort_keys=True, default=str).encode())
    for k in sorted(tensors):
        t = tensors[k].contiguous().reshape(-1)
        h.update(f"\0{k}\0{t.dtype}\0{tuple(tensors[k].shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy() if t.numel() else b"")
    return h.hexdigest()


def _read_config(d: Path) -> dict:
    p = d / "adapter_config.json"
    if not p.is_file():
        raise ConfigError(f"adapter {str(d)!r}: adapter_config.json is missing (not a PEFT adapter directory)")
    try:
        cfg = read_json(p, "not valid JSON")
    except OSError as e:
        raise ConfigError(f"{p}: cannot read adapter_config.json ({e.strerror or e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{p}: must hold a JSON object (PEFT's LoraConfig), got {type(cfg).__name__}")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ConfigError(f"{p}: peft_type {cfg.get('peft_type')!r} is not supported; only LORA adapters load")
    for key, why in _UNSUPPORTED.items():
        if cfg.get(key):
            raise ConfigError(f"{p}: {key}={cfg[key]!r}: {why}")
    init = cfg.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise ConfigError(f"{p}: init_lora_weights={init!r}: this adapter is relative to the base weights PEFT "
                          f"rewrites when it loads it, not to the model's; convert it to plain LoRA first (PEFT's "
                          f"save_pretrained(..., path_initial_model_for_weight_conversion=...))")
    if not isinstance(cfg.get("use_rslora", False), bool):
        raise ConfigError(f"{p}: use_rslora must be true or false, got {cfg['use_rslora']!r}")
    if cfg.get("bias", "none") != "none":
        raise ConfigError(f"{p}: bias={cfg['bias']!r}: trained biases are not supported (bias must be 'none')")
    for key in ("r", "lora_alpha"):     # (Python's json reads NaN and Infinity)
        v = cfg.get(key)
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"{p}: {key} must be a positive finite number, got {v!r}")
    rp = cfg.get("rank_pattern") or {}
    if not isinstance(rp, dict) or not all(isinstance(v, int) and not isinstance(v, bool) and v > 0
                                           for v in rp.values()):
        raise ConfigError(f"{p}: rank_pattern must map module patterns to positive integer ranks, got {rp!r}")
    for k in rp:
        try:
            re.compile(k)
        except re.error as e:
            raise ConfigError(f"{p}: rank_pattern key {k!r} is not a valid regular expression ({e})") from None
    return cfg


def _config_rank(cfg: dict, full_name: str) -> tuple[float, str]:
    """The rank adapter_config.json gives module `full_name`, and where from (PEFT's get_pattern_key rule)."""
    for k, v in (cfg.get("rank_pattern") or {}).items():
        if re.match(rf"(.*\.)?({k})$", full_name):
            return v, f"rank_pattern[{k!r}]"
    return cfg["r"], "r"


def _names_module(spec, full_name: str) -> bool:
    """PEFT's rule for target_modules / exclude_modules: a string is a regex the whole name matches; a list names
    modules by the name or its last dotted parts."""
    if isinstance(spec, str):
        return re.fullmatch(spec, full_name) is not None
    return any(full_name == k or full_name.endswith("." + k) for k in spec if isinstance(k, str))


def _untargeted(cfg: dict, full_name: str, layer: int) -> str | None:
    """Why adapter_config.json does not target module `full_name` (of layer `layer`), or None where it does, as
    PEFT decides which modules it wraps: its weights for a module it does not wrap are dropped silently, so an
    adapter whose weights and config disagree is refused rather than served with tokens PEFT would not give."""
    tm = cfg.get("target_modules")
    if tm is None or tm == "all-linear" or not isinstance(tm, (str, list)):     # (PEFT resolves these itself)
        return None
    if not _names_module(tm, full_name):
        return f"target_modules is {tm!r}"
    ex = cfg.get("exclude_modules")
    if isinstance(ex, (str, list)) and _names_module(ex, full_name):
        return f"exclude_modules is {ex!r}"
    lt = cfg.get("layers_to_transform")
    if not isinstance(tm, str) and lt not in (None, []):    # (PEFT reads it only for a list of targets)
        if layer not in (lt if isinstance(lt, list) else [lt]):
            return f"layers_to_transform is {lt!r}"
    return None


def _tti_targets(cfg: dict, where: str) -> set[str]:
    """The modules trainable_token_indices names token ids for (embed_tokens, lm_head); refuses any other."""
    tti = cfg.get("trainable_token_indices")
    if tti is None:
        return set()
    if isinstance(tti, list):
        return {"embed_tokens"} if tti else set()
    if not isinstance(tti, dict):
        raise ConfigError(f"{where}: trainable_token_indices must be a list of token ids or an object "
                          f"{{module: [ids]}}, got {tti!r}")
    out = set()
    for k, ids in tti.items():
        target = next((t for t in ("embed_tokens", "lm_head") if k == t or k.endswith("." + t)), None)
        if target is None:
            raise ConfigError(f"{where}: trainable_token_indices names module {k!r}: only embed_tokens and lm_head "
                              f"token rows are supported")
        if not isinstance(ids, list):
            raise ConfigError(f"{where}: trainable_token_indices[{k!r}] must be a list of token ids, got {ids!r}")
        if ids:
            out.add(target)
    return out


def _read_tensors(d: Path) -> dict[str, torch.Tensor]:
    p = d / "adapter_model.safetensors"
    if not p.is_file():
        extra = " (adapter_model.bin is not read: re-save with safe_serialization=True)" \
            if (d / "adapter_model.bin").exists() else ""
        raise ConfigError(f"adapter {str(d)!r}: adapter_model.safetensors is missing{extra}")
    from safetensors import SafetensorError
    from safetensors.torch import load_file
    try:
        return load_file(str(p))
    except (SafetensorError, OSError) as e:
        raise ConfigError(f"{p}: cannot read safetensors ({e})") from None


def _token_ids(cfg: dict, target: str, n_rows: int, vocab: int, where: str) -> torch.Tensor:
    tti = cfg.get("trainable_token_indices")
    ids = tti if isinstance(tti, list) and target == "embed_tokens" else None
    if isinstance(tti, dict):
        ids = next((v for k, v in tti.items() if k == target or k.endswith("." + target)), None)
    if ids is None:
        raise ConfigError(f"{where}: the file holds {target} token rows but trainable_token_indices names no "
                          f"{target} ids ({tti!r})")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids) or len(ids) != n_rows:
        raise ConfigError(f"{where}: trainable_token_indices[{target!r}] must be {n_rows} ints (one per saved row), "
                          f"got {ids!r}")
    bad = [i for i in ids if not 0 <= i < vocab]
    if bad:
        raise ConfigError(f"{where}: trainable token ids {bad[:5]} of {target} are outside the model's vocabulary "
                          f"[0, {vocab})")
    if len(set(ids)) != len(ids):
        raise ConfigError(f"{where}: trainable_token_indices[{target!r}] repeats an id")
    return torch.tensor(ids, dtype=torch.long)


def _once(seen: dict, what: tuple[str, str], key: str, where: str) -> None:
    """Refuses a second tensor for one module's half (two key spellings of it): one would silently win."""
    if what in seen:
        raise ConfigError(f"{where}: {seen[what]!r} and {key!r} both give {what[0]} {what[1]}")
    seen[what] = key


def load_peft_adapter(path, model_config: ModelConfig, max_rank: int, name: str | None = None) -> AdapterWeights:
    """Read a PEFT LoRA directory (adapter_config.json + adapter_model.safetensors) for `model_config`; `name`:
    the adapter's (what errors name), else the directory's."""
    d = Path(str(path)).expanduser()
    try:
        is_dir = d.is_dir()
    except OSError as e:        # (a name too long for the file system, ...)
        raise ConfigError(f"adapter path {str(path)[:200]!r} cannot be read: {e.strerror or e}") from None
    if not is_dir:
        # the stages read the path, each from its own working directory, not the caller's
        rel = "" if d.is_absolute() else f" (a relative path, read from {os.getcwd()!r}; pass an absolute path)"
        raise ConfigError(f"adapter path {str(path)!r} is not a directory{rel}")
    cfg, tensors = _read_config(d), _read_tensors(d)
    tc, where = model_config.text, str(d)
    V, H = tc.vocab_size, tc.hidden_size
    halves: dict[str, dict[str, torch.Tensor]] = {}
    rows: dict[str, torch.Tensor] = {}
    seen: dict[tuple[str, str], str] = {}     # (module or token target, half) -> the key that gave it
    names: dict[str, str] = {}                # canonical module -> its name in the model PEFT wrapped
    for key, t in tensors.items():
        if t.dtype not in FLOAT_DTYPES:    # (ints, bool, float8: refused rather than cast)
            raise ConfigError(f"{where}: adapter_model.safetensors' {key!r} is {str(t.dtype).replace('torch.', '')}; "
                              f"adapter tensors must be float16, bfloat16, float32 or float64")
        # refused, not loaded: a step computes every slot's LoRA and masks it per row, and NaN times a 0 mask is
        # NaN, so one adapter's NaN would reach every other adapter's requests in the batch
        if not bool(torch.isfinite(t).all()):
            raise ConfigError(f"{where}: adapter_model.safetensors' {key!r} holds NaN or inf")
        m = _LORA_KEY.match(key)
        if m:
            i, module = int(m.group(1)), m.group(2)
            if i >= tc.num_hidden_layers or module not in layer_modules(tc, i):
                raise ConfigError(f"{where}: unknown LoRA target {key!r}: layer {i} of this model targets only "
                                  f"{list(layer_modules(tc, i)) if i < tc.num_hidden_layers else 'nothing'}")
            canon = f"layers.{i}.{module}"
            _once(seen, (canon, "lora_" + m.group(3)), key, where)
            halves.setdefault(canon, {})[m.group(3)] = t
            names[canon] = key[:-len(".lora_X.weight")].removeprefix("base_model.model.")
            continue
        m = _TOKEN_KEY.match(key)
        if m:
            _once(seen, (m.group(1), "token rows"), key, where)
            rows[m.group(1)] = t
            continue
        m = _FULL_KEY.match(key)
        if m and t.dim() == 2 and t.shape[0] != V:
            raise ConfigError(f"{where}: {key!r} has {t.shape[0]} rows but the model's vocabulary is {V}: the "
                              f"adapter was trained on a resized vocabulary (vocab size mismatch)")
        raise ConfigError(f"{where}: unknown adapter tensor {key!r}: only LoRA on attention / linear-attention / "
                          f"MLP projections and trainable_token_indices rows are supported")
    if not halves and not rows:
        raise ConfigError(f"{where}: adapter_model.safetensors holds no LoRA or trainable-token tensors (keys: "
                          f"{sorted(tensors)[:5]}): loading it would change nothing")
    alpha, rs = float(cfg["lora_alpha"]), bool(cfg.get("use_rslora"))
    lora, top = {}, 0
    for module, ab in sorted(halves.items()):
        if set(ab) != {"A", "B"}:
            raise ConfigError(f"{where}: {module} has lora_{'A' if 'A' in ab else 'B'} but no "
                              f"lora_{'B' if 'A' in ab else 'A'}")
        a, b = ab["A"], ab["B"]
        out, inp = expected_shape(module + ".weight", tc)
        r = a.shape[0] if a.dim() == 2 else -1
        if r < 1 or a.shape != (r, inp) or b.shape != (out, r):
            raise ConfigError(f"{where}: {module} has lora_A {tuple(a.shape)}, lora_B {tuple(b.shape)}; the model "
                              f"needs (r, {inp}) and ({out}, r), r >= 1")
        why = _untargeted(cfg, names[module], int(module.split(".")[1]))
        if why is not None:
            raise ConfigError(f"{where}: adapter_model.safetensors holds LoRA weights for {names[module]} but "
                              f"adapter_config.json's {why}: PEFT would not apply them (the weights and their config "
                              f"disagree)")
        want, src = _config_rank(cfg, names[module])
        if r != want:
            raise ConfigError(f"{where}: {module} has rank {r} (lora_A {tuple(a.shape)}) but adapter_config.json's "
                              f"{src} is {want!r}: the weights and their config disagree")
        if r > max_rank:
            raise ConfigError(f"{where}: {module} has rank {r} above adapters.max_rank={max_rank}; raise "
                              f"adapters.max_rank in the placement or use a lower-rank adapter")
        lora[module] = LoraModule(a, b, alpha / (math.sqrt(r) if rs else r))
        top = max(top, r)
    if model_config.tied and "lm_head" in rows:
        raise ConfigError(f"{where}: lm_head token rows on a tied model: the lm_head is the embedding there; train "
                          f"embed_tokens rows only")
    missing = sorted(_tti_targets(cfg, where) - set(rows))
    if missing:     # loading without them would drop rows the config says were trained
        raise ConfigError(f"{where}: trainable_token_indices names {missing[0]} ids but adapter_model.safetensors "
                          f"holds no {missing[0]} token rows ({missing[0]}.token_adapter.trainable_tokens_delta)")
    tok = {}
    for target, t in rows.items():
        if t.dim() != 2 or t.shape[1] != H:
            raise ConfigError(f"{where}: {target} token rows have shape {tuple(t.shape)}, the model needs (K, {H})")
        tok[target] = (_token_ids(cfg, target, t.shape[0], V, where), t)
    e, lm = tok.get("embed_tokens", (None, None)), tok.get("lm_head", (None, None))
    return AdapterWeights(name or d.name, V, model_config.tied, top, lora, e[0], e[1], lm[0], lm[1],
                          content_digest(cfg, tensors))
