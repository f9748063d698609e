"""The distributed server on a real local Ray Serve, through real HTTP and the official
``openai`` client: greedy and seeded sampled output per mode is token-identical to the
in-process engine (the same coordinator over another transport), streams and chat work,
target data reaches proposers as ObjectRefs, and every KV block comes back -- also after
a client disconnects mid-stream."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from specserve.engine import GenerationOptions

from .conftest import local_metrics_url, running_server, stream_chat

MODES = ("none", "prompt_lookup", "draft_model", "mtp", "eagle3", "shared_kv")
MAX_TOKENS = 24
# Exported only once one happens (a Prometheus counter appears on its first increment);
# tests/test_faults.py checks that a fault exports it.
EVENT_ONLY_METRICS = {"ray_specserve_recovered_faults_total"}

API_KEY = f"sk-test-{uuid.uuid4().hex}"  # the whole module runs with authentication on
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server():
    # stream_interval 2: every stream here also checks that grouped writes lose and reorder nothing
    with running_server({"stream_interval": 2}, env={"SPECSERVE_API_KEY": API_KEY},
                        metrics_report_interval_ms=500) as url:
        yield url


@pytest.fixture(scope="module")
def metrics_url(server) -> str:
    return local_metrics_url()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def _handle(name: str):
    from ray import serve

    return serve.get_deployment_handle(name, "specserve")


def _kv_all_free(timeout_s: float = 30.0) -> dict:
    """Poll until the KV manager reports every block free (releases trail the last token)."""
    deadline = time.monotonic() + timeout_s
    while True:
        usage = _handle("Router").kv_usage.remote().result()
        if usage["free_blocks"] == usage["total_blocks"] or time.monotonic() > deadline:
            return usage
        time.sleep(0.1)


def _complete(client, prompt: str, mode: str, max_tokens: int = MAX_TOKENS, adaptive: bool | None = None):
    extra = {"speculative_mode": mode, "return_token_ids": True}
    if adaptive is not None:
        extra["adaptive_speculation"] = adaptive
    return client.completions.create(model="specserve", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body=extra)


def test_a_client_that_disconnects_fails_no_other_stream(server, bundle_engine, heldout_prompts):
    """The server's first request starts the coordinator's loop; its client leaves while a
    second stream shares that loop's target calls. Serve cancels the first request, and
    the second must finish, identical (first in this module: later requests find the loop
    running, started by a request that has already ended)."""
    import threading

    second_started, first_done = threading.Event(), threading.Event()
    second: list[int] = []

    def leave_early():
        second_started.wait(60)
        first_done.set()

    def stream_second():
        body = {"model": "specserve", "prompt": heldout_prompts[3], "max_tokens": 160, "temperature": 0,
                "stream": True, "ignore_eos": True, "speculative_mode": "none", "return_token_ids": True}
        with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH, timeout=180) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    assert "error" not in chunk, chunk
                    second.extend(t for choice in chunk["choices"] for t in choice.get("token_ids", []))
                    second_started.set()

    body = {"model": "specserve", "prompt": heldout_prompts[2], "max_tokens": 400, "temperature": 0, "n": 3,
            "stream": True, "ignore_eos": True, "speculative_mode": "none"}  # still running when it leaves
    thread = threading.Thread(target=stream_second)
    with httpx.stream("POST", f"{server}/v1/completions", json=body, headers=AUTH, timeout=180) as response:
        for line in response.iter_lines():
            if line.startswith("data: ") and not thread.is_alive() and not first_done.is_set():
                thread.start()
                leave_early()
            if first_done.is_set():
                break  # closes the connection with the stream half read
    thread.join(180)
    options = GenerationOptions(max_new_tokens=160, ignore_eos=True, speculative_mode="none")
    assert second == bundle_engine.generate(heldout_prompts[3], options).token_ids
    usage = _kv_all_free()
    assert usage["free_blocks"] == usage["total_blocks"]


def test_health_and_models(server, client):
    assert httpx.get(f"{server}/health").json() == {"status": "ok"}  # liveness needs no key
    assert [m.id for m in client.models.list().data] == ["specserve"]
    import importlib.metadata
    version = httpx.get(f"{server}/version", headers=AUTH, timeout=30).json()
    assert version == {"version": importlib.metadata.version("specserve")}  # vLLM's GET /version


@pytest.mark.parametrize("mode", MODES)
def test_greedy_output_through_the_server_is_token_identical_to_the_engine(client, bundle_engine, heldout_prompts,
                                                                            mode):
    prompts = heldout_prompts[:10]
    with ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: the rounds are batched server-side
        responses = list(pool.map(lambda p: _complete(client, p, mode), prompts))
    accepted = 0
    for prompt, response in zip(prompts, responses):
        expected = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=MAX_TOKENS, speculative_mode=mode))
        choice = response.choices[0]
        assert choice.model_extra["token_ids"] == expected.token_ids
        assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
        assert response.usage.completion_tokens == len(expected.token_ids)
        spec = response.model_extra["speculative"]
        assert spec["mode"] == mode
        # the same coordinator drafted and verified the same rounds in both
        assert (spec["rounds"], spec["draft_tokens"], spec["accepted_tokens"]) == (
            expected.speculative.verification_steps, expected.speculative.proposed_tokens,
            expected.speculative.accepted_tokens), (mode, prompt)
        accepted += spec["accepted_tokens"]
    assert (accepted > 0) == (mode != "none")  # the speculative modes really speculated


def test_adaptive_speculation_through_the_server_keeps_every_token(client, bundle_engine, heldout_prompts):
    """Adaptive requests (the router plans each round's drafts from the replicas' measured
    costs) give the target-only tokens in every mode, with concurrent streams."""
    jobs = [(prompt, mode) for prompt in heldout_prompts[:3] for mode in MODES[1:]]
    with ThreadPoolExecutor(len(jobs)) as pool:
        responses = list(pool.map(lambda job: _complete(client, job[0], job[1], adaptive=True), jobs))
    for (prompt, mode), response in zip(jobs, responses):
        expected = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=MAX_TOKENS, speculative_mode="none"))
        assert response.choices[0].model_extra["token_ids"] == expected.token_ids, (mode, prompt)
        assert response.model_extra["speculative"]["mode"] == mode


SAMPLED_TOKENS = 32


@pytest.mark.parametrize("mode", MODES)
def test_a_seeded_sampled_request_gives_the_same_tokens_in_process_and_through_the_server(client, bundle_engine,
                                                                                         heldout_prompts, mode):
    """Both run the same coordinator and workers with one random-number convention (the
    verifier draws from default_rng(seed), a sampling drafter from default_rng([seed, 1])),
    so a seed fixes the tokens -- and the drafts and acceptances -- wherever it runs."""
    prompt, seed = heldout_prompts[4], 1234
    response = client.completions.create(model="specserve", prompt=prompt, max_tokens=SAMPLED_TOKENS,
                                         temperature=0.8, seed=seed,
                                         extra_body={"speculative_mode": mode, "return_token_ids": True,
                                                     "ignore_eos": True})
    expected = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=SAMPLED_TOKENS, temperature=0.8,
                                                                seed=seed, ignore_eos=True, speculative_mode=mode))
    assert response.choices[0].model_extra["token_ids"] == expected.token_ids
    assert len(expected.token_ids) == SAMPLED_TOKENS
    spec = response.model_extra["speculative"]
    assert (spec["rounds"], spec["draft_tokens"], spec["accepted_tokens"]) == (
        expected.speculative.verification_steps, expected.speculative.proposed_tokens,
        expected.speculative.accepted_tokens)
    assert (spec["draft_tokens"] > 0) == (mode != "none")  # sampled rounds really checked drafts


@pytest.mark.parametrize("mode", ["none", "draft_model", "eagle3"])
def test_penalties_logit_bias_and_min_tokens_through_the_openai_client_match_the_engine(client, bundle_engine,
                                                                                      heldout_prompts, mode):
    """OpenAI's presence_penalty, frequency_penalty and logit_bias (string token ids), and
    vLLM's min_tokens, reach the same rules the engine applies: same tokens, sampled and
    seeded too (the draft model's drafts follow the rules; the proposer worker gets them)."""
    prompt = heldout_prompts[5]
    free = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=24, speculative_mode="none"))
    banned, stopper = free.token_ids[1], free.token_ids[2]
    rules = dict(presence_penalty=0.6, frequency_penalty=0.3, min_tokens=10, stop_token_ids=[stopper])
    for temperature in (0.0, 0.8):
        response = client.completions.create(
            model="specserve", prompt=prompt, max_tokens=24, temperature=temperature, seed=5,
            presence_penalty=0.6, frequency_penalty=0.3, logit_bias={str(banned): -100},
            extra_body={"speculative_mode": mode, "return_token_ids": True, "min_tokens": 10,
                        "stop_token_ids": [stopper]})
        expected = bundle_engine.generate(prompt, GenerationOptions(
            max_new_tokens=24, temperature=temperature, seed=5, logit_bias={banned: -100.0}, speculative_mode=mode,
            **rules))
        tokens = response.choices[0].model_extra["token_ids"]
        assert tokens == expected.token_ids and response.choices[0].text == expected.text
        assert banned not in tokens and len(tokens) >= 10 and stopper not in tokens[:9]
    assert tokens != free.token_ids


