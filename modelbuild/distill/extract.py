"""Step 2: the target's states over its own answers and over offline text (``texts.py``),
extracted once with the graph the heads are served beside (the fast format's, by default;
the engine's ``OnnxDecoder``) and stored in float16 for the head trainers (``train.py``),
which then never run the target.

    .venv/bin/python -m specserve.modelbuild.distill.extract [--bundle DIR] [--data .cache/distill] [--graph fast]

Per split, ``features/<split>/`` holds flat arrays over every stored position (memory-
mapped by the trainers) and ``index.json`` (each answer's first row, length and prompt
length). A position q of an answer's sequence (prompt + answer) is stored from the last
prompt token on: its token, the target's final normalised hidden state and its three
EAGLE-3 aux states at q, the target's top-``TOP_K`` next-token log-probabilities at q,
and the K and V of the layers the shared-KV assistant reads (for every position, the
prompt's included, since the assistant attends to the whole context). Resumable: a split
whose ``index.json`` exists is skipped.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

from specserve.engine.model.bundle import Bundle
from specserve.engine.model.default_model import DEFAULT_MODEL_DIR
from specserve.engine.model.graph_family import FAST_FILE
from specserve.engine.model.onnx_model import OnnxDecoder

from .generate import DEFAULT_OUT

TOP_K = 16
GRAPHS = {"fast": FAST_FILE, "exact": "model.onnx"}
KV_LAYERS = (14, 29)  # the shared-KV assistant's groups: a middle layer and the last


def _top_k(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Ids and log-probabilities of the ``k`` likeliest next tokens per row, likeliest first."""
    shifted = logits - logits.max(-1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    ids = np.argpartition(-log_probs, k, axis=-1)[:, :k]
    values = np.take_along_axis(log_probs, ids, -1)
    order = np.argsort(-values, axis=-1)
    return np.take_along_axis(ids, order, -1).astype(np.int32), np.take_along_axis(values, order, -1)


def extract_split(decoder: OnnxDecoder, names: dict[str, str], records: list[dict], out: Path) -> dict:
    rows = sum(len(r["response_ids"]) + 1 for r in records)  # last prompt token + every answer token
    kv_rows = sum(len(r["prompt_ids"]) + len(r["response_ids"]) for r in records)
    out.mkdir(parents=True, exist_ok=True)
    arrays: dict[str, np.memmap] = {}

    def array(name: str, shape: tuple[int, ...], dtype) -> np.memmap:
        if name not in arrays:
            arrays[name] = np.lib.format.open_memmap(out / f"{name}.npy", "w+", dtype, shape)
        return arrays[name]

    index, row, kv_row = [], 0, 0
    started = time.perf_counter()
    for n, record in enumerate(records):
        ids = record["prompt_ids"] + record["response_ids"]
        first = len(record["prompt_ids"]) - 1
        length = len(ids)
        result = decoder.forward(np.array([ids]), np.ones((1, length), np.int64), np.arange(length)[None],
                                 decoder.empty_past())
        take = slice(first, length)
        count = length - first
        top_ids, top_logp = _top_k(result.logits[0, take], TOP_K)
        width = result.extras[names["final"]].shape[-1]
        array("tokens", (rows,), np.int32)[row : row + count] = np.asarray(ids[first:], np.int32)
        array("final", (rows, width), np.float16)[row : row + count] = result.extras[names["final"]][0, take]
        fused = np.concatenate([result.extras[names[part]][0, take] for part in ("low", "mid", "high")], -1)
        array("fused", (rows, 3 * width), np.float16)[row : row + count] = fused
        array("top_ids", (rows, TOP_K), np.int32)[row : row + count] = top_ids
        array("top_logp", (rows, TOP_K), np.float16)[row : row + count] = top_logp
        for layer in KV_LAYERS:
            key, value = result.presents[layer]
            heads, dim = key.shape[1], key.shape[3]
            kv = np.stack([key[0].transpose(1, 0, 2), value[0].transpose(1, 0, 2)], 1)  # [T, 2, heads, dim]
            array(f"kv{layer}", (kv_rows, 2, heads, dim), np.float16)[kv_row : kv_row + length] = kv
        index.append({"job": record["job"], "source": record["source"], "kind": record["kind"], "row": row,
                      "rows": count, "kv_row": kv_row, "prompt_len": len(record["prompt_ids"])})
        row, kv_row = row + count, kv_row + length
        if (n + 1) % 200 == 0:
            print(f"  {n + 1}/{len(records)} answers, {kv_row / (time.perf_counter() - started):.0f} tokens/s",
                  flush=True)
    for memmap in arrays.values():
        memmap.flush()
    (out / "index.json").write_text(json.dumps({"sequences": index, "top_k": TOP_K, "kv_layers": list(KV_LAYERS)}))
    return {"answers": len(records), "stored_rows": rows, "tokens": kv_row,
            "seconds": round(time.perf_counter() - started, 1)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--data", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--graph", choices=sorted(GRAPHS), default="fast", help=(
        "the target graph whose states the heads learn: fast (int8 activations) is the one they are served beside "
        "by default; exact extracted 30 answers ~1.35x faster here (906 against 670 tokens/s on 2 cores: float32 "
        "products of whole sequences)"))
    parser.add_argument("--train-answers", type=int, default=None, help=(
        "extract at most this many training answers (in job-key order, a fixed pseudo-random subset that keeps "
        "a prompt's greedy and sampled answers together): extraction ran 524 tokens/s over 1.17 M tokens on 2 "
        "cores in the fast graph, so this sizes the step to the time it may take"))
    args = parser.parse_args(argv)
    bundle = Bundle.load(args.bundle)
    outputs = bundle.manifest.models["target"].hidden_outputs
    names = {"final": outputs.final, "low": outputs.low, "mid": outputs.mid, "high": outputs.high}
    decoder = OnnxDecoder(bundle.target_dir, "cpu", args.threads, onnx_file=GRAPHS[args.graph])
    records = [json.loads(line) for line in (args.data / "responses.jsonl").read_text().splitlines() if line.strip()]
    texts = args.data / "texts.jsonl"
    text_records = [json.loads(line) for line in texts.read_text().splitlines() if line.strip()] if texts.is_file() else []
    log = json.loads((args.data / "extract.log.json").read_text()) if (args.data / "extract.log.json").is_file() else {}
    for split in ("train", "heldout"):
        out = args.data / "features" / split
        if (out / "index.json").is_file():
            print(f"{out} exists; skipped", flush=True)
            continue
        chosen = sorted((r for r in records if r["split"] == split), key=lambda r: r["job"])
        if split == "train" and args.train_answers is not None:
            chosen = chosen[: args.train_answers]
        chosen += [r for r in text_records if r["split"] == split]
        print(f"{split}: {len(chosen)} answers and text chunks", flush=True)
        log[split] = extract_split(decoder, names, chosen, out)
        print(json.dumps(log[split]), flush=True)
    if log:
        (args.data / "extract.log.json").write_text(json.dumps(log, indent=2) + "\n")


if __name__ == "__main__":
    main()
