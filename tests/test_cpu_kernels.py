"""CPU kernels (the harness: `kernel_harness`; RoPE and attention: `test_cpu_attention`): embedding, norms
and activation quantization, the matmul family, AMX tiles, elementwise ops, threads, the library, the
targets and the kernel cache, each compared with numpy.

Float paths: max abs error ≤ 1e-4 · max|ref| + 1e-6 against float64 numpy. Integer
weights are checked against a reference on the same quantized data, so kernel error is
not confused with quantization error: `a32` (codes dequantized in registers) within
1e-5 of the float64 product with the dequantized weights; `a8` (integer dot products)
within 2e-6 of the integer reference of the tgt interpreter, on the same int8 rows;
activation quantization bit for bit against `formats.quantize_rows`.
"""

from __future__ import annotations

import ctypes
import itertools
import re
import uuid

import host
import numpy as np
import pytest
from kernel_harness import (
    IDX,
    Kernel,
    Machine,
    assembly,
    assert_close,
    f32,
    lm_head_op,
    qrows_of,
    rand,
    read_qrows,
)
from llvmlite import ir
from xdsl.dialects.builtin import i32
from xdsl.ir import Block

from llmc.abi import AMX_FLAG, WEIGH_BLOCK, WEIGH_GROUP
from llmc.backends.builder import FPTR, I64
from llmc.backends.cpu import (
    KernelLibrary,
    ToolchainError,
    compile_to_object,
    link_shared,
    target_machine,
)
from llmc.backends.cpu import amx as amx_tiles
from llmc.backends.cpu.codegen import argmax_kernel, draw_kernel, read_probe, weigh_kernel
from llmc.backends.cpu.gemm import CHUNK_BYTES, CHUNKS_PER_THREAD, DEALT_SHARE, PREFETCH_BYTES, TILE_COLS
from llmc.backends.cpu.target import (
    CPUS,
    cpu_target,
    integer_isa,
    kernel_tuning,
    llvm_features,
    near_prefetch_bytes,
    tiles_layout,
)
from llmc.errors import LlmcError, UsageError
from llmc.ir import tgt
from llmc.ir.formats import FORMATS, Storage, integer_matmul, quantize_rows, slice_sums
from llmc.ir.layouts import STRIP, Layout, QRowLayout, pack, pack_split, qrows_nbytes

INTEGER_FORMATS = [s for s in Storage if not s.is_float]


def weight_of(storage: Storage, w: np.ndarray, layout: Layout = Layout.SPLIT
              ) -> tuple[tgt.WeightType, np.ndarray, np.ndarray]:
    """A weight in `storage` as the artifact holds it (integer formats in `layout`): its type, its
    bytes, its float values."""
    if storage.is_float:
        from llmc.ir.formats import float_array, to_float_storage

        data = to_float_storage(storage, w)
        return tgt.WeightType(w.shape, storage), np.ascontiguousarray(data), float_array(storage, data)
    qt = FORMATS[storage].quantize(w)
    return tgt.WeightType(w.shape, storage, layout), pack(qt, layout), qt.dequantize()


# references ------------------------------------------------------------------------

