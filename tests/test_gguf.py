"""GGUFSource must hand out the Hugging Face tensors (canonical names) from llama.cpp-style qwen35 / qwen35moe GGUFs.

Tolerances, per element x of the HF tensor: F32 files and tensors the converter keeps in F32 (norms, A_log, dt_bias,
conv1d, routers): 1e-6 (norms and A_log pass through 1+w / -exp and back). F16: 2^-11 |x| + 2^-24 (f16 rounding).
Q8_0: 0.57 d with d = amax(32-block)/127, i.e. half a quantisation step plus the f16 rounding of the block scale
(127 d 2^-11 < 0.07 d); out_proj columns are permuted across blocks by the V-head untiling, so there amax is the row's.
"""
import functools
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from gguf_writer import canonical_state_dict, gguf_from_hf_dir, write_gguf
from memra_pp.errors import ConfigError
from memra_pp.model.config import FULL, LINEAR, load_config, parse_config
from memra_pp.model.gguf_source import GGUFSource
from tiny_hf import build

L, F = LINEAR, FULL
KEPT_F32 = ("norm.weight", "A_log", "dt_bias", "conv1d.weight", "mlp.gate.weight", "shared_expert_gate.weight")
# Table of scenarios: (kind, tied, fuse_gate_up, text overrides)
SCENARIOS = {
    # full attention at 2 and 5, where the (wrongly written) interval 4 says linear; rotary 16 where the
    # converter writes rope.dimension_count 8
    "dense-untied-layout": ("dense", False, False, dict(
        layer_types=[L, L, F, L, L, F, L, F], rope_parameters=dict(
            rope_type="default", rope_theta=1e7, partial_rotary_factor=0.5, mrope_section=[4, 2, 2],
            mrope_interleaved=True))),
    # r = nv/nk = 3 (tiling is not its own inverse) and dv != dk (state_size is not dv)
    "dense-tied-r3": ("dense", True, False, dict(linear_num_value_heads=6, linear_value_head_dim=32)),
    "moe-untied-nk2-nv4": ("moe", False, False, dict(linear_num_key_heads=2, linear_num_value_heads=4)),
    "moe-tied-fused-nk-eq-nv": ("moe", True, True, dict(linear_num_key_heads=4, linear_num_value_heads=4)),
}


def _fixtures() -> Path:
    here = Path(__file__).resolve().parents[1]
    for root in (here / "shared", here.parent / "shared"):
        if (root / "fixtures" / "qwen35-tiny").is_dir():
            return root / "fixtures" / "qwen35-tiny"
    raise AssertionError(f"fixtures/qwen35-tiny not found under {here}/shared or {here.parent}/shared")


FIXTURES = [("dense_text-s404", "dense_text"), ("moe_text-s414", "moe_text")]


@functools.lru_cache(maxsize=None)
def model(scenario: str):
    kind, tied, _, over = SCENARIOS[scenario]
    m = build(kind, tied=tied, seed=len(scenario), **over)
    cfg = parse_config(m.config.to_dict(), scenario)
    return cfg, canonical_state_dict(m.state_dict(), cfg.tied)


def tolerance(name: str, want: torch.Tensor, qtype: str) -> torch.Tensor:
    if qtype == "F32" or name.endswith(KEPT_F32) or want.ndim == 1:
        return torch.full_like(want, 1e-6)
    if qtype == "F16" or want.shape[-1] % 32:
        return want.abs() * 2.0 ** -11 + 2.0 ** -24
    if name.endswith("out_proj.weight"):
        return 0.57 * want.abs().amax(-1, keepdim=True).expand_as(want) / 127
    blocks = want.reshape(-1, 32)
    return (0.57 * blocks.abs().amax(-1, keepdim=True).expand_as(blocks) / 127).reshape(want.shape)


