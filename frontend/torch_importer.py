"""The state of one torch.export import: each FX node's `llm` value, each value's shape, and
how a node's arguments become operands.

The op tables (`torch_math`, `torch_shapes`) map each ATen call through a `ProgramImporter`:
`im.tensor(a["self"], dtype)` is an operand (a Python scalar becomes a constant, one op per
distinct value), `im.add(op)` appends an op, `im.type_of(node)` is the node's result type from
its `meta["val"]` (a symbolic dimension is `?`), and `im.vector([1, n])` is a 1-D i64 tensor
of ints and SymInt nodes (`n`, here `%sym_size_int`):

```mlir
%0 = llm.constant dense<1> : tensor<1xi64>
%1 = llm.unsqueeze %sym_size_int axes [0] : (tensor<i64>) -> tensor<1xi64>  // im.vector([1, sym_size_int])
%2 = llm.concat %0, %1 axis 0 : (tensor<1xi64>, tensor<1xi64>) -> tensor<2xi64>
```
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from xdsl.dialects.builtin import ModuleOp, TensorType, i64
from xdsl.ir import Operation, SSAValue
from xdsl.utils.exceptions import VerifyException

from llmc.errors import ModelFormatError
from llmc.frontend.graph import GraphBuilder, tensor_type
from llmc.frontend.pt2_loader import target_name
from llmc.ir import llm
from llmc.ir.weights import WeightStore

AtenMapping = Callable[["ProgramImporter", fx.Node, dict], SSAValue]  # a node's ops (arguments by name and position)

_DTYPES = {
    torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64, torch.int64: np.int64,
    torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_,
}
SLICE_END = 2**63 - 1  # torch's "to the end" slice bound


def axis_index(axis: int, rank: int) -> int:
    """A dimension argument (negative counts from the end) as an index into a tensor of `rank`."""
    return axis % max(rank, 1)


def _numpy_dtype(source: Path, node: fx.Node, dtype: torch.dtype) -> np.dtype:
    found = _DTYPES.get(dtype)
    if found is None:
        raise ModelFormatError(source, f"node '{node.name}' has element type {dtype}, which llmc does not import "
                                       "(export the model in float32)")
    return np.dtype(found)


def _probe(arg: object) -> object:
    """A stand-in with `arg`'s dtype and type-promotion category, for `torch.result_type`."""
    if isinstance(arg, fx.Node):
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            return torch.empty((0,) * min(val.dim(), 1), dtype=val.dtype)
        return {torch.SymInt: 0, torch.SymFloat: 0.0, torch.SymBool: False}.get(type(val), val)
    return arg


