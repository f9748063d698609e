"""Whether an attention row keeps its bits when its visible keys lie among closed slots, as
a token tree lays them out, instead of contiguous, as a chain does: the condition for
verifying trees in the fast format, whose int8 activations turn a last-bit difference in
a hidden state into logit differences of whole units (``docs/models.md``, row invariance).

    .venv/bin/python bench/tree_attention.py [--trials 300] [--threads 2] [--record DIR]

Each trial draws a past of P keys and a path of d new keys (the queries: a group's rows,
two or more, as the fast graph gives attention). The chain call reads the P + d visible
slots at the front of its width; the tree call puts the path's d slots at random
increasing places among closed ones after the past, as siblings of other branches would
leave them. Closed slots hold other keys and values under a ``-inf`` bias. Two ways of
computing attention are compared:

- the ONNX ``Attention`` op, as the fast graph runs it;
- attention written out as products: scores by ``MatMul``, ``ReduceMax``, ``Exp``, and one
  ``MatMul`` of the weights by the values with a column of ones beside them (numerator and
  normaliser in one product, whose sums run along the slots).

A trial differs where any element of the row differs in any bit.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402

HEAD_DIM = 64
INPUTS = ("query", "keys", "values", "bias")


def _session(nodes: list, initializers: list, threads: int) -> ort.InferenceSession:
    graph = helper.make_graph(nodes, "attention", [helper.make_tensor_value_info(n, TensorProto.FLOAT, None) for n in INPUTS],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)])
    model.ir_version = 10  # onnxruntime 1.31 reads IR <= 13
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])


def attention_op(threads: int) -> ort.InferenceSession:
    return _session([helper.make_node("Attention", list(INPUTS), ["out"], scale=float(HEAD_DIM ** -0.5))], [], threads)


def written_out(threads: int) -> ort.InferenceSession:
    """Attention as products; ``values`` here carry a column of ones (the normaliser)."""
    node = helper.make_node
    nodes = [node("Transpose", ["keys"], ["keys_t"], perm=[0, 1, 3, 2]),
             node("MatMul", ["query", "keys_t"], ["products"]),
             node("Mul", ["products", "scale"], ["scaled"]),
             node("Add", ["scaled", "bias"], ["scores"]),
             node("ReduceMax", ["scores", "last_axis"], ["largest"], keepdims=1),
             node("Sub", ["scores", "largest"], ["shifted"]),
             node("Exp", ["shifted"], ["weights"]),
             node("MatMul", ["weights", "values"], ["sums"]),
             node("Split", ["sums", "split"], ["numerator", "normaliser"], axis=-1),
             node("Div", ["numerator", "normaliser"], ["out"])]
    initializers = [numpy_helper.from_array(np.array(HEAD_DIM ** -0.5, np.float32), "scale"),
                    numpy_helper.from_array(np.array([-1], np.int64), "last_axis"),
                    numpy_helper.from_array(np.array([HEAD_DIM, 1], np.int64), "split")]
    return _session(nodes, initializers, threads)


def trial(rng: np.random.Generator, sessions: dict[str, ort.InferenceSession]) -> dict[str, float]:
    past, depth, rows = int(rng.integers(5, 600)), int(rng.integers(1, 8)), int(rng.integers(2, 40))
    width = past + depth + int(rng.integers(1, 16))
    keys, values = (rng.standard_normal((past + depth, HEAD_DIM)).astype(np.float32) for _ in range(2))
    query = rng.standard_normal((rows, HEAD_DIM)).astype(np.float32) * 2
    chain_slots = np.arange(past + depth)
    tree_slots = np.concatenate([np.arange(past), np.sort(rng.choice(np.arange(past, width), depth, replace=False))])
    chain_width = past + depth + int(rng.integers(0, 6))  # a chain's call reads its own mask width
    worst = {}
    for name, session in sessions.items():
        outs = []
        for slots, slot_count in ((chain_slots, chain_width), (tree_slots, width)):
            k, v = (rng.standard_normal((slot_count, HEAD_DIM)).astype(np.float32) for _ in range(2))
            k[slots], v[slots] = keys, values
            bias = np.full((rows, slot_count), -np.inf, np.float32)
            bias[:, slots] = 0.0
            if name == "written out":
                v = np.concatenate([v, np.ones((slot_count, 1), np.float32)], axis=-1)
            feed = dict(zip(INPUTS, (query[None, None], k[None, None], v[None, None], bias[None, None])))
            outs.append(session.run(None, feed)[0])
        worst[name] = float(np.abs(outs[0] - outs[1]).max())
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=300)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "tree_attention"):
        sessions = {"Attention op": attention_op(args.threads), "written out": written_out(args.threads)}
        rng = np.random.default_rng(args.seed)
        results = [trial(rng, sessions) for _ in range(args.trials)]
        print(f"{args.trials} trials: a past of 5-599 keys, a path of 1-7 new keys, 2-39 query rows, "
              f"head dim {HEAD_DIM}, {args.threads} threads; chain layout against tree layout\n")
        print("| attention | trials whose row differs | max abs difference |")
        print("|---|---:|---:|")
        for name in sessions:
            differences = [r[name] for r in results]
            print(f"| {name} | {sum(d > 0 for d in differences)} / {args.trials} | {max(differences):.1e} |")


if __name__ == "__main__":
    main()
