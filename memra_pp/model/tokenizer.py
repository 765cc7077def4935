"""Text in and out for a model directory's `tokenizer.json` or a GGUF file's `tokenizer.ggml.*` metadata (Hugging
Face `tokenizers`), with a streaming decoder that never splits a UTF-8 character. Runs in the driver process."""
from __future__ import annotations

import logging
from pathlib import Path

import tokenizers
from tokenizers import AddedToken, decoders, models, normalizers, pre_tokenizers, processors
from tokenizers.decoders import DecodeStream

from ..errors import ConfigError
from .gguf_check import gguf_named

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"

# `tokenizer.ggml.pre` -> the Split regex of the model's own tokenizer.json (the behaviour llama.cpp's
# LLAMA_VOCAB_PRE_TYPE_QWEN2 / _QWEN35 transcribe, contractions spelled '[sS]... there). qwen35 differs from qwen2
# only by keeping combining marks (\p{M}) with their letters: the wrong one would split "e\u0301" differently.
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
                r"|\s+(?!\S)|\s+")
_QWEN35_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
                 r"|\s*[\r\n]+|\s+(?!\S)|\s+")
GGUF_PRE_SPLITS = {"qwen2": _QWEN2_SPLIT, "qwen35": _QWEN35_SPLIT}
_CONTROL, _USER_DEFINED = 3, 4      # tokenizer.ggml.token_type values matched whole in text (llama.cpp's enum)
_UNUSED = 5                         # the converter's "[PAD{id}]" fillers up to the model's vocab_size: no text


