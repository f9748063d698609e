"""Hugging Face checkpoints or a Llama GGUF -> a specserve bundle (``manifest.json`` + ONNX graphs):

    python -m specserve.modelbuild.convert --target HF_DIR --out BUNDLE \\
        [--eagle3 DIR] [--mtp DIR] [--assistant DIR] [--draft HF_DIR] [--aux-layers 2,16,29]
    python -m specserve.modelbuild.convert --gguf FILE --out BUNDLE [--format fp32] [--step-format q4_1]

A GGUF converts without torch (``modelbuild.from_gguf``: numpy, gguf, onnx), in
specserve's own ``.venv``; the Hugging Face path needs the ``convert`` extra.

Runs in ``.venv-convert`` (``bash scripts/install_convert.sh``) or wherever the
``convert`` extra is installed: mobius-onnx needs torch (install ``torch==2.13.0``, the
CPU build, first), so it is never a runtime dependency.
Then ``python -m specserve.engine generate --model BUNDLE --speculative eagle3 ...`` runs it
in-process and ``bash scripts/quickstart.sh --model-dir BUNDLE`` serves it (or set
``model_dir`` in ``serve_config.yaml``, with ``load:`` naming only the kinds the bundle
has, and ``serve run serve_config.yaml``).

- ``--eagle3``: an EAGLE-3 head, SafeAILab/EAGLE (``LlamaForCausalLMEagle3``) or
  speculators (``Eagle3Speculator``) layout. Its aux layers are the config's
  ``eagle_aux_hidden_state_layer_ids`` if it names them, else ``--aux-layers``, else
  vLLM's default (2, N // 2, N - 3); all in vLLM's entering-layer indexing.
- ``--mtp``: a Qwen3.5 / Qwen3.6 / Qwen3-Next MTP head (``mtp.*`` keys), dense or
  mixture-of-experts (experts stored one by one or packed); these checkpoints carry it
  in their own safetensors, so this may be the target's directory.
  DeepSeek-V3 / GLM-4.5 MTP (``eh_proj``/``enorm``/``hnorm``) is not converted: mobius
  has no builder for it.
- ``--assistant``: a Gemma-4 ``*-assistant`` checkpoint (``Gemma4AssistantForCausalLM``),
  served as ``shared_kv``.
- ``--draft``: a small LM with the target's tokenizer, converted like the target.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Callable

from specserve.engine.model.manifest import ArrayEntry, BundleManifest, ConversionRecord, HeadEntry, HiddenOutputs, ModelEntry

from .eagle3 import Eagle3Checkpoint, convert_eagle3
from .target import (FINAL_HIDDEN, ConvertedTarget, aux_output_name, convert_target, default_aux_layers,
                     graph_parameters)
from .target import architecture_of as read_architecture


def tool_version() -> str:
    from importlib.metadata import version

    return f"mobius-onnx {version('mobius-onnx')}"


def _record(source: Path, source_format: str, notes: str = "") -> ConversionRecord:
    return ConversionRecord(source=str(source.resolve()), source_format=source_format, tool=tool_version(), notes=notes)


def _write_head_config(directory: Path, facts: dict, hidden_inputs: dict[str, list[str]]) -> None:
    config = {**facts, "target": "../../target", "target_hidden_inputs": hidden_inputs}
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def _model_entry(role: str, directory: str, target: ConvertedTarget, source: Path, hidden: HiddenOutputs) -> ModelEntry:
    config = json.loads((target.directory / "config.json").read_text())
    return ModelEntry(role=role, directory=directory, onnx="model.onnx", weights="model.onnx.data",
                      config="config.json", tokenizer="tokenizer.json", parameters=target.parameters,
                      architecture=target.architecture, hidden_outputs=hidden,
                      converted=_record(source, config.get("model_type", "unknown")))


def _eos(target_dir: Path) -> tuple[str, int]:
    """The EOS token by name and id, from the tokenizer's own files."""
    from specserve.engine.model.tokenizer import TextTokenizer

    tokenizer = TextTokenizer(target_dir)
    config = json.loads((target_dir / "config.json").read_text())
    eos_id = tokenizer.eos_token_id
    if eos_id is None:
        eos = config.get("eos_token_id")
        eos_id = eos[0] if isinstance(eos, list) else eos
    if eos_id is None:
        raise ValueError(f"{target_dir}: neither tokenizer_config.json nor config.json names an EOS token")
    return tokenizer.token_text(int(eos_id)), int(eos_id)


