"""specserve against onnxruntime-genai's plain greedy loop on the same weights, in one run.

    bash bench/peer/setup.sh            # once: .venv-peer + the genai build of models/fixture/target
    .venv/bin/python bench/peer_genai.py [--prompts 10] [--new-tokens 64] [--threads 2] [--repeats 3] [--record DIR]

The peer is onnxruntime-genai 0.18, its model builder run on the bundle's own
``models/fixture/target/model.safetensors``, generating greedily in its own process (it needs plain
onnxruntime, which cannot share specserve's venv). Both sides get the same prompt token
ids, batch 1, the same intra-op thread count, exactly ``--new-tokens`` tokens each; runs
are interleaved (genai, then every specserve mode, ``--repeats`` times) and each figure is
the median over repeats. Warm-up is excluded on both sides (one untimed request each
first). tokens/s counts every generated token over prompt-in to last-token-out, so
prefill is included.

Also printed, per mode, the bound ``tau * t_step / (t_verify + k * t_head)`` as a speed
over specserve target-only (from step costs measured here), and the engine's per-token
time against the raw onnxruntime session call of one decode step at the same past, and
against a bare greedy loop over the same session (each call's presents fed back), both
measured right after each target-only run -- on the graph the engine runs at batch 1
(its in-place graph, ``engine.model.in_place``, where the bundle has one) and on the
standard graph. The in-place graph's raw call is also timed right after each single target-only
request, at that request's mean past, and the median of those per-request ratios printed:
pairs ~0.1 s apart see the same machine speed. The ratio is taken over the raw calls'
mean (the engine's per-token time is a mean: its decode time over its tokens) and over
their median (robust to the odd slow run).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from specserve.engine import Engine, EngineConfig, GenerationOptions  # noqa: E402
from speculative import MODES, step_costs  # noqa: E402  (bench/ is on sys.path when run as a file)

PEER_PYTHON = ROOT / ".venv-peer/bin/python"
PEER_MODEL = ROOT / ".cache/peer/genai_target"


class GenaiPeer:
    """The genai worker process (bench/peer/genai_worker.py), one request at a time."""

    def __init__(self, threads: int) -> None:
        if not PEER_PYTHON.exists() or not (PEER_MODEL / "model.onnx").exists():
            raise SystemExit("the peer is not set up: run `bash bench/peer/setup.sh` first")
        self.process = subprocess.Popen([str(PEER_PYTHON), str(ROOT / "bench/peer/genai_worker.py"), str(PEER_MODEL),
                                         str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.version = json.loads(self.process.stdout.readline())["ready"]

    def generate(self, ids: list[int], new_tokens: int) -> dict:
        self.process.stdin.write(json.dumps({"ids": ids, "new_tokens": new_tokens}) + "\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


def run_genai(peer: GenaiPeer, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    outputs, tokens, seconds = [], 0, 0.0
    for ids in prompts:
        reply = peer.generate(ids, new_tokens)
        outputs.append(reply["tokens"])
        tokens, seconds = tokens + len(reply["tokens"]), seconds + reply["seconds"]
    return outputs, tokens / seconds


def run_specserve(engine: Engine, prompts: list[list[int]], mode: str, new_tokens: int
                  ) -> tuple[list[list[int]], float, float, float]:
    """(outputs, tokens/s, tau, per-token decode seconds)."""
    options = GenerationOptions(max_new_tokens=new_tokens, ignore_eos=True, speculative_mode=mode)
    outputs, tokens, seconds, decode_tokens, decode_seconds, committed, rounds = [], 0, 0.0, 0, 0.0, 0, 0
    for ids in prompts:
        started = time.perf_counter()
        result = engine.generate(ids, options)
        seconds += time.perf_counter() - started
        outputs.append(result.token_ids)
        tokens += result.completion_tokens
        decode_tokens, decode_seconds = decode_tokens + result.completion_tokens - 1, decode_seconds + result.decode_seconds
        committed += result.speculative.committed_tokens
        rounds += result.speculative.verification_steps
    return outputs, tokens / seconds, committed / max(rounds, 1), decode_seconds / decode_tokens


def raw_step_ms(engine: Engine, past_len: int, runs: int = 200) -> float:
    """Median ms of one bare ``session.run`` of a 1-token step after ``past_len`` tokens:
    contiguous inputs made once, every output fetched (what the engine asks for)."""
    decoder = engine.target.decoder
    rng = np.random.default_rng(0)
    feed = {decoder.io.input_ids: np.array([[5]], np.int64),
            decoder.io.attention_mask: np.ones((1, past_len + 1), np.int64)}
    if decoder.io.position_ids:
        feed[decoder.io.position_ids] = np.array([[past_len]], np.int64)
    for geometry, key, value in zip(decoder.layers, decoder.io.past_keys, decoder.io.past_values):
        shape = (1, geometry.num_kv_heads, past_len, geometry.head_dim)
        feed[key], feed[value] = rng.standard_normal(shape).astype(np.float32), rng.standard_normal(shape).astype(np.float32)
    names = [o.name for o in decoder.session.get_outputs()]
    for _ in range(10):
        decoder.session.run(names, feed)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        decoder.session.run(names, feed)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1000


def bare_loop_ms(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Mean ms per decode token of the plainest greedy loop over the engine's session:
    prefill, then ``session.run`` on one token at a time, feeding each call's presents
    back as the next past -- what any decoder must do with this graph (the past grows by
    a token a call), with no scheduler, KV cache or streaming."""
    decoder = engine.target.decoder
    session, io = decoder.session, decoder.io
    names = [o.name for o in session.get_outputs()]
    keys, values = [names.index(n) for n in io.present_keys], [names.index(n) for n in io.present_values]
    seconds, tokens = 0.0, 0
    for prompt in prompts:
        feed = {io.input_ids: np.array([prompt], np.int64), io.attention_mask: np.ones((1, len(prompt)), np.int64),
                io.position_ids: np.arange(len(prompt))[None]}
        for name, geometry in zip((*io.past_keys, *io.past_values), decoder.layers * 2):
            feed[name] = np.zeros((1, geometry.num_kv_heads, 0, geometry.head_dim), np.float32)
        out, past = session.run(names, feed), len(prompt)
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            feed = {io.input_ids: np.array([[int(np.argmax(out[0][0, -1]))]], np.int64),
                    io.attention_mask: np.ones((1, past + 1), np.int64), io.position_ids: np.array([[past]], np.int64)}
            feed.update(zip(io.past_keys, (out[i] for i in keys)))
            feed.update(zip(io.past_values, (out[i] for i in values)))
            out, past = session.run(names, feed), past + 1
        seconds, tokens = seconds + time.perf_counter() - started, tokens + new_tokens - 1
    return 1000 * seconds / tokens


