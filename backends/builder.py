"""Building blocks for emitting kernels with llvmlite (CPU and CUDA): types, fast-math flags, and
`KernelBuilder`, a function under construction with loop and vector helpers.

    fn = ir.Function(module, ir.FunctionType(VOID, [FPTR, I64]), name="scale")
    f = KernelBuilder(module, fn)
    with f.loop(0, fn.args[1], name="i") as i:
        f.store(f.fmul(f.load(fn.args[0], i), f.f32(2.0)), fn.args[0], i)
    f.finish()
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np
from llvmlite import ir

F32 = ir.FloatType()
F64 = ir.DoubleType()
I32 = ir.IntType(32)
I64 = ir.IntType(64)
VOID = ir.VoidType()
FPTR = F32.as_pointer()
I32PTR = I32.as_pointer()

# Flags on reductions and products: reassociation (vectorised sums), contraction (FMA).
# nnan/ninf are left out on purpose: softmax starts from -inf and IEEE infinities pass.
FAST = ("reassoc", "contract", "nsz", "arcp")
CONTRACT = ("contract",)
VW = 16  # width of the explicit vectors; LLVM splits them on narrower targets

def _chunks(length: int) -> list[tuple[int, int]]:
    """(offset, width) of the vector chunks covering a static row: VW wide, then the rest."""
    out = [(o, VW) for o in range(0, length - length % VW, VW)]
    if length % VW:
        out.append((length - length % VW, length % VW))
    return out


def f32_table(module: ir.Module, name: str, values: Sequence[float]) -> ir.GlobalVariable:
    """A constant `[N x float]` global of the module (emitted once per name)."""
    if name not in module.globals:
        ty = ir.ArrayType(F32, len(values))
        g = ir.GlobalVariable(module, ty, name=name)
        g.initializer = ir.Constant(ty, [float(v) for v in values])
        g.global_constant = True
        g.linkage = "internal"
    return module.globals[name]


class _LoopID(ir.values.MDValue):
    """A distinct, self-referencing loop ID node: `!n = distinct !{!n, !props...}`."""

    def __init__(self, module: ir.Module, props: Sequence[ir.values.MDValue]):
        super().__init__(module, [], name=str(len(module.metadata)))
        self.operands = (self, *props)

    def descr(self, buf):
        buf += ("distinct !{{ {0} }}".format(", ".join(op.get_reference() for op in self.operands)), "\n")

    __hash__ = object.__hash__

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other


class KernelBuilder:
    """A function being emitted: an entry block for allocas, a builder, loop helpers. `array_align`: the
    alignment of its stack arrays (`alloca` with a count; None: LLVM's choice)."""

    def __init__(self, module: ir.Module, fn: ir.Function, array_align: int | None = None):
        self.module = module
        self.fn = fn
        self.array_align = array_align
        entry = fn.append_basic_block("entry")
        self._entry = ir.IRBuilder(entry)
        self._first = fn.append_basic_block("start")
        self.b = ir.IRBuilder(self._first)

    def finish(self) -> None:
        self.b.ret_void()
        self._entry.branch(self._first)

    # constants and memory -------------------------------------------------------

    @staticmethod
    def i64(value: int | ir.Value) -> ir.Value:
        return ir.Constant(I64, value) if isinstance(value, int) else value

    @staticmethod
    def f32(value: float) -> ir.Constant:
        return ir.Constant(F32, float(np.float32(value)))

    def const(self, ty: ir.Type, value: float) -> ir.Constant:
        if isinstance(ty, ir.VectorType):
            return ir.Constant(ty, [float(np.float32(value))] * ty.count)
        return self.f32(value)

    def splat(self, value: ir.Value, ty: ir.Type) -> ir.Value:
        """`value` (a scalar) broadcast to `ty` (a scalar or a vector of its type)."""
        if not isinstance(ty, ir.VectorType):
            return value
        b = self.b
        one = b.insert_element(ir.Constant(ir.VectorType(value.type, 1), None), value, ir.Constant(I32, 0))
        return b.shuffle_vector(one, ir.Constant(ir.VectorType(value.type, 1), None),
                                ir.Constant(ir.VectorType(I32, ty.count), [0] * ty.count))

    def alloca(self, ty: ir.Type, count: int | None = None, name: str = "") -> ir.Value:
        """A stack slot in the entry block (static size: no stack growth in loops); with `count`, an array of
        `count` elements aligned to `array_align`."""
        if count is None:
            return self._entry.alloca(ty, name=name)
        arr = self._entry.alloca(ir.ArrayType(ty, count), name=name)
        if self.array_align is not None:
            arr.align = self.array_align
        return self._entry.bitcast(arr, ty.as_pointer())

    def ptr(self, base: ir.Value, index: int | ir.Value) -> ir.Value:
        return self.b.gep(base, [self.i64(index)], inbounds=True)

    def load(self, base: ir.Value, index: int | ir.Value = 0) -> ir.Value:
        return self.b.load(self.ptr(base, index), align=4)

    def store(self, value: ir.Value, base: ir.Value, index: int | ir.Value = 0) -> None:
        self.b.store(value, self.ptr(base, index), align=4)

    def vload(self, base: ir.Value, index: ir.Value, width: int = VW) -> ir.Value:
        p = self.b.bitcast(self.ptr(base, index), ir.VectorType(F32, width).as_pointer())
        return self.b.load(p, align=4)

    def vstore(self, value: ir.Value, base: ir.Value, index: ir.Value) -> None:
        p = self.b.bitcast(self.ptr(base, index), value.type.as_pointer())
        self.b.store(value, p, align=4)

    # integer arithmetic on i64 -------------------------------------------------------

    def add(self, a, c) -> ir.Value:
        return self.b.add(self.i64(a), self.i64(c), flags=("nsw",))

    def sub(self, a, c) -> ir.Value:
        return self.b.sub(self.i64(a), self.i64(c), flags=("nsw",))

    def mul(self, a, c) -> ir.Value:
        return self.b.mul(self.i64(a), self.i64(c), flags=("nsw",))

    def smin(self, a, c) -> ir.Value:
        a, c = self.i64(a), self.i64(c)
        return self.b.select(self.b.icmp_signed("<", a, c), a, c)

    def smax(self, a, c) -> ir.Value:
        a, c = self.i64(a), self.i64(c)
        return self.b.select(self.b.icmp_signed(">", a, c), a, c)

    def copy_bytes(self, dst: ir.Value, src: ir.Value | None, nbytes: ir.Value) -> None:
        """`nbytes` bytes from `src` to `dst` (both `i8*`, not overlapping), or zeros where `src` is None."""
        i8p = ir.IntType(8).as_pointer()
        if src is None:
            fn = self.module.declare_intrinsic("llvm.memset", [i8p, I64])
            self.b.call(fn, [dst, ir.Constant(ir.IntType(8), 0), self.i64(nbytes), ir.Constant(ir.IntType(1), 0)])
        else:
            fn = self.module.declare_intrinsic("llvm.memcpy", [i8p, i8p, I64])
            self.b.call(fn, [dst, src, self.i64(nbytes), ir.Constant(ir.IntType(1), 0)])

    # float arithmetic (fast-math flags by default) -----------------------------------

    def fadd(self, a, c, flags=FAST):
        return self.b.fadd(a, c, flags=flags)

    def fsub(self, a, c, flags=FAST):
        return self.b.fsub(a, c, flags=flags)

    def fmul(self, a, c, flags=FAST):
        return self.b.fmul(a, c, flags=flags)

    def intrinsic(self, name: str, *args: ir.Value, flags=()) -> ir.Value:
        ty = args[0].type
        if isinstance(ty, ir.VectorType):
            suffix = f"v{ty.count}{ty.element.intrinsic_name}"
        else:
            suffix = ty.intrinsic_name
        full = f"{name}.{suffix}"
        fn = self.module.globals.get(full)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(ty, [ty] * len(args)), name=full)
        return self.b.call(fn, list(args), fastmath=flags)

    def exp(self, x: ir.Value) -> ir.Value:
        """e**x for a float or float vector, inline and vectorisable (Cephes expf, ~1 ulp).

        The argument is clamped to [-87, 88] so the result stays a finite normal number.
        """
        b, ty = self.b, x.type
        c = lambda v: self.const(ty, v)  # noqa: E731
        x = self.intrinsic("llvm.minnum", x, c(88.0))
        x = self.intrinsic("llvm.maxnum", x, c(-87.0))
        fx = self.intrinsic("llvm.floor", b.fadd(b.fmul(x, c(1.44269504088896341)), c(0.5)))
        # x - fx*ln2 in two steps (Cody–Waite); no reassoc here, or the split is undone
        r = b.fsub(x, b.fmul(fx, c(0.693359375)))
        r = b.fsub(r, b.fmul(fx, c(-2.12194440e-4)))
        y = c(1.9875691500e-4)
        for coeff in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
            y = b.fadd(b.fmul(y, r, flags=CONTRACT), c(coeff), flags=CONTRACT)
        y = b.fadd(b.fmul(y, b.fmul(r, r), flags=CONTRACT), r, flags=CONTRACT)
        y = b.fadd(y, c(1.0))
        ity = ir.VectorType(I32, ty.count) if isinstance(ty, ir.VectorType) else I32
        k = b.fptosi(fx, ity)
        bias = ir.Constant(ity, [127] * ty.count) if isinstance(ty, ir.VectorType) else ir.Constant(I32, 127)
        shift = ir.Constant(ity, [23] * ty.count) if isinstance(ty, ir.VectorType) else ir.Constant(I32, 23)
        pow2 = b.bitcast(b.shl(b.add(k, bias), shift), ty)
        return b.fmul(y, pow2)

    def sincos(self, x: ir.Value) -> tuple[ir.Value, ir.Value]:
        """(sin x, cos x) of a double or double vector, inline (no libm), to ~1e-16 for |x| < 2**20.

        x − n·π/2 in three Cody–Waite steps (fdlibm's 33-bit pieces of π/2, so each
        n·piece is exact), Taylor polynomials on [−π/4, π/4], the quadrant n mod 4
        selecting and negating.
        """
        b, ty = self.b, x.type
        vector = isinstance(ty, ir.VectorType)
        c = lambda v: ir.Constant(ty, [float(v)] * ty.count) if vector else ir.Constant(F64, float(v))  # noqa: E731
        n = self.intrinsic("llvm.roundeven", b.fmul(x, c(2 / np.pi)))
        r = x
        for piece in (1.57079632673412561417e+00, 6.07710050630396597660e-11, 2.02226624871116645580e-21):
            r = b.fsub(r, b.fmul(n, c(piece)))
        r2 = b.fmul(r, r)
        s = c(1 / 355687428096000.0)  # 1/17!
        for k in (15, 13, 11, 9, 7, 5, 3):
            s = b.fadd(b.fmul(s, r2), c((-1) ** ((k - 1) // 2) / float(np.prod(np.arange(1, k + 1)))))
        s = b.fadd(b.fmul(b.fmul(s, r2), r), r)  # r − r³/3! + r⁵/5! − …
        co = c(1 / 20922789888000.0)  # 1/16!
        for k in (14, 12, 10, 8, 6, 4, 2):
            co = b.fadd(b.fmul(co, r2), c((-1) ** (k // 2) / float(np.prod(np.arange(1, k + 1)))))
        co = b.fadd(b.fmul(co, r2), c(1.0))
        ity = ir.VectorType(I64, ty.count) if vector else I64
        q = b.and_(b.fptosi(n, ity), ir.Constant(ity, [3] * ty.count) if vector else ir.Constant(I64, 3))
        odd = b.trunc(q, ir.VectorType(ir.IntType(1), ty.count) if vector else ir.IntType(1))
        upper = b.icmp_signed(">=", q, ir.Constant(ity, [2] * ty.count) if vector else ir.Constant(I64, 2))
        sin_r = b.select(odd, co, s)
        cos_r = b.select(odd, b.fneg(s), co)
        return b.select(upper, b.fneg(sin_r), sin_r), b.select(upper, b.fneg(cos_r), cos_r)

    def reduce_vector(self, v: ir.Value) -> ir.Value:
        """The sum of a float vector's lanes (a tree: reassoc)."""
        ty = v.type
        name = f"llvm.vector.reduce.fadd.v{ty.count}f32"
        fn = self.module.globals.get(name)
        if fn is None:
            fn = ir.Function(self.module, ir.FunctionType(F32, [F32, ty]), name=name)
        return self.b.call(fn, [self.f32(-0.0), v], fastmath=FAST)

    def forget_memory(self) -> None:
        """An optimization barrier: nothing read from memory before it is reused after it (an empty inline
        assembly that clobbers memory), so LLVM loads it again rather than keeping it in a register."""
        self.b.call(ir.InlineAsm(ir.FunctionType(ir.VoidType(), []), "", "~{memory}", side_effect=True), [])

    def fmax(self, a: ir.Value, c: ir.Value) -> ir.Value:
        """The larger of two floats, or of two float vectors lane by lane, of no NaN (`nnan`: one `vmaxss` or
        `vmaxps`, where NaN-aware `maxnum` adds a compare and a blend)."""
        return self.intrinsic("llvm.maxnum", a, c, flags=("nnan",))

    def reduce_max(self, v: ir.Value) -> ir.Value:
        """The largest lane of a float vector of no NaN (`nnan`: a tree of 4 `vmaxps` for 16 lanes, where
        NaN-aware `maxnum` takes a chain of 15 compares, maxima and blends in a row)."""
        name = f"llvm.vector.reduce.fmax.v{v.type.count}f32"
        fn = self.module.globals.get(name) or ir.Function(self.module, ir.FunctionType(F32, [v.type]), name=name)
        return self.b.call(fn, [v], fastmath=("nnan",))

    def hsum(self, vectors: Sequence[ir.Value]) -> ir.Value:
        """n `<n x float>` (n 8 or 16) → one whose lane j is the sum of vector j's lanes: a transposing tree
        of shuffles and adds (for 16: 45 instructions where 16 reductions take about twice as many)."""
        n = len(vectors)
        assert n in (8, 16) and all(v.type.count == n for v in vectors)
        level, half = list(vectors), n // 2
        while len(level) > 1:
            lo = [i for i in range(n) if i % (2 * half) < half]
            hi = [i for i in range(n) if i % (2 * half) >= half]
            masks = (ir.Constant(ir.VectorType(I32, n), lo + [n + i for i in lo]),
                     ir.Constant(ir.VectorType(I32, n), hi + [n + i for i in hi]))
            level = [self.fadd(self.b.shuffle_vector(a, c, masks[0]), self.b.shuffle_vector(a, c, masks[1]))
                     for a, c in zip(level[::2], level[1::2])]
            half //= 2
        return level[0]

    def splat_i64(self, value: int | ir.Value, count: int) -> ir.Value:
        """An i64 broadcast to `<count x i64>`."""
        if isinstance(value, int):
            return ir.Constant(ir.VectorType(I64, count), [value] * count)
        one = self.b.insert_element(ir.Constant(ir.VectorType(I64, 1), None), value, ir.Constant(I32, 0))
        return self.b.shuffle_vector(one, ir.Constant(ir.VectorType(I64, 1), None),
                                     ir.Constant(ir.VectorType(I32, count), [0] * count))

    def vdot(self, a: Sequence[ir.Value], c: Sequence[ir.Value]) -> ir.Value:
        """Σ a·c over matching vector chunks (full chunks summed as vectors first)."""
        groups: dict[int, list[ir.Value]] = {}
        for x, y in zip(a, c):
            groups.setdefault(x.type.count, []).append(self.fmul(x, y))
        total = None
        for terms in groups.values():
            while len(terms) > 1:  # pairwise: short dependency chains
                terms = [self.fadd(terms[i], terms[i + 1]) if i + 1 < len(terms) else terms[i]
                         for i in range(0, len(terms), 2)]
            r = self.reduce_vector(terms[0])
            total = r if total is None else self.fadd(total, r)
        return total

    def silu(self, x: ir.Value) -> ir.Value:
        """x / (1 + e**-x)."""
        one = self.const(x.type, 1.0)
        e = self.exp(self.b.fneg(x))
        return self.b.fdiv(x, self.b.fadd(one, e), flags=("arcp",))

    def tanh(self, x: ir.Value) -> ir.Value:
        """tanh x as 1 - 2 / (e**2x + 1) (`exp` clamps, so ±1 far out, never NaN)."""
        one = self.const(x.type, 1.0)
        e = self.exp(self.fmul(x, self.const(x.type, 2.0)))
        return self.b.fsub(one, self.b.fdiv(self.const(x.type, 2.0), self.b.fadd(e, one)))

    def softcap(self, x: ir.Value, cap: float) -> ir.Value:
        """cap · tanh(x / cap): Gemma's soft-capping of attention scores and logits."""
        return self.fmul(self.const(x.type, cap), self.tanh(self.fmul(x, self.const(x.type, 1.0 / cap))))

    def gelu_tanh(self, x: ir.Value) -> ir.Value:
        """GELU, tanh approximation: x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))."""
        c = lambda v: self.const(x.type, v)  # noqa: E731
        inner = self.fmul(c(0.7978845608028654), self.fadd(x, self.fmul(c(0.044715), self.fmul(x, self.fmul(x, x)))))
        return self.fmul(self.fmul(c(0.5), x), self.fadd(c(1.0), self.tanh(inner)))

    def erf(self, x: ir.Value) -> ir.Value:
        """erf x by Abramowitz–Stegun 7.1.26: 1 - t·(a1 + t·(a2 + … + t·a5))·e**-x² with t = 1/(1 + p|x|),
        the sign of x (max abs error 1.5e-7; 3e-7 in f32 with `exp`)."""
        c = lambda v: self.const(x.type, v)  # noqa: E731
        ax = self.intrinsic("llvm.fabs", x)
        t = self.b.fdiv(c(1.0), self.fadd(c(1.0), self.fmul(c(0.3275911), ax)))
        poly = c(1.061405429)
        for a in (-1.453152027, 1.421413741, -0.284496736, 0.254829592):
            poly = self.fadd(c(a), self.fmul(t, poly))
        y = self.b.fsub(c(1.0), self.fmul(self.fmul(t, poly), self.exp(self.b.fneg(self.fmul(ax, ax)))))
        return self.intrinsic("llvm.copysign", y, x)

    def gelu(self, x: ir.Value) -> ir.Value:
        """GELU: x/2 · (1 + erf(x/√2))."""
        c = lambda v: self.const(x.type, v)  # noqa: E731
        return self.fmul(self.fmul(c(0.5), x), self.fadd(c(1.0), self.erf(self.fmul(x, c(0.7071067811865476)))))

    # control flow ---------------------------------------------------------------------

    def _no_unroll(self) -> _LoopID:
        prop = self.module.add_metadata([ir.MetaDataString(self.module, "llvm.loop.unroll.disable")])
        return _LoopID(self.module, [prop])

    def share(self, units: int, tid: ir.Value, nth: ir.Value, unit: int = 1) -> tuple[ir.Value, ir.Value]:
        """Thread `tid` of `nth`'s part of `units` equal pieces: `[lo, hi)` in multiples of `unit`."""
        b = self.b
        lo = b.sdiv(b.mul(self.i64(units), tid), nth)
        hi = b.sdiv(b.mul(self.i64(units), b.add(tid, self.i64(1))), nth)
        return b.mul(lo, self.i64(unit)), b.mul(hi, self.i64(unit))

    @contextmanager
    def when(self, condition: ir.Value) -> Iterator[None]:
        """Emit the body only where `condition` (an i1) holds."""
        with self.b.if_then(condition):
            yield

    @contextmanager
    def loop(self, start: int | ir.Value, stop: int | ir.Value, step: int = 1, name: str = "i",
             unroll: bool = True) -> Iterator[ir.Value]:
        """`for (i = start; i < stop; i += step)` over i64; yields `i`. `unroll=False`
        keeps LLVM from unrolling it (vectorising and interleaving still happen): for
        short static loops whose full unrolling would only cost compile time."""
        b = self.b
        start, stop = self.i64(start), self.i64(stop)
        head = b.append_basic_block(f"{name}.head")
        body = b.append_basic_block(f"{name}.body")
        done = b.append_basic_block(f"{name}.done")
        pre = b.block
        b.branch(head)
        b.position_at_end(head)
        i = b.phi(I64, name=name)
        i.add_incoming(start, pre)
        b.cbranch(b.icmp_signed("<", i, stop), body, done)
        b.position_at_end(body)
        yield i
        nxt = b.add(i, self.i64(step), name=f"{name}.next", flags=("nsw",))
        i.add_incoming(nxt, b.block)
        latch = b.branch(head)
        if not unroll:
            latch.set_metadata("llvm.loop", self._no_unroll())
        b.position_at_end(done)

    def reduce_sum(self, count: int | ir.Value, term: Callable[[ir.Value], ir.Value], name: str = "s",
                   unroll: bool = True) -> ir.Value:
        """Σ term(i) for i < count, as a fast-math reduction the vectoriser widens."""
        acc = self.alloca(F32, name=f"{name}.acc")
        self.b.store(self.f32(0.0), acc)
        with self.loop(0, count, name=name, unroll=unroll) as i:
            self.b.store(self.fadd(self.b.load(acc), term(i)), acc)
        return self.b.load(acc)

    def vec_map(self, count: int | ir.Value, inputs: Sequence[ir.Value], out: ir.Value,
                op: Callable[[list[ir.Value]], ir.Value], name: str = "e") -> None:
        """out[i] = op(in0[i], in1[i], …) for i < count, in explicit vectors of VW then a
        scalar tail; `out` may be one of the inputs (each chunk is loaded before it is
        stored). `op` receives floats or float vectors."""
        b = self.b
        count = self.i64(count)
        vec_end = b.and_(count, self.i64(-VW))
        with self.loop(0, vec_end, VW, name=f"{name}.v", unroll=False) as i:
            self.vstore(op([self.vload(p, i) for p in inputs]), out, i)
        if isinstance(count, ir.Constant) and count.constant % VW == 0:
            return
        with self.loop(vec_end, count, name=f"{name}.t", unroll=False) as i:
            self.store(op([self.load(p, i) for p in inputs]), out, i)
