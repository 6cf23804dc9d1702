"""`raise-lm-head`: the matmul whose rows the entry point returns becomes `llm.logits`, the
op later phases know as the language-model head (decode computes its last row only).

```mlir
%m = llm.matmul %h, %w : (tensor<?x32xf32>, tensor<64x32xf32>) -> tensor<?x64xf32>
func.return %m : tensor<?x64xf32>
// becomes
%m = llm.logits %h, %w : (tensor<?x32xf32>, tensor<64x32xf32>) -> tensor<?x64xf32>
```
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects import func

from llmc.ir import llm
from llmc.passes.group import single_user
from llmc.passes.raising import RaisePass, insert_before, replace_value


@dataclass(frozen=True)
class RaiseLmHeadPass(RaisePass):
    name = "raise-lm-head"

    def raise_function(self, function: func.FuncOp) -> None:
        ret = function.body.block.last_op
        if not isinstance(ret, func.ReturnOp) or len(ret.operands) != 1:
            return
        m = ret.operands[0].owner
        if isinstance(m, llm.MatmulOp) and m.bias is None and m.residual is None and m.norm is None \
                and single_user(m.result) is ret:
            replace_value(m.result, insert_before(m, llm.LogitsOp(m.input, m.weight)))
