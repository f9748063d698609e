"""A tiny random Gemma-4 assistant (``google/gemma-4-*-it-assistant`` layout) and
transformers' own forward of it, to check a conversion against.

The checkpoint is written by transformers itself: ``Gemma4AssistantConfig`` (the
Gemma-4 text config nested under ``text_config``) and a randomly initialised
``Gemma4AssistantForCausalLM``, both through ``save_pretrained``, so ``config.json``
and the ``model.safetensors`` key names are exactly what a published assistant holds
(``pre_projection``, ``model.layers.{i}.*`` with Q-only attention, ``model.norm``,
``model.embed_tokens`` standing in for the tied ``lm_head``, ``post_projection``, and
``masked_embedding.*`` for the centroid-masked head).

Geometry: every layer type (group) has ``kv_heads`` KV heads of ``head_dim`` (2 x 16 by
default, the tiny Llama target's), unless ``global_head_dim`` gives full-attention
layers their own head size (as the published E2B assistant does: 256 sliding, 512
full). The sliding window is small (4) so that a 7-slot KV exercises it.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

LAYER_TYPES = ("sliding_attention", "sliding_attention", "sliding_attention", "full_attention")  # E2B's pattern


def write_tiny_gemma4_assistant(out_dir: Path, *, backbone_hidden_size: int = 64, vocab_size: int = 4096,
                                kv_heads: int = 2, head_dim: int = 16, seed: int = 0,
                                ordered_embeddings: bool = False, sliding_window: int = 4,
                                global_head_dim: int | None = None, tie_word_embeddings: bool = True) -> Path:
    """``config.json`` + ``model.safetensors`` in the published layout, float32."""
    import torch
    from transformers import Gemma4AssistantConfig, Gemma4AssistantForCausalLM, Gemma4TextConfig

    torch.manual_seed(seed)
    text = Gemma4TextConfig(
        vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=len(LAYER_TYPES),
        num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim,
        global_head_dim=global_head_dim or head_dim, layer_types=list(LAYER_TYPES), sliding_window=sliding_window,
        max_position_embeddings=512, hidden_size_per_layer_input=0, vocab_size_per_layer_input=0,
        num_kv_shared_layers=len(LAYER_TYPES), tie_word_embeddings=tie_word_embeddings)
    config = Gemma4AssistantConfig(
        text_config=text, backbone_hidden_size=backbone_hidden_size, use_ordered_embeddings=ordered_embeddings,
        num_centroids=64, centroid_intermediate_top_k=8, tie_word_embeddings=tie_word_embeddings)
    model = Gemma4AssistantForCausalLM(config).eval()
    with torch.no_grad():  # larger than the default init, and norms/scalars off 1, so every weight matters
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn_like(param))
            else:
                param.normal_(0.0, 0.15)
        for name, buffer in model.named_buffers():
            if name.endswith("layer_scalar"):
                buffer.copy_(0.5 + torch.rand_like(buffer))
        if ordered_embeddings:  # transformers initialises it to zeros; a real one is a permutation of the vocab
            model.masked_embedding.token_ordering.copy_(torch.randperm(vocab_size))
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def gemma4_assistant_reference(checkpoint_dir: Path, inputs_embeds: np.ndarray, position_ids: np.ndarray,
                               shared_kv: dict[str, tuple[np.ndarray, np.ndarray]],
                               attention_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(logits [B, Q, V], projected_state [B, Q, backbone]) from transformers'
    ``Gemma4AssistantForCausalLM`` itself, fed the way HF's assisted generation feeds it
    (``SinglePositionMultiTokenCandidateGenerator.get_candidates``): ``inputs_embeds``,
    a 2-D ``attention_mask`` over the shared KV, ``position_ids``, and
    ``shared_kv_states={layer_type: (key, value)}`` in [B, kv_heads, kv_len, head_dim].
    transformers' assistant needs both ``full_attention`` and ``sliding_attention``."""
    import torch
    from transformers import Gemma4AssistantForCausalLM

    model = Gemma4AssistantForCausalLM.from_pretrained(checkpoint_dir, dtype=torch.float32,
                                                       attn_implementation="eager").eval()
    states = {group: (torch.from_numpy(np.ascontiguousarray(k, np.float32)),
                      torch.from_numpy(np.ascontiguousarray(v, np.float32))) for group, (k, v) in shared_kv.items()}
    with torch.no_grad():
        out = model(inputs_embeds=torch.from_numpy(np.asarray(inputs_embeds, np.float32)),
                    position_ids=torch.from_numpy(np.asarray(position_ids, np.int64)),
                    attention_mask=torch.from_numpy(np.asarray(attention_mask, np.int64)),
                    shared_kv_states=states, use_cache=False)
    # The assistant returns post_projection(last hidden) as ``last_hidden_state``.
    return out.logits.numpy(), out.last_hidden_state.numpy()
