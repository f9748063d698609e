"""Shared fixtures: the bundled models (committed under models/) and held-out prompts."""
from __future__ import annotations

import importlib.util
import json
import os
import socket
import threading
from contextlib import contextmanager
from pathlib import Path

import pytest

from specserve.engine import Engine, EngineConfig, SpeculativeConfig

ROOT = Path(__file__).resolve().parents[1]
# tests/convert needs torch, transformers and mobius-onnx, which live in the convert venv
# (scripts/test_convert.sh runs them there); specserve's own venv never has them.
collect_ignore = [] if importlib.util.find_spec("mobius") else ["convert"]
MODELS = Path(os.environ.get("SPECSERVE_TEST_MODELS", ROOT / "models/fixture"))  # override only to try a rebuild
TARGET_DIR = MODELS / "target"
DRAFT_DIR = MODELS / "draft"
# Two intra-op threads: the CI machine has two cores.
# Adaptive speculation off: most tests check the rounds' mechanics at a known k, and
# compare round counts between runs; the tests of adaptive speculation turn it on.
PINNED = SpeculativeConfig(adaptive=False)
CPU_CONFIG = EngineConfig(device="cpu", intra_op_threads=2, speculative=PINNED)


@pytest.fixture(scope="session")
def heldout_prompts() -> list[str]:
    return [p["prompt"] for p in json.loads((ROOT / "tests/data/heldout_prompts.json").read_text())]


@pytest.fixture(scope="session")
def target_engine() -> Engine:
    """The target alone (no proposers loaded besides model-free prompt lookup)."""
    with Engine(TARGET_DIR, CPU_CONFIG.model_copy(update={"speculative": SpeculativeConfig(load=(), adaptive=False)})) as engine:
        yield engine


@pytest.fixture(scope="session")
def bundle_engine() -> Engine:
    """The whole bundle: target, draft model and every head."""
    with Engine(MODELS, CPU_CONFIG) as engine:
        yield engine


@pytest.fixture(scope="session")
def default_engine() -> Engine:
    """The default model (SmolLM2-135M-Instruct, converted by scripts/install.sh): what
    ``Engine()`` serves with no argument."""
    with Engine(config=CPU_CONFIG) as engine:
        yield engine


@pytest.fixture(scope="session")
def default_model_server(tmp_path_factory) -> str:
    """The default model as the shipped ``serve_config.yaml`` serves it (every head, mode
    "auto", adaptive on), by ``serve run`` in its own process, started once for every test
    that reads it; yields its base URL. Those tests run last
    (``pytest_collection_modifyitems``), so this local Ray starts after every other test's
    has shut down: one local Ray at a time."""
    from .serve_run import serve_run_shipped_config

    with serve_run_shipped_config(tmp_path_factory.mktemp("serve_run"), free_port()) as url:
        yield url


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A stable sort: the order within each group stays pytest's own.
    # The default model's server last: one local Ray at a time.
    def server_order(item: pytest.Item) -> int:
        return 1 if "default_model_server" in getattr(item, "fixturenames", ()) else 0

    items.sort(key=server_order)


@pytest.fixture
def make_engine():
    """``make_engine(path, config)``: an engine of the test's own, closed after the test."""
    engines: list[Engine] = []

    def make(model_dir, config: EngineConfig) -> Engine:
        engines.append(Engine(model_dir, config))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def running_server(args: dict | None = None, env: dict[str, str] | None = None, **ray_options):
    """specserve on a fresh local Ray head (127.0.0.1); yields its base URL and shuts
    Ray down afterwards. ``args`` are merged into the defaults below, nested dicts key by
    key (``{"engine": {"scheduler": {...}}}`` keeps the device and default mode). ``env``
    is set before Ray starts (its workers inherit it)."""
    import ray
    from ray import serve

    from specserve.cluster.local import serve_local, start_local_ray

    def merged(base: dict, extra: dict) -> dict:
        out = dict(base)
        for key, value in extra.items():
            out[key] = merged(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) \
                else value
        return out

    defaults = {"model_dir": "models/fixture", "served_model_name": "specserve",
                "engine": {"device": "cpu", "speculative": {"default_mode": "eagle3", "adaptive": False}}}
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})
    try:
        start_local_ray(**ray_options)
        for attempt in range(3):
            # Picked once Ray runs, never at import; still, between picking a free port and
            # Serve's proxy binding it, one of Ray's own processes may take it (seen once in
            # CI: "Failed to bind to address"). Then pick another.
            port = free_port()
            try:
                serve_local(merged(defaults, args or {}), port=port)
                break
            except Exception as exc:  # noqa: BLE001 - Ray wraps the proxy's error
                if "Failed to bind" not in str(exc) or attempt == 2:
                    raise
                serve.shutdown()
        yield f"http://127.0.0.1:{port}"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        serve.shutdown()
        ray.shutdown()


