"""GGUF files (architecture `llama`) → `Model`.

Tensors stay in the file: each `Weight` is a memory-mapped view in its GGUF storage
type (q8_0, q4_1, … are carried as they are). llama.cpp's converter permutes the rows
of `attn_q` and `attn_k` for its interleaved RoPE; the weight store records the inverse
row order so the graph uses the rotate-half RoPE that Hugging Face models use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader

from llmc.errors import ModelFormatError
from llmc.frontend import tokenizer as tok
from llmc.frontend.model import Model, ModelConfig
from llmc.ir.llm import Storage
from llmc.ir.weights import Weight, WeightStore

GGUF_MAGIC = b"GGUF"
SUPPORTED_ARCHITECTURES = ("llama", "qwen2")
# Architectures whose converter permuted Q/K rows for llama.cpp's interleaved RoPE.
_PERMUTED_QK = ("llama",)

_STORAGE = {
    GGMLQuantizationType.F32: Storage.F32,
    GGMLQuantizationType.F16: Storage.F16,
    GGMLQuantizationType.BF16: Storage.BF16,
    GGMLQuantizationType.Q8_0: Storage.Q8_0,
    GGMLQuantizationType.Q4_0: Storage.Q4_0,
    GGMLQuantizationType.Q4_1: Storage.Q4_1,
    GGMLQuantizationType.Q4_K: Storage.Q4_K,
    GGMLQuantizationType.Q6_K: Storage.Q6_K,
}


def _read(path: Path) -> GGUFReader:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelFormatError(path, f"cannot read: {e.strerror}") from e
    if magic != GGUF_MAGIC:
        raise ModelFormatError(path, f"not a GGUF file (magic {magic!r}, expected {GGUF_MAGIC!r})")
    try:
        return GGUFReader(path)
    except Exception as e:  # the gguf reader raises ValueError, KeyError, IndexError, … on bad input
        raise ModelFormatError(path, f"malformed GGUF: {e}") from e


class _Metadata:
    """Typed access to GGUF key/value metadata with errors that name the key."""

    def __init__(self, path: Path, reader: GGUFReader):
        self.path = path
        self.fields = reader.fields

    def get(self, key: str, default: Any = None) -> Any:
        field = self.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str, kind: type) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelFormatError(self.path, f"missing metadata key '{key}'")
        if kind is int and isinstance(value, (int, np.integer)) and not isinstance(value, bool):
            return int(value)
        if kind is float and isinstance(value, (int, float, np.number)):
            return float(value)
        if isinstance(value, kind):
            return value
        raise ModelFormatError(self.path, f"metadata key '{key}' should be {kind.__name__}, got {type(value).__name__}")


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation: logical row → stored row."""
    half = rows // heads // 2
    # stored row (h, j, t) with t in {0,1} holds logical row (h, t, j)
    return np.arange(rows).reshape(heads, half, 2).transpose(0, 2, 1).reshape(rows)


def _weights(path: Path, reader: GGUFReader, heads: int, kv_heads: int, permuted_qk: bool) -> WeightStore:
    store = WeightStore(path)
    for t in reader.tensors:
        if t.tensor_type not in _STORAGE:
            raise ModelFormatError(path, f"tensor '{t.name}' has unsupported type {t.tensor_type.name}")
        name = t.name.removesuffix(".weight")
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        storage = _STORAGE[t.tensor_type]
        data = t.data
        if storage is Storage.BF16:
            data = data.view(np.uint16)
        row_order = None
        if permuted_qk and name.endswith((".attn_q", ".attn_k", ".attn_q.bias", ".attn_k.bias")):
            n_heads = heads if ".attn_q" in name else kv_heads
            if shape[0] % (2 * n_heads):
                raise ModelFormatError(path, f"tensor '{t.name}' has {shape[0]} rows, not a multiple of 2 x {n_heads} heads")
            row_order = _unpermute_rows(shape[0], n_heads)
        store.add(Weight(name, storage, shape, data.reshape(shape[0], -1) if len(shape) > 1 else data, row_order))
    return store


def load_gguf(path: Path) -> Model:
    """Read a GGUF file's config, weights (lazily) and tokenizer recipe."""
    reader = _read(path)
    meta = _Metadata(path, reader)
    arch = meta.require("general.architecture", str)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFormatError(path, f"unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    a = arch + "."
    hidden = meta.require(a + "embedding_length", int)
    heads = meta.require(a + "attention.head_count", int)
    kv_heads = meta.get(a + "attention.head_count_kv", heads)
    if heads < 1 or not isinstance(kv_heads, int) or kv_heads < 1:
        raise ModelFormatError(path, f"invalid head counts: {heads} heads, {kv_heads} KV heads")
    if hidden % heads:
        raise ModelFormatError(path, f"embedding length {hidden} is not a multiple of {heads} heads")
    scaling = meta.get(a + "rope.scaling.type", "none")
    if scaling != "none" or float(meta.get(a + "rope.scaling.factor", 1.0)) not in (0.0, 1.0):
        raise ModelFormatError(path, f"RoPE scaling ({scaling}) is not supported yet")
    weights = _weights(path, reader, heads, kv_heads, arch in _PERMUTED_QK)
    if "token_embd" not in weights:
        raise ModelFormatError(path, "missing tensor 'token_embd'")
    tokens = meta.get("tokenizer.ggml.tokens")
    config = ModelConfig(
        arch=arch,
        vocab_size=weights["token_embd"].shape[0],
        hidden=hidden,
        layers=meta.require(a + "block_count", int),
        heads=heads,
        kv_heads=kv_heads,
        head_dim=int(meta.get(a + "rope.dimension_count", hidden // heads)),
        ffn=meta.require(a + "feed_forward_length", int),
        rope_theta=float(meta.get(a + "rope.freq_base", 10000.0)),
        rms_eps=meta.require(a + "attention.layer_norm_rms_epsilon", float),
        context_length=meta.require(a + "context_length", int),
        tied_embeddings="output" not in weights,
        qkv_bias="blk.0.attn_q.bias" in weights,
    )
    config.check(path)
    if tokens is not None and len(tokens) != config.vocab_size:
        raise ModelFormatError(path, f"tokenizer has {len(tokens)} tokens, token_embd has {config.vocab_size} rows")

    def make_tokenizer() -> tok.TextTokenizer:
        if tokens is None:
            raise ModelFormatError(path, "no tokenizer in this GGUF file (tokenizer.ggml.tokens is missing)")
        return tok.from_gguf_vocab(
            path,
            model=meta.require("tokenizer.ggml.model", str),
            pre=meta.get("tokenizer.ggml.pre", "default"),
            tokens=tokens,
            token_types=meta.get("tokenizer.ggml.token_type"),
            merges=meta.get("tokenizer.ggml.merges", []),
            bos_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_id=meta.get("tokenizer.ggml.eos_token_id"),
            add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", False)),
            chat_template=meta.get("tokenizer.chat_template"),
        )

    return Model(path, config, weights, make_tokenizer)
