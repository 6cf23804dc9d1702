"""The `llm` dialect's primitive ops, elementwise and reductions: what a graph frontend
(torch.export, ONNX) imports before `optimize` raises the subgraphs it knows into the model ops
(`llmc.ir.llm.model_ops`); `llm.add` and `llm.mul` serve both.

Numpy semantics on tensors of any rank and element type (f32, f16, f64, i64, i32, i8, u8, i1),
with numpy / ONNX broadcasting. Dimensions the source leaves symbolic are `?`; where an op's
result shape depends on data (a reshape to a computed shape, a range), the data is an operand,
as in ONNX (`llmc.ir.llm.shape_ops`).

```mlir
%d = llm.sub %a, %b : (tensor<?x1xf32>, tensor<f32>) -> tensor<?x1xf32>
%m = llm.reduce_mean %sq axes [2] keepdims : (tensor<1x?x32xf32>) -> tensor<1x?x1xf32>
```
"""


from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import ClassVar

from xdsl.dialects.builtin import (
    DenseArrayBase,
    DenseIntOrFPElementsAttr,
    Float32Type,
    TensorType,
    UnitAttr,
    i1,
    i64,
)
from xdsl.ir import (
    Attribute,
    SSAValue,
)
from xdsl.irdl import (
    IRDLOperation,
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.printer import Printer
from xdsl.traits import Pure

from llmc.ir.llm.attributes import _dims, _normalized_axis, _ShapeChecks, broadcast, element_type, shape_of, tensor
from llmc.ir.llm.model_ops import _UnaryOp


class _TypedOp(IRDLOperation, _ShapeChecks):
    """Ops printed `%r = llm.op %a, %b props : (type(a), type(b)) -> type(r)`, or `: type` when
    every operand and the result have one type."""

    def print(self, printer: Printer) -> None:
        printer.print_string(" ")
        printer.print_list(self.operands, printer.print_operand)
        self._print_props(printer)
        printer.print_op_attributes(self.attributes)
        printer.print_string(" : ")
        types = [v.type for v in self.operands]
        if types and all(t == self.results[0].type for t in types):
            printer.print_attribute(types[0])
            return
        printer.print_string("(")
        printer.print_list(types, printer.print_attribute)
        printer.print_string(") -> ")
        printer.print_attribute(self.results[0].type)

    def _print_props(self, printer: Printer) -> None:
        pass

    @classmethod
    def parse(cls, parser):  # noqa: ANN001, ANN206
        operands = parser.parse_comma_separated_list(parser.Delimiter.NONE, parser.parse_unresolved_operand)
        properties = cls._parse_props(parser)
        attributes = parser.parse_optional_attr_dict()
        parser.parse_punctuation(":")
        if parser.parse_optional_punctuation("(") is not None:
            types = parser.parse_comma_separated_list(parser.Delimiter.NONE, parser.parse_type) \
                if parser.parse_optional_punctuation(")") is None else []
            if types:
                parser.parse_punctuation(")")
            parser.parse_punctuation("->")
            result = parser.parse_type()
        else:
            result = parser.parse_type()
            types = [result] * len(operands)
        values = parser.resolve_operands(operands, types, parser.pos)
        return cls.create(operands=values, result_types=[result], properties=properties, attributes=attributes)

    @classmethod
    def _parse_props(cls, parser) -> dict[str, Attribute]:  # noqa: ANN001
        return {}


class _BinaryOp(_TypedOp):
    """Elementwise ops of two tensors with numpy broadcasting; the result has `lhs`'s element type
    (i1 for comparisons and logic)."""

    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    BOOLEAN: ClassVar[bool] = False  # the result is i1

    def __init__(self, lhs: SSAValue, rhs: SSAValue, result_type: Attribute | None = None):
        if result_type is None:
            element = i1 if self.BOOLEAN else element_type(lhs)
            result_type = tensor(*broadcast(shape_of(lhs), shape_of(rhs)), element_type=element)
        super().__init__(operands=[lhs, rhs], result_types=[result_type])

    def verify_(self) -> None:
        shape = broadcast(shape_of(self.lhs), shape_of(self.rhs))
        result = shape_of(self.result)
        if len(result) != len(shape) or any(a is not None and b is not None and a != b for a, b in zip(shape, result)):
            self._fail(f"result tensor<{_dims(result)}> is not the broadcast shape <{_dims(shape)}>")
        if element_type(self.lhs) != element_type(self.rhs):
            self._fail(f"operand element types differ: {element_type(self.lhs)} vs {element_type(self.rhs)}")
        expected = i1 if self.BOOLEAN else element_type(self.lhs)
        if element_type(self.result) != expected:
            self._fail(f"result element type must be {expected}")


class _PredicateOp(_BinaryOp):
    """Comparisons and logic: binary ops with an i1 result."""

    BOOLEAN: ClassVar[bool] = True


class _LogicOp(_PredicateOp):
    """Logic: binary ops of i1 tensors."""

    def verify_(self) -> None:
        super().verify_()
        if element_type(self.lhs) != i1:
            self._fail(f"operands must be i1, not {element_type(self.lhs)}")


def _named_op(base: type[IRDLOperation], op_name: str, doc: str) -> type[IRDLOperation]:
    """A subclass of `base` named after `op_name` (`llm.less_equal`: `LessEqualOp`) with `doc`, its `KIND`
    the name without the dialect and family (`less_equal`, `llm.reduce_sum`: `sum`): the kind of the
    generic `tgt` kernel it lowers to. Its numpy meaning is in `llmc.ir.interpreter`."""
    kind = op_name.split(".")[1].removeprefix("reduce_")
    cls = type(op_name.split(".")[1].title().replace("_", "") + "Op", (base,),
               {"name": op_name, "KIND": kind, "__doc__": doc, "__module__": __name__,
                "__annotations__": {"KIND": ClassVar[str]}})
    return irdl_op_definition(cls)


def _binary(op_name: str, doc: str, boolean: bool = False) -> type[IRDLOperation]:
    base = (_LogicOp if op_name in ("llm.and", "llm.or", "llm.xor") else _PredicateOp) if boolean else _BinaryOp
    return _named_op(base, op_name, doc)


SubOp = _binary("llm.sub", """Elementwise difference, broadcast: `%d = llm.sub %a, %b : (tensor<?x1xf32>, tensor<f32>) -> tensor<?x1xf32>`.""")
DivOp = _binary("llm.div", """Elementwise quotient (integers truncate toward zero): `%q = llm.div %a, %b : tensor<?x8xf32>`.""")
PowOp = _binary("llm.pow", """Elementwise power: `%sq = llm.pow %x, %two : (tensor<1x?x32xf32>, tensor<f32>) -> tensor<1x?x32xf32>`.""")
MaximumOp = _binary("llm.maximum", """Elementwise maximum: `%m = llm.maximum %a, %b : tensor<4xi64>`.""")
MinimumOp = _binary("llm.minimum", """Elementwise minimum: `%m = llm.minimum %a, %b : tensor<4xi64>`.""")
ModOp = _binary("llm.mod", """Elementwise remainder with the sign of the divisor (numpy's, ONNX `fmod=0`):
`%r = llm.mod %a, %b : tensor<4xi64>`.""")
EqualOp = _binary("llm.equal", """Elementwise `a == b` as i1: `%e = llm.equal %a, %b : (tensor<?xi64>, tensor<i64>) -> tensor<?xi1>`.""", True)
LessOp = _binary("llm.less", """Elementwise `a < b` as i1: `%l = llm.less %a, %b : (tensor<?xi64>, tensor<?x1xi64>) -> tensor<?x?xi1>`.""", True)
LessEqualOp = _binary("llm.less_equal", """Elementwise `a <= b` as i1: `%l = llm.less_equal %a, %b : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xi1>`.""", True)
GreaterOp = _binary("llm.greater", """Elementwise `a > b` as i1: `%g = llm.greater %a, %b : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xi1>`.""", True)
GreaterEqualOp = _binary("llm.greater_equal", """Elementwise `a >= b` as i1: `%g = llm.greater_equal %a, %b : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xi1>`.""", True)
AndOp = _binary("llm.and", """Elementwise logical and of i1 tensors: `%m = llm.and %a, %b : tensor<1x1x?x?xi1>`.""", True)
OrOp = _binary("llm.or", """Elementwise logical or of i1 tensors: `%m = llm.or %a, %b : tensor<3xi1>`.""", True)
XorOp = _binary("llm.xor", """Elementwise logical exclusive or of i1 tensors: `%m = llm.xor %a, %b : tensor<3xi1>`.""", True)


class _ConvertOp(_TypedOp):
    """Elementwise ops of one tensor whose result may have another element type."""

    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, result_type: Attribute):
        super().__init__(operands=[x], result_types=[result_type])

    def verify_(self) -> None:
        a, b = shape_of(self.input), shape_of(self.result)
        if len(a) != len(b) or any(x is not None and y is not None and x != y for x, y in zip(a, b)):
            self._fail(f"the result has the input's shape, tensor<{_dims(a)}>, not tensor<{_dims(b)}>")


