"""Several router replicas on the default model: correctness without faults, a router and
the KV manager killed mid-load, throughput against one router, and the router's CPU cost.

    .venv/bin/python bench/routers.py [--model DIR] [--runs 10] [--streams 16] [--load-streams 32]
        [--slices 8] [--new-tokens 64] [--cost-streams 1 4 16 32 64] [--record DIR]

One local Ray runs two copies of the application (``serve_config.yaml``'s ``args``; each
deployment takes its class's own options):
``one`` at ``/one`` with one router replica and ``two`` at ``/two`` with two. Each has its
own target, proposers and KV manager, so a measured slice on one leaves the other idle.

1. ``--runs`` runs of ``--streams`` concurrent greedy streams on ``two``; every stream is
   checked token-for-token against the in-process engine's target-only output.
2. Throughput at ``--load-streams``: ``--slices`` slices, each that many distinct requests
   at once on ``one`` and then on ``two`` (the order reversed every slice). Every request
   is new to its application (its own numbered prompt), so no prefix cache sees a repeat.
3. A router replica of ``two`` killed (``ray.kill``, Serve restarts it) after the first
   tokens of ``--streams`` streams: the streams it did not carry must finish identical, the
   ones it carried must end cleanly; then ``--streams`` new requests, each retried on a
   503 or a cut connection until served; the seconds until the KV ledger is empty again.
4. The KV manager of ``two`` killed the same way: every stream identical, or refused with
   a 503 before its first token; then the seconds until the ledger is empty.
5. The router's CPU per sequence-round and per token on ``one`` at each ``--cost-streams``
   (its process's CPU time from /proc around the load; rounds from each stream's stats).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from bench.distributed import descendants  # noqa: E402
from specserve.engine import Engine, EngineConfig, GenerationOptions  # noqa: E402
from specserve.engine.model.default_model import DEFAULT_MODEL_DIR  # noqa: E402

APPS = {"one": 1, "two": 2}  # application -> router replicas


@dataclass
class Stream:
    token_ids: list[int]
    rounds: int = 0
    error: str | None = None       # how it ended, when not with [DONE]
    first_token: bool = False      # whether any token came before the error


def questions() -> list[list[dict]]:
    chats = [c["messages"] for c in json.loads((ROOT / "tests/data/heldout_chat_prompts.json").read_text())]
    suite = json.loads((ROOT / "bench/data/task_suite.json").read_text())
    return chats + [[{"role": "user", "content": task["prompt"]}] for task in suite["chat"]]


def numbered(base: list[list[dict]], count: int) -> list[list[dict]]:
    """``count`` distinct conversations: the n-th asks base question n % len(base), opened
    by its own number, so two requests share no prefix beyond the template's header."""
    out = []
    for n in range(count):
        messages = [dict(m) for m in base[n % len(base)]]
        messages[-1]["content"] = f"Request {n}. {messages[-1]['content']}"
        out.append(messages)
    return out


def stream(client, url: str, messages: list[dict], new_tokens: int, on_token=None) -> Stream:
    body = {"model": "specserve", "messages": messages, "max_tokens": new_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True}
    out = Stream([])
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                out.error = f"HTTP {response.status_code}"
                return out
            for line in response.iter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    return out
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    out.error = f"error event: {chunk['error'].get('message', '')[:80]}"
                    return out
                if chunk.get("speculative"):
                    out.rounds = chunk["speculative"]["rounds"]
                for choice in chunk.get("choices", []):
                    out.token_ids += choice.get("token_ids", []) or []
                if out.token_ids and not out.first_token:
                    out.first_token = True
                    if on_token is not None:
                        on_token()
        out.error = "stream ended without [DONE]"
    except Exception as exc:  # noqa: BLE001 - a cut connection is one of the outcomes counted
        out.error = f"{type(exc).__name__}"
    return out


def at_once(client, url: str, conversations: list[list[dict]], new_tokens: int, on_token=None) -> list[Stream]:
    with ThreadPoolExecutor(len(conversations)) as pool:
        return list(pool.map(lambda m: stream(client, url, m, new_tokens, on_token), conversations))


def expected_tokens(engine: Engine, conversations: list[list[dict]], new_tokens: int) -> list[list[int]]:
    options = GenerationOptions(max_new_tokens=new_tokens, temperature=0, ignore_eos=True, speculative_mode="none")
    return [engine.generate(engine.chat_template.render(m), options).token_ids for m in conversations]


