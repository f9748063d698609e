"""Proposer heads trained against the bundled target (self-distillation) and their export.

All three heads learn to predict what the *target* would say next, from what the
target exposes at the last position it has processed:

- ``MtpHead`` (Qwen3.5 / DeepSeek MTP style): target embedding of the guaranteed token
  + target final hidden state -> one decoder layer -> ``mtp_hidden`` (read by the
  target's own LM head, outside the graph).
- ``Eagle3Head``: target embedding + target low|mid|high hidden states (fused) + a
  recycled hidden state -> one decoder layer -> logits over a reduced draft vocabulary
  (``d2t`` maps draft ids to target ids) and ``next_hidden``.
- ``SharedKvAssistant`` (Gemma-4 assistant style): no cache of its own; cross-attends
  to slices of the target's KV cache, one target layer per group, at a constant position.

Training unrolls two draft steps exactly as inference runs them, so the second step
learns from the head's own threaded hidden state.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from tqdm import tqdm

from .llama import (MLP, DecoderLayer, LlamaForCausalLM, LlamaShape, RMSNorm, attend, causal_bias,
                    inverse_frequencies, rotary, rotate_half)

UNROLL_STEPS = 2


def _head_shape(target: LlamaShape) -> LlamaShape:
    """One decoder layer with the target's width and attention geometry."""
    return LlamaShape(target.vocab_size, target.hidden_size, 1, target.num_heads, target.num_kv_heads,
                      target.intermediate_size, target.max_position_embeddings, target.rope_theta,
                      target.rms_norm_eps)


