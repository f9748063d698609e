"""Soak test: sustained concurrent streaming load on the server, checked for correctness and leaks.

    .venv/bin/python bench/soak.py [--url http://127.0.0.1:8000] [--concurrency 64] [--minutes 5] [--max-tokens 48]
        [--modes none,prompt_lookup,draft_model,mtp,eagle3,shared_kv] [--check-fraction 1.0]
        [--shared-prefix] [--start-server] [--port 8000] [--json PATH] [--record DIR]

A short benchmark shows speed; a soak shows what only long, mixed load shows: requests
that fail under pressure, outputs that drift when many sequences share a batch, KV
blocks that are never given back. ``--concurrency`` worker threads each send greedy
streaming completions back to back until the time is up, taking (mode, prompt)
round-robin: request i uses mode i % len(modes) and prompt (i // len(modes)) % prompts,
so a full cycle sends every prompt in every mode. EOS is ignored, so every request asks
for exactly ``--max-tokens`` tokens. ``--shared-prefix`` starts every prompt with the same
~150 tokens, as a system prompt would, so most of each prefill comes from the prefix
cache (and, on a small pool, its blocks are evicted and re-made under load).

Correctness: speculation is lossless, so the greedy output of every mode must equal the
target-only output of the in-process engine. Those reference token ids are computed once
per prompt before the load starts (``--check-fraction`` checks an evenly spread subset of
the prompts). Leaks: the KV free-block count from ``/specserve/status`` is read before the
load and, once no sequence is left (up to 30 s, releases trail the last token), after it
(cached prefix blocks count as free: no sequence holds them). The prompt tokens found in
the prefix cache over the run are printed too.

Latencies printed: TTFT (send -> first token), inter-token latency per token (a round's
tokens arrive in one write and share an arrival time, so the gaps inside a write are 0
and are counted), inter-token latency per write (gap between successive arrivals that
carried tokens; an arrival is one network read on the client, normally one server write,
i.e. one speculative round), and end-to-end. Exit code 1 on any error, identity failure
or KV blocks that did not come back.

Only a server on this machine is targeted (127.0.0.1, localhost or ::1); ``--start-server``
starts a local Ray head with the application on the bundled models and shuts it down after.
"""
from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record
from specserve.engine import Engine, EngineConfig, GenerationOptions, SpeculativeConfig
from specserve.engine.options import SPECULATIVE_MODES

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
KV_SETTLE_S = 30.0
REQUEST_TIMEOUT_S = 120.0
REFERENCE_THREADS = 16  # concurrent in-process requests: the engine batches them
_REFERENCE_CACHE: dict[tuple[str, int], list[int]] = {}  # (prompt, max_tokens) -> target-only greedy token ids


@dataclass
class RequestRecord:
    mode: str
    prompt_index: int
    sent: float
    ended: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    token_stamps: list[float] = field(default_factory=list)  # arrival time of each token
    write_stamps: list[float] = field(default_factory=list)  # arrival time of each read that carried tokens
    error: str | None = None


def load_prompts(shared_prefix: bool = False) -> list[str]:
    """The held-out prompts; with ``shared_prefix``, each after the same text: the last
    two of them, joined (~150 tokens of the fixture's tokenizer)."""
    prompts = [p["prompt"] for p in json.loads((ROOT / "tests/data/heldout_prompts.json").read_text())]
    if not shared_prefix:
        return prompts
    prefix = "\n".join(prompts[-2:]) + "\n"
    return [prefix + p for p in prompts]


def checked_indices(count: int, fraction: float) -> set[int]:
    """floor(count * fraction) prompt indices, spread evenly over the pool."""
    return {i for i in range(count) if math.floor((i + 1) * fraction) > math.floor(i * fraction)}


