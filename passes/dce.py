"""`dce`: erase ops whose results are unused and that have no side effects.

`llm.attention` writes the KV cache, so it stays even when unused; a dead `llm.weight`
or matmul goes:

```mlir
%w = llm.weight @blk.0.attn_q q4_1 : tensor<576x576xf32>    // no uses: erased
```
"""

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass
from xdsl.transforms.dead_code_elimination import region_dce


@dataclass(frozen=True)
class DeadCodeEliminationPass(ModulePass):
    name = "dce"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        for function in op.ops:
            for region in function.regions:
                region_dce(region)
