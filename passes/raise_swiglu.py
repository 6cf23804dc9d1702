"""`raise-swiglu`: the gate activation of a SwiGLU feed-forward written out becomes `llm.silu`
(`group` then fuses `silu(x · w_gateᵀ) * (x · w_upᵀ)` into `llm.swiglu`, as for every frontend).

```mlir
%s = llm.sigmoid %g : tensor<?x48xf32>
%a = llm.mul %g, %s : tensor<?x48xf32>
// becomes
%a = llm.silu %g : tensor<?x48xf32>
```
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects import func

from llmc.ir import llm
from llmc.passes.raising import RaisePass, insert_before, operand_pairs, producer, replace_value


@dataclass(frozen=True)
class RaiseSwigluPass(RaisePass):
    name = "raise-swiglu"

    def raise_function(self, function: func.FuncOp) -> None:
        for op in list(function.body.block.ops):
            if not isinstance(op, llm.MulOp) or op.lhs.type != op.rhs.type:
                continue
            for x, s in operand_pairs(op):
                sigmoid = producer(s, llm.SigmoidOp)
                if sigmoid is not None and sigmoid.input is x:
                    replace_value(op.result, insert_before(op, llm.SiluOp(x)))
                    break
