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

Model files come from strangers: the file size and how many nodes, messages and fields it
holds (`onnx_loader`), the opset, every tensor's declared size and every external-data
reference (only regular files inside the model's directory, read with bounds checks) are
checked before anything is read, and each problem is one `ModelFormatError` line.
"""

from __future__ import annotations

import math
import os
import re
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper
from xdsl.dialects.builtin import ModuleOp, TensorType, i1, i64
from xdsl.ir import Operation, SSAValue
from xdsl.utils.exceptions import VerifyException

from llmc.errors import ModelFormatError
from llmc.frontend.graph import GraphBuilder, tensor_type
from llmc.frontend.onnx_loader import load_model
from llmc.ir import llm
from llmc.ir.interpreter import evaluate, numpy_dtype
from llmc.ir.weights import WeightStore

OPSET = 17  # the oldest default-domain opset llmc reads
MAX_ELEMENTS = 2**40  # more elements than any tensor llmc could hold

DTYPES = {
    TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.DOUBLE: np.float64,
    TensorProto.INT64: np.int64, TensorProto.INT32: np.int32, TensorProto.INT16: np.int16,
    TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8, TensorProto.BOOL: np.bool_,
}
Shape = tuple[int | None, ...]


def import_graph(model: onnx.ModelProto, source: Path,
                 bind: Mapping[str, np.ndarray] | None = None) -> tuple[ModuleOp, WeightStore]:
    """`@forward` of the graph's inputs (less initializers and the inputs in `bind`, which become
    constants) returning the graph's outputs."""
    bind = dict(bind or {})
    graph = _Graph(model, source)
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
    graph = _Graph(model, path)
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
    module = builder.finish_decoder(graph.value(logits))
    _verify(module, path)
    return module, builder.weights


def _verify(module: ModuleOp, source: Path) -> None:
    try:
        module.verify()
    except VerifyException as e:
        raise ModelFormatError(source, f"the imported graph does not verify: {str(e).splitlines()[0]}") from e


# ------------------------------------------------------------------------------ tensors


def _dims(t: onnx.TypeProto) -> Shape | None:
    if not t.tensor_type.HasField("shape"):
        return None
    return tuple(d.dim_value if d.HasField("dim_value") else None for d in t.tensor_type.shape.dim)


def _dtype(source: Path, elem: int, what: str) -> np.dtype:
    found = DTYPES.get(elem)
    if found is None:
        kind = TensorProto.DataType.Name(elem) if elem in TensorProto.DataType.values() else str(elem)
        raise ModelFormatError(source, f"{what} has element type {kind}, which llmc does not import "
                                       f"(float, float16, double, int8/16/32/64, uint8, bool)")
    return np.dtype(found)


def _inside(source: Path, directory: Path, location: str, name: str) -> Path:
    """The external-data file `location` of tensor `name`, refused unless it is inside `directory`."""
    parts = location.replace("\\", "/").split("/")
    if not location or "\0" in location or os.path.isabs(location) or location.startswith(("/", "\\")) \
            or ":" in parts[0]:
        raise ModelFormatError(source, f"tensor '{name}': external data location '{location}' is not a path "
                                       f"relative to the model's directory; refusing to read it")
    if ".." in parts:
        raise ModelFormatError(source, f"tensor '{name}': external data location '{location}' leaves the model's "
                                       f"directory; refusing to read it")
    root = os.path.realpath(directory)
    resolved = os.path.realpath(os.path.join(root, location))
    if os.path.commonpath([root, resolved]) != root:
        raise ModelFormatError(source, f"tensor '{name}': external data '{location}' resolves outside the model's "
                                       f"directory ({resolved}); refusing to read it")
    return Path(resolved)


def tensor_array(t: TensorProto, source: Path, directory: Path) -> np.ndarray:
    """The values of `t`, its declared size checked against its data (a memory map for external data)."""
    name = t.name or "<unnamed>"
    dtype = _dtype(source, t.data_type, f"tensor '{name}'")
    if any(d < 0 for d in t.dims):
        raise ModelFormatError(source, f"tensor '{name}' has a negative dimension in {list(t.dims)}")
    count = math.prod(t.dims)
    if count > MAX_ELEMENTS:
        raise ModelFormatError(source, f"tensor '{name}' declares {list(t.dims)} = {count} elements, more than "
                                       f"2**40")
    shape = tuple(t.dims)
    if t.data_location == TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        path = _inside(source, directory, info.get("location", ""), name)
        try:
            offset, length = int(info.get("offset", 0)), int(info.get("length", count * dtype.itemsize))
            found = path.stat()
        except ValueError as e:
            raise ModelFormatError(source, f"tensor '{name}': malformed external data offset or length") from e
        except OSError as e:
            raise ModelFormatError(source, f"tensor '{name}': cannot read external data '{path.name}': "
                                           f"{e.strerror}") from e
        if not stat.S_ISREG(found.st_mode):  # a folder, a FIFO (opening it waits for a writer), a device
            raise ModelFormatError(source, f"tensor '{name}': external data '{path.name}' is not a regular file")
        size = found.st_size
        if offset < 0 or length != count * dtype.itemsize or offset + length > size:
            raise ModelFormatError(source, f"tensor '{name}': external data at offset {offset}, length {length} "
                                           f"does not hold {shape} {dtype} inside '{path.name}' ({size} bytes)")
        if count == 0:
            return np.zeros(shape, dtype)
        try:
            return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
        except (OSError, ValueError) as e:
            raise ModelFormatError(source, f"tensor '{name}': cannot map external data '{path.name}': {e}") from e
    stored = len(t.raw_data) // dtype.itemsize if t.HasField("raw_data") else _field_count(t)
    if stored != count or (t.HasField("raw_data") and len(t.raw_data) != count * dtype.itemsize):
        raise ModelFormatError(source, f"tensor '{name}' declares {list(t.dims)} = {count} elements but holds "
                                       f"{stored}")
    return numpy_helper.to_array(t).astype(dtype, copy=False).reshape(shape)