def test_n_choices_are_seeded_siblings_and_stream_interleaved_by_index(client, bundle_engine, heldout_prompts):
    """``n`` runs n sequences; a seeded request's choice i is what the engine gives with
    seed + i (vLLM's convention), whole or streamed; usage counts the prompt once."""
    prompt, seed = heldout_prompts[8], 321
    response = client.completions.create(model="specserve", prompt=prompt, max_tokens=16, temperature=0.9, seed=seed,
                                         n=3, extra_body={"speculative_mode": "eagle3", "return_token_ids": True})
    expected = [bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=16, temperature=0.9, seed=seed + i,
                                                                 speculative_mode="eagle3")) for i in range(3)]
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert [c.model_extra["token_ids"] for c in response.choices] == [e.token_ids for e in expected]
    assert len({tuple(e.token_ids) for e in expected}) > 1  # the seeds differ, so do the samples
    assert response.usage.prompt_tokens == len(bundle_engine.factory.encode(prompt))
    assert response.usage.completion_tokens == sum(len(e.token_ids) for e in expected)
    assert response.model_extra["speculative"]["rounds"] == sum(e.speculative.verification_steps for e in expected)
    chat = dict(model="specserve", messages=[{"role": "user", "content": prompt}], max_tokens=12, temperature=0.9,
                seed=seed, n=2)
    whole = client.chat.completions.create(**chat)
    texts, finished, roles = {0: "", 1: ""}, {0: 0, 1: 0}, {0: 0, 1: 0}
    for chunk in client.chat.completions.create(**chat, stream=True):
        for choice in chunk.choices:
            roles[choice.index] += choice.delta.role == "assistant"
            texts[choice.index] += choice.delta.content or ""
            finished[choice.index] += choice.finish_reason is not None
    assert texts == {c.index: c.message.content for c in whole.choices} and finished == roles == {0: 1, 1: 1}
    assert _kv_all_free()["sequences"] == 0


