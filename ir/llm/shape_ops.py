"""The `llm` dialect's primitive ops along an axis or over shapes: softmax, cumsum, concat,
gathers, transpose, squeeze and unsqueeze, slice, shape_of, expand, fill, range, trilu, where,
batch_matmul (numpy semantics, as `llmc.ir.llm.primitive_ops`).

```mlir
%c = llm.concat %neg, %lo axis 3 : (tensor<1x4x?x4xf32>, tensor<1x4x?x4xf32>) -> tensor<1x4x?x8xf32>
%p = llm.range %c0, %t, %c1 : (tensor<i64>, tensor<i64>, tensor<i64>) -> tensor<?xi64>
```
"""


from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from xdsl.dialects.builtin import (
    I64,
    IntegerAttr,
    IntegerType,
    TensorType,
    UnitAttr,
    i1,
    i32,
    i64,
)
from xdsl.ir import (
    Attribute,
    SSAValue,
)
from xdsl.irdl import (
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    prop_def,
    result_def,
    traits_def,
    var_operand_def,
)
from xdsl.printer import Printer
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from llmc.ir.llm.attributes import _dims, _normalized_axis, broadcast, element_type, shape_of, tensor
from llmc.ir.llm.primitive_ops import _axes_prop, _AxesOp, _ConvertOp, _TypedOp


class _AxisOp(_TypedOp):
    """Ops with one `axis N` (non-negative)."""

    axis = prop_def(IntegerAttr[I64])

    @property
    def axis_index(self) -> int:
        return self.axis.value.data

    def _print_props(self, printer: Printer) -> None:
        printer.print_string(f" axis {self.axis_index}")
        for flag in self.FLAGS:
            if self.properties.get(flag) is not None:
                printer.print_string(f" {flag}")

    FLAGS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def _parse_props(cls, parser) -> dict[str, Attribute]:  # noqa: ANN001
        parser.parse_keyword("axis")
        props: dict[str, Attribute] = {"axis": IntegerAttr(parser.parse_integer(False), i64)}
        for flag in cls.FLAGS:
            if parser.parse_optional_keyword(flag) is not None:
                props[flag] = UnitAttr()
        return props

    def _check_axis(self, rank: int) -> None:
        if not 0 <= self.axis_index < max(rank, 1):
            self._fail(f"axis {self.axis_index} is outside rank {rank}")


@irdl_op_definition
class SoftmaxOp(_AxisOp):
    """`exp(x - max) / sum(exp(x - max))` along `axis`.

    ```mlir
    %p = llm.softmax %scores axis 3 : tensor<1x4x?x?xf32>
    ```
    """

    name = "llm.softmax"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, axis: int):
        super().__init__(operands=[x], properties={"axis": IntegerAttr(_normalized_axis(axis, len(shape_of(x))), i64)},
                         result_types=[x.type])

    def verify_(self) -> None:
        self._check_axis(len(shape_of(self.input)))


