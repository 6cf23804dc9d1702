"""`tgt` entry points → one LLVM module: an exported function per entry point calling kernels.

Each entry point becomes

    void llmc_<stage>(i8* tokens, i8* positions, i64 n, i8* k_cache, i8* v_cache,
                      i8* logits, i8* arena, i8* weights, i64 tid, i64 nth, i64* sync)

(`entry_arguments`: the `tgt` function's own arguments by name, buffers as `i8*` and
indices as `i64`, then the arena, the weight file and the thread's place), whose body
is straight-line calls into the kernels of
`KernelLibrary` (each kernel a module of its own, compiled and cached alone; the library exports
only the `llmc_` symbols), with every buffer an offset into the arena (from `plan-memory`), into
the weight file (from the artifact's weight layout) or into the KV cache (a layer's
`tgt.subview`). `nth` threads call it at once, each with its `tid`, and every kernel splits its work
among them (rows, output columns, cache positions). A barrier on
`sync` (`llmc.abi.SYNC_WORDS`) goes before a kernel only where it touches bytes
that a kernel since the last barrier wrote, or writes bytes one of them read
(`tgt.Kernel.WRITES`; arena regions from plan-memory, cache regions from subviews):
the q, k and v projections of a layer read the same rows and write disjoint buffers,
so no barrier separates them. Each kernel that deals its work (the projections, `tgt.Kernel.DEALS`;
attention counts on it which thread merges one decode row)
gets a work counter of its own in `sync` between two barriers, and the barrier after zeroes
them; the last kernel's are zeroed by a barrier at the end. Otherwise none follows the last
kernel: each thread returns when its share is done, and the thread team (`team.py`) waits for
all of them. One native call per chunk or
token; no per-op calls from Python. The library also exports `llmc_description` (`describe`): what it was
compiled for, which the runtime checks the manifest against before any call.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from pathlib import Path

from llvmlite import ir
from xdsl.dialects import func
from xdsl.dialects.builtin import IndexType, ModuleOp
from xdsl.ir import SSAValue

from llmc.abi import (
    ARGMAX,
    ARGMAX_ARGUMENTS,
    DESCRIPTION,
    DRAW,
    DRAW_ARGUMENTS,
    ENTRY_PREFIX,
    IMPLICIT_ARGUMENTS,
    INT64,
    MAX_THREADS,
    READ_PROBE,
    READ_PROBE_ARGUMENTS,
    READ_PROBE_STEP,
    SYNC_LINE_WORDS,
    WEIGH,
    WEIGH_ARGUMENTS,
    WEIGH_BLOCK,
    WEIGH_GROUP,
    WORK_COUNTER_WORDS,
    WORK_COUNTERS,
    entry_symbol,
)
from llmc.backends.builder import F32, F64, I32, I64, VOID, KernelBuilder
from llmc.backends.cpu.kernels import I64PTR, KernelLibrary
from llmc.backends.cpu.quant import I8PTR, prefetch
from llmc.backends.cpu.team import team_run, team_work
from llmc.errors import LlmcError
from llmc.ir import entry_functions, tgt
from llmc.ir.layouts import Layout
from llmc.ir.target import Built, Describe, content_name, module_target

I64_ARRAYS = ("sync", "out")  # the pointer arguments (`llmc.abi`) indexed as int64: the barrier, the probe's results


def _parameter_type(name: str, kind: str) -> ir.Type:
    return I64 if kind == INT64 else I64PTR if name in I64_ARRAYS else I8PTR


def _entry_parameters(function: func.FuncOp) -> list[tuple[str, ir.Type]]:
    """The function's own arguments, then what every entry point also takes (`llmc.abi.IMPLICIT_ARGUMENTS`)."""
    own = [(arg.name_hint or f"arg{i}", I64 if isinstance(arg.type, IndexType) else I8PTR)
           for i, arg in enumerate(function.body.block.args)]
    return own + [(name, _parameter_type(name, kind)) for name, kind in IMPLICIT_ARGUMENTS.items()]


def entry_arguments(function: func.FuncOp) -> list[str]:
    """The argument names of an entry point's exported function, in order (for the manifest)."""
    return [name for name, _ in _entry_parameters(function)]