def assert_matches(src: GGUFSource, want: dict[str, torch.Tensor], qtype: str) -> None:
    for name, w in want.items():
        assert src.has(name), name
        got = src.get(name, torch.float32, "cpu")
        assert got.shape == w.shape, (name, got.shape, w.shape)
        err = (got - w).abs()
        assert bool((err <= tolerance(name, w, qtype)).all()), f"{name} ({qtype}): max |err| {err.max():.3g}"
    assert src.read_names == list(want)


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_written_gguf_matches_hf(scenario, qtype, tmp_path):
    """Every canonical tensor from a converter-style GGUF must equal the HF tensor within the qtype's tolerance."""
    cfg, want = model(scenario)
    path = write_gguf(want, cfg, tmp_path / "m.gguf", qtype, fuse_gate_up=SCENARIOS[scenario][2])
    src = GGUFSource(path)
    assert src.config.text == cfg.text
    assert src.has("lm_head.weight") == (not cfg.tied)
    assert_matches(src, want, qtype)
    types = {t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert types == {"F32": {"F32"}, "F16": {"F32", "F16"}, "Q8_0": {"F32", "Q8_0"}}[qtype] or \
        (qtype == "Q8_0" and types == {"F32", "Q8_0", "F16"} and cfg.text.moe)   # MoE shared expert: rows of 48


def test_config_ignores_untrusted_metadata(tmp_path):
    """Layer kinds must come from tensors and the rotary dim from the sections, not from the keys written wrong."""
    cfg, want = model("dense-untied-layout")
    path = write_gguf(want, cfg, tmp_path / "m.gguf", eos_token_id=7)
    fields = gguf.GGUFReader(path).fields
    assert fields["qwen35.full_attention_interval"].contents() == 4
    assert fields["qwen35.rope.dimension_count"].contents() == 8
    c = GGUFSource(path).config
    assert c.text.layer_types == (L, L, F, L, L, F, L, F)
    assert c.text.rotary_dim == 16 and c.text.partial_rotary_factor == 0.5 and c.text.mrope_interleaved
    assert c.eos_token_ids == (7,) and not c.tied and c.model_type == "qwen3_5_text"


@pytest.mark.parametrize("qtype", ["f32", "q8_0"])
@pytest.mark.parametrize("folder,kind", FIXTURES)
def test_llama_cpp_fixture_matches_hf(folder, kind, qtype):
    """GGUFs written by llama.cpp's own converter must load to the hf/ tensors, and to the hf/ config."""
    from safetensors.torch import load_file
    root = _fixtures() / folder
    hf_cfg = load_config(root / "hf")
    src = GGUFSource(root / f"{kind}-{qtype}.gguf")
    assert src.config.text == hf_cfg.text
    # the GGUF carries the tokenizer's eos (2, <|im_end|>); config.json has none. <|endoftext|> (0) ends
    # generation too, as llama.cpp takes it (llama-vocab.cpp's end-of-generation tokens by text)
    assert src.config.eos_token_ids == (2, 0)
    assert_matches(src, canonical_state_dict(load_file(root / "hf" / "model.safetensors"), hf_cfg.tied),
                   qtype.upper())


@pytest.mark.parametrize("qtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("folder,kind", FIXTURES)
def test_writer_reproduces_llama_cpp_bytes(folder, kind, qtype, tmp_path):
    """The test writer must reproduce llama.cpp's files: same tensors, types, bytes and model metadata."""
    root = _fixtures() / folder
    ours = gguf.GGUFReader(gguf_from_hf_dir(root / "hf", tmp_path / "m.gguf", qtype))
    theirs = gguf.GGUFReader(root / f"{kind}-{qtype.lower()}.gguf")
    a, b = {t.name: t for t in ours.tensors}, {t.name: t for t in theirs.tensors}
    assert sorted(a) == sorted(b)
    for n, t in b.items():
        assert a[n].tensor_type == t.tensor_type, n
        if n.endswith("ssm_a"):   # -exp(A_log): torch's float32 exp differs by 1 ulp between CPUs' vector paths
            np.testing.assert_array_max_ulp(np.asarray(a[n].data), np.asarray(t.data), maxulp=1)
        else:
            assert np.array_equal(a[n].data, t.data), n
    for key, f in theirs.fields.items():
        if not key.startswith(("tokenizer.", "general.name", "general.size_label", "GGUF.kv_count")):
            assert ours.fields[key].contents() == f.contents(), key


def test_stage_reads_only_its_layers(tmp_path):
    """A stage holding layers [2, 4) must leave no other layer's tensor in read_names."""
    cfg, want = model("moe-untied-nk2-nv4")
    src = GGUFSource(write_gguf(want, cfg, tmp_path / "m.gguf", "Q8_0"))
    mine = [n for n in want if n.startswith(("layers.2.", "layers.3."))]
    for n in mine:
        src.get(n, torch.bfloat16, "cpu")
    assert src.read_names == mine and len(mine) > 20


# ---- refusals --------------------------------------------------------------------------------------------

def _refusal_file(tmp_path, hook=None, qtype="F32"):
    cfg, want = model("dense-tied-r3")
    return write_gguf(want, cfg, tmp_path / "bad.gguf", qtype, tensor_hook=hook)


@pytest.mark.parametrize("keep", [40, 3000, -100])
def test_truncated_file_refused(keep, tmp_path):
    """A truncated GGUF (in the header, the tensor table or the data) must be a ConfigError naming the file."""
    data = _refusal_file(tmp_path).read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:keep])
    with pytest.raises(ConfigError, match=r"cut\.gguf: not a readable GGUF file, truncated or corrupt"):
        GGUFSource(cut)


