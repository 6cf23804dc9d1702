"""`plan-memory`: place every `tgt.alloc` of an entry point in one activation arena.

A buffer lives from the first to the last kernel that touches it or a view of it;
buffers whose lifetimes do not overlap share bytes. Placement is first-fit by offset in
order of first use, each offset aligned to 64 bytes. The arena size is recorded on the
function:

```mlir
func.func @prefill(...) attributes {tgt.arena_bytes = 3538944 : i64, ...} {
  %x = tgt.alloc offset 0 : memref<128x576xf32>
  %l0_q = tgt.alloc offset 294912 : memref<128x576xf32>
```
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, i64

from llmc.ir import tgt
from llmc.ir.layouts import align
from llmc.passes.base import LlmcPass


def lifetimes(function: func.FuncOp) -> dict[tgt.AllocOp, tuple[int, int]]:
    """Each alloc's first and last kernel index (views count as their buffer)."""
    spans: dict[tgt.AllocOp, tuple[int, int]] = {}
    for index, op in enumerate(function.body.block.ops):
        if isinstance(op, (tgt.AllocOp, tgt.ViewOp, tgt.SubviewOp, tgt.WeightOp)):
            continue
        for operand in op.operands:
            alloc = tgt.root(operand).owner
            if isinstance(alloc, tgt.AllocOp):
                first, _ = spans.get(alloc, (index, index))
                spans[alloc] = (first, index)
    return spans


def plan(function: func.FuncOp) -> int:
    """Assign offsets; returns the arena size in bytes."""
    placed: list[tuple[int, int, int, int]] = []  # (offset, end, first, last)
    size = 0
    spans = lifetimes(function)
    for alloc, (first, last) in sorted(spans.items(), key=lambda item: item[1][0]):
        nbytes = align(alloc.nbytes)
        busy = sorted((o, e) for o, e, f, l in placed if not (l < first or last < f))
        offset = 0
        for o, e in busy:
            if offset + nbytes <= o:
                break
            offset = max(offset, e)
        placed.append((offset, offset + nbytes, first, last))
        alloc.offset = IntegerAttr(offset, i64)
        size = max(size, offset + nbytes)
    for op in function.body.block.ops:
        if isinstance(op, tgt.AllocOp) and op not in spans:
            op.offset = IntegerAttr(0, i64)  # never touched: no bytes of its own
    function.attributes["tgt.arena_bytes"] = IntegerAttr(size, i64)
    return size


@dataclass(frozen=True)
class PlanMemoryPass(LlmcPass):
    name = "plan-memory"
    requires_phase = "split"

    def run(self, ctx: Context, module: ModuleOp) -> None:
        for function in self.functions(module):
            plan(function)
