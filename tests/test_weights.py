"""Checkpoint loading (issue 2): sharded, fused-expert and text-only layouts must match transformers; a stage must
read only its own tensors; bad checkpoints and configs must be refused naming the tensor, key or file; dummy weights.
"""
import functools
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from conftest_models import hf_reference, tiny_checkpoint
from memra_pp.errors import ConfigError
from memra_pp.model.batch import StepBatch
from memra_pp.model.config import FULL, LINEAR
from memra_pp.model.local import LocalPipeline
from memra_pp.model.stage_model import StageModel
from memra_pp.model.weights import DummySource, SafetensorsSource, expected_shape, open_weights
from tiny_hf import TEXT, hf_greedy, perturb
from gaps import worst_gap

PROMPTS = [(5, 17, 42), tuple(range(1, 71))]
NEW = 6
SPLIT = [(0, 3), (3, 8)]
LM = "model.language_model."
_ROOT = Path(tempfile.mkdtemp(prefix="memra-weights-"))


def check_tokens(src, reference):
    """Greedy tokens through 2 stages must equal `reference(prompt)` and logprobs stay within 5e-4."""
    toks, lps = LocalPipeline(src, SPLIT).greedy([list(p) for p in PROMPTS], NEW)
    for p, t, l in zip(PROMPTS, toks, lps, strict=True):
        ht, hl = reference(p)
        assert t == ht, f"prompt of {len(p)} tokens: {t} != transformers {ht}"
        assert worst_gap(zip(l, hl, strict=True)) < 5e-4


@functools.lru_cache(maxsize=None)
def sharded(kind: str, tied: bool = False) -> Path:
    m, _ = tiny_checkpoint(kind, tied)
    path = _ROOT / f"sharded-{kind}-{tied}"
    m.save_pretrained(path, max_shard_size="200KB")
    return path


def copy_checkpoint(kind: str, dst: Path, tied: bool = False) -> Path:
    _, src = tiny_checkpoint(kind, tied)
    shutil.copytree(src, dst)
    return dst


# ---- layouts ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_sharded_checkpoint_matches_transformers(kind):
    """A checkpoint written as model.safetensors.index.json + several shards must give transformers' tokens."""
    path = sharded(kind)
    assert (path / "model.safetensors.index.json").exists()
    assert not (path / "model.safetensors").exists()
    assert len(list(path.glob("model-*.safetensors"))) >= 3
    check_tokens(SafetensorsSource(path), lambda p: hf_reference(kind, False, p, NEW))


def fuse_experts(sd: dict, n_experts: int) -> dict:
    """Per-expert keys -> `mlp.experts.gate_up_proj` (E, 2I, H) and `mlp.experts.down_proj` (E, H, I), no .weight."""
    out, bases = {}, set()
    for k, v in sd.items():
        if ".mlp.experts." in k:
            bases.add(k.split(".mlp.experts.")[0] + ".mlp.experts")
        else:
            out[k] = v
    for b in bases:
        out[b + ".gate_up_proj"] = torch.stack([torch.cat([sd[f"{b}.{e}.gate_proj.weight"],
                                                           sd[f"{b}.{e}.up_proj.weight"]]) for e in range(n_experts)])
        out[b + ".down_proj"] = torch.stack([sd[f"{b}.{e}.down_proj.weight"] for e in range(n_experts)])
    return out


def test_fused_expert_tensors_match_per_expert(tmp_path):
    """A MoE checkpoint with fused 3-D expert tensors (as released Qwen3.5-MoE files) must give the same tensors
    and the same tokens as the per-expert original."""
    orig = tiny_checkpoint("moe")[1]
    per = SafetensorsSource(orig)
    d = tmp_path / "fused"
    d.mkdir()
    shutil.copy(orig / "config.json", d)
    sd = fuse_experts(load_file(orig / "model.safetensors"), per.config.text.num_experts)
    save_file(sd, d / "model.safetensors")
    assert not any(".experts.0." in k for k in sd) and LM + "layers.1.mlp.experts.gate_up_proj" in sd
    fused = SafetensorsSource(d)
    for name in ("layers.1.mlp.experts.gate_up_proj", "layers.6.mlp.experts.down_proj"):
        assert fused.has(name)
        assert torch.equal(fused.get(name, torch.float32), per.get(name, torch.float32))
    check_tokens(fused, lambda p: hf_reference("moe", False, p, NEW))


