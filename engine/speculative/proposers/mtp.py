"""Multi-token-prediction head proposer (Qwen3.5 / DeepSeek MTP style), behaving as
``MtpProposer`` in ``speculative.rs``: target final hidden + target embedding of the guaranteed token in,
``mtp_hidden`` out, read through the target's LM head; the hidden state is threaded.

It restarts every pass from a fresh target anchor (``speculative.rs``'s "hidden threaded"
mode), so it keeps nothing between rounds and drafts for a whole batch in one run per
step. That engine's "cached" mode, which keeps the head's KV across rounds, is not implemented:
the anchor already carries the target's state at the last accepted position. A head
whose config names a ``d2t`` drafts over that reduced vocabulary: the LM head keeps only
its rows (``engine.model.heads.load_head``) and draft ids map back as EAGLE-3's do."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specserve.engine.errors import InvalidRequestError, ModelLoadError
from specserve.engine.grammar.drafting import guided_choices
from specserve.engine.model.heads import HeadModel
from specserve.engine.speculative.proposers.base import Proposal, ProposerContext, StatelessProposer
from specserve.engine.speculative.proposers.mode import HeadMode


class MtpProposer(StatelessProposer):
    name = "mtp"
    batchable = True

    def __init__(self, head: HeadModel) -> None:
        self.head = head
        geometry = head.past_geometry()
        self._empty = np.zeros((1, geometry.num_kv_heads, 0, geometry.head_dim), np.float32)
        outputs = {o.name for o in head.session.get_outputs()}
        self._own_logits = "logits" in outputs  # a head may carry its own LM head
        self._outputs = [name for name in ("logits", "mtp_hidden") if name in outputs]
        if "mtp_hidden" not in outputs and not self._own_logits:
            raise ModelLoadError(f"{head.directory}: MTP head has neither 'mtp_hidden' nor 'logits' output")

    def propose(self, context: ProposerContext) -> Proposal:
        return self.propose_batch([context])[0]

    def propose_batch(self, contexts: Sequence[ProposerContext], owners=None) -> list[Proposal]:
        """Draft for several sequences with one head run per draft step (each row threads
        its own hidden state)."""
        size = self.head.hidden_size
        for context in contexts:
            if context.target_hidden is None:
                raise InvalidRequestError("MTP proposer requires the target model's last hidden state")
            if np.asarray(context.target_hidden).size != size:
                raise InvalidRequestError(f"target_hidden length {np.asarray(context.target_hidden).size} != "
                                          f"MTP hidden {size}")
        batch, steps = len(contexts), max(c.num_drafts for c in contexts)
        hidden = np.stack([np.asarray(c.target_hidden, np.float32).ravel() for c in contexts]).reshape(batch, 1, size)
        past_key, past_value = (np.repeat(self._empty, batch, axis=0),) * 2
        previous = [c.guaranteed_token for c in contexts]
        drafted: list[list[int]] = [[] for _ in contexts]
        for _ in range(steps):
            past_len = past_key.shape[2]
            *outs, past_key, past_value = self.head.session.run(
                [*self._outputs, "present.0.key", "present.0.value"],
                {"inputs_embeds": self.head.embedder.embed(previous).reshape(batch, 1, -1), "hidden_states": hidden,
                 "attention_mask": np.ones((batch, past_len + 1), np.int64),
                 "position_ids": np.full((batch, 1), past_len, np.int64),
                 "past_key_values.0.key": past_key, "past_key_values.0.value": past_value})
            named = dict(zip(self._outputs, outs))
            logits = named["logits"][:, -1] if self._own_logits else self.head.lm_head.logits(named["mtp_hidden"][:, -1])
            previous = self.head.target_ids(guided_choices(logits.reshape(batch, -1), [c.grammar for c in contexts],
                                                           self.head.draft_vocabulary))
            for row, token in zip(drafted, previous):
                row.append(token)
            if "mtp_hidden" in named:
                hidden = named["mtp_hidden"]  # thread the head's own hidden state to the next step
        return [Proposal(c.kept(row)) for row, c in zip(drafted, contexts)]


class MtpMode(HeadMode):
    mode, deployment = "mtp", "MtpProposer"
    description = "a multi-token-prediction head read through the target's LM head"
    proposer = MtpProposer
