"""Prefix caching on the default model through the server: time to first token behind a
shared ~750-token system prompt cold and warm, and the hit rate of prefix-aware routing
against round-robin with two target replicas.

    .venv/bin/python bench/prefix_cache.py [--model-dir DIR] [--questions 5] [--prefixes 4]
        [--requests-per-prefix 4] [--concurrency 2] [--kv-blocks 192] [--record DIR]

1. **Cold vs warm**, one target replica: twice, reset the prefix cache
   (``/reset_prefix_cache``), send one streamed greedy chat -- the system prompt
   (``tests/data/system_prompt.txt``) and a question -- then the others behind the same
   system prompt, one at a time. A question that runs cold once and warm once must give
   the same tokens. Prints each one's time to first token (TTFT) and cached tokens.
2. **In-process costs**, interleaved: the recomputed tail (what the heads' anchor costs
   on a hit: a prefill always feeds its last token, and on a hit everything after the
   last cached block, 1 to 16 tokens), as the warm TTFT of prompts whose tail is 1 token
   against those whose tail is a whole block; and what caching costs a cold prefill
   (naming its blocks writes their KV into the pools), as the cold TTFT of the whole
   prompt with prefix caching on (after a reset) against an engine with it off.
   On the test fixture (``--fixture``: its draft model is the one its tests exercise), the draft
   model's own prefix cache: the first drafting round of a ``draft_model`` request (from
   its first token to its second: the draft's first contact feeds it the whole context
   unless its pool caches the prefix), cold against warm.
3. **Routing**, two target replicas with ``--kv-blocks`` blocks each (a few system prompts'
   worth): ``--prefixes`` system prompts (the shared one, each under its own first line),
   ``--requests-per-prefix`` questions each, shuffled with a fixed seed and sent by
   ``--concurrency`` clients, once with ``replica_routing: prefix_aware`` and once with
   ``round_robin`` (a fresh server each). Prints the hit rate (cached over prompt tokens,
   from the responses' usage), mean TTFT and how the requests spread; both runs must
   give the same tokens.

Prefix caching is lossless by construction (a shared block holds the very KV a prefill
would compute), so the bench checks identity rather than trusting it.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402

PORT = 8321


@dataclass
class Reply:
    ttft_s: float
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int


def chat(client: httpx.Client, url: str, messages: list[dict], max_tokens: int) -> Reply:
    """One streamed greedy chat: seconds to its first token, its tokens and its usage."""
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True, "speculative_mode": "none"}
    sent, first, ids, usage = time.perf_counter(), None, [], None
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                if choice.get("token_ids"):
                    first = first or time.perf_counter() - sent
                    ids += choice["token_ids"]
            usage = chunk.get("usage") or usage
    return Reply(first, ids, usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"])


def questions() -> list[list[dict]]:
    return [p["messages"] for p in json.loads((ROOT / "tests/data/heldout_chat_prompts.json").read_text())]


def system_prompt() -> str:
    return (ROOT / "tests/data/system_prompt.txt").read_text()


def serve(model_dir: str, replicas: int, routing: str, kv_blocks: int):
    from specserve.cluster.local import serve_local, start_local_ray

    start_local_ray()
    serve_local({"model_dir": model_dir, "deployment_overrides": {"TargetModel": {"num_replicas": replicas}},
                 "engine": {"device": "cpu", "kv_num_blocks": kv_blocks,
                            # a few sequences at once here: a small batch calibrates in seconds
                            "scheduler": {"replica_routing": routing, "max_batch_size": 4}}}, port=PORT)
    return f"http://127.0.0.1:{PORT}"


def shutdown() -> None:
    import ray
    from ray import serve as ray_serve

    ray_serve.shutdown()
    ray.shutdown()


# -- 1. cold vs warm ----------------------------------------------------------------------------
def cold_and_warm(url: str, asked: list[list[dict]], max_tokens: int) -> None:
    system = {"role": "system", "content": system_prompt()}
    cold, warm, outputs, mismatches = [], [], {}, 0
    with httpx.Client(timeout=600) as client:
        chat(client, url, [system, *asked[-1]], 2)  # warm-up: the first call pays start-up costs
        for first in (0, 1):
            client.post(f"{url}/reset_prefix_cache").raise_for_status()
            order = [first] + [i for i in range(len(asked)) if i != first]
            for position, index in enumerate(order):
                reply = chat(client, url, [system, *asked[index]], max_tokens)
                (cold if position == 0 else warm).append(reply)
                if index in outputs and outputs[index] != reply.token_ids:
                    mismatches += 1
                outputs.setdefault(index, reply.token_ids)
    ratio = statistics.median(r.ttft_s for r in warm) / statistics.median(r.ttft_s for r in cold)
    print(f"## Cold vs warm: one target replica, a {cold[0].prompt_tokens - cold[0].cached_tokens}-token prompt "
          f"(system prompt + question), {max_tokens} new tokens, greedy, one request at a time\n")
    print("| request | n | TTFT median ms | TTFT range ms | cached tokens (of prompt) |")
    print("|---|---|---|---|---|")
    for name, replies in (("cold (after a reset)", cold), ("warm (same system prompt)", warm)):
        ttfts = [1000 * r.ttft_s for r in replies]
        print(f"| {name} | {len(replies)} | {statistics.median(ttfts):.0f} | {min(ttfts):.0f}-{max(ttfts):.0f} | "
              f"{statistics.median(r.cached_tokens for r in replies):.0f} "
              f"(of {statistics.median(r.prompt_tokens for r in replies):.0f}) |")
    print(f"\nwarm / cold TTFT: {ratio:.2f}x; a question asked cold and warm gives the same tokens: "
          f"{'yes' if mismatches == 0 else f'NO ({mismatches} differ)'}\n")


# -- 2. the recomputed tail ----------------------------------------------------------------------
def in_process_costs(model_dir: str, pairs: int) -> None:
    """Warm prefills whose fed tail is 1 token against 16, and cold prefills with prefix
    caching on against off, each interleaved, in-process."""
    from specserve.engine import Engine, EngineConfig, GenerationOptions

    config = EngineConfig(device="cpu", scheduler={"max_batch_size": 1})  # batch 1: calibrated in seconds
    with Engine(model_dir, config) as engine, \
            Engine(model_dir, config.model_copy(update={"prefix_caching": False})) as uncached:
        base = engine.factory.encode(engine.chat_template.render(
            [{"role": "system", "content": system_prompt()}, {"role": "user", "content": "Hello"}]))
        size = engine.config.kv_block_size
        cut = (len(base) // size - 1) * size  # whole blocks, then a tail of 1 or ``size`` tokens
        options = GenerationOptions(max_new_tokens=1, temperature=0)
        engine.generate(base, options)  # names every block the prompts below share
        times: dict[int, list[float]] = {1: [], size: []}
        for _ in range(pairs):
            for tail in (1, size):
                # ``cut + size`` tokens: its last block is not taken from the cache (the last
                # token is always fed), so the whole block is recomputed
                result = engine.generate(base[: cut + tail], options)
                assert result.cached_tokens == cut, (result.cached_tokens, cut)
                times[tail].append(result.prefill_seconds)
        cold: dict[str, list[float]] = {"on": [], "off": []}
        for _ in range(pairs):
            engine.reset_prefix_cache()
            cold["on"].append(engine.generate(base, options).prefill_seconds)
            cold["off"].append(uncached.generate(base, options).prefill_seconds)
    one, block = statistics.median(times[1]), statistics.median(times[size])
    on, off = statistics.median(cold["on"]), statistics.median(cold["off"])
    print(f"## The recomputed tail: in-process, {cut} cached tokens, then 1 or {size} fed ({pairs} interleaved "
          "pairs)\n")
    print(f"| fed after the cached blocks | TTFT median ms |\n|---|---|\n| 1 token | {1000 * one:.1f} |\n"
          f"| {size} tokens | {1000 * block:.1f} |\n")
    print(f"A whole recomputed last block costs {1000 * (block - one):.1f} ms over one token: the most that caching "
          "the anchor with a block could save (the last token must be fed anyway, for its logits).\n")
    print(f"Cold prefill of all {len(base)} tokens, median TTFT: prefix caching on {1000 * on:.1f} ms, off "
          f"{1000 * off:.1f} ms ({on / off:.3f}x: naming the blocks writes the prompt's KV into the pools)\n")


def draft_first_contact(fixture: str, pairs: int) -> None:
    """The first drafting round of a draft-model request, its prefix cold (after a reset)
    and warm (the same prompt again), interleaved, on the fixture in-process."""
    from specserve.engine import Engine, EngineConfig, GenerationOptions, SpeculativeConfig

    config = EngineConfig(device="cpu", speculative=SpeculativeConfig(load=("draft_model",), adaptive=False),
                          scheduler={"max_batch_size": 1})
    prompts = [p["prompt"] for p in json.loads((ROOT / "tests/data/heldout_prompts.json").read_text())]
    system = "\n".join(prompts[:3]) + "\n"
    options = GenerationOptions(max_new_tokens=6, speculative_mode="draft_model", temperature=0, ignore_eos=True)
    rounds: dict[str, list[float]] = {"cold": [], "warm": []}
    with Engine(fixture, config) as engine:
        engine.generate(system + prompts[5], options)  # warm-up
        for i in range(pairs):
            prompt = system + prompts[6 + i % 10]
            for name in ("cold", "warm"):
                if name == "cold":
                    engine.reset_prefix_cache()
                stamps: list[float] = []
                engine.generate(prompt, options, on_token=lambda event: stamps.append(time.perf_counter()))
                rounds[name].append(stamps[1] - stamps[0])
        tokens = len(engine.factory.encode(system + prompts[6]))
    cold, warm = (statistics.median(rounds[name]) for name in ("cold", "warm"))
    print(f"Draft model, first drafting round of a ~{tokens}-token prompt on the fixture ({pairs} interleaved pairs): "
          f"its prefix cold {1000 * cold:.1f} ms, cached in the draft's own pool {1000 * warm:.1f} ms\n")


# -- 3. routing ----------------------------------------------------------------------------------
def routing_run(url: str, jobs: list[tuple[int, list[dict]]], concurrency: int, max_tokens: int
                ) -> tuple[list[Reply], dict]:
    with httpx.Client(timeout=600) as client:
        chat(client, url, jobs[0][1][1:], 2)  # warm-up, with no system prompt
        with ThreadPoolExecutor(concurrency) as pool:
            replies = list(pool.map(lambda job: chat(client, url, job[1], max_tokens), jobs))
        placement = client.get(f"{url}/specserve/status").json()["kv"]["per_replica"]
    return replies, placement


def routing(model_dir: str, prefixes: int, per_prefix: int, concurrency: int, kv_blocks: int,
            max_tokens: int) -> None:
    asked = questions()
    systems = [f"Store #{k + 1} of {prefixes}.\n{system_prompt()}" for k in range(prefixes)]
    jobs = [(k, [{"role": "system", "content": systems[k]}, *asked[(k * per_prefix + i) % len(asked)]])
            for k in range(prefixes) for i in range(per_prefix)]
    random.Random(40).shuffle(jobs)
    results = {}
    for policy in ("prefix_aware", "round_robin"):
        url = serve(model_dir, 2, policy, kv_blocks)
        try:
            started = time.perf_counter()
            replies, placement = routing_run(url, jobs, concurrency, max_tokens)
            results[policy] = (replies, placement, time.perf_counter() - started)
        finally:
            shutdown()
    same = results["prefix_aware"][0] and all(
        a.token_ids == b.token_ids for a, b in zip(results["prefix_aware"][0], results["round_robin"][0]))
    print(f"## Routing: two target replicas of {kv_blocks} KV blocks each, {prefixes} system prompts x "
          f"{per_prefix} questions = {len(jobs)} requests (shuffled), {concurrency} clients, {max_tokens} new "
          "tokens\n")
    print("| routing | hit rate (cached / prompt tokens) | requests with a hit | mean TTFT ms | wall s | "
          "cached blocks per replica at the end |")
    print("|---|---|---|---|---|---|")
    for policy, (replies, placement, wall) in results.items():
        prompt = sum(r.prompt_tokens for r in replies)
        cached = sum(r.cached_tokens for r in replies)
        hits = sum(r.cached_tokens > 0 for r in replies)
        spread = ", ".join(str(p["cached_blocks"]) for p in placement.values())
        print(f"| {policy} | {cached / prompt:.1%} | {hits} of {len(replies)} | "
              f"{1000 * statistics.mean(r.ttft_s for r in replies):.0f} | {wall:.1f} | {spread} |")
    print(f"\nboth routings give the same tokens for every request: {'yes' if same else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="models/smollm2-135m-instruct")
    parser.add_argument("--fixture", default="models/fixture", help="a bundle with a draft model")
    parser.add_argument("--questions", type=int, default=5, help="cold vs warm: questions behind the system prompt")
    parser.add_argument("--tail-pairs", type=int, default=5, help="recomputed tail: interleaved pairs")
    parser.add_argument("--prefixes", type=int, default=4, help="routing: distinct system prompts")
    parser.add_argument("--requests-per-prefix", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--kv-blocks", type=int, default=192, help="routing: KV blocks per target replica")
    parser.add_argument("--max-tokens", type=int, default=16)
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "prefix_cache", model=ROOT / args.model_dir):
        url = serve(args.model_dir, 1, "prefix_aware", 1024)
        try:
            cold_and_warm(url, questions()[: args.questions + 1], args.max_tokens)
        finally:
            shutdown()
        in_process_costs(args.model_dir, args.tail_pairs)
        draft_first_contact(args.fixture, args.tail_pairs * 2)
        routing(args.model_dir, args.prefixes, args.requests_per_prefix, args.concurrency, args.kv_blocks,
                args.max_tokens)


if __name__ == "__main__":
    main()
