"""A target worker's batched decode step by its onnxruntime threads, and one batched call
against two of half the size, on the default model, interleaved.

    .venv/bin/python bench/worker_threads.py [--batches 1 2 4 8 16 32] [--repeats 6] [--record DIR]

A Serve replica's target worker runs its batched calls (the standard graph; batch-1 calls
run the in-place graph) on one thread per CPU of its bundle, not spinning between runs
(``deployments/workers.py``). Each configuration here is the standard session of the
target with a past of 120 tokens per sequence, stepping one token per sequence, timed as
the median of ``--repeats`` rounds of 5 steps, the configurations taking turns:

- 1 thread, 2 threads (no spinning: a worker's setting), 2 threads spinning within a run
  only (``session.force_spinning_stop``), 2 threads spinning (the in-process engine's).

Then, on the worker's setting, one call of B sequences against two calls of B/2 (what two
lanes of target-only sequences made the worker run).
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
from specserve.engine import EngineConfig  # noqa: E402
from specserve.engine.model.cached_decoder import CachedDecoder, FeedRequest  # noqa: E402
from specserve.engine.model.default_model import DEFAULT_MODEL_DIR  # noqa: E402
from specserve.engine.model.providers import session_options  # noqa: E402

PAST = 120
CONFIGS = {"1 thread": (1, False, False), "2 threads": (2, False, False),
           "2 threads, spinning within a run": (2, True, True), "2 threads, spinning": (2, True, False)}


def decoder(threads: int, spinning: bool, stop_after_run: bool) -> CachedDecoder:
    import onnxruntime as ort

    config = EngineConfig(device="cpu", intra_op_threads=threads, thread_spinning=spinning, in_place_kv=False,
                          kv_num_blocks=1024)
    made = CachedDecoder(DEFAULT_MODEL_DIR / "target", config, owns_cores=False)
    if stop_after_run:
        options = session_options(threads, spinning=True)
        options.add_session_config_entry("session.force_spinning_stop", "1")
        made.decoder.session = ort.InferenceSession(str(made.decoder.onnx_path), options,
                                                    providers=["CPUExecutionProvider"])
    return made


def steps(made: CachedDecoder, seqs: list, rng, count: int = 5) -> float:
    started = time.perf_counter()
    for _ in range(count):
        made.feed_batch([FeedRequest(s, [int(rng.integers(0, 40000))], made.cache.length(s)) for s in seqs])
    return (time.perf_counter() - started) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--repeats", type=int, default=6)
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "worker_threads", model=DEFAULT_MODEL_DIR):
        run(args)


def run(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    decoders = {name: decoder(*spec) for name, spec in CONFIGS.items()}
    table: dict[tuple[str, int], float] = {}
    halves: dict[int, tuple[float, float]] = {}
    for batch in args.batches:
        seqs = [(batch, i) for i in range(batch)]
        for made in decoders.values():
            for s in seqs:
                made.cache.add_sequence(s)
            made.feed_batch([FeedRequest(s, rng.integers(0, 40000, PAST).tolist(), 0) for s in seqs])
        times: dict[str, list[float]] = {name: [] for name in decoders}
        whole, split = [], []
        worker = decoders["2 threads"]
        for repeat in range(args.repeats):
            for name in (list(decoders) if repeat % 2 == 0 else list(reversed(decoders))):
                times[name].append(steps(decoders[name], seqs, rng))
            if batch >= 2:  # the worker's setting: one call of all, two calls of half each
                whole.append(steps(worker, seqs, rng))
                split.append(steps(worker, seqs[: batch // 2], rng) + steps(worker, seqs[batch // 2:], rng))
        for name, values in times.items():
            table[(name, batch)] = statistics.median(values)
        if whole:
            halves[batch] = (statistics.median(whole), statistics.median(split))
        for made in decoders.values():
            for s in seqs:
                made.cache.free(s)
        print(f"batch {batch} done", file=sys.stderr, flush=True)
    print(f"SmolLM2-135M-Instruct's standard graph, one token per sequence after a past of {PAST}, ms per batched "
          f"step (median of {args.repeats} x 5 steps, configurations taking turns)\n")
    print("| batch | " + " | ".join(CONFIGS) + " |")
    print("|---|" + "---|" * len(CONFIGS))
    for batch in args.batches:
        print(f"| {batch} | " + " | ".join(f"{1000 * table[(name, batch)]:.1f}" for name in CONFIGS) + " |")
    print("\nOne call of B sequences against two calls of B/2, 2 threads without spinning (ms):\n")
    print("| batch | one call | two half calls | two halves / one |")
    print("|---|---|---|---|")
    for batch, (whole, split) in halves.items():
        print(f"| {batch} | {1000 * whole:.1f} | {1000 * split:.1f} | {split / whole:.2f} |")


if __name__ == "__main__":
    main()