@irdl_op_definition
class CumsumOp(_AxisOp):
    """Running sum along `axis`; `exclusive` leaves out each element itself, `reverse` runs from the end.

    ```mlir
    %c = llm.cumsum %x axis 1 : tensor<1x?xi64>
    ```
    """

    name = "llm.cumsum"
    input = operand_def(TensorType)
    exclusive = opt_prop_def(UnitAttr)
    reverse = opt_prop_def(UnitAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    FLAGS: ClassVar[tuple[str, ...]] = ("exclusive", "reverse")

    def __init__(self, x: SSAValue, axis: int, exclusive: bool = False, reverse: bool = False):
        props: dict[str, Attribute] = {"axis": IntegerAttr(_normalized_axis(axis, len(shape_of(x))), i64)}
        props |= {k: UnitAttr() for k, on in (("exclusive", exclusive), ("reverse", reverse)) if on}
        super().__init__(operands=[x], properties=props, result_types=[x.type])

    def verify_(self) -> None:
        self._check_axis(len(shape_of(self.input)))


@irdl_op_definition
class ConcatOp(_AxisOp):
    """Tensors joined along `axis`.

    ```mlir
    %c = llm.concat %neg, %lo axis 3 : (tensor<1x4x?x4xf32>, tensor<1x4x?x4xf32>) -> tensor<1x4x?x8xf32>
    ```
    """

    name = "llm.concat"
    inputs = var_operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, inputs: Sequence[SSAValue], axis: int, result_type: Attribute | None = None):
        shape = list(shape_of(inputs[0]))
        axis = _normalized_axis(axis, len(shape))
        if result_type is None:
            sizes = [shape_of(v)[axis] for v in inputs]
            shape[axis] = None if None in sizes else sum(sizes)  # type: ignore[arg-type]
            result_type = tensor(*shape, element_type=element_type(inputs[0]))
        super().__init__(operands=[list(inputs)], properties={"axis": IntegerAttr(axis, i64)},
                         result_types=[result_type])

    def verify_(self) -> None:
        if not self.inputs:
            self._fail("needs at least one input")
        result = shape_of(self.result)
        rank, axis = len(result), self.axis_index
        self._check_axis(rank)
        for v in self.inputs:
            shape = shape_of(v)
            if len(shape) != rank or element_type(v) != element_type(self.result):
                self._fail("inputs must have the result's rank and element type")
            if any(a is not None and b is not None and a != b for i, (a, b) in enumerate(zip(shape, result)) if i != axis):
                self._fail(f"input tensor<{_dims(shape)}> differs from the result tensor<{_dims(result)}> off axis {axis}")
        sizes = [shape_of(v)[axis] for v in self.inputs]
        if None not in sizes and result[axis] is not None and sum(sizes) != result[axis]:  # type: ignore[arg-type]
            self._fail(f"the inputs' sizes along axis {axis} sum to {sum(sizes)}, not {result[axis]}")  # type: ignore[arg-type]


@irdl_op_definition
class GatherOp(_AxisOp):
    """Slices of `input` along `axis` at `indices` (negative indices count from the end):
    `result[i..., j..., k...] = input[i..., indices[j...], k...]`.

    ```mlir
    %rows = llm.gather %table, %ids axis 0 : (tensor<64x32xf32>, tensor<1x?xi64>) -> tensor<1x?x32xf32>
    ```
    """

    name = "llm.gather"
    input = operand_def(TensorType)
    indices = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, indices: SSAValue, axis: int, result_type: Attribute | None = None):
        shape = shape_of(x)
        axis = _normalized_axis(axis, len(shape))
        if result_type is None:
            result_type = tensor(*shape[:axis], *shape_of(indices), *shape[axis + 1:], element_type=element_type(x))
        super().__init__(operands=[x, indices], properties={"axis": IntegerAttr(axis, i64)},
                         result_types=[result_type])

    def verify_(self) -> None:
        rank = len(shape_of(self.input))
        self._check_axis(rank)
        if len(shape_of(self.result)) != rank - 1 + len(shape_of(self.indices)):
            self._fail("the result's rank is input rank - 1 + indices rank")
        if not isinstance(element_type(self.indices), IntegerType) or element_type(self.indices) == i1:
            self._fail(f"indices must be integers, not {element_type(self.indices)}")
        if element_type(self.result) != element_type(self.input):
            self._fail("the result has the input's element type")


@irdl_op_definition
class GatherNdOp(_TypedOp):
    """ONNX GatherND: `indices`' last dimension indexes the leading dimensions of `input`,
    after `batch_dims` shared leading dimensions.

    ```mlir
    %g = llm.gather_nd %x, %idx batch_dims 0 : (tensor<1x?xi64>, tensor<1x1x?x1x2xi64>) -> tensor<1x1x?x1xi64>
    ```
    """

    name = "llm.gather_nd"
    input = operand_def(TensorType)
    indices = operand_def(TensorType)
    batch_dims = prop_def(IntegerAttr[I64])
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, indices: SSAValue, batch_dims: int, result_type: Attribute):
        super().__init__(operands=[x, indices], properties={"batch_dims": IntegerAttr(batch_dims, i64)},
                         result_types=[result_type])

    def verify_(self) -> None:
        x, idx, b = shape_of(self.input), shape_of(self.indices), self.batch_dims.value.data
        if not idx or not isinstance(element_type(self.indices), IntegerType):
            self._fail("indices must be an integer tensor of rank >= 1")
        depth = idx[-1]
        if not 0 <= b < len(idx) or (depth is not None and b + depth > len(x)):
            self._fail(f"indices of depth {depth} after {b} batch dimensions do not fit tensor<{_dims(x)}>")
        if depth is not None and len(shape_of(self.result)) != len(idx) - 1 + len(x) - b - depth:
            self._fail("the result's rank is indices' rank - 1 + the input's rank - batch_dims - depth")

    def _print_props(self, printer: Printer) -> None:
        printer.print_string(f" batch_dims {self.batch_dims.value.data}")

    @classmethod
    def _parse_props(cls, parser) -> dict[str, Attribute]:  # noqa: ANN001
        parser.parse_keyword("batch_dims")
        return {"batch_dims": IntegerAttr(parser.parse_integer(False), i64)}


