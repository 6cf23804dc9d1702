"""Why the runtime allocates its buffers from a page: decode at a written depth with the KV cache, arena, logits and
the team's words where the runtime places them (`llmc.runtime.session.aligned_zeros`) against where numpy's own
allocator does (16 bytes past a cache line), the two sessions alternating in one process.

    .venv/bin/python benchmarks/aligned_buffers.py smollm2.llmc [--depth 2048] [--rows 1] [--turns 20] [--calls 10]
    .venv/bin/python benchmarks/aligned_buffers.py old.llmc:numpy new.llmc   # another build's kernels beside

Each argument is an artifact, `:numpy` to open it with numpy's placement (one artifact alone is measured both
ways). Every row's slot is filled by `prefill` up to `--depth` (random tokens), so the cache rows decode reads were
written (not pages never touched); then `--turns` turns of `--calls` decode calls per session. Prints the median
and the best call per session.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime import session as runtime


def numpy_zeros(shape, dtype) -> np.ndarray:
    """Where numpy places an array (the runtime's allocation before `aligned_zeros`)."""
    return np.zeros(shape, dtype)


def opened(spec: str, rows: int, depth: int) -> runtime.Conversation:
    """The session of `spec` (artifact[:numpy]), every row's slot filled up to `depth`."""
    path, _, placement = spec.partition(":")
    place = runtime.aligned_zeros
    runtime.aligned_zeros = numpy_zeros if placement else place
    try:
        session = runtime.open_session(Path(path), threads=2)
    finally:
        runtime.aligned_zeros = place
    if session.slot_count < rows or session.capacity <= depth:
        raise LlmcError(f"{path} holds {session.slot_count} sequence(s) of {session.capacity} tokens: {rows} rows at "
                        f"depth {depth} need --max-batch {rows} and --max-seq above {depth}")
    rng = np.random.default_rng(0)
    logits = np.zeros((1, session.vocab_size), np.float32)
    chunk = session.manifest.entry_points["prefill"]["max_tokens"]
    for slot in range(rows):
        tokens = rng.integers(3, session.vocab_size, depth).astype(np.int32)
        for first in range(0, depth, chunk):
            n = min(chunk, depth - first)
            session.run("prefill" if first == 0 else "prefill_kv", tokens[first:first + n],
                        np.arange(first, first + n, dtype=np.int32), np.full(n, slot, np.int32), logits)
    return session


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifacts", nargs="+", help="artifact directories, each optionally :numpy")
    p.add_argument("--depth", type=int, default=2048, help="cache positions written before the rows (default 2048)")
    p.add_argument("--rows", type=int, default=1)
    p.add_argument("--turns", type=int, default=20)
    p.add_argument("--calls", type=int, default=10, help="decode calls per turn")
    args = p.parse_args()
    if args.depth < 1 or min(args.rows, args.turns, args.calls) < 1:
        p.error("--depth, --rows, --turns and --calls must be at least 1")
    for spec in args.artifacts:
        if spec.partition(":")[2] not in ("", "numpy"):
            p.error(f"{spec}: the placement after ':' must be 'numpy'")
    specs = args.artifacts
    if len(specs) == 1 and ":" not in specs[0]:
        specs = [f"{specs[0]}:numpy", specs[0]]
    try:
        sessions = [(spec, opened(spec, args.rows, args.depth)) for spec in specs]
    except LlmcError as e:
        p.error(str(e))
    tokens = np.arange(5, 5 + args.rows, dtype=np.int32)
    positions = np.full(args.rows, args.depth, np.int32)
    slots = np.arange(args.rows, dtype=np.int32)
    logits = [runtime.aligned_zeros((args.rows, s.vocab_size), np.float32) for _, s in sessions]
    times: list[list[float]] = [[] for _ in sessions]
    for _ in range(args.turns):
        for (_, session), out, turns in zip(sessions, logits, times):
            start = time.perf_counter()
            for _ in range(args.calls):
                session.run("decode", tokens, positions, slots, out)
            turns.append((time.perf_counter() - start) / args.calls * 1e3)
    for (spec, session), turns in zip(sessions, times):
        print(f"{spec}: {args.rows} row{'s' * (args.rows > 1)} at depth {args.depth}: median "
              f"{statistics.median(turns):.3f} ms, best {min(turns):.3f} ms a call")
        session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
