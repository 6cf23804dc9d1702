"""CPU kernel emitters: one LLVM function per distinct `tgt` kernel op, from its definition.

`KernelLibrary.kernel(op)` emits (once per distinct operand types and properties) the
function that carries out `op`. Its arguments are the op's operands in definition
order (`tgt.Kernel.abi`): every buffer is an `i8*` (float rows, quantized rows, a
weight), every index an `i64`; kernels that split their work among threads
(`THREADED`) also take `i64 tid, i64 nth`. Shapes, storage types, layouts, eps and
theta are baked in as constants; only the row count `rows` and the rows' `positions`
arrive at run time.

    module = ir.Module("kernels")
    lib = KernelLibrary(module)
    fn = lib.kernel(matmul_op)   # void @matmul_q4_1_a8_k576_n576(i8* x, i8* weight, i8* out, i64 rows, i64 tid, i64 nth)

The matmul family (matmul, swiglu, the LM head) runs on `gemm`'s loop nests, whose
inner loop follows the weight format and whether the rows are float or quantized.
Kernels that write quantized rows (RMSNorm, SwiGLU, attention, quantize) quantize each
32-value block as soon as it is computed (`quant.QRowsAccess.store_block`). exp is
inline (Cephes polynomial), so silu and softmax vectorise and need no libm; RoPE calls
libm's cos/sin once per (position, frequency).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from llvmlite import ir
from xdsl.dialects.builtin import MemRefType

from llmc.backends.cpu.builder import F32, F64, FPTR, I32, I64, VOID, KernelBuilder, _chunks
from llmc.backends.cpu.gemm import TILE_ROWS, Rows, floats, gemm, inv_rms, load_weight, weight_ptr
from llmc.backends.cpu.quant import (
    I8PTR,
    QRowsAccess,
    SplitWeight,
    vec,
)
from llmc.ir import tgt
from llmc.ir.formats import ACT_BLOCK, GROUP
from llmc.ir.interpreter import rope_inv_freq
from llmc.ir.layouts import Layout


def _fmt(value: float) -> str:
    """A float as an identifier fragment: distinct floats give distinct text."""
    text = repr(float(value))
    if text.endswith(".0"):
        text = text[:-2]
    return text.replace("-", "m").replace("+", "").replace(".", "p")


def kernel_key(op: tgt.Kernel) -> tuple:
    """What makes two kernel ops the same function: op, operand roles and types (row buffers
    without their number of rows), properties."""
    operands = tuple((name, tgt.per_row(value.type) if name in op.ROWS else str(value.type))
                     for name, value in op.abi())
    props = tuple(sorted((k, str(v)) for k, v in op.properties.items() if k != "operandSegmentSizes"))
    return (op.name, operands, props)


def kernel_name(op: tgt.Kernel) -> str:
    """A readable function name: the op, then the storage and mode of a matmul, then shapes."""
    base = op.name.removeprefix("tgt.")
    parts = [base]
    weights = [v.type for _, v in op.abi() if isinstance(v.type, tgt.WeightType) and len(v.type.shape) == 2]
    if weights:
        parts.append(weights[0].storage.value)
    if isinstance(op, (tgt.MatmulOp, tgt.SwigluOp)):
        parts.append("a8" if tgt.is_quantized(op.x) else "a32")
        n, k = tgt.dims(op.weight if isinstance(op, tgt.MatmulOp) else op.gate)
        parts.append(f"k{k}_n{n}")
        flags = {"bias": "bias", "norm": "norm", "accumulate": "acc", "last_row": "last"}
        parts += [short for name, short in flags.items() if getattr(op, name, None) is not None]
    if "out" in dict(op.abi()) and tgt.is_quantized(op.out):
        parts.append("q8")
    return "_".join(parts)


class KernelLibrary:
    """Emits kernels into `module`, once per distinct kernel (`kernel_key`).

    `linkage` is that of every emitted function: "" (external, callable through
    ctypes from the shared library) or "internal" (callable only from functions of the
    same module, which lets LLVM drop unused ones).
    """

    def __init__(self, module: ir.Module, *, linkage: str = ""):
        self.module = module
        self.linkage = linkage
        self._cache: dict[tuple, ir.Function] = {}

    def kernel(self, op: tgt.Kernel) -> ir.Function:
        """The function of `op`, emitted on first request."""
        key = kernel_key(op)
        if key in self._cache:
            return self._cache[key]
        emitter = _EMITTERS.get(type(op))
        if emitter is None:
            raise NotImplementedError(f"cpu: no kernel emitter for {op.name}")
        params = [(name, I64 if not isinstance(v.type, (MemRefType, tgt.QRowsType, tgt.WeightType)) else I8PTR)
                  for name, v in op.abi()]
        if op.THREADED:
            params += [("tid", I64), ("nth", I64)]
        fn, f = self._new(key, kernel_name(op), params)
        emitter(self, f, op, dict(zip((p for p, _ in params), fn.args)))
        f.finish()
        return fn

    def functions(self) -> list[ir.Function]:
        """Every kernel emitted so far, in emission order."""
        return list(self._cache.values())

    def _new(self, key: tuple, name: str, args: Sequence[tuple[str, ir.Type]]) -> tuple[ir.Function, KernelBuilder]:
        if name in self.module.globals:
            name = self.module.get_unique_name(name)
        fn = ir.Function(self.module, ir.FunctionType(VOID, [t for _, t in args]), name=name)
        fn.linkage = self.linkage
        fn.attributes.add("nounwind")
        for arg, (arg_name, ty) in zip(fn.args, args):
            arg.name = arg_name
            if isinstance(ty, ir.PointerType):
                arg.add_attribute("noalias")
        self._cache[key] = fn
        return fn, KernelBuilder(self.module, fn)

    def inv_freq_table(self, D: int, theta: float) -> ir.Value:
        name = f"rope_inv_freq_d{D}_theta{_fmt(theta)}"
        if name not in self.module.globals:
            values = rope_inv_freq(D, theta)
            ty = ir.ArrayType(F32, len(values))
            g = ir.GlobalVariable(self.module, ty, name=name)
            g.initializer = ir.Constant(ty, [float(v) for v in values])
            g.global_constant = True
            g.linkage = "internal"
        return self.module.globals[name]


def _weight_type(value) -> tgt.WeightType:
    t = value.type
    assert isinstance(t, tgt.WeightType)
    return t


# ------------------------------------------------------------------------ embedding


def _embedding(lib: KernelLibrary, f: KernelBuilder, op: tgt.EmbeddingOp, a: dict) -> None:
    """out[t] = table[tokens[t]], dequantizing the row."""
    table_type = _weight_type(op.table)
    D = table_type.shape[1]
    tokens = f.b.bitcast(a["tokens"], I32.as_pointer())
    out = floats(f, a["out"])
    with f.loop(0, a["rows"], name="t") as t:
        tok = f.b.sext(f.load(tokens, t), I64)
        dst = f.ptr(out, f.mul(t, D))
        if table_type.layout is Layout.SPLIT:
            w = SplitWeight(f, a["table"], table_type)
            full, half = D // GROUP, D % GROUP // 16
            with f.loop(0, full, name="g", unroll=False) as g:
                for s, v in enumerate(w.values(tok, g)):
                    f.vstore(v, dst, f.add(f.mul(g, GROUP), 16 * s))
            if half:
                for s, v in enumerate(w.values(tok, f.i64(full), slices=half)):
                    f.vstore(v, dst, f.i64(full * GROUP + 16 * s))
        else:
            src_base = weight_ptr(f, a["table"], table_type.storage)
            src = f.mul(tok, D)
            with f.loop(0, D, name="d") as d:
                f.store(load_weight(f, src_base, f.add(src, d), table_type.storage), dst, d)


# ------------------------------------------------------------------------ rms_norm, quantize


def _rms_norm(lib: KernelLibrary, f: KernelBuilder, op: tgt.RMSNormOp, a: dict) -> None:
    """out[t] = x[t] / rms(x[t]) * w, into float rows or quantized rows."""
    D = tgt.row_width(op.x)
    eps = op.eps.value.data
    x, w = floats(f, a["x"]), floats(f, a["weight"])
    quantized = tgt.is_quantized(op.out)
    q = QRowsAccess(f, a["out"], op.out.type) if quantized else None
    out = None if quantized else floats(f, a["out"])
    with f.loop(0, a["rows"], name="t") as t:
        row = f.ptr(x, f.mul(t, D))
        inv = inv_rms(f, row, D, eps)
        if q is None:
            dst = f.ptr(out, f.mul(t, D))
            f.vec_map(D, [row, w], dst, lambda v: f.fmul(f.fmul(v[0], f.splat(inv, v[0].type)), v[1]), name="k")
        else:
            inv16 = f.splat(inv, vec(F32, 16))
            with f.loop(0, D // ACT_BLOCK, name="b", unroll=False) as blk:
                base = f.mul(blk, ACT_BLOCK)
                v0, v1 = (f.fmul(f.fmul(f.vload(row, f.add(base, o)), inv16), f.vload(w, f.add(base, o)))
                          for o in (0, 16))
                q.store_block(t, blk, v0, v1)


def _quantize(lib: KernelLibrary, f: KernelBuilder, op: tgt.QuantizeOp, a: dict) -> None:
    """out = x quantized to int8 per 32 values."""
    D = tgt.row_width(op.x)
    x = floats(f, a["x"])
    q = QRowsAccess(f, a["out"], op.out.type)
    with f.loop(0, a["rows"], name="t") as t:
        row = f.ptr(x, f.mul(t, D))
        with f.loop(0, D // ACT_BLOCK, name="b", unroll=False) as blk:
            base = f.mul(blk, ACT_BLOCK)
            q.store_block(t, blk, f.vload(row, base), f.vload(row, f.add(base, 16)))


# ------------------------------------------------------------------------ the matmul family

def _matmul(lib: KernelLibrary, f: KernelBuilder, op: tgt.MatmulOp, a: dict) -> None:
    """out[t, j] (+)= x̂[t] · w[j] (+ bias[j]); `last_row`: only row rows-1, into out row 0."""
    N, K = tgt.dims(op.weight)
    rows = Rows(f, a["x"], op.x, K, a["rows"], a.get("norm"), op.eps, op.last_row is not None)
    out = floats(f, a["out"])
    bias = floats(f, a["bias"]) if "bias" in a else None
    accumulate = op.accumulate is not None

    def finish(ts: list[ir.Value], js: list[ir.Value], vals: list[list[list[ir.Value]]]) -> None:
        biases = [f.load(bias, j) for j in js] if bias is not None else None
        for ri, t in enumerate(ts):
            for ci, j in enumerate(js):
                v = vals[0][ri][ci]
                if biases is not None:
                    v = f.b.fadd(v, biases[ci])
                idx = f.add(f.mul(t, N), j)
                if accumulate:
                    v = f.b.fadd(f.load(out, idx), v)
                f.store(v, out, idx)

    isa = op.isa.data if op.isa is not None else None
    gemm(f, rows, N, [(a["weight"], _weight_type(op.weight))], finish, a["tid"], a["nth"], isa)


def _swiglu(lib: KernelLibrary, f: KernelBuilder, op: tgt.SwigluOp, a: dict) -> None:
    """out[t, j] = silu(x̂[t]·w_gate[j]) * (x̂[t]·w_up[j]), into float rows or quantized rows.

    Quantized rows are written a block of 32 columns at a time: the thread computing
    the block keeps it in `block` (one tile of rows) and quantizes it when it is full.
    """
    N, K = tgt.dims(op.gate)
    rows = Rows(f, a["x"], op.x, K, a["rows"], a.get("norm"), op.eps, False)
    q = QRowsAccess(f, a["out"], op.out.type) if tgt.is_quantized(op.out) else None
    block = f.alloca(F32, TILE_ROWS * ACT_BLOCK, name="block") if q is not None else None
    out = floats(f, a["out"]) if q is None else None

    def finish(ts: list[ir.Value], js: list[ir.Value], vals: list[list[list[ir.Value]]]) -> None:
        # the tile's gate values go through one vector silu (exp is the costly part)
        b = f.b
        cells = [(ri, ci) for ri in range(len(ts)) for ci in range(len(js))]
        g = ir.Constant(ir.VectorType(F32, len(cells)), None)
        for i, (ri, ci) in enumerate(cells):
            g = b.insert_element(g, vals[0][ri][ci], ir.Constant(I32, i))
        act = f.silu(g)
        for i, (ri, ci) in enumerate(cells):
            y = b.fmul(b.extract_element(act, ir.Constant(I32, i)), vals[1][ri][ci])
            if block is not None:
                f.store(y, block, f.add(f.i64(ri * ACT_BLOCK), b.srem(js[ci], f.i64(ACT_BLOCK))))
            else:
                f.store(y, out, f.add(f.mul(ts[ri], N), js[ci]))

    def flush(t: ir.Value, r: int, j0: ir.Value) -> None:
        for ri in range(r):
            row = f.ptr(block, ri * ACT_BLOCK)
            q.store_block(f.add(t, ri), f.b.sdiv(j0, f.i64(ACT_BLOCK)), f.vload(row, f.i64(0)), f.vload(row, f.i64(16)))

    weights = [(a["gate"], _weight_type(op.gate)), (a["up"], _weight_type(op.up))]
    isa = op.isa.data if op.isa is not None else None
    if q is None:
        gemm(f, rows, N, weights, finish, a["tid"], a["nth"], isa)
        return
    gemm(f, rows, N, weights, finish, a["tid"], a["nth"], isa, unit=ACT_BLOCK, flush=flush)


# ------------------------------------------------------------------------ rope, attention


def _rope_tables(lib: KernelLibrary, f: KernelBuilder, D: int, theta: float
                 ) -> tuple[ir.Value, ir.Value, Callable[[ir.Value], None]]:
    """Stack tables cos/sin[D/2] and a function that fills them for a position."""
    half = D // 2
    cos_t = f.alloca(F32, half, name="rope_cos")
    sin_t = f.alloca(F32, half, name="rope_sin")
    table = lib.inv_freq_table(D, theta)

    def fill(pos: ir.Value) -> None:
        b = f.b
        p = b.sitofp(pos, F32)
        freqs = b.bitcast(table, FPTR)
        with f.loop(0, half, name="ri", unroll=False) as i:
            angle = b.fpext(b.fmul(p, f.load(freqs, i)), F64)  # f32 product, as numpy
            f.store(b.fptrunc(f.intrinsic("llvm.cos", angle), F32), cos_t, i)
            f.store(b.fptrunc(f.intrinsic("llvm.sin", angle), F32), sin_t, i)

    return cos_t, sin_t, fill


def _rope_apply(f: KernelBuilder, base: ir.Value, heads: int | ir.Value, D: int, cos_t: ir.Value,
                sin_t: ir.Value) -> None:
    """Rotate-half RoPE of `heads` rows of D floats at `base`, with filled tables."""
    b, half = f.b, D // 2
    with f.loop(0, heads, name="rh", unroll=False) as h:
        row = f.ptr(base, f.mul(h, D))
        with f.loop(0, half, name="rd", unroll=False) as i:
            i2 = f.add(i, half)
            x1, x2 = f.load(row, i), f.load(row, i2)
            c, s = f.load(cos_t, i), f.load(sin_t, i)
            f.store(b.fsub(b.fmul(x1, c), b.fmul(x2, s)), row, i)
            f.store(b.fadd(b.fmul(x2, c), b.fmul(x1, s)), row, i2)


def _position(f: KernelBuilder, positions: ir.Value, t: ir.Value) -> ir.Value:
    """Row `t`'s position, as an i64."""
    return f.b.sext(f.load(f.b.bitcast(positions, I32.as_pointer()), t), I64)


