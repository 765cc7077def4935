"""Adversarial review of GGUF loading (memra_pp.model.gguf_source / gguf_check / weights.open_weights / the GGUF
tokenizer, and memra_pp.launch on CPU): malformed files and paths, other architectures, missing / extra / misshapen
tensors, every tensor type gguf-py knows (refused by name, or dequantized bit-exactly as gguf-py does), metadata of
the wrong type, a corrupt tokenizer, and a placement or metadata that disagrees with the file. Every refusal must be
a memra_pp.errors type whose message names what was wrong; no hang; a failed launch leaves no actor or segment.

Files are rewritten from llama.cpp's own tiny fixtures (fixtures/qwen35-tiny) with gguf-py's writer."""
import glob
import os
import struct
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

import memra_pp
from memra_pp.errors import ConfigError
from memra_pp.model.gguf_source import GGUFSource
from memra_pp.model.tokenizer import Tokenizer
from memra_pp.model.weights import open_weights
from test_gguf import _fixtures

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType
DROP = object()


def _dense(qtype="f32") -> Path:
    return _fixtures() / "dense_text-s404" / f"dense_text-{qtype}.gguf"


def _moe() -> Path:
    return _fixtures() / "moe_text-s414" / "moe_text-f32.gguf"


def rewrite(src, dst, kv=None, tensors=None, arch=None) -> Path:
    """A copy of GGUF `src` at `dst`: kv maps a key to DROP, a value (its old type) or (value, type[, item type]);
    tensors maps a name to DROP or (array, raw qtype or None); names not in `src` are added."""
    kv, tensors = dict(kv or {}), dict(tensors or {})
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), arch or r.fields["general.architecture"].contents())
    for k, f in r.fields.items():
        if k.startswith("GGUF.") or k == "general.architecture":
            continue
        v = kv.pop(k, f.contents())
        if v is DROP:
            continue
        if isinstance(v, tuple):
            w.add_key_value(k, v[0], v[1], v[2] if len(v) > 2 else None)
        else:
            w.add_key_value(k, v, f.types[0], f.types[-1] if f.types[0] == V.ARRAY else None)
    for k, v in kv.items():
        w.add_key_value(k, v[0], v[1], v[2] if len(v) > 2 else None)
    for t in r.tensors:
        v = tensors.pop(t.name, None)
        if v is DROP:
            continue
        if v is not None:
            w.add_tensor(t.name, v[0], raw_dtype=v[1])
        elif t.tensor_type in (Q.F32, Q.F16):
            w.add_tensor(t.name, np.array(t.data))
        else:
            w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    for n, (a, qt) in tensors.items():
        w.add_tensor(n, a, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(dst)


def patch_tensor_type(path: Path, name: str, ttype: int) -> None:
    """Overwrite tensor `name`'s type id in the tensor-info table, in place."""
    b = bytearray(path.read_bytes())
    key = struct.pack("<Q", len(name)) + name.encode()
    at = b.index(key) + len(key)
    n_dims = struct.unpack_from("<I", b, at)[0]
    struct.pack_into("<I", b, at + 4 + 8 * n_dims, ttype)
    path.write_bytes(bytes(b))


def _tensor(src: Path, name: str) -> np.ndarray:
    return np.array({t.name: t for t in gguf.GGUFReader(str(src)).tensors}[name].data)


# ---- paths ----------------------------------------------------------------------------------------------------

def test_path_kinds_are_config_errors_naming_the_path(tmp_path):
    """A directory, a symlink loop, a dangling link, an empty file: each a ConfigError naming the path."""
    d = tmp_path / "adir.gguf"
    d.mkdir()
    with pytest.raises(ConfigError, match=r"adir\.gguf"):
        GGUFSource(d)
    with pytest.raises(ConfigError, match=r"adir\.gguf.*holds no \.gguf file"):
        open_weights(d, "gguf")
    loop = tmp_path / "loop.gguf"
    os.symlink(loop, loop)
    for fn in (GGUFSource, lambda p: open_weights(p, "auto"), lambda p: open_weights(p, "gguf")):
        with pytest.raises(ConfigError, match=r"loop\.gguf.*symbolic links"):
            fn(loop)
    assert Tokenizer.for_model(loop) is None
    dang = tmp_path / "dangling.gguf"
    os.symlink(tmp_path / "nowhere", dang)
    with pytest.raises(ConfigError, match=r"dangling\.gguf: GGUF file does not exist"):
        open_weights(dang, "auto")
    z = tmp_path / "zero.gguf"
    z.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"zero\.gguf: not a GGUF file \(0 bytes"):
        open_weights(z, "auto")
    with pytest.raises(ConfigError, match=r"zero\.gguf: not a GGUF file \(0 bytes"):
        Tokenizer.for_model(z)
    with pytest.raises(ConfigError, match=r"/dev/null: not a regular file"):
        open_weights("/dev/null", "gguf")


