"""A Hugging Face checkpoint of the default model's GGUF, for the peers that need one
(onnxruntime-genai's model builder, transformers). Runs in .venv-peer (see setup.sh):

    .venv-peer/bin/python bench/peer/export_hf.py [GGUF] [OUT]

defaults: .cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf -> .cache/peer/smollm2-hf.

transformers dequantises the GGUF's weights to float32 on load (``gguf_file=``, needs the
``gguf`` package and accelerate), but a model loaded that way refuses ``save_pretrained``:
its state dict goes into a fresh ``LlamaForCausalLM(config)``, which is saved instead,
with the tokenizer and generation config read from the same GGUF. Nothing is downloaded.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig,  # noqa: E402
                          LlamaForCausalLM)

ROOT = Path(__file__).resolve().parents[2]
GGUF = ROOT / ".cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = ROOT / ".cache/peer/smollm2-hf"


def export(gguf: Path, out: Path) -> None:
    started = time.perf_counter()
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    config.architectures = ["LlamaForCausalLM"]
    # The weights saved are plain float32: no GGUF quantization_config (the genai builder
    # would read one as a quantized checkpoint), no name of the GGUF's training run.
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        if hasattr(config, key):
            delattr(config, key)
    fresh = LlamaForCausalLM(config).to(torch.float32)
    state = loaded.state_dict()
    missing, unexpected = fresh.load_state_dict(state, strict=False)
    # A tied lm_head is not a key of its own; anything else missing is an error.
    missing = [key for key in missing if not (key == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise SystemExit(f"state dict mismatch: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        fresh.tie_weights()
    fresh.eval()
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    generation = GenerationConfig.from_model_config(config)
    generation.do_sample = False
    out.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    generation.save_pretrained(str(out))
    # The saved weights must be the loaded ones, bit for bit.
    check = LlamaForCausalLM.from_pretrained(str(out), dtype=torch.float32).state_dict()
    for key, value in state.items():
        if not torch.equal(check[key], value):
            raise SystemExit(f"saved {key} differs from the GGUF's")
    print(f"exported {gguf.name} -> {out} ({sum(v.numel() for v in state.values()) / 1e6:.1f}M parameters, "
          f"{time.perf_counter() - started:.1f} s)", flush=True)


if __name__ == "__main__":
    export(Path(sys.argv[1]) if len(sys.argv) > 1 else GGUF, Path(sys.argv[2]) if len(sys.argv) > 2 else OUT)
