"""The request bodies of `llmc serve`'s OpenAI API → checked generation jobs, or OpenAI's 400 naming the field.

`RequestParser(codec, limits, ...)` turns a body (bytes, read by the server) into a `Job`:

    parser.completion(b'{"prompt": "Once upon a time", "max_tokens": 8}')
    # Job(prompt=[...], max_tokens=8, sampling=SamplingOptions(1.0, 0, 1.0, None), stop=[], stream=False, ...)
    parser.chat(b'{"messages": [{"role": "user", "content": "Hi"}], "n": 2}')
    # ApiError(400, "n must be 1 (one choice per request), got 2", param="n")

Bodies take no other fields; OpenAI fields llmc does not implement are accepted at their neutral values
only (`_NEUTRAL`). What one request may cost is bounded by `Limits`, sized from the KV capacity: a longer
prompt could not run anyway. Nothing here knows HTTP: the server reads the body and answers the error.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field

from llmc.errors import LlmcError, printable
from llmc.runtime.batch import Request
from llmc.runtime.codec import TextCodec
from llmc.runtime.sampling import SamplingOptions
from llmc.runtime.session import CapacityError

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat replies default to the room left
MAX_STOP_STRINGS = 4  # as OpenAI allows
ROLES = ("system", "user", "assistant")
CHARS_PER_TOKEN = 32  # a prompt of more characters per token of KV capacity cannot fit (tokens are shorter)
JSON_BYTES_PER_CHAR = 12  # the longest JSON spelling of one character (a surrogate pair's two escapes)
BODY_OVERHEAD = 64 << 10  # bytes of a body besides its text (field names, options, message framing)


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
        """OpenAI's error body."""
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid(param: str | None, message: str, code: str | None = None) -> ApiError:
    """A 400 naming the request's field `param` (None: the body as a whole)."""
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
        raise invalid(param, f"{param} holds a lone surrogate (U+{ord(value[e.start]):04X} at character {e.start}), "
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

    def usage(self) -> dict:
        """OpenAI's `usage` of the job so far."""
        return {"prompt_tokens": len(self.prompt), "completion_tokens": self.completion_tokens,
                "total_tokens": len(self.prompt) + self.completion_tokens}


def _check_fields(body: dict, kind: str) -> None:
    for name, value in body.items():
        if name in _FIELDS[kind]:
            continue
        if name in _NEUTRAL:
            if not _NEUTRAL[name](value):
                raise invalid(name, f"'{name}' is not supported by llmc serve (only its default value)",
                              "unsupported_parameter")
            continue
        raise invalid(name, f"unknown field '{name}'", "unknown_parameter")


def _sampling(body: dict) -> SamplingOptions:
    temperature = body.get("temperature")
    if temperature is None:
        temperature = 1.0  # OpenAI's default
    elif not _is_number(temperature) or not 0 <= temperature < math.inf:
        raise invalid("temperature", f"temperature must be a number >= 0, got {_show(temperature)}")
    top_p = body.get("top_p")
    if top_p is None:
        top_p = 1.0
    elif not _is_number(top_p) or not 0 < top_p <= 1:
        raise invalid("top_p", f"top_p must be a number in (0, 1], got {_show(top_p)}")
    top_k = body.get("top_k")
    if top_k is None:
        top_k = 0
    elif not _is_int(top_k) or top_k < 0:
        raise invalid("top_k", f"top_k must be an integer >= 0 (0: no limit), got {_show(top_k)}")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise invalid("seed", f"seed must be an integer, got {_show(seed)}")
    return SamplingOptions(float(temperature), top_k, float(top_p), None if seed is None else seed % 2**64)


def _stop(body: dict) -> list[str]:
    stop = body.get("stop")
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stops, list) and all(isinstance(s, str) for s in stops)):
        raise invalid("stop", "stop must be a string or a list of strings")
    if len(stops) > MAX_STOP_STRINGS:
        raise invalid("stop", f"stop takes at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    if any(not s for s in stops):
        raise invalid("stop", "stop strings must not be empty")
    return stops


def _stream(body: dict) -> tuple[bool, bool]:
    stream = body.get("stream")
    if stream is not None and type(stream) is not bool:
        raise invalid("stream", f"stream must be a boolean, got {_show(stream)}")
    options = body.get("stream_options")
    include_usage = False
    if options is not None:
        if not stream:
            raise invalid("stream_options", "stream_options needs \"stream\": true")
        if not isinstance(options, dict) or set(options) - {"include_usage"}:
            raise invalid("stream_options", "stream_options must be an object with 'include_usage' only")
        include_usage = options.get("include_usage", False)
        if type(include_usage) is not bool:
            raise invalid("stream_options", "stream_options.include_usage must be a boolean")
    return bool(stream), include_usage


def _messages(body: dict, limits: Limits) -> list[dict[str, str]]:
    messages = body.get("messages")
    if messages is None:
        raise invalid("messages", "missing required field 'messages'", "missing_required_parameter")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "messages must be a non-empty list of {\"role\", \"content\"} objects")
    if len(messages) > limits.max_messages:
        raise invalid("messages", f"{len(messages)} messages; this server takes at most {limits.max_messages} (one "
                                  f"per token of its KV capacity)", "too_many_messages")
    out, chars = [], 0
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict):
            raise invalid(where, f"{where} must be an object with 'role' and 'content'")
        unknown = set(message) - {"role", "content", "name"}
        if unknown:
            raise invalid(f"{where}.{sorted(unknown)[0]}", f"unknown field '{sorted(unknown)[0]}' in {where}")
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, got "
                                           f"{_show(role)}")
        content = message.get("content")
        if isinstance(content, list):  # content parts: text only
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       and set(p) == {"type", "text"} for p in content):
                raise invalid(f"{where}.content", f"{where}.content parts must be {{\"type\": \"text\", "
                                                  f"\"text\": ...}} (this model reads text only)")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise invalid(f"{where}.content", f"{where}.content must be a string or a list of text parts")
        name = message.get("name")
        if name is not None and not isinstance(name, str):
            raise invalid(f"{where}.name", f"{where}.name must be a string")
        chars += len(content) + len(name or "")
        if chars > limits.max_chars:
            raise invalid("messages", f"the messages hold more than {limits.max_chars} characters, more than the KV "
                                      f"cache's tokens could take", "context_length_exceeded")
        _text(content, f"{where}.content")
        if name is not None:
            _text(name, f"{where}.name")
        out.append({"role": role, "content": content, **({"name": name} if name is not None else {})})
    return out