@irdl_op_definition
class TransposeOp(_AxesOp):
    """Dimensions permuted: result dimension `i` is input dimension `axes[i]`.

    ```mlir
    %t = llm.transpose %q axes [0, 2, 1, 3] : (tensor<1x?x4x8xf32>) -> tensor<1x4x?x8xf32>
    ```
    """

    name = "llm.transpose"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, perm: Sequence[int]):
        shape = shape_of(x)
        super().__init__(operands=[x], properties={"axes": _axes_prop(perm)},
                         result_types=[tensor(*(shape[p] for p in perm), element_type=element_type(x))])

    def verify_(self) -> None:
        shape, perm = shape_of(self.input), self.axis_list
        if sorted(perm) != list(range(len(shape))):
            self._fail(f"axes {list(perm)} is not a permutation of rank {len(shape)}")
        if shape_of(self.result) != tuple(shape[p] for p in perm):
            self._fail("the result shape is the permuted input shape")


class _ReshapeLikeOp(_AxesOp):
    """Unsqueeze and squeeze: the same elements with size-1 dimensions added or removed at `axes`."""

    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, axes: Sequence[int]):
        super().__init__(operands=[x], properties={"axes": _axes_prop(sorted(axes))},
                         result_types=[tensor(*self.reshaped(shape_of(x), sorted(axes)), element_type=element_type(x))])

    def verify_(self) -> None:
        try:
            expected = self.reshaped(shape_of(self.input), self.axis_list)
        except (ValueError, IndexError) as e:
            self._fail(str(e))
        if shape_of(self.result) != expected:
            self._fail(f"the result must be tensor<{_dims(expected)}>")


@irdl_op_definition
class UnsqueezeOp(_ReshapeLikeOp):
    """Size-1 dimensions inserted so that they are at `axes` of the result.

    ```mlir
    %u = llm.unsqueeze %cos axes [1] : (tensor<1x?x8xf32>) -> tensor<1x1x?x8xf32>
    ```
    """

    name = "llm.unsqueeze"

    @staticmethod
    def reshaped(shape: Sequence[int | None], axes: Sequence[int]) -> tuple[int | None, ...]:
        out = list(shape)
        rank = len(shape) + len(axes)
        for a in sorted(a % rank for a in axes):
            out.insert(a, 1)
        return tuple(out)


@irdl_op_definition
class SqueezeOp(_ReshapeLikeOp):
    """Size-1 dimensions at `axes` removed.

    ```mlir
    %s = llm.squeeze %x axes [0] : (tensor<1xi64>) -> tensor<i64>
    ```
    """

    name = "llm.squeeze"

    @staticmethod
    def reshaped(shape: Sequence[int | None], axes: Sequence[int]) -> tuple[int | None, ...]:
        axes = [a % max(len(shape), 1) for a in axes]
        if any(shape[a] not in (1, None) for a in axes):
            raise ValueError(f"squeezed axes {axes} must have size 1 in tensor<{_dims(shape)}>")
        return tuple(d for i, d in enumerate(shape) if i not in axes)


