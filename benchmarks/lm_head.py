"""An LM head kernel alone, screened (`tgt.matmul … screen M`: int8 rows first) against exact (int16 rows
only), at each row count asked, the two taking turns in one process.

    .venv/bin/python benchmarks/lm_head.py --vocab 65536 --hidden 640 --rows 8 1 [--turns 15] [--threads 2]

The kernel is compiled for this host (it needs AVX-512 VNNI: the tiles layout), with a norm and
int16 `quantize` rows as decode's LM head has (`fuse-norm`), on random q8_0 weights (`--vocab` ×
`--hidden`, the weights' bytes printed: above the L3 they stream from DRAM, as a model's do);
prints each variant's median time a call and the weights' bytes a second it reads.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from xdsl.dialects.builtin import IndexType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # (the kernel tests' harness)
from kernel_harness import Kernel, Machine, lm_head_op  # noqa: E402

from llmc.backends.cpu.target import cpu_target, integer_isa  # noqa: E402
from llmc.backends.cpu.toolchain import target_machine  # noqa: E402
from llmc.ir import tgt  # noqa: E402
from llmc.ir.formats import FORMATS, Storage  # noqa: E402
from llmc.ir.layouts import Layout, pack  # noqa: E402
from llmc.passes.screen_logits import MARGIN  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=640, help="a multiple of 32")
    parser.add_argument("--rows", type=int, nargs="+", default=[8, 1], help="row counts, each at most 8")
    parser.add_argument("--margin", type=float, default=MARGIN)
    parser.add_argument("--turns", type=int, default=15)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    if integer_isa(cpu_target("native")) not in (tgt.Isa.VNNI512, tgt.Isa.AMX):
        parser.error("this host has no AVX-512 VNNI: the screened kernel reads the tiles layout")
    if args.hidden % 32 or not all(1 <= r <= 8 for r in args.rows):
        parser.error("--hidden is a multiple of 32 and --rows from 1 to 8")
    N, K, R = args.vocab, args.hidden, max(args.rows)
    rng = np.random.default_rng(0)
    weights = pack(FORMATS[Storage.Q8_0].quantize(rng.standard_normal((N, K), np.float32)), Layout.TILES)
    types = [tgt.memref(R, K), tgt.WeightType((N, K), Storage.Q8_0, Layout.TILES), tgt.memref(R, N), IndexType(),
             tgt.WeightType((K,), Storage.F32)]

    machine = Machine("native", target_machine("native"))
    with tempfile.TemporaryDirectory() as tmp:
        kernels = {"exact": Kernel(Path(tmp), machine, lm_head_op(R, K), types),
                   f"screen {args.margin}": Kernel(Path(tmp), machine, lm_head_op(R, K, args.margin), types)}
        x, g = rng.standard_normal((R, K), np.float32), np.ones(K, np.float32)
        out = np.zeros((R, N), np.float32)
        print(f"q8_0 weights {N} x {K}: {weights.nbytes / 1e6:.1f} MB, {args.threads} threads")
        for rows in args.rows:
            times: dict[str, list[float]] = {name: [] for name in kernels}
            for _ in range(args.turns):
                for name, k in kernels.items():
                    start = time.perf_counter()
                    for _ in range(5):
                        k({"x": x, "weight": weights, "out": out, "rows": rows, "norm": g}, nth=args.threads)
                    times[name].append((time.perf_counter() - start) / 5)
            for name, t in times.items():
                median = statistics.median(t)
                print(f"{rows} row{'s' * (rows > 1)}, {name}: {median * 1e3:.3f} ms a call, "
                      f"{weights.nbytes / median / 1e9:.1f} GB/s of weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
