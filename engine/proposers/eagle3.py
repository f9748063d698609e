"""EAGLE-3 head proposer, as the seed's ``Eagle3Proposer``: target low|mid|high hidden
states fused, a recycled hidden state threaded step to step, fresh state every pass,
and an optional reduced draft vocabulary (``d2t``)."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import InvalidRequestError
from ..heads import HeadModel
from .base import AcceptContext, Proposal, ProposerContext


class Eagle3Proposer:
    name = "eagle3"

    def __init__(self, head: HeadModel) -> None:
        self.head = head
        geometry = head.past_geometry()
        self._empty = np.zeros((1, geometry.num_kv_heads, 0, geometry.head_dim), np.float32)
        self.reset()

    def reset(self) -> None:
        self._past_key, self._past_value = self._empty, self._empty

    def to_target_id(self, draft_id: int) -> int:
        return draft_id if self.head.d2t is None else int(draft_id + self.head.d2t[draft_id])

    def propose(self, context: ProposerContext) -> Proposal:
        layers = context.target_hidden_layers
        size = self.head.hidden_size
        if layers is None or len(layers) != 3 or any(np.asarray(x).size != size for x in layers):
            raise InvalidRequestError(f"EAGLE-3 requires exactly three target hidden states of width {size}")
        fused = np.concatenate([np.asarray(x, np.float32).ravel() for x in layers]).reshape(1, 1, 3 * size)
        recycled = np.asarray(context.target_hidden if context.target_hidden is not None else layers[2],
                              np.float32).reshape(1, 1, -1)
        if recycled.shape[-1] != size:
            raise InvalidRequestError(f"EAGLE-3 recycled target hidden length {recycled.shape[-1]} != hidden {size}")
        self.reset()
        kv_len = len(context.context_tokens) - 1  # the pending token is not in the target KV yet
        previous, tokens = context.guaranteed_token, []
        for step in range(context.max_drafts):
            past_len = self._past_key.shape[2]
            logits, recycled, self._past_key, self._past_value = self.head.session.run(
                ["draft_logits", "next_hidden", "present.0.key", "present.0.value"],
                {"inputs_embeds": self.head.embedder.embed([previous]).reshape(1, 1, -1), "fused_hidden": fused,
                 "recycled_hidden": recycled, "attention_mask": np.ones((1, past_len + 1), np.int64),
                 "position_ids": np.array([[kv_len + step]], np.int64),
                 "past_key_values.0.key": self._past_key, "past_key_values.0.value": self._past_value})
            previous = self.to_target_id(int(np.argmax(logits[0, -1])))
            tokens.append(previous)
        return Proposal(tokens)

    def accept(self, context: AcceptContext) -> None:
        # Every pass gets a fresh target low/mid/high anchor; draft-only KV from the
        # previous pass would be stale once drafts were rejected.
        self.reset()

    def rewind(self, target_tokens: Sequence[int]) -> None:
        self.reset()

    def close(self) -> None:
        self.reset()
