"""An ONNX backend (`onnx.backend.base.Backend`) that imports a model with `llmc.frontend.onnx`
and runs the `llm` interpreter on it, so onnx's own node test cases check the importer:

    rep = LlmcBackend.prepare(model)
    (y,) = rep.run([x, shape])

Graph inputs that an op needs as static data (Reshape's shape, Slice's starts, Unsqueeze's
axes, …) are bound to their values on each run, so they become `llm.constant`s:

```mlir
func.func @forward(%data: tensor<2x3x4xf32>) -> tensor<4x2x3xf32> {
  %shape = llm.constant dense<[4, 2, 3]> : tensor<3xi64>     // bound: the reshape reads it statically
  %reshaped = llm.reshape %data : tensor<2x3x4xf32> -> tensor<4x2x3xf32>
  func.return %reshaped : tensor<4x2x3xf32>
}
```
Every other input is an argument of `@forward`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx.backend.base import Backend, BackendRep

from llmc.frontend.onnx import import_graph
from llmc.ir import find_function
from llmc.ir.interpreter import run

_REDUCE = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceSumSquare", "ReduceL1",
           "ReduceL2", "ReduceLogSum")
STATIC_INPUTS: dict[str, tuple[int, ...]] = {  # op type → the inputs that are static data
    "Reshape": (1,), "Expand": (1,), "Slice": (1, 2, 3, 4), "Unsqueeze": (1,), "Squeeze": (1,),
    "Range": (0, 1, 2), "Trilu": (1,), "ConstantOfShape": (0,), "Split": (1,), "CumSum": (1,), "Tile": (1,),
    "Dropout": (1, 2),
    **{op: (1,) for op in _REDUCE},
}


def static_inputs(model: onnx.ModelProto) -> set[str]:
    """The graph inputs that some op reads as static data."""
    inputs = {i.name for i in model.graph.input}
    return {node.input[i] for node in model.graph.node for i in STATIC_INPUTS.get(node.op_type, ())
            if i < len(node.input) and node.input[i] in inputs}


class LlmcRep(BackendRep):
    """A model prepared for `run`: imported anew for each run's values of the static inputs."""

    def __init__(self, model: onnx.ModelProto, source: Path):
        self.model, self.source = model, source
        initializers = {t.name for t in model.graph.initializer}
        self.inputs = [i.name for i in model.graph.input if i.name not in initializers]
        self.static = static_inputs(model)

    def run(self, inputs: Sequence[np.ndarray] | Mapping[str, np.ndarray], **kwargs: object) -> tuple[np.ndarray, ...]:
        given = dict(inputs) if isinstance(inputs, Mapping) else dict(zip(self.inputs, inputs))
        bind = {name: np.asarray(value) for name, value in given.items() if name in self.static}
        module, weights = import_graph(self.model, self.source, bind)
        args = [np.asarray(given[name]) for name in self.inputs if name not in bind]
        return tuple(run(find_function(module, "forward"), weights, *args))


class LlmcBackend(Backend):
    """onnx's backend interface over llmc's ONNX importer and `llm` interpreter (CPU, numpy)."""

    @classmethod
    def prepare(cls, model: onnx.ModelProto, device: str = "CPU", **kwargs: object) -> LlmcRep:
        super().prepare(model, device, **kwargs)
        return LlmcRep(model, Path(f"{model.graph.name or 'model'}.onnx"))

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device == "CPU"
