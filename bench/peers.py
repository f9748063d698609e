"""specserve on the default model (SmolLM2-135M-Instruct) against its peers on the same
GGUF, batch 1, in one run, interleaved; then concurrency in-process and through the server.

    bash bench/peer/setup.sh --real          # once: .venv-peer with llama.cpp, onnxruntime-genai, transformers
    .venv/bin/python bench/peers.py [--prompts 10] [--new-tokens 64] [--threads 2] [--record docs/benchmarks]

Contestants: specserve in-process in every mode the bundle serves, in the default (fast)
format, adaptive speculation on (as served) and pinned at k = 4 drafts a round (where tau
and the bound are read); specserve in the exact format (its own engine,
``target_format="exact"``), target-only and every mode adaptive; and, each in its own
process in ``.venv-peer`` (``bench/peer/peer_worker.py``):
llama.cpp greedy on the GGUF itself and with its prompt-lookup drafter (4 drafts),
onnxruntime-genai greedy on its builder's int4 and fp32 graphs of the Hugging Face export,
and transformers' float32 greedy. Every contestant decodes exactly ``--new-tokens`` tokens
(EOS ignored) of each held-out chat prompt (``tests/data/heldout_chat_prompts.json``, the
same token ids for all), after one untimed warm-up request each; the contestants take
turns prompt by prompt, their order rotating. tokens/s counts prompt in to last token out
(prefill included, warm-up excluded). specserve's prefix and suffix caches are emptied
before every request: each is new to its engine. Identity: prompts whose first 48 tokens equal
transformers' (the same weights in float32). For each speculative mode, tau (tokens per
target pass) and the bound tau * t_step / (t_verify + k * t_head) from the engine's own
start-up timings.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from specserve.engine import Engine, EngineConfig, GenerationOptions  # noqa: E402
from specserve.engine.model.chat import ChatTemplate  # noqa: E402
from specserve.engine.model.default_model import DEFAULT_MODEL_DIR  # noqa: E402

PEER_PYTHON = ROOT / ".venv-peer/bin/python"
PEER_CACHE = ROOT / ".cache/peer"
IDENTITY_TOKENS = 48
PEERS = {  # name -> (worker kind, model path)
    "llama.cpp greedy": ("llama_cpp", ROOT / ".cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "llama.cpp prompt lookup": ("llama_cpp_lookup", ROOT / ".cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"),
    "onnxruntime-genai int4": ("genai", PEER_CACHE / "smollm2-genai-int4"),
    "onnxruntime-genai fp32": ("genai", PEER_CACHE / "smollm2-genai-fp32"),
    "transformers fp32": ("transformers", PEER_CACHE / "smollm2-hf"),
}
REFERENCE = "transformers fp32"
EXACT = "specserve exact"  # the exact format's contestants: "specserve exact <mode>"


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    rounds: int = 0       # specserve: target passes (rounds)
    committed: int = 0    # specserve: tokens those rounds committed

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


class PeerProcess:
    """A peer in its own venv, one JSON line per request (``bench/peer/peer_worker.py``)."""

    def __init__(self, kind: str, model: Path, threads: int) -> None:
        self.process = subprocess.Popen([str(PEER_PYTHON), str(ROOT / "bench/peer/peer_worker.py"), kind, str(model),
                                         str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.version = json.loads(self.process.stdout.readline())["ready"]

    def generate(self, ids: list[int], new_tokens: int) -> tuple[list[int], float]:
        self.process.stdin.write(json.dumps({"ids": ids, "new_tokens": new_tokens}) + "\n")
        self.process.stdin.flush()
        reply = json.loads(self.process.stdout.readline())
        return reply["tokens"], reply["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=30)


def specserve_contestant(engine: Engine, mode: str, adaptive: bool, tally: Tally, new_tokens: int):
    options = GenerationOptions(max_new_tokens=new_tokens, temperature=0, ignore_eos=True, speculative_mode=mode,
                                adaptive_speculation=adaptive)

    def generate(ids: list[int], _: int) -> tuple[list[int], float]:
        cold(engine)
        started = time.perf_counter()
        result = engine.generate(ids, options)
        seconds = time.perf_counter() - started
        tally.rounds += result.speculative.verification_steps
        tally.committed += result.speculative.committed_tokens
        return result.token_ids, seconds
    return generate


def cold(engine: Engine | None, server: str | None = None) -> None:
    """Forget earlier requests' prefixes and outputs, in ``engine`` or on ``server``: every
    contestant decodes the same prompts, and a timed request must be new to its engine (no
    prefix-cache hit, no suffix draft from another contestant's answer to it)."""
    if engine is not None:
        engine.reset_prefix_cache()
        engine.reset_suffix_cache()
    if server is not None:
        import httpx

        for path in ("/reset_prefix_cache", "/reset_suffix_cache"):
            httpx.post(server + path, timeout=30).raise_for_status()


def bound(engine: Engine, mode: str, tau: float, drafts: int) -> float:
    """tau * t_step / (t_verify + k * t_head), from the costs the engine timed at start-up."""
    table = engine.transport.target.verify_costs()
    step, verify = table.predict(1, 1), table.predict(1, drafts + 1)
    worker = engine.transport.proposers.get(mode)
    head = worker.draft_costs().seconds[(1, 4)] / 4 if worker is not None else 0.0  # prompt lookup: no model
    return tau * step / (verify + drafts * head)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-peers", action="store_true", help="specserve's modes only")
    parser.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16, 32],
                        help="streams for the in-process and served table (none: skip it)")
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "peers", model=DEFAULT_MODEL_DIR):
        run(args)


