"""`llmc bench`: prefill and decode throughput of an artifact at a KV depth, best of a few runs.

Measured as llama.cpp's `llama-bench -p P -n N -d D` measures: with D tokens already in
the KV cache (fed once, not timed), the prefill speed of P more tokens, and the decode
speed of N single-token steps (greedy, each token the argmax of the step before). The
tokens are a fixed pseudo-random sequence: the speed does not depend on the text.

The results of llmc and of other engines (`llmc.peers`) are `EngineSpeeds`; `table`
prints them side by side, with ratios against a baseline engine. `Session.read_weights`
measures the machine's streaming read speed over the artifact's weights, the limit of a
decode step that reads every weight once. The host's other load changes by the second, so
the two are taken in turn, a read after each decode step, and their medians compared. Only
numpy here, like the rest of the runtime.
Each test says what it is doing as it starts (`status`: `llmc bench` shows it as a progress line).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmc.runtime.artifact import Manifest
from llmc.runtime.session import CapacityError, open_session
from llmc.runtime.speculate import SpeculationStats

DEFAULT_PROMPTS = (128, 512, 2048)
DEFAULT_DEPTHS = (0, 2048)


@dataclass
class EngineSpeeds:
    """One engine's tokens/s: `prefill[(depth, prompt)]` and `decode[depth]`."""

    name: str
    family: str  # "llmc", "llama.cpp" or "transformers": ratios are taken against a family's best
    prefill: dict[tuple[int, int], float] = field(default_factory=dict)
    decode: dict[int, float] = field(default_factory=dict)


@dataclass(frozen=True)
class BenchResult:
    vocab_size: int
    threads: int
    where: str  # what the engines ran on: "2 threads", or the GPU's name
    capacity: int
    prompts: tuple[int, ...]
    depths: tuple[int, ...]
    decode_tokens: int
    speeds: EngineSpeeds
    read_gb_per_s: float  # the kernels' read probe over the weights, on the same threads (GPU: a copy), the
    # median of reads taken in turn with decode steps at the lowest depth
    probed_decode: float  # decode tokens/s at the lowest depth, in the steps taken in turn with the probe's reads
    weight_bytes: int
    probe: str  # how read_gb_per_s was measured, for the report

    def report(self) -> str:
        return table([self.speeds], self.prompts, self.depths, self.decode_tokens, self.where)


def check_capacity(capacity: int, prompts: Sequence[int], depths: Sequence[int], decode_tokens: int) -> None:
    """Each test fits the KV cache: depth + prompt (prefill) and depth + decode tokens (decode)."""
    for depth in depths:
        for what, n in (("prompt", max(prompts)), ("decode", decode_tokens)):
            if depth + n > capacity:
                raise CapacityError(f"depth {depth} + {what} {n} tokens exceed the artifact's KV capacity of "
                                    f"{capacity} (bench fewer tokens, or compile with a larger --max-seq)")


def fit_defaults(capacity: int, prompts: Sequence[int] | None, depths: Sequence[int] | None, decode_tokens: int
                 ) -> tuple[tuple[int, ...], tuple[int, ...], list[str]]:
    """The prompt lengths and depths to run: those given, else the defaults that fit `capacity`.

    Returns them with a note for each default left out; given values are checked, not cut.
    """
    notes = []
    if prompts is None:
        prompts = [p for p in DEFAULT_PROMPTS if p <= capacity] or [DEFAULT_PROMPTS[0]]  # (then refused below)
        left = [p for p in DEFAULT_PROMPTS if p not in prompts]
        if left:
            notes.append(f"prompt lengths {', '.join(map(str, left))} left out: the KV capacity is {capacity}")
    if depths is None:
        depths = [d for d in DEFAULT_DEPTHS if d + max(max(prompts), decode_tokens) <= capacity] or [0]
        left = [d for d in DEFAULT_DEPTHS if d not in depths]
        if left:
            notes.append(f"depths {', '.join(map(str, left))} left out: the KV capacity is {capacity}")
    check_capacity(capacity, prompts, depths, decode_tokens)
    return tuple(prompts), tuple(depths), notes


