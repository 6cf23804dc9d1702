"""How a CUDA kernel reads a `tgt` weight: packed codes dequantized in registers.

Integer weights are in the `split` layout (`llmc.ir.layouts`): per row, the codes of
each 64-weight group (32 bytes at 4–6 bits, 64 at 8 bits), the high bits as one
64-bit mask per group, and each field (scale, minimum) as a plane of its own. A lane
reads one 4-byte word of codes at a time, so a warp's 32 lanes read 128 consecutive
bytes. At 4–6 bits the word at unit `u` holds weights `64g + 4j + b` (low nibbles) and
`64g + 32 + 4j + b` (high nibbles), `g = u / 8`, `j = u % 8`, `b < 4`; at 8 bits
weights `4u + b`. Four consecutive weights share one 16-weight slice, so one scale
serves each quad. Float weights (`f32`, `f16`, `bf16`, stored row-major) are read one
weight per unit.

    w = WeightRows(f, weight_ptr, weight_type)
    for k, value in w.unit(row, u): ...      # the weights of unit u of a row
    value = w.element(row, k)                 # one weight (the embedding gather)
"""

from __future__ import annotations

from llvmlite import ir

from llmc.backends.builder import F32, I32, I64, KernelBuilder
from llmc.ir import tgt
from llmc.ir.formats import FORMATS, GROUP, Storage, padded_width
from llmc.ir.layouts import Layout, weight_planes

I8 = ir.IntType(8)
I16 = ir.IntType(16)
F16 = ir.HalfType()
I8PTR = I8.as_pointer()


def typed(f: KernelBuilder, base: ir.Value, byte_offset: ir.Value | int, ty: ir.Type) -> ir.Value:
    """`(ty*)(base + byte_offset)` for an `i8*` base."""
    return f.b.bitcast(f.b.gep(base, [f.i64(byte_offset)], inbounds=True), ty.as_pointer())


def load_f16(f: KernelBuilder, base: ir.Value, index: ir.Value) -> ir.Value:
    return f.b.fpext(f.b.load(typed(f, base, f.mul(index, 2), F16), align=2), F32)


def load_bf16(f: KernelBuilder, base: ir.Value, index: ir.Value) -> ir.Value:
    bits = f.b.zext(f.b.load(typed(f, base, f.mul(index, 2), I16), align=2), I32)
    return f.b.bitcast(f.b.shl(bits, ir.Constant(I32, 16)), F32)


