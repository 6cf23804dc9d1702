"""The block-format table and the target layouts: what bytes mean, and that nothing is lost packing them."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from llmc.ir.formats import FORMATS, GGUF_STORAGE, SLICE, QuantizedTensor, Storage, quantize_rows
from llmc.ir.layouts import Layout, QRowLayout, pack, pack_split, unpack, weight_nbytes

GGUF_INTEGER = [s for s, f in FORMATS.items() if f.ggml is not None and f.bits is not None]
INTEGER = [s for s in Storage if not s.is_float]
GGUF_QUANTIZES = {Storage.Q8_0, Storage.Q4_0, Storage.Q4_1, Storage.Q5_0, Storage.Q5_1}


def _weights(rows: int = 6, k: int = 512, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    w = rng.standard_normal((rows, k)).astype(np.float32)
    w[0, :32] *= 50  # one block of outliers
    w[1, :64] = 0.0  # an all-zero block: scale 0
    return w


def test_the_table_agrees_with_ggufs_sizes() -> None:
    for storage, fmt in FORMATS.items():
        if fmt.ggml is not None:
            assert (fmt.block, fmt.block_bytes) == gguf.GGML_QUANT_SIZES[fmt.ggml]
    assert set(GGUF_STORAGE) == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}
    assert FORMATS[Storage.Q4_1].row_bytes(576) == 18 * 20
    with pytest.raises(ValueError, match="not a whole number"):
        FORMATS[Storage.Q4_K].row_bytes(576)


@pytest.mark.parametrize("storage", GGUF_INTEGER, ids=str)
def test_codes_and_fields_mean_what_gguf_means(storage: Storage) -> None:
    """GGUF blocks → codes and fields → float32 equals gguf's own dequantization, bit for bit,
    and back to blocks gives the same bytes."""
    fmt = FORMATS[storage]
    w = _weights()
    blocks = gguf.quants.quantize(w, fmt.ggml) if storage in GGUF_QUANTIZES else fmt.to_blocks(fmt.quantize(w))
    qt = fmt.from_blocks(blocks, w.shape)
    np.testing.assert_array_equal(fmt.dequantize(qt), gguf.quants.dequantize(blocks, fmt.ggml).reshape(w.shape))
    np.testing.assert_array_equal(fmt.to_blocks(qt), blocks.reshape(w.shape[0], -1))
    assert qt.codes.max() < 1 << fmt.bits


RELATIVE_RMS = {8: 0.01, 6: 0.03, 5: 0.05, 4: 0.11}  # of normal weights, by code bits (g256 int4 at the top)


@pytest.mark.parametrize("storage", INTEGER, ids=str)
def test_round_to_nearest_quantizers_error_by_bits(storage: Storage) -> None:
    """Every quantizer's error is what its bits allow (and an all-zero block stays zero)."""
    fmt = FORMATS[storage]
    w = _weights(k=512)
    qt = fmt.quantize(w)
    err = fmt.dequantize(qt) - w
    assert np.sqrt(np.square(err[2:]).mean() / np.square(w[2:]).mean()) < RELATIVE_RMS[fmt.bits]
    if max(f.group for f in fmt.fields) <= 64 or fmt.zero is not None:  # the zeros fill whole groups
        np.testing.assert_array_equal(fmt.dequantize(qt)[1, :64], 0.0)


def test_q4_0_search_beats_llama_cpps_rounding_and_q8_0_matches_gguf() -> None:
    w = _weights(rows=64, seed=3)
    ours = FORMATS[Storage.Q4_0].dequantize(FORMATS[Storage.Q4_0].quantize(w))
    plain = gguf.quants.dequantize(gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0),
                                   gguf.GGMLQuantizationType.Q4_0)
    assert np.square(ours - w).mean() < 0.97 * np.square(plain - w).mean()
    q8 = FORMATS[Storage.Q8_0]
    np.testing.assert_array_equal(q8.to_blocks(q8.quantize(w)),
                                  gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0))


@pytest.mark.parametrize("layout", [Layout.SPLIT, Layout.TILES], ids=str)
@pytest.mark.parametrize(("storage", "k"), [(s, k) for s in INTEGER for k in (256, 288, 576, 1536)
                                             if FORMATS[s].fits(k)], ids=str)
