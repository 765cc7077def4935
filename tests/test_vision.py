"""Vision tower and M-RoPE positions against transformers' Qwen3_5VisionModel / Qwen3_5Model.get_rope_index."""
import pytest
import torch

from memra_pp.errors import ConfigError, InputError
from memra_pp.model.config import VisionConfig
from memra_pp.model.mrope import decode_position, placeholder_spans, rope_positions
from memra_pp.model.vision import VisionTower

import transformers  # noqa: E402,F401  (a test dependency: a missing one must fail, not skip)

VISION = dict(depth=2, hidden_size=32, intermediate_size=64, num_heads=4, patch_size=4, temporal_patch_size=2,
              spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=16)
TEXT = dict(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
            layer_types=["linear_attention"] * 3 + ["full_attention"],
            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25,
                                 mrope_section=[2, 1, 1], mrope_interleaved=True))
IMG, VID, VS, VE = 300, 301, 302, 303
VCFG = VisionConfig(**VISION)


def perturb(m):
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.05))
    return m.eval()


@pytest.fixture(scope="module")
def hf_tower():
    from transformers import Qwen3_5VisionConfig, Qwen3_5VisionModel
    torch.manual_seed(0)
    return perturb(Qwen3_5VisionModel(Qwen3_5VisionConfig(**VISION)))


@pytest.fixture(scope="module")
def tower(hf_tower):
    return VisionTower(VCFG).load_hf_state(hf_tower.state_dict())


@pytest.fixture(scope="module")
def hf_model():
    from transformers import Qwen3_5Config, Qwen3_5Model
    cfg = Qwen3_5Config(text_config=TEXT, vision_config=VISION, image_token_id=IMG, video_token_id=VID,
                        vision_start_token_id=VS, vision_end_token_id=VE)
    return Qwen3_5Model(cfg).eval()


@pytest.mark.parametrize("grids", [[(1, 4, 6)], [(1, 4, 6), (1, 8, 2)], [(2, 6, 4)], [(1, 2, 2), (2, 4, 4)]],
                         ids=["one", "two-grids", "video-t2", "image+video"])
