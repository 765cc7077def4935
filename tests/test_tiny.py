"""make_tiny: the written checkpoint loads in transformers with every key accounted for, and is deterministic."""
from __future__ import annotations

import hashlib
import json
import math
import re
import subprocess
import sys
import time

import pytest
import torch
import transformers
from safetensors.torch import load_file

from memra_pp.model.config import load_config
from memra_pp.model.tiny import TOKEN_IDS, make_tiny, tiny_config
from memra_pp.model.tokenizer import Tokenizer

# name -> make_tiny keywords; vision checkpoints load as the VLM class, text-only ones as ForCausalLM.
SCENARIOS = {
    "dense-untied": dict(),
    "dense-tied": dict(tied=True),
    "moe-untied": dict(moe=True),
    "moe-tied": dict(moe=True, tied=True),
    "dense-vision": dict(vision=True),
    "moe-vision-tied": dict(moe=True, vision=True, tied=True),
    "dense-6-layers": dict(num_layers=6, layer_types=["linear_attention"] * 3 + ["full_attention",
                                                                                 "linear_attention", "full_attention"]),
}
PROMPT = torch.tensor([[5, 17, 42, 99, 7, 250, 3, 11, 60]])


@pytest.fixture(scope="module")
def tiny_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return {name: make_tiny(root / name, **kw) for name, kw in SCENARIOS.items()}


def _load(path, vision: bool):
    auto = transformers.AutoModelForImageTextToText if vision else transformers.AutoModelForCausalLM
    model, info = auto.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


def _digest(path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir())}


@pytest.mark.parametrize("name", SCENARIOS)
def test_transformers_loads_every_key_and_generates(tiny_dirs, name):
    """transformers must load the checkpoint with no missing, unexpected or mismatched key, keep our values
    (not re-initialise any), and greedy-generate exactly max_new_tokens in-vocabulary tokens."""
    kw = SCENARIOS[name]
    model, info = _load(tiny_dirs[name], kw.get("vision", False))
    assert {k: v for k, v in info.items() if v} == {}
    expect = ("Qwen3_5Moe" if kw.get("moe") else "Qwen3_5") + \
        ("ForConditionalGeneration" if kw.get("vision") else "ForCausalLM")
    assert type(model).__name__ == expect
    assert model.config.tie_word_embeddings == kw.get("tied", False)
    params = dict(model.named_parameters(remove_duplicate=False))
    if not kw.get("vision"):          # ForCausalLM holds the language model as model.*
        params = {k.replace("model.", "model.language_model.", 1): v for k, v in params.items()}
    for k, v in load_file(tiny_dirs[name] / "model.safetensors").items():
        if ".experts." in k:          # transformers fuses per-expert tensors in memory: [gate; up] and down
            layer, e, proj = re.match(r"(.*\.experts)\.(\d+)\.(\w+)_proj\.weight", k).groups()
            fused = params[layer + (".down_proj" if proj == "down" else ".gate_up_proj")][int(e)]
            half = fused.shape[0] // 2
            v_in = {"gate": fused[:half], "up": fused[half:], "down": fused}[proj]
            assert torch.equal(v_in, v), k
        else:
            assert torch.equal(params[k], v), k
    head, embed = model.get_output_embeddings().weight, model.get_input_embeddings().weight
    assert (head.data_ptr() == embed.data_ptr()) == kw.get("tied", False)
    with torch.no_grad():
        logits = model(input_ids=PROMPT).logits
        out = model.generate(PROMPT, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    assert torch.isfinite(logits).all() and 0.5 < logits[0, -1].std() < 10
    new = out[0, PROMPT.shape[1]:]
    assert len(new) == 8 and int(new.max()) < 512


def test_weights_are_random_in_hf_conventions(tiny_dirs):
    """Every weight must be non-trivial: norms N(0, 0.3) around HF's 1 + w zero point, the gated norm and
    dt_bias around 1, A_log = log U(0.5, 8), no all-zero or all-one tensor anywhere."""
    w = load_file(tiny_dirs["moe-vision-tied"] / "model.safetensors")
    for k, v in w.items():
        assert v.dtype == torch.float32 and v.std() > 0.01, k
    p = "model.language_model.layers.0."
    assert 0.15 < w[p + "input_layernorm.weight"].std() < 0.5
    assert abs(w[p + "linear_attn.norm.weight"].mean() - 1) < 0.3
    assert abs(w[p + "linear_attn.dt_bias"].mean() - 1) < 0.6
    a = w[p + "linear_attn.A_log"]
    assert math.log(0.5) <= a.min() and a.max() <= math.log(8.0)
    assert p + "mlp.experts.7.down_proj.weight" in w and "lm_head.weight" not in w
    text_only = load_file(tiny_dirs["dense-untied"] / "model.safetensors")
    assert "lm_head.weight" in text_only and not any(k.startswith("model.visual.") for k in text_only)


@pytest.mark.parametrize("name", ["dense-vision", "moe-vision-tied"])
def test_vision_forward_uses_pixels(tiny_dirs, name):
    """A multimodal forward with pixel_values must run, and the image must reach the logits (other pixels,
    other logits), with the placeholder ids the config names."""
    model, _ = _load(tiny_dirs[name], True)
    cfg = model.config
    grid = torch.tensor([[1, 4, 4]])                   # 16 patches -> 4 merged image tokens
    n_img = int(grid.prod()) // cfg.vision_config.spatial_merge_size ** 2
    ids = torch.tensor([[5, 17, cfg.vision_start_token_id] + [cfg.image_token_id] * n_img +
                        [cfg.vision_end_token_id, 42, 99]])
    mm = (ids == cfg.image_token_id).long()
    patch = 3 * cfg.vision_config.temporal_patch_size * cfg.vision_config.patch_size ** 2
    g = torch.Generator().manual_seed(1)
    logits = []
    with torch.no_grad():
        for _ in range(2):
            pix = torch.randn(int(grid.prod()), patch, generator=g)
            logits.append(model(input_ids=ids, pixel_values=pix, image_grid_thw=grid, mm_token_type_ids=mm).logits)
    assert logits[0].shape == (1, ids.shape[1], 512) and torch.isfinite(logits[0]).all()
    assert not torch.allclose(logits[0][0, -1], logits[1][0, -1], atol=1e-4)


def test_same_seed_gives_identical_bytes(tmp_path):
    """The same arguments must give byte-identical files, also in a fresh process (tokenizer training
    included); another seed must change the weights and the recorded seed, nothing else."""
    a = _digest(make_tiny(tmp_path / "a", moe=True, vision=True, seed=3))
    b = _digest(make_tiny(tmp_path / "b", moe=True, vision=True, seed=3))
    code = ("import sys; from memra_pp.model.tiny import make_tiny; "
            "make_tiny(sys.argv[1], moe=True, vision=True, seed=3)")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], check=True, timeout=60)
    c = _digest(tmp_path / "c")
    d = _digest(make_tiny(tmp_path / "d", moe=True, vision=True, seed=4))
    assert a == b == c
    assert {k for k in a if a[k] != d[k]} == {"model.safetensors", "memra_tiny.json"}    # the seed is recorded


