"""Byte layouts of the target level: packed weights and quantized activation rows.

A `tgt` weight is in one of two layouts (`!tgt.weight<576x576, q4_1, split>`):

- `stored`: as the model file keeps it, row-major (float formats; GGUF blocks).
- `split`: integer formats repacked for SIMD loads. Each row's codes are cut into
  groups of 64 weights; a 4-, 5- or 6-bit group is 32 bytes whose low nibbles are
  weights 0–31 and high nibbles weights 32–63, so unpacking is one `and` and one
  shift; bit 4 (and 5) of the codes follow as one 64-bit mask per group (`bit4`,
  `bit5`); 8-bit codes are plain bytes. The format's fields (scales, minimums, zero
  points) follow as planes of their own, `[rows, K / group]`, one byte or f16 each
  (q4_k/q5_k's 6-bit scales take a byte: +2.8% for q4_k). Rows are padded to a
  multiple of 64 weights with zero codes and fields; planes are 64-byte aligned.

Quantized activation rows (`!tgt.qrows<128x576>`) hold, per row of width `W` (padded
to `Wp`, a multiple of 64): `qs int8[Wp]` (the values, quantized per 32 by
`formats.quantize_rows`), `d f32[Wp/16]` (each 16-slice's scale, shared by the two
slices of a 32-block) and `s f32[Wp/16]` (each slice's `d · Σ qs`, for the minimum
terms of the weights), the row padded to 64 bytes. Kernels address a row without
knowing how many rows the buffer holds.

    planes = weight_planes(Storage.Q4_1, (576, 576))   # codes, d, m with offsets
    data = pack_split(qt)                               # bytes for weights.bin
    qt == unpack_split(data, Storage.Q4_1, (576, 576))  # (up to the padding)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from llmc.ir.formats import FORMATS, GROUP, SLICE, QuantizedTensor, Storage, padded_width, round_up

ALIGN = 64  # bytes: planes, weights and buffers start at multiples of it


class Layout(StrEnum):
    """How a weight's bytes are arranged in the artifact."""

    STORED = "stored"
    SPLIT = "split"


@dataclass(frozen=True)
class Plane:
    """One array of a packed tensor: `rows × per_row` values of `dtype`, at `offset` bytes."""

    name: str
    dtype: np.dtype
    rows: int
    per_row: int
    offset: int

    @property
    def row_bytes(self) -> int:
        return self.per_row * self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.rows * self.row_bytes

    def view(self, buffer: np.ndarray) -> np.ndarray:
        """This plane of `buffer` (uint8), as `[rows, per_row]` of `dtype`."""
        return buffer[self.offset : self.offset + self.nbytes].view(self.dtype).reshape(self.rows, self.per_row)


def align(n: int) -> int:
    """`n` bytes rounded up to the alignment of planes, weights and arena buffers."""
    return round_up(n, ALIGN)


def _planes(specs: list[tuple[str, np.dtype, int, int]]) -> list[Plane]:
    out, offset = [], 0
    for name, dtype, rows, per_row in specs:
        plane = Plane(name, np.dtype(dtype), rows, per_row, offset)
        out.append(plane)
        offset = align(offset + plane.nbytes)
    return out


