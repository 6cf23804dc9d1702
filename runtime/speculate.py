"""Speculative decoding: draft a few tokens cheaply, check them all in one `verify` call.

A decode step reads every weight once for one token; `verify` reads them once for up to
`session.max_verify` rows, so where a step's time is that read, checking k drafted tokens costs
little more than one step. Where the rows' arithmetic costs more (a CPU of few cores whose one-row
step reads the weights from its cache: SmolLM2's 9 rows took 4.8 steps' time), `step` verifies
only as many drafted tokens as pay for their rows, by the calls it has timed (`CallCost`) and the
share of drafts taken so far (`Acceptance`, `worth_verifying`).
Greedy: the drafts are accepted while each equals the model's argmax at its row, and the
model's own token at the first mismatch (or after the last draft) comes free; the rows
past the accepted ones are discarded by `session.rewind` (no copy). Sampled: a draft `x` is
accepted with probability min(1, p(x)/q(x)), and on rejection the token is drawn from
norm(max(p - q, 0)) (Leviathan et al. 2023, Chen et al. 2023), which keeps the target
distribution `p`; the drafters here are deterministic, so q is one-hot at `x`.

Drafters: `PromptLookup` (the continuation of the latest earlier occurrence of the last few
tokens, in the prompt or the text so far; no second model) and `DraftModel` (a smaller
artifact with the same vocabulary, drafting greedily on its own session). `DraftLength`
backs off where drafts are rejected, so text the drafter cannot predict runs as plain decode.

    speculation = Speculation(PromptLookup())
    text = list(generate(session, codec, ids, 128, SamplingOptions(), speculation))
    print(speculation.stats.line())   # 91 of 120 drafted tokens accepted (76%), 2.9 tokens per call
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.codec import TextCodec
from llmc.runtime.sampling import Sampler
from llmc.runtime.session import Conversation

ROW_COST = 0.2  # a call's cost per row after its first, relative to a one-row call, until calls are timed
MARGIN = 1.15  # how much more tokens per second verifying must promise than plain decode (the promise is optimistic)
HOPE = 0.02  # how much likelier a draft is taken after each draft not verified (so drafting is tried again)
DECAY = 0.8  # the weight of the verifies before the latest in `Acceptance`


def next_token(session: Conversation, sampler: Sampler, tokens: list[int]) -> int:
    """Feed `tokens` and choose (and take) the next one: where the sampler is `plain` or `weighed_draw`, the
    session's choice (`Conversation.pick`: by the CPU's threads or on a GPU, where the logits are)."""
    if sampler.plain or sampler.weighed_draw:
        token = session.pick(tokens, sampler)
        sampler.take([token])
        return token
    return sampler(session.feed(tokens))


class Drafter(Protocol):
    """What proposes tokens: told the context (`start`), each token the model took (`extend`)."""

    def start(self, tokens: list[int]) -> None: ...

    def extend(self, tokens: list[int]) -> None: ...

    def draft(self, k: int) -> list[int]: ...


class PromptLookup:
    """Prompt lookup (llama.cpp's lookup, vLLM's ngram): the up-to-k tokens that followed the latest
    earlier occurrence of the last n tokens, n from `max_ngram` down to `min_ngram`. An index of
    every n-gram's latest continuation is kept as tokens arrive: O(max_ngram) work per token.

    >>> lookup = PromptLookup(); lookup.start([5, 6, 7, 8, 9, 1, 6, 7])
    >>> lookup.draft(3)
    [8, 9, 1]
    """

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.tokens: list[int] = []
        self.index: dict[tuple[int, ...], int] = {}  # n-gram → where the token after its latest occurrence is

    def start(self, tokens: list[int]) -> None:
        self.tokens, self.index = [], {}
        self.extend(tokens)

    def extend(self, tokens: list[int]) -> None:
        seen, index = self.tokens, self.index
        for token in tokens:
            end = len(seen)
            for n in range(self.min_ngram, min(self.max_ngram, end) + 1):
                index[tuple(seen[end - n : end])] = end
            seen.append(token)

    def draft(self, k: int) -> list[int]:
        seen, end = self.tokens, len(self.tokens)
        for n in range(min(self.max_ngram, end), self.min_ngram - 1, -1):
            follows = self.index.get(tuple(seen[end - n :]))
            if follows is not None:
                return seen[follows : follows + k]
        return []


def _same_vocabulary(draft: Conversation, target: Conversation) -> str | None:
    """Why two artifacts' tokenizers differ (None where they agree: the same size, the same token ids)."""
    if draft.vocab_size != target.vocab_size:
        return f"a vocabulary of {draft.vocab_size} tokens, the model's has {target.vocab_size}"
    mine, theirs = (TextCodec.from_artifact(s.manifest).tokenizer.get_vocab(with_added_tokens=True)
                    for s in (draft, target))
    if mine != theirs:
        differ = sorted(set(mine.items()) ^ set(theirs.items()))
        return f"a different tokenizer ({len(differ)} token ids differ, e.g. {differ[0]})"
    return None


