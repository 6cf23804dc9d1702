"""`llmc bench`: prefill and decode throughput of an artifact, best of a few runs.

The prompt is a fixed pseudo-random token sequence (the speed does not depend on the
text); decode continues greedily from it, as generation does.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.session import Session


@dataclass(frozen=True)
class BenchResult:
    vocab_size: int
    threads: int
    prompt_tokens: int
    decode_tokens: int
    prefill_tokens_per_s: float
    decode_tokens_per_s: float

    def report(self) -> str:
        return (
            f"threads  {self.threads}\n"
            f"prefill  {self.prompt_tokens:>4} tokens  {self.prefill_tokens_per_s:8.1f} tokens/s\n"
            f"decode   {self.decode_tokens:>4} tokens  {self.decode_tokens_per_s:8.1f} tokens/s"
        )


def benchmark(directory: Path, prompt_tokens: int = 512, decode_tokens: int = 128, repeat: int = 3,
              threads: int | None = None) -> BenchResult:
    session = Session(directory, threads=threads)
    if prompt_tokens + decode_tokens > session.capacity:
        raise LlmcError(f"{prompt_tokens} + {decode_tokens} tokens exceed the KV capacity of {session.capacity}")
    prompt = np.random.default_rng(0).integers(0, session.vocab_size, prompt_tokens, dtype=np.int32)
    best_prefill = best_decode = float("inf")
    for _ in range(repeat):
        session.reset()
        start = time.perf_counter()
        logits = session.feed(prompt)
        best_prefill = min(best_prefill, time.perf_counter() - start)
        start = time.perf_counter()
        for _ in range(decode_tokens):
            logits = session.feed([int(np.argmax(logits))])
        best_decode = min(best_decode, time.perf_counter() - start)
    session.close()
    return BenchResult(session.vocab_size, session.threads, prompt_tokens, decode_tokens,
                       prompt_tokens / best_prefill, decode_tokens / best_decode)
