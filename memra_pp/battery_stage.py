"""Battery checks that run inside a live stage process, against that stage's own engine (no Ray here)."""
from __future__ import annotations

import torch

from .engine import residency_of
from .gpu_checks import refusal as _refused
from .overlay import EmbedOverlay, OverlayPublish, overlay_publications, rows_digest


def context(r) -> dict:
    return {"ctx": r.engine.ctx, "device": str(r.engine.device), "pid": r.engine.ctx.pid}


def secondary(r) -> dict:
    """Rows allocated in a second, non-primary context on this stage's device: refused at construction, splice
    and publication source, each with its own message."""
    if not r.engine.is_cuda:
        return {"applicable": False}
    from .gpu_checks import secondary_context
    out = secondary_context(r.engine.device.index)
    out["applicable"] = True
    return out


def same_context_publication(r) -> dict:
    """AUTO between engines of one context aliases the rows (same pointer, no publication); FORCE publishes
    byte-identically and moves the counter."""
    e = r.engine
    rows = torch.randn(12, r.mc.text.hidden_size, device=e.device).to(r.dtype)
    c0 = overlay_publications()
    auto = EmbedOverlay.new_published(e, e, OverlayPublish.AUTO, rows, [(2, 0, 12)])
    c1 = overlay_publications()
    forced = EmbedOverlay.new_published(e, e, OverlayPublish.FORCE, rows, [(2, 0, 12)])
    c2 = overlay_publications()
    same = forced.rows.reshape(-1).view(torch.uint8).cpu().numpy().tobytes() == \
        rows.reshape(-1).view(torch.uint8).cpu().numpy().tobytes()
    return {"auto_aliases": auto.rows.data_ptr() == rows.data_ptr(), "auto_published": c1 - c0,
            "force_published": c2 - c1, "force_bytes_identical": same,
            "force_resident": residency_of(forced.rows, e) == e.ctx,
            "force_copy": forced.rows.data_ptr() != rows.data_ptr()}


def foreign_context(r, other_ctx) -> dict:
    """An overlay that claims another process's context (whose handle value may equal a local one) is refused."""
    e = r.engine
    rows = torch.ones(4, r.mc.text.hidden_size, device=e.device, dtype=r.dtype)
    ov = EmbedOverlay._carried(other_ctx, rows, ((0, 0, 4),))
    emb = torch.zeros_like(rows)
    return {"mine": str(e.ctx), "theirs": str(other_ctx), "same_uid_value": other_ctx.uid == e.ctx.uid,
            "same_device": other_ctx.device == e.ctx.device, "differ": other_ctx != e.ctx,
            "require_resident": _refused(lambda: ov.require_resident(e)),
            "splice": _refused(lambda: ov.splice_into(e, emb, 0)),
            "untouched": bool(emb.abs().sum().item() == 0)}


def record_rx(r, on: bool) -> list[str]:
    """Start (on) or stop-and-return the sha256 of every activation this stage receives at its boundary."""
    out = list(getattr(r, "rx_hashes", None) or [])
    r.rx_hashes = [] if on else None
    return out


def record_rows(r, on: bool) -> list[tuple[str, str]]:
    """Start (on) or stop-and-return the sha256 of the rows of each overlay this stage's engine publishes (the
    tower's, before the dtoh) or splices (the intake's, the rows the splice read): ("published" | "spliced", hex)."""
    c = r.engine.counters
    out = list(c.row_digests or [])
    c.row_digests = [] if on else None
    return out


def hash_rx(r, view: torch.Tensor) -> None:
    if getattr(r, "rx_hashes", None) is not None:
        r.rx_hashes.append(rows_digest(view))


CHECKS = {"context": context, "secondary": secondary, "same_context_publication": same_context_publication,
          "foreign_context": foreign_context, "record_rx": record_rx, "record_rows": record_rows}