class Tokenizer:
    """A loaded tokenizer (`tokenizer.json` or GGUF metadata): encode, decode, special-token lookup, incremental
    decoding."""

    def __init__(self, tok: tokenizers.Tokenizer, source: str = "<memory>"):
        self._tok = tok
        self.source = source

    @classmethod
    def from_model_dir(cls, path: str | Path) -> "Tokenizer | None":
        """The model directory's tokenizer, or None when it has no tokenizer.json (ids in, ids out)."""
        f = Path(path).expanduser() / "tokenizer.json"
        if not f.is_file():
            return None
        try:
            return cls(tokenizers.Tokenizer.from_file(str(f)), str(f))
        except Exception as e:          # tokenizers raises a bare Exception on a malformed file
            raise ConfigError(f"{f}: not a loadable tokenizer.json ({e}); remove it to run on token ids") from None

    @classmethod
    def from_gguf(cls, path: str | Path) -> "Tokenizer | None":
        """The tokenizer a llama.cpp GGUF file carries, or None when it has no `tokenizer.ggml.tokens`.

        A `tokenizer.ggml.model` other than "gpt2" or a `tokenizer.ggml.pre` without a known split regex is also
        None, with a warning: a guess would encode text to ids the model was not trained on, while token-id
        requests need no tokenizer. Incomplete tokenizer metadata is a ConfigError naming the key."""
        from .gguf_check import gguf_field, open_gguf
        f = Path(path).expanduser()
        reader = open_gguf(f)
        if "tokenizer.ggml.tokens" not in reader.fields:
            return None

        def get(key, default=KeyError):
            return gguf_field(reader, f, key, default, missing="; the file's tokenizer is incomplete")

        kind, pre = get("tokenizer.ggml.model"), get("tokenizer.ggml.pre", "default")
        if kind != "gpt2" or pre not in GGUF_PRE_SPLITS:    # a guessed split would give ids never trained on
            what = f"tokenizer.ggml.model {kind!r}" if kind != "gpt2" else f"tokenizer.ggml.pre {pre!r}"
            log.warning("%s: %s is not supported (byte-level BPE 'gpt2' with pre %s only); text prompts are refused, "
                        "token ids still work (or give the model directory's tokenizer.json)", f, what,
                        " / ".join(sorted(GGUF_PRE_SPLITS)))
            return None

        def listed(key: str, kind: type, what: str) -> list:
            v = get(key)
            if not isinstance(v, list) or not all(isinstance(x, kind) and not isinstance(x, bool) for x in v):
                raise ConfigError(f"{f}: {key} must be an array of {what}, got {_kind_of(v)}")
            return v
        tokens = listed("tokenizer.ggml.tokens", str, "strings")
        types = listed("tokenizer.ggml.token_type", int, "integers")
        if len(types) != len(tokens):
            raise ConfigError(f"{f}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
        merges = []
        for n, m in enumerate(listed("tokenizer.ggml.merges", str, "strings")):
            i = m.find(" ", 1)          # as llama.cpp splits: the first space past the first character
            if i < 0:
                raise ConfigError(f"{f}: tokenizer.ggml.merges[{n}] {m!r} is not two tokens joined by a space")
            merges.append((m[:i], m[i + 1:]))
        # Unused ids stay out of the vocabulary, as they are absent from the tokenizer.json they were padded from:
        # a sampled one decodes to "" (llama.cpp's token_to_piece too), never to the filler's name "[PAD248100]".
        vocab = {t: i for i, (t, k) in enumerate(zip(tokens, types)) if k != _UNUSED}
        try:
            tok = tokenizers.Tokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
        except Exception as e:  # noqa: BLE001 - the tokenizers library's own (a merge of tokens not in the vocabulary)
            raise ConfigError(f"{f}: tokenizer.ggml.tokens / merges do not build a BPE tokenizer ({e})") from None
        tok.normalizer = normalizers.NFC()      # as Qwen's tokenizer.json (llama.cpp itself does not normalize)
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(tokenizers.Regex(GGUF_PRE_SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
        tok.decoder = decoders.ByteLevel()
        bos, add_bos = get("tokenizer.ggml.bos_token_id", None), get("tokenizer.ggml.add_bos_token", False)
        if bos is not None and (not isinstance(bos, int) or isinstance(bos, bool)):
            raise ConfigError(f"{f}: tokenizer.ggml.bos_token_id must be an integer, got {_kind_of(bos)}")
        if not isinstance(add_bos, bool):
            raise ConfigError(f"{f}: tokenizer.ggml.add_bos_token must be a boolean, got {_kind_of(add_bos)}")
        if add_bos and bos is not None and 0 <= bos < len(tokens):
            tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A $B",
                                                               special_tokens=[(tokens[bos], bos)])
        else:
            tok.post_processor = processors.ByteLevel(trim_offsets=False)
        # Control tokens are special (skipped by skip_special_tokens); user-defined ones (<think>) are not, as in
        # tokenizer.json. Both already hold their ids in the vocabulary, so adding them keeps those ids.
        tok.add_special_tokens([AddedToken(t, normalized=False, special=True)
                                for t, k in zip(tokens, types) if k == _CONTROL])
        tok.add_tokens([AddedToken(t, normalized=False, special=False)
                        for t, k in zip(tokens, types) if k == _USER_DEFINED])
        return cls(tok, str(f))

    @classmethod
    def for_model(cls, path: str | Path, fmt: str = "auto") -> "Tokenizer | None":
        """The tokenizer for a placement's `model: {path, format}`: a directory's tokenizer.json, else the tokenizer
        of the GGUF file open_weights reads there (weights.gguf_file_of), or a GGUF file's own (by its magic bytes,
        whatever its name); None when there is none (the deployment then runs on token ids)."""
        from .weights import gguf_file_of
        p = Path(path).expanduser()
        if p.is_dir():
            t = cls.from_model_dir(p)
            if t is None and (g := gguf_file_of(p, fmt)) is not None:
                return cls.from_gguf(g)
            return t
        return cls.from_gguf(p) if p.is_file() and gguf_named(p) else None

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer can produce, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_id(self, name: str) -> int | None:
        """The id of a token by its text (e.g. "<|im_end|>"), or None when the vocabulary lacks it."""
        return self._tok.token_to_id(name)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Token ids for `text`; special-token text such as "<|im_start|>" maps to its single id."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def incremental_decoder(self, skip_special_tokens: bool = False) -> "IncrementalDecoder":
        return IncrementalDecoder(self, skip_special_tokens)


def _kind_of(v) -> str:
    """A metadata value's kind for a refusal: "str 'abc'", 'an array of int', 'an array of int / str'."""
    if isinstance(v, list):
        kinds = sorted({type(x).__name__ for x in v})
        return f"an array of {' / '.join(kinds) or 'nothing'}"
    return f"{type(v).__name__} {v!r}"[:80]


class IncrementalDecoder:
    """Turns ids arriving one by one into text pieces whose concatenation equals `decode(all ids)`.

    Text is held back while it would end in a partial UTF-8 sequence, so a piece never carries a replacement
    character that a later id would have completed; `flush()` gives whatever is held at the end of a stream.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.ids: list[int] = []
        self._pieces: list[str] = []    # everything emitted so far, joined only when read: a `text +=` per id
        #                                 would copy the whole text each time (quadratic in a long generation)

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def push(self, ids: int | list[int] | tuple[int, ...]) -> str:
        """Add one id or several; returns the new text they complete ("" when held back)."""
        new = [int(i) for i in ids] if isinstance(ids, (list, tuple)) else [int(ids)]
        out = []
        for i in new:                   # one id per step: list steps need a newer tokenizers
            self.ids.append(i)
            piece = self._stream.step(self._tok._tok, i)
            if piece is not None:
                out.append(piece)
        piece = "".join(out)
        if piece:
            self._pieces.append(piece)
        return piece

    def flush(self) -> str:
        """The text still held back at the end of the stream (replacement characters for bytes never
        completed), so that `text` then equals the full decode."""
        full, text = self._tok.decode(self.ids, self._skip), self.text
        # Byte-level decoders only ever extend their output; text already emitted cannot be taken back.
        rest = full[len(text):] if full.startswith(text) else ""
        if rest:
            self._pieces.append(rest)
        return rest
