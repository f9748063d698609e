"""Incremental detokenisation never emits half a character and loses nothing."""
from __future__ import annotations

import pytest

from specserve.engine.errors import ModelLoadError
from specserve.engine.model.tokenizer import TextTokenizer

from .conftest import TARGET_DIR

TEXT = 'print("caf\u00e9 na\u00efve \u65e5\u672c\u8a9e \u2603 \U0001F600 \u0928\u092e\u0938\u094d\u0924\u0947")\n'


def test_stream_deltas_are_whole_characters_and_concatenate_to_the_decode():
    tokenizer = TextTokenizer(TARGET_DIR)
    ids = tokenizer.encode(TEXT)
    stream = tokenizer.stream()
    deltas = [stream.push(t) for t in ids]
    deltas.append(stream.flush())
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert all("\ufffd" not in d for d in deltas)
    # Byte-level BPE trained on Python source splits these characters across tokens, so
    # some pushes must have held text back: otherwise this test would prove nothing.
    assert "" in deltas[:-1]


def test_token_bytes_are_the_raw_bytes_even_where_a_token_splits_a_character():
    tokenizer = TextTokenizer(TARGET_DIR)
    ids = tokenizer.encode(TEXT)
    assert b"".join(tokenizer.token_bytes(t) for t in ids) == TEXT.encode("utf-8")
    split = [t for t in ids if tokenizer.token_text(t) == "\ufffd"]  # tokens holding part of a character
    assert split and all(tokenizer.token_bytes(t) != "\ufffd".encode() for t in split)
    assert tokenizer.token_bytes(tokenizer.eos_token_id) == b""  # a special token: its (skipped) text


def test_missing_tokenizer_is_a_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        TextTokenizer(tmp_path)


def test_eos_token_comes_from_tokenizer_config():
    tokenizer = TextTokenizer(TARGET_DIR)
    assert tokenizer.eos_token_id is not None
    assert tokenizer.decode([tokenizer.eos_token_id]) == ""  # special tokens are not text