def test_unknown_architecture_refused(tmp_path):
    """An architecture other than qwen35 / qwen35moe must be refused, naming it."""
    w = gguf.GGUFWriter(str(tmp_path / "next.gguf"), "qwen3next")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"next\.gguf: GGUF architecture 'qwen3next' is not supported"):
        GGUFSource(tmp_path / "next.gguf")


def test_missing_tensor_refused(tmp_path):
    """A tensor absent from the file must be a ConfigError naming the GGUF and canonical names and the file."""
    src = GGUFSource(_refusal_file(tmp_path, lambda n, a: None if n == "blk.1.ssm_out.weight" else a))
    name = "layers.1.linear_attn.out_proj.weight"
    assert not src.has(name)
    with pytest.raises(ConfigError, match=r"bad\.gguf: tensor 'blk\.1\.ssm_out\.weight' \(canonical "
                                          r"'layers\.1\.linear_attn\.out_proj\.weight'\) is missing"):
        src.get(name, torch.float32)
    with pytest.raises(ConfigError, match=r"bad\.gguf: tensor 'output\.weight' .* the model is tied"):
        src.get("lm_head.weight", torch.float32)
    assert src.read_names == []


@pytest.mark.parametrize("gname,cut,canon,msg", [
    ("blk.0.attn_gate.weight", (slice(None), slice(0, 32)), "layers.0.linear_attn.in_proj_z.weight",
     r"has shape \(192, 32\), the config needs \(192, 64\)"),
    ("blk.0.ssm_beta.weight", (slice(0, 5),), "layers.0.linear_attn.in_proj_b.weight",
     r"has shape \(5, 64\), the config needs \(6, 64\)"),   # does not even untile
])
def test_wrong_shape_refused(gname, cut, canon, msg, tmp_path):
    """A tensor whose shape disagrees with the config must be a ConfigError naming it, the file and both shapes."""
    src = GGUFSource(_refusal_file(tmp_path, lambda n, a: a[cut] if n == gname else a))
    with pytest.raises(ConfigError, match=rf"bad\.gguf.*{gname}.*{msg}"):
        src.get(canon, torch.float32)


