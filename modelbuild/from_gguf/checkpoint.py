"""A Llama GGUF read as a Hugging Face checkpoint: its config, and its tensors under
Hugging Face's names and row order, still in the file's own encoding.

llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the
rows of every query and key projection so that ggml's interleaved rotary embedding
computes what Hugging Face's half-split one does. The graph here uses the half-split
form, so those rows are put back (transformers' GGUF loader does the same,
``reverse_permute_weights``). Rows are whole quantisation blocks' owners (blocks run
along the input axis), so reordering rows moves blocks intact: nothing is re-quantised.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

# ggml block layouts this module decodes: (weights per block, bytes per block).
Q4_1_BLOCK = (32, 20)  # float16 scale d, float16 minimum m, 16 bytes of 4-bit q: w = d * q + m
Q8_0_BLOCK = (32, 34)  # float16 scale d, 32 int8 q: w = d * q

_LAYER_NAMES = {  # GGUF ``blk.{i}.<key>`` -> Hugging Face ``model.layers.{i}.<value>``
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}


@dataclass(frozen=True)
class GgufTensor:
    """One tensor in the file's encoding: ``data`` is ``[rows, bytes per row]`` for a
    block-quantised matrix, else the float array itself; ``shape`` is Hugging Face's
    (``[out, in]`` for a matrix)."""

    name: str
    encoding: str  # ggml type name: F32, F16, Q4_1, Q8_0, ...
    shape: tuple[int, ...]
    data: np.ndarray

    def dequantize(self) -> np.ndarray:
        """The float32 values (exact: each is a float16 scale times a small integer, plus
        a float16 minimum for Q4_1)."""
        if self.encoding in ("F32", "F16"):
            return self.data.astype(np.float32).reshape(self.shape)
        if self.encoding == "Q4_1":
            d, m, q = q4_1_parts(self.data)
            return (d[..., None] * q + m[..., None]).reshape(self.shape)
        if self.encoding == "Q8_0":
            d, q = q8_0_parts(self.data)
            return (d[..., None] * q).reshape(self.shape)
        import gguf

        return gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType[self.encoding]).reshape(self.shape)


def q4_1_parts(data: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_1 rows ``[N, B * 20]`` -> scales ``d [N, B]``, minima ``m [N, B]`` (float32) and
    ``q [N, B, 32]`` (uint8, 0..15), so that ``w = d * q + m``. ggml packs a block's
    weights 0-15 in the low nibbles of its 16 bytes and 16-31 in the high ones."""
    blocks = np.ascontiguousarray(data).reshape(data.shape[0], -1, Q4_1_BLOCK[1])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    packed = blocks[..., 4:]
    return d, m, np.concatenate([packed & 0x0F, packed >> 4], axis=-1)


def q8_0_parts(data: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q8_0 rows ``[N, B * 34]`` -> scales ``d [N, B]`` (float32) and ``q [N, B, 32]``
    (int8), so that ``w = d * q``."""
    blocks = np.ascontiguousarray(data).reshape(data.shape[0], -1, Q8_0_BLOCK[1])
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    return d, blocks[..., 2:].copy().view(np.int8)


def unpermute_rows(data: np.ndarray, heads: int) -> np.ndarray:
    """Undo ``LlamaModel.permute`` on a projection's rows (the first axis): per head, the
    file holds rows (0, d/2, 1, d/2 + 1, ...); Hugging Face holds (0, 1, ..., d - 1)."""
    rows = data.shape[0]
    half = rows // heads // 2
    return data.reshape(heads, half, 2, *data.shape[1:]).swapaxes(1, 2).reshape(data.shape)


class GgufCheckpoint:
    """The metadata and tensors of one Llama-architecture GGUF (``gguf``'s reader: numpy only)."""

    def __init__(self, path: str | Path) -> None:
        import gguf  # the gguf extra: a conversion tool, never a runtime dependency

        self.path = Path(path)
        self._reader = gguf.GGUFReader(str(self.path))
        architecture = self.field("general.architecture")
        if architecture != "llama":
            raise ValueError(f"{self.path}: only Llama-architecture GGUFs convert, this one is '{architecture}'")
        self._tensors = {t.name: t for t in self._reader.tensors}

    def field(self, key: str, default=None):
        field = self._reader.fields.get(key)
        return default if field is None else field.contents()

    def llama(self, key: str, default=None):
        return self.field(f"llama.{key}", default)

    def config(self) -> dict:
        """A Hugging Face ``LlamaConfig`` (``config.json``) for the file's model."""
        hidden, heads = int(self.llama("embedding_length")), int(self.llama("attention.head_count"))
        if self.llama("rope.scaling.type") not in (None, "none"):
            raise ValueError(f"{self.path}: rope scaling '{self.llama('rope.scaling.type')}' is not supported")
        vocab = int(self.llama("vocab_size") or len(self.field("tokenizer.ggml.tokens")))
        return {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": vocab, "hidden_size": hidden,
            "num_hidden_layers": int(self.llama("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.llama("attention.head_count_kv", heads)),
            "head_dim": int(self.llama("rope.dimension_count", hidden // heads)),
            "intermediate_size": int(self.llama("feed_forward_length")),
            "hidden_act": "silu",
            "max_position_embeddings": int(self.llama("context_length")),
            "rope_theta": float(self.llama("rope.freq_base", 10000.0)),
            # stored as float32 (9.999999747e-06): written as the decimal it stands for
            "rms_norm_eps": float(f"{self.llama('attention.layer_norm_rms_epsilon'):.7g}"),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": False, "mlp_bias": False,
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.field("tokenizer.ggml.eos_token_id"),
            "pad_token_id": self.field("tokenizer.ggml.padding_token_id"),
            "torch_dtype": "float32",
        }

    def tensor(self, hf_name: str) -> GgufTensor:
        """The tensor Hugging Face calls ``hf_name``, in Hugging Face's row order (a tied
        ``lm_head.weight`` is the embedding table)."""
        name = self._gguf_name(hf_name)
        raw = self._tensors[name]
        shape = tuple(int(n) for n in reversed(raw.shape))  # ggml lists the fastest axis first
        data = np.asarray(raw.data)
        if hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = self.llama("attention.head_count" if "q_proj" in hf_name else "attention.head_count_kv")
            data = unpermute_rows(data, int(heads))
        return GgufTensor(hf_name, raw.tensor_type.name, shape, data)

    def _gguf_name(self, hf_name: str) -> str:
        if hf_name == "lm_head.weight" and "output.weight" not in self._tensors:
            return "token_embd.weight"
        for gguf_name, name in _GLOBAL_NAMES.items():
            if name == hf_name:
                return gguf_name
        prefix = "model.layers."
        if hf_name.startswith(prefix):
            layer, rest = hf_name[len(prefix):].split(".", 1)
            for gguf_key, key in _LAYER_NAMES.items():
                if key == rest:
                    return f"blk.{layer}.{gguf_key}"
        raise KeyError(f"{hf_name}: no GGUF tensor corresponds to it")

    def encodings(self) -> dict[str, int]:
        """How many tensors the file stores in each encoding."""
        counts: dict[str, int] = {}
        for t in self._reader.tensors:
            counts[t.tensor_type.name] = counts.get(t.tensor_type.name, 0) + 1
        return counts


def sha256_of(path: Path, chunk: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()