def reference_token_ids(prompts: list[str], max_tokens: int) -> dict[str, list[int]]:
    """Target-only greedy output of the in-process engine, cached per (prompt, max_tokens)."""
    missing = sorted({p for p in prompts if (p, max_tokens) not in _REFERENCE_CACHE})
    if missing:
        # Not spinning: the server under test shares these cores. Closed after, so its loop
        # thread (and the models it holds) do not outlive the references.
        with Engine(ROOT / "models/fixture", EngineConfig(device="cpu", thread_spinning=False,
                                                  speculative=SpeculativeConfig(load=()))) as engine:
            options = GenerationOptions(max_new_tokens=max_tokens, ignore_eos=True, speculative_mode="none")
            with ThreadPoolExecutor(REFERENCE_THREADS) as pool:
                for prompt, ids in zip(missing, pool.map(lambda p: engine.generate(p, options).token_ids, missing)):
                    _REFERENCE_CACHE[(prompt, max_tokens)] = ids
    return {p: _REFERENCE_CACHE[(p, max_tokens)] for p in prompts}


def check_loopback(url: str) -> None:
    host = urlsplit(url).hostname
    if host not in LOOPBACK_HOSTS:
        raise ValueError(f"refusing to load {url!r}: the soak only targets a server on this machine "
                         f"(host one of {', '.join(LOOPBACK_HOSTS)}), got host {host!r}")