def test_layouts_round_trip_and_keep_the_size(storage: Storage, k: int, layout: Layout) -> None:
    """Packed (split: 5 rows; tiles: 21, a strip and part of one) and unpacked again, every code and field
    comes back."""
    fmt = FORMATS[storage]
    qt = fmt.quantize(_weights(rows=5 if layout is Layout.SPLIT else 21, k=k))
    data = pack(qt, layout)
    assert data.size == weight_nbytes(storage, layout, qt.shape)
    back = unpack(data, storage, layout, qt.shape)
    np.testing.assert_array_equal(back.codes, qt.codes)
    for name, values in qt.fields.items():
        np.testing.assert_array_equal(back.fields[name], values)
    stored = fmt.nbytes(qt.shape)
    if k % 64 == 0 and layout is Layout.SPLIT:  # only the 64-byte alignment of each plane is added
        assert data.size <= stored + 64 * (len(fmt.fields) + 2)


def test_split_layout_of_smollm2_sized_weights_costs_what_the_budget_allows() -> None:
    """The split layout holds the stored bytes; q4_k/q5_k keep their 6-bit scales in bytes (+2.8%)."""
    for storage, shape, bound in ((Storage.Q4_1, (576, 576), 1.0), (Storage.Q4_1, (1536, 576), 1.0),
                                  (Storage.Q8_0, (49152, 576), 1.0), (Storage.Q6_K, (576, 1536), 1.0),
                                  (Storage.Q4_K, (576, 1536), 1.03)):
        assert weight_nbytes(storage, Layout.SPLIT, shape) <= bound * FORMATS[storage].nbytes(shape)


def test_nibbles_group_64_weights_so_one_and_and_one_shift_unpack_them() -> None:
    codes = np.arange(64, dtype=np.uint8)[None, :] % 16
    qt = QuantizedTensor(Storage.INT4_G32, codes, {"d": np.ones((1, 2), np.float16), "m": np.zeros((1, 2), np.float16)})
    nibbles = pack_split(qt)[:32]
    np.testing.assert_array_equal(nibbles & 15, codes[0, :32])
    np.testing.assert_array_equal(nibbles >> 4, codes[0, 32:])


def test_activation_quantization() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 96)).astype(np.float32) * 4
    x[1, :32] = 0.0
    qs, d, s = quantize_rows(x)
    assert qs.shape == (3, 128) and d.shape == s.shape == (3, 8)
    assert not qs[:, 96:].any() and not d[:, 6:].any()  # padded to a whole 64-group
    assert np.abs(qs).max() == 127 and not qs[1, :32].any() and d[1, 0] == 0
    back = qs[:, :96].astype(np.float32) * np.repeat(d, SLICE, axis=1)[:, :96]
    assert np.abs(back - x).max() <= 0.5 * d.max() * 1.0001
    np.testing.assert_allclose(s, d * qs.reshape(3, 8, SLICE).sum(-1), rtol=1e-6)
    np.testing.assert_array_equal(d[:, 0::2], d[:, 1::2])  # one scale per 32, stored per 16-slice


def test_quantized_rows_are_addressed_row_by_row() -> None:
    layout = QRowLayout(576)
    assert layout.row_bytes % 64 == 0 and layout.row_bytes >= 576 + 3 * 4 * 36
    buf = np.zeros(3 * layout.row_bytes, np.uint8)
    qs, d, s, n = layout.views(buf, 3)
    qs[2, 5], d[1, 0], s[0, 35], n[2, 35] = 7, 1.5, -2.0, -9
    assert buf[2 * layout.row_bytes + 5] == 7
    assert np.frombuffer(buf[layout.row_bytes + 576 : layout.row_bytes + 580].tobytes(), np.float32)[0] == 1.5
    last = 2 * layout.row_bytes + 576 + 2 * 4 * 36 + 4 * 35  # row 2's last integer sum
    assert np.frombuffer(buf[last : last + 4].tobytes(), np.int32)[0] == -9
    nonzero = 1 + np.count_nonzero(np.float32([1.5, -2.0]).view(np.uint8)) + np.count_nonzero(np.int32([-9]).view(np.uint8))
    assert np.count_nonzero(buf) == nonzero


def test_storage_names_parse_as_users_write_them() -> None:
    assert Storage.parse("Q4_1") is Storage.Q4_1 and Storage.parse("int4-g128") is Storage.INT4_G128
    with pytest.raises(ValueError, match="unknown storage type 'q9_9'.*int4-g32"):
        Storage.parse("q9_9")
