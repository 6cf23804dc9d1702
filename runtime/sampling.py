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

from llmc.abi import WEIGH_BLOCK, WEIGH_GROUP

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
    best = _largest(scores, k)
    best = best[np.argsort(-scores[best], kind="stable")]
    chosen, best_scores = scores[token], scores[best]
    scores -= top  # (in place: a second temporary of a vocabulary's float64s is page faults in every call)
    log_sum = top + math.log(np.exp(scores, out=scores).sum())
    return TokenLogprob(int(token), float(chosen - log_sum),
                        tuple((int(i), float(s - log_sum)) for i, s in zip(best, best_scores)))


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
        # what the logits' differences are multiplied by before `exp`: 1 / temperature in float32 (`_temperature`)
        self.scale = np.float32(1.0 / _temperature(options.temperature))
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
        may take the session's own argmax (`session.greedy`, `session.pick`) and then `take` it."""
        return self.greedy and self._raw

    @property
    def weighed_draw(self) -> bool:
        """A draw from the raw logits, with nothing to process or record, that weighs every token: temperature
        alone (the draw's search), or top-p without top-k (the total mass). A caller may take the session's
        choice (`session.pick`, which may weigh the logits where they are: `llmc.abi.WEIGH`, `draw_weighed`)
        and then `take` it. (A top-k or min-p draw finds its head in a few cheaper passes: the sampler's.)"""
        o = self.options
        return not self.greedy and self._raw and not o.top_k and (o.top_p < 1 or o.min_p == 0)

    @property
    def filtered(self) -> bool:
        """Whether top-k, top-p or min-p cut the tokens a draw may choose."""
        o = self.options
        return bool(o.top_k or o.top_p < 1 or o.min_p > 0)

    @property
    def _raw(self) -> bool:
        """Whether the choice is made on the raw logits, and nothing of them is recorded."""
        o = self.options
        return (self.constraint is None and self.generated is None and self.occurred is None and not o.logit_bias
                and o.logprobs is None)

    def __call__(self, logits: np.ndarray) -> int:
        """Choose the next token after `logits`, record its logprobs (if asked) and take it."""
        token = self.choose(logits)
        self.record(logits, token)
        return token

    def choose(self, logits: np.ndarray) -> int:
        """The next token after `logits` (not taken): the processed argmax, or a draw by `weights`."""
        if self.greedy:
            scores = self.processed(logits)
            token = int(np.argmax(scores))
            if scores[token] == -np.inf:
                raise ValueError("no token is allowed next (the grammar and logit-bias exclude all)")
            return token
        return self.draw(*self.weights(logits))

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
        ids, weights = self.weights(logits)
        if ids is None:
            ids = np.flatnonzero(weights)
            weights = weights[ids].astype(np.float64)
        return ids, weights / weights.sum()

    def weights(self, logits: np.ndarray, weighed: tuple[float, float, np.ndarray] | None = None
                ) -> tuple[np.ndarray | None, np.ndarray]:
        """What `distribution` normalizes, in the fewest passes over the vocabulary: where no filter applies,
        `(None, w)` with every token's float32 weight (the likeliest's 1; `exp((score - top) / temperature)`,
        0 for tokens at -inf); else the ids top-k, top-p and min-p keep and their float64 weights, likeliest
        first. Only top-p without top-k weighs every token (for the total mass); the filters find their heads
        among the largest scores (`_largest`), since the order of weights is the order of scores. `weighed`,
        from the team's weighing of raw `logits` (`draw_weighed`), gives the top, the total weight and the
        groups' largest, so that no pass over the vocabulary is left for a filtered draw."""
        o = self.options
        scores = self.processed(logits)
        top, total, maxima = weighed if weighed is not None else (scores.max(), None, None)
        if top == -np.inf:
            raise ValueError("no token is allowed next (the grammar and logit-bias exclude all)")
        if not self.filtered:
            return None, _float32_weights(scores, top, o.temperature)

        def weigh(ids: np.ndarray) -> np.ndarray:
            with np.errstate(over="ignore", invalid="ignore"):  # (a tiny temperature: -inf, weight 0)
                return np.exp((scores[ids].astype(np.float64) - top) / o.temperature)

        if o.top_k:
            ids = _largest(scores, o.top_k, maxima)
            weights = weigh(ids)
            mass = o.top_p * weights.sum()
        else:  # a head of the likeliest, grown 4x at a time until it holds every token top-p or min-p may keep
            mass = np.inf
            if o.top_p < 1:
                mass = o.top_p * float(total if total is not None else
                                       _float32_weights(scores, top, o.temperature).sum())
            size = HEAD
            while True:
                ids = _largest(scores, size, maxima)
                weights = weigh(ids)
                if ids.size == scores.size or weights.sum() > mass * (1 + 1e-9) or weights.min() < o.min_p:
                    break
                size *= 4
        order = np.argsort(-weights)
        ids, weights = ids[order], weights[order]
        keep = int(np.count_nonzero(weights))  # (tokens at -inf last)
        if o.top_p < 1:
            keep = min(keep, int(np.searchsorted(np.cumsum(weights), mass) + 1))
        if o.min_p > 0:
            keep = min(keep, int(np.count_nonzero(weights >= o.min_p)))
        return ids[:keep], weights[:keep]

    def draw_weighed(self, logits: np.ndarray, blocks: np.ndarray, maxima: np.ndarray) -> int | None:
        """`choose` for a `weighed_draw` sampler that is `filtered`, from raw `logits` as the team weighed them
        (`llmc.abi.WEIGH`): `blocks`, each `WEIGH_BLOCK` block's largest logit and its sum of exp((logit −
        largest) · `scale`) (float32 [blocks, 2]), give the top and the total mass, and `maxima`, each
        `WEIGH_GROUP` group's largest logit, the groups where the head is (`weights`): what
        `draw(*weights(logits))` draws, up to the float32 rounding of the blocks' sums. None, drawing nothing,
        where the masses are not finite numbers above 0 (a NaN logit, all at -inf): `choose` then says why.
        (An unfiltered draw is the team's own, `llmc.abi.DRAW`.)"""
        top = float(blocks[:, 0].max())
        with np.errstate(over="ignore", invalid="ignore"):  # (each block's sum times exp((its largest − top) · scale))
            total = float(blocks[:, 1] @ np.exp((blocks[:, 0].astype(np.float64) - top) * float(self.scale)))
        if not (math.isfinite(total) and total > 0):
            return None
        return self.draw(*self.weights(logits, (top, total, maxima)))

    def draw(self, ids: np.ndarray | None, weights: np.ndarray) -> int:
        """One of `ids` (None: 0, 1, …), drawn with probabilities proportional to `weights`: what
        `rng.choice(len(ids), p=weights / weights.sum())` draws, without its checks, normalization and running
        sum over every token, which cost more than the draw (`_search`)."""
        i = _search(weights, self.rng.random())
        return i if ids is None else int(ids[i])


