"""AMX-INT8 tiles for the matmul family on blocks of 16 quantized rows (`isa amx`).

A tile product `C[16 x 16] = A[16 x 32] · B[32 x 16]` (`tdpbusd`: unsigned × signed
bytes into int32) covers 16 output features × 16 rows × one 32-value block of K, the
granularity of the activations' and (every format `pack` gives `isa amx`) the weights'
scales. Per 32-block and feature, the int32 dot products are scaled and summed in
float registers: `acc += C · (d_w · d_x) + off_w · s_x` (`off_w` the weight's minimum,
or `−zero · d_w`; `s_x` the rows' block sums), exactly the arithmetic of the VNNI
kernels on the same bytes.

    A: the weight codes, one u8 per value, features as tile rows (4-bit codes are
       unpacked into a stack buffer once per strip of features and block of rows;
       8-bit codes are read where they are stored);
    B: the rows' int8 values in the VNNI layout `[K/4][16 rows][4]`, rearranged once per
       block of rows (a stack buffer);
    C: stored to the stack and scaled there.

LLVM's `.internal` intrinsics let it configure the tiles itself (`ldtilecfg`); the
process must have asked the kernel for the tile data first (`llmc.runtime.amx`), and
the kernels use the tiles only when the runtime has set `llmc_amx` (otherwise every row
takes the VNNI path: the fallback where the kernel refuses).
"""

from __future__ import annotations

from llvmlite import ir

from llmc.backends.cpu.builder import F32, I32, I64, KernelBuilder
from llmc.backends.cpu.quant import I8, I8PTR, QRowsAccess, SplitWeight, declare, vec
from llmc.ir.formats import ACT_BLOCK, FORMATS, GROUP, SLICE, Storage

I16 = ir.IntType(16)
TILE = 16  # rows and features per tile
KB = ACT_BLOCK  # K bytes per tile product
ROW_BLOCK = 64  # rows whose int8 values are rearranged at once (a stack buffer of ROW_BLOCK × K bytes)
FLAG = "llmc_amx"  # i32 the runtime sets to 1 once the process may use the tiles


class _AMXType(ir.Type):
    """LLVM's `x86_amx` (llvmlite has no such type)."""

    def _to_string(self) -> str:
        return "x86_amx"

    def __eq__(self, other) -> bool:
        return isinstance(other, _AMXType)

    def __hash__(self) -> int:
        return hash("x86_amx")


AMX = _AMXType()


def supports(storage: Storage) -> bool:
    """Whether a weight format's scales are constant over each 32-block (the tile's K)."""
    fmt = FORMATS[storage]
    return fmt.bits is not None and all(field.group % KB == 0 for field in fmt.fields)


def enabled(f: KernelBuilder) -> ir.Value:
    """An i1: whether the runtime has allowed the tiles (`llmc_amx` is 1)."""
    flag = f.module.globals.get(FLAG)
    if flag is None:
        flag = ir.GlobalVariable(f.module, I32, name=FLAG)
        flag.initializer = ir.Constant(I32, 0)
    return f.b.icmp_signed("!=", f.b.load(flag, align=4), ir.Constant(I32, 0))


def _i16(v: int) -> ir.Constant:
    return ir.Constant(I16, v)


def _load(f: KernelBuilder, rows: int, col_bytes: int, ptr: ir.Value, stride: ir.Value) -> ir.Value:
    fn = declare(f, "llvm.x86.tileloadd64.internal", AMX, [I16, I16, I8PTR, I64])
    return f.b.call(fn, [_i16(rows), _i16(col_bytes), ptr, f.i64(stride)])


