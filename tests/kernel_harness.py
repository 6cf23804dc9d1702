"""The harness of the CPU kernel tests: one `tgt` kernel op compiled alone at O3 for a `Machine`, linked, and
called through ctypes with its operands by name (the ABI its definition declares), on one thread or several.

    k = Kernel(tmp_path, tm, lambda x, w, o, n: tgt.MatmulOp(x, w, o, n), [types...])
    k({"x": x, "weight": w, "out": out, "rows": 4}, nth=2)
"""

from __future__ import annotations

import ctypes
import dataclasses
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from llvmlite import ir
from xdsl.dialects.builtin import FloatAttr, IndexType, i32
from xdsl.dialects.builtin import f32 as f32_type
from xdsl.ir import Attribute, Block

from llmc.abi import SYNC_WORDS, WORK_COUNTER_WORDS
from llmc.backends.cpu import KernelLibrary, compile_to_assembly, compile_to_object, link_shared
from llmc.backends.cpu.target import cpu_target, integer_isa, kernel_tuning, target_machine_for
from llmc.ir import llm, tgt
from llmc.ir.formats import join_planes
from llmc.ir.layouts import QRowLayout, qrows_nbytes
from llmc.ir.tgt_interpreter import QRows
from llmc.runtime import amx as amx_permission

f32 = np.float32
IDX = IndexType()


@dataclass(frozen=True)
class Machine:
    cpu: str
    tm: object

    @property
    def isas(self) -> list[tgt.Isa]:
        """The integer dot products this CPU runs: its best one, AVX2's and the generic one."""
        own = integer_isa(cpu_target(self.cpu))
        return sorted({own, tgt.Isa.AVX2, tgt.Isa.GENERIC}, key=list(tgt.Isa).index)


def kernel_op(make: Callable[..., tgt.Kernel], types: list[Attribute]) -> tgt.Kernel:
    """The op `make` builds over block arguments of `types`, verified."""
    block = Block(arg_types=types)
    op = make(*block.args)
    block.add_op(op)
    op.verify()
    return op


class Kernel:
    """One kernel op compiled alone; `kernel(values, nth)` calls it with operands by name."""

    def __init__(self, tmp_path: Path, tm: Machine, make: Callable[..., tgt.Kernel], types: list[Attribute],
                 **tuning: int):
        self.op = kernel_op(make, types)
        module = ir.Module(name="kernels")
        # the CPU's tuning, or with other values (`prefetch_bytes=…`: another prefetch distance)
        self.fn = KernelLibrary(module, tuning=dataclasses.replace(kernel_tuning(cpu_target(tm.cpu)), **tuning)
                                ).kernel(self.op)
        self.ir = str(module)
        path = link_shared([compile_to_object(module, tm.tm)], tmp_path / f"k_{uuid.uuid4().hex}.so")
        self.library = ctypes.CDLL(str(path))
        self.amx, _ = amx_permission.enable(self.library)  # kernels with `isa amx` may use the tiles
        self.c = getattr(self.library, self.fn.name)
        self.c.restype = None

    def __call__(self, values: dict[str, object], nth: int = 1, tid: int | None = None) -> None:
        """Run the kernel on `nth` threads at once (each with its tid, as an entry point
        does), or only thread `tid`'s share (kernels that do not synchronise; threads 0, 1, …
        in turn make one call: thread 0 takes every reserve's chunks, the others none)."""
        args = []
        for name, _ in self.op.abi():
            v = values[name]
            if isinstance(v, (int, np.integer)):
                args.append(ctypes.c_int64(int(v)))
            else:
                assert isinstance(v, np.ndarray) and v.flags.c_contiguous, name
                args.append(ctypes.c_void_p(v.ctypes.data))
        if not tid:  # a call's threads (run at once, or one by one from tid 0) share a work counter and a barrier
            self.work = np.zeros(WORK_COUNTER_WORDS, np.int64)
            self.sync = np.zeros(SYNC_WORDS, np.int64)
        extra = [ctypes.c_void_p(self.work.ctypes.data)] if self.op.DEALS else []
        extra += [ctypes.c_void_p(self.sync.ctypes.data)] if self.op.SYNCS else []
        if tid is not None:
            assert not self.op.SYNCS, "a kernel that synchronises runs on all its threads"
            self.c(*args, ctypes.c_int64(tid), ctypes.c_int64(nth), *extra)
            return
        threads = [threading.Thread(target=self.c, args=(*args, ctypes.c_int64(tid), ctypes.c_int64(nth), *extra))
                   for tid in range(1, nth)]
        for t in threads:
            t.start()
        self.c(*args, ctypes.c_int64(0), ctypes.c_int64(nth), *extra)
        for t in threads:
            t.join()


