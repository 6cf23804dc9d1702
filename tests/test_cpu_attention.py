"""CPU RoPE and attention kernels (the harness: `kernel_harness`), against numpy in float64: the rotation, the
cache write (f32, f16 and q8_0 rows), prefill's query tiles and decode's split positions, windows, soft-caps,
caches of several sequences, quantized output rows. Max abs error ≤ 1e-4 · max|ref| + 1e-6."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from kernel_harness import IDX, Kernel, assembly, assert_close, attention_op, f32, rand, read_qrows
from xdsl.dialects.builtin import f16 as F16_ATTR
from xdsl.dialects.builtin import f32 as F32_ATTR
from xdsl.dialects.builtin import i8, i32

from llmc.ir import llm, tgt
from llmc.ir.formats import quantize_rows, slice_sums
from llmc.ir.interpreter import rope_inv_freq
from llmc.ir.layouts import qrows_nbytes


def ref_rope(x, positions, theta, dims=0, mscale=1.0, factors=()):
    """Rotate-half RoPE of the first `dims` of each head, frequencies divided by `factors`."""
    dims = dims or x.shape[-1]
    half = dims // 2
    freqs = 1.0 / theta ** (np.arange(0, dims, 2, dtype=f32) / dims) / (np.asarray(factors, f32) if factors else 1)
    angles = positions.astype(f32)[:, None] * freqs.astype(f32)[None, :]
    cos, sin = np.cos(angles)[:, None, :] * mscale, np.sin(angles)[:, None, :] * mscale
    x1, x2 = x[..., :half], x[..., half:dims]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., dims:]], axis=-1).astype(f32)


def ref_attention(q, keys, values, positions, window=None, softcap=None, scale=None):
    """q [T, H, D]; keys/values [KVH, S, D] (the layer cache); causal by position (within the
    last `window` positions), scores scaled by `scale` (1/sqrt(D)) and soft-capped."""
    t, heads, d = q.shape
    group = heads // keys.shape[0]
    out = np.zeros((t, heads, d))
    for ti, p in enumerate(positions):
        first = 0 if window is None else max(0, p + 1 - window)
        for h in range(heads):
            k = keys[h // group, first: p + 1].astype(np.float64)
            v = values[h // group, first: p + 1].astype(np.float64)
            s = k @ q[ti, h].astype(np.float64) * (1 / np.sqrt(d) if scale is None else scale)
            if softcap is not None:
                s = softcap * np.tanh(s / softcap)
            e = np.exp(s - s.max())
            out[ti, h] = (e / e.sum()) @ v
    return out


ROPE = llm.RopeAttr(10000.0)


@pytest.mark.parametrize("H,D,theta,start,scaled", [
    (4, 8, 10000.0, 0, {}), (4, 8, 10000.0, 1000, {}), (9, 64, 100000.0, 300, {}), (4, 8, 10000.0, 8000, {}),
    (4, 8, 10000.0, 300, {"factors": (1.0, 2.5, 4.0, 8.0)}),  # scaled frequencies (llama3, linear, YaRN)
    (3, 16, 10000.0, 300, {"dims": 8, "mscale": 1.25}),  # partial rotary, an attention factor
])
def test_rope(tmp_path, tm, H, D, theta, start, scaled):
    rng = np.random.default_rng(3)
    n = 7
    k = Kernel(tmp_path, tm, lambda x, p, r: tgt.RopeOp(x, p, r, llm.RopeAttr(theta, **scaled)),
               [tgt.memref(n, H, D), tgt.memref(n, element_type=i32), IDX])
    x = rand(rng, n, H, D)
    y = x.copy()
    k({"x": y, "positions": positions(start, n, n), "rows": n})
    assert_close(y, ref_rope(x, np.arange(start, start + n), theta, **scaled))


@pytest.mark.parametrize("D", [10, 64])
def test_rope_angles_exact(tmp_path, tm, D):
    """The inline sin/cos (no libm) equal libm's to 1e-6 over positions up to 2**17: rotating
    (1, 0) pairs leaves cos in the first half and sin in the second."""
    pos = np.concatenate([np.arange(0, 64), np.geomspace(64, 2 ** 17, 64).astype(np.int64)]).astype(np.int32)
    n = len(pos)
    k = Kernel(tmp_path, tm, lambda x, p, r: tgt.RopeOp(x, p, r, llm.RopeAttr(10000.0)),
               [tgt.memref(n, 1, D), tgt.memref(n, element_type=i32), IDX])
    y = np.zeros((n, 1, D), f32)
    y[..., : D // 2] = 1.0
    k({"x": y, "positions": pos, "rows": n})
    angles = (pos.astype(f32)[:, None] * rope_inv_freq(D, ROPE)[None, :]).astype(np.float64)
    np.testing.assert_allclose(y[:, 0, : D // 2], np.cos(angles), rtol=0, atol=1e-6)
    np.testing.assert_allclose(y[:, 0, D // 2 :], np.sin(angles), rtol=0, atol=1e-6)


def positions(start: int, n: int, capacity: int) -> np.ndarray:
    """The positions of n consecutive rows from `start`, in a buffer of `capacity` rows."""
    out = np.zeros(capacity, np.int32)
    out[:n] = np.arange(start, start + n)
    return out


def attention_kernel(tmp_path, tm, H, KVH, D, S, R, rope, quantized=False, cache=f32, **scoring):
    return Kernel(tmp_path, tm, *attention_op(R, H, KVH, D, S, ROPE if rope else None,
                                              tgt.QRowsType(R, H * D) if quantized else None,
                                              F16_ATTR if cache == np.float16 else F32_ATTR, **scoring))


def partials(H, D) -> np.ndarray:
    return np.zeros(tgt.dims(tgt.AttentionOp.partials_type(H, D)), f32)


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("H,KVH,D,S", [(4, 2, 8, 32), (4, 4, 8, 32), (6, 1, 6, 24), (9, 3, 64, 64),
                                        (4, 1, 136, 24)])  # (wider than UNROLLED_HEAD_DIM: loops, a narrow tail)
@pytest.mark.parametrize("nth,cache", [(1, f32), (3, f32), (2, np.float16)])
def test_attention(tmp_path, tm, rope, H, KVH, D, S, nth, cache):
    """A 5-row prefill at 0 (query tiles), then 3 more rows at start=5 (positions split
    among the threads, partials merged) against a recomputation over all 8 rows; the
    layer's cache holds every (rotated) key and value, rounded to the cache's type."""
    rng = np.random.default_rng(5)
    theta, total = 10000.0, 8
    k_fn = attention_kernel(tmp_path, tm, H, KVH, D, S, total, rope, cache=cache)
    q, k, v = rand(rng, total, H, D), rand(rng, total, KVH, D), rand(rng, total, KVH, D)
    kc, vc = rand(rng, KVH, S, D).astype(cache), rand(rng, KVH, S, D).astype(cache)  # unused positions: garbage
    kc0, vc0 = kc.copy(), vc.copy()
    pos = np.arange(total)
    qr = ref_rope(q, pos, theta) if rope else q
    kr = ref_rope(k, pos, theta) if rope else k
    for lo, hi in ((0, 5), (5, 8)):
        qa, ka, va = (np.zeros_like(a) for a in (q, k, v))
        qa[: hi - lo], ka[: hi - lo], va[: hi - lo] = q[lo:hi], k[lo:hi], v[lo:hi]
        out = np.zeros((total, H, D), f32)
        k_fn({"q": qa, "k": ka, "v": va, "k_cache": kc, "v_cache": vc, "out": out,
              "positions": positions(lo, hi - lo, total), "partials": partials(H, D), "rows": hi - lo}, nth)
        keys, values = kc0.copy(), vc0.copy()
        keys[:, :hi] = kr[:hi].transpose(1, 0, 2)
        values[:, :hi] = v[:hi].transpose(1, 0, 2)
        assert_close(out[: hi - lo], ref_attention(qr[lo:hi], keys, values, pos[lo:hi]))
        assert_close(kc[:, :hi], kr[:hi].transpose(1, 0, 2).astype(cache))
        np.testing.assert_array_equal(vc[:, :hi], v[:hi].transpose(1, 0, 2).astype(cache))
        if rope:  # q and k rotated in place
            assert_close(qa[: hi - lo], qr[lo:hi])
            assert_close(ka[: hi - lo], kr[lo:hi])
    for c, c0 in ((kc, kc0), (vc, vc0)):  # positions past the last row untouched
        np.testing.assert_array_equal(c[:, total:], c0[:, total:])


@pytest.mark.parametrize("scoring,D", [({"window": 3}, 16), ({"window": 70}, 16), ({"softcap": 2.0}, 16),
                                       ({"scale": 0.9}, 16), ({"window": 5, "softcap": 3.0, "scale": 0.5}, 16),
                                       ({"window": 40}, 256), ({"softcap": 2.0}, 256)])
@pytest.mark.parametrize("nth", [1, 2])
def test_attention_scoring_options(tmp_path, tm, scoring, D, nth):
    """`window` (sliding-window attention), `softcap` and `scale`: a 78-row prefill (query tiles
    whose rows start at different window positions, over two position blocks; heads of 256, the Gemma 3
    270M model's: three blocks of 32 positions, `STAGED_FLOATS`, each query's weighted V rows summed in
    passes over D's chunks) then 2 decode rows (the window's positions split among the threads), against
    the float64 reference."""
    rng = np.random.default_rng(9)
    H, KVH, S, total = 4, 2, 96, 80
    k_fn = Kernel(tmp_path, tm, lambda q, k, v, kc, vc, o, p, s, n: tgt.AttentionOp(
                      q, k, v, kc, vc, o, p, s, n, **llm.AttentionOp.scoring_properties(**scoring)),
                  [tgt.memref(total, H, D), tgt.memref(total, KVH, D), tgt.memref(total, KVH, D),
                   tgt.memref(KVH, S, D), tgt.memref(KVH, S, D), tgt.memref(total, H, D),
                   tgt.memref(total, element_type=i32), tgt.AttentionOp.partials_type(H, D), IDX])
    q, k, v = (3 * rand(rng, total, heads, D) for heads in (H, KVH, KVH))  # scores large enough to cap
    kc, vc = np.zeros((KVH, S, D), f32), np.zeros((KVH, S, D), f32)
    for lo, hi in ((0, 78), (78, 79), (79, 80)):
        out = np.zeros((total, H, D), f32)
        rows = {"q": q[lo:hi].copy(), "k": k[lo:hi].copy(), "v": v[lo:hi].copy()}
        rows = {n: np.concatenate([a, np.zeros((total - a.shape[0], *a.shape[1:]), f32)]) for n, a in rows.items()}
        k_fn({**rows, "k_cache": kc, "v_cache": vc, "out": out, "positions": positions(lo, hi - lo, total),
              "partials": partials(H, D), "rows": hi - lo}, nth)
        expected = ref_attention(q[lo:hi], kc, vc, np.arange(lo, hi), **scoring)
        assert_close(out[: hi - lo], expected)
    plain = ref_attention(q[79:], kc, vc, np.arange(79, 80))
    assert np.abs(plain - ref_attention(q[79:], kc, vc, np.arange(79, 80), **scoring)).max() > 1e-3  # not vacuous


@pytest.mark.parametrize("nth", [1, 2])
def test_attention_in_a_cache_of_several_sequences(tmp_path, tm, nth):
    """`slots`: each row is written to and attends within its own sequence's cache. A 13-row call
    whose rows belong to three sequences, interleaved (query tiles taken one sequence at a time),
    then a decode-style call of one row per sequence (positions split among the threads)."""
    rng = np.random.default_rng(11)
    H, KVH, D, S, SLOTS, R = 4, 2, 16, 24, 3, 13
    split = 4
    k_fn = Kernel(tmp_path, tm, lambda q, k, v, kc, vc, o, p, sl, s, n: tgt.AttentionOp(q, k, v, kc, vc, o, p, s, n,
                                                                                         ROPE, slots=sl),
                  [tgt.memref(R, H, D), tgt.memref(R, KVH, D), tgt.memref(R, KVH, D),
                   tgt.memref(SLOTS, KVH, S, D), tgt.memref(SLOTS, KVH, S, D), tgt.memref(R, H, D),
                   tgt.memref(R, element_type=i32), tgt.memref(R, element_type=i32),
                   tgt.AttentionOp.partials_type(H, D, split), IDX])
    kc, vc = rand(rng, SLOTS, KVH, S, D), rand(rng, SLOTS, KVH, S, D)
    history: dict[int, list[tuple[np.ndarray, np.ndarray]]] = {s: [] for s in range(SLOTS)}  # rotated k, v rows
    calls = [[0, 1, 0, 2, 1, 1, 0, 2, 2, 0, 1, 0, 0], [2, 0, 1]]
    for slots in calls:
        n = len(slots)
        q, k, v = rand(rng, R, H, D), rand(rng, R, KVH, D), rand(rng, R, KVH, D)
        pos, seen = np.zeros(R, np.int32), {s: len(history[s]) for s in range(SLOTS)}
        for t, slot in enumerate(slots):
            pos[t] = seen[slot]
            seen[slot] += 1
        qr, kr = ref_rope(q[:n], pos[:n], 10000.0), ref_rope(k[:n], pos[:n], 10000.0)
        for t, slot in enumerate(slots):
            history[slot].append((kr[t], v[t]))
        out = np.zeros((R, H, D), f32)
        ids = np.zeros(R, np.int32)
        ids[:n] = slots
        k_fn({"q": q, "k": k, "v": v, "k_cache": kc, "v_cache": vc, "out": out, "positions": pos, "slots": ids,
              "partials": np.zeros(tgt.dims(tgt.AttentionOp.partials_type(H, D, split)), f32),
              "rows": n}, nth)
        for t, slot in enumerate(slots):
            keys = np.stack([kv[0] for kv in history[slot]], axis=1)  # [KVH, positions, D]
            values = np.stack([kv[1] for kv in history[slot]], axis=1)
            np.testing.assert_allclose(kc[slot][:, : keys.shape[1]], keys, rtol=1e-5, atol=1e-5)
            assert_close(out[t : t + 1], ref_attention(qr[t : t + 1], keys, values, pos[t : t + 1]))


def deals_evenly(slots: np.ndarray, lengths: np.ndarray, kv_heads: int, nth: int) -> bool:
    """Whether decode's rows take whole (row, kv head) items on `nth` threads: every row a sequence of its own, and
    no thread's items (tid, tid + nth, …) more than 5/4 of a thread's share of the positions they attend to."""
    load = np.repeat(lengths, kv_heads)
    heaviest = max(load[j::nth].sum() for j in range(nth))
    return len(set(slots.tolist())) == len(slots) and 4 * nth * heaviest <= 5 * load.sum()


@pytest.mark.parametrize("nth,cache,D", [(nth, cache, 32) for nth in (1, 2, 3) for cache in ("f32", "f16", "q8_0")]
                         + [(2, "f16", 256), (3, "q8_0", 256)])
def test_decode_rows_of_sequences_of_their_own_take_whole_items(tmp_path, tm, nth, cache, D):
    """A decode of 7 rows, each in a sequence of its own, at depths near each other (and an 8th outside the cache,
    skipped), with an f32, f16 or q8_0 cache (heads of 256 too: staged blocks, each query alone, G being 3): the threads take whole (row, kv head) items and wait at no barrier inside the kernel (the barrier's
    generation never moves); each row's rotated K and its V are in its sequence's cache and its output matches the
    reference over that cache (RoPE, GQA) and, bit for bit, the output of the row decoded alone. Two rows of one
    sequence, or (on 3 threads) one row far longer than the rest, have the threads split the positions instead
    (the generation moves, from 2 threads) and match all the same."""
    rng = np.random.default_rng(12)
    H, KVH, S, SLOTS, R = 6, 2, 64, 8, 8
    element = {"f32": F32_ATTR, "f16": F16_ATTR, "q8_0": i8}[cache]
    W = tgt.kv_row_width(D, element)

    def stored(x: np.ndarray) -> np.ndarray:
        """Rows of D floats as the cache holds them."""
        return q8_rows(x) if cache == "q8_0" else x.astype(np.float16 if cache == "f16" else f32)

    def values(rows: np.ndarray) -> np.ndarray:
        """The cache's rows as floats."""
        return q8_values(rows, D) if cache == "q8_0" else rows.astype(f32)
    k_fn = Kernel(tmp_path, tm, lambda q, k, v, kc, vc, o, p, sl, s, n: tgt.AttentionOp(q, k, v, kc, vc, o, p, s, n,
                                                                                         ROPE, slots=sl),
                  [tgt.memref(R, H, D), tgt.memref(R, KVH, D), tgt.memref(R, KVH, D),
                   tgt.memref(SLOTS, KVH, S, W, element_type=element), tgt.memref(SLOTS, KVH, S, W, element_type=element),
                   tgt.memref(R, H, D), tgt.memref(R, element_type=i32), tgt.memref(R, element_type=i32),
                   tgt.AttentionOp.partials_type(H, D, R), IDX])
    calls = [  # (slots, positions, whole items)
        ([3, 0, 6, 1, 5, 2, 7, 4], [19, 21, 18, 20, 22, 17, 20, S + 3], True),
        ([3, 3, 6, 1, 5, 2, 7, 4], [23, 24, 19, 21, 23, 18, 21, 5], False),  # rows 0 and 1: one sequence
        ([0, 1, 2, 3, 4, 5, 6, 7], [60, 2, 3, 2, 4, 3, 2, 3], nth < 3),  # row 0: 61 positions of 82 (each
    ]                                                                    # thread one of its heads, from 2 threads)
    for slots, pos, whole in calls:
        slots, pos = np.array(slots, np.int32), np.array(pos, np.int32)
        assert deals_evenly(slots, np.where(pos < S, pos + 1, 0), KVH, nth) == whole
        kc, vc = stored(rand(rng, SLOTS, KVH, S, D)), stored(rand(rng, SLOTS, KVH, S, D))
        q, k, v = rand(rng, R, H, D), rand(rng, R, KVH, D), rand(rng, R, KVH, D)
        kc_before, vc_before, out = kc.copy(), vc.copy(), np.zeros((R, H, D), f32)

        def call(rows: int, order: np.ndarray, k_cache: np.ndarray, v_cache: np.ndarray, out: np.ndarray) -> None:
            k_fn({"q": q[order].copy(), "k": k[order].copy(), "v": v[order].copy(), "k_cache": k_cache,
                  "v_cache": v_cache, "out": out, "positions": pos[order], "slots": slots[order],
                  "partials": np.zeros(tgt.dims(tgt.AttentionOp.partials_type(H, D, R)), f32), "rows": rows}, nth)

        call(R, np.arange(R), kc, vc, out)
        assert (k_fn.sync[1] == 0) == (whole or nth == 1)
        for t in range(R if whole else 0):
            alone = np.zeros((R, H, D), f32)
            call(1, np.roll(np.arange(R), -t), kc_before.copy(), vc_before.copy(), alone)
            np.testing.assert_array_equal(alone[0], out[t])
        inside = pos < S
        for t in np.flatnonzero(inside):
            p = pos[t : t + 1]
            # (the kernel's sin and cos are within an ulp of numpy's: a rounding may go the other way)
            rotated = ref_rope(k[t : t + 1], p, 10000.0)[0]
            rtol, atol = {"f32": (1e-5, 1e-5), "f16": (2e-3, 1e-6), "q8_0": (0, np.abs(rotated).max() / 127)}[cache]
            np.testing.assert_allclose(values(kc[slots[t], :, p[0]]), rotated, rtol=rtol, atol=atol)
            np.testing.assert_array_equal(vc[slots[t], :, p[0]], stored(v[t]))
            assert_close(out[t : t + 1], ref_attention(ref_rope(q[t : t + 1], p, 10000.0), values(kc[slots[t]]),
                                                       values(vc[slots[t]]), p))
        for t in np.flatnonzero(~inside):
            assert not out[t].any()
            np.testing.assert_array_equal(kc[slots[t]], kc_before[slots[t]])


