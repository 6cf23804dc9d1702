"""`llmc verify`: run every stage on the same tokens and compare its logits with the source.

One row per stage, like TPU-MLIR's per-stage tensor comparison:

    stage    cosine     max|err|   top-1
    source   reference  (transformers 5.24.0 fp32)
    llm      1.000000   1.84e-05   5/5 (100%)

`cosine` is the lowest cosine similarity over positions; `top-1` counts positions whose
arg-max agrees with the reference.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
