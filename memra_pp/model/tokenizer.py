"""Text in and out for a model directory's `tokenizer.json` (Hugging Face `tokenizers`), with a streaming decoder
that never splits a UTF-8 character. Runs in the driver process."""
from __future__ import annotations

from pathlib import Path

import tokenizers
from tokenizers.decoders import DecodeStream

from ..errors import ConfigError

REPLACEMENT = "\ufffd"


class Tokenizer:
    """A loaded `tokenizer.json`: encode, decode, special-token lookup, incremental decoding."""

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
        self.text = ""                  # everything emitted so far

    def push(self, ids: int | list[int] | tuple[int, ...]) -> str:
        """Add one id or several; returns the new text they complete ("" when held back)."""
        new = [int(i) for i in ids] if isinstance(ids, (list, tuple)) else [int(ids)]
        out = []
        for i in new:                   # one id per step: list steps need a newer tokenizers
            self.ids.append(i)
            piece = self._stream.step(self._tok._tok, i)
            if piece is not None:
                out.append(piece)
        self.text += "".join(out)
        return "".join(out)

    def flush(self) -> str:
        """The text still held back at the end of the stream (replacement characters for bytes never
        completed), so that `text` then equals the full decode."""
        full = self._tok.decode(self.ids, self._skip)
        # Byte-level decoders only ever extend their output; text already emitted cannot be taken back.
        rest = full[len(self.text):] if full.startswith(self.text) else ""
        self.text += rest
        return rest
