"""Build stage for the proposer heads: train against the target, export, check, describe."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from specserve.engine.model.manifest import HeadEntry, TrainingRecord

from .export import WEIGHTS_FILE, aux_output_name, save_checkpoint
from .heads import (Eagle3Head, MtpHead, SharedKvAssistant, export_head, heldout_agreement, train_heads)
from .int8_graph import INT8_HEADS, write_int8_graph
from .llama import LlamaForCausalLM
from .train import TokenWindows

DRAFT_VOCAB = 1024
HEAD_STEPS = 400
HEAD_LR = 2e-3


def draft_vocabulary(train_tokens: np.ndarray, vocab: int, size: int) -> np.ndarray:
    """The ``size`` most frequent target ids (ascending): EAGLE-3's reduced vocabulary."""
    counts = np.bincount(train_tokens, minlength=vocab)
    return np.sort(np.argsort(-counts, kind="stable")[:size])


def _check_export(kind: str, head: torch.nn.Module, onnx_path: Path, hidden: int, kv_heads: int, head_dim: int) -> float:
    """Same random inputs through torch and onnxruntime; returns max |difference|."""
    gen = torch.Generator().manual_seed(0)
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    s, p = 3, 4
    with torch.no_grad():
        if kind == "shared_kv":
            kv = [(torch.randn(1, kv_heads, p, head_dim, generator=gen),) * 2 for _ in head.groups]
            e = torch.randn(1, s, 2 * hidden, generator=gen)
            pos = torch.full((1, s), p - 1)
            ref = head(e, pos, torch.zeros(1, s, p), kv)
            feed = {"inputs_embeds": e.numpy(), "position_ids": pos.numpy(), "attention_mask": np.ones((1, p), np.int64)}
            for g, (k, v) in zip(head.groups, kv):
                feed[f"shared_kv.{g}.key"], feed[f"shared_kv.{g}.value"] = k.numpy(), v.numpy()
        else:
            e, r = torch.randn(1, s, hidden, generator=gen), torch.randn(1, s, hidden, generator=gen)
            mask, pos = torch.ones(1, p + s, dtype=torch.long), torch.arange(p, p + s)[None]
            pk, pv = torch.randn(1, kv_heads, p, head_dim, generator=gen), torch.randn(1, kv_heads, p, head_dim, generator=gen)
            feed = {"inputs_embeds": e.numpy(), "attention_mask": mask.numpy(), "position_ids": pos.numpy(),
                    "past_key_values.0.key": pk.numpy(), "past_key_values.0.value": pv.numpy()}
            if kind == "mtp":
                ref = head(e, r, mask, pos, pk, pv)
                feed["hidden_states"] = r.numpy()
            else:
                f = torch.randn(1, s, 3 * hidden, generator=gen)
                ref = head(e, f, r, mask, pos, pk, pv)
                feed["fused_hidden"], feed["recycled_hidden"] = f.numpy(), r.numpy()
    outs = session.run(None, feed)
    worst = max(float(np.abs(o - t.numpy()).max()) for o, t in zip(outs, ref))
    if worst > 1e-3:
        raise RuntimeError(f"{kind} head export disagrees with torch: max |d| = {worst}")
    return worst


def build_heads(out: Path, target: LlamaForCausalLM, train_tokens: np.ndarray, heldout_tokens: np.ndarray,
                aux: tuple[int, int, int], seed: int, batch_size: int, seq_len: int,
                steps: int = HEAD_STEPS) -> dict[str, HeadEntry]:
    shape = target.shape
    groups = {"middle": shape.num_layers // 2 - 1, "last": shape.num_layers - 1}
    draft_ids_np = draft_vocabulary(train_tokens, shape.vocab_size, DRAFT_VOCAB)
    draft_ids = torch.from_numpy(draft_ids_np.astype(np.int64))
    torch.manual_seed(seed)
    heads = {"mtp": MtpHead(shape), "eagle3": Eagle3Head(shape, DRAFT_VOCAB),
             "shared_kv": SharedKvAssistant(shape, groups)}
    for p in target.parameters():
        p.requires_grad_(False)
    kv_layers = list(groups.values())
    t0 = time.time()
    train_heads(heads, target, TokenWindows(train_tokens, seed), steps, batch_size, seq_len, HEAD_LR, aux,
                kv_layers, draft_ids)
    seconds = time.time() - t0
    for head in heads.values():
        with torch.no_grad():
            for param in head.parameters():
                param.copy_(param.half().float())
    agreement = heldout_agreement(heads, target, heldout_tokens, seq_len, aux, kv_layers, draft_ids)
    record = TrainingRecord(seed=seed, steps=steps, batch_size=batch_size, seq_len=seq_len, learning_rate=HEAD_LR,
                            objective=f"KL(target || head) over {len(agreement['mtp'])} unrolled draft steps",
                            tokens_seen=steps * batch_size * seq_len, seconds=round(seconds, 1))
    final = ["hidden_states"]
    fused = [aux_output_name(j) for j in aux]
    describe = {
        "mtp": dict(target_hidden_inputs={"hidden_states": final}, uses_arrays=["embed_tokens", "lm_head"]),
        "eagle3": dict(target_hidden_inputs={"fused_hidden": fused, "recycled_hidden": final},
                       uses_arrays=["embed_tokens"], draft_vocab_size=DRAFT_VOCAB, d2t="d2t.npy"),
        "shared_kv": dict(target_hidden_inputs={"inputs_embeds": final}, uses_arrays=["embed_tokens"],
                          shared_kv_groups=groups),
    }
    entries = {}
    for kind, head in heads.items():
        directory = out / "heads" / kind
        directory.mkdir(parents=True, exist_ok=True)
        config = {"head_type": kind, "hidden_size": shape.hidden_size, "num_attention_heads": shape.num_heads,
                  "num_key_value_heads": shape.num_kv_heads, "head_dim": shape.head_dim,
                  "intermediate_size": shape.intermediate_size, "vocab_size": shape.vocab_size,
                  "rope_theta": shape.rope_theta, "rms_norm_eps": shape.rms_norm_eps,
                  "target": "../../target", **{k: v for k, v in describe[kind].items() if k != "uses_arrays"}}
        save_checkpoint(head, directory, config)
        export_head(kind, head, shape, directory)
        if kind == "eagle3":
            np.save(directory / "d2t.npy", (draft_ids_np - np.arange(DRAFT_VOCAB)).astype(np.int64))
        diff = _check_export(kind, head, directory / "model.onnx", shape.hidden_size, shape.num_kv_heads, shape.head_dim)
        if kind in INT8_HEADS:
            write_int8_graph(directory)
        print(f"  {kind}: held-out top-1 agreement per draft step {agreement[kind]} "
              f"(onnxruntime vs torch max |d| = {diff:.1e})")
        entries[kind] = HeadEntry(kind=kind, directory=f"heads/{kind}", onnx="model.onnx", weights=WEIGHTS_FILE,
                                  config="config.json", parameters=sum(p.numel() for p in head.parameters()),
                                  heldout_top1_agreement=agreement[kind], training=record, **describe[kind])
    return entries
