"""Shared-KV assistant proposer (Gemma-4 ``*-assistant`` style), as the seed's
``SharedKvProposer``: no KV cache of its own; it reads per-group slices of the target's
paged KV (each from the one target layer bound to the group, with that layer's own
head count and head dim), holds its position constant, and threads its
``projected_state``. The first step is a bootstrap whose draft is discarded."""
from __future__ import annotations


import numpy as np

from ..errors import InvalidRequestError, ModelLoadError
from ..heads import HeadModel
from ..kv_cache import PagedKVCache
from .base import Proposal, ProposerContext, SharedKvSlice, StatelessProposer


def shared_kv_slices(cache: PagedKVCache, seq_id, groups: dict[str, int]) -> tuple[SharedKvSlice, ...]:
    """Slice the target cache per group; an unknown layer is a clear error, never a misread."""
    slices = []
    for group, layer in groups.items():
        if not 0 <= layer < len(cache.layers):
            raise IndexError(f"shared_kv group '{group}' references target layer {layer} but only "
                             f"{len(cache.layers)} layers exist")
        key, value = cache.slice(seq_id, layer)
        slices.append(SharedKvSlice(group, layer, key, value))
    return tuple(slices)


class SharedKvProposer(StatelessProposer):
    name = "shared_kv"

    def __init__(self, head: HeadModel) -> None:
        self.head = head
        self.groups: dict[str, int] = dict(head.config.get("shared_kv_groups", {}))
        inputs = {i.name for i in head.session.get_inputs()}
        missing = [f"shared_kv.{g}.{p}" for g in self.groups for p in ("key", "value")
                   if f"shared_kv.{g}.{p}" not in inputs]
        if not self.groups or missing:
            raise ModelLoadError(f"shared-KV head groups {self.groups} do not match its inputs (missing {missing})")

    def propose(self, context: ProposerContext) -> Proposal:
        if context.target_hidden is None:
            raise InvalidRequestError("shared-KV proposer requires the target model's last hidden state")
        if context.shared_kv is None:
            raise InvalidRequestError("shared-KV proposer requires target shared-KV slices")
        if len(context.context_tokens) < 2:
            raise InvalidRequestError("shared-KV proposer requires at least one token in the target KV")
        if context.max_drafts == 0:
            return Proposal([])
        hidden = np.asarray(context.target_hidden, np.float32).reshape(1, 1, -1)
        size = self.head.hidden_size
        if hidden.shape[-1] != size:
            raise InvalidRequestError(f"target_hidden length {hidden.shape[-1]} != shared-KV proposer hidden {size}")
        feed = {}
        for item in context.shared_kv:
            feed[f"shared_kv.{item.group}.key"], feed[f"shared_kv.{item.group}.value"] = item.key, item.value
        kv_len = context.shared_kv[0].kv_len
        feed["attention_mask"] = np.ones((1, kv_len), np.int64)
        # Constant across draft steps: the absolute position of the last token in the target KV.
        feed["position_ids"] = np.array([[len(context.context_tokens) - 2]], np.int64)
        last_token = int(context.context_tokens[-2])  # the last token in the target KV
        tokens: list[int] = []
        for step in range(context.width):
            embedding = self.head.embedder.embed([last_token]).reshape(1, 1, -1)
            feed["inputs_embeds"] = np.concatenate([embedding, hidden], axis=-1)
            logits, hidden = self.head.session.run(["logits", "projected_state"], feed)
            if step == 0:
                last_token = context.guaranteed_token  # bootstrap: its own draft is discarded
            else:
                last_token = int(np.argmax(logits[0, -1]))
                tokens.append(last_token)
        return Proposal(tokens)
