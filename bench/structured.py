"""Constrained against unconstrained decoding, per mode, in-process, batch 1.

    .venv/bin/python bench/structured.py [--models DIR ...] [--prompts 6] [--new-tokens 48] [--k 4]
                                         [--threads 2] [--record DIR]

For each model (the default model and the stdlib test fixture unless told otherwise) and
each mode it serves, the same prompts are decoded greedily three ways, interleaved prompt
by prompt: free (EOS ignored), under a JSON schema, and under the same schema with drafts
that ignore it (the proposers' own argmax: does drafting by the grammar pay?). It prints
decode tokens/s, τ (tokens committed per target pass) and draft acceptance of each, the
constrained ÷ free and guided ÷ unguided speed ratios, and checks every constrained
output token-identical to constrained target-only. Then what the grammar costs: building
llguidance's view of the vocabulary, compiling the schema, and one position's mask.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from specserve.engine import Engine, EngineConfig, GenerationOptions, StructuredOutput  # noqa: E402
from specserve.engine.grammar.compiler import GrammarCompiler  # noqa: E402
from specserve.engine.model.default_model import DEFAULT_MODEL_DIR  # noqa: E402

PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                           "city": {"type": "string"}, "job": {"type": "string"}},
          "required": ["name", "age", "city", "job"], "additionalProperties": False}
CITIES = ["Berlin", "Lisbon", "Osaka", "Toronto", "Nairobi", "Lima", "Oslo", "Hanoi", "Cairo", "Quito"]
# The fixture writes Python: its strings hold code, so its drafts have something to get right.
SNIPPET = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 24}, "body": {"type": "string"}},
           "required": ["name", "body"], "additionalProperties": False}


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0
    committed: int = 0
    rounds: int = 0
    accepted: int = 0
    proposed: int = 0
    outputs: list = field(default_factory=list)

    def add(self, result) -> None:
        self.tokens += result.completion_tokens - 1  # the first comes from the prefill
        self.seconds += result.decode_seconds
        s = result.speculative
        self.committed, self.rounds = self.committed + s.committed_tokens, self.rounds + s.verification_steps
        self.accepted, self.proposed = self.accepted + s.accepted_tokens, self.proposed + s.proposed_tokens
        self.outputs.append(result.token_ids)

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    def cells(self) -> str:
        tau = self.committed / max(self.rounds, 1)
        return f"{self.rate:8.1f} {tau:5.2f} {self.accepted / max(self.proposed, 1):6.2f}"


def workload(engine: Engine, model_dir: Path, count: int) -> tuple[list, StructuredOutput, str]:
    """(prompts, the schema they are constrained by, what they are)."""
    if engine.chat_template.source is not None:  # a chat model: ask for what the schema holds
        prompts = [engine.chat_template.render([{"role": "user", "content": f"Make up a person who lives in {city}. "
                                                 "Reply in JSON with their name, age, city and job."}])
                   for city in CITIES[:count]]
        return prompts, StructuredOutput.json_schema(PERSON), "chat prompts, a person schema"
    prompts = [p["prompt"] for p in json.loads((ROOT / "tests/data/heldout_prompts.json").read_text())][:count]
    return prompts, StructuredOutput.json_schema(SNIPPET), "held-out code prompts, a {name, body} schema"


def run_model(model_dir: Path, args: argparse.Namespace) -> None:
    engine = Engine(model_dir, EngineConfig(device=args.device, intra_op_threads=args.threads))
    prompts, spec, what = workload(engine, model_dir, args.prompts)
    modes = engine.available_modes
    workers = engine.transport.proposers
    configs = ["free", "grammar", "unguided"]
    tallies = {(mode, c): Tally() for mode in modes for c in configs}

    def options(mode: str, config: str, tokens: int) -> GenerationOptions:
        constrained = config != "free"
        return GenerationOptions(max_new_tokens=tokens, ignore_eos=not constrained, speculative_mode=mode,
                                 num_speculative_tokens=args.k, structured_output=spec if constrained else None)

    def run(prompt: str, mode: str, config: str, tokens: int):
        for worker in workers.values():
            worker.guided = config != "unguided"
        try:
            return engine.generate(prompt, options(mode, config, tokens))
        finally:
            for worker in workers.values():
                worker.guided = True

    plan = [(mode, c) for mode in modes for c in configs if c != "unguided" or mode in workers]
    for mode, config in plan:  # warm-up, untimed
        run(prompts[0], mode, config, 8)
    for n, prompt in enumerate(prompts):  # interleaved prompt by prompt: the VM drifts within minutes
        print(f"  {model_dir.name}: prompt {n + 1}/{len(prompts)}", file=sys.stderr)
        for mode, config in plan:
            tallies[mode, config].add(run(prompt, mode, config, args.new_tokens))

    print(f"\n{model_dir.name}: {len(prompts)} {what} x up to {args.new_tokens} tokens, greedy, k={args.k} "
          f"(adaptive), {args.threads} threads, batch 1")
    print(f"{'':14s} {'free':>20s}   {'grammar':>20s}   {'grammar, unguided drafts':>24s}")
    print(f"{'mode':14s} {'tok/s':>8s} {'tau':>5s} {'accept':>6s}   {'tok/s':>8s} {'tau':>5s} {'accept':>6s}   "
          f"{'tok/s':>8s} {'tau':>5s} {'accept':>6s}   {'grammar/free':>12s} {'guided/unguided':>15s}  identical")
    reference = tallies["none", "grammar"].outputs
    for mode in modes:
        free, grammar, unguided = (tallies[mode, c] for c in configs)
        guided_cells = unguided.cells() if mode in workers else f"{'-':>8s} {'-':>5s} {'-':>6s}"
        ratio = f"{grammar.rate / unguided.rate:14.2f}x" if mode in workers else f"{'-':>15s}"
        same = grammar.outputs == reference and (mode not in workers or unguided.outputs == reference)
        print(f"{mode:14s} {free.cells()}   {grammar.cells()}   {guided_cells}   "
              f"{grammar.rate / free.rate:11.2f}x {ratio}  {'yes' if same else 'NO'}")
    base_free, base_grammar = tallies["none", "free"].rate, tallies["none", "grammar"].rate
    best = max(modes, key=lambda m: tallies[m, "grammar"].rate)
    print(f"speedup over target-only: free, best mode {max(tallies[m, 'free'].rate for m in modes) / base_free:.2f}x; "
          f"under the grammar, {best} {tallies[best, 'grammar'].rate / base_grammar:.2f}x")
    grammar_costs(engine, spec, prompts[0])
    engine.close()


def grammar_costs(engine: Engine, spec: StructuredOutput, prompt: str) -> None:
    """What the grammar itself costs on this model's vocabulary."""
    target = engine.target
    started = time.perf_counter()
    compiler = GrammarCompiler(target.tokenizer, target.decoder.vocab_size, target.eos_token_ids)
    built = time.perf_counter() - started
    started = time.perf_counter()
    compiler.check(spec)
    compiled = time.perf_counter() - started
    output = engine.generate(prompt, GenerationOptions(max_new_tokens=48, structured_output=spec)).token_ids
    state, times = compiler.start(spec), []
    for token in output[:-1]:
        started = time.perf_counter()
        state.allowed()
        times.append(time.perf_counter() - started)
        state.advance(token)
    print(f"grammar costs on a {target.decoder.vocab_size}-token vocabulary: vocabulary read once "
          f"{built * 1000:.0f} ms; schema compiled {compiled * 1000:.2f} ms; a position's mask median "
          f"{statistics.median(times) * 1e6:.0f} us, max {max(times) * 1e6:.0f} us ({len(times)} positions)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", type=Path, default=[DEFAULT_MODEL_DIR, ROOT / "models/fixture"])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--k", type=int, default=4, help="most drafts per round")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="auto")
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "structured"):
        for model_dir in args.models:
            run_model(model_dir, args)


if __name__ == "__main__":
    main()
