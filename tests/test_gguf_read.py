"""memra_pp's own GGUF reader (model/gguf_check.GGUFFile) against gguf-py's GGUFReader, which it replaced: the same
metadata values (types included) and the same tensor views, on llama.cpp's fixtures and on a file holding every
value type; one read per file per process; and the loading paths that disagreed about what a GGUF is (a name not
ending in lower-case .gguf, format gguf beside a safetensors checkpoint, format dummy on a GGUF file), and a
safetensors checkpoint whose config undercounts its layers."""
import json
import os
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest

from memra_pp.errors import ConfigError
from memra_pp.model import gguf_check
from memra_pp.model.gguf_check import GGUFFile, open_gguf
from memra_pp.model.gguf_source import GGUFSource
from memra_pp.model.tokenizer import Tokenizer
from memra_pp.model.weights import DummySource, SafetensorsSource, gguf_file_of, open_weights
from test_gguf import _fixtures

V = gguf.GGUFValueType
Q = gguf.GGMLQuantizationType


def _same_as_gguf_py(path: Path) -> GGUFFile:
    ours, theirs = GGUFFile(path), gguf.GGUFReader(str(path))
    # gguf-py adds three pseudo keys (GGUF.version, GGUF.tensor_count, GGUF.kv_count) no reader here asks for
    assert list(ours.fields) == [k for k in theirs.fields if not k.startswith("GGUF.")]
    for k, f in ours.fields.items():
        a, b = f.contents(), theirs.fields[k].contents()
        assert a == b and type(a) is type(b), k
        if isinstance(a, list):
            assert [type(x) for x in a] == [type(x) for x in b], k
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for x, y in zip(ours.tensors, theirs.tensors):
        assert (x.tensor_type, x.shape.tolist(), x.data.dtype, x.data.shape) == \
            (y.tensor_type, y.shape.tolist(), y.data.dtype, y.data.shape), x.name
        assert np.array_equal(x.data.view(np.uint8), y.data.view(np.uint8)), x.name
        assert not x.data.flags.writeable, x.name      # a view of the read-only mapping, never a copy
    return ours


@pytest.mark.parametrize("name", ["dense_text-s404/dense_text-f32.gguf", "dense_text-s404/dense_text-q8_0.gguf",
                                  "moe_text-s414/moe_text-f32.gguf", "moe_text-s414/moe_text-q8_0.gguf"])
def test_llama_cpp_fixtures_read_as_gguf_py_reads_them(name):
    f = _same_as_gguf_py(_fixtures() / name)
    assert len(f.fields["tokenizer.ggml.tokens"].contents()) > 0 and len(f.tensors) > 70


