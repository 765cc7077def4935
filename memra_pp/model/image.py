"""Image and video preprocessing into vision-tower patches, equal to transformers' Qwen2VLImageProcessor (PIL backend).
Runs in the driver / client process; pure numpy + Pillow, no device work.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import numpy as np
import torch

from ..errors import InputError
from .config import IMAGE_PIXELS, VIDEO_PIXELS, PixelSpec, VisionConfig  # noqa: F401


@dataclasses.dataclass(frozen=True)
class ImageInput:
    """One image or video, ready for the tower: rows in merge-block order, each patch laid out (C, T, p, p)."""
    pixel_values: torch.Tensor          # [t*h*w, C*T*p*p]
    grid_thw: tuple[int, int, int]      # (t, h, w) in patches; t counts temporal patches

    def __post_init__(self):
        # As a processor hands them over: grid a tensor / numpy row or a tuple of its 0-d items, pixels a numpy
        # array (return_tensors="np"). Anything else stays as given, for validate_image_input to refuse by name.
        g = self.grid_thw
        if isinstance(g, (torch.Tensor, np.ndarray)):
            try:
                g = g.tolist()
            except RuntimeError:    # a meta or sparse tensor: kept as given, refused by name
                pass
        if isinstance(g, (list, tuple)):
            object.__setattr__(self, "grid_thw", tuple(_grid_entry(v) for v in g))
        pv = self.pixel_values
        if isinstance(pv, np.ndarray) and pv.dtype.kind in "biufc":
            pv = pv.astype(pv.dtype.newbyteorder("="), copy=False)
            if not pv.flags.writeable or any(st < 0 for st in pv.strides):   # (a flipped image: np.flip, [::-1])
                pv = np.array(pv, order="C")
            object.__setattr__(self, "pixel_values", torch.from_numpy(pv))

    def __reduce__(self):
        """Across processes (a Ray call) only this image's own pixels travel, from host memory: a tensor pickles
        its whole storage (a per-image slice of a batch's pixel_values would carry the batch) and a CUDA tensor
        would be rebuilt on the receiver's GPU of the same number."""
        return ImageInput, (_wire(self.pixel_values), self.grid_thw)

    @property
    def n_patches(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w


def _grid_entry(v):
    """An integer numpy scalar, 0-d integer tensor or int subclass (an IntEnum: a stage may not be able to unpickle
    it) as a Python int (bools are not sizes: kept, then refused)."""
    if isinstance(v, np.integer) or (isinstance(v, int) and type(v) not in (int, bool)):
        return int(v)
    if isinstance(v, torch.Tensor) and v.ndim == 0 and v.device.type != "meta" and \
            not (v.dtype.is_floating_point or v.dtype.is_complex or v.dtype == torch.bool):
        return int(v)
    return v


def _wire(pv):
    """pixel_values as sent to another process: detached, on the host, owning exactly its own bytes."""
    if not isinstance(pv, torch.Tensor) or pv.layout != torch.strided or pv.device.type == "meta":
        return pv
    pv = pv.detach().cpu()
    if not pv.is_contiguous() or pv.storage_offset() or \
            pv.untyped_storage().nbytes() != pv.numel() * pv.element_size():
        pv = pv.clone(memory_format=torch.contiguous_format)
    return pv


# the largest image Qwen3.5's own processor makes: size.longest_edge 16777216 pixels / 16^2 (each patch 16x16). A
# model's own budget is patch_budget(mc), from its preprocessor_config.json and patch size.
DEFAULT_MAX_PATCHES = 65536


def patch_budget(mc) -> int:
    """The most patches one image or video input may have (ModelConfig `mc`, with a vision tower): the largest its
    processor settings make (an image: max_pixels / patch^2; a clip: max_pixels over its frames / (temporal x
    patch^2)), so that an input given as ImageInput is bounded as a raw one is."""
    v = mc.vision
    p2 = v.patch_size ** 2
    return max(mc.image_pixels.max_pixels // p2, mc.video_pixels.max_pixels // (v.temporal_patch_size * p2))


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(h, w) multiples of `factor` closest in area to the input within [min_pixels, max_pixels] (HF's rule)."""
    if max(height, width) / min(height, width) > 200:
        raise InputError(f"image of {height}x{width} pixels: aspect ratio must be at most 200, got "
                         f"{max(height, width) / min(height, width):.1f}; crop or pad it first")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    if h_bar <= 0 or w_bar <= 0:
        raise InputError(f"image of {height}x{width} pixels resizes to {h_bar}x{w_bar}; raise min_pixels "
                         f"(now {min_pixels}) so that it covers at least one {factor}x{factor} block")
    return h_bar, w_bar


def video_smart_resize(frames: int, height: int, width: int, temporal: int, factor: int, min_pixels: int,
                       max_pixels: int) -> tuple[int, int]:
    """HF Qwen3-VL video rule: like smart_resize, but the pixel limits count every (padded) frame of the clip."""
    if frames < temporal:
        raise InputError(f"a video needs at least temporal_patch_size={temporal} frames, got {frames}; "
                         "pass a single frame to preprocess_image instead")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        raise InputError(f"video of {height}x{width} pixels: aspect ratio must be at most 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _as_rgb(img, what: str):
    """-> (H, W, 3) uint8 array; float input in [0, 1] is rounded to uint8 (see _resize_normalize)."""
    if isinstance(img, np.ndarray):
        if img.dtype == np.uint8:
            return img
        if not np.issubdtype(img.dtype, np.floating):
            raise InputError(f"{what}: expected uint8 or float pixels, got dtype {img.dtype}")
        if not np.isfinite(img).all():
            raise InputError(f"{what}: pixel values contain NaN or inf")
        if img.min() < 0 or img.max() > 1:
            raise InputError(f"{what}: float pixels must lie in [0, 1] (already rescaled), got "
                             f"[{img.min()}, {img.max()}]; pass uint8 for 0..255 values")
        return np.round(img * 255).astype(np.uint8)
    from PIL import Image
    if isinstance(img, Image.Image):
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            rgba = img.convert("RGBA")
            img = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
        return np.asarray(img.convert("RGB"))
    raise InputError(f"{what}: expected a numpy array or a PIL image, got {type(img).__name__}")


def _resize_normalize(rgb: np.ndarray, h: int, w: int, spec: PixelSpec) -> np.ndarray:
    """Bicubic resize with Pillow, rescale, normalise: (H, W, 3) uint8 -> (3, h, w) float32, bit-equal to HF's PIL
    backend. Pillow resizes 8-bit images in two passes with a uint8 intermediate, so a float resize would differ
    by up to ~12 levels on noisy input; float input is quantised first so that both kinds take this one path."""
    from PIL import Image
    out = np.asarray(Image.fromarray(np.ascontiguousarray(rgb)).resize((w, h), Image.Resampling.BICUBIC))
    out = (out.astype(np.float64) * spec.rescale_factor).astype(np.float32)
    out = (out - np.asarray(spec.image_mean, np.float32)) / np.asarray(spec.image_std, np.float32)
    return np.ascontiguousarray(out.transpose(2, 0, 1))


def _patchify(frames_FCHW: np.ndarray, p: int, m: int, T: int) -> np.ndarray:
    """(F, C, H, W) with F % T == 0 -> (t*h*w, C*T*p*p) rows in (t, h/m, w/m, m, m) order, patches (C, T, p, p)."""
    F, C, H, W = frames_FCHW.shape
    gt, gh, gw = F // T, H // p, W // p
    x = frames_FCHW.reshape(gt, T, C, gh // m, m, p, gw // m, m, p)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, C * T * p * p)


def _hw(img, what: str) -> tuple[int, int]:
    """(H, W) of an input without touching its pixels, refusing what preprocessing cannot take."""
    if isinstance(img, np.ndarray):
        if img.ndim != 3 or img.shape[2] != 3 or 0 in img.shape:
            raise InputError(f"{what}: expected a non-empty (H, W, 3) array, got shape {tuple(img.shape)}")
        return int(img.shape[0]), int(img.shape[1])
    from PIL import Image
    if isinstance(img, Image.Image) and min(img.size) > 0:
        return img.size[1], img.size[0]
    raise InputError(f"{what}: expected a non-empty (H, W, 3) numpy array or PIL image, got {type(img).__name__}")


def _budget(n: int, max_patches: int, what: str):
    if n > max_patches:
        raise InputError(f"{what} {n} patches, over the budget max_patches={max_patches} (the largest input the "
                         f"model's processor settings make: preprocessor_config.json's size.longest_edge / "
                         f"patch_size^2); downscale it")


def preprocess_image(img, vcfg: VisionConfig, max_patches: int = DEFAULT_MAX_PATCHES,
                     spec: PixelSpec = IMAGE_PIXELS) -> ImageInput:
    """One still image (H, W, 3) uint8/float array or PIL image -> ImageInput with grid (1, h, w)."""
    p, m, T = vcfg.patch_size, vcfg.spatial_merge_size, vcfg.temporal_patch_size
    H, W = _hw(img, "image")
    h, w = smart_resize(H, W, p * m, spec.min_pixels, spec.max_pixels)
    _budget((h // p) * (w // p), max_patches, f"image of {H}x{W} pixels resizes to")
    x = _resize_normalize(_as_rgb(img, "image"), h, w, spec)
    rows = _patchify(np.broadcast_to(x[None], (T, *x.shape)), p, m, T)
    return ImageInput(torch.from_numpy(np.ascontiguousarray(rows)), (1, h // p, w // p))


def preprocess_video(frames: Sequence | np.ndarray, vcfg: VisionConfig, max_patches: int = DEFAULT_MAX_PATCHES,
                     spec: PixelSpec = VIDEO_PIXELS) -> ImageInput:
    """Frames (F, H, W, 3) or a list of frames -> ImageInput with grid (ceil(F/T), h, w); the last frame pads."""
    p, m, T = vcfg.patch_size, vcfg.spatial_merge_size, vcfg.temporal_patch_size
    frames = list(frames)
    sizes = {_hw(f, f"video frame {i}") for i, f in enumerate(frames)}
    if not frames:
        raise InputError("video: no frames")
    if len(sizes) != 1:
        raise InputError(f"video: frames must share one size, got {sorted(sizes)}")
    (H, W), = sizes
    h, w = video_smart_resize(len(frames), H, W, T, p * m, spec.min_pixels, spec.max_pixels)
    gt = -(-len(frames) // T)
    _budget(gt * (h // p) * (w // p), max_patches, f"video of {len(frames)} frames of {H}x{W} pixels resizes to")
    x = np.stack([_resize_normalize(_as_rgb(f, f"video frame {i}"), h, w, spec) for i, f in enumerate(frames)])
    if pad := -len(frames) % T:
        x = np.concatenate([x, np.repeat(x[-1:], pad, axis=0)])
    return ImageInput(torch.from_numpy(np.ascontiguousarray(_patchify(x, p, m, T))), (gt, h // p, w // p))


def check_grid(g) -> tuple[int, int, int]:
    """An ImageInput's grid_thw as its sizes (t, h, w); InputError if it is not 3 positive ints."""
    if (not isinstance(g, tuple) or len(g) != 3
            or not all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in g)):
        raise InputError(f"ImageInput.grid_thw must be 3 positive ints (t, h, w), got {g!r}")
    return tuple(int(v) for v in g)


# the pixel dtypes an image is taken in (float8 would not unpickle in a stage, and no tower runs in it)
PIXEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_pixel_dtype(pv: torch.Tensor) -> None:
    if pv.dtype not in PIXEL_DTYPES:
        raise InputError(f"ImageInput.pixel_values must be float16, bfloat16, float32 or float64, got {pv.dtype}")


def validate_image_input(ii: ImageInput, vcfg: VisionConfig, max_patches: int = DEFAULT_MAX_PATCHES) -> ImageInput:
    """Refuse (InputError) an ImageInput the tower cannot take: bad grid, over budget, wrong shape, NaN/inf."""
    g = ii.grid_thw
    t, h, w = check_grid(g)
    m = vcfg.spatial_merge_size
    if h % m or w % m:
        raise InputError(f"ImageInput.grid_thw {g}: h and w must be multiples of spatial_merge_size {m}")
    _budget(t * h * w, max_patches, f"ImageInput with grid {g} has")
    width = vcfg.in_channels * vcfg.temporal_patch_size * vcfg.patch_size ** 2
    pv = ii.pixel_values
    if not isinstance(pv, torch.Tensor) or not pv.is_floating_point():
        raise InputError(f"ImageInput.pixel_values must be a floating torch.Tensor, got "
                         f"{getattr(pv, 'dtype', type(pv).__name__)}")
    check_pixel_dtype(pv)
    if pv.layout != torch.strided or pv.device.type == "meta":
        raise InputError(f"ImageInput.pixel_values must be a dense tensor with its values (layout strided, not "
                         f"meta), got layout {pv.layout} on {pv.device}")
    if tuple(pv.shape) != (t * h * w, width):
        raise InputError(f"ImageInput.pixel_values has shape {tuple(pv.shape)}; grid {g} needs "
                         f"({t * h * w}, {width}) = (t*h*w, C*T*p*p)")
    if not bool(torch.isfinite(pv).all()):
        raise InputError(f"ImageInput.pixel_values contains NaN or inf (grid {g})")
    return ii
