"""Fidelity of each of the default model's formats to transformers' float32 on the same
GGUF, with llama.cpp beside them: per-position top-1 agreement and mean KL(transformers ||
format) over held-out text, teacher-forced: the held-out prompts (``tests/data/
heldout_prompts.json``, whole texts) and the distillation corpus's held-out chat prompts
(``modelbuild.distill.prompts``, rendered with the chat template, which no head saw). Token identity over 48 generated tokens is ``bench/peers.py``'s column.

    bash bench/peer/setup.sh --real     # once: .venv-peer with transformers and llama.cpp
    .venv/bin/python bench/fidelity.py [--texts 40] [--threads 2] [--record docs/benchmarks]

specserve's logits are computed in ``.venv`` (each text in one call from an empty past:
in the fast format a row is the same bits in any call, ``tests/test_target_formats.py``),
written to a scratch directory, and compared in ``.venv-peer``
(``bench/peer/fidelity_worker.py``), where transformers and llama.cpp run.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench import record  # noqa: E402
from specserve.engine import EngineConfig  # noqa: E402
from specserve.engine.model.cached_decoder import CachedDecoder  # noqa: E402
from specserve.engine.model.default_model import DEFAULT_MODEL_DIR  # noqa: E402

PEER_PYTHON = ROOT / ".venv-peer/bin/python"
HF_EXPORT = ROOT / ".cache/peer/smollm2-hf"
GGUF = ROOT / ".cache/gguf/SmolLM2-135M-Instruct.Q4_1.gguf"
FORMATS = ("fast", "exact")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=24, help="held-out prompts (tests/data)")
    parser.add_argument("--chats", type=int, default=300, help="held-out chat prompts (modelbuild.distill)")
    parser.add_argument("--threads", type=int, default=2)
    record.add_option(parser)
    args = parser.parse_args()
    with record.recording(args.record, "fidelity", model=DEFAULT_MODEL_DIR):
        run(args)


def run(args: argparse.Namespace) -> None:
    target = DEFAULT_MODEL_DIR / "target"
    config = EngineConfig(device="cpu", intra_op_threads=args.threads)
    from specserve.engine.model.chat import ChatTemplate
    from specserve.modelbuild.distill.prompts import build_prompts

    prompts = [p["prompt"] for p in json.loads((ROOT / "tests/data/heldout_prompts.json").read_text())][: args.texts]
    template = ChatTemplate.from_model_dir(target)
    prompts += [template.render(p.messages) for p in build_prompts()[1][: args.chats]]
    with tempfile.TemporaryDirectory() as scratch_dir:
        scratch = Path(scratch_dir)
        texts = None
        for fmt in FORMATS:
            decoder = CachedDecoder(target, config, graph_format=fmt)
            if texts is None:
                texts = [ids for ids in (decoder.tokenizer.encode(p) for p in prompts) if len(ids) >= 8]
            for index, ids in enumerate(texts):
                decoder.cache.add_sequence(index)
                np.save(scratch / f"{fmt}-{index}.npy", decoder.feed(index, ids, 0).logits.astype(np.float32))
                decoder.cache.free(index)
        (scratch / "texts.json").write_text(json.dumps(texts))
        (scratch / "contestants.json").write_text(json.dumps(list(FORMATS)))
        reply = subprocess.run([str(PEER_PYTHON), str(ROOT / "bench/peer/fidelity_worker.py"), str(scratch),
                                str(HF_EXPORT), str(GGUF), str(args.threads)], capture_output=True, text=True,
                               check=True)
    results = json.loads(reply.stdout.strip().splitlines()[-1])
    positions = next(iter(results.values()))["positions"]
    print(f"SmolLM2-135M-Instruct: {len(texts)} held-out texts ({args.texts} prompts, {args.chats} chats), "
          f"{positions} positions, teacher-forced; reference "
          "transformers float32 on the GGUF's weights (its Hugging Face export)")
    print()
    print("| format | top-1 agreement | mean KL (nats) |")
    print("|---|---|---|")
    names = {"fast": "specserve fast (the default)", "exact": "specserve exact",
             "llama.cpp": "llama.cpp (Q4_1 x Q8_1 activations)"}
    for name, r in results.items():
        print(f"| {names.get(name, name)} | {r['top1_agreement'] * 100:.2f} % | {r['mean_kl']:.2e} |")


if __name__ == "__main__":
    main()
