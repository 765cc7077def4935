"""Overlays (rows that replace embeddings) and their publication across contexts by host bounce; the one module
where rows cross contexts. Runs in stage processes: the tower engine's (publish_out) and the intake's (land, splice).
"""
from __future__ import annotations

import enum
import hashlib
import numbers
import warnings
from dataclasses import dataclass

import numpy as np
import torch

from memra_pp.engine import ContextId, Engine, process_counters, residency_of
from memra_pp.errors import ConfigError, OverlayError, ResidencyError
from memra_pp.token_overlay import TokenOverlay, TokenOverlaySet  # noqa: F401 - the overlay API, one import
from memra_pp.token_overlay import describe_layout, has_values, require_engine

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


def rows_digest(rows: torch.Tensor) -> str:
    """sha256 of a tensor's bytes (read to the host): equal digests, bit-identical rows."""
    return hashlib.sha256(rows.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def _record(engine: Engine, what: str, rows: torch.Tensor) -> None:
    """The battery's proof that a publication is bit-exact (battery_stage.record_rows): off unless it records."""
    if engine.counters.row_digests is not None:
        engine.counters.row_digests.append((what, rows_digest(rows)))


def _check_spans(rows: torch.Tensor, spans) -> tuple[Span, ...]:
    if not isinstance(rows, torch.Tensor):
        raise OverlayError(f"overlay rows must be a torch.Tensor (N, H), got a {type(rows).__name__}")
    if not has_values(rows):
        raise OverlayError(f"overlay rows must be a dense tensor holding values, got {describe_layout(rows)}")
    if rows.dim() != 2 or 0 in rows.shape:      # (N, 0) rows would splice nothing into any target
        raise OverlayError(f"overlay rows must be a non-empty (N, H) tensor, got shape {tuple(rows.shape)}")
    # floating point, but any bit pattern: a publication carries the rows bit-exact, NaN payloads included
    if not rows.is_floating_point():
        raise OverlayError(f"overlay rows must be floating point (they replace embeddings), got {rows.dtype}")
    if not isinstance(spans, (list, tuple)):
        raise OverlayError(f"overlay spans must be a list of (prompt_pos, row_off, n_rows), got {spans!r}")
    n = rows.shape[0]
    out = []
    for i, s in enumerate(spans):
        if not isinstance(s, (list, tuple)) or len(s) != 3 or not all(_is_int(v) for v in s):
            raise OverlayError(f"span {i} {s!r} must be three ints (prompt_pos, row_off, n_rows)")
        p, r, k = (int(v) for v in s)
        if p < 0 or r < 0 or k < 1 or r + k > n:
            raise OverlayError(f"span {i} {(p, r, k)} is outside rows [0, {n}) or empty (prompt_pos, row_off >= 0, "
                               f"n_rows >= 1)")
        out.append((p, r, k))
    for key, what in ((0, "prompt positions"), (1, "rows")):
        order = sorted(range(len(out)), key=lambda j: out[j][key])
        for a, b in zip(order, order[1:]):
            if out[a][key] + out[a][2] > out[b][key]:
                raise OverlayError(f"span {b} {out[b]} overlaps span {a} {out[a]} in {what}")
    return tuple(sorted(out))


def _is_int(v) -> bool:
    """An integer position or count (numpy's too), never a bool or a float."""
    return isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))


def _not_resident(what: str, ctx: ContextId, engine: Engine, fix: str) -> ResidencyError:
    return ResidencyError(f"{what} live in {ctx} but engine {engine.device} is {engine.ctx}; {fix}")


_FIX = "publish them into the consuming engine with EmbedOverlay.new_published(tower, intake, mode, rows, spans)"


