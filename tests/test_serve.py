"""`llmc serve`: the OpenAI-compatible HTTP API, driven by the official `openai` client and raw httpx.

The server runs as `llmc serve` in a subprocess that refuses to import the compiler stack
(xdsl, llvmlite, torch, ...), on a tiny random-weight artifact with a long KV cache (so
that a long generation takes long enough to be cut short).
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from runtime_only import runtime_only
from tiny_models import TinySpec

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from llmc.driver import BackendOptions, compile_model  # noqa: E402
from llmc.passes.pipeline import CompileOptions  # noqa: E402
from llmc.runtime.api_requests import MAX_CHOICES  # noqa: E402
from llmc.runtime.artifact import load_manifest  # noqa: E402
from llmc.runtime.codec import TextCodec  # noqa: E402
from llmc.runtime.server import Limits  # noqa: E402

CAPACITY = 4096
LIMITS = Limits.for_capacity(CAPACITY)  # the server's defaults for this artifact
SPEC = TinySpec(context_length=CAPACITY)
SLOTS = 4
# greedy continuations of the tiny model that never reach its end-of-sequence token
REPEATS = "on the"  # → " the the the ..."
LETTERS = "abc def"  # → "apapap..."



@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve") / "tiny.llmc"
    options = {"prefill_chunk": 16, "max_seq": CAPACITY, "max_batch": SLOTS}
    compile_model(str(tiny(SPEC, "gguf")), out, CompileOptions(**options), BackendOptions(), progress=lambda _: None)
    return out


@pytest.fixture(scope="module")
def codec(artifact) -> TextCodec:
    return TextCodec.from_artifact(load_manifest(artifact))


@dataclass
class Served:
    process: subprocess.Popen
    url: str
    stderr: list[str]

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=10).json()

    def stop(self, timeout: float = 20) -> int:
        self.process.send_signal(signal.SIGINT)
        return self.process.wait(timeout)


def start_server(artifact: Path, *options: str, prelude: str = "") -> Served:
    """`llmc serve artifact *options` on a free port, runtime only (`runtime_only`, after `prelude`)."""
    return started(runtime_only("", "serve", str(artifact), "--port", "0", "--threads", "1", *options,
                                prelude=prelude))


def started(command: list[str]) -> Served:
    """The server `command` runs, once it prints the URL it listens on."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = process.stdout.readline()  # the one line, once it listens
    match = re.search(r"listening on (http://\S+)", line)
    if not match:
        process.kill()
        raise AssertionError(f"no URL from llmc serve: {line!r} {process.stderr.read()}")
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(process.stderr), daemon=True).start()
    return Served(process, match.group(1), stderr)


@pytest.fixture(scope="module")
def server(artifact) -> Iterator[Served]:
    served = start_server(artifact)
    yield served
    if served.process.poll() is None:
        served.stop()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=60) as client:
        yield client


def complete(client, prompt: str, **options) -> tuple[str, str, object]:
    """(text, finish_reason, usage) of a whole greedy completion."""
    result = client.completions.create(model="tiny", prompt=prompt, **{"temperature": 0, **options})
    return result.choices[0].text, result.choices[0].finish_reason, result.usage


def stream(client, prompt: str, **options) -> tuple[list[str], str]:
    """(text pieces, finish_reason) of a streamed greedy completion."""
    pieces, finish = [], None
    for chunk in client.completions.create(model="tiny", prompt=prompt, stream=True,
                                           **{"temperature": 0, **options}):
        assert chunk.object == "text_completion" and len(chunk.choices) == 1
        if chunk.choices[0].finish_reason is not None:
            assert finish is None, "one chunk carries the finish reason"
            finish = chunk.choices[0].finish_reason
        pieces.append(chunk.choices[0].text)
    return pieces, finish


# ------------------------------------------------------------------ the API


def test_models_and_health(server, client, artifact) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == ["tiny"]
    assert models[0].owned_by == "llmc" and models[0].max_model_len == CAPACITY
    assert client.models.retrieve("tiny.llmc").id == "tiny"  # the directory's own name is accepted too
    health = server.health()
    assert health["status"] == "ok" and health["slots"] == SLOTS and health["capacity"] == CAPACITY


