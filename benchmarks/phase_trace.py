"""Where a decode step's time goes, phase by phase, from an instrumented build.

    git apply benchmarks/phase_trace.patch       # llmc_barrier stamps each arrival and departure
    LLMC_CACHE_DIR=$(mktemp -d) .venv/bin/llmc compile smollm2-135m -o /tmp/traced.llmc
    git apply -R benchmarks/phase_trace.patch
    .venv/bin/python benchmarks/phase_trace.py /tmp/traced.llmc [--period 5 --first 1 --layers 30] [--steps 40] [--depth 32]

The patch makes every barrier write the time stamp counter at each thread's arrival and departure into
`llmc_btrace` (per barrier instance: the first thread to arrive, then the last; the team's done barrier, which
has a sync word of its own, in a ring of its own: it once overwrote the entry points' instances, and the LM head's
phase went missing at depth). This script runs `--steps`
decode calls of `--rows` rows (one by default; more need an artifact compiled with `--max-batch`) on 2
threads and prints, for each barrier's place in a layer (`--period` barriers
from the `--first` of a step, `--layers` times: SmolLM2's are after q/k/v, attention, o, swiglu and down)
and for each other barrier of a step, the median time from the previous barrier's release to this one's
(the phase's wall time) and the median skew (how long the first thread to arrive waited for the last).
The counter's rate is taken from the same calls' wall time.
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

from llmc.runtime.session import open_session

SLOTS = 16384  # barrier instances the patch's ring holds (4 words each, for 2 threads): an entry point's barriers
# by their sync word's generation in the first half, the team's done barrier (its own word) in the second


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--period", type=int, default=5, help="barriers per layer (default 5)")
    parser.add_argument("--first", type=int, default=1, help="the place in a step of the first layer's first barrier")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--rows", type=int, default=1, help="rows a call (at most the artifact's --max-batch)")
    args = parser.parse_args()
    session = open_session(args.artifact, threads=2)
    if not 1 <= args.rows <= session.batch:
        parser.error(f"--rows must be in 1..{session.batch} (the artifact's --max-batch)")
    tokens, slots = np.full(args.rows, 100, np.int32), np.arange(args.rows, dtype=np.int32)
    logits = np.zeros((args.rows, session.vocab_size), np.float32)
    for depth in range(0, args.depth + 1, 8):  # every cache page touched first
        session.run("decode", tokens, np.full(args.rows, depth, np.int32), slots, logits)
    try:
        ring = (ctypes.c_int64 * (SLOTS * 8)).in_dll(session.library, "llmc_btrace")
    except ValueError:
        parser.error(f"{args.artifact} was not compiled with benchmarks/phase_trace.patch applied (no llmc_btrace)")
    ctypes.memset(ring, 0, ctypes.sizeof(ring))
    start = time.perf_counter()
    for _ in range(args.steps):
        session.run("decode", tokens, np.full(args.rows, args.depth, np.int32), slots, logits)
    seconds = time.perf_counter() - start
    stamps = np.ctypeslib.as_array(ring).reshape(SLOTS, 2, 4)
    used = sorted((g for g in range(SLOTS) if stamps[g, 0, 0] and stamps[g, 1, 0]), key=lambda g: stamps[g, 0, 0])
    if not used or len(used) % args.steps:
        parser.error(f"{len(used)} barrier instances in {args.steps} steps: not the same number in each")
    per_step = len(used) // args.steps
    released = [int(stamps[g, :, 1].max()) for g in used]
    skew = [int(stamps[g, 1, 0] - stamps[g, 0, 0]) for g in used]
    ticks_per_us = (released[-1] - int(stamps[used[0], :, 0].min())) / (seconds * 1e6)  # (Python between calls too)
    phases, skews = defaultdict(list), defaultdict(list)
    for n in range(1, len(used)):
        place = n % per_step
        layer = args.first <= place < args.first + args.layers * args.period
        key = f"layer barrier {(place - args.first) % args.period}" if layer else f"barrier {place} of the step"
        phases[key].append((released[n] - released[n - 1]) / ticks_per_us)
        skews[key].append(skew[n] / ticks_per_us)
    print(f"{per_step} barriers a step, {seconds / args.steps * 1e3:.3f} ms a call, counter {ticks_per_us:.0f} ticks/us")
    print("(a phase: from the previous barrier's release to this one's; the first of a step holds the call from Python)")
    for key in sorted(phases, key=lambda k: (not k.startswith("layer"), int(k.split()[-1]) if k.startswith("layer")
                                             else int(k.split()[1]))):
        print(f"{key:24s} phase {statistics.median(phases[key]):7.2f} us, skew {statistics.median(skews[key]):5.2f} us"
              f" (median of {len(phases[key])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
