"""The server (Ray Serve, real HTTP) against the in-process engine, interleaved, on the default model.

    .venv/bin/python bench/distributed.py [--model DIR] [--modes none prompt_lookup] [--streams 1 4 16 32]
        [--new-tokens 64] [--repeats 2] [--min-requests 8] [--configs fixed autoscaled gpu-yaml]
        [--cpu-streams 16] [--record DIR]

For each server configuration (``--configs``: ``fixed`` is serve_config.yaml's shape,
``autoscaled`` every target and proposer deployment autoscaled between 1 and 2 replicas on
their own load, ``token-events`` the fixed one streaming one SSE event per token instead
of one per write, ``gpu-yaml`` cluster/serve_config.gpu.yaml's CPU variant on a local Ray
cluster of three nodes advertising the custom resources that config places by), each
concurrency and each mode it runs that many streaming requests at once (held-out prompts:
chat prompts in the model's template, or the fixture's code prompts; greedy, EOS ignored)
in-process through ``Engine.generate`` from threads and through the OpenAI streaming API
on 127.0.0.1, at least ``--min-requests`` requests a measurement, and prints aggregate
tokens/s, time to first token and inter-token latency. Each repeat (``--repeats``) is cut
into slices of one request per stream, and every mode runs each slice in-process and
served in turn, the orders reversed on the next slice, so the machine's drift falls on
both sides and on every mode alike and a ratio compares runs seconds apart: the spread of
each per-repeat ratio says how noisy a cell was. Every served output is checked
token-for-token against the in-process one.

At one stream the bench breaks a served round down over the first repeat, from the
router's tick timer and the workers' own timers (outside the tick: HTTP/SSE and the
router's loop; each hop: the router's call minus the worker's time; the workers'
object-store traffic; their model compute). At ``--cpu-streams`` it reads each Ray
process's CPU time from /proc around the first served slice and prints CPU milliseconds per token by process (HTTP proxy, router, target
worker, proposer workers, the client).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record, sse  # noqa: E402
from specserve.engine import Engine, EngineConfig, GenerationOptions  # noqa: E402
from specserve.engine.model.default_model import DEFAULT_MODEL_DIR  # noqa: E402


@dataclass
class StreamResult:
    token_ids: list[int]
    started: float
    stamps: list[float]   # arrival time of each token
    rounds: int

    @property
    def ttft(self) -> float:
        return self.stamps[0] - self.started

    @property
    def itl(self) -> float:
        return (self.stamps[-1] - self.stamps[0]) / max(1, len(self.stamps) - 1)


@dataclass
class Level:
    streams: int
    tokens_per_s: float
    ttft_ms: float
    itl_ms: float
    ms_per_round: float
    results: list[StreamResult]
    seconds: float = 0.0
    prompts: list[str] = field(default_factory=list)  # each result's prompt


def measure(run_one, prompts: list[str], streams: int, rounds_per_level: int, start: int = 0) -> Level:
    """``streams`` requests at once, ``rounds_per_level`` each, on the prompts from index
    ``start`` on (cycling)."""
    jobs = [prompts[(start + i) % len(prompts)] for i in range(streams * rounds_per_level)]
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(run_one, jobs))
    elapsed = time.perf_counter() - started
    tokens = sum(len(r.token_ids) for r in results)
    return Level(streams, tokens / elapsed, 1000 * statistics.mean(r.ttft for r in results),
                 1000 * statistics.mean(r.itl for r in results),
                 1000 * statistics.mean((r.stamps[-1] - r.started) / max(1, r.rounds + 1) for r in results), results,
                 elapsed, jobs)


def in_process_runner(engine: Engine, options: GenerationOptions):
    def run(prompt: str) -> StreamResult:
        stamps: list[float] = []
        started = time.perf_counter()
        result = engine.generate(prompt, options, on_token=lambda event: stamps.append(time.perf_counter()))
        return StreamResult(result.token_ids, started, stamps, result.speculative.verification_steps)
    return run


def server_runner(base_url: str, mode: str, new_tokens: int):
    import httpx

    client = httpx.Client(timeout=300, limits=httpx.Limits(max_connections=64))

    def run(prompt: str) -> StreamResult:
        body = {"prompt": prompt, "max_tokens": new_tokens, "temperature": 0,
                "ignore_eos": True, "stream": True, "speculative_mode": mode, "return_token_ids": True}
        ids, stamps, rounds = [], [], 0
        started = time.perf_counter()
        with client.stream("POST", f"{base_url}/v1/completions", json=body) as response:
            response.raise_for_status()
            for chunk in sse.chunks(response):
                if chunk.get("speculative"):
                    rounds = chunk["speculative"]["rounds"]
                now = time.perf_counter()
                for choice in chunk.get("choices", []):
                    for token in choice.get("token_ids", []):
                        ids.append(token)
                        stamps.append(now)
        return StreamResult(ids, started, stamps, rounds)
    return run


# -- where a served round's time goes ------------------------------------------------------
def snapshot(base_url: str, mode: str) -> dict[str, float]:
    """Cumulative timers: the router's ticks and the target's and ``mode``'s proposer's workers."""
    from urllib.request import urlopen

    from ray import serve

    from specserve.engine.speculative.proposers.registry import PROPOSER_MODES

    status = json.loads(urlopen(f"{base_url}/specserve/status").read())
    target = serve.get_deployment_handle("TargetModel", "specserve").kv_usage.remote().result()
    out = {"ticks": status["ticks"], "rounds": status["sequence_rounds"],
           "tick_s": status["mean_tick_ms"] * status["ticks"] / 1000,
           "propose_s": status["mean_propose_ms"] * status["ticks"] / 1000,
           "target_s": status["mean_target_ms"] * status["ticks"] / 1000,
           "target_steps": target["steps"], "target_step_s": target["step_s"], "target_compute_s": target["compute_s"],
           "proposer_calls": 0, "proposer_s": 0.0, "proposer_compute_s": 0.0}
    kind = PROPOSER_MODES.get(mode)
    if kind is not None and not kind.in_coordinator:
        stats = serve.get_deployment_handle(kind.deployment, "specserve").transport_stats.remote().result()
        out.update(proposer_calls=stats["calls"], proposer_s=stats["propose_s"], proposer_compute_s=stats["compute_s"])
    return out


def breakdown(d: dict, round_ms: float) -> str:
    """Per-round milliseconds at one stream from the timers' growth ``d`` (``snapshot``'s
    keys; one sequence per tick; with plain_steps > 1 a tick runs several of its rounds,
    and its costs are spread over them). With one target replica: the target's counters
    are that replica's."""
    rounds = max(d["rounds"], 1)

    def ms(seconds: float) -> float:
        return 1000 * seconds / rounds

    tick = ms(d["tick_s"])
    parts = [f"round {round_ms:.1f} ms = outside the tick (HTTP/SSE, router loop) {round_ms - tick:.1f}",
             f"router->target hop {ms(d['target_s'] - d['target_step_s']):.1f}",
             f"target worker object store {ms(d['target_step_s'] - d['target_compute_s']):.1f}",
             f"target compute {ms(d['target_compute_s']):.1f}"]
    if d["proposer_calls"]:
        parts += [f"router->proposer hop {ms(d['propose_s'] - d['proposer_s']):.1f}",
                  f"proposer worker object store {ms(d['proposer_s'] - d['proposer_compute_s']):.1f}",
                  f"proposer compute {ms(d['proposer_compute_s']):.1f}"]
    else:
        parts.append(f"in-router drafting {ms(d['propose_s']):.1f}")
    other = tick - ms(d["propose_s"] + d["target_s"])
    parts.append(f"router tick bookkeeping {other:.1f}")
    return ", ".join(parts) + f"; {rounds / max(d['ticks'], 1):.2f} rounds a tick"


