"""Image inputs as a vLLM / transformers user passes them, and GGUF files that are malformed: each is taken as the
processor hands it over or refused typed, naming what is wrong (no Ray: the checks are called directly)."""
import pickle
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from memra_pp.errors import ConfigError, InputError
from memra_pp.model.config import VisionConfig, parse_config
from memra_pp.model.gguf_source import GGUFSource
from memra_pp.model.image import ImageInput, validate_image_input
from memra_pp.model.mrope import placeholder_spans, rope_positions
from memra_pp.model.tiny import tiny_config
from memra_pp.model.vision import VisionTower
from memra_pp.multimodal import plan_images

MC = parse_config(tiny_config(vision=True))
IMG, VID, VS, VE = MC.image_token_id, MC.video_token_id, MC.vision_start_token_id, MC.vision_end_token_id
VCFG = MC.vision
GGUF_Q8 = Path("/work/shared/fixtures/qwen35-tiny/dense_text-s404/dense_text-q8_0.gguf")


def _px(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, 96, generator=torch.Generator().manual_seed(seed))


# ---- image inputs --------------------------------------------------------------------------------------------

def test_numpy_pixel_values_are_taken_as_a_tensor():
    """pixel_values as a numpy array (a processor's return_tensors="np") must validate as the same tensor; it was
    refused as "must be a floating torch.Tensor, got float32"."""
    a = _px(24).numpy()
    ii = validate_image_input(ImageInput(a, (1, 4, 6)), VCFG)
    assert isinstance(ii.pixel_values, torch.Tensor) and torch.equal(ii.pixel_values, torch.from_numpy(a))
    ro = a.copy()
    ro.flags.writeable = False          # (a read-only array is copied, not shared with a warning)
    assert torch.equal(ImageInput(ro, (1, 4, 6)).pixel_values, ii.pixel_values)
    with pytest.raises(InputError, match="must be a floating torch.Tensor, got torch.int64"):
        validate_image_input(ImageInput(np.zeros((24, 96), np.int64), (1, 4, 6)), VCFG)


@pytest.mark.parametrize("grid", [np.array([1, 4, 6]), tuple(torch.tensor([1, 4, 6])),
                                  (np.int64(1), np.int32(4), np.int64(6))],
                         ids=["numpy-row", "tuple-of-0d-tensors", "numpy-ints"])
def test_grid_as_a_processor_gives_it_becomes_python_ints(grid):
    """A grid row from image_grid_thw (numpy, or tuple() of a tensor row) must become (1, 4, 6) of Python ints;
    the first two were refused, the third kept numpy ints that the tower's grid parser could not take."""
    ii = validate_image_input(ImageInput(_px(24), grid), VCFG)
    assert ii.grid_thw == (1, 4, 6) and all(type(v) is int for v in ii.grid_thw)


@pytest.mark.parametrize("grid, shown", [((1, 4.7, 6), r"\(1, 4\.7, 6\)"), ((True, 4, 6), r"\(True, 4, 6\)"),
                                         ((torch.tensor(True), 4, 6), r"\(tensor\(True\), 4, 6\)")])
def test_a_dict_grid_is_not_truncated(grid, shown):
    """An image given as a dict must be refused for a fractional or bool grid entry, not served as int() of it
    (4.7 became 4 and True became 1: a request served with the wrong image layout)."""
    with pytest.raises(InputError, match=rf"grid_thw must be 3 positive ints \(t, h, w\), got {shown}"):
        plan_images([5, IMG, 7], [{"pixel_values": _px(24), "grid_thw": grid}], MC, 16384)


def test_an_image_sends_only_its_own_bytes():
    """Pickled for the intake (a Ray call), an ImageInput must carry its own pixels only, detached and contiguous:
    a per-image slice of a batch's pixel_values carried the whole batch (38 MB for a 9 KB image)."""
    batch = torch.randn(100_000, 96, requires_grad=True)
    ii = ImageInput(batch[500:524], (1, 4, 6))
    blob = pickle.dumps(ii)
    assert len(blob) < 2 * 24 * 96 * 4
    back = pickle.loads(blob)
    assert back.grid_thw == (1, 4, 6) and torch.equal(back.pixel_values, batch[500:524].detach())
    assert not back.pixel_values.requires_grad
    t = pickle.loads(pickle.dumps(ImageInput(torch.randn(96, 24).T, (1, 4, 6))))
    assert t.pixel_values.is_contiguous()