HEAD = 64  # top-p and min-p without top-k: the likeliest tokens weighed first
GROUP = 64  # `_largest`: values a group (at most), whose maxima bound the k-th largest from below
GATHERED = 16  # `_largest`: the team's groups are read where k of them are at most 1/16 of the values
SEARCH_BLOCK = WEIGH_BLOCK  # `_search`: weights whose sum is a step of its first, coarse search (the team's blocks)


def _temperature(temperature: float) -> float:
    """The temperature as the weights take it: at least float32's smallest normal (where every token but the
    likeliest already weighs 0) and at most its largest."""
    finfo = np.finfo(np.float32)
    return min(max(temperature, float(finfo.tiny)), float(finfo.max))


def _float32_weights(scores: np.ndarray, top: float, temperature: float) -> np.ndarray:
    """`exp((scores - top) / temperature)` in float32, in one array (three passes; the float64 copies they
    replace, two alive at once, page-faulted on every call): the likeliest's 1, a token at -inf 0, and so is
    one below float32's range (under e^-103 of the likeliest: never drawn in practice); the temperature as
    `_temperature` takes it."""
    weights = np.subtract(scores, np.float32(top), dtype=np.float32)
    scale = np.float32(_temperature(temperature))
    with np.errstate(over="ignore", invalid="ignore"):
        if scale != 1:
            np.divide(weights, scale, out=weights)
        return np.exp(weights, out=weights)