# -- CPU time by process ---------------------------------------------------------------------
PROCESS_ROLES = (("ProxyActor", "HTTP proxy"), (":Router", "router"), ("TargetStepper", "target worker"),
                 ("ProposerStepper", "proposer workers"), (":TargetModel", "replica shells"),
                 ("Proposer", "replica shells"), ("ServeController", "Serve controller"))


def descendants(root: int) -> set[str]:
    """Processes below ``root``: the Ray this bench started runs under it (its raylets and
    their workers), and other Ray instances on a shared machine do not."""
    children: dict[str, list[str]] = defaultdict(list)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            children[Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1]].append(pid)
        except OSError:
            continue
    found, todo = set(), [str(root)]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


def ray_process_cpu() -> dict[str, float]:
    """CPU seconds so far of the Ray actor processes this bench started, summed by role
    (their titles, ``ray::ServeReplica:app:Deployment`` / ``ray::ActorClass...``), and of
    this process (the benchmark's HTTP client)."""
    tick = os.sysconf("SC_CLK_TCK")
    out: dict[str, float] = defaultdict(float)
    for pid in descendants(os.getpid()):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if not title.startswith("ray::"):
                continue
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        role = next((name for key, name in PROCESS_ROLES if key in title), None)
        if role is not None:
            out[role] += (int(fields[11]) + int(fields[12])) / tick
    usage = os.times()
    out["client (this process)"] = usage.user + usage.system
    return out