class ProgramImporter:
    """The state of one import: the builder, each node's value and each value's shape."""

    def __init__(self, ep: ExportedProgram, source: Path, mappings: dict[object, AtenMapping]):
        self.ep = ep
        self.source = source
        self.mappings = mappings
        self.b = GraphBuilder.decoder(source)
        self.values: dict[fx.Node, SSAValue] = {}
        self._shapes: dict[SSAValue, SSAValue] = {}
        self._constants: dict[tuple, SSAValue] = {}
        self._specs = {spec.arg.name: spec for spec in ep.graph_signature.input_specs}

    def fail(self, node: fx.Node, problem: str) -> ModelFormatError:
        return ModelFormatError(self.source, f"node '{node.name}' {problem}")

    # types and operands

    def dtype(self, node: fx.Node) -> np.dtype:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return _numpy_dtype(self.source, node, val.dtype)
        if isinstance(val, torch.SymInt | int):
            return np.dtype(np.int64)
        raise self.fail(node, f"has no tensor or integer value ({type(val).__name__})")

    def type_of(self, node: fx.Node) -> TensorType:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return tensor_type((), self.dtype(node))
        return tensor_type([None if isinstance(d, torch.SymInt) else int(d) for d in val.shape], self.dtype(node))

    def promoted(self, *args: object) -> np.dtype:
        return np.dtype(_DTYPES[torch.result_type(*(_probe(a) for a in args[:2]))])

    def add(self, op: Operation) -> SSAValue:
        return self.b.add(op)

    def const(self, value: object, dtype: np.dtype | type) -> SSAValue:
        """A small constant, one op per distinct value."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            self._constants[key] = self.b.constant(array)
        return self._constants[key]

    def tensor(self, arg: object, dtype: np.dtype | None = None) -> SSAValue:
        """The value of a node or Python scalar, converted to `dtype` where given."""
        if not isinstance(arg, fx.Node):
            if dtype is None:
                raise TypeError(f"a scalar {arg!r} needs a dtype")
            return self.const(arg, dtype)
        value = self.values[arg]
        return value if dtype is None else self.tensor_value(value, dtype)

    def vector(self, items: Sequence[object]) -> SSAValue:
        """A 1-D i64 tensor of ints and SymInt nodes (sizes, slice bounds)."""
        parts: list[SSAValue] = []
        run: list[int] = []  # consecutive ints make one constant
        for item in [*items, None]:
            if item is not None and not isinstance(item, fx.Node):
                run.append(int(item))
                continue
            if run:
                parts.append(self.const(run, np.int64))
                run = []
            if item is not None:
                parts.append(self.add(llm.UnsqueezeOp(self.tensor(item), [0])))
        return self.add(llm.ConcatOp(parts, 0)) if len(parts) > 1 else parts[0]

    def shape(self, value: SSAValue) -> SSAValue:
        if value not in self._shapes:
            rank = len(llm.shape_of(value))
            self._shapes[value] = self.add(llm.ShapeOfOp(value, llm.tensor(rank, element_type=i64)))
        return self._shapes[value]

    def dim(self, value: SSAValue, axis: int) -> SSAValue:
        """Dimension `axis` of `value` as an i64 scalar: shape_of, slice, squeeze."""
        one = llm.tensor(1, element_type=i64)
        start, end = self.const([axis], np.int64), self.const([axis + 1], np.int64)
        piece = self.add(llm.SliceOp(self.shape(value), start, end, self.const([0], np.int64),
                                     self.const([1], np.int64), one))
        return self.add(llm.SqueezeOp(piece, [0]))

    def cast_to(self, node: fx.Node, value: SSAValue) -> SSAValue:
        """`value` with `node`'s element type."""
        return self.tensor_value(value, self.dtype(node))

    def tensor_value(self, value: SSAValue, dtype: np.dtype) -> SSAValue:
        if llm.element_type(value) == tensor_type((), dtype).element_type:
            return value
        return self.add(llm.CastOp(value, tensor_type(llm.shape_of(value), dtype)))

    # the program

    def placeholder(self, node: fx.Node) -> SSAValue:
        spec = self._specs[node.name]
        if spec.kind == InputKind.USER_INPUT:
            return self.user_input(node)
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            raise self.fail(node, f"is a {spec.kind.name.lower()} input, which llmc does not import")
        key = spec.target
        found = self.ep.state_dict.get(key, self.ep.constants.get(key))
        if not isinstance(found, torch.Tensor):
            raise self.fail(node, f"names '{key}', which the program has no tensor for")
        self.dtype(node)  # a dtype llmc reads (one line for bf16 and the like), before numpy must convert it
        array = found.detach().cpu().contiguous().numpy()
        if not np.issubdtype(array.dtype, np.floating):
            return self.b.constant(array, key)
        if spec.kind == InputKind.CONSTANT_TENSOR and array.size <= llm.ConstantOp.LIMIT:
            return self.b.constant(array.astype(self.dtype(node)), key)
        value = self.b.weight(key, array)
        return self.cast_to(node, value)  # the store reads f32; an f16 graph computes in f16

    def user_input(self, node: fx.Node) -> SSAValue:
        shape = llm.shape_of(self.type_of(node))
        if node.name.startswith("past") and len(shape) == 4:  # a layer's past keys or values: none
            return self.b.empty_past(shape, self.dtype(node), node.name)
        if node.name == "attention_mask" and len(shape) == 2:  # [1, past + tokens]: the past is empty
            return self.b.attention_mask(self.dtype(node))
        if len(shape) != 2 or shape[0] != 1 or shape[1] is not None:
            raise self.fail(node, f"must be [1, tokens] with a dynamic token dimension (export it with "
                                  f"export_decoder), got {list(shape)}")
        inputs = {"input_ids": self.b.input_ids, "position_ids": self.b.position_ids}
        if node.name not in inputs:
            raise self.fail(node, "is an input llmc cannot feed (only input_ids, position_ids, attention_mask, "
                                  "past keys and values)")
        return self.cast_to(node, inputs[node.name]())

    def run(self) -> tuple[ModuleOp, WeightStore]:
        signature = self.ep.graph_signature
        outputs = next(n for n in self.ep.graph.nodes if n.op == "output").args[0]
        logits = None
        for spec, out in zip(signature.output_specs, outputs):
            if spec.kind != OutputKind.USER_OUTPUT:
                raise ModelFormatError(self.source, f"the program's output '{spec.arg.name}' is a "
                                                    f"{spec.kind.name.lower()}, which llmc does not import")
            if logits is None:
                logits = out
        if not isinstance(logits, fx.Node):
            raise ModelFormatError(self.source, "the program has no tensor output (the logits)")
        live = _live(logits)
        for node in self.ep.graph.nodes:
            if node not in live:
                continue
            value = self.placeholder(node) if node.op == "placeholder" else self.call(node)
            if value.name_hint is None:
                value.name_hint = node.name
            self.values[node] = value
        return self.b.finish_decoder(self.values[logits]), self.b.weights

    def call(self, node: fx.Node) -> SSAValue:
        if node.op != "call_function":
            raise self.fail(node, f"is a {node.op} node, which llmc does not import")
        target = node.target
        mapping = self.mappings.get(target) or self.mappings.get(getattr(target, "overloadpacket", None))
        if mapping is None:
            raise self.fail(node, f"calls {target_name(target)}, which llmc does not import")
        args = _arguments(node) if isinstance(target, torch._ops.OpOverload) else dict(enumerate(node.args))
        try:
            return mapping(self, node, args)
        except (KeyError, TypeError, ValueError, IndexError, VerifyException) as e:  # a malformed graph
            raise self.fail(node, f"calls {target_name(target)} in a way llmc cannot import ({e})") from e


def _arguments(node: fx.Node) -> dict[object, object]:
    """The node's arguments by schema name (defaults filled in) and by position."""
    out: dict[object, object] = {}
    for i, argument in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            value = node.args[i]
        elif argument.name in node.kwargs:
            value = node.kwargs[argument.name]
        else:
            value = argument.default_value if argument.has_default_value() else None
        out[argument.name] = out[i] = value
    return out


def _live(root: fx.Node) -> set[fx.Node]:
    """The nodes `root` depends on, itself included."""
    live, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node not in live:
            live.add(node)
            todo.extend(node.all_input_nodes)
    return live
