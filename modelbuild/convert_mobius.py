"""Rebuild a bundle's target with mobius-onnx, keeping everything else:
``python -m modelbuild.convert_mobius --bundle models --out /tmp/mobius_bundle``.

Dev-only, in its own venv (``modelbuild/convert-requirements.txt``: mobius-onnx needs
torch and pulls plain onnxruntime). It is the path a user takes with their own Hugging
Face checkpoint, run on the bundle's target so every mode can be checked against it
(checked: every mode's greedy output on 10 held-out prompts equals target-only's, with
the bundle's τ):

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

import onnx
from onnx import helper

from engine.model.manifest import BundleManifest

from .weights_file import aux_output_name


def mobius_target(target_dir: Path, out_dir: Path, aux_layers: tuple[int, ...]) -> Path:
    """Build ``out_dir/model.onnx`` with mobius and give it the bundle's output names."""
    import mobius  # dev-only: pulls torch

    package = mobius.build(str(target_dir), dtype="f32", output_layer_indices=[j - 1 for j in aux_layers])
    package.save(str(out_dir))
    path = out_dir / "model.onnx"
    adopt_bundle_names(path, aux_layers)
    return path


def adopt_bundle_names(path: Path, aux_layers: tuple[int, ...]) -> None:
    """Rename a mobius target's outputs to the bundle's in place: ``hidden_states.{j-1}``
    becomes ``aux_hidden.{j}``, and the final norm's output (the LM head's input) is
    exposed as ``hidden_states``."""
    model = onnx.load(str(path), load_external_data=False)  # the weights stay where they are
    graph = model.graph
    producers = {output: node for node in graph.node for output in node.output}
    final_norm = producers["logits"].input[0]  # logits = MatMul(final norm output, lm_head)
    renames = {f"hidden_states.{j - 1}": aux_output_name(j) for j in aux_layers}
    for value in graph.output:
        value.name = renames.get(value.name, value.name)
    for node in graph.node:
        node.output[:] = [renames.get(o, o) for o in node.output]
        node.input[:] = [renames.get(i, i) for i in node.input]
    graph.node.append(helper.make_node("Identity", [final_norm], ["hidden_states"], name="final_hidden_out"))
    logits = next(o for o in graph.output if o.name == "logits")
    hidden = helper.make_tensor_value_info("hidden_states", logits.type.tensor_type.elem_type,
                                           ["batch", "sequence_len", None])
    graph.output.append(hidden)
    onnx.save(model, str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bundle", type=Path, default=Path("models"))
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
    mobius_target(args.bundle / target.directory, out_target, aux)
    print(json.dumps({"bundle": str(args.out), "target": str(out_target / "model.onnx"),
                      "aux_layers": list(aux)}))


if __name__ == "__main__":
    main()