def cpu_per_token(before: dict[str, float], after: dict[str, float], tokens: int) -> str:
    parts = [f"{role} {1000 * (after[role] - before.get(role, 0.0)) / tokens:.2f}" for role in after]
    total = sum(after[role] - before.get(role, 0.0) for role in after)
    return f"{1000 * total / tokens:.2f} ms CPU per token = " + ", ".join(parts)


# -- server configurations -----------------------------------------------------------------
def server_args(config: str, args: argparse.Namespace, modes: list[str], model: Path) -> dict:
    """The application's args for one measured configuration."""
    from specserve.deployments.autoscaling import replica_load_autoscaling
    from specserve.engine.speculative.proposers.registry import PROPOSER_MODES

    scheduler = {"lanes": args.lanes, **({} if args.plain_steps is None else {"plain_steps": args.plain_steps})}
    out = {"model_dir": str(model), "stream_interval": args.stream_interval,
           "stream_writes_per_s": args.stream_writes_per_s or None,
           "engine": {"device": "cpu", "intra_op_threads": args.target_threads, "scheduler": scheduler,
                      "speculative": {"default_mode": "auto"}}}
    if config == "autoscaled":  # min 1, max 2; one replica's worth of load from the start, so at most streams
        target = replica_load_autoscaling(1, 2, target_sequences=max(args.streams), target_kv_fraction=0.8,
                                          upscale_delay_s=5, downscale_delay_s=30)
        proposer = replica_load_autoscaling(1, 2, target_sequences=max(args.streams), upscale_delay_s=5,
                                            downscale_delay_s=30)
        out["deployment_overrides"] = {"TargetModel": {"autoscaling_config": target}, **{
            PROPOSER_MODES[m].deployment: {"autoscaling_config": proposer} for m in modes
            if m != "none" and not PROPOSER_MODES[m].in_coordinator}}
    elif config == "token-events":  # fixed, with one SSE event per token instead of one per write
        out["stream_events"] = "token"
    elif config == "gpu-yaml":
        return gpu_config_on_cpu(model, modes)
    elif config != "fixed":
        raise SystemExit(f"unknown configuration {config!r} (fixed, autoscaled, token-events, gpu-yaml)")
    return out


def gpu_config_on_cpu(model: Path, modes: list[str]) -> dict:
    """cluster/serve_config.gpu.yaml's application, its CPU variant: the model measured,
    on CPU (its bundles without GPUs, the target worker with serve_config.yaml's CPUs and
    onnxruntime threads: the GPU file leaves them to the GPU's one reserved CPU),
    its deployments' options as the file gives them -- custom resources and autoscaling
    included -- less those of proposers the model does not have."""
    import yaml

    from specserve.engine.speculative.proposers.registry import PROPOSER_MODES

    app = yaml.safe_load((ROOT / "cluster/serve_config.gpu.yaml").read_text())["applications"][0]
    args = app["args"]
    args["model_dir"] = str(model)
    args["engine"]["device"] = "cpu"
    speculative = args["engine"].setdefault("speculative", {})
    speculative["default_mode"] = "auto"
    speculative["load"] = [m for m in speculative.get("load") or () if m in modes]
    made = {"Router", "TargetModel"} | {PROPOSER_MODES[m].deployment for m in speculative["load"]}
    cpu_app = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]
    target_cpus = next(d for d in cpu_app["deployments"] if d["name"] == "TargetModel")["placement_group_bundles"][1]["CPU"]
    args["engine"]["intra_op_threads"] = cpu_app["args"]["engine"]["intra_op_threads"]
    overrides = {}
    for deployment in app["deployments"]:
        name = deployment.pop("name")
        if name not in made:
            continue
        for bundle in deployment.get("placement_group_bundles", []):
            bundle.pop("GPU", None)
        if name == "TargetModel":
            deployment["placement_group_bundles"][1]["CPU"] = target_cpus
        overrides[name] = deployment
    args["deployment_overrides"] = overrides
    return args


