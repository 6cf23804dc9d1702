"""RoPE and causal attention kernels: the positions' rotations, the KV cache, online softmax.

`attention` is one layer's whole attention for a chunk of rows: RoPE and the cache write,
then (after a barrier inside the kernel) each query row against the cache positions up
to its own, by online softmax over blocks of `POS_BLOCK` positions. Decode splits the
positions among the threads and merges their partials (flash-decoding; one row without a barrier
inside the kernel: the last thread writes the row's K and V, the last to finish merges), or gives
the threads whole (row, kv head) items (several rows of sequences of their own, lengths that deal
evenly: no barrier either), and reads each V row once from the cache for a set of queries (as many
as half the target's vector registers hold sums for); prefill deals tiles of `QUERY_TILE` rows × one
kv head to the threads. sin and cos are inline polynomials (`KernelBuilder.sincos`): no libm.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np
from llvmlite import ir

from llmc.abi import KV_Q8_BLOCK
from llmc.backends.builder import F32, F64, FPTR, I32, I64, VW, KernelBuilder, _chunks
from llmc.backends.cpu.gemm import floats
from llmc.backends.cpu.quant import CACHE_LINE, F16, I8, I8PTR, QRowsAccess, prefetch, q8_block, shuffle, vec
from llmc.ir import llm, tgt
from llmc.ir.formats import ACT_BLOCK

if TYPE_CHECKING:
    from llmc.backends.cpu.kernels import KernelLibrary, Tuning

QUERY_TILE = 8  # prefill attention: query rows per tile (they share every staged K/V block)
POS_BLOCK = 64  # attention: cache positions per online-softmax step (prefill: the block staged for a tile)
# prefill stages a block's K and V rows as f32 in this many floats each (32 KB): fewer positions a block for heads wider
# than 128 (the 270M model's D 256: 32, whose 64 KB a buffer read from L2 took its prefill at depth 2048 10% longer)
STAGED_FLOATS = 8192
SCORE_QUERIES = 4  # heads wider than `UNROLLED_HEAD_DIM`: queries scored together (sharing each K chunk)
PV_QUERIES = 2  # staged blocks: queries whose weighted V rows one pass sums (each V chunk loaded once for them)
assert QUERY_TILE % SCORE_QUERIES == 0 and QUERY_TILE % PV_QUERIES == 0  # (a tile's queries: QUERY_TILE × G)
DECODE_POS_BLOCK = 32  # decode's, whose K block (8 KB at D 64) stays in L1 beside the V rows streaming past
# decode's wide heads stage V in this many floats: 16 positions of D 256 (16 KB), which with the
# next block's rows prefetched stay in L1 (48 KB on Zen 5); prefill's 32 made its one row at depth 2048 13% slower
DECODE_STAGED_FLOATS = 4096
# decode, several rows: of the next row's share of the cache, this many positions' K and V rows (every kv head) are
# prefetched into L2 while a row is attended to (the start of its streams, before the hardware's prefetcher ramps up)
PREFETCH_POSITIONS = 64
# head dims up to this unroll a block's scores over every query and 16-float chunk; wider ones loop over them
# (a 256-wide head unrolled is 6 MB of IR and 13 s of LLVM O3)
UNROLLED_HEAD_DIM = 128


def _rope_tables(lib: KernelLibrary, f: KernelBuilder, D: int, rope: llm.RopeAttr
                 ) -> tuple[ir.Value, ir.Value, Callable[[ir.Value], None]]:
    """Stack tables cos/sin[dims/2] (times `mscale`) and a function that fills them for a position."""
    half = rope.rotary_dims(D) // 2
    mscale = rope.mscale.data
    cos_t = f.alloca(F32, half, name="rope_cos")
    sin_t = f.alloca(F32, half, name="rope_sin")
    table = lib.inv_freq_table(D, rope)

    def group(pos: ir.Value, o: ir.Value, w: int) -> None:
        """Entries o..o+w of both tables: f32 angles (as numpy), cos and sin in f64 vectors."""
        b = f.b
        angle = f.fmul(f.splat(b.sitofp(pos, F32), vec(F32, w)), f.vload(b.bitcast(table, FPTR), o, w), flags=())
        sin, cos = f.sincos(b.fpext(angle, vec(F64, w)))
        cos, sin = b.fptrunc(cos, vec(F32, w)), b.fptrunc(sin, vec(F32, w))
        if mscale != 1.0:
            m = f.splat(ir.Constant(F32, mscale), vec(F32, w))
            cos, sin = f.fmul(cos, m, flags=()), f.fmul(sin, m, flags=())
        f.vstore(cos, cos_t, o)
        f.vstore(sin, sin_t, o)

    def fill(pos: ir.Value) -> None:
        if 2 * half <= UNROLLED_HEAD_DIM:
            for o in range(0, half, 8):
                group(pos, f.i64(o), min(8, half - o))
            return
        with f.loop(0, half - half % 8, 8, name="rf", unroll=False) as o:  # wide heads: a loop, then the rest
            group(pos, o, 8)
        if half % 8:
            group(pos, f.i64(half - half % 8), half % 8)

    return cos_t, sin_t, fill


def _rope_apply(f: KernelBuilder, base: ir.Value, heads: int | ir.Value, D: int, rope: llm.RopeAttr,
                cos_t: ir.Value, sin_t: ir.Value) -> None:
    """Rotate-half RoPE of `heads` rows of D floats at `base` (their first `dims`), with filled tables."""
    b, half = f.b, rope.rotary_dims(D) // 2
    with f.loop(0, heads, name="rh", unroll=False) as h:
        row = f.ptr(base, f.mul(h, D))
        with f.loop(0, half, name="rd", unroll=False) as i:
            i2 = f.add(i, half)
            x1, x2 = f.load(row, i), f.load(row, i2)
            c, s = f.load(cos_t, i), f.load(sin_t, i)
            f.store(b.fsub(b.fmul(x1, c), b.fmul(x2, s)), row, i)
            f.store(b.fadd(b.fmul(x2, c), b.fmul(x1, s)), row, i2)


def _position(f: KernelBuilder, positions: ir.Value, t: ir.Value) -> ir.Value:
    """Row `t`'s position, as an i64."""
    return f.b.sext(f.load(f.b.bitcast(positions, I32.as_pointer()), t), I64)


