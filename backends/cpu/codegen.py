"""`tgt` entry points → one LLVM module: an exported function per entry point calling kernels.

Each entry point becomes

    void llmc_<stage>(i32* tokens, i64 n, i64 start, float* k_cache, float* v_cache,
                      float* logits, i8* arena, i8* weights, i64 tid, i64 nth, i64* sync)

whose body is straight-line calls into the kernels of `KernelLibrary`, with every buffer
an offset into the arena (from `plan-memory`) or into the weight file (from the
artifact's weight layout). `nth` threads call it at once, each with its `tid`: matmul,
SwiGLU and attention kernels split their work among them, the small kernels run on
thread 0, and a barrier on `sync` (two i64: arrivals, generation) separates kernels.
One native call per chunk or token per thread; no per-op calls from Python.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from llvmlite import ir
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.ir import SSAValue

from llmc.backends.cpu.kernels import FPTR, I32PTR, I64, VOID, KernelLibrary
from llmc.errors import LlmcError
from llmc.ir import tgt

I8PTR = ir.IntType(8).as_pointer()
I64PTR = I64.as_pointer()
ENTRY_TYPE = ir.FunctionType(VOID, [I32PTR, I64, I64, FPTR, FPTR, FPTR, I8PTR, I8PTR, I64, I64, I64PTR])


SPINS_BEFORE_YIELD = 2000


def barrier_function(module: ir.Module) -> ir.Function:
    """`void llmc_barrier(i64* sync, i64 nth)`: wait until all `nth` threads arrive.

    sync[0] counts arrivals; the last thread to arrive resets it and bumps the
    generation sync[1], which the others watch: spinning with `pause` at first, then
    yielding the core (another process may need it to run the thread everyone waits for).
    """
    fn = ir.Function(module, ir.FunctionType(VOID, [I64PTR, I64]), name="llmc_barrier")
    fn.linkage = "internal"
    fn.attributes.add("noinline")  # called ~1000 times per entry point: inlining would bloat them
    sync, nth = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    spins = b.alloca(I64)
    alone, arrive, last, wait, done = (fn.append_basic_block(n) for n in ("alone", "arrive", "last", "wait", "done"))
    b.cbranch(b.icmp_signed("<=", nth, ir.Constant(I64, 1)), alone, arrive)
    b.position_at_end(alone)
    b.ret_void()

    b.position_at_end(arrive)
    generation = b.gep(sync, [ir.Constant(I64, 1)])
    seen = b.load_atomic(generation, "acquire", 8)
    b.store(ir.Constant(I64, 0), spins)
    arrived = b.atomic_rmw("add", sync, ir.Constant(I64, 1), "acq_rel")
    b.cbranch(b.icmp_signed("==", arrived, b.sub(nth, ir.Constant(I64, 1))), last, wait)

    b.position_at_end(last)
    b.store_atomic(ir.Constant(I64, 0), sync, "monotonic", 8)
    b.atomic_rmw("add", generation, ir.Constant(I64, 1), "release")
    b.ret_void()

    b.position_at_end(wait)
    pause = module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(VOID, []))
    sched_yield = ir.Function(module, ir.FunctionType(ir.IntType(32), []), name="sched_yield")
    count = b.add(b.load(spins), ir.Constant(I64, 1))
    b.store(count, spins)
    with b.if_else(b.icmp_signed("<", count, ir.Constant(I64, SPINS_BEFORE_YIELD))) as (spin, give_way):
        with spin:
            b.call(pause, [])
        with give_way:
            b.call(sched_yield, [])
    b.cbranch(b.icmp_signed("==", b.load_atomic(generation, "acquire", 8), seen), wait, done)
    b.position_at_end(done)
    b.ret_void()
    return fn


def entry_symbol(stage: str) -> str:
    return f"llmc_{stage}"


def _eps(op: tgt.MatmulOp | tgt.SwigluOp) -> float:
    return op.eps.value.data if op.eps is not None else 1e-5


class _EntryEmitter:
    def __init__(self, lib: KernelLibrary, fn: ir.Function, weight_offsets: Mapping[str, int], barrier: ir.Function):
        self.lib = lib
        self.b = ir.IRBuilder(fn.append_basic_block("entry"))
        self.weight_offsets = weight_offsets
        self.barrier = barrier
        tokens, n, start, k_cache, v_cache, logits, self.arena, self.weights, self.tid, self.nth, self.sync = fn.args
        self.values: dict[SSAValue, ir.Value] = {}
        self.args = (tokens, n, start, k_cache, v_cache, logits)

    def bind_arguments(self, function: func.FuncOp) -> None:
        for value, arg in zip(function.body.block.args, self.args, strict=True):
            self.values[value] = arg

    def offset(self, base: ir.Value, offset: int) -> ir.Value:
        return self.b.bitcast(self.b.gep(base, [ir.Constant(I64, offset)]), FPTR)

    def ptr(self, value: SSAValue | None) -> ir.Value:
        return ir.Constant(FPTR, None) if value is None else self.values[value]

    def call(self, kernel: ir.Function, *args: ir.Value) -> None:
        """A kernel that one thread runs (thread 0), then the barrier."""
        with self.b.if_then(self.b.icmp_signed("==", self.tid, ir.Constant(I64, 0))):
            self.b.call(kernel, args)
        self.b.call(self.barrier, [self.sync, self.nth])

    def call_shared(self, kernel: ir.Function, *args: ir.Value) -> None:
        """A kernel that splits its work among the threads, then the barrier."""
        self.b.call(kernel, [*args, self.tid, self.nth])
        self.b.call(self.barrier, [self.sync, self.nth])

    def emit(self, op) -> None:  # noqa: C901 - one case per tgt op, read top to bottom
        lib, p, n = self.lib, self.ptr, self.values
        if isinstance(op, tgt.AllocOp):
            assert op.offset is not None, "run plan-memory before codegen"
            n[op.result] = self.offset(self.arena, op.offset.value.data)
        elif isinstance(op, tgt.ViewOp):
            n[op.result] = n[op.source]
        elif isinstance(op, tgt.WeightOp):
            n[op.result] = self.offset(self.weights, self.weight_offsets[op.sym_name])
        elif isinstance(op, tgt.EmbeddingOp):
            self.call(lib.embedding(tgt.dims(op.table)[1]), n[op.tokens], n[op.rows], n[op.table], n[op.out])
        elif isinstance(op, tgt.RMSNormOp):
            kernel = lib.rms_norm(tgt.dims(op.weight)[0], op.eps.value.data)
            self.call(kernel, n[op.x], n[op.rows], n[op.weight], n[op.out])
        elif isinstance(op, tgt.MatmulOp):
            out_width, k = tgt.dims(op.weight)
            kernel = lib.matmul(k, out_width, has_norm=op.norm is not None, eps=_eps(op), has_bias=op.bias is not None,
                                accumulate=op.accumulate is not None, last_row=op.last_row is not None)
            self.call_shared(kernel, n[op.x], n[op.rows], n[op.weight], p(op.bias), p(op.norm), n[op.out])
        elif isinstance(op, tgt.SwigluOp):
            out_width, k = tgt.dims(op.gate)
            kernel = lib.swiglu(k, out_width, has_norm=op.norm is not None, eps=_eps(op))
            self.call_shared(kernel, n[op.x], n[op.rows], n[op.gate], n[op.up], p(op.norm), n[op.out])
        elif isinstance(op, tgt.RopeOp):
            _, heads, head_dim = tgt.dims(op.x)
            self.call(lib.rope(heads, head_dim, op.theta.value.data), n[op.x], n[op.rows], n[op.start])
        elif isinstance(op, tgt.AttentionOp):
            _, heads, head_dim = tgt.dims(op.q)
            kv_heads = tgt.dims(op.k)[1]
            capacity = tgt.dims(op.k_cache)[2]
            rope = op.rope is not None
            kernel = lib.attention(heads, kv_heads, head_dim, capacity, op.layer.value.data, rope=rope,
                                   theta=op.rope.value.data if rope else 10000.0)
            self.call_shared(kernel, n[op.q], n[op.k], n[op.v], n[op.rows], n[op.start], n[op.k_cache],
                             n[op.v_cache], n[op.out])
        elif isinstance(op, (tgt.AddOp, tgt.MulOp)):
            width = math.prod(tgt.dims(op.out)[1:])
            kernel = lib.add(width) if isinstance(op, tgt.AddOp) else lib.mul(width)
            self.call(kernel, n[op.lhs], n[op.rhs], n[op.out], n[op.rows])
        elif isinstance(op, tgt.SiluOp):
            self.call(lib.silu(math.prod(tgt.dims(op.out)[1:])), n[op.x], n[op.out], n[op.rows])
        elif isinstance(op, func.ReturnOp):
            self.b.ret_void()
        else:
            raise LlmcError(f"cpu codegen: no emitter for {op.name}")


def emit_module(module: ModuleOp, weight_offsets: Mapping[str, int]) -> tuple[ir.Module, dict[str, str]]:
    """The LLVM module of every entry point; returns it and `{stage: exported symbol}`."""
    llvm_module = ir.Module("llmc")
    lib = KernelLibrary(llvm_module, linkage="internal")
    barrier = barrier_function(llvm_module)
    symbols: dict[str, str] = {}
    for function in module.ops:
        if not isinstance(function, func.FuncOp):
            continue
        stage = function.attributes.get("llm.stage")
        if not isinstance(stage, StringAttr):
            raise LlmcError(f"cpu codegen: @{function.sym_name.data} is not a lowered entry point")
        symbol = entry_symbol(stage.data)
        fn = ir.Function(llvm_module, ENTRY_TYPE, name=symbol)
        emitter = _EntryEmitter(lib, fn, weight_offsets, barrier)
        emitter.bind_arguments(function)
        for op in function.body.block.ops:
            emitter.emit(op)
        symbols[stage.data] = symbol
    return llvm_module, symbols
