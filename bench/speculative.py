"""Speculative vs. target-only decoding on the bundled models, in-process, batch 1.

    .venv/bin/python bench/speculative.py [--prompts 10] [--new-tokens 64] [--k 4] [--threads 2] [--record DIR]

For each mode it decodes the same held-out prompts greedily (EOS ignored) and prints
decode tokens/s, the speedup over target-only measured in this same run, tau (tokens
committed per target pass) and draft acceptance. It also checks every output is
token-identical to target-only (a speedup that changes the text is not a speedup).
Then it times one target decode step against one step of each proposer.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from specserve.engine import Engine, EngineConfig, GenerationOptions  # noqa: E402
from specserve.engine.speculative.proposers.base import ProposerContext  # noqa: E402
from specserve.engine.speculative.proposers.shared_kv import shared_kv_slices  # noqa: E402

MODES = ["none", "prompt_lookup", "draft_model", "mtp", "eagle3", "shared_kv"]


def run_mode(engine: Engine, prompts: list[str], mode: str, new_tokens: int, k: int):
    options = GenerationOptions(max_new_tokens=new_tokens, ignore_eos=True, speculative_mode=mode,
                                num_speculative_tokens=k)
    engine.generate(prompts[0], options.model_copy(update={"max_new_tokens": 8}))  # warm-up
    outputs, seconds, tokens, committed, rounds, accepted, proposed = [], 0.0, 0, 0, 0, 0, 0
    for prompt in prompts:
        result = engine.generate(prompt, options)
        outputs.append(result.token_ids)
        seconds += result.decode_seconds
        tokens += result.completion_tokens - 1
        s = result.speculative
        committed, rounds = committed + s.committed_tokens, rounds + s.verification_steps
        accepted, proposed = accepted + s.accepted_tokens, proposed + s.proposed_tokens
    return outputs, tokens / seconds, committed / max(rounds, 1), accepted / max(proposed, 1)


def step_costs(engine: Engine, prompt: str, runs: int = 100) -> dict[str, float]:
    """Median ms of one target decode step and of one draft step of each proposer."""
    target = engine.target
    ids = target.encode_prompt(prompt)
    target.cache.add_sequence("bench")
    out = target.feed("bench", ids, 0)
    pending = int(np.argmax(out.logits[-1]))
    costs = {}

    def median_ms(fn) -> float:
        for _ in range(5):
            fn()
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1000

    def target_step():
        target.feed("bench", [pending], len(ids))
        target.cache.rewind("bench", len(ids))

    costs["target"] = median_ms(target_step)
    tokens = ids + [pending]
    for mode in MODES[2:]:
        if mode not in engine.proposers:
            continue
        proposer = engine.proposers[mode].new_proposer()
        needs = engine.needs.get(mode)
        ctx = ProposerContext(
            num_drafts=1, context_tokens=tokens, options=GenerationOptions(),
            target_hidden=out.extras["hidden_states"][-1],
            target_hidden_layers=tuple(out.extras[n][-1] for n in needs.layer_hiddens) if needs else None,
            shared_kv=shared_kv_slices(target.cache, "bench", needs.shared_kv_layers)
            if needs and needs.shared_kv_layers else None)
        proposer.propose(ctx)  # a draft model aligns (prefills) once; later calls are one step
        if mode == "draft_model":
            costs[mode] = median_ms(lambda: (proposer.rewind(tokens[:-1]), proposer.propose(ctx)))
        else:
            costs[mode] = median_ms(lambda: proposer.propose(ctx))
        proposer.close()
    target.cache.free("bench")
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=str(ROOT / "models/fixture"))
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4, help="drafts per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto")
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "speculative", model=args.models):
        run(args)


def run(args: argparse.Namespace) -> None:
    prompts = [p["prompt"] for p in json.loads((ROOT / "tests/data/heldout_prompts.json").read_text())][: args.prompts]
    engine = Engine(args.models, EngineConfig(device=args.device, intra_op_threads=args.threads))
    print(f"{len(prompts)} held-out prompts x {args.new_tokens} tokens, greedy, k={args.k}, "
          f"{args.threads} threads, batch 1")
    print(f"{'mode':14s} {'tokens/s':>9s} {'speedup':>8s} {'tau':>6s} {'accept':>7s}  identical")
    reference, base_rate = None, None
    for mode in MODES:
        if mode not in engine.available_modes:
            print(f"{mode:14s} (not in this bundle)")
            continue
        outputs, rate, tau, acceptance = run_mode(engine, prompts, mode, args.new_tokens, args.k)
        if mode == "none":
            reference, base_rate = outputs, rate
        same = "yes" if outputs == reference else "NO"
        print(f"{mode:14s} {rate:9.1f} {rate / base_rate:7.2f}x {tau:6.2f} {acceptance:7.2f}  {same}")
    costs = step_costs(engine, prompts[0])
    print("one decode step (median ms): " + ", ".join(f"{m} {v:.2f}" for m, v in costs.items()))
    print("target step / proposer step: " + ", ".join(
        f"{m} {costs['target'] / v:.1f}x" for m, v in costs.items() if m != "target"))


if __name__ == "__main__":
    main()
