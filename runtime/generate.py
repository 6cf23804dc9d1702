"""Text in, text out: run the session on a prompt, sample, write the text as tokens arrive.

    generation = generate(session, codec, codec.encode("Once upon a time"), 64, SamplingOptions())
    tokens = stream_text(codec, generation, sys.stdout.write, generation.prompt, StopStrings(["\\n\\n"]))
    generation.reason, generation.reused   # ("length", 0): 64 tokens, nothing taken from the cache

A generation starts from what the session's cache already holds: the longest prefix it shares
with the prompt stays (`Conversation.reuse`), so a program calling `generate` again on a longer
or similar prompt feeds only the rest.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator, Sequence

from llmc.runtime.codec import TextCodec
from llmc.runtime.sampling import Constraint, Sampler, SamplingOptions
from llmc.runtime.session import CapacityError, Conversation
from llmc.runtime.speculate import Speculation, step


class Generation:
    """Up to `max_tokens` new token ids after `prompt`, yielded as they are chosen (iterate once), stopping
    after the end-of-text token (not yielded) or where the cache is full; with `speculation`, several tokens
    per model call where its drafts are accepted (greedy: the same tokens); with `constraint`, only tokens
    its grammar allows. Once iterated: `reason` ("eos", "length" or "full"; None where the reader stopped
    first), `reused` (prompt tokens the cache held already), `prompt_seconds` (feeding the rest of the
    prompt and choosing the first token)."""

    def __init__(self, session: Conversation, codec: TextCodec, prompt: list[int], max_tokens: int,
                 sampling: SamplingOptions, speculation: Speculation | None = None,
                 constraint: Constraint | None = None):
        if len(prompt) >= session.capacity:
            raise CapacityError(f"the prompt has {len(prompt)} tokens; the KV cache holds {session.capacity} "
                                f"({session.larger_capacity})")
        self.session, self.codec, self.prompt, self.max_tokens = session, codec, prompt, max_tokens
        self.sampler = Sampler(sampling, constraint, context=prompt)
        self.speculation = speculation
        self.reason: str | None = None
        self.reused = 0
        self.prompt_seconds = 0.0

    def __iter__(self) -> Iterator[int]:
        session, sampler, speculation, ends = self.session, self.sampler, self.speculation, self.codec.end_ids
        start = time.perf_counter()
        self.reused = session.reuse(self.prompt)
        if speculation is not None:
            speculation.start(session, self.prompt[: self.reused])
        # (the prompt's step drafts nothing, even where the cache held all but its last token: the first token
        # comes as soon as it exists, and the time after it is the generation's alone)
        produced = step(session, sampler, self.prompt[self.reused :], self.max_tokens, speculation, draft=False)
        self.prompt_seconds = time.perf_counter() - start
        count = 0
        while True:
            *fed, token = produced  # `fed` are in the cache already, `token` is not
            for each in fed:
                if each in ends:
                    self.reason = "eos"
                    return
                yield each
                count += 1
            if token in ends:
                self.reason = "eos"
                return
            if count >= self.max_tokens:  # (max_tokens 0: the prompt fed, nothing generated)
                self.reason = "length"
                return
            yield token
            count += 1
            if count >= self.max_tokens:
                self.reason = "length"
                return
            if session.position >= session.capacity:
                self.reason = "full"
                return
            produced = step(session, sampler, [token], self.max_tokens - count, speculation)


def generate(session: Conversation, codec: TextCodec, prompt_ids: list[int], max_tokens: int,
             sampling: SamplingOptions, speculation: Speculation | None = None,
             constraint: Constraint | None = None) -> Generation:
    """The `Generation` of up to `max_tokens` tokens after `prompt_ids`: `list(generate(...))` is its tokens."""
    return Generation(session, codec, prompt_ids, max_tokens, sampling, speculation, constraint)


class StopStrings:
    """A text cut before the first of `stops` to appear in it: `push(piece)` returns what may be shown now
    (an end that could begin a stop string waits for the next piece), '' once one has appeared (`found`);
    `flush()` returns what still waits, at the end of the text.

    >>> stops = StopStrings(["</s>"]); [stops.push("a <"), stops.push("/b"), stops.push("c</s>d"), stops.found]
    ['a ', '</b', 'c', '</s>']
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [stop for stop in stops if stop]
        self.waiting = ""
        self.found: str | None = None

    def push(self, piece: str) -> str:
        if self.found is not None:
            return ""
        text = self.waiting + piece
        cuts = [(at, stop) for stop in self.stops if (at := text.find(stop)) >= 0]
        if cuts:
            at, self.found = min(cuts)
            self.waiting = ""
            return text[:at]
        held = self._held_back(text)
        self.waiting = text[len(text) - held :]
        return text[: len(text) - held]

    def flush(self) -> str:
        rest, self.waiting = self.waiting, ""
        return rest

    def _held_back(self, text: str) -> int:
        """How many characters at the end of `text` could begin a stop string."""
        held = 0
        for stop in self.stops:
            for n in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:n]):
                    held = n
                    break
        return held


def stream_text(codec: TextCodec, tokens: Iterable[int], write: Callable[[str], None],
                prompt: Sequence[int] = (), stops: StopStrings | None = None) -> list[int]:
    """Write the text of `tokens` (following `prompt`) as it becomes complete UTF-8, up to the first of `stops`
    (then no more tokens are taken); returns the tokens taken."""
    seen: list[int] = []

    def record(stream: Iterable[int]) -> Iterator[int]:
        for token in stream:
            seen.append(token)
            yield token

    for piece in codec.decode_stream(record(tokens), prompt):
        write(stops.push(piece) if stops else piece)
        if stops and stops.found is not None:
            return seen
    if stops:
        write(stops.flush())
    return seen