def test_tokenize_gives_the_ids_a_request_gets_and_detokenize_reverses_it(server, client, bundle_engine,
                                                                         heldout_prompts):
    """vLLM's /tokenize and /detokenize: a prompt's ids are the ones a completion counts,
    chat messages' the ones a chat request counts (the template applied)."""
    def post(path: str, body: dict) -> httpx.Response:
        return httpx.post(f"{server}{path}", json={"model": "specserve", **body}, headers=AUTH, timeout=30)

    prompt = heldout_prompts[3]
    tokens = post("/tokenize", {"prompt": prompt}).json()
    completion = client.completions.create(model="specserve", prompt=prompt, max_tokens=1, temperature=0)
    assert tokens["count"] == len(tokens["tokens"]) == completion.usage.prompt_tokens
    assert tokens["max_model_len"] == client.models.list().data[0].model_extra["max_model_len"]
    assert post("/detokenize", {"tokens": tokens["tokens"]}).json() == {"prompt": prompt}
    eos = bundle_engine.tokenizer.eos_token_id  # special tokens are kept, as vLLM's /detokenize keeps them
    assert httpx.post(f"{server}/detokenize", json={"tokens": [eos, *tokens["tokens"]]}, headers=AUTH,
                      timeout=30).json()["prompt"] == "<|endoftext|>" + prompt  # and the model is optional
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "def f(x):"}]
    chat = post("/tokenize", {"messages": messages}).json()
    reply = client.chat.completions.create(model="specserve", messages=messages, max_tokens=1, temperature=0)
    bare = post("/tokenize", {"prompt": "def f(x):"}).json()["count"]
    assert chat["count"] == reply.usage.prompt_tokens and chat["count"] > bare  # the template was applied
    for path, body, param in (("/tokenize", {"prompt": "x", "messages": messages}, None),
                              ("/tokenize", {"prompt": "x", "add_special_tokens": True}, "add_special_tokens"),
                              ("/detokenize", {"tokens": [10 ** 7]}, "tokens"),
                              ("/detokenize", {"tokens": ["a"]}, "tokens.0")):
        response = post(path, body)
        assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text
    assert httpx.post(f"{server}/tokenize", json={"model": "nope", "prompt": "x"}, headers=AUTH,
                      timeout=30).status_code == 404


def test_echo_returns_the_prompt_and_its_token_logprobs_whole_or_streamed(client, bundle_engine, heldout_prompts):
    """echo (lm-evaluation-harness scores with it): the prompt leads the text, and with
    logprobs its tokens lead the lists, the first with null (nothing precedes it), the
    others as the engine's prompt_logprobs give them; then the completion as without echo."""
    prompt = heldout_prompts[9]
    ids = bundle_engine.factory.encode(prompt)
    plain = client.completions.create(model="specserve", prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    echoed = client.completions.create(model="specserve", prompt=prompt, max_tokens=6, temperature=0, logprobs=2,
                                       echo=True)
    choice, lps = echoed.choices[0], echoed.choices[0].logprobs
    assert choice.text == prompt + plain.choices[0].text
    # the same counts (the echoed request finds the prompt cached: its usage says so, the plain one's not)
    assert (echoed.usage.prompt_tokens, echoed.usage.completion_tokens) == \
        (plain.usage.prompt_tokens, plain.usage.completion_tokens)
    engine = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=6, prompt_logprobs=2,
                                                              speculative_mode="none"))
    assert len(lps.tokens) == len(ids) + 6 and lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
    assert lps.tokens[len(ids):] == plain.choices[0].logprobs.tokens
    np.testing.assert_allclose(lps.token_logprobs[1:len(ids)], [p.logprob for p in engine.prompt_logprobs],
                               atol=1e-4)
    assert lps.text_offset[len(ids)] == len("".join(lps.tokens[:len(ids)]))
    text, tokens, prompt_ids = "", [], []
    for chunk in client.completions.create(model="specserve", prompt=prompt, max_tokens=6, temperature=0,
                                           logprobs=2, echo=True, stream=True, extra_body={"return_token_ids": True}):
        text += chunk.choices[0].text
        tokens += chunk.choices[0].logprobs.tokens if chunk.choices[0].logprobs else []
        prompt_ids += [chunk.choices[0].model_extra["prompt_token_ids"]] if "prompt_token_ids" in \
            chunk.choices[0].model_extra else []
    assert text == choice.text and tokens == lps.tokens and prompt_ids == [ids]  # the prompt's ids once
    bare = client.completions.create(model="specserve", prompt=ids, max_tokens=2, temperature=0, echo=True)
    assert bare.choices[0].text.startswith(bundle_engine.tokenizer.decode(ids)) and bare.choices[0].logprobs is None


def test_a_batch_of_prompts_gets_n_choices_each_in_vllms_order(client, bundle_engine, heldout_prompts):
    prompts = [heldout_prompts[10], heldout_prompts[11]]
    response = client.completions.create(model="specserve", prompt=prompts, max_tokens=8, temperature=0, n=2,
                                         extra_body={"return_token_ids": True})
    expected = [bundle_engine.generate(p, GenerationOptions(max_new_tokens=8, speculative_mode="none")).token_ids
                for p in prompts]
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    assert [c.model_extra["token_ids"] for c in response.choices] == [expected[0]] * 2 + [expected[1]] * 2
    assert response.usage.prompt_tokens == sum(len(bundle_engine.factory.encode(p)) for p in prompts)
    assert [c.model_extra["prompt_token_ids"] for c in response.choices][1::2] == \
        [bundle_engine.factory.encode(p) for p in prompts]
    too_long = httpx.post(f"{client.base_url}completions", headers=AUTH, timeout=30,
                          json={"model": "specserve", "prompt": ["x", "x " * 600]})
    assert too_long.status_code == 400 and too_long.json()["error"]["message"].startswith("prompt[1]: ")
    too_many = httpx.post(f"{client.base_url}completions", headers=AUTH, timeout=30,
                          json={"model": "specserve", "prompt": ["a", "b", "c"], "n": 6})
    assert too_many.status_code == 400 and "at most 16 choices" in too_many.json()["error"]["message"]


