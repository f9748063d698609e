"""Shared-KV assistant proposer (Gemma-4 ``*-assistant`` style), behaving as
``SharedKvProposer`` in ``speculative.rs``: no KV cache of its own; it reads per-group slices of the target's
paged KV (each from the one target layer bound to the group, with that layer's own
head count and head dim), holds its position constant, and threads its
``projected_state``.

Two ways to start the chain, named by the head's ``config.json`` (``draft_feed``):
- ``bootstrap`` (``speculative.rs``'s, and the bundled assistant's): a first step on the last
  token in the target KV paired with the target's hidden state there, at that token's
  position; its draft is discarded, and the pending token follows with the assistant's
  own state;
- ``hf_assisted`` (transformers' assisted generation, which published Gemma-4
  assistants are trained for; converted heads): the first step pairs the pending token
  with the target's hidden state that predicted it, at the pending token's position, and
  its draft is kept.

A head whose config names a ``d2t`` drafts over that reduced vocabulary (its own LM head
has those rows only), mapped back to target ids as EAGLE-3's are.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specserve.engine.errors import InvalidRequestError, ModelLoadError
from specserve.engine.grammar.drafting import guided_choices
from specserve.engine.kv.paged_cache import PagedKVCache
from specserve.engine.model.bundle import Bundle
from specserve.engine.model.heads import HeadModel
from specserve.engine.speculative.proposers.base import Needs, Proposal, ProposerContext, SharedKvSlice, StatelessProposer
from specserve.engine.speculative.proposers.mode import HeadMode, LoadedProposer
from specserve.engine.speculative.rounds import Anchor


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

    FEEDS = ("bootstrap", "hf_assisted")

    def __init__(self, head: HeadModel) -> None:
        self.head = head
        self.feed = head.config.get("draft_feed", "bootstrap")
        if self.feed not in self.FEEDS:
            raise ModelLoadError(f"{head.directory}: draft_feed '{self.feed}' is not one of {self.FEEDS}")
        self.groups: dict[str, int] = dict(head.config.get("shared_kv_groups", {}))
        inputs = {i.name for i in head.session.get_inputs()}
        missing = [f"shared_kv.{g}.{p}" for g in self.groups for p in ("key", "value")
                   if f"shared_kv.{g}.{p}" not in inputs]
        if not self.groups or missing:
            raise ModelLoadError(f"shared-KV head groups {self.groups} do not match its inputs (missing {missing})")

    batchable = True  # no state of its own: any group of sequences can share one run per step

    def propose(self, context: ProposerContext) -> Proposal:
        return self.propose_batch([context])[0]

    def propose_batch(self, contexts: Sequence[ProposerContext], owners=None) -> list[Proposal]:
        """Draft for several sequences at once. Their target KV slices differ in length,
        so they are padded on the right and the attention mask closes the padding."""
        size = self.head.hidden_size
        for context in contexts:
            if context.target_hidden is None:
                raise InvalidRequestError("shared-KV proposer requires the target model's last hidden state")
            if context.shared_kv is None:
                raise InvalidRequestError("shared-KV proposer requires target shared-KV slices")
            if len(context.context_tokens) < 2:
                raise InvalidRequestError("shared-KV proposer requires at least one token in the target KV")
            if np.asarray(context.target_hidden).size != size:
                raise InvalidRequestError(f"target_hidden length {np.asarray(context.target_hidden).size} != "
                                          f"shared-KV proposer hidden {size}")
        batch, steps = len(contexts), max(c.num_drafts for c in contexts)
        if steps == 0:
            return [Proposal([]) for _ in contexts]
        lengths = [c.shared_kv[0].kv_len for c in contexts]
        longest = max(lengths)
        feed = {"attention_mask": np.zeros((batch, longest), np.int64)}
        for row, length in enumerate(lengths):
            feed["attention_mask"][row, :length] = 1
        for slot, item in enumerate(contexts[0].shared_kv):
            for part in ("key", "value"):
                first = getattr(item, part)
                padded = np.zeros((batch, first.shape[1], longest, first.shape[3]), first.dtype)
                for row, context in enumerate(contexts):
                    data = getattr(context.shared_kv[slot], part)
                    padded[row, :, : data.shape[2]] = data[0]
                feed[f"shared_kv.{item.group}.{part}"] = padded
        bootstrap = self.feed == "bootstrap"
        # Constant across draft steps: the position of the last token in the target KV
        # (bootstrap), or of the pending token after it (hf_assisted).
        back = 2 if bootstrap else 1
        feed["position_ids"] = np.array([[len(c.context_tokens) - back] for c in contexts], np.int64)
        hidden = np.stack([np.asarray(c.target_hidden, np.float32).ravel() for c in contexts]).reshape(batch, 1, size)
        last = [int(c.context_tokens[-back]) for c in contexts]
        drafted: list[list[int]] = [[] for _ in contexts]
        for step in range(steps + bootstrap):
            embedding = self.head.embedder.embed(last).reshape(batch, 1, -1)
            feed["inputs_embeds"] = np.concatenate([embedding, hidden], axis=-1)
            logits, hidden = self.head.session.run(["logits", "projected_state"], feed)
            if bootstrap and step == 0:
                last = [c.guaranteed_token for c in contexts]  # bootstrap: its own draft is discarded
            else:
                last = self.head.target_ids(guided_choices(logits[:, -1], [c.grammar for c in contexts],
                                                           self.head.draft_vocabulary))
                for row, token in zip(drafted, last):
                    row.append(token)
        return [Proposal(c.kept(row)) for row, c in zip(drafted, contexts)]


class SharedKvMode(HeadMode):
    mode, deployment = "shared_kv", "SharedKvProposer"
    description = "a Gemma-4-style assistant reading the target's KV cache"
    proposer = SharedKvProposer

    def head_needs(self, bundle: Bundle, config: dict, wiring: dict) -> Needs:
        """The final hidden state and the target KV layer bound to each of the head's groups."""
        return Needs(final_hidden=bundle.final_hidden_output, shared_kv_layers=dict(config.get("shared_kv_groups", {})))

    def calibration_anchor(self, loaded: LoadedProposer, kv_len: int) -> Anchor:
        head: HeadModel = loaded.model
        slices = []
        for group, layer in head.config.get("shared_kv_groups", {}).items():
            _, heads, _, dim = head.input_shape(f"shared_kv.{group}.key")
            kv = np.zeros((1, int(heads), kv_len, int(dim)), np.float32)
            slices.append(SharedKvSlice(group, layer, kv, kv))
        return Anchor(np.zeros(head.hidden_size, np.float32), None, tuple(slices))