def raw_in_place_step_times(engine: Engine, past_len: int, runs: int = 200) -> list[float]:
    """Ms of each of ``runs`` bare runs of the in-place graph: a 1-token step after
    ``past_len`` slots of a preallocated buffer (each run writes the same slot), every
    output fetched; after 10 untimed runs."""
    in_place = engine.target.in_place
    buffer = in_place.new_buffer(past_len + 64)
    rng = np.random.default_rng(0)
    for array in buffer.keys + buffer.values:
        array[:, :, :past_len] = rng.standard_normal(array[:, :, :past_len].shape)
    one = np.array([[5]], np.int64)
    for _ in range(10):
        in_place.run(buffer, past_len, one)
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        in_place.run(buffer, past_len, one)
        times.append(1000 * (time.perf_counter() - started))
    return times


def raw_in_place_step_ms(engine: Engine, past_len: int, runs: int = 200) -> float:
    """The median of ``raw_in_place_step_times``."""
    return statistics.median(raw_in_place_step_times(engine, past_len, runs))


def bare_in_place_loop_ms(engine: Engine, prompts: list[list[int]], new_tokens: int) -> float:
    """``bare_loop_ms`` on the in-place graph: prefill into a buffer, then one token a run,
    each written in place after the last."""
    in_place = engine.target.in_place
    seconds, tokens = 0.0, 0
    for prompt in prompts:
        buffer = in_place.new_buffer(len(prompt) + new_tokens)
        logits, _ = in_place.run(buffer, 0, np.array([prompt], np.int64))
        past = len(prompt)
        started = time.perf_counter()
        for _ in range(new_tokens - 1):
            logits, _ = in_place.run(buffer, past, np.array([[int(np.argmax(logits[0, -1]))]], np.int64))
            past += 1
        seconds, tokens = seconds + time.perf_counter() - started, tokens + new_tokens - 1
    return 1000 * seconds / tokens


