"""Tiny transformers decoders exported as graphs, for the graph frontends' tests.

`tiny_lm(shape)` builds a random-weight Llama or Qwen2 whose vocabulary is the tiny test
tokenizer's; `export(model, path)` writes it as a stateless `.onnx` (dynamo), an
Optimum-style `kv.onnx` (past keys and values in, presents out; the TorchScript exporter,
as the dynamo one cannot say `attention_mask`'s `past + tokens` length), a `.pt2`
(`torch.export.save`) or a `kv.pt2` (the same signature as `kv.onnx`), with the tokenizer
files beside it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
import transformers
from tiny_models import CHAT_TEMPLATE, VOCAB_SIZE, hf_tokenizer_json

SHAPES = {  # (config class, overrides of the common config)
    "llama-gqa": ("LlamaConfig", {}),
    "llama-mha-tied": ("LlamaConfig", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "llama3-rope": ("LlamaConfig", {"rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16}}),
    "qwen2-bias": ("Qwen2Config", {"hidden_size": 48, "num_attention_heads": 6, "tie_word_embeddings": True}),
    "mistral-window": ("MistralConfig", {"sliding_window": 4}),
}
FORMS = ("onnx", "kv.onnx", "pt2", "kv.pt2")


def tiny_lm(shape: str, seed: int = 0) -> torch.nn.Module:
    config_name, overrides = SHAPES[shape]
    config = getattr(transformers, config_name)(**{
        "vocab_size": VOCAB_SIZE, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms are ones and biases zeros at init: draw them too
        for p in model.parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.2)
    return model


class Logits(torch.nn.Module):
    """`forward(input_ids)` → logits, the stateless form."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


class WithCache(torch.nn.Module):
    """Optimum's decoder signature: ids, mask, positions and each layer's past in; logits and presents out."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                *past: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cache = transformers.DynamicCache(config=self.model.config)
        for i in range(len(past) // 2):
            cache.update(past[2 * i], past[2 * i + 1], i)
        logits = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=cache, use_cache=True).logits
        return (logits, *(t for layer in cache.layers for t in (layer.keys, layer.values)))


def past_names(model: torch.nn.Module) -> list[str]:
    return [f"past_key_values.{i}.{kind}" for i in range(model.config.num_hidden_layers) for kind in ("key", "value")]


def write_tokenizer(directory: Path) -> None:
    (directory / "tokenizer.json").write_text(hf_tokenizer_json())
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE}))


def export(model: torch.nn.Module, path: Path, tokenizer: bool = True) -> Path:
    """`model` as the graph `path` names: `*.pt2`, `*-kv.onnx` (the KV form) or `*.onnx`."""
    from llmc.frontend.torch_export import export_decoder

    path.parent.mkdir(parents=True, exist_ok=True)
    ids = (torch.arange(5)[None] * 7) % model.config.vocab_size
    c = model.config
    t, p, head_dim = 5, 3, c.hidden_size // c.num_attention_heads
    past = past_names(model)
    kv_args = (ids, torch.ones(1, p + t, dtype=torch.int64), torch.arange(p, p + t)[None],
               *(torch.randn(1, c.num_key_value_heads, p, head_dim) for _ in past))
    if path.name.endswith("kv.pt2"):
        tokens, history = torch.export.Dim("tokens", min=1, max=64), torch.export.Dim("past", min=0, max=64)
        dynamic = ({1: tokens}, {1: torch.export.Dim("total", min=4, max=128)}, {1: tokens},
                   tuple({2: history} for _ in past))  # `*past` is one argument
        with torch.no_grad():
            torch.export.save(torch.export.export(WithCache(model).eval(), kv_args, dynamic_shapes=dynamic), path)
    elif path.suffix == ".pt2":
        torch.export.save(export_decoder(model, (ids,)), path)
    elif path.name.endswith("kv.onnx"):
        args = kv_args
        outputs = ["logits"] + [name.replace("past_key_values", "present") for name in past]
        axes = {"input_ids": {1: "tokens"}, "position_ids": {1: "tokens"}, "attention_mask": {1: "total"},
                **{name: {2: "past"} for name in past}, **{name: {2: "total"} for name in outputs[1:]}}
        torch.onnx.export(WithCache(model), args, str(path), dynamo=False, opset_version=18,
                          input_names=["input_ids", "attention_mask", "position_ids", *past], output_names=outputs,
                          dynamic_axes=axes)
    else:
        program = torch.onnx.export(Logits(model), (ids,), dynamo=True, opset_version=18, verbose=False,
                                    dynamic_shapes={"input_ids": {1: torch.export.Dim("T", min=1, max=128)}})
        program.save(str(path))
    if tokenizer:
        write_tokenizer(path.parent)
    return path


def eager_logits(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    """`[T, V]` logits of torch eager, the reference every form is held to."""
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens[None], dtype=torch.long)).logits[0].numpy()
