"""`pack`: choose each weight's layout and each integer kernel's instructions for the target.

On a CPU target every integer-format weight takes the `split` layout (codes in
64-weight groups whose nibbles unpack with one `and` and one shift, scales in planes of
their own: `llmc.ir.layouts`), which the packager writes and the kernels read; float
weights stay as stored. Each kernel that reads quantized rows gets the integer dot
product of the target (`isa vnni512` with AVX-512 VNNI, `vnni256` with AVX-VNNI, `avx2`
with `pmaddubsw`, `generic` otherwise).

```mlir
%wq = tgt.weight @blk.0.attn_q : !tgt.weight<576x576, q4_1, stored>     // before
%wq = tgt.weight @blk.0.attn_q : !tgt.weight<576x576, q4_1, split>      // after
tgt.matmul %h, %wq -> %q rows %n isa vnni512 : ...
```
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp

from llmc.errors import LlmcError
from llmc.ir import tgt
from llmc.ir.layouts import Layout
from llmc.passes.base import LlmcPass
from llmc.passes.quantize import module_target


@dataclass(frozen=True)
class PackPass(LlmcPass):
    name = "pack"
    requires_phase = "split"

    def run(self, ctx: Context, module: ModuleOp) -> None:
        target = module_target(module)
        if target.kind.data != "cpu":
            raise LlmcError(f"pack: no layouts for target '{target.kind.data}' yet")
        from llmc.backends.cpu.target import integer_isa

        isa = tgt.IsaAttr(integer_isa(target))
        for function in self.functions(module):
            block = function.body.block
            for op in list(block.ops):
                if isinstance(op, tgt.WeightOp) and not op.weight_type.storage.is_float \
                        and op.weight_type.layout is Layout.STORED:
                    t = op.weight_type
                    packed = tgt.WeightOp(op.sym_name, tgt.WeightType(t.shape, t.storage, Layout.SPLIT))
                    block.insert_op_before(packed, op)
                    op.result.replace_all_uses_with(packed.result)
                    block.erase_op(op)
                elif isinstance(op, (tgt.MatmulOp, tgt.SwigluOp)) and tgt.is_quantized(op.x):
                    op.isa = isa
