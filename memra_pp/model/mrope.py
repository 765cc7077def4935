"""M-RoPE positions for a multimodal prompt (transformers' Qwen3_5Model.get_rope_index) and placeholder spans.
Pure functions of token ids and grids; used on the intake stage and the driver.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch

from ..errors import InputError


@dataclasses.dataclass(frozen=True)
class _Segment:
    """One block that takes M-RoPE positions: an image, or one temporal patch (frame pair) of a video."""
    start: int                  # prompt position of its first placeholder
    rows: int                   # placeholders == tower rows
    row_off: int                # offset into the stacked tower output
    grid: tuple[int, int, int]  # (t, h, w) in merged units: t temporal patches, h x w merge blocks


def _runs(ids: Sequence[int], image_token_id: int, video_token_id: int) -> list[tuple[int, int, int]]:
    """Maximal runs of one placeholder token: (start, end, token)."""
    runs, i, n = [], 0, len(ids)
    while i < n:
        tok = ids[i]
        if tok in (image_token_id, video_token_id):
            j = i
            while j < n and ids[j] == tok:
                j += 1
            runs.append((i, j, tok))
            i = j
        else:
            i += 1
    return runs


def _segments(input_ids, grids, image_token_id, video_token_id, merge) -> list[_Segment]:
    ids = [int(t) for t in input_ids]
    grids = [tuple(int(v) for v in g) for g in grids]
    for k, (t, h, w) in enumerate(grids):
        if t <= 0 or h <= 0 or w <= 0 or h % merge or w % merge:
            raise InputError(f"image {k}: grid_thw {(t, h, w)} must be positive with h and w multiples of "
                             f"spatial_merge_size {merge}")
    runs = _runs(ids, image_token_id, video_token_id)
    n_rows = sum(t * h * w for t, h, w in grids) // merge ** 2
    n_slots = sum(e - s for s, e, _ in runs)
    if n_rows != n_slots:
        raise InputError(f"Attempted to assign {n_rows} image tokens to {n_slots} placeholders: the "
                         f"{len(grids)} image(s)/video(s) give {n_rows} tower rows but the prompt holds "
                         f"{n_slots} image/video placeholder tokens; emit t*h*w/{merge ** 2} placeholders each")
    segs, ri, pos, row = [], 0, runs[0][0] if runs else 0, 0
    for k, (t, h, w) in enumerate(grids):
        kind = runs[ri][2]
        is_video = kind == video_token_id
        # Qwen3.5 separates video frames by timestamp text, so each temporal patch is its own block.
        pieces = [(1, h // merge, w // merge)] * t if is_video else [(t, h // merge, w // merge)]
        for g in pieces:
            size = g[0] * g[1] * g[2]
            start, end, tok = runs[ri]
            if tok != kind:
                raise InputError(f"{'video' if is_video else 'image'} {k}: its placeholders continue at prompt "
                                 f"position {pos} with {'image' if is_video else 'video'} tokens; one input "
                                 "uses one kind of placeholder")
            if pos + size > end:
                raise InputError(f"{'video' if is_video else 'image'} {k} (grid {(t, h, w)}) needs {size} "
                                 f"contiguous placeholders at prompt position {pos}, but the run ends at {end}; "
                                 "an image's (or a video frame's) placeholders must not be interrupted")
            segs.append(_Segment(pos, size, row, g))
            pos, row = pos + size, row + size
            if pos == end and ri + 1 < len(runs):
                ri += 1
                pos = runs[ri][0]
    return segs


def rope_positions(input_ids: Sequence[int], grids: Sequence[tuple[int, int, int]], image_token_id: int,
                   video_token_id: int, merge: int) -> tuple[torch.Tensor, int]:
    """-> (positions [3, S] long: rows T, H, W; rope_delta) for a prompt, grids in prompt order.

    Text advances all three rows by one; a block at p gets T = p + t_idx, H = p + row, W = p + col over its merged
    grid, then p += max(h, w). rope_delta = max position + 1 - S, so a later token at index i sits at i + delta.
    """
    ids = [int(t) for t in input_ids]
    segs = _segments(ids, grids, image_token_id, video_token_id, merge)
    out = torch.empty(3, len(ids), dtype=torch.long)
    p, i = 0, 0
    for seg in segs + [_Segment(len(ids), 0, 0, (0, 0, 0))]:
        n_text = seg.start - i
        out[:, i:seg.start] = torch.arange(p, p + n_text)
        p, i = p + n_text, seg.start
        if seg.rows:
            t, h, w = seg.grid
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij")
            out[:, i:i + seg.rows] = torch.stack([tt, hh, ww]).reshape(3, -1) + p
            p, i = p + max(h, w), i + seg.rows
    delta = int(out.max()) + 1 - len(ids) if ids else 0
    return out, delta


def decode_position(cache_len: int, rope_delta: int) -> int:
    """M-RoPE position (all three rows) of the token at sequence index `cache_len` after the prompt."""
    return cache_len + rope_delta


def placeholder_spans(input_ids: Sequence[int], grids: Sequence[tuple[int, int, int]], image_token_id: int,
                      video_token_id: int, merge: int) -> list[tuple[int, int, int]]:
    """-> [(prompt_pos, row_off, n_rows)]: each run of placeholders and the stacked tower rows that fill it."""
    spans: list[list[int]] = []
    for s in _segments(input_ids, grids, image_token_id, video_token_id, merge):
        if spans and spans[-1][0] + spans[-1][2] == s.start and spans[-1][1] + spans[-1][2] == s.row_off:
            spans[-1][2] += s.rows
        else:
            spans.append([s.start, s.row_off, s.rows])
    return [tuple(s) for s in spans]
