"""Step 1 of training heads for a converted target: the target's own answers to the chat
prompts of ``prompts.py`` (self-distillation: heads learn the target's distribution,
which is what acceptance measures).

    .venv/bin/python -m specserve.modelbuild.distill.generate [--bundle DIR] [--out .cache/distill] [--sampled 0.5] [--limit N]

Every prompt gets a greedy answer; a fraction of the training prompts also a sampled one
(temperature 0.8, seeded by the prompt), so the heads see the distribution's other
choices too. Answers are decoded by the engine itself, in continuous batches of 32, up
to ``--max-new-tokens`` tokens each. Each answer is appended to ``responses.jsonl`` as
it finishes; a rerun skips the ones there (resumable), and the step's throughput is
logged to ``generate.log.json``.
"""
from __future__ import annotations

import argparse
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from specserve.engine import Engine, EngineConfig, GenerationOptions, SchedulerConfig, SpeculativeConfig
from specserve.engine.model.default_model import CACHE_DIR, DEFAULT_MODEL_DIR

from .prompts import ChatPrompt, build_prompts

DEFAULT_OUT = CACHE_DIR / "distill"
SAMPLED_TEMPERATURE = 0.8


def jobs(train: list[ChatPrompt], heldout: list[ChatPrompt], sampled_fraction: float, heldout_count: int) -> list[dict]:
    """The evaluation answers first (greedy), then the training ones, each prompt's greedy
    and sampled answers together: a run stopped early still has both splits."""
    out = [{"split": "heldout", "prompt": prompt, "kind": "greedy"} for prompt in heldout[:heldout_count]]
    for index, prompt in enumerate(train):
        out.append({"split": "train", "prompt": prompt, "kind": "greedy"})
        if index < sampled_fraction * len(train):
            out.append({"split": "train", "prompt": prompt, "kind": "sampled"})
    return out


def job_key(job: dict) -> str:
    return f"{job['prompt'].key()}:{job['kind']}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--sampled", type=float, default=0.5, help="fraction of training prompts also sampled")
    parser.add_argument("--max-new-tokens", type=int, default=160)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--heldout", type=int, default=160, help="held-out prompts answered (for evaluation)")
    parser.add_argument("--limit", type=int, default=None, help="at most this many answers (a quick run)")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "responses.jsonl"
    done = set()
    if path.is_file():
        done = {json.loads(line)["job"] for line in path.read_text().splitlines() if line.strip()}
    train, heldout = build_prompts(args.seed)
    todo = [j for j in jobs(train, heldout, args.sampled, args.heldout) if job_key(j) not in done][: args.limit]
    print(f"{len(done)} answers on disk, {len(todo)} to generate", flush=True)
    config = EngineConfig(device="cpu", scheduler=SchedulerConfig(max_batch_size=args.streams),
                          speculative=SpeculativeConfig(load=()))
    engine = Engine(args.bundle, config)
    lock, written, tokens = threading.Lock(), [0], [0]
    started = time.perf_counter()

    def run(job: dict) -> None:
        prompt: ChatPrompt = job["prompt"]
        sampled = job["kind"] == "sampled"
        seed = int(prompt.key()[:8], 16) if sampled else None
        options = GenerationOptions(max_new_tokens=args.max_new_tokens, temperature=SAMPLED_TEMPERATURE if sampled else 0,
                                    seed=seed, speculative_mode="none")
        text = engine.chat_template.render(prompt.messages)
        prompt_ids = engine.tokenizer.encode(text)
        result = engine.generate(prompt_ids, options)
        record = {"job": job_key(job), "split": job["split"], "source": prompt.source, "kind": job["kind"],
                  "seed": seed, "prompt_ids": prompt_ids, "response_ids": result.token_ids,
                  "finish_reason": result.finish_reason}
        with lock:
            with open(path, "a") as out:
                out.write(json.dumps(record) + "\n")
            written[0] += 1
            tokens[0] += len(result.token_ids)
            if written[0] % 100 == 0:
                elapsed = time.perf_counter() - started
                print(f"{written[0]}/{len(todo)} answers, {tokens[0] / elapsed:.0f} tokens/s", flush=True)

    with ThreadPoolExecutor(args.streams) as pool:
        for future in [pool.submit(run, job) for job in todo]:
            future.result()
    engine.close()
    elapsed = time.perf_counter() - started
    log = {"answers": written[0], "new_tokens": tokens[0], "seconds": round(elapsed, 1),
           "tokens_per_s": round(tokens[0] / elapsed, 1) if elapsed else 0, "streams": args.streams,
           "max_new_tokens": args.max_new_tokens, "sampled_fraction": args.sampled, "seed": args.seed}
    (args.out / "generate.log.json").write_text(json.dumps(log, indent=2) + "\n")
    print(json.dumps(log), flush=True)


if __name__ == "__main__":
    main()
