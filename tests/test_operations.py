"""Operating `llmc serve` (`llmc.runtime.operations`): /metrics, the API key, CORS, the access log, /tokenize and
/detokenize on a small Starlette app of the test's own (and through the real server); chat templates from a
file (`--chat-template`) and from an HF directory's `chat_template.jinja`."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from tiny_models import CHAT_TEMPLATE, TinySpec

httpx = pytest.importorskip("httpx")
prometheus = pytest.importorskip("prometheus_client")
pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")

from prometheus_client.parser import text_string_to_metric_families  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.responses import JSONResponse, StreamingResponse  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from llmc.errors import ModelFormatError  # noqa: E402
from llmc.frontend.hf import load_hf_tokenizer  # noqa: E402
from llmc.runtime import operations  # noqa: E402
from llmc.runtime.api_requests import Limits  # noqa: E402
from llmc.runtime.codec import TextCodec, read_chat_template  # noqa: E402
from llmc.runtime.operations import ACCESS_LOGGER, Operations, ServeOptions, record_usage  # noqa: E402
from llmc.runtime.templates import RenderLimits  # noqa: E402

SPEC = TinySpec()
KEY = "sk-test-1"
ORIGIN = "https://app.example"


@pytest.fixture(scope="module")
def codec(tiny) -> TextCodec:
    return load_hf_tokenizer(tiny(SPEC, "hf"))


class Stats:
    """What the server's `/health` counts would say, changed by the test."""

    def __init__(self):
        self.values = {"slots": 4, "running": 2, "waiting": 1, "queue_size": 64, "prompt_tokens": 30,
                       "reused_tokens": 970, "drafted_tokens": 8, "accepted_tokens": 5, "generated_tokens": 0}

    def __call__(self) -> dict:
        return dict(self.values)


def small_app(codec: TextCodec, options: ServeOptions, stats: Stats | None = None,
              limits: Limits | None = None) -> tuple[Starlette, Operations]:
    """A Starlette app with the operations' middleware and routes, an open /health, a /v1/answer that records
    its usage, a /v1/stream that sends "first", waits for `app.state.go`, then sends "second", and a /v1/fail
    that raises."""
    operations = Operations("tiny", codec, stats or Stats(), options, limits)
    go = threading.Event()

    async def health(request):
        return JSONResponse({"status": "ok"})

    async def answer(request):
        record_usage(request, {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10})
        return JSONResponse({"answer": 42})

    async def stream(request):
        async def parts():
            yield b"first\n"
            await asyncio.to_thread(go.wait, 30)
            yield b"second\n"
        return StreamingResponse(parts(), media_type="text/plain")

    async def fail(request):
        raise RuntimeError("a fault of the test's own")

    app = Starlette(routes=[Route("/health", health), Route("/v1/answer", answer, methods=["POST"]),
                            Route("/v1/stream", stream), Route("/v1/fail", fail), *operations.routes],
                    middleware=operations.middleware)
    app.state.go = go
    return app, operations


def scrape(client) -> dict[tuple[str, tuple], float]:
    """/metrics' samples: {(name, sorted labels): value}."""
    page = client.get("/metrics")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/plain")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(page.text) for s in family.samples}


# ------------------------------------------------------------------ /metrics


def test_metrics_count_what_the_hooks_and_the_engine_report(codec) -> None:
    stats = Stats()
    app, operations = small_app(codec, ServeOptions(access_log=False), stats)
    metrics = operations.metrics
    for endpoint, reason, ttft, prompt, completion, seconds in (("chat", "stop", 0.03, 12, 30, 1.5),
                                                                ("chat", "length", 0.7, 20, 16, 2.0),
                                                                ("completions", "stop", 0.2, 5, 1, 0.3)):
        metrics.started(endpoint)
        metrics.first_token(endpoint, ttft)
        metrics.finished(endpoint, reason, prompt, completion, seconds)
    metrics.started("chat")  # one still running
    with TestClient(app) as client:
        samples = scrape(client)
    chat = (("endpoint", "chat"),)
    assert samples[("llmc_requests_total", (("endpoint", "chat"), ("reason", "stop")))] == 1
    assert samples[("llmc_requests_total", (("endpoint", "chat"), ("reason", "length")))] == 1
    assert samples[("llmc_requests_in_progress", chat)] == 1
    assert samples[("llmc_prompt_tokens_total", chat)] == 32
    assert samples[("llmc_generation_tokens_total", chat)] == 46
    assert samples[("llmc_time_to_first_token_seconds_count", chat)] == 2
    assert samples[("llmc_time_to_first_token_seconds_bucket", chat + (("le", "0.05"),))] == 1
    assert samples[("llmc_request_duration_seconds_sum", (("endpoint", "completions"),))] == pytest.approx(0.3)
    assert samples[("llmc_model_info", (("model", "tiny"),))] == 1
    for name, key in (("llmc_slots", "slots"), ("llmc_requests_running", "running"),
                      ("llmc_requests_waiting", "waiting"), ("llmc_queue_size", "queue_size"),
                      ("llmc_prefill_tokens_total", "prompt_tokens"),
                      ("llmc_reused_prompt_tokens_total", "reused_tokens"),
                      ("llmc_accepted_tokens_total", "accepted_tokens")):
        assert samples[(name, ())] == stats.values[key], name


