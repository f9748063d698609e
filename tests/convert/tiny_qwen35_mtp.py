"""Tiny random Qwen3.5 / Qwen3.5-MoE / Qwen3-Next checkpoints with an MTP head, and
independent torch references (the MoE ones are at the end of the module).

``write_tiny_qwen35_mtp`` lays a checkpoint out the way a published Qwen3.5 model is
laid out on the Hugging Face hub (``Qwen/Qwen3.5-27B``, ``Qwen/Qwen3.6-27B``), only
small: a composite ``model_type: qwen3_5`` config.json whose decoder fields sit under
``text_config`` (hybrid ``layer_types``, ``mtp_num_hidden_layers: 1``,
``mtp_use_dedicated_embeddings: false``, mRoPE ``rope_parameters`` with
``partial_rotary_factor: 0.25``), and one bfloat16 ``model.safetensors`` holding the 15
``mtp.*`` tensors under their published names and shapes next to a few main-model
tensors (``model.language_model.*``, ``lm_head``) that a converter must ignore.

``qwen35_mtp_reference`` runs the head's published semantics in torch without mobius:
``h' = fc(cat[pre_fc_norm_embedding(e), pre_fc_norm_hidden(h)])``, one full-attention
decoder layer, then ``mtp.norm``. The decoder layer, the zero-centred ``(1 + weight)``
RMSNorm and the rotary embedding are transformers' own Qwen3.5 classes, so a mistake
in the converter (or in mobius) cannot be copied into the reference.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

# What Hugging Face writes for a real Qwen3.5 checkpoint (Qwen3.5-27B's config.json),
# minus the sizes, which write_tiny_qwen35_mtp fills in small.
_ROPE_PARAMETERS = {
    "mrope_interleaved": True,
    "mrope_section": [11, 11, 10],
    "rope_type": "default",
    "rope_theta": 10000000,
    "partial_rotary_factor": 0.25,
}
_MAIN_LAYERS = 4  # the main model's depth: three linear-attention layers then one full one
_FULL_ATTENTION_INTERVAL = 4


def _hybrid_layers(head_dim: int, hidden_size: int, intermediate_size: int) -> dict:
    """The decoder fields Qwen3.5 and Qwen3-Next publish alike: their linear-attention
    (Gated DeltaNet) geometry and which layers are full attention."""
    return {
        "full_attention_interval": _FULL_ATTENTION_INTERVAL,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "layer_types": ["linear_attention" if (i + 1) % _FULL_ATTENTION_INTERVAL else "full_attention"
                        for i in range(_MAIN_LAYERS)],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 16,
    }


def tiny_qwen35_config(*, hidden_size: int, vocab_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                       intermediate_size: int, max_position_embeddings: int) -> dict:
    """The composite ``qwen3_5`` config.json of a published checkpoint, with tiny sizes."""
    eos = min(248044, vocab_size - 1)  # the published id, kept inside a tiny vocabulary
    text_config = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": eos,
        "dtype": "bfloat16",
        "eos_token_id": eos,
        **_hybrid_layers(head_dim, hidden_size, intermediate_size),
        "mamba_ssm_dtype": "float32",
        "max_position_embeddings": max_position_embeddings,
        "model_type": "qwen3_5_text",
        "mtp_num_hidden_layers": 1,
        "mtp_use_dedicated_embeddings": False,
        "num_attention_heads": num_heads,
        "num_hidden_layers": _MAIN_LAYERS,
        "num_key_value_heads": num_kv_heads,
        "rms_norm_eps": 1e-06,
        "rope_parameters": dict(_ROPE_PARAMETERS),
        "use_cache": True,
        "vocab_size": vocab_size,
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "dtype": "bfloat16",
        "image_token_id": 248056,
        "language_model_only": False,
        "model_type": "qwen3_5",
        "text_config": text_config,
        "tie_word_embeddings": False,
        "transformers_version": "4.57.0.dev0",
        "video_token_id": 248057,
        "vision_config": {
            "deepstack_visual_indexes": [],
            "depth": 1,
            "hidden_act": "gelu_pytorch_tanh",
            "hidden_size": 32,
            "in_channels": 3,
            "initializer_range": 0.02,
            "intermediate_size": 64,
            "model_type": "qwen3_5",
            "num_heads": 2,
            "num_position_embeddings": 16,
            "out_hidden_size": hidden_size,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
        "vision_end_token_id": 248054,
        "vision_start_token_id": 248053,
    }


def mtp_tensor_shapes(*, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                      intermediate_size: int) -> dict[str, tuple[int, ...]]:
    """The published ``mtp.*`` tensors of a dense Qwen3.5 checkpoint, name -> shape.

    ``q_proj`` is twice as wide as the heads need: each head's query is followed by the
    same number of output-gate channels (``attn_output_gate``)."""
    h, q, kv = hidden_size, num_heads * head_dim, num_kv_heads * head_dim
    layer = "mtp.layers.0."
    return {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.norm.weight": (h,),
        layer + "input_layernorm.weight": (h,),
        layer + "post_attention_layernorm.weight": (h,),
        layer + "self_attn.q_proj.weight": (2 * q, h),
        layer + "self_attn.k_proj.weight": (kv, h),
        layer + "self_attn.v_proj.weight": (kv, h),
        layer + "self_attn.o_proj.weight": (h, q),
        layer + "self_attn.q_norm.weight": (head_dim,),
        layer + "self_attn.k_norm.weight": (head_dim,),
        layer + "mlp.gate_proj.weight": (intermediate_size, h),
        layer + "mlp.up_proj.weight": (intermediate_size, h),
        layer + "mlp.down_proj.weight": (h, intermediate_size),
    }


def write_tiny_qwen35_mtp(out_dir: Path, *, hidden_size: int = 64, vocab_size: int = 4096, num_heads: int = 4,
                          num_kv_heads: int = 2, head_dim: int = 16, seed: int = 0, intermediate_size: int = 128,
                          max_position_embeddings: int = 2048) -> Path:
    """Write config.json + model.safetensors (bfloat16, like the published weights) to ``out_dir``.

    Norm weights are small random offsets around 0, because Qwen3.5's RMSNorm scales by
    ``1 + weight``: a converter that used ``weight`` alone would be far off, not close.
    Projections are ~N(0, 1/fan_in) so attention is sharp enough for masking and
    rotary mistakes to show. Returns ``out_dir``."""
    import torch
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = tiny_qwen35_config(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=num_heads,
                                num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=intermediate_size,
                                max_position_embeddings=max_position_embeddings)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    shapes = mtp_tensor_shapes(hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                               head_dim=head_dim, intermediate_size=intermediate_size)
    for name, shape in shapes.items():
        if len(shape) == 1:  # a (1 + weight) norm
            value = 0.2 * torch.randn(shape, generator=generator)
        else:
            value = torch.randn(shape, generator=generator) / shape[1] ** 0.5
        tensors[name] = value.to(torch.bfloat16)
    # A few of the main model's tensors, as they sit beside mtp.* in the real file: the
    # converter must leave them out (the head borrows embed_tokens and lm_head).
    main = {
        "model.language_model.embed_tokens.weight": (vocab_size, hidden_size),
        "lm_head.weight": (vocab_size, hidden_size),
        "model.language_model.norm.weight": (hidden_size,),
        "model.language_model.layers.3.self_attn.q_proj.weight": (2 * num_heads * head_dim, hidden_size),
    }
    for name, shape in main.items():
        tensors[name] = (0.02 * torch.randn(shape, generator=generator)).to(torch.bfloat16)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def qwen35_mtp_reference(checkpoint_dir: Path, inputs_embeds: np.ndarray, hidden_states: np.ndarray,
                         position_ids: np.ndarray) -> np.ndarray:
    """``mtp_hidden`` for ``[B, S, H]`` inputs, causal over the S positions, no past; float32.

    Built from transformers' ``Qwen3_5DecoderLayer`` / ``Qwen3_5RMSNorm`` /
    ``Qwen3_5TextRotaryEmbedding`` with the checkpoint's ``mtp.*`` tensors loaded strictly
    (a missing or extra key fails), eager attention."""
    import torch
    from safetensors import safe_open
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import (Qwen3_5DecoderLayer, Qwen3_5RMSNorm,
                                                              Qwen3_5TextRotaryEmbedding)

    checkpoint_dir = Path(checkpoint_dir)
    text = dict(json.loads((checkpoint_dir / "config.json").read_text())["text_config"])
    # The MTP block is one full-attention layer, whatever the main stack's pattern is.
    text.update(num_hidden_layers=1, layer_types=["full_attention"])
    text.pop("full_attention_interval", None)
    config = Qwen3_5TextConfig(**text)
    config._attn_implementation = "eager"

    weights = {}
    with safe_open(str(checkpoint_dir / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            if key.startswith("mtp."):
                weights[key[len("mtp."):]] = f.get_tensor(key).float()

    h, eps = config.hidden_size, config.rms_norm_eps
    norm_e, norm_h, norm_out = (Qwen3_5RMSNorm(h, eps=eps) for _ in range(3))
    fc = torch.nn.Linear(2 * h, h, bias=False)
    layer = Qwen3_5DecoderLayer(config, layer_idx=0)
    parts = {"pre_fc_norm_embedding.": norm_e, "pre_fc_norm_hidden.": norm_h, "norm.": norm_out, "fc.": fc,
             "layers.0.": layer}
    for prefix, module in parts.items():
        module.load_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}, strict=True)
    claimed = {k for k in weights if any(k.startswith(p) for p in parts)}
    if claimed != set(weights):
        raise ValueError(f"unexpected mtp tensors: {sorted(set(weights) - claimed)}")
    rotary = Qwen3_5TextRotaryEmbedding(config)

    e = torch.as_tensor(np.asarray(inputs_embeds, np.float32))
    hid = torch.as_tensor(np.asarray(hidden_states, np.float32))
    pos = torch.as_tensor(np.asarray(position_ids, np.int64))
    batch, seq, _ = e.shape
    causal = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1)
    mask = causal.expand(batch, 1, seq, seq)
    with torch.no_grad():
        x = fc(torch.cat([norm_e(e), norm_h(hid)], dim=-1))
        x = layer(x, position_embeddings=rotary(x, pos), attention_mask=mask, position_ids=pos)
        return norm_out(x).numpy()


# ----------------------------------------------------------------------------------------
# Mixture-of-experts MTP heads: Qwen3-Next and Qwen3.5-MoE / Qwen3.6-MoE
# ----------------------------------------------------------------------------------------
#
# Qwen3-Next (``Qwen/Qwen3-Next-80B-A3B-Instruct``) keeps a flat ``model_type: qwen3_next``
# config and its MTP layer's routed experts per expert; Qwen3.5-MoE
# (``Qwen/Qwen3.5-35B-A3B``) is composite (``qwen3_5_moe``, decoder fields under
# ``text_config``) with per-expert MTP experts, and Qwen3.6-35B-A3B, the same config,
# packs them (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I]), as
# NVIDIA Megatron-Bridge's qwen35_vl_bridge.py tells the two apart. Both put a softmax
# router ``mlp.gate.weight`` [E, H] and a sigmoid-gated shared expert next to them.

def tiny_qwen3_next_config(*, hidden_size: int, vocab_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                           intermediate_size: int, num_experts: int, num_experts_per_tok: int,
                           moe_intermediate_size: int, shared_expert_intermediate_size: int,
                           max_position_embeddings: int) -> dict:
    """Qwen3-Next-80B-A3B's config.json as published (transformers 4.57 wrote it: flat
    ``rope_theta`` / ``partial_rotary_factor``, ``full_attention_interval``), tiny sizes,
    plus the ``layer_types`` transformers 5 derives from the interval and writes back."""
    return {
        "architectures": ["Qwen3NextForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": min(151643, vocab_size - 2),
        "decoder_sparse_step": 1,
        "eos_token_id": min(151645, vocab_size - 1),
        **_hybrid_layers(head_dim, hidden_size, intermediate_size),
        "max_position_embeddings": max_position_embeddings,
        "mlp_only_layers": [],
        "model_type": "qwen3_next",
        "moe_intermediate_size": moe_intermediate_size,
        "norm_topk_prob": True,
        "num_attention_heads": num_heads,
        "num_experts": num_experts,
        "num_experts_per_tok": num_experts_per_tok,
        "num_hidden_layers": _MAIN_LAYERS,
        "num_key_value_heads": num_kv_heads,
        "output_router_logits": False,
        "partial_rotary_factor": 0.25,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": 10000000,
        "router_aux_loss_coef": 0.001,
        "shared_expert_intermediate_size": shared_expert_intermediate_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.0.dev0",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": vocab_size,
    }


def tiny_qwen35_moe_config(*, hidden_size: int, vocab_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                           num_experts: int, num_experts_per_tok: int, moe_intermediate_size: int,
                           shared_expert_intermediate_size: int, max_position_embeddings: int) -> dict:
    """The composite ``qwen3_5_moe`` config.json of Qwen3.5-35B-A3B / Qwen3.6-35B-A3B, tiny
    sizes: the dense one's, with the MoE fields in ``text_config`` instead of
    ``intermediate_size`` (Qwen3.5-MoE has no ``norm_topk_prob``: it always renormalises)."""
    config = tiny_qwen35_config(hidden_size=hidden_size, vocab_size=vocab_size, num_heads=num_heads,
                                num_kv_heads=num_kv_heads, head_dim=head_dim, intermediate_size=1,
                                max_position_embeddings=max_position_embeddings)
    text = config["text_config"]
    del text["intermediate_size"]
    text.update(model_type="qwen3_5_moe_text", moe_intermediate_size=moe_intermediate_size,
                shared_expert_intermediate_size=shared_expert_intermediate_size, num_experts=num_experts,
                num_experts_per_tok=num_experts_per_tok, output_router_logits=False, router_aux_loss_coef=0.001)
    config["text_config"] = dict(sorted(text.items()))
    config.update(architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe")
    config["vision_config"]["model_type"] = "qwen3_5_moe"
    return config


def moe_mtp_tensor_shapes(*, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, num_experts: int,
                          moe_intermediate_size: int, shared_expert_intermediate_size: int,
                          packed_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """The published ``mtp.*`` tensors of a MoE MTP head, name -> shape: the dense head's
    fc, norms and attention, with the dense MLP replaced by router, routed experts (per
    expert, or packed) and the gated shared expert."""
    shapes = {name: shape for name, shape in mtp_tensor_shapes(
        hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
        intermediate_size=1).items() if ".mlp." not in name}
    h, i, s = hidden_size, moe_intermediate_size, shared_expert_intermediate_size
    mlp = "mtp.layers.0.mlp."
    shapes[mlp + "gate.weight"] = (num_experts, h)
    if packed_experts:
        shapes[mlp + "experts.gate_up_proj"] = (num_experts, 2 * i, h)
        shapes[mlp + "experts.down_proj"] = (num_experts, h, i)
    else:
        for e in range(num_experts):
            shapes[f"{mlp}experts.{e}.gate_proj.weight"] = (i, h)
            shapes[f"{mlp}experts.{e}.up_proj.weight"] = (i, h)
            shapes[f"{mlp}experts.{e}.down_proj.weight"] = (h, i)
    shapes[mlp + "shared_expert.gate_proj.weight"] = (s, h)
    shapes[mlp + "shared_expert.up_proj.weight"] = (s, h)
    shapes[mlp + "shared_expert.down_proj.weight"] = (h, s)
    shapes[mlp + "shared_expert_gate.weight"] = (1, h)
    return shapes


def _write_moe_checkpoint(out_dir: Path, config: dict, shapes: dict[str, tuple[int, ...]],
                          main: dict[str, tuple[int, ...]], seed: int) -> Path:
    """config.json + one bfloat16 model.safetensors: random ``mtp.*`` tensors of ``shapes``
    and small main-model tensors of ``main`` that a converter must leave out.

    Norms are random offsets around 0 (the ``1 + weight`` RMSNorm); projections and experts
    ~N(0, 1/fan_in), so every expert and the shared expert move the output by O(1); the
    router ~N(0, 4/H), so the normalised hidden state's router logits have a spread of
    about 2 and the top-k differs from token to token (a routing mistake shows)."""
    import torch
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in shapes.items():
        if len(shape) == 1:
            value = 0.2 * torch.randn(shape, generator=generator)
        elif name.endswith("mlp.gate.weight"):
            value = 2.0 * torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        else:
            value = torch.randn(shape, generator=generator) / shape[-1] ** 0.5
        tensors[name] = value.to(torch.bfloat16)
    for name, shape in main.items():
        tensors[name] = (0.02 * torch.randn(shape, generator=generator)).to(torch.bfloat16)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return out_dir


def write_tiny_qwen3_next_mtp(out_dir: Path, *, hidden_size: int = 64, vocab_size: int = 4096, num_heads: int = 4,
                              num_kv_heads: int = 2, head_dim: int = 16, seed: int = 0, num_experts: int = 4,
                              num_experts_per_tok: int = 2, moe_intermediate_size: int = 32,
                              shared_expert_intermediate_size: int = 48, intermediate_size: int = 128,
                              max_position_embeddings: int = 2048) -> Path:
    """A tiny Qwen3-Next checkpoint laid out as ``Qwen/Qwen3-Next-80B-A3B-Instruct`` is:
    flat ``qwen3_next`` config.json, one bfloat16 model.safetensors with the MTP head's
    tensors under their published names (per-expert routed experts) beside a few main-model
    tensors (``model.*``, ``lm_head``, a main layer's expert) the converter must ignore.
    Returns ``out_dir``."""
    config = tiny_qwen3_next_config(
        hidden_size=hidden_size, vocab_size=vocab_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, intermediate_size=intermediate_size, num_experts=num_experts,
        num_experts_per_tok=num_experts_per_tok, moe_intermediate_size=moe_intermediate_size,
        shared_expert_intermediate_size=shared_expert_intermediate_size,
        max_position_embeddings=max_position_embeddings)
    shapes = moe_mtp_tensor_shapes(hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                   head_dim=head_dim, num_experts=num_experts,
                                   moe_intermediate_size=moe_intermediate_size,
                                   shared_expert_intermediate_size=shared_expert_intermediate_size)
    main = {
        "model.embed_tokens.weight": (vocab_size, hidden_size),
        "lm_head.weight": (vocab_size, hidden_size),
        "model.norm.weight": (hidden_size,),
        "model.layers.3.mlp.gate.weight": (num_experts, hidden_size),
        "model.layers.3.mlp.experts.0.gate_proj.weight": (moe_intermediate_size, hidden_size),
    }
    return _write_moe_checkpoint(out_dir, config, shapes, main, seed)


def write_tiny_qwen35_moe_mtp(out_dir: Path, *, hidden_size: int = 64, vocab_size: int = 4096, num_heads: int = 4,
                              num_kv_heads: int = 2, head_dim: int = 16, seed: int = 0, num_experts: int = 4,
                              num_experts_per_tok: int = 2, moe_intermediate_size: int = 32,
                              shared_expert_intermediate_size: int = 48, packed_experts: bool = False,
                              max_position_embeddings: int = 2048) -> Path:
    """A tiny Qwen3.5-MoE checkpoint: the composite ``qwen3_5_moe`` config.json and one
    bfloat16 model.safetensors with the MTP head's published tensors, its routed experts
    per expert (Qwen3.5-35B-A3B) or, with ``packed_experts``, packed (Qwen3.6-35B-A3B),
    beside main-model tensors (``model.language_model.*`` with the main stack's packed
    experts, ``lm_head``) the converter must ignore. Returns ``out_dir``."""
    config = tiny_qwen35_moe_config(
        hidden_size=hidden_size, vocab_size=vocab_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, num_experts=num_experts, num_experts_per_tok=num_experts_per_tok,
        moe_intermediate_size=moe_intermediate_size, shared_expert_intermediate_size=shared_expert_intermediate_size,
        max_position_embeddings=max_position_embeddings)
    shapes = moe_mtp_tensor_shapes(hidden_size=hidden_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
                                   head_dim=head_dim, num_experts=num_experts,
                                   moe_intermediate_size=moe_intermediate_size,
                                   shared_expert_intermediate_size=shared_expert_intermediate_size,
                                   packed_experts=packed_experts)
    main = {
        "model.language_model.embed_tokens.weight": (vocab_size, hidden_size),
        "lm_head.weight": (vocab_size, hidden_size),
        "model.language_model.norm.weight": (hidden_size,),
        "model.language_model.layers.3.mlp.gate.weight": (num_experts, hidden_size),
        "model.language_model.layers.3.mlp.experts.gate_up_proj": (num_experts, 2 * moe_intermediate_size,
                                                                   hidden_size),
    }
    return _write_moe_checkpoint(out_dir, config, shapes, main, seed)


def _pack_experts(weights: dict, num_experts: int) -> dict:
    """Per-expert ``layers.0.mlp.experts.{i}.*`` -> transformers' packed expert parameters,
    the way its checkpoint conversion does it (``conversion_mapping.py``, ``qwen2_moe``:
    stack each projection over experts, then concatenate gate and up along dim 1)."""
    import torch

    prefix = "layers.0.mlp.experts."
    if f"{prefix}gate_up_proj" in weights:
        return weights
    out = {k: v for k, v in weights.items() if not k.startswith(prefix)}
    gate, up, down = ([weights.pop(f"{prefix}{e}.{proj}.weight") for e in range(num_experts)]
                      for proj in ("gate_proj", "up_proj", "down_proj"))
    out[f"{prefix}gate_up_proj"] = torch.cat([torch.stack(gate), torch.stack(up)], dim=1)
    out[f"{prefix}down_proj"] = torch.stack(down)
    leftover = sorted(k for k in weights if k.startswith(prefix))
    if leftover:
        raise ValueError(f"experts beyond num_experts={num_experts}: {leftover[:4]}")
    return out


def _moe_mtp_reference(config, layer_class, norm_class, rotary_class, checkpoint_dir: Path, inputs_embeds,
                       hidden_states, position_ids, routing: list | None) -> np.ndarray:
    import torch
    from safetensors import safe_open

    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    weights = {}
    with safe_open(str(Path(checkpoint_dir) / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            if key.startswith("mtp."):
                weights[key[len("mtp."):]] = f.get_tensor(key).float()
    weights = _pack_experts(weights, config.num_experts)

    h, eps = config.hidden_size, config.rms_norm_eps
    norm_e, norm_h, norm_out = (norm_class(h, eps=eps) for _ in range(3))
    fc = torch.nn.Linear(2 * h, h, bias=False)
    layer = layer_class(config, layer_idx=0)
    parts = {"pre_fc_norm_embedding.": norm_e, "pre_fc_norm_hidden.": norm_h, "norm.": norm_out, "fc.": fc,
             "layers.0.": layer}
    for prefix, module in parts.items():
        module.load_state_dict({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)}, strict=True)
    claimed = {k for k in weights if any(k.startswith(p) for p in parts)}
    if claimed != set(weights):
        raise ValueError(f"unexpected mtp tensors: {sorted(set(weights) - claimed)}")
    if routing is not None:  # the router returns (logits, top-k weights, top-k expert indices)
        layer.mlp.gate.register_forward_hook(lambda _m, _i, out: routing.append(out[2].detach().clone().numpy()))
    rotary = rotary_class(config)

    e = torch.as_tensor(np.asarray(inputs_embeds, np.float32))
    hid = torch.as_tensor(np.asarray(hidden_states, np.float32))
    pos = torch.as_tensor(np.asarray(position_ids, np.int64))
    batch, seq, _ = e.shape
    mask = torch.full((seq, seq), torch.finfo(torch.float32).min).triu(1).expand(batch, 1, seq, seq)
    with torch.no_grad():
        x = fc(torch.cat([norm_e(e), norm_h(hid)], dim=-1))
        x = layer(x, position_embeddings=rotary(x, pos), attention_mask=mask, position_ids=pos)
        return norm_out(x).numpy()


def qwen3_next_mtp_reference(checkpoint_dir: Path, inputs_embeds: np.ndarray, hidden_states: np.ndarray,
                             position_ids: np.ndarray, routing: list | None = None) -> np.ndarray:
    """``mtp_hidden`` of a Qwen3-Next MTP head for ``[B, S, H]`` inputs, causal over the S
    positions, no past; float32.

    transformers' own ``Qwen3NextDecoderLayer`` (full attention; its MLP the
    ``Qwen3NextSparseMoeBlock`` the config's ``decoder_sparse_step`` / ``mlp_only_layers``
    give layer 0), ``Qwen3NextRMSNorm`` and ``Qwen3NextRotaryEmbedding``, loaded strictly
    with the checkpoint's ``mtp.*`` tensors (per-expert experts packed the way
    transformers' loader packs them), eager attention and experts. ``routing``, if given,
    receives the router's top-k expert indices ``[B*S, k]``."""
    from transformers.models.qwen3_next.configuration_qwen3_next import Qwen3NextConfig
    from transformers.models.qwen3_next.modeling_qwen3_next import (Qwen3NextDecoderLayer, Qwen3NextRMSNorm,
                                                                    Qwen3NextRotaryEmbedding)

    raw = json.loads((Path(checkpoint_dir) / "config.json").read_text())
    raw.update(num_hidden_layers=1, layer_types=["full_attention"])
    raw.pop("full_attention_interval", None)
    config = Qwen3NextConfig.from_dict(raw)
    return _moe_mtp_reference(config, Qwen3NextDecoderLayer, Qwen3NextRMSNorm, Qwen3NextRotaryEmbedding,
                              checkpoint_dir, inputs_embeds, hidden_states, position_ids, routing)


def qwen35_moe_mtp_reference(checkpoint_dir: Path, inputs_embeds: np.ndarray, hidden_states: np.ndarray,
                             position_ids: np.ndarray, routing: list | None = None) -> np.ndarray:
    """As :func:`qwen3_next_mtp_reference`, for a Qwen3.5-MoE / Qwen3.6-MoE head: transformers'
    ``Qwen3_5MoeDecoderLayer`` (full attention, ``Qwen3_5MoeSparseMoeBlock``),
    ``Qwen3_5MoeRMSNorm`` and ``Qwen3_5MoeTextRotaryEmbedding`` from ``text_config``."""
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm,
                                                                      Qwen3_5MoeTextRotaryEmbedding)

    text = dict(json.loads((Path(checkpoint_dir) / "config.json").read_text())["text_config"])
    text.update(num_hidden_layers=1, layer_types=["full_attention"])
    text.pop("full_attention_interval", None)
    config = Qwen3_5MoeTextConfig(**text)
    return _moe_mtp_reference(config, Qwen3_5MoeDecoderLayer, Qwen3_5MoeRMSNorm, Qwen3_5MoeTextRotaryEmbedding,
                              checkpoint_dir, inputs_embeds, hidden_states, position_ids, routing)
