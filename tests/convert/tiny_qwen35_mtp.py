"""A tiny random Qwen3.5 checkpoint with an MTP head, and an independent torch reference.

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


def tiny_qwen35_config(*, hidden_size: int, vocab_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                       intermediate_size: int, max_position_embeddings: int) -> dict:
    """The composite ``qwen3_5`` config.json of a published checkpoint, with tiny sizes."""
    eos = min(248044, vocab_size - 1)  # the published id, kept inside a tiny vocabulary
    layer_types = ["linear_attention" if (i + 1) % _FULL_ATTENTION_INTERVAL else "full_attention"
                   for i in range(_MAIN_LAYERS)]
    text_config = {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "attn_output_gate": True,
        "bos_token_id": eos,
        "dtype": "bfloat16",
        "eos_token_id": eos,
        "full_attention_interval": _FULL_ATTENTION_INTERVAL,
        "head_dim": head_dim,
        "hidden_act": "silu",
        "hidden_size": hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": intermediate_size,
        "layer_types": layer_types,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_value_head_dim": 16,
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