def test_tokens_per_second_is_the_rate_since_the_earliest_scrape_in_the_window(codec, monkeypatch) -> None:
    stats = Stats()
    begun = time.monotonic()
    app, _ = small_app(codec, ServeOptions(access_log=False), stats)
    with TestClient(app) as client:
        assert scrape(client)[("llmc_generation_tokens_per_second", ())] == 0
        stats.values["generated_tokens"] = 10_000
        rate = scrape(client)[("llmc_generation_tokens_per_second", ())]
        assert rate >= 10_000 / (time.monotonic() - begun)  # the first scrapes: over the time since the start
        monkeypatch.setattr(operations, "RATE_WINDOW_SECONDS", 0.05)
        time.sleep(0.1)
        stats.values["generated_tokens"] = 10_100
        assert scrape(client)[("llmc_generation_tokens_per_second", ())] <= 100 / 0.1  # since the last scrape


def test_each_server_has_a_registry_of_its_own(codec) -> None:
    first, second = small_app(codec, ServeOptions(access_log=False))[1], small_app(codec, ServeOptions())[1]
    first.metrics.started("chat")
    assert first.metrics.registry is not second.metrics.registry
    assert b'llmc_requests_in_progress{endpoint="chat"} 1.0' in first.metrics.text()
    assert b"llmc_requests_in_progress{" not in second.metrics.text()


# ------------------------------------------------------------------ API key and CORS


def test_an_api_key_guards_every_route_but_health(codec) -> None:
    app, _ = small_app(codec, ServeOptions(api_key=KEY, access_log=False))
    with TestClient(app) as client:
        for headers in ({}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": f"Basic {KEY}"},
                        {"Authorization": KEY}):
            for method, path in (("POST", "/v1/answer"), ("GET", "/metrics"), ("POST", "/tokenize")):
                refused = client.request(method, path, headers=headers)
                assert refused.status_code == 401, (headers, path)
                assert refused.headers["www-authenticate"] == "Bearer"
                error = refused.json()["error"]
                assert (error["type"], error["code"]) == ("invalid_request_error", "invalid_api_key")
        assert client.get("/health").status_code == 200
        assert client.post("/v1/answer", headers={"Authorization": f"Bearer {KEY}"}).json() == {"answer": 42}
        assert client.get("/metrics", headers={"Authorization": f"bearer {KEY}"}).status_code == 200


def test_cors_is_off_unless_origins_are_given(codec) -> None:
    app, _ = small_app(codec, ServeOptions(access_log=False))
    with TestClient(app) as client:
        answer = client.post("/v1/answer", headers={"Origin": ORIGIN})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers


def test_cors_answers_preflights_and_marks_answers_even_refusals(codec) -> None:
    app, _ = small_app(codec, ServeOptions(api_key=KEY, cors_origins=(ORIGIN,), access_log=False))
    with TestClient(app) as client:
        preflight = client.options("/v1/answer", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                                                           "Access-Control-Request-Headers": "authorization"})
        assert preflight.status_code == 200  # (a browser's preflight carries no key)
        assert preflight.headers["access-control-allow-origin"] == ORIGIN
        assert "authorization" in preflight.headers["access-control-allow-headers"].lower()
        refused = client.post("/v1/answer", headers={"Origin": ORIGIN})
        assert (refused.status_code, refused.headers["access-control-allow-origin"]) == (401, ORIGIN)
        other = client.options("/v1/answer", headers={"Origin": "https://evil.example",
                                                       "Access-Control-Request-Method": "POST"})
        assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
        assert other.json()["error"] == {"message": "Disallowed CORS origin", "type": "invalid_request_error",
                                         "param": None, "code": "cors_refused"}  # (was plain text)