def test_reuse_with_another_seed_is_refused(tmp_path):
    """A checkpoint is reused only for the seed it was made with (`make-tiny D --seed 3` over a seed-0 D used to
    return D unchanged): another seed is refused until overwrite, which writes that seed's weights."""
    d = make_tiny(tmp_path / "d")
    assert make_tiny(d) == d
    with pytest.raises(FileExistsError, match="holds the seed-0 checkpoint, not seed 3; pass overwrite=True"):
        make_tiny(d, seed=3)
    assert _digest(make_tiny(d, seed=3, overwrite=True)) == _digest(make_tiny(tmp_path / "e", seed=3))


def test_fast_and_config_matches_tokenizer(tmp_path):
    """make_tiny must take under 2 s; the config's multimodal and eos ids must be the tokenizer's ids for those
    tokens, and memra_pp's own config parser must accept the result."""
    t = time.perf_counter()
    path = make_tiny(tmp_path / "m", vision=True)
    assert time.perf_counter() - t < 2.0
    cfg, tok = load_config(path), Tokenizer.from_model_dir(path)
    assert tok.vocab_size == cfg.text.vocab_size == 512
    assert cfg.image_token_id == tok.token_id("<|image_pad|>") == TOKEN_IDS["<|image_pad|>"]
    assert cfg.video_token_id == tok.token_id("<|video_pad|>")
    assert cfg.vision_start_token_id == tok.token_id("<|vision_start|>")
    assert cfg.vision_end_token_id == tok.token_id("<|vision_end|>")
    assert cfg.eos_token_ids == (tok.token_id("<|im_end|>"),) == (2,)
    assert tok.token_id("<|endoftext|>") == 0 and tok.token_id("<|im_start|>") == 1
    assert cfg.vision is not None and cfg.vision.out_hidden_size == cfg.text.hidden_size
    assert load_config(make_tiny(tmp_path / "t")).vision is None
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2 and gen["pad_token_id"] == 0


def test_existing_checkpoint_kept_or_refused(tmp_path):
    """An existing checkpoint with the same config must be kept untouched; one with another config must be
    refused naming overwrite=True; overwrite=True must replace it."""
    path = make_tiny(tmp_path / "m")
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    assert make_tiny(path) == path and (path / "model.safetensors").stat().st_mtime_ns == stamp
    with pytest.raises(FileExistsError, match="overwrite=True"):
        make_tiny(path, moe=True)
    make_tiny(path, moe=True, overwrite=True)
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_5_moe"


def test_bad_layer_types_refused():
    """layer_types of the wrong length or with an unknown kind must be refused, naming the value."""
    with pytest.raises(ValueError, match="layer_types"):
        tiny_config(num_layers=4, layer_types=["linear_attention"] * 3)
    with pytest.raises(ValueError, match="mamba"):
        tiny_config(num_layers=2, layer_types=["linear_attention", "mamba"])