def to_stderr(line: str) -> None:
    """Progress goes to stderr: stdout keeps the result's one JSON line."""
    print(line, file=sys.stderr, flush=True)


def convert(args: argparse.Namespace, progress: Callable[[str], None] = to_stderr) -> BundleManifest:
    out: Path = args.out
    started = time.perf_counter()
    step = lambda what: progress(f"[{time.perf_counter() - started:5.1f} s] {what}")  # noqa: E731
    step(f"converting the target from {args.target}")
    target_config = json.loads((args.target / "config.json").read_text())
    num_layers = read_architecture(target_config).num_layers
    eagle3 = Eagle3Checkpoint.read(args.eagle3) if args.eagle3 else None
    aux: tuple[int, ...] = ()
    if eagle3 is not None:
        aux = eagle3.aux_layers(num_layers) or args.aux_layers or default_aux_layers(num_layers)
    elif args.aux_layers:
        aux = args.aux_layers

    target = convert_target(args.target, out / "target", aux)
    vocab, hidden = target.architecture.vocab_size, target.architecture.hidden_size
    hidden_outputs = HiddenOutputs(final=FINAL_HIDDEN, **(dict(zip(("low", "mid", "high"), map(aux_output_name, aux)),
                                                                layer_indices=aux) if len(aux) == 3 else {}))
    models = {"target": _model_entry("target", "target", target, args.target, hidden_outputs)}
    if args.draft:
        step(f"converting the draft model from {args.draft}")
        draft = convert_target(args.draft, out / "draft", ())
        if draft.architecture.vocab_size != vocab:
            raise SystemExit(f"draft vocabulary {draft.architecture.vocab_size} != target's {vocab}")
        models["draft"] = _model_entry("draft", "draft", draft, args.draft, HiddenOutputs(final=FINAL_HIDDEN))

    heads: dict[str, HeadEntry] = {}

    def add_head(kind: str, source: Path, facts: dict, wiring: dict[str, list[str]], uses: list[str],
                 groups: dict[str, int] | None = None) -> None:
        directory = out / "heads" / kind
        facts = {**facts, "head_type": kind, **({"shared_kv_groups": groups} if groups else {})}
        _write_head_config(directory, facts, wiring)
        heads[kind] = HeadEntry(
            kind=kind, directory=f"heads/{kind}", onnx="model.onnx", weights="model.onnx.data", config="config.json",
            parameters=graph_parameters(directory / "model.onnx"), target_hidden_inputs=wiring, shared_kv_groups=groups or {},
            draft_vocab_size=facts.get("draft_vocab_size"), d2t=facts.get("d2t"), uses_arrays=uses,
            converted=_record(source, facts.get("source_format", kind)))

    if eagle3 is not None:
        step(f"converting the EAGLE-3 head from {args.eagle3}")
        facts = convert_eagle3(eagle3, out / "heads/eagle3", hidden, vocab)
        add_head("eagle3", args.eagle3, facts, {"fused_hidden": [aux_output_name(j) for j in aux]},
                 ["embed_tokens"])
    if args.mtp:
        from .qwen35_mtp import build_qwen35_mtp

        step(f"converting the MTP head from {args.mtp}")
        facts = build_qwen35_mtp(args.mtp, out / "heads/mtp")
        _check_width("MTP head", facts["hidden_size"], hidden)
        add_head("mtp", args.mtp, facts, {"hidden_states": [FINAL_HIDDEN]}, ["embed_tokens", "lm_head"])
    if args.assistant:
        from .gemma4_assistant import bind_groups, build_gemma4_assistant

        step(f"converting the Gemma-4 assistant from {args.assistant}")
        # The feed published assistants are trained for (transformers' assisted generation).
        facts = {**build_gemma4_assistant(args.assistant, out / "heads/shared_kv"), "draft_feed": "hf_assisted"}
        _check_width("Gemma-4 assistant", facts["backbone_hidden_size"], hidden)
        text = target_config.get("text_config", target_config)
        groups = bind_groups(text.get("layer_types"), num_layers, list(facts["groups"]),
                             num_kv_shared_layers=text.get("num_kv_shared_layers") or 0)
        for group, geometry in facts["groups"].items():
            layer = _kv_geometry(target.directory, groups[group])
            if (geometry["num_kv_heads"], geometry["head_dim"]) != layer:
                raise SystemExit(f"assistant group '{group}' reads {geometry} but target layer {groups[group]} has "
                                 f"{layer[0]} KV heads of dim {layer[1]}")
        add_head("shared_kv", args.assistant, facts, {"inputs_embeds": [FINAL_HIDDEN]}, ["embed_tokens"], groups)

    eos_token, eos_id = _eos(target.directory)
    arrays = {name: ArrayEntry(file=f"target/{name}.npy", shape=(vocab, hidden), dtype="float32", meaning=meaning)
              for name, meaning in (("embed_tokens", "target input embedding table, row t = embedding of token t"),
                                    ("lm_head", "target LM head, logits = hidden @ lm_head.T"))}
    manifest = BundleManifest(tokenizer="target/tokenizer.json", eos_token=eos_token, eos_token_id=eos_id,
                              models=models, heads=heads, arrays=arrays)
    manifest.save(out)
    return manifest


