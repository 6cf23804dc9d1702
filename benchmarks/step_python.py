"""The Python around a decode step's native call: what a token costs beyond the kernels.

    .venv/bin/python benchmarks/step_python.py smollm2.llmc [--rows 8] [--steps 300] [--threads 2]

A decode step streams the weights through every cache, so the Python that runs between two steps finds
none of its objects there: code that takes 3 us warm takes ten times that after a step. This times, around
each native call (the team's job, wrapped), three paths as they run in a decode loop: `Session.run` of one
`decode` row (the Python before the call), a greedy step through `Session.greedy` (before and after it),
and an engine step of `--rows` sequences decoding together (`llmc.runtime.batch.Engine`, an artifact
compiled with `--max-batch` at least that); prints each one's median in microseconds.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.batch import Engine, Request
from llmc.runtime.session import open_session


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--rows", type=int, default=8, help="sequences of the engine's steps (default 8)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be at least 4")
    try:
        session = open_session(args.artifact, threads=args.threads)
    except LlmcError as e:
        parser.error(str(e))
    if not 1 <= args.rows <= session.batch:
        parser.error(f"--rows must be in 1..{session.batch} (the artifact's --max-batch)")
    team, clock = session.team, time.perf_counter
    native, entered = [], []
    run = team._run

    def timed(at, job) -> None:  # noqa: ANN001 (ctypes arguments)
        entered.append(clock())
        run(at, job)
        native.append(clock() - entered[-1])

    team._run = timed
    session.feed(list(range(100, 132)))
    tokens, slots = np.full(1, 100, np.int32), np.zeros(1, np.int32)
    logits = np.zeros((1, session.vocab_size), np.float32)
    before = []
    for step in range(args.steps):  # the Python before the call, each call after a step
        start = clock()
        session.run("decode", tokens, np.full(1, 32 + step % 64, np.int32), slots, logits)
        before.append(entered[-1] - start)
    around, token = [], 100
    for _ in range(args.steps):
        start, calls = clock(), len(native)
        token = session.greedy([token])
        around.append(clock() - start - sum(native[calls:]))
        if session.position > 512:
            session.rewind(32)
    rng = np.random.default_rng(0)
    engine = Engine(session, end_ids=(), max_active=args.rows)
    for _ in range(args.rows):
        engine.submit(Request(rng.integers(3, session.vocab_size, 32).tolist(), args.steps // 4 + 2,
                              emit=lambda token, logprob: None))
    while engine.busy and any(s.token is None for s in engine.running):  # the prompts
        engine.step()
    steps = []
    while engine.busy:
        start, calls = clock(), len(native)
        engine.step()
        steps.append(clock() - start - sum(native[calls:]))
    team._run = run
    session.close()
    for name, values in (("Session.run of one decode row, before the call", before),
                         ("a greedy step (Session.greedy), around the call", around),
                         (f"an engine step of {args.rows} rows, around the call", steps)):
        print(f"{name}: {statistics.median(values) * 1e6:.1f} us (median of {len(values)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
