"""Overlays (rows that replace embeddings) and their publication across contexts by host bounce; the one module
where rows cross contexts. Runs in stage processes: the tower engine's (publish_out) and the intake's (land, splice).
"""
from __future__ import annotations

import enum
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from memra_pp.engine import ContextId, Engine, process_counters, residency_of
from memra_pp.errors import ConfigError, OverlayError, ResidencyError

Span = tuple[int, int, int]  # (prompt_pos, row_off, n_rows)


class OverlayPublish(enum.Enum):
    AUTO = "auto"    # publish only when tower and intake contexts differ
    FORCE = "force"  # always publish (exercises the host bounce on a single-context placement)
    NEVER = "never"  # never publish; refuse when the contexts differ


def resolve_overlay_publish(value) -> OverlayPublish:
    if isinstance(value, OverlayPublish):
        return value
    if isinstance(value, str):
        for mode in OverlayPublish:
            if value.strip().lower() == mode.value:
                return mode
    raise ConfigError(f"overlay_publish: {value!r} is not one of {[m.value for m in OverlayPublish]}")


def overlay_publications() -> int:
    """Overlays landed by host bounce in this process (all engines)."""
    return process_counters().publications


def _check_spans(rows: torch.Tensor, spans) -> tuple[Span, ...]:
    if rows.dim() != 2 or rows.shape[0] == 0:
        raise OverlayError(f"overlay rows must be a non-empty (N, H) tensor, got shape {tuple(rows.shape)}")
    n = rows.shape[0]
    out = []
    for i, s in enumerate(spans):
        if len(s) != 3 or not all(isinstance(v, int) and not isinstance(v, bool) for v in s):
            raise OverlayError(f"span {i} {s!r} must be three ints (prompt_pos, row_off, n_rows)")
        p, r, k = s
        if p < 0 or r < 0 or k < 1 or r + k > n:
            raise OverlayError(f"span {i} {tuple(s)} is outside rows [0, {n}) or empty (prompt_pos, row_off >= 0, "
                               f"n_rows >= 1)")
        out.append((p, r, k))
    for key, what in ((0, "prompt positions"), (1, "rows")):
        order = sorted(range(len(out)), key=lambda j: out[j][key])
        for a, b in zip(order, order[1:]):
            if out[a][key] + out[a][2] > out[b][key]:
                raise OverlayError(f"span {b} {out[b]} overlaps span {a} {out[a]} in {what}")
    return tuple(sorted(out))


def _not_resident(what: str, ctx: ContextId, engine: Engine, fix: str) -> ResidencyError:
    return ResidencyError(f"{what} live in {ctx} but engine {engine.device} is {engine.ctx}; {fix}")


_FIX = "publish them into the consuming engine with EmbedOverlay.new_published(tower, intake, mode, rows, spans)"