def _field_count(t: TensorProto) -> int:
    fields = {TensorProto.FLOAT: t.float_data, TensorProto.DOUBLE: t.double_data, TensorProto.INT64: t.int64_data}
    return len(fields.get(t.data_type, t.int32_data))


# ------------------------------------------------------------------------------ graphs


class _Graph:
    """One ONNX graph being imported: ONNX names to SSA values, and the values known at import time."""

    def __init__(self, model: onnx.ModelProto, source: Path):
        self.model, self.source, self.directory = model, source, source.parent
        versions = {o.domain: o.version for o in model.opset_import}
        opset = versions.get("", versions.get("ai.onnx"))
        if opset is None or opset < OPSET:
            raise ModelFormatError(source, f"opset {opset if opset is not None else 'missing'}: llmc reads opset "
                                           f"{OPSET} and later (re-export, or convert with onnx.version_converter)")
        self.initializers = {t.name: t for t in model.graph.initializer}
        for node in model.graph.node:
            if node.op_type not in OPS or node.domain not in ("", "ai.onnx"):
                op = f"{node.domain}.{node.op_type}" if node.domain not in ("", "ai.onnx") else node.op_type
                raise ModelFormatError(source, f"node '{_node_name(node)}' uses ONNX op '{op}', which llmc "
                                               f"does not import")
            if node.op_type == "Split" and _attr(node, "num_outputs", len(node.output)) != len(node.output):
                raise self.error(node, f"num_outputs {_attr(node, 'num_outputs')} is not its {len(node.output)} "
                                       f"outputs")  # shape inference would allocate that many
        try:  # without data propagation, which materializes computed shapes (40 doubling Concats: 2**40 values)
            inferred = onnx.shape_inference.infer_shapes(_for_inference(model), data_prop=False)
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError, ValueError, RuntimeError,
                MemoryError) as e:
            raise ModelFormatError(source, f"ONNX shape inference fails: {(str(e).splitlines() or [type(e).__name__])[0]}") from e
        g = inferred.graph
        self.types = {v.name: v.type for v in (*g.input, *g.value_info, *g.output) if v.type.HasField("tensor_type")}
        # Matrices multiplied from the right: stored `[out, in]`.
        self.right = {n.input[1] for n in model.graph.node if len(n.input) > 1 and (
            n.op_type == "MatMul" or (n.op_type == "Gemm" and not _attr(n, "transB", 0)))}

    def start(self, builder: GraphBuilder, values: dict[str, SSAValue]) -> None:
        self.b = builder
        self.values = values
        self.known: dict[SSAValue, np.ndarray] = {}
        self.suffixes: dict[str, int] = {}

    def finish(self, outputs: Sequence[SSAValue]) -> ModuleOp:
        module = self.b.finish(outputs)
        _verify(module, self.source)
        return module

    # -- types

    def declared(self, name: str) -> tuple[Shape | None, np.dtype]:
        t = self.types.get(name)
        if t is None:
            raise ModelFormatError(self.source, f"value '{name}' has no tensor type")
        return _dims(t), _dtype(self.source, t.tensor_type.elem_type, f"value '{name}'")

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

    def error(self, node: onnx.NodeProto, problem: str) -> ModelFormatError:
        return ModelFormatError(self.source, f"node '{_node_name(node)}' ({node.op_type}): {problem}")

    def convert(self, outputs: Sequence[str]) -> None:
        """Add the ops of the nodes that `outputs` depend on (ONNX lists nodes in topological order)."""
        needed, nodes = set(outputs), []
        for node in reversed(self.model.graph.node):
            if needed.intersection(node.output):
                nodes.append(node)
                needed.update(node.input)
        for node in reversed(nodes):
            try:
                values = OPS[node.op_type](self, node)
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


def _node_name(node: onnx.NodeProto) -> str:
    return node.name or (node.output[0] if node.output else node.op_type)


