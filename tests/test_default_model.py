"""The default model, SmolLM2-135M-Instruct converted from its GGUF at install, as a user
meets it: ``Engine()`` with no argument, the chat call, every mode token-identical to
target-only with the heads trained for it (``modelbuild.distill``), in-process and
through the server, and a converted bundle without heads refusing their modes clearly.
(Its agreement with transformers' own load of the GGUF is in
``tests/convert/test_default_model.py``, which needs torch.) Prefix caching's acceptance
is here too: behind a ~750-token shared system prompt, later requests reach their first
token in at most half the first one's time, and every mode's tokens are the same with a
cold cache, a warm one and none."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from specserve.engine import Engine, GenerationOptions, InvalidRequestError
from specserve.engine.model.bundle import Bundle
from specserve.engine.model.default_model import DEFAULT_MODEL_DIR, DEFAULT_MODEL_NAME
from specserve.engine.speculative.proposers.registry import PROPOSER_MODES
from specserve.modelbuild.default_model import SMOLLM2
from specserve.modelbuild.from_gguf.checkpoint import GgufCheckpoint
from specserve.modelbuild.fused_graph import _Graph
from specserve.modelbuild.from_gguf.weights import ExternalData, GgufWeights

from .conftest import CPU_CONFIG, served_every_mode

ROOT = Path(__file__).resolve().parents[1]
NEW_TOKENS = 32
# Japan, not France: there float32 leads "The" over "L" by 0.08 logits at the first token, and
# the default (fast) format answers "L'Étoile, ..." as llama.cpp does (docs/models.md, fidelity).
CAPITAL = [{"role": "user", "content": "What is the capital of Japan?"}]


@pytest.fixture(scope="module")
def chats() -> list[list[dict]]:
    return [p["messages"] for p in json.loads((ROOT / "tests/data/heldout_chat_prompts.json").read_text())]


def test_the_bundle_records_the_gguf_it_was_converted_from():
    bundle = Bundle.load(DEFAULT_MODEL_DIR)
    record = bundle.manifest.models["target"].converted
    assert bundle.name == DEFAULT_MODEL_NAME
    assert record.sha256 == SMOLLM2.gguf_sha256 and record.source == SMOLLM2.source
    assert bundle.manifest.eos_token == "<|im_end|>" and bundle.manifest.eos_token_id == 2


def test_engine_with_no_argument_answers_a_chat_question_correctly(default_engine):
    result = default_engine.chat(CAPITAL, GenerationOptions(max_new_tokens=40, temperature=0))
    assert result.text == "The capital of Japan is Tokyo."
    assert result.finish_reason == "stop" and result.token_ids[-1] == 2  # <|im_end|> ends the turn
    assert default_engine.bundle.directory.resolve() == DEFAULT_MODEL_DIR.resolve()


def test_it_ships_a_head_of_every_kind_and_each_is_token_identical_to_target_only(default_engine, chats):
    assert default_engine.available_modes == ["none", *PROPOSER_MODES]
    base = GenerationOptions(max_new_tokens=NEW_TOKENS, temperature=0)
    expected = [default_engine.chat(c, base.model_copy(update={"speculative_mode": "none"})).token_ids
                for c in chats[:4]]
    for mode in default_engine.available_modes[1:]:
        for adaptive in (False, True):
            options = base.model_copy(update={"speculative_mode": mode, "adaptive_speculation": adaptive})
            results = [default_engine.chat(c, options) for c in chats[:4]]
            assert [r.token_ids for r in results] == expected, (mode, adaptive)
            if not adaptive:  # a fixed k drafts every round: a trained head's drafts are accepted at times
                assert sum(r.speculative.accepted_tokens for r in results) > 0, mode


def test_the_heads_record_how_they_were_trained():
    manifest = Bundle.load(DEFAULT_MODEL_DIR).manifest
    for kind, head in manifest.heads.items():
        assert head.training is not None and head.training.seed is not None, kind
        assert "sha256" in head.training.objective and head.training.seconds > 0, kind
        assert head.d2t is not None and head.draft_vocab_size == 8192, kind
    draft = manifest.models["draft"]
    assert draft.training is not None and draft.training.seconds > 0


def test_the_q4_1_blocks_are_carried_over_exactly():
    """One Q4_1 projection through ``MatMulNBits`` plus the block-sum correction equals the
    product with the file's dequantised weights (float64 reference)."""
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    from specserve.modelbuild.default_model import cached_gguf

    checkpoint = GgufCheckpoint(cached_gguf())
    name = "model.layers.3.mlp.down_proj.weight"
    tensor = checkpoint.tensor(name)
    assert tensor.encoding == "Q4_1"
    rows, width = tensor.shape
    import tempfile

    with tempfile.TemporaryDirectory() as scratch:
        store = ExternalData(Path(scratch) / "w.data")
        g = _Graph()
        GgufWeights(checkpoint, store, "q4_1").linear(g, "x", [name], [rows], width, output="y")
        store.close()
        graph = helper.make_graph(g.nodes, "one", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, width])],
                                  [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3, rows])], g.initializers)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 23), helper.make_opsetid("com.microsoft", 1)])
        model.ir_version = 11
        path = Path(scratch) / "one.onnx"
        onnx.save(model, str(path))
        x = np.random.default_rng(0).standard_normal((1, 3, width)).astype(np.float32) * 10
        got = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    expected = x.astype(np.float64) @ tensor.dequantize().astype(np.float64).T
    assert np.abs(got - expected).max() <= 1e-5 * np.abs(expected).max()


