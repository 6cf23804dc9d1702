"""A generation request's tokens, from the engine's thread to its client: as text, whole or as server-sent events.

The engine calls `TokenQueue.emit` per token on its own thread; the queue hands each to the
asyncio loop (`loop.call_soon_threadsafe`). `pieces` decodes one choice's tokens there (whole
UTF-8 characters only, each `Piece` with its tokens and their logprobs) and looks for the job's
`stop` strings; `whole` collects every choice's pieces unless the client goes away first,
`events` spells them as OpenAI's server-sent chunks (choices interleaved as their tokens come),
and `EventStream` sends those, cancelling the request as soon as the client is gone:

    data: {"id":"cmpl-…","object":"text_completion",…,"choices":[{"index":0,"text":" upon",…}]}
    …
    data: [DONE]
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request as HttpRequest
from starlette.responses import StreamingResponse

from llmc.runtime.api_requests import ApiError, Choice, Job
from llmc.runtime.codec import TextCodec
from llmc.runtime.generate import StopStrings
from llmc.runtime.sampling import TokenLogprob


@dataclass
class Piece:
    """A piece of a choice's text, the tokens that made it and, with logprobs asked for, their `TokenLogprob`s
    (echo: the prompt's, None for its first token)."""

    text: str
    tokens: list[int]
    logprobs: list[TokenLogprob | None] | None = None

    @classmethod
    def joined(cls, pieces: list[Piece]) -> Piece:
        """The pieces as one: `Piece.joined([Piece("a", [1]), Piece("b", [2])])` is `Piece("ab", [1, 2])`."""
        logprobs = [lp for p in pieces if p.logprobs is not None for lp in p.logprobs]
        return cls("".join(p.text for p in pieces), [t for p in pieces for t in p.tokens],
                   logprobs if any(p.logprobs is not None for p in pieces) else None)


class TokenQueue:
    """One request's tokens, prompt logprobs and end, from the engine's thread into the event loop's queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, counts: Counter):
        self.loop = loop
        self.queue: asyncio.Queue[tuple[int, TokenLogprob | None] | list | str] = asyncio.Queue()
        self.counts = counts
        self.stopped = False  # a stop string ended the text: the engine's "cancelled" that follows is a stop

    def _put(self, item: tuple | list | str) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed (shutting down): nobody is waiting
            pass

    def emit(self, token: int, logprob: TokenLogprob | None = None) -> None:  # on the engine's thread
        self.counts["generated_tokens"] += 1
        self._put((token, logprob))

    def prompt_logprobs(self, logprobs: list[TokenLogprob | None]) -> None:  # on the engine's thread
        self._put(logprobs)

    def finish(self, reason: str) -> None:  # on the engine's thread
        """Count the end (/health's stop, length, cancelled or error: a grammar that failed is an error) and pass
        it on."""
        if reason == "cancelled" and self.stopped:
            self.counts["stop"] += 1
        else:
            self.counts["error" if reason.startswith(("error", "grammar: ")) else reason] += 1
        self._put(reason)


class Disconnected(Exception):
    """The client went away before its answer was whole."""


async def pieces(job: Job, choice: Choice, codec: TextCodec,
                 first_token: Callable[[], None] = lambda: None) -> AsyncIterator[Piece]:
    """The choice's text, piece by piece (echo: the prompt's first); sets `choice.finish_reason` at the end
    and calls `first_token()` when its first token comes."""
    logprobs = job.sampling.logprobs is not None
    if job.echo is not None and not job.prompt_logprobs:
        yield Piece(job.echo, list(job.prompt))
    decoder = codec.text_stream(job.prompt)
    stops = StopStrings(job.stop)  # (holds back an end that may begin a stop string)
    tokens: list[int] = []  # the tokens of the text not yet given
    chosen: list[TokenLogprob | None] = []  # and their logprobs
    while True:
        item = await choice.tokens.queue.get()
        if isinstance(item, list):  # the prompt's logprobs (echo), before any token
            yield Piece(job.echo, list(job.prompt), item if logprobs else None)
            continue
        if isinstance(item, tuple):
            if not job.completion_tokens:
                first_token()
            job.completion_tokens += 1
            tokens.append(item[0])
            chosen.append(item[1])
            text, reason = stops.push(decoder.push(item[0])), None
        else:
            text, reason = stops.push(decoder.flush()), item

        def piece(text: str) -> Piece:
            given = Piece(text, tokens.copy(), chosen.copy() if logprobs else None)
            tokens.clear()
            chosen.clear()
            return given

        if stops.found is not None:
            choice.tokens.stopped = True
            choice.request.cancel()  # the engine frees the slot at its next step
            if text:
                yield piece(text)
            choice.finish_reason = "stop"
            return
        if reason is not None:
            if reason.startswith("grammar: "):  # (the client's grammar, schema or tools: a 400, as when compiled)
                raise ApiError(400, "the request's grammar failed while generating: "
                                    f"{reason.removeprefix('grammar: ')}", code="invalid_grammar")
            if reason not in ("stop", "length"):
                raise ApiError(503 if reason == "cancelled" else 500,
                               "the server is shutting down" if reason == "cancelled" else f"generation failed "
                               f"({reason})", "server_error")
            text += stops.flush()
            if text or tokens:
                yield piece(text)
            choice.finish_reason = reason
            return
        if text:
            yield piece(text)


async def whole(request: HttpRequest, job: Job, streams: list[AsyncIterator[Piece]]) -> list[Piece]:
    """Each choice's whole completion from its `pieces`, or Disconnected as soon as the client goes away."""

    async def joined(stream: AsyncIterator[Piece]) -> Piece:
        return Piece.joined([piece async for piece in stream])

    async def collect() -> list[Piece]:
        return await asyncio.gather(*map(joined, streams))

    collecting = asyncio.ensure_future(collect())
    watching = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        job.cancel()  # (a finished request is not affected)
        watching.cancel()
    if not collecting.done():
        collecting.cancel()
        raise Disconnected
    return collecting.result()


async def merged(streams: list[AsyncIterator[Piece]]) -> AsyncIterator[tuple[int, Piece | None]]:
    """The pieces of several choices as they come, each with its choice's index, and (index, None) when that
    choice ends; the first error of any ends it all. (One choice: its own pieces, with no task between.)"""
    if len(streams) == 1:
        async for piece in streams[0]:
            yield 0, piece
        yield 0, None
        return
    queue: asyncio.Queue[tuple[int, Piece | None, Exception | None]] = asyncio.Queue()

    async def forward(index: int, stream: AsyncIterator[Piece]) -> None:
        try:
            async for piece in stream:
                queue.put_nowait((index, piece, None))
            queue.put_nowait((index, None, None))
        except Exception as e:  # (ApiError: the engine stopped it)
            queue.put_nowait((index, None, e))

    tasks = [asyncio.ensure_future(forward(i, s)) for i, s in enumerate(streams)]
    try:
        running = len(tasks)
        while running:
            index, piece, error = await queue.get()
            if error is not None:
                raise error
            running -= piece is None
            yield index, piece
    finally:
        for task in tasks:
            task.cancel()


def events(job: Job, streams: list[AsyncIterator[Piece]], chunks: Callable[..., list[dict]]) -> AsyncIterator[str]:
    """Server-sent events of the choices' `pieces`: `chunks(index, start=True)` for each choice first,
    `chunks(index, piece=…)` per piece, `chunks(index, finish=…)` as each ends, `chunks(usage=…)` with
    `include_usage`, then `[DONE]`; an error while generating is sent as OpenAI's error body."""

    async def stream() -> AsyncIterator[str]:
        for index in range(len(streams)):
            for chunk in chunks(index, start=True):
                yield _sse(chunk)
        try:
            async for index, piece in merged(streams):
                parts = chunks(index, finish=job.choices[index].finish_reason) if piece is None else chunks(
                    index, piece=piece)
                for chunk in parts:
                    yield _sse(chunk)
            if job.include_usage:
                for chunk in chunks(usage=job.usage()):
                    yield _sse(chunk)
        except ApiError as e:
            yield _sse(e.body())
        yield "data: [DONE]\n\n"

    return stream()


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _disconnect(request: HttpRequest) -> None:
    """Return when the client has gone away (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """Server-sent events that stop, and cancel their request, as soon as the client goes away
    (whatever ASGI spec version the server speaks): `ended()` is called once they stop, however."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], ended: Callable[[], None]):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.ended = ended

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        listening = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.ended()
            for task in (streaming, listening):
                task.cancel()
            await asyncio.gather(streaming, listening, return_exceptions=True)
            await self.body_iterator.aclose()
        if streaming.done() and not streaming.cancelled() and streaming.exception() is not None:
            exc = streaming.exception()
            if not isinstance(exc, OSError):  # (a client gone while writing)
                raise exc
