"""GGUF files (architectures `llama` (with experts: Mixtral), `qwen2`, `qwen3`, `qwen3moe`, `phi3`,
`gemma2`, `gemma3`) → `Model`.

The file is parsed by the bounded reader in `gguf_reader`; tensors stay in the file:
each `Weight` is a memory-mapped view in its GGUF storage type (q8_0, q4_1, … are
carried as they are). llama.cpp's converter permutes the rows of `attn_q` and `attn_k`
of Llama models for its interleaved RoPE; the weight store records the inverse row
order so the graph uses the rotate-half RoPE that Hugging Face models use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from llmc.errors import ModelFormatError
from llmc.frontend import tokenizer as tok
from llmc.frontend.gguf_reader import GGUFFile, read_gguf
from llmc.frontend.model import Model, ModelConfig, check_declared_sizes, split_fused
from llmc.ir.activations import Activation
from llmc.ir.formats import GGUF_STORAGE, Storage
from llmc.ir.weights import Weight, WeightStore
from llmc.runtime.codec import TextCodec

SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "phi3", "gemma2", "gemma3")
# Architectures whose converter permuted Q/K rows for llama.cpp's interleaved RoPE.
_PERMUTED_QK = ("llama",)
# Architectures whose `attention.sliding_window` applies to every layer.
_WINDOWED_EVERYWHERE = ("llama", "phi3")
# Gemma: 1 global layer after every N-1 sliding ones (`attention.sliding_window_pattern`, these by
# default), the window's size by default, and the layer counts of the 27B models, whose queries
# llama.cpp scales by hidden/heads rather than head_dim (Google's query_pre_attn_scalar)
_GEMMA = {"gemma2": (2, 4096, 46), "gemma3": (6, None, 62)}
# RoPE frequency tables llama.cpp's converters store as tensors (not graph weights).
_ROPE_TABLES = ("rope_freqs", "rope_factors_short", "rope_factors_long")

# the numpy type of unquantized GGUF data
_FLOAT_DTYPES = {Storage.F32: np.float32, Storage.F16: np.float16, Storage.BF16: np.uint16}


_KINDS = {
    int: ("an integer", lambda v: type(v) is int),
    float: ("a number", lambda v: type(v) in (int, float)),
    str: ("a string", lambda v: isinstance(v, str)),
    bool: ("true or false", lambda v: type(v) is bool),
    "strings": ("an array of strings", lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v)),
    "integers": ("an array of integers", lambda v: isinstance(v, np.ndarray) and np.issubdtype(v.dtype, np.integer)),
}


class _Metadata:
    """Typed access to GGUF metadata with errors that name the key."""

    def __init__(self, gguf: GGUFFile):
        self.path = gguf.path
        self.values = gguf.metadata

    def get(self, key: str, kind: object, default: Any = None) -> Any:
        value = self.values.get(key)
        if value is None:
            return default
        name, accepts = _KINDS[kind]
        if not accepts(value):
            found = f"an array of {len(value)}" if isinstance(value, (list, np.ndarray)) else repr(value)
            raise ModelFormatError(self.path, f"metadata key '{key}' should be {name}, got {found}")
        return float(value) if kind is float else value

    def require(self, key: str, kind: object) -> Any:
        value = self.get(key, kind)
        if value is None:
            raise ModelFormatError(self.path, f"missing metadata key '{key}'")
        return value


def _unpermute_rows(rows: int, heads: int) -> np.ndarray:
    """Inverse of llama.cpp's Q/K permutation: logical row → stored row."""
    half = rows // heads // 2
    # stored row (h, j, t) with t in {0,1} holds logical row (h, t, j)
    return np.arange(rows).reshape(heads, half, 2).transpose(0, 2, 1).reshape(rows)


