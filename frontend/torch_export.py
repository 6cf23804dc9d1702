"""torch.export → `llm`: a causal LM's exported ATen graph as primitive `llm` ops.

`export_decoder` exports a module (a Hugging Face `*ForCausalLM`, or any module whose
`forward(input_ids)` returns logits `[1, T, V]`) with the token dimension dynamic;
`load_pt2` (of `pt2_loader`) reads one saved with `torch.export.save` without running code from the file;
`import_program` maps each FX node of the program, as exported (training IR, where
`aten.linear` and `aten.scaled_dot_product_attention` are still whole), to `llm` ops:

```mlir
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>) -> tensor<?x64xf32> {
  %model_embed_tokens_weight = llm.weight @model.embed_tokens.weight f32 : tensor<64x32xf32>
  %input_ids = llm.reshape %0 : tensor<?xi64> -> tensor<1x?xi64>
  %embedding = llm.gather %model_embed_tokens_weight, %input_ids axis 0
                 : (tensor<64x32xf32>, tensor<1x?xi64>) -> tensor<1x?x32xf32>
  ...
  %1 = llm.transpose %lm_head_weight axes [1, 0] : (tensor<64x32xf32>) -> tensor<32x64xf32>
  %linear_7 = llm.batch_matmul %mul_17, %1 : (tensor<1x?x32xf32>, tensor<32x64xf32>) -> tensor<1x?x64xf32>
  %logits = llm.reshape %linear_7 : tensor<1x?x64xf32> -> tensor<?x64xf32>
  func.return %logits : tensor<?x64xf32>
}
```
Result types come from each node's `meta["val"]` (a symbolic dimension is `?`). SymInt
nodes (`aten.sym_size`, `operator.add`, …) become i64 scalars computed from `llm.shape_of`.
Parameters and float buffers become `llm.weight` entries named by their state-dict key;
integer and boolean tensors become `llm.constant`. Only nodes the logits depend on are
imported, so asserts and unused buffers drop out.

`torch_importer` holds one import's state; `torch_math` and `torch_shapes` map the ops.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch.export import ExportedProgram
from xdsl.dialects.builtin import ModuleOp

from llmc.frontend import torch_math, torch_shapes
from llmc.frontend.pt2_loader import load_pt2
from llmc.frontend.torch_importer import AtenMapping, ProgramImporter
from llmc.ir.weights import WeightStore

__all__ = ["export_decoder", "import_program", "load_pt2"]  # load_pt2: from pt2_loader

ATEN: dict[object, AtenMapping] = {**torch_math.ATEN, **torch_shapes.ATEN}  # ATen op → the function adding its ops


class _CausalLMLogits(torch.nn.Module):
    """`forward(input_ids)` → `model(input_ids=input_ids, use_cache=False).logits`, with the
    model's children registered as its own so that parameter names stay the model's."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "causal_lm", model)  # not a submodule: no `causal_lm.` prefix
        for name, child in model.named_children():
            self.add_module(name, child)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.causal_lm(input_ids=input_ids, use_cache=False).logits


def export_decoder(module: torch.nn.Module, example_inputs: tuple, max_tokens: int | None = None) -> ExportedProgram:
    """`torch.export` of a decoder whose first input is `input_ids [1, T]`, with T dynamic
    (up to `max_tokens`, by default the config's `max_position_embeddings` or 4096) in it and in
    the other inputs of its shape (`position_ids`, `attention_mask`)."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(module, "generation_config"):  # a transformers model
        module = _CausalLMLogits(module)
    limit = max_tokens or getattr(config, "max_position_embeddings", None) or 4096
    tokens = torch.export.Dim("tokens", min=1, max=limit)
    ids_shape = tuple(example_inputs[0].shape)  # position_ids and an attention_mask share the token dimension
    dynamic = tuple({1: tokens} if getattr(x, "shape", None) == ids_shape else None for x in example_inputs)
    with torch.no_grad():
        return torch.export.export(module.eval(), tuple(example_inputs), dynamic_shapes=dynamic)


def import_program(ep: ExportedProgram, source: Path) -> tuple[ModuleOp, WeightStore]:
    """`@forward(%tokens, %pos)` computing the program's logits, and its weights."""
    return ProgramImporter(ep, source, ATEN).run()
