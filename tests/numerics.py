"""How far apart two float32 computations of the same numbers may be, derived from the arithmetic
that separates them, and the one helper that compares them.

Two evaluations that differ only in *summation order* (another token count changes numpy's
blocking; another thread split, another row count or batch changes a kernel's) or in *fused
multiply-adds* (a·b + c rounded once instead of twice) each round every sum of `terms` products
differently. One sum is off by at most γ = terms·u of the magnitude of its terms (u = 2⁻²⁴, the
unit roundoff of float32; Higham, Accuracy and Stability of Numerical Algorithms, §3.1), and by
about √terms·u in practice, rounding errors adding as a random walk. Through `depth` sums that
feed one another the relative errors add. So, for outputs of magnitude up to max|expected|:

    |actual − expected| ≤ depth · √terms · u · max|expected|

A transformer layer chains about `SUMS_PER_LAYER` such sums (RMSNorm, the q/k/v projections,
scores, the weighted values, the output projection, RMSNorm, gate/up, down), then the final norm
and the head: `model_depth(layers)`. On the tiny models (2 layers, 64 wide) the bound is ~3e-4 of
the logit scale, the observed difference ~3e-7, and a wrong position or cache row ~1e-1.
"""

from __future__ import annotations

import math

import numpy as np

U = 2.0 ** -24  # float32 unit roundoff
SUMS_PER_LAYER = 8


def model_depth(layers: int) -> int:
    """The sums that feed one another from a model's embedding to its logits."""
    return SUMS_PER_LAYER * layers + 2


def reorder_bound(expected: np.ndarray, terms: int, depth: int) -> float:
    """The largest difference allowed between two float32 evaluations of `expected` that differ
    only in summation order or fused multiply-adds (sums of at most `terms` products, `depth` deep)."""
    return depth * math.sqrt(terms) * U * float(np.abs(expected).max())


def assert_model_reordered(actual: np.ndarray, expected: np.ndarray, spec) -> None:
    """`actual` equals `expected` up to summation order (`reorder_bound`), for the logits of a tiny
    model (`tiny_models.TinySpec`): its widest sum (hidden, FFN or attention width; the tests feed
    fewer positions than that) and its depth."""
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"shape {actual.shape} != {expected.shape}"
    terms, depth = max(spec.hidden, spec.ffn, spec.heads * spec.head_dim), model_depth(spec.layers)
    bound = reorder_bound(expected, terms, depth)
    err = float(np.abs(actual.astype(np.float64) - expected).max()) if expected.size else 0.0
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g} (sums of {terms} terms, {depth} deep, reordered)"
