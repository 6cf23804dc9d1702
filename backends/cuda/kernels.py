"""CUDA kernel emitters: each `tgt` kernel op → one or more GPU kernels and their launch geometry.

`KernelLibrary(module, device).launches(op)` emits (once per distinct op and row
class) the kernels that carry out `op` and returns how to launch them, in order. Every
kernel of an op takes the op's operands in definition order (`tgt.Kernel.abi`):
buffers as `i8*`, indices as `i64`, so the launch plan's arguments come from the op
definition. A grid dimension is a number or `PerRows(r)`: `ceil(rows / r)` blocks,
decided at launch from the entry point's `n`.

| op | kernels | grid (x, y, z) | a thread block does |
|---|---|---|---|
| matmul, swiglu | GEMV | (N / 4, rows / R) | 4 warps, one output feature each, for R rows; lanes stride K 16 bytes of codes at a time, dequantize in registers, sum by warp shuffles; fused RMSNorm, bias, residual add, SwiGLU |
| matmul, swiglu with `isa mma_f16` | `_mma` | (N / 64, rows / 32) | f16 tiles of x and the dequantized weights in shared memory, `mma.sync.m16n8k16` per warp, the same epilogues |
| attention | `_store`, `_attend`, (`_merge`) | (1, rows); prefill (heads, rows / 4); decode (heads, rows, S) | RoPE in place and the cache write; an online softmax over cache positions, lanes over the head dimension: in prefill a warp per query row, in decode 4 warps and S blocks per row splitting the positions, merged (flash-decoding) |
| (greedy decoding) | `llmc_argmax` | (1, 1, 1) | the first index of the largest logit |
| embedding, rms_norm, add, mul, silu, rope | one each | (W / 128, rows) or (1, rows) | one row's elements |

Shapes, formats and constants are baked in; only `rows` and `positions` arrive at run time.

    lib = KernelLibrary(module, Ptx())
    lib.launches(op)   # [Launch("matmul_q4_1_a32_k576_n576_r1", (144, PerRows(1), 1), 128)]
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from llvmlite import ir
from xdsl.dialects.builtin import MemRefType

from llmc.backends.builder import F32, F64, FPTR, I32, I64, KernelBuilder, f32_table
from llmc.backends.cuda.device import WARP, Emulated, Ptx
from llmc.backends.cuda.weights import F16, I8, I8PTR, WeightRows, load_f16, typed
from llmc.backends.kernel_names import kernel_key, kernel_name, rope_table
from llmc.errors import LlmcError
from llmc.ir import llm, tgt

THREADS = 128  # threads of every block
WARPS = THREADS // WARP
ROW_TILE = 8  # rows a GEMV block computes at once in prefill: each weight dequantized once for them
SPLITS = 32  # decode attention: blocks per head over the cache positions (≤ tgt.MAX_THREADS partials)
NO_SCORE = -1e30  # the running maximum before any position (finite: no inf − inf)


@dataclass(frozen=True)
class PerRows:
    """A grid dimension of `ceil(rows / per)` blocks."""

    per: int


Dim = int | PerRows


@dataclass(frozen=True)
class Launch:
    """One kernel launch of an op: the kernel's name, its grid and its block of `block` threads."""

    kernel: str
    grid: tuple[Dim, Dim, Dim]
    block: int = THREADS


def _max_rows(op: tgt.Kernel) -> int:
    """The rows of the op's row buffers in this entry point (1 in decode)."""
    for name, value in op.abi():
        if name in op.ROWS:
            return tgt.dims(value)[0]
    return 1


class KernelLibrary:
    """Emits CUDA kernels into `module` for `device` (`Ptx` or `Emulated`), once per distinct op."""

    def __init__(self, module: ir.Module, device: Ptx | Emulated):
        self.module = module
        self.device = device
        self._cache: dict[tuple, list[Launch]] = {}
        self.kernels: dict[str, ir.Function] = {}

    def launches(self, op: tgt.Kernel) -> list[Launch]:
        rows = _max_rows(op)
        key = (kernel_key(op), rows)
        if key not in self._cache:
            emitter = _EMITTERS.get(type(op))
            if emitter is None:
                raise LlmcError(f"cuda: no kernel for {op.name} yet; --target cpu compiles it")
            quantized = [name for name, value in op.abi() if isinstance(value.type, tgt.QRowsType)]
            if quantized:
                raise LlmcError(f"cuda: {op.name} takes quantized rows ({', '.join(quantized)}); CUDA kernels "
                                f"take float rows (a32): compile without --compute a8")
            self._cache[key] = emitter(_Emit(self, op, f"{kernel_name(op)}_r{rows}", rows))
        return self._cache[key]

    def new_kernel(self, name: str, op: tgt.Kernel) -> tuple[KernelBuilder, dict[str, ir.Value]]:
        params = [(n, I64 if not isinstance(v.type, (MemRefType, tgt.QRowsType, tgt.WeightType)) else I8PTR)
                  for n, v in op.abi()]
        base, count = name, 1
        while name in self.kernels:  # same op and rows, other shapes (RoPE of q and of k)
            name, count = f"{base}_v{count}", count + 1
        fn = self.device.kernel(self.module, name, [t for _, t in params], THREADS)
        for arg, (arg_name, _) in zip(fn.args, params):
            arg.name = arg_name
        self.kernels[name] = fn
        return KernelBuilder(self.module, fn), dict(zip((n for n, _ in params), fn.args))