def test_an_internal_error_is_a_json_500_that_a_browser_may_read(codec) -> None:
    """A route's exception: OpenAI's error body, with CORS headers (Starlette's own 500 has none), and still
    raised for the server's log."""
    app, _ = small_app(codec, ServeOptions(cors_origins=(ORIGIN,), access_log=False))
    with TestClient(app, raise_server_exceptions=False) as client:
        failed = client.get("/v1/fail", headers={"Origin": ORIGIN})
    assert (failed.status_code, failed.headers["access-control-allow-origin"]) == (500, ORIGIN)
    assert failed.json()["error"] == {"message": "internal error: RuntimeError: a fault of the test's own",
                                      "type": "server_error", "param": None, "code": None}
    with TestClient(app) as client, pytest.raises(RuntimeError, match="a fault of the test's own"):
        client.get("/v1/fail")


def test_cors_any_origin(codec) -> None:
    app, _ = small_app(codec, ServeOptions(cors_origins=("*",), access_log=False))
    with TestClient(app) as client:
        assert client.post("/v1/answer", headers={"Origin": ORIGIN}).headers["access-control-allow-origin"] == "*"


# ------------------------------------------------------------------ the access log


class Lines(logging.Handler):
    """The access log's lines."""

    def __init__(self):
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def access_lines() -> Iterator[list[str]]:
    logger, lines = logging.getLogger(ACCESS_LOGGER), Lines()
    logger.addHandler(lines)
    level = logger.level
    logger.setLevel(logging.NOTSET)  # (as a program that configured nothing leaves it)
    yield lines.lines
    logger.removeHandler(lines)
    logger.setLevel(level)