def _weights(gguf: GGUFFile, heads: int, kv_heads: int, permuted_qk: bool) -> WeightStore:
    store = WeightStore(gguf.path)
    for t in gguf.tensors:
        if t.type_name not in GGUF_STORAGE:
            raise ModelFormatError(gguf.path, f"tensor '{t.name}' has type {t.type_name}, which llmc cannot compute "
                                              f"(it computes {', '.join(GGUF_STORAGE)})")
        storage = GGUF_STORAGE[t.type_name]
        name = t.name.removesuffix(".weight")
        dtype = _FLOAT_DTYPES.get(storage)
        data = t.data.view(dtype) if dtype is not None else t.data
        row_order = None
        if permuted_qk and name.endswith((".attn_q", ".attn_k", ".attn_q.bias", ".attn_k.bias")):
            n_heads = heads if ".attn_q" in name else kv_heads
            if t.shape[0] % (2 * n_heads):
                raise ModelFormatError(gguf.path, f"tensor '{t.name}' has {t.shape[0]} rows, not a multiple of 2 x {n_heads} heads")
            row_order = _unpermute_rows(t.shape[0], n_heads)
        store.add(Weight(name, storage, t.shape, data, row_order))
    return store


def _check_token_ids(meta: _Metadata, vocab: int) -> None:
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "eot_token_id",
                "eom_token_id"):
        value = meta.get("tokenizer.ggml." + key, int)
        if value is not None and not 0 <= value < vocab:
            raise ModelFormatError(meta.path, f"metadata key 'tokenizer.ggml.{key}': id {value} is outside the vocabulary of {vocab}")


