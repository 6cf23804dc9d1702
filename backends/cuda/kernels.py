"""CUDA kernel emitters: each `tgt` kernel op → one or more GPU kernels and their launch geometry.

`KernelLibrary(device).launches(op)` emits (once per distinct op and row
class, into a module of the op's own) the kernels that carry out `op` and returns how to launch them, in order. Every
kernel of an op takes the op's operands in definition order (`tgt.Kernel.abi`):
buffers as `i8*`, indices as `i64`, so the launch plan's arguments come from the op
definition. A grid dimension is a number or `PerRows(r)`: `ceil(rows / r)` blocks,
decided at launch from the entry point's `n`.

| op | kernels | grid (x, y, z) | a thread block does |
|---|---|---|---|
| matmul, swiglu | GEMV | (N / 4, rows / R) | 4 warps, one output feature each, for R rows; lanes stride K 16 bytes of codes at a time, dequantize in registers, sum by warp shuffles; fused RMSNorm, bias, residual add, SwiGLU (`gemm`) |
| matmul, swiglu with `isa mma_f16` | `_mma` | (N / 64, rows / 32) | f16 tiles of x and the dequantized weights in shared memory, `mma.sync.m16n8k16` per warp, the same epilogues (`gemm`) |
| attention | `_store`, `_attend`, (`_merge`) | (1, rows); prefill (heads, rows / 4); decode (heads, rows, S) | RoPE in place and the cache write; an online softmax over cache positions, lanes over the head dimension: in prefill a warp per query row, in decode 4 warps and S blocks per row splitting the positions, merged (flash-decoding) (`attention`) |
| (greedy decoding) | `llmc_argmax` | (1, 1, 1) | the first index of the largest logit |
| embedding, rms_norm, add, mul, silu, gelu; rope (`attention`) | one each | (W / 128, rows) or (1, rows) | one row's elements |

Shapes, formats and constants are baked in; only `rows` and `positions` arrive at run time.

    lib = KernelLibrary(Ptx())
    lib.launches(op)   # [Launch("matmul_q4_1_a32_k576_n576_r1", (144, PerRows(1), 1), 128)]
    lib.modules        # [<ir.Module "matmul_q4_1_a32_k576_n576_r1">]
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from llvmlite import ir
from xdsl.dialects.builtin import MemRefType

from llmc.backends.builder import F32, I32, I64, KernelBuilder
from llmc.backends.cuda import attention, gemm
from llmc.backends.cuda.device import Emulated, Ptx
from llmc.backends.cuda.emit import THREADS, WARPS, Dim, Emit, Launch, PerRows, fptr, inv_rms, load_index, lt, strided
from llmc.backends.cuda.weights import I8PTR, WeightRows
from llmc.backends.kernel_names import kernel_key, kernel_name
from llmc.errors import LlmcError
from llmc.ir import tgt
from llmc.ir.activations import ACTIVATIONS
from llmc.ir.interfaces import OpInterface


def _max_rows(op: tgt.Kernel) -> int:
    """The rows of the op's row buffers in this entry point (1 in decode)."""
    for name, value in op.abi():
        if name in op.ROWS:
            return tgt.dims(value)[0]
    return 1


