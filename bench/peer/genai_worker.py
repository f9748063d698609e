"""onnxruntime-genai's own greedy loop over one model, driven line by line over stdin/stdout
by bench/peer_genai.py. Runs in .venv-peer (see setup.sh), never in specserve's .venv.

    request:  {"ids": [prompt token ids], "new_tokens": 64}
    reply:    {"tokens": [generated ids], "seconds": prompt-in to last token out,
               "decode_seconds": first generated token to last}
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import onnxruntime_genai as og


def set_threads(model_dir: Path, threads: int) -> None:
    """The same intra-op thread count specserve's bench gives its sessions."""
    path = model_dir / "genai_config.json"
    config = json.loads(path.read_text())
    config["model"]["decoder"].setdefault("session_options", {})["intra_op_num_threads"] = threads
    path.write_text(json.dumps(config, indent=4))


def generate(model: og.Model, ids: list[int], new_tokens: int) -> dict:
    params = og.GeneratorParams(model)
    # min_length = max_length: exactly new_tokens, like specserve's ignore_eos.
    params.set_search_options(do_sample=False, max_length=len(ids) + new_tokens, min_length=len(ids) + new_tokens)
    generator = og.Generator(model, params)
    started = time.perf_counter()
    generator.append_tokens(ids)
    tokens: list[int] = []
    first = None
    while not generator.is_done():
        generator.generate_next_token()
        tokens.append(int(generator.get_next_tokens()[0]))
        first = first or time.perf_counter()
    done = time.perf_counter()
    return {"tokens": tokens, "seconds": done - started, "decode_seconds": done - (first or done)}


def main() -> None:
    model_dir, threads = Path(sys.argv[1]), int(sys.argv[2])
    set_threads(model_dir, threads)
    model = og.Model(str(model_dir))
    print(json.dumps({"ready": og.__version__}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        print(json.dumps(generate(model, request["ids"], request["new_tokens"])), flush=True)


if __name__ == "__main__":
    main()
