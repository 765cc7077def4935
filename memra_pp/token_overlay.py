"""Token overlays: an adapter's trainable-token rows (embedding rows, and lm_head rows on untied models) as device
tables per adapter slot on one engine. Part of the overlay API (`memra_pp.overlay` re-exports both classes). Runs
in stage processes (the intake's embedding, the primary's lm_head).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from memra_pp.engine import ContextId, Engine
from memra_pp.errors import ConfigError, OverlayError, ResidencyError
from memra_pp.model.weights import FLOAT_DTYPES


def require_engine(e, what: str) -> Engine:
    """`e` itself when it is an engine (an Engine, or anything carrying a ContextId as `.ctx`); an OverlayError
    naming `what` otherwise (None or a device string reached `.ctx` as a bare AttributeError)."""
    if not isinstance(getattr(e, "ctx", None), ContextId):
        raise OverlayError(f"{what} must be a memra_pp.engine.Engine (Engine(device)), got {type(e).__name__} {e!r}")
    return e


@dataclass(frozen=True)
class TokenOverlay:
    """One adapter slot's trainable-token rows: embedding rows for `embed_ids` and, on untied models, lm_head rows."""
    vocab_size: int
    embed_ids: torch.Tensor                   # (K,) int
    embed_rows: torch.Tensor                  # (K, H)
    lm_head_ids: torch.Tensor | None = None   # (L,) int, untied models only
    lm_head_rows: torch.Tensor | None = None  # (L, H)


class TokenOverlaySet:
    """Per-adapter-slot token rows as device tables on one engine. For kind in (embed, lm): `{kind}_map_SV` holds
    -1 or a row of `{kind}_rows_RH`; `{kind}_counts_S` the rows per slot; `lm_ids_R` / `lm_slot_R` name each lm row.
    On a tied model the lm tables are the embed tables (the same tensors). The rows tables hold every slot's rows in
    one dtype, the widest of theirs (torch.promote_types: slots loaded from bf16 and f32 files are both kept exactly,
    in f32); the apply casts to the activations' dtype."""

    @classmethod
    def from_slots(cls, engine: Engine, overlays, max_loras: int, tied: bool) -> TokenOverlaySet:
        require_engine(engine, "from_slots' engine")
        if isinstance(max_loras, bool) or not isinstance(max_loras, int) or max_loras < 1:
            raise ConfigError(f"max_loras (adapters.max_loras) must be an integer >= 1, got {max_loras!r}")
        if not isinstance(tied, bool):      # ("no" would be taken as True: the lm_head tables become the embedding's)
            raise OverlayError(f"tied must be True or False (the model ties its lm_head to the embedding), got "
                               f"{tied!r}")
        items = dict(overlays) if isinstance(overlays, Mapping) else dict(enumerate(overlays))
        items = {s: o for s, o in items.items() if o is not None}
        for s, o in items.items():      # before sorting them: keys of mixed types do not sort
            if isinstance(s, bool) or not isinstance(s, int):
                raise OverlayError(f"token overlay slot {s!r} must be an int in [0, max_loras={max_loras})")
            if not isinstance(o, TokenOverlay):
                raise OverlayError(f"token overlay slot {s} is a {type(o).__name__}, not a TokenOverlay")
        for s, o in items.items():      # first: the checks below read the rows (on their device)
            for what, t in (("embed ids", o.embed_ids), ("embed rows", o.embed_rows),
                            ("lm_head ids", o.lm_head_ids), ("lm_head rows", o.lm_head_rows)):
                ctx = engine.foreign_context(t) if isinstance(t, torch.Tensor) and has_values(t) else None
                if ctx is not None:
                    raise ResidencyError(f"token overlay slot {s}: {what} live in {ctx} but engine {engine.device} is "
                                         f"{engine.ctx}; they cannot be read there: load them on the host or in the "
                                         f"engine's own context")
        vocab = hidden = dtype = None
        for s, o in sorted(items.items()):
            if not 0 <= s < max_loras:
                raise OverlayError(f"token overlay slot {s} is outside [0, max_loras={max_loras})")
            if isinstance(o.vocab_size, bool) or not isinstance(o.vocab_size, int) or o.vocab_size < 1:
                raise OverlayError(f"token overlay slot {s} has vocab_size {o.vocab_size!r}: the model's vocabulary "
                                   f"size, an integer >= 1")
            if vocab is not None and o.vocab_size != vocab:
                raise OverlayError(f"token overlay slot {s} has vocab_size {o.vocab_size}, other slots {vocab}")
            if tied and (o.lm_head_ids is not None or o.lm_head_rows is not None):
                raise OverlayError(f"token overlay slot {s} carries lm_head rows on a tied model: the lm_head is the "
                                   f"embedding there, pass embed rows only")
            vocab = o.vocab_size
            for kind, ids, rows in (("embed", o.embed_ids, o.embed_rows), ("lm_head", o.lm_head_ids, o.lm_head_rows)):
                if ids is None and rows is None:
                    continue
                hidden = _check_token_rows(s, kind, ids, rows, vocab, hidden)
                dtype = rows.dtype if dtype is None else torch.promote_types(dtype, rows.dtype)
        self = cls.__new__(cls)
        self.ctx = engine.ctx               # the tables' context (they are made on engine.device below)
        self.max_loras, self.tied, self.vocab_size = max_loras, tied, vocab or 0
        dev = engine.device
        embed = _tables({s: (o.embed_ids, o.embed_rows) for s, o in items.items() if o.embed_ids is not None},
                        max_loras, self.vocab_size, hidden, dtype, dev)
        lm = embed if tied else _tables({s: (o.lm_head_ids, o.lm_head_rows) for s, o in items.items()
                                         if o.lm_head_ids is not None}, max_loras, self.vocab_size, hidden, dtype, dev)
        self.embed_map_SV, self.embed_rows_RH, self.embed_counts_S, _, _ = embed
        self.lm_map_SV, self.lm_rows_RH, self.lm_counts_S, self.lm_ids_R, self.lm_slot_R = lm
        self._active = bool(items)
        return self

    def any_active(self) -> bool:
        return self._active

    def apply_embedding(self, ids_T, slot_per_token_T, embedded_TD):
        """Reference: rows of tokens whose slot (>= 0) overrides their id replace `embedded_TD` rows in place."""
        if not self._active:
            return embedded_TD
        sel = (slot_per_token_T >= 0).nonzero().squeeze(1)
        r = self.embed_map_SV[slot_per_token_T[sel].long(), ids_T[sel].long()].long()
        hit = r >= 0
        embedded_TD[sel[hit]] = self.embed_rows_RH[r[hit]].to(embedded_TD.dtype)
        return embedded_TD

    def apply_lm_head(self, hidden_BD, slot_per_row_B, logits_BV):
        """Reference: for each row's slot, the overridden ids' logits become hidden . lm_row (f32 accumulate)."""
        if not self._active or self.lm_rows_RH.shape[0] == 0:
            return logits_BV
        dots_BR = hidden_BD.float() @ self.lm_rows_RH.float().T
        b, r = (slot_per_row_B.long()[:, None] == self.lm_slot_R[None, :]).nonzero(as_tuple=True)
        logits_BV[b, self.lm_ids_R[r]] = dots_BR[b, r].to(logits_BV.dtype)
        return logits_BV