def test_every_value_type_and_tensor_type_reads_as_gguf_py_reads_it(tmp_path):
    p = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(p), "qwen35")
    scalars = [(V.UINT8, 250), (V.INT8, -100), (V.UINT16, 65000), (V.INT16, -30000), (V.UINT32, 4_000_000_000),
               (V.INT32, -2_000_000_000), (V.FLOAT32, 0.1), (V.BOOL, True), (V.UINT64, 2 ** 63 + 5),
               (V.INT64, -2 ** 62), (V.FLOAT64, 1 / 3)]
    for vt, v in scalars:
        w.add_key_value(f"s.{vt.name}", v, vt)
        w.add_key_value(f"a.{vt.name}", [v, v], V.ARRAY, sub_type=vt)
    w.add_key_value("s.string", "grüße, 你好 \U0001f600", V.STRING)
    w.add_key_value("a.string", ["", "a b", "Ġthe", "\u0120\u010a", "你好"], V.ARRAY, sub_type=V.STRING)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    w.add_tensor("f32", x)
    w.add_tensor("f16", x.astype(np.float16))
    w.add_tensor("i32", np.arange(12, dtype=np.int32).reshape(3, 4))
    w.add_tensor("vec", x[0])
    for qt in (Q.BF16, Q.Q8_0, Q.Q4_0):
        q = gguf.quants.quantize(rng.standard_normal((2, 256)).astype(np.float32), qt)
        w.add_tensor(qt.name.lower(), q, raw_dtype=qt)
    for qt in (Q.Q4_K, Q.Q6_K):         # (gguf-py cannot quantize these: their blocks' bytes, as a file holds them)
        q = rng.integers(0, 256, gguf.quant_shape_to_byte_shape((2, 256), qt), dtype=np.uint8)
        w.add_tensor(qt.name.lower(), q, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    f = _same_as_gguf_py(p)
    assert f.fields["s.FLOAT32"].contents() == float(np.float32(0.1))
    assert f.fields["a.string"].contents()[4] == "你好"
    assert {t.tensor_type for t in f.tensors} >= {Q.F32, Q.F16, Q.I32, Q.BF16, Q.Q8_0, Q.Q4_K, Q.Q6_K}


def test_a_string_that_is_not_utf8_is_refused_when_read(tmp_path):
    src = _fixtures() / "dense_text-s404" / "dense_text-f32.gguf"
    b = bytearray(src.read_bytes())
    i = b.index(b"qwen35", b.index(b"general.architecture"))
    b[i] = 0xff
    p = tmp_path / "bad.gguf"
    p.write_bytes(bytes(b))
    with pytest.raises(ConfigError, match=r"bad\.gguf: GGUF metadata key 'general.architecture' does not decode "
                                          r"\(UnicodeDecodeError"):
        GGUFSource(p)


def test_a_process_reads_a_file_once_until_it_changes(tmp_path, monkeypatch):
    p = tmp_path / "m.gguf"
    shutil.copy(_fixtures() / "dense_text-s404" / "dense_text-q8_0.gguf", p)
    reads = []
    real = gguf_check.GGUFFile.__init__
    monkeypatch.setattr(gguf_check.GGUFFile, "__init__", lambda self, path: (reads.append(path), real(self, path))[1])
    a = open_gguf(p)
    # the driver's three reads (the config, the tokenizer, the config again for load_adapter) are one
    assert open_weights(p).config.text.num_hidden_layers == 6 and Tokenizer.for_model(p) is not None
    assert open_gguf(p) is a and len(reads) == 1
    shutil.copy(_fixtures() / "dense_text-s404" / "dense_text-f32.gguf", p)     # another file at the same path
    os.utime(p, ns=(1, 1))
    b = open_gguf(p)
    assert b is not a and len(reads) == 2
    assert [t.tensor_type for t in b.tensors] != [t.tensor_type for t in a.tensors]


def test_a_gguf_is_known_by_its_magic_not_its_name(tmp_path):
    src = _fixtures() / "dense_text-s404" / "dense_text-q8_0.gguf"
    for name in ("Qwen3.5-tiny-Q8_0.GGUF", "qwen35-tiny-q8_0"):
        p = tmp_path / name
        shutil.copy(src, p)
        assert isinstance(open_weights(p, "auto"), GGUFSource), name
        assert Tokenizer.for_model(p) is not None, name
        with pytest.raises(ConfigError, match="is a GGUF file but model.format is safetensors"):
            open_weights(p, "safetensors")
    d = tmp_path / "upper"
    d.mkdir()
    shutil.copy(src, d / "M.GGUF")
    assert isinstance(open_weights(d, "auto"), GGUFSource) and gguf_file_of(d) == d / "M.GGUF"
    notgguf = tmp_path / "weights.bin"
    notgguf.write_bytes(b"\0" * 64)
    with pytest.raises(ConfigError, match="is a file, not a checkpoint"):
        open_weights(notgguf, "auto")


def test_format_gguf_beside_a_safetensors_checkpoint_takes_the_gguf_tokenizer(tmp_path):
    """The weights come from the folder's one GGUF; so does the text, when the folder has no tokenizer.json."""
    fx = _fixtures() / "dense_text-s404"
    d = tmp_path / "both"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(fx / "hf" / f, d)
    shutil.copy(fx / "dense_text-q8_0.gguf", d)
    assert not (d / "tokenizer.json").exists()
    assert isinstance(open_weights(d, "gguf"), GGUFSource) and isinstance(open_weights(d, "auto"), SafetensorsSource)
    tok = Tokenizer.for_model(d, "gguf")
    assert tok is not None and tok.encode("hello world") == Tokenizer.from_gguf(fx / "dense_text-q8_0.gguf").encode(
        "hello world")
    assert Tokenizer.for_model(d, "auto") is None and Tokenizer.for_model(d, "safetensors") is None


def test_format_dummy_on_a_gguf_takes_the_files_dimensions(tmp_path):
    """Not the config.json of the folder it sits in (here the MoE model's, beside the dense GGUF)."""
    d = tmp_path / "mixed"
    d.mkdir()
    shutil.copy(_fixtures() / "moe_text-s414" / "hf" / "config.json", d)
    shutil.copy(_fixtures() / "dense_text-s404" / "dense_text-f32.gguf", d / "dense.gguf")
    src = open_weights(d / "dense.gguf", "dummy")
    assert isinstance(src, DummySource)
    assert src.config == GGUFSource(d / "dense.gguf").config and not src.config.text.num_experts
    assert open_weights(d, "dummy").config.text.num_experts        # the folder: its config.json, as before


def test_safetensors_with_more_layers_than_the_config_is_refused(tmp_path):
    fx = _fixtures() / "dense_text-s404" / "hf"
    d = tmp_path / "undercounted"
    shutil.copytree(fx, d)
    cfg = json.loads((d / "config.json").read_text())
    text = cfg.get("text_config", cfg)
    n = text["num_hidden_layers"]
    text["num_hidden_layers"], text["layer_types"] = n - 1, text["layer_types"][:n - 1]
    (d / "config.json").write_text(json.dumps(cfg))
    want = (rf"undercounted: tensor 'model\.(language_model\.)?layers\.{n - 1}\.[a-z_.]+' is past the last layer: "
            rf"config.json's num_hidden_layers is {n - 1}")
    with pytest.raises(ConfigError, match=want):
        open_weights(d)
    assert SafetensorsSource(fx).config.text.num_hidden_layers == n