class WeightRows:
    """The weight `[N, K]` at `base`, read a unit at a time: one 4-byte word of codes (`runs`), 16 bytes
    (`wide_runs`), or one float."""

    def __init__(self, f: KernelBuilder, base: ir.Value, weight_type: tgt.WeightType):
        self.f, self.base, self.type = f, base, weight_type
        self.storage = weight_type.storage
        self.n, self.k = weight_type.shape[0], weight_type.shape[-1]
        self.fmt = FORMATS[self.storage]
        if self.storage.is_float:
            if weight_type.layout is not Layout.STORED:
                raise ValueError(f"cuda: float weights are read as stored, not {weight_type.layout}")
            self.units, self.per_unit = self.k, 1
        else:
            if weight_type.layout is not Layout.SPLIT:
                raise ValueError(f"cuda: integer weights are read in the split layout, not {weight_type.layout}")
            self.planes = {p.name: p for p in weight_planes(self.storage, (self.n, self.k))}
            kp = padded_width(self.k)
            self.bytes = self.fmt.bits == 8  # one code a byte (else nibbles and bit planes)
            self.units, self.per_unit = (kp // 4, 4) if self.bytes else (kp // 8, 8)

    @property
    def padded(self) -> bool:
        """Whether units reach past K (the zero padding of a split row): callers mask x there."""
        return self.units * self.per_unit > self.k

    # ---------------------------------------------------------------- float formats

    def _float(self, row: ir.Value, k: ir.Value) -> ir.Value:
        f, index = self.f, self.f.add(self.f.mul(row, self.k), k)
        if self.storage is Storage.F32:
            return f.b.load(typed(f, self.base, f.mul(index, 4), F32), align=4)
        if self.storage is Storage.F16:
            return load_f16(f, self.base, index)
        if self.storage is Storage.BF16:
            return load_bf16(f, self.base, index)
        raise ValueError(f"cuda: no reader for {self.storage}")

    # ---------------------------------------------------------------- integer formats

    def _plane(self, name: str, row: ir.Value, index: ir.Value, ty: ir.Type, size: int) -> ir.Value:
        p, f = self.planes[name], self.f
        offset = f.add(f.add(p.offset, f.mul(row, p.row_bytes)), f.mul(index, size))
        return f.b.load(typed(f, self.base, offset, ty), align=size)

    def _field(self, name: str, row: ir.Value, k: ir.Value) -> ir.Value:
        f, field = self.f, self.fmt.field(name)
        index = f.b.udiv(k, f.i64(field.group))
        if field.dtype == "f16":
            return f.b.fpext(self._plane(name, row, index, F16, 2), F32)
        value = self._plane(name, row, index, I8, 1)
        return f.b.uitofp(value, F32) if field.dtype == "u8" else f.b.sitofp(value, F32)

    def _product(self, names: tuple[str, ...], row: ir.Value, k: ir.Value) -> ir.Value:
        out = None
        for name in names:
            v = self._field(name, row, k)
            out = v if out is None else self.f.fmul(out, v)
        assert out is not None
        return out

    def _dequantizer(self, row: ir.Value, k: ir.Value):
        """A function code (i32) → weight for the slice of weight `k` (its fields loaded once)."""
        f, fmt = self.f, self.fmt
        scale = self._product(fmt.scale, row, k)
        if fmt.zero is not None:
            zero = ir.Constant(I32, fmt.zero)
            return lambda code: f.fmul(scale, f.b.sitofp(f.b.sub(code, zero), F32))
        minimum = self._product(fmt.minimum, row, k)
        if fmt.minimum_sign < 0:
            minimum = f.b.fneg(minimum)
        return lambda code: f.fadd(f.fmul(scale, f.b.uitofp(code, F32)), minimum)

    def _high_bits(self, row: ir.Value, group: ir.Value) -> list[tuple[int, ir.Value]]:
        return [(bit, self._plane(f"bit{bit}", row, group, I64, 8)) for bit in range(4, self.fmt.bits)]

    def _with_high_bits(self, code: ir.Value, masks: list[tuple[int, ir.Value]], index: ir.Value) -> ir.Value:
        """`code` with bits 4.. taken from bit `index` (i64, within the group) of each mask."""
        f = self.f
        for bit, mask in masks:
            one = f.b.trunc(f.b.and_(f.b.lshr(mask, index), f.i64(1)), I32)
            code = f.b.or_(code, f.b.shl(one, ir.Constant(I32, bit)))
        return code

    def unit(self, row: ir.Value, u: ir.Value) -> list[tuple[ir.Value, ir.Value]]:
        """`(k, weight)` of each weight of unit `u` of `row` (f32 values)."""
        return [(self.f.add(k0, i), v) for k0, values in self.runs(row, u) for i, v in enumerate(values)]

    def runs(self, row: ir.Value, u: ir.Value) -> list[tuple[ir.Value, list[ir.Value]]]:
        """The weights of unit `u` of `row` as runs of consecutive ones: `(first k, [f32 values])`."""
        f = self.f
        if self.storage.is_float:
            return [(u, [self._float(row, u)])]
        word = self._plane("codes", row, u, I32, 4)
        if self.bytes:
            k0 = f.mul(u, 4)
            dq = self._dequantizer(row, k0)
            return [(k0, [dq(f.b.and_(f.b.lshr(word, ir.Constant(I32, 8 * b)), ir.Constant(I32, 255)))
                          for b in range(4)])]
        group, j = f.b.udiv(u, f.i64(8)), f.b.urem(u, f.i64(8))
        masks = self._high_bits(row, group)
        out = []
        for half in (0, 1):
            within = f.add(f.mul(j, 4), 32 * half)  # index of the quad's first weight in the group
            k0 = f.add(f.mul(group, GROUP), within)
            dq = self._dequantizer(row, k0)
            values = []
            for b in range(4):
                code = f.b.and_(f.b.lshr(word, ir.Constant(I32, 8 * b + 4 * half)), ir.Constant(I32, 15))
                values.append(dq(self._with_high_bits(code, masks, f.add(within, b))))
            out.append((k0, values))
        return out

    WIDE = 4  # words of a wide unit: 16 bytes a lane, one 16-weight slice (8 bits) or two (4–6 bits)

    @property
    def wide_units(self) -> int:
        """Units of 16 code bytes per row (`wide_runs`); float formats keep one weight per unit."""
        return self.units if self.storage.is_float else self.units // self.WIDE

    def wide_runs(self, row: ir.Value, u: ir.Value) -> list[tuple[ir.Value, list[ir.Value]]]:
        """Like `runs`, for 16 bytes of codes read at once: at 8 bits one run of 16 weights, at 4–6 bits
        two (`64g + 16h + i` and `64g + 32 + 16h + i`, `g = u / 2`, `h = u % 2`); one scale per run."""
        f, b = self.f, self.f.b
        if self.storage.is_float:
            return self.runs(row, u)
        p = self.planes["codes"]
        offset = f.add(f.add(p.offset, f.mul(row, p.row_bytes)), f.mul(u, 16))
        vector = b.load(typed(f, self.base, offset, ir.VectorType(I32, 4)), align=16)
        words = [b.extract_element(vector, ir.Constant(I32, w)) for w in range(4)]
        if self.bytes:
            k0 = f.mul(u, 16)
            dq = self._dequantizer(row, k0)
            return [(k0, [dq(b.and_(b.lshr(word, ir.Constant(I32, 8 * i)), ir.Constant(I32, 255)))
                          for word in words for i in range(4)])]
        group, h = b.udiv(u, f.i64(2)), b.urem(u, f.i64(2))
        masks = self._high_bits(row, group)
        out = []
        for half in (0, 1):
            within = f.add(f.mul(h, 16), 32 * half)
            k0 = f.add(f.mul(group, GROUP), within)
            dq = self._dequantizer(row, k0)
            bits = [(bit, b.trunc(b.lshr(mask, within), I32)) for bit, mask in masks]  # this run's 16 bits
            values = []
            for w, word in enumerate(words):
                for i in range(4):
                    code = b.and_(b.lshr(word, ir.Constant(I32, 8 * i + 4 * half)), ir.Constant(I32, 15))
                    for bit, run_bits in bits:
                        one = b.and_(b.lshr(run_bits, ir.Constant(I32, 4 * w + i)), ir.Constant(I32, 1))
                        code = b.or_(code, b.shl(one, ir.Constant(I32, bit)))
                    values.append(dq(code))
            out.append((k0, values))
        return out

    def element(self, row: ir.Value, k: ir.Value) -> ir.Value:
        """Weight `k` of `row`, alone."""
        f = self.f
        if self.storage.is_float:
            return self._float(row, k)
        dq = self._dequantizer(row, k)
        if self.bytes:
            return dq(f.b.zext(self._plane("codes", row, k, I8, 1), I32))
        group, within = f.b.udiv(k, f.i64(GROUP)), f.b.urem(k, f.i64(GROUP))
        byte = f.b.zext(self._plane("codes", row, f.add(f.mul(group, 32), f.b.urem(within, f.i64(32))), I8, 1), I32)
        shift = f.b.trunc(f.mul(f.b.udiv(within, f.i64(32)), 4), I32)
        code = f.b.and_(f.b.lshr(byte, shift), ir.Constant(I32, 15))
        return dq(self._with_high_bits(code, self._high_bits(row, group), within))
