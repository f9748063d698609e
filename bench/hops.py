"""What a speculative round's hops cost on Ray, by the ways of making them, interleaved.

    .venv/bin/python bench/hops.py [--rounds 200] [--repeats 5] [--target-ms 20] [--head-ms 2] [--record DIR]

A round of a head mode (eagle3, mtp) needs the target's anchor to draft and the drafts
to verify. Three ways to move them, each between a caller (the router) and two actors
(a proposer worker and a target worker) that busy-work for ``--head-ms`` and
``--target-ms`` per call (CPU, as a model does) and pass a hidden-state-sized anchor
(``--anchor-kb``):

- ``router``: the router calls the proposer, then the target: two round trips through
  the router, the anchor by value;
- ``router-ref``: the same with the anchor put in the object store by the target and
  passed on by reference (today's round: the router never holds it);
- ``chained``: the router calls the target, which hands its anchor straight to the
  proposer and returns the next round's drafts with its results (one round trip through
  the router, one hop between the workers);
- ``compiled``: the same chain as a Ray Compiled Graph (proposer -> target), driven by
  the router.

Also each way with no work at all (``--target-ms 0 --head-ms 0``: pure hop cost). It
prints each way's milliseconds per round beyond the work, median of ``--repeats`` runs
taking turns.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402


def busy(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


class Proposer:
    def __init__(self, head_s: float) -> None:
        self.head_s = head_s

    def propose(self, anchor):
        import ray

        if isinstance(anchor, ray.ObjectRef):
            anchor = ray.get(anchor)
        busy(self.head_s)
        return [1, 2, 3, 4]


class Target:
    def __init__(self, target_s: float, anchor_floats: int, proposer=None) -> None:
        self.target_s, self.proposer = target_s, proposer
        self.anchor = np.zeros(anchor_floats, dtype=np.float32)

    def step(self, drafts):
        busy(self.target_s)
        return [5], self.anchor

    def step_by_ref(self, drafts):
        import ray

        busy(self.target_s)
        return [5], ray.put(self.anchor)

    def step_and_propose(self, drafts):
        """Verify, then hand the anchor to the proposer and return its drafts with the results."""
        import ray

        busy(self.target_s)
        return [5], ray.get(self.proposer.propose.remote(self.anchor))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--target-ms", type=float, default=20.0)
    parser.add_argument("--head-ms", type=float, default=2.0)
    parser.add_argument("--anchor-kb", type=float, default=9.0, help="SmolLM2: 4 hidden states of 576 floats")
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "hops"):
        run(args)


def run(args: argparse.Namespace) -> None:
    import ray
    from ray.dag import InputNode

    from specserve.cluster.local import start_local_ray

    start_local_ray()
    floats = int(args.anchor_kb * 1024 / 4)
    results: dict[tuple[str, bool], list[float]] = {}
    for working in (False, True):
        head_s, target_s = (args.head_ms / 1000, args.target_ms / 1000) if working else (0.0, 0.0)
        proposer = ray.remote(Proposer).options(num_cpus=0.1).remote(head_s)
        chained_proposer = ray.remote(Proposer).options(num_cpus=0.1).remote(head_s)
        target = ray.remote(Target).options(num_cpus=0.1).remote(target_s, floats)
        chained = ray.remote(Target).options(num_cpus=0.1).remote(target_s, floats, chained_proposer)
        graph_proposer = ray.remote(Proposer).options(num_cpus=0.1).remote(head_s)
        graph_target = ray.remote(Target).options(num_cpus=0.1).remote(target_s, floats)
        with InputNode() as anchor:
            dag = graph_target.step.bind(graph_proposer.propose.bind(anchor))
        compiled = dag.experimental_compile()
        ray.get([target.step.remote([]), chained.step_and_propose.remote([]), proposer.propose.remote(None)])

        def router_round(state):
            drafts = ray.get(proposer.propose.remote(state))
            return ray.get(target.step.remote(drafts))[1]

        def router_ref_round(state):
            drafts = ray.get(proposer.propose.remote(state))
            return ray.get(target.step_by_ref.remote(drafts))[1]

        def chained_round(state):
            return ray.get(chained.step_and_propose.remote(state))[1]

        def compiled_round(state):
            return ray.get(compiled.execute(state))[1]

        ways = {"router": router_round, "router-ref": router_ref_round, "chained": chained_round,
                "compiled": compiled_round}
        for way in ways:
            state = np.zeros(floats, dtype=np.float32)
            for _ in range(10):
                state = ways[way](state)  # warm-up
        for repeat in range(args.repeats):
            for way in (list(ways) if repeat % 2 == 0 else list(reversed(ways))):
                state = np.zeros(floats, dtype=np.float32)
                started = time.perf_counter()
                for _ in range(args.rounds):
                    state = ways[way](state if way != "compiled" or not isinstance(state, ray.ObjectRef)
                                      else np.zeros(floats, dtype=np.float32))
                per_round = (time.perf_counter() - started) / args.rounds
                results.setdefault((way, working), []).append(per_round - head_s - target_s)
        compiled.teardown()
        for actor in (proposer, chained_proposer, target, chained, graph_proposer, graph_target):
            ray.kill(actor)
    ray.shutdown()
    print(f"{args.rounds} rounds x {args.repeats} repeats a way, ways taking turns; anchor {args.anchor_kb:g} KB; "
          f"work per round: head {args.head_ms:g} ms + target {args.target_ms:g} ms (busy CPU)\n")
    print("| way | ms a round beyond the work, no work | ms a round beyond the work, with work |")
    print("|---|---|---|")
    for way in ("router", "router-ref", "chained", "compiled"):
        idle, working = results[(way, False)], results[(way, True)]
        print(f"| {way} | {1000 * statistics.median(idle):.2f} ({1000 * min(idle):.2f}-{1000 * max(idle):.2f}) | "
              f"{1000 * statistics.median(working):.2f} ({1000 * min(working):.2f}-{1000 * max(working):.2f}) |")


if __name__ == "__main__":
    main()
