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


def is_raw_image(x) -> bool:
    """A PIL image, or an (H, W, 3) array of pixels: an image no processor has made rows of yet."""
    if any(c.__name__ == "Image" and c.__module__.startswith("PIL.") for c in type(x).__mro__):
        return True
    return isinstance(x, (np.ndarray, torch.Tensor)) and x.ndim == 3 and x.shape[-1] == 3


def as_image_input(x) -> ImageInput:
    if isinstance(x, ImageInput):
        return x
    if isinstance(x, dict) and "pixel_values" in x and "grid_thw" in x:
        pv = x["pixel_values"]
        try:    # the grid as given (not int(): 4.7 is no grid size, True no count): validate refuses it by name
            return ImageInput(pv if isinstance(pv, (torch.Tensor, np.ndarray)) else np.asarray(pv), x["grid_thw"])
        except (TypeError, ValueError, RuntimeError) as e:
            raise InputError(f"an image's pixel_values / grid_thw do not form an ImageInput: {type(e).__name__}: "
                             f"{e}") from None
    raise InputError(f"an image must be a memra_pp.ImageInput (pixel_values, grid_thw), a PIL image or an (H, W, 3) "
                     f"array of pixels, got {type(x).__name__}" + (f" of shape {tuple(x.shape)}" if hasattr(x, "shape")
                                                                  else ""))


def require_tower(mc: ModelConfig) -> None:
    """Images need a vision tower (and its image token): refused naming that, wherever images are first read."""
    if mc.vision is None or mc.image_token_id is None:
        raise InputError("this model has no vision tower (no vision_config): images cannot be given")


def plan_images(prompt: list[int], images, mc: ModelConfig, max_patches: int, generated: int = 0) -> ImagePlan:
    """Refuses (InputError) before any device work: a model without a tower, bad pixels, count mismatches.
    `generated`: the prompt's last tokens are the model's own (a replay's prompt after a stage failure): text at
    decode's positions (index + rope_delta) whatever their ids, never placeholders of an image span."""
    require_tower(mc)
    imgs = [validate_image_input(as_image_input(x), mc.vision, max_patches) for x in images]
    merge = mc.vision.spatial_merge_size
    cut = len(prompt) - generated
    prompt, tail = expand_placeholders(prompt[:cut], imgs, mc.image_token_id, merge, mc.video_token_id), prompt[cut:]
    grids = [ii.grid_thw for ii in imgs]
    spans = placeholder_spans(prompt, grids, mc.image_token_id, mc.video_token_id, merge)
    pos, delta = rope_positions(prompt, grids, mc.image_token_id, mc.video_token_id, merge)
    if tail:
        n = len(prompt)
        pos = torch.cat([pos, (torch.arange(n, n + len(tail)) + delta).expand(3, -1)], 1)
        prompt = prompt + tail
    return ImagePlan(prompt, imgs, spans, pos, delta)


def expand_placeholders(prompt: list[int], imgs: list[ImageInput], image_id: int, merge: int,
                        video_id: int | None = None) -> list[int]:
    """A lone image placeholder stands for all of its image's rows (as vLLM and the HF processor expand it).
    Runs already expanded (images, video frames) take their inputs' rows in prompt order, so that a lone
    placeholder after them gets its own image; any mismatch is left for the count check."""
    out, k, left, i = [], 0, 0, 0      # k: the next input; left: rows of the input being placed still unplaced
    while i < len(prompt):
        tok, j = prompt[i], i
        if tok != image_id and (video_id is None or tok != video_id):
            out.append(tok)
            i += 1
            continue
        while j < len(prompt) and prompt[j] == tok:
            j += 1
        n = j - i
        if n == 1 and tok == image_id and left == 0 and k < len(imgs):
            n, k = _rows(imgs[k], merge), k + 1
        else:
            placed = n
            while placed and (left or k < len(imgs)):
                if not left:
                    left, k = _rows(imgs[k], merge), k + 1
                took = min(placed, left)
                placed, left = placed - took, left - took
        out.extend([tok] * n)
        i = j
    return out


def _rows(ii: ImageInput, merge: int) -> int:
    t, h, w = ii.grid_thw
    return t * h * w // (merge * merge)
