"""CPU kernel emitters: one LLVM function per distinct `tgt` kernel op, from its definition.

`KernelLibrary.kernel(op)` emits (once per distinct operand types and properties) the
function that carries out `op`. Its arguments are the op's operands in definition
order (`tgt.Kernel.abi`): every buffer is an `i8*` (float rows, quantized rows, a
weight), every index an `i64`; then `i64 tid, i64 nth`: every kernel does thread
`tid`'s share of the work of `nth` threads. Shapes, storage types, layouts, eps and
theta are baked in as constants; only the row count `rows` and the rows' `positions`
arrive at run time.

    module = ir.Module("kernels")
    lib = KernelLibrary(module)
    fn = lib.kernel(matmul_op)   # void @matmul_q4_1_a8_k576_n576(i8* x, i8* weight, i8* out, i64 rows, i64 tid, i64 nth)

The matmul family (matmul, swiglu, the LM head) runs on `gemm`'s loop nests, whose
inner loop follows the weight format and whether the rows are float or quantized;
RoPE and attention are in `attention`.
Kernels that write quantized rows (RMSNorm, SwiGLU, attention, quantize) quantize each
32-value block as soon as it is computed (`quant.QRowsAccess.store_block`); a projection
with `quantize` (`fuse-norm`) writes the RMSNorm's quantized rows itself, on each thread's
stack. exp, sin and cos are inline polynomials (`KernelBuilder.exp`, `.sincos`), so silu,
softmax and RoPE vectorise and need no libm.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from llvmlite import ir
from xdsl.dialects.builtin import MemRefType

from llmc.abi import SYNC_LINE_WORDS, WORK_COUNTER_WORDS
from llmc.backends.builder import F32, I32, I64, VOID, KernelBuilder, f32_table
from llmc.backends.cpu import attention
from llmc.backends.cpu.gemm import (
    PREFETCH_BYTES,
    TILE_ROWS,
    Finish,
    Part,
    Prefetches,
    Rows,
    floats,
    gemm,
    gemm_screened,
    inv_rms,
    load_weight,
    weight_ptr,
)
from llmc.backends.cpu.quant import (
    CACHE_LINE,
    I8,
    I8PTR,
    QRowsAccess,
    SplitWeight,
    TiledWeight,
    vec,
)
from llmc.backends.cpu.toolchain import Deferred
from llmc.backends.kernel_cache import compiler_version
from llmc.backends.kernel_names import kernel_key, kernel_name, rope_table
from llmc.ir import llm, tgt
from llmc.ir.activations import ACTIVATIONS, activation_of
from llmc.ir.formats import ACT_BLOCK, GROUP, SLICE
from llmc.ir.interfaces import OpInterface
from llmc.ir.layouts import STRIP, TILE_K, Layout

I64PTR = I64.as_pointer()
EMITTERS = OpInterface("cpu", "kernel emitter")  # `fn(lib, f, op, args)` emits the body of `op`'s function


@dataclass(frozen=True)
class Tuning:
    """What a kernel's code takes from its CPU beyond the IR (`target.kernel_tuning`), part of each kernel's cache
    identity: the one-row tiles kernels' prefetch distances, into L1 (`target.near_prefetch_bytes`) and, where the
    CPU's table gives one, into L2 as well (`target.NEAR_L2_PREFETCH_BYTES`; 0: none), and the vector registers
    (decode attention keeps half of them for V sums)."""

    prefetch_bytes: int = PREFETCH_BYTES
    vector_registers: int = 16
    l2_prefetch_bytes: int = 0

    @property
    def near_prefetches(self) -> Prefetches:
        """The one-row tiles kernels' prefetches: (bytes ahead, cache level) each."""
        return ((self.prefetch_bytes, 1),) + (((self.l2_prefetch_bytes, 2),) if self.l2_prefetch_bytes else ())

    @property
    def register_floats(self) -> int:
        """The floats a vector register holds: 16 with AVX-512 (its 32 zmm), 8 otherwise."""
        return 16 if self.vector_registers >= 32 else 8

    @property
    def float_vectors(self) -> int:
        """The `<16 x float>` the vector registers hold: 32 zmm with AVX-512, 8 in 16 ymm otherwise."""
        return self.vector_registers * self.register_floats // 16


