"""Choosing the next token from logits: greedy, or temperature / top-k / top-p sampling."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class SamplingOptions:
    """`temperature = 0` is greedy; `top_k = 0` and `top_p = 1` disable those filters."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def check(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")


class Sampler:
    def __init__(self, options: SamplingOptions):
        options.check()
        self.options = options
        self.rng = np.random.default_rng(options.seed)

    @property
    def greedy(self) -> bool:
        """Whether every choice is the argmax (temperature 0, or top-k 1)."""
        return self.options.temperature == 0 or self.options.top_k == 1

    def __call__(self, logits: np.ndarray) -> int:
        if self.options.temperature == 0:
            return int(np.argmax(logits))
        return self.draw(*self.distribution(logits))

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids this sampler may choose from `logits` (temperature > 0) and their probabilities, after
        temperature, top-k and top-p: e.g. `ids, probs = sampler.distribution(logits)`, `probs.sum() == 1`."""
        o = self.options
        logits = logits.astype(np.float64)
        with np.errstate(over="ignore"):  # ≤ 0, and -inf far below the top at a tiny temperature
            scores = (logits - logits.max()) / o.temperature
        order = np.argsort(-scores)
        if o.top_k:
            order = order[: o.top_k]
        probs = np.exp(scores[order])
        probs /= probs.sum()
        if o.top_p < 1:
            keep = int(np.searchsorted(np.cumsum(probs), o.top_p) + 1)
            order, probs = order[:keep], probs[:keep] / probs[:keep].sum()
        return order, probs

    def draw(self, ids: np.ndarray, probs: np.ndarray) -> int:
        """One of `ids`, drawn with `probs`."""
        return int(ids[self.rng.choice(len(ids), p=probs)])