def test_chat_completion_and_its_stream_agree(client):
    messages = [{"role": "user", "content": "Write a function that reverses a list."}]
    full = client.chat.completions.create(model="specserve", messages=messages, max_tokens=20, temperature=0)
    stream = client.chat.completions.create(model="specserve", messages=messages, max_tokens=20, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert all("usage" in c.model_fields_set for c in chunks)  # null on all but the last, as OpenAI's
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert full.choices[0].message.role == "assistant"
    assert text == full.choices[0].message.content and text
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == 20
    # vLLM's continuous_usage_stats: every chunk carries the usage so far
    continuous = list(client.chat.completions.create(
        model="specserve", messages=messages, max_tokens=20, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}, extra_body={"return_token_ids": True}))
    counted = [c.usage.completion_tokens for c in continuous]
    assert counted[0] == 0 and counted == sorted(counted) and counted[-2] == counted[-1] == 20
    # One event per write, not per token: each carries the tokens its rounds committed,
    # and the usage grows by exactly those
    per_event = [len(c.choices[0].model_extra.get("token_ids") or []) for c in continuous[1:-1]]
    assert per_event == [b - a for a, b in zip(counted[:-2], counted[1:-1])] and sum(per_event) == 20
    assert len(per_event) < 20


def test_completion_logprobs_match_the_engine(client, bundle_engine, heldout_prompts):
    response = client.completions.create(model="specserve", prompt=heldout_prompts[3], max_tokens=6, temperature=0,
                                         logprobs=2)
    expected = bundle_engine.generate(heldout_prompts[3], GenerationOptions(max_new_tokens=6, logprobs=True,
                                                                            top_logprobs=2, speculative_mode="eagle3"))
    got = response.choices[0].logprobs
    assert got.tokens == [lp.token for lp in expected.logprobs]
    assert got.token_logprobs == pytest.approx([lp.logprob for lp in expected.logprobs], abs=1e-4)
    assert all(len(top) == 2 for top in got.top_logprobs)  # greedy: the chosen token is the first of its top 2
    # As OpenAI's: top_logprobs always holds the chosen token, so logprobs=0 gives just it.
    sampled = client.completions.create(model="specserve", prompt=heldout_prompts[3], max_tokens=8,
                                        temperature=1.5, seed=3, logprobs=0).choices[0].logprobs
    assert sampled.top_logprobs == [{token: lp} for token, lp in zip(sampled.tokens, sampled.token_logprobs)]


def test_a_streamed_completions_logprobs_agree_with_the_whole_response_even_with_a_stop_string(client,
                                                                                           heldout_prompts):
    """A stop string makes the stream hold text back, so its chunks' text lags their
    tokens; text_offset must still count each token's text, as the whole response does."""
    args = dict(model="specserve", prompt=heldout_prompts[4], max_tokens=24, temperature=0, logprobs=1)
    whole = client.completions.create(**args).choices[0]
    at = next(i for i in range(len(whole.text) // 2, len(whole.text)) if whole.text[i:i + 3].isalnum())
    stop = whole.text[at:at + 3]  # a stop string inside the text: it finishes early
    whole = client.completions.create(**args, stop=[stop]).choices[0]
    assert len(whole.logprobs.tokens) >= 3 and whole.text.strip()
    chunks = [c.choices[0] for c in client.completions.create(**args, stop=[stop], stream=True)]
    assert whole.finish_reason == chunks[-1].finish_reason == "stop"
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [c.logprobs for c in chunks if c.logprobs is not None and c.logprobs.tokens]
    assert sum((lp.tokens for lp in streamed), []) == whole.logprobs.tokens
    assert sum((lp.text_offset for lp in streamed), []) == whole.logprobs.text_offset


def test_sixteen_concurrent_streams_with_mixed_modes_all_complete_correctly(client, bundle_engine, heldout_prompts):
    jobs = [(heldout_prompts[i % len(heldout_prompts)], MODES[i % len(MODES)]) for i in range(16)]

    def stream(job):
        prompt, mode = job
        chunks = client.completions.create(model="specserve", prompt=prompt, max_tokens=32, temperature=0,
                                           stream=True, extra_body={"speculative_mode": mode,
                                                                    "return_token_ids": True})
        ids, text, finished = [], "", []
        for chunk in chunks:  # without include_usage, every chunk has a choice (OpenAI's shape)
            ids += chunk.choices[0].model_extra.get("token_ids", [])
            text += chunk.choices[0].text
            if chunk.choices[0].finish_reason:
                finished.append(chunk.model_extra["speculative"])  # the finishing chunk has the stats
        assert len(finished) == 1 and finished[0]["mode"] == mode
        return ids, text

    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(stream, jobs))
    for (prompt, mode), (ids, text) in zip(jobs, results):
        expected = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=32, speculative_mode=mode))
        assert ids == expected.token_ids, mode
        assert text == expected.text
    usage = _kv_all_free()
    assert usage["free_blocks"] == usage["total_blocks"] and usage["sequences"] == 0


def test_hidden_states_and_shared_kv_slices_reach_proposers_as_object_refs(client, heldout_prompts):
    for mode in ("mtp", "eagle3", "shared_kv"):
        _complete(client, heldout_prompts[5], mode, max_tokens=12)
    for name in ("MtpProposer", "Eagle3Proposer", "SharedKvProposer"):
        stats = _handle(name).transport_stats.remote().result()
        assert stats["anchor_refs"] > 0 and stats.get("anchor_values", 0) == 0, stats
    assert _handle("SharedKvProposer").transport_stats.remote().result()["shared_kv_slices"] > 0


