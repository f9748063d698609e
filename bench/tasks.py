"""The task suite: every speculative mode on what users send, against target-only.

    .venv/bin/python bench/tasks.py [--modes none prompt_lookup suffix eagle3 ...] [--target-format exact]
        [--new-tokens 128] [--streams 1 32] [--repeats 3] [--threads 2] [--served] [--record DIR]

Prompts come from ``bench/data/task_suite.json``, written for this bench (no test reads
them), in three kinds:
- grounded: code edits, renames, refactors, extraction, quoting, rewriting, JSON from
  text, questions over a given passage -- answers that reuse their input;
- agentic: loops under one system prompt and tool list, similar requests in a row, each
  tool result fed back; every turn's history holds target-only's earlier replies;
- chat: open questions.

Greedy, EOS honoured, the engine's defaults (adaptive speculation). Requests run in the
suite's order, each in every mode, the modes' order rotating from request to request
(one interleaved run). Before every timed request the prefix cache is reset; the suffix
cache is reset once after the warm-up, so a suffix-mode request drafts only from its own
tokens and the earlier requests' outputs -- never from its own earlier output. Speed is
decode tokens/s (first token to last) summed over a kind's requests (at several streams:
a kind's tokens over the seconds its requests were decoding, summed); tau is tokens
committed per target pass; every output is checked against target-only's. At N > 1
streams (``--streams``, default 1 then 32) the suite's requests run N at a time, every
mode on the same batches. ``--served`` then runs the one-stream suite again through the
server (a local Ray, the same bundle and format, the official chat endpoint streamed),
its prefix cache reset before every request and its suffix cache after its warm-up, every
output checked against in-process target-only's.
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record, sse  # noqa: E402
from specserve.engine import Engine, EngineConfig, GenerationOptions, GenerationResult  # noqa: E402
from specserve.engine.speculative.stats import SpeculativeStats  # noqa: E402

SUITE = ROOT / "bench/data/task_suite.json"
KINDS = ("grounded", "agentic", "chat")


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    requests: int = 0
    identical: int = 0
    stats: SpeculativeStats = field(default_factory=SpeculativeStats)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def grounded_and_chat(suite: dict, kind: str) -> list[list[dict]]:
    return [[{"role": "user", "content": task["prompt"]}] for task in suite[kind]]


def run_one(engine: Engine, messages: list[dict], mode: str, new_tokens: int):
    engine.reset_prefix_cache()
    return engine.chat(messages, GenerationOptions(max_new_tokens=new_tokens, temperature=0, speculative_mode=mode))


def run_many(engine: Engine, chats: list[list[dict]], mode: str, new_tokens: int) -> tuple[list, float]:
    """``chats`` at once, one thread each (the engine batches them); their results and
    the seconds from the first submission to the last reply."""
    engine.reset_prefix_cache()
    results: list = [None] * len(chats)
    started = time.perf_counter()

    def run(i: int) -> None:
        results[i] = engine.chat(chats[i], GenerationOptions(max_new_tokens=new_tokens, temperature=0,
                                                             speculative_mode=mode))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(chats))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=600)
    return results, time.perf_counter() - started


def add(tally: Tally, result, expected: list[int]) -> None:
    tally.tokens += result.completion_tokens - 1
    tally.seconds += result.decode_seconds
    tally.requests += 1
    tally.identical += result.token_ids == expected
    tally.stats.merge(result.speculative)


def rotated(modes: list[str], n: int) -> list[str]:
    shift = n % len(modes)
    return modes[shift:] + modes[:shift]


def one_stream(run: Callable[[list[dict], str], "Reply"], suite: dict, modes: list[str],
               expected_of: Callable[[list[dict]], list[int]] | None = None) -> dict[str, dict[str, Tally]]:
    """Every request in every mode, one at a time, through ``run(messages, mode)``; each
    output checked against target-only's (``expected_of(messages)``, else this run's)."""
    tallies: dict[str, dict[str, Tally]] = {kind: defaultdict(Tally) for kind in KINDS}
    counter = 0

    def each_mode(kind: str, messages: list[dict]) -> "Reply":
        nonlocal counter
        results = {}
        for mode in rotated(modes, counter):
            results[mode] = run(messages, mode)
        counter += 1
        expected = expected_of(messages) if expected_of else results["none"].token_ids
        for mode, result in results.items():
            add(tallies[kind][mode], result, expected)
        print(f"  {kind:9s} {counter:3d}: {len(expected)} tokens, "
              + ", ".join(f"{m} {r.speculative.mean_accepted_length:.2f}" for m, r in results.items()),
              file=sys.stderr)
        return results["none"]

    for messages in grounded_and_chat(suite, "grounded"):
        each_mode("grounded", messages)
    agentic_requests(suite, lambda history: each_mode("agentic", history))
    for messages in grounded_and_chat(suite, "chat"):
        each_mode("chat", messages)
    return tallies


@dataclass
class ServedReply:
    """What the tallies and the agentic loops read of a served reply."""

    text: str
    token_ids: list[int]
    decode_seconds: float        # first token to last, as the client saw them arrive
    speculative: SpeculativeStats

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


Reply = GenerationResult | ServedReply


def served_runner(base: str, new_tokens: int) -> Callable[[list[dict], str], ServedReply]:
    """One streamed chat completion per call, with the official request fields and
    vLLM's ``return_token_ids``; the prefix cache reset first."""
    import httpx

    client = httpx.Client(timeout=300)

    def run(messages: list[dict], mode: str) -> ServedReply:
        client.post(f"{base}/reset_prefix_cache").raise_for_status()
        body = {"messages": messages, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                "speculative_mode": mode, "return_token_ids": True}
        text, ids, stamps, spec = "", [], [], {}
        with client.stream("POST", f"{base}/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for chunk in sse.chunks(response):
                spec = chunk.get("speculative") or spec
                for choice in chunk.get("choices", []):
                    text += choice["delta"].get("content") or ""
                    ids += choice.get("token_ids") or []
                    stamps += [time.perf_counter()] * len(choice.get("token_ids") or [])
        rounds = spec.get("rounds", 0)
        stats = SpeculativeStats(mode=mode, verification_steps=rounds,
                                 committed_tokens=round(spec.get("mean_accepted_length", 0) * rounds),
                                 lookups=spec.get("lookups", 0),
                                 lookup_hits=round(spec.get("lookup_hit_rate", 0) * spec.get("lookups", 0)))
        return ServedReply(text, ids, stamps[-1] - stamps[0] if stamps else 0.0, stats)
    return run


def served_suite(args: argparse.Namespace, engine: Engine, suite: dict, modes: list[str]) -> None:
    """The one-stream suite through a local server; outputs checked against in-process
    target-only's on the same messages."""
    import httpx
    import ray
    from ray import serve

    from specserve.cluster.local import serve_local, start_local_ray

    start_local_ray()
    base = f"http://127.0.0.1:{args.port}"
    try:
        serve_local({"model_dir": str(engine.bundle.directory), "engine": {
            "device": "cpu", "intra_op_threads": args.threads, "target_format": args.target_format}}, port=args.port)
        run = served_runner(base, args.new_tokens)
        for mode in modes:  # warm-up, on text outside the suite
            run([{"role": "user", "content": "Say hello."}], mode)
        httpx.post(f"{base}/reset_suffix_cache", timeout=30).raise_for_status()
        print(f"task suite served: {args.target_format} format, greedy, EOS honoured, at most {args.new_tokens} "
              f"tokens, 1 stream, through the server; identity against in-process target-only\n")
        expected: dict[str, list[int]] = {}

        def in_process(messages: list[dict]) -> list[int]:
            key = json.dumps(messages)
            if key not in expected:
                expected[key] = run_one(engine, messages, "none", args.new_tokens).token_ids
            return expected[key]
        report(one_stream(run, suite, modes, in_process), modes)
    finally:
        serve.shutdown()
        ray.shutdown()


def many_streams(engine: Engine, suite: dict, modes: list[str], new_tokens: int,
                 streams: int, repeats: int = 1) -> dict[str, dict[str, Tally]]:
    """Every request of the suite, ``streams`` at a time, each mode on the same batches
    (the modes' order rotating from batch to batch), each batch ``repeats`` times in every
    mode, the order rotating again each time. The suite's requests are distinct,
    so no request shares a batch with a copy of itself; the suffix cache is reset before
    every mode's batch. The agentic loops need target-only's replies for their history:
    their turns are built at one stream first (untimed)."""
    tallies: dict[str, dict[str, Tally]] = {kind: defaultdict(Tally) for kind in (*KINDS, "all (wall clock)")}
    requests = [("grounded", c) for c in grounded_and_chat(suite, "grounded")]
    requests += [("agentic", c) for c in agentic_requests(suite, lambda h: run_one(engine, h, "none", new_tokens))]
    requests += [("chat", c) for c in grounded_and_chat(suite, "chat")]
    # Untimed: the first calls at this width pay for their shapes (a cold one ran 0.65x), and
    # the first batch decoded to full length pays for onnxruntime's buffers growing to its
    # longest pasts: timed, whichever mode ran first lost a quarter of its speed (24.4 s
    # against 33.0 s for the same 32 target-only requests, back to back).
    run_many(engine, [chat for _, chat in requests[:streams]], "none", new_tokens)
    for mode in modes:
        run_many(engine, [chat for _, chat in requests[:streams]], mode, 8)
    turn = 0
    for n, start in enumerate(range(0, len(requests), streams)):
        batch = requests[start:start + streams]
        for _ in range(repeats):
            results, walls = {}, {}
            for mode in rotated(modes, turn):
                engine.reset_suffix_cache()
                results[mode], walls[mode] = run_many(engine, [chat for _, chat in batch], mode, new_tokens)
            turn += 1
            for mode, got in results.items():
                whole = tallies["all (wall clock)"][mode]
                for (kind, _), result, expected in zip(batch, got, results["none"]):
                    add(tallies[kind][mode], result, expected.token_ids)
                    add(whole, result, expected.token_ids)
                whole.seconds += walls[mode] - sum(r.decode_seconds for r in got)  # the batch's wall clock
            print(f"  batch {n + 1}: {len(batch)} streams done", file=sys.stderr)
    return tallies


def agentic_requests(suite: dict, answer: Callable[[list[dict]], GenerationResult]) -> list[list[dict]]:
    """Every agentic request in order, each history ending in a user message: a loop's
    turns, with ``answer``'s reply to each (target-only's: every mode's is the same) and
    the tool result fed back."""
    requests = []
    for loop in suite["agentic"]:
        history = [{"role": "system", "content": loop["system"]}]
        for turn in loop["turns"]:
            history.append({"role": "user", "content": turn["user"]})
            requests.append(list(history))
            history += [{"role": "assistant", "content": answer(history).text},
                        {"role": "user", "content": f"Tool result: {turn['tool_result']}"}]
            requests.append(list(history))
            history.append({"role": "assistant", "content": answer(history).text})
    return requests


def report(tallies: dict[str, dict[str, Tally]], modes: list[str]) -> None:
    print("| kind | mode | requests | tau | hit rate | decode tok/s | vs target-only | identical |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for kind in tallies:
        base = tallies[kind]["none"].rate
        for mode in modes:
            t = tallies[kind][mode]
            hits = f"{t.stats.hit_rate:.2f}" if t.stats.lookups else "-"
            print(f"| {kind} | {mode} | {t.requests} | {t.stats.mean_accepted_length:.2f} | {hits} | {t.rate:.1f} | "
                  f"{t.rate / base if base else 0:.2f}x | {t.identical}/{t.requests} |")
    for kind in tallies:
        best = max((m for m in modes if m != "none"), key=lambda m: tallies[kind][m].rate, default=None)
        if best is not None:
            base = tallies[kind]["none"].rate
            print(f"best on {kind}: {best}, {tallies[kind][best].rate / base:.2f}x target-only")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="bundle directory (default: the default model)")
    parser.add_argument("--modes", nargs="+", default=None, help="modes to run (default: every one loaded)")
    parser.add_argument("--target-format", choices=("auto", "exact", "fast"), default="auto")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each batch in every mode at N > 1 streams")
    parser.add_argument("--served", action="store_true", help="also run the one-stream suite through the server")
    parser.add_argument("--port", type=int, default=8012)
    record.add_option(parser)
    args = parser.parse_args()
    suite = json.loads(SUITE.read_text())
    config = EngineConfig(target_format=args.target_format, intra_op_threads=args.threads)
    with record.recording(args.record, "tasks", model=args.model), Engine(args.model, config) as engine:
        modes = args.modes or engine.available_modes
        if "none" not in modes:
            modes = ["none", *modes]
        for mode in modes:  # warm-up, on text outside the suite
            engine.chat([{"role": "user", "content": "Say hello."}], GenerationOptions(max_new_tokens=16,
                                                                                      speculative_mode=mode))
        for streams in args.streams:
            engine.reset_suffix_cache()
            print(f"task suite: {args.target_format} format, greedy, EOS honoured, at most {args.new_tokens} tokens, "
                  f"{streams} stream(s), {args.threads} threads, adaptive speculation (the default)"
                  + (f", each batch {args.repeats} times" if streams > 1 else "") + "\n")
            if streams == 1:
                tallies = one_stream(lambda messages, mode: run_one(engine, messages, mode, args.new_tokens), suite,
                                     modes)
            else:
                tallies = many_streams(engine, suite, modes, args.new_tokens, streams, args.repeats)
            report(tallies, modes)
            print()
        if args.served:
            served_suite(args, engine, suite, modes)


if __name__ == "__main__":
    main()