def test_a_lone_image_placeholder_after_a_video_gets_its_own_image():
    """A lone image placeholder after an expanded video must stand for the image's rows, not the video's: the
    request was refused ("Attempted to assign 16 image tokens to 24 placeholders")."""
    vid, img = ImageInput(_px(48), (2, 4, 6)), ImageInput(_px(16, 1), (1, 4, 4))
    lone = [5, VS] + [VID] * 6 + [9] + [VID] * 6 + [VE, VS, IMG, VE, 7]
    full = [5, VS] + [VID] * 6 + [9] + [VID] * 6 + [VE, VS] + [IMG] * 4 + [VE, 7]
    ip = plan_images(lone, [vid, img], MC, 16384)
    grids = [(2, 4, 6), (1, 4, 4)]
    assert ip.prompt == full
    assert ip.spans == placeholder_spans(full, grids, IMG, VID, 2) == [(2, 0, 6), (9, 6, 6), (17, 12, 4)]
    pos, delta = rope_positions(full, grids, IMG, VID, 2)
    assert torch.equal(ip.positions_3L, pos) and ip.rope_delta == delta


def test_a_lone_placeholder_after_two_images_in_one_run_gets_the_third():
    """Rows already expanded for two images in one run must count as two images: the lone placeholder after them
    is the third image's (it took the second's size and the request was refused)."""
    a, b = ImageInput(_px(24), (1, 4, 6)), ImageInput(_px(16), (1, 4, 4))
    ip = plan_images([5, VS] + [IMG] * 10 + [VE, VS, IMG, VE], [a, b, a], MC, 16384)
    assert ip.spans == [(2, 0, 10), (14, 10, 6)] and ip.prompt.count(IMG) == 16
    with pytest.raises(InputError, match="Attempted to assign 16 image tokens to 12 placeholders"):
        plan_images([5, VS] + [IMG] * 10 + [VE, VS, IMG, IMG, VE], [a, b, a], MC, 16384)


def test_a_replays_generated_tokens_are_text_whatever_their_ids():
    """A replay's prompt is the prompt and the tokens generated before a stage failure (`generated`). Those are the
    model's own tokens: placeholders or vision marks among them are text at decode's positions (index +
    rope_delta), never an image span. They were planned as placeholders, and the replay refused ("6 tower rows but
    the prompt holds 7 image/video placeholder tokens")."""
    a = ImageInput(_px(24), (1, 4, 6))
    head, tail = [5, VS, IMG, VE, 7], [IMG, VS, IMG, IMG, VE, 9]
    with pytest.raises(InputError, match="the prompt holds 9 image/video placeholder tokens"):
        plan_images(head + tail, [a], MC, 16384)
    ip, alone = plan_images(head + tail, [a], MC, 16384, generated=len(tail)), plan_images(head, [a], MC, 16384)
    assert ip.prompt == alone.prompt + tail and ip.spans == alone.spans == [(2, 0, 6)]
    n = len(alone.prompt)
    assert ip.rope_delta == alone.rope_delta
    assert torch.equal(ip.positions_3L[:, :n], alone.positions_3L)
    assert ip.positions_3L[:, n:].tolist() == [[i + alone.rope_delta for i in range(n, n + len(tail))]] * 3


