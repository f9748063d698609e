"""A Gemma-4 assistant (``google/gemma-4-*-it-assistant``, transformers'
``Gemma4AssistantForCausalLM``), converted to the shared-KV head graph that
``engine/speculative/proposers/shared_kv.py`` runs. mobius (task ``gemma4-assistant``) builds
it, float32, from ``config.json`` + ``*.safetensors``.

Graph contract (float32 unless noted; no past/present, the head has no cache)::

    inputs   inputs_embeds                 [B, Q, 2*backbone]  concat(embedding of a token, hidden)
             position_ids           int64  [B, Q]              held constant across draft steps
             attention_mask         int64  [B, kv_len]         1 = a real KV slot, 0 = padding
             shared_kv.{g}.key / .value    [B, kv_heads_g, kv_len, head_dim_g]  per group g
    outputs  logits                        [B, Q, vocab]
             projected_state               [B, Q, backbone]    the next step's hidden half

A group g is a layer type of the assistant (``sliding_attention``, ``full_attention``);
each of its layers reads the same K/V: a slice of the target's cache (already RoPE'd)
from the one target layer :func:`bind_groups` binds to g.

What Hugging Face's assisted generation feeds (transformers 5.24,
``generation/candidate_generator.py``, ``SinglePositionMultiTokenCandidateGenerator.
get_candidates``, lines 1313-1346):

- ``inputs_embeds = cat([target.get_input_embeddings()(last_token_id), hidden])``. For
  a Gemma-4 target ``get_input_embeddings()`` is ``Gemma4TextScaledWordEmbedding``
  (``models/gemma4/modeling_gemma4.py`` 1421-1432, built at 1550-1552 with
  ``embed_scale = hidden_size ** 0.5``): the embedding half is the target's embedding
  row **scaled by sqrt(backbone_hidden_size)** (cast to the weight dtype, so bf16 rounds
  it, e.g. sqrt(1536) = 39.19 -> 39.25). The hidden half is the target's
  ``hidden_states[-1]``, which transformers ties to the *final-normed*
  ``last_hidden_state`` (``utils/output_capturing.py`` 318-379); later steps feed the
  assistant's own ``projected_state`` (its ``last_hidden_state`` output).
- ``position_ids = [[input_ids.shape[1] - 1]]``, constant over the draft loop: the
  position of ``last_token_id``, the target's pending token (not yet in its KV), one
  past the last KV slot. The embedding of step 1 is that pending token's, the hidden
  the target's at the last KV slot; there is no bootstrap step. The 2-D
  ``attention_mask`` is the whole sequence's (one slot wider than the KV; the graph,
  like transformers, uses its first kv_len columns); ``shared_kv_states`` sliced to
  ``[:, :, :input_ids.shape[1]]``.

Masking. transformers builds bidirectional masks over the shared KV
(``Gemma4AssistantForCausalLM.create_attention_masks``): full-attention layers see every
unmasked slot; sliding layers flip the mask and keep ``|q - kv| <= sliding_window``,
i.e. at Q = 1 the **last sliding_window + 1 slots** of the KV. mobius's own graph
ignores ``attention_mask`` on full layers (right padding leaks in) and keeps the last
``sliding_window`` valid slots on sliding layers (one fewer than transformers). This
module therefore swaps in its own attention mask for both: full layers keep the
unmasked slots, sliding layers the last ``sliding_window + 1`` *unmasked* slots
(counted from the right over the mask, so a right-padded row of a batch, as the
proposer pads, equals its unpadded run, and a left-padded or unpadded row equals
transformers). Full layers are exact for any Q; sliding layers for Q = 1 (each draft
step; transformers' Q > 1 sliding mask is not reproduced).

mobius quirks handled here: ``mobius.build`` cannot read a transformers >= 5.24 config
whose full-attention layers have their own head size (``per_layer_config``; the
published E2B has 256 / 512) -- reading ``head_dim`` raises
``AmbiguousGlobalPerLayerAttributeError`` -- and mobius only honours a distinct full-attention KV-head count when
``attention_k_eq_v``. The geometry is therefore read per layer from transformers'
config and handed to mobius's ``Gemma4AssistantConfig`` explicitly, and the graph's
shared-KV inputs are checked against it.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

from .weights import apply_every_weight

SOURCE_FORMAT = "gemma4-assistant"
GROUPS = ("full_attention", "sliding_attention")


def bind_groups(target_layer_types: list[str] | None, num_target_layers: int, groups: list[str],
                *, num_kv_shared_layers: int = 0) -> dict[str, int]:
    """The target layer whose KV each assistant group reads, as transformers binds it.

    transformers (5.24): a Gemma-4 target's ``Gemma4TextConfig.kv_sharing_modes``
    (``models/gemma4/configuration_gemma4.py`` 225-251) marks, for every layer type, the
    **last layer of that type before the KV-shared tail** (``first_shared =
    num_layers - num_kv_shared_layers``; with no sharing, the last layer of that type)
    as ``"store"``; that layer writes its K/V (after RoPE and the cache update) into
    ``shared_kv_states[layer_type]`` (``models/gemma4/modeling_gemma4.py`` 1230-1231),
    which the target returns (1702) and the candidate generator hands to the assistant,
    whose layers all read ``shared_kv_states[self.layer_type]`` (1213-1214).

    Fallback (not in transformers, which only pairs the assistant with a Gemma-3n/4
    target): a target without layer types (a plain Llama: every layer is full
    attention), or one with no layer of a group's type before its KV-shared tail (where
    transformers raises), binds that group to its last layer, ``num_target_layers - 1``.
    """
    if num_target_layers < 1:
        raise ValueError(f"num_target_layers must be >= 1, got {num_target_layers}")
    if not 0 <= num_kv_shared_layers < num_target_layers:
        raise ValueError(f"num_kv_shared_layers {num_kv_shared_layers} must be in [0, {num_target_layers})")
    last = num_target_layers - 1
    if target_layer_types is None:
        return {group: last for group in groups}
    if len(target_layer_types) != num_target_layers:
        raise ValueError(f"{len(target_layer_types)} target layer types for {num_target_layers} layers")
    producers = list(target_layer_types[: num_target_layers - num_kv_shared_layers])
    bound = {}
    for group in groups:
        matches = [i for i, kind in enumerate(producers) if kind == group]
        bound[group] = matches[-1] if matches else last
    return bound


def build_gemma4_assistant(checkpoint_dir: Path, out_dir: Path) -> dict:
    """Build ``out_dir/model.onnx`` (+ ``model.onnx.data``) from a Gemma-4 assistant
    checkpoint and return the facts for the head's ``config.json``."""
    import mobius  # convert extra only: mobius pulls torch
    import onnx_ir as ir
    from mobius._configs import Gemma4AssistantConfig
    from mobius.models.gemma4_assistant import Gemma4AssistantCausalLMModel

    checkpoint_dir, out_dir = Path(checkpoint_dir), Path(out_dir)
    raw = json.loads((checkpoint_dir / "config.json").read_text())
    if raw.get("model_type") != "gemma4_assistant":
        raise ValueError(f"{checkpoint_dir}: model_type {raw.get('model_type')!r} is not a Gemma-4 assistant "
                         "(gemma4_assistant)")
    text = raw["text_config"]
    geometry = group_geometry(checkpoint_dir)
    unknown = sorted(set(geometry) - set(GROUPS))
    if unknown:
        raise ValueError(f"{checkpoint_dir}: layer types {unknown} are not supported (only {list(GROUPS)})")

    # mobius reads attributes off a transformers-like config; hand it the raw JSON with
    # the per-group geometry made explicit (see the module docstring).
    sliding = geometry.get("sliding_attention", geometry.get("full_attention"))
    full = geometry.get("full_attention", sliding)
    text_ns = SimpleNamespace(**{k: v for k, v in text.items() if k != "per_layer_config"})
    text_ns.head_dim, text_ns.num_key_value_heads = sliding["head_dim"], sliding["num_kv_heads"]
    text_ns.global_head_dim = full["head_dim"]
    parent_ns = SimpleNamespace(**{**raw, "text_config": text_ns})
    config = Gemma4AssistantConfig.from_transformers(text_ns, parent_config=parent_ns)
    config = dataclasses.replace(config, dtype=ir.DataType.FLOAT,
                                 global_head_dim=full["head_dim"],
                                 num_global_key_value_heads=full["num_kv_heads"])

    module = Gemma4AssistantCausalLMModel(config)
    attention = _contract_attention_class()
    for layer in module.model.layers:
        layer.self_attn.__class__ = attention
    package = mobius.build_from_module(module, config, "gemma4-assistant", execution_provider="default")
    model = package["model"]
    apply_every_weight(package, module.preprocess_weights(_load_state_dict(checkpoint_dir)), checkpoint_dir)
    _adopt_contract(model, geometry, int(raw["backbone_hidden_size"]))
    if model.ir_version > 13:  # onnxruntime 1.31 reads IR <= 13
        model.ir_version = 11
    out_dir.mkdir(parents=True, exist_ok=True)
    package.save(str(out_dir), progress_bar=False)
    return {
        "backbone_hidden_size": int(raw["backbone_hidden_size"]),
        "hidden_size": int(text["hidden_size"]),
        "vocab_size": int(text["vocab_size"]),
        "groups": {group: dict(geometry[group]) for group in sorted(geometry)},
        "source_format": SOURCE_FORMAT,
        "ordered_embeddings": bool(raw.get("use_ordered_embeddings", False)),
    }