def _largest(values: np.ndarray, k: int, maxima: np.ndarray | None = None) -> np.ndarray:
    """The indices of the `k` largest `values`, in no order (ties at the k-th either way): found among the
    values at or above the k-th largest maximum of groups of up to `GROUP` values (k values reach it, so the
    k largest do), a few passes over `values` where `np.argpartition` over all of them took 5x as long. Given
    `maxima`, the largest of each `WEIGH_GROUP` values in turn (the team's, `draw_weighed`), only the groups
    whose largest reach the k-th are read, where they are at most a `GATHERED` part of `values` (gathered,
    an element costs ~16x one of a pass: of 262k values, k = 256 took 65 µs against the passes' 103, k = 1024
    200 against 97).

    >>> sorted(_largest(np.array([3.0, 9.0, 1.0, 7.0]), 2).tolist())
    [1, 3]
    """
    n = values.size
    if k >= n or k <= 0:
        return np.arange(n if k > 0 else 0)
    if maxima is not None and k * WEIGH_GROUP * GATHERED <= n:
        least = np.partition(maxima, maxima.size - k)[maxima.size - k]
        ids = (np.flatnonzero(maxima >= least)[:, None] * WEIGH_GROUP + np.arange(WEIGH_GROUP)).ravel()
        ids = ids[ids < n]
        ids = ids[values[ids] >= least]
        if ids.size >= k:  # (not so where NaN is among the values)
            return ids[np.argpartition(values[ids], ids.size - k)[ids.size - k :]]
    group = min(GROUP, n // k)  # k groups at least
    if group >= 2:
        columns = n // group
        maxima = values[: columns * group].reshape(group, columns).max(axis=0)  # group j: j, j + columns, …
        ids = np.flatnonzero(values >= np.partition(maxima, columns - k)[columns - k])
        if ids.size >= k:  # (not so where NaN is among the values)
            return ids[np.argpartition(values[ids], ids.size - k)[ids.size - k :]]
    return np.argpartition(values, n - k)[n - k :]


def _search(weights: np.ndarray, u: float) -> int:
    """The first index where the running sum of `weights` (≥ 0, not all 0) exceeds `u` (in [0, 1)) times their
    total, as `np.searchsorted(np.cumsum(weights), u * total, side="right")` finds it; searched by the sums of
    `SEARCH_BLOCK`-weight blocks, then a running sum within one block (a running sum over 49k weights took
    115 µs). Rounding at the last step lands on the last weight above 0 there (`llmc.abi.DRAW` searches alike).

    >>> _search(np.array([0.0, 1.0, 0.0, 3.0]), 0.5)
    3
    """
    whole = weights.size // SEARCH_BLOCK * SEARCH_BLOCK
    sums = weights[:whole].reshape(-1, SEARCH_BLOCK).sum(axis=1)  # (float32's pairwise sums: 2x as fast)
    if whole < weights.size:
        sums = np.append(sums, weights[whole:].sum())
    running = np.cumsum(sums, dtype=np.float64)
    target = u * running[-1]
    block = int(np.searchsorted(running, target, side="right"))  # (< sums.size: u < 1)
    part = weights[block * SEARCH_BLOCK : (block + 1) * SEARCH_BLOCK]
    i = int(np.searchsorted(np.cumsum(part, dtype=np.float64), target - (running[block - 1] if block else 0.0),
                            side="right"))
    if i == part.size:
        i = int(np.flatnonzero(part)[-1])
    return block * SEARCH_BLOCK + i
