"""Distributed server (Ray Serve, real HTTP) vs. the in-process engine, on the bundled models.

    .venv/bin/python bench/distributed.py [--mode eagle3] [--new-tokens 64] [--streams 1 4 16] [--lanes 2]

For each concurrency it runs that many streaming requests at once (held-out prompts,
greedy, EOS ignored) -- in-process through ``Engine.generate`` from threads (continuous
batching), distributed through the OpenAI streaming API on 127.0.0.1 -- and prints
aggregate tokens/s, mean time to first token and mean inter-token latency. Every
distributed output is checked token-for-token against the in-process one. The round
overhead is the extra wall time per round the distribution adds at one stream. The
in-process numbers are measured first, before Ray starts, so the two never share the
cores.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from engine import Engine, EngineConfig, GenerationOptions  # noqa: E402


@dataclass
class StreamResult:
    token_ids: list[int]
    started: float
    stamps: list[float]   # arrival time of each token
    rounds: int

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.started

    @property
    def itl(self) -> float:
        return (self.stamps[-1] - self.stamps[0]) / max(1, len(self.stamps) - 1)


@dataclass
class Level:
    streams: int
    tokens_per_s: float
    ttft_ms: float
    itl_ms: float
    ms_per_round: float
    results: list[StreamResult]


def measure(run_one, prompts: list[str], streams: int, rounds_per_level: int) -> Level:
    jobs = [prompts[i % len(prompts)] for i in range(streams * rounds_per_level)]
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(run_one, jobs))
    elapsed = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for r in results)
    one = [r for r in results]
    return Level(streams, tokens / elapsed, 1000 * statistics.mean(r.ttft for r in one),
                 1000 * statistics.mean(r.itl for r in one),
                 1000 * statistics.mean((r.stamps[-1] - r.started) / max(1, r.rounds + 1) for r in one), results)


def in_process_runner(engine: Engine, options: GenerationOptions):
    def run(prompt: str) -> StreamResult:
        stamps: list[float] = []
        started = time.perf_counter()
        result = engine.generate(prompt, options, on_token=lambda event: stamps.append(time.perf_counter()))
        return StreamResult(result.token_ids, started, stamps, result.speculative.verification_steps)
    return run


def server_runner(base_url: str, mode: str, new_tokens: int):
    import httpx

    client = httpx.Client(timeout=300, limits=httpx.Limits(max_connections=64))

    def run(prompt: str) -> StreamResult:
        body = {"model": "specserve", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "speculative_mode": mode, "return_token_ids": True}
        ids, stamps, rounds = [], [], 0
        started = time.perf_counter()
        with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            response.raise_for_status()
            for line in response.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("speculative"):
                    rounds = chunk["speculative"]["rounds"]
                for choice in chunk.get("choices", []):
                    for token in choice.get("token_ids", []):
                        ids.append(token)
                        stamps.append(time.perf_counter())
        return StreamResult(ids, started, stamps, rounds)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", default="eagle3")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--lanes", type=int, default=2)
    parser.add_argument("--target-threads", type=int, default=None, help="target onnxruntime threads (server)")
    parser.add_argument("--port", type=int, default=8311)
    args = parser.parse_args()
    prompts = [p["prompt"] for p in json.loads((ROOT / "tests/data/heldout_prompts.json").read_text())]
    options = GenerationOptions(max_new_tokens=args.new_tokens, ignore_eos=True, speculative_mode=args.mode)

    engine = Engine(ROOT / "models", EngineConfig(device="cpu"))
    run_local = in_process_runner(engine, options)
    run_local(prompts[0])  # warm-up
    local = {n: measure(run_local, prompts, n, args.requests_per_stream) for n in args.streams}
    expected = {p: run_local(p).token_ids for p in {prompts[i % len(prompts)]
                                                   for i in range(max(args.streams) * args.requests_per_stream)}}
    solo_tokens_per_s = statistics.mean(len(r.token_ids) / (r.stamps[-1] - r.started) for r in local[1].results) \
        if 1 in local else None
    engine.close()  # stop its loop thread before the server takes the cores
    del engine

    import ray
    from ray import serve

    from cluster.local import serve_local, start_local_ray
    start_local_ray()
    serve_local({"model_dir": "models", "engine": {
        "device": "cpu", "intra_op_threads": args.target_threads, "scheduler": {"lanes": args.lanes},
        "speculative": {"default_mode": args.mode}}}, port=args.port)
    base = f"http://127.0.0.1:{args.port}"
    run_remote = server_runner(base, args.mode, args.new_tokens)
    for prompt in prompts[:4]:
        run_remote(prompt)  # warm-up: first calls pay connection and replica start-up costs
    remote = {n: measure(run_remote, prompts, n, args.requests_per_stream) for n in args.streams}
    mismatches = sum(r.token_ids != expected[prompts[i % len(prompts)]]
                     for level in remote.values() for i, r in enumerate(level.results))
    status = json.loads(__import__("urllib.request").request.urlopen(f"{base}/specserve/status").read())
    serve.shutdown()
    ray.shutdown()

    print(f"\nmode {args.mode}, {args.new_tokens} new tokens per request, {args.requests_per_stream} requests per "
          f"stream, lanes {args.lanes}; every distributed output token-identical to in-process: "
          f"{'yes' if mismatches == 0 else f'NO ({mismatches} differ)'}\n")
    print("| streams | in-process tok/s | distributed tok/s | ratio | in-process TTFT / ITL ms "
          "| distributed TTFT / ITL ms |")
    print("|---|---|---|---|---|---|")
    for n in args.streams:
        a, b = local[n], remote[n]
        print(f"| {n} | {a.tokens_per_s:.1f} | {b.tokens_per_s:.1f} | {b.tokens_per_s / a.tokens_per_s:.2f}x "
              f"| {a.ttft_ms:.1f} / {a.itl_ms:.2f} | {b.ttft_ms:.1f} / {b.itl_ms:.2f} |")
    if 1 in args.streams:
        overhead = remote[1].ms_per_round - local[1].ms_per_round
        print(f"\nround time at 1 stream: in-process {local[1].ms_per_round:.1f} ms, distributed "
              f"{remote[1].ms_per_round:.1f} ms -> distribution adds {overhead:.1f} ms per round")
        top = max(args.streams)
        print(f"goal: distributed aggregate at {top} streams {remote[top].tokens_per_s:.1f} tok/s vs in-process "
              f"single-stream {solo_tokens_per_s:.1f} tok/s -> "
              f"{'met' if remote[top].tokens_per_s >= solo_tokens_per_s else 'not met'}")
    print(f"router tick breakdown (all levels): mean tick {status['mean_tick_ms']:.1f} ms = propose "
          f"{status['mean_propose_ms']:.1f} + target {status['mean_target_ms']:.1f}; "
          f"{status['sequence_rounds'] / max(status['ticks'], 1):.1f} sequences per tick")


if __name__ == "__main__":
    main()
