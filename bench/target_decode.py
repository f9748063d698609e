"""Baseline: target-only decode speed of the bundled target, in-process, batch 1.

    .venv/bin/python bench/target_decode.py [--prompts 8] [--new-tokens 64] [--threads 2] [--record DIR]

Prints per-prompt and aggregate tokens/s (decode only, and including prefill) plus the
median single-token step latency, so later speculative benchmarks have a number to
divide by. Greedy, EOS ignored, so every prompt decodes exactly --new-tokens tokens.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from specserve.engine import Engine, EngineConfig, GenerationOptions  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(ROOT / "models/fixture/target"))
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto")
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "target_decode", model=args.model):
        run(args)


def run(args: argparse.Namespace) -> None:
    prompts = [p["prompt"] for p in json.loads((ROOT / "tests/data/heldout_prompts.json").read_text())][: args.prompts]
    engine = Engine(args.model, EngineConfig(device=args.device, intra_op_threads=args.threads))
    options = GenerationOptions(max_new_tokens=args.new_tokens, ignore_eos=True, speculative_mode="none")
    engine.generate(prompts[0], options.model_copy(update={"max_new_tokens": 8}))  # warm-up

    step_times: list[float] = []
    original_feed = engine.target.feed_batch

    def timed_feed(requests):
        t0 = time.perf_counter()
        out = original_feed(requests)
        if len(requests) == 1 and len(requests[0].tokens) == 1:
            step_times.append(time.perf_counter() - t0)
        return out

    engine.target.feed_batch = timed_feed
    decode_tokens = decode_seconds = total_seconds = 0.0
    total_tokens = 0
    print(f"target-only decode, batch 1, {args.threads} threads, {args.new_tokens} new tokens per prompt")
    for i, prompt in enumerate(prompts):
        result = engine.generate(prompt, options)
        decode_tokens += result.completion_tokens - 1  # the first token comes from the prefill
        decode_seconds += result.decode_seconds
        total_seconds += result.prefill_seconds + result.decode_seconds
        total_tokens += result.completion_tokens
        print(f"  prompt {i:2d}: {result.prompt_tokens:3d} prompt tokens, "
              f"{(result.completion_tokens - 1) / result.decode_seconds:7.1f} decode tokens/s")
    print(f"decode tokens/s (target-only, batch 1): {decode_tokens / decode_seconds:.1f}")
    print(f"end-to-end tokens/s incl. prefill:      {total_tokens / total_seconds:.1f}")
    print(f"median 1-token step (feed incl. KV paging): {statistics.median(step_times) * 1000:.2f} ms")


if __name__ == "__main__":
    main()
