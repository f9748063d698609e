"""Which target replica admission puts a new sequence on.

``prefix_aware`` (the default) follows Ray Serve LLM's ``PrefixCacheAffinityRouter``:
while the replicas' loads are within ``IMBALANCE`` sequences of each other, a sequence
goes to the replica holding the longest cached prefix of its prompt, if that covers at
least ``MIN_MATCH`` of it, else to the roomiest replica (most blocks it could grant,
then the fewest sequences), as admission chose before it knew prefixes; loads further
apart than that send it to the least loaded replica, whatever it caches. ``round_robin`` takes the replicas in
turn, whatever they cache: the baseline ``bench/prefix_cache.py`` measures against.
Either way only a replica with room for the whole reservation now is chosen.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

ReplicaRouting = Literal["prefix_aware", "round_robin"]

# Ray Serve LLM's defaults are a 10-request imbalance and a 10 % match; a replica here
# batches up to 32 sequences per lane, so 8 sequences is a quarter of a full batch.
IMBALANCE = 8
MIN_MATCH = 0.1


@dataclass(frozen=True)
class Candidate:
    replica: str
    cached_blocks: int  # leading blocks of the prompt this replica already holds
    room: int           # blocks it could still grant (free + cached, less this prompt's own hits)
    needed: int         # blocks the sequence would take from ``room`` here
    load: int           # sequences it holds now


class ReplicaChooser:
    def __init__(self, routing: ReplicaRouting = "prefix_aware") -> None:
        self.routing = routing
        self._turn = 0

    def choose(self, candidates: Sequence[Candidate], query_blocks: int) -> Candidate | None:
        """The replica for a sequence whose prompt has ``query_blocks`` cacheable blocks;
        None when no candidate has room now."""
        fitting = [c for c in candidates if c.needed <= c.room]
        if not fitting:
            return None
        if self.routing == "round_robin":
            ordered = sorted(candidates, key=lambda c: c.replica)
            for step in range(len(ordered)):
                pick = ordered[(self._turn + step) % len(ordered)]
                if pick.needed <= pick.room:
                    self._turn = (self._turn + step + 1) % len(ordered)
                    return pick
        loads = [c.load for c in fitting]
        balanced = max(loads) - min(loads) <= IMBALANCE
        if not balanced:
            return min(fitting, key=lambda c: (c.load, -c.room))
        best = max(fitting, key=lambda c: (c.cached_blocks, -c.load, c.room))
        if best.cached_blocks and best.cached_blocks >= MIN_MATCH * query_blocks:
            return best
        return max(fitting, key=lambda c: (c.room, -c.load))