def _silent(text: str) -> None:
    pass


def benchmark(directory: Path, prompts: int | Sequence[int] = (512,), decode_tokens: int = 128, repeat: int = 3,
              threads: int | None = None, depths: Sequence[int] = (0,), name: str | None = None,
              status: Callable[[str], None] = _silent) -> BenchResult:
    """llmc's prefill tokens/s for each (depth, prompt) and decode tokens/s for each depth, best of `repeat`;
    `status` is told each test as it starts ("bench: prefill 512 at depth 0, run 2 of 3")."""
    prompts = (prompts,) if isinstance(prompts, int) else tuple(prompts)
    depths = tuple(depths)
    if not prompts or not depths or min(prompts) < 1 or min(depths) < 0 or decode_tokens < 1 or repeat < 1:
        raise ValueError("prompts and decode tokens must be positive, depths >= 0, repeat >= 1")
    session = open_session(directory, threads=threads)
    try:
        check_capacity(session.capacity, prompts, depths, decode_tokens)
        speeds = EngineSpeeds(name or f"llmc {directory.name}", "llmc")
        tokens = np.random.default_rng(0).integers(0, session.vocab_size, max(depths) + max(prompts), dtype=np.int32)
        status("bench: warm-up (the weights paged in)")
        session.feed(tokens[: min(session.chunk, max(prompts))])  # warm-up, as llama-bench's: weights paged in
        session.feed(tokens[:1])
        for depth in depths:
            session.reset()
            if depth:
                status(f"bench: filling the KV cache to depth {depth}")
                session.feed(tokens[:depth])  # the context, once; later tests overwrite only the rows after it
            for prompt in prompts:
                best = float("inf")
                for run in range(repeat):
                    status(f"bench: prefill {prompt} at depth {depth}, run {run + 1} of {repeat}")
                    session.rewind(depth)
                    start = time.perf_counter()
                    session.feed(tokens[depth : depth + prompt])
                    best = min(best, time.perf_counter() - start)
                speeds.prefill[depth, prompt] = prompt / best
            best = float("inf")
            for run in range(repeat):
                status(f"bench: decode {decode_tokens} at depth {depth}, run {run + 1} of {repeat}")
                session.rewind(depth)
                token = int(tokens[depth])
                start = time.perf_counter()
                for _ in range(decode_tokens):
                    token = session.greedy([token])
                best = min(best, time.perf_counter() - start)
            speeds.decode[depth] = decode_tokens / best
            if depth == min(depths):
                status(f"bench: the read probe, a read of the weights after each of {decode_tokens} decode steps")
                read, probed = _probe_between_steps(session, tokens, depth, decode_tokens)
    finally:
        session.close()
    return BenchResult(session.vocab_size, session.threads, session.where, session.capacity, prompts, depths,
                       decode_tokens, speeds, read, probed, session.weights.size, session.bandwidth_probe)


def _probe_between_steps(session, tokens: np.ndarray, depth: int, steps: int) -> tuple[float, float]:
    """The read probe's GB/s over the weights and decode's tokens/s at `depth`, each the median of `steps`
    taken in turn (a step, then a read of the weights): whatever else loads the host falls on both alike."""
    session.rewind(depth)
    token, decode, read = int(tokens[depth]), [], []
    for _ in range(steps):
        start = time.perf_counter()
        token = session.greedy([token])
        decode.append(1 / (time.perf_counter() - start))
        read.append(session.read_weights())
    return float(np.median(read)), float(np.median(decode))


# ------------------------------------------------------------------ speculative decoding


@dataclass
class SpeculationRun:
    """One prompt set's greedy decode, plain and speculative: tokens, seconds (best of the repeats, each
    prompt's first token — the prefill's — left out), the drafts' stats, and whether the texts agree."""

    name: str
    prompts: int
    tokens: int
    plain_seconds: float
    speculative_seconds: float
    stats: SpeculationStats
    identical: bool

    @property
    def speedup(self) -> float:
        return self.plain_seconds / self.speculative_seconds