class EmbedOverlay:
    """Image rows (N, H) spliced into the prompt at spans; `ctx` is read from the rows' allocation."""

    def __init__(self, engine: Engine, rows: torch.Tensor, spans):
        spans = _check_spans(rows, spans)
        ctx = residency_of(rows, engine)
        if ctx != engine.ctx:
            raise _not_resident("overlay rows", ctx, engine, f"they cannot be wrapped there: {_FIX}")
        self._init(ctx, rows, spans)

    def _init(self, ctx: ContextId, rows: torch.Tensor, spans: tuple[Span, ...]) -> None:
        self.ctx, self.rows, self.spans = ctx, rows, spans  # rows_NH

    @classmethod
    def _carried(cls, ctx: ContextId, rows: torch.Tensor, spans: tuple[Span, ...]) -> EmbedOverlay:
        o = cls.__new__(cls)
        o._init(ctx, rows, spans)
        return o

    def __repr__(self) -> str:
        return f"EmbedOverlay({tuple(self.rows.shape)} rows, spans={list(self.spans)}, ctx={self.ctx})"

    def __reduce__(self):
        # The context travels with the rows, so a copy landing in another process is refused there.
        return (EmbedOverlay._carried, (self.ctx, self.rows, self.spans))

    def resident_in(self, engine: Engine) -> bool:
        return self.ctx == engine.ctx

    def require_resident(self, engine: Engine) -> None:
        if self.ctx != engine.ctx:
            raise _not_resident("overlay rows", self.ctx, engine, f"they must not be read there: {_FIX}")

    def window(self, off: int, length: int) -> EmbedOverlay | None:
        """The overlay over prompt positions [off, off+length), spans rebased to 0; rows shared, not copied."""
        if off < 0 or length < 1:
            raise OverlayError(f"window(off={off}, length={length}) must have off >= 0 and length >= 1")
        spans = []
        for p, r, k in self.spans:
            lo, hi = max(p, off), min(p + k, off + length)
            if lo < hi:
                spans.append((lo - off, r + lo - p, hi - lo))
        if not spans:
            return None
        return EmbedOverlay._carried(self.ctx, self.rows.view(self.rows.shape), tuple(spans))

    def splice_into(self, engine: Engine, embedded_TD: torch.Tensor, chunk_off: int) -> int:
        """Write the rows falling in prompt positions [chunk_off, chunk_off+T) into `embedded_TD` (in place);
        returns the rows written. Refuses unless the rows live in `engine`'s context."""
        self.require_resident(engine)
        T = embedded_TD.shape[0]
        if embedded_TD.dim() != 2 or embedded_TD.shape[1] != self.rows.shape[1]:
            raise OverlayError(f"splice target {tuple(embedded_TD.shape)} is not (T, {self.rows.shape[1]})")
        if embedded_TD.device != self.rows.device:
            raise ResidencyError(f"splice target lives on {embedded_TD.device}, the overlay rows in {self.ctx}; "
                                 f"embed on engine {engine.device}")
        written = 0
        for p, r, k in self.spans:
            lo, hi = max(p, chunk_off), min(p + k, chunk_off + T)
            if lo < hi:
                embedded_TD[lo - chunk_off:hi - chunk_off].copy_(self.rows[r + lo - p:r + hi - p])
                written += hi - lo
        if written:
            if self.rows.is_cuda:
                # The copy was enqueued on the current stream: the rows' memory must not be recycled by their
                # allocation stream until it has run.
                self.rows.record_stream(torch.cuda.current_stream(self.rows.device))
            engine.counters.splices += 1
        return written

    @staticmethod
    def new_published(tower: Engine, intake: Engine, mode, rows: torch.Tensor, spans) -> EmbedOverlay:
        """An overlay resident in `intake` made from rows produced in `tower`: zero-copy when they share a context
        (unless FORCE), host bounce when they differ (unless NEVER, which refuses)."""
        if must_publish(resolve_overlay_publish(mode), tower.ctx, intake.ctx):
            return publish_out(tower, rows, spans).land(intake)
        return EmbedOverlay(intake, rows, spans)


def must_publish(mode: OverlayPublish, src: ContextId, dst: ContextId) -> bool:
    """Whether rows made in `src` must be published to be read in `dst` under `mode` (NEVER across contexts refuses)."""
    if mode is OverlayPublish.FORCE:
        return True
    if src == dst:
        return False
    if mode is OverlayPublish.NEVER:
        raise ResidencyError(f"overlay_publish: never, but the vision tower runs in {src} and the intake in {dst}; "
                             f"set overlay_publish to auto (or force), or place vision.engine on the intake stage")
    return True


