"""The target worker's merging of several routers' calls (``deployments/step_merging.py``),
driven from real threads as Ray's threaded actor drives it."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest

from specserve.deployments.step_merging import StepMerger


@dataclass
class Item:
    seq_id: str


@dataclass
class Result:
    seq_id: str
    step: int


class Target:
    """Records each step's sequences; a step takes ``seconds``."""

    def __init__(self, seconds: float = 0.02, fail: bool = False) -> None:
        self.steps: list[list[str]] = []
        self.seconds, self.fail = seconds, fail

    def run(self, prefills, verifies, releases):
        time.sleep(self.seconds)
        if self.fail:
            raise RuntimeError("the step failed")
        self.steps.append([item.seq_id for item in (*prefills, *verifies)])
        return [Result(item.seq_id, len(self.steps)) for item in (*verifies, *prefills)]  # any order


def test_a_lone_caller_runs_at_once_and_alone():
    target = Target()
    merger = StepMerger(target.run)
    for n in range(3):
        started = time.monotonic()
        results, merged = merger.step("a", [], [Item("a:1"), Item("a:2")], [])
        assert time.monotonic() - started < target.seconds + 0.015  # no wait for anyone
        assert [r.seq_id for r in results] == ["a:1", "a:2"] and not merged
    assert target.steps == [["a:1", "a:2"]] * 3 and merger.merged_steps == 0


def test_two_callers_in_lockstep_share_one_step_and_get_their_own_results_in_order():
    target = Target()
    merger = StepMerger(target.run)

    def router(name: str, ticks: int) -> list[bool]:
        seen = []
        for tick in range(ticks):
            time.sleep(0.002 if name == "b" else 0.0)  # b's next call always comes a little later
            items = [Item(f"{name}:{i}") for i in range(3)]
            results, merged = merger.step(name, [items[0]], items[1:], [])
            assert [r.seq_id for r in results] == [item.seq_id for item in items]
            seen.append(merged)
        return seen

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.submit(router, "a", 10), pool.submit(router, "b", 10)
        a, b = a.result(timeout=30), b.result(timeout=30)
    assert sum(a) >= 8 and sum(b) >= 8  # after the first ticks, every step carries both
    assert len(target.steps) <= 12 and merger.merged_steps >= 8


def test_a_caller_that_goes_quiet_stops_being_waited_for():
    target = Target(seconds=0.01)
    merger = StepMerger(target.run)
    merger.step("b", [], [Item("b:1")], [])  # b called once, then went away
    time.sleep(0.1)  # longer than it stays active
    started = time.monotonic()
    merger.step("a", [], [Item("a:1")], [])
    assert time.monotonic() - started < 0.01 + 0.01


def test_a_step_that_fails_raises_in_every_call_it_carried():
    merger = StepMerger(Target(fail=True).run)
    barrier = threading.Barrier(2)

    def call(name):
        barrier.wait()
        with pytest.raises(RuntimeError, match="the step failed"):
            merger.step(name, [], [Item(f"{name}:1")], [])

    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(call, "a"), pool.submit(call, "b")]:
            future.result(timeout=10)