@irdl_op_definition
class CastOp(_ConvertOp):
    """Elementwise conversion to the result's element type (floats to integers truncate; to i1: `x != 0`).

    ```mlir
    %f = llm.cast %ids : (tensor<1x?xi64>) -> tensor<1x?xf32>
    ```
    """

    name = "llm.cast"


@irdl_op_definition
class IsNanOp(_ConvertOp):
    """Elementwise `isnan` as i1: `%n = llm.isnan %x : (tensor<1x4x?x?xf32>) -> tensor<1x4x?x?xi1>`."""

    name = "llm.isnan"


def _unary(op_name: str, doc: str) -> type[IRDLOperation]:
    return _named_op(_UnaryOp, op_name, doc)


NegOp = _unary("llm.neg", """Elementwise negation: `%n = llm.neg %x : tensor<1x4x?x4xf32>`.""")
AbsOp = _unary("llm.abs", """Elementwise absolute value: `%a = llm.abs %x : tensor<3xf32>`.""")
SqrtOp = _unary("llm.sqrt", """Elementwise square root: `%s = llm.sqrt %x : tensor<1x?x1xf32>`.""")
RsqrtOp = _unary("llm.rsqrt", """Elementwise `1/sqrt(x)`: `%r = llm.rsqrt %x : tensor<1x?x1xf32>`.""")
ReciprocalOp = _unary("llm.reciprocal", """Elementwise `1/x`: `%r = llm.reciprocal %x : tensor<1x?x1xf32>`.""")
ExpOp = _unary("llm.exp", """Elementwise `e^x`: `%e = llm.exp %x : tensor<3xf32>`.""")
LogOp = _unary("llm.log", """Elementwise natural logarithm: `%l = llm.log %x : tensor<3xf32>`.""")
TanhOp = _unary("llm.tanh", """Elementwise hyperbolic tangent: `%t = llm.tanh %x : tensor<?x8xf32>`.""")
CosOp = _unary("llm.cos", """Elementwise cosine: `%c = llm.cos %angles : tensor<1x?x64xf32>`.""")
SinOp = _unary("llm.sin", """Elementwise sine: `%s = llm.sin %angles : tensor<1x?x64xf32>`.""")
ErfOp = _unary("llm.erf", """Elementwise error function (exact GELU uses it): `%e = llm.erf %x : tensor<?x8xf32>`.""")
SigmoidOp = _unary("llm.sigmoid", """Elementwise `1/(1 + e^-x)`: `%s = llm.sigmoid %x : tensor<1x?x48xf32>`.""")
ReluOp = _unary("llm.relu", """Elementwise `max(x, 0)`: `%r = llm.relu %x : tensor<3xf32>`.""")
FloorOp = _unary("llm.floor", """Elementwise floor: `%f = llm.floor %x : tensor<3xf32>`.""")
CeilOp = _unary("llm.ceil", """Elementwise ceiling: `%c = llm.ceil %x : tensor<3xf32>`.""")
class _NotOp(_UnaryOp):
    def verify_(self) -> None:
        if element_type(self.input) != i1:
            self._fail(f"the operand must be i1, not {element_type(self.input)}")


