"""A bundle's exported head measured on extracted held-out states: top-1 agreement with
the target per draft step and the expected tau at k = 1..6 (``train.evaluate``), for the
head as it is shipped (its float16 / int8-block weights, its own draft vocabulary). Two
heads trained on different data are compared on the same states this way.

    .venv-convert/bin/python -m specserve.modelbuild.distill.evaluate eagle3 [--bundle DIR] [--split heldout] [--kinds text]
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import load_file

from ..int8_storage import SCALE_SUFFIX, dequantize_blocks
from .features import Features
from .generate import DEFAULT_OUT
from .train import EVAL_STEPS, TRAINERS, evaluate, target_shape


def shipped_trainer(kind: str, bundle: Path):
    """The trainer of ``kind`` holding the head shipped in ``bundle`` (and its t2d map)."""
    shape = target_shape(json.loads((bundle / "target/config.json").read_text()))
    directory = bundle / "heads" / kind
    d2t = np.load(directory / "d2t.npy")
    draft_ids = d2t + np.arange(len(d2t))
    embed = torch.from_numpy(np.load(bundle / "target/embed_tokens.npy"))
    trainer = TRAINERS[kind](shape, embed, draft_ids)
    tensors = load_file(str(directory / "model.safetensors"))
    state = {}
    for name, value in tensors.items():
        if name.endswith(SCALE_SUFFIX):
            continue
        scale = tensors.get(name + SCALE_SUFFIX)
        state[name] = torch.from_numpy(dequantize_blocks(value, scale) if scale is not None else value.astype(np.float32))
    missing, unexpected = trainer.head.load_state_dict(state, strict=False)
    if missing or unexpected:  # a head measured with weights it does not hold would read as untrained
        raise ValueError(f"{directory}: the shipped weights do not fit a {kind} head (missing {missing}, "
                         f"unexpected {unexpected})")
    trainer.head.eval()
    t2d = torch.full((shape.vocab_size,), -1, dtype=torch.long)
    t2d[torch.from_numpy(draft_ids)] = torch.arange(len(draft_ids))
    return trainer, t2d


class Subset(Features):
    """Features whose anchors are only the rows of sequences of the given kinds."""

    def __init__(self, directory: Path, kinds: set[str] | None) -> None:
        super().__init__(directory)
        if kinds:
            keep = np.zeros(len(self.tokens), bool)
            for seq in self.sequences:
                if seq["kind"] in kinds:
                    keep[seq["row"] : seq["row"] + seq["rows"]] = True
            self.anchors = self.anchors[keep[self.anchors]]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=sorted(TRAINERS))
    parser.add_argument("--bundle", type=Path, default=Path("models/smollm2-135m-instruct"))
    parser.add_argument("--data", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--split", default="heldout")
    parser.add_argument("--kinds", nargs="*", default=None,
                        help="sequence kinds to anchor on (greedy, sampled, text); default all")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    trainer, t2d = shipped_trainer(args.kind, args.bundle)
    features = Subset(args.data / "features" / args.split, set(args.kinds) if args.kinds else None)
    print(json.dumps({"kind": args.kind, "bundle": str(args.bundle), "split": args.split, "kinds": args.kinds,
                      "anchors": int(len(features.anchors)), **evaluate(trainer, t2d, features, EVAL_STEPS)}),
          flush=True)


if __name__ == "__main__":
    main()
