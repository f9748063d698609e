"""Rebuild a bundle's target with mobius-onnx, keeping everything else:
``python -m specserve.modelbuild.convert_mobius --bundle models --out /tmp/mobius_bundle``.

Dev-only, in the convert venv (``bash scripts/install_convert.sh``). A user's own
checkpoints go through ``python -m specserve.modelbuild.convert``; this runs the same target
conversion on the bundle's target and keeps the bundle's trained heads, so every mode
can be checked against it (checked: every mode's greedy output on 10 held-out prompts
equals target-only's, with the bundle's τ):

- mobius builds the target from ``config.json`` + ``model.safetensors`` with
  ``output_layer_indices`` for the EAGLE-3 aux layers. mobius's ``hidden_states.{k}`` is
  the *output* of decoder layer k (HF ``hidden_states[k+1]``); the bundle's aux layer j
  is the residual stream *entering* layer j (HF ``hidden_states[j]``, vLLM's
  convention), so layer j is asked for as k = j - 1 and renamed ``aux_hidden.{j}``.
- mobius has no output for the final normalised hidden state, which every head starts
  from: the input of the LM head's ``MatMul`` (the output of the final norm) is exposed
  as ``hidden_states``.
- The rest of the bundle (manifest, tokenizer, draft, heads, arrays) is copied as is.
"""
from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

from specserve.engine.model.manifest import BundleManifest

from .convert.target import build_target_graph


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=Path("models/fixture"))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    manifest = BundleManifest.load(args.bundle)
    target = manifest.models["target"]
    aux = tuple(target.hidden_outputs.layer_indices or ())
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; choose a new directory")
    shutil.copytree(args.bundle, args.out)
    out_target = args.out / target.directory
    (out_target / target.onnx).unlink()  # replaced by mobius's graph (and its model.onnx.data)
    build_target_graph(args.bundle / target.directory, out_target, aux)
    print(json.dumps({"bundle": str(args.out), "target": str(out_target / "model.onnx"),
                      "aux_layers": list(aux)}))


if __name__ == "__main__":
    main()
