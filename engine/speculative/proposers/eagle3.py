"""EAGLE-3 head proposer, behaving as ``Eagle3Proposer`` in ``speculative.rs``: target low|mid|high hidden
states fused, a recycled hidden state threaded step to step, a fresh state every pass
(its own KV lives only within one ``propose_batch``, so nothing is kept between rounds),
and an optional reduced draft vocabulary (``d2t``).

Two ways to feed the chain, named by the head's ``config.json`` (``hidden_chain``):
- ``fused_every_step`` (the bundled head, trained that way): the fused target states
  on every step, the target's last hidden state recycled on the first step;
- ``fused_first_step`` (published EAGLE-3, as vLLM and SGLang run it; converted heads):
  the graph adds ``fc(fused_hidden)`` and ``recycled_hidden``, so the first step feeds
  the fused states with recycled = 0 and later steps feed the head's own ``next_hidden``
  with fused = 0.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from specserve.engine.errors import InvalidRequestError, ModelLoadError
from specserve.engine.grammar.drafting import guided_choices
from specserve.engine.model.bundle import Bundle
from specserve.engine.model.heads import HeadModel
from specserve.engine.speculative.proposers.base import Needs, Proposal, ProposerContext, StatelessProposer
from specserve.engine.speculative.proposers.mode import HeadMode, LoadedProposer
from specserve.engine.speculative.rounds import Anchor


class Eagle3Proposer(StatelessProposer):
    name = "eagle3"

    CHAINS = ("fused_every_step", "fused_first_step")

    def __init__(self, head: HeadModel) -> None:
        self.head = head
        self.chain = head.config.get("hidden_chain", "fused_every_step")
        if self.chain not in self.CHAINS:
            raise ModelLoadError(f"{head.directory}: hidden_chain '{self.chain}' is not one of {self.CHAINS}")
        geometry = head.past_geometry()
        self._empty = np.zeros((1, geometry.num_kv_heads, 0, geometry.head_dim), np.float32)

    batchable = True  # a fresh state every pass: any group of sequences can share one run per step

    def propose(self, context: ProposerContext) -> Proposal:
        return self.propose_batch([context])[0]

    def propose_batch(self, contexts: Sequence[ProposerContext], owners=None) -> list[Proposal]:
        """Draft for several sequences at once: one head run per draft step for all of
        them (each row keeps its own position; the head's own KV has the same length in
        every row, since it restarts every pass)."""
        size = self.head.hidden_size
        fused, recycled = [], []
        for context in contexts:
            layers = context.target_hidden_layers
            if layers is None or len(layers) != 3 or any(np.asarray(x).size != size for x in layers):
                raise InvalidRequestError(f"EAGLE-3 requires exactly three target hidden states of width {size}")
            fused.append(np.concatenate([np.asarray(x, np.float32).ravel() for x in layers]))
            own = np.asarray(context.target_hidden if context.target_hidden is not None else layers[2], np.float32)
            if own.size != size:
                raise InvalidRequestError(f"EAGLE-3 recycled target hidden length {own.size} != hidden {size}")
            recycled.append(own.ravel())
        batch, steps = len(contexts), max(c.num_drafts for c in contexts)
        fused_in = np.stack(fused).reshape(batch, 1, 3 * size)
        recycled_in = np.stack(recycled).reshape(batch, 1, size)
        published = self.chain == "fused_first_step"
        if published:
            recycled_in = np.zeros_like(recycled_in)
        kv_len = np.array([[len(c.context_tokens) - 1] for c in contexts], np.int64)  # pending not in the KV yet
        past_key = past_value = np.repeat(self._empty, batch, axis=0)
        previous = [c.guaranteed_token for c in contexts]
        drafted: list[list[int]] = [[] for _ in contexts]
        for step in range(steps):
            logits, recycled_in, past_key, past_value = self.head.session.run(
                ["draft_logits", "next_hidden", "present.0.key", "present.0.value"],
                {"inputs_embeds": self.head.embedder.embed(previous).reshape(batch, 1, -1), "fused_hidden": fused_in,
                 "recycled_hidden": recycled_in, "attention_mask": np.ones((batch, step + 1), np.int64),
                 "position_ids": kv_len + step, "past_key_values.0.key": past_key,
                 "past_key_values.0.value": past_value})
            if published and step == 0:
                fused_in = np.zeros_like(fused_in)
            previous = self.head.target_ids(guided_choices(logits[:, -1], [c.grammar for c in contexts],
                                                           self.head.draft_vocabulary))
            for row, token in zip(drafted, previous):
                row.append(token)
        return [Proposal(c.kept(row)) for row, c in zip(drafted, contexts)]


class Eagle3Mode(HeadMode):
    mode, deployment = "eagle3", "Eagle3Proposer"
    description = "an EAGLE-3 head fed low/mid/high target hidden states"
    proposer = Eagle3Proposer

    def head_needs(self, bundle: Bundle, config: dict, wiring: dict) -> Needs:
        """The final hidden state and the three target layers the head fuses."""
        return Needs(final_hidden=bundle.final_hidden_output, layer_hiddens=tuple(wiring.get("fused_hidden", ())))

    def calibration_anchor(self, loaded: LoadedProposer, kv_len: int) -> Anchor:
        hidden = np.zeros(loaded.model.hidden_size, np.float32)
        return Anchor(hidden, (hidden,) * 3)
