"""The block-format table: what the bytes of every weight storage type mean.

One table for the frontends (block sizes of GGUF tensors), the interpreters (numpy
dequantization), `quantize` (round-to-nearest quantizers for float sources), the
packager and plan-memory (byte sizes) and the kernels (the formula of each format).

Every integer format is described the same way, as *codes* and *fields*: an unsigned
code per weight (`bits` wide) and a few per-group fields (scales, minimums, zero
points, each shared by `group` consecutive weights of a row). The weight is

    w = scale · (code − zero)          formats with a zero point (q8_0, q4_0, q5_0, q6_k)
    w = scale · code + sign · minimum  formats with a minimum (q4_1, q5_1, q4_k, q5_k, int4)

where `scale` and `minimum` are products of fields (`d · sc` for the k-quants). q8_0's
signed values are stored as codes `q + 128`, so every code is unsigned: the integer
kernels multiply unsigned codes by signed activations (VNNI `vpdpbusd`, `pmaddubsw`).

    >>> fmt = FORMATS[Storage.Q4_1]
    >>> qt = fmt.from_blocks(gguf_bytes, (576, 576))      # codes [576, 576], fields d, m [576, 18]
    >>> fmt.dequantize(qt)                                # equals gguf.quants.dequantize
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

SLICE = 16  # the granularity of scales the kernels see: every format's groups are multiples of 16
ACT_BLOCK = 32  # activations are quantized to int8 per 32 values (one scale each)
GROUP = 64  # values the kernels read at once: rows are padded to whole groups


class Storage(StrEnum):
    """How a weight is stored: in the model file, and after `quantize`, in the artifact."""

    F32 = "f32"
    F16 = "f16"
    BF16 = "bf16"
    Q8_0 = "q8_0"
    Q4_0 = "q4_0"
    Q4_1 = "q4_1"
    Q5_0 = "q5_0"
    Q5_1 = "q5_1"
    Q4_K = "q4_k"
    Q5_K = "q5_k"
    Q6_K = "q6_k"
    INT4_G32 = "int4_g32"
    INT4_G64 = "int4_g64"
    INT4_G128 = "int4_g128"
    INT4_G256 = "int4_g256"

    @property
    def is_float(self) -> bool:
        return FORMATS[self].bits is None

    @classmethod
    def parse(cls, text: str) -> Storage:
        """`q4_1`, `Q4_1`, `int4-g128` → the storage type; ValueError naming the choices otherwise."""
        try:
            return cls(text.strip().lower().replace("-", "_"))
        except ValueError:
            names = ", ".join(s.value.replace("int4_", "int4-") for s in cls)
            raise ValueError(f"unknown storage type '{text}' (types: {names})") from None


@dataclass(frozen=True)
class Field:
    """A per-group value of an integer format: `dtype` is "f16", "u8" or "i8"; one per `group` weights."""

    name: str
    dtype: str
    group: int

    @property
    def numpy(self) -> np.dtype:
        return np.dtype({"f16": np.float16, "u8": np.uint8, "i8": np.int8}[self.dtype])


@dataclass
class QuantizedTensor:
    """An integer-format tensor as codes and fields, rows in logical order.

    `codes` is `uint8[rows, K]`; each field is `[rows, K / field.group]` in its dtype.
    """

    storage: Storage
    codes: np.ndarray
    fields: dict[str, np.ndarray]

    @property
    def shape(self) -> tuple[int, int]:
        return self.codes.shape  # type: ignore[return-value]

    def slices(self) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """`(scale, zero, minimum)` per 16-weight slice, float32 `[rows, K/16]` (zero/minimum may be None)."""
        return FORMATS[self.storage].slice_terms(self)

    def dequantize(self) -> np.ndarray:
        return FORMATS[self.storage].dequantize(self)


@dataclass(frozen=True)
class BlockFormat:
    """One storage type: its block in the file, and for integer formats, codes and fields."""

    storage: Storage
    block: int  # weights per stored block
    block_bytes: int  # bytes per stored block
    ggml: GGMLQuantizationType | None  # the GGUF type, None for llmc's own formats
    bits: int | None = None  # code width; None for float formats
    fields: tuple[Field, ...] = ()
    scale: tuple[str, ...] = ()  # fields whose product is the scale
    zero: int | None = None  # the constant zero point of the codes
    minimum: tuple[str, ...] = ()  # fields whose product is the minimum …
    minimum_sign: int = 1  # … added with this sign

    @property
    def is_float(self) -> bool:
        return self.bits is None

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)

    def row_bytes(self, k: int) -> int:
        """Bytes of one stored row of `k` weights (a whole number of blocks)."""
        if k % self.block:
            raise ValueError(f"a row of {k} weights is not a whole number of {self.storage} blocks of {self.block}")
        return k // self.block * self.block_bytes

    def nbytes(self, shape: tuple[int, ...]) -> int:
        rows = int(np.prod(shape[:-1], dtype=np.int64)) if len(shape) > 1 else 1
        return rows * self.row_bytes(shape[-1])

    def fits(self, k: int) -> bool:
        """Whether rows of `k` weights can be stored in this format."""
        return k % self.block == 0

    # -- the formula ---------------------------------------------------------------

    def _per_slice(self, qt: QuantizedTensor, names: tuple[str, ...]) -> np.ndarray:
        out = None
        for name in names:
            f = self.field(name)
            v = np.repeat(qt.fields[name].astype(np.float32), f.group // SLICE, axis=1)
            out = v if out is None else out * v
        assert out is not None
        return out

    def slice_terms(self, qt: QuantizedTensor) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
        scale = self._per_slice(qt, self.scale)
        zero = minimum = None
        if self.zero is not None:
            zero = np.full_like(scale, self.zero)
        if self.minimum:
            minimum = self.minimum_sign * self._per_slice(qt, self.minimum)
        return scale, zero, minimum

    def dequantize(self, qt: QuantizedTensor) -> np.ndarray:
        """float32 weights `[rows, K]` from codes and fields (the same arithmetic as GGUF's)."""
        rows, k = qt.codes.shape
        scale, zero, minimum = self.slice_terms(qt)
        w = qt.codes.reshape(rows, k // SLICE, SLICE).astype(np.float32)  # the one array; float32 throughout,
        if zero is not None:                                              # in place (all SmolLM2's weights: 0.4 s)
            np.subtract(w, zero[..., None], out=w)  # small integers: exact in float32
        np.multiply(w, scale[..., None], out=w)
        if zero is None:
            np.add(w, minimum[..., None], out=w)
        return w.reshape(rows, k)

    # -- GGUF blocks <-> codes and fields ---------------------------------------------

    def from_blocks(self, data: np.ndarray, shape: tuple[int, int]) -> QuantizedTensor:
        """Codes and fields of GGUF block bytes `uint8[rows, row_bytes]`."""
        rows, k = shape
        blocks = np.ascontiguousarray(data, dtype=np.uint8).reshape(rows * (k // self.block), self.block_bytes)
        codes, fields = _UNPACK[self.storage](blocks)
        return QuantizedTensor(
            self.storage, codes.reshape(rows, k),
            {name: v.reshape(rows, -1) for name, v in fields.items()},
        )

    def to_blocks(self, qt: QuantizedTensor) -> np.ndarray:
        """GGUF block bytes `uint8[rows, row_bytes]` of codes and fields."""
        rows, k = qt.shape
        nb = rows * (k // self.block)
        codes = qt.codes.reshape(nb, self.block)
        fields = {name: v.reshape(nb, -1) for name, v in qt.fields.items()}
        return _PACK[self.storage](codes, fields).reshape(rows, self.row_bytes(k))

    # -- quantization of float weights ---------------------------------------------

    def quantize(self, w: np.ndarray) -> QuantizedTensor:
        """Round-to-nearest quantization of float32 `[rows, K]` (for q8_0, q4_1, q5_1 GGUF's reference
        quantizer; for the others, llmc's: block scales chosen as in `_QUANTIZE`)."""
        if self.is_float:
            raise ValueError(f"{self.storage} is a float format: see to_float_storage")
        w = np.ascontiguousarray(w, dtype=np.float32)
        rows, k = w.shape
        if not self.fits(k):
            raise ValueError(f"rows of {k} weights are not whole {self.storage} blocks of {self.block}")
        if self.storage in _QUANTIZE:
            blocks = w.reshape(-1, self.block)
            codes, fields = _QUANTIZE[self.storage](blocks, self)
            return QuantizedTensor(self.storage, codes.reshape(rows, k),
                                   {n: v.reshape(rows, -1) for n, v in fields.items()})
        return self.from_blocks(quants.quantize(w, self.ggml), (rows, k))


# ------------------------------------------------------------------ GGUF layouts


def _f16(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b).view(np.float16).reshape(b.shape[0], -1)


def _nibbles_32(qs: np.ndarray) -> np.ndarray:
    """16 bytes per block → 32 codes: low nibbles are elements 0–15, high nibbles 16–31."""
    return np.concatenate([qs & 15, qs >> 4], axis=1)


def _pack_nibbles_32(codes: np.ndarray) -> np.ndarray:
    return (codes[:, :16] | (codes[:, 16:] << 4)).astype(np.uint8)


def _bits(packed: np.ndarray, count: int) -> np.ndarray:
    """Little-endian bit `i` of each row of bytes, for i < count."""
    return np.unpackbits(packed, axis=1, bitorder="little")[:, :count]


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and minimums of a q4_k / q5_k block's 12 scale bytes."""
    return quants.Q4_K.get_scale_min(scales)


def _pack_scale_min_k4(sc: np.ndarray, mn: np.ndarray) -> np.ndarray:
    out = np.zeros((sc.shape[0], 12), np.uint8)
    out[:, 0:4] = (sc[:, :4] & 63) | ((sc[:, 4:] >> 4) << 6)
    out[:, 4:8] = (mn[:, :4] & 63) | ((mn[:, 4:] >> 4) << 6)
    out[:, 8:12] = (sc[:, 4:] & 15) | ((mn[:, 4:] & 15) << 4)
    return out


def _unpack_q8_0(b: np.ndarray):
    return b[:, 2:] ^ np.uint8(0x80), {"d": _f16(b[:, :2])}  # int8 + 128 as uint8: the sign bit flipped


def _pack_q8_0(codes, f):
    q = (codes.astype(np.int16) - 128).astype(np.int8).view(np.uint8)
    return np.concatenate([f["d"].view(np.uint8), q], axis=1)


def _unpack_q4_0(b):
    return _nibbles_32(b[:, 2:]), {"d": _f16(b[:, :2])}


def _pack_q4_0(codes, f):
    return np.concatenate([f["d"].view(np.uint8), _pack_nibbles_32(codes)], axis=1)


def _unpack_q4_1(b):
    return _nibbles_32(b[:, 4:]), {"d": _f16(b[:, :2]), "m": _f16(b[:, 2:4])}


def _pack_q4_1(codes, f):
    return np.concatenate([f["d"].view(np.uint8), f["m"].view(np.uint8), _pack_nibbles_32(codes)], axis=1)


def _unpack_q5(b, offset):
    high = _bits(b[:, offset : offset + 4], 32)
    return _nibbles_32(b[:, offset + 4 :]) | (high << 4)


def _pack_q5(codes):
    high = np.packbits(codes >> 4, axis=1, bitorder="little")
    return np.concatenate([high, _pack_nibbles_32(codes & 15)], axis=1)


def _unpack_q5_0(b):
    return _unpack_q5(b, 2), {"d": _f16(b[:, :2])}


def _pack_q5_0(codes, f):
    return np.concatenate([f["d"].view(np.uint8), _pack_q5(codes)], axis=1)


def _unpack_q5_1(b):
    return _unpack_q5(b, 4), {"d": _f16(b[:, :2]), "m": _f16(b[:, 2:4])}


def _pack_q5_1(codes, f):
    return np.concatenate([f["d"].view(np.uint8), f["m"].view(np.uint8), _pack_q5(codes)], axis=1)


def _nibbles_64(qs: np.ndarray) -> np.ndarray:
    """32 bytes per pair of 32-weight sub-blocks: low nibbles are the first, high nibbles the second."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (q & 15).reshape(nb, -1)


def _pack_nibbles_64(codes: np.ndarray) -> np.ndarray:
    c = codes.reshape(codes.shape[0], -1, 2, 32)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(codes.shape[0], -1).astype(np.uint8)


def _unpack_q4_k(b):
    sc, mn = _scale_min_k4(b[:, 4:16])
    return _nibbles_64(b[:, 16:]), {"d": _f16(b[:, :2]), "dmin": _f16(b[:, 2:4]), "sc": sc, "mn": mn}


def _pack_q4_k(codes, f):
    return np.concatenate([f["d"].view(np.uint8), f["dmin"].view(np.uint8), _pack_scale_min_k4(f["sc"], f["mn"]),
                           _pack_nibbles_64(codes)], axis=1)


def _unpack_q5_k(b):
    sc, mn = _scale_min_k4(b[:, 4:16])
    nb = b.shape[0]
    qh = b[:, 16:48].reshape(nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    codes = _nibbles_64(b[:, 48:]) | ((qh & 1).reshape(nb, 256) << 4)
    return codes, {"d": _f16(b[:, :2]), "dmin": _f16(b[:, 2:4]), "sc": sc, "mn": mn}


def _pack_q5_k(codes, f):
    nb = codes.shape[0]
    high = (codes >> 4).reshape(nb, 8, 32)
    qh = np.zeros((nb, 32), np.uint8)
    for i in range(8):
        qh |= (high[:, i] << i).astype(np.uint8)
    return np.concatenate([f["d"].view(np.uint8), f["dmin"].view(np.uint8), _pack_scale_min_k4(f["sc"], f["mn"]),
                           qh, _pack_nibbles_64(codes & 15)], axis=1)


def _unpack_q6_k(b):
    nb = b.shape[0]
    ql = b[:, :128].reshape(nb, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    qh = b[:, 128:192].reshape(nb, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    codes = (ql & 15).reshape(nb, 256) | ((qh & 3).reshape(nb, 256) << 4)
    return codes, {"d": _f16(b[:, 208:210]), "sc": np.ascontiguousarray(b[:, 192:208]).view(np.int8)}


def _pack_q6_k(codes, f):
    nb = codes.shape[0]
    low = (codes & 15).reshape(nb, 2, 2, 64)
    ql = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(nb, 128)
    high = (codes >> 4).reshape(nb, 2, 4, 32)
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(nb, 64)
    return np.concatenate([ql.astype(np.uint8), qh.astype(np.uint8), f["sc"].view(np.uint8), f["d"].view(np.uint8)],
                          axis=1)


_UNPACK = {
    Storage.Q8_0: _unpack_q8_0, Storage.Q4_0: _unpack_q4_0, Storage.Q4_1: _unpack_q4_1,
    Storage.Q5_0: _unpack_q5_0, Storage.Q5_1: _unpack_q5_1, Storage.Q4_K: _unpack_q4_k,
    Storage.Q5_K: _unpack_q5_k, Storage.Q6_K: _unpack_q6_k,
}
_PACK = {
    Storage.Q8_0: _pack_q8_0, Storage.Q4_0: _pack_q4_0, Storage.Q4_1: _pack_q4_1,
    Storage.Q5_0: _pack_q5_0, Storage.Q5_1: _pack_q5_1, Storage.Q4_K: _pack_q4_k,
    Storage.Q5_K: _pack_q5_k, Storage.Q6_K: _pack_q6_k,
}


# ------------------------------------------------------- quantizers gguf lacks


def _to_f16(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16)


def _safe_div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(b == 0, 0, a / np.where(b == 0, 1, b)).astype(np.float32)


def _quantize_k_min(blocks: np.ndarray, fmt: BlockFormat):
    """q4_k / q5_k: per 32-weight sub-block a 6-bit scale and minimum, per 256 an f16 d and dmin."""
    nmax = (1 << fmt.bits) - 1
    nb = blocks.shape[0]
    sub = blocks.reshape(nb, 8, 32)
    mins = np.maximum(0, -sub.min(axis=2))  # subtracted, so stored positive
    scales = (sub.max(axis=2) + mins) / nmax
    d = _to_f16(scales.max(axis=1) / 63)
    dmin = _to_f16(mins.max(axis=1) / 63)
    sc = np.clip(np.rint(_safe_div(scales, d.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    mn = np.clip(np.rint(_safe_div(mins, dmin.astype(np.float32)[:, None])), 0, 63).astype(np.uint8)
    step = d.astype(np.float32)[:, None] * sc
    offset = dmin.astype(np.float32)[:, None] * mn
    q = np.rint(_safe_div(sub + offset[..., None], step[..., None]))
    codes = np.clip(q, 0, nmax).astype(np.uint8).reshape(nb, 256)
    return codes, {"d": d[:, None], "dmin": dmin[:, None], "sc": sc, "mn": mn}


def _quantize_q6_k(blocks: np.ndarray, fmt: BlockFormat):
    """q6_k: per 16-weight slice a signed 8-bit scale, per 256 an f16 d; codes − 32 in [−32, 31]."""
    nb = blocks.shape[0]
    sub = blocks.reshape(nb, 16, 16)
    amax = np.abs(sub).max(axis=2)
    scales = amax / 31
    d = _to_f16(scales.max(axis=1) / 127)
    sc = np.clip(np.rint(_safe_div(scales, d.astype(np.float32)[:, None])), 0, 127).astype(np.int8)
    step = d.astype(np.float32)[:, None] * sc
    q = np.rint(_safe_div(sub, step[..., None])) + 32
    codes = np.clip(q, 0, 63).astype(np.uint8).reshape(nb, 256)
    return codes, {"d": d[:, None], "sc": sc}


def _quantize_int4(blocks: np.ndarray, fmt: BlockFormat):
    """Group-wise affine int4 (as MLX's): `w = d · q + m`, m the group's minimum, q in 0..15."""
    lo, hi = blocks.min(axis=1), blocks.max(axis=1)
    d, m = _to_f16((hi - lo) / 15), _to_f16(lo)
    q = np.rint(_safe_div(blocks - m.astype(np.float32)[:, None], d.astype(np.float32)[:, None]))
    return np.clip(q, 0, 15).astype(np.uint8), {"d": d[:, None], "m": m[:, None]}


def _quantize_symmetric(blocks: np.ndarray, fmt: BlockFormat):
    """q4_0 / q5_0: `w = d · (q − zero)`, each block's d chosen by least squares among 19 candidate
    roundings (llama.cpp's `make_qx_quants` search); plain llama.cpp takes `d = max / −zero`."""
    step = 1 << 14  # blocks at a time: the temporaries stay in cache
    parts = [_search_symmetric(blocks[i : i + step], fmt.zero) for i in range(0, blocks.shape[0], step)]
    return np.concatenate([p[0] for p in parts]), {"d": np.concatenate([p[1] for p in parts])}


def _search_symmetric(blocks: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    signed_max = np.take_along_axis(blocks, np.abs(blocks).argmax(axis=1)[:, None], axis=1)
    inv_max = _safe_div(np.ones_like(signed_max), signed_max)
    best_err = np.full(blocks.shape[0], np.inf, np.float32)
    best = np.zeros((blocks.shape[0], 1), np.float32)
    for step in range(-9, 10):
        levels = np.clip(np.rint(blocks * (-(nmax + 0.1 * step) * inv_max)), -nmax, nmax - 1)
        d = _to_f16(_safe_div((blocks * levels).sum(1, keepdims=True), (levels * levels).sum(1, keepdims=True)))
        d = d.astype(np.float32)
        q = np.clip(np.rint(blocks * _safe_div(np.ones_like(d), d)), -nmax, nmax - 1)
        err = np.square(blocks - d * q).sum(axis=1)
        better = err < best_err
        best_err, best = np.where(better, err, best_err), np.where(better[:, None], d, best)
    q = np.clip(np.rint(blocks * _safe_div(np.ones_like(best), best)), -nmax, nmax - 1) + nmax
    return q.astype(np.uint8), best.astype(np.float16)


_QUANTIZE = {
    Storage.Q4_0: _quantize_symmetric, Storage.Q5_0: _quantize_symmetric,
    Storage.Q4_K: _quantize_k_min, Storage.Q5_K: _quantize_k_min, Storage.Q6_K: _quantize_q6_k,
    Storage.INT4_G32: _quantize_int4, Storage.INT4_G64: _quantize_int4, Storage.INT4_G128: _quantize_int4,
    Storage.INT4_G256: _quantize_int4,
}


# ------------------------------------------------------------------------ the table


def _ggml(storage: Storage) -> tuple[GGMLQuantizationType, int, int]:
    t = GGMLQuantizationType[storage.name]
    block, nbytes = GGML_QUANT_SIZES[t]
    return t, block, nbytes


def _gguf_format(storage: Storage, **kw) -> BlockFormat:
    t, block, nbytes = _ggml(storage)
    return BlockFormat(storage, block, nbytes, t, **kw)


def _int4(storage: Storage, group: int) -> BlockFormat:
    return BlockFormat(storage, group, group // 2 + 4, None, bits=4,
                       fields=(Field("d", "f16", group), Field("m", "f16", group)), scale=("d",), minimum=("m",))


_D32 = Field("d", "f16", 32)
_M32 = Field("m", "f16", 32)
_K_MIN_FIELDS = (Field("d", "f16", 256), Field("dmin", "f16", 256), Field("sc", "u8", 32), Field("mn", "u8", 32))

FORMATS: dict[Storage, BlockFormat] = {
    Storage.F32: _gguf_format(Storage.F32),
    Storage.F16: _gguf_format(Storage.F16),
    Storage.BF16: _gguf_format(Storage.BF16),
    Storage.Q8_0: _gguf_format(Storage.Q8_0, bits=8, fields=(_D32,), scale=("d",), zero=128),
    Storage.Q4_0: _gguf_format(Storage.Q4_0, bits=4, fields=(_D32,), scale=("d",), zero=8),
    Storage.Q4_1: _gguf_format(Storage.Q4_1, bits=4, fields=(_D32, _M32), scale=("d",), minimum=("m",)),
    Storage.Q5_0: _gguf_format(Storage.Q5_0, bits=5, fields=(_D32,), scale=("d",), zero=16),
    Storage.Q5_1: _gguf_format(Storage.Q5_1, bits=5, fields=(_D32, _M32), scale=("d",), minimum=("m",)),
    Storage.Q4_K: _gguf_format(Storage.Q4_K, bits=4, fields=_K_MIN_FIELDS, scale=("d", "sc"),
                               minimum=("dmin", "mn"), minimum_sign=-1),
    Storage.Q5_K: _gguf_format(Storage.Q5_K, bits=5, fields=_K_MIN_FIELDS, scale=("d", "sc"),
                               minimum=("dmin", "mn"), minimum_sign=-1),
    Storage.Q6_K: _gguf_format(Storage.Q6_K, bits=6, fields=(Field("d", "f16", 256), Field("sc", "i8", 16)),
                               scale=("d", "sc"), zero=32),
    Storage.INT4_G32: _int4(Storage.INT4_G32, 32),
    Storage.INT4_G64: _int4(Storage.INT4_G64, 64),
    Storage.INT4_G128: _int4(Storage.INT4_G128, 128),
    Storage.INT4_G256: _int4(Storage.INT4_G256, 256),
}

# ------------------------------------------------------------ int8 activations


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def padded_width(width: int) -> int:
    """A row width rounded up to whole `GROUP`s of values (what kernels read at once)."""
    return round_up(width, GROUP)


QMAX = {8: 127, 16: 32512}  # the largest quantized activation: int8, and int16 as two int8 planes (127·256)


def quantize_rows(x: np.ndarray, bits: int = 8) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Activations quantized to int8 (or int16) as the kernels do it, in numpy, bit for bit.

    Per 32 values: `d = amax / Q`, `q = rint(x · (Q / amax))` with `Q = QMAX[bits]` (127;
    32512 = 127·256 for 16 bits, so `q` splits into two int8 planes: `split_planes`); per
    16-slice the scale `d` and `s = d · Σ q`. Returns `(qs int8|int16[R, Wp], d f32[R, Wp/16],
    s f32[R, Wp/16])` with the width padded to whole 64-groups (zeros).

        qs, d, s = quantize_rows(x, 16)   # qs int16, |qs| ≤ 32512
    """
    x = np.asarray(x, np.float32)
    rows, width = x.shape
    wp = padded_width(width)
    xp = np.zeros((rows, wp), np.float32)
    xp[:, :width] = x
    blocks = xp.reshape(rows, wp // ACT_BLOCK, ACT_BLOCK)
    amax = np.abs(blocks).max(axis=-1)
    qmax = np.float32(QMAX[bits])
    d = (amax / qmax).astype(np.float32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, qmax / amax, np.float32(0)).astype(np.float32)
    q = np.rint(blocks * inv[..., None]).astype(np.int8 if bits == 8 else np.int16).reshape(rows, wp)
    d16 = np.repeat(d, ACT_BLOCK // SLICE, axis=1)
    return q, d16, (d16 * slice_sums(q).astype(np.float32)).astype(np.float32)  # (sums < 2^24: exact)


def slice_sums(qs: np.ndarray) -> np.ndarray:
    """Each 16-slice's `Σ qs` of quantized rows (`quantize_rows`' values), int32 `[R, Wp/16]`."""
    return qs.reshape(qs.shape[0], -1, SLICE).astype(np.int32).sum(-1)


def split_planes(q: np.ndarray) -> np.ndarray:
    """int16 values (`|q| ≤ 32512`) as two int8 planes `[..., 2, W]`: `hi = (q + 128) >> 8`
    (in [-127, 127]) and `lo = q − 256·hi` (in [-128, 127]), so `q = 256·hi + lo`."""
    q = np.asarray(q, np.int32)
    hi = (q + 128) >> 8
    return np.stack([hi, q - 256 * hi], axis=-2).astype(np.int8)


def join_planes(planes: np.ndarray) -> np.ndarray:
    """The int16 values of two int8 planes `[..., 2, W]` (`split_planes`' inverse)."""
    return (planes[..., 0, :].astype(np.int16) << 8) + planes[..., 1, :]


_COLUMNS = 4096  # output columns per step of an integer matmul (bounds the temporaries)


def integer_matmul(qs: np.ndarray, d: np.ndarray, s: np.ndarray, w: QuantizedTensor) -> np.ndarray:
    """`x · wᵀ` of int8 or int16 rows (`quantize_rows`' output) by an integer-format weight, as kernels compute it.

    Per 16-weight slice: the exact integer dot product of codes and values (int8 rows in
    float32: every partial sum is an integer below 2^24; int16 rows in float64, rounded
    once to float32 as a kernel converts its int32 sums), times the weight's and the row's
    scales; plus each slice's minimum times the row's sum. A zero point is subtracted from
    the integer dot product instead, as `−zero · Σ qs` (`slice_sums`).
    """
    rows = qs.shape[0]
    n_out, k = w.shape
    slices = k // SLICE
    exact = np.float32 if qs.dtype == np.int8 else np.float64
    scale, zero, minimum = w.slices()
    x = qs[:, :k].astype(exact).reshape(rows, slices, SLICE).transpose(1, 2, 0)  # [S, 16, T]
    d, s = d[:, :slices], s[:, :slices]
    sums = slice_sums(qs)[:, :slices].T.astype(exact)[:, None, :]  # [S, 1, T]
    out = np.empty((rows, n_out), np.float32)
    for lo in range(0, n_out, _COLUMNS):
        hi = min(lo + _COLUMNS, n_out)
        codes = w.codes[lo:hi].astype(exact).reshape(hi - lo, slices, SLICE).transpose(1, 0, 2)  # [S, N, 16]
        dots = codes @ x  # [S, N, T]
        if minimum is None:
            dots -= zero[lo:hi].T[:, :, None].astype(exact) * sums
        out[:, lo:hi] = np.einsum("snt,ns,ts->tn", dots.astype(np.float32, copy=False), scale[lo:hi], d)
        if minimum is not None:
            out[:, lo:hi] += s @ minimum[lo:hi].T
    return out


# GGUF tensor type name → storage, for the types llmc computes
GGUF_STORAGE: dict[str, Storage] = {f.ggml.name: s for s, f in FORMATS.items() if f.ggml is not None}


def float_array(storage: Storage, data: np.ndarray) -> np.ndarray:
    """float32 values of a float-format array (f32, f16, or bf16 given as uint16)."""
    if storage is Storage.F32:
        return np.asarray(data, dtype=np.float32)
    if storage is Storage.F16:
        return np.asarray(data).astype(np.float32)
    if storage is Storage.BF16:
        return (np.asarray(data, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
    raise ValueError(f"{storage} is not a float format")


def to_float_storage(storage: Storage, w: np.ndarray) -> np.ndarray:
    """float32 values in a float storage: f32, f16, or bf16 as uint16 (round to nearest even)."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if storage is Storage.F32:
        return w
    if storage is Storage.F16:
        return w.astype(np.float16)
    if storage is Storage.BF16:
        return quants.quantize(w, GGMLQuantizationType.BF16).view(np.uint16).reshape(w.shape)
    raise ValueError(f"{storage} is not a float format")