def group_geometry(checkpoint_dir: Path) -> dict[str, dict[str, int]]:
    """{layer type: {"num_kv_heads", "head_dim"}} as transformers' own per-layer config
    gives them (every layer of a type must agree: they all read one slice)."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(checkpoint_dir).get_text_config()
    geometry: dict[str, dict[str, int]] = {}
    for i, kind in enumerate(text.layer_types):
        layer = text.per_layer_config[i] if hasattr(text, "per_layer_config") else text
        shape = {"num_kv_heads": int(layer.num_key_value_heads), "head_dim": int(layer.head_dim)}
        if geometry.setdefault(kind, shape) != shape:
            raise ValueError(f"{checkpoint_dir}: {kind} layers disagree on their KV geometry "
                             f"({geometry[kind]} vs layer {i}'s {shape})")
    return geometry


def _load_state_dict(checkpoint_dir: Path) -> dict:
    from safetensors.torch import load_file

    index = checkpoint_dir / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state = {}
    for name in files:
        state.update(load_file(str(checkpoint_dir / name)))
    return state


def _adopt_contract(model, geometry: dict[str, dict[str, int]], backbone: int) -> None:
    """Check the graph's I/O against the contract; give every KV axis one name."""
    import onnx_ir as ir

    groups = sorted(geometry)
    want_in = ["inputs_embeds", "position_ids", "attention_mask"] + [
        f"shared_kv.{g}.{part}" for g in groups for part in ("key", "value")]
    inputs = {value.name: value for value in model.graph.inputs}
    outputs = [value.name for value in model.graph.outputs]
    if sorted(inputs) != sorted(want_in) or outputs != ["logits", "projected_state"]:
        raise ValueError(f"mobius graph I/O {sorted(inputs)} -> {outputs} is not the shared-KV contract "
                         f"{sorted(want_in)} -> ['logits', 'projected_state']")
    if any(node.op_type == "GroupQueryAttention" for node in model.graph):
        raise ValueError("mobius emitted GroupQueryAttention (positions from the mask, not position_ids)")
    batch, q_len, kv_len = ir.SymbolicDim("batch"), ir.SymbolicDim("q_len"), ir.SymbolicDim("kv_len")
    inputs["inputs_embeds"].shape = ir.Shape([batch, q_len, 2 * backbone])
    inputs["position_ids"].shape = ir.Shape([batch, q_len])
    inputs["attention_mask"].shape = ir.Shape([batch, kv_len])
    for group in groups:
        heads, dim = geometry[group]["num_kv_heads"], geometry[group]["head_dim"]
        for part in ("key", "value"):
            value = inputs[f"shared_kv.{group}.{part}"]
            if value.shape is None or [value.shape[1], value.shape[3]] != [heads, dim]:
                raise ValueError(f"{value.name} has shape {value.shape}; the checkpoint's {group} layers read "
                                 f"[batch, {heads}, kv_len, {dim}]")
            value.shape = ir.Shape([batch, heads, kv_len, dim])


