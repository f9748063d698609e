"""The default model, converted from its GGUF without torch, against transformers' own load
of the same file (``from_pretrained(dir, gguf_file=...)``, float32): the graphs' logits,
greedy decoding on held-out chat prompts, and the tokenizer.

Needs the converted bundle (``bash scripts/install.sh`` writes it) and transformers with
``gguf`` and ``accelerate``, which only the convert venv has."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specserve.engine import Engine, EngineConfig, GenerationOptions, SpeculativeConfig
from specserve.engine.model.default_model import DEFAULT_MODEL_DIR
from specserve.engine.model.in_place import IN_PLACE_FILE, STEP_FILE
from specserve.engine.model.tokenizer import TextTokenizer
from specserve.modelbuild.default_model import cached_gguf

ROOT = Path(__file__).resolve().parents[2]
TARGET = DEFAULT_MODEL_DIR / "target"
NEW_TOKENS = 48
# |logit| differences from transformers' float32 load: the weights are the same values, the
# sums run in another order, and the residual stream reaches ~25 000, where float32 carries
# ~2e-3 of absolute rounding. Measured: 1.4e-4 (float32 graph), 1.1e-4 (step graph).
LOGIT_TOLERANCE = 2e-3

pytestmark = pytest.mark.skipif(not (TARGET / "model.onnx").is_file(),
                                reason="the default model is not converted (bash scripts/install.sh)")


@pytest.fixture(scope="module")
def transformers_model():
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(2)
    gguf = cached_gguf()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    return model.eval(), tokenizer


@pytest.fixture(scope="module")
def chat_prompts() -> list[list[int]]:
    tokenizer = TextTokenizer(TARGET)
    from specserve.engine.model.chat import ChatTemplate

    template = ChatTemplate.from_model_dir(TARGET)
    prompts = json.loads((ROOT / "tests/data/heldout_chat_prompts.json").read_text())
    return [tokenizer.encode(template.render(p["messages"])) for p in prompts]


def _ort_logits(graph: str, ids: list[int]) -> np.ndarray:
    """Logits of ``graph`` (one of the target's three) for ``ids`` in one call from an
    empty past: the standard graph directly; the in-place graph through IO binding, as the engine
    runs it, the step graph fed its single tokens after the in-place graph's prefill."""
    import onnxruntime as ort

    from specserve.engine.model.onnx_model import OnnxDecoder

    decoder = OnnxDecoder(TARGET, "cpu")
    if graph == "model.onnx":
        return decoder.forward(np.array([ids]), np.ones((1, len(ids)), np.int64), np.arange(len(ids))[None],
                               decoder.empty_past()).logits[0]
    from specserve.engine.model.in_place import InPlaceDecoder

    in_place = InPlaceDecoder(decoder, TARGET / IN_PLACE_FILE, 2, False)
    if graph == STEP_FILE:
        in_place.step_session = ort.InferenceSession(str(TARGET / STEP_FILE), providers=["CPUExecutionProvider"])
    buffer = in_place.new_buffer(len(ids) + 8)
    prefill = 4 if graph == STEP_FILE else len(ids)
    rows = [in_place.run(buffer, 0, np.array([ids[:prefill]]))[0][0]]
    rows += [in_place.run(buffer, i, np.array([[ids[i]]]))[0][0] for i in range(prefill, len(ids))]
    return np.concatenate(rows)


@pytest.mark.parametrize("graph", ["model.onnx", IN_PLACE_FILE, STEP_FILE])
def test_each_graph_computes_transformers_logits_from_the_gguf(graph, transformers_model, chat_prompts):
    import torch

    model, _ = transformers_model
    ids = chat_prompts[0]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].numpy()
    got = _ort_logits(graph, ids)
    assert np.abs(got - expected).max() < LOGIT_TOLERANCE
    assert (got.argmax(-1) == expected.argmax(-1)).all()


def test_greedy_decoding_is_transformers_greedy_on_held_out_chat_prompts(transformers_model, chat_prompts):
    """Target-only through the engine in the exact format (its step graph serving the
    single-token calls) against ``generate(do_sample=False)``: eight prompts token-identical
    for 48 tokens or up to its end of turn (``<|im_end|>`` included on both sides). The
    fast format, the default, is measured against float32 in ``bench/fidelity.py``."""
    import torch

    model, _ = transformers_model
    config = EngineConfig(device="cpu", intra_op_threads=2, target_format="exact",
                          speculative=SpeculativeConfig(load=(), adaptive=False))
    options = GenerationOptions(max_new_tokens=NEW_TOKENS, temperature=0)
    with Engine(DEFAULT_MODEL_DIR, config) as engine:
        assert engine.target.in_place is not None and engine.target.in_place.step_session is not None
        ours = [engine.generate(ids, options).token_ids for ids in chat_prompts[:8]]
    with torch.no_grad():
        theirs = [model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=2)[0, len(ids):].tolist()
                  for ids in chat_prompts[:8]]
    assert ours == theirs


TEXTS = [
    "Hello world", "The year 2024 had 365 days; 3.14159 and 1,000,000.", "def f(x):\n    return x**2  # square\n",
    "  leading spaces,\ttabs\n\nand blank lines", "Ünïcödé – “quotes” 日本語 🙂 naïve café", "don't you'll I'm we've",
    "<|im_start|>user\nWhat is 12345+678?<|im_end|>\n<|im_start|>assistant\n", "<file_sep>x<repo_name>y<|endoftext|>",
    "https://example.com/path?q=1&r=2", "αβγ ΔΘΛ —— ...!!! ???", "   ", "\n",
]


def test_the_tokenizer_is_transformers_tokenizer_of_the_gguf(transformers_model):
    _, theirs = transformers_model
    ours = TextTokenizer(TARGET)
    for text in TEXTS:
        ids = theirs.encode(text, add_special_tokens=False)
        assert ours.encode(text) == ids, text
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(ids, skip_special_tokens=False)
    assert ours.encode("<|im_start|>") == [1] and ours.eos_token_id == 2 == theirs.eos_token_id