class KernelLibrary:
    """Emits CUDA kernels for `device` (`Ptx` or `Emulated`), once per distinct op: the kernels of each op
    in an LLVM module of their own (`modules`, in emission order), compiled and cached alone
    (`llmc.backends.cpu.toolchain.compile_objects`), so the same op in another model skips LLVM."""

    def __init__(self, device: Ptx | Emulated):
        self.device = device
        self.modules: list[ir.Module] = []
        self._cache: dict[tuple, list[Launch]] = {}
        self.kernels: dict[str, ir.Function] = {}

    def launches(self, op: tgt.Kernel) -> list[Launch]:
        rows = _max_rows(op)
        key = (kernel_key(op), rows)
        if key not in self._cache:
            emitter = EMITTERS.lookup(op)
            quantized = [name for name, value in op.abi() if isinstance(value.type, tgt.QRowsType)]
            if quantized:
                raise LlmcError(f"cuda: {op.name} takes quantized rows ({', '.join(quantized)}); CUDA kernels "
                                f"take float rows (a32): compile without --compute a8")
            name = f"{kernel_name(op)}_r{rows}"
            self.modules.append(ir.Module(name))
            self._cache[key] = emitter(Emit(self, op, name, rows))
        return self._cache[key]

    def argmax(self) -> Launch:
        """Greedy decoding's argmax kernel (`argmax_kernel`), in a module of its own."""
        self.modules.append(ir.Module(ARGMAX))
        return argmax_kernel(self.modules[-1], self.device)

    def new_kernel(self, name: str, op: tgt.Kernel) -> tuple[KernelBuilder, dict[str, ir.Value]]:
        params = [(n, I64 if not isinstance(v.type, (MemRefType, tgt.QRowsType, tgt.WeightType)) else I8PTR)
                  for n, v in op.abi()]
        base, count = name, 1
        while name in self.kernels:  # same op and rows, other shapes (RoPE of q and of k)
            name, count = f"{base}_v{count}", count + 1
        module = self.modules[-1]  # (the op's, `launches`)
        fn = self.device.kernel(module, name, [t for _, t in params], THREADS)
        for arg, (arg_name, _) in zip(fn.args, params):
            arg.name = arg_name
        self.kernels[name] = fn
        return KernelBuilder(module, fn), dict(zip((n for n, _ in params), fn.args))


# ---------------------------------------------------------------------- row kernels