def _attr(node: onnx.NodeProto, name: str, default: object = None) -> object:
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _dtype_of(value: SSAValue) -> np.dtype:
    return numpy_dtype(llm.element_type(value))


# ----------------------------------------------------------------------------- op table

OpMapping = Callable[[_Graph, onnx.NodeProto], Sequence[SSAValue]]
OPS: dict[str, OpMapping] = {}  # ONNX op type → the function adding its ops; its outputs' values


def _maps(*op_types: str) -> Callable[[OpMapping], OpMapping]:
    def add(fn: OpMapping) -> OpMapping:
        for op_type in op_types:
            OPS[op_type] = fn
        return fn

    return add


_BINARY = {"Add": llm.AddOp, "Sub": llm.SubOp, "Mul": llm.MulOp, "Div": llm.DivOp, "Equal": llm.EqualOp,
           "Less": llm.LessOp, "LessOrEqual": llm.LessEqualOp, "Greater": llm.GreaterOp,
           "GreaterOrEqual": llm.GreaterEqualOp, "And": llm.AndOp, "Or": llm.OrOp, "Xor": llm.XorOp}
_UNARY = {"Neg": llm.NegOp, "Sqrt": llm.SqrtOp, "Reciprocal": llm.ReciprocalOp, "Exp": llm.ExpOp, "Log": llm.LogOp,
          "Tanh": llm.TanhOp, "Cos": llm.CosOp, "Sin": llm.SinOp, "Erf": llm.ErfOp, "Sigmoid": llm.SigmoidOp,
          "Relu": llm.ReluOp, "Abs": llm.AbsOp, "Floor": llm.FloorOp, "Ceil": llm.CeilOp, "Not": llm.NotOp}
_REDUCE = {"ReduceSum": llm.ReduceSumOp, "ReduceMean": llm.ReduceMeanOp, "ReduceMax": llm.ReduceMaxOp,
           "ReduceMin": llm.ReduceMinOp, "ReduceProd": llm.ReduceProdOp}


def _binary_op(g: _Graph, node: onnx.NodeProto, op_type: type, a: SSAValue, b: SSAValue) -> SSAValue:
    """`op_type` of `a` and `b`, typed as the node's output."""
    shape = llm.broadcast(llm.shape_of(a), llm.shape_of(b))
    dtype = np.dtype(np.bool_) if op_type.BOOLEAN else _dtype_of(a)
    return g.emit(op_type(a, b, g.result_type(node, 0, shape, dtype)))


