"""Step 3: train a head on the extracted target states, with EAGLE-3's training-time-test
unroll for both kinds it serves: every chain of ``--steps`` draft steps runs as it does
when served (the head's own KV over the chain only; the first step reads the target's
state at the anchor, each later step the head's own output state), and every step is
taught the target's next-token distribution (its top 16, renormalised over the draft
vocabulary: soft cross-entropy, i.e. distillation).

    .venv-convert/bin/python -m specserve.modelbuild.distill.train {eagle3,mtp,shared_kv} [--minutes 80] [--steps 6] [--export BUNDLE]

- ``eagle3``: target low|mid|high states fused on every step, the final state recycled
  first, logits over a reduced draft vocabulary of the 8192 ids the answers use most (``d2t``).
- ``mtp``: target final state and the pending token's embedding, one decoder layer, read
  through the target's own (tied, frozen) LM head restricted to the same draft vocabulary.
- ``shared_kv``: a Gemma-4-style assistant with no KV of its own, cross-attending to the
  target's KV of a middle and the last layer, with its own LM head over the draft vocabulary.

Resumes from ``.cache/distill/ckpt/<kind>.pt`` (written every ``--save-every`` updates); a
run ends after ``--minutes`` of training in all (resumes included; the learning rate
follows that budget, ``schedule.py``) or at ``--updates``, and a rerun goes on where it stopped.
``--export`` writes the head into the bundle and records it in the manifest.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

import dataclasses

from ..heads import Eagle3Head, MtpHead, SharedKvAssistant
from ..int8_graph import INT8_HEADS
from ..llama import LlamaShape
from .features import ChainBatch, Features
from .generate import DEFAULT_OUT
from .run import TrainingRun

DRAFT_VOCAB = 8192
EVAL_STEPS = 6  # held-out agreement is measured over the longest chain served (k <= 6), however trained


def target_shape(config: dict) -> LlamaShape:
    return LlamaShape(config["vocab_size"], config["hidden_size"], config["num_hidden_layers"],
                      config["num_attention_heads"], config["num_key_value_heads"], config["intermediate_size"],
                      config["max_position_embeddings"], config["rope_theta"], config["rms_norm_eps"])


def draft_vocabulary(counts: np.ndarray, size: int) -> np.ndarray:
    """The ``size`` most frequent target ids in the answers, ascending."""
    return np.sort(np.argsort(-counts, kind="stable")[:size])


class Chains:
    """What every kind's unroll shares: the batch as tensors, the draft vocabulary, and
    each step's soft targets."""

    def __init__(self, batch: ChainBatch, t2d: torch.Tensor, context: tuple | None = None) -> None:
        self.n, self.steps = batch.inputs.shape
        self.context = context  # the target's KV up to each anchor, where the head reads it
        self.fused = torch.from_numpy(batch.fused)[:, None]
        self.final = torch.from_numpy(batch.final)[:, None]
        self.inputs = torch.from_numpy(batch.inputs)
        self.top_ids, self.top_p = torch.from_numpy(batch.top_ids), torch.from_numpy(batch.top_logp).exp()
        self.valid = torch.from_numpy(batch.valid)
        self.t2d = t2d

    def targets(self, step: int, draft_vocab: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(soft targets [B, V_draft], weight [B], the target's greedy token as a draft id
        [B], -1 where the draft vocabulary lacks it) of draft step ``step``."""
        draft = self.t2d[self.top_ids[:, step]]
        p = torch.where(draft >= 0, self.top_p[:, step], torch.zeros(()))
        mass = p.sum(-1, keepdim=True)
        target = torch.zeros(self.n, draft_vocab).scatter_add_(1, draft.clamp_min(0), p / mass.clamp_min(1e-9))
        return target, (self.valid[:, step] & (mass[:, 0] > 0)).float(), draft[:, 0]

    def mask(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.ones(self.n, step + 1, dtype=torch.long), torch.full((self.n, 1), step)


class HeadTrainer:
    """One kind's head and its unroll."""

    kind: str

    def __init__(self, shape: LlamaShape, embed: torch.Tensor, draft_ids: np.ndarray) -> None:
        self.shape, self.embed, self.draft_ids = shape, embed, draft_ids
        self.head = self.build()

    def build(self) -> torch.nn.Module:
        raise NotImplementedError

    def unroll(self, chains: Chains):
        """Per step: (draft logits [B, V_draft], soft targets, weight, greedy draft id)."""
        raise NotImplementedError

    def empty_past(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        attn = self.head.layer.self_attn
        empty = torch.zeros(n, attn.num_kv_heads, 0, attn.head_dim)
        return empty, empty


class Eagle3Trainer(HeadTrainer):
    kind = "eagle3"

    def build(self) -> torch.nn.Module:
        return Eagle3Head(self.shape, len(self.draft_ids))

    def unroll(self, chains: Chains):
        past_k, past_v = self.empty_past(chains.n)
        recycled, out = chains.final, []
        for step in range(chains.steps):
            mask, position = chains.mask(step)
            logits, recycled, past_k, past_v = self.head(self.embed[chains.inputs[:, step]][:, None], chains.fused,
                                                         recycled, mask, position, past_k, past_v)
            out.append((logits[:, 0], *chains.targets(step, len(self.draft_ids))))
        return out


class MtpTrainer(HeadTrainer):
    kind = "mtp"

    def build(self) -> torch.nn.Module:
        self.lm_head = self.embed[torch.from_numpy(self.draft_ids)]  # tied and frozen: the target's own rows
        return MtpHead(self.shape)

    def unroll(self, chains: Chains):
        past_k, past_v = self.empty_past(chains.n)
        hidden, out = chains.final, []
        for step in range(chains.steps):
            mask, position = chains.mask(step)
            hidden, past_k, past_v = self.head(self.embed[chains.inputs[:, step]][:, None], hidden, mask, position,
                                               past_k, past_v)
            out.append((hidden[:, 0] @ self.lm_head.T, *chains.targets(step, len(self.draft_ids))))
        return out


SHARED_KV_GROUPS = {"middle": 14, "last": 29}  # extract.py's KV_LAYERS


class SharedKvTrainer(HeadTrainer):
    """The Gemma-4-style assistant in transformers' assisted-generation feed
    (``hf_assisted``): step 0 pairs the pending token with the target state that predicted
    it, later steps the head's own draft with its own ``projected_state``; every step at
    the pending token's position, cross-attending to the target's KV of the two bound
    layers up to the anchor."""

    kind = "shared_kv"
    needs_context = True

    def build(self) -> torch.nn.Module:
        return SharedKvAssistant(dataclasses.replace(self.shape, vocab_size=len(self.draft_ids)), SHARED_KV_GROUPS)

    def unroll(self, chains: Chains):
        (kv, mask) = chains.context
        kv = [(torch.from_numpy(k), torch.from_numpy(v)) for k, v in kv]
        bias = (~torch.from_numpy(mask)).float()[:, None, :] * torch.finfo(torch.float32).min  # [B, 1, L]
        positions = torch.from_numpy(mask.sum(1, keepdims=True))  # the pending token's position, p + 1
        state, out = chains.final, []
        for step in range(chains.steps):
            inputs = torch.cat([self.embed[chains.inputs[:, step]][:, None], state], -1)
            logits, state = self.head(inputs, positions, bias, kv)
            out.append((logits[:, 0], *chains.targets(step, len(self.draft_ids))))
        return out


TRAINERS = {trainer.kind: trainer for trainer in (Eagle3Trainer, MtpTrainer, SharedKvTrainer)}


def chains_of(trainer: HeadTrainer, features: Features, anchors: np.ndarray, steps: int, t2d) -> Chains:
    context = features.context_kv(anchors) if getattr(trainer, "needs_context", False) else None
    return Chains(features.batch(anchors, steps), t2d, context)


def loss_and_accuracy(results) -> tuple[torch.Tensor, list[float]]:
    total, accuracy = torch.zeros(()), []
    for logits, target, weight, greedy in results:
        ce = -(target * F.log_softmax(logits, -1)).sum(-1)
        total = total + (ce * weight).sum() / weight.sum().clamp_min(1)
        hit = (logits.argmax(-1) == greedy).float()
        accuracy.append(round(float((hit * weight).sum() / weight.sum().clamp_min(1)), 3))
    return total, accuracy


@torch.no_grad()
def evaluate(trainer: HeadTrainer, t2d, features: Features, steps: int, anchors: int = 4096) -> dict:
    """Held-out top-1 agreement with the target's greedy token per step, and the expected
    tokens per round at k = 1..steps (greedy: a draft counts only if every one before it
    agreed; plus the target's own token)."""
    rng = np.random.default_rng(0)
    chosen = np.sort(rng.choice(features.anchors, min(anchors, len(features.anchors)), replace=False))
    hits = []
    for start in range(0, len(chosen), 256):
        results = trainer.unroll(chains_of(trainer, features, chosen[start : start + 256], steps, t2d))
        hits.append(torch.stack([(lg.argmax(-1) == greedy) & (w > 0) for lg, _, w, greedy in results], 1))
    agree = torch.cat(hits).float()
    prefix = torch.cumprod(agree, 1)
    return {"top1_per_step": [round(float(x), 4) for x in agree.mean(0)],
            "tau_at_k": [round(1 + float(prefix[:, :k].sum(1).mean()), 3) for k in range(1, steps + 1)]}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=sorted(TRAINERS))
    parser.add_argument("--data", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--bundle", type=Path, default=Path("models/smollm2-135m-instruct"))
    parser.add_argument("--steps", type=int, default=6, help="draft steps unrolled per chain")
    parser.add_argument("--batch", type=int, default=128, help="chains per update")
    parser.add_argument("--updates", type=int, default=1_000_000, help="a cap; the run is sized by --minutes")
    parser.add_argument("--minutes", type=float, default=80)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--save-every", type=int, default=200)
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--export", type=Path, default=None, help="write the trained head into this bundle")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="default <data>/ckpt/<kind>.pt; another name keeps a comparison run apart")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = target_shape(json.loads((args.bundle / "target/config.json").read_text()))
    train, heldout = Features(args.data / "features/train"), Features(args.data / "features/heldout")
    draft_ids = draft_vocabulary(train.token_counts(shape.vocab_size), DRAFT_VOCAB)
    t2d = torch.full((shape.vocab_size,), -1, dtype=torch.long)
    t2d[torch.from_numpy(draft_ids)] = torch.arange(len(draft_ids))
    embed = torch.from_numpy(np.load(args.bundle / "target/embed_tokens.npy"))
    torch.manual_seed(args.seed)
    trainer = TRAINERS[args.kind](shape, embed, draft_ids)
    head = trainer.head
    run = TrainingRun(head, "head", args.checkpoint or args.data / "ckpt" / f"{args.kind}.pt", args.lr, args.minutes,
                      args.updates, args.seed, args.save_every)
    state = run.state

    def batch_loss():
        anchors = np.sort(run.rng.choice(train.anchors, args.batch, replace=False))
        return loss_and_accuracy(trainer.unroll(chains_of(trainer, train, anchors, args.steps, t2d)))

    head.train()
    while run.running():
        loss, accuracy = run.update(batch_loss)
        if state["update"] % args.log_every == 0:
            state["log"].append({"update": state["update"], "loss": round(float(loss.detach()), 4), "top1": accuracy})
            print(f"update {state['update']}: loss {float(loss.detach()):.3f}, top-1 per step "
                  f"{' '.join(f'{a:.2f}' for a in accuracy)} ({state['seconds'] / state['update']:.2f} s/update)",
                  flush=True)
    head.eval()
    state["heldout"] = evaluate(trainer, t2d, heldout, EVAL_STEPS)
    run.save()
    print(json.dumps({"kind": args.kind, "update": state["update"], "minutes": round(state["seconds"] / 60, 1),
                      **state["heldout"]}), flush=True)
    if args.export is not None:
        from .export import export_head_into

        export_head_into(args.kind, trainer, args.export, state, args)
        if args.kind in INT8_HEADS:  # its weights now as stored (int8 blocks): what the float graph computes
            print(json.dumps({"kind": args.kind, "as_stored": evaluate(trainer, t2d, heldout, EVAL_STEPS)}), flush=True)


if __name__ == "__main__":
    main()
