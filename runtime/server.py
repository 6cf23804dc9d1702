"""`llmc serve`: an OpenAI-compatible HTTP API over one artifact.

    POST /v1/completions        a prompt (text or token ids) → its continuation
    POST /v1/chat/completions   messages, rendered with the model's chat template → the reply
    GET  /v1/models             the one model served (the artifact's name)
    GET  /health                the engine's state: slots, running and waiting requests, counts; requests
                                being prepared
    GET  /openapi.json          the OpenAPI description of these routes

Both generation endpoints stream as server-sent events in OpenAI's chunk format (ending
with `data: [DONE]`) when `"stream": true`, and answer whole otherwise. Requests run on the
batching `Engine` (`llmc.runtime.batch`), on its own thread: it calls each request's
`emit` per token there, and those hand the tokens to the asyncio loop
(`loop.call_soon_threadsafe`) into a queue per request, where the text is decoded (whole
UTF-8 characters only) and `stop` strings are looked for. A client that goes away
cancels its request at once, which frees its slot at the engine's next step.

Errors are OpenAI's body, `{"error": {"message", "type", "param", "code"}}`: 400 for a
malformed request (naming the field), 404 for an unknown route or model, 408 for a body that
does not arrive in time, 413 for one over the size limit, 429 when every slot is busy and the
queue of waiting requests is full (or too many requests are being prepared). The OpenAPI
description is written by hand in `llmc.runtime.openapi`.

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
import json
import logging
import math
import os
import socket
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import h11
import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from uvicorn.protocols.http.h11_impl import H11Protocol

from llmc.errors import LlmcError, printable
from llmc.runtime.artifact import MANIFEST
from llmc.runtime.batch import Engine, QueueFull, Request
from llmc.runtime.codec import TextCodec
from llmc.runtime.openapi import openapi_schema
from llmc.runtime.sampling import SamplingOptions
from llmc.runtime.session import CapacityError, Conversation

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat replies default to the room left
MAX_STOP_STRINGS = 4  # as OpenAI allows
ROLES = ("system", "user", "assistant")
CHARS_PER_TOKEN = 32  # a prompt of more characters per token of KV capacity cannot fit (tokens are shorter)
JSON_BYTES_PER_CHAR = 12  # the longest JSON spelling of one character (a surrogate pair's two escapes)
BODY_OVERHEAD = 64 << 10  # bytes of a body besides its text (field names, options, message framing)
WORKER_NICENESS = 10  # of the threads that prepare requests (Linux: per thread), below the engine's
MALLOC_ARENAS = 2  # glibc's heaps, shared by all threads (mallopt's M_ARENA_MAX)


@dataclass(frozen=True)
class Limits:
    """What one request may cost the server: bounds on its work and on how long its client may take."""

    max_chars: int  # characters of a prompt, or of all messages' text together
    max_messages: int
    max_body_bytes: int
    head_seconds: float = 10.0  # from connecting (or the previous response) to a whole request head
    body_seconds: float = 30.0  # from the head to the whole body
    workers: int = 8  # threads that parse, render and tokenize requests
    max_pending: int = 32  # requests being prepared or waiting for a worker; beyond them, 429

    @classmethod
    def for_capacity(cls, capacity: int, **options) -> Limits:
        """Limits for a KV cache of `capacity` tokens per sequence: nothing longer could run."""
        chars = CHARS_PER_TOKEN * capacity
        return cls(chars, capacity, BODY_OVERHEAD + JSON_BYTES_PER_CHAR * chars, **options)


# ------------------------------------------------------------------ errors


class ApiError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> Response:
        """The error as JSON in ASCII (a message may quote a client's lone surrogate, which UTF-8 cannot hold)."""
        headers = {"Retry-After": "1"} if self.status in (429, 503) else {}
        if self.status in (408, 413):  # the rest of the body is not read: the connection cannot serve another
            headers["Connection"] = "close"
        return Response(json.dumps(self.body()), self.status, headers, media_type="application/json")


def _invalid(param: str, message: str, code: str | None = None) -> ApiError:
    return ApiError(400, message, param=param, code=code)


# ------------------------------------------------------------------ request bodies

_COMMON_FIELDS = {"model", "temperature", "top_p", "top_k", "seed", "max_tokens", "stop", "n", "stream",
                  "stream_options", "user"}
_FIELDS = {"completions": _COMMON_FIELDS | {"prompt"},
           "chat": _COMMON_FIELDS | {"messages", "max_completion_tokens"}}


def _zero(v: object) -> bool:
    return v is None or (type(v) in (int, float) and v == 0)


# OpenAI fields that llmc does not implement, accepted at their neutral values only (clients send some by default)
_NEUTRAL: dict[str, Callable[[object], bool]] = {
    "frequency_penalty": _zero,
    "presence_penalty": _zero,
    "logit_bias": lambda v: v is None or v == {},
    "logprobs": lambda v: v is None or v is False,
    "top_logprobs": _zero,
    "echo": lambda v: v is None or v is False,
    "best_of": lambda v: v is None or (type(v) is int and v == 1),
    "suffix": lambda v: v is None,
    "tools": lambda v: v is None or v == [],
    "tool_choice": lambda v: v is None or v == "none",
    "parallel_tool_calls": lambda v: v is None or type(v) is bool,
    "response_format": lambda v: v is None or v == {"type": "text"},
}


def _show(v: object) -> str:
    """A value from a request, for an error message (bounded)."""
    try:
        text = json.dumps(v)
    except RecursionError:
        return "(a value nested too deeply to show)"
    return text if len(text) <= 60 else text[:59] + "…"


def _text(value: str, param: str) -> str:
    """`value`, if it is Unicode text (JSON's escapes can spell lone surrogates, which are not)."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise _invalid(param, f"{param} holds a lone surrogate (U+{ord(value[e.start]):04X} at character {e.start}), "
                              f"which is not Unicode text") from None
    return value


def _is_int(v: object) -> bool:
    return type(v) is int


def _is_number(v: object) -> bool:
    return type(v) in (int, float)


@dataclass
class Job:
    """One parsed generation request."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingOptions
    stop: list[str]
    stream: bool
    include_usage: bool
    # filled in as it runs
    completion_tokens: int = 0
    finish_reason: str | None = None
    request: Request | None = field(default=None, repr=False)


def _check_fields(body: dict, kind: str) -> None:
    for name, value in body.items():
        if name in _FIELDS[kind]:
            continue
        if name in _NEUTRAL:
            if not _NEUTRAL[name](value):
                raise _invalid(name, f"'{name}' is not supported by llmc serve (only its default value)",
                               "unsupported_parameter")
            continue
        raise _invalid(name, f"unknown field '{name}'", "unknown_parameter")


def _sampling(body: dict) -> SamplingOptions:
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0  # OpenAI's default
    elif not _is_number(temperature) or not 0 <= temperature < math.inf:
        raise _invalid("temperature", f"temperature must be a number >= 0, got {_show(temperature)}")
    top_p = body.get("top_p")
    if top_p is None:
        top_p = 1.0
    elif not _is_number(top_p) or not 0 < top_p <= 1:
        raise _invalid("top_p", f"top_p must be a number in (0, 1], got {_show(top_p)}")
    top_k = body.get("top_k")
    if top_k is None:
        top_k = 0
    elif not _is_int(top_k) or top_k < 0:
        raise _invalid("top_k", f"top_k must be an integer >= 0 (0: no limit), got {_show(top_k)}")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise _invalid("seed", f"seed must be an integer, got {_show(seed)}")
    return SamplingOptions(float(temperature), top_k, float(top_p), None if seed is None else seed % 2**64)


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise _invalid("stop", "stop must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise _invalid("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    if any(not s for s in stops):
        raise _invalid("stop", "stop strings must not be empty")
    return stops


def _stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is not None and type(stream) is not bool:
        raise _invalid("stream", f"stream must be a boolean, got {_show(stream)}")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise _invalid("stream_options", "stream_options needs \"stream\": true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise _invalid("stream_options", "stream_options must be an object with 'include_usage' only")
        include_usage = options.get("include_usage", False)
        if type(include_usage) is not bool:
            raise _invalid("stream_options", "stream_options.include_usage must be a boolean")
    return bool(stream), include_usage


def _messages(body: dict, limits: Limits) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise _invalid("messages", "missing required field 'messages'", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise _invalid("messages", "messages must be a non-empty list of {\"role\", \"content\"} objects")
    if len(messages) > limits.max_messages:
        raise _invalid("messages", f"{len(messages)} messages; this server takes at most {limits.max_messages} (one "
                                   f"per token of its KV capacity)", "too_many_messages")
    out, chars = [], 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise _invalid(where, f"{where} must be an object with 'role' and 'content'")
        unknown = set(message) - {"role", "content", "name"}
        if unknown:
            raise _invalid(f"{where}.{sorted(unknown)[0]}", f"unknown field '{sorted(unknown)[0]}' in {where}")
        role = message.get("role")
        if role not in ROLES:
            raise _invalid(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, got "
                                            f"{_show(role)}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       and set(p) == {"type", "text"} for p in content):
                raise _invalid(f"{where}.content", f"{where}.content parts must be {{\"type\": \"text\", "
                                                   f"\"text\": ...}} (this model reads text only)")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise _invalid(f"{where}.content", f"{where}.content must be a string or a list of text parts")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise _invalid(f"{where}.name", f"{where}.name must be a string")
        chars += len(content) + len(name or "")
        if chars > limits.max_chars:
            raise _invalid("messages", f"the messages hold more than {limits.max_chars} characters, more than the KV "
                                       f"cache's tokens could take", "context_length_exceeded")
        _text(content, f"{where}.content")
        if name is not None:
            _text(name, f"{where}.name")
        out.append({"role": role, "content": content, **({"name": name} if name is not None else {})})
    return out


def _max_tokens(body: dict, names: tuple[str, ...]) -> tuple[str, int | None]:
    given = [(name, body[name]) for name in names if body.get(name) is not None]
    if len(given) > 1 and given[0][1] != given[1][1]:
        raise _invalid(given[1][0], f"{given[0][0]} and {given[1][0]} disagree")
    if not given:
        return names[0], None
    name, value = given[0]
    if not _is_int(value) or value < 1:
        raise _invalid(name, f"{name} must be an integer >= 1, got {_show(value)}")
    return name, value


# ------------------------------------------------------------------ token hand-off and text


class _Tokens:
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


class _Disconnected(Exception):
    pass


# ------------------------------------------------------------------ the server


class Server:
    """The ASGI app (`self.app`) over one session's engine."""

    def __init__(self, session: Conversation, codec: TextCodec, name: str, queue_size: int = 64,
                 max_active: int | None = None, aliases: tuple[str, ...] = (), limits: Limits | None = None):
        self.session = session
        self.codec = codec
        self.name = name
        self.names = {name, *aliases}
        self.capacity = session.capacity
        self.limits = limits or Limits.for_capacity(self.capacity)
        self.engine = Engine(session, codec.eos_id, queue_size, max_active)
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
            ],
            exception_handlers={HTTPException: self._http_error, ApiError: self._api_error,
                                Exception: self._internal_error},
            lifespan=self._lifespan,
        )

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
            return ApiError(404, f"no route {request.method} {request.url.path} (llmc serve has POST "
                                 f"/v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health, "
                                 f"GET /openapi.json)",
                            code="not_found").response()
        if exc.status_code == 405:
            return ApiError(405, f"{request.url.path} does not take {request.method}",
                            code="method_not_allowed").response()
        return ApiError(exc.status_code, str(exc.detail)).response()

    async def _api_error(self, request: HttpRequest, exc: ApiError) -> Response:
        return exc.response()

    async def _internal_error(self, request: HttpRequest, exc: Exception) -> Response:
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error").response()

    # -------------------------------------------------------------- simple routes

    async def models(self, request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card]})

    async def model(self, request: HttpRequest) -> Response:
        self._check_model(request.path_params["model"])
        return JSONResponse(self.model_card)

    async def openapi(self, request: HttpRequest) -> Response:
        return JSONResponse(openapi_schema(self.name, self.limits))

    async def health(self, request: HttpRequest) -> Response:
        return JSONResponse({
            "status": "ok", "model": self.name, **self.engine.stats(), "preparing": self.pending, "capacity": self.capacity,
            "requests": {reason: self.counts[reason] for reason in ("stop", "length", "cancelled", "error")},
            "generated_tokens": self.counts["generated_tokens"],
        })

    # -------------------------------------------------------------- parsing

    def _check_model(self, model: object) -> None:
        if model is None:
            return
        if not isinstance(model, str):
            raise _invalid("model", "model must be a string")
        if model not in self.names:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{self.name}'",
                           param="model", code="model_not_found")

    async def _read(self, request: HttpRequest) -> bytes:
        """The request's body: at most `max_body_bytes`, whole within `body_seconds` (413 and 408 otherwise)."""
        limit = self.limits.max_body_bytes
        too_large = ApiError(413, f"the request body is larger than {limit} bytes, the most this server's KV "
                                  f"capacity of {self.capacity} tokens could use", code="too_large")
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.limits.body_seconds):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise too_large
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {self.limits.body_seconds:g} s",
                           code="timeout") from None
        except ClientDisconnect:  # (nobody reads the answer)
            raise ApiError(499, "the client went away before its request was whole") from None
        return b"".join(chunks)

    async def _prepared(self, request: HttpRequest, prepare: Callable[[bytes], Job]) -> Job:
        """`prepare(body)` on a worker thread: parsing, rendering and tokenizing never hold up the event loop
        (429 when `max_pending` requests are in hand already)."""
        raw = await self._read(request)
        if self.pending >= self.limits.max_pending:
            raise ApiError(429, f"the server is busy ({self.pending} requests are being prepared); retry later",
                           "server_overloaded", code="busy")
        self.pending += 1
        try:
            return await asyncio.wrap_future(self.workers.submit(prepare, raw))
        finally:
            self.pending -= 1

    def _body(self, raw: bytes, kind: str) -> dict:
        try:
            body = json.loads(raw)
        except ValueError as e:  # not UTF-8, not JSON, an integer beyond Python's 4300 digits
            raise _invalid(None, f"the request body is not valid JSON: {printable(e, 200)}", "invalid_json") from None
        except RecursionError:
            raise _invalid(None, "the request body is nested too deeply", "invalid_json") from None
        if not isinstance(body, dict):
            raise _invalid(None, "the request body must be a JSON object")
        _check_fields(body, kind)
        self._check_model(body.get("model"))
        n = body.get("n")
        if n is not None and not (_is_int(n) and n == 1):
            raise _invalid("n", f"n must be 1 (one choice per request), got {_show(n)}")
        return body

    def _job(self, body: dict, prompt: list[int], prompt_param: str, max_names: tuple[str, ...],
             default_max: int | None) -> Job:
        try:
            self.engine.check_prompt(prompt)
        except CapacityError as e:
            raise _invalid(prompt_param, str(e), "context_length_exceeded") from None
        except ValueError as e:
            raise _invalid(prompt_param, str(e)) from None
        room = self.capacity - len(prompt)
        max_name, max_tokens = _max_tokens(body, max_names)
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif max_tokens > room:
            raise _invalid(max_name, f"{max_name} is {max_tokens}, but the KV cache holds {self.capacity} tokens per "
                                     f"sequence and the prompt takes {len(prompt)}: at most {room} remain",
                           "context_length_exceeded")
        stream, include_usage = _stream(body)
        return Job(prompt, max_tokens, _sampling(body), _stop(body), stream, include_usage)

    # -------------------------------------------------------------- generation

    def _submit(self, job: Job, prompt_param: str) -> _Tokens:
        tokens = _Tokens(asyncio.get_running_loop(), self.counts)
        job.request = Request(job.prompt, job.max_tokens, job.sampling, tokens.emit, tokens.finish)
        try:
            self.engine.submit(job.request)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy ({e}); retry later", "server_overloaded",
                           code="queue_full") from None
        except ValueError as e:  # (the request was checked above; kept for what the engine checks itself)
            raise _invalid(prompt_param, str(e)) from None
        except LlmcError as e:  # shutting down
            raise ApiError(503, str(e), "server_error", code="unavailable") from None
        return tokens

    async def _pieces(self, job: Job, tokens: _Tokens) -> AsyncIterator[str]:
        """The completion's text, piece by piece; sets `job.finish_reason` at the end."""
        decoder = self.codec.text_stream(job.prompt)
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

    def _usage(self, job: Job) -> dict:
        return {"prompt_tokens": len(job.prompt), "completion_tokens": job.completion_tokens,
                "total_tokens": len(job.prompt) + job.completion_tokens}

    async def _whole(self, request: HttpRequest, job: Job, tokens: _Tokens) -> str:
        """The whole completion, or _Disconnected as soon as the client goes away."""

        async def collect() -> str:
            return "".join([piece async for piece in self._pieces(job, tokens)])

        collecting = asyncio.ensure_future(collect())
        watching = asyncio.ensure_future(_disconnect(request))
        try:
            await asyncio.wait({collecting, watching}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            job.request.cancel()  # (a finished request is not affected)
            watching.cancel()
        if not collecting.done():
            collecting.cancel()
            raise _Disconnected
        return collecting.result()

    def _events(self, job: Job, tokens: _Tokens, chunk: Callable[..., dict]) -> AsyncIterator[str]:
        async def events() -> AsyncIterator[str]:
            first = chunk(start=True)
            if first is not None:
                yield _sse(first)
            try:
                async for piece in self._pieces(job, tokens):
                    yield _sse(chunk(text=piece))
                yield _sse(chunk(finish=job.finish_reason))
                if job.include_usage:
                    yield _sse(chunk(usage=self._usage(job)))
            except ApiError as e:
                yield _sse(e.body())
            yield "data: [DONE]\n\n"

        return events()

    def _encode(self, text: str, param: str) -> list[int]:
        """`text`'s token ids, or a 400 naming `param` (a prompt longer than the cache could take is not tokenized)."""
        if len(text) > self.limits.max_chars:
            raise _invalid(param, f"{param} has {len(text)} characters; the KV cache holds {self.capacity} tokens per "
                                  f"sequence, so this server takes at most {self.limits.max_chars}",
                           "context_length_exceeded")
        try:
            return self.codec.encode(_text(text, param))
        except LlmcError as e:  # the tokenizer failed on it
            raise _invalid(param, str(e), "tokenizer_failed") from None

    def _completion_job(self, raw: bytes) -> Job:
        body = self._body(raw, "completions")
        prompt = body.get("prompt")
        if prompt is None:
            raise _invalid("prompt", "missing required field 'prompt'", "missing_required_parameter")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self._encode(prompt, "prompt")
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            ids = prompt
        else:
            raise _invalid("prompt", "prompt must be a string or a list of token ids (one prompt per request)")
        return self._job(body, ids, "prompt", ("max_tokens",), COMPLETION_MAX_TOKENS)

    def _chat_job(self, raw: bytes) -> Job:
        body = self._body(raw, "chat")
        messages = _messages(body, self.limits)
        if not self.codec.chat_template:
            raise _invalid("messages", "this model has no chat template; use /v1/completions", "no_chat_template")
        try:
            text = self.codec.render_chat(messages)
        except LlmcError as e:  # the template failed, or ran out of its time or size budget
            raise _invalid("messages", str(e), "chat_template_failed") from None
        return self._job(body, self._encode(text, "messages"), "messages", ("max_tokens", "max_completion_tokens"),
                         None)

    async def completions(self, request: HttpRequest) -> Response:
        job = await self._prepared(request, self._completion_job)
        tokens = self._submit(job, "prompt")
        ident, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str = "", finish: str | None = None, start: bool = False, usage: dict | None = None):
            if start:
                return None
            return {"id": ident, "object": "text_completion", "created": created, "model": self.name,
                    "choices": [] if usage else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                    **({"usage": usage} if job.include_usage else {})}

        return await self._respond(request, job, tokens, chunk, lambda text: {
            "id": ident, "object": "text_completion", "created": created, "model": self.name,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": job.finish_reason}]})

    async def chat_completions(self, request: HttpRequest) -> Response:
        job = await self._prepared(request, self._chat_job)
        tokens = self._submit(job, "messages")
        ident, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(text: str = "", finish: str | None = None, start: bool = False, usage: dict | None = None):
            if usage:
                choices = []
            else:
                delta = {"role": "assistant", "content": ""} if start else ({"content": text} if finish is None else {})
                choices = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
            return {"id": ident, "object": "chat.completion.chunk", "created": created, "model": self.name,
                    "choices": choices, **({"usage": usage} if job.include_usage else {})}

        return await self._respond(request, job, tokens, chunk, lambda reply: {
            "id": ident, "object": "chat.completion", "created": created, "model": self.name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": reply}, "logprobs": None,
                         "finish_reason": job.finish_reason}]})

    async def _respond(self, request: HttpRequest, job: Job, tokens: _Tokens, chunk: Callable[..., dict | None],
                       answer: Callable[[str], dict]) -> Response:
        """Server-sent `chunk`s as tokens come (`stream`), or `answer(text)` with the usage once whole."""
        if job.stream:
            return _EventStream(self._events(job, tokens, chunk), job.request.cancel)
        try:
            text = await self._whole(request, job, tokens)
        except _Disconnected:
            return Response(status_code=499)
        return JSONResponse(answer(text) | {"usage": self._usage(job)})


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


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _disconnect(request: HttpRequest) -> None:
    """Return when the client has gone away (the body is already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
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