def _rope(lib: KernelLibrary, f: KernelBuilder, op: tgt.RopeOp, a: dict) -> None:
    """Rotate-half RoPE in place on x [rows, H, D], row t at positions[t]."""
    _, H, D = tgt.dims(op.x)
    x = floats(f, a["x"])
    cos_t, sin_t, fill = _rope_tables(lib, f, D, op.theta.value.data)
    with f.loop(0, a["rows"], name="t") as t:
        fill(_position(f, a["positions"], t))
        _rope_apply(f, f.ptr(x, f.mul(t, H * D)), H, D, cos_t, sin_t)


def _exp_store(f: KernelBuilder, row: ir.Value, s: ir.Value, m: ir.Value) -> ir.Value:
    e = f.exp(f.b.fsub(f.load(row, s), m))
    f.store(e, row, s)
    return e


def _attention(lib: KernelLibrary, f: KernelBuilder, op: tgt.AttentionOp, a: dict) -> None:
    """q [n, H, D], k and v [n, KVH, D]; the layer's caches [KVH, S, D]. With `rope`, q and k
    are rotated in place first. Row t of k, v goes to cache position positions[t], then
    each query row t attends causally to positions 0..positions[t] (GQA: query head h
    reads kv head h / (H/KVH)); out [n, H·D], float or quantized. Rows whose position is
    outside the cache are skipped. Thread `tid` of `nth` handles its share of the kv
    heads, with their query heads."""
    _, H, D = tgt.dims(op.q)
    KVH, S, _ = tgt.dims(op.k_cache)
    q, k, v, k_cache, v_cache = (floats(f, a[name]) for name in ("q", "k", "v", "k_cache", "v_cache"))
    n, tid, nth = a["rows"], a["tid"], a["nth"]
    quantized = tgt.is_quantized(op.out)
    qout = QRowsAccess(f, a["out"], op.out.type) if quantized else None
    out = None if quantized else floats(f, a["out"])
    b = f.b
    G = H // KVH
    h_lo, h_hi = f.share(KVH, tid, nth)  # this thread's kv heads

    def inside(t: ir.Value) -> ir.Value:
        """Whether row t's position is inside the cache (the row is skipped otherwise)."""
        pos = _position(f, a["positions"], t)
        return b.and_(b.icmp_signed(">=", pos, f.i64(0)), b.icmp_signed("<", pos, f.i64(S)))

    # 1. RoPE and the cache write
    if op.rope is not None:
        cos_t, sin_t, fill = _rope_tables(lib, f, D, op.rope.value.data)
    with f.loop(0, n, name="t") as t, f.when(inside(t)):
        pos = _position(f, a["positions"], t)
        if op.rope is not None:
            fill(pos)
            own = f.sub(h_hi, h_lo)
            _rope_apply(f, f.ptr(q, f.add(f.mul(t, H * D), f.mul(h_lo, G * D))), f.mul(own, G), D, cos_t, sin_t)
            _rope_apply(f, f.ptr(k, f.add(f.mul(t, KVH * D), f.mul(h_lo, D))), own, D, cos_t, sin_t)
        with f.loop(h_lo, h_hi, name="ch", unroll=False) as h:
            src = f.mul(f.add(f.mul(t, KVH), h), D)
            dst = f.mul(f.add(f.mul(h, S), pos), D)
            with f.loop(0, D, name="cd", unroll=False) as d:
                f.store(f.load(k, f.add(src, d)), k_cache, f.add(dst, d))
                f.store(f.load(v, f.add(src, d)), v_cache, f.add(dst, d))

    # 2. causal GQA: the G query heads of one kv head share each K/V row. Rows of D
    # are handled as explicit vector chunks (q and the output accumulators stay in
    # registers across the position loop; LLVM only has to vectorise softmax).
    chunks = _chunks(D)
    scores = f.alloca(F32, G * S, name="scores")
    accs = [[f.alloca(ir.VectorType(F32, w), name=f"acc{g}_{o}") for o, w in chunks] for g in range(G)]
    inv_sum = f.alloca(F32, G, name="inv_sum")
    mx = f.alloca(F32, name="max")
    scale = f.f32(1.0 / np.sqrt(np.float32(D)))
    with f.loop(0, n, name="t") as t, f.when(inside(t)):
        span = f.add(_position(f, a["positions"], t), 1)
        with f.loop(h_lo, h_hi, name="h") as h:
            kv_base = f.mul(h, S * D)
            kbase = f.ptr(k_cache, kv_base)
            vbase = f.ptr(v_cache, kv_base)
            row_offs = [f.mul(f.add(f.mul(t, H), f.add(f.mul(h, G), g)), D) for g in range(G)]
            qv = [[f.vload(q, f.add(off, o), w) for o, w in chunks] for off in row_offs]
            # scores[g, s] = q_g · k_s / sqrt(D)
            with f.loop(0, span, name="s") as s:
                krow = f.mul(s, D)
                kv = [f.vload(kbase, f.add(krow, o), w) for o, w in chunks]
                for g in range(G):
                    dot = f.vdot(qv[g], kv)
                    f.store(b.fmul(dot, scale), scores, f.add(s, g * S))
            # softmax per query head (max-subtracted), then the weighted sum of V rows
            # (one copy of the softmax code, looping over the G heads at run time)
            with f.loop(0, G, name="sg", unroll=False) as g:
                srow = f.ptr(scores, f.mul(g, S))
                b.store(f.f32(float("-inf")), mx)
                with f.loop(0, span, name="m") as s:
                    b.store(f.intrinsic("llvm.maxnum", b.load(mx), f.load(srow, s)), mx)
                m = b.load(mx)
                total = f.reduce_sum(span, lambda s: _exp_store(f, srow, s, m), name="e")
                f.store(b.fdiv(f.f32(1.0), total), inv_sum, g)
            inv_sums = [f.load(inv_sum, g) for g in range(G)]
            for g in range(G):
                for acc, (_, w) in zip(accs[g], chunks):
                    b.store(f.const(ir.VectorType(F32, w), 0.0), acc)
            with f.loop(0, span, name="pv") as s:
                vrow = f.mul(s, D)
                vv = [f.vload(vbase, f.add(vrow, o), w) for o, w in chunks]
                for g in range(G):
                    p = f.load(scores, f.add(s, g * S))
                    for acc, x in zip(accs[g], vv):
                        b.store(f.fadd(b.load(acc), f.fmul(f.splat(p, x.type), x)), acc)
            for g in range(G):
                ys = [f.fmul(b.load(acc), f.splat(inv_sums[g], acc.type.pointee)) for acc in accs[g]]
                if qout is None:
                    for y, (o, _) in zip(ys, chunks):
                        f.vstore(y, out, f.add(row_offs[g], o))
                    continue
                first_block = f.b.sdiv(row_offs[g], f.i64(ACT_BLOCK))
                head = f.sub(first_block, f.mul(t, H * D // ACT_BLOCK))
                for blk in range(D // ACT_BLOCK):
                    qout.store_block(t, f.add(head, blk), ys[2 * blk], ys[2 * blk + 1])


# ------------------------------------------------------------------------ elementwise


def _elementwise(op_fn: Callable[[KernelBuilder, list[ir.Value]], ir.Value], names: tuple[str, ...]):
    def emit(lib: KernelLibrary, f: KernelBuilder, op: tgt.Kernel, a: dict) -> None:
        W = tgt.row_width(op.out)
        f.vec_map(f.mul(a["rows"], W), [floats(f, a[n]) for n in names], floats(f, a["out"]),
                  lambda vals: op_fn(f, vals), name="e")

    return emit


_EMITTERS: dict[type[tgt.Kernel], Callable] = {
    tgt.EmbeddingOp: _embedding,
    tgt.RMSNormOp: _rms_norm,
    tgt.QuantizeOp: _quantize,
    tgt.MatmulOp: _matmul,
    tgt.SwigluOp: _swiglu,
    tgt.RopeOp: _rope,
    tgt.AttentionOp: _attention,
    tgt.AddOp: _elementwise(lambda f, v: f.b.fadd(v[0], v[1]), ("lhs", "rhs")),
    tgt.MulOp: _elementwise(lambda f, v: f.b.fmul(v[0], v[1]), ("lhs", "rhs")),
    tgt.SiluOp: _elementwise(lambda f, v: f.silu(v[0]), ("x",)),
}