# What cluster/serve_config.gpu.yaml places by: each node advertises the custom resource its
# deployments ask for (cluster/README.md), here three Ray nodes on this machine.
THREE_NODES = [{"num_cpus": 4, "resources": {"specserve_head": 100}},
               {"num_cpus": 4, "resources": {"specserve_target": 1}},
               {"num_cpus": 4, "resources": {"specserve_proposer": 4}}]


def start_three_nodes():
    """A local Ray cluster of three nodes (head, a target node, a proposer node), joined."""
    import ray
    from ray.cluster_utils import Cluster

    common = {"node_ip_address": "127.0.0.1", "object_store_memory": 512 * 1024 * 1024}
    cluster = Cluster(initialize_head=True, head_node_args={**THREE_NODES[0], **common, "include_dashboard": False})
    for node in THREE_NODES[1:]:
        cluster.add_node(**node, **common)
    # ray.init rewrites a loopback address to this machine's outward IP
    # (services.resolve_ip_for_localhost), where a cluster bound to 127.0.0.1 does not
    # listen, unless Ray's own single-machine switch is off; it is read at each call.
    from ray._private import ray_constants
    saved, ray_constants.ENABLE_RAY_CLUSTER = ray_constants.ENABLE_RAY_CLUSTER, False
    try:
        ray.init(address=cluster.address, logging_level="WARNING", log_to_driver=False)
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved
    return cluster


def rate(levels: list[Level]) -> float:
    """Tokens per second over several measurements together."""
    return sum(sum(len(r.token_ids) for r in lv.results) for lv in levels) / sum(lv.seconds for lv in levels)


@dataclass
class Cell:
    """One (config, mode, streams) cell: each repeat's measurements, in-process and served."""

    local: dict[int, list[Level]] = field(default_factory=lambda: defaultdict(list))
    served: dict[int, list[Level]] = field(default_factory=lambda: defaultdict(list))
    round_timers: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # one stream, first repeat
    timed: list[Level] = field(default_factory=list)  # the served slices ``round_timers`` covers

    @staticmethod
    def levels(side: dict[int, list[Level]]) -> list[Level]:
        return [level for repeat in sorted(side) for level in side[repeat]]

    @property
    def local_rate(self) -> float:
        return rate(self.levels(self.local))

    @property
    def served_rate(self) -> float:
        return rate(self.levels(self.served))

    def spread(self) -> str:
        return spread(self.served, self.local)


def spread(side: dict[int, list[Level]], base: dict[int, list[Level]]) -> str:
    """The range of the per-repeat ratio of ``side`` to ``base``, measured side by side."""
    ratios = [rate(side[repeat]) / rate(base[repeat]) for repeat in sorted(side)]
    return f"{min(ratios):.2f}-{max(ratios):.2f}" if len(ratios) > 1 else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--modes", nargs="+", default=None, help="default: every mode the model serves")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16, 32])
    parser.add_argument("--requests-per-stream", type=int, default=None,
                        help="default: enough for --min-requests a measurement")
    parser.add_argument("--min-requests", type=int, default=8, help="requests in one measurement at least")
    parser.add_argument("--repeats", type=int, default=2, help="measurements of each cell, order alternating")
    parser.add_argument("--configs", nargs="+", default=["fixed", "autoscaled"])
    parser.add_argument("--threads", type=int, default=2, help="in-process onnxruntime threads")
    parser.add_argument("--lanes", type=int, default=2)
    parser.add_argument("--target-threads", type=int, default=None, help="target worker threads (server)")
    parser.add_argument("--stream-interval", type=int, default=1, help="server: tokens per stream write")
    parser.add_argument("--stream-writes-per-s", type=float, default=250.0,
                        help="server: the router's stream-write budget (0 = none)")
    parser.add_argument("--plain-steps", type=int, default=None,
                        help="scheduler.plain_steps on both sides (default: the engine's)")
    parser.add_argument("--cpu-streams", type=int, default=16, help="streams at which CPU per token is read (0: not)")
    parser.add_argument("--port", type=int, default=8311)
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "distributed", model=args.model):
        run(args)


def held_out_prompts(engine: Engine) -> list[str]:
    """Chat prompts in the model's template where it has one, else the fixture's code prompts."""
    if engine.chat_template._compiled is not None:
        chats = json.loads((ROOT / "tests/data/heldout_chat_prompts.json").read_text())
        return [engine.chat_template.render(c["messages"]) for c in chats]
    return [p["prompt"] for p in json.loads((ROOT / "tests/data/heldout_prompts.json").read_text())]


