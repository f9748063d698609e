"""A GGUF's GPT-2-style BPE vocabulary as a Hugging Face ``tokenizer.json`` (the
``tokenizers`` library builds it), and its special tokens and chat template as
``tokenizer_config.json``.

The pre-tokenizer follows llama.cpp's name for it (``tokenizer.ggml.pre``): ``smollm``
(like ``starcoder`` and ``refact``) splits every digit on its own before GPT-2's
byte-level regex, which is Hugging Face's ``Digits(individual_digits=True)`` followed by
``ByteLevel``. Control tokens (ggml token type 3) become special added tokens, so a
prompt's ``<|im_start|>`` is one token and decoding can skip them.
"""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from .checkpoint import GgufCheckpoint

CONTROL = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
_DIGIT_SPLITTING = {"smollm", "starcoder", "refact", "command-r"}
_PLAIN_GPT2 = {"gpt2", "default", None}


def build_tokenizer(checkpoint: GgufCheckpoint) -> Tokenizer:
    if checkpoint.field("tokenizer.ggml.model") != "gpt2":
        raise ValueError(f"{checkpoint.path}: only GPT-2-style BPE vocabularies convert, this one is "
                         f"'{checkpoint.field('tokenizer.ggml.model')}'")
    pre = checkpoint.field("tokenizer.ggml.pre")
    if pre not in _DIGIT_SPLITTING | _PLAIN_GPT2:
        raise ValueError(f"{checkpoint.path}: pre-tokenizer '{pre}' is not one this converter reproduces")
    tokens: list[str] = checkpoint.field("tokenizer.ggml.tokens")
    types: list[int] = checkpoint.field("tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in checkpoint.field("tokenizer.ggml.merges")]
    vocab = {token: i for i, token in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                               if pre in _DIGIT_SPLITTING else byte_level)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i, kind in enumerate(types) if kind == CONTROL])
    return tokenizer


def tokenizer_config(checkpoint: GgufCheckpoint, context: int) -> dict:
    """``tokenizer_config.json``: the special tokens by name and the chat template."""
    tokens = checkpoint.field("tokenizer.ggml.tokens")
    name = lambda key: tokens[int(checkpoint.field(key))] if checkpoint.field(key) is not None else None  # noqa: E731
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context,
              "bos_token": name("tokenizer.ggml.bos_token_id"), "eos_token": name("tokenizer.ggml.eos_token_id"),
              "unk_token": name("tokenizer.ggml.unknown_token_id"), "pad_token": name("tokenizer.ggml.padding_token_id"),
              "add_bos_token": bool(checkpoint.field("tokenizer.ggml.add_bos_token", False)),
              "clean_up_tokenization_spaces": False}
    template = checkpoint.field("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    return config


def write_tokenizer(checkpoint: GgufCheckpoint, out_dir: Path, context: int) -> None:
    build_tokenizer(checkpoint).save(str(out_dir / "tokenizer.json"))
    (out_dir / "tokenizer_config.json").write_text(json.dumps(tokenizer_config(checkpoint, context), indent=2) + "\n")