@dataclass
class _Emit:
    lib: KernelLibrary
    op: tgt.Kernel
    name: str
    rows: int

    @property
    def dev(self):
        return self.lib.device

    def kernel(self, suffix: str, body: Callable[[KernelBuilder, dict[str, ir.Value]], None],
               grid: tuple[Dim, Dim, Dim]) -> Launch:
        name = f"{self.name}{suffix}"
        f, args = self.lib.new_kernel(name, self.op)
        body(f, args)
        f.finish()
        return Launch(f.fn.name, grid)


# ---------------------------------------------------------------------- helpers


def _fptr(f: KernelBuilder, p: ir.Value) -> ir.Value:
    return f.b.bitcast(p, FPTR)


def _lt(f: KernelBuilder, a, c) -> ir.Value:
    return f.b.icmp_signed("<", f.i64(a), f.i64(c))


def _strided(f: KernelBuilder, start: ir.Value, stop: int | ir.Value, step: int, name: str):
    return f.loop(start, stop, step, name=name, unroll=False)


def _index(f: KernelBuilder, ids: ir.Value, t: ir.Value) -> ir.Value:
    """Entry `t` of an i32 buffer (tokens, positions) as an i64."""
    return f.b.sext(f.load(f.b.bitcast(ids, I32.as_pointer()), t), I64)


def _inv_rms(f: KernelBuilder, dev, x: ir.Value, width: int, eps: float, start: ir.Value, step: int,
             combine: Callable[[KernelBuilder, ir.Value], ir.Value]) -> ir.Value:
    """`1 / sqrt(mean(x²) + eps)` of the row at `x`, the squares summed by threads `start, start + step, …`."""
    acc = f.alloca(F32, name="ss")
    f.b.store(f.f32(0.0), acc)
    with _strided(f, start, width, step, "n") as k:
        v = f.load(x, k)
        f.b.store(f.fadd(f.b.load(acc), f.fmul(v, v)), acc)
    total = combine(f, f.b.load(acc))
    mean = f.fadd(f.fmul(total, f.f32(1.0 / width)), f.f32(eps))
    return f.b.fdiv(f.f32(1.0), f.intrinsic("llvm.sqrt", mean))


