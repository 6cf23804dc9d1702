"""CUDA matmul and SwiGLU kernels: a GEMV on CUDA cores, or a GEMM on tensor cores where `pack` chose
them (`isa mma_f16`).

| kernel | grid (x, y, z) | a thread block does |
|---|---|---|
| GEMV | (N / 4, rows / R) | 4 warps, one output feature each, for R rows; lanes stride K 16 bytes of codes at a time, dequantize in registers, sum by warp shuffles |
| `_mma` | (N / 64, rows / 32) | f16 tiles of x and the dequantized weights in shared memory, `mma.sync.m16n8k16` per warp |

Both fuse RMSNorm (`norm`), bias, soft-capping, the residual add (`accumulate`) and SwiGLU's
`act(gate) · up` (its activation's) into the store of each output (`_epilogue`).
"""

from __future__ import annotations

from llvmlite import ir

from llmc.backends.builder import F32, I32, KernelBuilder
from llmc.backends.cuda.device import WARP
from llmc.backends.cuda.emit import THREADS, WARPS, Emit, Launch, PerRows, fptr, inv_rms, lt, strided
from llmc.backends.cuda.weights import F16, WeightRows
from llmc.ir import llm, tgt
from llmc.ir.activations import ACTIVATIONS, activation_of

ROW_TILE = 8  # rows a GEMV block computes at once in prefill: each weight dequantized once for them


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
    (`act(gate) · up`, act its `activation`)."""
    out = fptr(f, a["out"])
    if isinstance(op, tgt.SwigluOp):
        value = f.fmul(getattr(f, ACTIVATIONS[activation_of(op)].builder)(totals[0]), totals[1])
    else:
        value = totals[0]
        if a.get("bias") is not None:
            value = f.fadd(value, f.load(fptr(f, a["bias"]), feature))
        if (cap := llm.optional_value(op, "softcap")) is not None:
            value = f.softcap(value, cap)
        if op.accumulate is not None:
            value = f.fadd(value, f.load(out, dest))
    f.store(value, out, dest)


def _gemv(e: Emit) -> list[Launch]:
    op, dev = e.op, e.dev
    weight_values = _matrices(op)
    n, k = tgt.dims(weight_values[0])
    last = getattr(op, "last_row", None) is not None
    tile = 1 if last else -(-e.rows // -(-e.rows // ROW_TILE))  # the fewest blocks of ≤ ROW_TILE rows, evened out

    def body(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        b = f.b
        x, rows = fptr(f, a["x"]), a["rows"]
        weights = [WeightRows(f, a[name], v.type) for name, v in op.abi() if v in weight_values]
        tid, lane, warp = dev.lanes(f)
        j = f.add(f.mul(dev.ctaid(f, "x"), WARPS), warp)
        first = f.sub(rows, 1) if last else f.mul(dev.ctaid(f, "y"), tile)
        with f.when(lt(f, j, n)):  # whole warps: the shuffles below see every lane
            row_of = [f.smin(f.add(first, r), f.sub(rows, 1)) for r in range(tile)]
            xs = [b.gep(x, [f.mul(t, k)]) for t in row_of]
            norm = a.get("norm")
            inv = [None] * tile
            if norm is not None:
                inv = [inv_rms(f, dev, xr, k, op.eps.value.data, lane, WARP, dev.warp_sum) for xr in xs]
                g = fptr(f, norm)
            accs = [[f.alloca(F32, name=f"acc{w}_{r}") for r in range(tile)] for w in range(len(weights))]
            for row_accs in accs:
                for acc in row_accs:
                    b.store(f.f32(0.0), acc)
            for w, weight in enumerate(weights):  # each its own pass: gate and up may differ in format
                with strided(f, lane, weight.wide_units, WARP, f"u{w}") as u:
                    for k0, values in weight.wide_runs(j, u):
                        inside = lt(f, k0, k) if weight.padded else None  # runs lie wholly in or past K
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
                with f.when(b.and_(b.icmp_unsigned("==", lane, f.i64(0)), lt(f, f.add(first, r), rows))):
                    _epilogue(f, op, a, totals, j if last else f.add(f.mul(f.add(first, r), n), j), j)

    grid = (-(-n // WARPS), 1 if last else PerRows(tile), 1)
    return [e.kernel("", body, grid)]


# ---------------------------------------------------------------------- GEMM on tensor cores

MMA_ROWS, MMA_COLS, MMA_K = 32, 64, 64  # a block's tile: rows × output features, K per step
_PAD = MMA_K + 8  # halves per row of a shared-memory tile (a stagger against bank conflicts)


def _gemm_mma(e: Emit) -> list[Launch]:
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
        x, rows = fptr(f, a["x"]), a["rows"]
        weights = [WeightRows(f, a[name], v.type) for name, v in op.abi() if v in weight_values]
        tid, lane, warp = dev.lanes(f)
        wm, wn = b.udiv(warp, f.i64(2)), b.urem(warp, f.i64(2))
        group, quad = b.udiv(lane, f.i64(4)), b.urem(lane, f.i64(4))
        n0, t0 = f.mul(dev.ctaid(f, "x"), MMA_COLS), f.mul(dev.ctaid(f, "y"), MMA_ROWS)
        a_s = b.bitcast(dev.shared(f, "a", MMA_ROWS * _PAD // 2), h16)
        b_s = [b.bitcast(dev.shared(f, f"b{i}", MMA_COLS * _PAD // 2), h16) for i in range(len(weights))]
        norm = a.get("norm")
        if norm is not None:
            g = fptr(f, norm)
            inv_s = dev.shared(f, "inv", MMA_ROWS)
            for r in range(MMA_ROWS // WARPS):
                row = f.add(f.mul(warp, MMA_ROWS // WARPS), r)
                xr = b.gep(x, [f.mul(f.smin(f.add(t0, row), f.sub(rows, 1)), k)])
                inv = inv_rms(f, dev, xr, k, op.eps.value.data, lane, WARP, dev.warp_sum)
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

        with strided(f, f.i64(0), steps, 1, "ks") as step:
            k0 = f.mul(step, MMA_K)
            for i in range(MMA_ROWS * MMA_K // THREADS):  # x (× norm weight) → f16
                idx = f.add(tid, THREADS * i)
                r, c = b.udiv(idx, f.i64(MMA_K)), b.urem(idx, f.i64(MMA_K))
                kk, t = f.add(k0, c), f.add(t0, r)
                inside = b.and_(lt(f, kk, k), lt(f, t, rows))
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
                            kk, value = u, b.select(lt(f, u, k), value, f.f32(0.0))
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
                with f.when(b.and_(lt(f, t, rows), lt(f, feature, n))):
                    totals = [b.load(accs[w][j][i]) for w in range(len(weights))]
                    if norm is not None:
                        totals = [f.fmul(v, f.load(inv_s, r)) for v in totals]
                    _epilogue(f, op, a, totals, f.add(f.mul(t, n), feature), feature)

    return [e.kernel("_mma", body, (-(-n // MMA_COLS), PerRows(MMA_ROWS), 1))]


def matmul(e: Emit) -> list[Launch]:
    """GEMV, or GEMM on tensor cores where `pack` chose them (`isa mma_f16`)."""
    if e.op.isa is not None and e.op.isa.data is tgt.Isa.MMA_F16:
        return _gemm_mma(e)
    return _gemv(e)