def rope(lib: KernelLibrary, f: KernelBuilder, op: tgt.RopeOp, a: dict) -> None:
    """Rotate-half RoPE in place on x [rows, H, D], row t at positions[t]."""
    _, H, D = tgt.dims(op.x)
    x = floats(f, a["x"])
    cos_t, sin_t, fill = _rope_tables(lib, f, D, op.rope)
    with f.loop(*f.share(a["rows"], a["tid"], a["nth"]), name="t") as t:
        fill(_position(f, a["positions"], t))
        _rope_apply(f, f.ptr(x, f.mul(t, H * D)), H, D, op.rope, cos_t, sin_t)


def _cache_element(value) -> ir.Type:
    """f32, f16, or i8: q8_0 rows (`tgt.kv_row_width`)."""
    return {"f16": F16, "i8": I8}.get(str(value.type.element_type), F32)


def attention(lib: KernelLibrary, f: KernelBuilder, op: tgt.AttentionOp, a: dict) -> None:
    """q [n, H, D], k and v [n, KVH, D]; the layer's caches [KVH, S, D] (f32 or f16). With
    `rope`, q and k are rotated in place first. Row t of k, v goes to cache position
    positions[t]; each query row t attends causally to positions 0..positions[t] (GQA:
    query head h reads kv head h / (H/KVH)); out [n, H·D], float or quantized. Rows whose
    position is outside the cache are skipped.

    One row (decode): no barrier. The last thread, whose share of the positions ends with the
    row's own, rotates and writes the row's K and V before it reads them (the other threads read
    older positions only); each thread rotates the queries into a buffer of its own; each leaves
    its partials, and the last of them to arrive (the work counter) merges every head.

    Several rows, each in a sequence of its own, whose (row, kv head) items deal evenly among the threads
    (`whole_items`; a batch decoding together): each thread takes items tid, tid + nth, …, writes the row's
    K and V of that head, rotates that head's queries into a buffer of its own, attends to each thread's
    share of the row's positions in turn and merges them as for one row. No barrier.

    Other rows:
    1. RoPE and the cache write, the threads sharing the rows (sin and cos once a row); a barrier.
    2. Online softmax over blocks of `POS_BLOCK` positions (fewer for heads wider than 128, `STAGED_FLOATS`; the
       scores of one block on the stack, whatever the context length). Up to `op.split_rows` rows (decode: 4, or its
       batch) the threads share the positions of the cache: each leaves a partial (max, sum,
       weighted values) per query head in `partials`, and after a barrier the threads
       merge them head by head (flash-decoding); its blocks are `DECODE_POS_BLOCK` positions,
       only K staged, each V row converted once for the sums of as many queries as half the target's vector
       registers hold (`weigh_v_rows`)
       (at depth 2048 the kernel 1.4–1.5x faster than with V staged too); while a row is attended
       to, the start of the next row's share (`PREFETCH_POSITIONS`) is prefetched into L2 (a
       batch's rows read caches of their own, whose short streams the hardware's prefetcher
       catches late: 8 rows at depth 32, a decode step 2–5% faster). More rows (prefill):
       the threads share tiles of `QUERY_TILE` rows × one kv head, dealt round-robin (later rows attend to
       more positions); every K and V row is loaded once for the tile's rows and heads, and the weighted V rows
       of `PV_QUERIES` queries at a time summed in as many passes over the block as their sums need to stay in
       the registers (each V chunk loaded once for them; D 256 on AVX2: 8 passes, where one pass a query had
       spilled every sum).
       Heads wider than `UNROLLED_HEAD_DIM` loop over the queries (`SCORE_QUERIES` at a time, each K chunk loaded
       once for them) and the chunks of D where narrower ones unroll them; their decode scores K straight from an
       f16 or f32 cache (each chunk read once, for all the queries: staged first, the 270M model's attention at
       depth 2048 took 19% longer) and stages V as prefill does (in blocks of `DECODE_STAGED_FLOATS`), a query's
       sums in passes over D's chunks, and as it weighs a block's V rows prefetches the next block's rows into L1
       (the Gemma 3 270M shape's decode step at depth 2048 8% faster on AVX2 than with V rows read directly a
       query at a time, whose 32 ymm of sums spilled).

    With `slots` (a cache of several sequences, `[slots, KVH, S, D]`), row t lives in
    sequence slots[t]: its cache rows are that sequence's. Decode's rows (one per sequence)
    each read their own; a prefill tile's rows are taken one sequence at a time (a chunk's
    rows are one sequence's: one pass).
    """
    _, H, D = tgt.dims(op.q)
    KVH, S, W = tgt.dims(op.k_cache)[-3:]  # W: a cache row's elements (D, or q8_0's bytes)
    SLOTS = tgt.dims(op.k_cache)[0] if op.slots is not None else 1
    SPLIT = op.split_rows
    G = H // KVH
    b = f.b
    q, k, v, partials = (floats(f, a[name]) for name in ("q", "k", "v", "partials"))
    element = _cache_element(op.k_cache)
    k_cache, v_cache = (b.bitcast(a[name], element.as_pointer()) for name in ("k_cache", "v_cache"))
    n, tid, nth = a["rows"], a["tid"], a["nth"]
    qout = QRowsAccess(f, a["out"], op.out.type) if tgt.is_quantized(op.out) else None
    out = None if qout is not None else floats(f, a["out"])
    chunks = _chunks(D)
    row_bytes = W * {F32: 4, F16: 2, I8: 1}[element]
    rolled = D > UNROLLED_HEAD_DIM
    window, softcap, scale = llm.scoring(op).values()
    scale = f.f32(scale if scale is not None else 1.0 / np.sqrt(np.float32(D)))

    def position(t: ir.Value) -> ir.Value:
        return _position(f, a["positions"], t)

    def slot(t: ir.Value) -> ir.Value:
        """Row t's sequence (0 in a cache of one)."""
        return _position(f, a["slots"], t) if op.slots is not None else f.i64(0)

    def sequence_base(sequence: ir.Value | None) -> ir.Value:
        """The element where a sequence's cache begins (None: the cache of one)."""
        return f.mul(sequence, KVH * S * W) if sequence is not None else f.i64(0)

    def slot_base(t: ir.Value) -> ir.Value:
        """The element where row t's sequence's cache begins."""
        return sequence_base(slot(t) if op.slots is not None else None)

    def inside(t: ir.Value) -> ir.Value:
        """Whether row t's position (and sequence) is inside the cache (the row is skipped otherwise)."""
        pos = position(t)
        ok = b.and_(b.icmp_signed(">=", pos, f.i64(0)), b.icmp_signed("<", pos, f.i64(S)))
        if op.slots is not None:
            sl = slot(t)
            ok = b.and_(ok, b.and_(b.icmp_signed(">=", sl, f.i64(0)), b.icmp_signed("<", sl, f.i64(SLOTS))))
        return ok

    def cache_chunk(p: ir.Value, w: int) -> ir.Value:
        """The `w` cache values at `p`: as f32 from an f32 or f16 cache, as stored from a q8_0 one."""
        x = b.load(b.bitcast(p, vec(element, w).as_pointer()), align=1)
        return b.fpext(x, vec(F32, w)) if element is F16 else x

    def cache_row(cache: ir.Value, index: ir.Value) -> list[ir.Value]:
        """The cache row at element `index` as f32 vectors (one per chunk of D)."""
        p = f.ptr(cache, index)
        rows = [cache_chunk(f.ptr(p, o), w) for o, w in chunks]
        if element is not I8:
            return rows
        scales = b.bitcast(f.ptr(p, D), FPTR)  # q8_0 (`llmc.abi`): an f32 per KV_Q8_BLOCK after the D int8 values
        return [f.fmul(b.sitofp(r, vec(F32, w)), f.splat(f.load(scales, o // KV_Q8_BLOCK), vec(F32, w)))
                for r, (o, w) in zip(rows, chunks)]

    def store_row(cache: ir.Value, index: ir.Value, row: list[ir.Value]) -> None:
        """Write a row of D floats (vectors per chunk) into the cache at element `index`."""
        p = f.ptr(cache, index)
        if element is I8:
            scales = b.bitcast(f.ptr(p, D), FPTR)
            for blk in range(D // KV_Q8_BLOCK):
                d, halves = q8_block(f, row[2 * blk], row[2 * blk + 1])
                f.store(d, scales, blk)
                for h, qv in enumerate(halves):
                    b.store(b.trunc(qv, vec(I8, 16)), b.bitcast(f.ptr(p, blk * KV_Q8_BLOCK + 16 * h),
                                                                vec(I8, 16).as_pointer()), align=1)
            return
        for (o, w), x in zip(chunks, row):
            x = x if element is F32 else b.fptrunc(x, vec(element, w))
            b.store(x, b.bitcast(f.ptr(p, o), x.type.as_pointer()), align=1)

    # 1. RoPE and the cache write (several rows: every thread's share, then a barrier)
    if op.rope is not None:
        cos_t, sin_t, fill = _rope_tables(lib, f, D, op.rope)

    def write_rows() -> None:
        """Each thread's share of the rows: the tables filled once a row for its K and query heads."""
        with f.loop(*f.share(n, tid, nth), name="ck") as t:
            with f.when(inside(t)):
                if op.rope is not None:
                    fill(position(t))
                    _rope_apply(f, f.ptr(q, f.mul(t, H * D)), H, D, op.rope, cos_t, sin_t)
                with f.loop(0, KVH, name="kh", unroll=False) as h:
                    write_kv(t, h)
        lib.wait(f.b, a["sync"], nth)

    def write_kv(t: ir.Value, h: ir.Value) -> None:
        """Row t's K (rotated in place: the tables filled for its position already) and V of kv head h into the
        cache."""
        pos, item = position(t), f.add(f.mul(t, KVH), h)
        if op.rope is not None:
            _rope_apply(f, f.ptr(k, f.mul(item, D)), 1, D, op.rope, cos_t, sin_t)
        dst = f.add(slot_base(t), f.mul(f.add(f.mul(h, S), pos), W))
        for src, cache in ((k, k_cache), (v, v_cache)):
            store_row(cache, dst, [f.vload(src, f.add(f.mul(item, D), o), w) for o, w in chunks])

    # 2. attention: per query (row r of a tile, head g of the kv head's group) a running
    # max m, sum l and weighted sum acc, on the stack
    TQ = QUERY_TILE
    m_buf, l_buf = f.alloca(F32, TQ * G, name="m"), f.alloca(F32, TQ * G, name="l")
    acc = f.alloca(F32, TQ * G * D, name="acc")
    block = max(16, min(POS_BLOCK, STAGED_FLOATS // D // 16 * 16))  # (prefill's; D 256: 32 positions)
    decode_block = max(16, min(block, DECODE_STAGED_FLOATS // D // 16 * 16))  # (wide heads' decode; D 256: 16)
    scores = f.alloca(F32, TQ * G * block, name="scores")
    corrs = f.alloca(F32, TQ * G, name="corrs")  # prefill: per query, what the block's new max scales its sums by
    kbuf = f.alloca(F32, max(block, DECODE_POS_BLOCK) * D, name="k_block")  # the block's K rows as f32
    vbuf = f.alloca(F32, block * D, name="v_block")
    limits = f.alloca(I64, TQ, name="limits")  # per row: its positions end here …
    starts = f.alloca(I64, TQ, name="starts")  # … and begin here (a sliding window's first)

    def first_position(t: ir.Value) -> ir.Value:
        """The first cache position row t attends to: 0, or the start of its window."""
        return f.i64(0) if window is None else f.smax(0, f.sub(f.add(position(t), 1), window))

    def capped(x: ir.Value) -> ir.Value:
        return x if softcap is None else f.softcap(x, softcap)

    def attend(t0: ir.Value, tq: int, h: ir.Value, s_lo: ir.Value, s_hi: ir.Value, base: ir.Value,
               queries: ir.Value = q) -> None:
        """Queries of rows t0..t0+tq (each from its `starts[r]` up to its `limits[r]`; in `queries`, laid out as `q`)
        × the G heads of kv head h,
        over cache positions [s_lo, s_hi) of the sequence whose cache begins at element `base`,
        a block of positions at a time: the block's K rows (wide heads' decode: V rows) staged as f32 (prefill: both),
        16 scores at once (`KernelBuilder.hsum` of 16 rows' products), then per query a vector max
        and exp and the weighted V rows (decode: `weigh_v_rows`, all the queries after the block's exps)."""
        nq = tq * G
        V16 = vec(F32, 16)
        for i in range(nq):
            f.store(f.f32(float("-inf")), m_buf, i)
            f.store(f.f32(0.0), l_buf, i)
        with f.loop(0, nq * D, name="az") as i:
            f.store(f.f32(0.0), acc, i)

        def query_row(i: int | ir.Value) -> ir.Value:
            """Query i's first element in q: row t0 + i / G, head h·G + i % G."""
            r, g = (i // G, i % G) if isinstance(i, int) else (b.sdiv(i, f.i64(G)), b.srem(i, f.i64(G)))
            return f.mul(f.add(f.mul(f.add(t0, r), H), f.add(f.mul(h, G), g)), D)

        def score16(qbases: list[ir.Value], s0: ir.Value, s16: ir.Value, ats: list[ir.Value]) -> None:
            """The queries at `qbases` against the block's rows s16..s16+15 (the block at position s0), 16 scores
            each into `scores` at its `at` + s16 (rows past `count` hold stale values: their lanes go unread)."""
            if rolled:
                def k_chunk(j: int, o: ir.Value, w: int) -> ir.Value:
                    """Row s16 + j's chunk of `w` floats at `o`: from the cache (`unstaged_k`), or staged."""
                    if not unstaged_k:
                        return f.vload(kbuf, f.add(f.add(f.mul(s16, D), o), j * D), w)
                    return cache_chunk(f.ptr(k_cache, f.add(f.add(kv_base, f.mul(f.add(f.add(s0, s16), j), W)), o)), w)

                by_query = [f.hsum(products) for products in _dots(f, [f.ptr(queries, qbase) for qbase in qbases],
                                                                   k_chunk, 16, D, lib.tuning)]
            else:
                krows = [f.mul(f.add(s16, j), D) for j in range(16)]

                def products(qbase: ir.Value, rows: list[ir.Value]) -> list[ir.Value]:
                    qv = [f.vload(queries, f.add(qbase, o), w) for o, w in chunks]
                    return [_sum16(f, [f.fmul(x, f.vload(kbuf, f.add(krow, o), w)) for x, (o, w) in zip(qv, chunks)])
                            for krow in rows]

                if lib.tuning.register_floats == 8:  # AVX2: a position's products folded into one ymm, 8 positions
                    # at a time (16 sums of 16 floats were 32 ymm, and spilled)
                    lo, hi = list(range(8)), list(range(8, 16))
                    by_query = []
                    for qbase in qbases:
                        halves = []
                        for group in (krows[:8], krows[8:]):
                            if halves:
                                f.forget_memory()
                            folded = [f.fadd(shuffle(f, p, lo), shuffle(f, p, hi)) for p in products(qbase, group)]
                            halves.append(f.hsum(folded))
                        by_query.append(shuffle(f, halves[0], list(range(16)), halves[1]))
                else:
                    by_query = [f.hsum(products(qbase, krows)) for qbase in qbases]
            for total, at in zip(by_query, ats):
                f.vstore(capped(f.fmul(total, f.splat(scale, V16))), scores, f.add(at, s16))

        qrow = [] if rolled else [query_row(i) for i in range(nq)]
        kv_base = f.add(base, f.mul(h, S * W))
        direct_v = tq == 1 and not rolled  # decode, heads up to 128: only K staged, V rows read by weigh_v_rows
        ahead = tq == 1 and rolled  # decode, wider heads: V staged, the next block's K and V rows prefetched
        unstaged_k = ahead and element is not I8  # (K scored straight from an f16 or f32 cache: read once anyway)
        span = DECODE_POS_BLOCK if direct_v else decode_block if ahead else block
        staging = ([] if unstaged_k else [(k_cache, kbuf)]) + ([] if direct_v else [(v_cache, vbuf)])
        lane = ir.Constant(vec(I64, 16), list(range(16)))

        def weigh_v_rows(s0: ir.Value, count: ir.Value) -> None:
            """Decode (one row, its G queries): acc += p · V over the block's positions, each V row read once
            from the cache for a set of queries whose sums stay in registers: 16-float chunks in half the target's
            vector registers (`Tuning.float_vectors`; AVX2: 8 of its 16 ymm, one query of head dim 64, where two
            spilled and SmolLM2's attention at depth 2048 took 10% longer; AVX-512: 16 of its 32 zmm, SmolLM2's 3
            queries a kv head in one pass, not two: its one-row decode step at depth 2048 3% faster on Zen 5)."""
            valid = f.smax(0, f.smin(count, f.sub(f.load(limits, 0), s0)))
            first = f.smax(0, f.smin(valid, f.sub(f.load(starts, 0), s0)))
            per_set = max(1, lib.tuning.float_vectors // 2 // len(chunks))
            for q0 in range(0, nq, per_set):
                queries = range(q0, min(nq, q0 + per_set))
                sums = {(i, o): f.alloca(vec(F32, w), name=f"pv{i}_{o}") for i in queries for o, w in chunks}
                for i in queries:
                    for o, w in chunks:
                        b.store(f.vload(acc, f.i64(i * D + o), w), sums[i, o])
                with f.loop(first, valid, name="pv", unroll=False) as s:
                    v_row = cache_row(v_cache, f.add(kv_base, f.mul(f.add(s0, s), W)))
                    for i in queries:
                        p = f.load(scores, f.add(f.i64(i * span), s))
                        for x, (o, _) in zip(v_row, chunks):
                            b.store(f.fadd(b.load(sums[i, o]), f.fmul(f.splat(p, x.type), x)), sums[i, o])
                for i in queries:
                    for o, _ in chunks:
                        f.vstore(b.load(sums[i, o]), acc, f.i64(i * D + o))

        def prefetch_rows(position: ir.Value) -> None:
            """Into L1: the K and V rows at cache position `position` (at most the last one attended to)."""
            at = f.add(kv_base, f.mul(f.smin(position, f.sub(s_hi, 1)), W))
            for cache in (k_cache, v_cache):
                row = b.bitcast(f.ptr(cache, at), I8PTR)
                for line in range(0, row_bytes, CACHE_LINE):
                    prefetch(f, row, f.i64(line))

        def weigh_v_block(s0: ir.Value, i0: ir.Value, together: int, valid: ir.Value, part: list, sets: int) -> None:
            """Queries i0..i0 + together − 1: acc (first times the query's `corrs`) += p · V over the staged
            block's positions 0..valid (p 0 past each query's own), for D's chunks `part`, each V chunk loaded once
            for them, in `sets` sets of sums (2: even and odd positions, two FMA chains a chunk). Wide heads'
            decode (`ahead`) prefetches the next block's K and V rows as it goes, a position's for each position,
            in every pass: prefetches issued while the miss buffers are full are dropped, and a later pass's find
            them free (the 270M model's attention at depth 2048, one thread from DRAM: 164 → 96 µs a layer; the
            rows all prefetched while the block was staged, or in the first pass alone: 152)."""
            queries = [f.add(i0, k) for k in range(together)]
            arows = [f.mul(i, D) for i in queries]
            sums = [[[f.alloca(vec(F32, w), name=f"pv{o}_{k}") for o, w in part] for k in range(sets)] for _ in queries]
            for i, arow, by_set in zip(queries, arows, sums):
                corr = f.load(corrs, i)
                for k, totals in enumerate(by_set):
                    for total_o, (o, w) in zip(totals, part):
                        start = f.fmul(f.vload(acc, f.add(arow, o), w), f.splat(corr, vec(F32, w)))
                        b.store(start if k == 0 else f.const(vec(F32, w), 0.0), total_o)
            with f.loop(0, valid, sets, name="pv", unroll=False) as s:  # (p is 0 at `valid`: whole pairs)
                for k in range(sets):
                    if ahead:
                        prefetch_rows(f.add(f.add(s0, s), span + k))
                    ps = [f.load(scores, f.add(f.mul(i, span), f.add(s, k))) for i in queries]
                    for c, (o, w) in enumerate(part):
                        x = f.vload(vbuf, f.add(f.mul(f.add(s, k), D), o), w)
                        for p, by_set in zip(ps, sums):
                            total_o = by_set[k][c]
                            b.store(f.fadd(b.load(total_o), f.fmul(f.splat(p, x.type), x)), total_o)
            for arow, by_set in zip(arows, sums):
                for (o, _), *totals in zip(part, *by_set):
                    f.vstore(functools.reduce(f.fadd, (b.load(t) for t in totals)), acc, f.add(arow, o))

        def weigh_v_blocks(s0: ir.Value, count: ir.Value) -> None:
            """Every query's weighted V rows of the staged block of `count` positions from s0, `PV_QUERIES` at a
            time (a decode row's G queries: as many as divide G), a pass over the positions per group of D's chunks
            whose sums fill half the registers."""
            together = math.gcd(nq, PV_QUERIES)
            held = lib.tuning.float_vectors // 2 // together
            sets = 2 if 2 * len(chunks) <= held else 1
            group = -(-len(chunks) // -(-len(chunks) // held))
            with f.loop(0, nq, together, name="pq", unroll=False) as i0:
                valid = f.i64(0)
                for k in range(together):
                    r = b.sdiv(f.add(i0, k), f.i64(G))
                    valid = f.smax(valid, f.smin(count, f.sub(f.load(limits, r), s0)))
                for first in range(0, len(chunks), group):
                    weigh_v_block(s0, i0, together, valid, chunks[first:first + group], sets)

        with f.loop(s_lo, s_hi, span, name="blk", unroll=False) as s0:
            count = f.smin(span, f.sub(s_hi, s0))
            with f.loop(0, count, name="st", unroll=False) as s:
                at = f.add(kv_base, f.mul(f.add(s0, s), W))
                for cache, staged in staging:
                    for (o, _), row in zip(chunks, cache_row(cache, at)):
                        f.vstore(row, staged, f.add(f.mul(s, D), o))
            if not direct_v:
                with f.when(b.icmp_signed("<", count, f.i64(span))):  # the odd position after the last: zeros
                    for o, w in chunks:
                        f.vstore(f.const(vec(F32, w), 0.0), vbuf, f.add(f.mul(count, D), o))
            with f.loop(0, count, 16, name="s16", unroll=False) as s16:
                if rolled:  # (`SCORE_QUERIES` at a time, each K chunk loaded once for them; decode: as many as divide G)
                    together = math.gcd(nq, SCORE_QUERIES)
                    with f.loop(0, nq, together, name="sq", unroll=False) as i:
                        ids = [f.add(i, k) for k in range(together)]
                        score16([query_row(k) for k in ids], s0, s16, [f.mul(k, span) for k in ids])
                else:  # (each query loads the staged K rows again: kept from the first for the others, SmolLM2's
                    # 64 K vectors spilled, and its decode attention at depth 2048 took 13% longer, 10% on AVX2)
                    for i in range(nq):
                        if i:
                            f.forget_memory()
                        score16([qrow[i]], s0, s16, [f.i64(i * span)])
            with f.loop(0, nq, name="sm", unroll=False) as i:
                row = f.ptr(scores, f.mul(i, span))
                r = b.sdiv(i, f.i64(G))
                valid = f.smax(0, f.smin(count, f.sub(f.load(limits, r), s0)))
                first = f.smax(0, f.smin(valid, f.sub(f.load(starts, r), s0)))
                with b.if_else(b.icmp_signed(">", valid, first)) as (attended, skipped):
                    with attended:
                        lanes = [b.add(lane, f.splat_i64(c, 16)) for c in range(0, span, 16)]
                        inside_block = [b.and_(b.icmp_signed(">=", at, f.splat_i64(first, 16)),
                                               b.icmp_signed("<", at, f.splat_i64(valid, 16))) for at in lanes]
                        chunk_scores = [b.select(m, f.vload(row, f.i64(c)), f.const(V16, float("-inf")))
                                        for m, c in zip(inside_block, range(0, span, 16))]
                        top = chunk_scores[0]
                        for v in chunk_scores[1:]:
                            top = f.fmax(top, v)
                        m_old = f.load(m_buf, i)
                        m_new = f.fmax(m_old, f.reduce_max(top))
                        total = f.const(V16, 0.0)
                        for m, v, c in zip(inside_block, chunk_scores, range(0, span, 16)):
                            e = b.select(m, f.exp(b.fsub(v, f.splat(m_new, V16))), f.const(V16, 0.0))
                            f.vstore(e, row, f.i64(c))
                            total = f.fadd(total, e)
                        corr = f.exp(b.fsub(m_old, m_new))
                        f.store(f.fadd(f.fmul(f.load(l_buf, i), corr), f.reduce_vector(total)), l_buf, i)
                        f.store(m_new, m_buf, i)
                        if direct_v:  # the weighted V rows come after, for all the queries at once
                            arow = f.mul(i, D)
                            for o, w in chunks:
                                f.vstore(f.fmul(f.vload(acc, f.add(arow, o), w), f.splat(corr, vec(F32, w))), acc,
                                         f.add(arow, o))
                        else:
                            f.store(corr, corrs, i)
                    with skipped:  # (prefill: no weight, the query's sums as they are)
                        if not direct_v:
                            for c in range(0, span, 16):
                                f.vstore(f.const(V16, 0.0), row, f.i64(c))
                            f.store(f.f32(1.0), corrs, i)
            if direct_v:
                weigh_v_rows(s0, count)
            else:
                weigh_v_blocks(s0, count)

    def store_head(t: ir.Value, head: ir.Value, ys: list[ir.Value]) -> None:
        """Row t's output for query head `head`: float, or quantized blocks of 32."""
        if qout is None:
            for y, (o, _) in zip(ys, chunks):
                f.vstore(y, out, f.add(f.mul(f.add(f.mul(t, H), head), D), o))
            return
        for blk in range(D // ACT_BLOCK):
            qout.store_block(t, f.add(f.mul(head, D // ACT_BLOCK), blk), ys[2 * blk], ys[2 * blk + 1])

    stride = D + 2  # a partial: max, sum, D weighted values

    def leave_partials(t: ir.Value, h: ir.Value, part: ir.Value = tid) -> None:
        """Share `part`'s partials (this thread's) of row t's queries of kv head h (`attend`'s running max, sum and
        sums)."""
        for g in range(G):
            base = f.mul(f.add(f.mul(f.add(f.mul(part, SPLIT), t), H), f.add(f.mul(h, G), g)), stride)
            f.store(f.load(m_buf, g), partials, base)
            f.store(f.load(l_buf, g), partials, f.add(base, 1))
            for o, w in chunks:
                f.vstore(f.vload(acc, f.i64(g * D + o), w), partials, f.add(base, 2 + o))

    def share_of(t: ir.Value, part: ir.Value = tid) -> tuple[ir.Value, ir.Value]:
        """Share `part` (this thread's) of row t's positions: its part of them in order (the last share ends at the
        row's own)."""
        lo = first_position(t)
        return tuple(f.add(lo, s) for s in f.share(f.sub(f.add(position(t), 1), lo), part, nth))

    def share_positions(t: ir.Value, part: ir.Value = tid) -> tuple[ir.Value, ir.Value]:
        """`share_of(t, part)`, set as the positions `attend` reads."""
        s_lo, s_hi = share_of(t, part)
        f.store(s_hi, limits, 0)
        f.store(s_lo, starts, 0)
        return s_lo, s_hi

    def prefetch_share(t: ir.Value) -> None:
        """Into L2: the K and V rows of every kv head at the first `PREFETCH_POSITIONS` of this thread's share of
        row t, if the row is inside the cache."""
        with f.when(inside(t)):
            s_lo, s_hi = share_of(t)
            base = slot_base(t)
            with f.loop(0, KVH, name="ph") as h, f.loop(s_lo, f.smin(s_hi, f.add(s_lo, PREFETCH_POSITIONS)),
                                                       name="pp") as s:
                index = f.add(base, f.mul(f.add(f.mul(h, S), s), W))
                for cache in (k_cache, v_cache):
                    row = b.bitcast(f.ptr(cache, index), I8PTR)
                    for line in range(0, row_bytes, CACHE_LINE):
                        prefetch(f, row, f.i64(line), level=2)

    def merge(t: ir.Value, head: ir.Value) -> None:
        """Row t's output for query head `head` from every thread's partial (flash-decoding)."""
        def part(j: ir.Value) -> ir.Value:
            return f.mul(f.add(f.mul(f.add(f.mul(j, SPLIT), t), H), head), stride)

        top = f.alloca(F32, name="top")
        b.store(f.f32(float("-inf")), top)
        with f.loop(0, nth, name="mx") as j:
            b.store(f.fmax(b.load(top), f.load(partials, part(j))), top)
        M = b.load(top)
        total = f.alloca(F32, name="total")
        b.store(f.f32(0.0), total)
        sums = [f.alloca(vec(F32, w), name=f"sum{o}") for o, w in chunks]
        for acc_o, (_, w) in zip(sums, chunks):
            b.store(f.const(vec(F32, w), 0.0), acc_o)
        with f.loop(0, nth, name="mj") as j:
            base = part(j)
            weight = f.exp(b.fsub(f.load(partials, base), M))
            b.store(f.fadd(b.load(total), f.fmul(weight, f.load(partials, f.add(base, 1)))), total)
            for acc_o, (o, w) in zip(sums, chunks):
                x = f.vload(partials, f.add(base, 2 + o), w)
                b.store(f.fadd(b.load(acc_o), f.fmul(f.splat(weight, x.type), x)), acc_o)
        inv = b.fdiv(f.f32(1.0), b.load(total))
        store_head(t, head, [f.fmul(b.load(acc_o), f.splat(inv, acc_o.type.pointee)) for acc_o in sums])

    def decode_alone() -> None:
        """One row, no barrier: the last thread, whose positions end with the row's own, writes its K and V rows
        before it reads them (the others read older positions only); each thread rotates the queries into a
        buffer of its own; the last thread to leave its partials (counted on `work`) merges them."""
        t = f.i64(0)
        queries = q if op.rope is None else f.alloca(F32, H * D, name="queries")
        with f.when(inside(t)):
            if op.rope is not None:
                fill(position(t))
                f.vec_map(H * D, [q], queries, lambda x: x[0], name="qc")
                _rope_apply(f, queries, H, D, op.rope, cos_t, sin_t)
            with f.when(b.icmp_signed("==", tid, f.sub(nth, 1))):
                with f.loop(0, KVH, name="dk") as h:
                    write_kv(t, h)
            s_lo, s_hi = share_positions(t)
            with f.loop(0, KVH, name="dh") as h:
                attend(t, 1, h, s_lo, s_hi, slot_base(t), queries)
                leave_partials(t, h)
        arrived = b.atomic_rmw("add", a["work"], f.i64(1), "acq_rel")  # (partials written before, read after)
        with f.when(b.icmp_signed("==", arrived, f.sub(nth, 1))), f.when(inside(t)):
            with f.loop(0, H, name="mg") as head:
                merge(t, head)

    def whole_items() -> ir.Value:
        """Whether a decode of several rows takes whole (row, kv head) items (an i1, the same on every thread):
        where each row is a sequence of its own (no row reads a cache row another writes) and no thread's items
        (tid, tid + nth, …) hold more than 5/4 of a thread's share of all the positions they attend to."""
        if op.slots is None:
            return ir.Constant(ir.IntType(1), 0)
        items = f.mul(n, KVH)

        def length(item: ir.Value) -> ir.Value:
            t = b.sdiv(item, f.i64(KVH))
            return b.select(inside(t), f.sub(f.add(position(t), 1), first_position(t)), f.i64(0))

        total, heaviest, load, clash = (f.alloca(I64, name=name) for name in ("total", "heaviest", "load", "clash"))
        for v in (total, heaviest, clash):
            b.store(f.i64(0), v)
        with f.loop(0, nth, name="wj") as j:
            b.store(f.i64(0), load)
            with f.loop(0, b.sdiv(f.add(f.sub(items, j), f.sub(nth, 1)), nth), name="wi") as i:
                b.store(f.add(b.load(load), length(f.add(j, f.mul(i, nth)))), load)
            b.store(f.smax(b.load(heaviest), b.load(load)), heaviest)
            b.store(f.add(b.load(total), b.load(load)), total)
        with f.loop(0, n, name="wt") as t, f.loop(0, t, name="wu") as u:
            b.store(f.add(b.load(clash), b.zext(b.icmp_signed("==", slot(t), slot(u)), I64)), clash)
        balanced = b.icmp_signed("<=", f.mul(f.mul(b.load(heaviest), 4), nth), f.mul(b.load(total), 5))
        return b.and_(b.icmp_signed("==", b.load(clash), f.i64(0)), balanced)

    def decode_items() -> None:
        """Several rows in sequences of their own, as whole (row, kv head) items, thread `tid` taking items tid,
        tid + nth, …: an item's thread rotates and writes the row's K and V of that head, rotates the head's G
        queries into a buffer of its own, and attends to each of the nth shares of the row's positions in turn
        and merges them, as the threads do for one row (so a row's output is its output alone, bit for bit). No
        barrier (a short context split among the threads cost two barriers and each thread's setup per row and
        head: 8 rows at depth 32 took 21 us a layer, 17 as items; prefetching the items' K and V rows, into L2
        or L1, all first or each one item ahead, changed nothing from depth 32 to 512)."""
        queries = q if op.rope is None else f.alloca(F32, H * D, name="queries")
        items = f.mul(n, KVH)

        with f.loop(0, b.sdiv(f.add(f.sub(items, tid), f.sub(nth, 1)), nth), name="it", unroll=False) as i:
            item = f.add(tid, f.mul(i, nth))
            t, h = b.sdiv(item, f.i64(KVH)), b.srem(item, f.i64(KVH))
            with f.when(inside(t)):
                t0 = t
                if op.rope is not None:
                    fill(position(t))
                    t0 = f.i64(0)  # (the rotated queries of row t at their heads' places in `queries`)
                    group = f.mul(f.mul(h, G), D)
                    f.vec_map(G * D, [f.ptr(q, f.add(f.mul(t, H * D), group))], f.ptr(queries, group),
                              lambda x: x[0], name="qi")
                    _rope_apply(f, f.ptr(queries, group), G, D, op.rope, cos_t, sin_t)
                write_kv(t, h)
                with f.loop(0, nth, name="ij", unroll=False) as part:
                    s_lo, s_hi = share_positions(t, part)
                    attend(t0, 1, h, s_lo, s_hi, slot_base(t), queries)
                    leave_partials(t, h, part)
                for g in range(G):
                    merge(t, f.add(f.mul(h, G), g))

    alone = b.icmp_signed("==", n, f.i64(1))
    split = b.icmp_signed("<=", n, f.i64(SPLIT))
    takes_items = f.alloca(ir.IntType(1), name="whole")
    b.store(ir.Constant(ir.IntType(1), 0), takes_items)
    with f.when(b.and_(split, b.not_(alone))):
        b.store(whole_items(), takes_items)
    whole = b.load(takes_items)
    with f.when(b.not_(b.or_(alone, whole))):
        write_rows()
    with b.if_else(split) as (decode, prefill):
        with decode:
            with b.if_else(alone) as (one_row, several):
                with one_row:
                    decode_alone()
                with several, b.if_else(whole) as (items, rows):
                    with items:
                        decode_items()
                    with rows:
                        prefetch_share(f.i64(0))
                        with f.loop(0, n, name="dt") as t:
                            with f.when(b.icmp_signed("<", f.add(t, 1), n)):
                                prefetch_share(f.add(t, 1))
                            with f.when(inside(t)):
                                s_lo, s_hi = share_positions(t)
                                with f.loop(0, KVH, name="dh") as h:
                                    attend(t, 1, h, s_lo, s_hi, slot_base(t))
                                    leave_partials(t, h)
                        lib.wait(f.b, a["sync"], nth)
                        with f.loop(*f.share(f.mul(n, H), tid, nth), name="mg") as item:
                            t, head = b.sdiv(item, f.i64(H)), b.srem(item, f.i64(H))
                            with f.when(inside(t)):
                                merge(t, head)
        with prefill:
            tiles = b.sdiv(f.add(n, TQ - 1), f.i64(TQ))
            items = f.mul(tiles, KVH)
            mine = b.sdiv(f.add(f.sub(items, tid), f.sub(nth, 1)), nth)  # items tid, tid + nth, …
            def tile(t0: ir.Value, h: ir.Value, sequence: ir.Value | None) -> None:
                """The tile's rows (of `sequence` only, with slots) against kv head h."""
                s_hi = f.alloca(I64, name="s_hi")
                b.store(f.i64(0), s_hi)
                s_lo = f.alloca(I64, name="s_lo")
                b.store(f.i64(S), s_lo)
                for r in range(TQ):
                    t = f.add(t0, r)
                    present = f.alloca(I64, name=f"lim{r}")
                    b.store(f.i64(0), present)
                    f.store(f.i64(0), starts, r)
                    with f.when(b.icmp_signed("<", t, n)), f.when(inside(t)):
                        ours = f.i64(1) if sequence is None else b.zext(b.icmp_signed("==", slot(t), sequence), I64)
                        b.store(f.mul(f.add(position(t), 1), ours), present)
                        f.store(first_position(t), starts, r)
                        with f.when(b.icmp_signed("==", ours, f.i64(1))):
                            b.store(f.smin(b.load(s_lo), first_position(t)), s_lo)
                    f.store(b.load(present), limits, r)
                    b.store(f.smax(b.load(s_hi), b.load(present)), s_hi)
                attend(t0, TQ, h, f.smin(b.load(s_lo), b.load(s_hi)), b.load(s_hi), sequence_base(sequence))

                def finish(r: int | ir.Value, g: int | ir.Value) -> None:
                    """Query (row t0 + r, head h·G + g)'s output, where the row attended to anything."""
                    t = f.add(t0, r)
                    i = r * G + g if isinstance(r, int) else f.add(f.mul(r, G), g)
                    with f.when(b.icmp_signed(">", f.load(limits, r), f.i64(0))):
                        inv = b.fdiv(f.f32(1.0), f.load(l_buf, i))
                        ys = [f.fmul(f.vload(acc, f.i64(i * D + o) if isinstance(i, int) else f.add(f.mul(i, D), o), w),
                                     f.splat(inv, vec(F32, w))) for o, w in chunks]
                        store_head(t, f.add(f.mul(h, G), g), ys)

                if rolled:
                    with f.loop(0, TQ * G, name="po", unroll=False) as i:
                        finish(b.sdiv(i, f.i64(G)), b.srem(i, f.i64(G)))
                else:
                    for r in range(TQ):
                        for g in range(G):
                            finish(r, g)

            with f.loop(0, mine, name="pt", unroll=False) as i:
                item = f.add(tid, f.mul(i, nth))
                t0, h = f.mul(b.sdiv(item, f.i64(KVH)), TQ), b.srem(item, f.i64(KVH))
                if op.slots is None:
                    tile(t0, h, None)
                else:  # one pass per sequence among the tile's rows: at the first row of each
                    last = f.sub(n, 1)
                    with f.loop(0, TQ, name="ps", unroll=False) as r0:
                        t = f.add(t0, r0)
                        with f.when(b.icmp_signed("<", t, n)):
                            sequence = slot(t)
                            seen = ir.Constant(ir.IntType(1), 0)
                            for r in range(TQ - 1):
                                earlier = b.and_(b.icmp_signed("<", f.i64(r), r0),
                                                 b.icmp_signed("==", slot(f.smin(f.add(t0, r), last)), sequence))
                                seen = b.or_(seen, earlier)
                            with f.when(b.not_(seen)):
                                tile(t0, h, sequence)


def _dots(f: KernelBuilder, xs: list[ir.Value], rows: Callable[[int, ir.Value, int], ir.Value], n: int, D: int,
          tuning: Tuning) -> list[list[ir.Value]]:
    """Per x of `xs` (D floats each) and row j < n (`rows(j, o, w)`: its `<w x float>` chunk at element o), the
    products of their floats as one `<VW x float>` (its lanes still to be added up), summed over D's `VW`-float
    chunks in a loop rather than unrolled (one induction variable: row j at a constant offset), as many (x, row)
    sums at a time as half the vector registers hold, each one register wide (AVX2: a chunk's two 8-float halves
    into one ymm; 16 sums of 16 floats were 32 ymm, and spilled), each chunk of x and of a row loaded once for
    them."""
    b = f.b
    width = tuning.register_floats
    halves = [list(range(h, h + width)) for h in range(0, VW, width)]
    W = vec(F32, width)
    step = max(1, tuning.vector_registers // 2 // len(xs))
    products: list[list[ir.Value]] = [[] for _ in xs]
    for first in range(0, n, step):
        js = range(first, min(n, first + step))
        sums = [[f.alloca(W, name=f"dot{j}") for j in js] for _ in xs]
        for total in (t for row in sums for t in row):
            b.store(f.const(W, 0.0), total)
        with f.loop(0, D - D % VW, VW, name="dc") as o:
            xvs = [[shuffle(f, f.vload(x, o), h) for h in halves] for x in xs]
            for c, j in enumerate(js):
                kv = [shuffle(f, rows(j, o, VW), h) for h in halves]
                for xv, row in zip(xvs, sums):
                    total = b.load(row[c])
                    for xh, kh in zip(xv, kv):
                        total = f.fadd(total, f.fmul(xh, kh))
                    b.store(total, row[c])
        for out, row in zip(products, sums):
            out += [_sum16(f, [b.load(total)]) for total in row]
    if D % VW:
        o, w = D - D % VW, D % VW
        for x, out in zip(xs, products):
            xv = f.vload(x, f.i64(o), w)
            out[:] = [f.fadd(p, _sum16(f, [f.fmul(xv, rows(j, f.i64(o), w))])) for j, p in enumerate(out)]
    return products


def _sum16(f: KernelBuilder, terms: list[ir.Value]) -> ir.Value:
    """The sum of float vectors as one `<16 x float>` (narrower ones widened with zeros)."""
    total = None
    for t in terms:
        if t.type.count < 16:
            t = f.b.shuffle_vector(t, ir.Constant(t.type, [0.0] * t.type.count),
                                   ir.Constant(vec(I32, 16), [i if i < t.type.count else t.type.count
                                                              for i in range(16)]))
        total = t if total is None else f.fadd(total, t)
    return total
