"""A tiny random Llama target in Hugging Face's own layout (``save_pretrained``), with
the bundled tokenizer beside it: what a user's ``HF_DIR`` looks like, small enough to
convert in seconds. Random weights make greedy output arbitrary but deterministic,
which is all an equivalence test needs."""
from __future__ import annotations

import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")

TINY = dict(vocab_size=4096, hidden_size=64, num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2,
            head_dim=16, intermediate_size=128, max_position_embeddings=512, rope_theta=10000.0,
            rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)


def write_tiny_llama(out_dir: Path, seed: int = 0, **overrides) -> Path:
    """``config.json`` + ``model.safetensors`` + the bundle's tokenizer, float32."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**TINY, **overrides})
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger than the default init, so the logits are not near-uniform
        for name, param in model.named_parameters():
            if name.endswith("proj.weight") or "embed" in name or "lm_head" in name:
                param.normal_(0.0, 0.08)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    for name in TOKENIZER_FILES:
        shutil.copy(ROOT / "models/fixture/target" / name, out_dir / name)
    return out_dir


def transformers_forward(model_dir: Path, tokens: list[int]):
    """(logits [S, V], final normalised hidden state [S, H], ``output_hidden_states``
    tuple of [S, H]) from transformers itself."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(torch.tensor([tokens]), output_hidden_states=True)
        final = model.model(torch.tensor([tokens])).last_hidden_state
    return out.logits[0].numpy(), final[0].numpy(), tuple(h[0].numpy() for h in out.hidden_states)


def transformers_greedy(model_dir: Path, tokens: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy continuation (no EOS stop: the tiny model's EOS is arbitrary)."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([tokens]), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(tokens):].tolist()