def has_values(t: torch.Tensor) -> bool:
    """A dense (strided) tensor with values: not sparse, nested or meta (no row of those can be spliced, copied
    or published as it is)."""
    return t.layout == torch.strided and not t.is_nested and t.device.type != "meta"


def describe_layout(t: torch.Tensor) -> str:
    return "a nested tensor" if t.is_nested else f"layout {t.layout} on device {t.device.type}"


def _check_token_rows(slot: int, kind: str, ids, rows, vocab: int, hidden):
    for what, t in (("ids", ids), ("rows", rows)):
        if t is not None and not isinstance(t, torch.Tensor):
            raise OverlayError(f"token overlay slot {slot}: {kind} {what} must be a torch.Tensor, got a "
                               f"{type(t).__name__}")
    for what, t in (("ids", ids), ("rows", rows)):
        if t is not None and not has_values(t):
            raise OverlayError(f"token overlay slot {slot}: {kind} {what} must be a dense tensor holding values, "
                               f"got {describe_layout(t)}")
    if ids is None or rows is None or ids.dim() != 1 or rows.dim() != 2 or rows.shape[0] != ids.shape[0]:
        raise OverlayError(f"token overlay slot {slot}: ids (K,) and rows (K, H) must come together, got "
                           f"{None if ids is None else tuple(ids.shape)} and "
                           f"{None if rows is None else tuple(rows.shape)}")
    if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
        raise OverlayError(f"token overlay slot {slot}: {kind} ids must be an integer tensor, got {ids.dtype}")
    if not rows.is_floating_point():
        raise OverlayError(f"token overlay slot {slot}: {kind} rows must be floating point, got {rows.dtype}")
    if rows.dtype not in FLOAT_DTYPES:
        # float8: neither isfinite nor the device kernels take it
        raise OverlayError(f"token overlay slot {slot}: {kind} rows must be float16, bfloat16, float32 or float64, "
                           f"got {rows.dtype}")
    if not bool(torch.isfinite(rows).all()):
        raise OverlayError(f"token overlay slot {slot}: {kind} rows hold NaN or inf")
    if hidden is not None and rows.shape[1] != hidden:
        raise OverlayError(f"token overlay slot {slot} has hidden size {rows.shape[1]}, other slots {hidden}")
    bad = ids[(ids < 0) | (ids >= vocab)]
    if bad.numel():
        raise OverlayError(f"token overlay slot {slot} overrides ids {bad[:5].tolist()} outside [0, vocab={vocab})")
    if torch.unique(ids).numel() != ids.numel():
        raise OverlayError(f"token overlay slot {slot} overrides some id more than once")
    return rows.shape[1]


def _tables(per_slot: dict, S: int, V: int, H, dtype, dev):
    map_SV = torch.full((S, V), -1, dtype=torch.int32)
    counts_S = torch.zeros(S, dtype=torch.int32)
    rows, ids, slots, n = [], [], [], 0
    for s, (i, r) in sorted(per_slot.items()):
        map_SV[s, i.long()] = torch.arange(n, n + i.numel(), dtype=torch.int32)
        counts_S[s] = i.numel()
        rows.append(r.detach().to("cpu", dtype))
        ids.append(i.long().cpu())
        slots.append(torch.full((i.numel(),), s, dtype=torch.long))
        n += i.numel()
    rows_RH = torch.cat(rows) if rows else torch.zeros(0, H or 0, dtype=dtype or torch.float32)
    ids_R = torch.cat(ids) if ids else torch.zeros(0, dtype=torch.long)
    slot_R = torch.cat(slots) if slots else torch.zeros(0, dtype=torch.long)
    return tuple(t.to(dev) for t in (map_SV, rows_RH, counts_S, ids_R, slot_R))
