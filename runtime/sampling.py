"""Choosing the next token from logits: logit processing (bias, penalties, a grammar's mask), then greedy or
temperature / top-k / top-p / min-p sampling; the chosen tokens' logprobs on request.

    sampler = Sampler(SamplingOptions(temperature=0.7, presence_penalty=0.5, logprobs=2), context=prompt)
    token = sampler(session.feed(prompt))      # chosen, recorded, taken into the penalties' counts
    sampler.taken_logprobs()                   # [TokenLogprob(token=…, logprob=-0.4, top=((…, -0.4), (…, -1.9)))]
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np

MOST_LOGPROBS = 20  # OpenAI's limit on top_logprobs
# repetition penalties from 1/10 to 10: past them, a score divided or multiplied by the penalty reaches inf
REPETITION_PENALTIES = (0.1, 10.0)


@dataclass(frozen=True)
class SamplingOptions:
    """How to choose each token. `temperature = 0` is greedy; `top_k = 0`, `top_p = 1`, `min_p = 0` disable
    those filters; the penalties and `logit_bias` change the logits first (see `Sampler.processed`).

    >>> SamplingOptions(0.8, top_p=0.95, frequency_penalty=0.5, logit_bias=((50256, -100.0),)).check()
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    min_p: float = 0.0  # drop tokens below min_p × the top token's probability
    presence_penalty: float = 0.0  # OpenAI's, over the generated tokens (-2..2)
    frequency_penalty: float = 0.0  # OpenAI's, over the generated tokens (-2..2)
    repetition_penalty: float = 1.0  # HF/llama.cpp's, over prompt + generated tokens (0.1..10)
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias -100..100), OpenAI's
    logprobs: int | None = None  # None: none; k >= 0: the chosen token's logprob and the k likeliest (k <= 20)

    def check(self) -> None:
        """Raise ValueError naming the first option out of its range."""
        if not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0, got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min-p must be in [0, 1], got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= getattr(self, name) <= 2:
                raise ValueError(f"{name.replace('_', '-')} must be in [-2, 2], got {getattr(self, name)}")
        low, high = REPETITION_PENALTIES
        if not low <= self.repetition_penalty <= high:
            raise ValueError(f"repetition-penalty must be in [{low:g}, {high:g}] (1: none), got "
                             f"{self.repetition_penalty:g}")
        seen = set()
        for token, bias in self.logit_bias:
            if token in seen:  # (a map in OpenAI's API; the CLI's --logit-bias added them up, past the range)
                raise ValueError(f"logit-bias: token {token} is given twice")
            seen.add(token)
            if not isinstance(token, (int, np.integer)) or token < 0:
                raise ValueError(f"logit-bias: a token id must be an integer >= 0, got {token!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit-bias: the bias of token {token} must be in [-100, 100], got {bias}")
        if self.logprobs is not None and not 0 <= self.logprobs <= MOST_LOGPROBS:
            raise ValueError(f"logprobs must be in 0..{MOST_LOGPROBS}, got {self.logprobs}")


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability under the model's raw distribution (the log-softmax of its logits, before
    temperature, penalties or a grammar's mask) and the `k` likeliest tokens there, likeliest first."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


def log_probs(logits: np.ndarray, token: int, k: int) -> TokenLogprob:
    """`token`'s log-softmax under `logits` and the `k` likeliest (id, logprob):
    `log_probs(np.log([0.5, 0.25, 0.25]), 1, 1)` is `TokenLogprob(1, log 0.25, ((0, log 0.5),))`."""
    scores = logits.astype(np.float64)
    top = scores.max()
    log_sum = top + math.log(np.exp(scores - top).sum())
    best = np.argpartition(-scores, k - 1)[:k] if 0 < k < scores.size else np.arange(scores.size if k else 0)
    best = best[np.argsort(-scores[best], kind="stable")]
    return TokenLogprob(int(token), float(scores[token] - log_sum),
                        tuple((int(i), float(scores[i] - log_sum)) for i in best))


