"""The `tgt` dialect: kernels over typed buffers, what a backend emits code for.

One `tgt` function is one entry point (`prefill`, `prefill_kv`, `decode`, `score`).
Its ops are kernels in destination-passing style: each reads buffers and writes a
buffer; none returns a value. Types say what the bytes are:

- `memref<128x576xf32>`: float activations (and the logits; the KV cache in f32, f16
  or i8 = q8_0 rows, `kv_row_width`);
- `!tgt.qrows<128x576>`: activation rows quantized to int8 per 32 values, with their
  scales and sums (`llmc.ir.layouts`), written by the kernel that produces them and read
  by integer (`a8`) matmuls; `!tgt.qrows<128x576xi16>`: the same quantized to int16, as
  two int8 planes (read by `a16` matmuls);
- `!tgt.weight<576x576, q4_1, tiles>`: a weight of the artifact in a storage type
  (`llmc.ir.formats`) and a layout (`stored` as in the model file, `split`, `tiles` or
  `tiles_avx2`, chosen for the target by the `pack` pass).

Activations live in one arena per entry point (`tgt.alloc`, placed by `plan-memory`),
weights are symbols into the artifact's weight file (`tgt.weight`), the KV cache and
the logits are arguments. Shapes are static except the row count `%n` (tokens in this
call, ≤ `tgt.max_tokens`); row `t` is at position `%positions[t]`. The module carries the
target (`tgt.target`), set before any phase runs.

```mlir
builtin.module attributes {tgt.target = #tgt.target<cpu, "x86_64", "sapphirerapids", ["avx2", "avx512vnni"]>} {
  func.func @decode(%tokens: memref<1xi32>, %positions: memref<1xi32>, %n: index,
                    %k_cache: memref<30x3x4096x64xf16>, %v_cache: memref<30x3x4096x64xf16>,
                    %logits: memref<1x49152xf32>) attributes {...} {
    %x = tgt.alloc offset 0 : memref<1x576xf32>
    %h = tgt.alloc offset 2304 : !tgt.qrows<1x576>
    %wn = tgt.weight @blk.0.attn_norm : !tgt.weight<576, f32, stored>
    tgt.rms_norm %x, %wn -> %h rows %n eps 1.000000e-05 : memref<1x576xf32>, !tgt.weight<576, f32, stored> -> !tgt.qrows<1x576>
    %wq = tgt.weight @blk.0.attn_q : !tgt.weight<576x576, q4_1, tiles>
    tgt.matmul %h, %wq -> %q rows %n isa vnni512 : !tgt.qrows<1x576>, !tgt.weight<576x576, q4_1, tiles> -> memref<1x576xf32>
    ...
```

A kernel's definition is its ABI: the operands it declares, in order, are the
arguments of its compiled function (`Kernel.abi`): the CPU call sites and kernel
signatures are derived from it, the tgt interpreter reads the same named operands, and
a buffer's type alone says how the packager writes it and how kernels read it.
"""

from xdsl.ir import Dialect

from llmc.ir.tgt.buffers import *  # noqa: F403 (the dialect's names are its modules' names)
from llmc.ir.tgt.buffers import AllocOp, SubviewOp, ViewOp, WeightOp
from llmc.ir.tgt.generic_kernels import *  # noqa: F403
from llmc.ir.tgt.generic_kernels import BinaryOp, ReduceOp, ScalarOp, UnaryOp
from llmc.ir.tgt.kernels import *  # noqa: F403
from llmc.ir.tgt.kernels import (
    ACTIVATION_KERNELS,
    AddOp,
    AttentionOp,
    EmbeddingOp,
    Kernel,
    MatmulOp,
    MoeOp,
    MulOp,
    QkvOp,
    QuantizeOp,
    RMSNormOp,
    RopeOp,
    SwigluOp,
)
from llmc.ir.tgt.types import *  # noqa: F403
from llmc.ir.tgt.types import IsaAttr, LayoutAttr, QRowsType, StorageType, TargetAttr, WeightType

KERNELS: tuple[type[Kernel], ...] = (
    EmbeddingOp, RMSNormOp, QuantizeOp, MatmulOp, QkvOp, SwigluOp, RopeOp, AttentionOp, AddOp, MulOp,
    *ACTIVATION_KERNELS.values(), MoeOp, BinaryOp, ScalarOp, UnaryOp, ReduceOp,
)

TGT = Dialect(
    "tgt",
    [AllocOp, ViewOp, SubviewOp, WeightOp, *KERNELS],
    [TargetAttr, IsaAttr, LayoutAttr, StorageType, WeightType, QRowsType],
)
