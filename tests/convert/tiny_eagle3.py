"""Tiny random EAGLE-3 heads in the two published checkpoint layouts, and an
independent torch forward of the published semantics to check a conversion against.

Layouts (exact key names and configs):
- **SafeAILab / EAGLE repo** (e.g. ``yuhuili/EAGLE3-LLaMA3.1-Instruct-8B``): a flat
  Llama ``config.json`` with ``architectures: ["LlamaForCausalLMEagle3"]`` and
  ``draft_vocab_size``; keys ``fc.weight`` [H, 3H], ``midlayer.*`` (q/k/v take 2H),
  ``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t`` (offsets) and ``t2d``
  (bool mask); no ``embed_tokens`` (the target's is used).
- **speculators** (``Eagle3Speculator``): the layer's Llama config nested under
  ``transformer_layer_config``; ``norm_before_residual``, ``target_hidden_size`` and
  ``eagle_aux_hidden_state_layer_ids`` at the top; keys ``layers.0.*`` and a copy of
  the target's ``embed_tokens.weight``.

The reference is written from the published semantics (vLLM's ``llama_eagle3``), not
from mobius: step 0 feeds ``fc(low|mid|high)``, later steps feed the previous step's
pre-norm output; the draft layer attends over its own chain only (a fresh pass per
round, as the proposer of speculative.rs does).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

DRAFT_VOCAB = 512


def write_tiny_eagle3(out_dir: Path, target_config: dict, layout: str, seed: int = 1,
                      aux_layer_ids: list[int] | None = None, norm_before_residual: bool = False) -> Path:
    """A random EAGLE-3 head for ``target_config`` (a Llama config dict), in ``layout``
    ``"safeailab"`` or ``"speculators"``."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    H, V = target_config["hidden_size"], target_config["vocab_size"]
    heads, kv_heads = target_config["num_attention_heads"], target_config["num_key_value_heads"]
    head_dim, inter = target_config["head_dim"], target_config["intermediate_size"]
    rope_theta = target_config.get("rope_theta") or target_config["rope_parameters"]["rope_theta"]

    def rand(*shape, std=0.08):
        return torch.randn(*shape, generator=g) * std

    def norm():
        return 1.0 + rand(H, std=0.1)

    layer = {
        "input_layernorm.weight": norm(), "hidden_norm.weight": norm(), "post_attention_layernorm.weight": norm(),
        "self_attn.q_proj.weight": rand(heads * head_dim, 2 * H), "self_attn.k_proj.weight": rand(kv_heads * head_dim, 2 * H),
        "self_attn.v_proj.weight": rand(kv_heads * head_dim, 2 * H), "self_attn.o_proj.weight": rand(H, heads * head_dim),
        "mlp.gate_proj.weight": rand(inter, H), "mlp.up_proj.weight": rand(inter, H), "mlp.down_proj.weight": rand(H, inter),
    }
    chosen = torch.sort(torch.randperm(V, generator=g)[:DRAFT_VOCAB]).values
    tensors = {"fc.weight": rand(H, 3 * H), "norm.weight": norm(), "lm_head.weight": rand(DRAFT_VOCAB, H, std=0.3),
               "d2t": (chosen - torch.arange(DRAFT_VOCAB)).to(torch.int64),
               "t2d": torch.zeros(V, dtype=torch.bool).index_fill_(0, chosen, True)}
    llama = {"model_type": "llama", "hidden_size": H, "intermediate_size": inter, "num_attention_heads": heads,
             "num_key_value_heads": kv_heads, "head_dim": head_dim, "num_hidden_layers": 1, "vocab_size": V,
             "max_position_embeddings": target_config["max_position_embeddings"],
             "rope_theta": rope_theta, "rms_norm_eps": target_config["rms_norm_eps"],
             "hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
    if layout == "safeailab":
        tensors.update({f"midlayer.{k}": v for k, v in layer.items()})
        config = {**llama, "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": DRAFT_VOCAB,
                  "torch_dtype": "float32", "bos_token_id": 0, "eos_token_id": 0}
    elif layout == "speculators":
        tensors.update({f"layers.0.{k}": v for k, v in layer.items()})
        tensors["embed_tokens.weight"] = rand(V, H)  # a copy of the target's in real checkpoints; unused
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "speculators_version": "0.1.0", "draft_vocab_size": DRAFT_VOCAB,
                  "norm_before_residual": norm_before_residual, "target_hidden_size": None,
                  "transformer_layer_config": llama, "torch_dtype": "float32",
                  "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                                         "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 4}],
                                         "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": "tiny"}}}
        if aux_layer_ids is not None:
            config["eagle_aux_hidden_state_layer_ids"] = aux_layer_ids
    else:
        raise ValueError(layout)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out_dir / "model.safetensors"))
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return out_dir