def ref_rms_norm(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu64(x):
    x = np.asarray(x, np.float64)
    return x / (1 + np.exp(-x))


def f32_weight(w: np.ndarray) -> tgt.WeightType:
    return tgt.WeightType(w.shape, Storage.F32)


# embedding -------------------------------------------------------------------------

@pytest.mark.parametrize("storage,layout", [(s, Layout.STORED) for s in Storage if s.is_float] +
                         [(s, layout) for s in Storage if not s.is_float
                          for layout in (Layout.SPLIT, Layout.TILES, Layout.TILES_AVX2)],
                         ids=str)
def test_embedding_dequantizes_rows_of_every_storage(tmp_path, tm, storage, layout):
    rng = np.random.default_rng(0)
    V, D = 50, 256 + 32  # one half group: D % 64 == 32
    if not FORMATS[storage].fits(D):
        D = 512
    wtype, data, values = weight_of(storage, rand(rng, V, D), layout)
    k = Kernel(tmp_path, tm, tgt.EmbeddingOp, [tgt.memref(8, element_type=i32), wtype, tgt.memref(8, D), IDX])
    tokens = np.array([3, 0, 49, 3, 17, 8, 22, 1], np.int32)
    out = np.full((8, D), np.nan, f32)
    k({"tokens": tokens, "table": data, "out": out, "rows": 7})
    np.testing.assert_array_equal(out[:7], values[tokens[:7]])
    assert np.isnan(out[7]).all()


# rms_norm and quantization -----------------------------------------------------------

@pytest.mark.parametrize("D", [40, 37, 576])
def test_rms_norm(tmp_path, tm, D):
    rng = np.random.default_rng(D)
    eps = 1e-5
    k = Kernel(tmp_path, tm, lambda x, w, o, n: tgt.RMSNormOp(x, w, o, n, eps),
               [tgt.memref(5, D), tgt.WeightType((D,), Storage.F32), tgt.memref(5, D), IDX])
    x, w = rand(rng, 5, D, scale=3.0), rand(rng, D)
    out = np.zeros_like(x)
    k({"x": x, "weight": w, "out": out, "rows": 5})
    assert_close(out, ref_rms_norm(x, w, eps))
    out2 = np.zeros_like(x)  # rows=1 leaves the other rows alone
    k({"x": x, "weight": w, "out": out2, "rows": 1})
    assert_close(out2[:1], ref_rms_norm(x[:1], w, eps))
    assert not out2[1:].any()
    y = x.copy()  # in place (out is x)
    k({"x": y, "weight": w, "out": y, "rows": 5})
    assert_close(y, ref_rms_norm(x, w, eps))


@pytest.mark.parametrize("D", [64, 96, 576])
def test_rms_norm_writes_quantized_rows(tmp_path, tm, D):
    """Normalized rows quantized per 32 as `quantize_rows` would (codes may differ by one
    where the kernel's last float bit puts a value on the other side of a rounding tie)."""
    rng = np.random.default_rng(D)
    k = Kernel(tmp_path, tm, lambda x, w, o, n: tgt.RMSNormOp(x, w, o, n, 1e-5),
               [tgt.memref(4, D), tgt.WeightType((D,), Storage.F32), tgt.QRowsType(4, D), IDX])
    x, w = rand(rng, 4, D, scale=3.0), rand(rng, D)
    buf = np.full(qrows_nbytes(4, D), 0xFF, np.uint8)  # garbage where the padding goes
    k({"x": x, "weight": w, "out": buf, "rows": 3})
    qs, d, s, n = read_qrows(buf, 4, D, 3)
    np.testing.assert_array_equal(n, slice_sums(qs))
    rq, rd, rs = quantize_rows(ref_rms_norm(x[:3], w, 1e-5).astype(f32))
    assert np.abs(qs.astype(int) - rq).max() <= 1 and (qs != rq).mean() < 0.01
    np.testing.assert_allclose(d, rd, rtol=1e-6)
    np.testing.assert_allclose(s, rs, rtol=1e-4, atol=1e-5 * np.abs(rs).max())
    assert not qs[:, D:].any() and not d[:, D // 16:].any()  # padding to whole 64-groups is zero


@pytest.mark.parametrize("D", [32, 64, 160, 1536])
def test_quantize_is_bit_exact(tmp_path, tm, D):
    rng = np.random.default_rng(D)
    k = Kernel(tmp_path, tm, tgt.QuantizeOp, [tgt.memref(6, D), tgt.QRowsType(6, D), IDX])
    x = rand(rng, 6, D, scale=2.0)
    x[0, :32] = 0.0  # an all-zero block: scale 0, codes 0
    x[1, :5] = [1e-30, -1e-30, 3e4, -3e4, 0.5]
    buf = np.zeros(qrows_nbytes(6, D), np.uint8)
    k({"x": x, "out": buf, "rows": 5})
    rq, rd, rs = quantize_rows(x[:5])
    for got, ref in zip(read_qrows(buf, 6, D, 5), (rq, rd, rs, slice_sums(rq)), strict=True):
        np.testing.assert_array_equal(got, ref)


# the matmul family ---------------------------------------------------------------------

FLAGS = list(itertools.product([False, True], repeat=4))


def matmul_op(has_norm=False, has_bias=False, accumulate=False, last_row=False, isa=None, eps=1e-5):
    def make(x, w, out, n, *extra):
        extra = list(extra)
        bias = extra.pop(0) if has_bias else None
        norm = extra.pop(0) if has_norm else None
        op = tgt.MatmulOp(x, w, out, n, bias=bias, norm=norm, eps=eps if has_norm else None, accumulate=accumulate,
                          last_row=last_row)
        if isa is not None:
            op.isa = tgt.IsaAttr(isa)
        return op

    return make


@pytest.mark.parametrize("has_norm,has_bias,accumulate,last_row", FLAGS,
                         ids=["".join(c for c, on in zip("nbal", f) if on) or "plain" for f in FLAGS])
def test_matmul_flags(tmp_path, tm, has_norm, has_bias, accumulate, last_row):
    rng = np.random.default_rng(1)
    K, N, R, eps = 37, 23, 9, 1e-5
    w, bias, nw = rand(rng, N, K), rand(rng, N), rand(rng, K)
    types = [tgt.memref(R, K), f32_weight(w), tgt.memref(R, N), IDX]
    types += [f32_weight(bias)] * has_bias + [f32_weight(nw)] * has_norm
    k = Kernel(tmp_path, tm, matmul_op(has_norm, has_bias, accumulate, last_row), types)
    for n in (1, 3, 4, 9):
        x = np.zeros((R, K), f32)
        x[:n] = rand(rng, n, K)
        xs = x[n - 1 : n] if last_row else x[:n]
        xn = ref_rms_norm(xs, nw, eps) if has_norm else xs.astype(np.float64)
        ref = xn @ w.T.astype(np.float64) + (bias if has_bias else 0)
        out = rand(rng, R, N)
        before = out.copy()
        if accumulate:
            ref = ref + before[: ref.shape[0]]
        k({"x": x, "weight": w, "out": out, "rows": n, "bias": bias, "norm": nw})
        assert_close(out[: ref.shape[0]], ref)
        np.testing.assert_array_equal(out[ref.shape[0]:], before[ref.shape[0]:])


@pytest.mark.parametrize("storage", [Storage.F16, Storage.BF16])
def test_matmul_half_precision_weights(tmp_path, tm, storage):
    rng = np.random.default_rng(11)
    K, N, n = 48, 20, 6
    wtype, data, values = weight_of(storage, rand(rng, N, K))
    k = Kernel(tmp_path, tm, matmul_op(), [tgt.memref(n, K), wtype, tgt.memref(n, N), IDX])
    x, out = rand(rng, n, K), np.zeros((n, N), f32)
    k({"x": x, "weight": data, "out": out, "rows": n})
    assert_close(out, x.astype(np.float64) @ values.T.astype(np.float64), rtol=1e-5)


@pytest.mark.parametrize("K,N,n,has_norm", [(576, 192, 1, False), (576, 192, 67, True), (40, 24, 130, True)])
def test_matmul_shapes(tmp_path, tm, K, N, n, has_norm):
    """SmolLM2-like widths, and row counts crossing the 4-row tiles and 64-row blocks."""
    rng = np.random.default_rng(K + N + n)
    x, w, nw = rand(rng, n, K), rand(rng, N, K, scale=0.05), rand(rng, K)
    types = [tgt.memref(n, K), f32_weight(w), tgt.memref(n, N), IDX] + [f32_weight(nw)] * has_norm
    k = Kernel(tmp_path, tm, matmul_op(has_norm), types)
    out = np.zeros((n, N), f32)
    k({"x": x, "weight": w, "out": out, "rows": n, "norm": nw})
    xn = ref_rms_norm(x, nw, 1e-5) if has_norm else x.astype(np.float64)
    assert_close(out, xn @ w.T.astype(np.float64))


def _int_shape(storage: Storage) -> tuple[int, int]:
    """A matrix shape the format can store, with a half 64-group where its blocks allow."""
    return (19, 288) if FORMATS[storage].fits(288) else (19, 512)


@pytest.mark.parametrize("storage", INTEGER_FORMATS, ids=str)
@pytest.mark.parametrize("has_norm,accumulate,last_row", [(False, False, False), (True, True, False),
                                                          (True, False, True)], ids=["plain", "norm-acc", "norm-last"])
def test_matmul_a32_integer_weights(tmp_path, tm, storage, has_norm, accumulate, last_row):
    """Codes dequantized in registers: the float64 product with the dequantized weights, within 1e-5."""
    rng = np.random.default_rng(12)
    N, K = _int_shape(storage)
    R = 6
    wtype, data, values = weight_of(storage, rand(rng, N, K))
    nw = rand(rng, K)
    types = [tgt.memref(R, K), wtype, tgt.memref(R, N), IDX] + [f32_weight(nw)] * has_norm
    k = Kernel(tmp_path, tm, matmul_op(has_norm, False, accumulate, last_row), types)
    for n in (1, 5):
        x = rand(rng, R, K)
        xs = x[n - 1 : n] if last_row else x[:n]
        xn = ref_rms_norm(xs, nw, 1e-5) if has_norm else xs.astype(np.float64)
        ref = xn @ values.T.astype(np.float64)
        out = rand(rng, R, N)
        if accumulate:
            ref = ref + out[: ref.shape[0]]
        k({"x": x, "weight": data, "out": out, "rows": n, "norm": nw})
        assert_close(out[: ref.shape[0]], ref, rtol=1e-5)


@pytest.mark.parametrize("storage", INTEGER_FORMATS, ids=str)
def test_matmul_a8_equals_the_integer_reference(tmp_path, tm, storage):
    """Integer dot products of codes and int8 rows, for every instruction set the target runs."""
    rng = np.random.default_rng(13)
    N, K = _int_shape(storage)
    R = 6
    w = rand(rng, N, K)
    w[:, :64] *= 20  # a group of large weights: scales of different magnitudes
    qt = FORMATS[storage].quantize(w)
    x = rand(rng, R, K, scale=3.0)
    buf, rows = qrows_of(x, R)
    layouts = [(isa, Layout.SPLIT) for isa in tm.isas] + \
        [(isa, tiles) for isa in tm.isas if isa is not tgt.Isa.GENERIC for tiles in (Layout.TILES, Layout.TILES_AVX2)]
    for isa, layout in layouts:
        wtype, data, _ = weight_of(storage, w, layout)
        for last_row in (False, True):
            k = Kernel(tmp_path, tm, matmul_op(last_row=last_row, isa=isa),
                       [tgt.QRowsType(R, K), wtype, tgt.memref(R, N), IDX])
            for n in (1, 5, 6):
                out = np.zeros((R, N), f32)
                k({"x": buf, "weight": data, "out": out, "rows": n})
                first = n - 1 if last_row else 0
                ref = integer_matmul(rows.qs[first:n], rows.d[first:n], rows.s[first:n], qt)
                assert_close(out[: ref.shape[0]], ref, rtol=2e-6)
                assert not out[ref.shape[0]:].any()


@pytest.mark.parametrize("bits", [8, 16])
def test_a_kernel_built_for_one_row_takes_any_number(tmp_path, tm, bits):
    """One function serves every entry point whose kernel ops differ only in their rows' count (`kernel_key`): a
    matmul emitted for a decode's one row, called with 1, 8 and 11 rows (a verify's), gives each row's integer
    reference on every integer path (AVX2 widens rows that fit in one tile once a call, more a tile at a time)."""
    rng = np.random.default_rng(29)
    N, K, R = 48, 256, 11
    w = rand(rng, N, K)
    qt = FORMATS[Storage.Q8_0].quantize(w)  # (8-bit codes: AVX2 multiplies 16-bit words)
    buf, rows = qrows_of(rand(rng, R, K, scale=3.0), R, bits)
    for isa, layout in [(isa, layout) for layout in (Layout.SPLIT, Layout.TILES) for isa in tm.isas
                        if isa is not tgt.Isa.GENERIC]:
        wtype, data, _ = weight_of(Storage.Q8_0, w, layout)
        k = Kernel(tmp_path, tm, matmul_op(isa=isa), [tgt.QRowsType(1, K, bits), wtype, tgt.memref(1, N), IDX])
        for n in (1, 8, R):
            out = np.zeros((R, N), f32)
            k({"x": buf, "weight": data, "out": out, "rows": n})
            ref = integer_matmul(*rows.values(0, n), qt)
            assert_close(out[:n], ref, rtol=2e-6)
            assert not out[n:].any()


@pytest.mark.parametrize("threads", [2, 3])
def test_the_projections_keep_reserves_the_other_threads_take(tmp_path, tm, threads):
    """Each thread takes its nth of a projection's columns in order, the last part a reserve of chunks
    (together `DEALT_SHARE`, at least `CHUNK_BYTES` of weights each) counted in its word of the work
    counter; then it takes what the others have left of theirs, from the back. Threads at once, or one
    after the other (the first then takes every reserve): each column is added once (an accumulating
    matmul), bit for bit as by one thread; the takes counted are the chunks plus one failed take per
    thread and reserve, and in turn the first thread took its own reserve front to back and all the others'."""
    rng = np.random.default_rng(23)
    N, K, R = 4096, 512, 3  # several chunks of `CHUNK_BYTES` in each reserve
    w = rand(rng, N, K)
    buf, _ = qrows_of(rand(rng, R, K), R)
    layouts = [(tm.isas[0], Layout.SPLIT, TILE_COLS[1])] + \
        [(tm.isas[0], Layout.TILES, STRIP)] * (tm.isas[0] is not tgt.Isa.GENERIC)

    def takes(work: np.ndarray) -> tuple[np.ndarray, np.ndarray]:  # each reserve's: by its thread, by the others
        assert not work[threads:].any()
        return work[:threads] & 0xFFFFFFFF, work[:threads] >> 32

    for isa, layout, unit in layouts:
        wtype, data, _ = weight_of(Storage.Q4_1, w, layout)
        k = Kernel(tmp_path, tm, matmul_op(accumulate=True, isa=isa), [tgt.QRowsType(R, K), wtype, tgt.memref(R, N), IDX])
        units = N // unit
        most = units * DEALT_SHARE[0] // DEALT_SHARE[1]
        chunk = max(-(-CHUNK_BYTES // (unit * wtype.nbytes // N)), -(-most // (threads * CHUNKS_PER_THREAD)))
        reserve = most // (threads * chunk)
        assert reserve >= 2
        start = rand(rng, R, N)
        alone, together, in_turn = start.copy(), start.copy(), start.copy()
        k({"x": buf, "weight": data, "out": alone, "rows": R})
        k({"x": buf, "weight": data, "out": together, "rows": R}, threads)
        np.testing.assert_array_equal(together, alone)
        own, others = takes(k.work)
        assert own.sum() + others.sum() == reserve * threads + threads * threads
        for tid in range(threads):
            k({"x": buf, "weight": data, "out": in_turn, "rows": R}, threads, tid=tid)
        np.testing.assert_array_equal(in_turn, alone)
        own, others = takes(k.work)
        assert own[0] == reserve + 1 and (own[1:] == 1).all()
        assert others[0] == threads - 1 and (others[1:] == reserve + threads - 1).all()


# the instructions that mark each integer path in a kernel's assembly, and those it must not use
ISA_INSTRUCTIONS = {
    tgt.Isa.AMX: ({"tdpbsud", "vpdpbusd", "zmm"}, set()),  # tiles for 16-row blocks, VNNI-512 for the rest
    tgt.Isa.VNNI512: ({"vpdpbusd", "zmm"}, {"tdpbsud"}),
    tgt.Isa.VNNI256: ({"vpdpbusd", "ymm"}, {"zmm", "tdpbsud"}),
    tgt.Isa.AVX2: ({"vpmaddubsw", "vpmaddwd"}, {"vpdpbusd", "zmm"}),
    tgt.Isa.GENERIC: (set(), {"vpdpbusd", "vpmaddubsw", "zmm"}),
}


@pytest.mark.parametrize("isa", host.ISA_CPUS, ids=str)
def test_every_integer_path_compiles(isa):
    """Every host compiles each integer path for a CPU that has it (AMX on an AVX2 host too): the a8
    matmul and SwiGLU kernels use that path's instructions and no wider ones. Those the host runs are
    also executed against the integer reference above."""
    N, K, R = 64, 256, 32
    layout = Layout.SPLIT if isa is tgt.Isa.GENERIC else tiles_layout(isa)  # (what `pack` gives each)
    wtype = tgt.WeightType((N, K), Storage.Q4_1, layout)
    asm = assembly(host.ISA_CPUS[isa], (matmul_op(isa=isa), [tgt.QRowsType(R, K), wtype, tgt.memref(R, N), IDX]),
                   (swiglu_op(isa=isa), [tgt.QRowsType(R, K), wtype, wtype, tgt.QRowsType(R, N), IDX]))
    used, unused = ISA_INSTRUCTIONS[isa]
    assert all(mark in asm for mark in used), [mark for mark in used if mark not in asm]
    assert not any(mark in asm for mark in unused), [mark for mark in unused if mark in asm]


def swiglu_op(isa=None):
    """A swiglu op; a sixth block argument, when given, is its norm weight."""
    def make(x, g, u, out, n, *norm):
        op = tgt.SwigluOp(x, g, u, out, n, norm=norm[0] if norm else None, eps=1e-6 if norm else None)
        if isa is not None:
            op.isa = tgt.IsaAttr(isa)
        return op

    return make


@pytest.mark.parametrize("has_norm", [False, True])
@pytest.mark.parametrize("K,N,n", [(37, 23, 6), (576, 96, 5)])
def test_swiglu(tmp_path, tm, has_norm, K, N, n):
    rng = np.random.default_rng(2)
    x, wg, wu, nw = rand(rng, n, K), rand(rng, N, K, scale=0.3), rand(rng, N, K, scale=0.3), rand(rng, K)
    x[0, :5] *= 40  # large gate values: e**-g far from 1 on both sides
    types = [tgt.memref(n, K), f32_weight(wg), f32_weight(wu), tgt.memref(n, N), IDX] + [f32_weight(nw)] * has_norm
    k = Kernel(tmp_path, tm, swiglu_op(), types)
    out = np.zeros((n, N), f32)
    k({"x": x, "gate": wg, "up": wu, "out": out, "rows": n, "norm": nw})
    xn = ref_rms_norm(x, nw, 1e-6) if has_norm else x.astype(np.float64)
    assert_close(out, silu64(xn @ wg.T.astype(np.float64)) * (xn @ wu.T.astype(np.float64)))


def check_swiglu_rows(out, rows, qg, qu, R: int, N: int, n: int, bits: int = 8) -> None:
    """The quantized rows (of `bits`) a SwiGLU kernel wrote equal the integer reference's, quantized
    (a rounding tie may go either way: int16's finer steps meet more of them), with the padding zero."""
    x = rows.values(0, n)
    y = silu64(integer_matmul(*x, qg)) * integer_matmul(*x, qu)
    qs, d, _, sums = read_qrows(out, R, N, n, bits)
    np.testing.assert_array_equal(sums, slice_sums(qs))
    rq, rd, _ = quantize_rows(y.astype(f32), bits)
    assert np.abs(qs.astype(int) - rq).max() <= 1 and (qs != rq).mean() < (0.01 if bits == 8 else 0.05)
    np.testing.assert_allclose(d, rd, rtol=1e-5)
    assert not qs[:, N:].any()


@pytest.mark.parametrize("storage", [Storage.Q4_1, Storage.Q8_0, Storage.Q6_K], ids=str)
@pytest.mark.parametrize("N", [96, 160])
def test_swiglu_a8_writes_quantized_rows(tmp_path, tm, storage, N):
    """Integer gate and up, output quantized 32 columns at a time by the thread computing them."""
    rng = np.random.default_rng(N)
    K, R = 256, 5
    qg, qu = (FORMATS[storage].quantize(rand(rng, N, K)) for _ in range(2))
    buf, rows = qrows_of(rand(rng, R, K), R)
    layout = Layout.SPLIT if tm.isas[0] is tgt.Isa.GENERIC else tiles_layout(tm.isas[0])
    wtype = tgt.WeightType((N, K), storage, layout)
    gd, ud = pack(qg, layout), pack(qu, layout)
    k = Kernel(tmp_path, tm, swiglu_op(isa=tm.isas[0]), [tgt.QRowsType(R, K), wtype, wtype, tgt.QRowsType(R, N), IDX])
    for n, nth in ((1, 1), (4, 1), (5, 2), (5, 3)):
        out = np.full(qrows_nbytes(R, N), 0xFF, np.uint8)
        for tid in range(nth):
            k({"x": buf, "gate": gd, "up": ud, "out": out, "rows": n}, nth, tid=tid)
        check_swiglu_rows(out, rows, qg, qu, R, N, n)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("storage", [Storage.Q4_1, Storage.Q6_K, Storage.Q8_0], ids=str)
def test_rows_equal_each_row_alone(tmp_path, tm, storage, bits):
    """A batch's rows walk each weight block together in tiles of up to 8 rows (then 4, 2, 1; from 4 rows
    one `vpdpbusd` chain per row and plane, fewer rows two chains each; 5 to 7 rows left, one tile of 8 read from
    a copy of them and zero rows): every row of a call of 1..11 rows is bit for bit that row alone,
    matmul and SwiGLU, on each integer path, int8 and int16 rows, and no row past the call's is written."""
    rng = np.random.default_rng(5)
    N, K, R = 96, 256, 11
    buf, _ = qrows_of(rand(rng, R, K, scale=3.0), R, bits)
    qts = [FORMATS[storage].quantize(rand(rng, N, K)) for _ in range(2)]
    paths = [(isa, layout) for layout in (Layout.SPLIT, Layout.TILES) for isa in tm.isas if isa is not tgt.Isa.GENERIC]
    for isa, layout in paths:
        wtype = tgt.WeightType((N, K), storage, layout)
        gd, ud = (pack(qt, layout) for qt in qts)
        matmul = Kernel(tmp_path, tm, matmul_op(isa=isa), [tgt.QRowsType(R, K, bits), wtype, tgt.memref(R, N), IDX])
        swiglu = Kernel(tmp_path, tm, swiglu_op(isa=isa),
                        [tgt.QRowsType(R, K, bits), wtype, wtype, tgt.QRowsType(R, N, bits), IDX])

        def run(x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
            out, act = np.zeros((R, N), f32), np.zeros(qrows_nbytes(R, N, bits), np.uint8)
            matmul({"x": x, "weight": gd, "out": out, "rows": n})
            swiglu({"x": x, "gate": gd, "up": ud, "out": act, "rows": n})
            return out, act.reshape(R, -1)

        row_bytes = QRowLayout(K, bits).row_bytes
        alone = []
        for t in range(R):
            x = np.zeros_like(buf)
            x[:row_bytes] = buf[t * row_bytes:(t + 1) * row_bytes]
            out, act = run(x, 1)
            alone.append((out[0], act[0]))
        for n in range(1, R + 1):
            out, act = run(buf, n)
            for t in range(n):
                assert np.array_equal(out[t], alone[t][0]) and np.array_equal(act[t], alone[t][1]), (isa, n, t)
            assert not out[n:].any() and not act[n:].any(), (isa, n)


# AMX tiles -------------------------------------------------------------------------

AMX_FORMATS = [s for s in INTEGER_FORMATS if amx_tiles.supports(s)]


@pytest.fixture(scope="module")
def host_amx() -> Machine:
    """The host CPU, for AMX kernels (skipped where the host or its kernel has no AMX-INT8)."""
    if not host.runs(host.ISA_CPUS[tgt.Isa.AMX]):
        pytest.skip(host.why_not(host.ISA_CPUS[tgt.Isa.AMX]))
    return Machine("native", target_machine("native"))


def test_amx_formats_are_those_with_32_value_scales():
    assert Storage.Q4_1 in AMX_FORMATS and Storage.Q8_0 in AMX_FORMATS and Storage.Q4_K in AMX_FORMATS
    assert Storage.Q6_K not in AMX_FORMATS  # 16-value scales: VNNI


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("storage", AMX_FORMATS, ids=str)
@pytest.mark.parametrize("N,K", [(100, 256), (64, 576)])
def test_matmul_amx_equals_the_integer_reference(tmp_path, host_amx, storage, N, K, bits):
    """Tiles for whole 16-row blocks, VNNI for the rows and columns left, on the same
    quantized data as the reference (int16 rows: a tile product per plane); with the tiles
    switched off, the VNNI path alone, bit for bit the tiles' result."""
    tm = host_amx
    rng = np.random.default_rng(17)
    R = 48
    K = K if K % FORMATS[storage].block == 0 else 768  # k-quants: whole 256-blocks
    w = rand(rng, N, K)
    w[:, :64] *= 20
    wtype, data, _ = weight_of(storage, w, Layout.TILES)
    qt = FORMATS[storage].quantize(w)
    buf, rows = qrows_of(rand(rng, R, K, scale=3.0), R, bits)
    k = Kernel(tmp_path, tm, matmul_op(isa=tgt.Isa.AMX), [tgt.QRowsType(R, K, bits), wtype, tgt.memref(R, N), IDX])
    assert k.amx
    flag = ctypes.c_int32.in_dll(k.library, AMX_FLAG)
    outs = {}
    for tiles, n, nth in ((1, 16, 1), (1, 37, 1), (1, 48, 3), (0, 48, 2), (0, 37, 2)):
        flag.value = tiles
        out = np.zeros((R, N), f32)
        k({"x": buf, "weight": data, "out": out, "rows": n}, nth)
        ref = integer_matmul(*rows.values(0, n), qt)
        assert_close(out[:n], ref, rtol=2e-6 * (K / 256) ** 0.5)  # (float sums of K / 32 blocks)
        assert not out[n:].any()
        outs[tiles, n] = out
    np.testing.assert_array_equal(outs[1, 48], outs[0, 48])


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("storage", [Storage.Q4_1, Storage.Q8_0, Storage.Q5_K], ids=str)
def test_swiglu_amx_writes_quantized_rows(tmp_path, host_amx, storage, bits):
    tm = host_amx
    rng = np.random.default_rng(19)
    N, K, R = 160, 256, 40
    wtype = tgt.WeightType((N, K), storage, Layout.TILES)
    qg, qu = (FORMATS[storage].quantize(rand(rng, N, K)) for _ in range(2))
    buf, rows = qrows_of(rand(rng, R, K), R, bits)
    k = Kernel(tmp_path, tm, swiglu_op(isa=tgt.Isa.AMX),
               [tgt.QRowsType(R, K, bits), wtype, wtype, tgt.QRowsType(R, N, bits), IDX])
    for n, nth in ((16, 1), (35, 2)):
        out = np.full(qrows_nbytes(R, N, bits), 0xFF, np.uint8)
        k({"x": buf, "gate": pack(qg, Layout.TILES), "up": pack(qu, Layout.TILES), "out": out, "rows": n}, nth)
        check_swiglu_rows(out, rows, qg, qu, R, N, n, bits)


# elementwise -----------------------------------------------------------------------

@pytest.mark.parametrize("W", [37, 48, 576])
def test_elementwise(tmp_path, tm, W):
    rng = np.random.default_rng(7)
    n = 3
    t = tgt.memref(n, W)
    add = Kernel(tmp_path, tm, tgt.AddOp, [t, t, t, IDX])
    mul = Kernel(tmp_path, tm, tgt.MulOp, [t, t, t, IDX])
    silu = Kernel(tmp_path, tm, tgt.SiluOp, [t, t, IDX])
    a, b = rand(rng, n, W, scale=4.0), rand(rng, n, W)
    a[0, :4] = [-100.0, 100.0, -30.0, 0.0]
    for k, ref in ((add, a.astype(np.float64) + b), (mul, a.astype(np.float64) * b)):
        out = np.zeros_like(a)
        k({"lhs": a, "rhs": b, "out": out, "rows": n})
        assert_close(out, ref, rtol=1e-6)
        inplace = a.copy()
        k({"lhs": inplace, "rhs": b, "out": inplace, "rows": n})
        assert_close(inplace, ref, rtol=1e-6)
    out = np.zeros_like(a)
    silu({"x": a, "out": out, "rows": n})
    assert_close(out, silu64(a))
    part = np.zeros_like(a)
    silu({"x": a, "out": part, "rows": 2})
    assert not part[2].any()


def test_exp_accuracy(tmp_path, tm):
    """The inline exp behind silu and softmax, over its whole range: ≤ 2e-7 relative."""
    from llmc.backends.builder import KernelBuilder

    module = ir.Module(name="kernels")
    g = ir.Function(module, ir.FunctionType(ir.VoidType(), [FPTR, FPTR, I64]), name="exp_map")
    body = KernelBuilder(module, g)
    body.vec_map(g.args[2], [g.args[0]], g.args[1], lambda v: body.exp(v[0]))
    body.finish()
    path = link_shared([compile_to_object(module, tm.tm)], tmp_path / f"e_{uuid.uuid4().hex}.so")
    cdll = ctypes.CDLL(str(path))
    x = np.linspace(-87, 88, 200003).astype(f32)
    y = np.zeros_like(x)
    cdll.exp_map(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(y.ctypes.data), ctypes.c_int64(x.size))
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(y / ref - 1)) < 2e-7
    assert np.all(np.isfinite(y))


# threads ---------------------------------------------------------------------------

@pytest.mark.parametrize("nth", [2, 3, 7])
def test_threads_share_the_work_exactly(tmp_path, tm, nth):
    """Each thread's share, run one after another, gives the single-thread result bit for bit:
    every output element is computed by exactly one thread with the same code."""
    rng = np.random.default_rng(nth)
    K, N, R = 40, 23, 5
    w, wu, bias, nw = rand(rng, N, K), rand(rng, N, K), rand(rng, N), rand(rng, K)
    x = rand(rng, R, K)
    mm = Kernel(tmp_path, tm, matmul_op(True, True), [tgt.memref(R, K), f32_weight(w), tgt.memref(R, N), IDX,
                                                      f32_weight(bias), f32_weight(nw)])
    sw = Kernel(tmp_path, tm, swiglu_op(), [tgt.memref(R, K), f32_weight(w), f32_weight(wu), tgt.memref(R, N),
                                                IDX, f32_weight(nw)])
    qw = FORMATS[Storage.Q4_1].quantize(rand(rng, 96, 256))
    xq, _ = qrows_of(rand(rng, R, 256), R)
    qm = Kernel(tmp_path, tm, matmul_op(isa=tgt.Isa.GENERIC), [tgt.QRowsType(R, 256),
                                                                tgt.WeightType((96, 256), Storage.Q4_1, Layout.SPLIT),
                                                                tgt.memref(R, 96), IDX])
    for k, values, n_out in ((mm, {"x": x, "weight": w, "bias": bias, "norm": nw}, N),
                             (sw, {"x": x, "gate": w, "up": wu, "norm": nw}, N),
                             (qm, {"x": xq, "weight": pack_split(qw)}, 96)):
        whole, parts = np.zeros((R, n_out), f32), np.zeros((R, n_out), f32)
        k({**values, "out": whole, "rows": R})
        for tid in range(nth):
            k({**values, "out": parts, "rows": R}, nth, tid=tid)
        np.testing.assert_array_equal(parts, whole)


# the library -----------------------------------------------------------------------

def test_one_function_per_distinct_kernel_and_readable_names():
    module = ir.Module(name="kernels")
    lib = KernelLibrary(module)
    w = tgt.WeightType((192, 576), Storage.Q4_1, Layout.SPLIT)

    def op(isa: tgt.Isa, rows: int = 4) -> tgt.MatmulOp:
        block = Block(arg_types=[tgt.QRowsType(rows, 576), w, tgt.memref(rows, 192), IDX])
        o = matmul_op(isa=isa)(*block.args)
        block.add_op(o)
        return o

    a = lib.kernel(op(tgt.Isa.VNNI512))
    assert lib.kernel(op(tgt.Isa.VNNI512)) is a  # other SSA values, the same kernel
    assert lib.kernel(op(tgt.Isa.VNNI512, rows=1)) is a  # decode's buffers hold fewer rows: the same kernel
    assert lib.kernel(op(tgt.Isa.AVX2)) is not a
    assert a.name == "matmul_q4_1_a8_k576_n192"
    assert [arg.name for arg in a.args] == ["x", "weight", "out", "rows", "tid", "nth", "work"]
    assert len(lib.functions()) == 2 and len({f.name for f in lib.functions()}) == 2


# targets and the toolchain -----------------------------------------------------------

def test_cpu_targets_record_their_features():
    v3 = cpu_target("x86-64-v3")
    assert v3.cpu.data == "x86-64-v3" and v3.has("avx2", "fma") and not v3.has("avx512f")
    assert integer_isa(v3) is tgt.Isa.AVX2
    assert integer_isa(cpu_target("sapphirerapids")) is tgt.Isa.VNNI512
    assert integer_isa(cpu_target("alderlake")) is tgt.Isa.VNNI256
    assert integer_isa(cpu_target("x86-64")) is tgt.Isa.GENERIC
    assert "+avx2" in llvm_features(v3) and "-avx512vnni" in llvm_features(v3)
    native = cpu_target("native")
    assert native.features <= set(cpu_target("sapphirerapids").features) | native.features
    with pytest.raises(UsageError, match="unknown CPU 'pentium9'.*x86-64-v3"):
        cpu_target("pentium9")


@pytest.mark.parametrize("cpu", ["x86-64-v3", "x86-64", "znver4", "skylake-avx512", "alderlake"])
def test_named_cpus_compile(cpu):
    """Integer and float kernels compile for named CPUs, whether or not this host could run them."""
    from llmc.backends.cpu.target import target_machine_for

    target = cpu_target(cpu)
    module = ir.Module(name="kernels")
    lib = KernelLibrary(module)
    w = tgt.WeightType((192, 512), Storage.Q6_K, Layout.SPLIT)
    block = Block(arg_types=[tgt.QRowsType(4, 512), w, tgt.memref(4, 192), IDX, tgt.memref(4, 512)])
    qm = matmul_op(isa=integer_isa(target))(*block.args[:4])
    am = tgt.MatmulOp(block.args[4], block.args[1], block.args[2], block.args[3])
    for o in (qm, am):
        block.add_op(o)
        lib.kernel(o)
    obj = compile_to_object(module, target_machine_for(target))
    assert obj[:4] == b"\x7fELF"
    assert set(CPUS) >= {"x86-64-v3", "znver4"}


def test_unknown_triple_is_a_clean_error():
    with pytest.raises(ToolchainError):
        target_machine(triple="no-such-arch-unknown-linux")


def test_missing_compiler(tmp_path, tm, monkeypatch):
    module = ir.Module(name="kernels")
    block = Block(arg_types=[tgt.memref(1, 8)] * 3 + [IDX])
    o = tgt.AddOp(*block.args)
    block.add_op(o)
    KernelLibrary(module).kernel(o)
    obj = compile_to_object(module, tm.tm)
    monkeypatch.setenv("CC", "/nonexistent")
    with pytest.raises(ToolchainError) as info:
        link_shared([obj], tmp_path / "k.so")
    assert isinstance(info.value, LlmcError)
    assert "\n" not in str(info.value) and "/nonexistent" in str(info.value)
    assert not (tmp_path / "k.so").exists()


@pytest.mark.parametrize(("cc", "message"), [('"unclosed', "$CC is not a command line"),
                                              ("true", "exited 0 without writing the library")])
def test_a_cc_that_is_no_compiler_is_one_line(tmp_path, monkeypatch, cc: str, message: str):
    monkeypatch.setenv("CC", cc)
    with pytest.raises(ToolchainError, match=re.escape(message)) as info:
        link_shared([b"an object file"], tmp_path / "k.so")
    assert "\n" not in str(info.value) and not list(tmp_path.iterdir())


def test_link_failure(tmp_path):
    with pytest.raises(ToolchainError) as info:
        link_shared([b"not an object file"], tmp_path / "k.so")
    assert "\n" not in str(info.value)
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob(".*.tmp"))


def test_a_cpu_s_prefetch_distance_changes_the_one_row_code_not_its_results(tmp_path):
    """`target.near_prefetch_bytes` (Zen 5's: 8 KB, twice the default) and an L2 prefetch as well (the AMX Xeon's,
    `rocketlake`: 16 KB ahead) reach a one-row tiles kernel: its code differs from the default's, its results are
    the same bits, on one thread and on two."""
    isa_cpu = host.ISA_CPUS[tgt.Isa.VNNI512]
    if not host.runs(isa_cpu):
        pytest.skip(host.why_not(isa_cpu))
    near = near_prefetch_bytes(cpu_target("znver5"))
    assert near != PREFETCH_BYTES == near_prefetch_bytes(cpu_target("znver4"))
    N, K = 300, 1024  # (a strip's 32 blocks of q4_1 codes: 8 KB, so the farther prefetch lands in the next strip)
    types = [tgt.memref(1, K), tgt.WeightType((N, K), Storage.Q4_1, Layout.TILES), tgt.memref(1, N), IDX,
             tgt.WeightType((K,), Storage.F32)]
    rng = np.random.default_rng(5)
    data = pack(FORMATS[Storage.Q4_1].quantize(rand(rng, N, K)), Layout.TILES)
    x, g = rand(rng, 1, K), rand(rng, K)
    machine = Machine(isa_cpu, target_machine(isa_cpu))
    far = kernel_tuning(cpu_target("rocketlake")).l2_prefetch_bytes
    assert far and not kernel_tuning(cpu_target("znver5")).l2_prefetch_bytes
    kernels = [Kernel(tmp_path, machine, lm_head_op(1, K), types, prefetch_bytes=b) for b in (PREFETCH_BYTES, near)]
    kernels.append(Kernel(tmp_path, machine, lm_head_op(1, K), types, l2_prefetch_bytes=far))
    assert len({k.ir for k in kernels}) == 3 and "i32 0, i32 2, i32 1)" in kernels[2].ir  # (llvm.prefetch into L2)
    for nth in (1, 2):
        outs = [np.zeros((1, N), np.float32) for _ in kernels]
        for k, out in zip(kernels, outs):
            k({"x": x, "weight": data, "out": out, "rows": 1, "norm": g}, nth=nth)
        assert np.abs(outs[0]).max() > 0
        for out in outs[1:]:
            np.testing.assert_array_equal(out, outs[0])


# greedy decoding's argmax ------------------------------------------------------------

@pytest.mark.parametrize("nth", [1, 2, 3])
def test_the_threads_argmax_is_numpys(tm, tmp_path, nth) -> None:
    """`llmc_argmax` (the thread team's, for greedy decoding): the largest of the threads' firsts, the earliest
    thread's on ties, is numpy's argmax of each row, where the largest is tied across the threads' shares and
    within a 16-float vector, where every logit is -inf, where the only finite one is the last (a share's tail);
    a share past the row's end is -1."""
    module = ir.Module(name="kernels")
    fn = argmax_kernel(module)
    library = ctypes.CDLL(str(link_shared([compile_to_object(module, tm.tm)], tmp_path / f"a_{uuid.uuid4().hex}.so")))
    run = getattr(library, fn.name)
    vocab = 269
    logits = np.random.default_rng(2).standard_normal((5, vocab)).astype(np.float32)
    logits[1, [vocab - 1, vocab // 2, 18, 34]] = 9.0
    logits[2] = -np.inf
    logits[3] = -np.inf
    logits[3, -1] = -5.0
    logits[4, 20:] = -np.inf

    def argmaxes(rows: int, count: int) -> tuple[list[int], np.ndarray]:
        """Each row's argmax as the session takes it from the threads' firsts, and the firsts."""
        firsts = np.full(rows * nth, -7, np.int64)
        for tid in range(nth):
            run(ctypes.c_void_p(logits.ctypes.data), ctypes.c_int64(rows), ctypes.c_int64(count),
                ctypes.c_int64(tid), ctypes.c_int64(nth), ctypes.c_void_p(firsts.ctypes.data))
        out = []
        for row, ours in zip(logits.ravel()[: rows * count].reshape(rows, count), firsts.reshape(rows, nth)):
            best = -1
            for i in ours.tolist():
                if i >= 0 and (best < 0 or row[i] > row[best]):
                    best = i
            out.append(best)
        return out, firsts

    got, firsts = argmaxes(5, vocab)
    assert got == logits.argmax(axis=1).tolist() and ((firsts >= 0) & (firsts < vocab)).all()
    got, firsts = argmaxes(1, 16)  # one vector: the threads' shares but one are empty
    assert got == [int(np.argmax(logits[0, :16]))] and sorted(firsts.tolist())[:-1] == [-1] * (nth - 1)


@pytest.mark.parametrize("nth", [1, 2, 3])
def test_the_threads_weighing_is_numpys_and_draws_what_the_sampler_draws(tm, tmp_path, nth) -> None:
    """`llmc_weigh` (the thread team's, for sampling): each `WEIGH_BLOCK` block's largest logit and each
    `WEIGH_GROUP` group's are numpy's, bit for bit, and a block's sum of exp((logit − largest) · scale) numpy's
    in float64 to float32 rounding: 17 whole blocks, a row's last block of 3 vectors and 5 floats (a partial
    group), a block where all but one logit are -inf, temperatures 1, 2 and 1/1000; a row of negative scale is
    not written, nor past the rows asked for. A draw from them is the sampler's own (`draw(*weights(…))`) for
    100 seeds a row: without a filter `llmc_draw`'s (by the uniform the sampler draws first), with each filter
    `Sampler.draw_weighed`'s. A row all at -inf draws nothing (-1); a row of negative scale or uniform is left."""
    from llmc.runtime.sampling import Sampler, SamplingOptions

    module = ir.Module(name="kernels")
    fn, draw_fn = weigh_kernel(module), draw_kernel(module)
    library = ctypes.CDLL(str(link_shared([compile_to_object(module, tm.tm)], tmp_path / f"w_{uuid.uuid4().hex}.so")))
    run, draw = getattr(library, fn.name), getattr(library, draw_fn.name)
    count = 17 * WEIGH_BLOCK + 53  # (18 blocks: the draw's masses 16 at a time, then one at a time)
    blocks, groups = -(-count // WEIGH_BLOCK), -(-count // WEIGH_GROUP)
    logits = (3 * np.random.default_rng(3).standard_normal((6, count))).astype(np.float32)
    logits[1, WEIGH_BLOCK : 2 * WEIGH_BLOCK] = -np.inf
    logits[1, WEIGH_BLOCK + 700] = 4.5
    logits[5] = -np.inf
    temperatures = {0: 1.0, 1: 2.0, 3: 1e-3, 5: 1.0}
    scales = np.array([Sampler(SamplingOptions(temperatures[r])).scale if r in temperatures else -1.0
                       for r in range(6)], np.float32)
    scales[4] = -1.0
    out = np.full((6, blocks, 2), 7.0, np.float32)
    maxima = np.full((6, groups), 7.0, np.float32)
    pointers = [ctypes.c_void_p(a.ctypes.data) for a in (scales, out)]
    for tid in range(nth):
        run(ctypes.c_void_p(logits.ctypes.data), ctypes.c_int64(6), ctypes.c_int64(count), ctypes.c_int64(tid),
            ctypes.c_int64(nth), *pointers, ctypes.c_void_p(maxima.ctypes.data))
    padded = np.concatenate([logits, np.full((6, groups * WEIGH_GROUP - count), -np.inf, np.float32)], axis=1)
    for r in (0, 1, 3):
        assert (maxima[r] == padded[r].reshape(groups, WEIGH_GROUP).max(axis=1)).all()
        for b in range(blocks):
            block = logits[r, b * WEIGH_BLOCK : (b + 1) * WEIGH_BLOCK].astype(np.float64)
            largest = block.max()
            with np.errstate(invalid="ignore"):
                mass = np.exp((block - largest) * float(scales[r])).sum()
            assert out[r, b, 0] == np.float32(largest)
            np.testing.assert_allclose(out[r, b, 1], mass, rtol=2e-6)
    assert (out[2] == 7.0).all() and (out[4] == 7.0).all() and (maxima[2] == 7.0).all() and (maxima[4] == 7.0).all()
    for seed in range(100):
        ours = {r: Sampler(SamplingOptions(temperatures[r], seed=seed)) for r in temperatures}
        uniforms = np.array([ours[r].rng.random() if r in ours else 0.5 for r in range(6)], np.float64)
        uniforms[2] = -1.0
        tokens = np.full(6, 77, np.int64)
        draw(ctypes.c_void_p(logits.ctypes.data), ctypes.c_int64(6), ctypes.c_int64(count), *pointers,
             ctypes.c_void_p(uniforms.ctypes.data), ctypes.c_void_p(tokens.ctypes.data))
        for r in (0, 1, 3):
            theirs = Sampler(SamplingOptions(temperatures[r], seed=seed))
            assert tokens[r] == theirs.draw(*theirs.weights(logits[r])), (seed, r)
        assert tokens[5] == -1 and tokens[2] == tokens[4] == 77
    for r in (0, 1, 3):
        for filters in ({"top_k": 40}, {"top_p": 0.9}, {"min_p": 0.05}, {"top_k": 40, "top_p": 0.95, "min_p": 0.05}):
            for seed in range(100):
                ours, theirs = (Sampler(SamplingOptions(temperatures[r], seed=seed, **filters)) for _ in range(2))
                assert ours.draw_weighed(logits[r], out[r], maxima[r]) == theirs.draw(*theirs.weights(logits[r]))
    assert Sampler(SamplingOptions(1.0, top_k=40)).draw_weighed(logits[5], out[5], maxima[5]) is None


# the kernel cache ------------------------------------------------------------------

def test_the_kernel_cache_returns_what_llvm_made_for_the_same_text_and_target(tmp_path, monkeypatch):
    """A second compile of the same module for the same target is the cache's copy, byte for byte;
    another target or optimization level is compiled anew; a damaged entry is compiled again; the
    cache can be turned off."""
    from llmc import cache

    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path))
    module = ir.Module(name="kernels")
    read_probe(module)
    text = str(module)
    first = compile_to_object(text, target_machine("x86-64-v3"))
    entries = list((tmp_path / "kernels").iterdir())
    assert len(entries) == 1 and entries[0].read_bytes()[32:] == first
    assert compile_to_object(text, target_machine("x86-64-v3")) == first
    compile_to_object(text, target_machine("x86-64"))
    compile_to_object(text, target_machine("x86-64-v3"), level=1)
    assert len(list((tmp_path / "kernels").iterdir())) == 3
    entries[0].write_bytes(entries[0].read_bytes()[:-1])  # cut short
    assert compile_to_object(text, target_machine("x86-64-v3")) == first
    assert entries[0].read_bytes()[32:] == first  # stored again
    monkeypatch.setenv("LLMC_CACHE_DIR", cache.OFF)
    assert cache.cache_dir("kernels") is None and compile_to_object(text, target_machine("x86-64-v3")) == first
    monkeypatch.setenv("LLMC_CACHE_DIR", " OFF")
    assert cache.cache_dir("kernels") is None
