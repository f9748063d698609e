"""The extracted target states (``extract.py``) as batches of unrolled draft chains.

An anchor is a stored row a (position p of some answer): the target's states at p, the
pending token at p + 1 (which the target committed there), and the target's next-token
distributions at p + 1, p + 2, ... -- what draft steps 0, 1, ... must predict, exactly
the chain a head runs at serving time after the target commits position p. Steps past
the answer's last stored row are masked out.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass
class ChainBatch:
    fused: np.ndarray        # [B, 3H] target low|mid|high at the anchor
    final: np.ndarray        # [B, H] target final normalised hidden at the anchor
    inputs: np.ndarray       # [B, K] token fed at step i (the token at p + 1 + i)
    top_ids: np.ndarray      # [B, K, top] the target's likeliest next tokens after step i's input
    top_logp: np.ndarray     # [B, K, top] their log-probabilities
    valid: np.ndarray        # [B, K] bool: step i lies inside the answer


class Features:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        index = json.loads((directory / "index.json").read_text())
        self.sequences = index["sequences"]
        self.top_k = index["top_k"]
        load = lambda name: np.load(directory / f"{name}.npy", mmap_mode="r")  # noqa: E731
        self.tokens, self.final, self.fused = load("tokens"), load("final"), load("fused")
        self.top_ids, self.top_logp = load("top_ids"), load("top_logp")
        ends = np.zeros(len(self.tokens), np.int64)
        for seq in self.sequences:
            ends[seq["row"] : seq["row"] + seq["rows"]] = seq["row"] + seq["rows"]
        self.end_of_row = ends  # one past the last row of each row's answer
        # Anchors: every row but an answer's last (which has no pending token after it).
        self.anchors = np.nonzero(np.arange(len(self.tokens)) + 1 < ends)[0]
        # Where a row's position starts its sequence's KV rows: row r holds position
        # (prompt_len - 1) + (r - first row), and that sequence's KV begins at kv_row.
        self.kv_start = np.zeros(len(self.tokens), np.int64)
        self.position = np.zeros(len(self.tokens), np.int64)
        for seq in self.sequences:
            rows = slice(seq["row"], seq["row"] + seq["rows"])
            self.kv_start[rows] = seq["kv_row"]
            self.position[rows] = seq["prompt_len"] - 1 + np.arange(seq["rows"])
        self.kv_layers = tuple(index.get("kv_layers", ()))
        self._kv = {layer: load(f"kv{layer}") for layer in self.kv_layers}

    def batch(self, anchors: np.ndarray, steps: int) -> ChainBatch:
        offsets = anchors[:, None] + 1 + np.arange(steps)[None]          # the row of step i's input token
        valid = offsets < self.end_of_row[anchors][:, None]
        rows = np.where(valid, offsets, anchors[:, None])                 # any in-range row where masked
        return ChainBatch(np.asarray(self.fused[anchors], np.float32), np.asarray(self.final[anchors], np.float32),
                          np.asarray(self.tokens[rows], np.int64), np.asarray(self.top_ids[rows], np.int64),
                          np.asarray(self.top_logp[rows], np.float32), valid)

    def context_kv(self, anchors: np.ndarray) -> tuple[list[tuple[np.ndarray, np.ndarray]], np.ndarray]:
        """Per stored KV layer, the target's keys and values ``[B, heads, L, dim]`` at
        positions 0..p of each anchor (right-padded to the longest), and the mask ``[B, L]``:
        what a shared-KV assistant reads when the target has committed position p."""
        lengths = self.position[anchors] + 1
        longest = int(lengths.max())
        mask = np.arange(longest)[None] < lengths[:, None]
        rows = np.where(mask, self.kv_start[anchors][:, None] + np.arange(longest)[None], self.kv_start[anchors][:, None])
        layers = []
        for layer in self.kv_layers:
            kv = np.asarray(self._kv[layer][rows], np.float32) * mask[..., None, None, None]  # [B, L, 2, heads, dim]
            layers.append((kv[:, :, 0].transpose(0, 2, 1, 3).copy(), kv[:, :, 1].transpose(0, 2, 1, 3).copy()))
        return layers, mask

    def token_counts(self, vocab: int) -> np.ndarray:
        return np.bincount(np.asarray(self.tokens), minlength=vocab)
