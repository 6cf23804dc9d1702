"""The matmul family's loop nests: every tile of rows × columns, for every weight format and row kind.

`gemm(f, rows, parts, tid, nth, isa)` visits tiles of up to `TILE_ROWS` rows ×
`TILE_COLS` columns (per weight; swiglu passes two) of each part (an output: `tgt.qkv` has three)
and hands each tile's dot products to the part's `finish`, which writes them (bias, accumulate,
silu·up, quantized rows). The inner loop depends on what the operands are:

- float weights (f32, f16, bf16) × float rows: a scalar reduction over k per (row,
  column) that LLVM vectorises (f16/bf16 converted as they are loaded);
- integer weights × float rows (`a32`): per 64-weight group, the codes dequantized in
  registers (`quant.SplitWeight.values`) and multiplied with explicit vectors;
- integer weights × quantized rows (`a8`), split layout: per 64-weight group, one
  integer dot product of codes and int8 values (`quant.rows_dot`), scaled per 32-block
  (per 16-weight slice where a format's scales change there) by the weight's and the
  row's scales, plus the weight minimums times the rows' sums, into one register-wide
  sum per row and column; int16 rows (`a16`) the same with one dot product per int8
  plane, joined as `(dot(codes, hi) << 8) + dot(codes, lo)` (on AVX2: the planes joined
  into 16-bit words first) before the same scaling;
- the same in the tiles layout (`gemm_tiles`, every CPU with an integer dot product): per
  strip of 16 columns and 32-block, 8 `vpdpbusd` of code vectors by broadcast activations
  (VNNI-256: two each, a half of the strip's columns apiece; AVX2: two `vpmaddubsw` each,
  whose 16-bit pairs add up over the block before a `vpmaddwd`, `quant.byte_pairs`, or for
  8-bit codes codes and activations as 16-bit words, 4 `vpmaddwd` each, `quant.words_quads`),
  the 16 columns' sums in the lanes, for up to 8 rows while the block's codes are in
  registers (a decode's rows read each weight once); a zero point (q8_0, q4_0, q5_0, q6_k) is taken
  into the integer sums, `−zero · Σq` per row and block (`QRowsAccess.zero_term`),
  where the split layout scales an offset term in; with `isa amx`, whole 16-row blocks
  on AMX tiles (`amx.gemm_amx`); screened (`gemm_screened`, decode's LM head): int8 rows
  first, int16 rows again for the strips that come near a row's largest result.

Rows come in blocks that stay in L2 while every weight tile passes; threads share the
output columns in whole units (`dealt`): each its nth of them in order, the last part of
which (`DEALT_SHARE` in all) is a reserve of chunks counted by the kernel's work counter,
so a thread slowed down (another process on its core, a slower core) leaves the end of its
reserve to the others rather than keeping them waiting at the next barrier.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from llvmlite import ir

from llmc.backends.builder import F32, FPTR, I32, I64, KernelBuilder
from llmc.backends.cpu import amx
from llmc.backends.cpu.quant import (
    F16,
    I8,
    I16,
    QRowsAccess,
    SplitWeight,
    TiledWeight,
    byte_pairs,
    dot_slices,
    pair_quads,
    pairs_sums,
    rows_dot,
    scaled_block,
    shuffle,
    vec,
    vpdpbusd,
    words_quads,
    words_sums,
)
from llmc.ir import tgt
from llmc.ir.formats import GROUP, SLICE, Storage
from llmc.ir.layouts import QUADS, STRIP, TILE_K, Layout
from llmc.ir.tgt import SCREEN_COLUMNS

# matmul register tiles: R rows × C output columns per weight matrix (split layout), R rows × a strip of 16
# (tiles layout: a decode's rows, up to 8, walk each weight block together while it is in registers)
SPLIT_ROWS = (4, 2, 1)
# (by the tiles' isa: VNNI-256's rows take two chains a plane for each half of a strip, and 4 or 8 rows spill them
# from its 16 registers: 8 rows of SmolLM2 7.73 ms a step in tiles of 2, 8.24 of 4, 10.23 of 8 on Zen 5; AVX2 shares
# each quad's codes (bytes, or words widened) between the rows, best at 8: 9.67 ms, 10.08 of 4, 9.99 of 2)
STRIP_ROWS = {tgt.Isa.VNNI512: (8, 4, 2, 1), tgt.Isa.AVX2: (8, 4, 2, 1), tgt.Isa.VNNI256: (2, 1)}
TILE_ROWS = max(SPLIT_ROWS[0], *(sizes[0] for sizes in STRIP_ROWS.values()))  # the most rows a `finish` or `flush` gets
TILE_COLS = {1: 4, 2: 2}
WORDS_BYTES = 64 * 1024  # the stack an AVX2 tiles kernel takes at most for rows as 16-bit words: a decode's rows
# widened once a call, a prefill's tile of rows once for every strip and weight of a unit of columns (SmolLM2's 8-row
# step 11.6 → 10.4 ms where each strip widened its rows and broadcast their quads with `vpermq`; tiles of fewer rows
# where K is long)
# Rows per block: the x rows of one block stay in L2 while every weight tile passes.
BLOCK_BYTES = 192 * 1024
MAX_BLOCK_ROWS = 64
PREFETCH_BYTES = 4096  # how far ahead the integer kernels prefetch weight codes (into L1; tiles: by target) …
FAR_PREFETCH_BYTES = 32768  # … and by the tiles kernels' tiles of 4 rows or more, into L2: a block of 8 rows takes
# ~150 cycles, so 4 KB ahead comes too late from DRAM, and farther ahead into L1 fills its miss buffers (an 8-row
# int8-row LM head, Zen 4: 1.77 ms with L1 at 4 KB, 1.49 ms with L2 at 32 KB; one row is as fast with either) …
L2_TO_L1_PREFETCH_BYTES = 2048  # … and, for int16 rows, from L2 into L1 this far ahead: their blocks take twice the
# vpdpbusd of int8 rows', and the codes' L2 latency showed (SmolLM2's 8-row decode step, Zen 5: 4.30 ms with L2
# alone, 3.99 with L1 at 2 KB as well; 1 or 4 KB 1% slower than 2, 8 KB 3%). Int8 rows (a screened head's first
# pass) go twice as fast through the bytes, and L1 prefetch filled the miss buffers (the 270M model: 7.82 → 8.06 ms).
DOT_CHAINS = 2  # independent vpdpbusd chains per 32-block (its 8 products, 5 cycles each otherwise in a row)
DEALT_SHARE = (1, 4)  # of a kernel's units of columns, at most this part is in the threads' reserves …
CHUNKS_PER_THREAD = 4  # … in chunks of about this many per thread …
CHUNK_BYTES = 32 * 1024  # … of at least this many weight bytes (a take costs a shared cache line; a stolen one a
# new stream)


def floats(f: KernelBuilder, p: ir.Value) -> ir.Value:
    return f.b.bitcast(p, FPTR)


def load_weight(f: KernelBuilder, ptr: ir.Value, index: ir.Value, storage: Storage) -> ir.Value:
    """One element of a float-format weight as f32 (`ptr` typed for the storage)."""
    value = f.b.load(f.ptr(ptr, index), align=2 if storage is not Storage.F32 else 4)
    if storage is Storage.F16:
        return f.b.fpext(value, F32)
    if storage is Storage.BF16:
        return f.b.bitcast(f.b.shl(f.b.zext(value, I32), ir.Constant(I32, 16)), F32)
    return value


def weight_ptr(f: KernelBuilder, p: ir.Value, storage: Storage) -> ir.Value:
    element = {Storage.F32: F32, Storage.F16: F16, Storage.BF16: I16}[storage]
    return f.b.bitcast(p, element.as_pointer())


def inv_rms(f: KernelBuilder, row: ir.Value, D: int, eps: float) -> ir.Value:
    """1 / sqrt(mean(row²) + eps) of a float row."""
    def square(k: ir.Value) -> ir.Value:
        v = f.load(row, k)
        return f.fmul(v, v)

    ss = f.reduce_sum(D, square, name="ss", unroll=False)
    mean = f.fmul(ss, f.f32(1.0 / D))
    root = f.intrinsic("llvm.sqrt", f.b.fadd(mean, f.f32(eps)))
    return f.b.fdiv(f.f32(1.0), root)



Finish = Callable[[list[ir.Value], list[ir.Value], list[list[list[ir.Value]]]], None]
Prefetches = tuple[tuple[int, int], ...]  # prefetches of a weight's codes: (bytes ahead, cache level) each


class Rows:
    """The rows a projection reads: float rows (optionally normalized) or quantized rows."""

    def __init__(self, f: KernelBuilder, x: ir.Value, x_type, K: int, rows: ir.Value,
                 norm: ir.Value | None, eps, last_row: bool):
        self.f, self.K = f, K
        self.quantized = isinstance(x_type, tgt.QRowsType)
        self.first = f.sub(rows, 1) if last_row else f.i64(0)  # the first row read
        self.count = f.i64(1) if last_row else rows
        self.norm = floats(f, norm) if norm is not None else None
        self.eps = eps.value.data if eps is not None else None  # with the norm
        if self.quantized:
            self.q = QRowsAccess(f, x, x_type)
        else:
            self.x = floats(f, x)

    def row(self, t: ir.Value) -> ir.Value:
        return self.f.ptr(self.x, self.f.mul(self.f.add(self.first, t), self.K))


@contextmanager
def dealt(f: KernelBuilder, units: int, unit_bytes: int, tid: ir.Value, nth: ir.Value, work: ir.Value,
          dealing: ir.Value | None = None) -> Iterator[tuple[ir.Value, ir.Value]]:
    """The body once per range `[lo, hi)` of `units` (each `unit_bytes` of weights) that thread
    `tid` of `nth` takes. Each thread's share is its nth of the units, in order; the share's last
    part is its reserve, `R` chunks of at least `CHUNK_BYTES` (all reserves together about
    `DEALT_SHARE` of the units; none where that holds no chunk a thread: a small kernel). A thread
    takes its share's fixed part, then its reserve's chunks front to back, then the chunks the other
    threads have not taken yet, from the back of their reserves. Threads as fast as each other each
    read their share as one stream; a slowed thread (another process on its core, a slower core)
    leaves its last chunks to the others rather than keeping them waiting at the next barrier. Every
    unit goes to exactly one thread, however the threads interleave. Thread v's reserve is counted
    by word v of `work` (i64s, zero when the kernel starts: `llmc_barrier` zeroes them): its own
    takes add 1, the others' 2^32, and a take is good while the two halves sum to under `R`. With
    `dealing` false (an i1), each thread takes its share whole and never touches the counters (a
    kernel that shares several rounds of work per call).

        with dealt(f, 1536, 1440, tid, nth, work) as (lo, hi):  # 2 threads: [0,576) or [768,1344) first,
            with f.loop(lo, hi) as u: ...                        # then chunks of 48 units, 4 a reserve
    """
    b = f.b
    num, den = DEALT_SHARE
    most = f.i64(units * num // den)
    per_round = f.mul(nth, CHUNKS_PER_THREAD)
    chunk = f.smax(-(-CHUNK_BYTES // unit_bytes), b.sdiv(f.add(most, f.sub(per_round, 1)), per_round))
    reserve = b.sdiv(most, f.mul(nth, chunk))  # R: chunks in each thread's reserve
    if dealing is not None:
        reserve = b.select(dealing, reserve, f.i64(0))

    def reserve_end(v: ir.Value) -> ir.Value:
        return b.sdiv(f.mul(f.i64(units), f.add(v, 1)), nth)

    lo0, hi0 = b.sdiv(f.mul(f.i64(units), tid), nth), f.sub(reserve_end(tid), f.mul(reserve, chunk))
    pre = b.block
    head, grab, good, other, done = (b.append_basic_block(f"deal.{n}") for n in ("head", "grab", "good", "other",
                                                                                 "done"))
    b.branch(head)
    b.position_at_end(head)
    lo, hi = b.phi(I64, name="deal.lo"), b.phi(I64, name="deal.hi")
    taken_from = b.phi(I64, name="deal.from")  # the last range's reserve: thread tid + taken_from (mod nth)
    lo.add_incoming(lo0, pre)
    hi.add_incoming(hi0, pre)
    taken_from.add_incoming(f.i64(0), pre)
    yield lo, hi
    b.cbranch(b.icmp_signed(">", reserve, f.i64(0)), grab, done)  # (nothing dealt: never touch the counters)
    body_end = b.block
    b.position_at_end(grab)
    d = b.phi(I64, name="deal.d")
    d.add_incoming(taken_from, body_end)
    v = f.add(tid, d)
    v = b.select(b.icmp_signed(">=", v, nth), f.sub(v, nth), v)
    own = b.icmp_signed("==", d, f.i64(0))
    old = b.atomic_rmw("add", b.gep(work, [v]), b.select(own, f.i64(1), f.i64(1 << 32)), "monotonic")
    front, back = b.and_(old, f.i64(0xFFFFFFFF)), b.ashr(old, f.i64(32))
    index = b.select(own, front, f.sub(f.sub(reserve, 1), back))
    start = f.sub(reserve_end(v), f.mul(f.sub(reserve, index), chunk))
    b.cbranch(b.icmp_signed("<", f.add(front, back), reserve), good, other)
    b.position_at_end(good)
    lo.add_incoming(start, good)
    hi.add_incoming(f.add(start, chunk), good)
    taken_from.add_incoming(d, good)
    b.branch(head)
    b.position_at_end(other)  # that reserve is all taken: the next thread's
    following = f.add(d, 1)
    d.add_incoming(following, other)
    b.cbranch(b.icmp_signed("<", following, nth), grab, done)
    b.position_at_end(done)


def dealt_columns(f: KernelBuilder, sizes: list[int], unit: int, column_bytes: int, tid: ir.Value, nth: ir.Value,
                  work: ir.Value, columns: Callable[[int, ir.Value, ir.Value], None],
                  rest: Callable[[int, ir.Value, int], None], dealing: ir.Value | None = None) -> None:
    """`dealt` over the whole `unit`s of one or more outputs' columns (`sizes[i]` columns in output i, their units
    dealt as one sequence): columns(i, lo, hi) for each range [lo, hi) of output i's columns (whole units) this
    thread takes; then on the last thread rest(i, j0, width) for each output's columns past its last whole unit.

        dealt_columns(f, [576, 192, 192], 16, …)  # q, k, v: 60 units; thread 1 of 2 takes q's 480..576, k, v
    """
    b = f.b
    counts = [n // unit for n in sizes]
    with dealt(f, sum(counts), unit * column_bytes, tid, nth, work, dealing) as (lo, hi):
        first = 0
        for i, count in enumerate(counts):
            if len(counts) > 1:  # the range's part in output i's units
                lo_i, hi_i = (f.smin(f.smax(f.sub(v, first), f.i64(0)), f.i64(count)) for v in (lo, hi))
            else:
                lo_i, hi_i = lo, hi
            columns(i, f.mul(lo_i, unit), f.mul(hi_i, unit))
            first += count
    left = [(i, n - n % unit, n % unit) for i, n in enumerate(sizes) if n % unit]
    if left:
        with f.when(b.icmp_signed("==", tid, b.sub(nth, f.i64(1)))):
            for i, j0, width in left:
                rest(i, f.i64(j0), width)


@dataclass(frozen=True)
class Part:
    """One output of a projection kernel: its weights (SwiGLU's gate and up, whose products `finish` joins), what
    writes its tiles (`finish`), and what writes quantized outputs after each unit of columns of a tile of rows
    (`flush(t, r, j0)`). A matmul or SwiGLU kernel has one part; `tgt.qkv` three."""

    weights: list[tuple[ir.Value, tgt.WeightType]]
    finish: Finish
    flush: Callable[[ir.Value, int, ir.Value], None] | None = None

    @property
    def N(self) -> int:
        return tgt.dims(self.weights[0][1])[0]


def tile_sizes(rows: Rows, sizes: tuple[int, ...]) -> tuple[int, ...]:
    """`sizes` without those larger than a quantized row buffer (a decode of one row: tiles of 1 only)."""
    return tuple(r for r in sizes if not rows.quantized or r <= rows.q.capacity)


def rows_left(f: KernelBuilder, span: ir.Value, big: int) -> tuple[ir.Value, ir.Value]:
    """Of `span` rows, those left after whole tiles of `big`, and whether they are one padded tile (more than
    half of one). The same for any span that starts at a multiple of `big`."""
    left = f.b.and_(span, f.i64(big - 1))
    return left, f.b.icmp_signed(">", left, f.i64(big // 2))


def row_tiles(f: KernelBuilder, rows: Rows, first: ir.Value, end: ir.Value, sizes: tuple[int, ...],
              body: Callable[[ir.Value, int], None],
              padded: Callable[[ir.Value, int, ir.Value], None] | None = None) -> None:
    """body(t, r) over rows first..end in tiles of r rows: `sizes[0]` at a time, then at most one tile
    of each smaller size (powers of two, halving: 7 rows of (4, 2, 1) are three tiles, not 4 + 1 + 1 + 1).
    Sizes larger than a quantized row buffer are left out (`tile_sizes`).
    With `padded`, rows left over that are more than half of `sizes[0]` are padded(t, sizes[0], n) instead, n
    the rows left (`rows_left`): each weight read once for them, not once per smaller tile (on the AMX Xeon a 1.1B
    model's step of 7 rows took 46 ms as 4 + 2 + 1, 36 as one tile; 8 rows 33)."""
    b = f.b
    sizes = tile_sizes(rows, sizes)
    span = f.sub(end, first)
    t = f.add(first, b.and_(span, f.i64(-sizes[0])))
    with f.loop(first, t, sizes[0], name=f"t{sizes[0]}") as t_big:
        body(t_big, sizes[0])

    def halving(t: ir.Value) -> None:
        for r in sizes[1:]:
            part = b.and_(span, f.i64(r))
            with f.when(b.icmp_signed("!=", part, f.i64(0))):
                body(t, r)
            t = f.add(t, part)

    if padded is None or len(sizes) == 1:
        halving(t)
        return
    left, one_tile = rows_left(f, span, sizes[0])
    with b.if_else(one_tile) as (whole, halves):
        with whole:
            padded(t, sizes[0], left)
        with halves:
            halving(t)


def gemm(f: KernelBuilder, rows: Rows, parts: list[Part], tid: ir.Value, nth: ir.Value, work: ir.Value,
         isa: tgt.Isa | None, unit: int | None = None, *, prefetch: Prefetches) -> None:
    """For every part, tile of rows ts and columns js: part.finish(ts, js, vals) with
    vals[w][r][c] = x̂[ts[r]] · part.weights[w][js[c]], x̂ the rows (RMS-normalised when
    `rows.norm`: the scale 1/rms is applied to the finished dot product, the norm weight
    inside it). Thread `tid` of `nth` takes the parts' output columns `dealt` it in whole `unit`s
    (a tile's width by default; dealt from the counter `work` where the rows are one block,
    a fixed share of each block otherwise); the last thread takes the columns left over.
    With `part.flush`, after the tiles of one unit of columns for a tile of rows `t` of `r`
    rows: flush(t, r, j0) (quantized outputs are written from there). Tiles of fewer than 4 rows
    prefetch a tiles weight's codes as `prefetch` says (`Tuning.near_prefetches`: bytes ahead and cache level)."""
    b = f.b
    nw = len(parts[0].weights)
    assert all(len(part.weights) == nw for part in parts)
    K = rows.K
    R, C = SPLIT_ROWS[0], TILE_COLS[nw]
    unit = unit or C
    assert unit % C == 0
    sizes = [part.N for part in parts]
    column_bytes = sum(t.nbytes for part in parts for _, t in part.weights) // sum(sizes)  # (what a unit hands out)
    if parts[0].weights[0][1].layout.tiled:
        gemm_tiles(f, rows, parts, column_bytes, tid, nth, work, isa, unit, prefetch)
        return
    integer = parts[0].weights[0][1].layout is Layout.SPLIT
    accesses = [[SplitWeight(f, p, t) if integer else (weight_ptr(f, p, t.storage), t.storage) for p, t in part.weights]
                for part in parts]
    row_bytes = rows.q.row.row_bytes if rows.quantized else 4 * K  # (a decode's 8 int8 rows of K = 8192: one block)
    TB = max(R, min(MAX_BLOCK_ROWS, BLOCK_BYTES // row_bytes) // R * R)
    inv = f.alloca(F32, TB, name="inv_rms") if rows.norm is not None else None

    def tile(i: int, t0: ir.Value, t: ir.Value, r: int, j0: ir.Value, c: int) -> None:
        access = accesses[i]
        if rows.quantized:
            vals = _tile_a8(f, rows, access, t, r, j0, c, isa)
        elif integer:
            vals = _tile_a32_groups(f, rows, access, t, r, j0, c)
        else:
            vals = _tile_a32_float(f, rows, access, t, r, j0, c)
        ts = [f.add(t, ri) for ri in range(r)]
        js = [f.add(j0, ci) for ci in range(c)]
        if inv is not None:
            for ri in range(r):
                scale = f.load(inv, f.sub(ts[ri], t0))
                for wi in range(nw):
                    vals[wi][ri] = [f.fmul(v, scale) for v in vals[wi][ri]]
        parts[i].finish(ts, js, vals)

    def unit_columns(i: int, t0: ir.Value, t_end: ir.Value, j0: ir.Value, width: int) -> None:
        """Rows t0..t_end of part i's `width` columns from j0, row tile by row tile."""
        def row_tile(t: ir.Value, r: int) -> None:
            c_main = width // C * C
            if c_main:
                with f.loop(0, c_main, C, name="jc", unroll=False) as jc:
                    tile(i, t0, t, r, f.add(j0, jc), C)
            if width % C:
                tile(i, t0, t, r, f.add(j0, f.i64(c_main)), width % C)
            if parts[i].flush is not None:
                parts[i].flush(t, r, j0)

        row_tiles(f, rows, t0, t_end, SPLIT_ROWS, row_tile)

    one_block = b.icmp_signed("<=", rows.count, f.i64(TB))  # (several: each block's columns shared, not dealt)
    with f.loop(0, rows.count, TB, name="tb") as t0:
        t_end = f.smin(f.add(t0, TB), rows.count)
        if inv is not None:
            with f.loop(t0, t_end, name="tn") as t:
                f.store(inv_rms(f, rows.row(t), K, rows.eps), inv, f.sub(t, t0))

        def columns(i: int, lo: ir.Value, hi: ir.Value) -> None:
            with f.loop(lo, hi, unit, name="j") as j0:
                unit_columns(i, t0, t_end, j0, unit)

        dealt_columns(f, sizes, unit, column_bytes, tid, nth, work, columns,
                      lambda i, j0, width: unit_columns(i, t0, t_end, j0, width), one_block)


def _accumulators(f: KernelBuilder, ty: ir.Type, nw: int, r: int, c: int, name: str) -> list:
    accs = [[[f.alloca(ty, name=f"{name}{wi}_{ri}_{ci}") for ci in range(c)] for ri in range(r)] for wi in range(nw)]
    zero = ir.Constant(ty, [0.0] * ty.count) if isinstance(ty, ir.VectorType) else f.f32(0.0)
    for plane in accs:
        for row in plane:
            for acc in row:
                f.b.store(zero, acc)
    return accs


def _tile_a32_float(f: KernelBuilder, rows: Rows, access: list, t: ir.Value, r: int, j0: ir.Value, c: int) -> list:
    """Float weights: a scalar reduction over k per (row, column), vectorised by LLVM."""
    b, K, nw = f.b, rows.K, len(access)
    accs = _accumulators(f, F32, nw, r, c, "acc")
    xrows = [rows.row(f.add(t, ri)) for ri in range(r)]
    wrows = [[f.mul(f.add(j0, ci), K) for ci in range(c)] for _ in access]
    with f.loop(0, K, name="k") as k:
        xs = [f.load(xr, k) for xr in xrows]
        if rows.norm is not None:
            g = f.load(rows.norm, k)
            xs = [f.fmul(xv, g) for xv in xs]
        for wi, (ptr, storage) in enumerate(access):
            for ci in range(c):
                wv = load_weight(f, ptr, f.add(wrows[wi][ci], k), storage)
                for ri in range(r):
                    acc = accs[wi][ri][ci]
                    b.store(f.fadd(b.load(acc), f.fmul(xs[ri], wv)), acc)
    return [[[b.load(accs[wi][ri][ci]) for ci in range(c)] for ri in range(r)] for wi in range(nw)]


def _tile_a32_groups(f: KernelBuilder, rows: Rows, access: list[SplitWeight], t: ir.Value, r: int, j0: ir.Value,
                     c: int) -> list:
    """Integer weights × float rows: each 64-group dequantized in registers, explicit vector FMAs."""
    b, K, nw = f.b, rows.K, len(access)
    accs = _accumulators(f, vec(F32, 16), nw, r, c, "acc")
    xrows = [rows.row(f.add(t, ri)) for ri in range(r)]

    def group(g: ir.Value, slices: int) -> None:
        base = f.mul(g, GROUP)
        xs = [[f.vload(xr, f.add(base, 16 * s)) for s in range(slices)] for xr in xrows]
        if rows.norm is not None:
            gs = [f.vload(rows.norm, f.add(base, 16 * s)) for s in range(slices)]
            xs = [[f.fmul(xv, gv) for xv, gv in zip(row, gs)] for row in xs]
        for wi, w in enumerate(access):
            for ci in range(c):
                ws = w.values(f.add(j0, ci), g, slices)
                for ri in range(r):
                    acc = accs[wi][ri][ci]
                    total = b.load(acc)
                    for wv, xv in zip(ws, xs[ri]):
                        total = f.fadd(total, f.fmul(wv, xv))
                    b.store(total, acc)

    full, half = K // GROUP, K % GROUP // 16
    with f.loop(0, full, name="g", unroll=False) as g:
        group(g, 4)
    if half:
        group(f.i64(full), half)
    return [[[f.reduce_vector(b.load(accs[wi][ri][ci])) for ci in range(c)] for ri in range(r)] for wi in range(nw)]


def _tile_a8(f: KernelBuilder, rows: Rows, access: list[SplitWeight], t: ir.Value, r: int, j0: ir.Value, c: int,
             isa: tgt.Isa) -> list:
    """Integer weights × quantized rows: per 64-group one integer dot product per (row, column)
    and plane of the rows (int16 rows: `hi` and `lo`, joined as `(hi << 8) + lo` in int32), its
    lanes (`dot_slices`) scaled into one sum per (row, column), the weight offsets times the row's
    slice (or 32-block) sums into its first lanes."""
    b, nw = f.b, len(access)
    slices = dot_slices(isa)
    width = len(slices)
    accs = _accumulators(f, vec(F32, width), nw, r, c, "acc")
    n = 4 // min(w.scale_step() for w in access)  # scale changes per 64-group: its slices, or its 32-blocks
    zero, first = ir.Constant(vec(F32, n), [0.0] * n), [min(i, n) for i in range(width)]  # (zero past lane n − 1)
    tiled = [i % n for i in range(width)]  # the offsets over every lane: only the first n meet nonzero sums
    with f.loop(0, access[0].groups, name="g", unroll=False) as g:
        cols = []
        for w in access:
            w.prefetch(j0, c, g, PREFETCH_BYTES)
            per_col = []
            for ci in range(c):
                j = f.add(j0, ci)
                scale = w.scale(j, g, n)
                per_col.append((w.codes(j, g), scale, shuffle(f, w.offset(j, g, scale), tiled)))
            cols.append(per_col)
        for ri in range(r):
            row = f.add(rows.first, f.add(t, ri))
            xq = [rows.q.qs(row, g, plane) for plane in range(rows.q.planes)]
            d, s = rows.q.group_scales(row, g, n)
            sums = shuffle(f, s, first, zero)
            for wi, per_col in enumerate(cols):
                for ci, (codes, scale, offset) in enumerate(per_col):
                    dot = b.sitofp(rows_dot(f, isa, codes, xq, access[wi].bits), vec(F32, width))
                    lanes = shuffle(f, b.fmul(scale, d), [sl * n // 4 for sl in slices])
                    acc = accs[wi][ri][ci]
                    b.store(f.fadd(f.fadd(b.load(acc), f.fmul(offset, sums)), f.fmul(dot, lanes)), acc)
    return [[[f.reduce_vector(b.load(accs[wi][ri][ci])) for ci in range(c)] for ri in range(r)] for wi in range(nw)]


# ------------------------------------------------------------------ the tiles layout


def broadcast_quad(f: KernelBuilder, q: QRowsAccess, t: ir.Value, k: ir.Value, plane: int = 0) -> ir.Value:
    """Row t's int8 values k..k+3 (k a multiple of 4; of `plane` for int16 rows) in every lane:
    `<64 x i8>`, a `vpdpbusd` operand."""
    word = f.load(f.b.bitcast(q.qs_ptr(t, plane), I32.as_pointer()), f.b.sdiv(k, f.i64(4)))
    lanes = f.b.insert_element(ir.Constant(vec(I32, 1), None), word, ir.Constant(I32, 0))
    lanes = f.b.shuffle_vector(lanes, ir.Constant(vec(I32, 1), None), ir.Constant(vec(I32, 16), [0] * 16))
    return f.b.bitcast(lanes, vec(I8, 64))


def gemm_tiles(f: KernelBuilder, rows: Rows, parts: list[Part], column_bytes: int, tid: ir.Value, nth: ir.Value,
               work: ir.Value, isa: tgt.Isa, unit: int, prefetch: Prefetches) -> None:
    """Quantized rows × weights in the tiles layout. Whole 16-row blocks on AMX tiles where the
    kernel has `isa amx` (and the runtime allowed them); every other row on VNNI-512 (or the kernel's
    `isa`, VNNI-256 or AVX2, as `_strip_dot` takes them): per strip
    of 16 columns and 32-block, 8 `vpdpbusd` of the block's code vectors and 4 broadcast
    int8 values of each row (the 16 columns' sums in the lanes; int16 rows: 8 per plane, joined
    as `(hi << 8) + lo`), scaled once per scale group: `acc += dot · (d_w · d_x) + off_w · s_x` (with a zero
    point, `acc += (dot − zero · Σq) · (d_w · d_x)`: no floating-point multiply-add on the pipes `vpdpbusd` uses).
    From 4 rows each row and plane is one chain, the rows' products interleaved quad by quad (a
    row's 16 dependent products had the out-of-order window waiting: 8 rows of int16, 1.06–1.08x)."""
    assert rows.quantized
    b = f.b
    unit = max(STRIP, unit)  # (whole strips)
    assert unit % STRIP == 0
    accesses = [[TiledWeight(f, p, t) for p, t in part.weights] for part in parts]
    start = f.i64(0)
    if isa is tgt.Isa.AMX:
        start = b.select(amx.enabled(f), b.and_(rows.count, f.i64(-amx.TILE)), f.i64(0))

    vector = tgt.Isa.VNNI512 if isa is tgt.Isa.AMX else isa  # (the rows AMX leaves)
    kp, sizes, row_words = accesses[0][0].kp, STRIP_ROWS[vector], None
    if vector is tgt.Isa.AVX2 and any(takes_words(w) for access in accesses for w in access):  # rows as 16-bit
        # words, on the stack
        sizes = tuple(r for r in sizes if r == 1 or r * kp * 2 <= WORDS_BYTES)
        row_words = b.bitcast(f.alloca(I32, sizes[0] * kp // 2, name="row_words"), I16.as_pointer())  # (4-aligned)
        # rows that fit in one tile (a decode's) are widened once, before any column; more, a tile at a time for each
        # unit of columns (the row count is the call's: one kernel serves entry points of any number of rows)
        every_row = b.icmp_signed("<=", rows.count, f.i64(sizes[0]))

    def widen(q: QRowsAccess, t: ir.Value, at: ir.Value) -> None:
        """Row t of q as 16-bit words into row `at` of `row_words`."""
        with f.loop(0, kp // TILE_K, name="wb", unroll=False) as blk:
            f.vstore(q.words(t, f.mul(blk, TILE_K)), row_words, f.add(f.mul(at, kp), f.mul(blk, TILE_K)))

    if row_words is not None:
        with f.when(every_row), f.loop(0, rows.count, name="wr", unroll=False) as t:
            widen(rows.q, f.add(rows.first, t), t)

    big = tile_sizes(rows, sizes)[0]
    padded_rows = f.alloca(I8, big * rows.q.row.row_bytes, name="padded_rows") if big > 2 else None
    if padded_rows is not None:  # rows left over that fill more than half a tile: a tile of them and zero rows
        # (once a call: `row_tiles` starts at 0 or at AMX's multiple of 16, so its rows left are these)
        row_bytes, tail = rows.q.row.row_bytes, b.and_(rows.count, f.i64(-big))
        left, one_tile = rows_left(f, rows.count, big)
        with f.when(one_tile):
            f.copy_bytes(padded_rows, rows.q.qs_ptr(f.add(rows.first, tail)), f.mul(left, row_bytes))
            f.copy_bytes(f.ptr(padded_rows, f.mul(left, row_bytes)), None, f.mul(f.sub(big, left), row_bytes))

    def unit_rows(i: int, t: ir.Value, r: int, j0: ir.Value, width: int, live: ir.Value | None = None) -> None:
        """Rows t..t+r of part i's `width` columns from j0 (whole strips, the last one possibly partial); a padded
        tile (`live` given, more than r/2): rows t..t+live, as copied to `padded_rows`."""
        access = accesses[i]
        step = min(w.scale_step() for w in access)  # 16-slices per scale group (the same for SwiGLU's two)
        nstrips = -(-width // STRIP)
        vals = [[[None] * width for _ in range(r)] for _ in access]
        q, ts = rows.q, [f.add(rows.first, f.add(t, ri)) for ri in range(r)]  # (last_row: the last row)
        if live is not None:  # the rows copied to `padded_rows`, zero rows after them
            q, ts = q.from_row(padded_rows), [f.i64(ri) for ri in range(r)]
        tile_words = row_words
        if row_words is not None:
            with f.when(b.not_(every_row)):
                for ri, x in enumerate(ts):
                    widen(q, x, f.i64(ri))
            tile_words = b.select(every_row, f.ptr(row_words, f.mul(t, kp)), row_words)
        for si in range(nstrips):
            s = b.sdiv(f.add(j0, si * STRIP), f.i64(STRIP))
            # one weight at a time (swiglu: gate, then up): a tile's codes and accumulators stay in registers
            sums = [_strip_dot(f, q, w, ts, s, step, prefetch, vector, tile_words) for w in access]
            for wi in range(len(access)):
                for ri in range(r):
                    for c in range(min(STRIP, width - si * STRIP)):
                        vals[wi][ri][si * STRIP + c] = b.extract_element(sums[wi][ri], ir.Constant(I32, c))

        def keep(first: int, n: int) -> None:
            """Rows t+first..t+first+n finished (and flushed)."""
            at = f.add(t, first)
            parts[i].finish([f.add(at, ri) for ri in range(n)], [f.add(j0, c) for c in range(width)],
                            [v[first:first + n] for v in vals])
            if parts[i].flush is not None:
                parts[i].flush(at, n, j0)

        if live is None:
            keep(0, r)
            return
        keep(0, r // 2 + 1)  # (a padded tile has more than half its rows; then each further row where there is one)
        for ri in range(r // 2 + 1, r - 1):
            with f.when(b.icmp_signed("<", f.i64(ri), live)):
                keep(ri, 1)

    def span(i: int, first: ir.Value, j0: ir.Value, width: int) -> None:
        """Rows first..count of part i's `width` columns from j0, in tiles of `STRIP_ROWS` (rows left over that
        fill more than half of the largest: one of those, padded)."""
        row_tiles(f, rows, first, rows.count, sizes, lambda t, r: unit_rows(i, t, r, j0, width),
                  None if padded_rows is None else lambda t, r, live: unit_rows(i, t, r, j0, width, live))

    def columns(i: int, lo: ir.Value, hi: ir.Value) -> None:
        if isa is tgt.Isa.AMX:
            amx.gemm_amx(f, rows.q, accesses[i], start, lo, hi, unit, parts[i].finish, parts[i].flush)
        with f.loop(lo, hi, unit, name="ju") as j0:
            span(i, start, j0, unit)

    dealt_columns(f, [part.N for part in parts], unit, column_bytes, tid, nth, work, columns,
                  lambda i, j0, width: span(i, f.i64(0), j0, width))  # (the columns left over: every row of them)


def takes_words(w: TiledWeight) -> bool:
    """Whether AVX2 multiplies rows by `w` as 16-bit words: 8-bit codes (whose `vpmaddubsw` pairs could saturate;
    codes below 8 bits take `quant.byte_pairs`)."""
    return w.bits == 8


def _strip_dot(f: KernelBuilder, q: QRowsAccess, w: TiledWeight, ts: list[ir.Value], s: ir.Value,
               step: int, prefetch: Prefetches, isa: tgt.Isa, row_words: ir.Value | None = None) -> list[ir.Value]:
    """`<16 x float>` per row: rows ts · the 16 columns of strip s of `w`, scaled every `step` 16-slices (the
    codes prefetched as `prefetch` says for fewer than 4 rows (bytes ahead, cache level); for more, into L2 `FAR_PREFETCH_BYTES`
    ahead, and from int16 rows into L1 `L2_TO_L1_PREFETCH_BYTES` ahead as well). `isa` `vnni512` or `vnni256`:
    `vpdpbusd` of the codes by each row's int8 values (of each plane); `avx2`, codes below 8 bits: `vpmaddubsw` of
    the codes by each plane's values, its 16-bit pairs summed over as many quads as stay exact (`quant.byte_pairs`:
    a 4-bit 32-block's 8), then one `vpmaddwd` a half (by 256 for `hi`, 1 for `lo`); 8-bit codes: the codes and
    each row's values as 16-bit words, `vpmaddwd` (`quant.words_quads`; `vpmaddubsw`'s pairs could saturate).
    `row_words` (`i16*`, with words): the rows as words already (`QRowsAccess.words`), `w.kp` apart."""
    b = f.b
    r = len(ts)
    accs = [acc for [acc] in _accumulators(f, vec(F32, STRIP), 1, r, 1, "tacc")[0]]
    # Several rows: one vpdpbusd chain per row and plane, emitted quad by quad across the rows, so that a row's
    # products wait on no other row's. Fewer: `DOT_CHAINS` chains a row, `lo`'s onto `hi`'s << 8 (fewer adds).
    # (Integer sums are exact in any order.) Codes with a zero point take it in as integers, `−zero · Σq` added to
    # the sums (`QRowsAccess.zero_term`, off the multiply pipes), so no offset term is scaled in after.
    folded = not w.fmt.minimum
    across = r >= 4
    words = isa is tgt.Isa.AVX2 and takes_words(w)
    bytewise = isa is tgt.Isa.AVX2 and not words
    assert row_words is not None or not words
    n_chains = 1 if across else DOT_CHAINS
    zero = ir.Constant(vec(I32, STRIP), [0] * STRIP)
    zero16 = ir.Constant(vec(I16, 16), [0] * 16)
    eight = ir.Constant(vec(I32, STRIP), [8] * STRIP)
    with f.loop(0, w.blocks, name="blk", unroll=False) as blk:
        for ahead, level in ((FAR_PREFETCH_BYTES, 2),) if across else prefetch:
            w.prefetch(s, blk, ahead, level)
        if across and q.planes == 2:
            w.prefetch(s, blk, L2_TO_L1_PREFETCH_BYTES, 1)
        codes = w.quads(s, blk)
        if words:
            block_words = [b.bitcast(f.ptr(row_words, f.add(f.i64(ri * w.kp), f.mul(blk, TILE_K))),
                                     vec(I16, 4).as_pointer()) for ri in range(r)]
        else:
            xs_by_row = [[[broadcast_quad(f, q, ts[ri], f.add(f.mul(blk, TILE_K), 4 * quad), plane)
                           for quad in range(QUADS)] for plane in range(q.planes)] for ri in range(r)]
        for first in range(0, TILE_K // SLICE, step):
            quads = range(first * SLICE // 4, (first + step) * SLICE // 4)
            sl = f.add(f.mul(blk, TILE_K // SLICE), first)
            scale = w.scale16(s, sl)
            offset = None if folded else w.offset16(s, sl, scale)
            dots = [zero] * r
            if words:
                pairs = [[ir.Constant(vec(I32, 8), [0] * 8)] * 4 for _ in range(r)]
                for quad in quads:
                    for ri, x in enumerate(block_words):  # (a broadcast load of the quad's 4 words)
                        x4 = shuffle(f, b.load(b.gep(x, [f.i64(quad)]), align=4), [i % 4 for i in range(16)])
                        pairs[ri] = words_quads(f, pairs[ri], codes[quad], x4)
                dots = [words_sums(f, p) for p in pairs]
            elif bytewise:  # 16-bit pair sums of as many quads as stay exact, then int32; `hi`'s times 256
                depth = pair_quads(w.bits)
                for n, quad in enumerate(quads):
                    if n % depth == 0:
                        acc = [[[zero16] * 2 for _ in range(q.planes)] for _ in range(r)]
                    for ri in range(r):
                        for plane, xs in enumerate(xs_by_row[ri]):
                            acc[ri][plane] = byte_pairs(f, acc[ri][plane], codes[quad], xs[quad])
                    if n % depth == depth - 1 or n == len(quads) - 1:
                        for ri in range(r):
                            for plane in range(q.planes):
                                times = 256 if plane == 0 and q.planes == 2 else 1
                                dots[ri] = b.add(dots[ri], pairs_sums(f, acc[ri][plane], times))
            elif across:
                chains = [[zero] * q.planes for _ in range(r)]
                for quad in quads:
                    for ri in range(r):
                        for plane, xs in enumerate(xs_by_row[ri]):
                            chains[ri][plane] = vpdpbusd(f, chains[ri][plane], codes[quad], xs[quad], isa)
                dots = [q.joined(c) for c in chains]
            else:
                for ri in range(r):
                    for plane, xs in enumerate(xs_by_row[ri]):  # int16 rows: `lo`'s products onto `hi`'s << 8
                        chains = [b.shl(dots[ri], eight) if plane else zero] + [zero] * (n_chains - 1)
                        for n, quad in enumerate(quads):
                            chains[n % n_chains] = vpdpbusd(f, chains[n % n_chains], codes[quad], xs[quad], isa)
                        dots[ri] = chains[0]
                        for other in chains[1:]:
                            dots[ri] = b.add(dots[ri], other)
            if folded:
                dots = [b.add(dot, q.zero_term(ts[ri], sl, step, w.fmt.zero)) for ri, dot in enumerate(dots)]
            for ri in range(r):
                row_scales = q.block_scales(ts[ri], sl, step, offset is not None)
                b.store(scaled_block(f, b.load(accs[ri]), dots[ri], scale, offset, *row_scales), accs[ri])
    return [b.load(acc) for acc in accs]


def gemm_screened(f: KernelBuilder, rows: Rows, coarse: QRowsAccess, N: int, weight: tuple[ir.Value, tgt.WeightType],
                  finish: Finish, margin: float, tid: ir.Value, nth: ir.Value, work: ir.Value,
                  prefetch: Prefetches) -> None:
    """A screened matmul (`tgt.matmul … screen M`) in the tiles layout: `rows` int16, `coarse` the same rows
    quantized to int8. Per block of `SCREEN_COLUMNS` columns (dealt whole, so the blocks do not depend on the
    threads) and tile of rows: every strip's products with the int8 rows, finished, each row's largest result
    per strip kept; then each (strip, row) whose largest is within `margin` of the row's largest in the block
    again with the int16 rows (`_strip_dot` of one row: the bits an unscreened kernel gives), finished over them.

        8 rows, a block of 128 strips: 128 × 64 `vpdpbusd` a 32-block, then 16 for each (strip, row) chosen
    """
    b = f.b
    w = TiledWeight(f, *weight)
    step = w.scale_step()
    rows_max = STRIP_ROWS[tgt.Isa.VNNI512][0]
    strip_best = f.alloca(F32, SCREEN_COLUMNS // STRIP * rows_max, name="strip_best")  # [strip][row]
    block_best = f.alloca(F32, rows_max, name="block_best")

    def block(j0: ir.Value, width: int) -> None:
        full, part = divmod(width, STRIP)
        valid = ir.Constant(vec(ir.IntType(1), STRIP), [c < part for c in range(STRIP)])  # (a last strip's columns)
        below = ir.Constant(vec(F32, STRIP), [float("-inf")] * STRIP)

        def strip_columns(si: ir.Value, cols: int) -> tuple[ir.Value, list[ir.Value]]:
            """Strip si of the block, and its first `cols` columns."""
            return f.add(b.sdiv(j0, f.i64(STRIP)), si), [f.add(j0, f.add(f.mul(si, STRIP), c)) for c in range(cols)]

        def tile(t: ir.Value, r: int) -> None:
            for ri in range(r):
                f.store(f.f32(float("-inf")), block_best, ri)

            def coarse_strip(si: ir.Value, cols: int) -> None:
                s, js = strip_columns(si, cols)
                sums = _strip_dot(f, coarse, w, [f.add(t, ri) for ri in range(r)], s, step, prefetch, tgt.Isa.VNNI512)
                lanes = [[b.extract_element(v, ir.Constant(I32, c)) for c in range(cols)] for v in sums]
                finish([f.add(t, ri) for ri in range(r)], js, [lanes])
                for ri in range(r):
                    top = f.reduce_max(sums[ri] if cols == STRIP else b.select(valid, sums[ri], below))
                    f.store(top, strip_best, f.add(f.mul(si, rows_max), ri))
                    f.store(f.fmax(f.load(block_best, ri), top), block_best, ri)

            def fine_strip(si: ir.Value, cols: int) -> None:
                s, js = strip_columns(si, cols)
                with f.loop(0, r, name="fr", unroll=False) as ri:
                    near = f.fsub(f.load(block_best, ri), f.f32(margin), flags=())
                    top = f.load(strip_best, f.add(f.mul(si, rows_max), ri))
                    with f.when(b.fcmp_ordered(">=", top, near)):
                        [exact] = _strip_dot(f, rows.q, w, [f.add(t, ri)], s, step, prefetch, tgt.Isa.VNNI512)
                        finish([f.add(t, ri)], js, [[[b.extract_element(exact, ir.Constant(I32, c))
                                                      for c in range(cols)]]])

            for strip in (coarse_strip, fine_strip):
                with f.loop(0, full, name="sj", unroll=False) as si:
                    strip(si, STRIP)
                if part:
                    strip(f.i64(full), part)

        row_tiles(f, rows, f.i64(0), rows.count, STRIP_ROWS[tgt.Isa.VNNI512], tile)

    def columns(_: int, lo: ir.Value, hi: ir.Value) -> None:
        with f.loop(lo, hi, SCREEN_COLUMNS, name="jb") as j0:
            block(j0, SCREEN_COLUMNS)

    dealt_columns(f, [N], SCREEN_COLUMNS, weight[1].nbytes // N, tid, nth, work, columns,
                  lambda _, j0, width: block(j0, width))
