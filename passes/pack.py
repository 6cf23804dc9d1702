"""`pack`: choose each weight's layout and each integer kernel's instructions for the target.

On a CPU target with AVX-512 VNNI, an integer-format weight that only `a8` kernels
(quantized rows) and the embedding read takes the `tiles` layout (strips of 16 output
features × 32-weight blocks, the operand of `vpdpbusd` and of an AMX tile:
`llmc.ir.layouts`); every other integer weight the `split` layout (codes in 64-weight
groups whose nibbles unpack with one `and` and one shift, scales in planes of their
own). The packager writes the layout and the kernels read it; float weights stay as
stored. Each kernel that reads quantized rows gets the integer dot
product of the target (`isa vnni512` with AVX-512 VNNI, `vnni256` with AVX-VNNI, `avx2`
with `pmaddubsw`, `generic` otherwise); where the target also has AMX-INT8, the kernels
of entry points of 16 rows or more (prefill, score) get `isa amx`: tiles for whole
16-row blocks (`backends/cpu/amx.py`), when every weight format's scales are constant
over 32-value blocks (q6_k's 16-value scales keep VNNI). Kernels reading int16 rows
(`a16`: two int8 planes, two products per block) take the same isa as `a8` except
`amx`, which would need twice the accumulator tiles: on an AMX target they get
`vnni512` (the tiles layout serves both).

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

from llmc.errors import LlmcError
from llmc.ir import tgt
from llmc.ir.layouts import Layout
from llmc.passes.base import LlmcPass
from llmc.passes.quantize import module_target

AMX_MIN_ROWS = 16  # entry points of at least this many rows get AMX tiles (one tile of rows)
MMA_MIN_ROWS = 16  # CUDA entry points of at least this many rows get tensor-core GEMMs


@dataclass(frozen=True)
class PackPass(LlmcPass):
    name = "pack"
    requires_phase = "split"

    def run(self, ctx: Context, module: ModuleOp) -> None:
        target = module_target(module)
        if target.kind.data == "cuda":
            self._pack_for_cuda(module, target)
            return
        if target.kind.data != "cpu":
            raise LlmcError(f"pack: no layouts for target '{target.kind.data}'")
        from llmc.backends.cpu.amx import supports
        from llmc.backends.cpu.target import integer_isa

        isa = integer_isa(target)
        amx = isa is tgt.Isa.VNNI512 and target.has("amx-tile", "amx-int8")
        self._relayout(module, self._layouts(module, isa))
        for function in self.functions(module):
            rows = function.attributes.get("tgt.max_tokens")
            blocks_of_rows = rows is not None and rows.value.data >= AMX_MIN_ROWS
            for op in function.body.block.ops:
                if isinstance(op, (tgt.MatmulOp, tgt.SwigluOp)) and tgt.is_quantized(op.x):
                    tiles = amx and blocks_of_rows and getattr(op, "last_row", None) is None \
                        and op.x.type.bits == 8 and all(supports(w.storage) for w in _matrices(op))
                    op.isa = tgt.IsaAttr(tgt.Isa.AMX if tiles else isa)

    def _pack_for_cuda(self, module: ModuleOp, target: tgt.TargetAttr) -> None:
        """Every integer weight in the `split` layout: a lane reads one 4-byte word of codes, a warp
        128 consecutive bytes (`backends/cuda/weights.py`). The kernels take float rows; those of entry
        points of 16 rows or more (prefill, score) run on tensor cores (`isa mma_f16`), the rest are GEMVs."""
        self._relayout(module, self._layouts(module, tgt.Isa.GENERIC))  # (no VNNI: no tiles)
        if not target.has("mma.m16n8k16.f16"):
            return
        for function in self.functions(module):
            rows = function.attributes.get("tgt.max_tokens")
            if rows is None or rows.value.data < MMA_MIN_ROWS:
                continue
            for op in function.body.block.ops:
                if isinstance(op, (tgt.MatmulOp, tgt.SwigluOp)) and getattr(op, "last_row", None) is None:
                    op.isa = tgt.IsaAttr(tgt.Isa.MMA_F16)

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

    def _layouts(self, module: ModuleOp, isa: tgt.Isa) -> dict[str, Layout]:
        """Each integer weight's layout, the same in every entry point: `tiles` where every kernel
        reading it takes quantized rows (or gathers rows: the embedding) and the target has
        AVX-512 VNNI, `split` otherwise."""
        readers: dict[str, list[tgt.Kernel]] = {}
        for function in self.functions(module):
            for op in function.body.block.ops:
                if isinstance(op, tgt.WeightOp) and not op.weight_type.storage.is_float \
                        and op.weight_type.layout is Layout.STORED:
                    readers.setdefault(op.sym_name, []).extend(use.operation for use in op.result.uses)
        tiles = isa is tgt.Isa.VNNI512
        return {name: Layout.TILES if tiles and all(_reads_tiles(k) for k in kernels) else Layout.SPLIT
                for name, kernels in readers.items()}


def _matrices(op: tgt.Kernel) -> list[tgt.WeightType]:
    return [v.type for _, v in op.abi() if isinstance(v.type, tgt.WeightType) and len(v.type.shape) == 2]


def _reads_tiles(op) -> bool:
    """Whether a kernel reads its integer weights in the tiles layout (on AVX-512 VNNI)."""
    return isinstance(op, tgt.EmbeddingOp) or (isinstance(op, (tgt.MatmulOp, tgt.SwigluOp)) and tgt.is_quantized(op.x))
