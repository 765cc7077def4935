"""The tokenizer a GGUF file carries (`Tokenizer.from_gguf`) against the `tokenizer.json` it was converted from:
same ids, same text back, same vocabulary; unsupported or incomplete tokenizer metadata never encodes text."""
from __future__ import annotations

import logging
import shutil

import gguf
import pytest
import tokenizers

from memra_pp.errors import ConfigError
from memra_pp.model.tokenizer import Tokenizer
from test_gguf import _fixtures

CASES = [("dense_text-s404", "dense_text-f32.gguf"), ("moe_text-s414", "moe_text-q8_0.gguf")]
TEXTS = [
    "", "a", "The river runs past the old mill, and 7:45 is the time of the train.",
    "  leading and trailing spaces  ", "one\ntwo\n\nthree\n\n\n\nfour\r\nfive\r\n\r\n", "\t\ttabs\t and \u00a0nbsp",
    "    \n    indented\n        code()\n", "x" * 40 + " " * 17 + "!",
    "0 12 345 6789 3.14159 -42 1e-6 1,000,000 007", "!!! ??? ... ,;: -- () [] {} <> @#$%^&*_+=|\\/~`\"'",
    "I'm don't you're we'll they'd it's I've HE'S YOU'RE We'Ll 'quoted' rock'n'roll",
    "\u65e5\u672c\u8a9e\u306e\u6587\u7ae0\u3002\u4e2d\u6587\uff0c\u6807\u70b9\uff01 \ud55c\uad6d\uc5b4 "
    "\u0627\u0644\u0639\u0631\u0628\u064a\u0629 \u0939\u093f\u0928\u094d\u0926\u0940",
    "\U0001F600\U0001F680 \U0001F468\u200d\U0001F469\u200d\U0001F467 \U0001F44D\U0001F3FD \u2764\ufe0f",
    "Caf\u00e9 e\u0301 x\u0301y\u0327 \u00c5ngstr\u00f6m \uff21\uff22 \ufb01ne",     # NFC composes e + U+0301
    "<|im_start|>user\nDescribe <|vision_start|><|image_pad|><|image_pad|><|vision_end|> please<|im_end|>\n"
    "<|im_start|>assistant\n<think>\nhmm\n</think>\n\nA cat.<|im_end|><|endoftext|>",
    "<|im_start|><|im_start|>no space<|video_pad|>x<|box_start|>(1,2)<|box_end|> <|im_end|",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
            "<|video_pad|>", "<think>", "</think>"]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def pair(request):
    d = _fixtures() / request.param[0]
    tok = Tokenizer.from_gguf(d / request.param[1])
    assert tok is not None
    return tok, tokenizers.Tokenizer.from_file(str(d / "hf" / "tokenizer.json"))


def _gguf_path(case=CASES[0]):
    return _fixtures() / case[0] / case[1]


def _rewrite(src, dst, drop=(), **override):
    """A metadata-only copy of `src`'s tokenizer.* keys (the reader needs no tensors), with keys dropped or replaced
    (override: key with '.' as '__' -> value)."""
    r = gguf.GGUFReader(str(src))
    w = gguf.GGUFWriter(str(dst), "qwen35")
    over = {k.replace("__", "."): v for k, v in override.items()}
    for k, f in r.fields.items():
        if not k.startswith("tokenizer.") or k in drop or k in over:
            continue
        if f.types[0] == gguf.GGUFValueType.ARRAY:
            w.add_key_value(k, f.contents(), f.types[0], sub_type=f.types[-1])
        else:
            w.add_key_value(k, f.contents(), f.types[0])
    for k, v in over.items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_array(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_encodes_like_tokenizer_json(pair):
    """Every text must encode to exactly the ids tokenizer.json gives, special-token text as its one id, split into
    the same pieces first (the tiny vocabulary's few merges would hide a wrong split regex in the ids)."""
    tok, hf = pair
    for text in TEXTS:
        norm = hf.normalizer.normalize_str(text)
        assert tok._tok.pre_tokenizer.pre_tokenize_str(norm) == hf.pre_tokenizer.pre_tokenize_str(norm), text
        assert tok.encode(text) == hf.encode(text, add_special_tokens=False).ids, text
        assert tok.encode(text, add_special_tokens=True) == hf.encode(text).ids, text


def test_decodes_like_tokenizer_json(pair):
    """Decoding must give tokenizer.json's text for the texts' ids and for every single id, with and without
    special tokens skipped (the client's r.text skips them; <think> is user-defined, so kept)."""
    tok, hf = pair
    for text in TEXTS:
        ids = hf.encode(text, add_special_tokens=False).ids
        for skip in (False, True):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip), text
        assert tok.decode(ids) == hf.normalizer.normalize_str(text), text   # a lossless round trip (after NFC)
    for i in range(hf.get_vocab_size(with_added_tokens=True)):
        assert tok.decode([i]) == hf.decode([i], skip_special_tokens=False), i
    assert "<think>x" in tok.decode(tok.encode("<|im_start|><think>x"), skip_special_tokens=True)


def test_vocabulary_and_special_ids(pair):
    """The vocabulary (every token at its id) and the special-token ids must be tokenizer.json's."""
    tok, hf = pair
    assert tok.vocab_size == hf.get_vocab_size(with_added_tokens=True) == 512
    assert tok._tok.get_vocab(with_added_tokens=True) == hf.get_vocab(with_added_tokens=True)
    assert {n: tok.token_id(n) for n in SPECIALS} == {n: hf.token_to_id(n) for n in SPECIALS}
    assert all(tok.encode(n) == [hf.token_to_id(n)] for n in SPECIALS)
    assert tok.token_id("<|no_such_token|>") is None


