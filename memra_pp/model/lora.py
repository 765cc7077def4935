"""LoRA slots of one stage: preallocated A/B buffers per targeted projection of the stage's own layers, and the
batched per-token LoRA delta applied inside the layers. Runs in the stage process; knows nothing of actors.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ..errors import ConfigError, InputError
from .batch import StepBatch
from .config import ModelConfig, TextConfig
from .weights import expected_shape

ATTENTION = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
LINEAR_ATTENTION = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
                    "linear_attn.in_proj_a", "linear_attn.out_proj")
DENSE_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
SHARED_EXPERT = ("mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj")


def layer_modules(tc: TextConfig, i: int) -> tuple[str, ...]:
    """The LoRA-targetable projections of layer i, as canonical module names without the `layers.{i}.` prefix."""
    return (ATTENTION if tc.is_full(i) else LINEAR_ATTENTION) + (SHARED_EXPERT if tc.moe else DENSE_MLP)


def local_name(module: str) -> str:
    """'self_attn.q_proj' -> 'q_proj', 'mlp.shared_expert.up_proj' -> 'shared_expert.up_proj': the name a layer's
    Param uses for the weight (unique within a layer)."""
    return module.split(".", 1)[1]


class LoraPool:
    """`max_loras` adapter slots for layers `layers` of one stage. Slot s of projection (i, name) lives in rows
    [s*R, (s+1)*R) of `a[(i, name)]` (A_CI, C = S*R) and the same columns of `b[(i, name)]` (B_OC, pre-scaled);
    ranks below R are zero-padded, so every slot computes at rank R exactly."""

    def __init__(self, mc: ModelConfig, layers, max_loras: int, max_rank: int, dtype=torch.float32, device="cpu"):
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
            raise ConfigError(f"adapters.max_loras must be a positive integer, got {max_loras!r}")
        if isinstance(max_rank, bool) or not isinstance(max_rank, int) or max_rank < 1:
            raise ConfigError(f"adapters.max_rank must be a positive integer, got {max_rank!r}")
        tc = mc.text
        self.mc, self.layers = mc, list(layers)
        self.S, self.R, self.dtype, self.device = max_loras, max_rank, dtype, torch.device(device)
        C = max_loras * max_rank
        self._require_fits(tc, dtype)
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        for i in self.layers:
            for m in layer_modules(tc, i):
                out, inp = expected_shape(f"layers.{i}.{m}.weight", tc)
                self.a[(i, local_name(m))] = torch.zeros(C, inp, dtype=dtype, device=self.device)
                self.b[(i, local_name(m))] = torch.zeros(out, C, dtype=dtype, device=self.device)
        self.targets: dict[tuple[int, str], set[int]] = {k: set() for k in self.a}
        self.names: list[str | None] = [None] * max_loras
        self.col_slot_C = torch.arange(C, device=self.device) // max_rank

    def _require_fits(self, tc: TextConfig, dtype) -> None:
        """Refuse adapters.max_loras x max_rank whose pools the device cannot hold, before any is allocated (a
        billion slots passed the schema, and the first load took the node's memory until Ray's OOM killer ended
        both stages)."""
        from .kv_memory import device_available, fits, reachable_blocks, size_text
        per_rank = sum(sum(expected_shape(f"layers.{i}.{m}.weight", tc)) for i in self.layers
                       for m in layer_modules(tc, i)) * torch.empty(0, dtype=dtype).element_size()
        need, have = self.S * self.R * per_rank, device_available(self.device)
        if have is None or fits(need, have):
            return
        most = reachable_blocks(0, self.S, lambda m: fits(m * self.R * per_rank, have))
        raise ConfigError(f"adapters.max_loras {self.S} x adapters.max_rank {self.R}: the LoRA pools of layers "
                          f"[{self.layers[0]}, {self.layers[-1] + 1}) need {size_text(need)} on {self.device}, which "
                          f"has {size_text(have)} {'free' if self.device.type == 'cuda' else 'available'}; lower "
                          f"adapters.max_loras" + (f" (at most {most} fit at this max_rank)" if most else "") +
                          " or adapters.max_rank")

    def __repr__(self) -> str:
        return f"LoraPool(layers={self.layers[0]}..{self.layers[-1]}, slots={self.names}, max_rank={self.R})"

    def _check_slot(self, slot: int) -> None:
        if not isinstance(slot, int) or not 0 <= slot < self.S:
            raise InputError(f"adapter slot {slot!r} is outside [0, max_loras={self.S})")

    def load(self, slot: int, weights) -> None:
        """Copy an AdapterWeights' LoRA of this stage's layers into `slot` (replacing what it held). Refuses
        modules of other layers: pass `weights.for_layers(start, end)`."""
        self._check_slot(slot)
        todo = {}
        for module, lw in weights.lora.items():
            parts = module.split(".", 2)
            key = (int(parts[1]), local_name(parts[2]))
            if key[0] not in self.layers:
                raise ConfigError(f"adapter {weights.name!r}: module {module!r} is not in this stage's layers "
                                  f"[{self.layers[0]}, {self.layers[-1] + 1}); load weights.for_layers(start, end)")
            if key not in self.a:
                raise ConfigError(f"adapter {weights.name!r}: module {module!r} is not a LoRA target of layer "
                                  f"{key[0]} (targets: {list(layer_modules(self.mc.text, key[0]))})")
            r = lw.a_RI.shape[0]
            if r > self.R:
                raise ConfigError(f"adapter {weights.name!r}: module {module!r} has rank {r} above "
                                  f"adapters.max_rank={self.R}")
            if lw.a_RI.shape[1] != self.a[key].shape[1] or lw.b_OR.shape != (self.b[key].shape[0], r):
                raise ConfigError(f"adapter {weights.name!r}: module {module!r} has A {tuple(lw.a_RI.shape)}, "
                                  f"B {tuple(lw.b_OR.shape)}; the model needs A (r, {self.a[key].shape[1]}), "
                                  f"B ({self.b[key].shape[0]}, r)")
            # scale folded into B in float32 before the cast (as vLLM does): one fewer multiply per token; cast
            # where the file's tensors are (the host), one module at a time on the device below
            a = lw.a_RI.to(dtype=self.a[key].dtype)
            b = (lw.b_OR.float() * lw.scale).to(dtype=self.b[key].dtype)
            if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
                # a step computes every slot's LoRA and masks it per row, and 0 * inf is NaN: one adapter's inf
                # would reach every adapter's requests of the batch. Refused before the slot is touched.
                raise ConfigError(f"adapter {weights.name!r}: module {module!r} is not finite in the pool's "
                                  f"{str(self.b[key].dtype).replace('torch.', '')} (lora_A, or lora_B x scale "
                                  f"{lw.scale:g}): lower lora_alpha or check the weights")
            todo[key] = (a, b)
        self.unload(slot)
        lo = slot * self.R
        for key, (a, b) in todo.items():
            r = a.shape[0]
            self.a[key][lo:lo + r] = a.to(self.a[key].device)
            self.b[key][:, lo:lo + r] = b.to(self.b[key].device)
            self.targets[key].add(slot)
        self.names[slot] = weights.name

    def unload(self, slot: int) -> None:
        self._check_slot(slot)
        lo, hi = slot * self.R, (slot + 1) * self.R
        for key in self.a:
            if slot in self.targets[key]:
                self.a[key][lo:hi].zero_()
                self.b[key][:, lo:hi].zero_()
                self.targets[key].discard(slot)
        self.names[slot] = None

    def step(self, b: StepBatch) -> LoraStep | None:
        """The batch's LoRA view, or None when no sequence of `b` uses a slot holding LoRA weights (no extra work)."""
        if not b.uses_adapters():
            return None
        used = {s for s in b.adapter_slots if s >= 0}
        for s in used:
            self._check_slot(s)
            if self.names[s] is None:
                raise InputError(f"adapter slot {s} is empty on stage layers [{self.layers[0]}, "
                                 f"{self.layers[-1] + 1}); load the adapter on every stage before using it")
        if not any(t & used for t in self.targets.values()):
            return None
        slot_T = b.adapter_slot_per_token(self.device)
        return LoraStep(self, slot_T[:, None] == self.col_slot_C[None, :])


class LoraStep:
    """One StepBatch's LoRA: y += where(mask, x A^T, 0) B^T per projection, two GEMMs over all slots at once.
    mask_TC (bool) keeps, for token t, only the R columns of its own slot (none for slot -1), so other slots add
    exact zeros. Selected, not multiplied: an adapter whose A and B x scale are finite may still overflow in x A,
    and 0 * inf is NaN in every other request's row of the batch."""

    def __init__(self, pool: LoraPool, mask_TC: torch.Tensor):
        self.pool, self.mask_TC = pool, mask_TC

    def layer(self, i: int):
        """The hook the layer's projections call: hook(name, x_TI, y_TO) -> y_TO plus the delta."""
        return functools.partial(self.apply, i)

    def apply(self, i: int, name: str, x_TI: torch.Tensor, y_TO: torch.Tensor) -> torch.Tensor:
        key = (i, name)
        if not self.pool.targets.get(key):
            return y_TO
        xa_TC = torch.where(self.mask_TC, F.linear(x_TI, self.pool.a[key]), 0.0)
        return y_TO + F.linear(xa_TC, self.pool.b[key])
