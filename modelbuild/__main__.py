"""Rebuild ``models/`` from scratch, offline: ``python -m specserve.modelbuild [--out models]``.

Stages: corpus -> BPE tokenizer -> target (next-token CE) -> draft (distilled from the
target) -> float16 checkpoints + ONNX export (traced, checked against torch, then rewritten as the
fused graph of ``fused_graph.py`` and checked against the traced one) -> embedding and
LM-head arrays -> cost measurement -> manifest. Seeds are fixed; step counts are fixed.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch
from safetensors.torch import load_file

from specserve.engine.model.manifest import (Architecture, ArrayEntry, BundleManifest, CorpusRecord, HiddenOutputs,
                             ModelEntry, TrainingRecord)

from .corpus import load_corpus
from .export import WEIGHTS_FILE, aux_output_name, export_onnx, save_checkpoint
from .fused_graph import fuse_in_place
from .llama import LlamaForCausalLM, LlamaShape
from .head_stage import HEAD_STEPS, build_heads
from .prompts import main as write_heldout_prompts
from tokenizers import Tokenizer
from .tokenizer import EOS_TOKEN, train_tokenizer
from .train import TokenWindows, TrainPlan, distill_draft, heldout_loss, train_target, unigram_cross_entropy

VOCAB = 4096
CONTEXT = 512
TARGET_SHAPE = LlamaShape(VOCAB, 256, 16, 8, 2, 640, max_position_embeddings=CONTEXT)
DRAFT_SHAPE = LlamaShape(VOCAB, 128, 2, 4, 2, 384, max_position_embeddings=CONTEXT)
# vLLM's EAGLE-3 default auxiliary layers: (2, L/2, L-3).
TARGET_AUX = (2, TARGET_SHAPE.num_layers // 2, TARGET_SHAPE.num_layers - 3)
SEED = 1234
SEQ_LEN = CONTEXT // 2  # trained mostly at 256, the last steps at 512 (TrainPlan.window)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("models/fixture"))
    parser.add_argument("--target-steps", type=int, default=1000)
    parser.add_argument("--draft-steps", type=int, default=450)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--head-steps", type=int, default=HEAD_STEPS)
    parser.add_argument("--heads-only", action="store_true",
                        help="keep tokenizer, target and draft in --out; (re)train only the proposer heads")
    return parser.parse_args()


def encode_files(tokenizer, files, eos_id: int) -> np.ndarray:
    ids: list[int] = []
    for item in files:
        ids.extend(tokenizer.encode(item.text).ids)
        ids.append(eos_id)
    return np.asarray(ids, dtype=np.int32)


def round_to_fp16(model: torch.nn.Module) -> None:
    """Make the torch weights exactly what the float16 checkpoint stores."""
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.half().float())


def check_export(model: LlamaForCausalLM, onnx_path: Path, tokens: np.ndarray) -> float:
    """Prefill + 8 cached steps in onnxruntime vs. one uncached torch pass; returns max |dlogits|."""
    shape = model.shape
    session = ort.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"])
    seq = tokens[:108].astype(np.int64)[None]
    with torch.no_grad():
        reference = model(torch.from_numpy(seq))[0][0].numpy()
    past = {f"past_key_values.{i}.{k}": np.zeros((1, shape.num_kv_heads, 0, shape.head_dim), np.float32)
            for i in range(shape.num_layers) for k in ("key", "value")}
    worst, start = 0.0, 0
    for end in [100] + list(range(101, 109)):
        feed = {"input_ids": seq[:, start:end], "attention_mask": np.ones((1, end), np.int64),
                "position_ids": np.arange(start, end)[None], **past}
        outputs = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
        worst = max(worst, float(np.abs(outputs["logits"][0] - reference[start:end]).max()))
        past = {name: outputs[name.replace("past_key_values", "present")] for name in past}
        start = end
    if worst > 1e-3:
        raise RuntimeError(f"ONNX export of {onnx_path} disagrees with torch: max |dlogits| = {worst}")
    return worst


def save_model(model: LlamaForCausalLM, out_dir: Path, tokenizer_path: Path, eos_id: int,
               aux: tuple[int, ...], tokens: np.ndarray) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, out_dir, model.shape.hf_config(bos_id=eos_id, eos_id=eos_id))
    onnx_path = export_onnx(model, out_dir, aux)
    shutil.copy(tokenizer_path, out_dir / "tokenizer.json")
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": EOS_TOKEN, "bos_token": EOS_TOKEN,
        "model_max_length": model.shape.max_position_embeddings}, indent=2) + "\n")
    diff = check_export(model, onnx_path, tokens)
    print(f"  exported {onnx_path} (onnxruntime vs torch: max |dlogits| = {diff:.2e})")
    # The traced graph is the reference; the served one is the fused graph, checked against it.
    fused_diff = fuse_in_place(out_dir, aux)
    print(f"  fused graph written over it (max |diff| vs the traced graph = {fused_diff:.2e})")


def load_model(shape: LlamaShape, directory: Path) -> LlamaForCausalLM:
    model = LlamaForCausalLM(shape)
    state = {k: v.float() for k, v in load_file(str(directory / WEIGHTS_FILE)).items()}
    model.load_state_dict(state, strict=False)
    return model.eval()


def measure_step_ms(onnx_path: Path, shape: LlamaShape, past_len: int = 256, runs: int = 200) -> float:
    """Median latency of a 1-token decode step at the given past length (2 threads)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = 2
    session = ort.InferenceSession(str(onnx_path), options, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    feed = {"input_ids": np.array([[5]]), "attention_mask": np.ones((1, past_len + 1), np.int64),
            "position_ids": np.array([[past_len]])}
    for i in range(shape.num_layers):
        for kind in ("key", "value"):
            feed[f"past_key_values.{i}.{kind}"] = rng.standard_normal(
                (1, shape.num_kv_heads, past_len, shape.head_dim)).astype(np.float32)
    for _ in range(10):
        session.run(None, feed)
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        session.run(None, feed)
        times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1000)


