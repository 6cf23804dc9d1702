"""CUDA RoPE and attention kernels, as `backends/cpu/attention.py` on the CPU.

| op | kernels | grid (x, y, z) | a thread block does |
|---|---|---|---|
| rope | one | (1, rows) | rotate-half RoPE in place of one row's heads |
| attention | `_store`, `_attend`, (`_merge`) | (1, rows); prefill (heads, rows / 4); decode (heads, rows, S) | RoPE in place and the cache write; an online softmax over cache positions, lanes over the head dimension: in prefill a warp per query row, in decode 4 warps and S blocks per row splitting the positions, merged (flash-decoding) |

A cache is f32, f16 or q8_0 rows (`_Cache`); decode's S blocks each write a partial result
(d weighted values, the maximum, the sum) into `partials`, which `_merge` combines.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from xdsl.dialects.builtin import MemRefType

from llmc.abi import ELEMENT_BYTES, KV_Q8_BLOCK, KV_Q8_SCALE_BYTES
from llmc.backends.builder import F32, F64, FPTR, KernelBuilder, f32_table
from llmc.backends.cuda.device import WARP
from llmc.backends.cuda.emit import THREADS, WARPS, Emit, Launch, PerRows, fptr, load_index, lt, strided
from llmc.backends.cuda.weights import F16, I8, load_f16, typed
from llmc.backends.kernel_names import rope_table
from llmc.ir import llm, tgt

SPLITS = 32  # decode attention: blocks per head over the cache positions (≤ abi.MAX_THREADS partials)
NO_SCORE = -1e30  # the running maximum before any position (finite: no inf − inf)


def _rotate(f: KernelBuilder, dev, x: ir.Value, heads: int, d: int, position: ir.Value, rope: llm.RopeAttr) -> None:
    """Rotate-half RoPE in place of the `heads` heads at `x` (one row; the first `dims` of each),
    threads striding the pairs: f32 angles as numpy computes them, sin and cos in f64
    (`KernelBuilder.sincos`), times `mscale`."""
    half = rope.rotary_dims(d) // 2
    freqs = f.b.bitcast(f32_table(f.module, *rope_table(d, rope)), FPTR)
    pos = f.b.sitofp(position, F32)
    with strided(f, dev.tid(f), heads * half, THREADS, "p") as p:
        h, i = f.b.udiv(p, f.i64(half)), f.b.urem(p, f.i64(half))
        angle = f.fmul(pos, f.load(freqs, i), flags=())
        sin, cos = (f.b.fptrunc(v, F32) for v in f.sincos(f.b.fpext(angle, F64)))
        if rope.mscale.data != 1.0:
            m = ir.Constant(F32, rope.mscale.data)
            sin, cos = f.fmul(sin, m, flags=()), f.fmul(cos, m, flags=())
        lo = f.add(f.mul(h, d), i)
        hi = f.add(lo, half)
        x1, x2 = f.load(x, lo), f.load(x, hi)
        f.store(f.fsub(f.fmul(x1, cos), f.fmul(x2, sin)), x, lo)
        f.store(f.fadd(f.fmul(x2, cos), f.fmul(x1, sin)), x, hi)


def rope(e: Emit) -> list[Launch]:
    op, dev = e.op, e.dev
    _, heads, d = tgt.dims(op.x)

    def body(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        t = dev.ctaid(f, "y")
        position = load_index(f, a["positions"], t)
        _rotate(f, dev, f.b.gep(fptr(f, a["x"]), [f.mul(t, heads * d)]), heads, d, position, op.rope)

    return [e.kernel("", body, (1, PerRows(1), 1))]


class _Cache:
    """One layer's cache `[kv_heads, capacity, row]` of f32, f16 or q8_0 rows (int8 values, f32 scale per 32),
    of one sequence: with `slot` (a cache of several, `[slots, kv_heads, capacity, row]`), that one's."""

    def __init__(self, f: KernelBuilder, base: ir.Value, memref: MemRefType, head_dim: int,
                 slot: ir.Value | None = None):
        self.f, self.d = f, head_dim
        kv_heads, self.capacity, self.row = tgt.dims(memref)[-3:]
        self.element = str(memref.element_type)
        self.size = ELEMENT_BYTES[self.element]
        self.base = base if slot is None else f.b.gep(base, [f.mul(slot, kv_heads * self.capacity * self.row * self.size)])

    def _row(self, head: ir.Value, position: ir.Value) -> ir.Value:
        f = self.f
        return f.mul(f.add(f.mul(head, self.capacity), position), self.row * self.size)

    def load(self, head: ir.Value, position: ir.Value, i: ir.Value) -> ir.Value:
        f, row = self.f, self._row(head, position)
        if self.element == "f32":
            return f.b.load(typed(f, self.base, f.add(row, f.mul(i, 4)), F32), align=4)
        if self.element == "f16":
            return load_f16(f, f.b.gep(self.base, [row]), i)
        code = f.b.sitofp(f.b.load(typed(f, self.base, f.add(row, i), I8)), F32)
        at = f.add(f.add(row, self.d), f.mul(f.b.udiv(i, f.i64(KV_Q8_BLOCK)), KV_Q8_SCALE_BYTES))
        scale = f.b.load(typed(f, self.base, at, F32))
        return f.fmul(code, scale)

    def store_row(self, dev, head: ir.Value, position: ir.Value, src: ir.Value, lane_start: ir.Value,
                  step: int) -> None:
        """Write the `d` floats at `src` as the row (head, position), threads striding elements
        (f32, f16) or 32-value blocks (q8_0: `d = amax / 127`, `q = rint(x · 127 / amax)`, as `quantize_rows`)."""
        f, b, row = self.f, self.f.b, self._row(head, position)
        if self.element != "i8":
            with strided(f, lane_start, self.d, step, "s") as i:
                v = f.load(src, i)
                if self.element == "f32":
                    b.store(v, typed(f, self.base, f.add(row, f.mul(i, 4)), F32), align=4)
                else:
                    b.store(b.fptrunc(v, F16), typed(f, self.base, f.add(row, f.mul(i, 2)), F16), align=2)
            return
        with strided(f, lane_start, self.d // KV_Q8_BLOCK, step, "q") as blk:
            amax = f.f32(0.0)
            for i in range(KV_Q8_BLOCK):
                x = f.load(src, f.add(f.mul(blk, KV_Q8_BLOCK), i))
                amax = f.intrinsic("llvm.maxnum", amax, f.intrinsic("llvm.fabs", x))
            scale = b.fdiv(amax, f.f32(127.0))
            inv = b.select(b.fcmp_ordered(">", amax, f.f32(0.0)), b.fdiv(f.f32(127.0), amax), f.f32(0.0))
            for i in range(KV_Q8_BLOCK):
                at = f.add(f.mul(blk, KV_Q8_BLOCK), i)
                q = f.intrinsic("llvm.roundeven", b.fmul(f.load(src, at), inv))
                b.store(b.fptosi(q, I8), typed(f, self.base, f.add(row, at), I8))
            at = f.add(f.add(row, self.d), f.mul(blk, KV_Q8_SCALE_BYTES))
            b.store(scale, typed(f, self.base, at, F32), align=4)


def attention(e: Emit) -> list[Launch]:
    op, dev = e.op, e.dev
    _, heads, d = tgt.dims(op.q)
    _, kv_heads, _ = tgt.dims(op.k)
    group = heads // kv_heads
    splits = SPLITS if e.rows <= op.split_rows else 1
    lanes = -(-d // WARP)  # head-dimension elements per lane
    stride = d + 2  # a partial result: d weighted values, the maximum, the sum
    window, softcap, scale = llm.scoring(op).values()

    def first(f: KernelBuilder, end: ir.Value) -> ir.Value:
        """The first position a row whose positions end at `end` attends to (a sliding window's)."""
        return f.i64(0) if window is None else f.smax(0, f.sub(end, window))

    def capped(f: KernelBuilder, x: ir.Value) -> ir.Value:
        return x if softcap is None else f.softcap(x, softcap)

    def slot(f: KernelBuilder, a: dict[str, ir.Value], t: ir.Value) -> ir.Value | None:
        """Row t's sequence, in a cache of several."""
        return load_index(f, a["slots"], t) if op.slots is not None else None

    def store(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        t = dev.ctaid(f, "y")
        position = load_index(f, a["positions"], t)
        q = f.b.gep(fptr(f, a["q"]), [f.mul(t, heads * d)])
        k = f.b.gep(fptr(f, a["k"]), [f.mul(t, kv_heads * d)])
        v = f.b.gep(fptr(f, a["v"]), [f.mul(t, kv_heads * d)])
        if op.rope is not None:
            _rotate(f, dev, q, heads, d, position, op.rope)
            _rotate(f, dev, k, kv_heads, d, position, op.rope)
            dev.barrier(f)
        for name, src in (("k_cache", k), ("v_cache", v)):
            cache = _Cache(f, a[name], getattr(op, name).type, d, slot(f, a, t))
            for h in range(kv_heads):
                cache.store_row(dev, f.i64(h), position, f.b.gep(src, [f.i64(h * d)]), dev.tid(f), THREADS)

    def online_softmax(f: KernelBuilder, a: dict[str, ir.Value], h: ir.Value, t: ir.Value, lo: ir.Value,
                       hi: ir.Value, step: int, lane: ir.Value):
        """This warp's pass over cache positions lo, lo + step, … < hi for query row t, head h: the running
        maximum, the sum of exponentials and the weighted values (lanes over the head dimension)."""
        b = f.b
        kvh = b.udiv(h, f.i64(group))
        keys = _Cache(f, a["k_cache"], op.k_cache.type, d, slot(f, a, t))
        values = _Cache(f, a["v_cache"], op.v_cache.type, d, slot(f, a, t))
        q = b.gep(fptr(f, a["q"]), [f.mul(f.add(f.mul(t, heads), h), d)])
        dims = [f.add(lane, WARP * i) for i in range(lanes)]
        valid = [lt(f, i, d) for i in dims]
        safe = [f.smin(i, d - 1) for i in dims]
        score_scale = f.f32(scale if scale is not None else 1.0 / np.sqrt(d))
        qs = [b.select(ok, f.fmul(f.load(q, i), score_scale), f.f32(0.0)) for ok, i in zip(valid, safe)]
        m, l = f.alloca(F32, name="m"), f.alloca(F32, name="l")
        accs = [f.alloca(F32, name=f"o{i}") for i in range(lanes)]
        b.store(f.f32(NO_SCORE), m)
        b.store(f.f32(0.0), l)
        for acc in accs:
            b.store(f.f32(0.0), acc)
        with strided(f, lo, hi, step, "p") as p:
            part = f.f32(0.0)
            for qv, i in zip(qs, safe):
                part = f.fadd(part, f.fmul(qv, keys.load(kvh, p, i)))
            score = capped(f, dev.warp_sum(f, part))
            m_old = b.load(m)
            m_new = f.intrinsic("llvm.maxnum", m_old, score)
            keep, weight = f.exp(f.fsub(m_old, m_new)), f.exp(f.fsub(score, m_new))
            b.store(f.fadd(f.fmul(b.load(l), keep), weight), l)
            for acc, i in zip(accs, safe):
                b.store(f.fadd(f.fmul(b.load(acc), keep), f.fmul(weight, values.load(kvh, p, i))), acc)
            b.store(m_new, m)
        return b.load(m), b.load(l), [b.load(acc) for acc in accs], valid, dims

    def attend_rows(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        """Prefill: each warp one query row (a block 4 consecutive rows of one head, which read the
        same cache rows, so the block's loads of them hit L1), over all its positions."""
        b = f.b
        tid, lane, warp = dev.lanes(f)
        h, t = dev.ctaid(f, "x"), f.add(f.mul(dev.ctaid(f, "y"), WARPS), warp)
        with f.when(lt(f, t, a["rows"])):
            end = f.add(load_index(f, a["positions"], t), 1)
            _, l, accs, valid, dims = online_softmax(f, a, h, t, first(f, end), end, 1, lane)
            out = fptr(f, a["out"])
            for ok, i, acc in zip(valid, dims, accs):
                with f.when(ok):
                    f.store(b.fdiv(acc, l), out, f.add(f.mul(f.add(f.mul(t, heads), h), d), i))

    def attend(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        """Decode: the block's 4 warps split its share of one row's positions, then merge in shared
        memory into a partial result; `merge` combines the `splits` blocks' partials."""
        b = f.b
        h, t, split = dev.ctaid(f, "x"), dev.ctaid(f, "y"), dev.ctaid(f, "z")
        tid, lane, warp = dev.lanes(f)
        end = f.add(load_index(f, a["positions"], t), 1)
        start = first(f, end)
        total = f.sub(end, start)
        lo = f.add(start, b.sdiv(f.mul(total, split), f.i64(splits)))
        hi = f.add(start, b.sdiv(f.mul(total, f.add(split, 1)), f.i64(splits)))
        m, l, accs, valid, dims = online_softmax(f, a, h, t, f.add(lo, warp), hi, WARPS, lane)
        slots = dev.shared(f, "warps", WARPS * stride)
        mine = f.mul(warp, stride)
        for ok, i, acc in zip(valid, dims, accs):
            with f.when(ok):
                f.store(acc, slots, f.add(mine, i))
        with f.when(b.icmp_unsigned("==", lane, f.i64(0))):
            f.store(m, slots, f.add(mine, d))
            f.store(l, slots, f.add(mine, d + 1))
        dev.barrier(f)
        with strided(f, tid, d, THREADS, "c") as c:
            top = f.f32(NO_SCORE)
            for w in range(WARPS):
                top = f.intrinsic("llvm.maxnum", top, f.load(slots, w * stride + d))
            out_v, out_l = f.f32(0.0), f.f32(0.0)
            for w in range(WARPS):
                factor = f.exp(f.fsub(f.load(slots, w * stride + d), top))
                out_v = f.fadd(out_v, f.fmul(f.load(slots, f.add(c, w * stride)), factor))
                out_l = f.fadd(out_l, f.fmul(f.load(slots, w * stride + d + 1), factor))
            partials = fptr(f, a["partials"])
            base = f.mul(f.add(f.mul(f.add(f.mul(split, op.split_rows), t), heads), h), stride)
            f.store(out_v, partials, f.add(base, c))
            with f.when(b.icmp_unsigned("==", c, f.i64(0))):
                f.store(top, partials, f.add(base, d))
                f.store(out_l, partials, f.add(base, d + 1))

    def merge(f: KernelBuilder, a: dict[str, ir.Value]) -> None:
        b = f.b
        h, t = dev.ctaid(f, "x"), dev.ctaid(f, "y")
        partials = fptr(f, a["partials"])

        def at(s: int) -> ir.Value:
            return f.mul(f.add(f.mul(f.add(f.i64(s * op.split_rows), t), heads), h), stride)

        with strided(f, dev.tid(f), d, THREADS, "c") as c:
            top = f.f32(NO_SCORE)
            for s in range(splits):
                top = f.intrinsic("llvm.maxnum", top, f.load(partials, f.add(at(s), d)))
            out_v, out_l = f.f32(0.0), f.f32(0.0)
            for s in range(splits):
                factor = f.exp(f.fsub(f.load(partials, f.add(at(s), d)), top))
                out_v = f.fadd(out_v, f.fmul(f.load(partials, f.add(at(s), c)), factor))
                out_l = f.fadd(out_l, f.fmul(f.load(partials, f.add(at(s), d + 1)), factor))
            f.store(b.fdiv(out_v, out_l), fptr(f, a["out"]), f.add(f.mul(f.add(f.mul(t, heads), h), d), c))

    launches = [e.kernel("_store", store, (1, PerRows(1), 1))]
    if splits == 1:
        return [*launches, e.kernel("_attend", attend_rows, (heads, PerRows(WARPS), 1))]
    return [*launches, e.kernel("_attend", attend, (heads, PerRows(1), splits)),
            e.kernel("_merge", merge, (heads, PerRows(1), 1))]
