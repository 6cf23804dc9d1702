"""`llmc verify`: run every stage on the same tokens and compare its logits with the source.

One row per stage, like TPU-MLIR's per-stage tensor comparison:

    stage    cosine     max|err|   top-1
    source   reference  (transformers 5.24.0 fp32)
    llm      1.000000   9.06e-05   5/5 (100%)
    tgt      1.000000   3.99e-05   5/5 (100%)
    artifact 1.000000   4.2e-05    5/5 (100%)

`llm` runs the whole prompt through `@forward`. `tgt` (the numpy kernels over the
planned arena) and `artifact` (the compiled code) run the entry points teacher-forced:
`prefill` on the first token, then `decode` on each next one, so every position has
logits. `cosine` is the lowest cosine similarity over positions; `top-1` counts
positions whose arg-max agrees with the reference.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np


@dataclass(frozen=True)
class Agreement:
    """How one stage's logits `[T, vocab]` compare with the reference's."""

    cosine: float
    max_abs_error: float
    top1_agree: int
    positions: int

    @classmethod
    def between(cls, logits: np.ndarray, reference: np.ndarray) -> Agreement:
        a, b = logits.astype(np.float64), reference.astype(np.float64)
        norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
        cosine = np.sum(a * b, axis=-1) / np.maximum(norms, 1e-30)
        return cls(
            cosine=float(cosine.min()),
            max_abs_error=float(np.abs(a - b).max()),
            top1_agree=int((a.argmax(-1) == b.argmax(-1)).sum()),
            positions=a.shape[0],
        )

    def row(self, stage: str) -> str:
        pct = 100.0 * self.top1_agree / self.positions
        return f"{stage:<8} {self.cosine:<10.6f} {self.max_abs_error:<10.3g} {self.top1_agree}/{self.positions} ({pct:.0f}%)"


def verify_stages(
    reference: np.ndarray,
    stages: dict[str, Callable[[], np.ndarray]],
    tolerance: float,
    reference_label: str,
    emit: Callable[[str], None],
) -> bool:
    """Print the table; True when every stage's cosine is at least `tolerance`."""
    emit(f"{'stage':<8} {'cosine':<10} {'max|err|':<10} top-1")
    emit(f"{'source':<8} {'reference':<10} ({reference_label})")
    ok = True
    for name, compute in stages.items():
        agreement = Agreement.between(compute(), reference)
        emit(agreement.row(name))
        ok &= agreement.cosine >= tolerance
    return ok


def teacher_forced(feed: Callable[[list[int], int], np.ndarray], tokens: list[int]) -> np.ndarray:
    """Logits `[T, vocab]` from an entry-point runner: prefill the first token, decode the rest."""
    return np.stack([feed(tokens[:1], 0)] + [feed([t], i) for i, t in enumerate(tokens[1:], 1)])


def verify_model(spec: str, prompt: str, tolerance: float, artifact: Path | None,
                 emit: Callable[[str], None], progress: Callable[[str], None], allow_pickle: bool = False) -> bool:
    """Print the model, the prompt and one row per stage; True when every stage passes."""
    from llmc.compile import BackendOptions, build_cpu_artifact
    from llmc.errors import UsageError
    from llmc.frontend import import_model, load_model
    from llmc.frontend.reference import reference_logits, reference_name
    from llmc.ir import find_function, tgt
    from llmc.ir.interpreter import KVCache, forward_logits
    from llmc.ir.tgt_interpreter import run_entry
    from llmc.passes.pipeline import CompileOptions, run_phase
    from llmc.runtime.session import Session

    if not 0.0 < tolerance <= 1.0:
        raise UsageError(f"--tolerance must be in (0, 1], got {tolerance}")
    model = load_model(spec, allow_pickle)
    tokens = model.tokenizer.encode(prompt)
    if not tokens:
        raise UsageError("--prompt gives no tokens")
    c = model.config
    emit(f"model    {model.source} ({c.arch}, {c.layers} layers, hidden {c.hidden}, vocab {c.vocab_size})")
    emit(f"prompt   {prompt!r} ({len(tokens)} tokens)")
    start = time.perf_counter()
    reference = reference_logits(model.source, tokens)
    progress(f"reference computed in {time.perf_counter() - start:.1f} s")

    module = import_model(model)
    max_seq = min(c.context_length, max(64, len(tokens)))
    options = CompileOptions(prefill_chunk=min(128, max_seq), max_seq=max_seq)
    for phase in ("import", "optimize"):
        run_phase(module, phase, options=options)
    llm_logits = forward_logits(module, model.weights, tokens)
    for phase in ("split", "group", "lower"):
        run_phase(module, phase, options=options)
    entries = {name: find_function(module, name) for name in ("prefill", "decode")}
    cache = KVCache.zeros(tgt.dims(entries["decode"].body.block.args[3]))

    def tgt_feed(chunk: list[int], start: int) -> np.ndarray:
        entry = entries["prefill" if start == 0 else "decode"]
        return run_entry(entry, model.weights, np.asarray(chunk, np.int32), start, cache)[0]

    stages: dict[str, Callable[[], np.ndarray]] = {
        "llm": lambda: llm_logits,
        "tgt": lambda: teacher_forced(tgt_feed, tokens),
    }
    with tempfile.TemporaryDirectory(prefix="llmc-verify-") as tmp:
        if artifact is None:
            artifact = build_cpu_artifact(module, model, Path(tmp) / "artifact", BackendOptions(), {}, progress)
        session = Session(artifact)
        stages["artifact"] = lambda: teacher_forced(lambda chunk, start: session.feed(chunk), tokens)
        try:
            return verify_stages(reference, stages, tolerance, reference_name(), emit)
        finally:
            session.close()