def _load(ckpt: Path) -> tuple[dict, dict, bool]:
    from safetensors.torch import load_file

    config = json.loads((ckpt / "config.json").read_text())
    weights = load_file(str(ckpt / "model.safetensors"))
    layer_prefix = "midlayer." if any(k.startswith("midlayer.") for k in weights) else "layers.0."
    arch = config.get("transformer_layer_config", config)
    layer = {k[len(layer_prefix):]: v for k, v in weights.items() if k.startswith(layer_prefix)}
    return {**arch, "_layer": layer, "_w": weights}, config, bool(config.get("norm_before_residual", False))


def eagle3_reference_chain(ckpt: Path, embed_table: np.ndarray, first_token: int, fused: np.ndarray,
                           steps: int, position: int = 0) -> tuple[list[np.ndarray], list[int]]:
    """(draft logits per step over the draft vocabulary, drafted target ids) for a chain
    of ``steps`` greedy draft steps starting from ``first_token`` and the target's
    low|mid|high hidden states ``fused`` [3H]."""
    import torch

    arch, _config, norm_before_residual = _load(ckpt)
    L, w = arch["_layer"], arch["_w"]
    H, heads, kv_heads = arch["hidden_size"], arch["num_attention_heads"], arch["num_key_value_heads"]
    head_dim, eps, theta = arch.get("head_dim", H // heads), arch["rms_norm_eps"], arch["rope_theta"]

    def rms(x, weight):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    def rope(x, pos):  # x [n_heads, head_dim] at one position; rotate-half convention
        inv = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.cat([pos * inv, pos * inv]).to(torch.float32)
        half = head_dim // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * torch.cos(angles) + rotated * torch.sin(angles)

    table = torch.from_numpy(np.asarray(embed_table, np.float32))
    d2t = w["d2t"]
    keys, values, logits_out, drafted = [], [], [], []
    hidden = torch.from_numpy(np.asarray(fused, np.float32)) @ w["fc.weight"].T  # step 0: fc(low|mid|high)
    token = first_token
    for step in range(steps):
        embeds = rms(table[token], L["input_layernorm.weight"])
        normed = rms(hidden, L["hidden_norm.weight"])
        residual = normed if norm_before_residual else hidden
        x = torch.cat([embeds, normed])
        q = rope((L["self_attn.q_proj.weight"] @ x).view(heads, head_dim), position + step)
        keys.append(rope((L["self_attn.k_proj.weight"] @ x).view(kv_heads, head_dim), position + step))
        values.append((L["self_attn.v_proj.weight"] @ x).view(kv_heads, head_dim))
        k = torch.stack(keys, 1).repeat_interleave(heads // kv_heads, 0)   # [heads, t, d]
        v = torch.stack(values, 1).repeat_interleave(heads // kv_heads, 0)
        scores = torch.softmax((k @ q.unsqueeze(-1)).squeeze(-1) / head_dim ** 0.5, -1)  # [heads, t]
        attn = (scores.unsqueeze(-1) * v).sum(1).reshape(-1)
        residual = residual + L["self_attn.o_proj.weight"] @ attn
        m = rms(residual, L["post_attention_layernorm.weight"])
        m = L["mlp.down_proj.weight"] @ (torch.nn.functional.silu(L["mlp.gate_proj.weight"] @ m) * (L["mlp.up_proj.weight"] @ m))
        prenorm = residual + m
        logits = w["lm_head.weight"] @ rms(prenorm, w["norm.weight"])
        draft = int(torch.argmax(logits))
        token = draft + int(d2t[draft])
        logits_out.append(logits.numpy())
        drafted.append(token)
        hidden = prenorm  # later steps: the previous pre-norm output, no fc
    return logits_out, drafted
