"""Tokenizer loading and incremental (streaming) detokenisation."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

from tokenizers import Tokenizer

from specserve.engine.errors import InvalidRequestError, ModelLoadError, PromptTooLongError

REPLACEMENT_CHAR = "\ufffd"


class TextTokenizer:
    """A ``tokenizer.json`` plus the special tokens named in ``tokenizer_config.json``."""

    def __init__(self, model_dir: str | Path) -> None:
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ModelLoadError(f"tokenizer missing: {path}")
        self._tokenizer = Tokenizer.from_file(str(path))
        config_path = Path(model_dir) / "tokenizer_config.json"
        self.config: dict = json.loads(config_path.read_text()) if config_path.is_file() else {}
        eos = self.config.get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        self.eos_token_id: int | None = self._tokenizer.token_to_id(eos) if eos else None
        self._added = frozenset(self._tokenizer.get_added_tokens_decoder())  # special and added tokens' ids
        self._byte_level = type(self._tokenizer.decoder).__name__ == "ByteLevel"

    @property
    def vocab_size(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def special_token_ids(self) -> list[int]:
        """The added and special tokens' ids: tokens that stand for themselves, not for text."""
        return sorted(self._added)

    def encode(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """The token's surface text (for logprob listings); may be a partial UTF-8 char."""
        return self.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """The token's raw bytes (OpenAI's logprob ``bytes``), which its text cannot give
        when the token holds part of a multi-byte character: a byte-level BPE's vocabulary
        string mapped back through GPT-2's byte alphabet, a byte-fallback ``<0xNN>`` as
        its byte, else (an added or special token among them) the decoded text."""
        piece = self._tokenizer.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self._added:  # kept as its content, not byte-level encoded
            return self.token_text(token_id).encode("utf-8")
        if self._byte_level:
            decoded = [_BYTE_LEVEL_DECODER.get(char) for char in piece]
            if None not in decoded:
                return bytes(decoded)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])
        return self.token_text(token_id).encode("utf-8")

    def stream(self) -> "StreamDecoder":
        return StreamDecoder(self)


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, inverted: character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    shifted = [byte for byte in range(256) if byte not in printable]  # drawn as 256, 257, ... in order
    return {chr(byte): byte for byte in printable} | {chr(256 + i): byte for i, byte in enumerate(shifted)}


_BYTE_LEVEL_DECODER = _byte_level_alphabet()


class StreamDecoder:
    """Turns a growing token list into text deltas that are always whole characters.

    Byte-level BPE splits multi-byte characters across tokens; decoding a prefix then
    ends in U+FFFD. We decode a small window ``[prefix, read)`` vs ``[prefix, end)`` and
    only emit once the new text no longer ends in a replacement character (the
    approach of HF TGI / vLLM's detokenizer), so the concatenated deltas equal the full
    decode and no delta carries half a character.
    """

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._prefix = 0
        self._read = 0

    def push(self, token_id: int) -> str:
        self._ids.append(token_id)
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        full_text = self._tokenizer.decode(self._ids[self._prefix :])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            self._prefix, self._read = self._read, len(self._ids)
            return full_text[len(prefix_text) :]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (only non-empty if the model ended mid-character)."""
        prefix_text = self._tokenizer.decode(self._ids[self._prefix : self._read])
        full_text = self._tokenizer.decode(self._ids[self._prefix :])
        self._prefix = self._read = len(self._ids)
        return full_text[len(prefix_text) :]


def encode_prompt(tokenizer: "TextTokenizer", prompt: str | Sequence[int], vocab_size: int,
                  max_context: int) -> list[int]:
    """Prompt text or ids -> ids, refused with a typed error when empty, out of the
    model's vocabulary, or too long to leave room for one new token."""
    ids = tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
    if not ids:
        raise InvalidRequestError("prompt is empty: at least one token is needed")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(f"prompt token ids out of range [0, {vocab_size}): {bad[:5]}")
    if len(ids) >= max_context:
        raise PromptTooLongError(f"prompt has {len(ids)} tokens; the context limit is {max_context}, "
                                 "which leaves no room for a new token")
    return ids