def test_completion_whole_and_streamed(client, codec) -> None:
    text, finish, usage = complete(client, REPEATS, max_tokens=12)
    assert finish == "length"
    assert text.startswith(" the the")
    prompt_tokens = len(codec.encode(REPEATS))
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (prompt_tokens, 12, prompt_tokens + 12)
    pieces, finish = stream(client, REPEATS, max_tokens=12)
    assert "".join(pieces) == text and finish == "length"
    assert len([p for p in pieces if p]) > 1, "the text comes piece by piece"
    # OpenAI's default of 16 tokens; token ids as the prompt give the same continuation
    assert complete(client, REPEATS)[2].completion_tokens == 16
    by_ids = client.completions.create(model="tiny", prompt=codec.encode(REPEATS), max_tokens=12, temperature=0)
    assert by_ids.choices[0].text == text


def test_chat_whole_and_streamed(client, codec) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello"}]
    prompt_tokens = len(codec.encode(codec.render_chat(messages)))
    whole = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=20)
    assert whole.object == "chat.completion" and whole.choices[0].message.role == "assistant"
    assert whole.usage.prompt_tokens == prompt_tokens and whole.usage.completion_tokens == 20
    assert whole.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=20,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    # without max_tokens a reply may take the rest of the cache
    rest = client.chat.completions.create(model="tiny", messages=messages, temperature=0)
    assert rest.usage.completion_tokens == CAPACITY - prompt_tokens
    assert rest.choices[0].finish_reason == "length"


def test_sse_ends_with_done(server) -> None:
    body = {"prompt": LETTERS, "max_tokens": 5, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(line[6:]) for line in lines[:-1]]
    assert "".join(e["choices"][0]["text"] for e in events).startswith("apap")
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_strings_end_the_text_before_them(client, server) -> None:
    text, _, _ = complete(client, REPEATS, max_tokens=12)  # " the the the ..."
    before = server.health()["requests"]
    # "e t" spans two tokens (" the", " the"): held back until it is known
    for stop in ("e t", ["zzz", "e t"]):
        cut, finish, usage = complete(client, REPEATS, max_tokens=2000, stop=stop)
        assert (cut, finish) == (text[: text.index("e t")], "stop")
        assert usage.completion_tokens == 2
        pieces, finish = stream(client, REPEATS, max_tokens=2000, stop=stop)
        assert ("".join(pieces), finish) == (cut, "stop")
    # the engine stopped generating (not run to max_tokens), and /health counts each as a stop, not a cancel
    deadline = time.monotonic() + 10
    while server.health()["requests"]["stop"] < before["stop"] + 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.health()["requests"] == before | {"stop": before["stop"] + 4}


def test_seed_makes_sampling_repeatable(client) -> None:
    def sample(seed: int) -> str:
        return complete(client, LETTERS, max_tokens=24, temperature=2.0, seed=seed)[0]

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)
    greedy = complete(client, LETTERS, max_tokens=24)[0]
    assert complete(client, LETTERS, max_tokens=24, temperature=1.0, extra_body={"top_k": 1})[0] == greedy