Region = tuple[str, int, int]  # a buffer's bytes: (what it is in, first byte, end)
WHOLE = 1 << 62  # an entry argument's extent: all of it


def _overlap(a: Region, b: Region) -> bool:
    return a[0] == b[0] and a[1] < b[2] and b[1] < a[2]


class _EntryEmitter:
    """The body of one entry point: pointers for buffers, then one call per kernel op,
    with barriers where the data flow needs them.

    A kernel's arguments are its op's operands in definition order (`tgt.Kernel.abi`):
    nothing here knows any kernel's signature.
    """

    def __init__(self, lib: KernelLibrary, fn: ir.Function, function: func.FuncOp, weight_offsets: Mapping[str, int]):
        self.lib = lib
        self.b = ir.IRBuilder(fn.append_basic_block("entry"))
        self.weight_offsets = weight_offsets
        own = len(function.body.block.args)
        self.arena, self.weights, self.tid, self.nth, self.sync = fn.args[own:]
        self.values: dict[SSAValue, ir.Value] = dict(zip(function.body.block.args, fn.args[:own]))
        self.regions: dict[SSAValue, Region] = {
            arg: (arg.name_hint or f"arg{i}", 0, WHOLE) for i, arg in enumerate(function.body.block.args)}
        self.read: list[Region] = []  # since the last barrier
        self.written: list[Region] = []
        self.counters = 0  # work counters of the kernels since the last barrier
        self.barriers = 0

    def barrier(self) -> None:
        self.lib.wait(self.b, self.sync, self.nth, self.counters)
        self.read, self.written, self.counters = [], [], 0
        self.barriers += 1

    def work_counter(self) -> ir.Value:
        """The next free work counter (`llmc.abi.SYNC_WORDS`), after a barrier if every one is in use."""
        if self.counters == WORK_COUNTERS:
            self.barrier()
        self.counters += 1
        return self.at(self.sync, SYNC_LINE_WORDS + WORK_COUNTER_WORDS * (self.counters - 1))

    def _order(self, op: tgt.Kernel) -> None:
        """A barrier first if `op` conflicts with a kernel since the last one; then record its accesses."""
        writes = {name for name in op.WRITES}
        mine_r = [self.regions[v] for name, v in op.abi() if v in self.regions and name not in writes]
        mine_w = [self.regions[v] for name, v in op.abi() if v in self.regions and name in writes]
        if any(_overlap(w, o) for w in mine_w for o in self.read + self.written) or \
                any(_overlap(r, o) for r in mine_r for o in self.written):
            self.barrier()
        self.read += mine_r
        self.written += mine_w

    def at(self, base: ir.Value, offset: int) -> ir.Value:
        return self.b.gep(base, [ir.Constant(I64, offset)])

    def emit(self, op) -> None:
        v = self.values
        if isinstance(op, tgt.AllocOp):
            assert op.offset is not None, "run plan-memory before codegen"
            offset = op.offset.value.data
            v[op.result] = self.at(self.arena, offset)
            self.regions[op.result] = ("arena", offset, offset + tgt.nbytes(op.result.type))
        elif isinstance(op, tgt.ViewOp):
            v[op.result] = v[op.source]
            self.regions[op.result] = self.regions[op.source]
        elif isinstance(op, tgt.SubviewOp):
            v[op.result] = self.at(v[op.source], op.byte_offset)
            where, lo, _ = self.regions[op.source]
            self.regions[op.result] = (where, lo + op.byte_offset, lo + op.byte_offset + tgt.nbytes(op.result.type))
        elif isinstance(op, tgt.WeightOp):
            t = op.weight_type
            if t.layout is Layout.STORED and not t.storage.is_float:
                raise LlmcError(f"cpu codegen: weight @{op.sym_name} ({t.storage}) is not packed: run the pack pass")
            v[op.result] = self.at(self.weights, self.weight_offsets[op.sym_name])
        elif isinstance(op, tgt.Kernel):
            self._order(op)
            kernel = self.lib.kernel(op)
            work = [self.work_counter()] if op.DEALS else []
            sync = [self.sync] if op.SYNCS else []
            self.b.call(kernel, [*(v[value] for _, value in op.abi()), self.tid, self.nth, *work, *sync])
        elif isinstance(op, func.ReturnOp):
            if self.counters:  # the last kernels' counters zeroed for the next call
                self.barrier()
            self.b.ret_void()  # no other barrier: the thread team's done barrier follows every call (`team.py`)
        else:
            raise LlmcError(f"cpu codegen: no emitter for {op.name}")


