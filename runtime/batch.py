"""Continuous batching: many sequences on one artifact, each in a slot of the KV cache.

An artifact compiled with `--max-batch B` holds B sequences in its cache, and its
`decode` takes one row per sequence (its own token, position and slot): the weights are
read once for all of them. `Engine` schedules requests onto the slots:

- a request waits in a bounded queue until a slot is free (`QueueFull` beyond it);
- each step runs at most one call feeding prompts, then one `decode` over every sequence
  that is generating, so new prompts enter between the decode steps of the others. The
  feeding call takes the prompts being fed in turn (the one fed least recently first), a
  chunk of each as far as its rows reach (`prefill_kv` with several sequences' rows), so a
  short prompt admitted behind long ones is fed at the next step, not after them, and
  prompts that arrive together are fed in one call (the weights read once for all of
  them). A prompt that ends inside the call but not on its last row (whose logits are the
  only ones a feeding call returns) holds its last token back for the step's `decode`:
  such prompts start generating together, in the same decode calls;
- a request ends at its end-of-sequence token, at `max_tokens`, at the cache's capacity
  or when cancelled; its slot is free for the next step.

Prefix caching (llama-server's cache_prompt): the engine remembers the tokens whose K/V each
slot holds (its prompt and the tokens fed after it; not drafts that verify rejected). A new
request takes the free slot whose tokens share the longest prefix with its prompt (ties, and
no common prefix at all: the slot free longest, so a hot prefix is evicted last) and feeds
only the rest of its prompt, from that position (`prefill_kv`). A request asking for its
prompt's logprobs (`prompt_logprobs`, the completions API's echo) runs the whole prompt through
`score` instead, which gives every row's logits and writes the cache as prefill does.

With `speculate`, each generating sequence has a prompt-lookup drafter
(`llmc.runtime.speculate`): a sequence whose drafter proposes tokens runs them after its
own in a `verify` call of its own (the artifact's `score` where it has no `verify`), and
keeps the drafts the model agrees with plus the model's next token (several tokens per
step; rejected rows are left in the cache to be overwritten); the others share the
batched `decode` call. A sequence whose drafts are rejected drafts less, then not at all.
Sampling with a seed does not speculate: the draws would depend on what else runs.
Each verify call costs about as much as a decode call of as many rows: the engine times its
calls (`CallCost`) and, each step, verifies the drafts (likeliest first) only as far as they
raise the tokens per second it expects, so that several sequences decoding together, which
share one call, are not slowed by drafts they could not pay for.

Tokens reach a request through its `emit` callback (with their logprobs when the sampling
options ask), and its end through `finish`, both called on the engine's thread. Only numpy
and the standard library here.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.grammar import GrammarError
from llmc.runtime.sampling import Constraint, Sampler, SamplingOptions, TokenLogprob, log_probs
from llmc.runtime.session import CapacityError, Conversation, aligned_zeros, common_prefix
from llmc.runtime.speculate import MARGIN, CallCost, PromptLookup, Speculation, accept

SWITCH_INTERVAL = 2e-4  # seconds: how long a thread waits for the GIL before the holder is asked to let go


class QueueFull(LlmcError):
    """Every slot is busy and the queue of waiting requests is full."""


@dataclass(eq=False)
class Request:
    """One generation: `prompt` token ids, then up to `max_tokens` new ones.

    `emit(token, logprob)` receives each new token (the end-of-sequence token is not emitted)
    and, when `sampling.logprobs` is set, its `TokenLogprob` (else None); `finish(reason)` is
    called once: "stop" (end of sequence), "length" (`max_tokens` or the cache's capacity),
    "cancelled", "grammar: …" (its grammar failed while generating: a limit of its matcher) or
    "error: …". `constraint` (a grammar's, fresh for this request) masks the tokens it does not
    allow. `prompt_logprobs` (echo) is called once, before the first `emit`, with each prompt
    token's logprobs (None for the first); `max_tokens` may then be 0.

    >>> engine.submit(Request(prompt, 16, emit=lambda token, logprob: print(token)))  # doctest: +SKIP
    """

    prompt: list[int]
    max_tokens: int
    sampling: SamplingOptions = SamplingOptions()
    emit: Callable[[int, TokenLogprob | None], None] = lambda token, logprob: None
    finish: Callable[[str], None] = lambda reason: None
    cancelled: threading.Event = field(default_factory=threading.Event)
    constraint: Constraint | None = None
    prompt_logprobs: Callable[[list[TokenLogprob | None]], None] | None = None

    def cancel(self) -> None:
        """Stop generating (from any thread); the slot is freed at the engine's next step."""
        self.cancelled.set()


@dataclass(eq=False)
class _Sequence:
    request: Request
    slot: int
    sampler: Sampler
    cached: list[int]  # the tokens whose K/V its slot holds, in order (the engine's list for that slot)
    fed: int = 0  # prompt tokens already in the cache (reused or fed)
    fed_at: int = -1  # when its last prompt chunk was fed (the engine's `prompt_tokens` then; -1: never)
    token: int | None = None  # the sampled token not yet fed (None while the prompt is being fed)
    generated: int = 0
    speculation: Speculation | None = None
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=lambda: [None])  # echo's, as scored

    @property
    def position(self) -> int:
        """Where its next token goes in its slot."""
        return len(self.cached)


def _failure(e: Exception) -> str:
    """The finish reason of a sequence whose sampling failed with `e`: the request's grammar, or an error."""
    return f"grammar: {e}" if isinstance(e, GrammarError) else f"error: {e}"


def _finish(request: Request, reason: str) -> None:
    """Tell a request it ended; a failing receiver affects nobody else."""
    try:
        request.finish(reason)
    except Exception:
        pass


class Engine:
    """Schedules requests onto the slots of one session's KV cache (see the module docstring)."""

    def __init__(self, session: Conversation, end_ids: Collection[int], queue_size: int = 64,
                 max_active: int | None = None, speculate: bool = False):
        """`end_ids`: the tokens that end a sequence (`TextCodec.end_ids`); `max_active` sequences at once (default:
        every slot of the cache); `queue_size` requests waiting beyond them; `speculate`: draft by prompt lookup and
        verify (see the module docstring)."""
        active = session.slot_count if max_active is None else max_active
        if not 1 <= active <= session.slot_count:
            raise LlmcError(f"--max-batch must be in 1..{session.slot_count} (the sequences this artifact's cache "
                            f"holds; compile with a larger --max-batch), got {active}")
        self.session = session
        session.reset()  # (the engine writes the slots' rows now: what the conversation held is forgotten)
        self.end_ids = frozenset(end_ids)
        self.queue_size = queue_size
        self.max_active = active
        self.free = list(range(active))  # the free slots, the one free longest first
        self.cached: list[list[int]] = [[] for _ in range(active)]  # each slot's tokens in the cache, in order
        self.prompt_tokens = 0  # prompt tokens fed
        self.reused_tokens = 0  # prompt tokens taken from a slot's cache instead
        self.waiting: deque[Request] = deque()
        self.running: list[_Sequence] = []
        self.logits = aligned_zeros((session.batch, session.vocab_size), np.float32)
        self.steps = 0  # decode calls so far
        self.decoded_rows = 0  # sequences' tokens those calls produced
        self.speculate = speculate
        self.verify_logits = aligned_zeros((session.max_verify, session.vocab_size), np.float32)
        self.score_logits: np.ndarray | None = None  # every row's logits of `score` (echo), when first run
        # a compiled `verify` takes rows of several slots, as `decode` does (`score`, standing in, one slot's)
        self.together = "verify" in session.manifest.entry_points
        self.cost = CallCost()
        self.verify_calls = 0
        self.drafted = 0  # draft tokens verified
        self.accepted = 0  # of them, those the model agreed with
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    def check_prompt(self, prompt: list[int], generating: bool = True) -> None:
        """Raise ValueError (or CapacityError) for a prompt this artifact cannot run: one that leaves the
        cache no room for a token, or, `generating` false (scoring alone: echo, max_tokens 0), one longer
        than the cache."""
        if not prompt:
            raise ValueError("the prompt has no tokens")
        if min(prompt) < 0 or max(prompt) >= self.session.vocab_size:
            raise ValueError(f"a prompt token id is outside the vocabulary of {self.session.vocab_size}")
        if len(prompt) + generating > self.session.capacity:
            raise CapacityError(f"the prompt has {len(prompt)} tokens; the KV cache holds {self.session.capacity} "
                                f"per sequence, prompt and completion together ({self.session.larger_capacity})")

    def check(self, request: Request) -> None:
        """Raise ValueError (or CapacityError) for a request this artifact cannot run."""
        request.sampling.check()
        least = 0 if request.prompt_logprobs is not None else 1  # (echo alone generates nothing)
        if request.max_tokens < least:
            raise ValueError(f"max_tokens must be at least {least}, got {request.max_tokens}")
        self.check_prompt(request.prompt, request.max_tokens > 0)

    def submit(self, request: Request) -> None:
        """Queue `request` (checked first); raises QueueFull when every slot is taken and `queue_size`
        requests are already waiting."""
        self.check(request)
        with self._wake:
            if self._stopping:
                raise LlmcError("the engine is shutting down")
            live = sum(not r.cancelled.is_set() for r in self.waiting)  # (cancelled ones end at the next step)
            if live >= self.queue_size + len(self.free):  # (the free slots admit at the next step)
                raise QueueFull(f"all {self.max_active} slots are busy and {self.queue_size} requests are waiting")
            self.waiting.append(request)
            self._wake.notify()

    def stats(self) -> dict[str, int]:
        """What the engine holds now and has done: sequences running and waiting, decode calls and the
        tokens they produced, prompt tokens fed and reused from a slot's cache, speculation's counts."""
        with self._wake:
            return {"slots": self.max_active, "running": len(self.running), "waiting": len(self.waiting),
                    "queue_size": self.queue_size, "decode_steps": self.steps, "decoded_tokens": self.decoded_rows,
                    "prompt_tokens": self.prompt_tokens, "reused_tokens": self.reused_tokens,
                    "speculate": self.speculate, "verify_calls": self.verify_calls, "drafted_tokens": self.drafted,
                    "accepted_tokens": self.accepted}

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ scheduling

    def _end(self, seq: _Sequence, reason: str) -> None:
        self.running.remove(seq)
        self.free.append(seq.slot)
        _finish(seq.request, reason)

    def _slot_for(self, request: Request) -> tuple[int, int]:
        """The free slot whose cached tokens share the longest prefix with `request`'s prompt (the one free
        longest among equals), and how many of them it reuses: at most all but the prompt's last token, which
        is fed for its logits; none for a request that scores its prompt (`prompt_logprobs`)."""
        if request.prompt_logprobs is not None:
            return self.free[0], 0
        prompt = request.prompt
        shared = [min(common_prefix(self.cached[slot], prompt), len(prompt) - 1) for slot in self.free]
        best = shared.index(max(shared))  # (the first of equals: the one free longest)
        return self.free[best], shared[best]

    def _admit(self) -> None:
        """Drop the waiting requests that were cancelled, then give free slots to the first waiting, each the
        slot whose cache it reuses most (`_slot_for`)."""
        with self._wake:
            dropped = [r for r in self.waiting if r.cancelled.is_set()]
            for request in dropped:
                self.waiting.remove(request)
            while self.free and self.waiting:
                request = self.waiting.popleft()
                slot, reuse = self._slot_for(request)
                self.free.remove(slot)
                del self.cached[slot][reuse:]
                self.reused_tokens += reuse
                sampler = Sampler(request.sampling, request.constraint, request.prompt)
                seq = _Sequence(request, slot, sampler, self.cached[slot], fed=reuse)
                if self.speculate and (seq.sampler.greedy or request.sampling.seed is None):
                    seq.speculation = Speculation(PromptLookup(), cost=self.cost)
                    seq.speculation.start(self.session, request.prompt)
                self.running.append(seq)
        for request in dropped:  # (outside the lock, on this thread, as every callback)
            _finish(request, "cancelled")

    def _next(self, seq: _Sequence, logits: np.ndarray) -> None:
        """Sample after `logits`, then `_take` the token (a failure ends this sequence only)."""
        try:
            token = seq.sampler(logits)
        except Exception as e:
            self._end(seq, _failure(e))
            return
        self._take(seq, [token])

    def _take(self, seq: _Sequence, tokens: list[int]) -> None:
        """Emit `tokens` in order (all but the last already fed), each with its logprobs where the sampler
        recorded them, or end the sequence at the first that ends it."""
        logprobs = seq.sampler.taken_logprobs() or [None] * len(tokens)
        for token, logprob in zip(tokens, logprobs, strict=True):
            if token in self.end_ids:
                self._end(seq, "stop")
                return
            seq.generated += 1
            try:
                seq.request.emit(token, logprob)
            except Exception as e:  # a failing receiver ends its own request only
                self._end(seq, f"error: {e}")
                return
            if seq.generated >= seq.request.max_tokens:
                self._end(seq, "length")
                return
        if seq.position >= self.session.capacity:
            self._end(seq, "length")
            return
        seq.token = tokens[-1]
        if seq.speculation is not None:
            seq.speculation.drafter.extend(tokens)

    def _feed_prompts(self) -> None:
        """One call feeding the prompts being fed, the one fed least recently first, as far as the call's rows
        reach (`prefill_kv`'s `max_tokens`): one sequence's chunk alone as `prefill` (or `prefill_kv` after the tokens
        already in its slot), several sequences' chunks together as `prefill_kv`. The call's logits are its last
        row's: a sequence whose prompt ends in the call but not on its last row holds its prompt's last token
        back, and `decode` feeds it beside the generating sequences' tokens, so prompts that arrive together
        start generating together. A request that asks for its prompt's logprobs runs its chunk alone through
        `score`, in its turn."""
        feeding = sorted((s for s in self.running if s.token is None), key=lambda s: s.fed_at)
        if not feeding:
            return
        if feeding[0].request.prompt_logprobs is not None:
            self._score_chunk(feeding[0])
            return
        room = self.session.manifest.entry_points["prefill_kv"]["max_tokens"]
        calls: list[tuple[_Sequence, list[int]]] = []
        for seq in (s for s in feeding if s.request.prompt_logprobs is None):
            if room == 0:
                break
            chunk = seq.request.prompt[seq.fed : seq.fed + room]
            calls.append((seq, chunk))
            room -= len(chunk)
        held = [seq for seq, chunk in calls[:-1] if seq.fed + len(chunk) == len(seq.request.prompt)]
        calls = [(seq, chunk[:-1] if seq in held else chunk) for seq, chunk in calls]
        calls = [(seq, chunk) for seq, chunk in calls if chunk]
        last = calls[-1][0]
        tokens = [t for _, chunk in calls for t in chunk]
        entry = "prefill" if len(calls) == 1 and last.position == 0 else "prefill_kv"
        self.session.run(entry, np.asarray(tokens, np.int32),
                         np.concatenate([np.arange(seq.position, seq.position + len(chunk)) for seq, chunk in calls]),
                         np.concatenate([np.full(len(chunk), seq.slot) for seq, chunk in calls]), self.logits)
        for seq, chunk in calls:
            self._fed(seq, chunk)
        for seq in held:
            seq.token = seq.request.prompt[-1]
            self._fed(seq, [seq.token], cached=False)
        if last.fed == len(last.request.prompt):
            self._prompt_done(last, self.logits[0])

    def _score_chunk(self, seq: _Sequence) -> None:
        """One chunk of `seq`'s prompt through `score` (every row's logits: the prompt's logprobs)."""
        prompt = seq.request.prompt
        if self.score_logits is None:
            self.score_logits = aligned_zeros(self.session.manifest.entry_points["score"]["logits"], np.float32)
        chunk = prompt[seq.fed : seq.fed + self.session.manifest.entry_points["score"]["max_tokens"]]
        self.session.run("score", np.asarray(chunk, np.int32), np.arange(seq.position, seq.position + len(chunk)),
                         np.full(len(chunk), seq.slot), self.score_logits)
        k = seq.request.sampling.logprobs or 0
        seq.prompt_logprobs += [log_probs(self.score_logits[i], prompt[seq.fed + i + 1], k)
                                for i in range(min(len(chunk), len(prompt) - 1 - seq.fed))]
        self._fed(seq, chunk)
        if seq.fed == len(prompt):
            self._prompt_done(seq, self.score_logits[len(chunk) - 1])

    def _fed(self, seq: _Sequence, chunk: list[int], cached: bool = True) -> None:
        """Count `chunk` of `seq`'s prompt fed, at this point of the prompts fed: its K/V in the slot now (`cached`
        false: from this step's decode, which puts the token in `seq.cached`)."""
        seq.fed += len(chunk)
        if cached:
            seq.cached.extend(chunk)
        self.prompt_tokens += len(chunk)
        seq.fed_at = self.prompt_tokens

    def _prompt_done(self, seq: _Sequence, logits: np.ndarray) -> None:
        """After the prompt's last token: hand over its logprobs (echo), then the first token, unless the
        request generates none."""
        request = seq.request
        if request.prompt_logprobs is not None:
            try:
                request.prompt_logprobs(seq.prompt_logprobs)
            except Exception as e:  # a failing receiver ends its own request only
                self._end(seq, f"error: {e}")
                return
            if request.max_tokens == 0:
                self._end(seq, "length")
                return
        self._next(seq, logits)

    def _draft(self, seq: _Sequence) -> list[int]:
        """The tokens `seq`'s drafter proposes after its next one: no more than its draft length, the tokens it
        may still emit after the next one, and the cache rows left after it; and of them as many as would pay
        for their rows in a call of their own (`Speculation.worth`; which drafts pay beside the others' rows is
        `_worth_verifying`'s)."""
        speculation = seq.speculation
        if speculation is None:
            return []
        room = min(seq.request.max_tokens - seq.generated - 1, self.session.capacity - seq.position - 1)
        k = min(speculation.length.next(), room)
        return speculation.worth(seq.sampler.drafts(speculation.drafter.draft(k)) if k > 0 else [])

    def _verify(self, groups: list[tuple[_Sequence, list[int]]]) -> None:
        """Run each sequence's next token and its draft in one `verify` call; take the drafts the model agrees
        with and its next token."""
        tokens = np.array([t for seq, draft in groups for t in (seq.token, *draft)], np.int32)
        positions = np.concatenate([np.arange(seq.position, seq.position + 1 + len(draft)) for seq, draft in groups])
        slots = np.concatenate([np.full(1 + len(draft), seq.slot) for seq, draft in groups])
        start = time.perf_counter()
        self.session.run("verify", tokens, positions, slots, self.verify_logits)
        self.cost.record(tokens.size, time.perf_counter() - start)
        self.verify_calls += 1
        row = 0
        for seq, draft in groups:
            logits, row = self.verify_logits[row : row + 1 + len(draft)], row + 1 + len(draft)
            try:
                accepted, token = accept(seq.sampler, logits, draft)
            except Exception as e:
                self._end(seq, _failure(e))
                continue
            if draft:
                self.drafted += len(draft)
                self.accepted += accepted
                seq.speculation.record(len(draft), accepted)
            seq.cached += [seq.token, *draft[:accepted]]  # (the rows after them are discarded)
            self._take(seq, draft[:accepted] + [token])

    @staticmethod
    def _expected(seq: _Sequence, draft: list[int]) -> float:
        """Tokens a verify of `draft` is expected to give (`Acceptance.expected`)."""
        return seq.speculation.acceptance.expected(len(draft))

    def _worth_verifying(self, drafted: list[tuple[_Sequence, list[int]]], others: int) -> int:
        """How many of `drafted` (best first) to verify, beside `others` generating sequences without a draft:
        the number that gives the most tokens per second expected (none unless that beats plain decode by
        `MARGIN`). In one call of every sequence's rows (`together`), or one call per draft and a decode call."""
        total = others + len(drafted)
        best, best_rate = 0, MARGIN * total / self.cost(total)
        gain = own_calls = 0.0  # accepted drafts expected; seconds of the verify calls of their own
        rows = total
        for count, (seq, draft) in enumerate(drafted, 1):
            gain += self._expected(seq, draft) - 1
            if self.together:
                rows += len(draft)
                seconds = self.cost(rows)
            else:
                own_calls += self.cost(1 + len(draft))
                seconds = own_calls + (self.cost(total - count) if total > count else 0)
            if (total + gain) / seconds > best_rate:
                best, best_rate = count, (total + gain) / seconds
        return best

    def _decode(self) -> None:
        """Verify the drafts worth it (`_worth_verifying`): in one `verify` call with every generating sequence's
        next token (`together`), or each in a call of its own beside one `decode` over the others; else one
        `decode` over every generating sequence (at most one per slot: decode's rows)."""
        ready, drafted = [], []
        for seq in [s for s in self.running if s.token is not None]:
            draft = self._draft(seq)
            if draft:
                drafted.append((seq, draft))
            else:
                ready.append(seq)
        drafted.sort(key=lambda pair: -self._expected(*pair) / len(pair[1]))
        if self.together:  # (the drafts that fit beside every sequence's next token)
            room = self.session.max_verify - len(ready) - len(drafted)
            for i, (seq, draft) in enumerate(drafted):
                drafted[i] = (seq, draft[: max(room, 0)])
                room -= len(drafted[i][1])
            ready += [seq for seq, draft in drafted if not draft]
            drafted = [(seq, draft) for seq, draft in drafted if draft]
        verified = self._worth_verifying(drafted, len(ready))
        for seq, _ in drafted[verified:]:
            ready.append(seq)
            seq.speculation.acceptance.hope()
        if self.together and verified:
            self._verify(drafted[:verified] + [(seq, []) for seq in ready])
            return
        for pair in drafted[:verified]:
            self._verify([pair])
        if not ready:
            return
        tokens = np.array([s.token for s in ready], np.int32)
        positions = np.array([s.position for s in ready], np.int32)
        slots = np.array([s.slot for s in ready], np.int32)
        start = time.perf_counter()  # (the same logits array every step: `run` checks it and takes its address once)
        if any(s.sampler.plain or s.sampler.weighed_draw for s in ready):  # the plain rows' tokens: the session's
            picks = self.session.decode_picks(tokens, positions, slots, self.logits, [s.sampler for s in ready])
        else:
            picks = [None] * len(ready)
            self.session.run("decode", tokens, positions, slots, self.logits)
        self.cost.record(len(ready), time.perf_counter() - start)
        self.steps += 1
        self.decoded_rows += len(ready)
        for row, (seq, token) in enumerate(zip(ready, picks)):
            seq.cached.append(seq.token)
            if token is not None:
                seq.sampler.take([token])
                self._take(seq, [token])
            else:
                self._next(seq, self.logits[row])

    def step(self) -> None:
        """Admit, drop cancelled sequences, feed the prompts being fed (one call), decode every generating sequence."""
        self._admit()
        for seq in [s for s in self.running if s.request.cancelled.is_set()]:
            self._end(seq, "cancelled")
        try:
            self._feed_prompts()
            self._decode()
        except Exception as e:  # a failed call ends its sequences, not the engine
            for seq in list(self.running):
                seq.cached.clear()  # (what the call wrote is unknown)
                self._end(seq, f"error: {e}")

    # ------------------------------------------------------------------ the engine's thread

    def start(self) -> None:
        """Run steps on a background thread until `close`.

        Each step hands the GIL between this thread, the session's worker threads (which
        return from native code and meet at a barrier) and whatever else runs in the
        process (a server's event loop): at Python's default switch interval (5 ms) every
        hand-off to a thread waiting on a busy one costs up to 5 ms, longer than a decode
        step. The interval is set to `SWITCH_INTERVAL` for the process."""
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL))
        self._thread = threading.Thread(target=self._loop, daemon=True, name="llmc-engine")
        self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not (self.busy or self._stopping):
                    self._wake.wait()
                if self._stopping:
                    break
            self.step()
        for seq in list(self.running):
            self._end(seq, "cancelled")
        while self.waiting:
            _finish(self.waiting.popleft(), "cancelled")

    def close(self) -> None:
        """Stop the thread (running and waiting requests end "cancelled")."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