class KernelLibrary:
    """Emits kernels into `module`, once per distinct kernel (`kernel_key`), each an external
    function (callable through ctypes from a shared library of `module` alone).

    With `separate`, each kernel is a module of its own (`modules`, each a `Deferred`: emitted only
    where the kernel cache lacks its object, `llmc.backends.kernel_cache`, so the same kernel in
    another artifact or compile skips IR emission and LLVM), and `module` gets its declaration; the
    objects are linked together.
    """

    def __init__(self, module: ir.Module, *, separate: bool = False, tuning: Tuning = Tuning()):
        self.module = module
        self.separate = separate
        self.tuning = tuning
        self.modules: list[Deferred] = []  # with `separate`: one per kernel
        self._cache: dict[tuple, ir.Function] = {}

    def kernel(self, op: tgt.Kernel) -> ir.Function:
        """The function of `op`, emitted on first request (with `separate`, declared)."""
        key = kernel_key(op)
        if key in self._cache:
            return self._cache[key]
        name = kernel_name(op)
        if not self.separate:
            return self._emit(key, op, name)
        if name in self.module.globals:  # another kernel of the same readable name: a digest of the key
            name = f"{name}_{hashlib.sha256(repr(key).encode()).hexdigest()[:8]}"

        def build(name: str = name) -> ir.Module:
            own = KernelLibrary(ir.Module(name), tuning=self.tuning)
            own._emit(key, op, name)
            return own.module

        self.modules.append(Deferred(f"{name} {key!r} {self.tuning} {compiler_version()}", build))
        parameters = _parameters(op)
        self._cache[key] = ir.Function(self.module, ir.FunctionType(VOID, [t for _, t in parameters]), name=name)
        return self._cache[key]

    def _emit(self, key: tuple, op: tgt.Kernel, fn_name: str) -> ir.Function:
        emitter = EMITTERS.lookup(op)
        params = _parameters(op)
        fn, f = self._new(key, fn_name, params)
        emitter(self, f, op, dict(zip((p for p, _ in params), fn.args)))
        f.finish()
        return fn

    def wait(self, b: ir.IRBuilder, sync: ir.Value, nth: ir.Value, counters: int = 0) -> None:
        """Every thread waits at the barrier on `sync` for the others; the last to arrive first zeroes the
        first `counters` work counters (`llmc.abi.SYNC_WORDS`), those of the kernels since the last barrier."""
        fn = self.module.globals.get("llmc_barrier") or _barrier_function(self.module)
        b.call(fn, [sync, nth, ir.Constant(I64, counters)])

    def functions(self) -> list[ir.Function]:
        """Every kernel emitted so far, in emission order."""
        return list(self._cache.values())

    def _new(self, key: tuple, name: str, args: Sequence[tuple[str, ir.Type]]) -> tuple[ir.Function, KernelBuilder]:
        if name in self.module.globals:
            name = self.module.get_unique_name(name)
        fn = ir.Function(self.module, ir.FunctionType(VOID, [t for _, t in args]), name=name)
        fn.attributes.add("nounwind")
        for arg, (arg_name, ty) in zip(fn.args, args):
            arg.name = arg_name
            if isinstance(ty, ir.PointerType):
                arg.add_attribute("noalias")
        self._cache[key] = fn
        # stack arrays on cache lines: a vector access of one never straddles two (LLVM gave them 16 bytes, and
        # one-row decode attention at depth 2048 took 13% longer with its staged K rows astride lines)
        return fn, KernelBuilder(self.module, fn, array_align=CACHE_LINE)

    def inv_freq_table(self, head_dim: int, rope: llm.RopeAttr) -> ir.Value:
        return f32_table(self.module, *rope_table(head_dim, rope))


def _parameters(op: tgt.Kernel) -> list[tuple[str, ir.Type]]:
    """The kernel function's arguments: the op's operands (buffers `i8*`, indices `i64`), `tid`, `nth`, then
    `work` for a kernel that deals its work and `sync` for one that waits on the others."""
    params = [(name, I64 if not isinstance(v.type, (MemRefType, tgt.QRowsType, tgt.WeightType)) else I8PTR)
              for name, v in op.abi()]
    params += [("tid", I64), ("nth", I64)]
    params += [("work", I64PTR)] if op.DEALS else []
    return params + [("sync", I64PTR)] if op.SYNCS else params


SPINS_BEFORE_YIELD = 2000


def _barrier_function(module: ir.Module) -> ir.Function:
    """`void llmc_barrier(i64* sync, i64 nth, i64 counters)`: wait until all `nth` threads arrive.

    sync[0] counts arrivals; the last thread to arrive zeroes the first `counters` work
    counters (the first `nth` words of each, `llmc.abi.SYNC_WORDS`), resets the
    count and bumps the generation sync[1], which the others watch: spinning with `pause` at
    first, then yielding the core (another process may need it to run the thread everyone
    waits for).
    """
    fn = ir.Function(module, ir.FunctionType(VOID, [I64PTR, I64, I64]), name="llmc_barrier")
    fn.linkage = "internal"
    fn.attributes.add("noinline")  # called ~1000 times per entry point: inlining would bloat them
    sync, nth, counters = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    spins = b.alloca(I64)
    arrive, last, zero, zeroed, release, wait, done = (fn.append_basic_block(n) for n in (
        "arrive", "last", "zero", "zeroed", "release", "wait", "done"))
    generation = b.gep(sync, [ir.Constant(I64, 1)])
    alone = b.icmp_signed("<=", nth, ir.Constant(I64, 1))
    b.cbranch(alone, last, arrive)  # (alone: the counters zeroed all the same)

    b.position_at_end(arrive)
    seen = b.load_atomic(generation, "acquire", 8)
    b.store(ir.Constant(I64, 0), spins)
    arrived = b.atomic_rmw("add", sync, ir.Constant(I64, 1), "acq_rel")
    b.cbranch(b.icmp_signed("==", arrived, b.sub(nth, ir.Constant(I64, 1))), last, wait)

    b.position_at_end(last)
    per = b.select(alone, ir.Constant(I64, 1), nth)
    b.cbranch(b.icmp_signed(">", counters, ir.Constant(I64, 0)), zero, zeroed)
    b.position_at_end(zero)  # word j of counter c: thread j's, for the first `nth` threads
    c, j = b.phi(I64), b.phi(I64)
    c.add_incoming(ir.Constant(I64, 0), last)
    j.add_incoming(ir.Constant(I64, 0), last)
    word = b.add(b.mul(c, ir.Constant(I64, WORK_COUNTER_WORDS)), b.add(j, ir.Constant(I64, SYNC_LINE_WORDS)))
    b.store_atomic(ir.Constant(I64, 0), b.gep(sync, [word]), "monotonic", 8)
    j_after = b.add(j, ir.Constant(I64, 1))
    wrap = b.icmp_signed(">=", j_after, per)
    c_next = b.select(wrap, b.add(c, ir.Constant(I64, 1)), c)
    c.add_incoming(c_next, zero)
    j.add_incoming(b.select(wrap, ir.Constant(I64, 0), j_after), zero)
    b.cbranch(b.icmp_signed("<", c_next, counters), zero, zeroed)
    b.position_at_end(zeroed)
    b.cbranch(alone, done, release)
    b.position_at_end(release)
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