def test_streaming_decoder_matches_decode(pair):
    """The incremental decoder over a GGUF tokenizer must end with the full decode, piece by piece."""
    tok, _ = pair
    ids = tok.encode(TEXTS[12] + TEXTS[11])
    dec = tok.incremental_decoder()
    pieces = [dec.push(i) for i in ids] + [dec.flush()]
    assert "".join(pieces) == tok.decode(ids) and "\ufffd" not in "".join(pieces)


@pytest.mark.parametrize("key,value", [("tokenizer.ggml.pre", "llama-bpe"), ("tokenizer.ggml.model", "llama"),
                                       ("tokenizer.ggml.model", "bert")])
def test_unsupported_tokenizer_is_refused(tmp_path, caplog, key, value):
    """An unknown pre-tokenizer or tokenizer model must give no tokenizer (text refused, ids still served), with
    a warning naming the file and the value, never a guessed encoding."""
    f = _rewrite(_gguf_path(), tmp_path / "t.gguf", **{key.replace(".", "__"): value})
    with caplog.at_level(logging.WARNING, logger="memra_pp.model.tokenizer"):
        assert Tokenizer.from_gguf(f) is None
        assert Tokenizer.for_model(f) is None
    assert str(f) in caplog.text and repr(value) in caplog.text


def test_qwen2_pre_uses_qwen2_split(tmp_path):
    """`qwen2` must split as Qwen2's regex: a combining mark without a precomposed form leaves its letter, which
    qwen35 keeps with it."""
    q2 = Tokenizer.from_gguf(_rewrite(_gguf_path(), tmp_path / "q2.gguf", tokenizer__ggml__pre="qwen2"))
    q35 = Tokenizer.from_gguf(_gguf_path())
    split = [[p for p, _ in t._tok.pre_tokenizer.pre_tokenize_str("x\u0301y ab")] for t in (q2, q35)]
    assert split[0] != split[1] and len(split[0]) > len(split[1])
    assert q2.decode(q2.encode("x\u0301y ab")) == "x\u0301y ab"


def test_no_tokens_is_none_and_incomplete_metadata_refused(tmp_path):
    """A GGUF without tokenizer.ggml.tokens must give None; one whose merges are missing or malformed, or whose
    token types do not match the tokens, must be a ConfigError naming the key (its text would encode wrong)."""
    assert Tokenizer.from_gguf(_rewrite(_gguf_path(), tmp_path / "a.gguf", drop=("tokenizer.ggml.tokens",))) is None
    with pytest.raises(ConfigError, match="tokenizer.ggml.merges"):
        Tokenizer.from_gguf(_rewrite(_gguf_path(), tmp_path / "b.gguf", drop=("tokenizer.ggml.merges",)))
    with pytest.raises(ConfigError, match=r"tokenizer.ggml.merges\[1\] 'ab'"):
        Tokenizer.from_gguf(_rewrite(_gguf_path(), tmp_path / "m.gguf", tokenizer__ggml__merges=["e r", "ab"]))
    with pytest.raises(ConfigError, match="tokenizer.ggml.token_type"):
        Tokenizer.from_gguf(_rewrite(_gguf_path(), tmp_path / "c.gguf", tokenizer__ggml__token_type=[1, 1, 3]))
    with pytest.raises(ConfigError, match="does not exist"):
        Tokenizer.from_gguf(tmp_path / "missing.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"GGUF" + b"\0" * 40)
    with pytest.raises(ConfigError, match="junk.gguf"):
        Tokenizer.from_gguf(tmp_path / "junk.gguf")


def test_add_bos_token_prepends_bos(tmp_path):
    """With add_bos_token and a bos id, encoding with special tokens must start with that id (and only then)."""
    f = _rewrite(_gguf_path(), tmp_path / "bos.gguf", tokenizer__ggml__add_bos_token=True,
                 tokenizer__ggml__bos_token_id=1)
    tok = Tokenizer.from_gguf(f)
    assert tok.encode("hi", add_special_tokens=True) == [1] + tok.encode("hi")
    # and a text prompt is encoded so, as llama.cpp and vLLM do (the client encoded without: no BOS)
    import types
    from memra_pp.client import Client
    assert Client._encode(types.SimpleNamespace(dep=types.SimpleNamespace(tokenizer=tok)), "hi") == \
        [1] + tok.encode("hi")
    plain = Tokenizer.from_gguf(_gguf_path())      # (add_bos_token false, as Qwen3.5's GGUFs: nothing added)
    assert Client._encode(types.SimpleNamespace(dep=types.SimpleNamespace(tokenizer=plain)), "hi") == \
        plain.encode("hi")


def test_for_model_picks_the_source(tmp_path):
    """for_model must read a directory's tokenizer.json, a .gguf file's metadata, the one .gguf of a directory
    without tokenizer.json or safetensors, and give None for anything else."""
    d = _fixtures() / CASES[0][0]
    assert Tokenizer.for_model(d / "hf").source.endswith("tokenizer.json")
    assert Tokenizer.for_model(_gguf_path()).source == str(_gguf_path())
    lone = tmp_path / "lone"
    lone.mkdir()
    shutil.copy(_gguf_path(), lone / "m.gguf")
    assert Tokenizer.for_model(lone).source == str(lone / "m.gguf")
    (lone / "model.safetensors").write_bytes(b"")
    assert Tokenizer.for_model(lone) is None
    assert Tokenizer.for_model(d / "build.json") is None
    assert Tokenizer.for_model(tmp_path / "nowhere") is None