class DraftModel:
    """A smaller artifact with the same vocabulary drafting greedily on its own session. Its cache holds
    `held` (the context and the drafts fed last time); each `draft` rewinds it to where that agrees with
    the context, feeds the rest, and decodes k tokens."""

    def __init__(self, session: Conversation, target: Conversation, directory: Path | str = "the draft"):
        why = _same_vocabulary(session, target)
        if why:
            raise LlmcError(f"{directory}: cannot draft for this model: {why}")
        self.session = session
        self.tokens: list[int] = []
        self.held: list[int] = []
        self.agree = 0  # `held` and `tokens` agree on at least this many tokens

    def start(self, tokens: list[int]) -> None:
        self.tokens, self.agree = list(tokens), 0

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def draft(self, k: int) -> list[int]:
        session, tokens, held = self.session, self.tokens, self.held
        keep = self.agree
        while keep < min(len(held), len(tokens)) and held[keep] == tokens[keep]:
            keep += 1
        keep = min(keep, len(tokens) - 1)  # (at least one token to feed)
        k = min(k, session.capacity - len(tokens) + 1)
        if k < 1:
            return []
        session.rewind(keep)
        drafts = [session.greedy(tokens[keep:])]
        while len(drafts) < k:
            drafts.append(session.greedy(drafts[-1:]))
        self.held, self.agree = tokens + drafts[:-1], len(tokens)
        return drafts


class DraftLength:
    """How many tokens to draft next: up to `most`, doubled after a draft fully accepted, halved after
    one mostly rejected; at 0, plain decode for `pause` tokens (doubling, up to `longest_pause`, each
    time it comes back to 0), then a probe of one token.

    >>> length = DraftLength(8); length.update(8, 0); length.k
    4
    """

    def __init__(self, most: int, longest_pause: int = 64):
        self.most, self.k, self.longest_pause = most, most, longest_pause
        self.pause, self.waiting = 4, 0

    def next(self) -> int:
        """The draft length for this step (0: a plain decode step)."""
        if self.waiting:
            self.waiting -= 1
            return 0
        return max(self.k, 1)

    def update(self, drafted: int, accepted: int) -> None:
        if accepted == drafted:
            self.k, self.pause = min(self.most, 2 * max(self.k, 1)), 4
        elif 2 * accepted < drafted:
            self.k //= 2
            if self.k == 0:
                self.waiting, self.pause = self.pause, min(2 * self.pause, self.longest_pause)


