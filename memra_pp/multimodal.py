"""Image requests on the intake stage: validate images, expand single placeholders, derive spans and M-RoPE
positions; the rows themselves come from the tower engine (published across contexts by host bounce)."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch

from .errors import InputError
from .model.config import ModelConfig
from .model.image import ImageInput, validate_image_input
from .model.mrope import placeholder_spans, rope_positions


@dataclasses.dataclass
class ImagePlan:
    prompt: list[int]                         # placeholders expanded
    images: list[ImageInput]                  # validated, in prompt order
    spans: list[tuple[int, int, int]]         # (prompt_pos, row_off, n_rows)
    positions_3L: torch.Tensor
    rope_delta: int


def as_image_input(x) -> ImageInput:
    if isinstance(x, ImageInput):
        return x
    if isinstance(x, dict) and "pixel_values" in x and "grid_thw" in x:
        pv = x["pixel_values"]
        try:
            return ImageInput(torch.as_tensor(np.asarray(pv)) if not isinstance(pv, torch.Tensor) else pv,
                              tuple(int(v) for v in x["grid_thw"]))
        except (TypeError, ValueError) as e:
            raise InputError(f"an image's pixel_values / grid_thw do not form an ImageInput: {e}") from None
    raise InputError(f"an image must be a memra_pp.ImageInput (pixel_values, grid_thw), got {type(x).__name__}")


def plan_images(prompt: list[int], images, mc: ModelConfig, max_patches: int) -> ImagePlan:
    """Refuses (InputError) before any device work: a model without a tower, bad pixels, count mismatches."""
    if mc.vision is None or mc.image_token_id is None:
        raise InputError("this model has no vision tower (no vision_config): images cannot be given")
    imgs = [validate_image_input(as_image_input(x), mc.vision, max_patches) for x in images]
    merge = mc.vision.spatial_merge_size
    prompt = expand_placeholders(prompt, imgs, mc.image_token_id, merge)
    grids = [ii.grid_thw for ii in imgs]
    spans = placeholder_spans(prompt, grids, mc.image_token_id, mc.video_token_id, merge)
    pos, delta = rope_positions(prompt, grids, mc.image_token_id, mc.video_token_id, merge)
    return ImagePlan(prompt, imgs, spans, pos, delta)


def expand_placeholders(prompt: list[int], imgs: list[ImageInput], image_id: int, merge: int) -> list[int]:
    """A lone image placeholder stands for all of its image's rows (as vLLM and the HF processor expand it);
    runs that already have a length other than 1 are left for the count check."""
    out, k, i = [], 0, 0
    while i < len(prompt):
        j = i
        while j < len(prompt) and prompt[j] == image_id:
            j += 1
        if j == i:
            out.append(prompt[i])
            i += 1
            continue
        n = j - i
        if n == 1 and k < len(imgs):
            t, h, w = imgs[k].grid_thw
            n = t * h * w // (merge * merge)
        out.extend([image_id] * n)
        k += 1
        i = j
    return out
