"""CPU kernel emitters: fp32 kernels of a Llama-style decoder as `llvmlite.ir` functions.

Every kernel is one LLVM function specialised to its static shape (sizes, eps, theta,
layer are baked in as constants); only the token count `n` and the position `start`
arrive at run time. Kernels are plain loop nests whose floating-point additions and
multiplications carry fast-math flags (reassoc/contract/nsz/arcp, never nnan/ninf), so
LLVM's loop vectoriser turns the reductions into SIMD code at O3; loops where in-place
use must stay fast (elementwise ops, the scaling pass of RMSNorm) and attention's rows
of D are written with explicit `<16 x float>` vectors instead. Short static loops whose
full unrolling would only cost compile time carry `llvm.loop.unroll.disable`.

matmul/swiglu are register-tiled (4 rows × 4 columns of one weight, or × 2 columns of
gate and up) inside blocks of up to 64 rows, so prefill reuses each weight tile from L1
and decode (n = 1) streams every weight row once. `attention(…, layer)` is a thin
per-layer wrapper around one shared body per shape, so 30 layers compile it once. exp
is inline (Cephes polynomial), so silu and softmax vectorise and need no libm; RoPE
calls libm's cos/sin once per (position, frequency).

    module = ir.Module("kernels")
    lib = KernelLibrary(module)
    f = lib.matmul(576, 192, has_norm=True, eps=1e-5, accumulate=True)  # @matmul_k576_n192_norm_eps1em05_acc
    g = lib.matmul(576, 192, has_norm=True, eps=1e-5, accumulate=True)  # the same function again

Signatures (all pointers `float*` unless noted, rows are row-major, `n` ≥ 1 rows):

    embedding(D)                 void(i32* tokens, i64 n, float* table, float* out)
    rms_norm(D, eps)             void(x, i64 n, w, out)                  out may equal x
    matmul(K, N, ...)            void(x, i64 n, w, bias, norm_w, out, i64 tid, i64 nth)    w is [N, K]
    swiglu(K, N, ...)            void(x, i64 n, w_gate, w_up, norm_w, out, i64 tid, i64 nth)
    rope(H, D, theta)            void(x, i64 n, i64 start)               in place on [n, H, D]
    attention(H, KVH, D, S, ...) void(q, k, v, i64 n, i64 start, k_cache, v_cache, out, i64 tid, i64 nth)
    add(W) / mul(W)              void(a, b, out, i64 n)                  out may equal a or b
    silu(W)                      void(x, out, i64 n)                     out may equal x

Buffers of different arguments must not overlap, except where noted above (pointer
arguments of matmul, swiglu, attention, rope and embedding are `noalias`). Null is
fine for `bias` / `norm_w` when the kernel does not use them. Kernels do not check
their inputs: token ids must lie in the table, and attention skips rows whose position
would reach S (keep start + n ≤ S); the runtime validates both before calling.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
from llvmlite import ir

from llmc.backends.cpu.builder import F32, F64, FPTR, I32, I32PTR, I64, VOID, KernelBuilder, _chunks
from llmc.ir.interpreter import rope_inv_freq

# matmul register tile: R rows × C output columns per weight matrix; R·C·len(weights)
# accumulators live in (vector) registers during the K loop.
TILE_ROWS = 4
TILE_COLS = {1: 4, 2: 2}
# Rows per block: the x rows of one block stay in L2 while every weight tile passes.
BLOCK_BYTES = 192 * 1024
MAX_BLOCK_ROWS = 64


def _fmt(value: float) -> str:
    """A float as an identifier fragment: distinct floats give distinct text."""
    text = repr(float(value))
    if text.endswith(".0"):
        text = text[:-2]
    return text.replace("-", "m").replace("+", "").replace(".", "p")

class KernelLibrary:
    """Emits kernels into `module`, once per distinct set of static parameters.

    `linkage` is that of every emitted function: "" (external, callable through
    ctypes from the shared library) or "internal" (callable only from functions of the
    same module, which lets LLVM inline them and drop unused ones). `prefix` is
    prepended to every function name.
    """

    def __init__(self, module: ir.Module, *, linkage: str = "", prefix: str = ""):
        self.module = module
        self.linkage = linkage
        self.prefix = prefix
        self._cache: dict[tuple, ir.Function] = {}

    # plumbing ----------------------------------------------------------------------

    def _new(self, key: tuple, name: str, args: Sequence[tuple[str, ir.Type]], noalias: bool,
             linkage: str | None = None) -> tuple[ir.Function, KernelBuilder]:
        name = self.prefix + name
        if name in self.module.globals:
            name = self.module.get_unique_name(name)
        fnty = ir.FunctionType(VOID, [t for _, t in args])
        fn = ir.Function(self.module, fnty, name=name)
        fn.linkage = self.linkage if linkage is None else linkage
        fn.attributes.add("nounwind")
        for arg, (arg_name, ty) in zip(fn.args, args):
            arg.name = arg_name
            if noalias and isinstance(ty, ir.PointerType):
                arg.add_attribute("noalias")
        self._cache[key] = fn
        return fn, KernelBuilder(self.module, fn)

    def _cached(self, key: tuple) -> ir.Function | None:
        return self._cache.get(key)

    def functions(self) -> list[ir.Function]:
        """Every kernel emitted so far, in emission order (internal helpers left out)."""
        return [fn for key, fn in self._cache.items() if not key[0].endswith("_impl")]

    # kernels -----------------------------------------------------------------------

    def embedding(self, D: int) -> ir.Function:
        """`void(i32* tokens, i64 n, float* table, float* out)`: out[t] = table[tokens[t]]."""
        key = ("embedding", D)
        if (fn := self._cached(key)) is not None:
            return fn
        fn, f = self._new(key, f"embedding_d{D}",
                          [("tokens", I32PTR), ("n", I64), ("table", FPTR), ("out", FPTR)], True)
        tokens, n, table, out = fn.args
        with f.loop(0, n, name="t") as t:
            tok = f.b.sext(f.load(tokens, t), I64)
            src = f.ptr(table, f.mul(tok, D))
            dst = f.ptr(out, f.mul(t, D))
            with f.loop(0, D, name="d") as d:
                f.store(f.load(src, d), dst, d)
        f.finish()
        return fn

    def _inv_rms(self, f: KernelBuilder, row: ir.Value, D: int, eps: float) -> ir.Value:
        """1 / sqrt(mean(row²) + eps)."""
        def square(k: ir.Value) -> ir.Value:
            v = f.load(row, k)
            return f.fmul(v, v)

        ss = f.reduce_sum(D, square, name="ss", unroll=False)
        mean = f.fmul(ss, f.f32(1.0 / D))
        root = f.intrinsic("llvm.sqrt", f.b.fadd(mean, f.f32(eps)))
        return f.b.fdiv(f.f32(1.0), root)

    def rms_norm(self, D: int, eps: float) -> ir.Function:
        """`void(float* x, i64 n, float* w, float* out)`: out[t] = x[t] / rms(x[t]) * w."""
        key = ("rms_norm", D, float(eps))
        if (fn := self._cached(key)) is not None:
            return fn
        fn, f = self._new(key, f"rms_norm_d{D}_eps{_fmt(eps)}",
                          [("x", FPTR), ("n", I64), ("w", FPTR), ("out", FPTR)], False)
        x, n, w, out = fn.args
        w.add_attribute("noalias")
        with f.loop(0, n, name="t") as t:
            row = f.ptr(x, f.mul(t, D))
            inv = self._inv_rms(f, row, D, eps)
            dst = f.ptr(out, f.mul(t, D))
            f.vec_map(D, [row, w], dst, lambda v: f.fmul(f.fmul(v[0], f.splat(inv, v[0].type)), v[1]), name="k")
        f.finish()
        return fn

    def _gemm(self, f: KernelBuilder, x: ir.Value, rows: ir.Value, K: int, N: int, weights: Sequence[ir.Value],
              norm_w: ir.Value | None, eps: float,
              finish: Callable[[list[ir.Value], list[ir.Value], list[list[list[ir.Value]]]], None],
              tid: ir.Value, nth: ir.Value) -> None:
        """For every tile of rows ts and columns js: finish(ts, js, vals) with
        vals[w][r][c] = x̂[ts[r]] · weights[w][js[c]], x̂ being x RMS-normalised with norm_w
        when given (the scale 1/rms is applied to the finished dot product, norm_w[k]
        inside it, so no normalised row is stored). Thread `tid` of `nth` takes its share
        of the output columns, whole tiles each; the last thread takes the odd tile."""
        b = f.b
        nw = len(weights)
        R, C = TILE_ROWS, TILE_COLS[nw]
        assert R & (R - 1) == 0, "TILE_ROWS must be a power of two"
        TB = max(R, min(MAX_BLOCK_ROWS, BLOCK_BYTES // (4 * K)) // R * R)
        inv = f.alloca(F32, TB, name="inv_rms") if norm_w is not None else None

        def tile(t0: ir.Value, t: ir.Value, r: int, j0: ir.Value, c: int) -> None:
            accs = [[[f.alloca(F32, name=f"acc{wi}_{ri}_{ci}") for ci in range(c)] for ri in range(r)]
                    for wi in range(nw)]
            zero = f.f32(0.0)
            for plane in accs:
                for acc_row in plane:
                    for acc in acc_row:
                        b.store(zero, acc)
            xrows = [f.ptr(x, f.mul(f.add(t, ri), K)) for ri in range(r)]
            wrows = [[f.ptr(W, f.mul(f.add(j0, ci), K)) for ci in range(c)] for W in weights]
            with f.loop(0, K, name="k") as k:
                xs = [f.load(xr, k) for xr in xrows]
                if norm_w is not None:
                    g = f.load(norm_w, k)
                    xs = [f.fmul(xv, g) for xv in xs]
                for wi in range(nw):
                    for ci in range(c):
                        wv = f.load(wrows[wi][ci], k)
                        for ri in range(r):
                            acc = accs[wi][ri][ci]
                            b.store(f.fadd(b.load(acc), f.fmul(xs[ri], wv)), acc)
            ts = [f.add(t, ri) for ri in range(r)]
            js = [f.add(j0, ci) for ci in range(c)]
            vals = [[[b.load(accs[wi][ri][ci]) for ci in range(c)] for ri in range(r)] for wi in range(nw)]
            if inv is not None:
                for ri in range(r):
                    scale = f.load(inv, f.sub(ts[ri], t0))
                    for wi in range(nw):
                        vals[wi][ri] = [f.fmul(v, scale) for v in vals[wi][ri]]
            finish(ts, js, vals)

        def column_tiles(t0: ir.Value, t_end: ir.Value, j0: ir.Value, c: int) -> None:
            span = f.sub(t_end, t0)
            t_split = f.add(t0, b.and_(span, f.i64(-R)))  # R is a power of two
            with f.loop(t0, t_split, R, name="tr") as t:
                tile(t0, t, R, j0, c)
            with f.loop(t_split, t_end, name="t1") as t:
                tile(t0, t, 1, j0, c)

        with f.loop(0, rows, TB, name="tb") as t0:
            t_end = f.smin(f.add(t0, TB), rows)
            if inv is not None:
                with f.loop(t0, t_end, name="tn") as t:
                    f.store(self._inv_rms(f, f.ptr(x, f.mul(t, K)), K, eps), inv, f.sub(t, t0))
            n_main = N // C * C
            if n_main:
                j_lo, j_hi = f.share(N // C, tid, nth, C)
                with f.loop(j_lo, j_hi, C, name="j") as j0:
                    column_tiles(t0, t_end, j0, C)
            if N % C:
                with f.when(b.icmp_signed("==", tid, b.sub(nth, f.i64(1)))):
                    column_tiles(t0, t_end, f.i64(n_main), N % C)

    def matmul(self, K: int, N: int, has_norm: bool = False, eps: float = 1e-5, has_bias: bool = False,
               accumulate: bool = False, last_row: bool = False) -> ir.Function:
        """`void(float* x, i64 n, float* w, float* bias, float* norm_w, float* out, i64 tid, i64 nth)`.

        out[t, j] (+)= x̂[t] · w[j] (+ bias[j]) with w [N, K]; x̂ = rms_norm(x, norm_w, eps)
        when has_norm, else x. last_row: only row n-1 of x, written to out row 0. Thread
        `tid` of `nth` computes its share of the columns (tid 0 of 1: all of them).
        """
        key = ("matmul", K, N, bool(has_norm), float(eps) if has_norm else None, bool(has_bias),
               bool(accumulate), bool(last_row))
        if (fn := self._cached(key)) is not None:
            return fn
        name = f"matmul_k{K}_n{N}"
        if has_norm:
            name += f"_norm_eps{_fmt(eps)}"
        name += "_bias" * has_bias + "_acc" * accumulate + "_last" * last_row
        fn, f = self._new(key, name, [("x", FPTR), ("n", I64), ("w", FPTR), ("bias", FPTR), ("norm_w", FPTR),
                                      ("out", FPTR), ("tid", I64), ("nth", I64)], True)
        x, n, w, bias, norm_w, out, tid, nth = fn.args
        rows = n
        if last_row:
            x = f.ptr(x, f.mul(f.sub(n, 1), K))
            rows = f.i64(1)

        def finish(ts: list[ir.Value], js: list[ir.Value], vals: list[list[list[ir.Value]]]) -> None:
            biases = [f.load(bias, j) for j in js] if has_bias else None
            for ri, t in enumerate(ts):
                for ci, j in enumerate(js):
                    v = vals[0][ri][ci]
                    if biases is not None:
                        v = f.b.fadd(v, biases[ci])
                    idx = f.add(f.mul(t, N), j)
                    if accumulate:
                        v = f.b.fadd(f.load(out, idx), v)
                    f.store(v, out, idx)

        self._gemm(f, x, rows, K, N, [w], norm_w if has_norm else None, eps, finish, tid, nth)
        f.finish()
        return fn

    def swiglu(self, K: int, N: int, has_norm: bool = False, eps: float = 1e-5) -> ir.Function:
        """`void(float* x, i64 n, float* w_gate, float* w_up, float* norm_w, float* out, i64 tid, i64 nth)`:
        out[t, j] = silu(x̂[t]·w_gate[j]) * (x̂[t]·w_up[j]), both weights [N, K]; columns
        shared among `nth` threads as in `matmul`."""
        key = ("swiglu", K, N, bool(has_norm), float(eps) if has_norm else None)
        if (fn := self._cached(key)) is not None:
            return fn
        name = f"swiglu_k{K}_n{N}" + (f"_norm_eps{_fmt(eps)}" if has_norm else "")
        fn, f = self._new(key, name, [("x", FPTR), ("n", I64), ("w_gate", FPTR), ("w_up", FPTR), ("norm_w", FPTR),
                                      ("out", FPTR), ("tid", I64), ("nth", I64)], True)
        x, n, wg, wu, norm_w, out, tid, nth = fn.args

        def finish(ts: list[ir.Value], js: list[ir.Value], vals: list[list[list[ir.Value]]]) -> None:
            # the tile's gate values go through one vector silu (exp is the costly part)
            b = f.b
            cells = [(ri, ci) for ri in range(len(ts)) for ci in range(len(js))]
            g = ir.Constant(ir.VectorType(F32, len(cells)), None)
            for i, (ri, ci) in enumerate(cells):
                g = b.insert_element(g, vals[0][ri][ci], ir.Constant(I32, i))
            act = f.silu(g)
            for i, (ri, ci) in enumerate(cells):
                y = b.fmul(b.extract_element(act, ir.Constant(I32, i)), vals[1][ri][ci])
                f.store(y, out, f.add(f.mul(ts[ri], N), js[ci]))

        self._gemm(f, x, n, K, N, [wg, wu], norm_w if has_norm else None, eps, finish, tid, nth)
        f.finish()
        return fn

    def _inv_freq_table(self, D: int, theta: float) -> ir.Value:
        name = f"{self.prefix}rope_inv_freq_d{D}_theta{_fmt(theta)}"
        if name not in self.module.globals:
            values = rope_inv_freq(D, theta)
            ty = ir.ArrayType(F32, len(values))
            g = ir.GlobalVariable(self.module, ty, name=name)
            g.initializer = ir.Constant(ty, [float(v) for v in values])
            g.global_constant = True
            g.linkage = "internal"
        return self.module.globals[name]

    def _rope_tables(self, f: KernelBuilder, D: int, theta: float) -> tuple[ir.Value, ir.Value, Callable[[ir.Value], None]]:
        """Stack tables cos/sin[D/2] and a function that fills them for a position."""
        half = D // 2
        cos_t = f.alloca(F32, half, name="rope_cos")
        sin_t = f.alloca(F32, half, name="rope_sin")
        table = self._inv_freq_table(D, theta)

        def fill(pos: ir.Value) -> None:
            b = f.b
            p = b.sitofp(pos, F32)
            freqs = b.bitcast(table, FPTR)
            with f.loop(0, half, name="ri", unroll=False) as i:
                angle = b.fpext(b.fmul(p, f.load(freqs, i)), F64)  # f32 product, as numpy
                f.store(b.fptrunc(f.intrinsic("llvm.cos", angle), F32), cos_t, i)
                f.store(b.fptrunc(f.intrinsic("llvm.sin", angle), F32), sin_t, i)

        return cos_t, sin_t, fill

    @staticmethod
    def _rope_apply(f: KernelBuilder, base: ir.Value, heads: int | ir.Value, D: int, cos_t: ir.Value,
                    sin_t: ir.Value) -> None:
        """Rotate-half RoPE of `heads` rows of D floats at `base`, with filled tables."""
        b, half = f.b, D // 2
        with f.loop(0, heads, name="rh", unroll=False) as h:
            row = f.ptr(base, f.mul(h, D))
            with f.loop(0, half, name="rd", unroll=False) as i:
                i2 = f.add(i, half)
                x1, x2 = f.load(row, i), f.load(row, i2)
                c, s = f.load(cos_t, i), f.load(sin_t, i)
                f.store(b.fsub(b.fmul(x1, c), b.fmul(x2, s)), row, i)
                f.store(b.fadd(b.fmul(x2, c), b.fmul(x1, s)), row, i2)

    def rope(self, H: int, D: int, theta: float) -> ir.Function:
        """`void(float* x, i64 n, i64 start)`: rotate-half RoPE in place on x [n, H, D]
        at positions start, start+1, …"""
        if D % 2:
            raise ValueError(f"rope needs an even head dimension, got {D}")
        key = ("rope", H, D, float(theta))
        if (fn := self._cached(key)) is not None:
            return fn
        fn, f = self._new(key, f"rope_h{H}_d{D}_theta{_fmt(theta)}", [("x", FPTR), ("n", I64), ("start", I64)], True)
        x, n, start = fn.args
        cos_t, sin_t, fill = self._rope_tables(f, D, theta)
        with f.loop(0, n, name="t") as t:
            fill(f.add(start, t))
            self._rope_apply(f, f.ptr(x, f.mul(t, H * D)), H, D, cos_t, sin_t)
        f.finish()
        return fn

    def attention(self, H: int, KVH: int, D: int, S: int, layer: int, rope: bool = False,
                  theta: float = 10000.0) -> ir.Function:
        """`void(float* q, float* k, float* v, i64 n, i64 start, float* k_cache,
        float* v_cache, float* out, i64 tid, i64 nth)`.

        q [n, H, D], k and v [n, KVH, D]; caches [layers, KVH, S, D]. With `rope`, q and k
        are rotated in place first. Rows of k, v go to cache positions start..start+n-1,
        then each query row t attends causally to positions 0..start+t (GQA: query head h
        reads kv head h / (H/KVH)); out [n, H, D]. Rows whose position would be ≥ S are
        skipped (the caller must keep start + n ≤ S). Thread `tid` of `nth` handles its
        share of the kv heads, with their query heads.
        """
        if H % KVH:
            raise ValueError(f"attention needs heads divisible by kv heads, got {H} and {KVH}")
        key = ("attention", H, KVH, D, S, layer, bool(rope), float(theta) if rope else None)
        if (fn := self._cached(key)) is not None:
            return fn
        impl = self._attention_impl(H, KVH, D, S, rope, theta)
        name = f"attention_h{H}_kvh{KVH}_d{D}_s{S}_l{layer}" + (f"_rope_theta{_fmt(theta)}" if rope else "")
        fn, f = self._new(key, name, [("q", FPTR), ("k", FPTR), ("v", FPTR), ("n", I64), ("start", I64),
                                      ("k_cache", FPTR), ("v_cache", FPTR), ("out", FPTR), ("tid", I64),
                                      ("nth", I64)], True)
        q, k, v, n, start, k_cache, v_cache, out, tid, nth = fn.args
        off = layer * KVH * S * D
        f.b.call(impl, [q, k, v, n, start, f.ptr(k_cache, off), f.ptr(v_cache, off), out, tid, nth])
        f.finish()
        return fn

    def _attention_impl(self, H: int, KVH: int, D: int, S: int, rope: bool, theta: float) -> ir.Function:
        """The body of `attention`, on one layer's cache slice [KVH, S, D]: shared by the
        per-layer wrappers, so a 30-layer model compiles it once."""
        key = ("attention_impl", H, KVH, D, S, bool(rope), float(theta) if rope else None)
        if (fn := self._cached(key)) is not None:
            return fn
        name = f"attention_h{H}_kvh{KVH}_d{D}_s{S}" + (f"_rope_theta{_fmt(theta)}" if rope else "") + "_impl"
        fn, f = self._new(key, name, [("q", FPTR), ("k", FPTR), ("v", FPTR), ("n", I64), ("start", I64),
                                      ("k_cache", FPTR), ("v_cache", FPTR), ("out", FPTR), ("tid", I64),
                                      ("nth", I64)], True, linkage="internal")
        q, k, v, n, start, k_cache, v_cache, out, tid, nth = fn.args
        b = f.b
        G = H // KVH
        h_lo, h_hi = f.share(KVH, tid, nth)  # this thread's kv heads
        rows = f.smin(n, f.smax(f.sub(S, start), 0))
        # 1. RoPE and the cache write
        if rope:
            cos_t, sin_t, fill = self._rope_tables(f, D, theta)
        with f.loop(0, rows, name="t") as t:
            pos = f.add(start, t)
            if rope:
                fill(pos)
                own = f.sub(h_hi, h_lo)
                self._rope_apply(f, f.ptr(q, f.add(f.mul(t, H * D), f.mul(h_lo, G * D))), f.mul(own, G), D,
                                 cos_t, sin_t)
                self._rope_apply(f, f.ptr(k, f.add(f.mul(t, KVH * D), f.mul(h_lo, D))), own, D, cos_t, sin_t)
            with f.loop(h_lo, h_hi, name="ch", unroll=False) as h:
                src = f.mul(f.add(f.mul(t, KVH), h), D)
                dst = f.mul(f.add(f.mul(h, S), pos), D)
                with f.loop(0, D, name="cd", unroll=False) as d:
                    f.store(f.load(k, f.add(src, d)), k_cache, f.add(dst, d))
                    f.store(f.load(v, f.add(src, d)), v_cache, f.add(dst, d))

        # 2. causal GQA: the G query heads of one kv head share each K/V row. Rows of D
        # are handled as explicit vector chunks (q and the output accumulators stay in
        # registers across the position loop; LLVM only has to vectorise softmax).
        chunks = _chunks(D)
        scores = f.alloca(F32, G * S, name="scores")
        accs = [[f.alloca(ir.VectorType(F32, w), name=f"acc{g}_{o}") for o, w in chunks] for g in range(G)]
        inv_sum = f.alloca(F32, G, name="inv_sum")
        mx = f.alloca(F32, name="max")
        scale = f.f32(1.0 / np.sqrt(np.float32(D)))
        with f.loop(0, rows, name="t") as t:
            span = f.add(f.add(start, t), 1)
            with f.loop(h_lo, h_hi, name="h") as h:
                kv_base = f.mul(h, S * D)
                kbase = f.ptr(k_cache, kv_base)
                vbase = f.ptr(v_cache, kv_base)
                row_offs = [f.mul(f.add(f.mul(t, H), f.add(f.mul(h, G), g)), D) for g in range(G)]
                qv = [[f.vload(q, f.add(off, o), w) for o, w in chunks] for off in row_offs]
                # scores[g, s] = q_g · k_s / sqrt(D)
                with f.loop(0, span, name="s") as s:
                    krow = f.mul(s, D)
                    kv = [f.vload(kbase, f.add(krow, o), w) for o, w in chunks]
                    for g in range(G):
                        dot = f.vdot(qv[g], kv)
                        f.store(b.fmul(dot, scale), scores, f.add(s, g * S))
                # softmax per query head (max-subtracted), then the weighted sum of V rows
                # (one copy of the softmax code, looping over the G heads at run time)
                with f.loop(0, G, name="sg", unroll=False) as g:
                    srow = f.ptr(scores, f.mul(g, S))
                    b.store(f.f32(float("-inf")), mx)
                    with f.loop(0, span, name="m") as s:
                        b.store(f.intrinsic("llvm.maxnum", b.load(mx), f.load(srow, s)), mx)
                    m = b.load(mx)
                    total = f.reduce_sum(span, lambda s: self._exp_store(f, srow, s, m), name="e")
                    f.store(b.fdiv(f.f32(1.0), total), inv_sum, g)
                inv_sums = [f.load(inv_sum, g) for g in range(G)]
                for g in range(G):
                    for a, (_, w) in zip(accs[g], chunks):
                        b.store(f.const(ir.VectorType(F32, w), 0.0), a)
                with f.loop(0, span, name="pv") as s:
                    vrow = f.mul(s, D)
                    vv = [f.vload(vbase, f.add(vrow, o), w) for o, w in chunks]
                    for g in range(G):
                        p = f.load(scores, f.add(s, g * S))
                        for a, x in zip(accs[g], vv):
                            b.store(f.fadd(b.load(a), f.fmul(f.splat(p, x.type), x)), a)
                for g in range(G):
                    for a, (o, w) in zip(accs[g], chunks):
                        y = f.fmul(b.load(a), f.splat(inv_sums[g], a.type.pointee))
                        f.vstore(y, out, f.add(row_offs[g], o))
        f.finish()
        return fn

    @staticmethod
    def _exp_store(f: KernelBuilder, row: ir.Value, s: ir.Value, m: ir.Value) -> ir.Value:
        e = f.exp(f.b.fsub(f.load(row, s), m))
        f.store(e, row, s)
        return e

    def _elementwise(self, kind: str, W: int, arity: int,
                     op: Callable[[KernelBuilder, list[ir.Value]], ir.Value]) -> ir.Function:
        key = (kind, W)
        if (fn := self._cached(key)) is not None:
            return fn
        names = ["a", "b"][:arity] if arity == 2 else ["x"]
        fn, f = self._new(key, f"{kind}_{W}", [*[(a, FPTR) for a in names], ("out", FPTR), ("n", I64)], False)
        *ins, out, n = fn.args
        f.vec_map(f.mul(n, W), ins, out, lambda vals: op(f, vals), name="e")
        f.finish()
        return fn

    def add(self, W: int) -> ir.Function:
        """`void(float* a, float* b, float* out, i64 n)`: out = a + b over n rows of W."""
        return self._elementwise("add", W, 2, lambda f, v: f.b.fadd(v[0], v[1]))

    def mul(self, W: int) -> ir.Function:
        """`void(float* a, float* b, float* out, i64 n)`: out = a * b over n rows of W."""
        return self._elementwise("mul", W, 2, lambda f, v: f.b.fmul(v[0], v[1]))

    def silu(self, W: int) -> ir.Function:
        """`void(float* x, float* out, i64 n)`: out = x / (1 + e**-x) over n rows of W."""
        return self._elementwise("silu", W, 1, lambda f, v: f.silu(v[0]))