def _elementwise_grid(width: int) -> tuple[Dim, Dim, Dim]:
    return (-(-width // THREADS), PerRows(1), 1)


def _column(f: KernelBuilder, dev) -> ir.Value:
    return f.add(f.mul(dev.ctaid(f, "x"), THREADS), dev.tid(f))


# ---------------------------------------------------------------------- GEMV: matmul, swiglu


def _floats(f: KernelBuilder, base: ir.Value, start: ir.Value, count: int) -> list[ir.Value]:
    """`count` consecutive floats from `base[start]`, in 16-byte vector loads where `count` is a multiple of
    4 (runs of weights start at multiples of 4, rows of float buffers at multiples of 16 bytes)."""
    if count % 4:
        return [f.load(base, f.add(start, i)) for i in range(count)]
    b, out = f.b, []
    for c in range(0, count, 4):
        vector = b.load(b.bitcast(b.gep(base, [f.add(start, c)]), ir.VectorType(F32, 4).as_pointer()), align=16)
        out += [b.extract_element(vector, ir.Constant(I32, i)) for i in range(4)]
    return out


def _matrices(op: tgt.Kernel) -> list:
    """The weight matrices of a matmul (one) or of SwiGLU (gate, up)."""
    return [op.gate, op.up] if isinstance(op, tgt.SwigluOp) else [op.weight]


def _epilogue(f: KernelBuilder, op: tgt.Kernel, a: dict[str, ir.Value], totals: list[ir.Value], dest: ir.Value,
              feature: ir.Value) -> None:
    """Store one output of a matmul (`+ bias`, soft-capped, `+=` with `accumulate`) or of SwiGLU
    (`silu(gate) · up`, or gelu's)."""
    out = _fptr(f, a["out"])
    if isinstance(op, tgt.SwigluOp):
        value = f.fmul(f.gelu_tanh(totals[0]) if op.gelu is not None else f.silu(totals[0]), totals[1])
    else:
        value = totals[0]
        if a.get("bias") is not None:
            value = f.fadd(value, f.load(_fptr(f, a["bias"]), feature))
        if (cap := llm.optional_value(op, "softcap")) is not None:
            value = f.softcap(value, cap)
        if op.accumulate is not None:
            value = f.fadd(value, f.load(out, dest))
    f.store(value, out, dest)


def _gemv(e: _Emit) -> list[Launch]:
    op, dev = e.op, e.dev
    weight_values = _matrices(op)
    n, k = tgt.dims(weight_values[0])
    last = getattr(op, "last_row", None) is not None
    tile = 1 if last else min(ROW_TILE, e.rows)

    def body(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        b = f.b
        x, rows = _fptr(f, a["x"]), a["rows"]
        weights = [WeightRows(f, a[name], v.type) for name, v in op.abi() if v in weight_values]
        tid, lane, warp = dev.lanes(f)
        j = f.add(f.mul(dev.ctaid(f, "x"), WARPS), warp)
        first = f.sub(rows, 1) if last else f.mul(dev.ctaid(f, "y"), tile)
        with f.when(_lt(f, j, n)):  # whole warps: the shuffles below see every lane
            row_of = [f.smin(f.add(first, r), f.sub(rows, 1)) for r in range(tile)]
            xs = [b.gep(x, [f.mul(t, k)]) for t in row_of]
            norm = a.get("norm")
            inv = [None] * tile
            if norm is not None:
                inv = [_inv_rms(f, dev, xr, k, op.eps.value.data, lane, WARP, dev.warp_sum) for xr in xs]
                g = _fptr(f, norm)
            accs = [[f.alloca(F32, name=f"acc{w}_{r}") for r in range(tile)] for w in range(len(weights))]
            for row_accs in accs:
                for acc in row_accs:
                    b.store(f.f32(0.0), acc)
            for w, weight in enumerate(weights):  # each its own pass: gate and up may differ in format
                with _strided(f, lane, weight.wide_units, WARP, f"u{w}") as u:
                    for k0, values in weight.wide_runs(j, u):
                        inside = _lt(f, k0, k) if weight.padded else None  # runs lie wholly in or past K
                        start = b.select(inside, k0, f.i64(0)) if inside is not None else k0
                        scales = _floats(f, g, start, len(values)) if norm is not None else None
                        for r in range(tile):
                            xv = _floats(f, xs[r], start, len(values))
                            if scales is not None:
                                xv = [f.fmul(v, s) for v, s in zip(xv, scales)]
                            total = f.fmul(values[0], xv[0])
                            for value, x_i in zip(values[1:], xv[1:]):
                                total = f.fadd(total, f.fmul(value, x_i))
                            if inside is not None:
                                total = b.select(inside, total, f.f32(0.0))
                            b.store(f.fadd(b.load(accs[w][r]), total), accs[w][r])
            for r in range(tile):
                totals = [dev.warp_sum(f, b.load(accs[w][r])) for w in range(len(weights))]
                if inv[r] is not None:
                    totals = [f.fmul(t, inv[r]) for t in totals]
                with f.when(b.and_(b.icmp_unsigned("==", lane, f.i64(0)), _lt(f, f.add(first, r), rows))):
                    _epilogue(f, op, a, totals, j if last else f.add(f.mul(f.add(first, r), n), j), j)

    grid = (-(-n // WARPS), 1 if last else PerRows(tile), 1)
    return [e.kernel("", body, grid)]


# ---------------------------------------------------------------------- GEMM on tensor cores

MMA_ROWS, MMA_COLS, MMA_K = 32, 64, 64  # a block's tile: rows × output features, K per step
_PAD = MMA_K + 8  # halves per row of a shared-memory tile (a stagger against bank conflicts)


def _gemm_mma(e: _Emit) -> list[Launch]:
    """Prefill matmul / SwiGLU on tensor cores: a block computes 32 rows × 64 features; per 64-wide K step
    the threads stage x (times the norm weight) and the dequantized weights as f16 tiles in shared
    memory, then each warp (2 × 2 of them, 16 rows × 32 features each) runs 4 k16 steps of
    `mma.sync.m16n8k16` (f16 → f32) over its 4 n8 tiles. RMSNorm's 1/rms, bias, residual add and
    SwiGLU are applied to the f32 accumulators."""
    op, dev = e.op, e.dev
    weight_values = _matrices(op)
    n, k = tgt.dims(weight_values[0])
    steps = -(-k // MMA_K)
    h16 = F16.as_pointer()

    def body(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        b = f.b
        x, rows = _fptr(f, a["x"]), a["rows"]
        weights = [WeightRows(f, a[name], v.type) for name, v in op.abi() if v in weight_values]
        tid, lane, warp = dev.lanes(f)
        wm, wn = b.udiv(warp, f.i64(2)), b.urem(warp, f.i64(2))
        group, quad = b.udiv(lane, f.i64(4)), b.urem(lane, f.i64(4))
        n0, t0 = f.mul(dev.ctaid(f, "x"), MMA_COLS), f.mul(dev.ctaid(f, "y"), MMA_ROWS)
        a_s = b.bitcast(dev.shared(f, "a", MMA_ROWS * _PAD // 2), h16)
        b_s = [b.bitcast(dev.shared(f, f"b{i}", MMA_COLS * _PAD // 2), h16) for i in range(len(weights))]
        norm = a.get("norm")
        if norm is not None:
            g = _fptr(f, norm)
            inv_s = dev.shared(f, "inv", MMA_ROWS)
            for r in range(MMA_ROWS // WARPS):
                row = f.add(f.mul(warp, MMA_ROWS // WARPS), r)
                xr = b.gep(x, [f.mul(f.smin(f.add(t0, row), f.sub(rows, 1)), k)])
                inv = _inv_rms(f, dev, xr, k, op.eps.value.data, lane, WARP, dev.warp_sum)
                with f.when(b.icmp_unsigned("==", lane, f.i64(0))):
                    f.store(inv, inv_s, row)
        accs = [[[f.alloca(F32, name=f"c{w}_{j}_{i}") for i in range(4)] for j in range(4)]
                for w in range(len(weights))]
        for per_weight in accs:
            for tile in per_weight:
                for acc in tile:
                    b.store(f.f32(0.0), acc)

        def pair(base: ir.Value, index: ir.Value) -> ir.Value:  # two f16 of a tile as one i32 register
            return b.load(b.bitcast(b.gep(base, [index]), I32.as_pointer()), align=4)

        with _strided(f, f.i64(0), steps, 1, "ks") as step:
            k0 = f.mul(step, MMA_K)
            for i in range(MMA_ROWS * MMA_K // THREADS):  # x (× norm weight) → f16
                idx = f.add(tid, THREADS * i)
                r, c = b.udiv(idx, f.i64(MMA_K)), b.urem(idx, f.i64(MMA_K))
                kk, t = f.add(k0, c), f.add(t0, r)
                inside = b.and_(_lt(f, kk, k), _lt(f, t, rows))
                kk_safe = f.smin(kk, k - 1)
                v = f.load(x, f.add(f.mul(f.smin(t, f.sub(rows, 1)), k), kk_safe))
                if norm is not None:
                    v = f.fmul(v, f.load(g, kk_safe))
                b.store(b.fptrunc(b.select(inside, v, f.f32(0.0)), F16), b.gep(a_s, [f.add(f.mul(r, _PAD), c)]))
            for w, weight in enumerate(weights):  # weights dequantized → f16, [feature][k]
                per_step = MMA_K // weight.per_unit
                for i in range(MMA_COLS * per_step // THREADS):
                    idx = f.add(tid, THREADS * i)
                    feature, j = b.udiv(idx, f.i64(per_step)), b.urem(idx, f.i64(per_step))
                    row = f.smin(f.add(n0, feature), n - 1)
                    u = f.add(f.mul(step, per_step), j)
                    clamp = weight.storage.is_float and k % MMA_K != 0
                    for kk, value in weight.unit(row, f.smin(u, k - 1) if clamp else u):
                        if clamp:
                            kk, value = u, b.select(_lt(f, u, k), value, f.f32(0.0))
                        at = f.add(f.mul(feature, _PAD), f.sub(kk, k0))
                        b.store(b.fptrunc(value, F16), b.gep(b_s[w], [at]))
            dev.barrier(f)
            for sub in range(MMA_K // 16):
                col = f.add(f.mul(quad, 2), sub * 16)
                a_row = f.add(f.mul(wm, 16), group)
                regs = [pair(a_s, f.add(f.mul(f.add(a_row, 8 * (i % 2)), _PAD), f.add(col, 8 * (i // 2))))
                        for i in range(4)]
                for w in range(len(weights)):
                    for j in range(4):
                        feature = f.add(f.add(f.mul(wn, 32), 8 * j), group)
                        bregs = [pair(b_s[w], f.add(f.mul(feature, _PAD), f.add(col, 8 * i))) for i in range(2)]
                        tile = accs[w][j]
                        d = dev.mma_f16(f, regs, bregs, [b.load(acc) for acc in tile])
                        for acc, v in zip(tile, d):
                            b.store(v, acc)
            dev.barrier(f)
        for j in range(4):
            for i in range(4):
                r = f.add(f.add(f.mul(wm, 16), group), 8 * (i // 2))
                feature = f.add(f.add(n0, f.add(f.mul(wn, 32), 8 * j)), f.add(f.mul(quad, 2), i % 2))
                t = f.add(t0, r)
                with f.when(b.and_(_lt(f, t, rows), _lt(f, feature, n))):
                    totals = [b.load(accs[w][j][i]) for w in range(len(weights))]
                    if norm is not None:
                        totals = [f.fmul(v, f.load(inv_s, r)) for v in totals]
                    _epilogue(f, op, a, totals, f.add(f.mul(t, n), feature), feature)

    return [e.kernel("_mma", body, (-(-n // MMA_COLS), PerRows(MMA_ROWS), 1))]


def _matmul(e: _Emit) -> list[Launch]:
    """GEMV, or GEMM on tensor cores where `pack` chose them (`isa mma_f16`)."""
    if e.op.isa is not None and e.op.isa.data is tgt.Isa.MMA_F16:
        return _gemm_mma(e)
    return _gemv(e)


# ---------------------------------------------------------------------- row kernels


def _embedding(e: _Emit) -> list[Launch]:
    op, dev = e.op, e.dev
    width = tgt.dims(op.table)[1]

    def body(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        col, t = _column(f, dev), dev.ctaid(f, "y")
        with f.when(_lt(f, col, width)):
            token = _index(f, a["tokens"], t)
            table = WeightRows(f, a["table"], op.table.type)
            value = table.element(token, col)
            if op.scale is not None:
                value = f.fmul(value, f.f32(op.scale.value.data))
            f.store(value, _fptr(f, a["out"]), f.add(f.mul(t, width), col))

    return [e.kernel("", body, _elementwise_grid(width))]


def _rms_norm(e: _Emit) -> list[Launch]:
    op, dev = e.op, e.dev
    width = tgt.row_width(op.x) // op.groups  # one block per row, its groups one after another

    def body(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        t, tid = dev.ctaid(f, "y"), dev.tid(f)
        with f.loop(0, op.groups, name="g", unroll=False) as g:
            item = f.add(f.mul(t, op.groups), g)
            x = f.b.gep(_fptr(f, a["x"]), [f.mul(item, width)])
            out = f.b.gep(_fptr(f, a["out"]), [f.mul(item, width)])
            inv = _inv_rms(f, dev, x, width, op.eps.value.data, tid, THREADS,
                           lambda f, v: dev.block_sum(f, v, WARPS, "ss"))
            w = _fptr(f, a["weight"])
            with _strided(f, tid, width, THREADS, "c") as c:
                f.store(f.fmul(f.fmul(f.load(x, c), inv), f.load(w, c)), out, c)

    return [e.kernel("", body, (1, PerRows(1), 1))]


def _elementwise(e: _Emit, names: tuple[str, ...], fn: Callable) -> list[Launch]:
    op, dev = e.op, e.dev
    width = tgt.row_width(op.out)

    def body(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        col, t = _column(f, dev), dev.ctaid(f, "y")
        with f.when(_lt(f, col, width)):
            at = f.add(f.mul(t, width), col)
            f.store(fn(f, *(f.load(_fptr(f, a[n]), at) for n in names)), _fptr(f, a["out"]), at)

    return [e.kernel("", body, _elementwise_grid(width))]


def _rotate(f: KernelBuilder, dev, x: ir.Value, heads: int, d: int, position: ir.Value, rope: llm.RopeAttr) -> None:
    """Rotate-half RoPE in place of the `heads` heads at `x` (one row; the first `dims` of each),
    threads striding the pairs: f32 angles as numpy computes them, sin and cos in f64
    (`KernelBuilder.sincos`), times `mscale`."""
    half = rope.rotary_dims(d) // 2
    freqs = f.b.bitcast(f32_table(f.module, *rope_table(d, rope)), FPTR)
    pos = f.b.sitofp(position, F32)
    with _strided(f, dev.tid(f), heads * half, THREADS, "p") as p:
        h, i = f.b.udiv(p, f.i64(half)), f.b.urem(p, f.i64(half))
        angle = f.fmul(pos, f.load(freqs, i), flags=())
        sin, cos = (f.b.fptrunc(v, F32) for v in f.sincos(f.b.fpext(angle, F64)))
        if rope.mscale.data != 1.0:
            m = ir.Constant(F32, rope.mscale.data)
            sin, cos = f.fmul(sin, m, flags=()), f.fmul(cos, m, flags=())
        lo = f.add(f.mul(h, d), i)
        hi = f.add(lo, half)
        x1, x2 = f.load(x, lo), f.load(x, hi)
        f.store(f.fsub(f.fmul(x1, cos), f.fmul(x2, sin)), x, lo)
        f.store(f.fadd(f.fmul(x2, cos), f.fmul(x1, sin)), x, hi)


def _rope(e: _Emit) -> list[Launch]:
    op, dev = e.op, e.dev
    _, heads, d = tgt.dims(op.x)

    def body(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        t = dev.ctaid(f, "y")
        position = _index(f, a["positions"], t)
        _rotate(f, dev, f.b.gep(_fptr(f, a["x"]), [f.mul(t, heads * d)]), heads, d, position, op.rope)

    return [e.kernel("", body, (1, PerRows(1), 1))]


# ---------------------------------------------------------------------- attention


class _Cache:
    """One layer's cache `[kv_heads, capacity, row]` of f32, f16 or q8_0 rows (int8 values, f32 scale per 32),
    of one sequence: with `slot` (a cache of several, `[slots, kv_heads, capacity, row]`), that one's."""

    def __init__(self, f: KernelBuilder, base: ir.Value, memref: MemRefType, head_dim: int,
                 slot: ir.Value | None = None):
        self.f, self.d = f, head_dim
        kv_heads, self.capacity, self.row = tgt.dims(memref)[-3:]
        self.element = str(memref.element_type)
        self.size = {"f32": 4, "f16": 2, "i8": 1}[self.element]
        self.base = base if slot is None else f.b.gep(base, [f.mul(slot, kv_heads * self.capacity * self.row * self.size)])

    def _row(self, head: ir.Value, position: ir.Value) -> ir.Value:
        f = self.f
        return f.mul(f.add(f.mul(head, self.capacity), position), self.row * self.size)

    def load(self, head: ir.Value, position: ir.Value, i: ir.Value) -> ir.Value:
        f, row = self.f, self._row(head, position)
        if self.element == "f32":
            return f.b.load(typed(f, self.base, f.add(row, f.mul(i, 4)), F32), align=4)
        if self.element == "f16":
            return load_f16(f, f.b.gep(self.base, [row]), i)
        code = f.b.sitofp(f.b.load(typed(f, self.base, f.add(row, i), I8)), F32)
        scale = f.b.load(typed(f, self.base, f.add(f.add(row, self.d), f.mul(f.b.udiv(i, f.i64(32)), 4)), F32))
        return f.fmul(code, scale)

    def store_row(self, dev, head: ir.Value, position: ir.Value, src: ir.Value, lane_start: ir.Value,
                  step: int) -> None:
        """Write the `d` floats at `src` as the row (head, position), threads striding elements
        (f32, f16) or 32-value blocks (q8_0: `d = amax / 127`, `q = rint(x · 127 / amax)`, as `quantize_rows`)."""
        f, b, row = self.f, self.f.b, self._row(head, position)
        if self.element != "i8":
            with _strided(f, lane_start, self.d, step, "s") as i:
                v = f.load(src, i)
                if self.element == "f32":
                    b.store(v, typed(f, self.base, f.add(row, f.mul(i, 4)), F32), align=4)
                else:
                    b.store(b.fptrunc(v, F16), typed(f, self.base, f.add(row, f.mul(i, 2)), F16), align=2)
            return
        with _strided(f, lane_start, self.d // 32, step, "q") as blk:
            amax = f.f32(0.0)
            for i in range(32):
                amax = f.intrinsic("llvm.maxnum", amax, f.intrinsic("llvm.fabs", f.load(src, f.add(f.mul(blk, 32), i))))
            scale = b.fdiv(amax, f.f32(127.0))
            inv = b.select(b.fcmp_ordered(">", amax, f.f32(0.0)), b.fdiv(f.f32(127.0), amax), f.f32(0.0))
            for i in range(32):
                at = f.add(f.mul(blk, 32), i)
                q = f.intrinsic("llvm.roundeven", b.fmul(f.load(src, at), inv))
                b.store(b.fptosi(q, I8), typed(f, self.base, f.add(row, at), I8))
            b.store(scale, typed(f, self.base, f.add(f.add(row, self.d), f.mul(blk, 4)), F32), align=4)


def _attention(e: _Emit) -> list[Launch]:
    op, dev = e.op, e.dev
    _, heads, d = tgt.dims(op.q)
    _, kv_heads, _ = tgt.dims(op.k)
    group = heads // kv_heads
    splits = SPLITS if e.rows <= op.split_rows else 1
    lanes = -(-d // WARP)  # head-dimension elements per lane
    stride = d + 2  # a partial result: d weighted values, the maximum, the sum
    window, softcap, scale = llm.scoring(op).values()

    def first(f: KernelBuilder, end: ir.Value) -> ir.Value:
        """The first position a row whose positions end at `end` attends to (a sliding window's)."""
        return f.i64(0) if window is None else f.smax(0, f.sub(end, window))

    def capped(f: KernelBuilder, x: ir.Value) -> ir.Value:
        return x if softcap is None else f.softcap(x, softcap)

    def slot(f: KernelBuilder, a: dict[str, ir.Value], t: ir.Value) -> ir.Value | None:
        """Row t's sequence, in a cache of several."""
        return _index(f, a["slots"], t) if op.slots is not None else None

    def store(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        t = dev.ctaid(f, "y")
        position = _index(f, a["positions"], t)
        q = f.b.gep(_fptr(f, a["q"]), [f.mul(t, heads * d)])
        k = f.b.gep(_fptr(f, a["k"]), [f.mul(t, kv_heads * d)])
        v = f.b.gep(_fptr(f, a["v"]), [f.mul(t, kv_heads * d)])
        if op.rope is not None:
            _rotate(f, dev, q, heads, d, position, op.rope)
            _rotate(f, dev, k, kv_heads, d, position, op.rope)
            dev.barrier(f)
        for name, src in (("k_cache", k), ("v_cache", v)):
            cache = _Cache(f, a[name], getattr(op, name).type, d, slot(f, a, t))
            for h in range(kv_heads):
                cache.store_row(dev, f.i64(h), position, f.b.gep(src, [f.i64(h * d)]), dev.tid(f), THREADS)

    def online_softmax(f: KernelBuilder, a: dict[str, ir.Value], h: ir.Value, t: ir.Value, lo: ir.Value,
                       hi: ir.Value, step: int, lane: ir.Value):
        """This warp's pass over cache positions lo, lo + step, … < hi for query row t, head h: the running
        maximum, the sum of exponentials and the weighted values (lanes over the head dimension)."""
        b = f.b
        kvh = b.udiv(h, f.i64(group))
        keys = _Cache(f, a["k_cache"], op.k_cache.type, d, slot(f, a, t))
        values = _Cache(f, a["v_cache"], op.v_cache.type, d, slot(f, a, t))
        q = b.gep(_fptr(f, a["q"]), [f.mul(f.add(f.mul(t, heads), h), d)])
        dims = [f.add(lane, WARP * i) for i in range(lanes)]
        valid = [_lt(f, i, d) for i in dims]
        safe = [f.smin(i, d - 1) for i in dims]
        score_scale = f.f32(scale if scale is not None else 1.0 / np.sqrt(d))
        qs = [b.select(ok, f.fmul(f.load(q, i), score_scale), f.f32(0.0)) for ok, i in zip(valid, safe)]
        m, l = f.alloca(F32, name="m"), f.alloca(F32, name="l")
        accs = [f.alloca(F32, name=f"o{i}") for i in range(lanes)]
        b.store(f.f32(NO_SCORE), m)
        b.store(f.f32(0.0), l)
        for acc in accs:
            b.store(f.f32(0.0), acc)
        with _strided(f, lo, hi, step, "p") as p:
            part = f.f32(0.0)
            for qv, i in zip(qs, safe):
                part = f.fadd(part, f.fmul(qv, keys.load(kvh, p, i)))
            score = capped(f, dev.warp_sum(f, part))
            m_old = b.load(m)
            m_new = f.intrinsic("llvm.maxnum", m_old, score)
            keep, weight = f.exp(f.fsub(m_old, m_new)), f.exp(f.fsub(score, m_new))
            b.store(f.fadd(f.fmul(b.load(l), keep), weight), l)
            for acc, i in zip(accs, safe):
                b.store(f.fadd(f.fmul(b.load(acc), keep), f.fmul(weight, values.load(kvh, p, i))), acc)
            b.store(m_new, m)
        return b.load(m), b.load(l), [b.load(acc) for acc in accs], valid, dims

    def attend_rows(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        """Prefill: each warp one query row (a block 4 consecutive rows of one head, which read the
        same cache rows, so the block's loads of them hit L1), over all its positions."""
        b = f.b
        tid, lane, warp = dev.lanes(f)
        h, t = dev.ctaid(f, "x"), f.add(f.mul(dev.ctaid(f, "y"), WARPS), warp)
        with f.when(_lt(f, t, a["rows"])):
            end = f.add(_index(f, a["positions"], t), 1)
            _, l, accs, valid, dims = online_softmax(f, a, h, t, first(f, end), end, 1, lane)
            out = _fptr(f, a["out"])
            for ok, i, acc in zip(valid, dims, accs):
                with f.when(ok):
                    f.store(b.fdiv(acc, l), out, f.add(f.mul(f.add(f.mul(t, heads), h), d), i))

    def attend(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        """Decode: the block's 4 warps split its share of one row's positions, then merge in shared
        memory into a partial result; `merge` combines the `splits` blocks' partials."""
        b = f.b
        h, t, split = dev.ctaid(f, "x"), dev.ctaid(f, "y"), dev.ctaid(f, "z")
        tid, lane, warp = dev.lanes(f)
        end = f.add(_index(f, a["positions"], t), 1)
        start = first(f, end)
        total = f.sub(end, start)
        lo = f.add(start, b.sdiv(f.mul(total, split), f.i64(splits)))
        hi = f.add(start, b.sdiv(f.mul(total, f.add(split, 1)), f.i64(splits)))
        m, l, accs, valid, dims = online_softmax(f, a, h, t, f.add(lo, warp), hi, WARPS, lane)
        slots = dev.shared(f, "warps", WARPS * stride)
        mine = f.mul(warp, stride)
        for ok, i, acc in zip(valid, dims, accs):
            with f.when(ok):
                f.store(acc, slots, f.add(mine, i))
        with f.when(b.icmp_unsigned("==", lane, f.i64(0))):
            f.store(m, slots, f.add(mine, d))
            f.store(l, slots, f.add(mine, d + 1))
        dev.barrier(f)
        with _strided(f, tid, d, THREADS, "c") as c:
            top = f.f32(NO_SCORE)
            for w in range(WARPS):
                top = f.intrinsic("llvm.maxnum", top, f.load(slots, w * stride + d))
            out_v, out_l = f.f32(0.0), f.f32(0.0)
            for w in range(WARPS):
                factor = f.exp(f.fsub(f.load(slots, w * stride + d), top))
                out_v = f.fadd(out_v, f.fmul(f.load(slots, f.add(c, w * stride)), factor))
                out_l = f.fadd(out_l, f.fmul(f.load(slots, w * stride + d + 1), factor))
            partials = _fptr(f, a["partials"])
            base = f.mul(f.add(f.mul(f.add(f.mul(split, op.split_rows), t), heads), h), stride)
            f.store(out_v, partials, f.add(base, c))
            with f.when(b.icmp_unsigned("==", c, f.i64(0))):
                f.store(top, partials, f.add(base, d))
                f.store(out_l, partials, f.add(base, d + 1))

    def merge(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        b = f.b
        h, t = dev.ctaid(f, "x"), dev.ctaid(f, "y")
        partials = _fptr(f, a["partials"])

        def at(s: int) -> ir.Value:
            return f.mul(f.add(f.mul(f.add(f.i64(s * op.split_rows), t), heads), h), stride)

        with _strided(f, dev.tid(f), d, THREADS, "c") as c:
            top = f.f32(NO_SCORE)
            for s in range(splits):
                top = f.intrinsic("llvm.maxnum", top, f.load(partials, f.add(at(s), d)))
            out_v, out_l = f.f32(0.0), f.f32(0.0)
            for s in range(splits):
                factor = f.exp(f.fsub(f.load(partials, f.add(at(s), d)), top))
                out_v = f.fadd(out_v, f.fmul(f.load(partials, f.add(at(s), c)), factor))
                out_l = f.fadd(out_l, f.fmul(f.load(partials, f.add(at(s), d + 1)), factor))
            f.store(b.fdiv(out_v, out_l), _fptr(f, a["out"]), f.add(f.mul(f.add(f.mul(t, heads), h), d), c))

    launches = [e.kernel("_store", store, (1, PerRows(1), 1))]
    if splits == 1:
        return [*launches, e.kernel("_attend", attend_rows, (heads, PerRows(WARPS), 1))]
    return [*launches, e.kernel("_attend", attend, (heads, PerRows(1), splits)),
            e.kernel("_merge", merge, (heads, PerRows(1), 1))]


# ---------------------------------------------------------------------- greedy decoding

ARGMAX = "llmc_argmax"


def argmax_kernel(module: ir.Module, dev) -> Launch:
    """`llmc_argmax(float* logits, i32* out, i64 count)`: `out[0]` = the index of the largest of
    `count` logits, the first on ties (as numpy's argmax), so greedy decoding downloads 4 bytes."""
    fn = dev.kernel(module, ARGMAX, [I8PTR, I8PTR, I64], THREADS)
    f = KernelBuilder(module, fn)
    b = f.b
    logits, out, count = _fptr(f, fn.args[0]), b.bitcast(fn.args[1], I32.as_pointer()), fn.args[2]
    tid = dev.tid(f)
    best, where = f.alloca(F32, name="best"), f.alloca(I32, name="where")
    mine = _lt(f, tid, count)  # each thread starts from its first logit (an all -inf row has an argmax too)
    b.store(b.select(mine, f.load(logits, f.smin(tid, f.sub(count, 1))), f.f32(-np.inf)), best)
    b.store(b.select(mine, b.trunc(tid, I32), ir.Constant(I32, 0x7FFFFFFF)), where)
    with _strided(f, f.add(tid, THREADS), count, THREADS, "i") as i:
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


_EMITTERS: dict[type, Callable[[_Emit], list[Launch]]] = {
    tgt.MatmulOp: _matmul,
    tgt.SwigluOp: _matmul,
    tgt.EmbeddingOp: _embedding,
    tgt.RMSNormOp: _rms_norm,
    tgt.RopeOp: _rope,
    tgt.AttentionOp: _attention,
    tgt.AddOp: lambda e: _elementwise(e, ("lhs", "rhs"), lambda f, x, y: f.fadd(x, y)),
    tgt.MulOp: lambda e: _elementwise(e, ("lhs", "rhs"), lambda f, x, y: f.fmul(x, y)),
    tgt.SiluOp: lambda e: _elementwise(e, ("x",), lambda f, x: f.silu(x)),
    tgt.GeluOp: lambda e: _elementwise(e, ("x",), lambda f, x: f.gelu_tanh(x)),
}
