"""How the target worker runs one round's verifies: one padded call, or the sequences
without drafts apart from those with them (``TargetWorker``), as its measured table
(``sched.cost_tables``) predicts cheaper. The cost models use the same rule to tell the
padded calls a plan prices from the split ones it does not (``VerifyCostModel.observe``).
"""
from __future__ import annotations

from typing import Sequence

from specserve.engine.sched.cost_tables import VerifyCostTable

SPLIT_MARGIN = 0.4  # a split must be predicted this much cheaper: it moves the drafting sequences'
                    # pasts into a batch layout of their own and back, copies the table does not time
                    # (docs/design-decisions.md measures the margins tried)


def verify_groups(rows: Sequence[int], table: VerifyCostTable | None) -> list[list[int]]:
    """How one round's verifies run, given each sequence's rows (its drafts + 1): one call
    padded to the widest (a batched call runs every sequence to the longest one's rows),
    or the sequences without drafts in one call and those with drafts in another,
    whichever ``table`` predicts cheaper.

    At a large batch a CPU pass is compute-bound: one sequence's drafts pad every
    sequence to its rows, so a few drafting sequences make a round dearer than plain
    decoding; run apart, they cost a small call (it pays most for pinned prompt lookup,
    whose drafts come and go per sequence: docs/design-decisions.md). At a small batch
    the second call's fixed cost wins and one padded call stays. The draft-length planner
    still costs a round padded: with the margin a split is only ever cheaper than that.
    Indices in ``rows`` order."""
    everyone = list(range(len(rows)))
    plain = [i for i, w in enumerate(rows) if w == 1]
    drafting = [i for i, w in enumerate(rows) if w > 1]
    if table is None or not plain or not drafting:
        return [everyone]
    widest = max(rows)
    padded = table.predict(len(rows), len(rows) * widest)
    split = table.predict(len(plain), len(plain)) + table.predict(len(drafting), len(drafting) * widest)
    return [plain, drafting] if split < (1 - SPLIT_MARGIN) * padded else [everyone]
