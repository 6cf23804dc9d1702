"""What every frontend produces: the model's hyper-parameters, its weights, its tokenizer.

`ModelConfig` holds the facts of a Llama-family decoder under one set of names, so the
GGUF and Hugging Face frontends meet here and `frontend.llama` builds the same IR from
either. `ModelConfig.check` rejects hyper-parameters that contradict each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from llmc.errors import ModelFormatError
from llmc.ir.weights import WeightStore
from llmc.runtime.codec import TextCodec


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of a Llama-family decoder (Llama, SmolLM, Qwen2)."""

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
        if not self.rope_theta > 0:
            raise ModelFormatError(source, f"rope theta must be positive, got {self.rope_theta}")
        if not 0 < self.rms_eps < 1:
            raise ModelFormatError(source, f"RMSNorm epsilon must be in (0, 1), got {self.rms_eps}")


@dataclass
class Model:
    """An imported model: where it came from, its config, its weights and its tokenizer.

    The tokenizer is built on first use (`tokenizer`), so that `llmc ir` on a model whose
    tokenizer llmc cannot build still works.
    """

    source: Path
    config: ModelConfig
    weights: WeightStore
    make_tokenizer: Callable[[], TextCodec]

    @cached_property
    def tokenizer(self) -> TextCodec:
        return self.make_tokenizer()