@functools.lru_cache(maxsize=None)
def text_only(tied: bool):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
    torch.manual_seed(3)
    m = perturb(Qwen3_5ForCausalLM(Qwen3_5TextConfig(**{**TEXT, "tie_word_embeddings": tied})).float())
    path = _ROOT / f"text-{tied}"
    m.save_pretrained(path)
    return m, path


@pytest.mark.parametrize("tied", [False, True])
def test_text_only_checkpoint_matches_transformers(tied):
    """A Qwen3_5ForCausalLM checkpoint (flat qwen3_5_text config, `model.` prefix) must load and match
    transformers, tied (no lm_head.weight in the file) and untied."""
    m, path = text_only(tied)
    raw = json.loads((path / "config.json").read_text())
    assert raw["model_type"] == "qwen3_5_text" and "text_config" not in raw
    keys = set(safe_open(str(path / "model.safetensors"), "pt").keys())
    assert "model.embed_tokens.weight" in keys and not any(k.startswith(LM) for k in keys)
    assert ("lm_head.weight" in keys) != tied
    src = SafetensorsSource(path)
    assert src.config.tied == tied and src.has("lm_head.weight") != tied
    check_tokens(src, lambda p: hf_greedy(m, list(p), NEW))


# ---- a stage reads only its own tensors --------------------------------------------------------------------------

class RecordingHandle:
    """A safe_open handle that logs every tensor it materialises."""

    def __init__(self, h, log):
        self.h, self.log = h, log

    def keys(self):
        return self.h.keys()

    def get_tensor(self, key):
        self.log.append(key)
        return self.h.get_tensor(key)


def layer_of(name: str) -> int | None:
    return int(name.split(".")[1]) if name.startswith("layers.") else None


@pytest.mark.parametrize("kind,tied,layout", [("dense", False, "single"), ("dense", True, "single"),
                                              ("moe", False, "sharded")])
def test_stage_reads_only_its_own_tensors(kind, tied, layout):
    """Stage slices [0,3) intake and [3,8) primary must each read (and materialise from the file) only their own
    layers, the embedding on the intake, norm + lm_head on the primary (embed_tokens as lm_head when tied)."""
    path = tiny_checkpoint(kind, tied)[1] if layout == "single" else sharded(kind, tied)
    for (a, b), intake, primary in [((0, 3), True, False), ((3, 8), False, True)]:
        src = SafetensorsSource(path)
        files, log = [], []

        def opener(f, framework, files=files, log=log):
            files.append(Path(f))
            return RecordingHandle(safe_open(f, framework=framework), log)
        src._safe_open = opener
        StageModel(src.config, a, b, intake=intake, primary=primary).load(src)
        got = set(src.read_names)
        layers = {layer_of(n) for n in got} - {None}
        assert layers == set(range(a, b)), f"stage [{a},{b}) read layers {sorted(layers)}"
        assert len(src.read_names) == len(got), "a tensor was read twice"
        extra = got - {n for n in got if layer_of(n) is not None}
        want = ({"embed_tokens.weight"} if intake else set()) | \
            ({"norm.weight", "embed_tokens.weight" if tied else "lm_head.weight"} if primary else set())
        assert extra == want
        # Through the file handles: every materialised key belongs to a name handed out, nothing else.
        for k in log:
            name = k.removeprefix(LM) if k != "lm_head.weight" else k
            if ".mlp.experts." in name:
                name = name.split(".mlp.experts.")[0] + ".mlp.experts." + \
                    ("down_proj" if name.endswith("down_proj.weight") else "gate_up_proj")
            assert name in got, f"stage [{a},{b}) materialised {k!r} it did not ask for"
        assert len(log) >= len(got)
        if layout == "sharded":
            own = {src._file_of[k] for k in log}
            assert set(files) == own, "a shard holding none of this stage's tensors was opened"
            assert len(own) < len(set(src._file_of.values()))


# ---- bad checkpoints ---------------------------------------------------------------------------------------------

def edit_safetensors(d: Path, fn):
    f = d / "model.safetensors"
    sd = load_file(f)
    fn(sd)
    save_file(sd, f)


def break_missing_tensor(d):
    edit_safetensors(d, lambda sd: sd.pop(LM + "layers.5.linear_attn.A_log"))
    return "layers.5.linear_attn.A_log", r"model\.language_model\.layers\.5\.linear_attn\.A_log' .*is missing"


def break_wrong_shape(d):
    edit_safetensors(d, lambda sd: sd.__setitem__(LM + "layers.2.mlp.down_proj.weight", torch.zeros(64, 7)))
    return "layers.2.mlp.down_proj.weight", \
        r"model\.safetensors: tensor 'layers\.2\.mlp\.down_proj\.weight' has shape \(64, 7\), the config needs " \
        r"\(64, 128\)"


