"""A minimal Llama decoder in torch whose parameter names match Hugging Face's
``LlamaForCausalLM``, so the saved safetensors + ``config.json`` load in transformers.

Why our own module instead of transformers': the export needs full control of the
graph interface (flat past tensors in, presents and chosen hidden states out) and must
not depend on the cache-object API of one transformers release.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class LlamaShape:
    """Architecture hyper-parameters; serialised as a transformers ``LlamaConfig``."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int = 1024
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def hf_config(self, bos_id: int, eos_id: int) -> dict:
        """The transformers ``config.json`` for these weights."""
        return {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "intermediate_size": self.intermediate_size,
            "hidden_act": "silu",
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rms_norm_eps": self.rms_norm_eps,
            "tie_word_embeddings": False,
            "attention_bias": False,
            "mlp_bias": False,
            "bos_token_id": bos_id,
            "eos_token_id": eos_id,
            "torch_dtype": "float16",
        }

    def as_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def inverse_frequencies(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))


def rotary(position_ids: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) ``[B, 1, S, head_dim]`` for HF-Llama rotary embedding (half-split)."""
    freqs = position_ids.unsqueeze(-1).float() * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)


def causal_bias(attention_mask: torch.Tensor, past_len, new_len) -> torch.Tensor:
    """Additive mask ``[B, S, P+S]``: causal in cache-index space (valid for left- or
    right-padded pasts) and closed on padded positions."""
    q_index = torch.arange(new_len).unsqueeze(1) + past_len
    k_index = torch.arange(past_len + new_len).unsqueeze(0)
    allowed = (k_index <= q_index).unsqueeze(0) & attention_mask.bool().unsqueeze(1)
    return (~allowed).float() * torch.finfo(torch.float32).min


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask_bias: torch.Tensor) -> torch.Tensor:
    """Grouped-query attention: q ``[B, H, S, d]``, k/v ``[B, KV, T, d]`` -> ``[B, S, H*d]``."""
    b, num_heads, s, d = q.shape
    num_kv = k.shape[1]
    # [B, kv, group, S, d] @ [B, kv, 1, d, T]: broadcasting replaces repeat_kv.
    qg = q.reshape(b, num_kv, num_heads // num_kv, s, d)
    scores = torch.matmul(qg, k.unsqueeze(2).transpose(-1, -2)) / math.sqrt(d)
    probs = torch.softmax(scores + mask_bias[:, None, None], dim=-1)
    out = torch.matmul(probs, v.unsqueeze(2)).reshape(b, num_heads, s, d)
    return out.transpose(1, 2).reshape(b, s, num_heads * d)


class Attention(nn.Module):
    """Grouped-query attention with rotary positions and an explicit KV past."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        h, d = shape.hidden_size, shape.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = shape.num_heads, shape.num_kv_heads, d
        self.q_proj = nn.Linear(h, shape.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, shape.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, shape.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(shape.num_heads * d, h, bias=False)

    def forward(self, x, cos, sin, mask_bias, past_k, past_v):
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        k = torch.cat([past_k, k], dim=2)
        v = torch.cat([past_v, v], dim=2)
        return self.o_proj(attend(q, k, v, mask_bias)), k, v


class MLP(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.up_proj = nn.Linear(shape.hidden_size, shape.intermediate_size, bias=False)
        self.down_proj = nn.Linear(shape.intermediate_size, shape.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.self_attn = Attention(shape)
        self.mlp = MLP(shape)
        self.input_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)

    def forward(self, x, cos, sin, mask_bias, past_k, past_v):
        attn, k, v = self.self_attn(self.input_layernorm(x), cos, sin, mask_bias, past_k, past_v)
        x = x + attn
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v


class LlamaBody(nn.Module):
    """``model.*`` in HF naming: embeddings, layers, final norm."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(shape) for _ in range(shape.num_layers))
        self.norm = RMSNorm(shape.hidden_size, shape.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """Decoder with an explicit KV past; returns logits, presents and every hidden state."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        self.model = LlamaBody(shape)
        self.lm_head = nn.Linear(shape.hidden_size, shape.vocab_size, bias=False)
        self.register_buffer("inv_freq", inverse_frequencies(shape.head_dim, shape.rope_theta), persistent=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, input_ids, attention_mask=None, position_ids=None, past=None):
        """Returns ``(logits, presents, hidden_states)``.

        ``hidden_states[j]`` for j <= L is the residual stream entering layer j (0 = the
        embeddings, L = the last layer's output, pre-norm); ``hidden_states[-1]`` is the
        final normalised state (what the LM head reads). ``past`` is a list of (key, value)
        ``[B, kv_heads, P, head_dim]``; ``attention_mask`` is ``[B, P+S]`` (1 = attend).
        """
        b, s = input_ids.shape
        shape = self.shape
        if past is None:
            empty = torch.zeros(b, shape.num_kv_heads, 0, shape.head_dim)
            past = [(empty, empty)] * shape.num_layers
        p = past[0][0].shape[2]
        if attention_mask is None:
            attention_mask = torch.ones(b, p + s, dtype=torch.long)
        if position_ids is None:
            position_ids = torch.arange(p, p + s).unsqueeze(0).expand(b, s)
        cos, sin = rotary(position_ids, self.inv_freq)
        mask_bias = causal_bias(attention_mask, p, s)
        x = self.model.embed_tokens(input_ids)
        hidden_states = [x]
        presents = []
        for layer, (pk, pv) in zip(self.model.layers, past):
            x, k, v = layer(x, cos, sin, mask_bias, pk, pv)
            presents.append((k, v))
            hidden_states.append(x)
        x = self.model.norm(x)
        hidden_states.append(x)
        return self.lm_head(x), presents, hidden_states