def _rope(meta: _Metadata, weights: WeightStore, a: str, head_dim: int, dims: int, context: int) -> dict:
    """`ModelConfig`'s RoPE fields: `dims` (`rope.dimension_count`: partial rotary), linear scaling, and the
    per-pair frequency factors llama.cpp's converters store as tensors (`rope_freqs`: Llama 3's;
    `rope_factors_short`: Phi-3's LongRoPE, with `rope.scaling.attn_factor`, the context capped at
    `rope.scaling.original_context_length`, where the short factors hold)."""
    path = meta.path
    scaling = meta.get(a + "rope.scaling.type", str, "none")
    factor = meta.get(a + "rope.scaling.factor", float, 1.0)
    tables = {name: weights.entries.pop(name) for name in _ROPE_TABLES if name in weights}
    for name, table in tables.items():
        if table.storage is not Storage.F32 or table.shape != (dims // 2,):
            raise ModelFormatError(path, f"tensor '{name}' must be {dims // 2} f32 values (one per rotating pair)")
    factors: tuple[float, ...] = ()
    if "rope_freqs" in tables:
        factors = tuple(float(v) for v in tables["rope_freqs"].to_f32())
    elif "rope_factors_short" in tables:
        factors = tuple(float(v) for v in tables["rope_factors_short"].to_f32())
    if scaling == "linear" and factor not in (0.0, 1.0):
        if factors:
            raise ModelFormatError(path, "linear RoPE scaling and frequency factors together are not supported")
        factors = (factor,) * (dims // 2)
    elif scaling not in ("none", "linear"):
        raise ModelFormatError(path, f"RoPE scaling '{scaling}' in a GGUF file is not supported yet (none, linear)")
    if "rope_factors_short" in tables:
        context = min(context, meta.get(a + "rope.scaling.original_context_length", int, context))
    return {
        "context_length": context,
        "rope_theta": meta.get(a + "rope.freq_base", float, 10000.0),
        "rope_dims": 0 if dims == head_dim else dims,
        "rope_factors": factors,
        "rope_mscale": meta.get(a + "rope.scaling.attn_factor", float, 1.0) if "rope_factors_short" in tables else 1.0,
    }


def _experts(meta: _Metadata, a: str, ffn: int) -> dict:
    """A mixture of experts' fields (`expert_count`, …; Mixtral is a `llama` with experts), their
    weights renormalized as llama.cpp always does for these architectures."""
    experts = meta.get(a + "expert_count", int, 0)
    if not experts:
        return {}
    return {"experts": experts, "experts_used": meta.require(a + "expert_used_count", int),
            "expert_ffn": meta.get(a + "expert_feed_forward_length", int, ffn), "experts_normalized": True}


def load_gguf(path: Path) -> Model:
    """Read a GGUF file's config, weights (lazily) and tokenizer recipe."""
    gguf = read_gguf(path)
    meta = _Metadata(gguf)
    if not gguf.tensors:
        raise ModelFormatError(path, "holds no tensors (a vocabulary-only GGUF?): nothing to compile; "
                                     "'llmc tokenize' reads its tokenizer")
    arch = meta.require("general.architecture", str)
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelFormatError(path, f"unsupported architecture '{arch}' (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    a = arch + "."
    hidden = meta.require(a + "embedding_length", int)
    heads = meta.require(a + "attention.head_count", int)
    kv_heads = meta.get(a + "attention.head_count_kv", int, heads)
    if heads < 1 or kv_heads < 1:
        raise ModelFormatError(path, f"head counts must be positive, got {heads} heads and {kv_heads} KV heads")
    if heads % kv_heads:
        raise ModelFormatError(path, f"{heads} attention heads are not a multiple of {kv_heads} KV heads")
    head_dim = meta.get(a + "attention.key_length", int)
    if head_dim is None:
        if hidden % heads:
            raise ModelFormatError(path, f"embedding length {hidden} is not a multiple of {heads} heads")
        head_dim = hidden // heads
    if meta.get(a + "attention.value_length", int, head_dim) != head_dim:
        raise ModelFormatError(path, "attention.value_length differs from attention.key_length, which llmc does not support")
    weights = _weights(gguf, heads, kv_heads, arch in _PERMUTED_QK)
    if "token_embd" not in weights:
        raise ModelFormatError(path, "missing tensor 'token_embd'")
    layers = meta.require(a + "block_count", int)
    ffn = meta.require(a + "feed_forward_length", int)
    dims = meta.get(a + "rope.dimension_count", int, head_dim)
    family = _experts(meta, a, ffn)  # what a family adds to ModelConfig's Llama fields
    expert_sizes = {a + "expert_count": family["experts"], a + "expert_used_count": family["experts_used"],
                    a + "expert_feed_forward_length": family["expert_ffn"]} if family else {}
    check_declared_sizes(path, weights, (a + "block_count", layers), {
        a + "embedding_length": hidden, a + "attention.head_count": heads, a + "attention.head_count_kv": kv_heads,
        a + "attention.key_length": head_dim, "head_count x key_length": heads * head_dim,
        a + "feed_forward_length": ffn, a + "rope.dimension_count": dims, **expert_sizes})
    rope = _rope(meta, weights, a, head_dim, dims, meta.require(a + "context_length", int))
    if arch == "phi3":  # its `ffn_up` holds gate and up: `split_fused` takes them apart
        for i in range(layers):
            if f"blk.{i}.ffn_up" in weights and f"blk.{i}.ffn_gate" not in weights:
                weights.add(replace(weights.entries.pop(f"blk.{i}.ffn_up"), name=f"blk.{i}.ffn_gate_up"))
    window = meta.get(a + "attention.sliding_window", int)
    sliding = tuple(range(layers)) if window and arch in _WINDOWED_EVERYWHERE else ()
    if arch in _GEMMA:
        pattern, default_window, layers_27b = _GEMMA[arch]
        window = window or default_window
        pattern = meta.values.get(a + "attention.sliding_window_pattern", pattern)
        if isinstance(pattern, np.ndarray):  # one flag per layer
            if pattern.shape != (layers,):
                raise ModelFormatError(path, f"attention.sliding_window_pattern has {pattern.size} flags for {layers} layers")
            sliding = tuple(int(i) for i in np.flatnonzero(pattern)) if window else ()
        elif type(pattern) is int and pattern >= 0:  # N-1 sliding layers, then a global one (0: all sliding)
            sliding = tuple(i for i in range(layers) if not pattern or (i + 1) % pattern) if window else ()
        else:
            raise ModelFormatError(path, f"attention.sliding_window_pattern must be a count or per-layer flags, got {pattern!r}")
        family = {"embedding_scale": float(np.float32(hidden ** 0.5)), "activation": Activation.GELU_TANH,
                 "post_norms": True,
                 "attn_scale": (hidden / heads if layers == layers_27b else head_dim) ** -0.5,
                 # llama.cpp's defaults: Gemma 2 soft-caps at 50 and 30, Gemma 3 does not
                 "attn_softcap": meta.get(a + "attn_logit_softcapping", float, 50.0) if arch == "gemma2" else None,
                 "final_softcap": meta.get(a + "final_logit_softcapping", float, 30.0 if arch == "gemma2" else 0.0)
                 or None,
                 "local_rope_theta": meta.get(a + "rope.freq_base_swa", float, 10000.0) if arch == "gemma3" else None}
        if arch == "gemma2" and meta.get(a + "rope.freq_base_swa", float, rope["rope_theta"]) != rope["rope_theta"]:
            raise ModelFormatError(path, "Gemma 2 with its own RoPE base for the sliding layers is not supported yet")
    config = ModelConfig(
        arch=arch,
        vocab_size=weights["token_embd"].shape[0],
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=ffn,
        rms_eps=meta.require(a + "attention.layer_norm_rms_epsilon", float),
        tied_embeddings="output" not in weights,
        qkv_bias="blk.0.attn_q.bias" in weights,
        qk_norm=arch in ("qwen3", "qwen3moe", "gemma3"),
        sliding_window=window if sliding else None,
        sliding_layers=sliding,
        **rope,
        **family,
    )
    config.check(path)
    split_fused(config, weights)
    return Model(path, config, weights, _tokenizer_recipe(meta, config.vocab_size))


def _tokenizer_recipe(meta: _Metadata, vocab_size: int | None) -> Callable[[], TextCodec]:
    """Check the file's tokenizer metadata now (against the embedding's rows, where there is one);
    build the tokenizer when called."""
    path = meta.path
    tokens = meta.get("tokenizer.ggml.tokens", "strings")
    types = meta.get("tokenizer.ggml.token_type", "integers")
    merges = meta.get("tokenizer.ggml.merges", "strings", [])
    scores = meta.values.get("tokenizer.ggml.scores")
    if scores is not None and not (isinstance(scores, np.ndarray) and scores.dtype.kind in "fiu"):
        raise ModelFormatError(path, "metadata key 'tokenizer.ggml.scores' should be an array of numbers")
    if tokens is not None:
        if vocab_size is not None and len(tokens) != vocab_size:
            raise ModelFormatError(path, f"tokenizer has {len(tokens)} tokens, token_embd has {vocab_size} rows")
        for key, values in (("token_type", types), ("scores", scores)):
            if values is not None and len(values) != len(tokens):
                raise ModelFormatError(path, f"tokenizer.ggml.{key} has {len(values)} entries for {len(tokens)} tokens")
        _check_token_ids(meta, len(tokens))

    def make_tokenizer() -> TextCodec:
        if tokens is None:
            raise ModelFormatError(path, "no tokenizer in this GGUF file (tokenizer.ggml.tokens is missing)")
        return tok.from_gguf_vocab(
            path,
            model=meta.require("tokenizer.ggml.model", str),
            pre=meta.get("tokenizer.ggml.pre", str, "default"),
            tokens=tokens,
            token_types=[] if types is None else types.tolist(),
            merges=merges,
            scores=None if scores is None else scores.tolist(),
            bos_id=meta.get("tokenizer.ggml.bos_token_id", int),
            eos_id=meta.get("tokenizer.ggml.eos_token_id", int),
            add_bos=meta.get("tokenizer.ggml.add_bos_token", bool),
            add_space_prefix=meta.get("tokenizer.ggml.add_space_prefix", bool),
            chat_template=meta.get("tokenizer.chat_template", str),
            name=meta.get("general.name", str),
            stop_ids=[i for key in ("eot_token_id", "eom_token_id")
                      if (i := meta.get("tokenizer.ggml." + key, int)) is not None],
        )

    return make_tokenizer


def load_gguf_tokenizer(path: Path) -> TextCodec:
    """The tokenizer of a GGUF file from its metadata alone: a model's, or a vocabulary-only file's
    (as llama.cpp's `models/ggml-vocab-*.gguf`, which hold no tensors)."""
    return _tokenizer_recipe(_Metadata(read_gguf(path)), None)()
