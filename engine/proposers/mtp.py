"""Multi-token-prediction head proposer (Qwen3.5 / DeepSeek MTP style), as the seed's
``MtpProposer``: target final hidden + target embedding of the guaranteed token in,
``mtp_hidden`` out, read through the target's LM head; the hidden state is threaded."""
from __future__ import annotations

from typing import Literal, Sequence

import numpy as np

from ..errors import InvalidRequestError, ModelLoadError
from ..heads import HeadModel
from .base import AcceptContext, Proposal, ProposerContext

MtpKvMode = Literal["hidden_threaded", "cached"]


class MtpProposer:
    name = "mtp"

    def __init__(self, head: HeadModel, kv_mode: MtpKvMode = "hidden_threaded") -> None:
        self.head, self.kv_mode = head, kv_mode
        geometry = head.past_geometry()
        self._empty = np.zeros((1, geometry.num_kv_heads, 0, geometry.head_dim), np.float32)
        outputs = {o.name for o in head.session.get_outputs()}
        self._own_logits = "logits" in outputs  # a head may carry its own LM head
        self._outputs = [name for name in ("logits", "mtp_hidden") if name in outputs]
        if "mtp_hidden" not in outputs and not self._own_logits:
            raise ModelLoadError(f"{head.directory}: MTP head has neither 'mtp_hidden' nor 'logits' output")
        self.reset()

    def reset(self) -> None:
        self._past_key, self._past_value = self._empty, self._empty

    @property
    def past_len(self) -> int:
        return self._past_key.shape[2]

    def propose(self, context: ProposerContext) -> Proposal:
        if context.target_hidden is None:
            raise InvalidRequestError("MTP proposer requires the target model's last hidden state")
        hidden = np.asarray(context.target_hidden, np.float32).reshape(1, 1, -1)
        if hidden.shape[-1] != self.head.hidden_size:
            raise InvalidRequestError(f"target_hidden length {hidden.shape[-1]} != MTP hidden {self.head.hidden_size}")
        self.reset()
        previous, tokens = context.guaranteed_token, []
        for _ in range(context.max_drafts):
            embedding = self.head.embedder.embed([previous]).reshape(1, 1, -1)
            *outs, self._past_key, self._past_value = self.head.session.run(
                [*self._outputs, "present.0.key", "present.0.value"],
                {"inputs_embeds": embedding, "hidden_states": hidden,
                 "attention_mask": np.ones((1, self.past_len + 1), np.int64),
                 "position_ids": np.array([[self.past_len]], np.int64),
                 "past_key_values.0.key": self._past_key, "past_key_values.0.value": self._past_value})
            named = dict(zip(self._outputs, outs))
            logits = named["logits"][0, -1] if self._own_logits else self.head.lm_head.logits(named["mtp_hidden"][0, -1])
            previous = int(np.argmax(logits))
            tokens.append(previous)
            if "mtp_hidden" in named:
                hidden = named["mtp_hidden"]  # thread the head's own hidden state to the next step
        return Proposal(tokens)

    def accept(self, context: AcceptContext) -> None:
        if self.kv_mode == "hidden_threaded":
            self.reset()
        else:  # keep the head KV of the accepted steps (the seed rewinds to accepted - 1)
            keep = max(0, context.accepted_prefix_len - 1)
            self._past_key, self._past_value = self._past_key[:, :, :keep], self._past_value[:, :, :keep]

    def rewind(self, target_tokens: Sequence[int]) -> None:
        self.reset()

    def close(self) -> None:
        self.reset()
