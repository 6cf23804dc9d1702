"""One decode call of N rows, timed alone: artifacts compared in alternating turns in one process.

    .venv/bin/python benchmarks/decode_step.py before.llmc after.llmc --rows 8 --depth 32 [--turns 30] [--calls 20]

Each artifact's `decode` entry point is called on `--rows` rows (row i in cache slot i, all at position
`--depth`; an artifact compiled with `--max-batch` at least that) through `Session.run`, with no engine, sampling
or server around it: the time of the kernels and the thread team alone. The artifacts take turns of `--calls`
calls each, `--turns` times, so a shared machine's slow spells fall on all of them alike; prints the median and
the best turn per call, and the rows decoded per second at the median.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.session import open_session


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifacts", nargs="+", type=Path)
    parser.add_argument("--rows", type=int, default=1)
    parser.add_argument("--depth", type=int, default=32, help="the rows' cache position (default 32)")
    parser.add_argument("--turns", type=int, default=30)
    parser.add_argument("--calls", type=int, default=20, help="decode calls per turn")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.rows < 1 or args.depth < 0 or args.turns < 1 or args.calls < 1:
        parser.error("--rows, --turns and --calls must be positive, --depth not negative")
    try:
        sessions = [open_session(path, threads=args.threads) for path in args.artifacts]
    except LlmcError as e:
        parser.error(str(e))
    for path, s in zip(args.artifacts, sessions):
        if s.slot_count < args.rows or s.capacity <= args.depth:
            parser.error(f"{path} holds {s.slot_count} sequence(s) of {s.capacity} tokens: {args.rows} rows at "
                         f"depth {args.depth} need --max-batch {args.rows} and --max-seq above {args.depth}")
    tokens = np.arange(100, 100 + args.rows, dtype=np.int32)
    slots = np.arange(args.rows, dtype=np.int32)
    positions = np.full(args.rows, args.depth, np.int32)
    logits = [np.zeros((args.rows, s.vocab_size), np.float32) for s in sessions]
    for s, out in zip(sessions, logits):  # every cache page the timed calls read, touched first
        for depth in range(0, args.depth + 1, 8):
            s.run("decode", tokens, np.full(args.rows, depth, np.int32), slots, out)
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(args.turns):
        for s, out, turns in zip(sessions, logits, times):
            start = time.perf_counter()
            for _ in range(args.calls):
                s.run("decode", tokens, positions, slots, out)
            turns.append((time.perf_counter() - start) / args.calls * 1e3)
    for path, turns in zip(args.artifacts, times):
        median = statistics.median(turns)
        print(f"{path.name}: {args.rows} row{'s' * (args.rows > 1)} at depth {args.depth}: median {median:.3f} ms, best {min(turns):.3f} ms "
              f"a call ({args.rows / median * 1e3:.0f} rows/s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
