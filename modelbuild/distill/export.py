"""Step 4: a trained head into the bundle: ``heads/<kind>/`` (the graph with the I/O of
``head-contracts.md``, float16 weights, its config, ``d2t.npy`` for EAGLE-3, the int8
int8 graph where the mode has one), checked against torch, and recorded in the manifest."""
from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from specserve.engine.model.manifest import BundleManifest, HeadEntry, TrainingRecord

from ..export import WEIGHTS_FILE, save_checkpoint
from ..head_stage import _check_export
from ..heads import export_head
from ..int8_graph import INT8_HEADS, write_int8_graph
from ..llama import LlamaShape


def _config(shape: LlamaShape, kind: str, extra: dict) -> dict:
    return {"head_type": kind, "hidden_size": shape.hidden_size, "num_attention_heads": shape.num_heads,
            "num_key_value_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
            "intermediate_size": shape.intermediate_size, "vocab_size": shape.vocab_size,
            "rope_theta": shape.rope_theta, "rms_norm_eps": shape.rms_norm_eps, "target": "../../target", **extra}


def data_hash(data: Path) -> str:
    """What the head learnt from, as the manifest records it: the lines of
    ``responses.jsonl`` and ``texts.jsonl`` whose sequences were extracted for training,
    in job order."""
    used = {s["job"] for s in json.loads((data / "features/train/index.json").read_text())["sequences"]}
    lines = sorted(line for name in ("responses.jsonl", "texts.jsonl") if (data / name).is_file()
                   for line in (data / name).read_text().splitlines()
                   if line.strip() and json.loads(line)["job"] in used)
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def export_head_into(kind: str, trainer, bundle: Path, state: dict, args: argparse.Namespace) -> HeadEntry:
    """Write ``trainer``'s head as ``bundle/heads/<kind>`` and add it to the manifest."""
    head, shape, draft_ids = trainer.head, trainer.shape, trainer.draft_ids
    manifest = BundleManifest.load(bundle)
    outputs = manifest.models["target"].hidden_outputs
    final = [outputs.final]
    groups: dict[str, int] = {}
    if kind == "eagle3":
        wiring = {"fused_hidden": [outputs.low, outputs.mid, outputs.high], "recycled_hidden": final}
        uses, extra = ["embed_tokens"], {"hidden_chain": "fused_every_step"}
    elif kind == "mtp":  # read through the target's LM head, restricted to the draft vocabulary
        wiring, uses, extra = {"hidden_states": final}, ["embed_tokens", "lm_head"], {}
    else:  # shared_kv
        groups = dict(head.groups)
        wiring, uses = {"inputs_embeds": final}, ["embed_tokens"]
        extra = {"shared_kv_groups": groups, "draft_feed": "hf_assisted"}
    directory = bundle / "heads" / kind
    directory.mkdir(parents=True, exist_ok=True)
    with torch.no_grad():  # the graph computes with the float16 weights it is shipped with
        for param in head.parameters():
            param.copy_(param.half().float())
    config = _config(shape, kind, {"target_hidden_inputs": wiring, "draft_vocab_size": len(draft_ids),
                                   "d2t": "d2t.npy", **extra})
    save_checkpoint(head, directory, config, int8_matrices=kind in INT8_HEADS)  # served as int8 on CPU anyway
    export_head(kind, head, shape, directory)
    np.save(directory / "d2t.npy", (draft_ids - np.arange(len(draft_ids))).astype(np.int64))
    difference = _check_export(kind, head, directory / "model.onnx", shape.hidden_size, shape.num_kv_heads,
                               shape.head_dim)
    if kind in INT8_HEADS:
        write_int8_graph(directory)
    record = TrainingRecord(
        seed=args.seed, steps=state["update"], batch_size=args.batch, seq_len=args.steps, learning_rate=args.lr,
        objective=(f"soft cross-entropy to the target's top-16 next-token distribution over {len(draft_ids)} draft "
                   f"ids, {args.steps} draft steps unrolled as served (EAGLE-3's training-time test), on the "
                   f"target's own answers and offline text (sha256 of the training records {data_hash(args.data)})"),
        tokens_seen=state["update"] * args.batch * args.steps, seconds=round(state["seconds"], 1))
    entry = HeadEntry(kind=kind, directory=f"heads/{kind}", onnx="model.onnx", weights=WEIGHTS_FILE,
                      config="config.json", parameters=sum(p.numel() for p in head.parameters()),
                      target_hidden_inputs=wiring, shared_kv_groups=groups, draft_vocab_size=len(draft_ids),
                      d2t="d2t.npy", uses_arrays=uses,
                      heldout_top1_agreement=state["heldout"]["top1_per_step"], training=record)
    manifest.model_copy(update={"heads": {**manifest.heads, kind: entry}}).save(bundle)
    print(f"{kind} head written to {directory} (onnxruntime vs torch max |d| = {difference:.1e})", flush=True)
    return entry
