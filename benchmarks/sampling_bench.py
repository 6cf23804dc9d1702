"""What choosing a token costs, per option set, on a model's own logits (not random ones: the head that top-p
needs depends on how peaked they are): in Python, and in a decode step as a generation takes it.

    .venv/bin/python benchmarks/sampling_bench.py smollm2.llmc [--steps 100] [--threads 2]

Decodes `--steps` tokens after each of three chat prompts (sampling at temperature 1, seed i), keeps every
step's logits, then times `Sampler.__call__` (numpy's passes over the vocabulary) on each row in turn for each
option set below (a fresh sampler per set, warmed on five rows): the mean, median and 99th percentile in µs.
Then, for each set, 6 × `--steps` decode steps after the first prompt in ten turns of every set, every other
step chosen as `llmc run` and the engine choose (the session's choice where the sampler allows: the thread
team's argmax, or its weighing and draw) and the others by the sampler in numpy: the median µs a step of
each, whose difference is what the team saves. Prints a Markdown table beside the artifact's vocabulary size.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.codec import TextCodec
from llmc.runtime.sampling import Sampler, SamplingOptions
from llmc.runtime.session import Conversation, open_session
from llmc.runtime.speculate import next_token

PROMPTS = ["Tell me a long story about a dragon.", "Explain how a compiler works, step by step.",
           "Write a poem about the sea."]
OPTIONS = {
    "greedy": SamplingOptions(),
    "temperature 1 (OpenAI's default)": SamplingOptions(1.0),
    "temperature 1, top-p 0.9": SamplingOptions(1.0, top_p=0.9),
    "temperature 0.7, top-p 0.95": SamplingOptions(0.7, top_p=0.95),
    "temperature 0.7, top-k 40": SamplingOptions(0.7, top_k=40),
    "temperature 0.8, top-k 40, top-p 0.95, min-p 0.05 (llama.cpp's)": SamplingOptions(0.8, 40, 0.95, min_p=0.05),
    "temperature 1, min-p 0.05": SamplingOptions(1.0, min_p=0.05),
    "temperature 1, presence 0.5": SamplingOptions(1.0, presence_penalty=0.5),
    "greedy, repetition 1.1 (numpy's argmax of processed logits)": SamplingOptions(repetition_penalty=1.1),
}


def logits_rows(session: Conversation, codec: TextCodec, steps: int) -> np.ndarray:
    rows = []
    for seed, question in enumerate(PROMPTS):
        session.reset()
        sampler = Sampler(SamplingOptions(1.0, seed=seed))
        logits = session.feed(codec.encode(codec.chat(question)))
        for _ in range(steps):
            rows.append(np.array(logits))
            logits = session.feed([sampler(logits)])
    return np.stack(rows)


def step_times(session: Conversation, codec: TextCodec, steps: int, turns: int = 10) -> dict[str, np.ndarray]:
    """Seconds of `steps` decode steps per option set after the first prompt, the token chosen as a generation
    chooses it: every other step by the session (`next_token`: where the sampler is plain or weighs every token,
    `session.pick`, the thread team's argmax, or its weighing and draw in an artifact with `llmc_weigh`), the
    others by the sampler on a copy of the logits in numpy (`sampler(session.feed(…))`). `turns` of each
    set in turn (a fresh generation each, seed = the turn): the host's drift falls on every set and path
    alike. Keys (set name, True for the session's steps)."""
    prompt = codec.encode(codec.chat(PROMPTS[0]))
    times: dict[tuple[str, bool], list[float]] = {}
    for turn in range(turns):
        for name, options in OPTIONS.items():
            session.reset()
            sampler = Sampler(dataclasses.replace(options, seed=turn))
            token = next_token(session, sampler, prompt)
            for i in range(-(-steps // turns)):
                own = i % 2 == 0
                start = time.perf_counter()
                token = next_token(session, sampler, [token]) if own else sampler(session.feed([token]))
                times.setdefault((name, own), []).append(time.perf_counter() - start)
    return {key: np.array(t) for key, t in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--steps", type=int, default=100, help="tokens decoded after each prompt (rows timed: 3x)")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    try:
        session = open_session(args.artifact, threads=args.threads)
    except LlmcError as e:
        p.error(str(e))
    codec = TextCodec.from_artifact(session.manifest)
    try:
        rows = logits_rows(session, codec, args.steps)
        print(f"{len(rows)} rows of {rows.shape[1]} logits ({args.artifact.name})\n")
        print("| options | Python: mean µs | median µs | p99 µs | a decode step, median µs: the session's | numpy's |")
        print("|---|--:|--:|--:|--:|--:|")
        steps = step_times(session, codec, 6 * args.steps)
        for name, options in OPTIONS.items():
            sampler = Sampler(options)
            for row in rows[:5]:
                sampler(row)
            times = []
            for row in rows:
                start = time.perf_counter()
                sampler(row)
                times.append(time.perf_counter() - start)
            us = np.array(times) * 1e6
            own, numpys = (np.median(steps[(name, path)]) * 1e6 for path in (True, False))
            print(f"| {name} | {us.mean():.1f} | {np.median(us):.1f} | {np.percentile(us, 99):.1f} | {own:.1f} | "
                  f"{numpys:.1f} |")
    finally:
        session.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
