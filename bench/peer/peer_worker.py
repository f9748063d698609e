"""One peer's own greedy loop over one model, driven line by line over stdin/stdout (by
bench/peers.py). Runs in .venv-peer (made by bench/peer/setup.sh), never in specserve's .venv:

    .venv-peer/bin/python bench/peer/peer_worker.py KIND MODEL_PATH THREADS

    KIND              MODEL_PATH
    llama_cpp         the GGUF (.cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf)
    llama_cpp_lookup  the same GGUF; llama-cpp-python's LlamaPromptLookupDecoding, num_pred_tokens=4
    genai             an onnxruntime-genai builder dir (.cache/peer/smollm2-genai-int4 or -fp32)
    transformers      the Hugging Face export (.cache/peer/smollm2-hf), float32

    once loaded: {"ready": "<peer name and version>"}
    request:     {"ids": [prompt token ids], "new_tokens": 64}
    reply:       {"tokens": [generated ids], "seconds": prompt-in to last token out,
                  "decode_seconds": first generated token to last}

Every kind: greedy, batch 1, the prompt's ids fed as they are (no re-tokenisation, no BOS
added), THREADS for every thread pool the library has, and exactly ``new_tokens`` tokens:
EOS does not end a sequence and is not masked either -- generation just goes on past it,
as specserve's ``ignore_eos`` does, so each output is the model's argmax chain:

- llama.cpp: ``Llama.generate`` is an endless token generator (EOS only ends
  ``create_completion``); the worker takes ``new_tokens`` from it. The state is reset
  before each request, so no request reuses an earlier one's KV cache (generate's own
  prefix match would otherwise skip a repeated prompt's prefill).
- onnxruntime-genai: its generator is done at EOS (``min_length`` would mask EOS instead,
  as bench/peer/genai_worker.py does). At EOS it has returned the token but not fed it, so
  the worker feeds it with ``append_tokens([eos])``, which computes the next logits as
  ``generate_next_token`` would have, and goes on; ``max_length`` = prompt + ``new_tokens``.
- transformers: ``generate`` with a generation config that has no EOS (so only
  ``max_new_tokens`` stops it); a streamer stamps the first token's time.

The clock starts when the request line has been read and parsed.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Callable

KINDS = ("llama_cpp", "llama_cpp_lookup", "genai", "transformers")
LOOKUP_TOKENS = 4  # num_pred_tokens of LlamaPromptLookupDecoding


Generate = Callable[[list[int], int, float], dict]


def _reply(tokens: list[int], started: float, first: float | None) -> dict:
    done = time.perf_counter()
    return {"tokens": tokens, "seconds": done - started, "decode_seconds": done - (first or done)}


def load_llama_cpp(model_path: Path, threads: int, lookup: bool) -> tuple[str, Generate]:
    import llama_cpp
    from llama_cpp import Llama

    draft = None
    if lookup:
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
        draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS)
    llm = Llama(model_path=str(model_path), n_ctx=2048, n_threads=threads, n_threads_batch=threads,
                draft_model=draft, verbose=False)

    def generate(ids: list[int], new_tokens: int, started: float) -> dict:
        llm.reset()
        tokens: list[int] = []
        first = None
        if new_tokens > 0:
            # temp 0: the sampler chain is the (no-op) penalties then greedy; no top-k/p.
            for token in llm.generate(ids, temp=0.0, repeat_penalty=1.0, reset=True):
                tokens.append(int(token))
                first = first or time.perf_counter()
                if len(tokens) == new_tokens:
                    break
        return _reply(tokens, started, first)

    name = "llama.cpp (llama-cpp-python %s)" % llama_cpp.__version__
    if lookup:
        name = "llama.cpp prompt lookup (llama-cpp-python %s, LlamaPromptLookupDecoding num_pred_tokens=%d)" % (
            llama_cpp.__version__, LOOKUP_TOKENS)
    return name, generate


def load_genai(model_dir: Path, threads: int) -> tuple[str, Generate]:
    import onnxruntime as ort
    import onnxruntime_genai as og

    config = og.Config(str(model_dir))  # threads overlaid in memory: genai_config.json is left as built
    config.overlay(json.dumps({"model": {"decoder": {"session_options": {
        "intra_op_num_threads": threads, "inter_op_num_threads": 1}}}}))
    model = og.Model(config)

    def generate(ids: list[int], new_tokens: int, started: float) -> dict:
        params = og.GeneratorParams(model)
        params.set_search_options(do_sample=False, max_length=len(ids) + new_tokens)
        generator = og.Generator(model, params)
        generator.append_tokens(ids)
        tokens: list[int] = []
        first = None
        while len(tokens) < new_tokens:
            if generator.is_done():  # at EOS, returned but not fed: feed it and go on
                generator.append_tokens(tokens[-1:])
                continue
            generator.generate_next_token()
            tokens.append(int(generator.get_next_tokens()[0]))
            first = first or time.perf_counter()
        return _reply(tokens, started, first)

    return f"onnxruntime-genai {og.__version__} (onnxruntime {ort.__version__}) {model_dir.name}", generate


def load_transformers(model_dir: Path, threads: int) -> tuple[str, Generate]:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    # No eos_token_id anywhere: the only stopping criterion left is max_new_tokens.
    model.generation_config.eos_token_id = None

    class FirstToken:
        """generate's streamer: put() gets the prompt once, then each new token."""

        def __init__(self) -> None:
            self.calls, self.first = 0, None

        def put(self, value) -> None:
            self.calls += 1
            if self.calls == 2:
                self.first = time.perf_counter()

        def end(self) -> None:
            pass

    def generate(ids: list[int], new_tokens: int, started: float) -> dict:
        config = GenerationConfig(do_sample=False, max_new_tokens=new_tokens, min_new_tokens=0, eos_token_id=None,
                                  pad_token_id=pad, use_cache=True)
        streamer = FirstToken()
        with torch.inference_mode():
            input_ids = torch.tensor([ids], dtype=torch.long)
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), generation_config=config,
                                 streamer=streamer)
        tokens = [int(t) for t in out[0, len(ids):]]
        return _reply(tokens, started, streamer.first)

    return f"transformers {transformers.__version__} (torch {torch.__version__}) float32", generate


def load(kind: str, model_path: Path, threads: int) -> tuple[str, Generate]:
    if kind in ("llama_cpp", "llama_cpp_lookup"):
        return load_llama_cpp(model_path, threads, lookup=kind == "llama_cpp_lookup")
    if kind == "genai":
        return load_genai(model_path, threads)
    if kind == "transformers":
        return load_transformers(model_path, threads)
    raise SystemExit(f"unknown KIND {kind!r}: one of {', '.join(KINDS)}")


def main() -> None:
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    kind, model_path, threads = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    name, generate = load(kind, model_path, threads)
    print(json.dumps({"ready": name}), flush=True)
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        started = time.perf_counter()
        reply = generate([int(i) for i in request["ids"]], int(request["new_tokens"]), started)
        if len(reply["tokens"]) != request["new_tokens"]:
            raise SystemExit(f"{kind} gave {len(reply['tokens'])} tokens, not {request['new_tokens']}")
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
