"""An onnxruntime-genai model-builder export of a Hugging Face Llama, built at test time
(5 s for the tiny checkpoint): it declares its KV head size symbolically
(``kv_cache_dim``), which the runner resolves from ``genai_config.json``, and it must
reproduce transformers' greedy tokens, target-only and speculative."""
from __future__ import annotations

import subprocess
import sys

import onnxruntime as ort
import pytest

from specserve.engine import Engine, GenerationOptions

from .test_convert import CPU, PROMPT
from .tiny_llama import transformers_greedy


@pytest.fixture(scope="module")
def genai_export(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("genai") / "model"
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(tiny.target), "-o", str(out),
                    "-p", "fp32", "-e", "cpu", "-c", str(out.parent / "cache")], check=True, capture_output=True,
                   timeout=300)
    return out


def test_the_export_really_has_symbolic_kv_head_sizes(genai_export):
    session = ort.InferenceSession(str(genai_export / "model.onnx"), providers=["CPUExecutionProvider"])
    past = next(i for i in session.get_inputs() if i.name == "past_key_values.0.key")
    assert isinstance(past.shape[3], str), past.shape  # what the runner must resolve from genai_config.json


def test_a_genai_export_reproduces_transformers_greedy_tokens(tiny, genai_export):
    expected = transformers_greedy(tiny.target, PROMPT, 24)
    with Engine(genai_export, CPU) as engine:
        for mode in ("none", "prompt_lookup"):
            result = engine.generate(PROMPT, GenerationOptions(max_new_tokens=24, ignore_eos=True,
                                                               speculative_mode=mode))
            assert result.token_ids == expected, mode
