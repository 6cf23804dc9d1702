"""`fuse-norm`: at decode-sized entry points of a CPU target, each projection normalizes and quantizes
its own rows instead of reading an RMSNorm's quantized rows.

A `tgt.rms_norm` into quantized rows whose every reader is a matmul or SwiGLU goes; each reader
takes the float rows, the norm and the quantized type (`quantize`), and every thread writes the
same bytes the norm wrote into rows of its own before its share of the columns. The norm's rows
were split across the threads, so every projection waited at a barrier for them; now the
threads meet only where the residual stream changes (two barriers per layer fewer).

```mlir
tgt.rms_norm %x, %g -> %h rows %n eps 1.000000e-05 : memref<1x576xf32>, !tgt.weight<576, f32, stored> -> !tgt.qrows<1x576xi16>
tgt.matmul %h, %wq -> %q rows %n isa vnni512 : !tgt.qrows<1x576xi16>, !tgt.weight<576x576, q4_1, tiles> -> memref<1x576xf32>
// becomes
tgt.matmul %x, %wq -> %q rows %n norm %g eps 1.000000e-05 quantize <1x576xi16> isa vnni512 : memref<1x576xf32>, !tgt.weight<576x576, q4_1, tiles> norm !tgt.weight<576, f32, stored> -> memref<1x576xf32>
```

Three matmuls reading the norm (an attention's q, k and v projections) become one `tgt.qkv`, which
normalizes and quantizes the rows once for the three and deals their columns as one stream:

```mlir
tgt.qkv %x, %wq, %wk, %wv -> %q, %k, %v rows %n norm %g eps 1.000000e-05 quantize <1x576xi16> isa vnni512 : memref<1x576xf32>, !tgt.weight<576x576, q4_1, tiles>, !tgt.weight<192x576, q4_1, tiles>, !tgt.weight<192x576, q4_1, tiles> norm !tgt.weight<576, f32, stored> -> memref<1x576xf32>, memref<1x192xf32>, memref<1x192xf32>
```

Entry points of more than `MAX_ROWS` rows (prefill, score) keep the norm: there every thread
would quantize every row once per reader, more than the barrier costs. So does a norm whose
float rows a kernel writes before its last reader reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block

from llmc.errors import LlmcError
from llmc.ir import tgt
from llmc.ir.target import module_target
from llmc.passes.base import LlmcPass

MAX_ROWS = 16  # the most rows (`tgt.max_tokens`) of an entry point whose norms are fused


def _readers(norm: tgt.RMSNormOp) -> list[tgt.MatmulOp | tgt.SwigluOp] | None:
    """The projections reading `norm`'s quantized rows as their `x`, or None if anything else touches them."""
    out = norm.out
    if not tgt.is_quantized(out) or norm.groups != 1 or not isinstance(out.owner, tgt.AllocOp):
        return None
    readers = [use.operation for use in out.uses if use.operation is not norm]
    if not readers or any(not isinstance(op, (tgt.MatmulOp, tgt.SwigluOp)) or op.x is not out or
                          op.norm is not None for op in readers):
        return None
    return readers


def _writes(op, value) -> bool:
    """Whether kernel `op` writes the buffer of `value`."""
    return isinstance(op, tgt.Kernel) and any(name in op.WRITES and tgt.root(v) is tgt.root(value)
                                              for name, v in op.abi())


def _fused(op: tgt.MatmulOp | tgt.SwigluOp, norm: tgt.RMSNormOp) -> tgt.MatmulOp | tgt.SwigluOp:
    """`op` reading `norm`'s float rows, normalizing and quantizing them itself."""
    eps = norm.eps.value.data
    if isinstance(op, tgt.MatmulOp):
        new = tgt.MatmulOp(norm.x, op.weight, op.out, op.rows, bias=op.bias, norm=norm.weight, eps=eps)
    else:
        new = tgt.SwigluOp(norm.x, op.gate, op.up, op.out, op.rows, norm=norm.weight, eps=eps)
    new.properties.update({k: v for k, v in op.properties.items() if k != "operandSegmentSizes"})
    new.properties["eps"] = norm.eps
    new.properties["quantize"] = norm.out.type
    return new


def _qkv(block: Block, ops: list, readers: list) -> tgt.QkvOp | None:
    """One `tgt.qkv` of three fused matmuls `readers` (in program order) where they qualify: plain projections
    (no residual, last row or soft-cap) of one isa and layout, all biased or none, with nothing but buffers and
    weights defined between them; it takes the last one's place."""
    matmuls = [op for op in readers if isinstance(op, tgt.MatmulOp)]
    if len(matmuls) != 3:
        return None
    at = sorted(ops.index(op) for op in matmuls)
    first, last = ops[at[0]], ops[at[-1]]
    plain = all(op.accumulate is None and op.last_row is None and op.softcap is None for op in matmuls)
    if not plain or len({(op.isa, op.weight.type.layout, op.bias is None) for op in matmuls}) != 1 or \
            any(isinstance(op, tgt.Kernel) for op in ops[at[0] + 1:at[-1]] if op not in matmuls):
        return None
    q, k, v = (ops[i] for i in at)
    biases = None if first.bias is None else (q.bias, k.bias, v.bias)
    fused = tgt.QkvOp(first.x, (q.weight, k.weight, v.weight), (q.out, k.out, v.out), first.rows, biases=biases,
                      norm=first.norm, eps=first.eps, quantize=first.quantize, isa=first.isa)
    block.insert_op_before(fused, last)
    for op in matmuls:
        block.erase_op(op)
        ops[ops.index(op)] = fused
    return fused


def fuse(function: func.FuncOp) -> int:
    """Fuse every norm of `function` that qualifies; returns how many."""
    block = function.body.block
    ops = list(block.ops)
    fused = 0
    for at, norm in enumerate(ops):
        if not isinstance(norm, tgt.RMSNormOp) or (readers := _readers(norm)) is None:
            continue
        last = max(ops.index(op) for op in readers)
        if any(_writes(op, norm.x) for op in ops[at + 1:last + 1]):
            continue
        news = []
        for op in readers:
            block.insert_op_before(new := _fused(op, norm), op)
            ops[ops.index(op)] = new
            news.append(new)
            block.erase_op(op)
        _qkv(block, ops, news)
        alloc = norm.out.owner
        block.erase_op(norm)
        if not alloc.result.uses:
            block.erase_op(alloc)
        fused += 1
    return fused


@dataclass(frozen=True)
class FuseNormPass(LlmcPass):
    name = "fuse-norm"
    requires_phase = "split"

    def run(self, ctx: Context, module: ModuleOp) -> None:
        if module_target(module).kind.data != "cpu":
            return
        planned = next((f.sym_name.data for f in self.functions(module) if "tgt.arena_bytes" in f.attributes), None)
        if planned is not None:
            raise LlmcError(f"pass 'fuse-norm' runs before plan-memory: @{planned}'s arena is planned already, for "
                            f"the IR before the fusion")
        for function in self.functions(module):
            rows = function.attributes.get("tgt.max_tokens")
            if rows is not None and rows.value.data <= MAX_ROWS:
                fuse(function)
