"""A tiles matmul kernel alone, at each row count and thread count asked: nanoseconds per strip-block (16
output columns × one 32-value block of K), what a batch of rows costs where the weights are read once for all.

    .venv/bin/python benchmarks/matmul_rows.py [--n 16384] [--k 2048] [--rows 1 4 8] [--threads 1 2] [--turns 7]

The kernel is compiled for this host (`isa` its integer dot product: VNNI-512, VNNI-256 or AVX2), int8 rows
(`a8`), random q4_1 weights in the tiles layout (`--n` × `--k`, the weights' bytes printed: above the L3
they stream from DRAM, as a model's do); prints the best turn's time a call, per strip-block and the weights'
bytes a second. 8 rows take 8 × 8 `vpdpbusd` a strip-block (one row 8): where 8 rows cost eight times one
row's products in about the same time, the products' pipe, not the weights' reading, is the limit.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from xdsl.dialects.builtin import IndexType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # (the kernel tests' harness)
from kernel_harness import Kernel, Machine, qrows_of  # noqa: E402

from llmc.backends.cpu.target import cpu_target, integer_isa, tiles_layout  # noqa: E402
from llmc.backends.cpu.toolchain import target_machine  # noqa: E402
from llmc.ir import tgt  # noqa: E402
from llmc.ir.formats import FORMATS, Storage  # noqa: E402
from llmc.ir.layouts import STRIP, TILE_K, pack  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=16384, help="output columns, a multiple of 16")
    parser.add_argument("--k", type=int, default=2048, help="a multiple of 32")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--turns", type=int, default=7)
    args = parser.parse_args()
    isa = integer_isa(cpu_target("native"))
    isa = tgt.Isa.VNNI512 if isa is tgt.Isa.AMX else isa  # (rows fewer than AMX's 16)
    if isa is tgt.Isa.GENERIC:
        parser.error("this host has no AVX2: the tiles layout needs it")
    if args.n % STRIP or args.k % TILE_K or min(args.rows + args.threads + [args.turns]) < 1:
        parser.error("--n is a multiple of 16, --k of 32, and --rows, --threads and --turns positive")
    N, K, R = args.n, args.k, max(args.rows)
    rng = np.random.default_rng(0)
    layout = tiles_layout(isa)
    weights = pack(FORMATS[Storage.Q4_1].quantize(rng.standard_normal((N, K), np.float32)), layout)
    x, _ = qrows_of(rng.standard_normal((R, K), np.float32), R)
    out = np.zeros((R, N), np.float32)
    blocks = N // STRIP * (K // TILE_K)

    def make(x, w, o, n):
        op = tgt.MatmulOp(x, w, o, n)
        op.isa = tgt.IsaAttr(isa)
        return op

    with tempfile.TemporaryDirectory() as tmp:
        k = Kernel(Path(tmp), Machine("native", target_machine("native")), make,
                   [tgt.QRowsType(R, K), tgt.WeightType((N, K), Storage.Q4_1, layout), tgt.memref(R, N), IndexType()])
        print(f"q4_1 weights {N} x {K}, {isa.value}: {weights.nbytes / 1e6:.1f} MB, {blocks} strip-blocks")
        calls = max(1, int(2e9 // weights.nbytes))  # (about 2 GB read a turn)
        for threads in args.threads:
            for rows in args.rows:
                best = float("inf")
                for turn in range(args.turns + 1):  # (the first turn warms up)
                    start = time.perf_counter()
                    for _ in range(calls):
                        k({"x": x, "weight": weights, "out": out, "rows": rows}, nth=threads)
                    if turn:
                        best = min(best, (time.perf_counter() - start) / calls)
                print(f"{threads} thread{'s' * (threads > 1)}, {rows} row{'s' * (rows > 1)}: {best * 1e6:.1f} µs a "
                      f"call, {best * 1e9 / blocks:.2f} ns a strip-block, {weights.nbytes / best / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