def _kv_geometry(target_dir: Path, layer: int) -> tuple[int, int]:
    """(KV heads, head dim) of one target layer, read off its graph's past input: layers
    of one target may differ (Gemma's full and sliding layers)."""
    import onnx

    graph = onnx.load(str(target_dir / "model.onnx"), load_external_data=False).graph
    past = next(i for i in graph.input if i.name == f"past_key_values.{layer}.key")
    dims = past.type.tensor_type.shape.dim
    return dims[1].dim_value, dims[3].dim_value


def _check_width(what: str, width: int, target_hidden: int) -> None:
    if width != target_hidden:
        raise SystemExit(f"{what} reads target states of width {width}, the target's are {target_hidden}")


def _layers(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def main(argv: list[str] | None = None) -> None:
    os.environ.setdefault("TQDM_DISABLE", "1")  # mobius prints a progress bar per tensor
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--target", type=Path, help="Hugging Face directory of the target")
    source.add_argument("--gguf", type=Path, help="a Llama GGUF file (llama.cpp's format): the target, no heads")
    parser.add_argument("--out", type=Path, required=True, help="new directory for the bundle")
    parser.add_argument("--eagle3", type=Path, help="EAGLE-3 head (SafeAILab or speculators layout)")
    parser.add_argument("--mtp", type=Path, help="Qwen3.5 / Qwen3.6 / Qwen3-Next MTP head (mtp.* keys)")
    parser.add_argument("--assistant", type=Path, help="Gemma-4 assistant checkpoint (served as shared_kv)")
    parser.add_argument("--draft", type=Path, help="a small draft LM sharing the target's tokenizer")
    parser.add_argument("--aux-layers", type=_layers, help="EAGLE-3 aux layers j (stream entering layer j), "
                        "when the head's config does not name them; default 2,N/2,N-3")
    parser.add_argument("--format", default="fp32", help="--gguf: weight format of every call (fp32, q4_1, int8)")
    parser.add_argument("--step-format", default="q4_1", help="--gguf: weight format of single-token calls at "
                        "batch 1 ('none': the same as --format)")
    parser.add_argument("--no-fast", action="store_true", help="--gguf: write the exact format only, not the fast "
                        "one (int8 activations, row-invariant graphs; docs/models.md)")
    args = parser.parse_args(argv)
    if args.out.exists():
        raise SystemExit(f"{args.out} exists; choose a new directory")
    if args.gguf and any((args.eagle3, args.mtp, args.assistant, args.draft)):
        raise SystemExit("--gguf converts a target alone; heads come from Hugging Face checkpoints (--target)")
    try:
        if args.gguf:
            from ..from_gguf.convert import convert_gguf

            manifest = convert_gguf(args.gguf, args.out, args.format,
                                    step_format=None if args.step_format == "none" else args.step_format,
                                    fast=not args.no_fast, progress=to_stderr)
        else:
            manifest = convert(args)
    except BaseException:
        shutil.rmtree(args.out, ignore_errors=True)  # a half-written bundle must not look like a bundle
        raise
    print(json.dumps({"bundle": str(args.out), "models": sorted(manifest.models), "heads": sorted(manifest.heads),
                      "aux_layers": list(manifest.models["target"].hidden_outputs.layer_indices or ())}))


if __name__ == "__main__":
    main()
