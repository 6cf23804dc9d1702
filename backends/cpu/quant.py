"""Integer formats in CPU kernels: reading split-layout weights and quantized rows, integer dot products.

Kernels see every integer weight format the same way (`llmc.ir.formats`): per row and
64-weight group, 64 unsigned codes and, per 16-weight slice, a scale and a zero point
or a minimum. `SplitWeight` loads them from the split layout (`llmc.ir.layouts`),
`QRowsAccess` reads and writes quantized activation rows (int8, or int16 as two int8
planes whose dot products it joins), and `integer_dot` multiplies 64 codes by 64 int8
values into int32 lanes, each summing products of one 16-slice (`dot_slices`), with the
instructions the kernel's `isa` names (`rows_dot`: a row's planes; on AVX2, 8-bit codes and
int16 rows as 16-bit words, `words_dot`):

    w = SplitWeight(f, ptr, weight_type)
    codes = w.codes(j, g)                         # <64 x i8>
    lanes = integer_dot(f, Isa.VNNI512, codes, x.qs(t, g), w.bits)   # <16 x i32>, lane l of slice l // 4
"""

from __future__ import annotations

import copy

from llvmlite import ir

from llmc.backends.builder import F32, I32, I64, KernelBuilder
from llmc.ir.formats import ACT_BLOCK, FORMATS, GROUP, QMAX, SLICE, padded_width
from llmc.ir.layouts import QUADS, STRIP, TILE_K, Layout, Plane, tile_planes, weight_planes
from llmc.ir.tgt import Isa, QRowsType, WeightType

I1 = ir.IntType(1)
I8 = ir.IntType(8)
I16 = ir.IntType(16)
F16 = ir.HalfType()
I8PTR = I8.as_pointer()
CACHE_LINE = 64


def vec(ty: ir.Type, n: int) -> ir.VectorType:
    return ir.VectorType(ty, n)


def declare(f: KernelBuilder, name: str, ret: ir.Type, args: list[ir.Type]) -> ir.Function:
    """The function `name` of the module, declared on first use."""
    fn = f.module.globals.get(name)
    return fn if fn is not None else ir.Function(f.module, ir.FunctionType(ret, args), name=name)


def splat_i(ty: ir.VectorType, value: int) -> ir.Constant:
    return ir.Constant(ty, [value] * ty.count)


def shuffle(f: KernelBuilder, v: ir.Value, mask: list[int], other: ir.Value | None = None) -> ir.Value:
    other = other if other is not None else ir.Constant(v.type, None)
    return f.b.shuffle_vector(v, other, ir.Constant(vec(I32, len(mask)), mask))


def typed_ptr(f: KernelBuilder, base: ir.Value, plane: Plane, element: ir.Type) -> ir.Value:
    return f.b.bitcast(f.b.gep(base, [ir.Constant(I64, plane.offset)], inbounds=True), element.as_pointer())


def load_vector(f: KernelBuilder, ptr: ir.Value, index: ir.Value, ty: ir.VectorType, align: int = 1) -> ir.Value:
    p = f.b.bitcast(f.b.gep(ptr, [index], inbounds=True), ty.as_pointer())
    return f.b.load(p, align=align)


def _to_float(f: KernelBuilder, value: ir.Value, dtype: str) -> ir.Value:
    ty = vec(F32, value.type.count) if isinstance(value.type, ir.VectorType) else F32
    if dtype == "f16":
        return f.b.fpext(value, ty)
    if dtype == "u8":
        return f.b.uitofp(value, ty)
    return f.b.sitofp(value, ty)


def prefetch(f: KernelBuilder, base: ir.Value, offset: ir.Value, level: int = 1) -> None:
    """Prefetch the cache line at byte `offset` of `base` (an `i8*`) into L1 (`level` 2: L2)."""
    fn = declare(f, "llvm.prefetch.p0", ir.VoidType(), [I8PTR, I32, I32, I32])
    f.b.call(fn, [f.b.gep(base, [offset]), ir.Constant(I32, 0), ir.Constant(I32, 4 - level), ir.Constant(I32, 1)])


def vpdpbusd(f: KernelBuilder, acc: ir.Value, codes: ir.Value, x: ir.Value, isa: Isa = Isa.VNNI512) -> ir.Value:
    """`acc` (`<16 x i32>`) plus, per lane, 4 unsigned codes × 4 int8 values: one AVX-512 VNNI instruction; with
    `isa` `vnni256` (AVX-VNNI) one for each half of the lanes. (AVX2 has no such instruction: `byte_pairs`.)"""
    if isa is Isa.VNNI512:
        fn = declare(f, "llvm.x86.avx512.vpdpbusd.512", vec(I32, 16), [vec(I32, 16), vec(I8, 64), vec(I8, 64)])
        return f.b.call(fn, [acc, codes, x])
    assert isa is Isa.VNNI256, isa
    fn = declare(f, "llvm.x86.avx512.vpdpbusd.256", vec(I32, 8), [vec(I32, 8), vec(I8, 32), vec(I8, 32)])
    halves = []
    for h in (0, 1):
        part, c, v = (shuffle(f, value, list(range(n * h, n * h + n))) for value, n in ((acc, 8), (codes, 32), (x, 32)))
        halves.append(f.b.call(fn, [part, c, v]))
    return shuffle(f, halves[0], list(range(16)), halves[1])