@pytest.fixture(scope="module")
def served(default_model_server) -> str:
    return default_model_server


def test_served_chat_names_the_model_and_matches_the_engine_in_every_mode(served, default_engine, chats):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0, timeout=120)
    assert [m.id for m in client.models.list().data] == [DEFAULT_MODEL_NAME]
    answer = client.chat.completions.create(model=DEFAULT_MODEL_NAME, messages=CAPITAL, max_tokens=40, temperature=0)
    assert answer.choices[0].message.content == "The capital of Japan is Tokyo."
    assert answer.model == DEFAULT_MODEL_NAME and answer.choices[0].finish_reason == "stop"
    options = GenerationOptions(max_new_tokens=NEW_TOKENS, temperature=0)
    for messages in chats[:4]:
        expected = default_engine.chat(messages, options).token_ids
        for mode in ("none", *PROPOSER_MODES):
            response = client.chat.completions.create(
                model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=NEW_TOKENS, temperature=0,
                extra_body={"speculative_mode": mode, "return_token_ids": True})
            assert response.choices[0].model_extra["token_ids"] == expected, mode


def test_served_every_mode_at_1_and_32_streams_is_the_engines_target_only(served, default_engine, chats):
    """The fast format (the default) through the server. The exact format passes the same
    check in-process (test_target_formats.py): the served path is the same for both."""
    served_every_mode(served, default_engine, chats[:8], streams=32, new_tokens=24)


def _first_token(client: openai.OpenAI, messages: list[dict], mode: str) -> tuple[float, list[int], int]:
    """Stream a greedy chat: seconds to the first token, the token ids, the cached tokens."""
    sent = time.perf_counter()
    first, ids, cached = None, [], None
    for chunk in client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=messages, max_tokens=NEW_TOKENS, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"speculative_mode": mode, "return_token_ids": True}):
        for choice in chunk.choices:
            if choice.model_extra.get("token_ids"):
                first = first or time.perf_counter() - sent
                ids += choice.model_extra["token_ids"]
        if chunk.usage is not None:
            cached = chunk.usage.prompt_tokens_details.cached_tokens
    return first, ids, cached


def test_behind_a_shared_system_prompt_first_tokens_come_at_least_twice_as_fast(served, chats):
    """Twice, after a reset: one cold request, then three with other questions behind the
    same ~750-token system prompt; each warm one's time to first token is at most half
    the cold one's (the bench measures the ratio itself: docs/benchmarks/)."""
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0, timeout=120)
    system = {"role": "system", "content": (ROOT / "tests/data/system_prompt.txt").read_text()}
    for attempt, questions in enumerate((chats[:4], chats[4:8])):
        assert httpx.post(f"{served}/reset_prefix_cache", timeout=30).json()["status"] == "ok"
        cold, _, cached = _first_token(client, [system, *questions[0]], "none")
        assert cached == 0
        warm = [_first_token(client, [system, *q], "none") for q in questions[1:]]
        assert all(c >= 704 for _, _, c in warm), [c for _, _, c in warm]  # 44 blocks of 16: the system prompt
        assert statistics.median(t for t, _, _ in warm) <= 0.5 * cold, (attempt, cold, [t for t, _, _ in warm])