def stream_one(client: httpx.Client, url: str, prompt: str, prompt_index: int, mode: str,
               max_tokens: int) -> RequestRecord:
    """One greedy streaming completion, timed per token and per arrival; failures land in ``error``."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True, "speculative_mode": mode, "return_token_ids": True}
    record = RequestRecord(mode, prompt_index, time.perf_counter())
    try:
        with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"HTTP {response.status_code}: {response.read().decode(errors='replace')[:200]}"
                return record
            buffer, done = b"", False
            for data in response.iter_bytes():
                arrived = time.perf_counter()
                *events, buffer = (buffer + data).split(b"\n\n")
                new_tokens = 0
                for event in map(bytes.strip, events):
                    if not event.startswith(b"data: "):
                        continue
                    payload = event[len(b"data: "):]
                    if payload == b"[DONE]":
                        done = True
                        continue
                    chunk = json.loads(payload)
                    if "error" in chunk and record.error is None:
                        record.error = f"error chunk: {chunk['error'].get('message', chunk['error'])}"
                    for choice in chunk.get("choices", []):
                        ids = choice.get("token_ids", [])
                        record.token_ids += ids
                        new_tokens += len(ids)
                if new_tokens:
                    record.token_stamps += [arrived] * new_tokens
                    record.write_stamps.append(arrived)
            if not done and record.error is None:
                record.error = "stream ended without [DONE]"
    except Exception as exc:  # noqa: BLE001 - any failure under load is a finding, not a crash
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        record.ended = time.perf_counter()
    return record


def read_status(client: httpx.Client, url: str) -> dict:
    response = client.get(f"{url}/specserve/status")
    response.raise_for_status()
    return response.json()


def read_kv(client: httpx.Client, url: str) -> dict:
    return read_status(client, url)["kv"]


def settled_kv(client: httpx.Client, url: str, timeout_s: float = KV_SETTLE_S) -> dict:
    """Poll until no sequence holds KV (releases trail a request's last token) or the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        kv = read_kv(client, url)
        if kv["sequences"] == 0 or time.monotonic() > deadline:
            return kv
        time.sleep(0.2)


def _percentiles_ms(values_s: list[float], qs: tuple[int, ...]) -> dict[str, float | None]:
    if not values_s:
        return {f"p{q}": None for q in qs}
    return {f"p{q}": float(v) for q, v in zip(qs, np.percentile(np.asarray(values_s) * 1000, qs))}


def run_soak(url: str, concurrency: int, seconds: float, max_tokens: int, modes: list[str] | tuple[str, ...],
             check_fraction: float, shared_prefix: bool = False) -> dict:
    """Load ``url`` for ``seconds`` from ``concurrency`` threads; return the summary (see ``format_summary``)."""
    check_loopback(url)
    if not 0.0 <= check_fraction <= 1.0:
        raise ValueError(f"check_fraction must be in [0, 1], got {check_fraction}")
    modes = list(modes)
    url = url.rstrip("/")
    prompts = load_prompts(shared_prefix)
    checked = checked_indices(len(prompts), check_fraction)
    limits = httpx.Limits(max_connections=concurrency + 1, max_keepalive_connections=concurrency + 1)
    with httpx.Client(timeout=httpx.Timeout(REQUEST_TIMEOUT_S, connect=10.0), limits=limits,
                      trust_env=False) as client:
        status_start = read_status(client, url)  # first: an unreachable server fails before the references are built
        kv_start = status_start["kv"]
        expected = reference_token_ids([prompts[i] for i in sorted(checked)], max_tokens)
        counter = itertools.count()  # next() on a count is atomic under the GIL: a shared round-robin ticket
        started = time.perf_counter()
        deadline = started + seconds

        def worker(_: int) -> list[RequestRecord]:
            records = []
            while time.perf_counter() < deadline:
                i = next(counter)
                index = (i // len(modes)) % len(prompts)
                records.append(stream_one(client, url, prompts[index], index, modes[i % len(modes)], max_tokens))
            return records

        with ThreadPoolExecutor(concurrency) as pool:
            records = [r for rs in pool.map(worker, range(concurrency)) for r in rs]
        duration = time.perf_counter() - started
        kv_end = settled_kv(client, url)
        cache_start, cache_end = status_start["prefix_cache"], read_status(client, url)["prefix_cache"]

    failed = [r for r in records if r.error is not None]
    done = [r for r in records if r.error is None]
    identity_failures = []
    for r in done:
        want = expected[prompts[r.prompt_index]] if r.prompt_index in checked else None
        if want is not None and r.token_ids != want:
            first = next((k for k, (a, b) in enumerate(zip(r.token_ids, want)) if a != b),
                         min(len(r.token_ids), len(want)))
            identity_failures.append(f"{r.mode} prompt #{r.prompt_index}: first difference at token {first} "
                                     f"(got {len(r.token_ids)} tokens, expected {len(want)})")
    tokens = sum(len(r.token_ids) for r in done)
    ttft = [r.token_stamps[0] - r.sent for r in done if r.token_stamps]
    itl_token = [b - a for r in done for a, b in itertools.pairwise(r.token_stamps)]
    itl_write = [b - a for r in done for a, b in itertools.pairwise(r.write_stamps)]
    kv_returned = kv_end["free_blocks"] == kv_start["free_blocks"] and kv_end["sequences"] == 0
    return {
        "url": url, "concurrency": concurrency, "seconds": seconds, "max_tokens": max_tokens, "modes": modes,
        "prompts": len(prompts), "duration_s": duration,
        "requests_completed": len(done), "requests_per_s": len(done) / duration,
        "output_tokens_per_s": tokens / duration,
        "completed_by_mode": {m: sum(r.mode == m for r in done) for m in modes},
        "errors": len(failed), "error_samples": [f"{r.mode} prompt #{r.prompt_index}: {r.error}" for r in failed[:3]],
        "identity_checked": sum(r.prompt_index in checked for r in done),
        "identity_failures": len(identity_failures), "identity_failure_samples": identity_failures[:3],
        "ttft_ms": _percentiles_ms(ttft, (50, 90, 99)),
        "itl_per_token_ms": _percentiles_ms(itl_token, (50, 90, 99)),
        "itl_per_write_ms": _percentiles_ms(itl_write, (50, 90, 99)),
        "e2e_ms": _percentiles_ms([r.ended - r.sent for r in done], (50, 99)),
        "kv": {"total_blocks": kv_start["total_blocks"], "free_blocks_start": kv_start["free_blocks"],
               "free_blocks_end": kv_end["free_blocks"], "sequences_end": kv_end["sequences"],
               "cached_blocks_end": kv_end["cached_blocks"], "returned": kv_returned},
        "prefix_cache": {key: cache_end[key] - cache_start[key] for key in ("queried_tokens", "hit_tokens")},
        "ok": not failed and not identity_failures and kv_returned,
    }


def format_summary(s: dict) -> str:
    def row(values: dict[str, float | None]) -> str:
        return "  ".join(f"{k} {'n/a' if v is None else f'{v:.1f}'}" for k, v in values.items())

    kv = s["kv"]
    lines = [
        (f"soak against {s['url']}: {s['duration_s']:.1f} s, concurrency {s['concurrency']}, "
         f"max_tokens {s['max_tokens']} (EOS ignored), {s['prompts']} prompts, modes {','.join(s['modes'])}"),
        (f"  requests completed   {s['requests_completed']} ({s['requests_per_s']:.2f}/s), "
         f"output {s['output_tokens_per_s']:.1f} tok/s"),
        "  per mode             " + ", ".join(f"{m} {n}" for m, n in s["completed_by_mode"].items()),
        f"  errors               {s['errors']}",
        *(f"    {e}" for e in s["error_samples"]),
        f"  identity failures    {s['identity_failures']} (of {s['identity_checked']} checked against the engine)",
        *(f"    {e}" for e in s["identity_failure_samples"]),
        f"  TTFT ms              {row(s['ttft_ms'])}",
        f"  ITL ms per token     {row(s['itl_per_token_ms'])}   (tokens of one write share an arrival: 0 gaps counted)",
        f"  ITL ms per write     {row(s['itl_per_write_ms'])}   (gap between arrivals that carried tokens)",
        f"  end-to-end ms        {row(s['e2e_ms'])}",
        (f"  KV free blocks       {kv['free_blocks_start']} -> {kv['free_blocks_end']} of {kv['total_blocks']} "
         f"({kv['cached_blocks_end']} of them keeping cached prefixes), {kv['sequences_end']} sequences left: "
         f"{'all returned' if kv['returned'] else 'NOT RETURNED'}"),
        (f"  prefix cache         {s['prefix_cache']['hit_tokens']} of {s['prefix_cache']['queried_tokens']} prompt "
         f"tokens found cached"),
        f"  result               {'PASS' if s['ok'] else 'FAIL'}",
    ]
    return "\n".join(lines)


def _modes(text: str) -> list[str]:
    modes = [m.strip() for m in text.split(",") if m.strip()]
    unknown = [m for m in modes if m not in SPECULATIVE_MODES]
    if not modes or unknown:
        raise argparse.ArgumentTypeError(f"modes must be a comma list of {', '.join(SPECULATIVE_MODES)}")
    return modes


@contextmanager
def local_server(port: int) -> Iterator[str]:
    """specserve on a fresh local Ray head (127.0.0.1, bundled models, CPU); shut down on exit."""
    import ray
    from ray import serve

    from specserve.cluster.local import serve_local, start_local_ray

    start_local_ray()
    try:
        serve_local({"model_dir": "models/fixture", "engine": {"device": "cpu", "speculative": {"default_mode": "eagle3"}}},
                    port=port)
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="server to load (loopback only)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--modes", type=_modes, default=list(SPECULATIVE_MODES))
    parser.add_argument("--check-fraction", type=float, default=1.0, help="share of prompts checked for identity")
    parser.add_argument("--shared-prefix", action="store_true", help="every prompt after the same ~150 tokens")
    parser.add_argument("--start-server", action="store_true", help="start Ray + specserve here, on --port")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--json", type=Path, default=None, help="also write the summary as JSON here")
    record.add_option(parser)
    args = parser.parse_args(argv)
    if not 0.0 <= args.check_fraction <= 1.0:
        parser.error(f"--check-fraction must be in [0, 1], got {args.check_fraction}")
    if not args.start_server:
        try:
            check_loopback(args.url)
        except ValueError as exc:
            parser.error(str(exc))
    with record.recording(args.record, "soak", model=ROOT / "models/fixture" if args.start_server else None):
        with local_server(args.port) if args.start_server else nullcontext(args.url) as url:
            try:
                summary = run_soak(url, args.concurrency, args.minutes * 60, args.max_tokens, args.modes,
                                   args.check_fraction, args.shared_prefix)
            except httpx.HTTPError as exc:  # /specserve/status unreachable: no server there
                parser.exit(2, f"{parser.prog}: cannot read {url}/specserve/status: {type(exc).__name__}: {exc}\n")
        print(format_summary(summary), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