def pair_quads(bits: int) -> int:
    """How many quads' `byte_pairs` a 16-bit lane sums exactly: each adds two products of a code below 2^bits and
    an int8 value, at most 2 · (2^bits − 1) · 128 in size (4-bit codes: 8 quads, a 32-block; 6-bit: 2)."""
    return (2**15 - 1) // (2 * (2**bits - 1) * 128)


def byte_pairs(f: KernelBuilder, acc: list[ir.Value], codes: ir.Value, x: ir.Value) -> list[ir.Value]:
    """AVX2: 4 codes × 16 features (`codes`, below 128) by 4 int8 values (`x`, in every lane) added to `acc` as
    16-bit pairs, one `vpmaddubsw` per half of the features: `acc` is two `<16 x i16>` (features 8h..8h+7, each
    feature's two pair sums side by side), exact for `pair_quads` quads; `pairs_sums` makes them int32 sums."""
    maddubs = declare(f, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [vec(I8, 32), vec(I8, 32)])
    return [f.b.add(a, f.b.call(maddubs, [shuffle(f, codes, list(range(32 * h, 32 * h + 32))),
                                           shuffle(f, x, list(range(32 * h, 32 * h + 32)))]))
            for h, a in enumerate(acc)]


def pairs_sums(f: KernelBuilder, pairs: list[ir.Value], times: int = 1) -> ir.Value:
    """`byte_pairs`'s two `<16 x i16>` → the 16 features' sums times `times` (`<16 x i32>`, in order): one
    `vpmaddwd` a half."""
    halves = [_pmaddwd(f, p, splat_i(vec(I16, 16), times)) for p in pairs]
    return shuffle(f, halves[0], list(range(16)), halves[1])


def words_quads(f: KernelBuilder, acc: list[ir.Value], codes: ir.Value, x: ir.Value) -> list[ir.Value]:
    """AVX2's `vpdpbusd` of 4 codes × 16 features by 4 int16 values (`x`: `<16 x i16>`, the 4 repeated): the codes
    widened to words, one `vpmaddwd` per 4 features. `acc` and the result are 4 `<8 x i32>` in pairs (features 4i..4i+3
    in vector i, each feature's two partial sums side by side: `words_sums` adds them)."""
    wide = f.b.zext(codes, vec(I16, 64))
    return [f.b.add(a, _pmaddwd(f, shuffle(f, wide, list(range(16 * i, 16 * i + 16))), x)) for i, a in enumerate(acc)]


def words_sums(f: KernelBuilder, pairs: list[ir.Value]) -> ir.Value:
    """`words_quads`'s 4 `<8 x i32>` of pairs → the 16 features' sums (`<16 x i32>`, in order): `vphaddd` joins
    features 0–3 with 4–7 as 0, 1, 4, 5 | 2, 3, 6, 7 (and 8–15 alike); a shuffle puts them back in order."""
    joined = shuffle(f, _phaddd(f, pairs[0], pairs[1]), list(range(16)), _phaddd(f, pairs[2], pairs[3]))
    return shuffle(f, joined, [0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15])


def weight_offset(f: KernelBuilder, fmt, minimum: ir.Value | None, scale: ir.Value) -> ir.Value:
    """What multiplies the activations' sums: the weight's (signed) minimum, or `−zero · scale`."""
    if minimum is not None:
        return minimum
    return f.b.fneg(f.b.fmul(ir.Constant(scale.type, [float(fmt.zero)] * scale.type.count), scale))


def scaled_block(f: KernelBuilder, total: ir.Value, dot: ir.Value, scale: ir.Value, offset: ir.Value | None,
                 xd: ir.Value, xs: ir.Value | None) -> ir.Value:
    """`total + dot · scale · xd + offset · xs`: a block's int32 dot products (`<16 x i32>`)
    with the weights' scales and offsets (per lane) and the row's scale and sum (scalars); no
    offset where the dot products have taken the zero point in (`QRowsAccess.zero_term`)."""
    lanes = scale.type  # (a multiply and explicit fused multiply-adds: the same bits in every kernel and context)
    scaled = f.fmul(f.b.sitofp(dot, lanes), scale, ())
    total = f.intrinsic("llvm.fma", scaled, f.splat(xd, lanes), total)
    return total if offset is None else f.intrinsic("llvm.fma", offset, f.splat(xs, lanes), total)