@dataclass(frozen=True, eq=False)
class PublishedRows:
    """Overlay rows in transit between contexts: host bytes plus what is needed to land them (picklable). The bytes
    are a uint8 numpy array (Ray moves it through its object store out of band and the receiver reads it in place),
    or None when the tower wrote them into the intake's publication slot (stages/pub_inbox.py): then `land` reads
    them from that slot and Ray carries only this description."""
    data: np.ndarray | None
    dtype: str    # torch dtype name, e.g. 'bfloat16'
    shape: tuple[int, int]
    spans: tuple[Span, ...]
    source: ContextId

    def __eq__(self, other) -> bool:
        return (isinstance(other, PublishedRows) and (self.dtype, self.shape, self.spans, self.source) ==
                (other.dtype, other.shape, other.spans, other.source) and
                ((self.data is None and other.data is None) or (self.data is not None and other.data is not None
                                                                and np.array_equal(self.data, other.data))))

    __hash__ = None

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.shape[1] * self._torch_dtype().itemsize

    def _torch_dtype(self) -> torch.dtype:
        dtype = getattr(torch, self.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise OverlayError(f"published rows carry unknown dtype {self.dtype!r}")
        return dtype

    def land(self, intake: Engine, host: torch.Tensor | None = None) -> EmbedOverlay:
        """The htod half of a publication, in `intake`'s context; counted on the engine and the process. `host`:
        the intake's publication slot (uint8) the tower wrote into, when `data` is None."""
        dtype = self._torch_dtype()
        if self.data is None:
            if host is None or host.numel() < self.nbytes:
                raise OverlayError("these rows were written into a publication slot: land them from that slot "
                                   f"({self.nbytes} bytes)")
            buf = host[:self.nbytes]
        else:
            with warnings.catch_warnings():              # read, never written: copied below
                warnings.simplefilter("ignore", UserWarning)
                buf = torch.from_numpy(np.frombuffer(self.data, dtype=np.uint8))
        host_rows = buf.view(dtype).reshape(self.shape)
        # the intake's own rows: a device copy (synchronous; DMA when the slot is page-locked), or a host copy
        rows = host_rows.to(intake.device) if intake.is_cuda else host_rows.clone()
        ov = EmbedOverlay(intake, rows, self.spans)
        intake.counters.publications += 1
        process_counters().publications += 1
        return ov


def publish_out(tower: Engine, rows: torch.Tensor, spans, into: torch.Tensor | None = None) -> PublishedRows:
    """The dtoh half of a publication, in `tower`'s context; refuses rows that do not live there. `into`: the
    intake's publication slot (a uint8 host tensor): the rows' bytes are copied there and not carried (rows larger
    than the slot are carried instead)."""
    spans = _check_spans(rows, spans)
    ctx = residency_of(rows, tower)
    if ctx != tower.ctx:
        raise _not_resident("rows to publish", ctx, tower,
                            "the vision tower must produce its rows on its own engine (vision.engine) before "
                            "they can be published")
    src = rows.detach().contiguous()
    dtype, shape = str(src.dtype).removeprefix("torch."), tuple(src.shape)
    nbytes = src.numel() * src.element_size()
    if into is not None and into.numel() >= nbytes:
        into[:nbytes].copy_(src.reshape(-1).view(torch.uint8))   # a synchronous dtoh straight into the slot
        return PublishedRows(None, dtype, shape, spans, ctx)
    host = src.to("cpu")                         # a synchronous dtoh on the current stream of tower's device
    if host.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr():
        host = host.clone()                      # CPU rows: a snapshot, never a view the tower may write again
    return PublishedRows(host.reshape(-1).view(torch.uint8).numpy(), dtype, shape, spans, ctx)


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
    On a tied model the lm tables are the embed tables (the same tensors)."""

    @classmethod
    def from_slots(cls, engine: Engine, overlays, max_loras: int, tied: bool) -> TokenOverlaySet:
        items = dict(overlays) if isinstance(overlays, Mapping) else dict(enumerate(overlays))
        items = {s: o for s, o in items.items() if o is not None}
        vocab = hidden = dtype = None
        for s, o in sorted(items.items()):
            if not 0 <= s < max_loras:
                raise OverlayError(f"token overlay slot {s} is outside [0, max_loras={max_loras})")
            if vocab is not None and o.vocab_size != vocab:
                raise OverlayError(f"token overlay slot {s} has vocab_size {o.vocab_size}, other slots {vocab}")
            if tied and (o.lm_head_ids is not None or o.lm_head_rows is not None):
                raise OverlayError(f"token overlay slot {s} carries lm_head rows on a tied model: the lm_head is the "
                                   f"embedding there, pass embed rows only")
            vocab = o.vocab_size
            for ids, rows in ((o.embed_ids, o.embed_rows), (o.lm_head_ids, o.lm_head_rows)):
                if ids is None and rows is None:
                    continue
                hidden = _check_token_rows(s, ids, rows, vocab, hidden)
                dtype = dtype or rows.dtype
        self = cls.__new__(cls)
        self.max_loras, self.tied, self.vocab_size = max_loras, tied, vocab or 0
        dev = engine.device
        embed = _tables({s: (o.embed_ids, o.embed_rows) for s, o in items.items()},
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


def _check_token_rows(slot: int, ids, rows, vocab: int, hidden):
    if ids is None or rows is None or ids.dim() != 1 or rows.dim() != 2 or rows.shape[0] != ids.shape[0]:
        raise OverlayError(f"token overlay slot {slot}: ids (K,) and rows (K, H) must come together, got "
                           f"{None if ids is None else tuple(ids.shape)} and {None if rows is None else tuple(rows.shape)}")
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
