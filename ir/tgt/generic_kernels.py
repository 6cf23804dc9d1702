"""The `tgt` dialect's generic kernels: what `llm`'s primitive ops become where `optimize` raised
nothing better. One loop per element, no vectors: correct on any rows, and slower than the fused
kernels (`llmc.ir.tgt.kernels`).

```mlir
tgt.binary "sub" %x, %m -> %d rows %n : memref<128x64xf32>, memref<128x1xf32> -> memref<128x64xf32>
tgt.reduce "mean" %sq -> %m rows %n : memref<128x64xf32> -> memref<128x1xf32>
```
"""

from __future__ import annotations

from typing import ClassVar

from xdsl.dialects.builtin import (
    Float32Type,
    FloatAttr,
    IndexType,
    MemRefType,
    StringAttr,
    UnitAttr,
)
from xdsl.ir import Attribute, SSAValue
from xdsl.irdl import (
    AnyAttr,
    BaseAttr,
    VarConstraint,
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    prop_def,
)

from llmc.ir.formats import Storage
from llmc.ir.tgt.kernels import Kernel
from llmc.ir.tgt.types import WeightType, dims, f32

BINARY_KINDS = ("add", "sub", "mul", "div", "pow", "maximum", "minimum")
UNARY_KINDS = ("neg", "abs", "sqrt", "rsqrt", "reciprocal", "exp", "tanh", "sigmoid", "relu", "cos", "sin")
REDUCE_KINDS = ("sum", "mean", "max")


def _check_kind(op: Kernel, kinds: tuple[str, ...]) -> None:
    if op.kind.data not in kinds:
        op._fail(f"kind must be one of {', '.join(kinds)}, got {op.kind.data!r}")


def broadcast_operand(op: Kernel, what: str, value: SSAValue, out: SSAValue) -> None:
    """A generic kernel's input: float rows `[rows, width]` or `[rows, 1]` (as many rows as
    `out`), or an f32 weight `[width]`."""
    t = value.type
    rows, width = dims(out)
    if isinstance(t, WeightType):
        if t.storage is not Storage.F32 or t.shape != (width,):
            op._fail(f"{what} must be !tgt.weight<{width}, f32, stored>, got {t}")
    elif not (isinstance(t, MemRefType) and len(dims(value)) == 2 and dims(value)[0] == rows
              and dims(value)[1] in (width, 1) and t.element_type == f32):
        op._fail(f"{what} must be f32 rows memref<{rows}x{width}xf32> or memref<{rows}x1xf32>, or a weight, got {t}")


def _float_rows(op: Kernel, *values: SSAValue) -> None:
    for value in values:
        if len(dims(value)) != 2 or value.type.element_type != f32:
            op._fail(f"generic kernels read and write f32 rows [rows, width], not {value.type}")


@irdl_op_definition
class BinaryOp(Kernel):
    """`out = lhs ⊙ rhs` elementwise on the first `rows` rows (⊙ one of `BINARY_KINDS`), each
    input float rows of `out`'s width, one value per row (`[rows, 1]`), or a weight of one value
    per column.

    ```mlir
    tgt.binary "sub" %x, %m -> %d rows %n : memref<128x64xf32>, memref<128x1xf32> -> memref<128x64xf32>
    ```
    """

    name = "tgt.binary"
    ROWS: ClassVar[tuple[str, ...]] = ("lhs", "rhs", "out")
    kind = prop_def(StringAttr)
    lhs = operand_def(AnyAttr())
    rhs = operand_def(AnyAttr())
    out = operand_def(MemRefType)
    rows = operand_def(IndexType)
    assembly_format = "$kind $lhs `,` $rhs `->` $out `rows` $rows attr-dict `:` type($lhs) `,` type($rhs) `->` type($out)"

    def __init__(self, kind: str, lhs: SSAValue, rhs: SSAValue, out: SSAValue, rows: SSAValue):
        super().__init__(operands=[lhs, rhs, out, rows], properties={"kind": StringAttr(kind)})

    def verify_(self) -> None:
        _check_kind(self, BINARY_KINDS)
        _float_rows(self, self.out)
        for what in ("lhs", "rhs"):
            broadcast_operand(self, what, getattr(self, what), self.out)


@irdl_op_definition
class ScalarOp(Kernel):
    """`out = x ⊙ s` (with `reversed`, `s ⊙ x`) for a constant `s`, on the first `rows` rows.

    ```mlir
    tgt.scalar "add" %m, 1.000000e-06 -> %e rows %n : memref<128x1xf32>
    ```
    """

    name = "tgt.scalar"
    kind = prop_def(StringAttr)
    T: ClassVar = VarConstraint("T", BaseAttr(MemRefType))
    x = operand_def(T)
    value = prop_def(FloatAttr[Float32Type])
    reversed = opt_prop_def(UnitAttr)
    out = operand_def(T)
    rows = operand_def(IndexType)
    assembly_format = "$kind $x `,` $value (`reversed` $reversed^)? `->` $out `rows` $rows attr-dict `:` type($out)"

    def __init__(self, kind: str, x: SSAValue, value: float, out: SSAValue, rows: SSAValue, reversed: bool = False):
        props: dict[str, Attribute] = {"kind": StringAttr(kind), "value": FloatAttr(value, f32)}
        if reversed:
            props["reversed"] = UnitAttr()
        super().__init__(operands=[x, out, rows], properties=props)

    def verify_(self) -> None:
        _check_kind(self, BINARY_KINDS)
        _float_rows(self, self.out)


@irdl_op_definition
class UnaryOp(Kernel):
    """`out = f(x)` elementwise on the first `rows` rows, `f` one of `UNARY_KINDS`.

    ```mlir
    tgt.unary "rsqrt" %e -> %r rows %n : memref<128x1xf32>
    ```
    """

    name = "tgt.unary"
    kind = prop_def(StringAttr)
    T: ClassVar = VarConstraint("T", BaseAttr(MemRefType))
    x = operand_def(T)
    out = operand_def(T)
    rows = operand_def(IndexType)
    assembly_format = "$kind $x `->` $out `rows` $rows attr-dict `:` type($out)"

    def __init__(self, kind: str, x: SSAValue, out: SSAValue, rows: SSAValue):
        super().__init__(operands=[x, out, rows], properties={"kind": StringAttr(kind)})

    def verify_(self) -> None:
        _check_kind(self, UNARY_KINDS)
        _float_rows(self, self.out)


@irdl_op_definition
class ReduceOp(Kernel):
    """One value per row: the sum, mean or maximum of each of the first `rows` rows.

    ```mlir
    tgt.reduce "mean" %sq -> %m rows %n : memref<128x64xf32> -> memref<128x1xf32>
    ```
    """

    name = "tgt.reduce"
    kind = prop_def(StringAttr)
    x = operand_def(MemRefType)
    out = operand_def(MemRefType)
    rows = operand_def(IndexType)
    assembly_format = "$kind $x `->` $out `rows` $rows attr-dict `:` type($x) `->` type($out)"

    def __init__(self, kind: str, x: SSAValue, out: SSAValue, rows: SSAValue):
        super().__init__(operands=[x, out, rows], properties={"kind": StringAttr(kind)})

    def verify_(self) -> None:
        _check_kind(self, REDUCE_KINDS)
        _float_rows(self, self.x, self.out)
        if len(dims(self.out)) != 2 or dims(self.out)[1] != 1 or dims(self.out)[0] != dims(self.x)[0]:
            self._fail(f"out must be memref<{dims(self.x)[0]}x1xf32>, got {self.out.type}")
