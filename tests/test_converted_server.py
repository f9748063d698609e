"""Converted Hugging Face checkpoints through the server: tiny random checkpoints in
every published head layout (EAGLE-3 SafeAILab and speculators, Qwen3.5 dense and
Qwen3-Next mixture-of-experts MTP, Gemma-4 assistant) are converted by ``python -m specserve.modelbuild.convert`` in the convert venv, served
on a real local Ray Serve, and every mode's greedy tokens over HTTP must equal the
in-process engine's target-only tokens on the same bundle.

The heads' numerics against transformers and independent torch forwards are checked in
``tests/convert`` (convert venv); this module checks the server carries them unchanged.
"""
from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from specserve.engine import Engine, EngineConfig, GenerationOptions, SpeculativeConfig

from .conftest import ROOT, running_server

CONVERT_PYTHON = ROOT / ".venv-convert/bin/python"
MAX_TOKENS = 16
CPU = EngineConfig(device="cpu", intra_op_threads=2, speculative=SpeculativeConfig(adaptive=False))
LAYOUTS = {"full": ["eagle3", "mtp", "shared_kv", "prompt_lookup"], "speculators": ["eagle3", "mtp"]}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Both tiny bundles, converted by the convert venv (``bash scripts/install_convert.sh``)."""
    if not CONVERT_PYTHON.exists():
        pytest.fail(f"{CONVERT_PYTHON} is missing: run `bash scripts/install_convert.sh` (scripts/test.sh does)")
    root = tmp_path_factory.mktemp("converted")
    subprocess.run([str(CONVERT_PYTHON), "-m", "tests.convert.build_tiny_bundles", str(root)], cwd=ROOT, check=True,
                   env={**os.environ, "PYTHONPATH": str(ROOT), "TQDM_DISABLE": "1"}, capture_output=True, timeout=600)
    return root


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_every_converted_mode_through_the_server_equals_target_only(converted, heldout_prompts, layout):
    bundle = converted / layout
    prompts = [p[:120] for p in heldout_prompts[:4]]
    with Engine(bundle, CPU) as engine:
        expected = [engine.generate(p, GenerationOptions(max_new_tokens=MAX_TOKENS, speculative_mode="none")).token_ids
                    for p in prompts]
    args = {"model_dir": str(bundle), "engine": {"speculative": {"default_mode": LAYOUTS[layout][0]}}}
    with running_server(args) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

        def complete(job):
            prompt, mode = job
            return client.completions.create(model="specserve", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                             extra_body={"speculative_mode": mode, "return_token_ids": True})

        jobs = [(prompt, mode) for mode in LAYOUTS[layout] for prompt in prompts]
        with ThreadPoolExecutor(4) as pool:
            responses = list(pool.map(complete, jobs))
    drafted = {mode: 0 for mode in LAYOUTS[layout]}
    for (prompt, mode), response in zip(jobs, responses):
        assert response.choices[0].model_extra["token_ids"] == expected[prompts.index(prompt)], (layout, mode)
        assert response.model_extra["speculative"]["mode"] == mode
        drafted[mode] += response.model_extra["speculative"]["draft_tokens"]
    assert all(drafted.values()), drafted  # every mode really drafted through its replica