def architecture(shape: LlamaShape) -> Architecture:
    return Architecture(vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, num_layers=shape.num_layers,
                        num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                        intermediate_size=shape.intermediate_size,
                        max_position_embeddings=shape.max_position_embeddings,
                        rope_theta=shape.rope_theta, rms_norm_eps=shape.rms_norm_eps)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()

    print("[1/7] corpus")
    corpus = load_corpus()
    print(f"  {len(corpus.train)} train files, {len(corpus.heldout)} held-out files (Python {corpus.python_version})")
    if args.heads_only:
        rebuild_heads(out, corpus, args)
        return

    print("[2/7] tokenizer")
    tokenizer = train_tokenizer([f.text for f in corpus.train], VOCAB)
    tokenizer_path = out / "tokenizer.json"
    tokenizer.save(str(tokenizer_path))
    eos_id = tokenizer.token_to_id(EOS_TOKEN)
    train_tokens = encode_files(tokenizer, corpus.train, eos_id)
    heldout_tokens = encode_files(tokenizer, corpus.heldout, eos_id)
    unigram = unigram_cross_entropy(train_tokens, heldout_tokens, VOCAB)
    print(f"  {len(train_tokens):,} train tokens, {len(heldout_tokens):,} held-out tokens; "
          f"unigram cross-entropy on held-out = {unigram:.3f} nats")

    entries: dict[str, ModelEntry] = {}

    print("[3/7] target")
    target_plan = TrainPlan(steps=args.target_steps, batch_size=args.batch_size, seq_len=SEQ_LEN, lr=1.5e-3)
    torch.manual_seed(SEED)
    target = LlamaForCausalLM(TARGET_SHAPE)
    t0 = time.time()
    train_target(target, target_plan, TokenWindows(train_tokens, SEED))
    round_to_fp16(target)
    target_record = TrainingRecord(seed=SEED, steps=target_plan.steps, batch_size=target_plan.batch_size,
                                   seq_len=SEQ_LEN, learning_rate=target_plan.lr, objective="next-token cross-entropy",
                                   tokens_seen=target_plan.steps * target_plan.batch_size * SEQ_LEN,
                                   seconds=round(time.time() - t0, 1))
    save_model(target, out / "target", tokenizer_path, eos_id, TARGET_AUX, heldout_tokens)
    target_loss = heldout_loss(target, heldout_tokens, SEQ_LEN)
    print(f"  target held-out loss = {target_loss:.3f} nats (unigram {unigram:.3f})")
    entries["target"] = ModelEntry(
        role="target", directory="target", onnx="model.onnx", weights=WEIGHTS_FILE, config="config.json",
        tokenizer="tokenizer.json", parameters=sum(p.numel() for p in target.parameters()),
        architecture=architecture(TARGET_SHAPE),
        hidden_outputs=HiddenOutputs(final="hidden_states", low=aux_output_name(TARGET_AUX[0]),
                                     mid=aux_output_name(TARGET_AUX[1]), high=aux_output_name(TARGET_AUX[2]),
                                     layer_indices=TARGET_AUX),
        heldout_loss_nats=round(target_loss, 4), training=target_record)

    print("[4/7] draft (distilled from the target)")
    torch.manual_seed(SEED + 1)
    draft = LlamaForCausalLM(DRAFT_SHAPE)
    draft_plan = TrainPlan(steps=args.draft_steps, batch_size=args.batch_size, seq_len=SEQ_LEN, lr=3e-3)
    t0 = time.time()
    distill_draft(draft, target, draft_plan, TokenWindows(train_tokens, SEED + 1))
    round_to_fp16(draft)
    draft_seconds = time.time() - t0
    save_model(draft, out / "draft", tokenizer_path, eos_id, (), heldout_tokens)
    draft_loss = heldout_loss(draft, heldout_tokens, SEQ_LEN)
    print(f"  draft held-out loss = {draft_loss:.3f} nats")
    entries["draft"] = ModelEntry(
        role="draft", directory="draft", onnx="model.onnx", weights=WEIGHTS_FILE, config="config.json",
        tokenizer="tokenizer.json", parameters=sum(p.numel() for p in draft.parameters()),
        architecture=architecture(DRAFT_SHAPE), hidden_outputs=HiddenOutputs(final="hidden_states"),
        heldout_loss_nats=round(draft_loss, 4),
        training=TrainingRecord(seed=SEED + 1, steps=draft_plan.steps, batch_size=draft_plan.batch_size,
                                seq_len=SEQ_LEN, learning_rate=draft_plan.lr,
                                objective="0.7 KL(target || draft) + 0.3 next-token cross-entropy",
                                tokens_seen=draft_plan.steps * draft_plan.batch_size * SEQ_LEN,
                                seconds=round(draft_seconds, 1)))

    print("[5/7] embedding and LM-head arrays")
    arrays = {}
    for key, tensor, meaning in (
        ("embed_tokens", target.model.embed_tokens.weight, "target input embedding table, row t = embedding of token t"),
        ("lm_head", target.lm_head.weight, "target LM head, logits = hidden @ lm_head.T"),
    ):
        path = out / "target" / f"{key}.npy"
        np.save(path, tensor.detach().numpy().astype(np.float16))
        arrays[key] = ArrayEntry(file=f"target/{key}.npy", shape=tuple(tensor.shape), dtype="float16", meaning=meaning)

    print("[6/7] proposer heads (self-distilled from the target)")
    heads = build_heads(out, target, train_tokens, heldout_tokens, TARGET_AUX, SEED + 2, args.batch_size, SEQ_LEN,
                        args.head_steps)

    print("[7/7] cost of a target step vs. a one-layer head step")
    with tempfile.TemporaryDirectory() as tmp:
        head_shape = LlamaShape(VOCAB, TARGET_SHAPE.hidden_size, 1, TARGET_SHAPE.num_heads,
                                TARGET_SHAPE.num_kv_heads, TARGET_SHAPE.intermediate_size, CONTEXT)
        head = LlamaForCausalLM(head_shape).eval()
        save_checkpoint(head, Path(tmp), head_shape.hf_config(eos_id, eos_id))
        head_ms = measure_step_ms(export_onnx(head, Path(tmp)), head_shape)
    target_ms = measure_step_ms(out / "target" / "model.onnx", TARGET_SHAPE)
    print(f"  target step {target_ms:.3f} ms, one-layer head step {head_ms:.3f} ms: ratio {target_ms / head_ms:.1f}x")

    tokenizer_path.unlink()  # each model directory carries its own copy
    manifest = BundleManifest(
        tokenizer="target/tokenizer.json", eos_token=EOS_TOKEN, eos_token_id=eos_id,
        corpus=CorpusRecord(**corpus.describe(), train_tokens=len(train_tokens), heldout_tokens=len(heldout_tokens),
                            unigram_cross_entropy_nats=round(unigram, 4)),
        models=entries, heads=heads, arrays=arrays,
        measurements={"target_step_ms_past256": round(target_ms, 3), "one_layer_head_step_ms_past256": round(head_ms, 3),
                      "target_to_head_step_ratio": round(target_ms / head_ms, 2)})
    manifest.save(out)
    write_heldout_prompts()
    print(f"done in {time.time() - started:.0f} s; manifest at {out / 'manifest.json'}")


def rebuild_heads(out: Path, corpus, args: argparse.Namespace) -> None:
    """Retrain only the heads against the target already in ``out`` and update the manifest."""
    manifest = BundleManifest.load(out)
    tokenizer = Tokenizer.from_file(str(out / manifest.tokenizer))
    train_tokens = encode_files(tokenizer, corpus.train, manifest.eos_token_id)
    heldout_tokens = encode_files(tokenizer, corpus.heldout, manifest.eos_token_id)
    target = load_model(TARGET_SHAPE, out / "target")
    print("[6/7] proposer heads (self-distilled from the target)")
    heads = build_heads(out, target, train_tokens, heldout_tokens, TARGET_AUX, SEED + 2, args.batch_size, SEQ_LEN,
                        args.head_steps)
    manifest.model_copy(update={"heads": heads}).save(out)
    print(f"manifest updated: {out / 'manifest.json'}")


if __name__ == "__main__":
    sys.exit(main())