def break_missing_expert(d):
    edit_safetensors(d, lambda sd: sd.pop(LM + "layers.4.mlp.experts.3.up_proj.weight"))
    return "layers.4.mlp.experts.gate_up_proj", r"layers\.4\.mlp\.experts\.3\.up_proj\.weight' is missing"


def break_truncated(d):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    return None, r"model\.safetensors: cannot read safetensors header"


def break_truncated_header(d):
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])
    return None, r"model\.safetensors: cannot read safetensors header"


def edit_config(d: Path, fn):
    raw = json.loads((d / "config.json").read_text())
    fn(raw)
    (d / "config.json").write_text(json.dumps(raw))


def break_model_type(d):
    def fn(raw):
        raw["model_type"] = "llama"
        raw["text_config"]["model_type"] = "llama_text"
    edit_config(d, fn)
    return None, r"config\.json: model_type 'llama' is not a Qwen3\.5 model; supported: \['qwen3_5'"


def break_no_config(d):
    (d / "config.json").unlink()
    return None, r"config\.json: no config\.json in the model directory"


def break_bad_json(d):
    (d / "config.json").write_text('{"model_type": "qwen3_5", ')
    return None, r"config\.json: not valid JSON"


def break_no_safetensors(d):
    (d / "model.safetensors").unlink()
    return None, r": no \*\.safetensors files and no model\.safetensors\.index\.json"


BAD = {
    "missing tensor": ("dense", break_missing_tensor),
    "wrong shape": ("dense", break_wrong_shape),
    "missing expert": ("moe", break_missing_expert),
    "truncated data": ("dense", break_truncated),
    "truncated header": ("dense", break_truncated_header),
    "unknown model_type": ("dense", break_model_type),
    "no config.json": ("dense", break_no_config),
    "invalid JSON": ("dense", break_bad_json),
    "no safetensors": ("dense", break_no_safetensors),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_checkpoint_is_a_config_error_naming_it(tmp_path, case):
    """Each broken checkpoint must give a ConfigError naming the tensor or the file, at open or at the tensor's get
    (never a bare KeyError / SafetensorError / JSONDecodeError)."""
    kind, brk = BAD[case]
    d = copy_checkpoint(kind, tmp_path / "ckpt")
    name, msg = brk(d)
    with pytest.raises(ConfigError, match=msg) as e:
        src = open_weights(d)
        StageModel(src.config, 0, 8, intake=True, primary=True).load(src)
    assert str(d) in str(e.value), "the message must name the checkpoint's file or directory"
    if name is not None:
        assert name.split(".")[-2] in str(e.value)


def test_missing_shard_is_a_config_error_naming_it(tmp_path):
    """A shard named by model.safetensors.index.json but absent must give a ConfigError naming that file, on the
    first get of a tensor it holds; stages not reading that shard must still load."""
    d = tmp_path / "sh"
    shutil.copytree(sharded("dense"), d)
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    shard = wm[LM + "layers.6.mlp.down_proj.weight"]
    (d / shard).unlink()
    src = SafetensorsSource(d)
    early = [n for n, f in wm.items() if f == shard]
    assert not any(layer_of(k.removeprefix(LM)) in (0, 1, 2) or k.endswith("embed_tokens.weight") for k in early), \
        "test premise: the removed shard holds none of the intake stage's tensors"
    StageModel(src.config, 0, 3, intake=True, primary=False).load(src)
    with pytest.raises(ConfigError, match=rf"{shard}: shard named by the index is missing"):
        StageModel(src.config, 3, 8, intake=False, primary=True).load(src)


def test_wrong_shape_in_a_shard_names_the_shard(tmp_path):
    """A wrongly shaped tensor in a sharded checkpoint must give a ConfigError naming the shard file and tensor."""
    d = tmp_path / "sh"
    shutil.copytree(sharded("dense"), d)
    key = LM + "layers.1.linear_attn.out_proj.weight"
    shard = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][key]
    sd = load_file(d / shard)
    sd[key] = torch.zeros(64, 63)
    save_file(sd, d / shard)
    src = SafetensorsSource(d)
    with pytest.raises(ConfigError, match=rf"{d / shard}: tensor 'layers\.1\.linear_attn\.out_proj\.weight' has "
                       r"shape \(64, 63\), the config needs \(64, 64\)"):
        StageModel(src.config, 0, 3, intake=True, primary=False).load(src)