def test_the_tower_takes_numpy_grids_and_refuses_what_the_merge_cannot():
    """VisionTower must take a grid of numpy ints as ints, and refuse a grid the 2x2 merge cannot take by name
    (numpy ints raised TypeError, (1, 3, 4) a RuntimeError from a view)."""
    cfg = VisionConfig(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4,
                       temporal_patch_size=2, spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
    g = torch.Generator().manual_seed(0)
    tower = VisionTower(cfg)
    shapes = {n: (32, 3, 2, 4, 4) if n == "patch_embed.proj.weight" else p.shape for n, p in tower.named_parameters()}
    tower.load(lambda name: torch.randn(shapes[name], generator=g) * 0.1)
    px = _px(24)
    with torch.no_grad():
        assert torch.equal(tower(px, (np.int64(1), np.int64(4), np.int64(6))), tower(px, (1, 4, 6)))
        with pytest.raises(InputError, match=r"grid_thw \[\(1, 3, 8\)\] must be \(t, h, w\) triples of positive ints "
                                             r"with h and w multiples of spatial_merge_size 2"):
            tower(px, [(1, 3, 8)])


# ---- GGUF files ----------------------------------------------------------------------------------------------

def _mutated(tmp_path, edit) -> Path:
    b = bytearray(GGUF_Q8.read_bytes())
    edit(b)
    f = tmp_path / "bad.gguf"
    f.write_bytes(bytes(b))
    return f


def _rename(old: bytes, new: bytes):
    def edit(b):
        i = b.index(old)
        b[i:i + len(new)] = new
    return edit


def _tensor_field(name: bytes, extra: int, fmt: str, value: int):
    """Overwrite a field of tensor `name`'s info: extra = bytes after the name (n_dims at 0, ne0 at 4, ...)."""
    def edit(b):
        struct.pack_into("<" + fmt, b, b.index(name) + len(name) + extra, value)
    return edit


OUT = b"blk.0.ssm_out.weight"   # Q8_0, 2 dims (64, 64): type at +20, offset at +24


def _overlap(b):
    """ssm_out's data offset set to attn_gate's (same type and shape): both would read attn_gate's bytes."""
    gate = b"blk.0.attn_gate.weight"
    at = struct.unpack_from("<Q", b, b.index(gate) + len(gate) + 24)[0]
    struct.pack_into("<Q", b, b.index(OUT) + len(OUT) + 24, at)


@pytest.mark.parametrize("edit, msg", [
    (lambda b: struct.pack_into(">I", b, 4, 3), r"a big-endian GGUF: only little-endian files are read"),
    (_rename(b"qwen35.ssm.state_size", b"qwen35.ssm.inner_size"),
     r"metadata key 'qwen35\.ssm\.inner_size' is written twice"),
    (_rename(b"blk.1.ssm_a", b"blk.0.ssm_a"), r"tensor 'blk\.0\.ssm_a' is listed twice"),
    (_tensor_field(OUT, 0, "I", 7), r"tensor 'blk\.0\.ssm_out\.weight' has 7 dimensions; GGUF allows 1 to 4"),
    (_tensor_field(OUT, 20, "I", 99), r"tensor 'blk\.0\.ssm_out\.weight' has unknown type 99"),
    (_tensor_field(OUT, 20, "I", 12), r"tensor 'blk\.0\.ssm_out\.weight' of shape \(64, 64\) is Q4_K, whose blocks "
                                      r"hold 256 values, but its rows hold 64"),
    (_tensor_field(OUT, 4, "Q", 2 ** 40), r"tensor 'blk\.0\.ssm_out\.weight' \(Q8_0, shape \(64, 1099511627776\)\) "
                                          r"lies at bytes \d+\.\.\d+ of a file of 362688 bytes"),
    (_tensor_field(OUT, 24, "Q", 2 ** 50 + 32), r"tensor 'blk\.0\.ssm_out\.weight' \(Q8_0, shape \(64, 64\)\) lies "
                                                r"at bytes"),
    (_tensor_field(OUT, 24, "Q", 8), r"tensor 'blk\.0\.ssm_out\.weight' \(Q8_0, shape \(64, 64\)\) lies at bytes "
                                     r"\d+\.\.\d+ of a file of 362688 bytes, not aligned to 32"),
    (_overlap, r"tensor 'blk\.0\.ssm_out\.weight' starts at byte \d+, inside tensor 'blk\.0\.attn_gate\.weight' "
               r"\(which ends at \d+\)"),
], ids=["big-endian", "duplicate-key", "duplicate-tensor", "seven-dims", "unknown-type", "q4k-partial-block",
        "huge-dim", "offset-past-end", "unaligned-offset", "overlapping-tensors"])
def test_a_malformed_gguf_is_refused_naming_the_key_or_tensor(tmp_path, edit, msg):
    """Each corrupt header, key or tensor info must be a ConfigError naming the file and the key or tensor at open
    (they were refused with the reader's own words: "cannot reshape array of size 0 into shape (64,68)", "version
    50331648", "Found duplicated tensor with name ...", or a duplicate key taken on the reader's say)."""
    f = _mutated(tmp_path, edit)
    with pytest.raises(ConfigError, match=rf"bad\.gguf: not a readable GGUF file, truncated or corrupt \({msg}"):
        GGUFSource(f)


def test_a_gguf_with_a_bad_alignment_is_refused(tmp_path):
    """general.alignment that is not a power of two must be refused naming the key."""
    r = gguf.GGUFReader(str(GGUF_Q8))
    w = gguf.GGUFWriter(str(tmp_path / "bad.gguf"), "qwen35")
    w.add_uint32("general.alignment", 48)     # (add_custom_alignment refuses it)
    w.add_block_count(int(r.fields["qwen35.block_count"].contents()))
    w.add_tensor("token_embd.weight", np.zeros((8, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"bad\.gguf: .*metadata key 'general\.alignment' must be a uint32 power "
                                          "of two"):
        GGUFSource(tmp_path / "bad.gguf")


def test_the_fixture_still_opens_and_reads():
    """The checks must pass the llama.cpp converter's own file, every tensor of it."""
    src = GGUFSource(GGUF_Q8)
    assert src.get("layers.0.linear_attn.out_proj.weight", torch.float32).shape == (64, 64)
