"""Command line: ``python -m specserve.engine chat --message "What is the capital of France?"`` (the
default model, with its chat template) or ``python -m specserve.engine generate --prompt "def "``
(raw text; ``--model`` names another bundle, e.g. ``models/fixture``)."""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pydantic import ValidationError

from specserve.engine.api import Engine
from specserve.engine.config import EngineConfig, SpeculativeConfig
from specserve.engine.errors import EngineError
from specserve.engine.grammar.spec import StructuredOutput
from specserve.engine.options import SPECULATIVE_MODES, GenerationOptions
from specserve.engine.speculative.proposers.registry import MODEL_MODES
from specserve.engine.speculative.sequence import TokenEvent


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m specserve.engine", description="specserve in-process engine")
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="continue a raw text prompt and print it with its speed")
    gen.add_argument("--prompt", required=True)
    chat = commands.add_parser("chat", help="answer one chat message (the model's chat template) with its speed")
    chat.add_argument("--message", required=True, help="the user's message")
    chat.add_argument("--system", default=None, help="a system message before it")
    for sub in (gen, chat):
        _add_common(sub)
    return parser


def _add_common(gen: argparse.ArgumentParser) -> None:
    gen.add_argument("--model", default=None, help="bundle or model directory (default: the default model, "
                     "SmolLM2-135M-Instruct; models/fixture is the test fixture)")
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--min-tokens", type=int, default=0, help="no EOS or stop string before this many tokens")
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    gen.add_argument("--speculative", choices=SPECULATIVE_MODES, default="none",
                     help="proposer for propose->verify rounds (output is identical to 'none' under greedy)")
    gen.add_argument("--num-speculative-tokens", type=int, default=None, help="drafts per round (default 4)")
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", default=None, metavar="SCHEMA",
                       help="the output must be JSON satisfying this schema (its JSON text, or @FILE)")
    shape.add_argument("--json", action="store_true", help="the output must be a JSON object")
    shape.add_argument("--regex", default=None, help="the output must match this regular expression")
    shape.add_argument("--choice", action="append", default=None, help="the output must be one of these (repeatable)")
    gen.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    gen.add_argument("--threads", type=int, default=None, help="onnxruntime intra-op threads")
    gen.add_argument("--target-format", choices=["auto", "exact", "fast"], default="auto",
                     help="the target's format (docs/models.md): fast = int8 activations, lossless at any batch; "
                          "exact = the file's weights in float32")
    gen.add_argument("--no-stream", action="store_true", help="print the text only when finished")


def _structured_output(args: argparse.Namespace) -> StructuredOutput | None:
    if args.json_schema is not None:
        schema = args.json_schema
        return StructuredOutput.json_schema(Path(schema[1:]).read_text() if schema.startswith("@") else schema)
    if args.json:
        return StructuredOutput.json_object()
    if args.regex is not None:
        return StructuredOutput.regex(args.regex)
    return StructuredOutput.choice(args.choice) if args.choice else None


def generate(args: argparse.Namespace) -> int:
    try:
        options = GenerationOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    top_k=args.top_k, top_p=args.top_p, repetition_penalty=args.repetition_penalty,
                                    presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                                    min_tokens=args.min_tokens,
                                    seed=args.seed, stop=tuple(args.stop), speculative_mode=args.speculative,
                                    num_speculative_tokens=args.num_speculative_tokens,
                                    structured_output=_structured_output(args))
        # Load only the proposer this run uses: start-up stays fast.
        load = () if args.speculative not in MODEL_MODES else (args.speculative,)
        engine = Engine(args.model, EngineConfig(device=args.device, intra_op_threads=args.threads,
                                                 target_format=args.target_format,
                                                 speculative=SpeculativeConfig(load=load)))
    except ValidationError as exc:
        print(f"error: invalid option: {exc}", file=sys.stderr)
        return 2
    except EngineError as exc:  # a model that cannot be served as asked (a format it lacks, say)
        print(f"error: {exc}", file=sys.stderr)
        return 2

    def stream(event: TokenEvent) -> None:
        sys.stdout.write(event.text)
        sys.stdout.flush()

    on_token = None if args.no_stream else stream
    if args.command == "chat":
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": args.message}]
        result = engine.chat(messages, options, on_token=on_token)
    else:
        sys.stdout.write(args.prompt)
        result = engine.generate(args.prompt, options, on_token=on_token)
    if args.no_stream:
        sys.stdout.write(result.text)
    print()
    stats = result.speculative
    speculative = (f", mode={stats.mode}, tau={stats.mean_accepted_length:.2f} tokens/round, "
                   f"acceptance={stats.acceptance_rate:.2f}") if stats.mode != "none" else ""
    # Engine() warmed every session up while it measured verify and draft costs, so this
    # is the engine's own speed; it includes the prompt's prefill.
    print(f"[{result.completion_tokens} tokens, {result.tokens_per_second:.1f} tokens/s incl. prefill "
          f"(sessions warmed up at load), finish_reason={result.finish_reason}{speculative}]")
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    args = build_parser().parse_args(argv)
    try:
        return generate(args)
    except EngineError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
