"""Check that transformers runs the very same weights: ``python -m specserve.modelbuild.compare_transformers``.

Loads ``models/fixture/target`` and ``models/fixture/draft`` (float16 safetensors + config.json) with
transformers' own ``LlamaForCausalLM`` and compares its logits and greedy continuation
with the ONNX models run by onnxruntime. Dev-only (needs the ``train`` extra).
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaForCausalLM

from specserve.engine.model.onnx_model import OnnxDecoder
from specserve.engine.model.tokenizer import TextTokenizer

ROOT = Path(__file__).resolve().parents[1]


def compare(model_dir: Path, prompt: str, new_tokens: int = 24) -> tuple[float, bool]:
    hf = LlamaForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32).eval()
    onnx = OnnxDecoder(model_dir, "cpu")
    ids = TextTokenizer(model_dir).encode(prompt)
    with torch.no_grad():
        hf_logits = hf(torch.tensor([ids])).logits[0].numpy()
        hf_tokens = hf.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                pad_token_id=0)[0, len(ids):].tolist()
    array = np.asarray(ids)[None]
    ort_logits = onnx.forward(array, np.ones_like(array), np.arange(len(ids))[None], onnx.empty_past()).logits[0]
    tokens = list(ids)
    for _ in range(new_tokens):
        array = np.asarray(tokens)[None]
        step = onnx.forward(array, np.ones_like(array), np.arange(len(tokens))[None], onnx.empty_past()).logits[0, -1]
        tokens.append(int(np.argmax(step)))
    return float(np.abs(hf_logits - ort_logits).max()), hf_tokens == tokens[len(ids):]


def main() -> int:
    prompt = json.loads((ROOT / "tests/data/heldout_prompts.json").read_text())[0]["prompt"]
    ok = True
    for name in ("target", "draft"):
        diff, same = compare(ROOT / "models" / name, prompt)
        print(f"{name}: transformers vs onnxruntime max |dlogits| = {diff:.2e}, greedy tokens identical: {same}")
        ok &= same and diff < 1e-3
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