def test_tower_matches_hf(tower, hf_tower, grids):
    """The tower's rows must equal Qwen3_5VisionModel's pooler_output (fp32, atol 1e-5) for any mix of grids."""
    torch.manual_seed(1)
    g = torch.tensor(grids)
    px = torch.randn(int(g.prod(-1).sum()), 3 * 2 * 4 * 4)
    with torch.no_grad():
        want = hf_tower(px, grid_thw=g).pooler_output
        got = tower(px, g)
    assert got.shape == (int(g.prod(-1).sum()) // 4, 64)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_the_towers_rope_base_is_read_from_the_config_and_other_ropes_refused():
    """vision_config.rope_parameters.rope_theta is the axial rope's base in transformers; the tower used 10000
    whatever the config said (1e-4 off at theta 100 on this small grid, more on larger ones). A rope_type other
    than "axial", or a base that is no finite number above 1, is refused naming the key."""
    from transformers import Qwen3_5VisionConfig, Qwen3_5VisionModel

    from memra_pp.model.config import parse_config
    from memra_pp.model.tiny import tiny_config
    rope = {"rope_type": "axial", "rope_theta": 100.0}
    torch.manual_seed(0)
    hf = perturb(Qwen3_5VisionModel(Qwen3_5VisionConfig(**VISION, rope_parameters=rope)))
    raw = tiny_config(vision=True)
    raw["vision_config"] = dict(VISION, out_hidden_size=raw["text_config"]["hidden_size"], rope_parameters=rope)
    vc = parse_config(raw).vision
    assert vc.rope_theta == 100.0
    tower = VisionTower(vc).load_hf_state(hf.state_dict())
    g = torch.tensor([(1, 8, 12)])
    px = torch.randn(96, 3 * 2 * 4 * 4)
    with torch.no_grad():
        assert torch.allclose(tower(px, g), hf(px, grid_thw=g).pooler_output, atol=1e-5)
    for bad, msg in ((dict(rope, rope_type="mrope"), "rope_type 'mrope' is not supported"),
                     (dict(rope, rope_theta=float("nan")), "rope_theta must be a finite number above 1"),
                     (dict(rope, rope_theta="1e4"), "rope_theta must be a finite number above 1"),
                     ([100.0], "rope_parameters must be an object")):
        raw["vision_config"]["rope_parameters"] = bad
        with pytest.raises(ConfigError, match=msg):
            parse_config(raw)


def test_tower_loads_by_checkpoint_name(hf_tower):
    """load() must read the 5-D conv weight and every other tensor by its name after `model.visual.`."""
    sd = {"model.visual." + k: v for k, v in hf_tower.state_dict().items()}
    asked = []
    VisionTower(VCFG).load(lambda n: asked.append(n) or sd["model.visual." + n])
    assert "patch_embed.proj.weight" in asked and "blocks.1.attn.qkv.bias" in asked
    assert len(asked) == len(sd)


def test_tower_refuses_missing_and_misshaped(hf_tower):
    """A missing or mis-shaped tensor must raise ConfigError naming it."""
    sd = dict(hf_tower.state_dict())
    del sd["blocks.1.mlp.linear_fc2.bias"]
    with pytest.raises(ConfigError, match=r"visual\.blocks\.1\.mlp\.linear_fc2\.bias .* missing"):
        VisionTower(VCFG).load_hf_state(sd)
    sd = dict(hf_tower.state_dict())
    sd["patch_embed.proj.weight"] = sd["patch_embed.proj.weight"].reshape(32, -1)
    with pytest.raises(ConfigError, match=r"patch_embed\.proj\.weight has shape \(32, 96\), expected "
                                          r"\(32, 3, 2, 4, 4\)"):
        VisionTower(VCFG).load_hf_state(sd)


def test_tower_refuses_bad_config_and_shapes(tower):
    """An unsupported activation, a non-square position table or pixel rows that disagree with the grid must
    be refused."""
    with pytest.raises(ConfigError, match="hidden_act 'relu'"):
        VisionTower(VisionConfig(**{**VISION, "hidden_act": "relu"}))
    with pytest.raises(ConfigError, match="num_position_embeddings 15 must be a square"):
        VisionTower(VisionConfig(**{**VISION, "num_position_embeddings": 15}))
    with pytest.raises(InputError, match=r"shape \(10, 96\), but grid_thw \[\(1, 4, 6\)\] describes 24 patches"):
        tower(torch.zeros(10, 96), (1, 4, 6))


def _prompt(*parts):
    """parts: n text tokens, ('img', grid), ('vid', grid) -> (ids, grids, mm_token_type_ids, kinds); each video
    frame pair is preceded by timestamp text, as Qwen3.5's chat template writes it."""
    ids, types, grids, kinds = [], [], [], []
    for part in parts:
        if isinstance(part, int):
            ids += [7 + i % 50 for i in range(part)]
            types += [0] * part
            continue
        kind, (t, h, w) = part
        grids.append((t, h, w))
        kinds.append(kind)
        frames = [(t * h * w // 4, IMG, 1)] if kind == "img" else [(h * w // 4, VID, 2)] * t
        for k, (n, tok, ty) in enumerate(frames):
            pre = [VS] if kind == "img" else [60 + k, 61, VS]      # '<t> seconds' text before each frame
            ids += pre + [tok] * n + [VE]
            types += [0] * len(pre) + [ty] * n + [0]
    return ids, grids, types, kinds


PROMPTS = {
    "text-only": (5,),
    "one-image": (3, ("img", (1, 4, 6)), 4),
    "two-images": (2, ("img", (1, 4, 6)), 3, ("img", (1, 8, 4)), 1),
    "video": (2, ("vid", (2, 4, 4)), 5),
    "image-video-image": (1, ("img", (1, 2, 6)), 2, ("vid", (3, 6, 2)), 2, ("img", (1, 4, 4)), 3),
}


@pytest.mark.parametrize("name", list(PROMPTS))
def test_positions_match_get_rope_index(hf_model, name):
    """rope_positions must equal get_rope_index's positions and rope_deltas, videos split per temporal patch."""
    ids, grids, types, kinds = _prompt(*PROMPTS[name])
    img = [g for g, k in zip(grids, kinds) if k == "img"]
    vid = [g for g, k in zip(grids, kinds) if k == "vid"]
    want, want_delta = hf_model.get_rope_index(
        torch.tensor([ids]), mm_token_type_ids=torch.tensor([types]),
        image_grid_thw=torch.tensor(img) if img else None, video_grid_thw=torch.tensor(vid) if vid else None)
    got, delta = rope_positions(ids, grids, IMG, VID, merge=2)
    assert torch.equal(got, want[:, 0])
    assert delta == int(want_delta)
    assert decode_position(len(ids), delta) == int(got.max()) + 1


def test_positions_reference_example():
    """A (1, 4, 6) image at p = 3 must take T = 3 x6, H = 3,3,3,4,4,4, W = 3,4,5,3,4,5; the next text sits at 6."""
    ids = [1, 2, VS] + [IMG] * 6 + [VE, 9]
    pos, delta = rope_positions(ids, [(1, 4, 6)], IMG, VID, 2)
    assert pos[:, 3:9].tolist() == [[3] * 6, [3, 3, 3, 4, 4, 4], [3, 4, 5, 3, 4, 5]]
    assert pos[:, 9].tolist() == [6, 6, 6] and delta == 8 - 11


def test_placeholder_spans():
    """Each run of placeholders must map to its rows of the stacked tower output, video frames included."""
    ids, grids, _, _ = _prompt(3, ("img", (1, 4, 6)), 2, ("vid", (2, 4, 4)), 1)
    spans = placeholder_spans(ids, grids, IMG, VID, 2)
    assert spans == [(4, 0, 6), (16, 6, 4), (24, 10, 4)]
    for pos, off, n in spans:
        assert set(ids[pos:pos + n]) <= {IMG, VID} and ids[pos + n] == VE
    adjacent = [VS] + [IMG] * 12 + [VE]                          # two images back to back: one run, one span
    assert placeholder_spans(adjacent, [(1, 4, 6), (1, 4, 6)], IMG, VID, 2) == [(1, 0, 12)]


def test_mrope_refusals():
    """Count mismatches, interrupted blocks, mixed kinds and bad grids must raise InputError saying the numbers."""
    ids = [1, VS] + [IMG] * 5 + [VE]
    with pytest.raises(InputError, match="Attempted to assign 6 image tokens to 5 placeholders"):
        rope_positions(ids, [(1, 4, 6)], IMG, VID, 2)
    with pytest.raises(InputError, match="Attempted to assign 6 image tokens to 5 placeholders"):
        placeholder_spans(ids, [(1, 4, 6)], IMG, VID, 2)
    with pytest.raises(InputError, match="Attempted to assign 0 image tokens to 2 placeholders"):
        placeholder_spans([IMG, IMG], [], IMG, VID, 2)
    split = [VS] + [IMG] * 3 + [VE, VS] + [IMG] * 3 + [VE]
    with pytest.raises(InputError, match=r"image 0 \(grid \(1, 4, 6\)\) needs 6 contiguous placeholders at "
                                         r"prompt position 1, but the run ends at 4"):
        rope_positions(split, [(1, 4, 6)], IMG, VID, 2)
    mixed = [VS] + [VID] * 4 + [5] + [IMG] * 4
    with pytest.raises(InputError, match="video 0: its placeholders continue at prompt position 6 with image "
                                         "tokens"):
        rope_positions(mixed, [(2, 4, 4)], IMG, VID, 2)
    with pytest.raises(InputError, match=r"image 0: grid_thw \(1, 3, 4\) must be positive with h and w multiples"):
        rope_positions([IMG] * 3, [(1, 3, 4)], IMG, VID, 2)


def test_building_the_tower_imports_no_dynamo():
    """A stage that holds the tower builds it at every start: nn.Embedding's own initialisation on the meta device
    went through torch's refs, which imported torch._dynamo (and sympy), 1.2-1.7 s of CPU a start. Checked in a
    fresh interpreter, where nothing else has imported it."""
    import subprocess
    import sys
    code = ("import sys, torch\n"
            "from memra_pp.model.config import VisionConfig\n"
            "from memra_pp.model.vision import VisionTower\n"
            f"t = VisionTower(VisionConfig(**{VISION!r}))\n"
            "assert t.pos_embed.weight.is_meta, t.pos_embed.weight.device\n"
            "print('torch._dynamo' in sys.modules, 'sympy' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "False"], out.stdout