class MtpHead(nn.Module):
    def __init__(self, target: LlamaShape) -> None:
        super().__init__()
        shape = _head_shape(target)
        h = shape.hidden_size
        self.enorm, self.hnorm = RMSNorm(h, shape.rms_norm_eps), RMSNorm(h, shape.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.layer = DecoderLayer(shape)
        self.norm = RMSNorm(h, shape.rms_norm_eps)
        self.register_buffer("inv_freq", inverse_frequencies(shape.head_dim, shape.rope_theta), persistent=False)

    def forward(self, inputs_embeds, hidden_states, attention_mask, position_ids, past_k, past_v):
        x = self.eh_proj(torch.cat([self.enorm(inputs_embeds), self.hnorm(hidden_states)], dim=-1))
        cos, sin = rotary(position_ids, self.inv_freq)
        bias = causal_bias(attention_mask, past_k.shape[2], x.shape[1])
        x, k, v = self.layer(x, cos, sin, bias, past_k, past_v)
        return self.norm(x), k, v


class Eagle3Head(nn.Module):
    def __init__(self, target: LlamaShape, draft_vocab: int) -> None:
        super().__init__()
        shape = _head_shape(target)
        h, eps = shape.hidden_size, shape.rms_norm_eps
        self.fc = nn.Linear(3 * h, h, bias=False)  # fuse low|mid|high target states
        self.enorm, self.fnorm, self.rnorm = RMSNorm(h, eps), RMSNorm(h, eps), RMSNorm(h, eps)
        self.in_proj = nn.Linear(3 * h, h, bias=False)
        self.layer = DecoderLayer(shape)
        self.norm = RMSNorm(h, eps)
        self.lm_head = nn.Linear(h, draft_vocab, bias=False)
        self.register_buffer("inv_freq", inverse_frequencies(shape.head_dim, shape.rope_theta), persistent=False)

    def forward(self, inputs_embeds, fused_hidden, recycled_hidden, attention_mask, position_ids, past_k, past_v):
        x = self.in_proj(torch.cat([self.enorm(inputs_embeds), self.fnorm(self.fc(fused_hidden)),
                                    self.rnorm(recycled_hidden)], dim=-1))
        cos, sin = rotary(position_ids, self.inv_freq)
        bias = causal_bias(attention_mask, past_k.shape[2], x.shape[1])
        x, k, v = self.layer(x, cos, sin, bias, past_k, past_v)
        hidden = self.norm(x)
        return self.lm_head(hidden), hidden, k, v


class CrossLayer(nn.Module):
    """Decoder layer whose attention reads someone else's (the target's) keys and values."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.num_heads, self.head_dim = shape.num_heads, shape.head_dim
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.q_proj = nn.Linear(shape.hidden_size, shape.num_heads * shape.head_dim, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * shape.head_dim, shape.hidden_size, bias=False)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.mlp = MLP(shape)

    def forward(self, x, cos, sin, bias, key, value):
        b, s, _ = x.shape
        q = self.q_proj(self.input_layernorm(x)).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        x = x + self.o_proj(attend(q, key, value, bias))
        return x + self.mlp(self.post_attention_layernorm(x))


class SharedKvAssistant(nn.Module):
    def __init__(self, target: LlamaShape, groups: dict[str, int]) -> None:
        super().__init__()
        shape = _head_shape(target)
        h = shape.hidden_size
        self.groups = dict(groups)  # group name -> bound target layer
        self.in_proj = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(CrossLayer(shape) for _ in self.groups)
        self.norm = RMSNorm(h, shape.rms_norm_eps)
        self.lm_head = nn.Linear(h, shape.vocab_size, bias=False)
        self.state_proj = nn.Linear(h, h, bias=False)
        self.register_buffer("inv_freq", inverse_frequencies(shape.head_dim, shape.rope_theta), persistent=False)

    def forward(self, inputs_embeds, position_ids, bias, shared_kv):
        """``bias [B, Q, kv_len]`` additive mask; ``shared_kv`` one (key, value) per group."""
        x = self.in_proj(inputs_embeds)
        cos, sin = rotary(position_ids, self.inv_freq)
        for layer, (key, value) in zip(self.layers, shared_kv):
            x = layer(x, cos, sin, bias, key, value)
        hidden = self.norm(x)
        return self.lm_head(hidden), self.state_proj(hidden)


@dataclass
class TeacherBatch:
    tokens: torch.Tensor        # [B, T]
    probs: torch.Tensor         # [B, T, V] target next-token distribution at each position
    final: torch.Tensor         # [B, T, H] target final normalised hidden
    fused: torch.Tensor         # [B, T, 3H] low|mid|high
    kv: list[tuple[torch.Tensor, torch.Tensor]]  # per assistant group: target layer K/V [B, kv, T, d]


@torch.no_grad()
def teacher_batch(target: LlamaForCausalLM, tokens: torch.Tensor, aux: tuple[int, int, int],
                  kv_layers: list[int]) -> TeacherBatch:
    logits, presents, hidden = target(tokens)
    return TeacherBatch(tokens, F.softmax(logits, -1), hidden[-1], torch.cat([hidden[j] for j in aux], -1),
                        [presents[i] for i in kv_layers])


def _kl(teacher_probs: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """Mean per-position KL(teacher || student), whatever the leading dimensions."""
    vocab = student_logits.shape[-1]
    return F.kl_div(F.log_softmax(student_logits, -1).reshape(-1, vocab), teacher_probs.reshape(-1, vocab),
                    reduction="batchmean")


def _rows(x: torch.Tensor, offset: int, anchors: int) -> torch.Tensor:
    """Positions ``offset .. offset+anchors`` of ``[B, T, ...]`` as ``[B*anchors, 1, ...]``."""
    sliced = x[:, offset : offset + anchors]
    return sliced.reshape(-1, 1, *sliced.shape[2:])


def unroll_mtp(head: MtpHead, embed: nn.Embedding, lm_head: nn.Linear, batch: TeacherBatch):
    """Per-step (student logits, teacher probs): anchor t has the target state at t and
    embeds token t+1 (the guaranteed token); step i predicts the target at t+1+i."""
    anchors = batch.tokens.shape[1] - UNROLL_STEPS
    n = batch.tokens.shape[0] * anchors
    hidden = _rows(batch.final, 0, anchors)
    past_k = past_v = torch.zeros(n, head.layer.self_attn.num_kv_heads, 0, head.layer.self_attn.head_dim)
    results = []
    for step in range(UNROLL_STEPS):
        emb = embed(batch.tokens[:, 1 + step : 1 + step + anchors]).reshape(n, 1, -1)
        mask = torch.ones(n, step + 1, dtype=torch.long)
        hidden, past_k, past_v = head(emb, hidden, mask, torch.full((n, 1), step), past_k, past_v)
        results.append((lm_head(hidden), _rows(batch.probs, 1 + step, anchors)))
    return results


def unroll_eagle3(head: Eagle3Head, embed: nn.Embedding, draft_ids: torch.Tensor, batch: TeacherBatch):
    anchors = batch.tokens.shape[1] - UNROLL_STEPS
    n = batch.tokens.shape[0] * anchors
    fused = _rows(batch.fused, 0, anchors)
    hidden = _rows(batch.final, 0, anchors)
    past_k = past_v = torch.zeros(n, head.layer.self_attn.num_kv_heads, 0, head.layer.self_attn.head_dim)
    results = []
    for step in range(UNROLL_STEPS):
        emb = embed(batch.tokens[:, 1 + step : 1 + step + anchors]).reshape(n, 1, -1)
        mask = torch.ones(n, step + 1, dtype=torch.long)
        logits, hidden, past_k, past_v = head(emb, fused, hidden, mask, torch.full((n, 1), step), past_k, past_v)
        teacher = _rows(batch.probs, 1 + step, anchors)[..., draft_ids]
        results.append((logits, teacher / teacher.sum(-1, keepdim=True).clamp_min(1e-9)))
    return results


def unroll_assistant(head: SharedKvAssistant, embed: nn.Embedding, batch: TeacherBatch):
    """Bootstrap on the anchor token (discarded), then draft steps at a constant position."""
    b, t = batch.tokens.shape
    anchors = t - UNROLL_STEPS
    bias = causal_bias(torch.ones(b, t, dtype=torch.long), 0, t)[:, :anchors]  # anchor sees KV <= itself
    positions = torch.arange(anchors).unsqueeze(0).expand(b, anchors)
    state = batch.final[:, :anchors]
    results = []
    for step in range(UNROLL_STEPS + 1):
        emb = embed(batch.tokens[:, step : step + anchors])
        logits, state = head(torch.cat([emb, state], -1), positions, bias, batch.kv)
        if step > 0:
            results.append((logits, batch.probs[:, step : step + anchors]))
    return results


def train_heads(heads: dict, target: LlamaForCausalLM, windows, steps: int, batch_size: int, seq_len: int,
                lr: float, aux, kv_layers, draft_ids) -> None:
    """Train every head on the same teacher batches (one target forward per step)."""
    embed, lm_head = target.model.embed_tokens, target.lm_head
    params = [p for h in heads.values() for p in h.parameters()]
    optimizer = torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    for h in heads.values():
        h.train()
    bar = tqdm(range(steps), desc="heads", unit="step")
    for step in bar:
        batch = teacher_batch(target, windows.batch(batch_size, seq_len)[:, :-1], aux, kv_layers)
        losses = {
            "mtp": sum(_kl(p, s) for s, p in unroll_mtp(heads["mtp"], embed, lm_head, batch)),
            "eagle3": sum(_kl(p, s) for s, p in unroll_eagle3(heads["eagle3"], embed, draft_ids, batch)),
            "shared_kv": sum(_kl(p, s) for s, p in unroll_assistant(heads["shared_kv"], embed, batch)),
        }
        optimizer.zero_grad(set_to_none=True)
        sum(losses.values()).backward()
        for head in heads.values():  # clipped per head: one head's gradients never scale another's
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        if step % 10 == 0:
            bar.set_postfix({k: f"{v.item():.2f}" for k, v in losses.items()})
    for h in heads.values():
        h.eval()


@torch.no_grad()
def heldout_agreement(heads: dict, target: LlamaForCausalLM, tokens, seq_len: int, aux, kv_layers,
                      draft_ids: torch.Tensor, windows: int = 24) -> dict[str, list[float]]:
    """Top-1 agreement of each head's step-i draft with the target's greedy token."""
    embed, lm_head = target.model.embed_tokens, target.lm_head
    stream = torch.from_numpy(tokens.astype("int64"))
    hits: dict[str, list[float]] = {name: [0.0] * UNROLL_STEPS for name in heads}
    total = 0
    for i in range(windows):
        chunk = stream[i * seq_len : (i + 1) * seq_len].unsqueeze(0)
        batch = teacher_batch(target, chunk, aux, kv_layers)
        per_head = {"mtp": [(s, p) for s, p in unroll_mtp(heads["mtp"], embed, lm_head, batch)],
                    "eagle3": [(draft_ids[s.argmax(-1)], p) for s, p in
                               unroll_eagle3(heads["eagle3"], embed, draft_ids, batch)],
                    "shared_kv": unroll_assistant(heads["shared_kv"], embed, batch)}
        full_teacher = [_rows(batch.probs, 1 + k, seq_len - UNROLL_STEPS) for k in range(UNROLL_STEPS)]
        for name, results in per_head.items():
            for k, (student, _) in enumerate(results):
                guess = student if name == "eagle3" else student.argmax(-1)
                truth = full_teacher[k].argmax(-1).reshape(guess.shape)
                hits[name][k] += (guess == truth).float().sum().item()
        total += seq_len - UNROLL_STEPS
    return {name: [round(h / total, 4) for h in per] for name, per in hits.items()}


class _Wrap(nn.Module):
    """Export adapter: weights under ``inner`` (the prefix the weight externaliser strips)."""

    def __init__(self, inner: nn.Module, kind: str) -> None:
        super().__init__()
        self.inner, self.kind = inner, kind

    def forward(self, *args):
        if self.kind == "shared_kv":
            inputs_embeds, position_ids, attention_mask, *flat_kv = args
            bias = (1.0 - attention_mask[:, None, :].float()) * torch.finfo(torch.float32).min
            bias = bias.expand(-1, inputs_embeds.shape[1], -1)
            kv = [(flat_kv[2 * i], flat_kv[2 * i + 1]) for i in range(len(flat_kv) // 2)]
            return self.inner(inputs_embeds, position_ids, bias, kv)
        return self.inner(*args)


def export_head(kind: str, head: nn.Module, target: LlamaShape, out_dir) -> None:
    """Export with the I/O names of ``shared/docs/head-contracts.md``."""
    from .export import export_graph

    h, kv, d = target.hidden_size, target.num_kv_heads, target.head_dim
    b, s, p = 1, 2, 3  # non-empty past when tracing
    seq = {0: "batch", 1: "sequence"}
    past_axes, total_axes = {0: "batch", 2: "past_sequence"}, {0: "batch", 2: "total_sequence"}
    if kind == "mtp":
        example = (torch.randn(b, s, h), torch.randn(b, s, h), torch.ones(b, p + s, dtype=torch.long),
                   torch.arange(p, p + s)[None], torch.randn(b, kv, p, d), torch.randn(b, kv, p, d))
        inputs = ["inputs_embeds", "hidden_states", "attention_mask", "position_ids",
                  "past_key_values.0.key", "past_key_values.0.value"]
        outputs = ["mtp_hidden", "present.0.key", "present.0.value"]
        axes = {"inputs_embeds": seq, "hidden_states": seq, "attention_mask": {0: "batch", 1: "total_sequence"},
                "position_ids": seq, "past_key_values.0.key": past_axes, "past_key_values.0.value": past_axes,
                "mtp_hidden": seq, "present.0.key": total_axes, "present.0.value": total_axes}
    elif kind == "eagle3":
        example = (torch.randn(b, s, h), torch.randn(b, s, 3 * h), torch.randn(b, s, h),
                   torch.ones(b, p + s, dtype=torch.long), torch.arange(p, p + s)[None],
                   torch.randn(b, kv, p, d), torch.randn(b, kv, p, d))
        inputs = ["inputs_embeds", "fused_hidden", "recycled_hidden", "attention_mask", "position_ids",
                  "past_key_values.0.key", "past_key_values.0.value"]
        outputs = ["draft_logits", "next_hidden", "present.0.key", "present.0.value"]
        axes = {"inputs_embeds": seq, "fused_hidden": seq, "recycled_hidden": seq,
                "attention_mask": {0: "batch", 1: "total_sequence"}, "position_ids": seq,
                "past_key_values.0.key": past_axes, "past_key_values.0.value": past_axes,
                "draft_logits": seq, "next_hidden": seq, "present.0.key": total_axes, "present.0.value": total_axes}
    else:
        groups = list(head.groups)
        example = (torch.randn(b, s, 2 * h), torch.full((b, s), p - 1), torch.ones(b, p, dtype=torch.long),
                   *[torch.randn(b, kv, p, d) for _ in range(2 * len(groups))])
        kv_names = [f"shared_kv.{g}.{part}" for g in groups for part in ("key", "value")]
        inputs = ["inputs_embeds", "position_ids", "attention_mask", *kv_names]
        outputs = ["logits", "projected_state"]
        axes = {"inputs_embeds": seq, "position_ids": seq, "attention_mask": {0: "batch", 1: "kv_sequence"},
                **{n: {0: "batch", 2: "kv_sequence"} for n in kv_names}, "logits": seq, "projected_state": seq}
    export_graph(_Wrap(head, kind).eval(), example, inputs, outputs, axes, out_dir)