def test_unreadable_file_is_a_config_error(tmp_path, monkeypatch):
    """A file the OS refuses to open is a ConfigError naming it. Mode 000, and (root reads a mode-000 file, as CI
    does) the open made to refuse it the way the OS would, so the refusal is taken under any user."""
    import builtins
    u = tmp_path / "unread.gguf"
    u.write_bytes(_dense("q8_0").read_bytes())
    u.chmod(0)
    real, refused = builtins.open, []

    def denying(f, *a, **k):
        if os.fspath(f) == os.fspath(u):
            refused.append(f)
            raise PermissionError(13, "Permission denied", os.fspath(u))
        return real(f, *a, **k)
    monkeypatch.setattr(builtins, "open", denying)
    with pytest.raises(ConfigError, match=r"unread\.gguf.*Permission denied"):
        open_weights(u, "auto")
    assert refused, "the open the test refuses was never made: the refusal came from elsewhere"


def test_a_fifo_named_gguf_does_not_hang(tmp_path):
    """(Was a defect.) model.path naming a FIFO (or any non-regular file) blocked forever in check_gguf_metadata's
    open(); it is refused (not a regular file) at once."""
    f = tmp_path / "pipe.gguf"
    os.mkfifo(f)
    out = {}

    def go():
        try:
            open_weights(f, "auto")
            out["r"] = "opened"
        except BaseException as e:      # noqa: BLE001 (recorded, asserted below)
            out["r"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(2)
    hung = t.is_alive()
    if hung:        # release the blocked open(): a writer arrives and leaves, the reader sees 0 bytes
        os.close(os.open(f, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
    assert not hung, "open_weights on a FIFO blocked for 2 s (no writer): a launch would hang forever"
    assert isinstance(out["r"], ConfigError) and "pipe.gguf: not a regular file" in str(out["r"])


# ---- header, architecture -------------------------------------------------------------------------------------

@pytest.mark.parametrize("mutate,needle", [
    (lambda b: b"GGJT" + b[4:], r"magic b'GGJT'"),
    (lambda b: b[:4] + struct.pack("<I", 4) + b[8:], r"version 4: only GGUF 2 and 3"),
    (lambda b: b[:4] + struct.pack(">I", 3) + b[8:], r"big-endian"),
    (lambda b: b[:8] + struct.pack("<Q", 2**60) + b[16:], r"tensors cannot fit"),
    (lambda b: b[:16] + struct.pack("<Q", 2**60) + b[24:], r"metadata keys .* cannot fit"),
    (lambda b: b[:24], r"truncated or corrupt"),
    (lambda b: b[:23], r"shorter than the header"),
    (lambda b: b[:len(b) // 2], r"truncated or corrupt"),
])
def test_corrupt_headers_are_refused(tmp_path, mutate, needle):
    f = tmp_path / "m.gguf"
    f.write_bytes(mutate(_dense("q8_0").read_bytes()))
    with pytest.raises(ConfigError, match=rf"m\.gguf: .*{needle}"):
        GGUFSource(f)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3next", "qwen2vl"])
def test_another_architecture_is_refused_by_name(tmp_path, arch):
    """The same tensors and qwen35.* keys under another general.architecture: refused naming it (not read as
    qwen35 because the keys happen to be there)."""
    f = rewrite(_dense("q8_0"), tmp_path / "other.gguf", arch=arch)
    with pytest.raises(ConfigError, match=rf"other\.gguf: GGUF architecture '{arch}' is not supported"):
        GGUFSource(f)
    with pytest.raises(ConfigError, match="not supported"):
        open_weights(f, "auto")


def test_architecture_of_the_wrong_type_is_refused(tmp_path):
    f = rewrite(_dense("q8_0"), tmp_path / "a.gguf")
    b = bytearray(f.read_bytes())
    i = b.index(b"general.architecture") + len("general.architecture")
    struct.pack_into("<I", b, i, int(V.UINT64))     # the type says u64: 8 bytes of its string length are read
    f.write_bytes(bytes(b))
    with pytest.raises(ConfigError, match=r"a\.gguf"):
        GGUFSource(f)


# ---- metadata --------------------------------------------------------------------------------------------------

K = "qwen35."
METADATA = {
    "heads-string": ({K + "attention.head_count": ("4", V.STRING)}, r"'qwen35\.attention\.head_count' must be an int"),
    "heads-float": ({K + "attention.head_count": (4.0, V.FLOAT32)}, r"'qwen35\.attention\.head_count' must be an int"),
    "heads-zero": ({K + "attention.head_count": 0}, r"'qwen35\.attention\.head_count' must be an integer >= 1"),
    "heads-not-multiple": ({K + "attention.head_count": 3}, r"num_attention_heads \(3\) must be a multiple"),
    "kv-heads-array": ({K + "attention.head_count_kv": ([2] * 6, V.ARRAY, V.UINT32)}, r"head_count_kv' must be an"),
    "blocks-missing": ({K + "block_count": DROP}, r"'qwen35\.block_count' is missing"),
    "blocks-bool": ({K + "block_count": (True, V.BOOL)}, r"'qwen35\.block_count' must be an integer"),
    "blocks-too-few": ({K + "block_count": 4}, r"tensor 'blk\.4\..*' is past the last block"),
    "blocks-too-many": ({K + "block_count": 7}, r"block 6 has neither"),
    "nextn-all-layers": ({K + "nextn_predict_layers": (6, V.UINT32)}, r"num_hidden_layers must be a positive"),
    "sections-missing": ({K + "rope.dimension_sections": DROP}, r"'qwen35\.rope\.dimension_sections' is missing"),
    "sections-string": ({K + "rope.dimension_sections": ("2,1,1", V.STRING)}, r"dimension_sections' must be an"),
    "sections-float": ({K + "rope.dimension_sections": ([2.0, 1.0, 1.0, 0.0], V.ARRAY, V.FLOAT32)},
                       r"dimension_sections' must be an array of integers"),
    "sections-negative": ({K + "rope.dimension_sections": ([-2, 6, 4, 0], V.ARRAY, V.INT32)}, r"mrope_section"),
    "sections-too-wide": ({K + "rope.dimension_sections": ([100, 100, 100, 0], V.ARRAY, V.INT32)},
                          r"partial_rotary_factor must be in"),
    "sections-zero": ({K + "rope.dimension_sections": ([0, 0, 0, 0], V.ARRAY, V.INT32)}, r"partial_rotary_factor"),
    "theta-string": ({K + "rope.freq_base": ("1e7", V.STRING)}, r"'qwen35\.rope\.freq_base' must be a number"),
    "theta-nan": ({K + "rope.freq_base": float("nan")}, r"rope_theta must be a finite positive"),
    "theta-negative": ({K + "rope.freq_base": -1.0}, r"rope_theta must be a finite positive"),
    "eps-missing": ({K + "attention.layer_norm_rms_epsilon": DROP}, r"layer_norm_rms_epsilon' is missing"),
    "eps-inf": ({K + "attention.layer_norm_rms_epsilon": float("inf")}, r"rms_norm_eps must be a finite"),
    "scaling-yarn": ({K + "rope.scaling.type": ("yarn", V.STRING)}, r"rope_type 'yarn' is not supported"),
    "scaling-int": ({K + "rope.scaling.type": (2, V.UINT32)}, r"rope_type '2' is not supported"),
    "eos-string": ({"tokenizer.ggml.eos_token_id": ("2", V.STRING)}, r"eos_token_id '2' must be a token id"),
    "eos-out-of-vocab": ({"tokenizer.ggml.eos_token_id": 10**6}, r"eos_token_id 1000000 must be a token id"),
    "eos-negative": ({"tokenizer.ggml.eos_token_id": (-1, V.INT32)}, r"eos_token_id -1 must be a token id"),
    "inner-not-multiple": ({K + "ssm.inner_size": 63}, r"'qwen35\.ssm\.inner_size' \(63\) must be a multiple"),
    "groups-not-dividing": ({K + "ssm.group_count": 3}, r"linear_num_value_heads \(4\) must be a multiple"),
    "context-zero": ({K + "context_length": 0}, r"'qwen35\.context_length' must be an integer >= 1"),
    "alignment-not-power-of-two": ({"general.alignment": (48, V.UINT32)}, r"'general\.alignment' must be a uint32"),
}


def test_generation_ends_on_every_token_llama_cpp_ends_it_on(tmp_path):
    """A GGUF's end-of-generation tokens as llama.cpp takes them: the eos id first, the eot / eom / fill-in-the-middle
    ids its metadata names, and tokens whose text ends a turn (<|endoftext|>, <|im_end|>, ...). The fixture's eos
    is <|im_end|> (2); stopping on it alone let a model that writes <|endoftext|> (0) go on past it, where the
    same model's safetensors directory (generation_config.json's list) and llama.cpp stop."""
    assert GGUFSource(_dense()).config.eos_token_ids == (2, 0)
    f = rewrite(_dense(), tmp_path / "eot.gguf", kv={"tokenizer.ggml.eot_token_id": (7, V.UINT32),
                                                    "tokenizer.ggml.eos_token_id": (0, V.UINT32)})
    assert GGUFSource(f).config.eos_token_ids == (0, 7, 2)
    f = rewrite(_dense(), tmp_path / "bad.gguf", kv={"tokenizer.ggml.eom_token_id": (10**6, V.UINT32)})
    with pytest.raises(ConfigError, match=r"bad\.gguf: tokenizer\.ggml\.eom_token_id 1000000 must be a token id"):
        GGUFSource(f)
    f = rewrite(_dense(), tmp_path / "none.gguf", kv={"tokenizer.ggml.eos_token_id": DROP,
                                                     "tokenizer.ggml.tokens": DROP})
    assert GGUFSource(f).config.eos_token_ids == ()


@pytest.mark.parametrize("case", list(METADATA))
def test_bad_metadata_is_refused_at_open(tmp_path, case):
    kv, msg = METADATA[case]
    f = rewrite(_dense("q8_0"), tmp_path / "meta.gguf", kv=kv)
    with pytest.raises(ConfigError, match=rf"meta\.gguf: .*{msg}"):
        GGUFSource(f)


@pytest.mark.parametrize("key,value,tensor,canon", [
    ("embedding_length", 96, "token_embd.weight", "embed_tokens.weight"),
    ("embedding_length", 2**31, "blk.0.attn_qkv.weight", "layers.0.linear_attn.in_proj_qkv.weight"),
    ("feed_forward_length", 96, "blk.0.ffn_up.weight", "layers.0.mlp.up_proj.weight"),
    ("attention.key_length", 2**31, "blk.3.attn_q.weight", "layers.3.self_attn.q_proj.weight"),
    ("ssm.conv_kernel", 2**20, "blk.0.ssm_conv1d.weight", "layers.0.linear_attn.conv1d.weight"),
    ("ssm.state_size", 8, "blk.0.attn_qkv.weight", "layers.0.linear_attn.in_proj_qkv.weight"),
])
def test_metadata_that_disagrees_with_the_tensors_is_refused_naming_the_tensor(tmp_path, key, value, tensor, canon):
    f = rewrite(_dense("q8_0"), tmp_path / "dis.gguf", kv={K + key: value})
    src = GGUFSource(f)
    with pytest.raises(ConfigError, match=rf"dis\.gguf.*'{tensor}'.*the config needs"):
        src.get(canon, torch.float32)


def test_moe_metadata_refusals(tmp_path):
    f = rewrite(_moe(), tmp_path / "moe.gguf", kv={"qwen35moe.expert_used_count": 100})
    with pytest.raises(ConfigError, match=r"moe\.gguf: num_experts_per_tok \(100\) must be at most"):
        GGUFSource(f)
    f = rewrite(_moe(), tmp_path / "moe2.gguf", kv={"qwen35moe.expert_count": 3})
    with pytest.raises(ConfigError, match=r"moe2\.gguf: tensor 'blk\.0\.ffn_gate_exps\.weight' \(half of canonical"):
        GGUFSource(f).get("layers.0.mlp.experts.gate_up_proj", torch.float32)
    f = rewrite(_moe(), tmp_path / "moe3.gguf", arch="qwen35")     # MoE tensors under the dense architecture
    with pytest.raises(ConfigError, match=r"moe3\.gguf: GGUF metadata key 'qwen35\.block_count' is missing"):
        GGUFSource(f)


# ---- tensors ---------------------------------------------------------------------------------------------------

def test_missing_and_misshapen_tensors(tmp_path):
    src = _dense("f32")
    f = rewrite(src, tmp_path / "t.gguf", tensors={
        "blk.0.ffn_up.weight": DROP,
        "blk.1.ffn_up.weight": (_tensor(src, "blk.1.ffn_up.weight")[:, :32].copy(), None),
        "blk.0.ssm_a": (-np.ones((2, 2), np.float32), None),
        "output.weight": (np.zeros((500, 64), np.float32), None)})
    s = GGUFSource(f)
    assert not s.has("layers.0.mlp.up_proj.weight")
    for canon, msg in [("layers.0.mlp.up_proj.weight", r"'blk\.0\.ffn_up\.weight' .* is missing"),
                       ("layers.1.mlp.up_proj.weight", r"'blk\.1\.ffn_up\.weight'.*\(128, 32\).*\(128, 64\)"),
                       ("layers.0.linear_attn.A_log", r"'blk\.0\.ssm_a'.*\(2, 2\).*\(4,\)"),
                       ("lm_head.weight", r"'output\.weight'.*\(500, 64\).*\(512, 64\)")]:
        with pytest.raises(ConfigError, match=rf"t\.gguf.*{msg}"):
            s.get(canon, torch.float32)
    for emb, shape in [(np.zeros(64 * 512, np.float32), r"\(32768,\)"), (np.zeros((2, 256, 64), np.float32),
                                                                          r"\(2, 256, 64\)")]:
        f = rewrite(src, tmp_path / "e.gguf", tensors={"token_embd.weight": (emb, None)})
        with pytest.raises(ConfigError, match=rf"e\.gguf: tensor 'token_embd\.weight' has shape {shape}"):
            GGUFSource(f)


def test_extra_blocks_past_block_count_are_refused(tmp_path):
    src = _dense("f32")
    f = rewrite(src, tmp_path / "x.gguf", tensors={"blk.9.ffn_up.weight": (_tensor(src, "blk.0.ffn_up.weight"),
                                                                          None)})
    with pytest.raises(ConfigError, match=r"x\.gguf: tensor 'blk\.9\.ffn_up\.weight' is past the last block"):
        GGUFSource(f)


def test_nan_ssm_a_is_refused(tmp_path):
    """(Was a defect.) ssm_a (= -exp(A_log)) was refused as corrupt only for entries >= 0; NaN passed that check
    (NaN >= 0 is False), so a corrupt ssm_a loaded as A_log = NaN instead of the refusal the check exists for."""
    f = rewrite(_dense("f32"), tmp_path / "a.gguf", tensors={"blk.0.ssm_a": (np.array([-1, np.nan, -2, -3],
                                                                                      np.float32), None)})
    with pytest.raises(ConfigError, match=r"a\.gguf: tensor for 'layers\.0\.linear_attn\.A_log'.*non-negative or NaN"):
        got = GGUFSource(f).get("layers.0.linear_attn.A_log", torch.float32)
        pytest.fail(f"loaded A_log {got.tolist()}")


# ---- tensor types ----------------------------------------------------------------------------------------------

UNSUPPORTED = [Q.Q8_1, Q.Q8_K, Q.Q1_0] if hasattr(Q, "Q1_0") else [Q.Q8_1, Q.Q8_K]


@pytest.mark.parametrize("qt", [Q.I8, Q.I16, Q.I32, Q.I64, Q.F64], ids=lambda q: q.name)
def test_integer_and_f64_tensors_are_refused_naming_tensor_and_type(tmp_path, qt):
    src = _dense("f32")
    a = _tensor(src, "blk.0.ffn_up.weight").astype({Q.I8: np.int8, Q.I16: np.int16, Q.I32: np.int32,
                                                    Q.I64: np.int64, Q.F64: np.float64}[qt])
    f = rewrite(src, tmp_path / "i.gguf", tensors={"blk.0.ffn_up.weight": (a, None)})
    assert {t.name: t for t in gguf.GGUFReader(str(f)).tensors}["blk.0.ffn_up.weight"].tensor_type == qt
    s = GGUFSource(f)
    with pytest.raises(ConfigError, match=rf"i\.gguf: tensor 'blk\.0\.ffn_up\.weight' has type {qt.name}"):
        s.get("layers.0.mlp.up_proj.weight", torch.float32)


@pytest.mark.parametrize("ttype,needle", [(4, "unknown type 4"), (31, "unknown type 31"), (99, "unknown type 99"),
                                          (int(Q.Q4_K), "Q4_K, whose blocks hold 256 values, but its rows hold 64")])
def test_unknown_or_misfit_type_ids_are_refused_at_open(tmp_path, ttype, needle):
    """A removed (Q4_2 = 4, Q4_0_4_4 = 31) or unknown type id, or a block type whose blocks do not fit the rows."""
    f = rewrite(_dense("q8_0"), tmp_path / "u.gguf")
    patch_tensor_type(f, "blk.0.ffn_up.weight", ttype)
    with pytest.raises(ConfigError, match=rf"u\.gguf: .*tensor 'blk\.0\.ffn_up\.weight'.*{needle}"):
        GGUFSource(f)


@pytest.fixture(scope="module")
def wide_model():
    """A tiny dense model whose ffn_down rows hold 256 values (every block size divides them)."""
    from gguf_writer import canonical_state_dict
    from memra_pp.model.config import parse_config
    from tiny_hf import build
    m = build("dense", seed=3, intermediate_size=256, num_hidden_layers=4,
              layer_types=["linear_attention"] * 3 + ["full_attention"])
    cfg = parse_config(m.config.to_dict(), "wide")
    return cfg, canonical_state_dict(m.state_dict(), cfg.tied)


def _raw_of(qt, a: np.ndarray) -> np.ndarray:
    """`a` in type qt: quantized by gguf-py where it can, else random bytes with finite block scales: bit 14 of
    every 16-bit word cleared, so each float16 field (a block's scales lie at even offsets; IQ1_M packs its scale's
    top bits into bits 12-15 of its words) is below 2, and no dequantized value is NaN or inf (the loader refuses
    those: weights.check_finite)."""
    try:
        return gguf.quants.quantize(a, qt)
    except NotImplementedError:
        block, size = gguf.GGML_QUANT_SIZES[qt]
        raw = np.random.default_rng(int(qt)).integers(0, 256, (a.shape[0], a.shape[1] // block * size), np.uint8)
        raw.view(np.uint16)[...] &= np.uint16(0xBFFF)
        return raw


SUPPORTED = [Q.F16, Q.BF16] + sorted((q for q in gguf.quants._type_traits if q != Q.BF16), key=int)


@pytest.mark.parametrize("qt", SUPPORTED, ids=lambda q: q.name)
def test_supported_types_dequantize_bit_exactly_as_gguf_py(tmp_path, wide_model, qt):
    from gguf_writer import write_gguf
    cfg, sd = wide_model
    name, gname = "layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"
    raw = {}

    def hook(n, a):
        if n != gname:
            return a
        raw["a"] = a.astype(np.float16) if qt == Q.F16 else _raw_of(qt, a)
        return raw["a"], (None if qt == Q.F16 else qt)
    f = write_gguf(sd, cfg, tmp_path / "q.gguf", "F32", tensor_hook=hook)
    t = {t.name: t for t in gguf.GGUFReader(str(f)).tensors}[gname]
    assert t.tensor_type == qt
    want = gguf.quants.dequantize(raw["a"], qt).reshape(sd[name].shape)
    with np.errstate(all="ignore"):
        got = GGUFSource(f).get(name, torch.float32).numpy()
    assert got.shape == want.shape
    assert np.array_equal(got.view(np.uint32), np.ascontiguousarray(want, np.float32).view(np.uint32)), qt.name
    if qt in (Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q5_1):        # and near the float weights where gguf-py quantized
        assert np.abs(got - sd[name].numpy()).max() < 0.2


@pytest.mark.parametrize("qt", UNSUPPORTED, ids=lambda q: q.name)
def test_unsupported_block_types_are_refused_naming_tensor_and_type(tmp_path, wide_model, qt):
    from gguf_writer import write_gguf
    cfg, sd = wide_model
    block, size = gguf.GGML_QUANT_SIZES[qt]

    def hook(n, a):
        return (np.zeros((a.shape[0], a.shape[1] // block * size), np.uint8), qt) if n == "blk.0.ffn_down.weight" \
            else a
    s = GGUFSource(write_gguf(sd, cfg, tmp_path / "q.gguf", "F32", tensor_hook=hook))
    with pytest.raises(ConfigError, match=rf"q\.gguf: tensor 'blk\.0\.ffn_down\.weight' has type {qt.name}"):
        s.get("layers.0.mlp.down_proj.weight", torch.float32)


# ---- tokenizer metadata ----------------------------------------------------------------------------------------

def _tok_field(key):
    return gguf.GGUFReader(str(_dense("q8_0"))).fields[key].contents()


TOKENIZER = {
    # (tokens-not-strings .. add-bos-not-bool were defects: the values went to `tokenizers` / str methods unchecked,
    # and escaped as TypeError / AttributeError / a bare Exception, or a plain string read as an array)
    "tokens-not-strings": ({"tokenizer.ggml.tokens": (list(range(512)), V.ARRAY, V.INT32)}, "tokenizer.ggml.tokens"),
    "token-type-scalar": ({"tokenizer.ggml.token_type": (1, V.INT32)}, "tokenizer.ggml.token_type"),
    "merges-not-strings": ({"tokenizer.ggml.merges": (list(range(10)), V.ARRAY, V.INT32)}, "tokenizer.ggml.merges"),
    "merge-out-of-vocab": ({"tokenizer.ggml.merges": (["QQQ ZZZ"], V.ARRAY, V.STRING)}, "QQQ"),
    "bos-not-int": ({"tokenizer.ggml.bos_token_id": ("0", V.STRING), "tokenizer.ggml.add_bos_token": (True, V.BOOL)},
                    "tokenizer.ggml.bos_token_id must be an integer"),
    "add-bos-not-bool": ({"tokenizer.ggml.add_bos_token": ("no", V.STRING)},
                         "tokenizer.ggml.add_bos_token must be a boolean, got str 'no'"),
    "tokens-a-string": ({"tokenizer.ggml.tokens": ("abc", V.STRING)},
                        "tokenizer.ggml.tokens must be an array of strings, got str 'abc'"),
    # these work
    "token-type-missing": ({"tokenizer.ggml.token_type": DROP}, "'tokenizer.ggml.token_type' is missing"),
    "merges-missing": ({"tokenizer.ggml.merges": DROP}, "'tokenizer.ggml.merges' is missing"),
    "merge-without-space": ({"tokenizer.ggml.merges": (["abc"], V.ARRAY, V.STRING)}, "merges[0] 'abc'"),
    "type-count-mismatch": ({"tokenizer.ggml.token_type": ([1] * 500, V.ARRAY, V.INT32)}, "500 entries for 512"),
}


@pytest.mark.parametrize("case", list(TOKENIZER))
def test_corrupt_tokenizer_metadata_is_a_config_error(tmp_path, case):
    kv, needle = TOKENIZER[case]
    f = rewrite(_dense("q8_0"), tmp_path / "tok.gguf", kv=kv)
    try:
        Tokenizer.from_gguf(f)
    except ConfigError as e:
        assert "tok.gguf" in str(e) and needle in str(e), str(e)
    except Exception as e:     # noqa: BLE001
        pytest.fail(f"untyped {type(e).__name__} from Tokenizer.from_gguf: {str(e)[:200]}")
    else:
        pytest.fail("accepted")


def test_unsupported_tokenizer_kinds_fall_back_to_token_ids(tmp_path):
    for kv in ({"tokenizer.ggml.model": ("llama", V.STRING)}, {"tokenizer.ggml.pre": ("deepseek-llm", V.STRING)},
               {"tokenizer.ggml.model": (1, V.UINT32)}):
        assert Tokenizer.from_gguf(rewrite(_dense("q8_0"), tmp_path / "t.gguf", kv=kv)) is None
    assert Tokenizer.from_gguf(_dense("q8_0")).vocab_size == 512


# ---- through launch (CPU, Ray) ---------------------------------------------------------------------------------

def _launch_refused(cfg, match, cls=ConfigError):
    import ray
    before = set(glob.glob("/dev/shm/mpp*"))
    with pytest.raises(cls, match=match):
        memra_pp.launch(cfg, detached=True)
    for i in range(len(cfg["stages"])):
        if ray.is_initialized():
            with pytest.raises(ValueError):
                ray.get_actor(f"{cfg['name']}.stage{i}")
    assert set(glob.glob("/dev/shm/mpp*")) - before == set()


def _cfg(name, path, stages=None):
    return {"name": name, "model": {"path": str(path), "format": "gguf", "dtype": "float32"},
            "stages": stages or [{"device": "cpu", "num_cpus": 0.1}] * 2}


def test_launch_refuses_metadata_that_disagrees_with_tensors_and_leaves_nothing(ray_cluster, tmp_path):
    """embedding_length 96 for 64-wide tensors: the stages' load refuses it by tensor; no actor, no segment."""
    f = rewrite(_dense("q8_0"), tmp_path / "dis.gguf", kv={K + "embedding_length": 96})
    _launch_refused(_cfg("ggufdis", f), r"dis\.gguf: GGUF tensor '.*' has shape .*the config needs")


def test_launch_refuses_a_non_finite_weight_and_leaves_nothing(ray_cluster, tmp_path):
    """A NaN in one tensor of the file: the stage that loads it refuses it by name (weights.check_finite); no
    actor, no segment left."""
    src = _dense("q8_0")
    t = next(t for t in gguf.GGUFReader(str(src)).tensors if t.name == "blk.0.ffn_down.weight")
    a = np.zeros([int(d) for d in reversed(t.shape.tolist())], np.float32)
    a[1, 2] = np.nan
    f = rewrite(src, tmp_path / "nan.gguf", tensors={"blk.0.ffn_down.weight": (a, None)})
    _launch_refused(_cfg("ggufnan", f), r"nan\.gguf: GGUF tensor 'blk\.0\.ffn_down\.weight': tensor "
                                        r"'layers\.0\.mlp\.down_proj\.weight' holds 1 non-finite value\(s\)")


def test_launch_refuses_placement_that_disagrees_with_the_gguf(ray_cluster, tmp_path):
    """Placement layers past the file's 6 blocks, more stages than blocks, a directory of two GGUFs, a shard."""
    p = _dense("q8_0")
    _launch_refused(_cfg("ggufpl1", p, [{"device": "cpu", "num_cpus": 0.1, "layers": [0, 4]},
                                        {"device": "cpu", "num_cpus": 0.1, "layers": [4, 8]}]),
                    r"stages\[1\]\.layers: \[4, 8\) is out of range: the model has 6 layers")
    _launch_refused(_cfg("ggufpl2", p, [{"device": "cpu", "num_cpus": 0.1}] * 7), r"7 stages for a model of 6")
    d = tmp_path / "two"
    d.mkdir()
    for n in ("a.gguf", "b.gguf"):
        (d / n).write_bytes(p.read_bytes())
    _launch_refused(_cfg("ggufpl3", d), r"holds 2 \.gguf files \(a\.gguf, b\.gguf\); name one file")
    shard = tmp_path / "m-00001-of-00002.gguf"
    shard.write_bytes(p.read_bytes())
    _launch_refused(_cfg("ggufpl4", shard), r"one shard of a split GGUF")


def test_launch_refuses_a_corrupt_gguf_tokenizer_with_a_config_error(ray_cluster, tmp_path):
    """(Was a defect.) launch reads the GGUF's tokenizer before Ray; a merge naming a token outside the vocabulary
    escaped as tokenizers' bare `Exception` ("Error while initializing BPE"), not a ConfigError naming the file."""
    f = rewrite(_dense("q8_0"), tmp_path / "tok.gguf", kv={"tokenizer.ggml.merges": (["QQQ ZZZ"], V.ARRAY, V.STRING)})
    _launch_refused(_cfg("gguftok", f), r"tok\.gguf: tokenizer\.ggml\.tokens / merges do not build a BPE tokenizer")