def _max_tokens(body: dict, names: tuple[str, ...]) -> tuple[str, int | None]:
    given = [(name, body[name]) for name in names if body.get(name) is not None]
    if len(given) > 1 and given[0][1] != given[1][1]:
        raise invalid(given[1][0], f"{given[0][0]} and {given[1][0]} disagree")
    if not given:
        return names[0], None
    name, value = given[0]
    if not _is_int(value) or value < 1:
        raise invalid(name, f"{name} must be an integer >= 1, got {_show(value)}")
    return name, value


class RequestParser:
    """Request bodies → `Job`s for one served model (`names`: what `model` may say), its codec and limits;
    `check_prompt` is the engine's check of a prompt's tokens (`CapacityError` when they do not fit)."""

    def __init__(self, codec: TextCodec, limits: Limits, capacity: int, name: str, names: set[str],
                check_prompt: Callable[[list[int]], None]):
        self.codec, self.limits, self.capacity = codec, limits, capacity
        self.name, self.names = name, names
        self.check_prompt = check_prompt

    def check_model(self, model: object) -> None:
        """`model` as a request names it: absent, or a name this server answers to (404 otherwise)."""
        if model is None:
            return
        if not isinstance(model, str):
            raise invalid("model", "model must be a string")
        if model not in self.names:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{self.name}'",
                           param="model", code="model_not_found")

    def completion(self, raw: bytes) -> Job:
        """A `/v1/completions` body's job."""
        body = self._body(raw, "completions")
        prompt = body.get("prompt")
        if prompt is None:
            raise invalid("prompt", "missing required field 'prompt'", "missing_required_parameter")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            ids = self._encode(prompt, "prompt")
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            ids = prompt
        else:
            raise invalid("prompt", "prompt must be a string or a list of token ids (one prompt per request)")
        return self._job(body, ids, "prompt", ("max_tokens",), COMPLETION_MAX_TOKENS)

    def chat(self, raw: bytes) -> Job:
        """A `/v1/chat/completions` body's job: its messages rendered with the chat template and tokenized."""
        body = self._body(raw, "chat")
        messages = _messages(body, self.limits)
        if not self.codec.chat_template:
            raise invalid("messages", "this model has no chat template; use /v1/completions", "no_chat_template")
        try:
            text = self.codec.render_chat(messages)
        except LlmcError as e:  # the template failed, or ran out of its time or size budget
            raise invalid("messages", str(e), "chat_template_failed") from None
        return self._job(body, self._encode(text, "messages"), "messages", ("max_tokens", "max_completion_tokens"),
                         None)

    def _body(self, raw: bytes, kind: str) -> dict:
        try:
            body = json.loads(raw)
        except ValueError as e:  # not UTF-8, not JSON, an integer beyond Python's 4300 digits
            raise invalid(None, f"the request body is not valid JSON: {printable(e, 200)}", "invalid_json") from None
        except RecursionError:
            raise invalid(None, "the request body is nested too deeply", "invalid_json") from None
        if not isinstance(body, dict):
            raise invalid(None, "the request body must be a JSON object")
        _check_fields(body, kind)
        self.check_model(body.get("model"))
        n = body.get("n")
        if n is not None and not (_is_int(n) and n == 1):
            raise invalid("n", f"n must be 1 (one choice per request), got {_show(n)}")
        return body

    def _job(self, body: dict, prompt: list[int], prompt_param: str, max_names: tuple[str, ...],
             default_max: int | None) -> Job:
        try:
            self.check_prompt(prompt)
        except CapacityError as e:
            raise invalid(prompt_param, str(e), "context_length_exceeded") from None
        except ValueError as e:
            raise invalid(prompt_param, str(e)) from None
        room = self.capacity - len(prompt)
        max_name, max_tokens = _max_tokens(body, max_names)
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif max_tokens > room:
            raise invalid(max_name, f"{max_name} is {max_tokens}, but the KV cache holds {self.capacity} tokens per "
                                    f"sequence and the prompt takes {len(prompt)}: at most {room} remain",
                          "context_length_exceeded")
        stream, include_usage = _stream(body)
        return Job(prompt, max_tokens, _sampling(body), _stop(body), stream, include_usage)

    def _encode(self, text: str, param: str) -> list[int]:
        """`text`'s token ids, or a 400 naming `param` (a prompt longer than the cache could take is not tokenized)."""
        if len(text) > self.limits.max_chars:
            raise invalid(param, f"{param} has {len(text)} characters; the KV cache holds {self.capacity} tokens per "
                                 f"sequence, so this server takes at most {self.limits.max_chars}",
                          "context_length_exceeded")
        try:
            return self.codec.encode(_text(text, param))
        except LlmcError as e:  # the tokenizer failed on it
            raise invalid(param, str(e), "tokenizer_failed") from None