def _decode_seconds(tokens: Iterator[int]) -> tuple[list[int], float]:
    """The tokens, and the seconds from the first one to the last (decode, without the prefill)."""
    out, first = [], 0.0
    for token in tokens:
        out.append(token)
        if len(out) == 1:
            first = time.perf_counter()
    return out, time.perf_counter() - first


def speculation_benchmark(directory: Path, prompt_sets: dict[str, Sequence[str]], max_tokens: int = 128,
                          repeat: int = 2, threads: int | None = None, draft: Path | None = None,
                          most: int = 8, status: Callable[[str], None] = _silent) -> tuple[list[SpeculationRun], str]:
    """Greedy decode tokens/s of each set's prompts (chat template applied), plain and speculative (prompt
    lookup, or the `draft` artifact), alternating prompt by prompt, best of `repeat` each; and where they ran
    (`status` told each prompt as it starts)."""
    from llmc.runtime.codec import TextCodec
    from llmc.runtime.generate import generate
    from llmc.runtime.sampling import SamplingOptions
    from llmc.runtime.speculate import DraftModel, PromptLookup, Speculation

    session = open_session(directory, threads=threads)
    drafting = open_session(draft, threads=threads) if draft else None
    try:
        codec = TextCodec.from_artifact(session.manifest)
        drafter = DraftModel(drafting, session, draft) if drafting else PromptLookup()
        greedy = SamplingOptions()
        session.feed(codec.encode(codec.chat("hello")))  # warm-up: weights paged in
        runs = []
        for name, prompts in prompt_sets.items():
            stats = SpeculationStats()
            tokens = plain_total = fast_total = 0
            identical = True
            for i, text in enumerate(prompts, 1):
                status(f"bench: {name} prompt {i} of {len(prompts)}, plain and speculative")
                ids = codec.encode(codec.chat(text))
                plain_best = fast_best = float("inf")
                for _ in range(repeat):
                    plain, seconds = _decode_seconds(generate(session, codec, ids, max_tokens, greedy))
                    plain_best = min(plain_best, seconds)
                    speculation = Speculation(drafter, most, stats)
                    fast, seconds = _decode_seconds(generate(session, codec, ids, max_tokens, greedy, speculation))
                    fast_best = min(fast_best, seconds)
                    identical &= fast == plain
                tokens += len(plain) - 1
                plain_total += plain_best
                fast_total += fast_best
            runs.append(SpeculationRun(name, len(prompts), tokens, plain_total, fast_total, stats, identical))
    finally:
        session.close()
        if drafting:
            drafting.close()
    return runs, session.where


def speculation_table(runs: Sequence[SpeculationRun], where: str, drafter: str) -> str:
    """One line per prompt set: decode tokens/s plain and speculative, the ratio, acceptance, tokens per call."""
    lines = [f"| prompts ({where}) | decode tokens | plain tok/s | {drafter} tok/s | × | accepted | "
             f"tokens/call | text |", "|---|--:|--:|--:|--:|--:|--:|---|"]
    for r in runs:
        lines.append(f"| {r.name} ({r.prompts}) | {r.tokens} | {r.tokens / r.plain_seconds:.1f} | "
                     f"{r.tokens / r.speculative_seconds:.1f} | {r.speedup:.2f}x | {r.stats.acceptance:.0%} | "
                     f"{r.stats.tokens_per_call:.2f} | {'identical' if r.identical else 'DIFFERS'} |")
    return "\n".join(lines)


# ------------------------------------------------------------------ bandwidth


def decode_weight_bytes(manifest: Manifest) -> tuple[int, str]:
    """Bytes of weights one decode step reads, and where the number comes from.

    Every weight is read whole, except the token embedding of an untied model (its LM
    head is `output`), of which a step reads one row.
    """
    weights = manifest.data.get("weights")
    if not isinstance(weights, dict) or not weights:
        return manifest.data["files"]["weights"]["bytes"], "weights.bin"
    total = sum(w["bytes"] for w in weights.values())
    embedding = weights.get("token_embd")
    if "output" in weights and embedding is not None:
        total -= embedding["bytes"] - embedding["bytes"] // embedding["shape"][0]
        return total, "the manifest's weights, one token_embd row"
    return total, "the manifest's weights"