@pytest.fixture
def listening() -> Iterator[Callable[[Starlette], str]]:
    """`listening(app)` → the URL of `app` served by uvicorn on a free port, until the test ends."""
    servers = []

    def serve(app) -> str:
        sock = socket.create_server(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
        thread.start()
        servers.append((server, thread, sock))
        deadline = time.monotonic() + 10
        while not server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    yield serve
    for server, thread, sock in servers:
        server.should_exit = True
        thread.join(10)
        sock.close()


def test_access_log_writes_a_line_per_request_with_its_usage(codec, access_lines) -> None:
    app, _ = small_app(codec, ServeOptions(api_key=KEY))
    with TestClient(app) as client:
        client.post("/v1/answer", headers={"Authorization": f"Bearer {KEY}"})
        client.post("/v1/answer")
        client.get("/nowhere", headers={"Authorization": f"Bearer {KEY}"})
    assert len(access_lines) == 3
    answered, refused, missing = access_lines
    assert answered.startswith("testclient:") and ' "POST /v1/answer" 200 ' in answered
    assert answered.endswith(" prompt=7 completion=3") and " ms " in answered
    assert ' "POST /v1/answer" 401 ' in refused and "prompt=" not in refused
    assert ' "GET /nowhere" 404 ' in missing


def test_access_log_is_off_when_asked(codec, access_lines) -> None:
    app, _ = small_app(codec, ServeOptions(access_log=False))
    with TestClient(app) as client:
        client.post("/v1/answer")
    assert access_lines == []


def test_a_stream_passes_through_unbuffered_and_is_logged_when_it_ends(codec, access_lines, listening) -> None:
    """The stream's second part waits for the client to have read the first: middleware that buffered the
    answer would never deliver it (and the read would time out)."""
    app, _ = small_app(codec, ServeOptions(api_key=KEY, cors_origins=("*",)))
    url = listening(app)
    with httpx.stream("GET", f"{url}/v1/stream", headers={"Authorization": f"Bearer {KEY}"}, timeout=20) as answer:
        lines = answer.iter_lines()
        assert next(lines) == "first"
        assert access_lines == []  # (the line comes at the stream's end)
        app.state.go.set()
        assert next(lines) == "second"
    deadline = time.monotonic() + 10
    while not access_lines and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(access_lines) == 1 and access_lines[0].startswith("127.0.0.1:")
    assert ' "GET /v1/stream" 200 ' in access_lines[0]


# ------------------------------------------------------------------ /tokenize and /detokenize


def test_tokenize_and_detokenize_round_trip(codec) -> None:
    text = "Hello world, 2018 <|im_end|>"
    app, _ = small_app(codec, ServeOptions(access_log=False))
    with TestClient(app) as client:
        tokens = client.post("/tokenize", json={"content": text}).json()["tokens"]
        assert tokens == codec.encode(text) and len(tokens) > 5
        assert client.post("/detokenize", json={"tokens": tokens}).json() == {"content": text}
        pieces = client.post("/tokenize", json={"content": text, "with_pieces": True}).json()["tokens"]
        assert [p["id"] for p in pieces] == tokens
        assert "".join(p["piece"] for p in pieces) == text


def test_tokenize_adds_the_beginning_of_text_token_with_add_special(codec) -> None:
    bos_codec = dataclasses.replace(codec, add_bos=True)
    app, _ = small_app(bos_codec, ServeOptions(access_log=False))
    with TestClient(app) as client:
        plain = client.post("/tokenize", json={"content": "Hi"}).json()["tokens"]
        special = client.post("/tokenize", json={"content": "Hi", "add_special": True}).json()["tokens"]
    assert special == [codec.bos_id, *plain] and codec.bos_id not in plain


@pytest.mark.parametrize("path,body,param,words", [
    ("/tokenize", b"{", None, "not valid JSON"),
    ("/tokenize", b"[1]", None, "must be a JSON object"),
    ("/tokenize", b"{}", "content", "missing required field 'content'"),
    ("/tokenize", b'{"content": 5}', "content", "content must be a string"),
    ("/tokenize", b'{"content": "a", "add_special": 1}', "add_special", "must be a boolean"),
    ("/tokenize", b'{"content": "a", "parse_special": true}', "parse_special", "unknown field"),
    ("/tokenize", b'{"content": "' + b"x" * 200 + b'"}', "content", "at most 128"),
    ("/tokenize", b'{"content": "\\ud800"}', "content", "tokenizer failed"),
    ("/detokenize", b'{"tokens": 5}', "tokens", "tokens must be a list"),
    ("/detokenize", b'{"tokens": [1, 100000]}', "tokens", "tokens[1] is 100000, not a token id"),
    ("/detokenize", b'{"tokens": [1, -1]}', "tokens", "tokens[1] is -1"),
    ("/detokenize", b'{"tokens": [1, "2"]}', "tokens", 'tokens[1] is "2"'),
    ("/detokenize", b'{"tokens": [true]}', "tokens", "tokens[0] is true"),
])
def test_bad_bodies_are_400_naming_the_field(codec, path, body, param, words) -> None:
    app, _ = small_app(codec, ServeOptions(access_log=False), limits=Limits(128, 4, 4096))
    with TestClient(app) as client:
        refused = client.post(path, content=body)
    error = refused.json()["error"]
    assert (refused.status_code, error["param"]) == (400, param) and words in error["message"], error


def test_a_body_over_the_limit_is_413(codec) -> None:
    app, _ = small_app(codec, ServeOptions(access_log=False), limits=Limits(128, 4, 4096))
    with TestClient(app) as client:
        refused = client.post("/tokenize", content=json.dumps({"content": "x" * 5000}))
    assert (refused.status_code, refused.json()["error"]["code"]) == (413, "too_large")
    assert refused.headers["connection"] == "close"


# ------------------------------------------------------------------ chat templates


def test_read_chat_template_checks_the_file(tmp_path: Path) -> None:
    good = tmp_path / "good.jinja"
    good.write_text(CHAT_TEMPLATE)
    assert read_chat_template(good) == CHAT_TEMPLATE
    cases = {"broken.jinja": ("{% for m in messages %}{{ m.content }", "chat template failed: unexpected '}'"),
             "latin1.jinja": (b"caf\xe9", "not UTF-8 text (byte 3)"),
             "long.jinja": ("{{ 'x' }}" * 20, "longer than 100 characters"),
             "empty.jinja": (" \n", "the chat template is empty")}  # (was: "this model has no chat template")
    for name, (content, words) in cases.items():
        path = tmp_path / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        with pytest.raises(ModelFormatError, match=f"^{re.escape(str(path))}: .*{re.escape(words)}"):
            read_chat_template(path, RenderLimits(chars=100))
    with pytest.raises(ModelFormatError, match="cannot read the chat template: No such file"):
        read_chat_template(tmp_path / "absent.jinja")
    assert read_chat_template(tmp_path / "broken.jinja", check=False).startswith("{% for")


def hf_copy(tiny, tmp_path: Path) -> Path:
    directory = tmp_path / "model"
    shutil.copytree(tiny(SPEC, "hf"), directory)
    return directory


def test_chat_template_jinja_wins_over_tokenizer_config(tiny, tmp_path: Path) -> None:
    directory = hf_copy(tiny, tmp_path)
    assert load_hf_tokenizer(directory).chat_template == CHAT_TEMPLATE
    (directory / "chat_template.jinja").write_text("{{ messages[0].content }}")
    codec = load_hf_tokenizer(directory)
    assert codec.chat_template == "{{ messages[0].content }}"
    assert codec.render_chat([{"role": "user", "content": "Hi"}]) == "Hi"


def test_tokenizer_config_named_templates_give_the_default(tiny, tmp_path: Path) -> None:
    directory = hf_copy(tiny, tmp_path)
    settings = json.loads((directory / "tokenizer_config.json").read_text())
    settings["chat_template"] = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "chat"}]
    (directory / "tokenizer_config.json").write_text(json.dumps(settings))
    assert load_hf_tokenizer(directory).chat_template == "chat"


