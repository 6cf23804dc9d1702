"""`raise-embedding`: token rows gathered from a weight become `llm.embedding`.

```mlir
%ids = llm.reshape %0 : tensor<?xi64> -> tensor<1x?xi64>          // %0 = llm.cast %tokens
%x = llm.gather %table, %ids axis 0 : (tensor<64x32xf32>, tensor<1x?xi64>) -> tensor<1x?x32xf32>
// becomes
%e = llm.embedding %tokens, %table : (tensor<?xi32>, tensor<64x32xf32>) -> tensor<?x32xf32>
%x = llm.reshape %e : tensor<?x32xf32> -> tensor<1x?x32xf32>
```
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects import func
from xdsl.ir import SSAValue

from llmc.ir import llm
from llmc.passes.raising import RaisePass, insert_before, replace_value, weight


def _is_tokens(value: SSAValue, tokens: SSAValue) -> bool:
    """`value` is the tokens, reshaped to `[1, ?]` or `[?]` and cast to an integer type."""
    if llm.shape_of(value) not in ((1, None), (None,)):
        return False
    while isinstance(value.owner, (llm.ReshapeOp, llm.CastOp)):
        value = value.owner.input
    return value is tokens


@dataclass(frozen=True)
class RaiseEmbeddingPass(RaisePass):
    name = "raise-embedding"

    def raise_function(self, function: func.FuncOp) -> None:
        tokens = function.body.block.args[0]
        for op in list(function.body.block.ops):
            if isinstance(op, llm.GatherOp) and op.axis_index == 0 and weight(op.input, 2) \
                    and _is_tokens(op.indices, tokens):
                e = llm.EmbeddingOp(tokens, op.input)
                out = insert_before(op, e, llm.ReshapeOp(e.result, llm.shape_of(op.result)))
                replace_value(op.result, out)
