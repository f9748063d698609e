"""How fast each weight format of a converted GGUF runs the calls the engine makes, and
how far its logits are from float32's, measured in one run, interleaved.

    .venv/bin/python bench/weight_formats.py [--gguf FILE] [--past 256] [--rounds 7] [--record DIR]

Candidates (``modelbuild.from_gguf.weights``): ``fp32`` (every matrix dequantised),
``q4_1`` (the file's Q4_1 blocks carried over exactly: ``MatMulNBits`` + block sums),
``q4_1 acc4`` (the same with int8 activations), ``int8`` (8-bit blocks, int8 activations).
Shapes: the standard graph at batch 1 with 1, 2, 5, 9 and 17 new tokens (a decode step
and verifies of 1, 4, 8 and 16 drafts), its in-place graph at batch 1 (IO binding, the
engine's batch-1 path) at the same widths, and batched verifies of 5 tokens at 4, 16
and 32 sequences. Each cell is the median of ``--rounds`` calls, candidates taking turns
within each round. Logit error: the largest |difference| from fp32's on a chat prompt.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from specserve.modelbuild.default_model import cached_gguf  # noqa: E402
from specserve.modelbuild.from_gguf.convert import convert_gguf  # noqa: E402

CANDIDATES = {"fp32": ("fp32", 0), "q4_1": ("q4_1", 0), "q4_1 acc4": ("q4_1", 4), "int8": ("int8", 4)}
WIDTHS = (1, 2, 5, 9, 17)
BATCHES = (4, 16, 32)


class Graphs:
    """One candidate's standard graph and in-place graph, with feeds for a past of ``past``."""

    def __init__(self, target: Path, threads: int, past: int) -> None:
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        # Eight sessions take turns here: one whose pool spun on after its run would slow the next.
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.standard = ort.InferenceSession(str(target / "model.onnx"), options, providers=["CPUExecutionProvider"])
        self.in_place = ort.InferenceSession(str(target / "model.inplace.onnx"), options, providers=["CPUExecutionProvider"])
        self.pasts = [i for i in self.standard.get_inputs() if i.name.startswith("past_key_values.")]
        self.outputs = [o.name for o in self.in_place.get_outputs() if not o.name.startswith("present.")]
        self.past = past
        rng = np.random.default_rng(0)
        self.kv = {i.name: rng.standard_normal((1, i.shape[1], past, i.shape[3])).astype(np.float32) for i in self.pasts}
        capacity = past + max(WIDTHS)
        self.buffers = {name: ort.OrtValue.ortvalue_from_numpy(np.pad(v, ((0, 0), (0, 0), (0, capacity - past), (0, 0))))
                        for name, v in self.kv.items()}

    def run_standard(self, batch: int, width: int) -> None:
        feed = {"input_ids": np.ones((batch, width), np.int64),
                "attention_mask": np.ones((batch, self.past + width), np.int64),
                "position_ids": np.tile(np.arange(self.past, self.past + width), (batch, 1)),
                **{n: np.repeat(v, batch, axis=0) if batch > 1 else v for n, v in self.kv.items()}}
        self.standard.run(None, feed)

    def run_in_place(self, width: int) -> None:
        binding = self.in_place.io_binding()
        binding.bind_cpu_input("input_ids", np.ones((1, width), np.int64))
        binding.bind_cpu_input("attention_mask", np.ones((1, self.past + width), np.int64))
        for name in self.outputs:
            binding.bind_output(name, "cpu")
        for name, value in self.buffers.items():
            binding.bind_ortvalue_input(name, value)
            binding.bind_ortvalue_output(name.replace("past_key_values", "present"), value)
        self.in_place.run_with_iobinding(binding)

    def logits(self, ids: list[int]) -> np.ndarray:
        feed = {"input_ids": np.array([ids]), "attention_mask": np.ones((1, len(ids)), np.int64),
                "position_ids": np.arange(len(ids))[None],
                **{i.name: np.zeros((1, i.shape[1], 0, i.shape[3]), np.float32) for i in self.pasts}}
        return self.standard.run(["logits"], feed)[0][0]


def timed(call) -> float:
    started = time.perf_counter()
    call()
    return (time.perf_counter() - started) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, default=None, help="default: the cached SmolLM2-135M-Instruct GGUF")
    parser.add_argument("--past", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "weight_formats", model=args.gguf or cached_gguf()):
        run(args)


def run(args: argparse.Namespace) -> None:
    gguf = args.gguf or cached_gguf()

    with tempfile.TemporaryDirectory() as scratch:
        graphs: dict[str, Graphs] = {}
        for name, (weight_format, level) in CANDIDATES.items():
            out = Path(scratch) / name.replace(" ", "_")
            convert_gguf(gguf, out, weight_format, level, step_format=None, fast=False, progress=lambda _: None)
            graphs[name] = Graphs(out / "target", args.threads, args.past)
        from specserve.engine.model.chat import ChatTemplate
        from specserve.engine.model.tokenizer import TextTokenizer

        target = Path(scratch) / "fp32" / "target"
        prompt = ChatTemplate.from_model_dir(target).render([{"role": "user", "content": "What is the capital of France?"}])
        ids = TextTokenizer(target).encode(prompt)
        reference = graphs["fp32"].logits(ids)
        error = {name: float(np.abs(g.logits(ids) - reference).max()) for name, g in graphs.items()}

        cells: list[tuple[str, callable]] = [(f"standard, 1 x {w}", (lambda g, w=w: g.run_standard(1, w))) for w in WIDTHS]
        cells += [(f"in place, 1 x {w}", (lambda g, w=w: g.run_in_place(w))) for w in WIDTHS]
        cells += [(f"standard, {b} x 5", (lambda g, b=b: g.run_standard(b, 5))) for b in BATCHES]
        cells += [(f"standard, {b} x 1", (lambda g, b=b: g.run_standard(b, 1))) for b in BATCHES]
        print(f"SmolLM2 weight formats, onnxruntime {ort.__version__}, {args.threads} threads, past {args.past}, "
              f"median of {args.rounds} interleaved calls (ms); after one warm-up call per cell")
        print(f"| call (batch x new tokens) | {' | '.join(graphs)} |")
        print(f"|---|{'---|' * len(graphs)}")
        for label, call in cells:
            for g in graphs.values():
                call(g)  # warm-up
            samples = {name: [] for name in graphs}
            for _ in range(args.rounds):
                for name, g in graphs.items():
                    samples[name].append(timed(lambda: call(g)))
            print(f"| {label} | {' | '.join(f'{statistics.median(s):.1f}' for s in samples.values())} |")
        print(f"| max abs logit error vs fp32 | {' | '.join(f'{e:.1e}' for e in error.values())} |")


if __name__ == "__main__":
    main()
