"""Image / video preprocessing against transformers' Qwen2VLImageProcessor (PIL backend), and input validation."""
import numpy as np
import pytest
import torch

from memra_pp.errors import InputError
from memra_pp.model import image as image_mod
from memra_pp.model.config import VisionConfig
from memra_pp.model.image import ImageInput, PixelSpec, preprocess_image, preprocess_video, validate_image_input

import transformers  # noqa: E402,F401  (a test dependency: a missing one must fail, not skip)
import PIL.Image as PIL  # noqa: E402

VCFG = VisionConfig(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, temporal_patch_size=2,
                    spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
SPEC = PixelSpec(min_pixels=16 * 16, max_pixels=48 * 48)
BIG = 10 ** 6


@pytest.fixture(scope="module")
def hf_proc():
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil(patch_size=4, temporal_patch_size=2, merge_size=2, min_pixels=SPEC.min_pixels,
                                    max_pixels=SPEC.max_pixels, image_mean=[0.5] * 3, image_std=[0.5] * 3)


def _hf(proc, img):
    out = proc(images=[img], return_tensors="pt")
    return out["pixel_values"], tuple(out["image_grid_thw"][0].tolist())


@pytest.mark.parametrize("hw", [(37, 53), (8, 8), (5, 90), (121, 77), (30, 31)],
                         ids=["odd", "exact", "min-clamp", "max-clamp", "near-square"])
def test_image_matches_hf(hf_proc, hw):
    """pixel_values (atol 1e-6) and grid_thw must equal Qwen2VLImageProcessor's for uint8 images of odd sizes."""
    img = np.random.default_rng(sum(hw)).integers(0, 256, (*hw, 3), dtype=np.uint8)
    want_px, want_grid = _hf(hf_proc, img)
    got = preprocess_image(img, VCFG, max_patches=BIG, spec=SPEC)
    assert got.grid_thw == want_grid
    torch.testing.assert_close(got.pixel_values, want_px.float(), atol=1e-6, rtol=0)
    validate_image_input(got, VCFG, max_patches=BIG)


def test_pil_image_matches_hf(hf_proc):
    """A PIL image (RGBA composited on white, like HF) must give HF's pixel_values and grid."""
    rng = np.random.default_rng(3)
    img = PIL.fromarray(rng.integers(0, 256, (29, 43, 4), dtype=np.uint8), mode="RGBA")
    want_px, want_grid = _hf(hf_proc, img)
    got = preprocess_image(img, VCFG, max_patches=BIG, spec=SPEC)
    assert got.grid_thw == want_grid
    torch.testing.assert_close(got.pixel_values, want_px.float(), atol=1e-6, rtol=0)


def test_float_image_equals_uint8():
    """A float image in [0, 1] must give exactly what the same uint8 image gives (it takes the uint8 path)."""
    img = np.random.default_rng(4).integers(0, 256, (37, 53, 3), dtype=np.uint8)
    a = preprocess_image(img, VCFG, max_patches=BIG, spec=SPEC)
    b = preprocess_image(img.astype(np.float64) / 255, VCFG, max_patches=BIG, spec=SPEC)
    assert a.grid_thw == b.grid_thw and torch.equal(a.pixel_values, b.pixel_values)


def _hf_video(frames, spec):
    """HF's Qwen3-VL video rule (smart_resize over the clip, last frame pads, patchify) on PIL-resized frames."""
    from transformers.image_transforms import normalize, rescale, resize
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor, smart_resize
    h, w = smart_resize(len(frames), *frames[0].shape[:2], temporal_factor=2, factor=8,
                        min_pixels=spec.min_pixels, max_pixels=spec.max_pixels)
    out = []
    for f in frames:
        x = resize(f.transpose(2, 0, 1), (h, w), resample=3, input_data_format="channels_first")
        x = normalize(rescale(x, 1 / 255, input_data_format="channels_first"), [0.5] * 3, [0.5] * 3,
                      input_data_format="channels_first")
        out.append(torch.from_numpy(x))
    patches, t, gh, gw = Qwen3VLVideoProcessor.patchify(None, torch.stack(out)[None], 4, 2, 2)
    return patches[0], (t, gh, gw)


@pytest.mark.parametrize("n_frames", [2, 3, 4])
def test_video_matches_hf_rule(n_frames):
    """A video must follow HF's clip smart_resize and pad an odd frame count with the last frame."""
    frames = list(np.random.default_rng(n_frames).integers(0, 256, (n_frames, 27, 45, 3), dtype=np.uint8))
    spec = PixelSpec(min_pixels=8 * 8, max_pixels=4 * 24 * 40)
    want_px, want_grid = _hf_video(frames, spec)
    got = preprocess_video(np.stack(frames), VCFG, max_patches=BIG, spec=spec)
    assert got.grid_thw == want_grid and want_grid[0] == (n_frames + 1) // 2
    torch.testing.assert_close(got.pixel_values, want_px, atol=1e-6, rtol=0)


def test_still_video_equals_image():
    """A video of T identical frames must equal the still image it repeats (same size limits)."""
    img = np.random.default_rng(7).integers(0, 256, (24, 40, 3), dtype=np.uint8)
    spec = PixelSpec(min_pixels=8 * 8, max_pixels=2 * 24 * 40)
    a = preprocess_image(img, VCFG, max_patches=BIG, spec=PixelSpec(min_pixels=8 * 8, max_pixels=24 * 40))
    b = preprocess_video([img, img], VCFG, max_patches=BIG, spec=spec)
    assert a.grid_thw == b.grid_thw == (1, 6, 10)
    assert torch.equal(a.pixel_values, b.pixel_values)


def test_budget_refused_before_tensor_work(monkeypatch):
    """An image over max_patches must raise InputError naming the budget and its patch count, touching no pixel."""
    def boom(*a, **k):
        raise AssertionError("pixels were processed before the budget check")
    monkeypatch.setattr(image_mod, "_resize_normalize", boom)
    huge = np.broadcast_to(np.zeros((1, 1, 1), np.uint8), (4000, 3000, 3))
    with pytest.raises(InputError, match=r"image of 4000x3000 pixels resizes to 120 patches, over the budget "
                                         r"max_patches=100"):
        preprocess_image(huge, VCFG, max_patches=100, spec=SPEC)
    with pytest.raises(InputError, match=r"video of 4 frames of 40x40 pixels resizes to 200 patches, over the "
                                         r"budget max_patches=199"):
        preprocess_video(np.zeros((4, 40, 40, 3), np.uint8), VCFG, max_patches=199,
                         spec=PixelSpec(min_pixels=64, max_pixels=BIG))


@pytest.mark.parametrize("bad, msg", [
    (np.zeros((9, 9, 4), np.uint8), r"image: expected a non-empty \(H, W, 3\) array, got shape \(9, 9, 4\)"),
    (np.zeros((9, 9, 3), np.int32), "image: expected uint8 or float pixels, got dtype int32"),
    (np.full((9, 9, 3), 2.0, np.float32), r"float pixels must lie in \[0, 1\]"),
    (np.full((9, 9, 3), np.nan, np.float32), "image: pixel values contain NaN or inf"),
    (np.zeros((2, 900, 3), np.uint8), "aspect ratio must be at most 200, got 450.0"),
    ([[0, 0, 0]], "expected a non-empty .* numpy array or PIL image, got list"),
])
def test_preprocess_refusals(bad, msg):
    """Inputs preprocessing cannot take must raise InputError saying what is wrong."""
    with pytest.raises(InputError, match=msg):
        preprocess_image(bad, VCFG, max_patches=BIG, spec=SPEC)


def test_video_refusals():
    """Too few frames, no frames and frames of different sizes must be refused."""
    with pytest.raises(InputError, match="at least temporal_patch_size=2 frames, got 1"):
        preprocess_video(np.zeros((1, 16, 16, 3), np.uint8), VCFG, spec=SPEC)
    with pytest.raises(InputError, match="video: no frames"):
        preprocess_video([], VCFG, spec=SPEC)
    with pytest.raises(InputError, match=r"frames must share one size, got \[\(16, 16\), \(16, 24\)\]"):
        preprocess_video([np.zeros((16, 16, 3), np.uint8), np.zeros((16, 24, 3), np.uint8)], VCFG, spec=SPEC)


def _ii(grid, rows=None, fill=0.0):
    t, h, w = grid
    return ImageInput(torch.full((rows if rows is not None else t * h * w, 96), fill), grid)


@pytest.mark.parametrize("ii, msg", [
    (ImageInput(torch.zeros(24, 96), (1, 4)), r"grid_thw must be 3 positive ints \(t, h, w\), got \(1, 4\)"),
    (ImageInput(torch.zeros(24, 96), (1, -4, -6)), r"got \(1, -4, -6\)"),
    (ImageInput(torch.zeros(24, 96), (1.0, 4, 6)), r"got \(1.0, 4, 6\)"),
    (_ii((1, 3, 8)), r"grid_thw \(1, 3, 8\): h and w must be multiples of spatial_merge_size 2"),
    (_ii((1, 4, 6), rows=20), r"shape \(20, 96\); grid \(1, 4, 6\) needs \(24, 96\)"),
    (ImageInput(torch.zeros(24, 95), (1, 4, 6)), r"shape \(24, 95\); grid \(1, 4, 6\) needs \(24, 96\)"),
    (ImageInput(torch.zeros(24, 96, dtype=torch.long), (1, 4, 6)), "must be a floating torch.Tensor"),
    (_ii((1, 4, 6), fill=float("nan")), r"contains NaN or inf \(grid \(1, 4, 6\)\)"),
    (_ii((1, 4, 6), fill=float("inf")), "contains NaN or inf"),
    (_ii((2, 16, 16)), r"ImageInput with grid \(2, 16, 16\) has 512 patches, over the budget "
                       r"max_patches=500"),
])
def test_validate_refusals(ii, msg):
    """validate_image_input must refuse every malformed ImageInput with a message naming the fault."""
    with pytest.raises(InputError, match=msg):
        validate_image_input(ii, VCFG, max_patches=500)


def test_image_input_grid_normalised():
    """A grid given as a list or tensor must become a tuple of ints that validates."""
    ii = ImageInput(torch.zeros(24, 96), torch.tensor([1, 4, 6]))
    assert ii.grid_thw == (1, 4, 6) and ii.n_patches == 24
    assert validate_image_input(ii, VCFG) is ii


def test_a_request_takes_raw_images_as_its_processor_would():
    """A PIL image or an (H, W, 3) array in a request's images is made rows by preprocess_image with the model's
    vision config (the client's raw_image), as vLLM takes PIL images; anything else raw is refused naming its type
    and shape, and ImageInputs pass as they are."""
    from memra_pp.request import request_dict
    rng = np.random.default_rng(3)
    arr = rng.integers(0, 255, (24, 40, 3), dtype=np.uint8)
    made = []

    def raw(x):
        made.append(type(x).__name__)
        return preprocess_image(x, VCFG)
    want = preprocess_image(arr, VCFG)
    given = ImageInput(want.pixel_values.clone(), want.grid_thw)
    req = request_dict({"images": [PIL.fromarray(arr), arr, torch.from_numpy(arr), given]}, raw_image=raw,
                       prompt=[1], max_new_tokens=1)
    assert made == ["Image", "ndarray", "ndarray"]
    for x in req["images"]:
        assert x.grid_thw == want.grid_thw and torch.equal(torch.as_tensor(x.pixel_values), want.pixel_values)
    for bad, what in ((rng.random((24, 40, 4)), r"ndarray of shape \(24, 40, 4\)"), ("cat.png", "str")):
        with pytest.raises(InputError, match=r"a PIL image or an \(H, W, 3\) array of pixels, got " + what):
            request_dict({"images": [bad]}, raw_image=raw, prompt=[1], max_new_tokens=1)


def _vision_dir(tmp_path, processor=None, video=None):
    """A tiny vision checkpoint's config (no weights: load_config reads config.json and the processor files)."""
    import json
    from memra_pp.model.tiny import tiny_config
    d = tmp_path / "vis"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(tiny_config(vision=True)))
    for name, raw in (("preprocessor_config.json", processor), ("video_preprocessor_config.json", video)):
        if raw is not None:
            (d / name).write_text(raw if isinstance(raw, str) else json.dumps(raw))
    return d