def q8_rows(x: np.ndarray) -> np.ndarray:
    """Rows `[..., D]` as a q8_0 cache holds them: D int8 values, then one f32 scale per 32 (as bytes)."""
    flat = x.reshape(-1, x.shape[-1])
    qs, d, _ = quantize_rows(flat)
    width = flat.shape[1]
    out = np.concatenate([qs[:, :width].view(np.uint8), d[:, : width // 16 : 2].copy().view(np.uint8)], axis=1)
    return out.view(np.int8).reshape(*x.shape[:-1], -1)


def q8_values(rows: np.ndarray, D: int) -> np.ndarray:
    flat = rows.reshape(-1, rows.shape[-1])
    scales = np.ascontiguousarray(flat[:, D:]).view(np.float32)
    return (flat[:, :D].astype(np.float32) * scales.repeat(32, axis=1)).reshape(*rows.shape[:-1], D)


@pytest.mark.parametrize("nth,D", [(1, 64), (2, 64), (2, 256)])
def test_attention_with_a_q8_0_cache(tmp_path, tm, nth, D):
    """A q8_0 cache: each new row stored as the numpy q8_0 encoding of the rotated k and v,
    byte for byte; attention over the stored values (prefill tiles, then decode's split; heads of 256 too)."""
    rng = np.random.default_rng(8)
    H, KVH, S, total = 4, 2, 80, 8
    W = tgt.kv_row_width(D, i8)
    k_fn = Kernel(tmp_path, tm, lambda q, k, v, kc, vc, o, p, s, n: tgt.AttentionOp(q, k, v, kc, vc, o, p, s, n, ROPE),
                  [tgt.memref(total, H, D), tgt.memref(total, KVH, D), tgt.memref(total, KVH, D),
                   tgt.memref(KVH, S, W, element_type=i8), tgt.memref(KVH, S, W, element_type=i8),
                   tgt.memref(total, H, D), tgt.memref(total, element_type=i32), tgt.AttentionOp.partials_type(H, D), IDX])
    q, k, v = rand(rng, total, H, D), rand(rng, total, KVH, D), rand(rng, total, KVH, D)
    kc, vc = np.zeros((KVH, S, W), np.int8), np.zeros((KVH, S, W), np.int8)
    pos = np.arange(total)
    qr, kr = ref_rope(q, pos, 10000.0), ref_rope(k, pos, 10000.0)
    for lo, hi in ((0, 6), (6, 7), (7, 8)):
        qa, ka, va = (np.zeros_like(a) for a in (q, k, v))
        qa[: hi - lo], ka[: hi - lo], va[: hi - lo] = q[lo:hi], k[lo:hi], v[lo:hi]
        out = np.zeros((total, H, D), f32)
        k_fn({"q": qa, "k": ka, "v": va, "k_cache": kc, "v_cache": vc, "out": out,
              "positions": positions(lo, hi - lo, total), "partials": partials(H, D), "rows": hi - lo}, nth)
        np.testing.assert_array_equal(kc[:, lo:hi], q8_rows(ka[: hi - lo].transpose(1, 0, 2)))
        np.testing.assert_array_equal(vc[:, lo:hi], q8_rows(v[lo:hi].transpose(1, 0, 2)))
        keys, values = q8_values(kc, D), q8_values(vc, D)
        assert_close(ka[: hi - lo], kr[lo:hi])
        assert_close(out[: hi - lo], ref_attention(qr[lo:hi], keys, values, pos[lo:hi]))


@pytest.mark.parametrize("nth", [1, 2, 3])
@pytest.mark.parametrize("scoring", [{}, {"window": 4}])
def test_one_decode_row_waits_at_no_barrier(tmp_path, tm, nth, scoring):
    """One row at a time from position 0 (fewer positions than threads at first), with RoPE, GQA and an f16
    cache, each against the reference over the cache so far. No thread waits inside the kernel (the barrier's
    generation never moves), every thread arrives once on the work counter (the last merges), the row's K and V
    are in the cache, and the queries are left as they came (each thread rotates a copy of its own)."""
    rng = np.random.default_rng(9)
    H, KVH, D, S, R, steps = 6, 2, 32, 16, 4, 7
    k_fn = attention_kernel(tmp_path, tm, H, KVH, D, S, R, True, cache=np.float16, **scoring)
    q, k, v = rand(rng, steps, H, D), rand(rng, steps, KVH, D), rand(rng, steps, KVH, D)
    kc, vc = np.zeros((KVH, S, D), np.float16), np.zeros((KVH, S, D), np.float16)
    pos = np.arange(steps)
    qr, kr = ref_rope(q, pos, 10000.0), ref_rope(k, pos, 10000.0)
    for p in range(steps):
        qa, ka, va = np.zeros((R, H, D), f32), np.zeros((R, KVH, D), f32), np.zeros((R, KVH, D), f32)
        qa[0], ka[0], va[0] = q[p], k[p], v[p]
        out = np.zeros((R, H, D), f32)
        k_fn({"q": qa, "k": ka, "v": va, "k_cache": kc, "v_cache": vc, "out": out,
              "positions": positions(p, 1, R), "partials": partials(H, D), "rows": 1}, nth)
        assert k_fn.sync[:2].tolist() == [0, 0] and k_fn.work[0] == nth
        np.testing.assert_array_equal(qa[0], q[p])
        np.testing.assert_array_equal(kc[:, p], kr[p].astype(np.float16))
        np.testing.assert_array_equal(vc[:, p], v[p].astype(np.float16))
        assert_close(out[:1], ref_attention(qr[p : p + 1], kc, vc, pos[p : p + 1], **scoring))


@pytest.mark.parametrize("nth", [1, 2, 5])
def test_attention_decode_long_and_capacity(tmp_path, tm, nth):
    """Decode near the end of a 256-row cache (large score spread, several position
    blocks per thread), then rows past the capacity are skipped instead of written out of bounds."""
    rng = np.random.default_rng(6)
    H, KVH, D, S = 4, 2, 16, 256
    k_fn = attention_kernel(tmp_path, tm, H, KVH, D, S, 5, False)
    kc, vc = rand(rng, KVH, S, D, scale=3.0), rand(rng, KVH, S, D)
    q, k, v = rand(rng, 5, H, D, scale=3.0), rand(rng, 5, KVH, D), rand(rng, 5, KVH, D)
    out = np.zeros((5, H, D), f32)
    start = 250
    k_fn({"q": q, "k": k, "v": v, "k_cache": kc, "v_cache": vc, "out": out, "positions": positions(start, 1, 5),
          "partials": partials(H, D), "rows": 1}, nth)
    keys = kc.copy()
    assert_close(out[:1], ref_attention(q[:1], keys, vc, np.array([start])))
    big = np.zeros((5, KVH, D), f32)
    kc_before = kc.copy()
    out5 = np.zeros((5, H, D), f32)
    outside = np.array([S - 2, S - 1, S, S + 1, -1], np.int32)  # the last three are outside the cache: skipped
    k_fn({"q": rand(rng, 5, H, D), "k": big, "v": big, "k_cache": kc, "v_cache": vc, "out": out5, "rows": 5,
          "positions": outside, "partials": partials(H, D)}, nth)
    np.testing.assert_array_equal(kc[:, : S - 2], kc_before[:, : S - 2])
    assert not kc[:, S - 2:].any()
    assert not out5[2:].any()


@pytest.mark.parametrize("H,KVH,D", [(2, 1, 32), (9, 3, 64), (3, 1, 32), (4, 1, 256)])
def test_attention_writes_quantized_rows(tmp_path, tm, H, KVH, D):
    """3 rows (decode's split positions) and 6 (prefill's query tiles) into quantized rows."""
    rng = np.random.default_rng(7)
    S, R, start = 32, 8, 5
    k_fn = attention_kernel(tmp_path, tm, H, KVH, D, S, R, True, quantized=True)
    q, k, v = rand(rng, R, H, D), rand(rng, R, KVH, D), rand(rng, R, KVH, D)
    kc, vc = rand(rng, KVH, S, D), rand(rng, KVH, S, D)
    for n, nth in itertools.product((3, 6), (1, 2)):
        pos = np.arange(start, start + n)
        keys, values = kc.copy(), vc.copy()
        keys[:, start : start + n] = ref_rope(k[:n], pos, 10000.0).transpose(1, 0, 2)
        values[:, start : start + n] = v[:n].transpose(1, 0, 2)
        ref = ref_attention(ref_rope(q[:n], pos, 10000.0), keys, values, pos).reshape(n, H * D)
        out = np.full(qrows_nbytes(R, H * D), 0xFF, np.uint8)
        qa, ka, kca, vca = q.copy(), k.copy(), kc.copy(), vc.copy()
        k_fn({"q": qa, "k": ka, "v": v, "k_cache": kca, "v_cache": vca, "out": out,
              "positions": positions(start, n, R), "partials": partials(H, D), "rows": n}, nth)
        qs, d, _, sums = read_qrows(out, R, H * D, n)
        np.testing.assert_array_equal(sums, slice_sums(qs))
        rq, rd, _ = quantize_rows(ref.astype(f32))
        assert np.abs(qs.astype(int) - rq).max() <= 1 and (qs != rq).mean() < 0.01
        np.testing.assert_allclose(d, rd, rtol=1e-5)
        assert not qs[:, H * D:].any()


@pytest.mark.parametrize("nth", [2, 3, 7])
def test_threads_write_the_cache_and_queries_exactly(tmp_path, tm, nth):
    """Four rows on `nth` threads against one: the cache and the rotated queries bit for bit (each element
    written by one thread with the same code), the output merged from the threads' partials within 1e-6."""
    rng = np.random.default_rng(nth)
    H, KVH, D, S = 6, 3, 8, 16
    att = attention_kernel(tmp_path, tm, H, KVH, D, S, 4, True)
    q, kk, v = rand(rng, 4, H, D), rand(rng, 4, KVH, D), rand(rng, 4, KVH, D)
    results = []
    for count in (1, nth):
        qa, ka, out = q.copy(), kk.copy(), np.zeros((4, H, D), f32)
        kc, vc = np.zeros((KVH, S, D), f32), np.zeros((KVH, S, D), f32)
        att({"q": qa, "k": ka, "v": v, "k_cache": kc, "v_cache": vc, "out": out,
             "positions": positions(2, 4, 4), "partials": partials(H, D), "rows": 4}, count)
        results.append((kc, vc, qa, out))
    for a, b in zip(results[0][:3], results[1][:3]):
        np.testing.assert_array_equal(a, b)
    assert_close(results[1][3], results[0][3], rtol=1e-6)


def test_stack_arrays_lie_on_cache_lines(tmp_path, tm):
    """Every stack array of a kernel (attention's staged K rows, scores, sums; a thread's quantized rows) is aligned
    to a cache line, so a vector access of one never straddles two (LLVM's own 16 bytes made one-row decode
    attention at depth 2048 13% slower); and the kernel still attends as numpy does."""
    rng = np.random.default_rng(7)
    H, KVH, D, S = 9, 3, 64, 64
    att = attention_kernel(tmp_path, tm, H, KVH, D, S, 1, True, cache=np.float16)
    arrays = re.findall(r"= alloca \[\d+ x [^\]]+\](.*)", att.ir)
    assert len(arrays) >= 5 and all(", align 64" in rest for rest in arrays), arrays
    q, k, v = rand(rng, 1, H, D), rand(rng, 1, KVH, D), rand(rng, 1, KVH, D)
    kc, vc = rand(rng, KVH, S, D).astype(np.float16), rand(rng, KVH, S, D).astype(np.float16)
    out = np.zeros((1, H, D), f32)
    start = 40
    att({"q": q.copy(), "k": k.copy(), "v": v, "k_cache": kc, "v_cache": vc, "out": out,
         "positions": positions(start, 1, 1), "partials": partials(H, D), "rows": 1}, 2)
    keys, values = kc.astype(f32), vc.astype(f32)
    pos = np.array([start])
    keys[:, start], values[:, start] = ref_rope(k, pos, 10000.0)[0].astype(np.float16), v[0].astype(np.float16)
    assert_close(out, ref_attention(ref_rope(q, pos, 10000.0), keys, values, pos), rtol=1e-3)


@pytest.mark.parametrize("cpu,most", [("znver4", 100), ("x86-64-v3", 300)])
def test_attention_keeps_its_sums_in_registers(cpu, most):
    """SmolLM2's attention (9 heads, 3 kv heads, D 64) compiled for a VNNI-512 and an AVX2 CPU (any host: its
    assembly) stores few vector registers to fixed stack slots (now 52 and 210): each query loads the staged K
    rows again (`forget_memory`), AVX2 sums 8 positions a ymm at a time and weighs V one query a pass. With 348
    and 1122 such stores, its decode attention at depth 2048 took 13% and 27% longer."""
    asm = assembly(cpu, attention_op(1, 9, 3, 64, 256))
    spills = re.findall(r"vmov[au]ps\s+%[yz]mm\d+, -?\d+\(%rsp\)$", asm, re.M)
    assert len(spills) <= most, len(spills)