def _contract_attention_class():
    """mobius's Q-only attention with this module's mask (see the module docstring)."""
    import onnx_ir as ir
    from mobius._build_context import get_build_dtype
    from mobius.components._attention import _apply_attention
    from mobius.components._gemma4_assistant import Gemma4AssistantAttention
    from mobius.components._rotary_embedding import apply_rotary_pos_emb

    class ContractAttention(Gemma4AssistantAttention):
        def forward(self, op, hidden_states, shared_key, shared_value, position_embeddings, gqa_ctx=None,
                    attention_mask=None):
            if gqa_ctx is not None or position_embeddings is None or attention_mask is None:
                raise ValueError("the shared-KV contract needs the generic attention path with attention_mask")
            q = self.q_proj(op, hidden_states)
            q = op.Reshape(q, [0, 0, -1, self.head_dim])
            q = self.q_norm(op, q)
            q = op.Reshape(q, [0, 0, -1])
            q = apply_rotary_pos_emb(op, x=q, position_embeddings=position_embeddings,
                                     num_heads=self.num_attention_heads,
                                     rotary_embedding_dim=self.rotary_embedding_dim, interleaved=self._rope_interleave)
            # Shared K/V arrive in BNSH; the Attention op takes [B, S, heads * dim].
            k = op.Reshape(op.Transpose(shared_key, perm=[0, 2, 1, 3]), [0, 0, -1])
            v = op.Reshape(op.Transpose(shared_value, perm=[0, 2, 1, 3]), [0, 0, -1])
            kv_len = op.Shape(shared_key, start=2, end=3)
            mask = op.Slice(attention_mask, [0], kv_len, [1], [1])  # [B, kv_len]
            keep = op.Cast(mask, to=ir.DataType.BOOL)
            if self.sliding_window:
                # transformers keeps |q - kv| <= window over the flipped KV: the last window + 1 slots.
                from_right = op.CumSum(mask, op.Constant(value_int=1), reverse=1)
                keep = op.And(keep, op.LessOrEqual(from_right, op.Constant(value_int=self.sliding_window + 1)))
            dtype = get_build_dtype()
            bias = op.Cast(op.Where(keep, 0.0, float(dtype.min)), to=dtype)
            bias = op.Unsqueeze(bias, [1, 2])  # [B, 1, 1, kv_len]: every head, every query
            out, _k, _v = _apply_attention(op, q, k, v, attn_mask=bias, past_key=None, past_value=None,
                                           num_attention_heads=self.num_attention_heads,
                                           num_key_value_heads=self.num_key_value_heads, scale=self.scaling,
                                           softcap=self.softcap, is_causal=0)
            return self.o_proj(op, out)

    return ContractAttention
