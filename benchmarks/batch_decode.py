"""Batched decode in the engine alone (no server): N sequences decoding together against one alone.

    .venv/bin/llmc compile llama1b-q4_1.gguf --max-batch 8 --compute a8 --max-seq 512 -o llama1b-b8.llmc
    .venv/bin/python benchmarks/batch_decode.py llama1b-b8.llmc --rows 8 --tokens 32 [--threads 2] [--repeat 3]

Each sequence gets its own prompt (token ids drawn from the vocabulary with a fixed seed) and
decodes `--tokens` tokens greedily, or sampled at `--temperature` (each seeded by its prompt's sum; end of
sequence ignored) through `llmc.runtime.batch.Engine`.
Decode rate: the tokens produced after every prompt has been fed, over the time they took (the
engine's steps, each one `decode` call of all the rows), per second of wall time and per second of
the process's CPU time (with `--threads 1` the second is steadier on a busy machine). The first
sequence alone is measured the same way; every sequence's tokens are compared with the same
sequence alone (they must be equal: a row's result does not depend on its neighbours). Each run
starts from an empty cache: a prompt still in a slot's cache from an earlier run would be fed from
its last token. The engine feeds the prompts submitted together in one `prefill_kv` call, all but
the last holding their last token back for the first decode call, so a row's logits are not
computed in the calls that compute them alone: they differ in the last bits (an `a8` build rounds
them another way), and the greedy tokens are checked equal all the same; sampled rows that differ
(over flat distributions a draw near a boundary can land on a neighbouring token) are reported, not an
error. Prints one line per repeat and the best.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.batch import Engine, Request
from llmc.runtime.sampling import SamplingOptions
from llmc.runtime.session import Conversation, open_session


def prompts(vocab: int, n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, length).tolist() for _ in range(n)]


def decode(session: Conversation, rows: int, batch: list[list[int]], tokens: int, temperature: float = 0.0
           ) -> tuple[list[list[int]], float, float]:
    """Every prompt of `batch` at once, on an engine of `rows` slots with an empty cache: each one's tokens, and
    the decode rate (all rows) once every prompt has been fed, in tokens per second of wall time and per second
    of the process's CPU time. Each sequence samples at `temperature` (0: greedy) seeded by its prompt's sum."""
    engine = Engine(session, end_ids=(), max_active=rows)  # (a prompt a slot still held would be fed in part)
    got: list[list[int]] = [[] for _ in batch]
    for prompt, out in zip(batch, got):
        engine.submit(Request(prompt, tokens, SamplingOptions(temperature, seed=sum(prompt)),
                              emit=lambda token, logprob, out=out: out.append(token)))
    while engine.busy and min(len(out) for out in got) < 1:  # the prompts, then every row's first token
        engine.step()
    before, start, cpu = sum(map(len, got)), time.perf_counter(), time.process_time()
    while engine.busy:
        engine.step()
    made = sum(map(len, got)) - before
    return got, made / (time.perf_counter() - start), made / (time.process_time() - cpu)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--rows", type=int, default=8, help="sequences decoding together (at most the artifact's batch)")
    p.add_argument("--tokens", type=int, default=32, help="tokens each sequence generates")
    p.add_argument("--prompt", type=int, default=16, help="prompt length in tokens")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--temperature", type=float, default=0.0, help="sample at this temperature (0: greedy)")
    args = p.parse_args()
    if min(args.rows, args.tokens, args.prompt, args.repeat) < 1:
        p.error("--rows, --tokens, --prompt and --repeat must be at least 1")
    try:
        SamplingOptions(args.temperature).check()
    except ValueError as e:
        p.error(str(e))
    try:
        session = open_session(args.artifact, threads=args.threads)
    except LlmcError as e:
        p.error(str(e))
    if args.rows > session.slot_count:
        p.error(f"--rows {args.rows}: this artifact decodes at most {session.slot_count} sequences together "
                f"(compile it with --max-batch {args.rows})")
    batch = prompts(session.vocab_size, args.rows, args.prompt)
    alone = [decode(session, args.rows, [prompt], args.tokens, args.temperature)[0][0] for prompt in batch]
    best = (0.0, 0.0)
    for i in range(args.repeat):
        _, one, one_cpu = decode(session, args.rows, batch[:1], args.tokens, args.temperature)
        got, many, many_cpu = decode(session, args.rows, batch, args.tokens, args.temperature)
        bad = [r for r in range(args.rows) if got[r] != alone[r]]
        if bad and not args.temperature:
            print(f"rows {bad}: tokens differ from the same sequence alone", file=sys.stderr)
            return 1
        if bad:  # (a held prompt's last token is fed by `decode`, whose logits and K/V differ in the last bits
            # from `prefill`'s: a draw near a boundary of the cumulative sums lands on a neighbour, then all differ)
            print(f"rows {bad}: sampled tokens differ from the same sequence alone (held prompt tokens)")
        print(f"repeat {i}: 1 row {one:.2f} tok/s, {args.rows} rows {many:.2f} tok/s in all, {many / one:.2f}x "
              f"(per CPU second: {one_cpu:.2f}, {many_cpu:.2f}, {many_cpu / one_cpu:.2f}x)")
        best = max(best, (many / one, many), key=lambda b: b[1])
    same = "every row's tokens equal alone" if not args.temperature else "sampled"
    print(f"best: {args.rows} rows {best[1]:.2f} tok/s, {best[0]:.2f}x one row; {same}")
    session.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