def kv_usage(app: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle("TargetModel", app).describe.remote().result()["kv_manager"] \
        .usage.remote().future().result(timeout=10)


def target_steps(app: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle("TargetModel", app).kv_usage.remote().result()


def seconds_until_empty(app: str, started: float, timeout_s: float = 120.0) -> float | None:
    while time.monotonic() - started < timeout_s:
        try:
            usage = kv_usage(app)
            if usage["sequences"] == 0 and usage["free_blocks"] == usage["total_blocks"]:
                return time.monotonic() - started
        except Exception:  # noqa: BLE001 - the KV manager may be restarting
            pass
        time.sleep(0.25)
    return None


def kill_once(action):
    """An ``on_token`` callback that runs ``action`` once, when the fourth stream sees its
    first token."""
    lock, seen = threading.Lock(), [0]

    def on_token() -> None:
        with lock:
            seen[0] += 1
            if seen[0] == 4:
                threading.Thread(target=action, daemon=True).start()
    return on_token


def kill_a_router(app: str) -> None:
    import ray

    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if f"{app}#Router#" in a["name"])
    ray.kill(ray.get_actor(names[0], namespace="serve"), no_restart=False)


def kill_kv_manager(app: str) -> None:
    import ray
    from ray import serve

    ray.kill(serve.get_deployment_handle("TargetModel", app).describe.remote().result()["kv_manager"],
             no_restart=False)


def served_after(client, url: str, conversations: list[list[dict]], new_tokens: int,
                 timeout_s: float = 120.0) -> list[tuple[Stream, int]]:
    """Each request retried (a 503, a cut connection) until served: (result, tries)."""
    def one(messages):
        deadline, tries = time.monotonic() + timeout_s, 0
        while True:
            tries += 1
            result = stream(client, url, messages, new_tokens)
            if result.error is None or time.monotonic() > deadline:
                return result, tries
            time.sleep(0.5)
    with ThreadPoolExecutor(len(conversations)) as pool:
        return list(pool.map(one, conversations))


def run(args: argparse.Namespace) -> None:
    import httpx
    import ray
    import yaml
    from ray import serve

    from specserve.cluster.local import start_local_ray
    from specserve.deployments.builder import build_app

    model = Path(args.model)
    settings = yaml.safe_load((ROOT / "serve_config.yaml").read_text())["applications"][0]["args"]
    settings.update(model_dir=str(model), served_model_name="specserve")
    engine = Engine(model, EngineConfig(device="cpu", intra_op_threads=2))
    base = questions()
    check = numbered(base, args.streams)
    expected = expected_tokens(engine, check, args.new_tokens)
    del engine

    start_local_ray()
    serve.start(http_options={"host": "127.0.0.1", "port": args.port}, logging_config={"log_level": "WARNING"})
    for app, routers in APPS.items():
        serve.run(build_app({**settings, "deployment_overrides": {"Router": {"num_replicas": routers}}}),
                  name=app, route_prefix=f"/{app}", blocking=False)
    urls = {app: f"http://127.0.0.1:{args.port}/{app}" for app in APPS}
    client = httpx.Client(timeout=300, limits=httpx.Limits(max_connections=128))
    for url in urls.values():  # warm both: the first batch-32 calls of a cold target are slow
        at_once(client, url, numbered(base, args.load_streams), args.new_tokens)
    print(f"{model.name}: applications 'one' (1 router) and 'two' (2 routers), serve_config.yaml's settings; "
          f"greedy chat, {args.new_tokens} new tokens (EOS ignored), checked against the in-process engine")

    if 1 in args.phases:
        no_fault(args, client, urls, check, expected)
    if 2 in args.phases:
        throughput(args, client, urls, base)
    if 3 in args.phases:
        router_killed(args, client, urls, base, check, expected)
    if 4 in args.phases:
        kv_manager_killed(args, client, urls, check, expected)
    if 5 in args.phases:
        router_cost(args, client, urls, base)
    serve.shutdown()
    ray.shutdown()


def no_fault(args, client, urls, check, expected) -> None:
    print(f"\n## 1. {args.runs} runs of {args.streams} concurrent streams on 2 routers, no fault")
    failures, mismatches = 0, 0
    for n in range(args.runs):
        results = at_once(client, urls["two"], check, args.new_tokens)
        failed = [r.error for r in results if r.error is not None]
        wrong = sum(1 for r, e in zip(results, expected) if r.error is None and r.token_ids != e)
        failures, mismatches = failures + len(failed), mismatches + wrong
        print(f"run {n + 1}: {len(results) - len(failed)}/{len(results)} succeeded, {wrong} differ"
              + (f" ({', '.join(sorted(set(failed)))})" if failed else ""))
    print(f"total: {failures} failed, {mismatches} differ, of {args.runs * args.streams}")


def throughput(args, client, urls, base) -> None:

    print(f"\n## 2. Throughput at {args.load_streams} streams, {args.slices} interleaved slices")
    tokens_per_s: dict[str, list[float]] = {app: [] for app in APPS}
    before = {app: target_steps(app) for app in APPS}
    fresh = numbered(base, 1000 + args.load_streams * args.slices)[1000:]  # unseen by the warm-up
    for s in range(args.slices):
        order = list(APPS) if s % 2 == 0 else list(reversed(APPS))
        jobs = fresh[s * args.load_streams:(s + 1) * args.load_streams]
        for app in order:
            started = time.perf_counter()
            results = at_once(client, urls[app], jobs, args.new_tokens)
            elapsed = time.perf_counter() - started
            assert all(r.error is None for r in results), [r.error for r in results]
            tokens_per_s[app].append(sum(len(r.token_ids) for r in results) / elapsed)
    ratios = [t / o for t, o in zip(tokens_per_s["two"], tokens_per_s["one"])]
    for app in APPS:
        steps = {key: value - before[app].get(key, 0) for key, value in target_steps(app).items()
                 if isinstance(value, (int, float)) and not isinstance(value, bool)}
        print(f"{app}'s target worker in these slices: {steps['steps']} steps, {steps['merged_steps']} of them "
              f"merging two calls (deployments/step_merging.py); batch buffers reused {steps.get('row_buffers_reused')}"
              f", rebuilt {steps.get('row_buffers_rebuilt')}, rows copied in {steps.get('rows_placed')}")
    for app in APPS:
        print(f"{app} ({APPS[app]} router{'s' if APPS[app] > 1 else ''}): "
              f"{statistics.median(tokens_per_s[app]):.1f} tok/s median "
              f"({', '.join(f'{t:.1f}' for t in tokens_per_s[app])})")
    print(f"2 routers / 1 router: {statistics.median(ratios):.2f}x median of slices "
          f"({', '.join(f'{r:.2f}' for r in ratios)})")


def router_killed(args, client, urls, base, check, expected) -> None:

    print(f"\n## 3. One of 2 routers killed mid-load ({args.streams} streams)")
    results = at_once(client, urls["two"], check, args.new_tokens, kill_once(lambda: kill_a_router("two")))
    killed_at = time.monotonic()
    done = [(r, e) for r, e in zip(results, expected) if r.error is None]
    print(f"finished: {len(done)}/{len(results)}, identical: {sum(1 for r, e in done if r.token_ids == e)}; "
          f"ended by the kill: {', '.join(sorted({r.error for r in results if r.error})) or 'none'} "
          f"(tokens each had: {sorted(len(r.token_ids) for r in results if r.error)})")
    after = served_after(client, urls["two"], numbered(base, 2000 + args.streams)[2000:], args.new_tokens)
    print(f"requests after the kill: {sum(1 for r, _ in after if r.error is None)}/{len(after)} served, "
          f"tries {max(t for _, t in after)} at most")
    empty = seconds_until_empty("two", killed_at)
    print(f"KV ledger empty {empty:.1f} s after the kill" if empty is not None else "KV ledger NOT empty in 120 s")


def kv_manager_killed(args, client, urls, check, expected) -> None:
    print(f"\n## 4. The KV manager killed mid-load ({args.streams} streams)")
    results = at_once(client, urls["two"], check, args.new_tokens, kill_once(lambda: kill_kv_manager("two")))
    killed_at = time.monotonic()
    identical = sum(1 for r, e in zip(results, expected) if r.error is None and r.token_ids == e)
    refused = sum(1 for r in results if r.error == "HTTP 503" and not r.first_token)
    other = [r.error or "differs" for r, e in zip(results, expected)
             if not (r.error is None and r.token_ids == e) and not (r.error == "HTTP 503" and not r.first_token)]
    print(f"identical: {identical}, refused with 503 before a token: {refused}, otherwise: {len(other)}"
          + (f" ({', '.join(sorted(set(other)))})" if other else ""))
    empty = seconds_until_empty("two", killed_at)
    print(f"KV ledger empty {empty:.1f} s after the kill" if empty is not None else "KV ledger NOT empty in 120 s")


def router_cost(args, client, urls, base) -> None:
    print("\n## 5. The router's CPU time, one router ('one')")
    print("| streams | router CPU ms per sequence-round | per token | rounds per token |")
    print("|---|---|---|---|")
    start = 3000
    for streams in args.cost_streams:
        jobs = numbered(base, start + streams)[start:]
        start += streams
        before = router_cpu_s("one")
        results = at_once(client, urls["one"], jobs, args.new_tokens)
        after_cpu = router_cpu_s("one")
        rounds = sum(r.rounds for r in results)
        tokens = sum(len(r.token_ids) for r in results)
        cpu_ms = 1000 * (after_cpu - before)
        print(f"| {streams} | {cpu_ms / max(1, rounds):.3f} | {cpu_ms / tokens:.3f} | {rounds / tokens:.2f} |")


def router_cpu_s(app: str) -> float:
    """CPU seconds so far of ``app``'s router processes (their titles name the app)."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in descendants(os.getpid()):
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")
            if f"ServeReplica:{app}:Router" in title:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            continue
    return total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR))
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--load-streams", type=int, default=32)
    parser.add_argument("--slices", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--cost-streams", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    parser.add_argument("--phases", type=int, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--port", type=int, default=8011)
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "routers", model=args.model):
        run(args)


if __name__ == "__main__":
    main()