def test_bad_index_is_a_config_error_naming_it(tmp_path):
    """An index that is not JSON, or has no weight_map, must give a ConfigError naming the index file."""
    d = tmp_path / "sh"
    shutil.copytree(sharded("dense"), d)
    idx = d / "model.safetensors.index.json"
    for text in ("{not json", '{"metadata": {}}'):
        idx.write_text(text)
        with pytest.raises(ConfigError, match=r"model\.safetensors\.index\.json: not a safetensors index"):
            SafetensorsSource(d)


# ---- format: dummy -----------------------------------------------------------------------------------------------

def test_a_preset_without_format_dummy_says_to_set_it():
    """(Was a defect: "model.path 'preset:...' does not exist".) A preset has no weights; the refusal names the fix."""
    for fmt in ("auto", "safetensors"):
        with pytest.raises(ConfigError, match=r"model\.path 'preset:qwen3\.5-27b' names a preset, which has no "
                                              r"weights: set model\.format: dummy"):
            open_weights("preset:qwen3.5-27b", fmt)


def test_dummy_preset_27b_config_and_shapes():
    """open_weights('preset:qwen3.5-27b', 'dummy') must give the 27B dims (64 layers, hidden 5120, 48 linear + 16
    full) and a DummySource whose tensors have expected_shape (small ones only are materialised)."""
    src = open_weights("preset:qwen3.5-27b", "dummy")
    assert isinstance(src, DummySource)
    t = src.config.text
    assert (t.num_hidden_layers, t.hidden_size, t.vocab_size) == (64, 5120, 248320)
    assert t.layer_types.count(LINEAR) == 48 and t.layer_types.count(FULL) == 16
    assert [i for i in range(64) if t.is_full(i)] == list(range(3, 64, 4))
    assert not src.config.tied and src.has("lm_head.weight") and not t.moe
    assert expected_shape("embed_tokens.weight", t) == (248320, 5120)
    assert expected_shape("layers.3.self_attn.q_proj.weight", t) == (2 * 24 * 256, 5120)
    assert expected_shape("layers.0.linear_attn.in_proj_qkv.weight", t) == (2 * 16 * 128 + 48 * 128, 5120)
    for name in ("norm.weight", "layers.0.input_layernorm.weight", "layers.0.linear_attn.A_log",
                 "layers.0.linear_attn.dt_bias", "layers.0.linear_attn.norm.weight",
                 "layers.0.linear_attn.conv1d.weight", "layers.3.self_attn.q_norm.weight",
                 "layers.63.post_attention_layernorm.weight"):
        x = src.get(name, torch.bfloat16, "cpu")
        assert tuple(x.shape) == expected_shape(name, t) and x.dtype == torch.bfloat16, name
        assert torch.isfinite(x.float()).all()
    assert src.read_names[0] == "norm.weight" and len(src.read_names) == 8
    moe = open_weights("preset:qwen3.5-35b-a3b", "dummy").config.text
    assert moe.moe and expected_shape("layers.0.mlp.experts.gate_up_proj", moe) == (256, 1024, 2048)
    with pytest.raises(ConfigError, match=r"no shape known for tensor 'layers\.0\.bogus\.weight'"):
        src.get("layers.0.bogus.weight", torch.float32)
    with pytest.raises(ConfigError, match=r"preset:qwen3\.5-9000b is unknown"):
        open_weights("preset:qwen3.5-9000b", "dummy")


def dummy_logits(d: Path, split):
    lp = LocalPipeline(open_weights(d, "dummy"), split)
    ids = torch.tensor([5, 17, 42, 7, 300, 1])
    b = StepBatch([0], [0], [len(ids)], StepBatch.text_positions([0], [len(ids)]), [True])
    return lp.step(b, ids)


@pytest.mark.parametrize("kind,tied", [("dense", False), ("moe", True)])
def test_dummy_weights_run_a_stage(tmp_path, kind, tied):
    """format: dummy over a config-only directory must build stages whose forward gives finite logits, the same
    across two loads, and never look for a weight file."""
    d = tmp_path / "cfg"
    d.mkdir()
    shutil.copy(tiny_checkpoint(kind, tied)[1] / "config.json", d)
    a = dummy_logits(d, SPLIT)
    b = dummy_logits(d, [(0, 8)])
    assert a.shape == (1, TEXT["vocab_size"]) and torch.isfinite(a).all() and a.std() > 0
    assert torch.equal(a, b)
    src = open_weights(d, "dummy")
    StageModel(src.config, 3, 8, intake=False, primary=True).load(src)
    assert ("embed_tokens.weight" in src.read_names) == tied and ("lm_head.weight" in src.read_names) != tied
