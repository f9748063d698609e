"""Distributed server (Ray Serve, real HTTP) vs. the in-process engine, on the bundled models.

    .venv/bin/python bench/distributed.py [--modes none eagle3] [--new-tokens 64] [--streams 1 4 16] [--lanes 2]
        [--record DIR]

For each concurrency it runs that many streaming requests at once (held-out prompts,
greedy, EOS ignored) -- in-process through ``Engine.generate`` from threads (continuous
batching), distributed through the OpenAI streaming API on 127.0.0.1 -- and prints
aggregate tokens/s, mean time to first token and mean inter-token latency. Every
distributed output is checked token-for-token against the in-process one. The round
overhead is the extra wall time per round the distribution adds at one stream, broken
down from the router's tick timer and the workers' own timers (counter differences over
the one-stream run): outside the tick (HTTP/SSE, the router's loop), each hop (router
call minus the worker's time), the workers' object-store traffic and their model
compute. The in-process numbers are measured first, before Ray starts, so the two
never share the cores.
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

from bench import record  # noqa: E402
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
        body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
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


def snapshot(base_url: str, mode: str) -> dict[str, float]:
    """Cumulative timers: the router's ticks and the target's and ``mode``'s proposer's workers."""
    from urllib.request import urlopen

    from ray import serve

    from engine.speculative.proposers.registry import PROPOSER_KINDS

    status = json.loads(urlopen(f"{base_url}/specserve/status").read())
    target = serve.get_deployment_handle("TargetModel", "specserve").kv_usage.remote().result()
    out = {"ticks": status["ticks"], "rounds": status["sequence_rounds"], "tick_s": status["mean_tick_ms"] * status["ticks"] / 1000,
           "propose_s": status["mean_propose_ms"] * status["ticks"] / 1000,
           "target_s": status["mean_target_ms"] * status["ticks"] / 1000,
           "target_steps": target["steps"], "target_step_s": target["step_s"], "target_compute_s": target["compute_s"],
           "proposer_calls": 0, "proposer_s": 0.0, "proposer_compute_s": 0.0}
    kind = PROPOSER_KINDS.get(mode)
    if kind is not None and not kind.in_coordinator:
        stats = serve.get_deployment_handle(kind.deployment, "specserve").transport_stats.remote().result()
        out.update(proposer_calls=stats["calls"], proposer_s=stats["propose_s"], proposer_compute_s=stats["compute_s"])
    return out


def breakdown(before: dict, after: dict, round_ms: float) -> str:
    """Per-round milliseconds at one stream (one sequence per tick; with plain_steps > 1 a
    tick runs several of its rounds, and its costs are spread over them)."""
    d = {k: after[k] - before[k] for k in after}
    rounds = max(d["rounds"], 1)

    def ms(seconds: float) -> float:
        return 1000 * seconds / rounds

    tick = ms(d["tick_s"])
    parts = [f"round {round_ms:.1f} ms = outside the tick (HTTP/SSE, router loop) {round_ms - tick:.1f}",
             f"router->target hop {ms(d['target_s'] - d['target_step_s']):.1f}",
             f"target worker object store {ms(d['target_step_s'] - d['target_compute_s']):.1f}",
             f"target compute {ms(d['target_compute_s']):.1f}"]
    if d["proposer_calls"]:
        parts += [f"router->proposer hop {ms(d['propose_s'] - d['proposer_s']):.1f}",
                  f"proposer worker object store {ms(d['proposer_s'] - d['proposer_compute_s']):.1f}",
                  f"proposer compute {ms(d['proposer_compute_s']):.1f}"]
    else:
        parts.append(f"in-router drafting {ms(d['propose_s']):.1f}")
    other = tick - ms(d["propose_s"] + d["target_s"])
    parts.append(f"router tick bookkeeping {other:.1f}")
    return ", ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modes", nargs="+", default=["none", "eagle3"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--lanes", type=int, default=2)
    parser.add_argument("--target-threads", type=int, default=None, help="target onnxruntime threads (server)")
    parser.add_argument("--stream-interval", type=int, default=1, help="server: tokens per stream write")
    parser.add_argument("--stream-writes-per-s", type=float, default=250.0,
                        help="server: the router's stream-write budget (0 = none)")
    parser.add_argument("--plain-steps", type=int, default=None,
                        help="scheduler.plain_steps on both sides (default: the engine's)")
    parser.add_argument("--port", type=int, default=8311)
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "distributed", model=ROOT / "models/fixture"):
        run(args)


def run(args: argparse.Namespace) -> None:
    prompts = [p["prompt"] for p in json.loads((ROOT / "tests/data/heldout_prompts.json").read_text())]
    used = {prompts[i % len(prompts)] for i in range(max(args.streams) * args.requests_per_stream)}

    scheduler = {} if args.plain_steps is None else {"plain_steps": args.plain_steps}
    engine = Engine(ROOT / "models/fixture", EngineConfig(device="cpu", scheduler=scheduler))
    local, expected, solo = {}, {}, {}
    for mode in args.modes:
        run_local = in_process_runner(engine, GenerationOptions(max_new_tokens=args.new_tokens, ignore_eos=True,
                                                                speculative_mode=mode))
        run_local(prompts[0])  # warm-up
        local[mode] = {n: measure(run_local, prompts, n, args.requests_per_stream) for n in args.streams}
        expected[mode] = {p: run_local(p).token_ids for p in used}
        solo[mode] = statistics.mean(len(r.token_ids) / (r.stamps[-1] - r.started)
                                     for r in local[mode][1].results) if 1 in args.streams else None
    engine_plain_steps = engine.config.scheduler.plain_steps
    engine.close()  # stop its loop thread before the server takes the cores
    del engine

    import ray
    from ray import serve

    from cluster.local import serve_local, start_local_ray
    start_local_ray()
    serve_local({"model_dir": "models/fixture", "stream_interval": args.stream_interval,
                 "stream_writes_per_s": args.stream_writes_per_s or None, "engine": {
        "device": "cpu", "intra_op_threads": args.target_threads, "scheduler": {"lanes": args.lanes, **scheduler},
        "speculative": {"default_mode": "auto"}}}, port=args.port)
    base = f"http://127.0.0.1:{args.port}"
    remote, breakdowns, mismatches = {}, {}, 0
    for mode in args.modes:
        run_remote = server_runner(base, mode, args.new_tokens)
        for prompt in prompts[:4]:
            run_remote(prompt)  # warm-up: first calls pay connection and replica start-up costs
        remote[mode] = {}
        for n in args.streams:
            before = snapshot(base, mode) if n == 1 else None
            remote[mode][n] = measure(run_remote, prompts, n, args.requests_per_stream)
            if before is not None:
                breakdowns[mode] = breakdown(before, snapshot(base, mode), remote[mode][1].ms_per_round)
        mismatches += sum(r.token_ids != expected[mode][prompts[i % len(prompts)]]
                          for level in remote[mode].values() for i, r in enumerate(level.results))
    serve.shutdown()
    ray.shutdown()

    print(f"\n{args.new_tokens} new tokens per request, {args.requests_per_stream} requests per stream, lanes "
          f"{args.lanes}, stream interval {args.stream_interval}, write budget "
          f"{args.stream_writes_per_s or 'none'}/s, plain steps "
          f"{engine_plain_steps}; every distributed output token-identical to in-process: "
          f"{'yes' if mismatches == 0 else f'NO ({mismatches} differ)'}\n")
    print("| mode | streams | in-process tok/s | distributed tok/s | ratio | in-process TTFT / ITL ms "
          "| distributed TTFT / ITL ms |")
    print("|---|---|---|---|---|---|---|")
    for mode in args.modes:
        for n in args.streams:
            a, b = local[mode][n], remote[mode][n]
            print(f"| {mode} | {n} | {a.tokens_per_s:.1f} | {b.tokens_per_s:.1f} | "
                  f"{b.tokens_per_s / a.tokens_per_s:.2f}x | {a.ttft_ms:.1f} / {a.itl_ms:.2f} "
                  f"| {b.ttft_ms:.1f} / {b.itl_ms:.2f} |")
    for mode in args.modes:
        if 1 not in args.streams:
            break
        overhead = remote[mode][1].ms_per_round - local[mode][1].ms_per_round
        print(f"\n{mode}, one stream: in-process {local[mode][1].ms_per_round:.1f} ms per round, distributed "
              f"{remote[mode][1].ms_per_round:.1f} ms -> distribution adds {overhead:.1f} ms per round")
        print(f"  {breakdowns[mode]}")
        top = max(args.streams)
        print(f"  distributed aggregate at {top} streams {remote[mode][top].tokens_per_s:.1f} tok/s vs in-process "
              f"single-stream {solo[mode]:.1f} tok/s")


if __name__ == "__main__":
    main()
