"""``specserve``: one command for what the repository does.

    specserve serve [--port 8000 ...]      the quickstart's server: a local Ray head, every deployment
    specserve chat [--url URL] [...]       an interactive chat, embedded or against a server
    specserve generate --prompt TEXT ...   continue raw text in-process
    specserve convert --default-model      fetch and convert the default model (SmolLM2-135M-Instruct)
    specserve convert --gguf FILE ...      convert a GGUF or Hugging Face checkpoint into a bundle
    specserve bench NAME [...]             run bench/NAME.py (``specserve bench --list``)

``serve``, ``generate`` and ``convert`` take the flags of the modules they run
(``specserve.cluster.local``, ``python -m specserve.engine generate``,
``specserve.modelbuild.convert``; ``convert --default-model`` those of
``specserve.modelbuild.default_model``). A GGUF converts with the ``gguf`` extra, a Hugging
Face checkpoint with the ``convert`` extra. ``bench`` runs from a source checkout, where
``bench/`` lives.
"""
from __future__ import annotations

import argparse
import logging
import runpy
import sys
from pathlib import Path

CHECKOUT = Path(__file__).resolve().parents[1]
COMMANDS = ("serve", "chat", "generate", "convert", "bench")


def _checkout_dir(name: str, command: str) -> Path:
    folder = CHECKOUT / name
    if not folder.is_dir():
        raise SystemExit(f"error: specserve {command} runs from a source checkout; {folder} is missing")
    if str(CHECKOUT) not in sys.path:
        sys.path.insert(0, str(CHECKOUT))
    return folder


def serve(argv: list[str]) -> int:
    from specserve.cluster.local import main as local_main

    return local_main(argv)


def generate(argv: list[str]) -> int:
    from specserve.engine.__main__ import main as engine_main

    return engine_main(["generate", *argv])


def convert(argv: list[str]) -> int:
    if "--default-model" in argv:
        from specserve.modelbuild.default_model import main as default_model_main

        default_model_main([arg for arg in argv if arg != "--default-model"])
        return 0
    from specserve.modelbuild.convert.__main__ import main as convert_main

    convert_main(argv)
    return 0


def bench(argv: list[str]) -> int:
    folder = _checkout_dir("bench", "bench")
    names = sorted(p.stem for p in folder.glob("*.py") if not p.stem.startswith("_") and p.stem != "record")
    if not argv or argv[0] in ("--list", "-h", "--help"):
        print("specserve bench NAME [ARGS]: runs bench/NAME.py; NAME is one of\n  " + "\n  ".join(names))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in names:
        print(f"error: no bench named {name!r}; one of: {', '.join(names)}", file=sys.stderr)
        return 2
    sys.argv = [str(folder / f"{name}.py"), *rest]
    runpy.run_path(sys.argv[0], run_name="__main__")
    return 0


def chat(argv: list[str]) -> int:
    from specserve import chat as chat_loop

    parser = argparse.ArgumentParser(prog="specserve chat", description="An interactive chat, printing each "
                                     "reply's tokens/s and tau. Embedded (in-process) unless --url is given.")
    parser.add_argument("--url", default=None, help="a running server, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="embedded: bundle or model directory (default: the "
                        "default model); with --url: the served model's name (default: the first listed)")
    parser.add_argument("--system", default=None, help="a system message opening the conversation")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--speculative", default=None, help="speculative mode (default: the engine's or "
                        "server's default)")
    # A person reads a chat: float32's own answer is worth the format's ~20 % of tokens/s there
    # (README, "The specserve command"); throughput paths keep `auto`.
    parser.add_argument("--target-format", choices=["auto", "exact", "fast"], default="exact",
                        help="embedded: the target's format (default exact: float32's own tokens; "
                        "docs/models.md)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    args = parser.parse_args(argv)
    if args.url is not None:
        body = {"model": args.model or chat_loop.first_model(args.url), "max_tokens": args.max_new_tokens,
                "temperature": args.temperature,
                **({"speculative_mode": args.speculative} if args.speculative else {})}
        answer = chat_loop.remote(args.url, body)
    else:
        from specserve.engine import Engine, EngineConfig, GenerationOptions

        print("loading the model ...", flush=True)
        engine = Engine(args.model, EngineConfig(device=args.device, target_format=args.target_format))
        options = GenerationOptions(max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                    **({"speculative_mode": args.speculative} if args.speculative else {}))
        answer = chat_loop.embedded(engine, options)
    return chat_loop.run(answer, args.system)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip())
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    command = {"serve": serve, "chat": chat, "generate": generate, "convert": convert, "bench": bench}[argv[0]]
    return command(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