def weight_planes(storage: Storage, shape: tuple[int, ...]) -> list[Plane]:
    """The planes of an integer-format `[N, K]` weight in the split layout."""
    fmt = FORMATS[storage]
    assert fmt.bits is not None, f"{storage} is not an integer format"
    n, k = shape
    kp = padded_width(k)
    specs: list[tuple[str, np.dtype, int, int]] = [("codes", np.uint8, n, kp if fmt.bits == 8 else kp // 2)]
    for bit in range(4, fmt.bits if fmt.bits < 8 else 4):
        specs.append((f"bit{bit}", np.uint64, n, kp // GROUP))
    for f in fmt.fields:
        specs.append((f.name, f.numpy, n, kp // f.group))
    return _planes(specs)


def weight_nbytes(storage: Storage, layout: Layout, shape: tuple[int, ...]) -> int:
    if layout is Layout.SPLIT:
        planes = weight_planes(storage, shape)
        return align(planes[-1].offset + planes[-1].nbytes)
    return FORMATS[storage].nbytes(shape)


def pack_split(qt: QuantizedTensor) -> np.ndarray:
    """The split-layout bytes of a quantized tensor."""
    fmt = FORMATS[qt.storage]
    n, k = qt.shape
    kp = padded_width(k)
    codes = np.zeros((n, kp), np.uint8)
    codes[:, :k] = qt.codes
    groups = codes.reshape(n, kp // GROUP, GROUP)
    planes = weight_planes(qt.storage, qt.shape)
    out = np.zeros(weight_nbytes(qt.storage, Layout.SPLIT, qt.shape), np.uint8)
    for plane in planes:
        dst = plane.view(out)
        if plane.name == "codes":
            low = groups & 15
            dst[...] = codes if fmt.bits == 8 else (low[..., :32] | (low[..., 32:] << 4)).reshape(n, kp // 2)
        elif plane.name.startswith("bit"):
            bit = int(plane.name[3:])
            mask = np.packbits((groups >> bit) & 1, axis=-1, bitorder="little")  # [n, G, 8] bytes
            dst[...] = np.ascontiguousarray(mask).view("<u8").reshape(n, kp // GROUP)
        else:
            values = qt.fields[plane.name]
            dst[:, : values.shape[1]] = values
    return out


def unpack_split(data: np.ndarray, storage: Storage, shape: tuple[int, int]) -> QuantizedTensor:
    """The quantized tensor in split-layout bytes (the padding dropped)."""
    fmt = FORMATS[storage]
    n, k = shape
    kp = padded_width(k)
    buffer = np.asarray(data, np.uint8)
    codes = np.zeros((n, kp // GROUP, GROUP), np.uint8)
    fields = {}
    for plane in weight_planes(storage, shape):
        src = plane.view(buffer)
        if plane.name == "codes":
            if fmt.bits == 8:
                codes[...] = src.reshape(n, kp // GROUP, GROUP)
            else:
                nib = src.reshape(n, kp // GROUP, 32)
                codes[...] = np.concatenate([nib & 15, nib >> 4], axis=-1)
        elif plane.name.startswith("bit"):
            bit = int(plane.name[3:])
            mask = np.ascontiguousarray(src).view(np.uint8).reshape(n, kp // GROUP, 8)
            codes |= np.unpackbits(mask, axis=-1, bitorder="little") << bit
        else:
            fields[plane.name] = np.ascontiguousarray(src[:, : k // fmt.field(plane.name).group])
    return QuantizedTensor(storage, np.ascontiguousarray(codes.reshape(n, kp)[:, :k]), fields)


# ------------------------------------------------------------- quantized activations


@dataclass(frozen=True)
class QRowLayout:
    """One quantized activation row of `width` values: `qs`, then `d`, then `s`, `row_bytes` apart."""

    width: int

    @property
    def wp(self) -> int:
        return padded_width(self.width)

    @property
    def slices(self) -> int:
        return self.wp // SLICE

    @property
    def d_offset(self) -> int:
        return self.wp

    @property
    def s_offset(self) -> int:
        return self.wp + 4 * self.slices

    @property
    def row_bytes(self) -> int:
        return align(self.s_offset + 4 * self.slices)

    def views(self, buffer: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """`(qs int8[R, Wp], d f32[R, Wp/16], s f32[R, Wp/16])`: views of the rows in `buffer` (uint8)."""
        table = buffer[: rows * self.row_bytes].reshape(rows, self.row_bytes)
        return (table[:, : self.wp].view(np.int8), table[:, self.d_offset : self.s_offset].view(np.float32),
                table[:, self.s_offset : self.s_offset + 4 * self.slices].view(np.float32))


def qrows_nbytes(rows: int, width: int) -> int:
    return rows * QRowLayout(width).row_bytes