@irdl_op_definition
class SliceOp(_TypedOp):
    """ONNX Slice: along each of `axes`, elements `starts:ends:steps` (negative values count from
    the end; bounds are clamped). The four lists are 1-D i64 operands, usually constants.

    ```mlir
    %lo = llm.slice %q, %c0, %c4, %c3, %c1 : (tensor<1x4x?x8xf32>, tensor<1xi64>, tensor<1xi64>, tensor<1xi64>,
            tensor<1xi64>) -> tensor<1x4x?x4xf32>
    ```
    """

    name = "llm.slice"
    input = operand_def(TensorType)
    starts = operand_def(TensorType)
    ends = operand_def(TensorType)
    slice_axes = operand_def(TensorType)
    steps = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, starts: SSAValue, ends: SSAValue, axes: SSAValue, steps: SSAValue,
                 result_type: Attribute):
        super().__init__(operands=[x, starts, ends, axes, steps], result_types=[result_type])

    def verify_(self) -> None:
        if len(shape_of(self.result)) != len(shape_of(self.input)) or element_type(self.result) != element_type(
                self.input):
            self._fail("the result has the input's rank and element type")
        counts = set()
        for what in ("starts", "ends", "slice_axes", "steps"):
            value = getattr(self, what)
            if len(shape_of(value)) != 1 or element_type(value) not in (i64, i32):
                self._fail(f"{what} must be a 1-D i64 or i32 tensor, got {value.type}")
            counts.add(shape_of(value)[0])
        if len(counts - {None}) > 1:
            self._fail("starts, ends, axes and steps must have one length")


@irdl_op_definition
class ShapeOfOp(_ConvertOp):
    """The dimensions of a tensor as a 1-D i64 tensor (ONNX Shape).

    ```mlir
    %s = llm.shape_of %ids : (tensor<1x?xi64>) -> tensor<2xi64>
    ```
    """

    name = "llm.shape_of"

    def verify_(self) -> None:
        if shape_of(self.result) != (len(shape_of(self.input)),) or element_type(self.result) != i64:
            self._fail(f"the result must be tensor<{len(shape_of(self.input))}xi64>")


@irdl_op_definition
class ExpandOp(_TypedOp):
    """`input` broadcast with a tensor of the 1-D i64 `shape` (ONNX Expand: both ways).

    ```mlir
    %e = llm.expand %k, %shape : (tensor<1x2x1x?x8xf32>, tensor<5xi64>) -> tensor<1x2x2x?x8xf32>
    ```
    """

    name = "llm.expand"
    input = operand_def(TensorType)
    shape = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, shape: SSAValue, result_type: Attribute):
        super().__init__(operands=[x, shape], result_types=[result_type])

    def verify_(self) -> None:
        n = self._shape_length(self.shape)
        if n is not None and len(shape_of(self.result)) != max(n, len(shape_of(self.input))):
            self._fail("the result's rank is the larger of the input's and the shape's length")
        if element_type(self.input) != element_type(self.result):
            self._fail("the result has the input's element type")


@irdl_op_definition
class FillOp(_TypedOp):
    """A tensor of the 1-D i64 `shape`, every element the scalar `value` (ONNX ConstantOfShape).

    ```mlir
    %ones = llm.fill %shape, %one : (tensor<2xi64>, tensor<i64>) -> tensor<1x?xi64>
    ```
    """

    name = "llm.fill"
    shape = operand_def(TensorType)
    value = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, shape: SSAValue, value: SSAValue, result_type: Attribute):
        super().__init__(operands=[shape, value], result_types=[result_type])

    def verify_(self) -> None:
        n = self._shape_length(self.shape)
        if n is not None and len(shape_of(self.result)) != n:
            self._fail(f"the result's rank must be the shape's length {n}")
        if int(math.prod(d or 1 for d in shape_of(self.value))) != 1 or element_type(self.value) != element_type(
                self.result):
            self._fail("the value is one element of the result's element type")


@irdl_op_definition
class RangeOp(_TypedOp):
    """`start, start + delta, …` below `limit` (scalar operands), as ONNX Range and `torch.arange`.

    ```mlir
    %p = llm.range %c0, %t, %c1 : (tensor<i64>, tensor<i64>, tensor<i64>) -> tensor<?xi64>
    ```
    """

    name = "llm.range"
    start = operand_def(TensorType)
    limit = operand_def(TensorType)
    delta = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, start: SSAValue, limit: SSAValue, delta: SSAValue, result_type: Attribute):
        super().__init__(operands=[start, limit, delta], result_types=[result_type])

    def verify_(self) -> None:
        if len(shape_of(self.result)) != 1:
            self._fail("the result is 1-D")


