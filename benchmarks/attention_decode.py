"""Decode attention alone: one CPU attention kernel, one query row at a depth, over `--layers` layers' caches in
turn (so the K and V rows come from DRAM, as in a decode step, not from a cache level), one thread.

    .venv/bin/python benchmarks/attention_decode.py --shape 9,3,64 --depth 2048 --layers 30

Prints the best and median microseconds per layer and the cache bytes read per second. Run it at two commits
(a worktree of each) to compare kernels; `--cpu x86-64-v3` builds the AVX2 code on an AVX-512 host.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from llvmlite import ir
from xdsl.dialects.builtin import IndexType, f16, i32
from xdsl.ir import Block

from llmc.abi import SYNC_WORDS
from llmc.backends.cpu import KernelLibrary, compile_to_object, link_shared
from llmc.backends.cpu.target import cpu_target, kernel_tuning, target_machine_for
from llmc.errors import UsageError
from llmc.ir import llm, tgt
from llmc.ir.layouts import qrows_nbytes
from llmc.runtime.session import aligned_zeros

ROWS = 4  # the kernel's row capacity (decode takes 1)
MAX_CACHE_BYTES = 4 << 30  # the layers' K and V caches together, f16


def shape(text: str) -> tuple[int, int, int]:
    """`--shape H,KVH,D`: three positive integers, query heads a multiple of kv heads, D a multiple of 32."""
    try:
        H, KVH, D = (int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not three integers H,KVH,D") from None
    if min(H, KVH, D) < 1 or H % KVH or D % 32:
        raise argparse.ArgumentTypeError(f"'{text}': heads ≥ 1, query heads a multiple of kv heads, "
                                         "head dim a multiple of 32")
    return H, KVH, D


def attention_op(H: int, KVH: int, D: int, capacity: int) -> tgt.AttentionOp:
    """A decode attention kernel as the CPU pipeline emits it: f16 caches, RoPE, int16 rows out."""
    types = [tgt.memref(ROWS, H, D), tgt.memref(ROWS, KVH, D), tgt.memref(ROWS, KVH, D),
             tgt.memref(KVH, capacity, D, element_type=f16), tgt.memref(KVH, capacity, D, element_type=f16),
             tgt.QRowsType(ROWS, H * D, 16), tgt.memref(ROWS, element_type=i32),
             tgt.AttentionOp.partials_type(H, D), IndexType()]
    block = Block(arg_types=types)
    op = tgt.AttentionOp(*block.args, llm.RopeAttr(10000.0), **llm.AttentionOp.scoring_properties())
    block.add_op(op)
    op.verify()
    return op


def cache_rows(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random f16 cache rows where the runtime keeps a cache: from a page (`aligned_zeros`)."""
    rows = aligned_zeros(shape, np.float16)
    rows[:] = rng.standard_normal(shape, dtype=np.float32)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", type=shape, default=(9, 3, 64),
                   help="query heads, kv heads, head dim: H,KVH,D (default SmolLM2's 9,3,64)")
    p.add_argument("--depth", type=int, default=2048, help="cache positions before the query (default 2048)")
    p.add_argument("--layers", type=int, default=30, help="layers' caches taken in turn (default 30)")
    p.add_argument("--repeat", type=int, default=20, help="passes over the layers; best and median reported")
    p.add_argument("--cpu", default="native", help="LLVM CPU to build for (default: this host)")
    args = p.parse_args()
    H, KVH, D = args.shape
    if args.depth < 0 or min(args.layers, args.repeat) < 1:
        p.error("--depth must be ≥ 0, --layers and --repeat ≥ 1")
    capacity = max(4096, args.depth + 1)
    if args.layers * 2 * KVH * capacity * D * 2 > MAX_CACHE_BYTES:
        p.error(f"{args.layers} layers' caches of {capacity} positions exceed {MAX_CACHE_BYTES >> 30} GiB: "
                "lower --depth or --layers")
    try:
        machine = target_machine_for(cpu_target(args.cpu))
    except UsageError as e:
        p.error(f"--cpu: {e}")
    op = attention_op(H, KVH, D, capacity)
    module = ir.Module("attention_decode")
    fn = KernelLibrary(module, tuning=kernel_tuning(cpu_target(args.cpu))).kernel(op)
    with tempfile.TemporaryDirectory() as tmp:
        lib = ctypes.CDLL(str(link_shared([compile_to_object(module, machine)],
                                          str(Path(tmp) / "attention.so"))))
        kernel = getattr(lib, fn.name)
        rng = np.random.default_rng(0)
        shared = {"q": rng.standard_normal((ROWS, H, D)).astype(np.float32),
                  "k": rng.standard_normal((ROWS, KVH, D)).astype(np.float32),
                  "v": rng.standard_normal((ROWS, KVH, D)).astype(np.float32),
                  "out": np.zeros(qrows_nbytes(ROWS, H * D, 16), np.uint8),
                  "positions": np.full(ROWS, args.depth, np.int32),
                  "partials": np.zeros(tgt.dims(tgt.AttentionOp.partials_type(H, D)), np.float32)}
        caches = [{name: cache_rows(rng, (KVH, capacity, D)) for name in ("k_cache", "v_cache")}
                  for _ in range(args.layers)]
        sync = np.zeros(SYNC_WORDS, np.int64)
        work = np.zeros(1, np.int64)  # the work counter: zero at each call, as the entry point's barrier leaves it
        calls = [[ctypes.c_int64(1) if name == "rows" else ctypes.c_void_p({**shared, **layer}[name].ctypes.data)
                  for name, _ in op.abi()] + [ctypes.c_int64(0), ctypes.c_int64(1), ctypes.c_void_p(work.ctypes.data),
                                              ctypes.c_void_p(sync.ctypes.data)]
                 for layer in caches]
        per_layer = []
        for _ in range(args.repeat):
            start = time.perf_counter()
            for call in calls:
                work[0] = 0
                kernel(*call)
            per_layer.append((time.perf_counter() - start) / args.layers)
    best, median = min(per_layer), statistics.median(per_layer)
    read = 2 * KVH * (args.depth + 1) * D * 2  # K and V rows, f16
    print(f"attention decode, H {H} KVH {KVH} D {D}, depth {args.depth}, {args.layers} layers' caches, cpu "
          f"{args.cpu}, 1 thread: best {best * 1e6:.1f} us per layer (median {median * 1e6:.1f}), "
          f"{read / best / 1e9:.1f} GB/s of cache rows")
    return 0


if __name__ == "__main__":
    sys.exit(main())
