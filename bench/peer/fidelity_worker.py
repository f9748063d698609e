"""Runs in ``.venv-peer`` for ``bench/fidelity.py``: reads the token ids and specserve's
logits it wrote (``texts.json``, ``<format>.npy``), computes transformers' float32 logits
(the reference) and llama.cpp's on the same ids, and prints one JSON line: per contestant,
per-position top-1 agreement with the reference and mean KL(reference || contestant).

    .venv-peer/bin/python bench/peer/fidelity_worker.py SCRATCH HF_DIR GGUF THREADS
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np


def log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits.astype(np.float64) - logits.max(-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def main() -> None:
    scratch, hf_dir, gguf, threads = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
    import torch
    from llama_cpp import Llama
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(threads)
    texts = json.loads((scratch / "texts.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    llm = Llama(model_path=gguf, n_ctx=2048, n_threads=threads, n_threads_batch=threads, logits_all=True,
                verbose=False)
    contestants = json.loads((scratch / "contestants.json").read_text())
    totals = {name: {"positions": 0, "top1": 0, "kl": 0.0} for name in [*contestants, "llama.cpp"]}
    for index, ids in enumerate(texts):
        with torch.no_grad():
            reference = log_softmax(model(torch.tensor([ids])).logits[0].numpy())
        llm.reset()
        llm.eval(ids)
        theirs = {"llama.cpp": np.array(llm.scores[: len(ids)], np.float32)}
        theirs.update({name: np.load(scratch / f"{name}-{index}.npy") for name in contestants})
        p = np.exp(reference)
        for name, logits in theirs.items():
            q = log_softmax(logits)
            tally = totals[name]
            tally["positions"] += len(ids)
            tally["top1"] += int((q.argmax(-1) == reference.argmax(-1)).sum())
            tally["kl"] += float((p * (reference - q)).sum())
    print(json.dumps({name: {"positions": t["positions"], "top1_agreement": t["top1"] / t["positions"],
                             "mean_kl": t["kl"] / t["positions"]} for name, t in totals.items()}))


if __name__ == "__main__":
    main()