def bandwidth_report(decode_bytes: int, source: str, result: BenchResult) -> str:
    """The bytes a decode step reads, the read speed that implies, and the limit the read probe measured
    (medians of the steps and reads taken in turn: the percentage compares those two)."""
    depth = min(result.depths)
    speed = result.speeds.decode[depth]
    limit = result.read_gb_per_s * 1e9 / decode_bytes
    return (f"weights   {decode_bytes / 1e6:.1f} MB read per decode token ({source}); llmc decode at depth {depth}, "
            f"{speed:.1f} tokens/s, reads {decode_bytes * speed / 1e9:.1f} GB/s\n"
            f"bandwidth limit ≈ {limit:.1f} tokens/s ({result.read_gb_per_s:.1f} GB/s: {result.probe} over the "
            f"{result.weight_bytes / 1e6:.1f} MB of weights, the median of {result.decode_tokens} reads taken in "
            f"turn with decode steps, whose median was {result.probed_decode:.1f} tokens/s); llmc decode at "
            f"{100 * result.probed_decode / limit:.0f}% of it")


# ------------------------------------------------------------------ the table


def baseline_of(engines: Sequence[EngineSpeeds]) -> tuple[str, EngineSpeeds] | None:
    """The speeds to divide by: llama.cpp's fastest path per test, else transformers; None without peers.

    Returns a description and an `EngineSpeeds` holding the best of that family per test.
    """
    for family, label in (("llama.cpp", "llama.cpp's fastest path per test"), ("transformers", "transformers")):
        members = [e for e in engines if e.family == family]
        if members:
            best = EngineSpeeds(label, family)
            for e in members:
                for key, value in e.prefill.items():
                    best.prefill[key] = max(best.prefill.get(key, 0.0), value)
                for key, value in e.decode.items():
                    best.decode[key] = max(best.decode.get(key, 0.0), value)
            return label, best
    return None


def _ratio(value: float | None, base: float | None) -> str:
    return f"{value / base:.2f}x" if value and base else ""


def _speed(value: float | None) -> str:
    return f"{value:.1f}" if value else "—"


def table(engines: Sequence[EngineSpeeds], prompts: Sequence[int], depths: Sequence[int], decode_tokens: int,
          where: str) -> str:
    """A Markdown table, padded to line up in a terminal: one row per engine × (depth, prompt).

    An engine's decode speed depends on the depth only: it is shown on the first of its
    rows at that depth.
    """
    found = baseline_of(engines)
    base = found[1] if found else None
    header = [f"engine ({where})", "depth", "prompt", "prefill tok/s", f"decode {decode_tokens} tok/s"]
    if base:
        header[4:4] = ["prefill ×"]
        header.append("decode ×")
    rows = []
    for depth in depths:
        for engine in engines:
            for i, prompt in enumerate(prompts):
                pp = engine.prefill.get((depth, prompt))
                tg = engine.decode.get(depth) if i == 0 else None
                row = [engine.name, str(depth), str(prompt), _speed(pp), _speed(tg) if i == 0 else ""]
                if base:
                    row[4:4] = [_ratio(pp, base.prefill.get((depth, prompt)))]
                    row.append(_ratio(tg, base.decode.get(depth)) if i == 0 else "")
                rows.append(row)
    widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

    def line(cells: list[str]) -> str:
        padded = [cell.ljust(w) if c == 0 else cell.rjust(w) for c, (cell, w) in enumerate(zip(cells, widths))]
        return "| " + " | ".join(padded) + " |"

    out = [line(header), "|" + "|".join("-" * (w + 1) + (":" if c else "-") for c, w in enumerate(widths)) + "|"]
    out += [line(r) for r in rows]
    if found:
        out.append(f"\nratios (×) against {found[0]}")
    return "\n".join(out)
