"""Text in, text out: run the session on a prompt, sample, write the text as tokens arrive."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from llmc.runtime.codec import TextCodec
from llmc.runtime.sampling import Sampler, SamplingOptions
from llmc.runtime.session import CapacityError, Conversation
from llmc.runtime.speculate import Speculation, step


def generate(session: Conversation, codec: TextCodec, prompt_ids: list[int], max_tokens: int,
             sampling: SamplingOptions, speculation: Speculation | None = None) -> Iterator[int]:
    """Yield up to `max_tokens` new token ids, stopping after EOS (not yielded) or at capacity; with
    `speculation`, several tokens per model call where its drafts are accepted (greedy: the same tokens)."""
    sampler = Sampler(sampling)
    if len(prompt_ids) >= session.capacity:
        raise CapacityError(f"the prompt has {len(prompt_ids)} tokens; the KV cache holds {session.capacity}")
    session.reset()
    if speculation is not None:
        speculation.start(session, [])

    produced = step(session, sampler, prompt_ids, max_tokens, speculation)
    count = 0
    while True:
        *fed, token = produced  # `fed` are in the cache already, `token` is not
        for each in fed:
            if each == codec.eos_id:
                return
            yield each
            count += 1
        if token == codec.eos_id or count >= max_tokens:
            return
        yield token
        count += 1
        if count >= max_tokens or session.position >= session.capacity:
            return
        produced = step(session, sampler, [token], max_tokens - count, speculation)


def stream_text(codec: TextCodec, tokens: Iterator[int], write: Callable[[str], None],
                prompt: Sequence[int] = ()) -> list[int]:
    """Write the text of `tokens` (following `prompt`) as it becomes complete UTF-8; returns the tokens."""
    seen: list[int] = []

    def record(stream: Iterator[int]) -> Iterator[int]:
        for token in stream:
            seen.append(token)
            yield token

    for piece in codec.decode_stream(record(tokens), prompt):
        write(piece)
    return seen