def _plane_element(fmt, name: str) -> ir.Type:
    """The LLVM element type of a packed weight's plane."""
    if name == "codes":
        return I8
    if name.startswith("bit"):
        return I64
    return F16 if fmt.field(name).dtype == "f16" else I8


class SplitWeight:
    """An integer-format `[N, K]` weight in the split layout at `base` (an `i8*`)."""

    def __init__(self, f: KernelBuilder, base: ir.Value, weight_type: WeightType):
        self.f = f
        self.fmt = FORMATS[weight_type.storage]
        self.n, self.k = weight_type.shape
        self.kp = padded_width(self.k)
        self.groups = self.kp // GROUP
        self.bits = self.fmt.bits
        self.planes = {p.name: p for p in weight_planes(weight_type.storage, weight_type.shape)}
        self.base = base
        self.code_bytes = self.kp if self.bits == 8 else self.kp // 2
        self.ptrs = {name: typed_ptr(f, base, p, self._element(name)) for name, p in self.planes.items()}

    def _element(self, name: str) -> ir.Type:
        return _plane_element(self.fmt, name)

    def codes(self, j: ir.Value, g: ir.Value) -> ir.Value:
        """The 64 unsigned codes of group `g` of row `j`: `<64 x i8>`."""
        f, b = self.f, self.f.b
        row = f.mul(j, self.code_bytes)
        if self.bits == 8:
            return load_vector(f, self.ptrs["codes"], f.add(row, f.mul(g, GROUP)), vec(I8, 64))
        raw = load_vector(f, self.ptrs["codes"], f.add(row, f.mul(g, GROUP // 2)), vec(I8, 32))
        low = b.and_(raw, splat_i(vec(I8, 32), 15))
        high = b.lshr(raw, splat_i(vec(I8, 32), 4))
        codes = shuffle(f, low, list(range(64)), high)
        for bit in range(4, self.bits):
            mask = b.load(f.ptr(self.ptrs[f"bit{bit}"], f.add(f.mul(j, self.groups), g)), align=8)
            plane = b.zext(b.bitcast(mask, vec(I1, 64)), vec(I8, 64))
            codes = b.or_(codes, b.shl(plane, splat_i(vec(I8, 64), bit)))
        return codes

    def prefetch(self, j: ir.Value, rows: int, g: ir.Value, ahead: int) -> None:
        """Prefetch (into L1) the codes `ahead` bytes past group `g` of rows j..j+rows, which lie
        together in the codes plane: a walk over them at `rows` groups' bytes per group, each
        cache line once."""
        f = self.f
        step = rows * (GROUP if self.bits == 8 else GROUP // 2)
        at = f.add(f.add(f.mul(j, self.code_bytes), f.mul(g, step)), ahead)
        for line in range(0, step, CACHE_LINE):
            prefetch(f, self.ptrs["codes"], f.add(at, line))

    def scale_step(self) -> int:
        """16-slices per scale change: 2 where every field spans whole 32-blocks, else 1."""
        return 2 if all(field.group % (2 * SLICE) == 0 for field in self.fmt.fields) else 1

    def _field(self, name: str, j: ir.Value, g: ir.Value, n: int) -> ir.Value:
        """A field's value for each of the `n` equal parts of group `g` of row `j` (4: its slices; 2: its
        32-blocks, where the field spans them): `<n x float>`."""
        f = self.f
        field = self.fmt.field(name)
        per_row = self.kp // field.group
        row = f.mul(j, per_row)
        ty = F16 if field.dtype == "f16" else I8
        distinct = max(1, GROUP // field.group)  # the field's values in one group
        assert distinct <= n, (name, n)
        if distinct > 1:
            v = load_vector(f, self.ptrs[name], f.add(row, f.mul(g, distinct)), vec(ty, distinct))
        else:
            per = field.group // GROUP
            one = f.b.load(f.ptr(self.ptrs[name], f.add(row, f.b.sdiv(g, f.i64(per)) if per > 1 else g)))
            v = f.b.insert_element(ir.Constant(vec(ty, 1), None), one, ir.Constant(I32, 0))
        if distinct < n:
            v = shuffle(f, v, [i * distinct // n for i in range(n)])
        return _to_float(f, v, field.dtype)

    def _product(self, names: tuple[str, ...], j: ir.Value, g: ir.Value, n: int) -> ir.Value:
        out = None
        for name in names:
            v = self._field(name, j, g, n)
            out = v if out is None else self.f.b.fmul(out, v)
        return out

    def scale(self, j: ir.Value, g: ir.Value, n: int = 4) -> ir.Value:
        """The scale of each of the `n` parts of group `g` of row `j` (`_field`)."""
        return self._product(self.fmt.scale, j, g, n)

    def zero(self, n: int = 4) -> ir.Value | None:
        zero = self.fmt.zero
        return ir.Constant(vec(F32, n), [float(zero)] * n) if zero is not None else None

    def minimum(self, j: ir.Value, g: ir.Value, n: int = 4) -> ir.Value | None:
        if not self.fmt.minimum:
            return None
        m = self._product(self.fmt.minimum, j, g, n)
        return self.f.b.fneg(m) if self.fmt.minimum_sign < 0 else m

    def offset(self, j: ir.Value, g: ir.Value, scale: ir.Value) -> ir.Value:
        """Per part (as `scale`'s), what multiplies the activations' sums: the minimum, or `−zero · scale`."""
        return weight_offset(self.f, self.fmt, self.minimum(j, g, scale.type.count), scale)

    def values(self, j: ir.Value, g: ir.Value, slices: int = 4) -> list[ir.Value]:
        """The dequantized weights of group `g` of row `j`: `slices` × `<16 x float>`.

        `(code − zero) · scale`, or `code · scale + minimum`: the arithmetic of GGUF's own
        dequantization, so the results are the same floats.
        """
        f, b = self.f, self.f.b
        codes = self.codes(j, g)
        scale = self.scale(j, g)
        zero, minimum = self.zero(), self.minimum(j, g)
        out = []
        for s in range(slices):
            u = b.uitofp(shuffle(f, codes, list(range(16 * s, 16 * s + 16))), vec(F32, 16))
            pick = [s] * 16
            if zero is not None:
                out.append(b.fmul(b.fsub(u, shuffle(f, zero, pick)), shuffle(f, scale, pick)))
            else:
                out.append(b.fadd(b.fmul(u, shuffle(f, scale, pick)), shuffle(f, minimum, pick)))
        return out


class TiledWeight:
    """An integer-format `[N, K]` weight in the tiles layout at `base` (an `i8*`), by strip of 16 rows.

    For strip `s` and 32-block `b`: `quads(s, b)` are the 8 vectors `<64 x i8>` of 4 codes
    × 16 features (a `vpdpbusd` operand each; together an AMX B tile), `scale16` and
    `offset16` a 16-slice's scale and activation-sum factor for the 16 features.
    """

    def __init__(self, f: KernelBuilder, base: ir.Value, weight_type: WeightType):
        self.f = f
        self.transposed = weight_type.layout is Layout.TILES_AVX2  # (its high-bit masks)
        self.fmt = FORMATS[weight_type.storage]
        self.n, self.k = weight_type.shape
        self.kp = padded_width(self.k)
        self.blocks = self.kp // TILE_K
        self.bits = self.fmt.bits
        self.block_bytes = STRIP * TILE_K if self.bits == 8 else STRIP * TILE_K // 2
        self.planes = {p.name: p for p in tile_planes(weight_type.storage, weight_type.shape)}
        self.ptrs = {name: typed_ptr(f, base, p, _plane_element(self.fmt, name)) for name, p in self.planes.items()}

    def _block(self, s: ir.Value, b: ir.Value) -> ir.Value:
        """Block b of strip s, counted from the first block."""
        return self.f.add(self.f.mul(s, self.blocks), b)

    def codes_ptr(self, s: ir.Value, b: ir.Value) -> ir.Value:
        """Where block b of strip s's codes start (an `i8*`)."""
        return self.f.b.gep(self.ptrs["codes"], [self.f.mul(self._block(s, b), self.block_bytes)])

    def quads(self, s: ir.Value, b: ir.Value) -> list[ir.Value]:
        """The 8 `<64 x i8>` code vectors of block b of strip s: quad q holds codes 4q..4q+3 of the 16 features.
        A high bit's mask in byte order is one `<64 x i1>` (AVX-512: `kmovq` and a masked move); transposed
        (`tiles_avx2`: bit 8m + k for byte 8k + m), it is broadcast to 8 lanes of 64 bits and lane k shifted by
        `bit − k` (AVX2: 7 instructions a quad and bit where the mask in byte order took 11; the 270M model's
        one-row decode step 4.38 → 4.17 ms on Zen 5)."""
        f, b_ = self.f, self.f.b
        start = f.mul(self._block(s, b), self.block_bytes)
        if self.bits == 8:
            return [load_vector(f, self.ptrs["codes"], f.add(start, 64 * q), vec(I8, 64)) for q in range(QUADS)]
        packed = [load_vector(f, self.ptrs["codes"], f.add(start, 64 * r), vec(I8, 64))
                  for r in range(QUADS // 2)]
        out = [b_.and_(p, splat_i(vec(I8, 64), 15)) for p in packed] + \
              [b_.lshr(p, splat_i(vec(I8, 64), 4)) for p in packed]
        for bit in range(4, self.bits):
            at = f.mul(self._block(s, b), QUADS)
            for q in range(QUADS):
                mask = b_.load(f.ptr(self.ptrs[f"bit{bit}"], f.add(at, q)), align=8)
                if self.transposed:
                    moved = b_.lshr(b_.shl(f.splat_i64(mask, 8), ir.Constant(vec(I64, 8), [max(bit - k, 0) for k in range(8)])),
                                    ir.Constant(vec(I64, 8), [max(k - bit, 0) for k in range(8)]))
                    plane = b_.and_(b_.bitcast(moved, vec(I8, 64)), splat_i(vec(I8, 64), 1 << bit))
                else:
                    plane = b_.shl(b_.zext(b_.bitcast(mask, vec(I1, 64)), vec(I8, 64)), splat_i(vec(I8, 64), bit))
                out[q] = b_.or_(out[q], plane)
        return out

    def prefetch(self, s: ir.Value, b: ir.Value, ahead: int, level: int = 1) -> None:
        """Prefetch (into L1; `level` 2: L2) what the block `ahead` code bytes past block b of strip s reads: every
        cache line of its codes (a 4-bit block is 4 lines; one prefetch per block left 3 of them to the hardware's
        prefetcher), and the line of each other plane (scales, minimums, high bits: streams of their own)."""
        f = self.f
        block = f.add(self._block(s, b), ahead // self.block_bytes)
        at = f.mul(block, self.block_bytes)
        for line in range(0, self.block_bytes, CACHE_LINE):
            prefetch(f, self.ptrs["codes"], f.add(at, line), level)
        for name in self.planes:
            if name.startswith("bit"):
                offset = f.mul(block, QUADS * 8)  # (an i64 per quad)
            elif name != "codes":
                field = self.fmt.field(name)
                offset = f.mul(f.b.sdiv(f.mul(block, TILE_K), f.i64(field.group)),
                               STRIP * (2 if field.dtype == "f16" else 1))
            else:
                continue
            prefetch(f, f.b.bitcast(self.ptrs[name], I8PTR), offset, level)

    def _field16(self, name: str, s: ir.Value, sl: ir.Value | int) -> ir.Value:
        """Field `name` of the 16 features of strip s for 16-slice `sl`: `<16 x float>`."""
        f = self.f
        field = self.fmt.field(name)
        per_strip = self.kp // field.group
        index = f.b.sdiv(f.mul(f.i64(sl), SLICE), f.i64(field.group)) if field.group > SLICE else f.i64(sl)
        at = f.mul(f.add(f.mul(s, per_strip), index), STRIP)
        ty = F16 if field.dtype == "f16" else I8
        return _to_float(f, load_vector(f, self.ptrs[name], at, vec(ty, STRIP), align=2), field.dtype)

    def _product16(self, names: tuple[str, ...], s: ir.Value, sl) -> ir.Value:
        out = None
        for name in names:
            v = self._field16(name, s, sl)
            out = v if out is None else self.f.b.fmul(out, v)
        return out

    def scale16(self, s: ir.Value, sl) -> ir.Value:
        return self._product16(self.fmt.scale, s, sl)

    def offset16(self, s: ir.Value, sl, scale16: ir.Value) -> ir.Value:
        """What multiplies the activations' slice sums: the minimum, or `−zero · scale`."""
        minimum = None
        if self.fmt.minimum:
            m = self._product16(self.fmt.minimum, s, sl)
            minimum = self.f.b.fneg(m) if self.fmt.minimum_sign < 0 else m
        return weight_offset(self.f, self.fmt, minimum, scale16)

    def scale_step(self) -> int:
        """16-slices per scale change: 2 where every field spans whole 32-blocks, else 1."""
        return 2 if all(field.group % TILE_K == 0 for field in self.fmt.fields) else 1


def q8_block(f: KernelBuilder, v0: ir.Value, v1: ir.Value, qmax: int = 127) -> tuple[ir.Value, list[ir.Value]]:
    """32 floats (two `<16 x float>`) quantized as `formats.quantize_rows` does: the scale
    `d = amax / qmax` and the values `roundeven(x · qmax / amax)` as two `<16 x i32>` (`qmax`
    127 for int8; `QMAX[16]` = 32512 for int16 rows)."""
    b = f.b
    # (a NaN value has no defined code either way)
    amax = f.reduce_max(f.fmax(*(f.intrinsic("llvm.fabs", v) for v in (v0, v1))))
    inv = b.select(b.fcmp_ordered(">", amax, f.f32(0.0)), b.fdiv(f.f32(float(qmax)), amax), f.f32(0.0))
    inv16 = f.splat(inv, vec(F32, 16))
    return b.fdiv(amax, f.f32(float(qmax))), [b.fptosi(f.intrinsic("llvm.roundeven", b.fmul(v, inv16)), vec(I32, 16))
                                              for v in (v0, v1)]


class QRowsAccess:
    """Quantized activation rows (`!tgt.qrows<R x W>`, int8 or int16) at `base` (an `i8*`), row by row.

    Int16 rows are two int8 planes (`hi`, `lo`: `planes` is 2): a reader takes each plane's
    values (`qs(t, g, plane)`) through the int8 dot products and joins the two sums as
    `(dot_hi << 8) + dot_lo` (no overflow: 4 products of 255 · 127, shifted, stay below 2^31)."""

    def __init__(self, f: KernelBuilder, base: ir.Value, qrows: QRowsType):
        self.f = f
        self.base = base
        self.row = qrows.layout
        self.wp = self.row.wp
        self.width = qrows.width
        self.bits = qrows.bits
        self.planes = self.row.planes
        self.capacity = qrows.rows  # the most rows the buffer holds

    def from_row(self, base: ir.Value) -> QRowsAccess:
        """The same rows' layout with row 0 at `base` (an `i8*`: a row of this buffer, or a copy of rows)."""
        other = copy.copy(self)
        other.base = base
        return other

    def _at(self, t: ir.Value, offset: int, element: ir.Type) -> ir.Value:
        f = self.f
        p = f.b.gep(self.base, [f.add(f.mul(t, self.row.row_bytes), offset)], inbounds=True)
        return f.b.bitcast(p, element.as_pointer())

    def qs_ptr(self, t: ir.Value, plane: int = 0) -> ir.Value:
        """Row t's int8 values (of int16 rows: plane 0 `hi`, plane 1 `lo`)."""
        return self._at(t, plane * self.wp, I8)

    def block_scales(self, t: ir.Value, sl: ir.Value, slices: int, summed: bool = True
                     ) -> tuple[ir.Value, ir.Value | None]:
        """Row t's scale and sum over `slices` 16-slices from slice `sl` (one scale block); no sum unless
        `summed` (a dot product that took its zero point in has no offset term to scale it by)."""
        f = self.f
        if not summed:
            return f.load(self.d_ptr(t), sl), None
        total = f.load(self.s_ptr(t), sl)
        for extra in range(1, slices):
            total = f.fadd(total, f.load(self.s_ptr(t), f.add(sl, extra)))
        return f.load(self.d_ptr(t), sl), total

    def d_ptr(self, t: ir.Value) -> ir.Value:
        """Row t's scales, one per 16-value slice (each 32-block's twice)."""
        return self._at(t, self.row.d_offset, F32)

    def s_ptr(self, t: ir.Value) -> ir.Value:
        """Row t's sums d · Σq, one per 16-value slice."""
        return self._at(t, self.row.s_offset, F32)

    def n_ptr(self, t: ir.Value) -> ir.Value:
        """Row t's integer sums Σq, one per 16-value slice."""
        return self._at(t, self.row.n_offset, I32)

    def zero_term(self, t: ir.Value, sl: ir.Value, slices: int, zero: int) -> ir.Value:
        """`−zero · Σq` of row t over `slices` 16-slices from slice `sl`, in 16 int32 lanes: what a
        dot product with codes of zero point `zero` adds to be the weights' (exact: below 2^31)."""
        f, lanes = self.f, vec(I32, 16)
        total = None
        for i in range(slices):  # (broadcast loads, and a multiply by a power of two: off the multiply pipes)
            n = f.splat(f.load(self.n_ptr(t), f.add(sl, i)), lanes)
            total = n if total is None else f.b.add(total, n)
        return f.b.mul(total, splat_i(lanes, -zero))

    def words(self, t: ir.Value, k: ir.Value) -> ir.Value:
        """Row t's values k..k+31 (k a multiple of 32) as `<32 x i16>`: int8 rows widened, int16 rows'
        planes joined (`256 · hi + lo`, within ±`QMAX[16]`)."""
        b = self.f.b
        planes = [b.sext(load_vector(self.f, self.qs_ptr(t, plane), k, vec(I8, 32)), vec(I16, 32))
                  for plane in range(self.planes)]
        return planes[0] if self.planes == 1 else b.add(b.shl(planes[0], splat_i(vec(I16, 32), 8)), planes[1])

    def joined(self, dots: list[ir.Value]) -> ir.Value:
        """A block's int32 dot products, one per plane, as the rows' own: int16 rows' `(hi << 8) + lo`."""
        if self.planes == 1:
            return dots[0]
        return self.f.b.add(self.f.b.shl(dots[0], splat_i(dots[0].type, 8)), dots[1])

    def qs(self, t: ir.Value, g: ir.Value, plane: int = 0) -> ir.Value:
        return load_vector(self.f, self.qs_ptr(t, plane), self.f.mul(g, GROUP), vec(I8, 64))

    def group_scales(self, t: ir.Value, g: ir.Value, n: int = 4) -> tuple[ir.Value, ir.Value]:
        """Row t's scale and sum for each of the `n` parts of 64-group `g` (4: its slices; 2: its
        32-blocks, the sum of their two slices'): two `<n x float>`."""
        f = self.f
        d = load_vector(f, self.d_ptr(t), f.mul(g, 4), vec(F32, 4), align=4)
        s = load_vector(f, self.s_ptr(t), f.mul(g, 4), vec(F32, 4), align=4)
        if n == 4:
            return d, s
        return shuffle(f, d, [0, 2]), f.fadd(shuffle(f, s, [0, 2]), shuffle(f, s, [1, 3]))

    def store_block(self, t: ir.Value, block: int | ir.Value, v0: ir.Value, v1: ir.Value) -> None:
        """Quantize 32 floats (two `<16 x float>`) into block `block` of row `t`.

        `d = amax / Q`, `q = roundeven(x · (Q / amax))`, `s = d · Σ q` per slice (`Q` 127, or
        32512 for int16 rows, stored as `hi = (q + 128) >> 8`, `lo = q − 256·hi`): the same
        float operations as `formats.quantize_rows`, so the bytes are identical.
        Whoever stores a row's last block also zeroes the padding after it (to a whole
        64-group), so readers of whole groups see zeros there.
        """
        f = self.f
        block = f.i64(block)
        self._store(t, block, v0, v1)
        if self.width % GROUP:
            last = self.width // ACT_BLOCK - 1
            with f.when(f.b.icmp_signed("==", block, f.i64(last))):
                zero = ir.Constant(vec(F32, 16), [0.0] * 16)
                self._store(t, f.i64(last + 1), zero, zero)

    def _store(self, t: ir.Value, block: ir.Value, v0: ir.Value, v1: ir.Value) -> None:
        f, b = self.f, self.f.b
        qs = [self.qs_ptr(t, plane) for plane in range(self.planes)]
        d_ptr, s_ptr, n_ptr = self.d_ptr(t), self.s_ptr(t), self.n_ptr(t)
        d, halves = q8_block(f, v0, v1, QMAX[self.bits])
        at_qs, at_d = f.mul(block, 32), f.mul(block, 2)
        radd = declare(f, "llvm.vector.reduce.add.v16i32", I32, [vec(I32, 16)])
        for half, q in enumerate(halves):
            if self.planes == 1:
                planes = [q]
            else:
                hi = b.ashr(b.add(q, splat_i(q.type, 128)), splat_i(q.type, 8))
                planes = [hi, b.sub(q, b.shl(hi, splat_i(q.type, 8)))]
            for ptr, values in zip(qs, planes):
                p = b.bitcast(f.ptr(ptr, f.add(at_qs, 16 * half)), vec(I8, 16).as_pointer())
                b.store(b.trunc(values, vec(I8, 16)), p, align=1)
            total = b.call(radd, [q])
            f.store(d, d_ptr, f.add(at_d, half))
            f.store(b.fmul(d, b.sitofp(total, F32)), s_ptr, f.add(at_d, half))
            f.store(total, n_ptr, f.add(at_d, half))


def dot_slices(isa: Isa) -> tuple[int, ...]:
    """The 16-slice each lane of `integer_dot`'s sums belongs to: 16 lanes of 4 products (lane l:
    slice l // 4), or on 256-bit paths 8 lanes of 8 (the two 32-blocks' sums joined by a horizontal
    add, `vphaddd` or on AVX2's bytes `vphaddw`, which interleaves their 128-bit halves)."""
    if isa in (Isa.AVX2, Isa.VNNI256):
        return (0, 0, 2, 2, 1, 1, 3, 3)
    return tuple(lane // 4 for lane in range(16))


def integer_dot(f: KernelBuilder, isa: Isa, codes: ir.Value, x: ir.Value, bits: int, times: int = 1) -> ir.Value:
    """64 unsigned codes × 64 int8 values → the int32 sums of `dot_slices(isa)`'s lanes (times `times`,
    a power of two). AVX2 takes codes below 8 bits only (`vpmaddubsw`'s pairs of products must not
    saturate: `words_dot` takes 8-bit codes)."""
    b = f.b
    if isa is Isa.VNNI512:
        return _times(f, vpdpbusd(f, ir.Constant(vec(I32, 16), [0] * 16), codes, x), times)
    halves = [(shuffle(f, codes, list(range(h, h + 32))), shuffle(f, x, list(range(h, h + 32)))) for h in (0, 32)]
    if isa is Isa.VNNI256:
        fn = declare(f, "llvm.x86.avx512.vpdpbusd.256", vec(I32, 8), [vec(I32, 8), vec(I8, 32), vec(I8, 32)])
        parts = [b.call(fn, [ir.Constant(vec(I32, 8), [0] * 8), c, v]) for c, v in halves]
        return _times(f, _phaddd(f, *parts), times)
    if isa is Isa.AVX2:
        assert bits < 8, "8-bit codes take 16-bit words on AVX2 (rows_dot)"
        maddubs = declare(f, "llvm.x86.avx2.pmadd.ub.sw", vec(I16, 16), [vec(I8, 32), vec(I8, 32)])
        phaddw = declare(f, "llvm.x86.avx2.phadd.w", vec(I16, 16), [vec(I16, 16), vec(I16, 16)])
        # codes ≤ 63: pairs of products, and pairs of those (4 · 63 · 127 < 2^15), fit in i16
        quads = b.call(phaddw, [b.call(maddubs, [c, v]) for c, v in halves])
        return _times(f, _pmaddwd(f, quads, splat_i(vec(I16, 16), 1)), times)
    wide = b.mul(b.zext(codes, vec(I32, 64)), b.sext(x, vec(I32, 64)))
    total = None
    for i in range(4):
        part = shuffle(f, wide, list(range(i, 64, 4)))
        total = part if total is None else b.add(total, part)
    return _times(f, total, times)


def _times(f: KernelBuilder, lanes: ir.Value, times: int) -> ir.Value:
    return lanes if times == 1 else f.b.shl(lanes, splat_i(lanes.type, times.bit_length() - 1))


def _phaddd(f: KernelBuilder, a: ir.Value, c: ir.Value) -> ir.Value:
    """Two 32-blocks' 8 lanes (lanes 0–3 of slice 2h, 4–7 of slice 2h + 1) → 8, pairs added (`dot_slices`)."""
    fn = declare(f, "llvm.x86.avx2.phadd.d", vec(I32, 8), [vec(I32, 8), vec(I32, 8)])
    return f.b.call(fn, [a, c])


def _pmaddwd(f: KernelBuilder, a: ir.Value, c: ir.Value) -> ir.Value:
    fn = declare(f, "llvm.x86.avx2.pmadd.wd", vec(I32, 8), [vec(I16, 16), vec(I16, 16)])
    return f.b.call(fn, [a, c])


def _words(f: KernelBuilder, low: ir.Value, high: ir.Value, h: int) -> list[ir.Value]:
    """Bytes 32h..32h+31 of two `<64 x i8>` as two `<16 x i16>` (`low` the low bytes, `high` the high
    ones), in `vpunpck{l,h}bw` order: bytes 0–7 and 16–23 of the half, then 8–15 and 24–31."""
    out = []
    for first in (0, 8):
        picks = [32 * h + first + (w if w < 8 else w + 8) for w in range(16)]
        pairs = [i for p in picks for i in (p, 64 + p)]
        out.append(f.b.bitcast(shuffle(f, low, pairs, high), vec(I16, 16)))
    return out


def words_dot(f: KernelBuilder, codes: ir.Value, xs: list[ir.Value]) -> ir.Value:
    """AVX2, 8-bit codes (or int16 rows): codes and values widened to 16-bit words, one `vpmaddwd` per 16
    (no byte pair can saturate), lanes as `integer_dot`'s; an int16 row's planes joined as
    `256 · hi + lo` before the products."""
    b = f.b
    zero = ir.Constant(vec(I8, 64), [0] * 64)
    negative = b.sext(b.icmp_signed("<", xs[-1], zero), vec(I8, 64))  # the sign of the low bytes
    high = negative if len(xs) == 1 else b.add(xs[0], negative)  # 256 · hi + lo = 256 · (hi − [lo < 0]) + (lo & 255)
    parts = []
    for h in (0, 1):
        c, v = _words(f, codes, zero, h), _words(f, xs[-1], high, h)
        parts.append(b.add(_pmaddwd(f, c[0], v[0]), _pmaddwd(f, c[1], v[1])))
    return _phaddd(f, *parts)


def rows_dot(f: KernelBuilder, isa: Isa, codes: ir.Value, xs: list[ir.Value], bits: int) -> ir.Value:
    """64 codes × a row's 64 values, given as its int8 planes (`QRowsAccess.qs`): lanes as
    `integer_dot`'s; for int16 rows `256 · dot(codes, hi) + dot(codes, lo)`. On AVX2, 8-bit codes and
    int16 rows take `words_dot` (one `vpmaddwd` per 16 values, where bytes took two multiplies)."""
    if isa is Isa.AVX2 and (bits == 8 or len(xs) == 2):
        return words_dot(f, codes, xs)
    if len(xs) == 1:
        return integer_dot(f, isa, codes, xs[0], bits)
    hi, lo = xs
    return f.b.add(integer_dot(f, isa, codes, hi, bits, times=256), integer_dot(f, isa, codes, lo, bits))
