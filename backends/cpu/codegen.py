"""`tgt` entry points → one LLVM module: an exported function per entry point calling kernels.

Each entry point becomes

    void llmc_<stage>(i8* tokens, i8* positions, i64 n, i8* k_cache, i8* v_cache,
                      i8* logits, i8* arena, i8* weights, i64 tid, i64 nth, i64* sync)

(`entry_arguments`: the `tgt` function's own arguments by name, buffers as `i8*` and
indices as `i64`, then the arena, the weight file and the thread's place), whose body
is straight-line calls into the kernels of
`KernelLibrary`, with every buffer an offset into the arena (from `plan-memory`), into
the weight file (from the artifact's weight layout) or into the KV cache (a layer's
`tgt.subview`). `nth` threads call it at once, each with its `tid`: kernels marked
`THREADED` split their work among them, the others run on thread 0, and a barrier on
`sync` (two i64: arrivals, generation) separates kernels. One native call per chunk or
token per thread; no per-op calls from Python.
"""

from __future__ import annotations

from collections.abc import Mapping

from llvmlite import ir
from xdsl.dialects import func
from xdsl.dialects.builtin import IndexType, ModuleOp, StringAttr
from xdsl.ir import SSAValue

from llmc.backends.cpu.builder import I64, VOID
from llmc.backends.cpu.kernels import KernelLibrary
from llmc.backends.cpu.quant import I8PTR
from llmc.errors import LlmcError
from llmc.ir import tgt
from llmc.ir.layouts import Layout

I64PTR = I64.as_pointer()
# after the function's own arguments: what every entry point also takes
IMPLICIT_ARGUMENTS = (("arena", I8PTR), ("weights", I8PTR), ("tid", I64), ("nth", I64), ("sync", I64PTR))


def _entry_parameters(function: func.FuncOp) -> list[tuple[str, ir.Type]]:
    own = [(arg.name_hint or f"arg{i}", I64 if isinstance(arg.type, IndexType) else I8PTR)
           for i, arg in enumerate(function.body.block.args)]
    return own + list(IMPLICIT_ARGUMENTS)


def entry_arguments(function: func.FuncOp) -> list[str]:
    """The argument names of an entry point's exported function, in order (for the manifest)."""
    return [name for name, _ in _entry_parameters(function)]


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


class _EntryEmitter:
    """The body of one entry point: pointers for buffers, then one call per kernel op.

    A kernel's arguments are its op's operands in definition order (`tgt.Kernel.abi`):
    nothing here knows any kernel's signature.
    """

    def __init__(self, lib: KernelLibrary, fn: ir.Function, function: func.FuncOp, weight_offsets: Mapping[str, int],
                 barrier: ir.Function):
        self.lib = lib
        self.b = ir.IRBuilder(fn.append_basic_block("entry"))
        self.weight_offsets = weight_offsets
        self.barrier = barrier
        own = len(function.body.block.args)
        self.arena, self.weights, self.tid, self.nth, self.sync = fn.args[own:]
        self.values: dict[SSAValue, ir.Value] = dict(zip(function.body.block.args, fn.args[:own]))

    def at(self, base: ir.Value, offset: int) -> ir.Value:
        return self.b.gep(base, [ir.Constant(I64, offset)])

    def emit(self, op) -> None:
        v = self.values
        if isinstance(op, tgt.AllocOp):
            assert op.offset is not None, "run plan-memory before codegen"
            v[op.result] = self.at(self.arena, op.offset.value.data)
        elif isinstance(op, tgt.ViewOp):
            v[op.result] = v[op.source]
        elif isinstance(op, tgt.SubviewOp):
            v[op.result] = self.at(v[op.source], op.byte_offset)
        elif isinstance(op, tgt.WeightOp):
            t = op.weight_type
            if t.layout is Layout.STORED and not t.storage.is_float:
                raise LlmcError(f"cpu codegen: weight @{op.sym_name} ({t.storage}) is not packed: run the pack pass")
            v[op.result] = self.at(self.weights, self.weight_offsets[op.sym_name])
        elif isinstance(op, tgt.Kernel):
            kernel = self.lib.kernel(op)
            args = [v[value] for _, value in op.abi()]
            if op.THREADED:  # every thread takes its share
                self.b.call(kernel, [*args, self.tid, self.nth])
            else:  # thread 0 runs it
                with self.b.if_then(self.b.icmp_signed("==", self.tid, ir.Constant(I64, 0))):
                    self.b.call(kernel, args)
            self.b.call(self.barrier, [self.sync, self.nth])
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
        parameters = _entry_parameters(function)
        fn = ir.Function(llvm_module, ir.FunctionType(VOID, [t for _, t in parameters]), name=symbol)
        for arg, (name, _) in zip(fn.args, parameters):
            arg.name = name
        emitter = _EntryEmitter(lib, fn, function, weight_offsets, barrier)
        for op in function.body.block.ops:
            emitter.emit(op)
        symbols[stage.data] = symbol
    return llvm_module, symbols
