"""Byte layouts of the target level: packed weights and quantized activation rows.

A `tgt` weight is in one of four layouts (`!tgt.weight<576x576, q4_1, tiles>`):

- `stored`: as the model file keeps it, row-major (float formats; GGUF blocks).
- `split`: integer formats repacked for SIMD loads. Each row's codes are cut into
  groups of 64 weights; a 4-, 5- or 6-bit group is 32 bytes whose low nibbles are
  weights 0–31 and high nibbles weights 32–63, so unpacking is one `and` and one
  shift; bit 4 (and 5) of the codes follow as one 64-bit mask per group (`bit4`,
  `bit5`); 8-bit codes are plain bytes. The format's fields (scales, minimums, zero
  points) follow as planes of their own, `[rows, K / group]`, one byte or f16 each
  (q4_k/q5_k's 6-bit scales take a byte: +2.8% for q4_k). Rows are padded to a
  multiple of 64 weights with zero codes and fields; planes are 64-byte aligned.
- `tiles`: integer formats in strips of 16 rows (output features) × blocks of 32
  weights, the layout of a VNNI / AMX-INT8 operand `[8 quads][16 features][4 weights]`:
  one 64-byte vector holds 4 consecutive weights of 16 features, so a `vpdpbusd` with
  4 broadcast activation bytes yields 16 features' partial sums (no horizontal sums),
  and a block's 8 vectors are an AMX B tile as they are. 4-bit codes pack quads q and
  q+4 of a block into one byte (low and high nibble: 256 bytes a block); bits 4 and 5
  follow as one 64-bit mask per quad row (bit i: the quad's byte i, one `kmovq` for
  AVX-512's masked moves); 8-bit codes take 512 bytes a block. Fields
  are `[strip][K / group][16]`: one vector load gives a group's value for the 16
  features. A strip's codes are contiguous, so a kernel streams them. Rows are padded
  to a multiple of 16, K to a multiple of 64, with zero codes and fields.
- `tiles_avx2`: the tiles with each high-bit mask an 8 × 8 transpose of the quad's bytes
  (byte m of the mask holds at bit k the bit of the quad's byte 8k + m), for cores without
  AVX-512's mask registers: the mask broadcast to 8 lanes of 64 bits takes each lane's bits
  into place with one shift, where a bit per byte in order took AVX2 a byte shuffle, a
  compare and two masks (7 instructions a quad and bit where 11).

Quantized activation rows (`!tgt.qrows<128x576>`) hold, per row of width `W` (padded
to `Wp`, a multiple of 64): `qs int8[Wp]` (the values, quantized per 32 by
`formats.quantize_rows`), `d f32[Wp/16]` (each 16-slice's scale, shared by the two
slices of a 32-block), `s f32[Wp/16]` (each slice's `d · Σ qs`, for the minimum
terms of the weights) and `n i32[Wp/16]` (each slice's `Σ qs`, for the zero points: a
kernel adds `−zero · Σ qs` to its integer dot product), the row padded to 64 bytes.
Int16 rows (`!tgt.qrows<128x576xi16>`, `a16`) hold two int8 planes instead of `qs`:
`hi int8[Wp]` then `lo int8[Wp]`, the values being `256·hi + lo` (`formats.split_planes`),
so kernels multiply each plane with the int8 dot products of `a8`. Kernels address a row
without knowing how many rows the buffer holds.

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
    TILES = "tiles"
    TILES_AVX2 = "tiles_avx2"  # the tiles, their high-bit masks transposed (what AVX2 unpacks with shifts)

    @property
    def tiled(self) -> bool:
        """Whether the layout is one of the tiles (strips of 16 features × 32-blocks)."""
        return self in (Layout.TILES, Layout.TILES_AVX2)


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


STRIP = 16  # rows (output features) of a strip in the tiles layout
TILE_K = 32  # weights of a block in the tiles layout
QUADS = TILE_K // 4


def tile_planes(storage: Storage, shape: tuple[int, ...]) -> list[Plane]:
    """The planes of an integer-format `[N, K]` weight in the tiles layouts: `[strips, per strip]` each."""
    fmt = FORMATS[storage]
    assert fmt.bits is not None, f"{storage} is not an integer format"
    n, k = shape
    strips, blocks = -(-n // STRIP), padded_width(k) // TILE_K
    per_block = STRIP * TILE_K if fmt.bits == 8 else STRIP * TILE_K // 2
    specs: list[tuple[str, np.dtype, int, int]] = [("codes", np.uint8, strips, blocks * per_block)]
    for bit in range(4, fmt.bits if fmt.bits < 8 else 4):
        specs.append((f"bit{bit}", np.uint64, strips, blocks * QUADS))
    for f in fmt.fields:
        specs.append((f.name, f.numpy, strips, padded_width(k) // f.group * STRIP))
    return _planes(specs)


def planes_of(storage: Storage, layout: Layout, shape: tuple[int, ...]) -> list[Plane]:
    return tile_planes(storage, shape) if layout.tiled else weight_planes(storage, shape)


def weight_nbytes(storage: Storage, layout: Layout, shape: tuple[int, ...]) -> int:
    if layout is not Layout.STORED:
        planes = planes_of(storage, layout, shape)
        return align(planes[-1].offset + planes[-1].nbytes)
    return FORMATS[storage].nbytes(shape)


def pack_tiles(qt: QuantizedTensor, layout: Layout) -> np.ndarray:
    """The bytes of a quantized tensor in a tiles layout."""
    fmt = FORMATS[qt.storage]
    n, k = qt.shape
    kp = padded_width(k)
    strips, blocks = -(-n // STRIP), kp // TILE_K
    codes = qt.codes
    if codes.shape != (strips * STRIP, kp) or codes.dtype != np.uint8:  # padded to whole strips and tiles
        codes = np.zeros((strips * STRIP, kp), np.uint8)
        codes[:n, :k] = qt.codes
    out = np.zeros(weight_nbytes(qt.storage, layout, qt.shape), np.uint8)
    for plane in tile_planes(qt.storage, qt.shape):
        dst = plane.view(out)
        if plane.name == "codes":
            words = codes.reshape(strips, STRIP, blocks, QUADS, 4)
            if fmt.bits != 8:  # quad q's low nibbles under quad q + 4's
                words = (words[:, :, :, : QUADS // 2] & 15) | ((words[:, :, :, QUADS // 2 :] & 15) << 4)
            # a quad's 4 bytes as one word: [strip, feature, block, quad] → [strip, block, quad, feature]
            words = np.ascontiguousarray(words).view("<u4")[..., 0]
            dst.view("<u4").reshape(strips, blocks, -1, STRIP)[...] = words.transpose(0, 2, 3, 1)
        elif plane.name.startswith("bit") and layout is Layout.TILES_AVX2:  # per quad, bit 8m + k: byte 8k + m's
            bit = int(plane.name[3:])
            ones = ((codes >> bit) & 1).reshape(strips, STRIP, blocks, QUADS, 4).transpose(0, 2, 3, 1, 4)
            lanes = np.ascontiguousarray(ones).reshape(strips, blocks, QUADS, 64).view("<u8")  # [.., k]: bytes 8k..
            dst.view("<u8").reshape(strips, blocks, QUADS)[...] = \
                np.bitwise_or.reduce(lanes << np.arange(8, dtype=np.uint64), axis=-1)
        elif plane.name.startswith("bit"):  # per quad, bit f·4 + i: code i of feature f's bit
            bit = int(plane.name[3:])
            words = ((codes >> bit) & 1).reshape(strips, STRIP, blocks, QUADS, 4).view("<u4")[..., 0]
            nibbles = (words | words >> 7 | words >> 14 | words >> 21).astype(np.uint8) & 15
            nibbles = nibbles.transpose(0, 2, 3, 1)  # [strip, block, quad, feature]
            dst.view(np.uint8).reshape(strips, blocks, QUADS, STRIP // 2)[...] = \
                nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
        else:
            values = np.zeros((strips * STRIP, kp // fmt.field(plane.name).group), qt.fields[plane.name].dtype)
            values[:n, : qt.fields[plane.name].shape[1]] = qt.fields[plane.name]
            dst[...] = values.reshape(strips, STRIP, -1).transpose(0, 2, 1).reshape(strips, -1)
    return out


def unpack_tiles(data: np.ndarray, storage: Storage, shape: tuple[int, int], layout: Layout) -> QuantizedTensor:
    """The quantized tensor in a tiles layout's bytes (the padding dropped)."""
    fmt = FORMATS[storage]
    n, k = shape
    kp = padded_width(k)
    strips, blocks = -(-n // STRIP), kp // TILE_K
    buffer = np.asarray(data, np.uint8)
    quads = np.zeros((strips, blocks, QUADS, STRIP, 4), np.uint8)
    fields = {}
    for plane in tile_planes(storage, shape):
        src = plane.view(buffer)
        if plane.name == "codes":
            if fmt.bits == 8:
                quads[...] = src.reshape(quads.shape)
            else:
                nib = src.reshape(strips, blocks, QUADS // 2, STRIP, 4)
                quads[...] = np.concatenate([nib & 15, nib >> 4], axis=2)
        elif plane.name.startswith("bit"):
            bit = int(plane.name[3:])
            mask = np.ascontiguousarray(src).view(np.uint8).reshape(strips, blocks, QUADS, 8, 1)
            bits = np.unpackbits(mask, axis=-1, bitorder="little")  # [.., byte m of the mask, its bit k]
            if layout is Layout.TILES_AVX2:
                bits = bits.swapaxes(-1, -2)  # bit k of byte m: the quad's byte 8k + m
            quads |= bits.reshape(quads.shape) << bit
        else:
            group = fmt.field(plane.name).group
            values = src.reshape(strips, kp // group, STRIP).transpose(0, 2, 1).reshape(strips * STRIP, -1)
            fields[plane.name] = np.ascontiguousarray(values[:n, : k // group])
    codes = quads.transpose(0, 3, 1, 2, 4).reshape(strips * STRIP, kp)
    return QuantizedTensor(storage, np.ascontiguousarray(codes[:n, :k]), fields)


def pack(qt: QuantizedTensor, layout: Layout) -> np.ndarray:
    """A quantized tensor's bytes in `layout` (split or a tiles layout)."""
    return pack_tiles(qt, layout) if layout.tiled else pack_split(qt)


def unpack(data: np.ndarray, storage: Storage, layout: Layout, shape: tuple[int, int]) -> QuantizedTensor:
    return unpack_tiles(data, storage, shape, layout) if layout.tiled else unpack_split(data, storage, shape)


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
    """One quantized activation row of `width` values: `qs` (int8: one plane; int16: planes `hi`
    then `lo`, `formats.split_planes`), then `d`, `s` and `n`; rows `row_bytes` apart."""

    width: int
    bits: int = 8

    @property
    def wp(self) -> int:
        return padded_width(self.width)

    @property
    def planes(self) -> int:
        """int8 planes of values: 1, or 2 for int16 (`hi`, `lo`)."""
        return self.bits // 8

    @property
    def slices(self) -> int:
        return self.wp // SLICE

    @property
    def d_offset(self) -> int:
        return self.planes * self.wp

    @property
    def s_offset(self) -> int:
        return self.d_offset + 4 * self.slices

    @property
    def n_offset(self) -> int:
        return self.s_offset + 4 * self.slices

    @property
    def row_bytes(self) -> int:
        return align(self.n_offset + 4 * self.slices)

    def views(self, buffer: np.ndarray, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """`(qs, d f32[R, Wp/16], s f32[R, Wp/16], n i32[R, Wp/16])`: views of the rows in `buffer`
        (uint8); `qs` is int8 `[R, Wp]`, or for 16 bits the planes int8 `[R, 2, Wp]`
        (`formats.join_planes`)."""
        table = buffer[: rows * self.row_bytes].reshape(rows, self.row_bytes)
        qs = table[:, : self.d_offset].view(np.int8)
        if self.planes > 1:
            qs = qs.reshape(rows, self.planes, self.wp)
        return (qs, table[:, self.d_offset : self.s_offset].view(np.float32),
                table[:, self.s_offset : self.n_offset].view(np.float32),
                table[:, self.n_offset : self.n_offset + 4 * self.slices].view(np.int32))


def qrows_nbytes(rows: int, width: int, bits: int = 8) -> int:
    return rows * QRowLayout(width, bits).row_bytes