def local_metrics_url() -> str:
    """Where the running local Ray serves Prometheus metrics. Ray picks the port as it
    starts its processes: a port picked here beforehand can be taken by one of Ray's own
    connections before its metrics agent binds it, and the node then never starts."""
    import ray

    (node,) = [node for node in ray.nodes() if node["Alive"]]
    return f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"


def generate_concurrently(engine: Engine, jobs) -> list:
    """One thread per (prompt, options[, on_token]); each job's result, or the exception
    it raised (None if it never returned)."""
    results: dict[int, object] = {}

    def run(i):
        try:
            results[i] = engine.generate(*jobs[i])
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    return [results.get(i) for i in range(len(jobs))]


def assert_everything_released(engine: Engine) -> None:
    """Every KV block back -- target pages, ledger reservations, draft pages -- and no
    worker still holding a sequence."""
    assert engine.drain()
    cache = engine.target.cache
    assert cache.free_blocks == cache.num_blocks
    usage = engine.transport.admission.usage()
    assert usage["free_blocks"] == usage["total_blocks"] == cache.num_blocks and usage["sequences"] == 0
    assert engine.transport.target.sequences == []
    assert all(worker.sequences == [] for worker in engine.transport.proposers.values())
    if engine.draft is not None:
        assert engine.draft.cache.free_blocks == engine.draft.cache.num_blocks


def stream_chat(client, **request):
    """A streamed chat reply put back together: content, tool calls (OpenAI's deltas
    accumulated by index), finish reason, token ids."""
    content, calls, finish, ids = "", {}, None, []
    for chunk in client.chat.completions.create(stream=True, **request):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": delta.id, "name": None, "arguments": ""})
            call["name"] = call["name"] or (delta.function.name if delta.function else None)
            call["arguments"] += (delta.function.arguments or "") if delta.function else ""
        finish = choice.finish_reason or finish
        ids += choice.model_extra.get("token_ids") or []
    return content, [calls[i] for i in sorted(calls)], finish, ids


def served_every_mode(url: str, engine: Engine, chats: list[list[dict]], streams: int, new_tokens: int) -> None:
    """Every mode of the default model through the server at ``url``, at one stream and
    at ``streams`` at once (modes mixed), each reply equal to ``engine``'s target-only
    one request at a time. Every client call carries a timeout."""
    from concurrent.futures import ThreadPoolExecutor

    import openai

    from specserve.engine import GenerationOptions
    from specserve.engine.model.default_model import DEFAULT_MODEL_NAME
    from specserve.engine.speculative.proposers.registry import PROPOSER_MODES

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=300)
    options = GenerationOptions(max_new_tokens=new_tokens, temperature=0, speculative_mode="none")
    expected = [engine.chat(c, options).token_ids for c in chats]
    modes = ("none", *PROPOSER_MODES)

    def ask(i: int) -> list[int]:
        response = client.chat.completions.create(
            model=DEFAULT_MODEL_NAME, messages=chats[i % len(chats)], max_tokens=new_tokens, temperature=0,
            extra_body={"speculative_mode": modes[i % len(modes)], "return_token_ids": True})
        return response.choices[0].model_extra["token_ids"]

    assert [ask(i) for i in range(len(modes))] == [expected[i % len(chats)] for i in range(len(modes))], "one stream"
    with ThreadPoolExecutor(streams) as pool:
        got = list(pool.map(ask, range(streams)))
    assert got == [expected[i % len(chats)] for i in range(streams)], f"{streams} streams"
