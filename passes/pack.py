"""`pack`: choose each weight's layout and each integer kernel's instructions for the target.

The pass walks the IR; the target's description chooses (`weight_layout`, `kernel_isa`:
`llmc.ir.target`, implemented by `backends/cpu/target.py` and `backends/cuda/target.py`).

On a CPU target with an integer dot product (AVX2 or better), an integer-format weight that
only `a8`/`a16` kernels (quantized rows) and the embedding read takes the `tiles` layout (strips
of 16 output features × 32-weight blocks, the operand of `vpdpbusd` and of an AMX tile, and on
AVX2 of `vpmaddwd` on 4 features at a time: `llmc.ir.layouts`); every other integer weight the
`split` layout (codes in 64-weight
groups whose nibbles unpack with one `and` and one shift, scales in planes of their
own). The packager writes the layout and the kernels read it; float weights stay as
stored. Each kernel that reads quantized rows gets the integer dot
product of the target (`isa vnni512` with AVX-512 VNNI, `vnni256` with AVX-VNNI, `avx2`
with `vpmaddwd`, `generic` otherwise); where the target also has AMX-INT8, the kernels
of entry points of 16 rows or more (prefill, score) get `isa amx`: tiles for whole
16-row blocks (`backends/cpu/amx.py`), when every weight format's scales are constant
over 32-value blocks (q6_k's 16-value scales keep VNNI). Kernels reading int16 rows
(`a16`: two int8 planes, two products per block) take the same isa as `a8`.

On a CUDA target every integer weight takes the `split` layout: a lane reads one 4-byte
word of codes, a warp 128 consecutive bytes (`backends/cuda/weights.py`); the matmuls of
prefill and score (16 rows or more) get `isa mma_f16`: tensor-core GEMMs.

```mlir
%wq = tgt.weight @blk.0.attn_q : !tgt.weight<576x576, q4_1, stored>     // before
%wq = tgt.weight @blk.0.attn_q : !tgt.weight<576x576, q4_1, tiles>      // after
tgt.matmul %h, %wq -> %q rows %n isa vnni512 : ...
```
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp

from llmc.ir import tgt
from llmc.ir.layouts import Layout
from llmc.ir.target import TargetDescription, module_target, target_description
from llmc.passes.base import LlmcPass


@dataclass(frozen=True)
class PackPass(LlmcPass):
    """The walk over the IR; the target's description (`llmc.ir.target`) chooses each layout and isa."""

    name = "pack"
    requires_phase = "split"

    def run(self, ctx: Context, module: ModuleOp) -> None:
        target = target_description(module_target(module))
        self._relayout(module, self._layouts(module, target))
        for function in self.functions(module):
            rows = function.attributes.get("tgt.max_tokens")
            for op in function.body.block.ops:
                if isinstance(op, tgt.Kernel):
                    isa = target.kernel_isa(op, rows.value.data if rows is not None else 0)
                    if isa is not None:
                        op.isa = tgt.IsaAttr(isa)

    def _relayout(self, module: ModuleOp, layouts: dict[str, Layout]) -> None:
        """Each weight named in `layouts` retyped to its layout, in every entry point."""
        for function in self.functions(module):
            block = function.body.block
            for op in list(block.ops):
                if isinstance(op, tgt.WeightOp) and op.sym_name in layouts:
                    t = op.weight_type
                    packed = tgt.WeightOp(op.sym_name, tgt.WeightType(t.shape, t.storage, layouts[op.sym_name]))
                    block.insert_op_before(packed, op)
                    op.result.replace_all_uses_with(packed.result)
                    block.erase_op(op)

    def _layouts(self, module: ModuleOp, target: TargetDescription) -> dict[str, Layout]:
        """Each integer weight's layout, the same in every entry point: the target's choice for the
        kernels that read it in all of them."""
        readers: dict[str, list[tgt.Kernel]] = {}
        for function in self.functions(module):
            for op in function.body.block.ops:
                if isinstance(op, tgt.WeightOp) and not op.weight_type.storage.is_float \
                        and op.weight_type.layout is Layout.STORED:
                    readers.setdefault(op.sym_name, []).extend(use.operation for use in op.result.uses)
        return {name: target.weight_layout(kernels) for name, kernels in readers.items()}
