"""Several routers' calls to one target worker, run as one batched step.

Each router replica coordinates its own sequences and sends a target worker one call per
tick. The worker runs one step at a time, so without merging two routers' calls take
turns: two batches of 16 cost what 16 x 2 rows cost, not what one batch of 32 does (on
this CPU 2 x 40 ms against 75 ms; on a GPU, where a step is memory-bound, nearly 2x).
``StepMerger`` collects the calls that arrive together and runs them as one step:

- a call that finds the worker idle runs at once, unless another caller that is active
  (it called in the last few steps) has not called yet: then it waits for that caller,
  at most a quarter of the last step's time from when the worker went idle (a router's
  next call comes as soon as it has taken its last results);
- calls that arrive while a step runs join the next one;
- each caller gets its own sequences' results, in its own order; a step that raises
  raises in every call it carried.

One router is one caller, so it never waits; its lanes' calls are merged only when both
wait behind another call.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Sequence

ACTIVE_STEPS = 3        # a caller is active if it called within this many last steps' time...
ACTIVE_MIN_S = 0.05     # ...or this long, whichever is longer
WAIT_FRACTION = 0.25    # the longest wait for an active caller, as a share of the last step's time


@dataclass(eq=False)
class _Call:
    caller: str
    prefills: list
    verifies: list
    releases: list
    arrived: float
    results: list | None = None
    error: BaseException | None = None
    done: bool = False
    merged: bool = False  # ran with another call's sequences


@dataclass
class StepMerger:
    """``run(prefills, verifies, releases)`` returns one result per prefill and verify,
    each with a ``seq_id``; the merger calls it from the calling threads, one at a time."""

    run: Callable[[list, list, list], list]
    _cv: threading.Condition = field(default_factory=threading.Condition)
    _queue: list[_Call] = field(default_factory=list)
    _busy: bool = False
    _last_call: dict[str, float] = field(default_factory=dict)
    _last_step_s: float = 0.0
    _idle_since: float = 0.0  # when the last step ended
    merged_steps: int = 0  # steps that carried more than one call's sequences

    def step(self, caller: str, prefills: Sequence, verifies: Sequence,
             releases: Sequence[Hashable]) -> tuple[list, bool]:
        """Run this call, alone or with others; returns its results and whether the step
        carried other calls' sequences too."""
        call = _Call(caller, list(prefills), list(verifies), list(releases), time.monotonic())
        with self._cv:
            if call.prefills or call.verifies:  # a release-only call (the KV manager's reaper) is no caller
                self._last_call[caller] = call.arrived
            self._queue.append(call)
            self._cv.notify_all()
            while not call.done:
                wait = self._wait_before_running()
                if wait is None:
                    self._cv.wait()
                elif wait > 0:
                    self._cv.wait(wait)
                else:
                    batch, self._queue, self._busy = self._queue, [], True
                    self._cv.release()
                    try:
                        self._run(batch)
                    finally:
                        self._cv.acquire()
                        self._busy = False
                        self._cv.notify_all()
        if call.error is not None:
            raise call.error
        return call.results, call.merged

    def _wait_before_running(self) -> float | None:
        """None: not this thread's turn (a step runs, or nothing is queued); 0: run the
        queue now; > 0: wait that long for an active caller that has not called yet."""
        if self._busy or not self._queue:
            return None
        now = time.monotonic()
        active_since = now - max(ACTIVE_MIN_S, ACTIVE_STEPS * self._last_step_s)
        queued = {call.caller for call in self._queue}
        missing = [c for c, at in self._last_call.items() if at >= active_since and c not in queued]
        if not missing:
            return 0.0
        waited = now - max(self._idle_since, min(call.arrived for call in self._queue))
        return max(0.0, WAIT_FRACTION * self._last_step_s - waited)

    def _run(self, batch: list[_Call]) -> None:
        started = time.monotonic()
        try:
            results = self.run([p for c in batch for p in c.prefills], [v for c in batch for v in c.verifies],
                               [r for c in batch for r in c.releases])
        except BaseException as exc:  # noqa: BLE001 - every call it carried raises it
            for call in batch:
                call.error, call.done = exc, True
            return
        finally:
            self._idle_since = time.monotonic()
            self._last_step_s = self._idle_since - started
        by_id = {result.seq_id: result for result in results}
        merged = sum(1 for call in batch if call.prefills or call.verifies) > 1
        self.merged_steps += merged
        for call in batch:
            call.results = [by_id[item.seq_id] for item in (*call.prefills, *call.verifies)]
            call.merged, call.done = merged, True
