"""A decoder with its tokenizer and its own paged KV cache, kept in step.

Used for the target and for the draft model: ``feed`` runs new tokens after a
sequence's cached past and appends their KV; rewinds go to ``cache.rewind``. Calls at
batch 1 run on the model's in-place graph where it has one (``engine.model.in_place``).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Hashable, Sequence

import numpy as np

from specserve.engine.errors import ModelLoadError
from specserve.engine.kv.batch_layout import BatchLayouts
from specserve.engine.kv.paged_cache import KVCacheCapacityError, PagedKVCache
from specserve.engine.model.graph_family import EXACT, GraphFamily, TargetFormat, graph_family
from specserve.engine.model.in_place import InPlaceDecoder, KVBuffer, buffer_capacity
from specserve.engine.model.onnx_model import OnnxDecoder, configured_eos_token_ids
from specserve.engine.config import EngineConfig
from specserve.engine.model.probe import check_finite
from specserve.engine.model.row_buffers import RowBuffers
from specserve.engine.model.tokenizer import TextTokenizer, encode_prompt

log = logging.getLogger("specserve.engine")


def model_eos_token_ids(model_dir: str | Path, tokenizer: TextTokenizer) -> tuple[int, ...]:
    """The ids that end a sequence of this model: its config's, else its tokenizer's EOS."""
    configured = configured_eos_token_ids(Path(model_dir))
    return configured or ((tokenizer.eos_token_id,) if tokenizer.eos_token_id is not None else ())


@dataclass(frozen=True)
class FeedRequest:
    seq_id: Hashable
    tokens: Sequence[int]
    first_position: int  # absolute position of tokens[0]
    last_logits_only: bool = False  # a prefill's: its output holds the last token's logits row only


@dataclass
class SequenceOutput:
    logits: np.ndarray             # [S, V] one row per fed token ([1, V]: the last, if only that was asked)
    extras: dict[str, np.ndarray]  # e.g. hidden states, [S, ...] each


def _logit_rows(request: FeedRequest, fed: int) -> slice:
    """The rows of a call's logits that ``request`` asked for, of the ``fed`` it fed."""
    return slice(fed - 1 if request.last_logits_only else 0, fed)