@dataclass
class SpeculationStats:
    """Drafted and accepted tokens, verify calls, and the tokens they gave (accepted + the model's own)."""

    drafted: int = 0
    accepted: int = 0
    verify_calls: int = 0
    decode_calls: int = 0

    @property
    def acceptance(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_call(self) -> float:
        """Tokens each model call gave after the prompt (plain decode: 1)."""
        calls = self.verify_calls + self.decode_calls
        return (self.accepted + calls) / calls if calls else 0.0

    def line(self) -> str:
        if not self.drafted:  # (prompt lookup found no earlier n-gram to copy, or no token came after the prompt)
            return "nothing drafted"
        return (f"{self.accepted} of {self.drafted} drafted tokens accepted ({self.acceptance:.0%}), "
                f"{self.tokens_per_call:.2f} tokens per call")


class CallCost:
    """Seconds a call of n rows (`decode` or `verify`) is expected to take: a + b·n fitted to the mean time of
    each size timed so far (recent calls weigh most), or `ROW_COST`'s line through the one size timed.

    >>> cost = CallCost(); cost.record(1, 0.030); cost.record(9, 0.078); round(cost(5), 3)
    0.054
    """

    def __init__(self):
        self.seconds: dict[int, float] = {}  # rows → mean seconds
        self.line = (1.0 - ROW_COST, ROW_COST, 0.0)  # intercept, slope, least: before any call is timed

    def record(self, rows: int, seconds: float) -> None:
        mean = self.seconds.get(rows)
        self.seconds[rows] = seconds if mean is None else 0.9 * mean + 0.1 * seconds
        least = min(self.seconds.values())
        if len(self.seconds) == 1:
            scale = seconds / (1 + ROW_COST * (rows - 1))
            self.line = (scale * (1 - ROW_COST), scale * ROW_COST, least)
        else:
            # the standard library's least squares: numpy's would wake OpenBLAS's threads, which spin on the
            # cores the kernels' threads run on
            slope, intercept = statistics.linear_regression(list(self.seconds), list(self.seconds.values()))
            self.line = (intercept, max(slope, 0.0), least)

    def __call__(self, rows: int) -> float:
        intercept, slope, least = self.line
        return max(intercept + slope * rows, least)


class Acceptance:
    """How likely a drafted token is to be taken: the drafts taken over the drafts examined (a verify examines
    its accepted drafts and the first rejected one), recent verifies weighing most (`DECAY`); before any, one
    in two. Taken one after another with that chance, k drafts give 1 + p + … + p^k tokens (the model's own
    among them: Leviathan et al. 2023).

    >>> acceptance = Acceptance(); acceptance.record(4, 4); round(acceptance.rate, 2), round(acceptance.expected(4), 2)
    (0.86, 3.76)
    """

    def __init__(self):
        self.taken, self.examined = 1.0, 2.0

    @property
    def rate(self) -> float:
        return self.taken / self.examined

    def record(self, drafted: int, accepted: int) -> None:
        self.taken = DECAY * self.taken + accepted
        self.examined = DECAY * self.examined + accepted + (accepted < drafted)

    def hope(self) -> None:
        """A draft was not verified (too unlikely for its cost): `HOPE` likelier, so it is tried again."""
        self.taken = min(self.examined, self.taken + HOPE * self.examined)

    def expected(self, k: int) -> float:
        """Tokens a verify of k drafts is expected to give."""
        return float(sum(self.rate ** i for i in range(k + 1)))


def worth_verifying(acceptance: Acceptance, cost: CallCost, drafted: int) -> int:
    """How many of `drafted` tokens to verify alone: the number whose expected tokens a second (`expected` over
    `cost` of its rows and the token before them) is the most, 0 (a plain decode step) unless that beats
    plain decode by `MARGIN`.

    >>> cost = CallCost(); cost.record(1, 1.0); cost.record(9, 5.0)  # each row after the first: ½ a one-row call
    >>> likely = Acceptance(); likely.record(4, 4)
    >>> worth_verifying(Acceptance(), cost, 8), worth_verifying(likely, cost, 8)
    (0, 2)
    """
    best, best_rate = 0, MARGIN / cost(1)
    for k in range(1, drafted + 1):
        rate = acceptance.expected(k) / cost(1 + k)
        if rate > best_rate:
            best, best_rate = k, rate
    return best


@dataclass
class Speculation:
    """A drafter, its adaptive draft length (at most `most` tokens, and what `verify` takes), how likely its
    drafts are taken, what calls cost (timed as they run) and stats."""

    drafter: Drafter
    most: int = 8
    stats: SpeculationStats = field(default_factory=SpeculationStats)
    length: DraftLength | None = None
    acceptance: Acceptance = field(default_factory=Acceptance)
    cost: CallCost = field(default_factory=CallCost)  # (an engine's sequences share the engine's: one call, all rows)

    def start(self, session: Conversation, context: list[int]) -> None:
        """Begin a generation after `context`, the tokens already in the session's cache."""
        if self.length is None:
            self.length = DraftLength(min(self.most, session.max_verify - 1))
        self.drafter.start(context)

    def worth(self, drafts: list[int]) -> list[int]:
        """The first of `drafts` that pay for their rows in a call of their own (`worth_verifying` by `cost`);
        none, and a little more hope (`Acceptance.hope`), where none does."""
        keep = worth_verifying(self.acceptance, self.cost, len(drafts)) if drafts else 0
        if drafts and not keep:
            self.acceptance.hope()
        return drafts[:keep]

    def record(self, drafted: int, accepted: int) -> None:
        """A verify's outcome: `accepted` of `drafted` tokens taken."""
        self.length.update(drafted, accepted)
        self.acceptance.record(drafted, accepted)


def step(session: Conversation, sampler: Sampler, tokens: list[int], most: int,
         speculation: Speculation | None = None, draft: bool = True) -> list[int]:
    """Feed `tokens` and return the next ones (up to `most`): with `speculation`, the accepted drafts (fed
    too) then the model's own token; else (or where nothing is drafted, or not `draft`: a prompt's step, whose
    first token is shown as soon as it exists) the one next token, not yet fed. Of a draft, only as many
    tokens are verified as raise the tokens a second expected (`worth_verifying`, on the calls timed so far:
    where a verify of several rows costs several decode steps, as on a CPU whose one-row step reads the weights
    at the memory's speed, few or none)."""
    if speculation is None:
        return [next_token(session, sampler, tokens)]
    assert speculation.length is not None, "Speculation.start first"
    k = min(speculation.length.next(), most - 1, session.capacity - session.position - len(tokens))
    speculation.drafter.extend(tokens)
    drafts = sampler.drafts(speculation.drafter.draft(k)) if draft and len(tokens) == 1 and k > 0 else []
    drafts = speculation.worth(drafts)
    if not drafts:
        began = time.perf_counter()
        token = next_token(session, sampler, tokens)
        if draft and len(tokens) == 1:
            speculation.cost.record(1, time.perf_counter() - began)
            speculation.stats.decode_calls += 1
        return [token]
    start = session.position
    began = time.perf_counter()
    rows = session.verify(tokens + drafts)
    speculation.cost.record(1 + len(drafts), time.perf_counter() - began)
    accepted, token = accept(sampler, rows, drafts)
    session.rewind(start + 1 + accepted)
    speculation.drafter.extend(drafts[:accepted])
    speculation.record(len(drafts), accepted)
    stats = speculation.stats
    stats.drafted += len(drafts)
    stats.accepted += accepted
    stats.verify_calls += 1
    return drafts[:accepted] + [token]


def accept(sampler: Sampler, rows: np.ndarray, drafts: list[int]) -> tuple[int, int]:
    """How many `drafts` to accept given the model's logits `rows` (row i follows draft i - 1), and the
    token after them: the standard acceptance rule with a one-hot draft distribution, on the sampler's
    processed logits (greedy: while each draft is their argmax). The sampler takes (and records) the
    accepted drafts and the token, row by row, so each row's penalties and grammar mask follow the drafts
    before it; a draft the grammar does not allow is rejected."""
    if sampler.plain:
        best = rows.argmax(axis=1)
        accepted = 0
        while accepted < len(drafts) and best[accepted] == drafts[accepted]:
            accepted += 1
        token = int(best[accepted])
        sampler.take(drafts[:accepted] + [token])
        return accepted, token
    for i, x in enumerate(drafts):
        if sampler.greedy:
            token = sampler.choose(rows[i])
            taken = token == x
        else:
            ids, probs = sampler.distribution(rows[i])
            taken = sampler.rng.random() < probs[ids == x].sum()
            if not taken:
                residual = np.where(ids == x, 0.0, probs)  # norm(max(p - q, 0)), q one-hot at x
                token = sampler.draw(ids, residual)
        if not taken:
            sampler.record(rows[i], token)
            return i, token
        sampler.record(rows[i], x)
    return len(drafts), sampler(rows[len(drafts)])