def test_chat_template_jinja_outside_the_directory_is_refused(tiny, tmp_path: Path) -> None:
    directory = hf_copy(tiny, tmp_path)
    outside = tmp_path / "elsewhere.jinja"
    outside.write_text("{{ 1 }}")
    (directory / "chat_template.jinja").symlink_to(outside)
    with pytest.raises(ModelFormatError, match="points outside the model directory"):
        load_hf_tokenizer(directory)
    (directory / "chat_template.jinja").unlink()
    (directory / "chat_template.jinja").write_bytes(b"\xff")
    with pytest.raises(ModelFormatError, match="chat_template.jinja: the chat template is not UTF-8"):
        load_hf_tokenizer(directory)


# ------------------------------------------------------------------ through the real server


@pytest.fixture(scope="module")
def served_session(artifact):
    from llmc.runtime.session import open_session

    session = open_session(artifact(SPEC), threads=1)
    yield session
    session.close()


def test_the_server_wires_metrics_key_tokenize_and_access_log(served_session, access_lines) -> None:
    from llmc.runtime.server import Server

    codec = TextCodec.from_artifact(served_session.manifest)
    server = Server(served_session, codec, "tiny", options=ServeOptions(api_key=KEY))
    key = {"Authorization": f"Bearer {KEY}"}
    with TestClient(server.app) as client:
        assert client.post("/v1/completions", json={"prompt": "on the", "max_tokens": 3}).status_code == 401
        assert client.get("/health").status_code == 200
        answer = client.post("/v1/completions", headers=key, json={"prompt": "on the", "max_tokens": 3,
                                                                   "temperature": 0})
        assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 3
        tokens = client.post("/tokenize", headers=key, json={"content": "on the"}).json()["tokens"]
        assert tokens == codec.encode("on the")
        assert client.get("/metrics").status_code == 401
        client.headers.update(key)
        samples = scrape(client)
    completions = (("endpoint", "completions"),)
    assert samples[("llmc_requests_total", completions + (("reason", "length"),))] == 1
    assert samples[("llmc_generation_tokens_total", completions)] == 3
    assert samples[("llmc_prompt_tokens_total", completions)] == len(tokens)
    assert samples[("llmc_time_to_first_token_seconds_count", completions)] == 1
    assert samples[("llmc_prefill_tokens_total", ())] + samples[("llmc_reused_prompt_tokens_total", ())] == len(tokens)
    assert samples[("llmc_generation_tokens_per_second", ())] > 0
    assert any(' "POST /v1/completions" 401 ' in line for line in access_lines)
    assert any(' "POST /v1/completions" 200 ' in line and line.endswith(f" prompt={len(tokens)} completion=3")
               for line in access_lines)


def test_chat_logprobs_build_the_token_bytes_off_the_event_loop(served_session, monkeypatch) -> None:
    """The first chat request with logprobs builds llguidance's tokenizer (the token bytes it reports) on a
    request worker, not on the event loop, where it would hold up every stream for ~0.2 s."""
    pytest.importorskip("llguidance")
    from llmc.runtime import grammar
    from llmc.runtime.server import Server

    threads, build = [], grammar.llg_tokenizer

    def recorded(codec):
        threads.append(threading.current_thread().name)
        return build(codec)

    monkeypatch.setattr(grammar, "llg_tokenizer", recorded)
    codec = TextCodec.from_artifact(served_session.manifest)  # (a codec of its own: no tokenizer built for it yet)
    server = Server(served_session, codec, "tiny", options=ServeOptions(access_log=False))
    with TestClient(server.app) as client:
        answer = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 3, "logprobs": True})
    assert answer.status_code == 200 and len(answer.json()["choices"][0]["logprobs"]["content"]) == 3
    assert threads and threads[0].startswith("llmc-request"), threads


def test_serve_without_prometheus_client_names_the_extra(artifact) -> None:
    from runtime_only import runtime_only

    done = subprocess.run(runtime_only("prometheus_client", "serve", str(artifact(SPEC)), "--port", "0"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip().splitlines() == [
        "llmc: error: llmc serve's /metrics needs prometheus-client: pip install 'llmc[serve]'"]