def test_concurrent_streams_equal_each_alone(client) -> None:
    """Eight streams at once on four slots give each request's text alone: greedy, and sampled with a
    seed per request at a high temperature (the tiny model's greedy text repeats its last token; a
    sampled one depends on the whole distribution, so rows mixed between slots would show)."""
    requests = [(p, {}) for p in (REPEATS, LETTERS)] + [(p, {"temperature": 2.0, "seed": i, "frequency_penalty": 2.0})
                                                      for i, p in enumerate(("hello world", "12345", REPEATS, "abc"))]

    def text(request) -> str:
        prompt, options = request
        return "".join(stream(client, prompt, max_tokens=40, **options)[0])

    alone = [text(r) for r in requests]
    assert len(set(alone[2:])) == 4 and len(set(alone[2][i:i + 4] for i in range(0, 36, 4))) > 3
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(text, requests + requests[:2]))
    assert together == alone + alone[:2]


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize(
    ("path", "body", "param", "message"),
    [
        ("completions", b"{not json", None, "not valid JSON"),
        ("completions", b"[1, 2]", None, "must be a JSON object"),
        ("completions", {"prompt": "x", "temperature": "hot"}, "temperature", "temperature must be a number"),
        ("completions", {"prompt": "x", "temperature": True}, "temperature", "temperature must be a number"),
        ("completions", {"prompt": "x", "top_p": 0}, "top_p", "top_p must be a number in"),
        ("completions", {"prompt": "x", "top_k": 1.5}, "top_k", "top_k must be an integer"),
        ("completions", {"prompt": "x", "max_tokens": "5"}, "max_tokens", "max_tokens must be an integer"),
        ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens", "max_tokens must be an integer >= 1"),
        ("completions", {"prompt": "x", "stream": "yes"}, "stream", "stream must be a boolean"),
        ("completions", {"prompt": "x", "stop": 5}, "stop", "stop must be a string or a list"),
        ("completions", {"prompt": "x", "seed": "1"}, "seed", "seed must be an integer"),
        ("completions", {"prompt": {"a": 1}}, "prompt", "prompt must be a string or a list of token ids"),
        ("completions", {"prompt": [1, 99999]}, "prompt", "outside the vocabulary"),
        ("completions", {}, "prompt", "missing required field 'prompt'"),
        ("completions", {"prompt": "x", "colour": "red"}, "colour", "unknown field 'colour'"),
        ("completions", {"prompt": "x", "best_of": 2}, "best_of", "not supported"),
        ("completions", {"prompt": "x", "n": MAX_CHOICES + 1}, "n", f"n must be an integer in [1, {MAX_CHOICES}]"),
        ("completions", {"prompt": "x", "temperature": 2.5}, "temperature", "in [0, 2]"),
        ("completions", {"prompt": "x", "frequency_penalty": 3}, "frequency_penalty", "in [-2, 2]"),
        ("completions", {"prompt": "x", "presence_penalty": "1"}, "presence_penalty", "in [-2, 2]"),
        ("completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty", "in [0.1, 10]"),
        ("completions", {"prompt": "x", "repetition_penalty": 1e-320}, "repetition_penalty", "in [0.1, 10]"),
        ("completions", {"prompt": "x", "min_p": 1.5}, "min_p", "in [0, 1]"),
        ("completions", {"prompt": "x", "logit_bias": {"abc": 1}}, "logit_bias", "token ids below"),
        ("completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias", "token ids below"),
        ("completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias", "in [-100, 100]"),
        ("completions", {"prompt": "x", "logit_bias": {"9" * 5000: 1}}, "logit_bias", "token ids below"),
        ("completions", {"prompt": "x", "user": ["a"]}, "user", "user must be a string"),
        ("completions", {"prompt": "x", "stop": ["a", "\ud800"]}, "stop", "lone surrogate"),
        ("completions", {"prompt": "x", "max_tokens": 10**4000}, "max_tokens", "…, but the KV cache holds"),
        ("completions", {"prompt": "x", "logprobs": 6}, "logprobs", "in [0, 5]"),
        ("completions", {"prompt": "x", "echo": 1}, "echo", "echo must be a boolean"),
        ("completions", {"prompt": "x", "response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ("completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
         "response_format", "needs a \"name\""),
        ("completions", {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wizard"}}}}}},
         "response_format", "response_format"),
        ("completions", {"prompt": "x", "grammar": "root ::= nothing"}, "grammar", "grammar"),
        ("completions", {"prompt": "x", "grammar": "root ::= root"}, "grammar", "no text matches it"),
        ("completions", {"prompt": "x", "grammar": "start: start", "grammar_format": "lark"}, "grammar",
         "no text matches it"),
        ("completions", {"prompt": "x", "grammar": 'root ::= "a"', "grammar_format": "ebnf"}, "grammar_format",
         "gbnf, lark"),
        ("completions", {"prompt": "x", "grammar": 'root ::= "a"', "response_format": {"type": "json_object"}},
         "grammar", "cannot be combined"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs",
         "must be a boolean"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs",
         "needs \"logprobs\": true"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
         "top_logprobs", "in [0, 20]"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools[0]", "must be"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "letters, digits"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                           "function": {"name": "g"}}},
         "tool_choice", "must name one of the tools"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
         "tool_choice", "needs tools"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": "f", "description": "a \ud800"}}]},
         "tools[0].function.description", "lone surrogate"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {"properties": {"\udfff": {}}}}}]},
         "tools[0].function.parameters", "lone surrogate"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": "f", "strict": "yes"}}]},
         "tools[0].function.strict", "must be a boolean"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": [
            {"type": "function", "function": {"name": "f"}}], "response_format": {"type": "json_object"}},
         "response_format", "cannot be combined with tools"),
        ("chat/completions", {"messages": [{"role": "tool", "content": "22"}]}, "messages[0].tool_call_id",
         "the id of the tool call"),
        ("chat/completions", {"messages": [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
         "messages[0].tool_calls[0].function.arguments", "a JSON object's text"),
        ("chat/completions", {"messages": [{"role": "user", "content": None}]}, "messages[0].content",
         "must be a string"),
        ("completions", {"prompt": [5] * CAPACITY}, "prompt", f"the KV cache holds {CAPACITY}"),
        ("completions", {"prompt": "x", "max_tokens": CAPACITY}, "max_tokens", f"at most {CAPACITY - 1} remain"),
        ("chat/completions", {"messages": "hi"}, "messages", "non-empty list"),
        ("chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role", "must be one of"),
        ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages[0].content", "must be a string"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x", "mood": 1}]}, "messages[0].mood",
         "unknown field"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": CAPACITY},
         "max_tokens", "remain"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x " * CAPACITY}]}, "messages",
         f"the KV cache holds {CAPACITY}"),
        # hostile bodies: what Python's json module makes of them must not escape as a 500
        ("completions", b'{"prompt": "a\\ud800b"}', "prompt", "lone surrogate (U+D800 at character 1)"),
        ("completions", b'{"prompt": "\xed\xa0\x80"}', "prompt", "lone surrogate"),  # raw: json decodes surrogatepass
        ("chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content",
         "lone surrogate"),
        ("chat/completions", b'{"messages": [{"role": "user", "content": "x", "name": "\\ud800"}]}',
         "messages[0].name", "lone surrogate"),
        ("completions", b'{"prompt": "x", "\\ud800": 1}', "\ud800", "unknown field"),
        ("completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", None, "not valid JSON"),
        ("completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "nested too deeply"),
        ("completions", b'{"prompt": "\xff\xfe"}', None, "not valid JSON"),
        ("completions", b"\xff\xfe\x00{", None, "not valid JSON"),
        ("completions", b"", None, "not valid JSON"),
        ("completions", b"null", None, "must be a JSON object"),
        ("completions", b'"prompt"', None, "must be a JSON object"),
        ("completions", b'{"prompt": "x", "temperature": NaN}', "temperature", "temperature must be a number"),
        ("completions", b'{"prompt": "x", "top_p": 1e999}', "top_p", "top_p must be a number"),
        ("completions", {"prompt": [1.0]}, "prompt", "prompt must be a string or a list of token ids"),
        ("completions", {"prompt": [True]}, "prompt", "prompt must be a string or a list of token ids"),
        ("completions", {"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
        ("completions", {"prompt": "x", "stop": [None]}, "stop", "stop must be a string or a list"),
        ("completions", {"prompt": "x", "stream": True, "stream_options": {"include_usage": 1}}, "stream_options",
         "include_usage must be a boolean"),
        ("completions", {"prompt": "x", "seed": [[[[1]]]]}, "seed", "seed must be an integer"),
        ("chat/completions", {"messages": [None]}, "messages[0]", "must be an object"),
        ("chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content", "parts must be"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x", "name": 5}]}, "messages[0].name",
         "must be a string"),
        ("chat/completions", {"messages": {"role": "user"}}, "messages", "non-empty list"),
        # work bounded by the KV capacity: refused before tokenizing or rendering
        ("completions", {"prompt": "x" * (LIMITS.max_chars + 1)}, "prompt", f"at most {LIMITS.max_chars}"),
        ("chat/completions", {"messages": [{"role": "user", "content": ""}] * (CAPACITY + 1)}, "messages",
         f"at most {CAPACITY}"),
        ("chat/completions", {"messages": [{"role": "user", "content": "x" * (LIMITS.max_chars // 2)}] * 3},
         "messages", f"more than {LIMITS.max_chars} characters"),
    ],
)
def test_malformed_requests_are_400_naming_the_field(server, path: str, body, param: str | None, message: str) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    response = httpx.post(f"{server.url}/v1/{path}", content=raw, headers={"Content-Type": "application/json"},
                          timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert message in error["message"]
    assert "Traceback" not in "".join(server.stderr), "".join(server.stderr)


def test_other_errors(server, client) -> None:
    missing = httpx.get(f"{server.url}/v2/nothing", timeout=10)
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"
    wrong_method = httpx.get(f"{server.url}/v1/completions", timeout=10)
    assert wrong_method.status_code == 405 and "does not take GET" in wrong_method.json()["error"]["message"]
    assert wrong_method.headers["allow"] == "POST"  # (RFC 9110: a 405 names the methods the route takes)
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x")
    assert e.value.body["code"] == "model_not_found" and "serves 'tiny'" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # the official client reads the error body
        client.completions.create(model="tiny", prompt="x", n=MAX_CHOICES + 1)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"


def test_disconnect_mid_stream_frees_the_slot_at_once(server, client) -> None:
    before = server.health()
    body = {"prompt": REPEATS, "max_tokens": CAPACITY - 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
    # (leaving the block closed the connection mid-stream)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        after = server.health()
        if after["requests"]["cancelled"] > before["requests"]["cancelled"] and after["running"] == 0:
            break
        time.sleep(0.02)
    assert after["requests"]["cancelled"] == before["requests"]["cancelled"] + 1
    assert after["running"] == 0 and after["waiting"] == 0
    assert after["requests"]["length"] == before["requests"]["length"]
    assert after["generated_tokens"] - before["generated_tokens"] < CAPACITY // 2, "cut short, not run to the end"
    assert complete(client, LETTERS, max_tokens=8)[1] == "length"  # the slot serves the next request
    # a client waiting for a whole completion that goes away is cancelled too
    before = server.health()
    host, port = server.url.removeprefix("http://").split(":")
    payload = json.dumps({**body, "stream": False}).encode()
    with socket.create_connection((host, int(port))) as raw:
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Content-Length: %d\r\n\r\n%s" % (len(payload), payload))
        deadline = time.monotonic() + 10
        while server.health()["running"] == 0 and time.monotonic() < deadline:
            pass
    deadline = time.monotonic() + 10
    while server.health()["requests"]["cancelled"] == before["requests"]["cancelled"] and time.monotonic() < deadline:
        time.sleep(0.02)
    after = server.health()
    assert after["requests"]["cancelled"] == before["requests"]["cancelled"] + 1
    assert after["generated_tokens"] - before["generated_tokens"] < CAPACITY // 2


def test_full_queue_is_429_and_ctrl_c_stops_cleanly(artifact) -> None:
    """One slot, one place in the queue: a third request is refused while a long one runs."""
    served = start_server(artifact, "--max-batch", "1", "--queue", "1")
    try:
        assert served.health()["slots"] == 1
        long = {"prompt": REPEATS, "max_tokens": CAPACITY - 8, "temperature": 0, "stream": True}
        short = {"prompt": LETTERS, "max_tokens": 4, "temperature": 0}
        with httpx.Client(timeout=30) as http, ThreadPoolExecutor(1) as pool:
            with http.stream("POST", f"{served.url}/v1/completions", json=long) as running:
                events = running.iter_lines()
                assert next(events).startswith("data: ")  # generating: the one slot is taken
                waiting = pool.submit(httpx.post, f"{served.url}/v1/completions", json=short, timeout=30)
                deadline = time.monotonic() + 10
                while served.health()["waiting"] < 1 and time.monotonic() < deadline:
                    time.sleep(0.01)
                refused = httpx.post(f"{served.url}/v1/completions", json=short, timeout=10)
                assert refused.status_code == 429, refused.text
                assert refused.json()["error"]["code"] == "queue_full"
                assert "busy" in refused.json()["error"]["message"] and refused.headers["retry-after"]
            # the long stream was dropped: the waiting request runs, and a new one is taken again
            assert waiting.result().status_code == 200, waiting.result().text
            assert waiting.result().json()["usage"]["completion_tokens"] == 4
            assert httpx.post(f"{served.url}/v1/completions", json=short, timeout=10).status_code == 200
            # Ctrl-C while a stream is running: it ends at once, and so does the server
            with http.stream("POST", f"{served.url}/v1/completions", json=long) as running:
                events = running.iter_lines()
                assert next(events).startswith("data: ")
                start = time.monotonic()
                served.process.send_signal(signal.SIGINT)
                rest = [line for line in events if line]
            assert rest[-1] == "data: [DONE]" and "shutting down" in rest[-2]
        assert served.process.wait(20) == 0, "".join(served.stderr)
        assert time.monotonic() - start < 10
        time.sleep(0.1)
        assert "Traceback" not in "".join(served.stderr) and "stopped" in "".join(served.stderr)
    finally:
        if served.process.poll() is None:
            served.process.kill()


# ------------------------------------------------------------------ hostile clients

# a chat template that would loop 10^10 times: the codec's time budget ends it
HANGING_TEMPLATE = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
SLOW = 0.5  # the guarded server's head and body timeouts, in seconds
GUARDED = textwrap.dedent("""
    import sys
    from pathlib import Path
    from llmc.runtime.codec import TextCodec
    from llmc.runtime.server import Limits, Server, serve
    from llmc.runtime.session import open_session

    session = open_session(Path(sys.argv[1]), threads=1)
    codec = TextCodec.from_artifact(session.manifest)
    codec.chat_template = sys.argv[2]
    limits = Limits.for_capacity(session.capacity, head_seconds=float(sys.argv[3]), body_seconds=float(sys.argv[3]),
                                 workers=2, max_pending=2)
    serve(Server(session, codec, "tiny", limits=limits), port=0, announce=lambda url: print("listening on", url,
                                                                                           flush=True))
""")


@pytest.fixture(scope="module")
def guarded(artifact) -> Iterator[Served]:
    """A server with short head and body timeouts, two requests prepared at a time and no more waiting,
    whose model's chat template never ends."""
    served = started([sys.executable, "-c", GUARDED, str(artifact), HANGING_TEMPLATE, str(SLOW)])
    yield served
    served.process.terminate()
    served.process.wait(20)


def connect(served: Served) -> socket.socket:
    host, port = served.url.removeprefix("http://").split(":")
    raw = socket.create_connection((host, int(port)))
    raw.settimeout(10)
    return raw


def answer(raw: socket.socket) -> tuple[int, dict, bool]:
    """(status, JSON body, whether the server then closed the connection) of a raw answer."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += raw.recv(65536)
    head, body = data.split(b"\r\n\r\n", 1)
    length = int(re.search(rb"(?i)content-length: (\d+)", head).group(1))
    while len(body) < length:
        body += raw.recv(65536)
    return int(head.split()[1]), json.loads(body), raw.recv(1) == b""


def test_oversized_bodies_are_413_before_they_are_read(server) -> None:
    too_long = LIMITS.max_body_bytes + 1
    with connect(server) as raw:  # declared: answered at once, nothing read
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n{" % too_long)
        status, body, closed = answer(raw)
    assert (status, body["error"]["code"], closed) == (413, "too_large", True)
    assert f"larger than {LIMITS.max_body_bytes} bytes" in body["error"]["message"]
    with connect(server) as raw:  # chunked, without an end: read up to the limit only
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n")
        for start in range(0, too_long, 1 << 20):
            size = min(1 << 20, too_long - start)
            raw.sendall(b"%x\r\n%s\r\n" % (size, b"x" * size))
        status, body, closed = answer(raw)
    assert (status, body["error"]["code"], closed) == (413, "too_large", True)
    assert "Traceback" not in "".join(server.stderr)


def test_slow_clients_are_cut_off(guarded) -> None:
    with connect(guarded) as silent, connect(guarded) as trickling:
        trickling.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
        start = time.monotonic()
        with pytest.raises(OSError):  # a header line every 0.1 s: cut off at the head timeout all the same
            while time.monotonic() - start < 10 * SLOW:
                trickling.sendall(b"X-Slow: 1\r\n")
                time.sleep(0.1)
        assert SLOW <= time.monotonic() - start < 4 * SLOW
        assert silent.recv(1) == b"", "a connection that sends nothing is closed"
    with connect(guarded) as raw:  # a body that never completes
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
        status, body, closed = answer(raw)
    assert (status, body["error"]["code"], closed) == (408, "timeout", True)
    assert f"within {SLOW:g} s" in body["error"]["message"]
    with connect(guarded) as raw:  # a client that gives up halfway through its body
        raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\": ")
    # a client in time is served, twice on one connection
    with httpx.Client(base_url=guarded.url, timeout=30) as http:
        for _ in range(2):
            assert http.post("/v1/completions", json={"prompt": LETTERS, "max_tokens": 2}).status_code == 200
    assert "Traceback" not in "".join(guarded.stderr), "".join(guarded.stderr)


def test_hanging_chat_template_is_400_and_holds_up_no_one(guarded) -> None:
    alone = httpx.post(f"{guarded.url}/v1/completions", json={"prompt": LETTERS, "max_tokens": 8, "temperature": 0},
                       timeout=30).json()["choices"][0]["text"]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        hanging = pool.submit(httpx.post, f"{guarded.url}/v1/chat/completions", json=chat, timeout=30)
        time.sleep(0.1)  # (rendering)
        meanwhile = httpx.post(f"{guarded.url}/v1/completions", timeout=30,
                               json={"prompt": LETTERS, "max_tokens": 8, "temperature": 0})
        assert not hanging.done(), "the other client was answered while the template still ran"
        assert meanwhile.json()["choices"][0]["text"] == alone
        refused = hanging.result()
    assert time.monotonic() - start < 5, "the template's time budget ends it"
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "messages"
    assert refused.json()["error"]["code"] == "chat_template_failed"
    assert "Traceback" not in "".join(guarded.stderr), "".join(guarded.stderr)


def test_requests_beyond_those_in_preparation_are_429(guarded) -> None:
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with ThreadPoolExecutor(2) as pool:
        hanging = [pool.submit(httpx.post, f"{guarded.url}/v1/chat/completions", json=chat, timeout=30)
                   for _ in range(2)]
        deadline = time.monotonic() + 10
        while guarded.health()["preparing"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        refused = httpx.post(f"{guarded.url}/v1/completions", json={"prompt": LETTERS}, timeout=30)
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "busy", refused.text
        assert refused.headers["retry-after"]
        assert [r.result().status_code for r in hanging] == [400, 400]
    assert httpx.post(f"{guarded.url}/v1/completions", json={"prompt": LETTERS}, timeout=30).status_code == 200


def test_requests_are_prepared_at_a_lower_priority(server) -> None:
    """Parsing, rendering and tokenizing threads yield the CPU to the engine's (Linux: niceness per thread)."""
    httpx.post(f"{server.url}/v1/completions", json={"prompt": LETTERS, "max_tokens": 1}, timeout=30)
    nice = {int(stat.read_text().rsplit(")", 1)[1].split()[16])
            for stat in Path(f"/proc/{server.process.pid}/task").glob("*/stat")}
    assert nice == {0, 10}


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024


def test_long_prompts_leave_memory_flat(server) -> None:
    """Prompts and conversations of many times the cache's tokens are tokenized and refused; the server's
    memory comes back (the limits' largest take a second each with the tiny vocabulary: see
    benchmarks/hostile_client.py)."""
    words = " ".join(f"w{i}" for i in range(LIMITS.max_chars))[: LIMITS.max_chars // 8]
    messages = [{"role": "user", "content": f"w{i}"} for i in range(CAPACITY // 4)]
    def refused(request: tuple[str, dict]) -> str:
        response = httpx.post(f"{server.url}/v1/{request[0]}", json=request[1], timeout=60)
        return response.json()["error"]["code"] if response.status_code == 400 else str(response.status_code)

    refused(("completions", {"prompt": words}))  # (allocator pools warmed)
    before = rss_mb(server.process.pid)
    with ThreadPoolExecutor(4) as pool:  # at once, on several workers
        codes = pool.map(refused, [("completions", {"prompt": words}), ("chat/completions", {"messages": messages})] * 3)
        assert set(codes) == {"context_length_exceeded"}
    assert rss_mb(server.process.pid) - before < 64


def test_openapi_schema_describes_what_the_server_takes(server) -> None:
    """Every field of the schema's request bodies is taken (null: the default), the limits are the server's,
    and real answers match the response schemas."""
    jsonschema = pytest.importorskip("jsonschema")
    schema = httpx.get(f"{server.url}/openapi.json", timeout=10).json()
    assert set(schema["paths"]) == {"/v1/completions", "/v1/chat/completions", "/v1/models", "/v1/models/{model}",
                                    "/health", "/openapi.json", "/metrics", "/tokenize", "/detokenize"}
    components = schema["components"]["schemas"]

    def valid(name: str, value: object) -> bool:
        return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": {
            "schemas": components}}).is_valid(value)

    requests = {"completions": ("CompletionRequest", {"prompt": LETTERS, "max_tokens": 1}, "Completion"),
                "chat/completions": ("ChatCompletionRequest", {"messages": [{"role": "user", "content": "hi"}],
                                                               "max_completion_tokens": 1}, "ChatCompletion")}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        for path, (request, base, response) in requests.items():
            fields = components[request]["properties"]
            assert valid(request, base) and not valid(request, {**base, "colour": 1})
            every = {name: None for name in set(fields) - set(components[request]["required"])} | base
            assert valid(request, every)
            answer = http.post(f"/v1/{path}", json=every)
            assert answer.status_code == 200, answer.text
            assert valid(response, answer.json()), answer.json()
            error = http.post(f"/v1/{path}", json={**base, "colour": 1})
            assert error.status_code == 400 and valid("Error", error.json())
        assert valid("Model", http.get("/v1/models/tiny").json())
    assert fields["messages"]["maxItems"] == CAPACITY
    assert components["Message"]["properties"]["content"]["anyOf"][0]["anyOf"][0]["maxLength"] == LIMITS.max_chars
    assert components["CompletionRequest"]["properties"]["n"]["anyOf"][0]["maximum"] == MAX_CHOICES


def test_without_starlette_serve_says_how_to_install(artifact) -> None:
    proc = subprocess.run(runtime_only("starlette", "serve", str(artifact)),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "pip install 'llmc[serve]'" in proc.stderr


@pytest.mark.parametrize(("options", "message"), [
    (["--port", "70000"], "--port: must be in 0..65535, got 70000"),
    (["--queue", "-1"], "--queue: must be >= 0, got -1"),
    (["--max-batch", "0"], "--max-batch: must be a positive integer, got 0"),
    (["--max-batch", "9"], "--max-batch must be in 1..4"),
])
def test_bad_serve_options_are_one_line(artifact, options: list[str], message: str) -> None:
    proc = subprocess.run(runtime_only("", "serve", str(artifact), *options), capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and message in proc.stderr, proc.stderr


def test_text_stream_gives_whole_characters(codec) -> None:
    """Byte-level tokens of multi-byte characters: nothing comes out until a character is whole."""
    text = "é漢🙂 ok"
    ids = codec.encode(text)
    assert len(ids) > len(text)  # (the tiny vocabulary has a token per byte, few merges)
    stream = codec.text_stream()
    pieces = [stream.push(token) for token in ids]
    assert "".join(pieces) + stream.flush() == text
    assert all("\ufffd" not in piece for piece in pieces)
    assert [p for p in pieces if p][:3] == ["é", "漢", "🙂"]
