"""AMX-INT8 tiles for the matmul family on blocks of 16 quantized rows (`isa amx`).

A tile product `C[16 x 16] = A[16 x 32] · B[32 x 16]` (`tdpbsud`: signed × unsigned
bytes into int32) covers 16 rows × 16 output features (a strip of the `tiles` layout) ×
one 32-value block of K, the granularity of the activations' and (every format `pack`
gives `isa amx`) the weights' scales. Per 32-block, the int32 products are scaled and
summed in float registers, `acc += C · (d_w · d_x) + off_w · s_x`, the arithmetic of the
VNNI kernels on the same bytes.

    A: the rows' int8 values, loaded from the quantized rows as they are (stride: a row);
       int16 rows (`a16`) are two int8 planes, `hi` and `lo`: an A tile and a product each;
    B: a block's 8 code vectors of the tiles layout, as stored (8-bit codes) or unpacked
       once per strip into a stack buffer (4- and 5-bit codes);
    C: stored to the stack and scaled there, 16 features of a row per vector (int16 rows:
       `(C_hi << 8) + C_lo` first, exact in int32).

LLVM's `.internal` intrinsics let it configure the tiles itself (`ldtilecfg`); the
process must have asked the kernel for the tile data first (`llmc.runtime.amx`), and
the kernels use the tiles only once the runtime has set `llmc_amx` (otherwise every
row takes the VNNI path: the fallback where the kernel refuses).
"""

from __future__ import annotations

from llvmlite import ir

from llmc.abi import AMX_FLAG
from llmc.backends.builder import F32, I32, I64, KernelBuilder
from llmc.backends.cpu.quant import I8, I8PTR, QRowsAccess, TiledWeight, declare, scaled_block, vec
from llmc.ir.formats import FORMATS, SLICE, Storage
from llmc.ir.layouts import QUADS, STRIP, TILE_K

I16 = ir.IntType(16)
TILE = 16  # rows per tile


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
    return fmt.bits is not None and all(field.group % TILE_K == 0 for field in fmt.fields)


def enabled(f: KernelBuilder) -> ir.Value:
    """An i1: whether the runtime has allowed the tiles (`llmc_amx` is 1)."""
    flag = f.module.globals.get(AMX_FLAG)
    if flag is None:  # weak: kernels compiled one module each share the one flag of their library
        flag = ir.GlobalVariable(f.module, I32, name=AMX_FLAG)
        flag.linkage = "weak"
        flag.initializer = ir.Constant(I32, 0)
    return f.b.icmp_signed("!=", f.b.load(flag, align=4), ir.Constant(I32, 0))


def _i16(v: int) -> ir.Constant:
    return ir.Constant(I16, v)


def _load(f: KernelBuilder, rows: int, col_bytes: int, ptr: ir.Value, stride: int | ir.Value) -> ir.Value:
    fn = declare(f, "llvm.x86.tileloadd64.internal", AMX, [I16, I16, I8PTR, I64])
    return f.b.call(fn, [_i16(rows), _i16(col_bytes), ptr, f.i64(stride)])


def _product(f: KernelBuilder, a: ir.Value, b: ir.Value) -> ir.Value:
    zero = f.b.call(declare(f, "llvm.x86.tilezero.internal", AMX, [I16, I16]), [_i16(TILE), _i16(4 * STRIP)])
    fn = declare(f, "llvm.x86.tdpbsud.internal", AMX, [I16, I16, I16, AMX, AMX, AMX])
    return f.b.call(fn, [_i16(TILE), _i16(4 * STRIP), _i16(TILE_K), zero, a, b])


def _store(f: KernelBuilder, ptr: ir.Value, tile: ir.Value) -> None:
    fn = declare(f, "llvm.x86.tilestored64.internal", ir.VoidType(), [I16, I16, I8PTR, I64, AMX])
    f.b.call(fn, [_i16(TILE), _i16(4 * STRIP), ptr, f.i64(4 * STRIP), tile])