def _weight_type(value) -> tgt.WeightType:
    t = value.type
    assert isinstance(t, tgt.WeightType)
    return t


# ------------------------------------------------------------------------ embedding


def _weight_row(f: KernelBuilder, ptr: ir.Value, weight: tgt.WeightType, row: ir.Value, dst: ir.Value) -> None:
    """Row `row` of a weight matrix (any storage, any layout), dequantized into floats at `dst`."""
    D = weight.shape[1]
    if weight.layout.tiled:
        _tiles_row(f, TiledWeight(f, ptr, weight), row, D, dst)
    elif weight.layout is Layout.SPLIT:
        w = SplitWeight(f, ptr, weight)
        full, half = D // GROUP, D % GROUP // 16
        with f.loop(0, full, name="g", unroll=False) as g:
            for s, v in enumerate(w.values(row, g)):
                f.vstore(v, dst, f.add(f.mul(g, GROUP), 16 * s))
        if half:
            for s, v in enumerate(w.values(row, f.i64(full), slices=half)):
                f.vstore(v, dst, f.i64(full * GROUP + 16 * s))
    else:
        src_base = weight_ptr(f, ptr, weight.storage)
        src = f.mul(row, D)
        with f.loop(0, D, name="d") as d:
            f.store(load_weight(f, src_base, f.add(src, d), weight.storage), dst, d)


@EMITTERS.implement(tgt.EmbeddingOp)
def _embedding(lib: KernelLibrary, f: KernelBuilder, op: tgt.EmbeddingOp, a: dict) -> None:
    """out[t] = table[tokens[t]] (times `scale`), dequantizing the row."""
    table_type = _weight_type(op.table)
    D = table_type.shape[1]
    tokens = f.b.bitcast(a["tokens"], I32.as_pointer())
    out = floats(f, a["out"])
    with f.loop(*f.share(a["rows"], a["tid"], a["nth"]), name="t") as t:
        tok = f.b.sext(f.load(tokens, t), I64)
        dst = f.ptr(out, f.mul(t, D))
        _weight_row(f, a["table"], table_type, tok, dst)
        if op.scale is not None:
            scale = op.scale.value.data
            f.vec_map(D, [dst], dst, lambda v: f.fmul(v[0], f.const(v[0].type, scale)), name="s")