def paired_in_place_ratios(engine: Engine, prompts: list[list[int]], new_tokens: int
                       ) -> tuple[list[float], list[float]]:
    """Per prompt: the engine's target-only decode ms per token over the in-place graph's raw call
    at that request's mean past, the raw calls timed right after the request (~0.1 s
    later), so both sides see the same machine speed: this VM drifts 10-25 % within
    minutes, and a ratio of figures taken seconds apart carries that drift.

    Two ratios each: over the raw calls' mean -- like for like, since the engine's figure
    is itself a mean (its decode time over its tokens), and the odd slow run counts on
    both sides -- and over their median, which the odd slow run does not move."""
    options = GenerationOptions(max_new_tokens=new_tokens, ignore_eos=True, speculative_mode="none")
    over_mean, over_median = [], []
    for ids in prompts:
        result = engine.generate(ids, options)
        engine_ms = 1000 * result.decode_seconds / (result.completion_tokens - 1)
        raw = raw_in_place_step_times(engine, len(ids) + new_tokens // 2, runs=48)
        over_mean.append(engine_ms / statistics.fmean(raw))
        over_median.append(engine_ms / statistics.median(raw))
    return over_mean, over_median


def verify_ms(engine: Engine, ids: list[int], width: int, runs: int = 100) -> float:
    """Median ms of one engine verify pass of ``width`` tokens (feed + rewind)."""
    target = engine.target
    target.cache.add_sequence("bench-verify")
    target.feed("bench-verify", ids, 0)
    times = []
    for _ in range(runs + 5):
        started = time.perf_counter()
        target.feed("bench-verify", [5] * width, len(ids))
        target.cache.rewind("bench-verify", len(ids))
        times.append(time.perf_counter() - started)
    target.cache.free("bench-verify")
    return statistics.median(times[5:]) * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=str(ROOT / "models/fixture"))
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "peer_genai", model=args.models):
        run(args)


