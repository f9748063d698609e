"""Offline text as training positions: the target teacher-forced over documents it did not
write, each chunk framed as an assistant's reply, so a head learns the target's own
next-token distribution there as it does over the target's answers (EAGLE-1 trained on
fixed text and reported regenerating it gained little). A position costs one batched
forward pass instead of a generated token.

    .venv/bin/python -m specserve.modelbuild.distill.texts [--bundle DIR] [--data .cache/distill] [--tokens 400000]

Two sources, both on every machine that runs specserve:

- ``readme``: the long descriptions (READMEs) of the installed Python distributions;
- ``code``: the CPython standard library's sources (``modelbuild.corpus``).

Whole sources are held out, as for the prompts: every ``HOLDOUT_EVERY``-th distribution by
name and the corpus's held-out files, so an evaluation never reads a document a head
trained on. Each document is cut into chunks of ``CHUNK_TOKENS`` tokens; a chunk becomes
one record of ``responses.jsonl``'s form (``prompt_ids``: the chat template's turns up to
the assistant's, ``response_ids``: the chunk), written to
``texts.jsonl``: ``--tokens`` chunk tokens for training and ``--heldout-tokens`` held
out, half of each kind.
"""
from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import random
from collections.abc import Iterator
from pathlib import Path

from specserve.engine.model.chat import ChatTemplate
from specserve.engine.model.default_model import DEFAULT_MODEL_DIR
from specserve.engine.model.tokenizer import TextTokenizer

from ..corpus import HOLDOUT_EVERY, load_corpus
from .generate import DEFAULT_OUT

CHUNK_TOKENS = 384
MIN_CHUNK_TOKENS = 48
MAX_DOCUMENT_CHARS = 60_000  # a document's first part: a long file would crowd out the others
README_ASKS = ("Tell me about the Python package {name}.", "What is {name} and how do I use it?",
               "Write the README of {name}.")
CODE_ASKS = ("Show me the source of the Python module {name}.", "Write the Python module {name}.",
             "How is {name} implemented? Show the code.")
CONTINUE_ASK = "Go on with {name}."


def readme_documents(split: str) -> Iterator[tuple[str, str]]:
    """(name, text) of the installed distributions' long descriptions in ``split``."""
    seen: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata.get("Name") or "").lower()
        text = dist.metadata.get_payload() or ""
        if name and name not in seen and len(text) >= 400:
            seen[name] = text
    for index, name in enumerate(sorted(seen)):
        if (index % HOLDOUT_EVERY == HOLDOUT_EVERY - 1) == (split == "heldout"):
            yield name, seen[name]


def code_documents(split: str) -> Iterator[tuple[str, str]]:
    corpus = load_corpus()
    for item in corpus.heldout if split == "heldout" else corpus.train:
        yield item.relpath.removesuffix(".py").replace("/", "."), item.text


def chunks(tokenizer: TextTokenizer, text: str) -> Iterator[list[int]]:
    """The document's token ids (tokenised whole, as the target would read it) in chunks
    of ``CHUNK_TOKENS``; a last chunk under ``MIN_CHUNK_TOKENS`` is dropped."""
    ids = tokenizer.encode(text[:MAX_DOCUMENT_CHARS])
    for start in range(0, len(ids), CHUNK_TOKENS):
        if len(ids) - start >= MIN_CHUNK_TOKENS:
            yield ids[start : start + CHUNK_TOKENS]


def records(template: ChatTemplate, tokenizer: TextTokenizer, kind: str, split: str, budget: int,
            seed: int = 1234) -> list[dict]:
    """Text records of one kind and split, up to ``budget`` chunk tokens, documents in a
    shuffled (seeded) order so a budget samples every part of the source."""
    documents = list(readme_documents(split) if kind == "readme" else code_documents(split))
    random.Random(seed).shuffle(documents)
    asks = README_ASKS if kind == "readme" else CODE_ASKS
    out, total = [], 0
    for name, text in documents:
        ask = asks[int(hashlib.sha256(name.encode()).hexdigest(), 16) % len(asks)]
        for part, chunk in enumerate(chunks(tokenizer, text)):
            question = (ask if part == 0 else CONTINUE_ASK).format(name=name)
            prompt = template.render([{"role": "user", "content": question}])
            key = f"text:{kind}:{name}:{part}"
            out.append({"job": key, "split": split, "source": f"{kind}:{name}", "kind": "text", "seed": None,
                        "prompt_ids": tokenizer.encode(prompt), "response_ids": chunk, "finish_reason": "text"})
            total += len(chunk)
            if total >= budget:
                return out
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--data", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--tokens", type=int, default=400_000, help="training chunk tokens, both kinds together")
    parser.add_argument("--heldout-tokens", type=int, default=40_000)
    args = parser.parse_args(argv)
    target = args.bundle / "target"
    template, tokenizer = ChatTemplate.from_model_dir(target), TextTokenizer(target)
    out = []
    for split, budget in (("train", args.tokens), ("heldout", args.heldout_tokens)):
        for kind in ("readme", "code"):
            chosen = records(template, tokenizer, kind, split, budget // 2)
            out += chosen
            print(f"{split} {kind}: {len(chosen)} chunks, {sum(len(r['response_ids']) for r in chosen)} tokens",
                  flush=True)
    args.data.mkdir(parents=True, exist_ok=True)
    (args.data / "texts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out))


if __name__ == "__main__":
    main()