def run(args: argparse.Namespace) -> None:
    chats = [p["messages"] for p in json.loads((ROOT / "tests/data/heldout_chat_prompts.json").read_text())]
    engine = Engine(DEFAULT_MODEL_DIR, EngineConfig(device="cpu", intra_op_threads=args.threads))
    exact = Engine(DEFAULT_MODEL_DIR, EngineConfig(device="cpu", intra_op_threads=args.threads, target_format="exact"))
    template = ChatTemplate.from_model_dir(engine.bundle.target_dir)
    prompts = [engine.tokenizer.encode(template.render(c)) for c in chats[: args.prompts]]
    tallies: dict[str, Tally] = {}
    contestants = {}
    drafts = engine.config.speculative.num_speculative_tokens
    for mode in engine.available_modes:  # as served (adaptive), and pinned at k drafts a round for tau
        for adaptive in ((True,) if mode == "none" else (True, False)):
            name = f"specserve {mode}" + ("" if mode == "none" else " (adaptive)" if adaptive else f" (k={drafts})")
            tallies[name] = Tally()
            contestants[name] = specserve_contestant(engine, mode, adaptive, tallies[name], args.new_tokens)
    for mode in exact.available_modes:
        name = f"{EXACT} {mode}" + ("" if mode == "none" else " (adaptive)")
        tallies[name] = Tally()
        contestants[name] = specserve_contestant(exact, mode, True, tallies[name], args.new_tokens)
    peers: dict[str, PeerProcess] = {}
    if not args.no_peers:
        for name, (kind, model) in PEERS.items():
            peers[name] = PeerProcess(kind, model, args.threads)
            tallies[name], contestants[name] = Tally(), peers[name].generate
    try:
        for generate in contestants.values():
            generate(prompts[0], args.new_tokens)  # warm-up, untimed
        for tally in tallies.values():
            tally.rounds = tally.committed = 0
        names = list(contestants)
        for i, ids in enumerate(prompts):
            for name in names[i % len(names):] + names[: i % len(names)]:
                tokens, seconds = contestants[name](ids, args.new_tokens)
                tally = tallies[name]
                tally.tokens, tally.seconds = tally.tokens + len(tokens), tally.seconds + seconds
                tally.outputs.append(tokens)
            print(f"prompt {i + 1}/{len(prompts)} done", file=sys.stderr, flush=True)
    finally:
        for peer in peers.values():
            peer.close()
        exact.close()
    report(args, engine, tallies, peers)
    if args.concurrency:
        from specserve.modelbuild.distill.prompts import build_prompts

        # Distinct prompts for every request in flight (the 10 above would repeat at 16 and 32
        # streams): the distillation corpus's held-out chats, which no head trained on.
        concurrency(args, engine, [template.render(p.messages) for p in build_prompts()[1][: 2 * max(args.concurrency)]])
    engine.close()