class CachedDecoder:
    """A decoder, its tokenizer and a paged KV cache sized for it, checked to agree."""

    def __init__(self, model_dir: str | Path, config: EngineConfig | None = None, owns_cores: bool = True,
                 graph_format: TargetFormat = "auto") -> None:
        """``owns_cores``: the process runs only this engine (in-process) rather than one
        Ray replica among several; it decides ``thread_spinning="auto"``. ``graph_format``:
        the graph family to serve (``engine.model.graph_family``); the target's comes from
        ``EngineConfig.target_format``."""
        self.config = config or EngineConfig()
        spinning = self.config.spinning(owns_cores)
        in_place = self.config.in_place_kv and self.config.sliding_window is None and self.config.device != "cuda"
        self.family: GraphFamily = graph_family(Path(model_dir), graph_format, in_place)
        self.decoder = OnnxDecoder(model_dir, self.config.device, self.config.intra_op_threads,
                                   onnx_file=self.family.standard, thread_spinning=spinning)
        if (graph_format == "auto" and self.family.row_invariant
                and self.decoder.session.get_providers()[0] != "CPUExecutionProvider"):
            # Device "auto" found CUDA: the fast family's graphs are checked row-invariant on CPU only.
            self.family = EXACT
            self.decoder = OnnxDecoder(model_dir, self.config.device, self.config.intra_op_threads,
                                       onnx_file=EXACT.standard, thread_spinning=spinning)
        self.tokenizer = TextTokenizer(model_dir)
        vocab = self.decoder.vocab_size
        if self.tokenizer.vocab_size > vocab:
            raise ModelLoadError(f"tokenizer in {model_dir} has {self.tokenizer.vocab_size} tokens but the model's "
                                 f"logits cover only {vocab}: tokenizer and model do not match")
        config_vocab = self.decoder.config.get("vocab_size")
        if config_vocab is not None and config_vocab != vocab:
            raise ModelLoadError(f"config.json in {model_dir} says vocab_size={config_vocab} but the ONNX logits "
                                 f"have {vocab} entries")
        self.eos_token_ids = model_eos_token_ids(model_dir, self.tokenizer)
        limit = self.config.max_context or self.decoder.max_context
        if limit is None:
            raise ModelLoadError(f"{model_dir}: no context limit in config.json; set EngineConfig.max_context")
        self.max_context = int(limit)
        self.cache = PagedKVCache(self.decoder.layers, self.config.kv_num_blocks, self.config.kv_block_size,
                                  dtype=self.decoder.kv_dtype, sliding_window=self.config.sliding_window,
                                  sink_tokens=self.config.sink_tokens, prefix_caching=self.config.caches_prefixes)
        self.batch_layouts = BatchLayouts(self.cache)
        self.in_place = None  # the in-place graph, batch 1 (any batch in a row-invariant family), where it serves
        # Whether this decoder's sessions keep a thread pool spinning after each run.
        self._pools_spin = spinning == "always" and self.config.intra_op_threads != 1
        if self.config.in_place_kv and self.config.sliding_window is None:
            threads = self.config.in_place_threads or self.config.intra_op_threads
            # Several in-place threads that sleep between ops wake for every op, which is slower
            # than spinning: where they would, they spin within a run instead.
            spins = spinning != "never" or (self.config.in_place_threads or 1) > 1
            directory = Path(model_dir)
            self.in_place = InPlaceDecoder.load(
                self.decoder, threads, spins, path=directory / self.family.in_place,
                step_path=directory / self.family.step if self.family.step else None,
                batched=self.family.row_invariant)
        if self.family.row_invariant and not self._rows_invariant():
            self.family = EXACT
            self.decoder = OnnxDecoder(model_dir, self.config.device, self.config.intra_op_threads,
                                       onnx_file=EXACT.standard, thread_spinning=spinning)
            self.in_place = InPlaceDecoder.load(self.decoder, threads, spins) if self.in_place is not None else None
        self.row_buffers = (RowBuffers(self.cache, self.in_place, self.max_context)
                            if self.in_place is not None and self.in_place.batched else None)
        self.buffers_made = 0  # in-place buffers allocated (a sequence's first, or one that grew or was copied)

    def _rows_invariant(self) -> bool:
        """Whether this machine computes the fast family's rows alike at every width and
        batch (checked once, at load; MLAS picks kernels by CPU). Where it does not, the
        exact family serves instead, and the log says why."""
        if self.in_place is None:
            return True  # no in-place graph: the standard graph serves batch 1 only (CUDA, a window)
        difference = self.in_place.row_invariance()
        if difference:
            log.warning("%s: this CPU computes a row differently at different widths or batches (max |logit "
                        "difference| %.2e), so the fast format would not be lossless here; serving the exact "
                        "format instead", self.in_place.path, difference)
        return difference == 0.0

    def feed(self, seq_id, tokens: Sequence[int], first_position: int) -> SequenceOutput:
        """Run ``tokens`` after one sequence's cached past; see ``feed_batch``."""
        return self.feed_batch([FeedRequest(seq_id, tokens, first_position)])[0]

    def feed_batch(self, requests: Sequence[FeedRequest]) -> list[SequenceOutput]:
        """One model call for several sequences, each running its new tokens after its
        own cached past; their KV is appended to the cache.

        Sequences of different lengths share the call by padding: pasts are padded on the
        right to the longest, new tokens on the right to the most, and the attention mask
        closes every padded slot; each keeps its own position ids. Capacity for all of
        them is checked before the model runs, so a full cache raises
        ``KVCacheCapacityError`` without touching any sequence.
        """
        if len(requests) > 1 and self.decoder.io.position_ids is None:
            # GroupQueryAttention exports derive positions from the mask and accept
            # multi-token steps only at batch 1 (architecture.md): run them one by one.
            return [output for r in requests for output in self.feed_batch([r])]
        if any(len(r.tokens) < 1 for r in requests):
            raise ValueError("every sequence in a batch must feed at least one token")
        needed = sum(self.cache.blocks_needed(r.seq_id, len(r.tokens)) for r in requests)
        if needed > self.cache.free_blocks:
            raise KVCacheCapacityError(f"sequences {[r.seq_id for r in requests]} need {needed} KV blocks, "
                                       f"{self.cache.free_blocks} free")
        # Pasts in the session's own layout: last call's presents, rejected slots dead
        # (closed by the mask), so nothing is gathered or copied at batch 1, and at batch
        # > 1 only what changed since the last batched call (``kv.batch_layout``). A graph
        # that derives positions from the mask (no position_ids) cannot skip dead slots,
        # and a sliding window evicts from the middle: those gather from the pools every call.
        session_layout = self.decoder.io.position_ids is not None and self.cache.sliding_window is None
        if session_layout and len(requests) > 1:
            if self.row_buffers is not None and all(r.first_position == self.cache.length(r.seq_id) for r in requests):
                return self._feed_rows(requests)
            return self._feed_batched(requests)
        if session_layout and self._in_place_serves(requests[0]):
            return [self._feed_in_place(requests[0])]
        return self._feed_padded(requests, session_layout)

    def _feed_padded(self, requests: Sequence[FeedRequest], session_layout: bool) -> list[SequenceOutput]:
        """``feed_batch`` as one call of the standard graph over pasts padded on the right
        to the longest -- each in the session's own layout, or gathered from the pools --
        and new tokens padded to the most."""
        pasts = [self.cache.session_past(r.seq_id) if session_layout else self.cache.gathered_past(r.seq_id)
                 for r in requests]
        past_lens = [p.alive.size for p in pasts]
        new_lens = [len(r.tokens) for r in requests]
        batch, longest_past, most_new = len(requests), max(past_lens), max(new_lens)
        ids = np.zeros((batch, most_new), np.int64)
        positions = np.zeros((batch, most_new), np.int64)
        mask = np.zeros((batch, longest_past + most_new), np.int64)
        for i, r in enumerate(requests):
            ids[i, : new_lens[i]] = r.tokens
            positions[i] = r.first_position + np.minimum(np.arange(most_new), new_lens[i] - 1)
            mask[i, : past_lens[i]] = pasts[i].alive
            mask[i, longest_past : longest_past + new_lens[i]] = 1
        if batch == 1:
            past = list(zip(pasts[0].keys, pasts[0].values))
        else:
            past = []
            for layer, geometry in enumerate(self.decoder.layers):
                shape = (batch, geometry.num_kv_heads, longest_past, geometry.head_dim)
                key, value = np.zeros(shape, self.decoder.kv_dtype), np.zeros(shape, self.decoder.kv_dtype)
                for i, seq_past in enumerate(pasts):
                    key[i, :, : past_lens[i]] = seq_past.keys[layer][0]
                    value[i, :, : past_lens[i]] = seq_past.values[layer][0]
                past.append((key, value))
        out = self.decoder.forward(ids, mask, positions, past)
        outputs = []
        for i, r in enumerate(requests):
            if session_layout:  # row i of the presents, whole (contiguous): padding slots are dead
                self.cache.append_from_session(r.seq_id, [k[i : i + 1] for k, _ in out.presents],
                                               [v[i : i + 1] for _, v in out.presents], mask[i].astype(np.bool_))
            else:
                new = slice(longest_past, longest_past + new_lens[i])
                self.cache.append(r.seq_id, [k[i : i + 1, :, new] for k, _ in out.presents],
                                  [v[i : i + 1, :, new] for _, v in out.presents])
            outputs.append(SequenceOutput(out.logits[i, _logit_rows(r, new_lens[i])],
                                          {name: value[i, : new_lens[i]] for name, value in out.extras.items()}))
        return outputs

    def _in_place_serves(self, request: FeedRequest) -> bool:
        """Whether this batch-1 call runs on the in-place graph: where there is one, its
        positions are the slot indices, and either the decoder serves no other sequence or
        its sessions keep no thread pool spinning (one thread, or spinning off, as in a
        Serve replica). The standard session's pool spins after each batched call, and
        when in-place and standard calls alternate on their own cores -- a batched verify, a
        prefill on the in-place graph, the next verify -- the two fight over them (docs/design-decisions.md
        measures what that costs)."""
        return (self.in_place is not None and request.first_position == self.cache.length(request.seq_id)
                and (self.in_place.batched or not self._pools_spin or self.cache.sequence_count == 1))

    def _feed_in_place(self, request: FeedRequest) -> SequenceOutput:
        """``feed_batch`` at batch 1 on the in-place graph: the new tokens' KV lands in the
        sequence's buffer right after its live slots, and that buffer (views of it) becomes
        its session copy, so the next call, after a rewind or not, goes on in place. A new
        buffer, holding a copy of the live past, only where the session copy is no
        buffer's (a prefill, a batched call's row) or the buffer is full."""
        seq_id = request.seq_id
        length = self.cache.length(seq_id)
        needed = length + len(request.tokens)
        past = self.cache.kept_session(seq_id)
        buffer = past.buffer if past is not None else None
        if not (isinstance(buffer, KVBuffer) and needed <= buffer.capacity):
            buffer = self.in_place.new_buffer(buffer_capacity(needed, self.max_context))
            self.cache.copy_past_into(seq_id, buffer.keys, buffer.values)  # a prefill's past is in the pools only
            self.buffers_made += 1
        last = len(request.tokens) - 1 if request.last_logits_only else 0
        logits, extras = self.in_place.run(buffer, length, np.asarray([request.tokens]), logits_from=last)
        self.cache.append_in_buffer(seq_id, buffer, needed)
        return SequenceOutput(logits[0], {name: value[0] for name, value in extras.items()})

    def _feed_batched(self, requests: Sequence[FeedRequest]) -> list[SequenceOutput]:
        """``feed_batch`` at batch > 1 in the session layout, on a kept ``BatchLayout``."""
        seq_ids = [r.seq_id for r in requests]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence may appear once per batch, got {seq_ids}")
        new_lens = [len(r.tokens) for r in requests]
        arrangement = self.batch_layouts.arrange(seq_ids)
        batch, length, most_new = arrangement.batch, arrangement.length, max(new_lens)
        ids = np.zeros((batch, most_new), np.int64)
        positions = np.zeros((batch, most_new), np.int64)
        mask = np.zeros((batch, length + most_new), np.int64)
        mask[:, length] = 1  # a dummy row attends to its own token: no row is wholly masked
        for row, alive in enumerate(arrangement.alive):
            if alive is not None:
                mask[row, :length] = alive
        for r, row, n in zip(requests, arrangement.row_of, new_lens):
            ids[row, :n] = r.tokens
            positions[row] = r.first_position + np.minimum(np.arange(most_new), n - 1)
            mask[row, length : length + n] = 1
        try:
            out = self.decoder.forward(ids, mask, positions, list(zip(arrangement.keys, arrangement.values)))
            for r, row in zip(requests, arrangement.row_of):
                self.cache.append_from_session(r.seq_id, [k[row : row + 1] for k, _ in out.presents],
                                               [v[row : row + 1] for _, v in out.presents], mask[row].astype(np.bool_))
        except BaseException:
            self.batch_layouts.forget(arrangement)
            raise
        self.batch_layouts.remember(arrangement, seq_ids, out.presents)
        return [SequenceOutput(out.logits[row, _logit_rows(r, n)],
                               {name: value[row, :n] for name, value in out.extras.items()})
                for r, row, n in zip(requests, arrangement.row_of, new_lens)]

    def _feed_rows(self, requests: Sequence[FeedRequest]) -> list[SequenceOutput]:
        """``feed_batch`` at batch > 1 in a row-invariant family: one in-place call over a
        batch buffer, each sequence in its own row (``engine.model.row_buffers``)."""
        assert self.row_buffers is not None
        seq_ids = [r.seq_id for r in requests]
        if len(set(seq_ids)) != len(seq_ids):
            raise ValueError(f"a sequence may appear once per batch, got {seq_ids}")
        call = self.row_buffers.arrange(seq_ids, max(len(r.tokens) for r in requests))
        try:
            logits, extras = self.row_buffers.run(call, [r.tokens for r in requests])
        except BaseException:
            self.row_buffers.forget(call)
            raise
        outputs = []
        for index, (r, row) in enumerate(zip(requests, call.row_of)):
            n = len(r.tokens)
            self.cache.append_in_buffer(r.seq_id, self.row_buffers.row_buffer(call, index), int(call.lengths[row]) + n)
            outputs.append(SequenceOutput(logits[row, _logit_rows(r, n)],
                                          {name: value[row, :n] for name, value in extras.items()}))
        return outputs

    def probe(self) -> None:
        """Run the real session on one token (no past) and check the logits are finite."""
        one = np.zeros((1, 1), np.int64)
        out = self.decoder.forward(one, np.ones((1, 1), np.int64), one, self.decoder.empty_past())
        check_finite([out.logits], f"model {self.decoder.model_dir}")

    def encode_prompt(self, prompt: str | Sequence[int]) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, self.decoder.vocab_size, self.max_context)