@_maps(*_BINARY)
def _binary(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    return [_binary_op(g, node, _BINARY[node.op_type], g.input(node, 0), g.input(node, 1))]


@_maps("Pow")
def _pow(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    """`X ** Y` in X's type; an integer X with a float Y is raised in Y's type, then cast back."""
    x, y = g.input(node, 0), g.input(node, 1)
    if np.issubdtype(_dtype_of(x), np.integer) and np.issubdtype(_dtype_of(y), np.floating):
        power = g.emit(llm.PowOp(g.cast(x, _dtype_of(y)), y))
        return [g.cast(power, _dtype_of(x))]
    return [_binary_op(g, node, llm.PowOp, x, g.cast(y, _dtype_of(x)))]


@_maps("Mod")
def _mod(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    a, b = g.input(node, 0), g.input(node, 1)
    r = _binary_op(g, node, llm.ModOp, a, b)
    if not _attr(node, "fmod", 0):
        return [r]
    # C's fmod takes the dividend's sign: numpy's remainder minus the divisor where the signs differ.
    zero = g.scalar(0, a)
    differ = g.emit(llm.XorOp(g.emit(llm.LessOp(a, zero)), g.emit(llm.LessOp(b, zero))))
    nonzero = g.emit(llm.NotOp(g.emit(llm.EqualOp(r, zero))))
    return [g.emit(llm.WhereOp(g.emit(llm.AndOp(differ, nonzero)), g.emit(llm.SubOp(r, b)), r, r.type))]


@_maps(*_UNARY)
def _unary(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    return [g.emit(_UNARY[node.op_type](g.input(node, 0)))]


@_maps("Gelu")
def _gelu(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    if _attr(node, "approximate", b"none") in (b"tanh", "tanh"):
        return [g.emit(llm.GeluOp(x))]
    erf = g.emit(llm.ErfOp(g.emit(llm.MulOp(x, g.scalar(1 / math.sqrt(2), x)))))
    half = g.emit(llm.MulOp(x, g.scalar(0.5, x)))
    return [g.emit(llm.MulOp(half, g.emit(llm.AddOp(erf, g.scalar(1, x)))))]


@_maps("Identity")
def _identity(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    return [g.input(node, 0)]


@_maps("Max", "Min", "Sum", "Mean")
def _variadic(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    op_type = {"Max": llm.MaximumOp, "Min": llm.MinimumOp, "Sum": llm.AddOp, "Mean": llm.AddOp}[node.op_type]
    values = [g.input(node, i) for i in range(len(node.input))]
    out = values[0]
    for v in values[1:]:
        out = g.emit(op_type(out, v))
    if node.op_type == "Mean" and len(values) > 1:
        out = g.emit(llm.DivOp(out, g.scalar(len(values), out)))
    return [out]


@_maps("Where")
def _where(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    c, a, b = (g.input(node, i) for i in range(3))
    shape = llm.broadcast(llm.shape_of(c), llm.shape_of(a), llm.shape_of(b))
    return [g.emit(llm.WhereOp(c, a, b, g.result_type(node, 0, shape, _dtype_of(a))))]


@_maps("IsNaN")
def _isnan(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    return [g.emit(llm.IsNanOp(x, llm.tensor(*llm.shape_of(x), element_type=i1)))]


@_maps("Cast", "CastLike")
def _cast(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    if node.op_type == "Cast":
        dtype = _dtype(g.source, _attr(node, "to"), f"node '{_node_name(node)}' (Cast)'s target")
    else:
        dtype = _dtype_of(g.input(node, 1))
    return [g.emit(llm.CastOp(x, tensor_type(llm.shape_of(x), dtype)))]


def _axes(g: _Graph, node: onnx.NodeProto, i: int, rank: int) -> list[int] | None:
    """Axes from attribute `axes` or static input `i`, normalized (None where absent)."""
    axes = _attr(node, "axes")
    if axes is None:
        found = g.static(node, i, "axes")
        axes = None if found is None else found.reshape(-1).tolist()
    if axes is None:
        return None
    if any(not -max(rank, 1) <= a < max(rank, 1) for a in axes):
        raise g.error(node, f"axes {list(axes)} are outside rank {rank}")
    return [a % max(rank, 1) for a in axes]


def _square(g: _Graph, x: SSAValue) -> SSAValue:
    return g.emit(llm.MulOp(x, x))


_COMPOSED_REDUCE: dict[str, tuple[str, Callable[[_Graph, SSAValue], SSAValue] | None, type | None]] = {
    # op type → (the reduction, what is reduced, the elementwise op after)
    "ReduceSumSquare": ("ReduceSum", _square, None), "ReduceL1": ("ReduceSum", lambda g, x: g.emit(llm.AbsOp(x)), None),
    "ReduceL2": ("ReduceSum", _square, llm.SqrtOp), "ReduceLogSum": ("ReduceSum", None, llm.LogOp),
}


@_maps(*_COMPOSED_REDUCE)
def _composed_reduce(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    reduction, before, after = _COMPOSED_REDUCE[node.op_type]
    x = g.input(node, 0)
    (y,) = _reduce(g, node, reduction, x if before is None else before(g, x))
    return [y if after is None else g.emit(after(y))]


@_maps(*_REDUCE)
def _reduce(g: _Graph, node: onnx.NodeProto, op_type: str | None = None, x: SSAValue | None = None) -> list[SSAValue]:
    op_type = op_type or node.op_type
    x = g.input(node, 0) if x is None else x
    shape = llm.shape_of(x)
    axes = _axes(g, node, 1, len(shape))
    if not axes:
        if _attr(node, "noop_with_empty_axes", 0) or not shape:
            return [x]
        axes = list(range(len(shape)))
    keep = bool(_attr(node, "keepdims", 1))
    kept = [1 if i in axes else d for i, d in enumerate(shape)] if keep else \
        [d for i, d in enumerate(shape) if i not in axes]
    dtype = _dtype_of(x)
    out = g.result_type(node, 0, kept, dtype)
    if any(shape[a] == 0 for a in axes) and op_type in ("ReduceMax", "ReduceMin") and \
            None not in llm.shape_of(out):
        # The maximum of nothing is the type's lowest value (-inf), the minimum its highest.
        low, high = (-np.inf, np.inf) if dtype.kind == "f" else (False, True) if dtype.kind == "b" else \
            (np.iinfo(dtype).min, np.iinfo(dtype).max)
        fill = g.scalar(low if op_type == "ReduceMax" else high, x)
        return [g.emit(llm.FillOp(g.i64s(llm.shape_of(out)), fill, out))]
    return [g.emit(_REDUCE[op_type](x, axes, keep, out))]


def _normalized(g: _Graph, node: onnx.NodeProto, centered: bool) -> list[SSAValue]:
    """LayerNormalization (`centered`) and RMSNormalization over the axes from `axis` on, computed in f32."""
    x, scale, bias = g.input(node, 0), g.input(node, 1), g.optional(node, 2)
    rank = len(llm.shape_of(x))
    axis = _attr(node, "axis", -1)
    axes = list(range(axis + rank if axis < 0 else axis, rank))
    dtype = _dtype_of(x)
    if _attr(node, "stash_type", 1) != 1:
        raise g.error(node, "only stash_type 1 (float32 statistics) is supported")
    x32 = g.cast(x, np.dtype(np.float32))
    mean = g.emit(llm.ReduceMeanOp(x32, axes, True)) if centered else None
    d = x32 if mean is None else g.emit(llm.SubOp(x32, mean))
    var = g.emit(llm.ReduceMeanOp(_square(g, d), axes, True))
    inv = g.emit(llm.RsqrtOp(g.emit(llm.AddOp(var, g.scalar(_attr(node, "epsilon", 1e-5), var)))))
    y = g.emit(llm.MulOp(g.cast(g.emit(llm.MulOp(d, inv)), dtype), scale))
    y = y if bias is None else g.emit(llm.AddOp(y, bias))
    return [y, mean, inv] if centered else [y]


@_maps("LayerNormalization")
def _layer_norm(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    return _normalized(g, node, True)


@_maps("RMSNormalization")
def _rms_norm(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    return _normalized(g, node, False)


@_maps("LogSoftmax")
def _log_softmax(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    axis = _attr(node, "axis", -1) % len(llm.shape_of(x))
    shifted = g.emit(llm.SubOp(x, g.emit(llm.ReduceMaxOp(x, [axis], True))))
    total = g.emit(llm.ReduceSumOp(g.emit(llm.ExpOp(shifted)), [axis], True))
    return [g.emit(llm.SubOp(shifted, g.emit(llm.LogOp(total))))]


def _activation(fn: Callable[[_Graph, onnx.NodeProto, SSAValue], SSAValue]) -> OpMapping:
    return lambda g, node: [fn(g, node, g.input(node, 0))]


def _where_negative(g: _Graph, x: SSAValue, negative: SSAValue, strict: bool = True) -> SSAValue:
    zero = g.scalar(0, x)
    test = g.emit(llm.LessOp(x, zero) if strict else llm.LessEqualOp(x, zero))
    return g.emit(llm.WhereOp(test, negative, x, x.type))


def _expm1(g: _Graph, x: SSAValue, alpha: float) -> SSAValue:
    """`alpha · (eˣ - 1)`."""
    e = g.emit(llm.SubOp(g.emit(llm.ExpOp(x)), g.scalar(1, x)))
    return g.emit(llm.MulOp(e, g.scalar(alpha, x)))


def _softplus(g: _Graph, x: SSAValue) -> SSAValue:
    return g.emit(llm.LogOp(g.emit(llm.AddOp(g.emit(llm.ExpOp(x)), g.scalar(1, x)))))


def _hard_sigmoid(g: _Graph, x: SSAValue, alpha: float, beta: float) -> SSAValue:
    y = g.emit(llm.AddOp(g.emit(llm.MulOp(x, g.scalar(alpha, x))), g.scalar(beta, x)))
    return g.emit(llm.MaximumOp(g.emit(llm.MinimumOp(y, g.scalar(1, x))), g.scalar(0, x)))


ACTIVATIONS: dict[str, Callable[[_Graph, onnx.NodeProto, SSAValue], SSAValue]] = {
    "LeakyRelu": lambda g, n, x: _where_negative(g, x, g.emit(llm.MulOp(x, g.scalar(_attr(n, "alpha", 0.01), x)))),
    "Elu": lambda g, n, x: _where_negative(g, x, _expm1(g, x, _attr(n, "alpha", 1.0))),
    "Selu": lambda g, n, x: g.emit(llm.MulOp(
        _where_negative(g, x, _expm1(g, x, _attr(n, "alpha", 1.67326319217681884765625)), strict=False),
        g.scalar(_attr(n, "gamma", 1.05070102214813232421875), x))),
    "Celu": lambda g, n, x: g.emit(llm.AddOp(g.emit(llm.ReluOp(x)), g.emit(llm.MinimumOp(
        _expm1(g, g.emit(llm.DivOp(x, g.scalar(_attr(n, "alpha", 1.0), x))), _attr(n, "alpha", 1.0)),
        g.scalar(0, x))))),
    "ThresholdedRelu": lambda g, n, x: g.emit(llm.WhereOp(
        g.emit(llm.GreaterOp(x, g.scalar(_attr(n, "alpha", 1.0), x))), x, g.scalar(0, x), x.type)),
    "HardSigmoid": lambda g, n, x: _hard_sigmoid(g, x, _attr(n, "alpha", 0.2), _attr(n, "beta", 0.5)),
    "HardSwish": lambda g, n, x: g.emit(llm.MulOp(x, _hard_sigmoid(g, x, 1 / 6, 0.5))),
    "Softplus": lambda g, n, x: _softplus(g, x),
    "Softsign": lambda g, n, x: g.emit(llm.DivOp(x, g.emit(llm.AddOp(g.emit(llm.AbsOp(x)), g.scalar(1, x))))),
    "Mish": lambda g, n, x: g.emit(llm.MulOp(x, g.emit(llm.TanhOp(_softplus(g, x))))),
    "Swish": lambda g, n, x: g.emit(llm.MulOp(x, g.emit(llm.SigmoidOp(
        g.emit(llm.MulOp(x, g.scalar(_attr(n, "alpha", 1.0), x))))))),
    "Tan": lambda g, n, x: g.emit(llm.DivOp(g.emit(llm.SinOp(x)), g.emit(llm.CosOp(x)))),
}
for _name, _fn in ACTIVATIONS.items():
    OPS[_name] = _activation(_fn)


@_maps("PRelu")
def _prelu(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    return [_where_negative(g, x, g.emit(llm.MulOp(x, g.input(node, 1))))]


@_maps("Clip")
def _clip(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    y, low, high = g.input(node, 0), g.optional(node, 1), g.optional(node, 2)
    if low is not None:
        y = g.emit(llm.MaximumOp(y, low))
    if high is not None:
        y = g.emit(llm.MinimumOp(y, high))
    return [y]


@_maps("Dropout")
def _dropout(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    """Inference: the input as it is, and a mask of ones."""
    training = g.static(node, 2, "training_mode")
    if training is not None and training.any():
        raise g.error(node, "training-mode dropout is random; llmc imports inference graphs")
    x = g.input(node, 0)
    shape = llm.shape_of(x)
    mask = g.emit(llm.FillOp(g.dims(x, 0, len(shape)), g.constant(np.ones((), np.bool_)),
                             llm.tensor(*shape, element_type=i1)))
    return [x, mask]


@_maps("Tile")
def _tile(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    """`x [d0, d1]` repeated `[r0, r1]` times: unsqueezed to `[1, d0, 1, d1]`, expanded to
    `[r0, d0, r1, d1]`, reshaped to `[r0·d0, r1·d1]`."""
    x = g.input(node, 0)
    shape = llm.shape_of(x)
    repeats = g.static(node, 1, "repeats")
    if repeats is None or repeats.shape != (len(shape),):
        raise g.error(node, f"repeats must be {len(shape)} integers")
    repeats = repeats.tolist()
    spread = g.emit(llm.UnsqueezeOp(x, [2 * i for i in range(len(shape))]))
    wide = [d for r in repeats for d in (r, 1)]
    expanded = g.emit(llm.ExpandOp(spread, g.i64s(wide), tensor_type(
        [d for r, s in zip(repeats, shape) for d in (r, s)], _dtype_of(x))))
    dims = [None if d is None else r * d for r, d in zip(repeats, shape)]

    def runtime() -> SSAValue:
        return g.emit(llm.MulOp(g.dims(x, 0, len(shape)), g.i64s(repeats)))

    return [g.reshape(expanded, g.result_type(node, 0, dims, _dtype_of(x)), runtime)]


@_maps("Softmax")
def _softmax(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    return [g.emit(llm.SoftmaxOp(g.input(node, 0), _attr(node, "axis", -1)))]


def _matmul_shape(a: Shape, b: Shape) -> Shape:
    if len(a) == 1 and len(b) == 1:
        return ()
    if len(a) == 1:
        return (*b[:-2], b[-1])
    if len(b) == 1:
        return a[:-1]
    return (*llm.broadcast(a[:-2], b[:-2]), a[-2], b[-1])


@_maps("MatMul")
def _matmul(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    a, b = g.input(node, 0), g.input(node, 1)
    shape = _matmul_shape(llm.shape_of(a), llm.shape_of(b))
    return [g.emit(llm.BatchMatmulOp(a, b, g.result_type(node, 0, shape, _dtype_of(a))))]


@_maps("Gemm")
def _gemm(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    a, b, c = g.input(node, 0), g.input(node, 1), g.optional(node, 2)
    if _attr(node, "transA", 0):
        a = g.emit(llm.TransposeOp(a, (1, 0)))
    if _attr(node, "transB", 0):
        b = g.emit(llm.TransposeOp(b, (1, 0)))
    y = g.emit(llm.BatchMatmulOp(a, b))
    alpha, beta = _attr(node, "alpha", 1.0), _attr(node, "beta", 1.0)
    if alpha != 1:
        y = g.emit(llm.MulOp(y, g.scalar(alpha, y)))
    if c is not None:
        if beta != 1:
            c = g.emit(llm.MulOp(c, g.scalar(beta, c)))
        y = g.emit(llm.AddOp(y, c, y.type))
    return [y]


@_maps("Reshape")
def _reshape(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x, to = g.input(node, 0), g.cast(g.input(node, 1), np.dtype(np.int64))
    src = llm.shape_of(x)
    if len(llm.shape_of(to)) != 1 or llm.shape_of(to)[0] is None:
        raise g.error(node, "the target shape must be a 1-D tensor of static length")
    (n,) = llm.shape_of(to)
    copies = not _attr(node, "allowzero", 0)  # a 0 in the target copies the input's dimension
    target = g.known.get(to)
    if target is None:
        def runtime() -> SSAValue:
            if not copies:
                return to
            here = g.dims(x, 0, min(n, len(src)))
            if n > len(src):
                here = g.emit(llm.ConcatOp([here, g.i64s([0] * (n - len(src)))], 0))
            return g.emit(llm.WhereOp(g.emit(llm.EqualOp(to, g.i64s([0] * n))), here, to))

        return [g.reshape(x, g.result_type(node, 0, [None] * n, _dtype_of(x)), runtime)]
    target = target.tolist()
    if copies and any(d == 0 and i >= len(src) for i, d in enumerate(target)):
        raise g.error(node, f"target {target} copies a dimension the input tensor<{src}> lacks")
    dims = [src[i] if d == 0 and copies else (None if d == -1 else d) for i, d in enumerate(target)]
    if -1 in target and None not in src and dims.count(None) == 1:
        rest = math.prod(d for d in dims if d is not None)
        dims[target.index(-1)] = math.prod(src) // rest if rest else 0

    def given() -> SSAValue:
        if None not in dims:
            return g.i64s(dims)
        if copies and 0 in target:  # dimensions copied at run time
            parts = [g.dims(x, i, i + 1) if d == 0 else g.i64s([d]) for i, d in enumerate(target)]
            return g.emit(llm.ConcatOp(parts, 0))
        return to

    return [g.reshape(x, g.result_type(node, 0, dims, _dtype_of(x)), given)]


@_maps("Flatten")
def _flatten(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    shape = llm.shape_of(x)
    axis = _attr(node, "axis", 1)
    axis += len(shape) if axis < 0 else 0
    sides = ((0, axis), (axis, len(shape)))
    dims = [None if None in shape[lo:hi] else math.prod(shape[lo:hi]) for lo, hi in sides]

    def runtime() -> SSAValue:
        parts = [g.i64s([d]) if d is not None else g.emit(llm.ReduceProdOp(g.dims(x, lo, hi), [0], True))
                 for d, (lo, hi) in zip(dims, sides)]
        return g.emit(llm.ConcatOp(parts, 0))

    return [g.reshape(x, g.result_type(node, 0, dims, _dtype_of(x)), runtime)]


@_maps("Transpose")
def _transpose(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    perm = _attr(node, "perm", list(reversed(range(len(llm.shape_of(x))))))
    return [g.emit(llm.TransposeOp(x, list(perm)))]


@_maps("Unsqueeze")
def _unsqueeze(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    given = g.static(node, 1, "axes")
    if given is None:
        raise g.error(node, "its axes (input 1) are missing")
    return [g.emit(llm.UnsqueezeOp(x, _axes(g, node, 1, len(llm.shape_of(x)) + given.size)))]


@_maps("Squeeze")
def _squeeze(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    shape = llm.shape_of(x)
    axes = _axes(g, node, 1, len(shape))
    if axes is None:
        if None in shape:
            raise g.error(node, f"without axes, which dimensions of tensor<{shape}> to squeeze is only known at "
                                f"run time")
        axes = [i for i, d in enumerate(shape) if d == 1]
    return [g.emit(llm.SqueezeOp(x, axes))]


@_maps("Slice")
def _slice(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    shape = llm.shape_of(x)
    starts, ends = (g.cast(g.input(node, i), np.dtype(np.int64)) for i in (1, 2))
    (n,) = llm.shape_of(starts)
    axes, steps = (g.optional(node, i) for i in (3, 4))
    if n is None:
        raise g.error(node, "starts must have a static length")
    axes = g.i64s(range(n)) if axes is None else g.cast(axes, np.dtype(np.int64))
    steps = g.i64s([1] * n) if steps is None else g.cast(steps, np.dtype(np.int64))
    values = [g.known.get(v) for v in (starts, ends, axes, steps)]
    out: list[int | None] = list(shape)
    if values[2] is None:
        out = [None] * len(shape)
    else:
        for i, a in enumerate(values[2].tolist()):
            a %= len(shape)
            if shape[a] is None or any(v is None for v in values):
                out[a] = None
                continue
            start, end, step = (int(v[i]) for v in (values[0], values[1], values[3]))
            out[a] = len(range(*slice(start, end, step).indices(shape[a]))) if step else None
    return [g.emit(llm.SliceOp(x, starts, ends, axes, steps, g.result_type(node, 0, out, _dtype_of(x))))]


@_maps("Split")
def _split(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    shape = llm.shape_of(x)
    axis = _attr(node, "axis", 0) % len(shape)
    sizes = g.static(node, 1, "split")
    count = len(node.output)
    if sizes is None:
        if shape[axis] is None:
            raise g.error(node, f"splitting axis {axis} of tensor<{shape}> needs split sizes, it is dynamic")
        part = -(-shape[axis] // count)
        sizes = [min(part, shape[axis] - i * part) for i in range(count)]
    else:
        sizes = sizes.tolist()
    bounds = np.cumsum([0, *sizes]).tolist()
    return [g.slice(x, axis, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


@_maps("Concat")
def _concat(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    inputs = [g.input(node, i) for i in range(len(node.input))]
    axis = _attr(node, "axis")
    shape = list(llm.shape_of(inputs[0]))
    axis %= len(shape)
    sizes = [llm.shape_of(v)[axis] for v in inputs]
    shape[axis] = None if None in sizes else sum(sizes)
    return [g.emit(llm.ConcatOp(inputs, axis, g.result_type(node, 0, shape, _dtype_of(inputs[0]))))]


@_maps("Gather")
def _gather(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x, indices = g.input(node, 0), g.input(node, 1)
    shape = llm.shape_of(x)
    axis = _attr(node, "axis", 0) % len(shape)
    out = (*shape[:axis], *llm.shape_of(indices), *shape[axis + 1:])
    return [g.emit(llm.GatherOp(x, indices, axis, g.result_type(node, 0, out, _dtype_of(x))))]


@_maps("GatherND")
def _gather_nd(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x, indices = g.input(node, 0), g.input(node, 1)
    batch = _attr(node, "batch_dims", 0)
    ishape, xshape = llm.shape_of(indices), llm.shape_of(x)
    out = None if ishape[-1] is None else (*ishape[:-1], *xshape[batch + ishape[-1]:])
    return [g.emit(llm.GatherNdOp(x, indices, batch, g.result_type(node, 0, out, _dtype_of(x))))]


def _shape_value(g: _Graph, node: onnx.NodeProto, i: int) -> tuple[SSAValue, list[int | None]]:
    """Input `i`, a 1-D shape, as i64, and the dimensions it says where they are known."""
    s = g.cast(g.input(node, i), np.dtype(np.int64))
    (n,) = llm.shape_of(s)
    if n is None:
        raise g.error(node, "the shape input must have a static length")
    known = g.known.get(s)
    return s, ([None] * n if known is None else known.tolist())


@_maps("Expand")
def _expand(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    s, dims = _shape_value(g, node, 1)
    out = llm.broadcast(llm.shape_of(x), dims)
    return [g.emit(llm.ExpandOp(x, s, g.result_type(node, 0, out, _dtype_of(x))))]


@_maps("ConstantOfShape")
def _constant_of_shape(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    s, dims = _shape_value(g, node, 0)
    given = _attr(node, "value")
    value = np.zeros((), np.float32) if given is None else tensor_array(given, g.source, g.directory).reshape(())
    return [g.emit(llm.FillOp(s, g.constant(value), g.result_type(node, 0, dims, value.dtype)))]


@_maps("Range")
def _range(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    start, limit, delta = (g.input(node, i) for i in range(3))
    values = [g.known.get(v) for v in (start, limit, delta)]
    count = None
    if all(v is not None for v in values) and values[2].item() != 0:
        count = max(math.ceil((values[1].item() - values[0].item()) / values[2].item()), 0)
    return [g.emit(llm.RangeOp(start, limit, delta, g.result_type(node, 0, [count], _dtype_of(start))))]


@_maps("Trilu")
def _trilu(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    k = g.optional(node, 1)
    k = g.constant(np.zeros((), np.int64)) if k is None else k
    return [g.emit(llm.TriluOp(g.input(node, 0), k, bool(_attr(node, "upper", 1))))]


@_maps("Shape")
def _shape(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    rank = len(llm.shape_of(x))
    start, end = (max(0, min(rank, (v + rank if v < 0 else v))) for v in (_attr(node, "start", 0),
                                                                              _attr(node, "end", rank)))
    return [g.dims(x, start, max(start, end))]


@_maps("Size")
def _size(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    shape = llm.shape_of(x)
    if None not in shape:
        return [g.constant(np.asarray(math.prod(shape), np.int64))]
    return [g.emit(llm.ReduceProdOp(g.dims(x, 0, len(shape)), [0], False))]


@_maps("Constant")
def _constant(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    if len(node.attribute) != 1:
        raise g.error(node, "a constant has exactly one value attribute")
    (a,) = node.attribute
    name = node.output[0]
    if a.name == "value":
        array = tensor_array(a.t, g.source, g.directory)
        if array.size > llm.ConstantOp.LIMIT and array.dtype.kind == "f":
            return [g.weight(name, array)]
        return [g.constant(np.asarray(array), name)]
    forms = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64}
    if a.name not in forms:
        raise g.error(node, f"a constant given as '{a.name}' is not supported")
    return [g.constant(np.asarray(helper.get_attribute_value(a), forms[a.name]), name)]


@_maps("CumSum")
def _cumsum(g: _Graph, node: onnx.NodeProto) -> list[SSAValue]:
    axis = g.static(node, 1, "axis")
    return [g.emit(llm.CumsumOp(g.input(node, 0), int(axis.reshape(())), bool(_attr(node, "exclusive", 0)),
                                bool(_attr(node, "reverse", 0))))]

