"""Training loops: next-token cross-entropy for the target, distillation for the draft.

Step counts are fixed (not time budgets) so a rebuild with the same seed does the same
work on any machine; the defaults fit the 45-minute budget on 2 CPU cores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F
from tqdm import tqdm

from .llama import LlamaForCausalLM


@dataclass(frozen=True)
class TrainPlan:
    steps: int
    batch_size: int
    seq_len: int
    lr: float
    warmup: int = 40
    weight_decay: float = 0.1
    # The last steps train on windows twice as long (half the batch, same tokens per
    # step) so positions up to 2 * seq_len are seen: that is the context limit we ship.
    long_fraction: float = 0.15

    def window(self, step: int) -> tuple[int, int]:
        """(batch_size, seq_len) for this step."""
        if step >= self.steps * (1 - self.long_fraction):
            return max(1, self.batch_size // 2), self.seq_len * 2
        return self.batch_size, self.seq_len


class TokenWindows:
    """Random fixed-length windows over one long token stream (seeded)."""

    def __init__(self, tokens: np.ndarray, seed: int) -> None:
        self.tokens = torch.from_numpy(tokens.astype(np.int64))
        self.generator = torch.Generator().manual_seed(seed)

    def batch(self, batch_size: int, seq_len: int) -> torch.Tensor:
        starts = torch.randint(0, len(self.tokens) - seq_len - 1, (batch_size,), generator=self.generator)
        return torch.stack([self.tokens[s : s + seq_len + 1] for s in starts.tolist()])


def _optimizer(model: torch.nn.Module, plan: TrainPlan) -> torch.optim.Optimizer:
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": plan.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=plan.lr, betas=(0.9, 0.95),
    )


def _lr_at(step: int, plan: TrainPlan) -> float:
    if step < plan.warmup:
        return plan.lr * (step + 1) / plan.warmup
    progress = (step - plan.warmup) / max(1, plan.steps - plan.warmup)
    return plan.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _run(model, plan: TrainPlan, windows: TokenWindows, loss_fn, desc: str) -> None:
    optimizer = _optimizer(model, plan)
    model.train()
    bar = tqdm(range(plan.steps), desc=desc, unit="step")
    for step in bar:
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, plan)
        batch = windows.batch(*plan.window(step))
        loss = loss_fn(batch)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 10 == 0:
            bar.set_postfix(loss=f"{loss.item():.3f}")
    model.eval()


def train_target(model: LlamaForCausalLM, plan: TrainPlan, windows: TokenWindows) -> None:
    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        logits, _, _ = model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))

    _run(model, plan, windows, loss_fn, "target")


def distill_draft(draft: LlamaForCausalLM, teacher: LlamaForCausalLM, plan: TrainPlan,
                  windows: TokenWindows, kl_weight: float = 0.7) -> None:
    """Match the teacher's next-token distribution (KL) plus a little plain CE.

    Distillation raises acceptance: the draft learns what the *target* would say, not
    what the corpus says.
    """
    teacher.eval()

    def loss_fn(batch: torch.Tensor) -> torch.Tensor:
        inputs = batch[:, :-1]
        with torch.no_grad():
            teacher_logits, _, _ = teacher(inputs)
        logits, _, _ = draft(inputs)
        vocab = logits.shape[-1]
        kl = F.kl_div(F.log_softmax(logits, -1).reshape(-1, vocab),
                      F.log_softmax(teacher_logits, -1).reshape(-1, vocab),
                      log_target=True, reduction="batchmean")
        ce = F.cross_entropy(logits.reshape(-1, vocab), batch[:, 1:].reshape(-1))
        return kl_weight * kl + (1 - kl_weight) * ce

    _run(draft, plan, windows, loss_fn, "draft")


@torch.no_grad()
def heldout_loss(model: LlamaForCausalLM, tokens: np.ndarray, seq_len: int, max_windows: int = 96) -> float:
    """Mean next-token cross-entropy (nats) over consecutive held-out windows."""
    model.eval()
    stream = torch.from_numpy(tokens.astype(np.int64))
    count = min(max_windows, (len(stream) - 1) // seq_len)
    total = 0.0
    for i in range(count):
        chunk = stream[i * seq_len : (i + 1) * seq_len + 1].unsqueeze(0)
        logits, _, _ = model(chunk[:, :-1])
        total += F.cross_entropy(logits[0], chunk[0, 1:]).item()
    return total / count


def unigram_cross_entropy(train_tokens: np.ndarray, heldout_tokens: np.ndarray, vocab: int) -> float:
    """Cross-entropy (nats) of held-out tokens under the train split's unigram
    distribution (add-one smoothed): the bar a model must clearly beat."""
    counts = np.bincount(train_tokens, minlength=vocab).astype(np.float64) + 1.0
    logp = np.log(counts / counts.sum())
    return float(-logp[heldout_tokens].mean())
