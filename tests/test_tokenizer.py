"""Tokenizer: round trips, special tokens, and the streaming decoder on the tiny and the fixture tokenizers."""
from __future__ import annotations

from pathlib import Path

import pytest

from memra_pp.errors import ConfigError
from memra_pp.model.tiny import make_tiny
from memra_pp.model.tokenizer import REPLACEMENT, Tokenizer

# shared/ sits beside the checkout here and inside it on the device machines.
_ROOTS = [Path(__file__).resolve().parents[n] / "shared" / "fixtures" / "qwen35-tiny" for n in (1, 2)]
FIXTURES = next((r for r in _ROOTS if r.is_dir()), _ROOTS[-1])
FIXTURE_DIRS = [FIXTURES / "dense_text-s404" / "hf", FIXTURES / "moe_text-s414" / "hf"]
ASCII = "The river runs past the old mill, and 7:45 is the time of the train.\n\tTabs  and  spaces!"
MULTIBYTE = "Caf\u00e9 na\u00efve \u00fcber \u65e5\u672c\u8a9e \u0394x=\u03c0 \U0001F600\U0001F680 \u00e9\u0301 end"


@pytest.fixture(scope="module", params=["tiny", "fixture-dense", "fixture-moe"])
def tok(request, tmp_path_factory):
    if request.param == "tiny":
        path = make_tiny(tmp_path_factory.mktemp("tok") / "m")
    else:
        path = FIXTURE_DIRS[request.param == "fixture-moe"]
        if not (path / "tokenizer.json").is_file():
            raise AssertionError(f"no fixture tokenizer at {path} (looked in {[str(r) for r in _ROOTS]}); "
                                 "the suite needs ../shared/fixtures beside the checkout")
    t = Tokenizer.from_model_dir(path)
    assert t is not None
    return t


def test_fixture_tokenizer_layout(tok):
    """Every tokenizer in use must have 512 ids with the Qwen specials at the fixtures' ids."""
    assert tok.vocab_size == 512
    names = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "<|vision_start|>": 505,
             "<|vision_end|>": 506, "<|image_pad|>": 507, "<|video_pad|>": 508}
    assert {n: tok.token_id(n) for n in names} == names
    assert tok.token_id("<|no_such_token|>") is None


@pytest.mark.parametrize("text", [ASCII, MULTIBYTE, "", " ", "\n\n"])
def test_round_trip(tok, text):
    """decode(encode(text)) must give the text back exactly, ASCII and multi-byte UTF-8 alike."""
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text


def test_special_tokens_encode_as_one_id(tok):
    """Special-token text in a prompt must map to its single id, and skip_special_tokens must drop it."""
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>")
    assert ids[0] == 1 and ids[-1] == 2 and 1 not in ids[1:-1]
    assert tok.decode(ids, skip_special_tokens=True) == "user\nhi"


@pytest.mark.parametrize("text", [ASCII, MULTIBYTE])
def test_incremental_equals_full_decode(tok, text):
    """Fed one id at a time, the streaming decoder's pieces must concatenate to the full decode, and no piece
    may hold a replacement character for valid input (a partial character is held back, not emitted)."""
    ids = tok.encode(text)
    dec = tok.incremental_decoder()
    pieces = [dec.push(i) for i in ids]
    assert all(REPLACEMENT not in p for p in pieces)
    assert dec.flush() == "" and "".join(pieces) == dec.text == tok.decode(ids) == text
    if text is MULTIBYTE:
        assert "" in pieces          # non-vacuity: some id really ended mid-character and was held back


def test_incremental_accepts_batches(tok):
    """Pushing ids in groups must give the same text as one at a time."""
    ids = tok.encode(MULTIBYTE)
    dec = tok.incremental_decoder()
    got = "".join(dec.push(ids[i:i + 3]) for i in range(0, len(ids), 3)) + dec.flush()
    assert got == MULTIBYTE and dec.push([]) == ""


def test_incremental_flush_gives_incomplete_tail(tok):
    """A stream that stops mid-character must hold the bytes back until flush(), which then gives the full
    decode's replacement character, so the stream's text still equals decode(ids)."""
    ids = tok.encode("ab\U0001F600")
    for cut in range(len(ids) - 1, 0, -1):
        if REPLACEMENT in tok.decode(ids[:cut]):
            break
    else:
        raise AssertionError("the emoji must span several ids here, or this test proves nothing")
    dec = tok.incremental_decoder()
    pieces = "".join(dec.push(i) for i in ids[:cut])
    assert REPLACEMENT not in pieces
    assert pieces + dec.flush() == tok.decode(ids[:cut]) == dec.text


def test_skip_special_in_stream(tok):
    """The streaming decoder must honour skip_special_tokens like decode does."""
    ids = tok.encode("<|im_start|>assistant\nok<|im_end|>")
    dec = tok.incremental_decoder(skip_special_tokens=True)
    assert "".join(dec.push(i) for i in ids) + dec.flush() == "assistant\nok"


def test_missing_and_broken_tokenizer(tmp_path):
    """A model dir without tokenizer.json must give None; a malformed one must be refused with a ConfigError
    naming the file."""
    assert Tokenizer.from_model_dir(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ConfigError, match="tokenizer.json"):
        Tokenizer.from_model_dir(tmp_path)


def test_transformers_reads_the_tiny_tokenizer_alike(tmp_path):
    """transformers' AutoTokenizer must load the tiny tokenizer files, encode as we do, and see the same
    eos / pad ids and chat template."""
    from transformers import AutoTokenizer
    path = make_tiny(tmp_path / "m")
    hf, ours = AutoTokenizer.from_pretrained(path), Tokenizer.from_model_dir(path)
    for text in (ASCII, MULTIBYTE, "<|im_start|>user\nhi<|im_end|>"):
        assert hf(text)["input_ids"] == ours.encode(text)
    assert (hf.eos_token_id, hf.pad_token_id) == (2, 0)
    chat = hf.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