def test_unsupported_type_refused(tmp_path):
    """A tensor type gguf-py cannot dequantize (Q8_1) must be a ConfigError naming the tensor and the type."""
    def q8_1(n, a):
        if n != "blk.0.ssm_out.weight":
            return a
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1]
        return np.zeros((a.shape[0], a.shape[1] // block * size), np.uint8), gguf.GGMLQuantizationType.Q8_1
    src = GGUFSource(_refusal_file(tmp_path, q8_1))
    with pytest.raises(ConfigError, match=r"bad\.gguf: tensor 'blk\.0\.ssm_out\.weight' has type Q8_1"):
        src.get("layers.0.linear_attn.out_proj.weight", torch.float32)


def _drop(*names):
    return lambda n, a: None if n in names else a


@pytest.mark.parametrize("hook,msg", [
    (_drop("blk.1.attn_qkv.weight", "blk.1.ssm_a"), r"block 1 has neither blk\.1\.attn_q\.weight"),
    (_drop("token_embd.weight"), r"tensor 'token_embd\.weight' is missing"),
])
def test_unreadable_layout_refused(hook, msg, tmp_path):
    """A file whose layer kinds or vocabulary cannot be read from its tensors must be refused at open."""
    with pytest.raises(ConfigError, match=rf"bad\.gguf: {msg}"):
        GGUFSource(_refusal_file(tmp_path, hook))


def test_bad_names_and_values_refused(tmp_path):
    """A missing file, missing metadata, an unknown canonical name and a positive ssm_a must each be refused."""
    with pytest.raises(ConfigError, match=r"nowhere\.gguf: GGUF file does not exist"):
        GGUFSource(tmp_path / "nowhere.gguf")
    w = gguf.GGUFWriter(str(tmp_path / "bare.gguf"), "qwen35")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ConfigError, match=r"bare\.gguf: GGUF metadata key 'qwen35\.block_count' is missing"):
        GGUFSource(tmp_path / "bare.gguf")
    src = GGUFSource(_refusal_file(tmp_path, lambda n, a: -a if n == "blk.0.ssm_a" else a))
    assert not src.has("layers.0.mlp.bogus.weight") and not src.has("visual.blocks.0.norm1.weight")
    with pytest.raises(ConfigError, match=r"bad\.gguf: no GGUF tensor corresponds to canonical name "
                                          r"'layers\.0\.mlp\.bogus\.weight'"):
        src.get("layers.0.mlp.bogus.weight", torch.float32)
    with pytest.raises(ConfigError, match=r"bad\.gguf: tensor for 'layers\.0\.linear_attn\.A_log' .* non-negative"):
        src.get("layers.0.linear_attn.A_log", torch.float32)


def test_rope_scaling_is_refused(tmp_path):
    """A GGUF whose rope.scaling.type asks for scaling (YaRN) must be refused naming it, not run as plain RoPE;
    "none" loads."""
    cfg, want = model("dense-untied-layout")
    GGUFSource(write_gguf(want, cfg, tmp_path / "none.gguf", rope_scaling="none")).config
    with pytest.raises(ConfigError, match=r"yarn\.gguf: rope_parameters\.rope_type 'yarn' is not supported"):
        GGUFSource(write_gguf(want, cfg, tmp_path / "yarn.gguf", rope_scaling="yarn")).config


def test_a_metadata_string_that_is_not_utf8_is_a_config_error(tmp_path):
    """Found by tests/test_fuzz.py: the architecture string's first byte mutated to 0x80 made gguf's reader raise
    UnicodeDecodeError out of GGUFSource; it is a ConfigError naming the key."""
    from test_fuzz import FIX
    b = bytearray(Path(f"{FIX}/dense_text-q8_0.gguf").read_bytes())
    i = b.index(b"qwen35")
    b[i] = 0x80
    f = tmp_path / "m.gguf"
    f.write_bytes(bytes(b))
    with pytest.raises(ConfigError, match="GGUF metadata key 'general.architecture' does not decode"):
        GGUFSource(f)


@pytest.mark.parametrize("key,item_bytes", [("tokenizer.ggml.token_type", 4), ("tokenizer.ggml.tokens", 8)])
def test_a_corrupt_array_count_is_refused_before_the_reader_runs_out_of_memory(tmp_path, key, item_bytes):
    """Found by tests/test_fuzz.py (the suite was killed for memory): one byte of an array's count mutated made
    gguf's reader build views past the end of the file until the process held 24 GB. The metadata is bounds-checked
    first: a ConfigError naming the key, in milliseconds."""
    import gguf
    from test_fuzz import FIX
    src = f"{FIX}/dense_text-q8_0.gguf"
    field = gguf.GGUFReader(src).fields[key]
    count_at = field.offset + 8 + len(key.encode()) + 4 + 4          # key length, key, value type, item type
    b = bytearray(Path(src).read_bytes())
    assert int.from_bytes(b[count_at:count_at + 8], "little") == len(field.data)
    b[count_at + 3] = 27                                              # the count grows by 27 * 2**24
    f = tmp_path / "m.gguf"
    f.write_bytes(bytes(b))
    with pytest.raises(ConfigError, match=rf"'{key}': an array of \d+ items where \d+ bytes remain"):
        GGUFSource(f)


def test_truncated_and_foreign_files_are_refused_by_the_metadata_check(tmp_path):
    from test_fuzz import FIX
    b = Path(f"{FIX}/dense_text-q8_0.gguf").read_bytes()
    for data, needle in ((b[:10], "shorter than the header"), (b"GGML" + b[4:], "magic b'GGML'"),
                         (b[:4] + (1).to_bytes(4, "little") + b[8:], "version 1"), (b[:4000], "remain")):
        f = tmp_path / "m.gguf"
        f.write_bytes(data)
        with pytest.raises(ConfigError, match=needle):
            GGUFSource(f)
