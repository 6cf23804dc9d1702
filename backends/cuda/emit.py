"""What every CUDA kernel emitter shares: the block shape, a launch's geometry, the emitting
context of one op (`Emit`) and the small IR helpers the GEMM, attention and row kernels use.

An emitter takes an `Emit` and returns the op's launches, in order:

    def emitter(e: Emit) -> list[Launch]:
        def body(f: KernelBuilder, a: dict[str, ir.Value]) -> None: ...   # a: the op's operands by name
        return [e.kernel("", body, (1, PerRows(1), 1))]                   # one block per row
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from llvmlite import ir

from llmc.backends.builder import F32, FPTR, I32, I64, KernelBuilder
from llmc.backends.cuda.device import WARP
from llmc.ir import tgt

if TYPE_CHECKING:
    from llmc.backends.cuda.kernels import KernelLibrary

THREADS = 128  # threads of every block
WARPS = THREADS // WARP


@dataclass(frozen=True)
class PerRows:
    """A grid dimension of `ceil(rows / per)` blocks."""

    per: int


Dim = int | PerRows


@dataclass(frozen=True)
class Launch:
    """One kernel launch of an op: the kernel's name, its grid and its block of `block` threads."""

    kernel: str
    grid: tuple[Dim, Dim, Dim]
    block: int = THREADS


@dataclass
class Emit:
    """The op being emitted, its kernels' name prefix and the rows of its row buffers (1 in decode)."""

    lib: KernelLibrary
    op: tgt.Kernel
    name: str
    rows: int

    @property
    def dev(self):
        return self.lib.device

    def kernel(self, suffix: str, body: Callable[[KernelBuilder, dict[str, ir.Value]], None],
               grid: tuple[Dim, Dim, Dim]) -> Launch:
        name = f"{self.name}{suffix}"
        f, args = self.lib.new_kernel(name, self.op)
        body(f, args)
        f.finish()
        return Launch(f.fn.name, grid)


def fptr(f: KernelBuilder, p: ir.Value) -> ir.Value:
    """An `i8*` buffer as `float*`."""
    return f.b.bitcast(p, FPTR)


def lt(f: KernelBuilder, a, c) -> ir.Value:
    """`a < c`, signed, of two i64 values or constants."""
    return f.b.icmp_signed("<", f.i64(a), f.i64(c))


def strided(f: KernelBuilder, start: ir.Value, stop: int | ir.Value, step: int, name: str):
    """A loop `start, start + step, … < stop` (a thread's share of a block- or warp-strided range)."""
    return f.loop(start, stop, step, name=name, unroll=False)


def load_index(f: KernelBuilder, ids: ir.Value, t: ir.Value) -> ir.Value:
    """Entry `t` of an i32 buffer (tokens, positions) as an i64."""
    return f.b.sext(f.load(f.b.bitcast(ids, I32.as_pointer()), t), I64)


def inv_rms(f: KernelBuilder, dev, x: ir.Value, width: int, eps: float, start: ir.Value, step: int,
            combine: Callable[[KernelBuilder, ir.Value], ir.Value]) -> ir.Value:
    """`1 / sqrt(mean(x²) + eps)` of the row at `x`, the squares summed by threads `start, start + step, …`."""
    acc = f.alloca(F32, name="ss")
    f.b.store(f.f32(0.0), acc)
    with strided(f, start, width, step, "n") as k:
        v = f.load(x, k)
        f.b.store(f.fadd(f.b.load(acc), f.fmul(v, v)), acc)
    total = combine(f, f.b.load(acc))
    mean = f.fadd(f.fmul(total, f.f32(1.0 / width)), f.f32(eps))
    return f.b.fdiv(f.f32(1.0), f.intrinsic("llvm.sqrt", mean))
