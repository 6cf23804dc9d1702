"""`llmc serve`: an OpenAI-compatible HTTP API over one artifact.

    POST /v1/completions        a prompt (text or token ids) → its continuation (`echo`: after the prompt)
    POST /v1/chat/completions   messages, rendered with the model's chat template → the reply, or tool calls
    GET  /v1/models             the one model served (the artifact's name)
    GET  /health                the engine's state: slots, running and waiting requests, counts (decode and
                                verify calls, tokens drafted and accepted, prompt tokens fed and reused);
                                requests being prepared
    GET  /openapi.json          the OpenAPI description of these routes
    GET  /metrics, POST /tokenize, POST /detokenize   (`llmc.runtime.operations`, with the API key, CORS
                                and the access log)

A request may ask for `n` choices (each an engine request of its own), logprobs (the model's raw
distribution), penalties and `logit_bias`, and constrain its reply by a JSON schema, a grammar or
tools (`llmc.runtime.api_requests`, `llmc.runtime.tools`): the grammar masks the tokens it does not
allow as the engine samples.

Both generation endpoints stream as server-sent events in OpenAI's chunk format (ending
with `data: [DONE]`) when `"stream": true`, and answer whole otherwise. Requests run on the
batching `Engine` (`llmc.runtime.batch`; speculating by prompt lookup unless `--no-speculate`,
several tokens per step where drafts are accepted), on its own thread: it calls each request's
`emit` per token there, and those hand the tokens to the asyncio loop
(`loop.call_soon_threadsafe`) into a queue per request, where the text is decoded (whole
UTF-8 characters only) and `stop` strings are looked for (`llmc.runtime.streaming`). A client
that goes away cancels its request at once, which frees its slot at the engine's next step.

Errors are OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: 400 for a
malformed request (naming the field), 404 for an unknown route or model, 408 for a body that
does not arrive in time, 413 for one over the size limit, 429 when every slot is busy and the
queue of waiting requests is full (or too many requests are being prepared). Request bodies are
checked, and their 400s worded, in `llmc.runtime.api_requests`; the OpenAPI description is
written by hand in `llmc.runtime.openapi`.

One client cannot hurt another: each request's work is bounded by `Limits` (body bytes,
prompt characters, messages; sized from the KV capacity, since a longer prompt could not run
anyway), parsing, chat rendering (under the codec's time and size budget) and tokenizing run
on a small pool of worker threads at a lower CPU priority, never on the event loop, and a
client must send a request's head within `Limits.head_seconds` and its body within
`Limits.body_seconds` (benchmarks/hostile_client.py measures a good client beside a hostile one).

Starlette and uvicorn only (the `serve` extra), besides the runtime: no compiler here.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from pathlib import Path

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmc.errors import LlmcError
from llmc.runtime.api_requests import MAX_CHOICES, ApiError, Choice, Job, Limits, RequestParser, invalid
from llmc.runtime.artifact import MANIFEST
from llmc.runtime.batch import Engine, QueueFull, Request
from llmc.runtime.codec import TextCodec
from llmc.runtime.grammar import token_bytes
from llmc.runtime.openapi import openapi_schema
from llmc.runtime.operations import Operations, ServeOptions, error_response, internal_error, read_body, record_usage
from llmc.runtime.session import Conversation
from llmc.runtime.streaming import Disconnected, EventStream, Piece, TokenQueue, events, pieces, whole
from llmc.runtime.tools import read_reply

WORKER_NICENESS = 10  # of the threads that prepare requests (Linux: per thread), below the engine's
MALLOC_ARENAS = 2  # glibc's heaps, shared by all threads (mallopt's M_ARENA_MAX)


def _token(codec: TextCodec, token: int, logprob: float) -> dict:
    """A token's entry in chat's logprobs: its text, logprob and bytes (its own: a part of a UTF-8 character
    where the text is U+FFFD, so that the bytes of consecutive tokens join into the reply's text)."""
    return {"token": codec.piece(token), "logprob": logprob, "bytes": list(token_bytes(codec, token))}


class _Answer:
    """How a generation endpoint spells one request's answers in OpenAI's formats: the id's prefix, the
    `object` of a streamed chunk and of the whole answer, and each choice's part: streamed (`start`, `piece`,
    `end`, each a list of choices' entries) and whole (`whole`)."""

    name: str  # the endpoint, as metrics name it
    id_prefix: str
    chunk_object: str
    answer_object: str

    def __init__(self, codec: TextCodec, job: Job):
        self.codec, self.job = codec, job

    def start(self, index: int) -> list[dict]:
        return []


class _CompletionAnswer(_Answer):
    """/v1/completions: a choice's `text`, and with logprobs OpenAI's legacy `tokens`, `token_logprobs`,
    `top_logprobs` and `text_offset`."""

    name, id_prefix, chunk_object, answer_object = "completions", "cmpl", "text_completion", "text_completion"

    def __init__(self, codec: TextCodec, job: Job):
        super().__init__(codec, job)
        self.offsets = [0] * job.n  # each choice's text so far, in characters
        # each choice's tokens decoded as `pieces` decodes them (echo: from the prompt's start), so that a token's
        # offset counts the whole characters before it (a character of several tokens starts at its first)
        self.streams = [codec.text_stream(() if job.echo is not None else job.prompt) for _ in range(job.n)]

    def piece(self, index: int, piece: Piece) -> list[dict]:
        return [{"index": index, "text": piece.text, "logprobs": self._logprobs(index, piece), "finish_reason": None}]

    def end(self, index: int, finish: str) -> list[dict]:
        return [{"index": index, "text": "", "logprobs": None, "finish_reason": finish}]

    def whole(self, index: int, piece: Piece, finish: str) -> dict:
        return {"index": index, "text": piece.text, "logprobs": self._logprobs(index, piece), "finish_reason": finish}

    def _logprobs(self, index: int, piece: Piece) -> dict | None:
        if piece.logprobs is None:
            return None
        offsets = []
        for token in piece.tokens:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(self.streams[index].push(token))
        return {"tokens": [self.codec.piece(token) for token in piece.tokens],
                "token_logprobs": [None if lp is None else lp.logprob for lp in piece.logprobs],
                "top_logprobs": [None if lp is None else {self.codec.piece(t): p for t, p in lp.top}
                                 for lp in piece.logprobs],
                "text_offset": offsets}


class _ChatAnswer(_Answer):
    """/v1/chat/completions: a choice's `message` (streamed: `delta`), its `content` or, with tools, its
    `tool_calls` (streamed whole, in one delta, once the reply has ended), and logprobs as `{"content": [...]}`."""

    name, id_prefix, chunk_object, answer_object = "chat", "chatcmpl", "chat.completion.chunk", "chat.completion"

    def __init__(self, codec: TextCodec, job: Job):
        super().__init__(codec, job)
        self.held: list[list[Piece]] = [[] for _ in range(job.n)]  # with tools: each reply until it ends

    def start(self, index: int) -> list[dict]:
        return [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                 "finish_reason": None}]

    def piece(self, index: int, piece: Piece) -> list[dict]:
        if self.job.tools is not None:
            self.held[index].append(piece)
            return []
        return [{"index": index, "delta": {"content": piece.text}, "logprobs": self._logprobs(piece),
                 "finish_reason": None}]

    def end(self, index: int, finish: str) -> list[dict]:
        out = []
        if self.held[index]:
            reply = self.whole(index, Piece.joined(self.held[index]), finish)
            message, finish = reply["message"], reply["finish_reason"]
            calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls", []))]
            out.append({"index": index, "delta": {"tool_calls": calls} if calls else {"content": message["content"]},
                        "logprobs": reply["logprobs"], "finish_reason": None})
        return [*out, {"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}]

    def whole(self, index: int, piece: Piece, finish: str) -> dict:
        content, calls = read_reply(piece.text) if self.job.tools is not None else (piece.text, None)
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"], finish = calls, "tool_calls"
        return {"index": index, "message": message, "logprobs": self._logprobs(piece), "finish_reason": finish}

    def _logprobs(self, piece: Piece) -> dict | None:
        if piece.logprobs is None:
            return None
        return {"content": [{**_token(self.codec, lp.token, lp.logprob),
                             "top_logprobs": [_token(self.codec, t, p) for t, p in lp.top]}
                            for lp in piece.logprobs]}


# ------------------------------------------------------------------ the server


class Server:
    """The ASGI app (`self.app`) over one session's engine."""

    def __init__(self, session: Conversation, codec: TextCodec, name: str, queue_size: int = 64,
                 max_active: int | None = None, aliases: tuple[str, ...] = (), limits: Limits | None = None,
                 speculate: bool = False, options: ServeOptions = ServeOptions()):
        self.session = session
        self.codec = codec
        self.name = name
        self.names = {name, *aliases}
        self.capacity = session.capacity
        self.limits = limits or Limits.for_capacity(self.capacity)
        self.engine = Engine(session, codec.end_ids, queue_size, max_active, speculate)
        self.requests = RequestParser(codec, self.limits, self.capacity, name, self.names, self.engine.check_prompt,
                                      min(MAX_CHOICES, self.engine.max_active + queue_size))
        self.operations = Operations(name, codec, self.health_stats, options, self.limits)
        self.workers = ThreadPoolExecutor(self.limits.workers, thread_name_prefix="llmc-request",
                                          initializer=_yield_to_generation)
        self.pending = 0  # requests handed to the workers and not yet back
        self.counts: Counter = Counter()
        manifest = session.manifest
        self.created = int((manifest.directory / MANIFEST).stat().st_mtime)  # when the artifact was written
        self.model_card = {
            "id": name, "object": "model", "created": self.created, "owned_by": "llmc",
            "source": manifest.model.get("source"), "target": manifest.target,
            "max_model_len": self.capacity, "slots": self.engine.max_active,
            "chat_template": bool(codec.chat_template),
        }
        self.app = Starlette(
            routes=[
                Route("/v1/completions", self.completions, methods=["POST"]),
                Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
                Route("/v1/models", self.models, methods=["GET"]),
                Route("/v1/models/{model:path}", self.model, methods=["GET"]),
                Route("/health", self.health, methods=["GET"]),
                Route("/openapi.json", self.openapi, methods=["GET"]),
                *self.operations.routes,
            ],
            middleware=self.operations.middleware,
            exception_handlers={HTTPException: self._http_error, ApiError: self._api_error,
                                Exception: self._internal_error},
            lifespan=self._lifespan,
        )
        self.app.router.redirect_slashes = False  # (Starlette's redirect names the client's Host: a 404 instead)

    # -------------------------------------------------------------- lifecycle

    @asynccontextmanager
    async def _lifespan(self, app: Starlette) -> AsyncIterator[None]:
        self.engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Stop the engine (requests running or waiting end, their clients get an error) and the workers."""
        self.engine.close()
        self.workers.shutdown(wait=False, cancel_futures=True)

    # -------------------------------------------------------------- errors

    async def _http_error(self, request: HttpRequest, exc: HTTPException) -> Response:
        if exc.status_code == 404:
            return error_response(ApiError(404, f"no route {request.method} {request.url.path} (llmc serve has POST "
                                                f"/v1/completions, POST /v1/chat/completions, GET /v1/models, GET "
                                                f"/health, GET /openapi.json, GET /metrics, POST /tokenize, POST "
                                                f"/detokenize)", code="not_found"))
        if exc.status_code == 405:
            answer = error_response(ApiError(405, f"{request.url.path} does not take {request.method}",
                                             code="method_not_allowed"))
            answer.headers.update(exc.headers or {})  # (Starlette's `Allow`: the methods the route takes)
            return answer
        return error_response(ApiError(exc.status_code, str(exc.detail)))

    async def _api_error(self, request: HttpRequest, exc: ApiError) -> Response:
        return error_response(exc)

    async def _internal_error(self, request: HttpRequest, exc: Exception) -> Response:
        return internal_error(exc)  # (raised in a middleware: a route's is answered by `InternalErrors`)

    # -------------------------------------------------------------- simple routes

    async def models(self, request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card]})

    async def model(self, request: HttpRequest) -> Response:
        self.requests.check_model(request.path_params["model"])
        return JSONResponse(self.model_card)

    async def openapi(self, request: HttpRequest) -> Response:
        return JSONResponse(openapi_schema(self.name, self.limits, self.requests.max_choices))

    async def health(self, request: HttpRequest) -> Response:
        return JSONResponse(self.health_stats())

    def health_stats(self) -> dict:
        """The engine's state and the server's counts (GET /health; the metrics read it too)."""
        return {
            "status": "ok", "model": self.name, **self.engine.stats(), "preparing": self.pending,
            "capacity": self.capacity,
            "requests": {reason: self.counts[reason] for reason in ("stop", "length", "cancelled", "error")},
            "generated_tokens": self.counts["generated_tokens"],
        }

    # -------------------------------------------------------------- reading requests

    async def _prepared(self, request: HttpRequest, prepare: Callable[[bytes], Job]) -> Job:
        """`prepare(body)` on a worker thread: parsing, rendering and tokenizing never hold up the event loop
        (429 when `max_pending` requests are in hand already)."""
        raw = await read_body(request, self.limits)
        if self.pending >= self.limits.max_pending:
            raise ApiError(429, f"the server is busy ({self.pending} requests are being prepared); retry later",
                           "server_overloaded", code="busy")
        self.pending += 1
        try:
            return await asyncio.wrap_future(self.workers.submit(prepare, raw))
        finally:
            self.pending -= 1

    # -------------------------------------------------------------- generation

    def _submit(self, job: Job, prompt_param: str) -> None:
        """One engine request per choice (each with its own constraint, and seed where one is set)."""
        loop = asyncio.get_running_loop()
        for index in range(job.n):
            tokens = TokenQueue(loop, self.counts)
            request = Request(job.prompt, job.max_tokens, job.choice_sampling(index), tokens.emit, tokens.finish,
                              constraint=None if job.grammar is None else job.grammar.constraint(),
                              prompt_logprobs=tokens.prompt_logprobs if job.prompt_logprobs else None)
            job.choices.append(Choice(index, request, tokens))
            try:
                self.engine.submit(request)
            except QueueFull as e:
                job.cancel()
                raise ApiError(429, f"the server is busy ({e}); retry later", "server_overloaded",
                               code="queue_full") from None
            except ValueError as e:  # (the request was checked above; kept for what the engine checks itself)
                job.cancel()
                raise invalid(prompt_param, str(e)) from None
            except LlmcError as e:  # shutting down
                job.cancel()
                raise ApiError(503, str(e), "server_error", code="unavailable") from None

    async def completions(self, request: HttpRequest) -> Response:
        return await self._generate(request, self.requests.completion, "prompt", _CompletionAnswer)

    async def chat_completions(self, request: HttpRequest) -> Response:
        return await self._generate(request, self._chat_job, "messages", _ChatAnswer)

    def _chat_job(self, raw: bytes) -> Job:
        """A chat request, prepared on a worker thread; with logprobs, the token bytes they name come from
        llguidance's tokenizer, built here on the first such request (~0.2 s), not on the event loop."""
        job = self.requests.chat(raw)
        if job.sampling.logprobs is not None:
            token_bytes(self.codec, 0)
        return job

    async def _generate(self, request: HttpRequest, prepare: Callable[[bytes], Job], prompt_param: str,
                        spelling: type[_Answer]) -> Response:
        """Prepare and submit the request, then answer server-sent chunks as tokens come (`stream`), or the
        whole answer with the usage."""
        job = await self._prepared(request, prepare)
        self._submit(job, prompt_param)
        started, metrics, endpoint = time.monotonic(), self.operations.metrics, spelling.name
        metrics.started(endpoint)
        answers = spelling(self.codec, job)
        ident, created = f"{spelling.id_prefix}-{uuid.uuid4().hex}", int(time.time())

        def answer(kind: str, choices: list[dict]) -> dict:
            return {"id": ident, "object": kind, "created": created, "model": self.name, "choices": choices}

        def chunks(index: int = 0, piece: Piece | None = None, finish: str | None = None, start: bool = False,
                   usage: dict | None = None) -> list[dict]:
            if usage is not None:
                parts = [[]]
            else:
                choices = (answers.start(index) if start else answers.end(index, finish) if finish is not None
                           else answers.piece(index, piece))
                parts = [[c] for c in choices]
            return [answer(spelling.chunk_object, p) | ({"usage": usage} if job.include_usage else {}) for p in parts]

        def finished() -> None:
            reason = job.choices[0].finish_reason or "cancelled"
            record_usage(request, job.usage())
            metrics.finished(endpoint, reason, len(job.prompt), job.completion_tokens, time.monotonic() - started)

        def first_token() -> None:
            metrics.first_token(endpoint, time.monotonic() - started)

        streams = [pieces(job, choice, self.codec, first_token) for choice in job.choices]
        if job.stream:
            def ended() -> None:
                job.cancel()  # (a finished request is not affected)
                finished()

            return EventStream(events(job, streams, chunks), ended)
        try:
            replies = await whole(request, job, streams)
        except Disconnected:
            return Response(status_code=499)
        finally:
            finished()
        choices = [answers.whole(c.index, reply, c.finish_reason) for c, reply in zip(job.choices, replies)]
        return JSONResponse(answer(spelling.answer_object, choices) | {"usage": job.usage()})


def _share_malloc_arenas() -> None:
    """Let glibc's allocator keep at most MALLOC_ARENAS heaps. By default each worker thread may
    get its own, and what a large request freed stays in its thread's heap: six requests at the
    limits at once left the resident memory 121 MB higher (SmolLM2), 31 MB with two heaps."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(-8, MALLOC_ARENAS)  # (M_ARENA_MAX)


def _yield_to_generation() -> None:
    """Lower this (worker) thread's CPU priority: preparing a request never slows the running ones."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICENESS)
    except (AttributeError, OSError):  # (a system without per-thread priorities)
        pass


# ------------------------------------------------------------------ running it


def model_name(directory: Path) -> str:
    """The name a served artifact answers to: its directory's name, without a `.llmc` suffix."""
    name = directory.resolve().name
    return name[: -len(".llmc")] if name.endswith(".llmc") and len(name) > len(".llmc") else name


class _TimedProtocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose client has not sent a whole request head
    (request line and headers) `head_seconds` after connecting or after its previous response: a client
    trickling its headers cannot hold a connection (uvicorn's own timeout covers idle connections only)."""

    head_seconds = 10.0  # (set per server by `_protocol`)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._head_timer = self.loop.call_later(self.head_seconds, self._head_expired)

    def handle_events(self) -> None:
        super().handle_events()
        if self.conn.their_state is not h11.IDLE:  # a whole head has come
            self._head_timer.cancel()

    def on_response_complete(self) -> None:
        self._head_timer.cancel()
        self._head_timer = self.loop.call_later(self.head_seconds, self._head_expired)
        super().on_response_complete()  # (which reads a pipelined request's head at once)

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_timer.cancel()
        super().connection_lost(exc)

    def _head_expired(self) -> None:
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()


def _protocol(head_seconds: float) -> type[H11Protocol]:
    return type("TimedProtocol", (_TimedProtocol,), {"head_seconds": head_seconds})


class _Uvicorn(uvicorn.Server):
    """uvicorn, announcing the URL once it listens, and stopping the engine first on shutdown
    (so that streams in flight end at once instead of holding the shutdown)."""

    def __init__(self, config: uvicorn.Config, server: Server, url: str, announce: Callable[[str], None]):
        super().__init__(config)
        self.llmc, self.url, self.announce = server, url, announce

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets=sockets)
        if self.started:
            self.announce(self.url)

    async def shutdown(self, sockets=None) -> None:
        await asyncio.to_thread(self.llmc.close)
        await super().shutdown(sockets=sockets)


def serve(server: Server, host: str = "127.0.0.1", port: int = 8000,
          announce: Callable[[str], None] = lambda url: print(url, flush=True)) -> None:
    """Listen on `host:port` (port 0: any free port) until Ctrl-C or SIGTERM; `announce(url)` once ready."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        sock = socket.create_server((host, port), family=family, backlog=128)
    except OSError as e:
        raise LlmcError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    bound = sock.getsockname()[1]
    _share_malloc_arenas()  # (before the server's threads start)
    url = f"http://{f'[{host}]' if family == socket.AF_INET6 else host}:{bound}"
    config = uvicorn.Config(server.app, http=_protocol(server.limits.head_seconds), log_level="warning",
                            access_log=False, lifespan="on", timeout_graceful_shutdown=5)
    # (asyncio warns of writes to a socket its client has just closed: that client's stream is being cancelled)
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    try:
        _Uvicorn(config, server, url, announce).run(sockets=[sock])
    finally:
        sock.close()
        server.close()