def _exported(module: ir.Module, name: str, arguments: Mapping[str, str]) -> tuple[ir.Function, KernelBuilder]:
    """A function the library exports besides the entry points (`llmc.abi`'s `name` and `arguments`), and a
    builder for its body."""
    types = [_parameter_type(argument, kind) for argument, kind in arguments.items()]
    fn = ir.Function(module, ir.FunctionType(VOID, types), name=name)
    for arg, argument in zip(fn.args, arguments):
        arg.name = argument
    return fn, KernelBuilder(module, fn)


READ_PROBE_STREAMS = 4  # the read probe's streams per thread: a projection reads 4 to 8 at once
ARGMAX_CHAINS = 4  # the argmax's independent (largest, index) vectors (one: 42 GB/s from L2; four: 54)


def read_probe(module: ir.Module) -> ir.Function:
    """`void llmc_read(i8* p, i64 bytes, i64 tid, i64 nth, i64* out)`: thread `tid` of `nth`
    reads its share of `bytes` (whole 256-byte steps) once, as `READ_PROBE_STREAMS` streams side
    by side (as a decode step streams the weights: codes and scale planes, gate and up), and
    leaves the xor of what it read in out[tid]. The buffer may start anywhere. `llmc bench`
    times it: the read bandwidth the decode kernels are measured against."""
    fn, f = _exported(module, READ_PROBE, READ_PROBE_ARGUMENTS)
    p, nbytes, tid, nth, out = fn.args
    lanes = ir.VectorType(ir.IntType(32), 16)
    accs = [f.alloca(lanes, name=f"acc{i}") for i in range(READ_PROBE_STEP // 64)]
    for acc in accs:
        f.b.store(ir.Constant(lanes, [0] * 16), acc)

    def read_step(step: ir.Value) -> None:
        base = f.mul(step, READ_PROBE_STEP)
        prefetch(f, p, f.add(base, 4096))
        for i, acc in enumerate(accs):
            v = f.b.load(f.b.bitcast(f.b.gep(p, [f.add(base, 64 * i)]), lanes.as_pointer()), align=1)
            f.b.store(f.b.xor(f.b.load(acc), v), acc)

    lo, hi = f.share(f.b.sdiv(nbytes, f.i64(READ_PROBE_STEP)), tid, nth)
    length = f.b.sdiv(f.sub(hi, lo), f.i64(READ_PROBE_STREAMS))
    with f.loop(f.i64(0), length, name="c", unroll=False) as c:  # the share as streams read side by side
        for s in range(READ_PROBE_STREAMS):
            read_step(f.add(f.add(lo, f.mul(length, s)), c))
    with f.loop(f.add(lo, f.mul(length, READ_PROBE_STREAMS)), hi, name="t", unroll=False) as t:
        read_step(t)
    total = f.b.load(accs[0])
    for acc in accs[1:]:
        total = f.b.xor(total, f.b.load(acc))
    word = f.b.bitcast(total, ir.VectorType(I64, 8))
    folded = f.b.extract_element(word, ir.Constant(ir.IntType(32), 0))
    for i in range(1, 8):
        folded = f.b.xor(folded, f.b.extract_element(word, ir.Constant(ir.IntType(32), i)))
    f.b.store(folded, f.b.gep(out, [tid]))
    f.finish()
    return fn


def argmax_kernel(module: ir.Module) -> ir.Function:
    """`void llmc_argmax(i8* logits, i64 n, i64 count, i64 tid, i64 nth, i64* out)`: per row of `n` rows of
    `count` floats, the first index of the largest in thread `tid`'s share of the row (whole 16-float vectors,
    the last share's tail too) into out[row · nth + tid]: its share's first index where none is above -inf, -1
    where the share is empty. NaN is never the largest (as the CUDA target's argmax). Greedy decoding's token
    is the largest of the threads' (`Session._team_picks`): each reads the logits its share of the LM head wrote, in
    its own caches, where numpy's argmax read them all from the other core's too (SmolLM2: 26 us a token).
    The thread team runs it after a call whose words ask (`team.py`)."""
    fn, f = _exported(module, ARGMAX, ARGMAX_ARGUMENTS)
    b = f.b
    logits, n, count, tid, nth, out = fn.args
    x = b.bitcast(logits, F32.as_pointer())
    floats, indices = ir.VectorType(F32, 16), ir.VectorType(I64, 16)
    none = 1 << 62  # (a lane's index before any of its floats is above -inf)
    lo, hi = f.share(b.sdiv(f.add(count, 15), f.i64(16)), tid, nth, 16)
    hi = f.smin(hi, count)
    whole = f.add(lo, f.mul(b.sdiv(f.smax(f.sub(hi, lo), 0), f.i64(16)), 16))
    chains = [(f.alloca(floats, name=f"best{k}"), f.alloca(indices, name=f"where{k}")) for k in range(ARGMAX_CHAINS)]
    quads = f.add(lo, f.mul(b.sdiv(f.sub(whole, lo), f.i64(16 * ARGMAX_CHAINS)), 16 * ARGMAX_CHAINS))
    top, at = f.alloca(F32, name="top"), f.alloca(I64, name="at")

    def take(chain: tuple[ir.Value, ir.Value], row: ir.Value, i: ir.Value) -> None:
        """The 16 floats at i into a chain's lanes: each lane keeps its first largest and where it was."""
        best, where = chain
        v = f.vload(row, i)
        above = b.fcmp_ordered(">", v, b.load(best))
        b.store(b.select(above, v, b.load(best)), best)
        b.store(b.select(above, b.add(f.splat_i64(i, 16), ir.Constant(indices, list(range(16)))), b.load(where)),
                where)

    with f.loop(0, n, name="row", unroll=False) as r:
        row = f.ptr(x, f.mul(r, count))
        for best, where in chains:
            b.store(f.const(floats, float("-inf")), best)
            b.store(ir.Constant(indices, [none] * 16), where)
        with f.loop(lo, quads, 16 * ARGMAX_CHAINS, name="v", unroll=False) as i:
            for k, chain in enumerate(chains):
                take(chain, row, f.add(i, 16 * k))
        with f.loop(quads, whole, 16, name="w", unroll=False) as i:
            take(chains[0], row, i)
        largest = f.reduce_max(functools.reduce(f.fmax, (b.load(best) for best, _ in chains)))  # (no NaN gets in)
        firsts = [b.select(b.fcmp_ordered("==", b.load(best), f.splat(largest, floats)), b.load(where),
                           ir.Constant(indices, [none] * 16)) for best, where in chains]
        first = functools.reduce(lambda p, q: b.select(b.icmp_signed("<", p, q), p, q), firsts)
        b.store(largest, top)
        smin = "llvm.vector.reduce.smin.v16i64"
        b.store(b.call(module.globals.get(smin) or ir.Function(module, ir.FunctionType(I64, [indices]), name=smin),
                       [first]), at)
        with f.loop(whole, hi, name="t", unroll=False) as i:
            v = f.load(row, i)
            above = b.fcmp_ordered(">", v, b.load(top))
            b.store(b.select(above, v, b.load(top)), top)
            b.store(b.select(above, i, b.load(at)), at)
        index = b.select(b.icmp_signed("==", b.load(at), f.i64(none)), lo, b.load(at))
        f.store(b.select(b.icmp_signed("<", lo, hi), index, f.i64(-1)), out, f.add(f.mul(r, nth), tid))
    f.finish()
    return fn


def _exp_from(f: KernelBuilder, v: ir.Value, top: ir.Value, scale: ir.Value) -> ir.Value:
    """exp((v − top) · scale) for a float or a float vector `v` (`top` and `scale` floats): a weight."""
    return f.exp(f.b.fmul(f.b.fsub(v, f.splat(top, v.type)), f.splat(scale, v.type)))


WEIGH_CHAINS = 4  # the weighing's independent sums (a block is 64 vectors: one chain would wait on each add)
assert WEIGH_GROUP == 16 * WEIGH_CHAINS and WEIGH_BLOCK % WEIGH_GROUP == 0  # (a group: one step of the chains)


def weigh_kernel(module: ir.Module) -> ir.Function:
    """`void llmc_weigh(i8* logits, i64 n, i64 count, i64 tid, i64 nth, i8* scales, i8* out, i8* groups)`: per
    row of `n` rows of `count` floats whose scale s = scales[row] is >= 0, for each `WEIGH_BLOCK`-float block of
    thread `tid`'s share of the row's blocks: the block's largest float m and Σ exp((x − m) · s) over it, as two
    floats at out[2 · (row · blocks + block)], and the largest of each `WEIGH_GROUP` floats of the block at
    groups[row · ⌈count / WEIGH_GROUP⌉ + group] (`llmc.abi.WEIGH`). Each block is read twice from L1, the row
    once from where the LM head left it. A sampled token's draw needs nothing else from the logits but its
    block's own, or the groups that hold the likeliest (`Sampler.draw_weighed`): the passes over the vocabulary
    run on every thread, in native code. The thread team runs it after a call whose words ask (`team.py`)."""
    fn, f = _exported(module, WEIGH, WEIGH_ARGUMENTS)
    b = f.b
    logits, n, count, tid, nth, scales, out, groups = fn.args
    x, s, o, g = (b.bitcast(p, F32.as_pointer()) for p in (logits, scales, out, groups))
    floats = ir.VectorType(F32, 16)
    blocks = b.sdiv(f.add(count, WEIGH_BLOCK - 1), f.i64(WEIGH_BLOCK))
    row_groups = b.sdiv(f.add(count, WEIGH_GROUP - 1), f.i64(WEIGH_GROUP))
    lo, hi = f.share(blocks, tid, nth)
    chains = [f.alloca(floats, name=f"chain{k}") for k in range(WEIGH_CHAINS)]
    rest, tail = f.alloca(floats, name="rest"), f.alloca(F32, name="tail")

    def steps(row: ir.Value, start: ir.Value, end: ir.Value, first: float, combine, term,
              maxima: ir.Value | None = None) -> ir.Value:
        """combine(…, term(v)) over the floats [start, end) of `row` (`start` a multiple of `WEIGH_GROUP`): a
        group's `WEIGH_CHAINS` vectors side by side, then vectors and floats one at a time in a last partial
        group (`term` takes a float or a vector). With `maxima`, each group's largest term goes to g[maxima +
        group]."""
        for chain in chains:
            b.store(f.const(floats, first), chain)
        whole = f.add(start, f.mul(b.sdiv(f.sub(end, start), f.i64(16)), 16))
        wide = f.add(start, f.mul(b.sdiv(f.sub(end, start), f.i64(WEIGH_GROUP)), WEIGH_GROUP))

        def group_at(i: ir.Value) -> ir.Value:
            return f.add(maxima, b.sdiv(i, f.i64(WEIGH_GROUP)))

        with f.loop(start, wide, WEIGH_GROUP, name="c", unroll=False) as i:
            terms = [term(f.vload(row, f.add(i, 16 * k))) for k in range(WEIGH_CHAINS)]
            if maxima is not None:
                f.store(f.reduce_max(functools.reduce(f.fmax, terms)), g, group_at(i))
            for chain, t in zip(chains, terms):
                b.store(combine(b.load(chain), t), chain)
        b.store(f.const(floats, first), rest)
        with f.loop(wide, whole, 16, name="v", unroll=False) as i:
            b.store(combine(b.load(rest), term(f.vload(row, i))), rest)
        b.store(functools.reduce(combine, (b.extract_element(b.load(rest), f.i64(j)) for j in range(16))), tail)
        with f.loop(whole, end, name="t", unroll=False) as i:
            b.store(combine(b.load(tail), term(f.load(row, i))), tail)
        if maxima is not None:
            with f.when(b.icmp_signed("<", wide, end)):
                f.store(b.load(tail), g, group_at(wide))
        vector = functools.reduce(combine, (b.load(chain) for chain in chains))
        return functools.reduce(combine, [*(b.extract_element(vector, f.i64(j)) for j in range(16)), b.load(tail)])

    with f.loop(0, n, name="row", unroll=False) as r:
        scale = f.load(s, r)
        with f.when(b.fcmp_ordered(">=", scale, f.f32(0.0))):
            row = f.ptr(x, f.mul(r, count))
            with f.loop(lo, hi, name="block", unroll=False) as j:
                start = f.mul(j, WEIGH_BLOCK)
                end = f.smin(f.add(start, WEIGH_BLOCK), count)
                largest = steps(row, start, end, float("-inf"), f.fmax, lambda v: v, f.mul(r, row_groups))

                total = steps(row, start, end, 0.0, f.fadd, lambda v: _exp_from(f, v, largest, scale))
                at = f.mul(f.add(f.mul(r, blocks), j), 2)
                f.store(largest, o, at)
                f.store(total, o, f.add(at, 1))
    f.finish()
    return fn


def draw_kernel(module: ir.Module) -> ir.Function:
    """`void llmc_draw(i8* logits, i64 n, i64 count, i8* scales, i8* out, i8* uniforms, i8* tokens)`: thread 0's
    after the weighing (`weigh_kernel`), for each of `n` rows whose scale s is >= 0 and uniform u (a double) in
    [0, 1): the token drawn with probability ∝ exp((x − top) · s) into tokens[row] (an int64), as
    `Sampler.draw` finds it in the float32 weights: the block where the running sum (in double) of the blocks'
    masses passes u times their total, then the float where the block's running sum passes the rest, or the
    block's last weight above 0 where rounding leaves none; -1 where the total is not a finite number above 0
    (`llmc.abi.DRAW`). Two passes over the blocks and one over a block, their exps 16 at a time: 9 µs a row of
    49k logits, 12.5 of 262k (one exp at a time: 14), where the same in Python after a decode step (each object
    it touches a cache miss) took ~100."""
    fn, f = _exported(module, DRAW, DRAW_ARGUMENTS)
    b = f.b
    logits, n, count, scales, out, uniforms, tokens = fn.args
    x, s, o = (b.bitcast(p, F32.as_pointer()) for p in (logits, scales, out))
    us, ts = b.bitcast(uniforms, F64.as_pointer()), b.bitcast(tokens, I64.as_pointer())
    floats = ir.VectorType(F32, 16)
    blocks = b.sdiv(f.add(count, WEIGH_BLOCK - 1), f.i64(WEIGH_BLOCK))
    top_at, total, running, before = (f.alloca(t, name=name) for t, name in
                                      ((F32, "top"), (F64, "total"), (F64, "running"), (F64, "before")))
    chosen, last, last_before = (f.alloca(t, name=name) for t, name in
                                 ((I64, "chosen"), (I64, "last"), (F64, "last_before")))
    terms = b.bitcast(f.alloca(floats, name="terms"), F32.as_pointer())
    zero, none = ir.Constant(F64, 0.0), f.i64(-1)

    def each(start: ir.Value, end: ir.Value, term, visit) -> None:
        """visit(i, term) for i in [start, end) in order, the terms (`term(i, 16)`: a vector of i … i + 15, or
        `term(i, 1)`: a float) 16 at a time where whole vectors fit."""
        whole = f.add(start, f.mul(b.sdiv(f.sub(end, start), f.i64(16)), 16))
        with f.loop(start, whole, 16, name="v", unroll=False) as i:
            f.vstore(term(i, 16), terms, f.i64(0))
            with f.loop(0, 16, name="l", unroll=False) as lane:
                visit(f.add(i, lane), f.load(terms, lane))
        with f.loop(whole, end, name="s", unroll=False) as i:
            visit(i, term(i, 1))

    def first_passing(start: ir.Value, end: ir.Value, term, past: ir.Value) -> None:
        """Where the running sum of the terms over [start, end) first passes `past` (into `chosen`, the sum
        before it into `before`), or where rounding leaves none, the last term above 0 (and the sum before it)."""
        for slot, value in ((chosen, none), (last, none), (running, zero), (before, zero), (last_before, zero)):
            b.store(value, slot)

        def visit(i: ir.Value, w: ir.Value) -> None:
            w = b.fpext(w, F64)
            now = b.load(running)
            after = b.fadd(now, w)
            first = b.and_(b.icmp_signed("==", b.load(chosen), none), b.fcmp_ordered(">", after, past))
            b.store(b.select(first, i, b.load(chosen)), chosen)
            b.store(b.select(first, now, b.load(before)), before)
            above = b.fcmp_ordered(">", w, zero)
            b.store(b.select(above, i, b.load(last)), last)
            b.store(b.select(above, now, b.load(last_before)), last_before)
            b.store(after, running)

        each(start, end, term, visit)
        missed = b.icmp_signed("==", b.load(chosen), none)
        b.store(b.select(missed, b.load(last), b.load(chosen)), chosen)
        b.store(b.select(missed, b.load(last_before), b.load(before)), before)

    with f.loop(0, n, name="row", unroll=False) as r:
        scale, u = f.load(s, r), f.load(us, r)
        with f.when(b.and_(b.fcmp_ordered(">=", scale, f.f32(0.0)), b.fcmp_ordered(">=", u, zero))):
            f.store(none, ts, r)
            base = f.mul(r, blocks)
            b.store(f.f32(float("-inf")), top_at)
            with f.loop(0, blocks, name="m", unroll=False) as j:
                b.store(f.fmax(b.load(top_at), f.load(o, f.mul(f.add(base, j), 2))), top_at)
            top = b.load(top_at)

            def mass(j: ir.Value, width: int) -> ir.Value:
                """Blocks j … j + width − 1's sums times exp((their largest − top) · s): their masses."""
                at = f.mul(f.add(base, j), 2)
                if width == 1:
                    largest, sums = f.load(o, at), f.load(o, f.add(at, 1))
                else:  # (width (largest, sum) pairs: the even floats, then the odd ones)
                    pairs = f.vload(o, at, 16), f.vload(o, f.add(at, 16), 16)
                    largest, sums = (b.shuffle_vector(*pairs, ir.Constant(ir.VectorType(I32, 16), list(range(k, 32, 2))))
                                     for k in (0, 1))
                return b.fmul(sums, _exp_from(f, largest, top, scale))

            b.store(zero, total)
            each(f.i64(0), blocks, mass, lambda _, w: b.store(b.fadd(b.load(total), b.fpext(w, F64)), total))
            whole = b.load(total)
            finite = b.fcmp_ordered("<", whole, ir.Constant(F64, float("inf")))
            with f.when(b.and_(b.fcmp_ordered(">", whole, zero), finite)):
                target = b.fmul(u, whole)
                first_passing(f.i64(0), blocks, mass, target)
                start = f.mul(b.load(chosen), WEIGH_BLOCK)
                rest = b.fsub(target, b.load(before))
                row = f.ptr(x, f.mul(r, count))

                def weight(i: ir.Value, width: int) -> ir.Value:
                    """The float32 weights of logits i … i + width − 1 (a logit at -inf weighs 0)."""
                    v = f.vload(row, i, 16) if width > 1 else f.load(row, i)
                    excluded = b.fcmp_ordered("==", v, f.const(v.type, float("-inf")))
                    return b.select(excluded, f.const(v.type, 0.0), _exp_from(f, v, top, scale))

                first_passing(start, f.smin(f.add(start, WEIGH_BLOCK), count), weight, rest)
                f.store(b.load(chosen), ts, r)
    f.finish()
    return fn


def describe(module: ir.Module, description: dict) -> ir.GlobalVariable:
    """`const char llmc_description[]`: what the library's code was compiled for (the manifest's own
    fields, `llmc.package.describe`), as NUL-terminated JSON, for the runtime to check the manifest
    against before any call."""
    data = bytearray(json.dumps(description, sort_keys=True).encode() + b"\0")
    array = ir.ArrayType(ir.IntType(8), len(data))
    variable = ir.GlobalVariable(module, array, name=DESCRIPTION)
    variable.initializer = ir.Constant(array, data)
    variable.global_constant = True
    return variable


def emit_module(module: ModuleOp, weight_offsets: Mapping[str, int], description: dict
                ) -> tuple[list[ir.Module], dict[str, int]]:
    """The LLVM modules of an artifact: the first holds every entry point (`entry_symbol(stage)`
    each), the read probe (`READ_PROBE`), greedy decoding's argmax (`ARGMAX`) and sampling's weighing
    (`WEIGH`), the thread team that runs them (`team`) and the `description` (`DESCRIPTION`), the others one
    kernel each (compiled and cached alone); also the number of barriers each entry point's threads pass."""
    from llmc.backends.cpu.target import kernel_tuning

    llvm_module = ir.Module("llmc")
    lib = KernelLibrary(llvm_module, separate=True, tuning=kernel_tuning(module_target(module)))
    barriers: dict[str, int] = {}
    for stage, function in entry_functions(module).items():
        parameters = _entry_parameters(function)
        fn = ir.Function(llvm_module, ir.FunctionType(VOID, [t for _, t in parameters]), name=entry_symbol(stage))
        for arg, (name, _) in zip(fn.args, parameters):
            arg.name = name
        emitter = _EntryEmitter(lib, fn, function, weight_offsets)
        for op in function.body.block.ops:
            emitter.emit(op)
        barriers[stage] = emitter.barriers
    read_probe(llvm_module)
    passes = argmax_kernel(llvm_module), weigh_kernel(llvm_module)
    jobs = [llvm_module.get_global(symbol) for symbol in team_jobs(module)]
    team_work(lib, jobs, *passes)
    team_run(lib, jobs, *passes, draw_kernel(llvm_module))
    describe(llvm_module, description)
    return [llvm_module, *lib.modules], barriers


def cpu_facts(module: ModuleOp) -> tuple[dict, dict[str, dict]]:
    """The CPU parts of a manifest: the target facts, and each entry point's exported symbol and arguments."""
    target = module_target(module)
    entries = {stage: {"symbol": entry_symbol(stage), "arguments": entry_arguments(function)}
               for stage, function in entry_functions(module).items()}
    facts = {"target": "cpu", "cpu": {"name": target.cpu.data, "features": sorted(target.features)},
             "max_threads": MAX_THREADS, "read_probe": READ_PROBE, "team_jobs": team_jobs(module)}
    return facts, entries


def team_jobs(module: ModuleOp) -> list[str]:
    """What the thread team runs, by job index: the entry points' symbols, then the read probe's."""
    return [entry_symbol(stage) for stage in entry_functions(module)] + [READ_PROBE]


def build(module: ModuleOp, weight_offsets: Mapping[str, int], describe: Describe, stage: Path, options) -> Built:
    """The kernels library of a planned module, `kernels-<digest>.so` in `stage`, each kernel compiled
    (or taken from the kernel cache) for exactly the recorded CPU and features (`options` add nothing)."""
    from llmc.backends.cpu.target import target_machine_for
    from llmc.backends.cpu.toolchain import compile_objects, link_shared

    target = module_target(module)
    description = describe(*cpu_facts(module))
    llvm_modules, barriers = emit_module(module, weight_offsets, description)
    objects, cached = compile_objects(llvm_modules, target_machine_for(target))
    kernels = link_shared(objects, stage / content_name("kernels", b"".join(objects), ".so"), exports=ENTRY_PREFIX)
    note = (f"{kernels.name} (cpu {target.cpu.data}{_isa_note(module)}; {len(objects) - 1} kernels, {cached} of "
            f"{len(objects)} modules from the cache; barriers per call: decode {barriers.get('decode', 0)})")
    return Built(description, {"kernels": kernels}, note)


def _isa_note(module: ModuleOp) -> str:
    """`, a16+a8 on avx2`: the integer modes of the kernels (by the width of the rows they read), and the
    dot product they use."""
    isa, modes = "", set()
    for op in module.walk():
        if isinstance(op, tgt.Projection) and op.isa is not None:
            isa = isa or op.isa.data.value
            rows = op.rows_type()
            modes.add(f"a{rows.bits}" if isinstance(rows, tgt.QRowsType) else "a8")
    return f", {'+'.join(sorted(modes, reverse=True))} on {isa}" if isa else ""
