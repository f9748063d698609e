"""Each proposer on the default model, per draft length: tau, per-position acceptance, its
step cost against the target's, and the speed it reaches against the speed its numbers bound.

    .venv/bin/python bench/heads.py [--models DIR] [--prompts 16] [--new-tokens 96] [--ks 1 2 3 4 5 6]
                                    [--modes ...] [--threads 2] [--record DIR]

The prompts are the first held-out chat prompts of ``modelbuild.distill.prompts`` (whole
sources no head was trained on), answered greedily to their end (EOS stops them), one
request at a time, adaptive speculation off so that every round drafts exactly k. Every
output is checked token-identical to target-only's. tau = tokens committed per target
pass; acceptance at position i = drafts accepted at i over drafts proposed at i.

The bound is what the measured numbers allow one stream: tau x t_step / (t_verify(k) +
k x t_head), with t_step the target's one-token step, t_verify(k) its (k+1)-token verify
and t_head one draft step of the proposer (all medians on the warm sessions, after the
answers). Speed is decode tokens/s after each request's first token (onnxruntime's warm-
up excluded: one untimed request per cell first).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from bench.speculative import step_costs  # noqa: E402
from specserve.engine import Engine, EngineConfig, GenerationOptions  # noqa: E402
from specserve.engine.model.default_model import DEFAULT_MODEL_DIR  # noqa: E402
from specserve.modelbuild.distill.prompts import build_prompts  # noqa: E402

MODES = ["prompt_lookup", "draft_model", "mtp", "eagle3", "shared_kv"]


def heldout_chats(count: int) -> list[list[dict]]:
    _, heldout = build_prompts()
    return [prompt.messages for prompt in heldout[:count]]


def run_cell(engine: Engine, chats: list[list[dict]], options: GenerationOptions) -> dict:
    engine.chat(chats[0], options.model_copy(update={"max_new_tokens": 8}))  # warm-up, untimed
    outputs, seconds, tokens, committed, rounds = [], 0.0, 0, 0, 0
    proposed, accepted = np.zeros(8), np.zeros(8)
    for messages in chats:
        result = engine.chat(messages, options)
        outputs.append(result.token_ids)
        seconds += result.decode_seconds
        tokens += result.completion_tokens - 1
        stats = result.speculative
        committed, rounds = committed + stats.committed_tokens, rounds + stats.verification_steps
        for i, n in enumerate(stats.proposed_per_position[:8]):
            proposed[i] += n
        for i, n in enumerate(stats.accepted_per_position[:8]):
            accepted[i] += n
    used = proposed > 0
    return {"outputs": outputs, "rate": tokens / seconds, "tau": committed / max(rounds, 1),
            "acceptance": [float(a / p) for a, p in zip(accepted[used], proposed[used])]}


def verify_costs(engine: Engine, chat: list[dict], ks: list[int], runs: int = 40) -> dict[int, float]:
    """Median ms of the target verifying k drafts (a (k+1)-token feed, then the rewind)."""
    target = engine.target
    ids = engine.tokenizer.encode(engine.chat_template.render(chat))
    target.cache.add_sequence("verify")
    target.feed("verify", ids, 0)
    costs = {}
    for k in ks:
        block = [ids[-1]] * (k + 1)
        times = []
        for run in range(runs + 3):
            t0 = time.perf_counter()
            target.feed("verify", block, len(ids))
            target.cache.rewind("verify", len(ids))
            if run >= 3:
                times.append(time.perf_counter() - t0)
        costs[k] = statistics.median(times) * 1000
    target.cache.free("verify")
    return costs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=96)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3, 4, 5, 6])
    parser.add_argument("--modes", nargs="+", default=MODES)
    parser.add_argument("--threads", type=int, default=2)
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "heads", model=args.models):
        run(args)


def run(args: argparse.Namespace) -> None:
    chats = heldout_chats(args.prompts)
    engine = Engine(args.models, EngineConfig(device="cpu", intra_op_threads=args.threads))
    modes = [m for m in args.modes if m in engine.available_modes]
    base = GenerationOptions(max_new_tokens=args.new_tokens, adaptive_speculation=False)
    print(f"{len(chats)} held-out chat prompts, greedy to EOS or {args.new_tokens} tokens, one stream, "
          f"adaptive off, {args.threads} threads; tokens/s after the first token, warm")
    reference = run_cell(engine, chats, base.model_copy(update={"speculative_mode": "none"}))
    print(f"target-only: {reference['rate']:.1f} tokens/s")
    cells = {(m, k): run_cell(engine, chats, base.model_copy(update={"speculative_mode": m,
                                                                        "num_speculative_tokens": k}))
             for m in modes for k in args.ks}
    costs = step_costs(engine, engine.chat_template.render(chats[0]))
    verify = verify_costs(engine, chats[0], args.ks)
    engine.close()
    print(f"one step (median ms): target {costs['target']:.2f}; " + ", ".join(
        f"{m} {costs[m]:.2f} ({costs[m] / costs['target']:.2f} of the target's)" for m in modes if m in costs))
    print("target verify of k drafts (median ms): " + ", ".join(f"k={k} {v:.2f}" for k, v in verify.items()))
    print(f"{'mode':14s} {'k':>2s} {'tau':>5s} {'tokens/s':>9s} {'x none':>7s} {'bound':>6s}  "
          f"{'acceptance per position':28s} identical")
    for (mode, k), cell in cells.items():
        head = costs.get(mode, 0.0)
        bound = cell["tau"] * costs["target"] / (verify[k] + k * head)
        same = "yes" if cell["outputs"] == reference["outputs"] else "NO"
        accept = " ".join(f"{a:.2f}" for a in cell["acceptance"])
        print(f"{mode:14s} {k:2d} {cell['tau']:5.2f} {cell['rate']:9.1f} {cell['rate'] / reference['rate']:6.2f}x "
              f"{bound:5.2f}x  {accept:28s} {same}")


if __name__ == "__main__":
    main()
