"""Step 3 (draft model): a small Llama sharing the target's tokenizer, distilled from it.

    .venv-convert/bin/python -m specserve.modelbuild.distill.draft_model [--layers 2] [--minutes 80] [--export BUNDLE]

Its embedding table is the target's, tied and frozen: 49152 x 576 weights that dominate a
small model's size are not trained and not committed (the install step takes them from
the target's GGUF). Its LM head reads the same table's rows of the draft vocabulary only
(8192 ids): a full-vocabulary product costs 6.2 ms a step here, a draft model's layers a
fraction of that (``docs/models.md``). What is trained and committed is its layers and
final norm, in float16 under Hugging Face's names (``draft/model.safetensors``), with its
``config.json`` and ``d2t.npy``; ``modelbuild.from_gguf.draft`` writes its graphs at install.

Teaching: every answer position from the last prompt token on learns the target's top-16
next-token distribution over the draft vocabulary (soft cross-entropy), the prompt
tokens only conditioning. Resumes from ``.cache/distill/ckpt/draft_model.pt``; the run and
its learning rate are sized by ``--minutes`` of training in all (``schedule.py``).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from ..export import save_checkpoint
from ..llama import DecoderLayer, LlamaShape, RMSNorm, causal_bias, inverse_frequencies, rotary
from .features import Features
from .generate import DEFAULT_OUT
from .run import TrainingRun
from .train import DRAFT_VOCAB, draft_vocabulary, target_shape


class DraftLM(nn.Module):
    """``model.layers.*`` and ``model.norm`` of a Llama whose embeddings are someone else's."""

    def __init__(self, shape: LlamaShape, embed: torch.Tensor, draft_ids: torch.Tensor) -> None:
        super().__init__()
        self.shape = shape
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.model.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        for module in self.model.layers.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=0.02)
        self.register_buffer("embed", embed, persistent=False)
        self.register_buffer("head", embed[draft_ids], persistent=False)
        self.register_buffer("inv_freq", inverse_frequencies(shape.head_dim, shape.rope_theta), persistent=False)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits ``[B, T, V_draft]`` of right-padded ``ids`` ``[B, T]``."""
        b, t = ids.shape
        cos, sin = rotary(torch.arange(t).unsqueeze(0).expand(b, t), self.inv_freq)
        bias = causal_bias(mask, 0, t)
        empty = torch.zeros(b, self.shape.num_kv_heads, 0, self.shape.head_dim)
        x = self.embed[ids]
        for layer in self.model.layers:
            x, _, _ = layer(x, cos, sin, bias, empty, empty)
        return self.model.norm(x) @ self.head.T


def sequences(data: Path, split: str) -> list[dict]:
    records = [json.loads(line) for line in (data / "responses.jsonl").read_text().splitlines() if line.strip()]
    return sorted((r for r in records if r["split"] == split), key=lambda r: r["job"])


def batch_of(records: list[dict], features: Features, by_job: dict, t2d: torch.Tensor):
    """Ids ``[B, T]``, mask, soft targets ``[B, T, V_draft]`` and their weights ``[B, T]``."""
    longest = max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in records)
    ids = torch.zeros(len(records), longest, dtype=torch.long)
    mask = torch.zeros(len(records), longest, dtype=torch.long)
    targets = torch.zeros(len(records), longest, DRAFT_VOCAB)
    weight = torch.zeros(len(records), longest)
    for i, record in enumerate(records):
        seq = record["prompt_ids"] + record["response_ids"]
        ids[i, : len(seq)] = torch.tensor(seq)
        mask[i, : len(seq)] = 1
        stored = by_job[record["job"]]
        rows = slice(stored["row"], stored["row"] + stored["rows"])
        draft = t2d[torch.from_numpy(np.asarray(features.top_ids[rows], np.int64))]
        p = torch.where(draft >= 0, torch.from_numpy(np.asarray(features.top_logp[rows], np.float32)).exp(),
                        torch.zeros(()))
        mass = p.sum(-1, keepdim=True)
        first = stored["prompt_len"] - 1
        targets[i, first : first + stored["rows"]].scatter_add_(1, draft.clamp_min(0), p / mass.clamp_min(1e-9))
        weight[i, first : first + stored["rows"]] = (mass[:, 0] > 0).float()
    return ids, mask, targets, weight


@torch.no_grad()
def evaluate(model: DraftLM, records: list[dict], features: Features, t2d: torch.Tensor, steps: int = 6) -> dict:
    """Held-out top-1 agreement with the target's greedy token at every answer position,
    and the expected tokens per round at k = 1..steps if it drafted greedily from each
    position (a draft counts only if every one before it agreed)."""
    by_job = {s["job"]: s for s in features.sequences}
    agree = []
    for start in range(0, len(records), 8):
        chunk = records[start : start + 8]
        ids, mask, targets, weight = batch_of(chunk, features, by_job, t2d)
        hit = (model(ids, mask).argmax(-1) == targets.argmax(-1)) & (weight > 0)
        for i, record in enumerate(chunk):
            stored = by_job[record["job"]]
            first = stored["prompt_len"] - 1
            agree.append(hit[i, first : first + stored["rows"] - 1].float())
    # Teacher-forced agreement per position stands for the chain: at an anchor, draft j
    # is right when the model agrees at positions anchor .. anchor + j (the target's tokens
    # are the greedy path the accepted drafts follow).
    tau = np.zeros(steps)
    count = 0
    for row in agree:
        r = row.numpy()
        for a in range(len(r) - steps):
            prefix = np.cumprod(r[a : a + steps])
            tau += np.cumsum(prefix)
            count += 1
    if not agree:
        return {"top1": None, "tau_at_k": []}
    flat = torch.cat(agree)
    return {"top1": round(float(flat.mean()), 4), "tau_at_k": [round(1 + float(x), 3) for x in tau / max(count, 1)]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--bundle", type=Path, default=Path("models/smollm2-135m-instruct"))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="answers per update")
    parser.add_argument("--updates", type=int, default=1_000_000, help="a cap; the run is sized by --minutes")
    parser.add_argument("--minutes", type=float, default=80)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save-every", type=int, default=100)
    parser.add_argument("--log-every", type=int, default=25)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--export", type=Path, default=None, help="write the trained draft model into this bundle")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = dataclasses.replace(target_shape(json.loads((args.bundle / "target/config.json").read_text())),
                                num_layers=args.layers)
    train, heldout = Features(args.data / "features/train"), Features(args.data / "features/heldout")
    draft_ids = draft_vocabulary(train.token_counts(shape.vocab_size), DRAFT_VOCAB)
    t2d = torch.full((shape.vocab_size,), -1, dtype=torch.long)
    t2d[torch.from_numpy(draft_ids)] = torch.arange(len(draft_ids))
    embed = torch.from_numpy(np.load(args.bundle / "target/embed_tokens.npy"))
    torch.manual_seed(args.seed)
    model = DraftLM(shape, embed, torch.from_numpy(draft_ids))
    records, by_job = sequences(args.data, "train"), {s["job"]: s for s in train.sequences}
    records = [r for r in records if r["job"] in by_job]
    run = TrainingRun(model, "model", args.data / "ckpt" / "draft_model.pt", args.lr, args.minutes, args.updates,
                      args.seed, args.save_every, strict=False)  # the frozen shared embeddings load as they are
    state = run.state

    def batch_loss():
        chosen = [records[i] for i in run.rng.choice(len(records), args.batch, replace=False)]
        ids, mask, targets, weight = batch_of(chosen, train, by_job, t2d)
        ce = -(targets * F.log_softmax(model(ids, mask), -1)).sum(-1)
        state["tokens"] = state.get("tokens", 0) + int(weight.sum())  # counted before a checkpoint is due
        return (ce * weight).sum() / weight.sum().clamp_min(1), None

    model.train()
    while run.running():
        loss, _ = run.update(batch_loss)
        if state["update"] % args.log_every == 0:
            state["log"].append({"update": state["update"], "loss": round(float(loss.detach()), 4)})
            print(f"update {state['update']}: loss {float(loss.detach()):.3f} "
                  f"({state['seconds'] / state['update']:.2f} s/update)", flush=True)
    model.eval()
    held = [r for r in sequences(args.data, "heldout") if r["job"] in {s["job"] for s in heldout.sequences}]
    state["heldout"] = evaluate(model, held, heldout, t2d)
    run.save()
    print(json.dumps({"kind": "draft_model", "update": state["update"], "minutes": round(state["seconds"] / 60, 1),
                      **state["heldout"]}), flush=True)
    if args.export is not None:
        export_draft(model, shape, draft_ids, args.export, state, args)


def export_draft(model: DraftLM, shape: LlamaShape, draft_ids: np.ndarray, bundle: Path, state: dict,
                 args: argparse.Namespace) -> None:
    """``bundle/draft``: the trained layers (float16), config, ``d2t.npy``, and the manifest's
    entry; the graphs are written at install (``modelbuild.from_gguf.draft``)."""
    from specserve.engine.model.manifest import BundleManifest, HiddenOutputs, ModelEntry, TrainingRecord

    from ..convert.target import architecture_of
    from ..from_gguf.draft import DRAFT_WEIGHTS, write_draft_graphs
    from .export import data_hash

    directory = bundle / "draft"
    directory.mkdir(parents=True, exist_ok=True)
    target_config = json.loads((bundle / "target/config.json").read_text())
    config = {**target_config, "num_hidden_layers": shape.num_layers, "draft_vocabulary": "d2t.npy",
              "torch_dtype": "float16"}
    save_checkpoint(model, directory, config)  # writes DRAFT_WEIGHTS
    np.save(directory / "d2t.npy", (draft_ids - np.arange(len(draft_ids))).astype(np.int64))
    write_draft_graphs(bundle)
    manifest = BundleManifest.load(bundle)
    record = TrainingRecord(
        seed=args.seed, steps=state["update"], batch_size=args.batch, seq_len=0, learning_rate=args.lr,
        objective=(f"soft cross-entropy to the target's top-16 next-token distribution over {len(draft_ids)} draft ids "
                   f"at every answer position; embeddings tied to the target's and frozen; on the target's own "
                   f"answers (the training answers' sha256 {data_hash(args.data)})"),
        tokens_seen=int(state.get("tokens", 0)), seconds=round(state["seconds"], 1))
    entry = ModelEntry(role="draft", directory="draft", onnx="model.onnx", weights=DRAFT_WEIGHTS, config="config.json",
                       tokenizer="tokenizer.json", parameters=sum(p.numel() for p in model.parameters()),
                       architecture=architecture_of(config), hidden_outputs=HiddenOutputs(final="hidden_states"),
                       training=record)
    manifest.model_copy(update={"models": {**manifest.models, "draft": entry}}).save(bundle)
    print(f"draft model written to {directory}", flush=True)


if __name__ == "__main__":
    main()