NotOp = _named_op(_NotOp, "llm.not", """Elementwise logical not of an i1 tensor: `%n = llm.not %m : tensor<1x?xi1>`.""")


@irdl_op_definition
class ConstantOp(IRDLOperation, _ShapeChecks):
    """A small tensor given in the IR (shapes, indices, scalars; weights stay in the weight store).

    ```mlir
    %two = llm.constant dense<2.000000e+00> : tensor<f32>
    %perm = llm.constant dense<[1, -1, 4, 8]> : tensor<4xi64>
    ```
    """

    name = "llm.constant"
    value = prop_def(DenseIntOrFPElementsAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    LIMIT: ClassVar[int] = 4096  # the most elements a constant may have; frontends keep bigger ones as weights

    def __init__(self, value: DenseIntOrFPElementsAttr):
        super().__init__(properties={"value": value}, result_types=[value.type])

    def print(self, printer: Printer) -> None:
        printer.print_string(" ")
        values = self.value.get_values()
        if isinstance(self.value.get_element_type(), Float32Type) and not all(math.isfinite(v) for v in values):
            # xDSL parses ±inf and NaN back wrongly from `dense<[0xff800000, …]>`; raw bytes round-trip
            raw = struct.pack(f"<{len(values)}f", *values)
            printer.print_string(f'dense<"0x{raw.hex().upper()}"> : ')
            printer.print_attribute(self.value.type)
        else:
            printer.print_attribute(self.value)
        printer.print_op_attributes(self.attributes)

    @classmethod
    def parse(cls, parser):  # noqa: ANN001, ANN206
        value = parser.parse_attribute()
        attributes = parser.parse_optional_attr_dict()
        if not isinstance(value, DenseIntOrFPElementsAttr):
            parser.raise_error("llm.constant takes a dense<...> : tensor<...> value")
        return cls.create(properties={"value": value}, result_types=[value.type], attributes=attributes)

    def verify_(self) -> None:
        if self.value.type != self.result.type:
            self._fail("the result type is the value's type")


def _axes_prop(axes: Sequence[int]) -> DenseArrayBase:
    return DenseArrayBase.from_list(i64, list(axes))


class _AxesOp(_TypedOp):
    """Ops with an `axes [..]` list (printed after the operands)."""

    axes = prop_def(DenseArrayBase)

    @property
    def axis_list(self) -> tuple[int, ...]:
        return tuple(int(a) for a in self.axes.get_values())

    def _print_props(self, printer: Printer) -> None:
        printer.print_string(" axes [" + ", ".join(str(a) for a in self.axis_list) + "]")
        if self.properties.get("keepdims") is not None:
            printer.print_string(" keepdims")

    @classmethod
    def _parse_props(cls, parser) -> dict[str, Attribute]:  # noqa: ANN001
        parser.parse_keyword("axes")
        axes = parser.parse_comma_separated_list(parser.Delimiter.SQUARE, lambda: parser.parse_integer(False))
        props: dict[str, Attribute] = {"axes": _axes_prop(axes)}
        if parser.parse_optional_keyword("keepdims") is not None:
            props["keepdims"] = UnitAttr()
        return props


class _ReduceOp(_AxesOp):
    """Reductions over `axes` (sorted, non-negative), keeping them as 1s with `keepdims`."""

    input = operand_def(TensorType)
    keepdims = opt_prop_def(UnitAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, axes: Sequence[int], keepdims: bool, result_type: Attribute | None = None):
        shape = shape_of(x)
        axes = sorted({_normalized_axis(a, len(shape)) for a in axes})
        if result_type is None:
            kept = [1 if i in axes else d for i, d in enumerate(shape)] if keepdims else \
                [d for i, d in enumerate(shape) if i not in axes]
            result_type = tensor(*kept, element_type=element_type(x))
        props: dict[str, Attribute] = {"axes": _axes_prop(axes)}
        if keepdims:
            props["keepdims"] = UnitAttr()
        super().__init__(operands=[x], properties=props, result_types=[result_type])

    def verify_(self) -> None:
        rank = len(shape_of(self.input))
        axes = self.axis_list
        if list(axes) != sorted(set(axes)) or any(not 0 <= a < max(rank, 1) for a in axes):
            self._fail(f"axes {list(axes)} must be sorted, distinct and inside rank {rank}")
        expected = rank if self.keepdims is not None else rank - len(axes)
        if len(shape_of(self.result)) != max(expected, 0):
            self._fail(f"the result must have rank {expected}")


def _reduce(op_name: str, doc: str) -> type[IRDLOperation]:
    return _named_op(_ReduceOp, op_name, doc)


ReduceSumOp = _reduce("llm.reduce_sum", """Sum over `axes`: `%s = llm.reduce_sum %x axes [2] keepdims : (tensor<1x?x32xf32>) -> tensor<1x?x1xf32>`.""")
ReduceMeanOp = _reduce("llm.reduce_mean", """Mean over `axes`: `%m = llm.reduce_mean %sq axes [2] keepdims : (tensor<1x?x32xf32>) -> tensor<1x?x1xf32>`.""")
ReduceMaxOp = _reduce("llm.reduce_max", """Maximum over `axes`: `%m = llm.reduce_max %x axes [0, 1] : (tensor<3x4xf32>) -> tensor<f32>`.""")
ReduceMinOp = _reduce("llm.reduce_min", """Minimum over `axes`: `%m = llm.reduce_min %x axes [1] : (tensor<3x4xf32>) -> tensor<3xf32>`.""")
ReduceProdOp = _reduce("llm.reduce_prod", """Product over `axes`: `%p = llm.reduce_prod %x axes [1] : (tensor<3x4xf32>) -> tensor<3xf32>`.""")


@irdl_op_definition
class AddOp(_BinaryOp):
    """Elementwise sum, broadcast; e.g. a residual connection.

    ```mlir
    %x1 = llm.add %x0, %attn_out : tensor<?x576xf32>
    ```
    """

    name = "llm.add"
    KIND: ClassVar[str] = "add"


@irdl_op_definition
class MulOp(_BinaryOp):
    """Elementwise product, broadcast; e.g. the gate of a SwiGLU feed-forward.

    ```mlir
    %gu = llm.mul %g, %u : tensor<?x1536xf32>
    ```
    """

    name = "llm.mul"
    KIND: ClassVar[str] = "mul"


# the elementwise and reduction families, each op with its `KIND`
BINARY_OPS = (AddOp, MulOp, SubOp, DivOp, PowOp, MaximumOp, MinimumOp, ModOp, EqualOp, LessOp, LessEqualOp, GreaterOp,
              GreaterEqualOp, AndOp, OrOp, XorOp)
UNARY_OPS = (NegOp, AbsOp, SqrtOp, RsqrtOp, ReciprocalOp, ExpOp, LogOp, TanhOp, CosOp, SinOp, ErfOp, SigmoidOp, ReluOp,
             FloorOp, CeilOp, NotOp)
REDUCE_OPS = (ReduceSumOp, ReduceMeanOp, ReduceMaxOp, ReduceMinOp, ReduceProdOp)

PRIMITIVE_OPS = (
    AddOp, MulOp, SubOp, DivOp, PowOp, MaximumOp, MinimumOp, ModOp, EqualOp, LessOp, LessEqualOp, GreaterOp,
    GreaterEqualOp, AndOp, OrOp, XorOp, CastOp, IsNanOp, NegOp, AbsOp, SqrtOp, RsqrtOp, ReciprocalOp, ExpOp, LogOp,
    TanhOp, CosOp, SinOp, ErfOp, SigmoidOp, ReluOp, FloorOp, CeilOp, NotOp, ConstantOp, ReduceSumOp, ReduceMeanOp,
    ReduceMaxOp, ReduceMinOp, ReduceProdOp,
)
