"""Running `llmc serve` in production: Prometheus metrics, an API key, CORS, an access log, and tokenizing.

`Operations` gives the server's Starlette app what it adds; the server calls `metrics`' hooks as requests run:

    ops = Operations("smol", codec, server.health_stats, ServeOptions(api_key="sk-1", cors_origins=("*",)))
    app = Starlette(routes=[*routes, *ops.routes], middleware=ops.middleware)
    ops.metrics.started("chat"); ops.metrics.first_token("chat", 0.2)
    ops.metrics.finished("chat", "stop", prompt_tokens=12, completion_tokens=30, seconds=1.5)

    GET  /metrics      Prometheus' text format: `llmc_*` metrics, in a registry of this server's own
    POST /tokenize     {"content": "Hi", "add_special": false, "with_pieces": false} → {"tokens": [13, 4]}
                       (with_pieces: [{"id": 13, "piece": "H"}, ...]; llama-server's shapes)
    POST /detokenize   {"tokens": [13, 4]} → {"content": "Hi"}

With an API key, every route but /health needs `Authorization: Bearer KEY` (as llama-server, which keeps
/metrics behind the key too): 401 with OpenAI's error body otherwise. CORS headers are sent for the origins
given only (none by default). The access log writes one line per request to stderr (logger "llmc.access"),
when its response has ended: a stream's line comes when the stream does.

The middleware is plain ASGI (a streamed answer passes through unbuffered); prometheus-client is imported
when a server starts (the serve extra).
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from anyio import CapacityLimiter
from anyio.to_thread import run_sync
from starlette.datastructures import Headers
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmc.errors import LlmcError, printable
from llmc.runtime.api_requests import ApiError, Limits, invalid, json_object
from llmc.runtime.codec import TextCodec

ACCESS_LOGGER = "llmc.access"
USAGE = "llmc_usage"  # the key of a request's state where the server puts its OpenAI usage, for the access log
OPEN_PATHS = ("/health",)  # the routes an API key does not guard
RATE_WINDOW_SECONDS = 60.0  # tokens/s is measured over at least this much of the recent past
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
DURATION_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)
TOKENIZE_CAPACITY = 1 << 15  # the KV capacity `Operations` sizes its limits for when it is given none


@dataclass(frozen=True)
class ServeOptions:
    """How `llmc serve` meets the outside: `ServeOptions(api_key="sk-1", cors_origins=("https://a.example",))`."""

    api_key: str | None = None  # a Bearer token every route but /health requires
    cors_origins: tuple[str, ...] = ()  # the origins browsers may call from ("*": any); (): no CORS headers
    access_log: bool = True  # one line per request on stderr (logger "llmc.access")


# ------------------------------------------------------------------ HTTP helpers the server shares


def error_response(error: ApiError) -> Response:
    """The error as OpenAI's body in ASCII JSON (a message may quote a client's lone surrogate, which UTF-8
    cannot hold): `error_response(ApiError(401, "invalid API key", code="invalid_api_key"))`."""
    headers = {"Retry-After": "1"} if error.status in (429, 503) else {}
    if error.status in (408, 413):  # the rest of the body is not read: the connection cannot serve another
        headers["Connection"] = "close"
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return Response(json.dumps(error.body()), error.status, headers, media_type="application/json")


def internal_error(exc: BaseException) -> Response:
    """The 500 of an exception that nothing else answered: `internal error: KeyError: 'x'`."""
    return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))


async def read_body(request: HttpRequest, limits: Limits) -> bytes:
    """The request's body: at most `limits.max_body_bytes`, whole within `limits.body_seconds` (413 and 408
    otherwise): `raw = await read_body(request, Limits.for_capacity(4096))`."""
    limit = limits.max_body_bytes
    too_large = ApiError(413, f"the request body is larger than {limit} bytes, the most this server takes",
                         code="too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(limits.body_seconds):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {limits.body_seconds:g} s",
                       code="timeout") from None
    except ClientDisconnect:  # (nobody reads the answer)
        raise ApiError(499, "the client went away before its request was whole") from None
    return b"".join(chunks)


def record_usage(request: HttpRequest, usage: dict) -> None:
    """Give the access log a request's OpenAI `usage` (its line then names the prompt and completion tokens):
    `record_usage(request, {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42})`."""
    setattr(request.state, USAGE, usage)


# ------------------------------------------------------------------ middleware


class ApiKeyCheck:
    """ASGI middleware: every HTTP request but those of `OPEN_PATHS` must carry `Authorization: Bearer KEY`
    (compared in constant time); 401 otherwise. `Middleware(ApiKeyCheck, key="sk-1")`."""

    def __init__(self, app: ASGIApp, key: str):
        self.app, self.expected = app, key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            given = dict(scope["headers"]).get(b"authorization")
            if given is None:
                problem = "this server needs an API key: send the header 'Authorization: Bearer KEY'"
            else:
                scheme, _, token = given.partition(b" ")
                if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.expected):
                    return await self.app(scope, receive, send)
                problem = "invalid API key (send the header 'Authorization: Bearer KEY')"
            return await error_response(ApiError(401, problem, code="invalid_api_key"))(scope, receive, send)
        await self.app(scope, receive, send)


class Cors(CORSMiddleware):
    """Starlette's CORS middleware, its refused preflights in OpenAI's error body (`Disallowed CORS origin`, 400,
    `code: cors_refused`) like every other refusal, not plain text."""

    def preflight_response(self, request_headers: Headers) -> Response:
        answer = super().preflight_response(request_headers)
        if answer.status_code == 200:
            return answer
        refused = error_response(ApiError(answer.status_code, bytes(answer.body).decode(), code="cors_refused"))
        refused.headers.update({k: v for k, v in answer.headers.items() if k.lower().startswith("access-control-")})
        return refused


class InternalErrors:
    """ASGI middleware, the innermost: an exception that escapes a route before its response has started is
    answered here with `internal_error`'s 500, inside the CORS middleware, so that a browser may read it
    (Starlette's own handler answers outside every middleware, without CORS headers). The exception is then
    raised on, for the server's log, as Starlette does."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except Exception as exc:
            if not started:
                await internal_error(exc)(scope, receive, send)
            raise


class AccessLog:
    """ASGI middleware: one line per HTTP request on the "llmc.access" logger when its response has ended,
    `127.0.0.1:50312 "POST /v1/chat/completions" 200 1532.1 ms prompt=12 completion=30` (the tokens where the
    server has `record_usage`d them; status 500 where the app failed before answering)."""

    def __init__(self, app: ASGIApp):
        self.app = app
        self.log = logging.getLogger(ACCESS_LOGGER)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, status = time.perf_counter(), 500
        state = scope.setdefault("state", {})

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            client = scope.get("client")
            where = f"{client[0]}:{client[1]}" if client else "-"
            line = (f'{where} "{scope["method"]} {printable(scope["path"], 200)}" {status} '
                    f"{1000 * (time.perf_counter() - start):.1f} ms")
            usage = state.get(USAGE)
            if isinstance(usage, dict):
                line += f" prompt={usage.get('prompt_tokens')} completion={usage.get('completion_tokens')}"
            self.log.info(line)


def _log_to_stderr() -> None:
    """The access logger's lines (at level INFO, unless the program set another) on stderr, unless the program
    has given it handlers of its own."""
    log = logging.getLogger(ACCESS_LOGGER)
    if log.level == logging.NOTSET:
        log.setLevel(logging.INFO)
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s"))
        log.addHandler(handler)
        log.propagate = False


# ------------------------------------------------------------------ metrics


class Metrics:
    """The server's Prometheus metrics, in a registry of its own (`registry`), and the hooks that feed them.
    The engine's state (running, waiting, reused tokens, ...) is read from `stats()` (the server's /health
    counts) at each scrape; `text()` is the page. Each `started` is followed by one `finished`; the seconds
    passed to `first_token` and `finished` count from the `started`.

        metrics = Metrics("smol", server.health_stats)
        metrics.started("completions"); metrics.first_token("completions", 0.12)
        metrics.finished("completions", "length", prompt_tokens=5, completion_tokens=16, seconds=0.9)
    """

    def __init__(self, name: str, stats: Callable[[], dict]):
        try:
            import prometheus_client as prometheus
            from prometheus_client import core
        except ImportError:
            raise LlmcError("llmc serve's /metrics needs prometheus-client: pip install 'llmc[serve]'") from None
        self.generate_latest, self.content_type = prometheus.generate_latest, prometheus.CONTENT_TYPE_LATEST
        self.registry = prometheus.CollectorRegistry()
        self.stats = stats
        registry = {"registry": self.registry}
        prometheus.Info("llmc_model", "the model served", **registry).info({"model": name})
        self.requests = prometheus.Counter("llmc_requests", "generation requests ended, by endpoint and finish "
                                           "reason", ["endpoint", "reason"], **registry)
        self.in_progress = prometheus.Gauge("llmc_requests_in_progress", "generation requests begun and not ended "
                                            "(being prepared, waiting or running)", ["endpoint"], **registry)
        self.prompt_tokens = prometheus.Counter("llmc_prompt_tokens", "prompt tokens of the requests ended",
                                                ["endpoint"], **registry)
        self.generation_tokens = prometheus.Counter("llmc_generation_tokens", "tokens generated by the requests "
                                                    "ended", ["endpoint"], **registry)
        self.time_to_first_token = prometheus.Histogram("llmc_time_to_first_token_seconds", "from a request's "
                                                        "start to its first token", ["endpoint"],
                                                        buckets=TTFT_BUCKETS, **registry)
        self.duration = prometheus.Histogram("llmc_request_duration_seconds", "from a request's start to its "
                                             "end", ["endpoint"], buckets=DURATION_BUCKETS, **registry)
        self.registry.register(_EngineCollector(stats, core))

    def started(self, endpoint: str) -> None:
        self.in_progress.labels(endpoint).inc()

    def first_token(self, endpoint: str, seconds: float) -> None:
        self.time_to_first_token.labels(endpoint).observe(seconds)

    def finished(self, endpoint: str, reason: str, prompt_tokens: int, completion_tokens: int,
                 seconds: float) -> None:
        self.in_progress.labels(endpoint).dec()
        self.requests.labels(endpoint, reason).inc()
        self.prompt_tokens.labels(endpoint).inc(prompt_tokens)
        self.generation_tokens.labels(endpoint).inc(completion_tokens)
        self.duration.labels(endpoint).observe(seconds)

    def text(self) -> bytes:
        """The metrics in Prometheus' text format."""
        return self.generate_latest(self.registry)


class _EngineCollector:
    """The engine's gauges and counters, from one `stats()` call per scrape; and the generation's tokens/s
    over the last `RATE_WINDOW_SECONDS` at least (between scrapes: the first one's rate is since the start)."""

    def __init__(self, stats: Callable[[], dict], families):
        self.stats, self.families = stats, families  # (prometheus_client.core)
        self.lock = threading.Lock()
        self.samples: deque[tuple[float, int]] = deque([(time.monotonic(), 0)], maxlen=1024)  # (when, generated)

    def collect(self) -> Iterator:
        stats, gauge, counter = self.stats(), self.families.GaugeMetricFamily, self.families.CounterMetricFamily
        yield gauge("llmc_slots", "sequences the engine runs at once", value=stats["slots"])
        yield gauge("llmc_requests_running", "requests holding a slot", value=stats["running"])
        yield gauge("llmc_requests_waiting", "requests waiting for a slot", value=stats["waiting"])
        yield gauge("llmc_queue_size", "requests that may wait for a slot (beyond them: 429)",
                    value=stats["queue_size"])
        yield counter("llmc_prefill_tokens", "prompt tokens run through the model", value=stats["prompt_tokens"])
        yield counter("llmc_reused_prompt_tokens", "prompt tokens taken from a slot's cache instead",
                      value=stats["reused_tokens"])
        yield counter("llmc_drafted_tokens", "tokens drafted by speculation", value=stats["drafted_tokens"])
        yield counter("llmc_accepted_tokens", "drafted tokens accepted", value=stats["accepted_tokens"])
        yield gauge("llmc_generation_tokens_per_second", "tokens generated per second, all requests together, "
                    f"over the last {RATE_WINDOW_SECONDS:g} s or more", value=self._rate(stats["generated_tokens"]))

    def _rate(self, generated: int) -> float:
        now = time.monotonic()
        with self.lock:
            self.samples.append((now, generated))
            while len(self.samples) > 2 and self.samples[1][0] <= now - RATE_WINDOW_SECONDS:
                self.samples.popleft()  # (the oldest kept is the last one before the window)
            then, before = self.samples[0]
        return (generated - before) / (now - then) if now > then else 0.0


# ------------------------------------------------------------------ the routes and what wraps them


class Operations:
    """What `llmc serve` adds for operating it: `middleware` (access log, CORS, API key, internal errors, outermost
    first),
    `routes` (GET /metrics, POST /tokenize, POST /detokenize) and `metrics` (the hooks the generation calls).
    `limits` bound the tokenizing routes' bodies (the server's, sized from its KV capacity)."""

    def __init__(self, name: str, codec: TextCodec, stats: Callable[[], dict], options: ServeOptions,
                 limits: Limits | None = None):
        self.codec = codec
        self.limits = limits or Limits.for_capacity(TOKENIZE_CAPACITY)
        self.workers = CapacityLimiter(self.limits.workers)  # threads that tokenize at once
        self.metrics = Metrics(name, stats)
        self.middleware: list[Middleware] = []
        if options.access_log:
            _log_to_stderr()
            self.middleware.append(Middleware(AccessLog))
        if options.cors_origins:
            self.middleware.append(Middleware(Cors, allow_origins=list(options.cors_origins),
                                              allow_methods=["GET", "POST"], allow_headers=["*"],
                                              expose_headers=["Retry-After"]))
        if options.api_key is not None:
            self.middleware.append(Middleware(ApiKeyCheck, key=options.api_key))
        self.middleware.append(Middleware(InternalErrors))
        self.routes = [Route("/metrics", self.metrics_page, methods=["GET"]),
                       Route("/tokenize", self.tokenize, methods=["POST"]),
                       Route("/detokenize", self.detokenize, methods=["POST"])]

    async def metrics_page(self, request: HttpRequest) -> Response:
        return Response(self.metrics.text(), media_type=self.metrics.content_type)

    async def tokenize(self, request: HttpRequest) -> Response:
        """{"content": TEXT, "add_special": false, "with_pieces": false} → {"tokens": [...]}; `add_special`
        puts the beginning-of-text token first where the model adds one."""
        try:
            body = await self._body(request, {"content": str, "add_special": bool, "with_pieces": bool}, "content")
            text = body["content"]
            if len(text) > self.limits.max_chars:
                raise invalid("content", f"content has {len(text)} characters; this server takes at most "
                                         f"{self.limits.max_chars}")
            tokens = await self._on_worker("content", self.codec.encode, text, body.get("add_special", False))
            if body.get("with_pieces", False):
                pieces = await self._on_worker("content", lambda: [self.codec.piece(t) for t in tokens])
                return JSONResponse({"tokens": [{"id": t, "piece": p} for t, p in zip(tokens, pieces)]})
            return JSONResponse({"tokens": tokens})
        except ApiError as e:
            return error_response(e)

    async def detokenize(self, request: HttpRequest) -> Response:
        """{"tokens": [ids]} → {"content": TEXT} (special tokens spelt out); an id outside the vocabulary is 400."""
        try:
            tokens = (await self._body(request, {"tokens": list}, "tokens"))["tokens"]
            vocabulary = self.codec.tokenizer.get_vocab_size(with_added_tokens=True)
            wrong = next((i for i, t in enumerate(tokens) if type(t) is not int or not 0 <= t < vocabulary), None)
            if wrong is not None:
                raise invalid("tokens", f"tokens[{wrong}] is {printable(json.dumps(tokens[wrong]), 60)}, not a token "
                                        f"id (an integer in 0..{vocabulary - 1})")
            return JSONResponse({"content": await self._on_worker("tokens", self.codec.decode, tokens)})
        except ApiError as e:
            return error_response(e)

    async def _body(self, request: HttpRequest, fields: dict[str, type], required: str) -> dict:
        """The request's JSON object, holding `required` and no field but `fields`, each of its type (400s
        naming the field)."""
        body = json_object(await read_body(request, self.limits))
        if required not in body:
            raise invalid(required, f"missing required field '{required}'", "missing_required_parameter")
        for name, value in body.items():
            if name not in fields:
                raise invalid(name, f"unknown field '{printable(name, 60)}'", "unknown_parameter")
            if type(value) is not fields[name]:
                raise invalid(name, f"{name} must be {_KINDS[fields[name]]}")
        return body

    async def _on_worker(self, param: str, work: Callable, *args):
        """`work(*args)` on a thread (tokenizing a long text must not hold up the event loop); a tokenizer's
        failure is a 400 naming the field `param`."""
        try:
            return await run_sync(work, *args, limiter=self.workers)
        except LlmcError as e:
            raise invalid(param, str(e), "tokenizer_failed") from None


_KINDS = {str: "a string", bool: "a boolean", list: "a list"}