CLIP = {"image_processor_type": "Qwen2VLImageProcessor", "do_resize": True, "do_rescale": True,
        "do_normalize": True, "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711], "size": {"shortest_edge": 1024, "longest_edge": 4096},
        "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2}


def test_a_checkpoints_preprocessor_config_sizes_and_normalises_its_raw_images(tmp_path):
    """A raw image (PIL, array) is made as the checkpoint's own processor makes it: its preprocessor_config.json's
    size and mean / std (a helper found them ignored: a checkpoint with CLIP's mean / std and other limits got
    another grid and other rows than transformers' AutoImageProcessor of the same folder, and other tokens)."""
    from transformers import AutoImageProcessor
    from memra_pp.model.config import load_config
    from memra_pp.model.image import patch_budget
    d = _vision_dir(tmp_path, CLIP)
    mc = load_config(d)
    assert (mc.image_pixels.min_pixels, mc.image_pixels.max_pixels) == (1024, 4096)
    assert mc.image_pixels.image_mean == tuple(CLIP["image_mean"]) and mc.video_pixels == image_mod.VIDEO_PIXELS
    proc = AutoImageProcessor.from_pretrained(str(d))
    rng = np.random.default_rng(7)
    for hw in ((97, 131), (20, 300), (300, 300)):
        img = PIL.fromarray(rng.integers(0, 256, (*hw, 3), dtype=np.uint8))
        out = proc(images=[img], return_tensors="pt")
        got = preprocess_image(img, mc.vision, patch_budget(mc), mc.image_pixels)
        assert got.grid_thw == tuple(out["image_grid_thw"][0].tolist()), hw
        torch.testing.assert_close(got.pixel_values, out["pixel_values"].float(), atol=1e-5, rtol=0)
    # Qwen2-VL's keys (min_pixels / max_pixels at the top) are read too; without the file, Qwen3.5's defaults
    mc2 = load_config(_vision_dir(tmp_path / "q2", {"min_pixels": 256, "max_pixels": 1 << 20}))
    assert (mc2.image_pixels.min_pixels, mc2.image_pixels.max_pixels) == (256, 1 << 20)
    assert load_config(_vision_dir(tmp_path / "none")).image_pixels == image_mod.IMAGE_PIXELS


def test_the_patch_budget_is_the_largest_input_the_processor_makes():
    """Qwen3.5's processor resizes an image to at most 16777216 pixels, 65,536 patches of 16x16: the budget was
    16,384 (the merged rows), which refused a 2560x2560 image transformers accepts. A clip's budget counts its
    frames merged in time."""
    from memra_pp.model.config import ModelConfig, PixelSpec
    v16 = VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=16,
                       temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
    mc = ModelConfig("qwen3_5", None, v16)
    assert image_mod.patch_budget(mc) == 65536 == image_mod.DEFAULT_MAX_PATCHES
    img = np.zeros((2560, 2560, 3), np.uint8)
    got = preprocess_image(img, v16, image_mod.patch_budget(mc))
    assert got.grid_thw == (1, 160, 160)
    validate_image_input(got, v16, image_mod.patch_budget(mc))
    big_video = ModelConfig("qwen3_5", None, v16, video_pixels=PixelSpec(max_pixels=1 << 28))
    assert image_mod.patch_budget(big_video) == (1 << 28) // (2 * 256)


@pytest.mark.parametrize("raw,match", [
    ("[1, 2]", r"must hold a JSON object, got list"),
    ({"do_normalize": False}, r"do_normalize false is not supported"),
    ({"do_resize": False}, r"do_resize false is not supported"),
    ({"patch_size": 16}, r"patch_size 16 differs from the vision tower's \(4, config.json\)"),
    ({"merge_size": 1}, r"merge_size 1 differs from the vision tower's \(2"),
    ({"size": {"shortest_edge": 5000, "longest_edge": 4096}}, r"min_pixels 5000 is above max_pixels 4096"),
    ({"size": {"longest_edge": -1}}, r"max_pixels \(size.longest_edge\) must be a positive integer, got -1"),
    ({"size": [1, 2]}, r"size must be an object"),
    ({"image_std": [0.5, 0, 0.5]}, r"image_std must be 3 finite numbers \(none 0\)"),
    ({"image_mean": [0.5, 0.5]}, r"image_mean must be 3 finite numbers, got \[0.5, 0.5\]"),
    ({"rescale_factor": 0}, r"rescale_factor must be a positive number, got 0"),
    ("{", r"not valid JSON"),
], ids=["list", "no-normalize", "no-resize", "patch", "merge", "min-above-max", "negative", "size-list", "std-0",
        "mean-2", "rescale-0", "json"])
def test_a_bad_preprocessor_config_is_refused_naming_the_file_and_key(tmp_path, raw, match):
    from memra_pp.errors import ConfigError
    from memra_pp.model.config import load_config
    with pytest.raises(ConfigError, match=r"preprocessor_config.json: .*" + match):
        load_config(_vision_dir(tmp_path, raw))
    with pytest.raises(ConfigError, match=r"video_preprocessor_config.json: .*" + match):
        load_config(_vision_dir(tmp_path / "v", None, raw))