class EmbedOverlay:
    """Image rows (N, H) spliced into the prompt at spans; `ctx` is read from the rows' allocation."""

    def __init__(self, engine: Engine, rows: torch.Tensor, spans):
        require_engine(engine, "EmbedOverlay's engine")
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
        return self.ctx == require_engine(engine, "resident_in's engine").ctx

    def require_resident(self, engine: Engine) -> None:
        if self.ctx != require_engine(engine, "require_resident's engine").ctx:
            raise _not_resident("overlay rows", self.ctx, engine, f"they must not be read there: {_FIX}")

    def window(self, off: int, length: int) -> EmbedOverlay | None:
        """The overlay over prompt positions [off, off+length), spans rebased to 0; rows shared, not copied."""
        if not (_is_int(off) and _is_int(length)) or off < 0 or length < 1:   # (a float would make float spans)
            raise OverlayError(f"window(off={off!r}, length={length!r}) must be ints with off >= 0 and length >= 1")
        off, length = int(off), int(length)     # (numpy's: the spans stay plain ints, as the constructor makes them)
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
        H = self.rows.shape[1]
        if not isinstance(embedded_TD, torch.Tensor):
            raise OverlayError(f"splice target must be a (T, {H}) torch.Tensor, got a {type(embedded_TD).__name__}")
        if embedded_TD.dim() != 2 or embedded_TD.shape[1] != H:
            raise OverlayError(f"splice target {tuple(embedded_TD.shape)} is not (T, {H})")
        if embedded_TD.dtype != self.rows.dtype:    # copy_ would cast: the rows would not arrive bit-exact
            raise OverlayError(f"splice target is {embedded_TD.dtype} but the overlay rows are {self.rows.dtype}; "
                               f"produce the rows in the embedding's dtype (the model's)")
        if not _is_int(chunk_off) or chunk_off < 0:
            raise OverlayError(f"splice chunk_off {chunk_off!r} must be the chunk's first prompt position, an int >= 0")
        T = embedded_TD.shape[0]
        if embedded_TD.device != self.rows.device:
            raise ResidencyError(f"splice target lives on {embedded_TD.device}, the overlay rows in {self.ctx}; "
                                 f"embed on engine {engine.device}")
        ctx = engine.foreign_context(embedded_TD)      # (a device's tensor over another context's memory)
        if ctx is not None:
            raise _not_resident("the splice target's bytes", ctx, engine, "the rows cannot be written there: embed "
                                "in the engine's own context")
        written = 0
        for p, r, k in self.spans:
            lo, hi = max(p, chunk_off), min(p + k, chunk_off + T)
            if lo < hi:
                embedded_TD[lo - chunk_off:hi - chunk_off].copy_(self.rows[r + lo - p:r + hi - p])
                written += hi - lo
                engine.counters.mid_span_splices += int(p < chunk_off)  # lo == chunk_off < hi <= p + k
        if written:
            if self.rows.is_cuda:
                # The copy was enqueued on the current stream: the rows' memory must not be recycled by their
                # allocation stream until it has run.
                self.rows.record_stream(torch.cuda.current_stream(self.rows.device))
            engine.counters.splices += 1
            _record(engine, "spliced", self.rows)
        return written

    @staticmethod
    def new_published(tower: Engine, intake: Engine, mode, rows: torch.Tensor, spans) -> EmbedOverlay:
        """An overlay resident in `intake` made from rows produced in `tower`: zero-copy when they share a context
        (unless FORCE), host bounce when they differ (unless NEVER, which refuses)."""
        require_engine(tower, "new_published's tower"), require_engine(intake, "new_published's intake")
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
            raise OverlayError(f"published rows carry unknown dtype {self.dtype!r}: not a dtype of this process's "
                               f"torch {torch.__version__}; the tower and intake stages must run the same torch")
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
    _record(tower, "published", src)
    if into is not None and into.numel() >= nbytes:
        into[:nbytes].copy_(src.reshape(-1).view(torch.uint8))   # a synchronous dtoh straight into the slot
        return PublishedRows(None, dtype, shape, spans, ctx)
    host = src.to("cpu")                         # a synchronous dtoh on the current stream of tower's device
    if host.untyped_storage().data_ptr() == rows.untyped_storage().data_ptr():
        host = host.clone()                      # CPU rows: a snapshot, never a view the tower may write again
    return PublishedRows(host.reshape(-1).view(torch.uint8).numpy(), dtype, shape, spans, ctx)