@irdl_op_definition
class TriluOp(_TypedOp):
    """The upper (`upper`) or lower triangle of the last two dimensions, from diagonal `k` (a scalar).

    ```mlir
    %m = llm.trilu %x, %k upper : (tensor<?x?xf32>, tensor<i64>) -> tensor<?x?xf32>
    ```
    """

    name = "llm.trilu"
    input = operand_def(TensorType)
    k = operand_def(TensorType)
    upper = opt_prop_def(UnitAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, k: SSAValue, upper: bool):
        super().__init__(operands=[x, k], properties={"upper": UnitAttr()} if upper else {}, result_types=[x.type])

    def _print_props(self, printer: Printer) -> None:
        if self.upper is not None:
            printer.print_string(" upper")

    @classmethod
    def _parse_props(cls, parser) -> dict[str, Attribute]:  # noqa: ANN001
        return {"upper": UnitAttr()} if parser.parse_optional_keyword("upper") is not None else {}

    def verify_(self) -> None:
        if len(shape_of(self.input)) < 2:
            self._fail("the input must have rank >= 2")


@irdl_op_definition
class WhereOp(_TypedOp):
    """`a` where `condition` (i1) holds, else `b`, broadcast.

    ```mlir
    %m = llm.where %causal, %zero, %ninf : (tensor<1x1x?x?xi1>, tensor<f32>, tensor<f32>) -> tensor<1x1x?x?xf32>
    ```
    """

    name = "llm.where"
    condition = operand_def(TensorType)
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, condition: SSAValue, a: SSAValue, b: SSAValue, result_type: Attribute | None = None):
        if result_type is None:
            shape = broadcast(shape_of(condition), shape_of(a), shape_of(b))
            result_type = tensor(*shape, element_type=element_type(a))
        super().__init__(operands=[condition, a, b], result_types=[result_type])

    def verify_(self) -> None:
        if element_type(self.condition) != i1:
            self._fail("the condition must be i1")
        if element_type(self.lhs) != element_type(self.rhs) or element_type(self.lhs) != element_type(self.result):
            self._fail("both branches and the result have one element type")
        broadcast(shape_of(self.condition), shape_of(self.lhs), shape_of(self.rhs))


@irdl_op_definition
class BatchMatmulOp(_TypedOp):
    """numpy's `matmul`: the last two dimensions multiply, the leading ones broadcast (1-D
    operands are vectors). Unlike `llm.matmul`, both operands are activations or constants.

    ```mlir
    %s = llm.batch_matmul %q, %kt : (tensor<1x4x?x8xf32>, tensor<1x4x8x?xf32>) -> tensor<1x4x?x?xf32>
    ```
    """

    name = "llm.batch_matmul"
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, lhs: SSAValue, rhs: SSAValue, result_type: Attribute | None = None):
        if result_type is None:
            a, b = shape_of(lhs), shape_of(rhs)
            if len(a) < 2 or len(b) < 2:
                raise VerifyException("llm.batch_matmul: give 1-D operands their result type")
            result_type = tensor(*broadcast(a[:-2], b[:-2]), a[-2], b[-1], element_type=element_type(lhs))
        super().__init__(operands=[lhs, rhs], result_types=[result_type])

    def verify_(self) -> None:
        a, b = shape_of(self.lhs), shape_of(self.rhs)
        if not a or not b:
            self._fail("operands must have rank >= 1")
        k1, k2 = a[-1], (b[-2] if len(b) > 1 else b[0])
        if k1 is not None and k2 is not None and k1 != k2:
            self._fail(f"reduction dimension mismatch: {k1} vs {k2}")


SHAPE_OPS = (
    SoftmaxOp, CumsumOp, ConcatOp, GatherOp, GatherNdOp, TransposeOp, UnsqueezeOp, SqueezeOp, SliceOp, ShapeOfOp,
    ExpandOp, FillOp, RangeOp, TriluOp, WhereOp, BatchMatmulOp,
)
