"""ONNX models (opset 17 and later) as `llm` functions of primitive ops.

`import_graph` turns any graph into a function of its inputs; `import_decoder` turns an
exported causal LM (`input_ids [1, T]`, maybe `attention_mask`, `position_ids` and
`past_key_values.N.key/value`, returning `logits`) into llmc's `@forward(%tokens, %pos)`.
Each ONNX op has one mapping function in `OPS`; ops llmc has no primitive for are composed
from the ones it has (Gemm is transposes, a `batch_matmul`, a `mul` and an `add`):

```mlir
func.func @forward(%X: tensor<?x4xf32>) -> tensor<?x3xf32> {    // MatMul(X [T, 4], W [4, 3])
  %W = llm.weight @W f32 : tensor<3x4xf32>
  %0 = llm.transpose %W axes [1, 0] : (tensor<3x4xf32>) -> tensor<4x3xf32>
  %Y = llm.batch_matmul %X, %0 : (tensor<?x4xf32>, tensor<4x3xf32>) -> tensor<?x3xf32>
  func.return %Y : tensor<?x3xf32>
}
```
Result types come from ONNX shape inference (`dim_param` dimensions are `?`) or, where it
has none, from the op. Float initializers of rank ≥ 1 become `llm.weight` entries (a matrix
multiplied from the right is stored transposed, `[out, in]`); integer, boolean and scalar
ones become `llm.constant`. Values computed from constants only (shapes, axes) are folded
while importing, so ops that need static data (Unsqueeze's axes, Split's sizes) find it.

The import is in four modules: `onnx_loader` reads and checks the file (model files come
from strangers: the file size and how many nodes, messages and fields it holds, the opset,
every tensor's declared size and every external-data reference are checked before anything
is read, and each problem is one `ModelFormatError` line); `onnx_graph` holds one import's
state; `onnx_math` and `onnx_shapes` map the ops.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
from xdsl.dialects.builtin import ModuleOp

from llmc.errors import ModelFormatError
from llmc.frontend import onnx_math, onnx_shapes
from llmc.frontend.graph import GraphBuilder
from llmc.frontend.onnx_graph import OnnxGraph, OpMapping, verified
from llmc.frontend.onnx_loader import DTYPES, OPSET, load_model
from llmc.ir.weights import WeightStore

__all__ = ["OPS", "OPSET", "import_decoder", "import_graph"]  # OPSET: from onnx_loader

OPS: dict[str, OpMapping] = {**onnx_math.OPS, **onnx_shapes.OPS}  # ONNX op type → the function adding its ops


def import_graph(model: onnx.ModelProto, source: Path,
                 bind: Mapping[str, np.ndarray] | None = None) -> tuple[ModuleOp, WeightStore]:
    """`@forward` of the graph's inputs (less initializers and the inputs in `bind`, which become
    constants) returning the graph's outputs."""
    bind = dict(bind or {})
    graph = OnnxGraph(model, source, OPS)
    args = [i for i in model.graph.input if i.name not in graph.initializers and i.name not in bind]
    builder = GraphBuilder(source, [graph.input_type(i) for i in args], [i.name for i in args])
    graph.start(builder, dict(zip((i.name for i in args), builder.args)))
    for name, array in bind.items():
        array = np.asarray(array)
        if array.dtype not in {np.dtype(d) for d in DTYPES.values()}:
            raise ModelFormatError(source, f"input '{name}' is bound to a {array.dtype} array, which llmc does not "
                                           f"import")
        graph.define(name, graph.constant(array, name))
    outputs = [o.name for o in model.graph.output]
    graph.convert(outputs)
    return graph.finish([graph.value(name) for name in outputs]), builder.weights


def import_decoder(path: Path) -> tuple[ModuleOp, WeightStore]:
    """`@forward(%tokens, %pos)` of an exported causal LM file: `input_ids`, `position_ids` and
    `attention_mask` come from the tokens and positions, past keys and values are empty, the
    `logits` output (or the first) is returned and `present.*` outputs are dropped."""
    model = load_model(path)
    graph = OnnxGraph(model, path, OPS)
    builder = GraphBuilder.decoder(path)
    graph.start(builder, {})
    for given in model.graph.input:
        name = given.name
        if name in graph.initializers:
            continue
        shape, dtype = graph.declared(name)
        if name == "input_ids":
            value = graph.cast(builder.input_ids(), dtype)
        elif name == "position_ids":
            value = graph.cast(builder.position_ids(), dtype)
        elif name == "attention_mask":
            value = builder.attention_mask(dtype)
        elif name.startswith("past_key_values.") and name.endswith((".key", ".value")):
            value = builder.empty_past(shape or (), dtype, name)
        else:
            raise ModelFormatError(path, f"graph input '{name}' is none of input_ids, attention_mask, position_ids, "
                                         f"past_key_values.N.key/value")
        graph.define(name, value)
    outputs = [o.name for o in model.graph.output]
    if not outputs:
        raise ModelFormatError(path, "the graph has no outputs")
    logits = "logits" if "logits" in outputs else outputs[0]
    graph.convert([logits])
    return verified(builder.finish_decoder(graph.value(logits)), path), builder.weights