def _elementwise_grid(width: int) -> tuple[Dim, Dim, Dim]:
    return (-(-width // THREADS), PerRows(1), 1)


def _column(f: KernelBuilder, dev) -> ir.Value:
    return f.add(f.mul(dev.ctaid(f, "x"), THREADS), dev.tid(f))


def _embedding(e: Emit) -> list[Launch]:
    op, dev = e.op, e.dev
    width = tgt.dims(op.table)[1]

    def body(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        col, t = _column(f, dev), dev.ctaid(f, "y")
        with f.when(lt(f, col, width)):
            token = load_index(f, a["tokens"], t)
            table = WeightRows(f, a["table"], op.table.type)
            value = table.element(token, col)
            if op.scale is not None:
                value = f.fmul(value, f.f32(op.scale.value.data))
            f.store(value, fptr(f, a["out"]), f.add(f.mul(t, width), col))

    return [e.kernel("", body, _elementwise_grid(width))]


def _rms_norm(e: Emit) -> list[Launch]:
    op, dev = e.op, e.dev
    width = tgt.row_width(op.x) // op.groups  # one block per row, its groups one after another

    def body(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        t, tid = dev.ctaid(f, "y"), dev.tid(f)
        with f.loop(0, op.groups, name="g", unroll=False) as g:
            item = f.add(f.mul(t, op.groups), g)
            x = f.b.gep(fptr(f, a["x"]), [f.mul(item, width)])
            out = f.b.gep(fptr(f, a["out"]), [f.mul(item, width)])
            inv = inv_rms(f, dev, x, width, op.eps.value.data, tid, THREADS,
                          lambda f, v: dev.block_sum(f, v, WARPS, "ss"))
            w = fptr(f, a["weight"])
            with strided(f, tid, width, THREADS, "c") as c:
                f.store(f.fmul(f.fmul(f.load(x, c), inv), f.load(w, c)), out, c)

    return [e.kernel("", body, (1, PerRows(1), 1))]


def _elementwise(e: Emit, names: tuple[str, ...], fn: Callable) -> list[Launch]:
    op, dev = e.op, e.dev
    width = tgt.row_width(op.out)

    def body(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        col, t = _column(f, dev), dev.ctaid(f, "y")
        with f.when(lt(f, col, width)):
            at = f.add(f.mul(t, width), col)
            f.store(fn(f, *(f.load(fptr(f, a[n]), at) for n in names)), fptr(f, a["out"]), at)

    return [e.kernel("", body, _elementwise_grid(width))]


# ---------------------------------------------------------------------- greedy decoding

ARGMAX = "llmc_argmax"


def argmax_kernel(module: ir.Module, dev) -> Launch:
    """`llmc_argmax(float* logits, i32* out, i64 count)`: `out[0]` = the index of the largest of
    `count` logits, the first on ties (as numpy's argmax), so greedy decoding downloads 4 bytes."""
    fn = dev.kernel(module, ARGMAX, [I8PTR, I8PTR, I64], THREADS)
    f = KernelBuilder(module, fn)
    b = f.b
    logits, out, count = fptr(f, fn.args[0]), b.bitcast(fn.args[1], I32.as_pointer()), fn.args[2]
    tid = dev.tid(f)
    best, where = f.alloca(F32, name="best"), f.alloca(I32, name="where")
    mine = lt(f, tid, count)  # each thread starts from its first logit (an all -inf row has an argmax too)
    b.store(b.select(mine, f.load(logits, f.smin(tid, f.sub(count, 1))), f.f32(-np.inf)), best)
    b.store(b.select(mine, b.trunc(tid, I32), ir.Constant(I32, 0x7FFFFFFF)), where)
    with strided(f, f.add(tid, THREADS), count, THREADS, "i") as i:
        v = f.load(logits, i)
        better = b.fcmp_ordered(">", v, b.load(best))
        b.store(b.select(better, v, b.load(best)), best)
        b.store(b.select(better, b.trunc(i, I32), b.load(where)), where)

    def merge(v: ir.Value, i: ir.Value, v2: ir.Value, i2: ir.Value) -> tuple[ir.Value, ir.Value]:
        other = b.or_(b.fcmp_ordered(">", v2, v), b.and_(b.fcmp_ordered("==", v2, v), b.icmp_signed("<", i2, i)))
        return b.select(other, v2, v), b.select(other, i2, i)

    v, i = b.load(best), b.load(where)
    for mask in (16, 8, 4, 2, 1):
        v, i = merge(v, i, dev.shfl_xor(f, v, mask), dev.shfl_xor_i32(f, i, mask))
    values = dev.shared(f, "values", WARPS)
    indices = b.bitcast(dev.shared(f, "indices", WARPS), I32.as_pointer())
    _, lane, warp = dev.lanes(f)
    with f.when(b.icmp_unsigned("==", lane, f.i64(0))):
        f.store(v, values, warp)
        f.store(i, indices, warp)
    dev.barrier(f)
    with f.when(b.icmp_unsigned("==", tid, f.i64(0))):
        v, i = f.load(values, 0), f.load(indices, 0)
        for w in range(1, WARPS):
            v, i = merge(v, i, f.load(values, w), f.load(indices, w))
        f.store(i, out, 0)
    f.finish()
    return Launch(ARGMAX, (1, 1, 1))


EMITTERS = OpInterface("cuda", "kernel")  # `fn(emit) -> launches`
EMITTERS.implement(tgt.MatmulOp, tgt.SwigluOp)(gemm.matmul)
EMITTERS.implement(tgt.EmbeddingOp)(_embedding)
EMITTERS.implement(tgt.RMSNormOp)(_rms_norm)
EMITTERS.implement(tgt.RopeOp)(attention.rope)
EMITTERS.implement(tgt.AttentionOp)(attention.attention)
EMITTERS.implement(tgt.AddOp)(lambda e: _elementwise(e, ("lhs", "rhs"), lambda f, x, y: f.fadd(x, y)))
EMITTERS.implement(tgt.MulOp)(lambda e: _elementwise(e, ("lhs", "rhs"), lambda f, x, y: f.fmul(x, y)))
EMITTERS.implement(*tgt.ACTIVATION_KERNELS.values())(
    lambda e: _elementwise(e, ("x",), lambda f, x: getattr(f, ACTIVATIONS[e.op.ACTIVATION].builder)(x)))
for _op_type in (tgt.QuantizeOp, tgt.QkvOp, tgt.MoeOp, tgt.BinaryOp, tgt.ScalarOp, tgt.UnaryOp, tgt.ReduceOp):
    EMITTERS.refuse(_op_type, "yet; --target cpu compiles it")