def _product(f: KernelBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    zero = f.b.call(declare(f, "llvm.x86.tilezero.internal", AMX, [I16, I16]), [_i16(TILE), _i16(4 * TILE)])
    fn = declare(f, "llvm.x86.tdpbusd.internal", AMX, [I16, I16, I16, AMX, AMX, AMX])
    return f.b.call(fn, [_i16(TILE), _i16(4 * TILE), _i16(KB), zero, a, b])


def _store(f: KernelBuilder, ptr: ir.Value, tile: ir.Value) -> None:
    fn = declare(f, "llvm.x86.tilestored64.internal", ir.VoidType(), [I16, I16, I8PTR, I64, AMX])
    f.b.call(fn, [_i16(TILE), _i16(4 * TILE), ptr, f.i64(4 * TILE), tile])


def gemm_amx(f: KernelBuilder, q: QRowsAccess, access: list[SplitWeight], t_end: ir.Value,
             j_lo: ir.Value, j_hi: ir.Value, unit: int, finish, flush=None) -> None:
    """Rows [0, t_end) (a multiple of 16) × this thread's columns [j_lo, j_hi) (whole `unit`s,
    a multiple of 16): finish(ts, js, vals) per row and unit, vals[w][0][c] the row's dot
    products with column js[c] of weight w; then flush(t, 1, j0) if given."""
    b = f.b
    kp = access[0].kp
    blocks = kp // KB
    nw = len(access)
    strips = unit // TILE
    xb = f.alloca(I32, ROW_BLOCK * kp // 4, name="xb")  # [row tile][block][K/4 of 32][16 rows] i32
    xd = f.alloca(F32, ROW_BLOCK * blocks, name="xd")  # [row tile][block][16 rows]: the rows' scales
    xs = f.alloca(F32, ROW_BLOCK * blocks, name="xs")  # … and block sums
    wa = f.alloca(I8, nw * unit * kp, name="wa")  # [weight][feature][K]: unpacked codes
    wsc = f.alloca(F32, nw * unit * blocks, name="wsc")  # [weight][block][feature]
    wof = f.alloca(F32, nw * unit * blocks, name="wof")
    cbuf = f.alloca(I32, TILE * TILE, name="c")
    acc = f.alloca(F32, nw * unit * TILE, name="acc")  # [weight][feature][row]
    cbytes = b.bitcast(cbuf, I8PTR)

    def rearrange(r0: ir.Value, count: ir.Value) -> None:
        """xb, xd, xs of rows r0..r0+count (whole tiles)."""
        with f.loop(0, count, name="xr") as r:
            t = f.add(r0, r)
            tile, row = b.sdiv(r, f.i64(TILE)), b.srem(r, f.i64(TILE))
            qs = b.bitcast(q.qs_ptr(t), I32.as_pointer())
            d, s = q.d_ptr(t), q.s_ptr(t)
            with f.loop(0, blocks, name="xk") as kb:
                base = f.mul(f.add(f.mul(tile, blocks), kb), KB // 4 * TILE)
                for quad in range(KB // 4):
                    word = f.load(qs, f.add(f.mul(kb, KB // 4), quad))
                    f.store(word, xb, f.add(base, f.add(f.i64(quad * TILE), row)))
                at = f.add(f.mul(f.add(f.mul(tile, blocks), kb), TILE), row)
                first = f.mul(kb, KB // SLICE)
                f.store(f.load(d, first), xd, at)
                f.store(f.fadd(f.load(s, first), f.load(s, f.add(first, 1))), xs, at)

    def weights(j0: ir.Value) -> None:
        """wa (4-bit and 5-bit codes unpacked), wsc, wof of the unit of columns from j0."""
        for wi, w in enumerate(access):
            with f.loop(0, unit, name="wf") as c:
                j = f.add(j0, c)
                with f.loop(0, kp // GROUP, name="wg", unroll=False) as g:
                    if w.bits != 8:
                        codes = w.codes(j, g)
                        dst = f.ptr(wa, f.add(f.mul(f.add(f.i64(wi * unit), c), kp), f.mul(g, GROUP)))
                        b.store(codes, b.bitcast(dst, codes.type.as_pointer()), align=1)
                    scale = w.scale4(j, g)
                    offset = w.offset4(j, g, scale)
                    for half in range(GROUP // KB):
                        at = f.add(f.mul(f.add(f.i64(wi * blocks), f.add(f.mul(g, GROUP // KB), half)), unit), c)
                        lane = ir.Constant(I32, half * KB // SLICE)
                        f.store(b.extract_element(scale, lane), wsc, at)
                        f.store(b.extract_element(offset, lane), wof, at)

    def a_tile(wi: int, w: SplitWeight, j0: ir.Value, strip: int, kb: ir.Value) -> ir.Value:
        if w.bits == 8:  # the stored codes, rows of code_bytes
            base = f.add(f.mul(f.add(j0, strip * TILE), w.code_bytes), f.mul(kb, KB))
            return _load(f, TILE, KB, f.ptr(w.ptrs["codes"], base), w.code_bytes)
        base = f.add(f.mul(f.i64(wi * unit + strip * TILE), kp), f.mul(kb, KB))
        return _load(f, TILE, KB, f.ptr(wa, base), kp)

    with f.loop(0, t_end, ROW_BLOCK, name="rb") as r0:
        count = f.smin(ROW_BLOCK, f.sub(t_end, r0))
        rearrange(r0, count)
        with f.loop(j_lo, j_hi, unit, name="ju") as j0:
            weights(j0)
            with f.loop(0, count, TILE, name="rt") as rt:
                tile = b.sdiv(rt, f.i64(TILE))
                with f.loop(0, nw * unit * TILE, name="az") as i:
                    f.store(f.f32(0.0), acc, i)
                with f.loop(0, blocks, name="kb", unroll=False) as kb:
                    at = f.mul(f.add(f.mul(tile, blocks), kb), TILE)
                    bt = _load(f, KB // 4, 4 * TILE, b.bitcast(f.ptr(xb, f.mul(at, KB // 4)), I8PTR), 4 * TILE)
                    dx, sx = f.vload(xd, at), f.vload(xs, at)
                    for wi, w in enumerate(access):
                        for strip in range(strips):
                            _store(f, cbytes, _product(f, a_tile(wi, w, j0, strip, kb), bt))
                            for c in range(TILE):
                                feature = strip * TILE + c
                                wat = f.add(f.mul(f.add(f.i64(wi * blocks), kb), unit), feature)
                                dot = b.sitofp(b.load(b.bitcast(f.ptr(cbuf, c * TILE), vec(I32, TILE).as_pointer()),
                                                      align=4), vec(F32, TILE))
                                scale = f.fmul(dx, f.splat(f.load(wsc, wat), vec(F32, TILE)))
                                off = f.fmul(sx, f.splat(f.load(wof, wat), vec(F32, TILE)))
                                slot = f.i64((wi * unit + feature) * TILE)
                                f.vstore(f.fadd(f.fadd(f.vload(acc, slot), f.fmul(dot, scale)), off), acc, slot)
                with f.loop(0, TILE, name="fr", unroll=False) as r:
                    t = f.add(f.add(r0, rt), r)
                    vals = [[[f.load(acc, f.add((wi * unit + c) * TILE, r)) for c in range(unit)]] for wi in range(nw)]
                    finish([t], [f.add(j0, c) for c in range(unit)], vals)
                    if flush is not None:
                        flush(t, 1, j0)