@pytest.fixture(scope="module")
def uncached_default():
    """The default model in-process with prefix caching off (batch 1 is all it serves)."""
    config = CPU_CONFIG.model_copy(update={"prefix_caching": False, "scheduler": CPU_CONFIG.scheduler.model_copy(
        update={"max_batch_size": 1})})
    with Engine(config=config) as engine:
        yield engine


def test_every_mode_gives_the_same_tokens_cold_warm_and_uncached(served, chats, uncached_default):
    client = openai.OpenAI(base_url=f"{served}/v1", api_key="none", max_retries=0, timeout=120)
    system = {"role": "system", "content": (ROOT / "tests/data/system_prompt.txt").read_text()}
    conversations = [[system, *chats[i]] for i in (8, 9)]
    options = GenerationOptions(max_new_tokens=NEW_TOKENS, temperature=0)
    expected = [uncached_default.chat(c, options).token_ids for c in conversations]
    for mode in ("none", *PROPOSER_MODES):
        assert httpx.post(f"{served}/reset_prefix_cache", timeout=30).json()["status"] == "ok"
        cold, warm = (_first_token(client, c, mode) for c in conversations)
        assert cold[2] == 0 and warm[2] >= 704, mode
        assert [cold[1], warm[1]] == expected, mode


def test_the_convert_command_writes_a_bundle_from_a_gguf_that_the_engine_serves(tmp_path, default_engine):
    """``python -m specserve.modelbuild.convert --gguf`` (no torch) on the default model's file, one
    format throughout and no fast format: the engine serves the bundle it writes, with
    target-only's tokens, and refuses by name the modes it has no head for."""
    import subprocess
    import sys

    from specserve.engine import Engine, EngineConfig
    from specserve.modelbuild.default_model import cached_gguf

    out = tmp_path / "bundle"
    run = subprocess.run([sys.executable, "-m", "specserve.modelbuild.convert", "--gguf", str(cached_gguf()), "--out", str(out),
                          "--step-format", "none", "--no-fast"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    assert not (out / "target/model.inplace.step.onnx").exists() and not (out / "target/model.fast.onnx").exists()
    options = GenerationOptions(max_new_tokens=12, temperature=0)
    with Engine(out, EngineConfig(device="cpu", intra_op_threads=2)) as engine:
        assert engine.chat(CAPITAL, options).token_ids == default_engine.chat(CAPITAL, options).token_ids
        assert engine.available_modes == ["none", "prompt_lookup", "suffix"]
        for mode in ("draft_model", "mtp", "eagle3", "shared_kv"):
            with pytest.raises(InvalidRequestError, match=mode):
                engine.chat(CAPITAL, GenerationOptions(max_new_tokens=4, speculative_mode=mode))


def test_a_cpu_start_prints_no_error_or_warning_and_says_which_provider_serves():
    """The CLI on the default model, device auto, on this machine (no CUDA libraries): onnxruntime
    is never asked for a provider it cannot load, so it prints nothing; one INFO line names
    the provider that serves and why."""
    run = subprocess.run([sys.executable, "-m", "specserve.engine", "generate", "--prompt", "The capital of France is",
                          "--max-new-tokens", "4", "--device", "auto"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
    lines = (run.stdout + run.stderr).splitlines()
    assert not [line for line in lines if "onnxruntime:" in line or "ERROR" in line or "WARNING" in line], lines
    choices = [line for line in run.stderr.splitlines() if "device=auto ->" in line]
    assert len(choices) == 1 and "INFO" in choices[0], run.stderr
    from specserve.engine.model.providers import cuda_unavailable
    if cuda_unavailable() is not None:
        assert "CPUExecutionProvider (" in choices[0] and cuda_unavailable() in choices[0]
