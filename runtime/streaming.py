"""A generation request's tokens, from the engine's thread to its client: as text, whole or as server-sent events.

The engine calls `TokenQueue.emit` per token on its own thread; the queue hands each to the
asyncio loop (`loop.call_soon_threadsafe`). `pieces` decodes them there (whole UTF-8 characters
only) and looks for the job's `stop` strings; `whole` collects the text unless the client goes
away first, `events` spells it as OpenAI's server-sent chunks, and `EventStream` sends those,
cancelling the request as soon as the client is gone:

    data: {"id":"cmpl-…","object":"text_completion",…,"choices":[{"index":0,"text":" upon",…}]}
    …
    data: [DONE]
"""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from collections.abc import AsyncIterator, Callable

from starlette.requests import Request as HttpRequest
from starlette.responses import StreamingResponse

from llmc.runtime.api_requests import ApiError, Job
from llmc.runtime.codec import TextCodec


class TokenQueue:
    """One request's tokens and end, from the engine's thread into the event loop's queue."""

    def __init__(self, loop: asyncio.AbstractEventLoop, counts: Counter):
        self.loop = loop
        self.queue: asyncio.Queue[int | str] = asyncio.Queue()
        self.counts = counts

    def _put(self, item: int | str) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the loop has closed (shutting down): nobody is waiting
            pass

    def emit(self, token: int) -> None:  # on the engine's thread
        self.counts["generated_tokens"] += 1
        self._put(token)

    def finish(self, reason: str) -> None:  # on the engine's thread
        self.counts["error" if reason.startswith("error") else reason] += 1
        self._put(reason)


def _held_back(text: str, stops: list[str]) -> int:
    """How many characters at the end of `text` could begin a stop string (kept until the next piece)."""
    held = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), held, -1):
            if text.endswith(stop[:n]):
                held = n
                break
    return held


class Disconnected(Exception):
    """The client went away before its answer was whole."""


async def pieces(job: Job, tokens: TokenQueue, codec: TextCodec) -> AsyncIterator[str]:
    """The completion's text, piece by piece; sets `job.finish_reason` at the end."""
    decoder = codec.text_stream(job.prompt)
    pending = ""  # text held back: it may begin a stop string
    while True:
        item = await tokens.queue.get()
        if isinstance(item, int):
            job.completion_tokens += 1
            text, reason = pending + decoder.push(item), None
        else:
            text, reason = pending + decoder.flush(), item
        if job.stop:
            cuts = [i for i in (text.find(s) for s in job.stop) if i >= 0]
            if cuts:
                job.request.cancel()  # the engine frees the slot at its next step
                if min(cuts):
                    yield text[: min(cuts)]
                job.finish_reason = "stop"
                return
        if reason is not None:
            if reason not in ("stop", "length"):
                raise ApiError(503 if reason == "cancelled" else 500,
                               "the server is shutting down" if reason == "cancelled" else f"generation failed "
                               f"({reason})", "server_error")
            if text:
                yield text
            job.finish_reason = reason
            return
        held = _held_back(text, job.stop) if job.stop else 0
        pending = text[len(text) - held:]
        if len(text) > held:
            yield text[: len(text) - held]


async def whole(request: HttpRequest, job: Job, text: AsyncIterator[str]) -> str:
    """The whole completion from its `pieces`, or Disconnected as soon as the client goes away."""

    async def collect() -> str:
        return "".join([piece async for piece in text])

    collecting = asyncio.ensure_future(collect())
    watching = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        job.request.cancel()  # (a finished request is not affected)
        watching.cancel()
    if not collecting.done():
        collecting.cancel()
        raise Disconnected
    return collecting.result()


def events(job: Job, text: AsyncIterator[str], chunk: Callable[..., dict | None]) -> AsyncIterator[str]:
    """Server-sent events of the completion's `pieces`: `chunk(start=True)` first where it is not None, a
    `chunk(text=…)` per piece, `chunk(finish=…)`, `chunk(usage=…)` with `include_usage`, then `[DONE]`;
    an error while generating is sent as OpenAI's error body."""

    async def stream() -> AsyncIterator[str]:
        first = chunk(start=True)
        if first is not None:
            yield _sse(first)
        try:
            async for piece in text:
                yield _sse(chunk(text=piece))
            yield _sse(chunk(finish=job.finish_reason))
            if job.include_usage:
                yield _sse(chunk(usage=job.usage()))
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
    (whatever ASGI spec version the server speaks)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], cancel: Callable[[], None]):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.cancel = cancel

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.ensure_future(self.stream_response(send))
        listening = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({streaming, listening}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.cancel()
            for task in (streaming, listening):
                task.cancel()
            await asyncio.gather(streaming, listening, return_exceptions=True)
            await self.body_iterator.aclose()
        if streaming.done() and not streaming.cancelled() and streaming.exception() is not None:
            exc = streaming.exception()
            if not isinstance(exc, OSError):  # (a client gone while writing)
                raise exc