class Constraint(Protocol):
    """What restricts the next token (a grammar's matcher, `llmc.runtime.grammar`)."""

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens allowed next."""
        ...

    def consume(self, tokens: list[int]) -> None: ...

    def rollback(self, count: int) -> None: ...

    def admissible(self, tokens: list[int]) -> int:
        """How many of `tokens`, in order, it would accept (consuming none)."""
        ...


class _Counts:
    """How often each token occurred, kept as arrays as tokens arrive (O(1) each): `ids[:n]`, `counts[:n]`."""

    def __init__(self, tokens: Sequence[int] = ()):
        self.where: dict[int, int] = {}
        self.ids = np.zeros(64, np.int64)
        self.counts = np.zeros(64, np.float32)
        self.add(tokens)

    def add(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            slot = self.where.get(token)
            if slot is None:
                slot = self.where[token] = len(self.where)
                if slot == self.ids.size:
                    self.ids, self.counts = (np.concatenate([a, np.zeros_like(a)]) for a in (self.ids, self.counts))
                self.ids[slot] = token
            self.counts[slot] += 1

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        n = len(self.where)
        return self.ids[:n], self.counts[:n]


class Sampler:
    """Chooses tokens for one generation: processes each step's logits (`processed`), picks the argmax
    (greedy) or draws from `distribution`, records its logprobs when asked, and takes it (the penalties'
    counts, the constraint). `context` are the prompt's tokens, which `repetition_penalty` counts.

    >>> sampler = Sampler(SamplingOptions(logit_bias=((3, 100.0),)))
    >>> sampler(np.zeros(8, np.float32))
    3
    """

    def __init__(self, options: SamplingOptions, constraint: Constraint | None = None, context: Sequence[int] = ()):
        options.check()
        self.options = options
        self.constraint = constraint
        self.rng = np.random.default_rng(options.seed)
        self.bias_ids = np.array([token for token, _ in options.logit_bias], np.int64)
        self.biases = np.array([bias for _, bias in options.logit_bias], np.float32)
        penalized = options.presence_penalty != 0 or options.frequency_penalty != 0
        self.generated = _Counts() if penalized else None  # for presence/frequency
        self.occurred = _Counts(context) if options.repetition_penalty != 1 else None  # prompt + generated
        self.logprobs: list[TokenLogprob] = []

    @property
    def greedy(self) -> bool:
        """Whether every choice is the argmax of the processed logits (temperature 0, or top-k 1)."""
        return self.options.temperature == 0 or self.options.top_k == 1

    @property
    def plain(self) -> bool:
        """Greedy with nothing to process or record: the argmax of the raw logits is the choice, so a caller
        may take the session's own argmax (`session.greedy`) and then `take` it."""
        o = self.options
        return (self.greedy and self.constraint is None and self.generated is None and self.occurred is None
                and not o.logit_bias and o.logprobs is None)

    def __call__(self, logits: np.ndarray) -> int:
        """Choose the next token after `logits`, record its logprobs (if asked) and take it."""
        token = self.choose(logits)
        self.record(logits, token)
        return token

    def choose(self, logits: np.ndarray) -> int:
        """The next token after `logits` (not taken): the processed argmax, or a draw from `distribution`."""
        if self.greedy:
            scores = self.processed(logits)
            token = int(np.argmax(scores))
            if scores[token] == -np.inf:
                raise ValueError("no token is allowed next (the grammar and logit-bias exclude all)")
            return token
        return self.draw(*self.distribution(logits))

    def record(self, logits: np.ndarray, token: int) -> None:
        """Take `token`, chosen after `logits`, recording its logprobs there when `options.logprobs` asks."""
        if self.options.logprobs is not None:
            self.logprobs.append(log_probs(logits, token, self.options.logprobs))
        self.take([token])

    def take(self, tokens: list[int]) -> None:
        """Tokens chosen (into the penalties' counts and the constraint), e.g. the session's greedy argmax."""
        if self.generated is not None:
            self.generated.add(tokens)
        if self.occurred is not None:
            self.occurred.add(tokens)
        if self.constraint is not None:
            self.constraint.consume(tokens)

    def taken_logprobs(self) -> list[TokenLogprob]:
        """The logprobs of the tokens chosen since the last call, in order (none unless `options.logprobs`)."""
        taken, self.logprobs = self.logprobs, []
        return taken

    def drafts(self, tokens: list[int]) -> list[int]:
        """The longest prefix of drafted `tokens` the constraint admits (all of them without one)."""
        return tokens if self.constraint is None else tokens[: self.constraint.admissible(tokens)]

    def processed(self, logits: np.ndarray) -> np.ndarray:
        """`logits` after, in order: logit_bias (added), repetition_penalty (positive logits of the tokens
        seen in prompt + generated divided by it, negative ones multiplied), presence and frequency penalties
        (`logit -= presence·[count > 0] + frequency·count` over the generated tokens), and the constraint
        (tokens it does not allow at -inf). A copy where anything applies, else `logits` itself."""
        o = self.options
        if not (o.logit_bias or self.occurred is not None or self.generated is not None or self.constraint is not None):
            return logits
        scores = np.array(logits, np.float32)
        if o.logit_bias:
            if self.bias_ids.max() >= scores.size:
                raise ValueError(f"logit-bias: token {self.bias_ids.max()} is not in the vocabulary of "
                                 f"{scores.size} tokens")
            np.add.at(scores, self.bias_ids, self.biases)
        if self.occurred is not None:
            ids, _ = self.occurred.arrays()
            chosen = scores[ids]
            penalty = o.repetition_penalty
            scores[ids] = np.where(chosen > 0, chosen / penalty, chosen * penalty)
        if self.generated is not None:
            ids, counts = self.generated.arrays()
            scores[ids] -= o.presence_penalty + o.frequency_penalty * counts
        if self.constraint is not None:
            allowed = self.constraint.allowed()
            scores[: allowed.size][~allowed[: scores.size]] = -np.inf
            scores[allowed.size :] = -np.inf
        return scores

    def distribution(self, logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ids this sampler may choose after raw `logits` (temperature > 0) and their probabilities:
        `processed`, then temperature, top-k, top-p and min-p; likeliest first where a filter applies (else in
        id order), e.g. `ids, probs = sampler.distribution(logits)`, `probs.sum() == 1`."""
        o = self.options
        scores = self.processed(logits).astype(np.float64)
        top = scores.max()
        if top == -np.inf:
            raise ValueError("no token is allowed next (the grammar and logit-bias exclude all)")
        scores -= top
        with np.errstate(over="ignore", invalid="ignore"):  # ≤ 0, and -inf far below the top at a tiny temperature
            scores /= o.temperature
        weights = np.exp(scores, out=scores)  # the top one's 1
        ids = np.flatnonzero(weights)
        weights = weights[ids]
        if 0 < o.top_k < ids.size:
            best = np.argpartition(-weights, o.top_k - 1)[: o.top_k]
            ids, weights = ids[best], weights[best]
        if o.top_k or o.top_p < 1 or o.min_p > 0:
            total = weights.sum()
            ids, weights = _likeliest(ids, weights, o.top_p * total, o.min_p)
            keep = ids.size
            if o.top_p < 1:
                keep = int(np.searchsorted(np.cumsum(weights), o.top_p * total) + 1)
            if o.min_p > 0:
                keep = min(keep, int(np.count_nonzero(weights >= o.min_p)))
            ids, weights = ids[:keep], weights[:keep]
        return ids, weights / weights.sum()

    def draw(self, ids: np.ndarray, probs: np.ndarray) -> int:
        """One of `ids`, drawn with `probs` (as `rng.choice(len(ids), p=probs)` draws, without its checks of
        `probs`, which cost more than the draw over a whole vocabulary)."""
        cdf = np.cumsum(probs)
        cdf /= cdf[-1]
        return int(ids[np.searchsorted(cdf, self.rng.random(), side="right")])


def _likeliest(ids: np.ndarray, weights: np.ndarray, mass: float, min_p: float) -> tuple[np.ndarray, np.ndarray]:
    """`ids` and their `weights` (the top one's 1) sorted likeliest first, cut to a head that holds every token
    top-p (the head reaching `mass`) or min-p (weights >= `min_p`) may keep: a partial sort grown 4x at a time,
    not a sort of the whole vocabulary."""
    size = 64
    while size < ids.size:
        head = np.argpartition(-weights, size - 1)[:size]
        if weights[head].sum() > mass * (1 + 1e-9) or weights[head].min() < min_p:
            ids, weights = ids[head], weights[head]
            break
        size *= 4
    order = np.argsort(-weights)
    return ids[order], weights[order]
