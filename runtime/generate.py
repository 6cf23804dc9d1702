"""Text in, text out: run the session on a prompt, sample, write the text as tokens arrive."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from llmc.runtime.codec import TextCodec
from llmc.runtime.sampling import Sampler, SamplingOptions
from llmc.runtime.session import CapacityError, Conversation


def next_token(session: Conversation, sampler: Sampler, tokens: list[int]) -> int:
    """Feed `tokens` and choose the next one (greedy: the session's argmax, on a GPU where the logits are)."""
    return session.greedy(tokens) if sampler.greedy else sampler(session.feed(tokens))


def generate(session: Conversation, codec: TextCodec, prompt_ids: list[int], max_tokens: int,
             sampling: SamplingOptions) -> Iterator[int]:
    """Yield up to `max_tokens` new token ids, stopping after EOS (not yielded) or at capacity."""
    sampler = Sampler(sampling)
    if len(prompt_ids) >= session.capacity:
        raise CapacityError(f"the prompt has {len(prompt_ids)} tokens; the KV cache holds {session.capacity}")
    session.reset()

    token = next_token(session, sampler, prompt_ids)
    for _ in range(max_tokens):
        if token == codec.eos_id:
            return
        yield token
        if session.position >= session.capacity:
            return
        token = next_token(session, sampler, [token])


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