def report(args, engine: Engine, tallies: dict[str, Tally], peers: dict[str, PeerProcess]) -> None:
    base = tallies["specserve none"].tokens_per_s
    reference = tallies.get(REFERENCE)
    print(f"SmolLM2-135M-Instruct (specserve's default format: {engine.target.family.name}; '{EXACT}': the exact "
          f"format), batch 1, "
          f"{args.threads} threads, {len(tallies['specserve none'].outputs)} held-out "
          f"chat prompts x {args.new_tokens} new tokens (EOS ignored), greedy; tokens/s include prefill, exclude "
          "each contestant's one warm-up request; contestants interleaved prompt by prompt")
    for name, peer in peers.items():
        print(f"  {name}: {peer.version}")
    for prefix, base_name in (("specserve ", "specserve none"), (f"{EXACT} ", f"{EXACT} none")):
        ours = {name: t.outputs for name, t in tallies.items()
                if name.startswith(prefix) and name.startswith(EXACT) == prefix.startswith(EXACT)}
        same = all(outputs == ours[base_name] for outputs in ours.values())
        print(f"  every {prefix.strip()} mode token-identical to its target-only: {'yes' if same else 'NO'}")
    for ours_name, theirs in (("specserve none", "onnxruntime-genai int4"), ("specserve none", "llama.cpp greedy"),
                              (f"{EXACT} none", "llama.cpp greedy"), ("specserve none", f"{EXACT} none")):
        if theirs in tallies:
            print(f"  {ours_name} / {theirs}: {tallies[ours_name].tokens_per_s / tallies[theirs].tokens_per_s:.2f}x")
    print()
    print("| contestant | tokens/s | specserve target-only / it | identical to transformers (48 tokens) | tau | bound |")
    print("|---|---|---|---|---|---|")
    drafts = engine.config.speculative.num_speculative_tokens
    for name, tally in tallies.items():
        same = (f"{sum(a[:IDENTITY_TOKENS] == b[:IDENTITY_TOKENS] for a, b in zip(tally.outputs, reference.outputs))}"
                f"/{len(tally.outputs)}") if reference else "-"
        tau = limit = "-"
        mode = name.removeprefix(f"{EXACT} ").removeprefix("specserve ").split(" ")[0]
        if name.startswith("specserve ") and mode != "none" and tally.rounds:
            t = tally.committed / tally.rounds
            tau = f"{t:.2f}"
            if name.endswith(f"(k={drafts})"):  # the bound assumes k drafts every round
                limit = f"{bound(engine, mode, t, drafts):.2f}x"
        print(f"| {name} | {tally.tokens_per_s:.1f} | {base / tally.tokens_per_s:.2f} | {same} | {tau} | {limit} |")


def concurrency(args, engine: Engine, prompts: list[str]) -> None:
    """Aggregate tokens/s at each concurrency, in-process then through the server (every
    served output checked against the in-process one)."""
    from bench.distributed import in_process_runner, measure, server_runner

    modes = engine.available_modes
    print()
    print(f"Concurrency (streams x {args.new_tokens} tokens, greedy, EOS ignored, one request per stream after an "
          "untimed one, every prompt distinct and new to its engine; in-process measured first, before Ray starts; "
          "bench/distributed.py compares the two sides interleaved):")
    print("| mode | streams | in-process tokens/s | served tokens/s | served / in-process |")
    print("|---|---|---|---|---|")
    local: dict[tuple[str, int], object] = {}
    half = len(prompts) // 2  # the first half warms each cell's shapes up, the second is timed

    def timed(run_one, streams: int, engine_or_none, server: str | None = None):
        measure(run_one, prompts, streams, 1)
        cold(engine_or_none, server)
        return measure(run_one, prompts, streams, 1, start=half)

    for mode in modes:
        options = GenerationOptions(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True, speculative_mode=mode)
        for streams in args.concurrency:
            local[(mode, streams)] = timed(in_process_runner(engine, options), streams, engine)
    engine.close()
    from specserve.cluster.local import serve_local, start_local_ray

    start_local_ray()
    try:
        # serve_config.yaml's application (bench/distributed.py's "fixed" configuration), on CPU
        serve_local({"model_dir": str(DEFAULT_MODEL_DIR), "stream_interval": 1, "stream_writes_per_s": 250,
                     "engine": {"device": "cpu", "intra_op_threads": 2, "scheduler": {"lanes": 2}}}, port=8012)
        for mode in modes:
            for streams in args.concurrency:
                served = timed(server_runner("http://127.0.0.1:8012", mode, args.new_tokens), streams, None,
                               "http://127.0.0.1:8012")
                same = all(a.token_ids == b.token_ids for a, b in zip(served.results, local[(mode, streams)].results))
                ratio = served.tokens_per_s / local[(mode, streams)].tokens_per_s
                print(f"| {mode} | {streams} | {local[(mode, streams)].tokens_per_s:.1f} | {served.tokens_per_s:.1f} | "
                      f"{ratio:.2f}{'' if same else ' (OUTPUT DIFFERS)'} |")
    finally:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
