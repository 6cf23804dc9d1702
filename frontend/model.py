"""What every frontend produces: the model's hyper-parameters, its weights, its tokenizer.

`ModelConfig` holds the facts of a Llama-family decoder under one set of names, so the
GGUF and Hugging Face frontends meet here and `frontend.llama` builds the same IR from
either. `ModelConfig.check` rejects hyper-parameters that contradict each other.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from xdsl.dialects.builtin import ModuleOp

from llmc.errors import ModelFormatError
from llmc.ir import llm
from llmc.ir.activations import Activation
from llmc.ir.weights import WeightStore
from llmc.runtime.codec import TextCodec

F32_MAX = float(np.finfo(np.float32).max)
MAX_POSITIONS = 2**31 - 1  # positions are i32 in the IR


def finite(value: object) -> float | None:
    """`value` as a finite float, or None where it is no finite number (a bool, a string, NaN, 10**400)."""
    if type(value) not in (int, float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


def rope_base(source: object, key: str, value: float) -> float:
    """A RoPE base that its float32 frequency table can hold: positive and below float32's largest."""
    if not F32_MAX > value > 0:
        raise ModelFormatError(source, f"{key} must be a positive number below {F32_MAX:.3g}, got {value}")
    return value


def check_declared_sizes(source: object, weights: WeightStore, layers: tuple[str, int], widths: dict[str, int]) -> None:
    """Refuse declared sizes that the tensors present cannot hold, before anything proportional to
    them is allocated or looped over: each of `layers` needs tensors of its own, and each of
    `widths` (heads, head sizes, experts, ...) is at most the tensor count or the largest
    dimension present. Sizes are named by the file's own keys."""
    tensors = len(weights)
    widest = max((d for w in weights.entries.values() for d in w.shape), default=0)
    checks = [(*layers, tensors, f"the {tensors} tensors present")]
    checks += [(key, value, max(tensors, widest), f"the largest dimension ({widest}) and tensor count ({tensors}) present")
               for key, value in widths.items()]
    for key, value, bound, what in checks:
        if value < 1:
            raise ModelFormatError(source, f"{key} must be a positive integer, got {value}")
        if value > bound:
            raise ModelFormatError(source, f"{key} {value} exceeds {what}")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama, SmolLM, Qwen2/3, Mistral, Phi-3, Gemma 2/3).

    What the families add to Llama's block is optional here: RoPE scaling and partial
    rotary (`rope_dims`, `rope_factors`, `rope_mscale`, as `#llm.rope` carries them),
    per-head q/k RMSNorm (`qk_norm`), sliding-window attention in `sliding_layers` (with
    their own RoPE base, `local_rope_theta`), the gate's `activation` (Gemma's GeGLU:
    `gelu_tanh`), and Gemma's: the embedding scaled, norms after attention and after the
    feed-forward (`post_norms`), attention scores scaled by `attn_scale` and soft-capped,
    final logits soft-capped; a mixture of
    experts' `experts`, `experts_used` per token, `expert_ffn` wide, their weights
    `experts_normalized` or not.
    """

    arch: str
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    rope_theta: float
    rms_eps: float
    context_length: int
    tied_embeddings: bool
    qkv_bias: bool = False
    rope_dims: int = 0  # rotating elements of a head; 0: all of them
    rope_factors: tuple[float, ...] = ()  # per rotating pair, the frequency's divisor
    rope_mscale: float = 1.0
    qk_norm: bool = False
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()  # the layers that attend within `sliding_window`
    local_rope_theta: float | None = None  # the RoPE base of the sliding layers, where it differs
    embedding_scale: float | None = None
    activation: Activation = Activation.SILU
    post_norms: bool = False
    attn_scale: float | None = None
    attn_softcap: float | None = None
    final_softcap: float | None = None
    experts: int = 0  # mixture of experts (Mixtral, Qwen3-MoE): the feed-forward is `llm.moe`
    experts_used: int = 0
    expert_ffn: int = 0
    experts_normalized: bool = False

    @property
    def rope(self) -> llm.RopeAttr:
        return llm.RopeAttr(self.rope_theta, self.rope_dims, self.rope_mscale, self.rope_factors)

    def rope_for(self, layer: int) -> llm.RopeAttr:
        """The RoPE of `layer`: the sliding layers' own base where there is one."""
        if layer in self.sliding_layers and self.local_rope_theta is not None:
            return llm.RopeAttr(self.local_rope_theta, self.rope_dims)
        return self.rope

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention, or None (it sees every earlier position)."""
        return self.sliding_window if layer in self.sliding_layers else None

    IDENTITY = ("arch", "layers", "hidden", "heads", "kv_heads", "head_dim", "vocab_size")  # an artifact's `model`

    def other_than(self, recorded: dict) -> tuple[str, object, object] | None:
        """The first field in which this model differs from the one an artifact's manifest `recorded` (its
        `model` facts): (name, the recorded value, this model's); None for the same shapes."""
        return next(((name, recorded.get(name), getattr(self, name)) for name in self.IDENTITY
                     if recorded.get(name) != getattr(self, name)), None)

    def check(self, source: object) -> None:
        """Raise `ModelFormatError` when the numbers cannot describe one model."""
        for name in ("vocab_size", "hidden", "layers", "heads", "kv_heads", "head_dim", "ffn", "context_length"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelFormatError(source, f"{name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise ModelFormatError(source, f"{self.heads} attention heads are not a multiple of {self.kv_heads} KV heads")
        if self.head_dim % 2:
            raise ModelFormatError(source, f"head dimension {self.head_dim} must be even for RoPE")
        rope_base(source, "rope theta", self.rope_theta)
        if not 0 < self.rms_eps < 1:
            raise ModelFormatError(source, f"RMSNorm epsilon must be in (0, 1), got {self.rms_eps}")
        dims = self.rope_dims or self.head_dim
        if dims % 2 or dims > self.head_dim:
            raise ModelFormatError(source, f"{dims} rotary dimensions must be even and at most the head dimension "
                                           f"{self.head_dim}")
        if self.rope_factors and (len(self.rope_factors) != dims // 2
                                  or not all(F32_MAX > f > 0 for f in self.rope_factors)):
            raise ModelFormatError(source, f"RoPE frequency factors must be {dims // 2} positive numbers below "
                                           f"{F32_MAX:.3g}, got {len(self.rope_factors)} from {min(self.rope_factors)} "
                                           f"to {max(self.rope_factors)}")
        if not F32_MAX > self.rope_mscale > 0:
            raise ModelFormatError(source, f"RoPE attention factor must be positive, got {self.rope_mscale}")
        if self.context_length > MAX_POSITIONS:
            raise ModelFormatError(source, f"context length {self.context_length} exceeds {MAX_POSITIONS} positions")
        if self.sliding_layers and not (isinstance(self.sliding_window, int) and 0 < self.sliding_window <= MAX_POSITIONS):
            raise ModelFormatError(source, f"sliding window must be an integer in 1..{MAX_POSITIONS}, got {self.sliding_window!r}")
        if self.experts and not (0 < self.experts_used <= self.experts and self.expert_ffn > 0):
            raise ModelFormatError(source, f"{self.experts_used} of {self.experts} experts, each of width "
                                           f"{self.expert_ffn}, cannot describe a mixture of experts")
        if self.local_rope_theta is not None:
            rope_base(source, "local rope theta", self.local_rope_theta)
        for name in ("embedding_scale", "attn_scale", "attn_softcap", "final_softcap"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, float) and F32_MAX > value > 0):
                raise ModelFormatError(source, f"{name} must be a positive number, got {value!r}")


@dataclass
class Model:
    """An imported model: where it came from, its config, its weights and its tokenizer.

    The tokenizer is built on first use (`tokenizer`), so that `llmc ir` on a model whose
    tokenizer llmc cannot build still works. A graph frontend's model carries its imported
    `graph`; its `config` is known once `optimize` has raised it (`frontend.graph.graph_config`).
    """

    source: Path
    config: ModelConfig  # of a graph (`graph`), set by `optimize` from the raised IR
    weights: WeightStore
    make_tokenizer: Callable[[], TextCodec]
    graph: ModuleOp | None = None  # an exported graph's `llm` import (torch.export, ONNX), where there is one

    @cached_property
    def tokenizer(self) -> TextCodec:
        return self.make_tokenizer()

    def check_bos(self) -> None:
        """The token put before every prompt is one of the model's: an artifact whose is not would
        be refused by the runtime (a tokenizer may hold more tokens than the embedding has rows)."""
        codec = self.tokenizer
        if codec.add_bos and codec.bos_id is not None and codec.bos_id >= self.config.vocab_size:
            raise ModelFormatError(self.source, f"the tokenizer puts token {codec.bos_id} before every prompt, "
                                                f"outside the model's vocabulary of {self.config.vocab_size}")


# fused tensors (Phi-3's `qkv_proj` and `gate_up_proj`, as HF and GGUF store them) → their parts
FUSED = ("attn_qkv", "ffn_gate_up")


def split_fused(config: ModelConfig, weights: WeightStore) -> None:
    """Replace each layer's fused QKV and gate-up matrices by the parts the graph names,
    slicing rows (no copy of a memory-mapped file's float data)."""
    q_width, kv_width = config.heads * config.head_dim, config.kv_heads * config.head_dim
    parts = {"attn_qkv": (("attn_q", q_width), ("attn_k", kv_width), ("attn_v", kv_width)),
             "ffn_gate_up": (("ffn_gate", config.ffn), ("ffn_up", config.ffn))}
    for name in [n for n in weights if n.rsplit(".", 1)[-1] in FUSED]:
        fused = weights.entries.pop(name)
        prefix, kind = name.rsplit(".", 1)
        rows = sum(width for _, width in parts[kind])
        if fused.shape[0] != rows:
            raise ModelFormatError(weights.source, f"tensor '{name}' has {fused.shape[0]} rows, the config implies {rows}")
        start = 0
        for part, width in parts[kind]:
            weights.add(fused.row_slice(f"{prefix}.{part}", start, start + width))
            start += width