def requests_per_stream(args: argparse.Namespace, streams: int) -> int:
    """``--requests-per-stream``, or enough that a measurement holds ``--min-requests``
    requests: one stream's single request is a second of work, too short to read a ratio."""
    return args.requests_per_stream or max(1, -(-args.min_requests // streams))


def start_cluster(config: str):
    """The Ray a configuration runs on: ``gpu-yaml`` places by custom resources, so it gets
    the three-node cluster that advertises them; every other configuration one local node."""
    if config == "gpu-yaml":
        return start_three_nodes()
    from specserve.cluster.local import start_local_ray
    start_local_ray()
    return None


def served_level(run_served, cell: Cell, label: str, base: str, mode: str, streams: int, repeat: int, part: int,
                 args: argparse.Namespace, prompts: list[str], notes: list[str]) -> Level:
    """One served slice (a request per stream). On a cell's first repeat it also adds, at
    one stream, the round's timers to the cell's (``cell.round_timers``), and on its first
    slice at ``--cpu-streams`` notes the CPU each Ray process spends a token."""
    timing = streams == 1 and repeat == 0
    before = snapshot(base, mode) if timing else None
    cpu = ray_process_cpu() if streams == args.cpu_streams and repeat == 0 and part == 0 else None
    level = measure(run_served, prompts, streams, 1, start=part * streams)
    if before is not None:
        after = snapshot(base, mode)
        for key, value in after.items():
            cell.round_timers[key] += value - before[key]
        cell.timed.append(level)
    if cpu is not None:
        tokens = sum(len(r.token_ids) for r in level.results)
        notes.append(f"{label}, {streams} streams: {cpu_per_token(cpu, ray_process_cpu(), tokens)}")
    return level


def mismatches_of(cell: Cell, expected: dict[str, list[int]]) -> int:
    """The cell's outputs that differ from the first in-process output of their prompt
    (``expected``, which this fills from the cell's in-process runs)."""
    local, served = cell.levels(cell.local), cell.levels(cell.served)
    for level in local:
        for prompt, r in zip(level.prompts, level.results):
            expected.setdefault(prompt, r.token_ids)
    return sum(r.token_ids != expected[prompt] for level in local + served
               for prompt, r in zip(level.prompts, level.results))


def run(args: argparse.Namespace) -> None:
    scheduler = {} if args.plain_steps is None else {"plain_steps": args.plain_steps}
    engine = Engine(args.model, EngineConfig(device="cpu", intra_op_threads=args.threads, scheduler=scheduler))
    modes = args.modes or engine.available_modes
    prompts = held_out_prompts(engine)
    options = {mode: GenerationOptions(max_new_tokens=args.new_tokens, ignore_eos=True, temperature=0,
                                       speculative_mode=mode) for mode in modes}
    expected: dict[str, dict[str, list[int]]] = {mode: {} for mode in modes}
    for mode in modes:
        in_process_runner(engine, options[mode])(prompts[0])  # warm-up

    import ray
    from ray import serve

    from specserve.cluster.local import serve_local
    base = f"http://127.0.0.1:{args.port}"
    cells: dict[tuple[str, str, int], Cell] = defaultdict(Cell)
    notes: list[str] = []
    mismatches = 0
    try:
        for config in args.configs:
            cluster = start_cluster(config)
            try:
                serve_local(server_args(config, args, modes, args.model), port=args.port)
                runners = {mode: (in_process_runner(engine, options[mode]), server_runner(base, mode, args.new_tokens))
                           for mode in modes}
                for mode in modes:
                    for prompt in prompts[:4]:
                        runners[mode][1](prompt)  # warm-up: first calls pay connection and replica start-up costs
                for n in args.streams:
                    measure_concurrency(config, n, args, modes, runners, cells, base, prompts, notes, engine)
                    for mode in modes:
                        cell = cells[(config, mode, n)]
                        mismatches += mismatches_of(cell, expected[mode])
                        if cell.timed:
                            notes.append(f"{config}, {mode}, one stream: " + breakdown(
                                cell.round_timers, statistics.mean(lv.ms_per_round for lv in cell.timed)))
                        print(f"{config} {mode} {n} streams: in-process {cell.local_rate:.1f}, served "
                              f"{cell.served_rate:.1f} tok/s", file=sys.stderr, flush=True)
                if config in ("autoscaled", "gpu-yaml"):
                    replicas = {name: d.replica_states.get("RUNNING", 0) for name, d in
                                serve.status().applications["specserve"].deployments.items()}
                    notes.append(f"{config}: running replicas at the end {replicas}")
            finally:
                serve.shutdown()
                ray.shutdown()
                if cluster is not None:
                    cluster.shutdown()
    finally:
        engine.close()
    report(args, modes, cells, notes, mismatches, engine.config.scheduler.plain_steps)


def reset_suffix_caches(engine: Engine, base: str) -> None:
    """Forget earlier suffix-mode outputs on both sides: a repeat's requests are the same
    prompts as the last repeat's, and no timed request may draft from its own earlier output."""
    import httpx

    engine.reset_suffix_cache()
    httpx.post(f"{base}/reset_suffix_cache", timeout=30).raise_for_status()


def measure_concurrency(config: str, streams: int, args: argparse.Namespace, modes: list[str], runners: dict,
                        cells: dict, base: str, prompts: list[str], notes: list[str], engine: Engine) -> None:
    """Every mode at one concurrency, in-process and served, ``--repeats`` times. A repeat
    is cut into slices of one request per stream, and every mode and side runs each slice
    in turn, the orders reversed on the next slice: so the machine's drift (this VM's
    speed moves 5-20 % within minutes) falls alike on every mode and on both sides, and a
    ratio compares runs seconds apart -- a one-stream slice is one request. Each repeat
    starts with empty suffix caches (the warm-ups and the last repeat ran its prompts)."""
    for repeat in range(args.repeats):
        reset_suffix_caches(engine, base)
        for part in range(requests_per_stream(args, streams)):
            forward = (repeat * requests_per_stream(args, streams) + part) % 2 == 0
            for mode in modes if forward else modes[::-1]:
                cell = cells[(config, mode, streams)]
                run_local, run_served = runners[mode]
                for side in ("local", "served") if forward else ("served", "local"):
                    if side == "local":
                        cell.local[repeat].append(measure(run_local, prompts, streams, 1, start=part * streams))
                    else:
                        cell.served[repeat].append(served_level(run_served, cell, f"{config}, {mode}", base, mode,
                                                                streams, repeat, part, args, prompts, notes))


def report(args, modes: list[str], cells: dict, notes: list[str], mismatches: int, plain_steps: int) -> None:
    where = ("one Ray node; gpu-yaml on a local 3-node Ray cluster (head, target node, proposer node)"
             if "gpu-yaml" in args.configs else "one Ray node")
    per_stream = ", ".join(f"{n} streams {requests_per_stream(args, n)}" for n in args.streams)
    print(f"\n{args.model.name} on {where}: {args.new_tokens} new tokens per request, greedy, EOS ignored, "
          f"requests per stream: {per_stream}; each cell {args.repeats}x, each repeat in slices of a request per "
          f"stream, every mode in-process and served on each slice in turn, the order reversed each slice; in-process {args.threads} threads; server lanes "
          f"{args.lanes}, stream interval {args.stream_interval}, write budget {args.stream_writes_per_s or 'none'}/s, plain steps {plain_steps}. "
          f"Every served output token-identical to in-process: {'yes' if mismatches == 0 else f'NO ({mismatches})'}\n")
    print("| config | mode | streams | in-process tok/s | served tok/s | served / in-process (per-repeat range) "
          "| served / served target-only (per-repeat range) | in-process TTFT / ITL ms | served TTFT / ITL ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for config in args.configs:
        for mode in modes:
            for n in args.streams:
                cell = cells[(config, mode, n)]
                base = cells.get((config, "none", n))
                vs_none = "-" if base is None or mode == "none" else \
                    f"{cell.served_rate / base.served_rate:.2f} ({spread(cell.served, base.served)})"
                lo, sv = cell.levels(cell.local), cell.levels(cell.served)
                print(f"| {config} | {mode} | {n} | {cell.local_rate:.1f} | {cell.served_rate:.1f} | "
                      f"{cell.served_rate / cell.local_rate:.2f} ({cell.spread()}) | {vs_none} | "
                      f"{statistics.mean(x.ttft_ms for x in lo):.0f} / {statistics.mean(x.itl_ms for x in lo):.1f} | "
                      f"{statistics.mean(x.ttft_ms for x in sv):.0f} / {statistics.mean(x.itl_ms for x in sv):.1f} |")
    print()
    for note in notes:
        print(f"- {note}")


if __name__ == "__main__":
    main()