def test_rounds_call_the_workers_directly_not_through_serve(client, heldout_prompts):
    """Serve handle calls cost several times a plain actor call: a sequence's first
    proposer round goes through Serve (to pick a replica and learn its worker), every
    later round straight to the worker; the target's rounds all go to its worker."""
    before = _handle("MtpProposer").transport_stats.remote().result()
    target_before = _handle("TargetModel").kv_usage.remote().result()["steps"]
    result = _complete(client, heldout_prompts[4], "mtp", max_tokens=40)
    after = _handle("MtpProposer").transport_stats.remote().result()
    rounds = after["calls"] - before["calls"]
    assert result.usage.completion_tokens > 8 and rounds >= 3
    assert after["serve_calls"] - before["serve_calls"] <= 1 < rounds
    target = _handle("TargetModel").kv_usage.remote().result()
    assert target["steps"] - target_before >= rounds and target["serve_steps"] == 0


def _status(server: str) -> dict:
    return httpx.get(f"{server}/specserve/status", headers=AUTH, timeout=30).json()


def test_a_client_that_disconnects_mid_stream_gets_its_kv_blocks_freed(server, heldout_prompts):
    body = {"model": "specserve", "prompt": heldout_prompts[6], "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True, "speculative_mode": "draft_model"}
    with httpx.stream("POST", f"{server}/v1/completions", json=body, timeout=60, headers=AUTH) as response:
        assert response.status_code == 200
        lines = response.iter_lines()
        seen = [line for _, line in zip(range(6), lines) if line.startswith("data:")]
        assert seen and json.loads(seen[0][5:])["choices"]
        usage = _handle("Router").kv_usage.remote().result()
        assert usage["sequences"] == 1 and usage["free_blocks"] < usage["total_blocks"]
        writes = _status(server)["stream_writes"]
        assert _status(server)["open_streams"] == 1  # it shares the router's write budget while it lasts
    usage = _kv_all_free()  # closed mid-stream: the request is retired and its reservation freed
    assert usage["free_blocks"] == usage["total_blocks"] and usage["sequences"] == 0
    status = _status(server)
    assert status["open_streams"] == 0  # and it no longer takes a share of the write budget
    assert writes >= 1 and status["stream_writes"] >= writes  # its writes were counted
    assert _handle("TargetModel").kv_usage.remote().result()["sequences"] == 0
    assert _handle("DraftModelProposer").transport_stats.remote().result()["sequences"] == 0


@pytest.mark.parametrize("body, status, param", [
    ({"model": "nope", "prompt": "x"}, 404, "model"),
    ({"model": "specserve", "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": "specserve", "prompt": "x", "max_tokens": 100000}, 400, "max_tokens"),
    ({"model": "specserve", "prompt": "x", "speculative_mode": "medusa"}, 400, "speculative_mode"),
    ({"model": "specserve", "prompt": "x", "num_speculative_tokens": 99}, 400, "num_speculative_tokens"),
    ({"model": "specserve", "prompt": "x " * 600}, 400, "prompt"),
    ({"model": "specserve", "prompt": ""}, 400, "prompt"),
    ({"model": "specserve", "prompt": "x", "n": 0}, 400, "n"),
    ({"model": "specserve", "prompt": "x", "n": 17}, 400, "n"),
    ({"model": "specserve", "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": "specserve", "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"model": "specserve", "prompt": "x", "frobnicate": None}, 400, "frobnicate"),  # null or not: unknown
    ({"model": "specserve", "prompt": "x", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ({"model": "specserve", "prompt": [True, False]}, 400, "prompt"),  # token ids are integers, not booleans
    ({"model": "specserve", "prompt": "x", "stop_token_ids": [10 ** 7]}, 400, "stop_token_ids"),
    ({"model": "specserve", "prompt": "x", "stop_token_ids": [-5]}, 400, "stop_token_ids.0"),
    ({"model": "specserve", "prompt": "x", "response_format": {"type": "xml"}}, 400, "response_format.type"),
    ({"model": "specserve", "prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
        "name": "bad", "schema": {"type": "frobnicate"}}}}, 400, "response_format"),
    ({"model": "specserve", "prompt": "x", "structured_outputs": {"regex": "a(b"}}, 400, "structured_outputs"),
    ({"model": "specserve", "prompt": "x", "structured_outputs": {"regex": "a", "choice": ["b"]}}, 400,
     "structured_outputs"),
    ({"model": "specserve", "prompt": "x", "structured_outputs": {"choice": []}}, 400, "structured_outputs"),
    ({"model": "specserve", "prompt": "x", "structured_outputs": {"json_object": True}, "ignore_eos": True}, 400,
     None),
    ({"model": "specserve", "prompt": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, 400,
     "tools"),  # chat's, not completions'
    ({"model": "specserve", "prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({"model": "specserve", "prompt": "x", "logit_bias": {"5": 500}}, 400, "logit_bias.5"),
    ({"model": "specserve", "prompt": "x", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),  # outside the vocabulary
    ({"model": "specserve", "prompt": "x", "presence_penalty": 2.5}, 400, "presence_penalty"),
    ({"model": "specserve", "prompt": "x", "max_tokens": 5, "min_tokens": 6}, 400, "min_tokens"),
    ({"model": "specserve", "prompt": "x", "logit_bias": {"\u00b2": 1}}, 400, "logit_bias"),  # a digit int() refuses
    ({"model": "specserve", "prompt": "x", "logit_bias": {"5": 1, "05": -1}}, 400, "logit_bias"),  # one id twice
    ({"model": "specserve", "prompt": "x", "logit_bias": {"5": True}}, 400, "logit_bias.5"),
    ({"model": "specserve", "prompt": "x", "n": 2, "best_of": 3}, 400, None),
    # the prompt fits and so does max_tokens alone, but not both: told, never cut short
    ({"model": "specserve", "prompt": "x " * 200, "max_tokens": 400}, 400, "max_tokens"),
])
def test_bad_requests_get_openai_style_errors(server, body, status, param):
    response = httpx.post(f"{server}/v1/completions", json=body, timeout=30, headers=AUTH)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param


def test_malformed_json_and_empty_chat_are_400(server):
    response = httpx.post(f"{server}/v1/completions", content=b"{not json", timeout=30,
                          headers={"Content-Type": "application/json", **AUTH})
    assert response.status_code == 400 and "malformed JSON" in response.json()["error"]["message"]
    assert response.json()["error"]["param"] is None
    response = httpx.post(f"{server}/v1/chat/completions", json={"model": "specserve", "messages": []}, timeout=30,
                          headers=AUTH)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"
    # Chat without max_tokens may generate the rest of the context: a min_tokens past that is refused.
    response = httpx.post(f"{server}/v1/chat/completions", timeout=30, headers=AUTH, json={
        "model": "specserve", "messages": [{"role": "user", "content": "x " * 300}], "min_tokens": 400})
    assert response.status_code == 400 and response.json()["error"]["param"] == "min_tokens"


def test_unknown_routes_and_methods_get_openai_shaped_errors_and_the_model_card_is_served(server):
    for method, path, status in (("GET", "/v1/nothing", 404), ("GET", "/v1/completions", 405),
                                 ("GET", "/v1/models/nope", 404)):
        response = httpx.request(method, f"{server}{path}", headers=AUTH, timeout=30)
        assert response.status_code == status, path
        assert response.json()["error"]["message"], path
    card = httpx.get(f"{server}/v1/models/specserve", headers=AUTH, timeout=30).json()
    assert card == httpx.get(f"{server}/v1/models", headers=AUTH, timeout=30).json()["data"][0]
    assert card["id"] == "specserve" and abs(card["created"] - time.time()) < 3600


def test_nulls_for_optional_fields_and_a_reply_sent_back_are_accepted(client, server):
    """Clients send unset settings as null, and a conversation goes on by appending the
    assistant's reply as the SDK dumps it (refusal, tool_calls, ... at null)."""
    first = client.chat.completions.create(model="specserve", max_tokens=6, temperature=0,
                                           messages=[{"role": "user", "content": "Write a sort function."}])
    messages = [{"role": "user", "content": "Write a sort function."}, first.choices[0].message.model_dump(),
                {"role": "user", "content": "Now in one line."}]
    assert messages[1]["refusal"] is None and "tool_calls" in messages[1]
    nulls = {"temperature": None, "top_p": None, "n": None, "stream": None, "presence_penalty": None,
             "frequency_penalty": None, "logprobs": None, "tools": None, "tool_choice": None, "top_k": -1}
    body = {"model": "specserve", "messages": messages, "max_tokens": 6, "seed": 5}
    with_nulls = httpx.post(f"{server}/v1/chat/completions", json={**body, **nulls}, headers=AUTH, timeout=60)
    assert with_nulls.status_code == 200, with_nulls.text
    plain = httpx.post(f"{server}/v1/chat/completions", json=body, headers=AUTH, timeout=60).json()
    assert with_nulls.json()["choices"][0]["message"] == plain["choices"][0]["message"]  # null = the default
    response = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, timeout=60,
                          json={"model": "specserve", "messages": [{"role": "user", "content": None}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages.0"


def test_the_auth_scheme_is_case_insensitive(server):
    for scheme in ("bearer", "BEARER"):
        response = httpx.get(f"{server}/v1/models", headers={"Authorization": f"{scheme} {API_KEY}"}, timeout=30)
        assert response.status_code == 200, scheme


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY},
                                     {"Authorization": f"Basic {API_KEY}"}])
def test_without_the_api_key_every_endpoint_but_health_is_401(server, headers):
    for method, path in (("GET", "/v1/models"), ("POST", "/v1/completions"), ("GET", "/specserve/status"),
                         ("POST", "/tokenize"), ("POST", "/reset_prefix_cache")):
        response = httpx.request(method, f"{server}{path}", headers=headers, timeout=30,
                                 json={"model": "specserve", "prompt": "x"} if method == "POST" else None)
        assert response.status_code == 401, path
        assert response.json()["error"]["type"] == "authentication_error"
        assert API_KEY not in response.text


def test_a_body_over_the_size_limit_is_413_before_parsing(server):
    response = httpx.post(f"{server}/v1/completions", headers={**AUTH, "Content-Type": "application/json"},
                          content=b'{"model": "specserve", "prompt": "' + b"x" * (2 << 20) + b'"}', timeout=30)
    assert response.status_code == 413 and "larger than" in response.json()["error"]["message"]


def _scrape(metrics_url: str, name: str, **labels: str) -> float:
    """Sum of a metric over the series whose labels include ``labels`` (Prometheus text)."""
    text = httpx.get(metrics_url, timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_prometheus_counters_agree_with_the_stats_responses_reported(client, metrics_url, heldout_prompts):
    counters = {"ray_spec_decode_num_draft_tokens_total": "draft_tokens",
                "ray_spec_decode_num_accepted_tokens_total": "accepted_tokens",
                "ray_specserve_verify_rounds_total": "rounds"}
    ttft = "ray_vllm_time_to_first_token_seconds_count"
    before = {name: _scrape(metrics_url, name, mode="shared_kv") for name in [*counters, ttft]}
    before_pos = [_scrape(metrics_url, "ray_spec_decode_num_accepted_tokens_per_pos_total", mode="shared_kv",
                          position=str(i)) for i in range(4)]
    spec = [_complete(client, prompt, "shared_kv").model_extra["speculative"] for prompt in heldout_prompts[:3]]
    expected = {**{name: sum(s[field] for s in spec) for name, field in counters.items()}, ttft: len(spec)}
    expected_pos = [sum((s["accepted_per_position"] + [0] * 4)[i] for s in spec) for i in range(4)]
    total_blocks = _kv_all_free()["total_blocks"]
    deadline = time.monotonic() + 30  # workers report every 500 ms here, the KV gauges every 2 s
    while True:
        got = {name: _scrape(metrics_url, name, mode="shared_kv") - before[name] for name in expected}
        free = _scrape(metrics_url, "ray_specserve_kv_blocks_free")
        if (got == expected and free == total_blocks) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got == expected and expected["ray_spec_decode_num_draft_tokens_total"] > 0
    assert [_scrape(metrics_url, "ray_spec_decode_num_accepted_tokens_per_pos_total", mode="shared_kv",
                    position=str(i)) - b for i, b in enumerate(before_pos)] == expected_pos
    assert free == total_blocks  # the gauge reports the ledger: every block back once the requests ended


def test_suffix_decoding_drafts_from_earlier_outputs_counts_its_lookups_and_resets(
        server, client, metrics_url, bundle_engine, heldout_prompts):
    """The router's suffix cache: a repeat of a request drafts from the first one's output
    (a cache hit: far fewer rounds), ``/reset_suffix_cache`` forgets it, every reply is
    the engine's target-only one, and the lookup counters on Prometheus add up to what
    the responses reported."""
    names = {"ray_specserve_draft_lookups_total": "lookups", "ray_specserve_draft_lookup_hits_total": "hits"}
    before = {name: _scrape(metrics_url, name, mode="suffix") for name in names}
    reset = httpx.post(f"{server}/reset_suffix_cache", headers=AUTH, timeout=30)
    assert reset.status_code == 200 and reset.json()["status"] == "ok"
    prompt, tokens = heldout_prompts[10], 48
    cold, hit = (_complete(client, prompt, "suffix", tokens, adaptive=False) for _ in range(2))
    assert httpx.post(f"{server}/reset_suffix_cache", headers=AUTH, timeout=30).json()["forgotten_outputs"] == 2
    again = _complete(client, prompt, "suffix", tokens, adaptive=False)
    expected = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=tokens, speculative_mode="none"))
    assert all(r.choices[0].model_extra["token_ids"] == expected.token_ids for r in (cold, hit, again))
    spec = [r.model_extra["speculative"] for r in (cold, hit, again)]
    assert spec[1]["rounds"] < spec[0]["rounds"] / 2 and spec[2]["rounds"] == spec[0]["rounds"]
    want = {"ray_specserve_draft_lookups_total": sum(s["lookups"] for s in spec),
            "ray_specserve_draft_lookup_hits_total": round(sum(s["lookups"] * s["lookup_hit_rate"] for s in spec))}
    deadline = time.monotonic() + 30  # the router reports every 500 ms here
    while True:
        got = {name: _scrape(metrics_url, name, mode="suffix") - before[name] for name in names}
        if got == want or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got == want and want["ray_specserve_draft_lookup_hits_total"] > 0


def test_a_shared_prefix_is_reported_cached_counted_and_token_identical_in_every_mode(
        server, client, metrics_url, bundle_engine, heldout_prompts):
    """Per mode, after a reset: a cold request, then one sharing its ~300-token prefix,
    give the engine's tokens; usage reports the warm one's cached tokens (OpenAI's
    ``prompt_tokens_details.cached_tokens``, streamed too), and vLLM's counters on
    Prometheus add up to what the responses reported."""
    counters = ("ray_prefix_cache_queries_total", "ray_prefix_cache_hits_total")
    before = {name: _scrape(metrics_url, name) for name in counters}
    system = "\n".join(heldout_prompts[:3]) + "\n"
    queried = hit = 0
    for mode in MODES:
        reset = httpx.post(f"{server}/reset_prefix_cache", headers=AUTH, timeout=30)
        assert reset.status_code == 200 and reset.json()["status"] == "ok"
        responses = [_complete(client, system + question, mode) for question in heldout_prompts[5:7]]
        expected = [bundle_engine.generate(system + question, GenerationOptions(
            max_new_tokens=MAX_TOKENS, speculative_mode=mode)).token_ids for question in heldout_prompts[5:7]]
        assert [r.choices[0].model_extra["token_ids"] for r in responses] == expected, mode
        cold, warm = (r.usage.prompt_tokens_details.cached_tokens for r in responses)
        assert cold == 0 and warm >= 256, (mode, cold, warm)
        queried += sum(r.usage.prompt_tokens for r in responses)
        hit += warm
    messages = [{"role": "system", "content": system}, {"role": "user", "content": heldout_prompts[8]}]
    first = client.chat.completions.create(model="specserve", messages=messages, max_tokens=4, temperature=0)
    stream = client.chat.completions.create(model="specserve", messages=messages, max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True})
    last = list(stream)[-1].usage
    assert first.usage.prompt_tokens_details.cached_tokens == 0 and last.prompt_tokens_details.cached_tokens >= 256
    queried += first.usage.prompt_tokens + last.prompt_tokens
    hit += last.prompt_tokens_details.cached_tokens
    deadline = time.monotonic() + 30  # the router reports every 500 ms here
    while True:
        got = [_scrape(metrics_url, name) - before[name] for name in counters]
        if got == [queried, hit] or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert got == [queried, hit]
    status = httpx.get(f"{server}/specserve/status", headers=AUTH, timeout=30).json()
    assert status["prefix_cache"]["enabled"] and status["kv"]["cached_blocks"] > 0


def test_schemathesis_finds_no_server_errors(server):
    """A short property-based run against /openapi.json (the README has the long one)."""
    command = [sys.executable, "-m", "schemathesis.cli", "run", f"{server}/openapi.json", "--checks",
               "not_a_server_error", "--max-time", "12", "-n", "10", "-w", "1", "--request-timeout", "60",
               "--seed", "7", "-H", f"Authorization: Bearer {API_KEY}"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "passed" in result.stdout


def test_every_metric_the_grafana_dashboard_plots_is_exported(client, metrics_url, heldout_prompts):
    _complete(client, heldout_prompts[7], "mtp", max_tokens=8)
    _complete(client, heldout_prompts[7], "eagle3", max_tokens=8, adaptive=True)  # the chosen-draft-length histogram
    dashboard = (Path(__file__).resolve().parents[1] / "cluster/grafana-dashboard.json").read_text()
    plotted = set(re.findall(r"ray_[a-z_]+", dashboard))
    assert EVENT_ONLY_METRICS <= plotted  # else the exception below excuses nothing
    wanted = plotted - EVENT_ONLY_METRICS
    deadline = time.monotonic() + 30
    while True:
        exported = set(re.findall(r"^(ray_[a-z_]+)", httpx.get(metrics_url, timeout=10).text, re.MULTILINE))
        if wanted <= exported or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert wanted and wanted <= exported, sorted(wanted - exported)


def test_seeded_sampling_with_a_sampling_drafter_is_reproducible_and_complete(client, heldout_prompts):
    """Sampling with the draft model: its draft distributions travel to the target by
    ObjectRef for rejection sampling; a seed makes the whole request reproducible."""
    def sample(seed: int):
        return client.completions.create(model="specserve", prompt=heldout_prompts[8], max_tokens=24,
                                         temperature=0.8, top_p=0.95, seed=seed,
                                         extra_body={"speculative_mode": "draft_model", "return_token_ids": True,
                                                     "ignore_eos": True})
    first, again, other = sample(11), sample(11), sample(12)
    assert len(first.choices[0].model_extra["token_ids"]) == 24
    assert first.choices[0].model_extra["token_ids"] == again.choices[0].model_extra["token_ids"]
    assert first.choices[0].model_extra["token_ids"] != other.choices[0].model_extra["token_ids"]
    assert first.model_extra["speculative"]["draft_tokens"] > 0


SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "line": {"type": "string"}},
          "required": ["name", "line"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup", "description": "Find a symbol in a module",
                                           "parameters": {"type": "object", "properties": {
                                               "module": {"type": "string", "maxLength": 16},
                                               "depth": {"type": "integer", "minimum": 0, "maximum": 9}},
                                               "required": ["module", "depth"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "noop"}}]


def test_structured_output_through_the_server_is_the_engines_constrained_target_only_output(client, bundle_engine,
                                                                                          heldout_prompts):
    """response_format json_schema and vLLM's regex, per mode, streamed and not: the
    in-process engine's constrained target-only tokens."""
    from specserve.engine.grammar.spec import StructuredOutput

    prompt = heldout_prompts[9]
    for body, spec in (({"response_format": {"type": "json_schema", "json_schema": {"name": "line", "strict": True,
                                                                                   "schema": SCHEMA}}},
                        StructuredOutput.json_schema(SCHEMA)),
                       ({"structured_outputs": {"regex": r"\n        return [a-z_.()]+"}},
                        StructuredOutput.regex(r"\n        return [a-z_.()]+"))):
        expected = bundle_engine.generate(prompt, GenerationOptions(max_new_tokens=MAX_TOKENS, structured_output=spec,
                                                                    speculative_mode="none"))
        for mode in ("none", "draft_model", "eagle3"):
            extra = {**body, "speculative_mode": mode, "return_token_ids": True}  # completions: vLLM's extension
            request = dict(model="specserve", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, extra_body=extra)
            whole = client.completions.create(**request).choices[0]
            streamed = list(client.completions.create(stream=True, **request))
            assert whole.model_extra["token_ids"] == expected.token_ids, mode
            assert [t for c in streamed for t in c.choices[0].model_extra["token_ids"]] == expected.token_ids
            assert whole.text == "".join(c.choices[0].text for c in streamed) == expected.text
        if expected.finish_reason == "stop" and "response_format" in body:
            assert set(json.loads(expected.text)) == {"name", "line"}


def test_forced_required_and_auto_tool_calls_through_the_server_stream_in_openais_shape(client):
    messages = [{"role": "user", "content": "Look up the symbol 'join' in os.path."}]
    for choice, names in (({"type": "function", "function": {"name": "lookup"}}, ["lookup"]), ("required", None),
                          ("auto", None)):
        request = dict(model="specserve", messages=messages, max_tokens=60, temperature=0, tools=TOOLS,
                       tool_choice=choice, extra_body={"speculative_mode": "eagle3", "return_token_ids": True})
        whole = client.chat.completions.create(**request).choices[0]
        content, calls, finish, ids = stream_chat(client, **request)
        assert (whole.message.content or "") == content
        assert [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or ()] == \
            [(c["name"], c["arguments"]) for c in calls]
        assert whole.model_extra["token_ids"] == ids and whole.finish_reason == finish
        if names:
            assert [c.function.name for c in whole.message.tool_calls] == names
        if finish == "tool_calls":  # the grammar completed: every call's arguments are whole and valid
            for call in whole.message.tool_calls:
                arguments = json.loads(call.function.arguments)
                assert call.function.name in ("lookup", "noop") and isinstance(arguments, dict)
                assert call.id.startswith("call_")


@pytest.mark.parametrize("body, param, says", [
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "tool_choice", "response_format"),
    ({"tool_choice": "required"}, None, "tool_choice needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "missing"}}}, None, "missing"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}],
      "tool_choice": "required"}, "tools", "frobnicate"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "response_format"),
])
def test_bad_tool_requests_get_a_400_naming_the_problem(server, body, param, says):
    response = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, timeout=30, json={
        "model": "specserve", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and says in error["message"]

