"""`screen-logits`: decode's LM head takes its products with int8 rows first, and with its int16 rows again
only where a result comes near the row's largest.

At decode of a CPU target whose LM head reads int16 rows (`a16`) of its own (`quantize`, from `fuse-norm`) in
the tiles layout (`isa vnni512`), and holds at least `MIN_SHARE` of the step's weights (a large vocabulary
on a small model: Gemma 3 270M's 262k × 640 is 63% of its products, SmolLM2's 21%), the matmul into the
entry point's logits gets `screen MARGIN`: half the products for most of the vocabulary, `a16`'s exact
results wherever a row's largest logits (within `MARGIN` of the largest of their block of
`tgt.SCREEN_COLUMNS` columns) can be. Greedy choices read exact results; the rest of the vocabulary carries
the int8 rows' rounding (`tgt.matmul`'s `screen`): a sampled distribution's KL from the exact one is about
1e-4 nats (SmolLM2 at margin 1–3, where int8 rows everywhere give 5e-3). Where the LM head is a smaller
share the step gains too little for that (SmolLM2's 8-row step at most 2.5%), and the pass leaves it exact.
`--exact-logits` leaves the pass out.

```mlir
tgt.matmul %x, %emb -> %logits rows %n norm %g eps 1.000000e-05 quantize <8x576xi16> isa vnni512 : ...
// becomes
tgt.matmul %x, %emb -> %logits rows %n norm %g eps 1.000000e-05 quantize <8x576xi16> screen 2.000000e+00 isa vnni512 : ...
```
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import FloatAttr, ModuleOp, StringAttr, f32
from xdsl.ir import BlockArgument

from llmc.errors import UsageError
from llmc.ir import tgt
from llmc.ir.layouts import Layout
from llmc.passes.base import LlmcPass

MARGIN = 2.0  # logits this close to the block's largest are a16's exactly (int8 rows' error: up to 0.2–0.5)
MIN_SHARE = 1 / 3  # the least share of the decode step's weight products in the LM head that the screen takes


def screens(op: tgt.Kernel) -> bool:
    """Whether `op` is an LM head the screen serves: int16 rows of its own, a tiles weight, into the logits."""
    return (isinstance(op, tgt.MatmulOp) and op.quantize is not None and op.quantize.bits == 16
            and op.isa is not None and op.isa.data is tgt.Isa.VNNI512 and op.weight.type.layout is Layout.TILES
            and op.accumulate is None and op.last_row is None and isinstance(tgt.root(op.out), BlockArgument))


@dataclass(frozen=True)
class ScreenLogitsPass(LlmcPass):
    name = "screen-logits"
    requires_phase = "split"

    margin: float | int = MARGIN  # (an int too: `margin=3`)
    min_share: float | int = MIN_SHARE

    def run(self, ctx: Context, module: ModuleOp) -> None:
        if not self.margin >= 0:
            raise UsageError(f"screen-logits: the margin is 0 or more, not {self.margin}")
        if not 0 <= self.min_share <= 1:
            raise UsageError(f"screen-logits: min_share is a fraction from 0 to 1, not {self.min_share}")
        for function in self.functions(module):
            if function.attributes.get("llm.stage") != StringAttr("decode"):
                continue
            heads = [op for op in function.body.block.ops if screens(op)]
            products = sum(_products(op) for op in function.body.block.ops)
            for op in heads:
                if _products(op) >= self.min_share * products:
                    op.screen = FloatAttr(float(self.margin), f32)


def _products(op) -> int:
    """The weight elements a projection multiplies per row (0 for any other op)."""
    if isinstance(op, tgt.MatmulOp):
        return op.weight.type.shape[0] * op.weight.type.shape[1]
    if isinstance(op, tgt.SwigluOp):
        return 2 * op.gate.type.shape[0] * op.gate.type.shape[1]
    if isinstance(op, tgt.MoeOp):
        return sum(w.type.shape[0] * w.type.shape[1] for w in op.operands if isinstance(w.type, tgt.WeightType))
    return 0
