"""The calls the engine makes, timed in each of the default model's formats as the engine
runs them (``CachedDecoder.feed_batch``: the fast format's in-place graph at every width
and batch; the exact format's step graph, in-place graph and standard graph), in one run,
interleaved; and the fast format's row invariance over thousands of positions.

    .venv/bin/python bench/target_formats.py [--past 128] [--runs 30] [--threads 2] [--record DIR]

Cells: one sequence after a ``--past``-token held-out text with 1, 2, 5, 9 and 17 new
tokens (a decode step and verifies of 1, 4, 8 and 16 drafts), then 4, 16 and 32 such
sequences in one call with 1 and 5 new tokens each. Each call is fed and rewound; a
cell's figure is the median over ``--runs`` calls, formats taking turns cell by cell.
Invariance: every position of the held-out texts computed by one-token steps against
the same positions in calls of 5 and 17 tokens and in batches of 32 beside other
sequences; the largest |logit difference| (0 = bitwise identical).
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
from specserve.engine import EngineConfig  # noqa: E402
from specserve.engine.model.cached_decoder import CachedDecoder, FeedRequest  # noqa: E402
from specserve.engine.model.default_model import DEFAULT_MODEL_DIR  # noqa: E402

FORMATS = ("fast", "exact")
WIDTHS = (1, 2, 5, 9, 17)
BATCHES = (4, 16, 32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--past", type=int, default=128)
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-invariance", action="store_true")
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "target_formats", model=DEFAULT_MODEL_DIR):
        run(args)


def texts(decoder: CachedDecoder, length: int) -> list[list[int]]:
    prompts = [p["prompt"] for p in json.loads((ROOT / "tests/data/heldout_prompts.json").read_text())]
    stream = [t for p in prompts for t in decoder.tokenizer.encode(p)]
    return [stream[i * 37 : i * 37 + length] for i in range(max(BATCHES))]


def timed_call(decoder: CachedDecoder, sequences: int, width: int, past: int) -> float:
    """Seconds of one call feeding ``width`` tokens to each of ``sequences``, rewound after."""
    requests = [FeedRequest(i, list(range(100, 100 + width)), past) for i in range(sequences)]
    started = time.perf_counter()
    decoder.feed_batch(requests)
    seconds = time.perf_counter() - started
    for i in range(sequences):
        decoder.cache.rewind(i, past)
    return seconds


def run(args: argparse.Namespace) -> None:
    # Threads spin within a run only: two decoders take turns here, and one's pool spinning
    # after its run would take the cores the other's run needs.
    config = EngineConfig(device="cpu", intra_op_threads=args.threads, thread_spinning="within_run")
    decoders = {fmt: CachedDecoder(DEFAULT_MODEL_DIR / "target", config, graph_format=fmt) for fmt in FORMATS}
    for decoder in decoders.values():
        for i, ids in enumerate(texts(decoder, args.past)):
            decoder.cache.add_sequence(i)
            decoder.feed(i, ids, 0)
    cells = [(1, w) for w in WIDTHS] + [(b, w) for b in BATCHES for w in (1, 5)]
    ms: dict[tuple[str, int, int], float] = {}
    for sequences, width in cells:
        samples = {fmt: [] for fmt in FORMATS}
        for fmt in FORMATS:
            for _ in range(3):
                timed_call(decoders[fmt], sequences, width, args.past)  # warm the shape (and batch buffers)
        for _ in range(args.runs):
            for fmt in FORMATS:
                samples[fmt].append(timed_call(decoders[fmt], sequences, width, args.past))
        for fmt in FORMATS:
            ms[(fmt, sequences, width)] = statistics.median(samples[fmt]) * 1000
    print(f"SmolLM2-135M-Instruct, {args.threads} threads, past {args.past}; median ms of {args.runs} calls "
          "through CachedDecoder.feed_batch, formats interleaved")
    print()
    print("| sequences x new tokens | " + " | ".join(f"{f} ms | {f} / its step" for f in FORMATS) + " |")
    print("|---|" + "---|---|" * len(FORMATS))
    for sequences, width in cells:
        print(f"| {sequences} x {width} | " + " | ".join(
            f"{ms[(f, sequences, width)]:.2f} | {ms[(f, sequences, width)] / ms[(f, 1, 1)]:.2f}" for f in FORMATS) + " |")
    print()
    print("fast / exact, per cell: " + ", ".join(
        f"{s}x{w} {ms[('fast', s, w)] / ms[('exact', s, w)]:.2f}" for s, w in cells))
    if not args.no_invariance:
        invariance(decoders["fast"], args)


def invariance(decoder: CachedDecoder, args: argparse.Namespace) -> None:
    graph = decoder.in_place
    sequences = texts(decoder, 160)
    prefill, positions, worst = 32, 0, 0.0
    stepped = []
    for ids in sequences:
        buffer = graph.new_buffer(len(ids))
        graph.run(buffer, 0, np.array([ids[:prefill]]))
        past = [k.copy() for k in buffer.keys], [v.copy() for v in buffer.values]
        steps = np.concatenate([graph.run(buffer, i, np.array([[ids[i]]]))[0][0] for i in range(prefill, len(ids))])
        stepped.append((steps, past))
        for width in (5, 17):
            wide = graph.view_buffer([k.copy() for k in past[0]], [v.copy() for v in past[1]])
            rows = np.concatenate([graph.run(wide, s, np.array([ids[s : s + width]]))[0][0]
                                   for s in range(prefill, len(ids), width)])
            worst = max(worst, float(np.abs(rows - steps).max()))
            positions += len(rows)
    rng = np.random.default_rng(0)
    new = len(sequences[0]) - prefill
    for _ in range(4):  # each sequence beside 31 others, in another order each time
        order = rng.permutation(len(sequences))
        keys = [np.concatenate([stepped[i][1][0][layer] for i in order]) for layer in range(len(graph.past_names) // 2)]
        values = [np.concatenate([stepped[i][1][1][layer] for i in order]) for layer in range(len(graph.past_names) // 2)]
        binding, _kept = graph.bind_rows(keys, values)
        for start in range(0, new, 8):
            width = min(8, new - start)
            logits, _ = graph.run_rows(binding, np.full(len(order), prefill + start),
                                       np.array([sequences[i][prefill + start : prefill + start + width] for i in order]))
            for row, i in enumerate(order):
                worst = max(worst, float(np.abs(logits[row] - stepped[i][0][start : start + width]).max()))
                positions += width
    print()
    print(f"fast format row invariance: {positions} positions compared (steps against calls of 5 and 17 tokens, "
          f"and against batches of {len(sequences)} in 4 orders): max |logit difference| {worst:g}")


if __name__ == "__main__":
    main()
