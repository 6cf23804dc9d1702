"""The state of one ONNX import: ONNX names to SSA values, types from shape inference, and
the values known while importing (shapes, axes), which `emit` computes where it can.

The op tables (`onnx_math`, `onnx_shapes`) map each ONNX node through an `OnnxGraph`:
`g.input(node, 0)` is an operand, `g.emit(op)` appends an op, `g.static(node, 1, "axes")`
reads an input that must be known at import time, `g.result_type(node, 0, shape, dtype)`
types an output from ONNX's inference merged with what the op knows:

```mlir
%0 = llm.constant dense<[1]> : tensor<1xi64>                      // known: [1]
%1 = llm.unsqueeze %x axes [1] : (tensor<?xf32>) -> tensor<?x1xf32>  // Unsqueeze(x, axes=%0)
```
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper
from xdsl.dialects.builtin import ModuleOp, TensorType, i64
from xdsl.ir import Operation, SSAValue
from xdsl.utils.exceptions import VerifyException

from llmc.errors import ModelFormatError
from llmc.frontend.graph import GraphBuilder, tensor_type
from llmc.frontend.onnx_loader import DTYPES, check_opset, element_dtype, tensor_array
from llmc.ir import llm
from llmc.ir.interpreter import evaluate, numpy_dtype

Shape = tuple[int | None, ...]
OpMapping = Callable[["OnnxGraph", onnx.NodeProto], Sequence[SSAValue]]  # a node's ops; its outputs' values


class OnnxGraph:
    """One ONNX graph being imported: ONNX names to SSA values, and the values known at import time."""

    def __init__(self, model: onnx.ModelProto, source: Path, ops: Mapping[str, OpMapping]):
        self.model, self.source, self.directory, self.ops = model, source, source.parent, ops
        check_opset(model, source)
        self.initializers = {t.name: t for t in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type not in ops or node.domain not in ("", "ai.onnx"):
                op = f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
                raise ModelFormatError(source, f"node '{node_name(node)}' uses ONNX op '{op}', which llmc "
                                               f"does not import")
            if node.op_type == "Split" and attr(node, "num_outputs", len(node.output)) != len(node.output):
                raise self.error(node, f"num_outputs {attr(node, 'num_outputs')} is not its {len(node.output)} "
                                       f"outputs")  # shape inference would allocate that many
        try:  # without data propagation, which materializes computed shapes (40 doubling Concats: 2**40 values)
            inferred = onnx.shape_inference.infer_shapes(_for_inference(model), data_prop=False)
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, ValueError, RuntimeError,
                MemoryError) as e:
            first = (str(e).splitlines() or [type(e).__name__])[0]
            raise ModelFormatError(source, f"ONNX shape inference fails: {first}") from e
        g = inferred.graph
        self.types = {v.name: v.type for v in (*g.input, *g.value_info, *g.output) if v.type.HasField("tensor_type")}
        # Matrices multiplied from the right: stored `[out, in]`.
        self.right = {n.input[1] for n in model.graph.node if len(n.input) > 1 and (
            n.op_type == "MatMul" or (n.op_type == "Gemm" and not attr(n, "transB", 0)))}

    def start(self, builder: GraphBuilder, values: dict[str, SSAValue]) -> None:
        self.b = builder
        self.values = values
        self.known: dict[SSAValue, np.ndarray] = {}
        self.suffixes: dict[str, int] = {}

    def finish(self, outputs: Sequence[SSAValue]) -> ModuleOp:
        return verified(self.b.finish(outputs), self.source)

    # -- types

    def declared(self, name: str) -> tuple[Shape | None, np.dtype]:
        t = self.types.get(name)
        if t is None:
            raise ModelFormatError(self.source, f"value '{name}' has no tensor type")
        return _dims(t), element_dtype(self.source, t.tensor_type.elem_type, f"value '{name}'")

    def input_type(self, value: onnx.ValueInfoProto) -> TensorType:
        shape, dtype = self.declared(value.name)
        if shape is None:
            raise ModelFormatError(self.source, f"graph input '{value.name}' has no shape")
        return tensor_type(shape, dtype)

    def inferred(self, name: str) -> TensorType | None:
        """The type ONNX shape inference gives `name`, where it gives one with a rank."""
        t = self.types.get(name)
        if t is None or t.tensor_type.elem_type not in DTYPES or _dims(t) is None:
            return None
        return tensor_type(_dims(t), DTYPES[t.tensor_type.elem_type])

    def result_type(self, node: onnx.NodeProto, i: int, shape: Sequence[int | None] | None,
                    dtype: np.dtype) -> TensorType:
        """Output `i`'s type: ONNX's where it knows one, merged with `shape` (None: unknown)."""
        found = self.inferred(node.output[i])
        if found is not None and shape is not None and len(shape) == len(llm.shape_of(found)):
            merged = [d if d is not None else e for d, e in zip(shape, llm.shape_of(found))]
            return tensor_type(merged, dtype)
        if found is not None:
            return tensor_type(llm.shape_of(found), dtype)
        if shape is None:
            raise self.error(node, f"cannot tell the shape of output '{node.output[i]}'")
        return tensor_type(shape, dtype)

    # -- values

    def define(self, name: str, value: SSAValue) -> None:
        self.values[name] = value

    def value(self, name: str) -> SSAValue:
        if name not in self.values:
            if name not in self.initializers:
                raise ModelFormatError(self.source, f"value '{name}' is used but never defined")
            self.values[name] = self.initializer(self.initializers[name])
        return self.values[name]

    def initializer(self, t: TensorProto) -> SSAValue:
        array = tensor_array(t, self.source, self.directory)
        if array.dtype.kind == "f" and array.ndim >= 1 and array.size and (
                array.dtype != np.float64 or array.size > llm.ConstantOp.LIMIT):
            return self.weight(t.name, array)
        return self.constant(np.asarray(array), t.name)

    def weight(self, name: str, array: np.ndarray) -> SSAValue:
        """`array` as `llm.weight`, named after the ONNX name."""
        base = symbol = _identifier(name)
        while symbol in self.b.weights:  # names differing only in characters IR names lack: numbered, in linear time
            self.suffixes[base] = self.suffixes.get(base, 0) + 1
            symbol = f"{base}_{self.suffixes[base]}"
        value = self.b.weight(symbol, array, transposed=name in self.right and array.ndim == 2)
        return value if array.dtype == np.float32 else self.emit(
            llm.CastOp(value, tensor_type(array.shape, array.dtype)))

    def constant(self, array: np.ndarray, name: str | None = None) -> SSAValue:
        value = self.b.constant(array, name)
        self.known[value] = np.asarray(array)
        return value

    def emit(self, op: Operation) -> SSAValue:
        """Append `op`; its value is computed now where its operands are known and it is small."""
        value = self.b.add(op)
        shape = llm.shape_of(value)
        operands = [self.known.get(o) for o in op.operands]
        if None not in shape and math.prod(shape) <= llm.ConstantOp.LIMIT and all(v is not None for v in operands):
            try:
                (self.known[value],) = evaluate([value], dict(zip(op.operands, operands)), self.b.weights)
            except (ValueError, IndexError, TypeError, ArithmeticError):
                pass  # left to run time, where it fails the same way
        return value

    def input(self, node: onnx.NodeProto, i: int) -> SSAValue:
        if i >= len(node.input) or not node.input[i]:
            raise self.error(node, f"input {i} is missing")
        return self.value(node.input[i])

    def optional(self, node: onnx.NodeProto, i: int) -> SSAValue | None:
        return self.value(node.input[i]) if i < len(node.input) and node.input[i] else None

    def static(self, node: onnx.NodeProto, i: int, what: str) -> np.ndarray | None:
        """The value of input `i` (None where absent); it must be known at import time."""
        value = self.optional(node, i)
        if value is None:
            return None
        if value not in self.known:
            raise self.error(node, f"its {what} (input '{node.input[i]}') must be a constant, not computed at run "
                                   f"time")
        return self.known[value]

    def axes(self, node: onnx.NodeProto, i: int, rank: int) -> list[int] | None:
        """Axes from attribute `axes` or static input `i`, normalized (None where absent)."""
        axes = attr(node, "axes")
        if axes is None:
            found = self.static(node, i, "axes")
            axes = None if found is None else found.reshape(-1).tolist()
        if axes is None:
            return None
        if any(not -max(rank, 1) <= a < max(rank, 1) for a in axes):
            raise self.error(node, f"axes {list(axes)} are outside rank {rank}")
        return [a % max(rank, 1) for a in axes]

    def error(self, node: onnx.NodeProto, problem: str) -> ModelFormatError:
        return ModelFormatError(self.source, f"node '{node_name(node)}' ({node.op_type}): {problem}")

    def convert(self, outputs: Sequence[str]) -> None:
        """Add the ops of the nodes that `outputs` depend on (ONNX lists nodes in topological order)."""
        needed, nodes = set(outputs), []
        for node in reversed(self.model.graph.node):
            if needed.intersection(node.output):
                nodes.append(node)
                needed.update(node.input)
        for node in reversed(nodes):
            try:
                values = self.ops[node.op_type](self, node)
            except VerifyException as e:
                raise self.error(node, str(e).splitlines()[0]) from e
            except (ValueError, IndexError) as e:
                raise self.error(node, str(e).splitlines()[0] if str(e) else type(e).__name__) from e
            for name, value in zip(node.output, values):
                if name:
                    self.values[name] = value
                    if value is not None and value.name_hint is None:
                        value.name_hint = _identifier(name)

    # -- small builders shared by the op mappings

    def i64s(self, values: Sequence[int]) -> SSAValue:
        return self.constant(np.asarray(values, dtype=np.int64))

    def scalar(self, value: float | int, like: SSAValue) -> SSAValue:
        return self.constant(np.asarray(value, dtype=numpy_dtype(llm.element_type(like))))

    def cast(self, value: SSAValue, dtype: np.dtype) -> SSAValue:
        if numpy_dtype(llm.element_type(value)) == dtype:
            return value
        return self.emit(llm.CastOp(value, tensor_type(llm.shape_of(value), dtype)))

    def slice(self, x: SSAValue, axis: int, start: int, end: int) -> SSAValue:
        """Elements `start:end` of `axis` of `x` (static bounds)."""
        shape = list(llm.shape_of(x))
        if shape[axis] is not None:
            shape[axis] = len(range(*slice(start, end).indices(shape[axis])))
        return self.emit(llm.SliceOp(x, self.i64s([start]), self.i64s([end]), self.i64s([axis]), self.i64s([1]),
                                     tensor_type(shape, numpy_dtype(llm.element_type(x)))))

    def dims(self, x: SSAValue, start: int, end: int) -> SSAValue:
        """Dimensions `start:end` of `x` as a 1-D i64 tensor (a constant where they are static)."""
        rank = len(llm.shape_of(x))
        shape = llm.shape_of(x)[start:end]
        if None not in shape:
            return self.i64s(shape)
        dims = self.emit(llm.ShapeOfOp(x, llm.tensor(rank, element_type=i64)))
        return dims if (start, end) == (0, rank) else self.slice(dims, 0, start, end)

    def reshape(self, x: SSAValue, result: TensorType, to: Callable[[], SSAValue]) -> SSAValue:
        """`x` as `result`; where the result type cannot say the shape, `to()` gives it (1-D i64, -1 for the rest)."""
        src, dst = llm.shape_of(x), llm.shape_of(result)
        if None not in src and None not in dst or dst.count(None) == 1 and None in src:
            return self.emit(llm.ReshapeOp(x, dst))
        return self.emit(llm.ReshapeOp(x, dst, to()))


def _for_inference(model: onnx.ModelProto) -> onnx.ModelProto:
    """`model` for shape inference, its large float initializers as typed graph inputs: inference
    needs their types, and a copy of their bytes (it serializes the model twice) would double the
    import's peak memory."""
    g = model.graph
    light = onnx.ModelProto(ir_version=model.ir_version, opset_import=model.opset_import, functions=model.functions)
    light.graph.node.extend(g.node)
    light.graph.input.extend(g.input)
    light.graph.output.extend(g.output)
    light.graph.value_info.extend(g.value_info)
    declared = {i.name for i in g.input}
    for t in g.initializer:
        if np.dtype(DTYPES.get(t.data_type, np.int64)).kind == "f" and math.prod(t.dims) > llm.ConstantOp.LIMIT:
            if t.name not in declared:
                light.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, t.dims))
        else:
            light.graph.initializer.append(t)
    return light


def _identifier(name: str) -> str:
    """An ONNX name in the characters of IR names: `onnx::W_7` is `onnx__W_7`, `0.w` is `v0.w`."""
    text = re.sub(r"[^A-Za-z0-9_.]", "_", name)
    return text if text[:1].isalpha() or text[:1] == "_" else f"v{text}"


def node_name(node: onnx.NodeProto) -> str:
    """What error messages call `node`: its name, else its first output, else its op type."""
    return node.name or (node.output[0] if node.output else node.op_type)


def attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    """The value of `node`'s attribute `name`, or `default`."""
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def dtype_of(value: SSAValue) -> np.dtype:
    """The numpy dtype of `value`'s elements."""
    return numpy_dtype(llm.element_type(value))


def _dims(t: onnx.TypeProto) -> Shape | None:
    if not t.tensor_type.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else None for d in t.tensor_type.shape.dim)


def verified(module: ModuleOp, source: Path) -> ModuleOp:
    """`module`, once it verifies; a `ModelFormatError` line where it does not."""
    try:
        module.verify()
    except VerifyException as e:
        raise ModelFormatError(source, f"the imported graph does not verify: {str(e).splitlines()[0]}") from e
    return module