def gemm_amx(f: KernelBuilder, q: QRowsAccess, access: list[TiledWeight], t_end: ir.Value,
             j_lo: ir.Value, j_hi: ir.Value, unit: int, finish, flush=None) -> None:
    """Rows [0, t_end) (a multiple of 16) × columns [j_lo, j_hi) (whole `unit`s of whole
    strips): finish(ts, js, vals) per row and unit, vals[w][0][c] the row's dot product with
    column js[c] of weight w; then flush(t, 1, j0) if given. Int16 rows take a tile product
    per plane on the same B tile, joined as `(hi << 8) + lo` (the VNNI kernels' int32 sums)."""
    b = f.b
    w0 = access[0]
    blocks, nw, strips = w0.blocks, len(access), unit // STRIP
    bbuf = f.alloca(I8, nw * strips * blocks * QUADS * 64, name="bt")  # unpacked B tiles of the unit
    cbuf = f.alloca(I32, q.planes * TILE * STRIP, name="c")  # [plane][row][feature]
    acc = f.alloca(F32, nw * strips * TILE * STRIP, name="acc")  # [weight][strip][row][feature]
    row_bytes = q.row.row_bytes

    def b_tile(wi: int, w: TiledWeight, s: ir.Value, si: int, blk: ir.Value) -> ir.Value:
        if w.bits == 8:  # the stored codes are the tile
            return _load(f, QUADS, 4 * STRIP, w.codes_ptr(s, blk), 4 * STRIP)
        at = f.mul(f.add(f.i64((wi * strips + si) * blocks), blk), QUADS * 64)
        return _load(f, QUADS, 4 * STRIP, f.ptr(bbuf, at), 4 * STRIP)

    with f.loop(j_lo, j_hi, unit, name="ju") as j0:
        s0 = b.sdiv(j0, f.i64(STRIP))
        for wi, w in enumerate(access):  # unpack the unit's 4- and 5-bit codes once
            if w.bits == 8:
                continue
            for si in range(strips):
                with f.loop(0, blocks, name="ub", unroll=False) as blk:
                    base = f.mul(f.add(f.i64((wi * strips + si) * blocks), blk), QUADS * 64)
                    for quad, codes in enumerate(w.quads(f.add(s0, si), blk)):
                        b.store(codes, b.bitcast(f.ptr(bbuf, f.add(base, quad * 64)), codes.type.as_pointer()), align=1)
        with f.loop(0, t_end, TILE, name="rt") as t0:
            for wi, w in enumerate(access):  # per weight and strip: the 16 rows' sums in registers
                for si in range(strips):
                    s = f.add(s0, si)
                    sums = [f.alloca(vec(F32, STRIP), name=f"sum{r}") for r in range(TILE)]
                    for total in sums:
                        b.store(f.const(vec(F32, STRIP), 0.0), total)
                    with f.loop(0, blocks, name="kb", unroll=False) as blk:
                        codes = b_tile(wi, w, s, si, blk)
                        for plane in range(q.planes):
                            a = _load(f, TILE, TILE_K, f.ptr(q.qs_ptr(t0, plane), f.mul(blk, TILE_K)), row_bytes)
                            _store(f, b.bitcast(f.ptr(cbuf, plane * TILE * STRIP), I8PTR), _product(f, a, codes))
                        sl = f.mul(blk, TILE_K // SLICE)
                        scale = w.scale16(s, sl)
                        offset = w.offset16(s, sl, scale) if w.fmt.minimum else None  # (a zero point: taken into `dot`)
                        for r, total in enumerate(sums):
                            dots = [b.load(b.bitcast(f.ptr(cbuf, (plane * TILE + r) * STRIP), vec(I32, STRIP).as_pointer()),
                                           align=4) for plane in range(q.planes)]
                            dot = q.joined(dots)
                            if offset is None:
                                dot = b.add(dot, q.zero_term(f.add(t0, r), sl, TILE_K // SLICE, w.fmt.zero))
                            xd, xs = q.block_scales(f.add(t0, r), sl, TILE_K // SLICE, offset is not None)
                            b.store(scaled_block(f, b.load(total), dot, scale, offset, xd, xs), total)
                    for r, total in enumerate(sums):
                        f.vstore(b.load(total), acc, f.i64(((wi * strips + si) * TILE + r) * STRIP))
            with f.loop(0, TILE, name="fr", unroll=False) as r:
                t = f.add(t0, r)
                vals = [[[f.load(acc, f.add(f.mul(f.add(f.i64((wi * strips + c // STRIP) * TILE), r), STRIP), c % STRIP))
                          for c in range(unit)]] for wi in range(nw)]
                finish([t], [f.add(j0, c) for c in range(unit)], vals)
                if flush is not None:
                    flush(t, 1, j0)