def run(args: argparse.Namespace) -> None:
    texts = [p["prompt"] for p in json.loads((ROOT / "tests/data/heldout_prompts.json").read_text())][: args.prompts]
    engine = Engine(args.models, EngineConfig(device="cpu", intra_op_threads=args.threads))
    prompts = [engine.target.encode_prompt(text) for text in texts]
    peer = GenaiPeer(args.threads)
    modes = [m for m in MODES if m in engine.available_modes]
    k = engine.config.speculative.num_speculative_tokens

    peer.generate(prompts[0], 8)  # warm-up, untimed, on both sides
    for mode in modes:
        engine.generate(prompts[0], GenerationOptions(max_new_tokens=8, speculative_mode=mode))
    rates: dict[str, list[float]] = {"genai": [], **{m: [] for m in modes}}
    taus: dict[str, list[float]] = {m: [] for m in modes}
    per_token: list[float] = []
    raw_steps: list[float] = []
    bare_loops: list[float] = []  # ms per token of a bare greedy loop, right after each target-only run
    has_in_place = engine.target.in_place is not None  # the engine runs batch-1 calls on the in-place graph
    raw_in_place_steps: list[float] = []
    bare_in_place_loops: list[float] = []
    paired: list[float] = []  # engine / raw in-place call's mean, per prompt, each pair ~0.2 s apart
    paired_median: list[float] = []  # the same over the raw calls' median
    mean_past = int(np.mean([len(p) for p in prompts])) + args.new_tokens // 2
    outputs: dict[str, list[list[int]]] = {}
    for _ in range(args.repeats):
        outputs["genai"], rate = run_genai(peer, prompts, args.new_tokens)
        rates["genai"].append(rate)
        for mode in modes:
            outputs[mode], rate, tau, seconds_per_token = run_specserve(engine, prompts, mode, args.new_tokens)
            rates[mode].append(rate)
            taus[mode].append(tau)
            if mode == "none":
                per_token.append(seconds_per_token)
                # The bare call right after the engine's run: this VM drifts 10-25 % within
                # minutes, so a raw figure taken at another time makes the ratio noise.
                raw_steps.append(raw_step_ms(engine, mean_past, runs=100))
                bare_loops.append(bare_loop_ms(engine, prompts, args.new_tokens))
                if has_in_place:
                    raw_in_place_steps.append(raw_in_place_step_ms(engine, mean_past, runs=100))
                    bare_in_place_loops.append(bare_in_place_loop_ms(engine, prompts, args.new_tokens))
                    over_mean, over_median = paired_in_place_ratios(engine, prompts, args.new_tokens)
                    paired.extend(over_mean)
                    paired_median.extend(over_median)
    peer.close()

    costs = step_costs(engine, texts[0])
    t_step, t_verify = costs["target"], verify_ms(engine, prompts[0], k + 1)
    genai = statistics.median(rates["genai"])
    base = statistics.median(rates["none"])
    print(f"{len(prompts)} held-out prompts x {args.new_tokens} tokens, greedy, batch 1, {args.threads} threads, "
          f"median of {args.repeats} interleaved runs, warm-up excluded, prefill included")
    print(f"peer: onnxruntime-genai {peer.version} greedy, its builder's fp32 graph of models/fixture/target's weights")
    print(f"{'':24s} {'tokens/s':>9s} {'vs genai':>9s} {'vs none':>8s} {'bound':>7s} {'tau':>5s}  identical to genai")
    print(f"{'onnxruntime-genai greedy':24s} {genai:9.1f} {1.0:8.2f}x")
    for mode in modes:
        rate, tau = statistics.median(rates[mode]), statistics.median(taus[mode])
        # The bound, as a speed over specserve target-only: every round costs one verify
        # pass and k head steps, and commits tau tokens that target-only pays a step each.
        bound = "" if mode == "none" else f"{tau * t_step / (t_verify + k * costs.get(mode, 0.0)):6.2f}x"
        same = "yes" if outputs[mode] == outputs["genai"] else "NO"
        print(f"{'specserve ' + mode:24s} {rate:9.1f} {rate / genai:8.2f}x {rate / base:7.2f}x {bound:>7s} "
              f"{tau:5.2f}  {same}")
    engine_ms = statistics.median(per_token) * 1000

    def against(label: str, figures: list[float]) -> None:
        ratios = sorted(1000 * e / r for e, r in zip(per_token, figures))
        print(f"  vs {label}: {statistics.median(figures):.2f} ms, {statistics.median(ratios):.2f}x "
              f"(per run {', '.join(f'{x:.2f}' for x in ratios)})")

    print(f"target-only per token: engine {engine_ms:.2f} ms; measured right after each target-only run "
          f"(1-token steps, past {mean_past} for the raw calls):")
    if has_in_place:
        against("the in-place graph's raw call (the graph the engine runs at batch 1)", raw_in_place_steps)
        against("a bare greedy loop on the in-place graph", bare_in_place_loops)
        for label, ratios in (("mean", paired), ("median", paired_median)):
            quartiles = statistics.quantiles(ratios, n=4)
            print(f"  vs the in-place graph's raw call, paired per request (48 raw calls right after each request, at its "
                  f"mean past; over their {label}): median {statistics.median(ratios):.2f}x over {len(ratios)} "
                  f"requests (quartiles {quartiles[0]:.2f}-{quartiles[2]:.2f})")
    against("the standard graph's raw session call", raw_steps)
    against("a bare greedy loop of the standard graph feeding its presents back (past growing)", bare_loops)
    print(f"step costs (ms): target step {t_step:.2f}, verify of {k + 1} {t_verify:.2f}, " + ", ".join(
        f"{m} {v:.2f}" for m, v in costs.items() if m != "target"))
    engine.close()


if __name__ == "__main__":
    main()
