"""The `tgt` dialect's buffer ops: activation buffers in the arena, views of them, and weights.

```mlir
%x = tgt.alloc offset 0 : memref<128x576xf32>
%q_heads = tgt.view %q : memref<128x576xf32> -> memref<128x9x64xf32>
%k_cache_3 = tgt.subview %k_cache[3] : memref<30x3x4096x64xf32> -> memref<3x4096x64xf32>
%wq = tgt.weight @blk.0.attn_q : !tgt.weight<576x576, q4_1, tiles>
```
"""

from __future__ import annotations

import math

from xdsl.dialects.builtin import (
    I64,
    IntegerAttr,
    MemRefType,
    SymbolRefAttr,
    i64,
)
from xdsl.ir import Attribute, SSAValue
from xdsl.irdl import (
    IRDLOperation,
    irdl_op_definition,
    operand_def,
    opt_prop_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

from llmc.ir.llm.attributes import ssa_name
from llmc.ir.tgt.types import Activations, WeightType, dims, memref, nbytes


@irdl_op_definition
class AllocOp(IRDLOperation):
    """An activation buffer in the entry point's arena; `offset` (bytes) is set by `plan-memory`.

    ```mlir
    %x = tgt.alloc offset 2304 : memref<128x576xf32>
    %h = tgt.alloc offset 0 : !tgt.qrows<128x576>
    ```
    """

    name = "tgt.alloc"
    offset = opt_prop_def(IntegerAttr[I64])
    result = result_def(Activations)
    traits = traits_def(Pure())
    assembly_format = "(`offset` $offset^)? attr-dict `:` type($result)"

    def __init__(self, result_type: Attribute):
        super().__init__(result_types=[result_type])

    @property
    def nbytes(self) -> int:
        return nbytes(self.result.type)


@irdl_op_definition
class ViewOp(IRDLOperation):
    """The same float buffer in another shape (what `llm.reshape` becomes).

    ```mlir
    %q_heads = tgt.view %q : memref<128x576xf32> -> memref<128x9x64xf32>
    ```
    """

    name = "tgt.view"
    source = operand_def(MemRefType)
    result = result_def(MemRefType)
    traits = traits_def(Pure())
    assembly_format = "$source attr-dict `:` type($source) `->` type($result)"

    def __init__(self, source: SSAValue, shape: tuple[int, ...]):
        super().__init__(operands=[source], result_types=[memref(*shape)])

    def verify_(self) -> None:
        a, b = dims(self.source), dims(self.result)
        if a[0] != b[0] or math.prod(a) != math.prod(b):
            raise VerifyException(f"tgt.view: {self.source.type} and {self.result.type} differ in rows or elements")


@irdl_op_definition
class SubviewOp(IRDLOperation):
    """One entry of a buffer's leading dimension, e.g. one layer of the KV cache.

    ```mlir
    %k_cache_3 = tgt.subview %k_cache[3] : memref<30x3x4096x64xf32> -> memref<3x4096x64xf32>
    ```
    """

    name = "tgt.subview"
    source = operand_def(MemRefType)
    index = prop_def(IntegerAttr[I64])
    result = result_def(MemRefType)
    traits = traits_def(Pure())
    assembly_format = "$source `[` $index `]` attr-dict `:` type($source) `->` type($result)"

    def __init__(self, source: SSAValue, index: int):
        super().__init__(operands=[source], properties={"index": IntegerAttr(index, i64)},
                         result_types=[memref(*dims(source)[1:], element_type=source.type.element_type)])

    @property
    def byte_offset(self) -> int:
        return self.index.value.data * nbytes(self.result.type)

    def verify_(self) -> None:
        src, dst = dims(self.source), dims(self.result)
        if src[1:] != dst or not 0 <= self.index.value.data < src[0]:
            raise VerifyException(f"tgt.subview: [{self.index.value.data}] of {self.source.type} is not {self.result.type}")


@irdl_op_definition
class WeightOp(IRDLOperation):
    """A weight of the artifact's weight file, by symbol; its type says storage and layout.

    ```mlir
    %wq = tgt.weight @blk.0.attn_q : !tgt.weight<576x576, q4_1, tiles>
    ```
    """

    name = "tgt.weight"
    sym = prop_def(SymbolRefAttr)
    result = result_def(WeightType)
    traits = traits_def(Pure())
    assembly_format = "$sym attr-dict `:` type($result)"

    def __init__(self, sym: str, weight_type: WeightType):
        super().__init__(properties={"sym": SymbolRefAttr(sym)}, result_types=[weight_type])
        self.result.name_hint = ssa_name(sym)

    @property
    def sym_name(self) -> str:
        return self.sym.root_reference.data

    @property
    def weight_type(self) -> WeightType:
        assert isinstance(self.result.type, WeightType)
        return self.result.type


def root(value: SSAValue) -> SSAValue:
    """The buffer a value is a view of."""
    while isinstance(value.owner, (ViewOp, SubviewOp)):
        value = value.owner.source
    return value
