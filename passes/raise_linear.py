"""`raise-linear`: an activation times a transposed weight becomes `llm.matmul`, a bias added
to it its `bias`.

```mlir
%wt = llm.transpose %w axes [1, 0] : (tensor<48x32xf32>) -> tensor<32x48xf32>
%y = llm.batch_matmul %x, %wt : (tensor<1x?x32xf32>, tensor<32x48xf32>) -> tensor<1x?x48xf32>
%z = llm.add %y, %b : (tensor<1x?x48xf32>, tensor<48xf32>) -> tensor<1x?x48xf32>
// becomes
%x2 = llm.reshape %x : tensor<1x?x32xf32> -> tensor<?x32xf32>
%m = llm.matmul %x2, %w bias %b : (tensor<?x32xf32>, tensor<48x32xf32>, tensor<48xf32>) -> tensor<?x48xf32>
%z = llm.reshape %m : tensor<?x48xf32> -> tensor<1x?x48xf32>
```
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects import func

from llmc.ir import llm
from llmc.passes.group import single_user
from llmc.passes.raising import RaisePass, insert_before, operand_pairs, producer, replace_value, to_rows, weight


@dataclass(frozen=True)
class RaiseLinearPass(RaisePass):
    name = "raise-linear"

    def raise_function(self, function: func.FuncOp) -> None:
        block = function.body.block
        for op in list(block.ops):
            if not isinstance(op, llm.BatchMatmulOp):
                continue
            t = producer(op.rhs, llm.TransposeOp)
            if t is None or t.axis_list != (1, 0) or weight(t.input, 2) is None:
                continue
            rows = to_rows(op.lhs, op)
            if rows is None:
                continue
            m = llm.MatmulOp(rows, t.input)
            out = insert_before(op, m, llm.ReshapeOp(m.result, llm.shape_of(op.result))) \
                if llm.shape_of(op.result) != llm.shape_of(m.result) else insert_before(op, m)
            replace_value(op.result, out)
        for op in list(block.ops):
            if isinstance(op, llm.AddOp):
                self._bias(op)

    @staticmethod
    def _bias(add: llm.AddOp) -> None:
        for y, b in operand_pairs(add):
            reshape = producer(y, llm.ReshapeOp)
            m = producer(reshape.input if reshape is not None else y, llm.MatmulOp)
            if m is None or m.bias is not None or m.residual is not None or weight(b, 1) is None \
                    or llm.shape_of(b) != llm.shape_of(m.result)[-1:] or add.result.type != y.type \
                    or single_user(m.result) is not (reshape or add) \
                    or (reshape is not None and single_user(reshape.result) is not add):
                continue
            biased = llm.MatmulOp(m.input, m.weight, b)
            out = insert_before(add, biased, llm.ReshapeOp(biased.result, llm.shape_of(add.result))) \
                if reshape is not None else insert_before(add, biased)
            replace_value(add.result, out)
            return