def _tiles_row(f: KernelBuilder, w: TiledWeight, j: ir.Value, D: int, dst: ir.Value) -> None:
    """Row j of a tiles-layout weight, dequantized into dst: per 16-slice, the 4 code words of
    row j in the slice's 4 quad vectors, then `(code − zero) · scale` or `code · scale + minimum`."""
    b = f.b
    assert D % TILE_K == 0, "every integer format's blocks are whole 32-blocks"
    s, fi = b.sdiv(j, f.i64(STRIP)), b.trunc(b.srem(j, f.i64(STRIP)), I32)

    with f.loop(0, D // TILE_K, name="eb", unroll=False) as blk:
        quads = w.quads(s, blk)
        for h in range(TILE_K // SLICE):
            sl = f.add(f.mul(blk, 2), h)
            words = ir.Constant(vec(I32, 4), None)
            for i in range(4):
                word = b.extract_element(b.bitcast(quads[4 * h + i], vec(I32, STRIP)), fi)
                words = b.insert_element(words, word, ir.Constant(I32, i))
            u = b.uitofp(b.bitcast(words, vec(ir.IntType(8), 16)), vec(F32, 16))
            scale16 = w.scale16(s, sl)
            scale = f.splat(b.extract_element(scale16, fi), vec(F32, 16))
            if w.fmt.zero is not None:
                value = b.fmul(b.fsub(u, f.const(vec(F32, 16), float(w.fmt.zero))), scale)
            else:
                minimum = f.splat(b.extract_element(w.offset16(s, sl, scale16), fi), vec(F32, 16))
                value = b.fadd(b.fmul(u, scale), minimum)
            f.vstore(value, dst, f.mul(sl, SLICE))


# ------------------------------------------------------------------------ rms_norm, quantize


@EMITTERS.implement(tgt.RMSNormOp)
def _rms_norm(lib: KernelLibrary, f: KernelBuilder, op: tgt.RMSNormOp, a: dict) -> None:
    """out[t] = x[t] / rms(x[t]) * w, into float rows or quantized rows; with `groups`, each
    group of the weight's width in a row on its own (float rows)."""
    D = tgt.row_width(op.x) // op.groups
    eps = op.eps.value.data
    x, w = floats(f, a["x"]), floats(f, a["weight"])
    quantized = tgt.is_quantized(op.out)
    q = QRowsAccess(f, a["out"], op.out.type) if quantized else None
    out = None if quantized else floats(f, a["out"])

    def normalize(item: ir.Value) -> None:  # one group of D floats into float rows
        row = f.ptr(x, f.mul(item, D))
        inv = inv_rms(f, row, D, eps)
        f.vec_map(D, [row, w], f.ptr(out, f.mul(item, D)),
                  lambda v: f.fmul(f.fmul(v[0], f.splat(inv, v[0].type)), v[1]), name="k")

    if q is None:
        with f.loop(*f.share(f.mul(a["rows"], op.groups), a["tid"], a["nth"]), name="t") as item:
            normalize(item)
        return
    with f.loop(*f.share(a["rows"], a["tid"], a["nth"]), name="t") as t:
        _norm_quantize_row(f, x, w, D, eps, [q], t)


def _norm_quantize_row(f: KernelBuilder, x: ir.Value, w: ir.Value, D: int, eps: float, qs: list[QRowsAccess],
                       t: ir.Value) -> None:
    """Row t of float rows `x` RMS-normalized with weight `w` into quantized row t of each of `qs`."""
    row = f.ptr(x, f.mul(t, D))
    inv16 = f.splat(inv_rms(f, row, D, eps), vec(F32, 16))
    with f.loop(0, D // ACT_BLOCK, name="b", unroll=False) as blk:
        base = f.mul(blk, ACT_BLOCK)
        v0, v1 = (f.fmul(f.fmul(f.vload(row, f.add(base, o)), inv16), f.vload(w, f.add(base, o))) for o in (0, 16))
        for q in qs:
            q.store_block(t, blk, v0, v1)


@EMITTERS.implement(tgt.QuantizeOp)
def _quantize(lib: KernelLibrary, f: KernelBuilder, op: tgt.QuantizeOp, a: dict) -> None:
    """out = x quantized to int8 per 32 values."""
    D = tgt.row_width(op.x)
    x = floats(f, a["x"])
    q = QRowsAccess(f, a["out"], op.out.type)
    with f.loop(*f.share(a["rows"], a["tid"], a["nth"]), name="t") as t:
        row = f.ptr(x, f.mul(t, D))
        with f.loop(0, D // ACT_BLOCK, name="b", unroll=False) as blk:
            base = f.mul(blk, ACT_BLOCK)
            q.store_block(t, blk, f.vload(row, base), f.vload(row, f.add(base, 16)))


# ------------------------------------------------------------------------ the matmul family


def _projection_rows(f: KernelBuilder, op: tgt.Projection, a: dict, K: int, last_row: bool) -> Rows:
    """The rows a projection's dot products read. With `quantize`, every row of `x` RMS-normalized and
    quantized first, by every thread into its own copy on its stack (the bytes `tgt.rms_norm` writes),
    so no thread waits for another's rows."""
    if op.quantize is None:
        return Rows(f, a["x"], op.x.type, K, a["rows"], a.get("norm"), op.eps, last_row)
    [private] = _private_rows(f, op, a, K, [op.quantize])
    return Rows(f, private.base, op.quantize, K, a["rows"], None, None, last_row)


def _private_rows(f: KernelBuilder, op: tgt.Projection, a: dict, K: int,
                  types: list[tgt.QRowsType]) -> list[QRowsAccess]:
    """Every row of `x` RMS-normalized once and quantized to each of `types` by this thread, into copies on
    its stack."""
    qs = [QRowsAccess(f, f.alloca(I8, t.nbytes, name="private_rows"), t) for t in types]
    with f.loop(0, a["rows"], name="nt") as t:
        _norm_quantize_row(f, floats(f, a["x"]), floats(f, a["norm"]), K, op.eps.value.data, qs, t)
    return qs


def _isa(op: tgt.Projection) -> tgt.Isa | None:
    return op.isa.data if op.isa is not None else None


def _columns_finish(f: KernelBuilder, out: ir.Value, N: int, bias: ir.Value | None, softcap: float | None = None,
                    accumulate: bool = False) -> Finish:
    """The `finish` of a matmul's columns: `out[t, j] (+)= v (+ bias[j])`, soft-capped with `softcap`."""
    def finish(ts: list[ir.Value], js: list[ir.Value], vals: list[list[list[ir.Value]]]) -> None:
        biases = [f.load(bias, j) for j in js] if bias is not None else None
        for ri, t in enumerate(ts):
            for ci, j in enumerate(js):
                v = vals[0][ri][ci]
                if biases is not None:
                    v = f.b.fadd(v, biases[ci])
                if softcap is not None:
                    v = f.softcap(v, softcap)
                idx = f.add(f.mul(t, N), j)
                if accumulate:
                    v = f.b.fadd(f.load(out, idx), v)
                f.store(v, out, idx)

    return finish


@EMITTERS.implement(tgt.MatmulOp)
def _matmul(lib: KernelLibrary, f: KernelBuilder, op: tgt.MatmulOp, a: dict) -> None:
    """out[t, j] (+)= x̂[t] · w[j] (+ bias[j]); `last_row`: only row rows-1, into out row 0."""
    N, K = tgt.dims(op.weight)
    finish = _columns_finish(f, floats(f, a["out"]), N, floats(f, a["bias"]) if "bias" in a else None,
                             llm.optional_value(op, "softcap"), op.accumulate is not None)
    weight = (a["weight"], _weight_type(op.weight))
    if op.screen is not None:  # (int16 `quantize` rows: the same rows in int8 too, for the first products)
        fine, coarse = _private_rows(f, op, a, K, [op.quantize, tgt.QRowsType(op.quantize.rows, op.quantize.width)])
        rows = Rows(f, fine.base, op.quantize, K, a["rows"], None, None, False)
        gemm_screened(f, rows, coarse, N, weight, finish, op.screen.value.data, a["tid"], a["nth"], a["work"],
                      lib.tuning.near_prefetches)
        return
    rows = _projection_rows(f, op, a, K, op.last_row is not None)
    gemm(f, rows, [Part([weight], finish)], a["tid"], a["nth"], a["work"], _isa(op), prefetch=lib.tuning.near_prefetches)


@EMITTERS.implement(tgt.QkvOp)
def _qkv(lib: KernelLibrary, f: KernelBuilder, op: tgt.QkvOp, a: dict) -> None:
    """q, k, v[t, j] = x̂[t] · w[j] (+ bias[j]): the rows normalized and quantized once, the three weights'
    columns dealt as one sequence."""
    K = tgt.row_width(op.x)
    parts = [Part([(a[w], _weight_type(getattr(op, w)))],
                  _columns_finish(f, floats(f, a[o]), tgt.row_width(getattr(op, o)), floats(f, a[b]) if b in a else None))
             for w, o, b in op.OUTPUTS]
    rows = _projection_rows(f, op, a, K, False)
    gemm(f, rows, parts, a["tid"], a["nth"], a["work"], _isa(op), prefetch=lib.tuning.near_prefetches)


@EMITTERS.implement(tgt.SwigluOp)
def _swiglu(lib: KernelLibrary, f: KernelBuilder, op: tgt.SwigluOp, a: dict) -> None:
    """out[t, j] = act(x̂[t]·w_gate[j]) * (x̂[t]·w_up[j]) (act: silu or the op's `activation`), into float
    rows or quantized rows.

    Quantized rows are written a block of 32 columns at a time: the thread computing
    the block keeps it in `block` (row t of a tile in its row t mod `TILE_ROWS`) and quantizes it when it is full.
    """
    N, K = tgt.dims(op.gate)
    rows = _projection_rows(f, op, a, K, False)
    q = QRowsAccess(f, a["out"], op.out.type) if tgt.is_quantized(op.out) else None
    assert TILE_ROWS & (TILE_ROWS - 1) == 0  # (a power of two: `block_row`)
    block = f.alloca(F32, TILE_ROWS * ACT_BLOCK, name="block") if q is not None else None
    out = floats(f, a["out"]) if q is None else None

    def finish(ts: list[ir.Value], js: list[ir.Value], vals: list[list[list[ir.Value]]]) -> None:
        # the tile's values as vectors: one activation of the gates (exp is the costly part), one product, a
        # store per row (the columns js are consecutive)
        b = f.b
        cells = [(ri, ci) for ri in range(len(ts)) for ci in range(len(js))]

        def gathered(w: int) -> ir.Value:
            v = ir.Constant(ir.VectorType(F32, len(cells)), None)
            for i, (ri, ci) in enumerate(cells):
                v = b.insert_element(v, vals[w][ri][ci], ir.Constant(I32, i))
            return v

        y = b.fmul(getattr(f, ACTIVATIONS[activation_of(op)].builder)(gathered(0)), gathered(1))
        width = len(js)
        for ri in range(len(ts)):
            row = b.shuffle_vector(y, ir.Constant(y.type, None),
                                   ir.Constant(ir.VectorType(I32, width), list(range(ri * width, (ri + 1) * width))))
            if block is not None:
                f.vstore(row, block, f.add(block_row(ts[ri]), b.srem(js[0], f.i64(ACT_BLOCK))))
            else:
                f.vstore(row, out, f.add(f.mul(ts[ri], N), js[0]))

    def block_row(t: ir.Value) -> ir.Value:
        """Where row t's values start in `block`."""
        return f.mul(f.b.and_(t, f.i64(TILE_ROWS - 1)), ACT_BLOCK)

    def flush(t: ir.Value, r: int, j0: ir.Value) -> None:
        for ri in range(r):
            row = f.ptr(block, block_row(f.add(t, ri)))
            q.store_block(f.add(t, ri), f.b.sdiv(j0, f.i64(ACT_BLOCK)), f.vload(row, f.i64(0)), f.vload(row, f.i64(16)))

    weights = [(a["gate"], _weight_type(op.gate)), (a["up"], _weight_type(op.up))]
    if q is None:
        gemm(f, rows, [Part(weights, finish)], a["tid"], a["nth"], a["work"], _isa(op),
             prefetch=lib.tuning.near_prefetches)
        return
    gemm(f, rows, [Part(weights, finish, flush)], a["tid"], a["nth"], a["work"], _isa(op), unit=ACT_BLOCK,
         prefetch=lib.tuning.near_prefetches)


# ------------------------------------------------------------------------ mixture of experts


@EMITTERS.implement(tgt.MoeOp)
def _moe(lib: KernelLibrary, f: KernelBuilder, op: tgt.MoeOp, a: dict) -> None:
    """A mixture of experts in three phases, a barrier between them. Only the chosen experts'
    weight rows are read, each dequantized once per call into a row on the stack and dotted
    with the input of every row routed to that expert:

    1. routing, threads sharing the rows: the router's scores, softmax, the `top_k` best
       (the lower index on ties) and their weights (renormalized with `normalize`), into `scratch`;
    2. the gated activations silu(x·gate[e][j]) · (x·up[e][j]), threads sharing the (expert, j)
       pairs, experts interleaved (a decode's few chosen experts spread over the threads);
    3. the output, threads sharing the columns d: Σ over the experts, over their rows, of
       weight · act · down[e][d].
    """
    b = f.b
    E, F, K = op.experts, op.width, op.top_k.value.data
    D = tgt.row_width(op.x)
    S = F + 2  # scratch per (row, choice): F activations, the weight, the expert's index
    x, out, scratch = floats(f, a["x"]), floats(f, a["out"]), floats(f, a["scratch"])
    rows, tid, nth = a["rows"], a["tid"], a["nth"]
    types = {name: _weight_type(getattr(op, name)) for name in ("router", "gate", "up", "down")}
    row_buf, up_buf = f.alloca(F32, max(D, F), name="weight_row"), f.alloca(F32, D, name="up_row")
    scores = f.alloca(F32, E, name="scores")
    acc = f.alloca(F32, name="acc")

    def dot(src: ir.Value, buf: ir.Value, n: int) -> ir.Value:
        """n floats at `src` dotted with a dequantized weight row at `buf`."""
        b.store(f.f32(0.0), acc)
        with f.loop(0, n, name="k") as k:
            b.store(f.fadd(b.load(acc), f.fmul(f.load(src, k), f.load(buf, k))), acc)
        return b.load(acc)

    def slot(t: ir.Value, i: int | ir.Value) -> ir.Value:
        return f.mul(f.add(f.mul(t, K), i), S)

    with f.loop(*f.share(rows, tid, nth), name="rt") as t:
        xrow = f.ptr(x, f.mul(t, D))
        top = f.alloca(F32, name="top")
        b.store(f.f32(float("-inf")), top)
        with f.loop(0, E, name="re") as e:
            _weight_row(f, a["router"], types["router"], e, row_buf)
            score = dot(xrow, row_buf, D)
            f.store(score, scores, e)
            b.store(f.fmax(b.load(top), score), top)
        total = f.alloca(F32, name="total")
        b.store(f.f32(0.0), total)
        with f.loop(0, E, name="se") as e:
            p = f.exp(b.fsub(f.load(scores, e), b.load(top)))
            f.store(p, scores, e)
            b.store(f.fadd(b.load(total), p), total)
        chosen_sum = f.alloca(F32, name="chosen")
        b.store(f.f32(0.0), chosen_sum)
        best = f.alloca(I64, name="best")
        for i in range(K):  # the best remaining expert, then marked taken (-1: below every probability)
            b.store(f.i64(0), best)
            with f.loop(1, E, name=f"pick{i}") as e:
                better = b.fcmp_ordered(">", f.load(scores, e), f.load(scores, b.load(best)))
                b.store(b.select(better, e, b.load(best)), best)
            chosen = b.load(best)
            p = b.fdiv(f.load(scores, chosen), b.load(total))
            f.store(p, scratch, f.add(slot(t, i), F))
            f.store(b.sitofp(chosen, F32), scratch, f.add(slot(t, i), F + 1))
            b.store(f.fadd(b.load(chosen_sum), p), chosen_sum)
            f.store(f.f32(-1.0), scores, chosen)
        if op.normalize is not None:
            for i in range(K):
                at = f.add(slot(t, i), F)
                f.store(b.fdiv(f.load(scratch, at), b.load(chosen_sum)), scratch, at)
    lib.wait(f.b, a["sync"], nth)

    def expert(t: ir.Value, i: int) -> ir.Value:
        return b.fptosi(f.load(scratch, f.add(slot(t, i), F + 1)), I64)

    routed = f.alloca(I64, E, name="routed")  # per expert: whether any row chose it (each thread its own copy)
    with f.loop(0, E, name="rz") as e:
        f.store(f.i64(0), routed, e)
    with f.loop(0, rows, name="rf") as t:
        for i in range(K):
            f.store(f.i64(1), routed, expert(t, i))

    def if_routed(e: ir.Value) -> ir.Value:
        return b.icmp_signed("!=", f.load(routed, e), f.i64(0))

    def for_rows_of(e: ir.Value, body: Callable[[ir.Value, int], None]) -> None:
        """body(t, i) for each row t whose choice i is expert `e`."""
        with f.loop(0, rows, name="rt_e") as t:
            for i in range(K):
                with f.when(b.icmp_signed("==", expert(t, i), e)):
                    body(t, i)

    with f.loop(*f.share(E * F, tid, nth), name="ga") as item:
        e, j = b.srem(item, f.i64(E)), b.sdiv(item, f.i64(E))
        with f.when(if_routed(e)):
            row = f.add(f.mul(e, F), j)
            _weight_row(f, a["gate"], types["gate"], row, row_buf)
            _weight_row(f, a["up"], types["up"], row, up_buf)

            def gated(t: ir.Value, i: int) -> None:
                xrow = f.ptr(x, f.mul(t, D))
                g = dot(xrow, row_buf, D)
                f.store(f.fmul(f.silu(g), dot(xrow, up_buf, D)), scratch, f.add(slot(t, i), j))

            for_rows_of(e, gated)
    lib.wait(f.b, a["sync"], nth)

    with f.loop(*f.share(D, tid, nth), name="dn") as d:
        with f.loop(0, rows, name="z") as t:
            f.store(f.f32(0.0), out, f.add(f.mul(t, D), d))
        with f.loop(0, E, name="de") as e:
            with f.when(if_routed(e)):
                _weight_row(f, a["down"], types["down"], f.add(f.mul(e, D), d), row_buf)

                def output(t: ir.Value, i: int) -> None:
                    at = f.add(f.mul(t, D), d)
                    y = dot(f.ptr(scratch, slot(t, i)), row_buf, F)
                    f.store(f.fadd(f.load(out, at), f.fmul(f.load(scratch, f.add(slot(t, i), F)), y)), out, at)

                for_rows_of(e, output)


# ------------------------------------------------------------------------ elementwise


def _elementwise(op_fn: Callable[[KernelBuilder, list[ir.Value]], ir.Value], names: tuple[str, ...]):
    def emit(lib: KernelLibrary, f: KernelBuilder, op: tgt.Kernel, a: dict) -> None:
        W = tgt.row_width(op.out)
        lo, hi = f.share(a["rows"], a["tid"], a["nth"])
        start = f.mul(lo, W)
        f.vec_map(f.mul(f.sub(hi, lo), W), [f.ptr(floats(f, a[n]), start) for n in names],
                  f.ptr(floats(f, a["out"]), start), lambda vals: op_fn(f, vals), name="e")

    return emit


# generic kernels (`tgt.binary`, `tgt.scalar`, `tgt.unary`, `tgt.reduce`): one element at a time
def _binary_kind(f: KernelBuilder, kind: str) -> Callable[[ir.Value, ir.Value], ir.Value]:
    b = f.b
    return {
        "add": lambda x, y: b.fadd(x, y), "sub": lambda x, y: b.fsub(x, y), "mul": lambda x, y: b.fmul(x, y),
        "div": lambda x, y: b.fdiv(x, y), "maximum": lambda x, y: f.intrinsic("llvm.maximum", x, y),
        "minimum": lambda x, y: f.intrinsic("llvm.minimum", x, y),
    }[kind]


def _unary_kind(f: KernelBuilder, kind: str) -> Callable[[ir.Value], ir.Value]:
    b, one = f.b, f.f32(1.0)
    sqrt = lambda x: f.intrinsic("llvm.sqrt", x)  # noqa: E731
    sin_cos = lambda x, i: b.fptrunc(f.sincos(b.fpext(x, ir.DoubleType()))[i], F32)  # noqa: E731
    return {
        "neg": b.fneg, "abs": lambda x: f.intrinsic("llvm.fabs", x), "sqrt": sqrt,
        "rsqrt": lambda x: b.fdiv(one, sqrt(x)), "reciprocal": lambda x: b.fdiv(one, x), "exp": f.exp,
        "tanh": f.tanh, "sigmoid": lambda x: b.fdiv(one, b.fadd(one, f.exp(b.fneg(x)))),
        "relu": lambda x: f.intrinsic("llvm.maximum", x, f.f32(0.0)), "sin": lambda x: sin_cos(x, 0),
        "cos": lambda x: sin_cos(x, 1),
    }[kind]


def _power(f: KernelBuilder, x: ir.Value, exponent: float) -> ir.Value:
    """x ** exponent for the exponents `lower` gives `tgt.scalar "pow"` (POWERS)."""
    b = f.b
    results = {2.0: lambda: b.fmul(x, x), 3.0: lambda: b.fmul(x, b.fmul(x, x)), 1.0: lambda: x,
               0.5: lambda: f.intrinsic("llvm.sqrt", x), -1.0: lambda: b.fdiv(f.f32(1.0), x),
               -0.5: lambda: b.fdiv(f.f32(1.0), f.intrinsic("llvm.sqrt", x))}
    return results[exponent]()


def _element(f: KernelBuilder, op: tgt.Kernel, a: dict, name: str, t: ir.Value, c: ir.Value) -> ir.Value:
    """Element (row t, column c) of a generic kernel's input: a row's, a row's single value, or a column's."""
    value = getattr(op, name)
    base = floats(f, a[name])
    if isinstance(value.type, tgt.WeightType):
        return f.load(base, c)
    width = tgt.dims(value)[1]
    return f.load(base, t if width == 1 else f.add(f.mul(t, width), c))


def _each_element(f: KernelBuilder, op: tgt.Kernel, a: dict, compute: Callable[[ir.Value, ir.Value], ir.Value]) -> None:
    W = tgt.row_width(op.out)
    out = floats(f, a["out"])
    with f.loop(*f.share(a["rows"], a["tid"], a["nth"]), name="t") as t:
        with f.loop(0, W, name="c", unroll=False) as c:
            f.store(compute(t, c), out, f.add(f.mul(t, W), c))


@EMITTERS.implement(tgt.BinaryOp)
def _binary(lib: KernelLibrary, f: KernelBuilder, op: tgt.BinaryOp, a: dict) -> None:
    fn = _binary_kind(f, op.kind.data)
    _each_element(f, op, a, lambda t, c: fn(_element(f, op, a, "lhs", t, c), _element(f, op, a, "rhs", t, c)))


@EMITTERS.implement(tgt.ScalarOp)
def _scalar(lib: KernelLibrary, f: KernelBuilder, op: tgt.ScalarOp, a: dict) -> None:
    value = op.value.value.data
    if op.kind.data == "pow":
        _each_element(f, op, a, lambda t, c: _power(f, _element(f, op, a, "x", t, c), value))
        return
    fn, s = _binary_kind(f, op.kind.data), f.f32(value)
    swap = op.reversed is not None
    _each_element(f, op, a, lambda t, c: fn(s, _element(f, op, a, "x", t, c)) if swap
                  else fn(_element(f, op, a, "x", t, c), s))


@EMITTERS.implement(tgt.UnaryOp)
def _unary(lib: KernelLibrary, f: KernelBuilder, op: tgt.UnaryOp, a: dict) -> None:
    fn = _unary_kind(f, op.kind.data)
    _each_element(f, op, a, lambda t, c: fn(_element(f, op, a, "x", t, c)))


@EMITTERS.implement(tgt.ReduceOp)
def _reduce(lib: KernelLibrary, f: KernelBuilder, op: tgt.ReduceOp, a: dict) -> None:
    W, kind, b = tgt.row_width(op.x), op.kind.data, f.b
    x, out = floats(f, a["x"]), floats(f, a["out"])
    with f.loop(*f.share(a["rows"], a["tid"], a["nth"]), name="t") as t:
        row = f.ptr(x, f.mul(t, W))
        if kind == "max":
            acc = f.alloca(F32, name="m")
            b.store(f.load(row, 0), acc)
            with f.loop(1, W, name="c", unroll=False) as c:
                b.store(f.intrinsic("llvm.maximum", b.load(acc), f.load(row, c)), acc)
            result = b.load(acc)
        else:
            result = f.reduce_sum(W, lambda c: f.load(row, c), name="c")
            if kind == "mean":
                result = b.fmul(result, f.f32(1.0 / W))
        f.store(result, out, t)


@EMITTERS.implement(*tgt.ACTIVATION_KERNELS.values())
def _activation(lib: KernelLibrary, f: KernelBuilder, op: tgt.Kernel, a: dict) -> None:
    """`out = act(x)` for an activation kernel (`tgt.silu`, `tgt.gelu_tanh`): its builder method, vectorised."""
    builder = ACTIVATIONS[op.ACTIVATION].builder  # type: ignore[attr-defined]
    _elementwise(lambda f, v: getattr(f, builder)(v[0]), ("x",))(lib, f, op, a)


EMITTERS.implement(tgt.AddOp)(_elementwise(lambda f, v: f.b.fadd(v[0], v[1]), ("lhs", "rhs")))
EMITTERS.implement(tgt.MulOp)(_elementwise(lambda f, v: f.b.fmul(v[0], v[1]), ("lhs", "rhs")))
EMITTERS.implement(tgt.RopeOp)(attention.rope)
EMITTERS.implement(tgt.AttentionOp)(attention.attention)