def attention_op(R: int, H: int, KVH: int, D: int, S: int, rope: llm.RopeAttr | None = None,
                 out: Attribute | None = None, cache: Attribute = f32_type, **scoring
                 ) -> tuple[Callable[..., tgt.AttentionOp], list[Attribute]]:
    """A `tgt.attention` of R rows of H query heads of width D over KVH kv heads, caches of S positions of `cache`
    elements, output `out` (default float rows `[R, H, D]`): `make` and its operand types, for `Kernel` or
    `assembly`."""
    def make(q, k, v, kc, vc, o, p, s, n):
        return tgt.AttentionOp(q, k, v, kc, vc, o, p, s, n, rope, **llm.AttentionOp.scoring_properties(**scoring))

    return make, [tgt.memref(R, H, D), tgt.memref(R, KVH, D), tgt.memref(R, KVH, D),
                  tgt.memref(KVH, S, D, element_type=cache), tgt.memref(KVH, S, D, element_type=cache),
                  out or tgt.memref(R, H, D), tgt.memref(R, element_type=i32), tgt.AttentionOp.partials_type(H, D),
                  IDX]


def assembly(cpu: str, *kernels: tuple[Callable[..., tgt.Kernel], list[Attribute]]) -> str:
    """The assembly of kernels (each `make` and its operand types) compiled together for `cpu`, with its tuning:
    what the code for a CPU the host may not run looks like."""
    module = ir.Module(name="kernels")
    library = KernelLibrary(module, tuning=kernel_tuning(cpu_target(cpu)))
    for make, types in kernels:
        library.kernel(kernel_op(make, types))
    return compile_to_assembly(module, target_machine_for(cpu_target(cpu)))


def lm_head_op(rows: int, width: int, screen: float | None = None) -> Callable[..., tgt.MatmulOp]:
    """Decode's LM head as `fuse-norm` leaves it (a norm, int16 rows of its own, `isa vnni512`), `screen`ed or not:
    `make(x, weight, out, n, norm)` for `Kernel`."""
    def make(x, w, out, n, g):
        op = tgt.MatmulOp(x, w, out, n, norm=g, eps=1e-6)
        op.quantize = tgt.QRowsType(rows, width, 16)
        op.isa = tgt.IsaAttr(tgt.Isa.VNNI512)
        if screen is not None:
            op.screen = FloatAttr(screen, f32_type)
        return op

    return make


def assert_close(got: np.ndarray, ref: np.ndarray, rtol: float = 1e-4) -> None:
    ref = np.asarray(ref, np.float64)
    err = float(np.max(np.abs(got.astype(np.float64) - ref))) if ref.size else 0.0
    bound = rtol * float(np.max(np.abs(ref))) + 1e-6
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"


def rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(f32)


def qrows_of(x: np.ndarray, capacity: int, bits: int = 8) -> tuple[np.ndarray, QRows]:
    """`x` quantized to `bits`-wide rows in an arena buffer of `capacity` rows, and a view of it for the
    references."""
    buf = np.zeros(qrows_nbytes(capacity, x.shape[1], bits), np.uint8)
    rows = QRows(*QRowLayout(x.shape[1], bits).views(buf, capacity))
    rows.write(x)
    return buf, rows


def read_qrows(buf: np.ndarray, capacity: int, width: int, rows: int, bits: int = 8) -> tuple[np.ndarray, ...]:
    """The values (int16 rows: joined from their planes), scales, sums and integer sums of the first `rows` rows."""
    qs, d, s, n = (v[:rows] for v in QRowLayout(width, bits).views(buf, capacity))
    return (join_planes(qs) if bits == 16 else qs), d, s, n
