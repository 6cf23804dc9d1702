"""The request bodies of `llmc serve`'s OpenAI API → checked generation jobs, or OpenAI's 400 naming the field.

`RequestParser(codec, limits, ...)` turns a body (bytes, read by the server) into a `Job`:

    parser.completion(b'{"prompt": "Once upon a time", "max_tokens": 8}')
    # Job(prompt=[...], max_tokens=8, sampling=SamplingOptions(1.0, 0, 1.0, None), stop=[], stream=False, ...)
    parser.chat(b'{"messages": [{"role": "user", "content": "Hi"}], "temperature": 3}')
    # ApiError(400, "temperature must be a number in [0, 2], got 3", param="temperature")

Besides sampling (penalties, `logit_bias`, `min_p`, `logprobs`), `n` choices and completions' `echo`,
a reply may be constrained by `response_format` (JSON, a JSON schema), the `grammar` extension (GBNF
or Lark), or `tools` (`llmc.runtime.tools`), compiled here (`llmc.runtime.grammar`, on the worker
thread that parses the request) and cached by their text. Bodies take no other fields; OpenAI fields
llmc does not implement are accepted at their neutral values only (`_NEUTRAL`). What one request may
cost is bounded by `Limits`, sized from the KV capacity: a longer prompt could not run anyway.
Nothing here knows HTTP: the server reads the body and answers the error.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from llmc.errors import LlmcError, printable
from llmc.runtime.batch import Request
from llmc.runtime.codec import TextCodec
from llmc.runtime.sampling import REPETITION_PENALTIES, SamplingOptions
from llmc.runtime.session import CapacityError
from llmc.runtime.templates import template_variables
from llmc.runtime.tools import ToolUse, closed, history, with_system_text

if TYPE_CHECKING:
    from llmc.runtime.grammar import Grammar
    from llmc.runtime.streaming import TokenQueue

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat replies default to the room left
MAX_STOP_STRINGS = 4  # as OpenAI allows
MAX_CHOICES = 16  # `n`, at most (and at most a server's slots and queue together)
ROLES = ("system", "user", "assistant", "tool")
_ROLE_FIELDS = {"assistant": {"tool_calls"}, "tool": {"tool_call_id"}}  # a role's fields besides role, content, name
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

_COMMON_FIELDS = {"model", "temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "stop", "n", "stream",
                  "stream_options", "user", "presence_penalty", "frequency_penalty", "repetition_penalty",
                  "logit_bias", "logprobs", "response_format", "grammar", "grammar_format"}
_FIELDS = {"completions": _COMMON_FIELDS | {"prompt", "echo"},
           "chat": _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice",
                                     "parallel_tool_calls"}}


# OpenAI fields that llmc does not implement, accepted at their neutral values only (clients send some by default)
_NEUTRAL: dict[str, Callable[[object], bool]] = {
    "best_of": lambda v: v is None or (type(v) is int and v == 1),
    "suffix": lambda v: v is None,
}
MAX_TEMPERATURE = 2.0  # as OpenAI
MAX_LOGIT_BIAS = 1024  # entries of one request's logit_bias
MAX_TOP_LOGPROBS = {"chat": 20, "completions": 5}  # as OpenAI
GRAMMAR_FORMATS = ("gbnf", "lark")
MAX_TOOLS = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # as OpenAI
GRAMMAR_CACHE = 32  # compiled grammars kept, by their text


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
    """One parsed generation request: `n` choices of the same prompt."""

    prompt: list[int]
    max_tokens: int
    sampling: SamplingOptions  # the first choice's; choice i's seed is seed + i
    stop: list[str]
    stream: bool
    include_usage: bool
    n: int = 1
    echo: str | None = None  # completions' `echo`: the prompt's text, which the answer begins with
    grammar: Grammar | None = None  # what each reply must match (response_format, grammar, or the tools' format)
    tools: ToolUse | None = None  # chat with tools: the reply is read as tool calls or a response
    # filled in as it runs
    choices: list[Choice] = field(default_factory=list, repr=False)
    completion_tokens: int = 0  # of all choices

    @property
    def prompt_logprobs(self) -> bool:
        """Whether the engine scores the prompt: echo with logprobs, or echo alone with nothing to generate."""
        return self.echo is not None and (self.sampling.logprobs is not None or self.max_tokens == 0)

    def choice_sampling(self, index: int) -> SamplingOptions:
        """Choice `index`'s sampling options: its own seed (seed + index) where a seed is set."""
        if self.sampling.seed is None or not index:
            return self.sampling
        return replace(self.sampling, seed=(self.sampling.seed + index) % 2**64)

    def cancel(self) -> None:
        """Cancel every choice's request (a finished one is not affected)."""
        for choice in self.choices:
            choice.request.cancel()

    def usage(self) -> dict:
        """OpenAI's `usage` of the job so far (the prompt counted once)."""
        return {"prompt_tokens": len(self.prompt), "completion_tokens": self.completion_tokens,
                "total_tokens": len(self.prompt) + self.completion_tokens}


@dataclass(eq=False)
class Choice:
    """One of a job's answers as it runs: its engine request and the queue its tokens come through."""

    index: int
    request: Request
    tokens: TokenQueue
    finish_reason: str | None = None


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


def _number(body: dict, name: str, default: float, low: float, high: float, what: str) -> float:
    """`body[name]` (`default` when absent): a number in [low, high] (`what` words the range)."""
    value = body.get(name)
    if value is None:
        return default
    if not _is_number(value) or not low <= value <= high:
        raise invalid(name, f"{name} must be a number {what}, got {_show(value)}")
    return float(value)


def _logit_bias(body: dict, vocabulary: int) -> tuple[tuple[int, float], ...]:
    bias = body.get("logit_bias")
    if bias is None:
        return ()
    if not isinstance(bias, dict):
        raise invalid("logit_bias", "logit_bias must be an object of token ids (as strings) to numbers")
    if len(bias) > MAX_LOGIT_BIAS:
        raise invalid("logit_bias", f"logit_bias takes at most {MAX_LOGIT_BIAS} tokens, got {len(bias)}")
    out = []
    for key, value in bias.items():
        if not (key.isascii() and key.isdigit() and len(key) <= 10 and int(key) < vocabulary):  # (ids < 2**31)
            raise invalid("logit_bias", f"logit_bias keys must be token ids below {vocabulary}, got {_show(key)}")
        if not _is_number(value) or not -100 <= value <= 100:
            raise invalid("logit_bias", f"logit_bias values must be numbers in [-100, 100], got {_show(value)} for "
                                        f"token {key}")
        out.append((int(key), float(value)))
    return tuple(sorted(out))


def _logprobs(body: dict, kind: str) -> int | None:
    """How many likeliest tokens to report beside each chosen token's logprob (None: no logprobs). Chat:
    `logprobs` true and `top_logprobs`; completions: `logprobs` the number."""
    logprobs, most = body.get("logprobs"), MAX_TOP_LOGPROBS[kind]
    if kind == "completions":
        if logprobs is not None and not (_is_int(logprobs) and 0 <= logprobs <= most):
            raise invalid("logprobs", f"logprobs must be an integer in [0, {most}], got {_show(logprobs)}")
        return logprobs
    if logprobs is not None and type(logprobs) is not bool:
        raise invalid("logprobs", f"logprobs must be a boolean, got {_show(logprobs)}")
    top = body.get("top_logprobs")
    if top is not None:
        if not (_is_int(top) and 0 <= top <= most):
            raise invalid("top_logprobs", f"top_logprobs must be an integer in [0, {most}], got {_show(top)}")
        if top and not logprobs:
            raise invalid("top_logprobs", "top_logprobs needs \"logprobs\": true")
    return (top or 0) if logprobs else None


def _sampling(body: dict, kind: str, vocabulary: int) -> SamplingOptions:
    top_k = body.get("top_k")
    if top_k is None:
        top_k = 0
    elif not _is_int(top_k) or top_k < 0:
        raise invalid("top_k", f"top_k must be an integer >= 0 (0: no limit), got {_show(top_k)}")
    seed = body.get("seed")
    if seed is not None and not _is_int(seed):
        raise invalid("seed", f"seed must be an integer, got {_show(seed)}")
    top_p = _number(body, "top_p", 1.0, 0, 1, "in (0, 1]")
    if top_p == 0:
        raise invalid("top_p", "top_p must be a number in (0, 1], got 0")
    repetition = _number(body, "repetition_penalty", 1.0, *REPETITION_PENALTIES,
                         "in [{:g}, {:g}] (1: none)".format(*REPETITION_PENALTIES))
    return SamplingOptions(
        temperature=_number(body, "temperature", 1.0, 0, MAX_TEMPERATURE, f"in [0, {MAX_TEMPERATURE:g}]"),
        top_k=top_k, top_p=top_p, seed=None if seed is None else seed % 2**64,
        min_p=_number(body, "min_p", 0.0, 0, 1, "in [0, 1]"),
        presence_penalty=_number(body, "presence_penalty", 0.0, -2, 2, "in [-2, 2]"),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2, 2, "in [-2, 2]"),
        repetition_penalty=repetition, logit_bias=_logit_bias(body, vocabulary), logprobs=_logprobs(body, kind))


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
    return [_text(s, "stop") for s in stops]


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


def _content(content: object, where: str, empty: bool) -> str:
    """A message's content as text: a string or text parts (None where `empty` allows it: an assistant's tool
    calls)."""
    if content is None and empty:
        return ""
    if isinstance(content, list):  # content parts: text only
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   and set(p) == {"type", "text"} for p in content):
            raise invalid(f"{where}.content", f"{where}.content parts must be {{\"type\": \"text\", "
                                              f"\"text\": ...}} (this model reads text only)")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise invalid(f"{where}.content", f"{where}.content must be a string or a list of text parts")
    return _text(content, f"{where}.content")


def _tool_calls(calls: object, where: str) -> list[dict]:
    """An assistant message's `tool_calls`, as OpenAI spells them (each call's arguments a JSON object's text)."""
    where = f"{where}.tool_calls"
    if not isinstance(calls, list) or not calls:
        raise invalid(where, f"{where} must be a non-empty list of tool calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not (isinstance(call, dict) and set(call) <= {"id", "type", "function"} and isinstance(call.get("id"), str)
                and call.get("type", "function") == "function" and isinstance(function, dict)
                and set(function) == {"name", "arguments"} and isinstance(function["name"], str)
                and isinstance(function["arguments"], str)):
            raise invalid(at, f"{at} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                              f"\"arguments\"}}}} with strings")
        try:
            arguments = json.loads(function["arguments"])
        except (ValueError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict):
            raise invalid(f"{at}.function.arguments", f"{at}.function.arguments must be a JSON object's text")
        out.append({"id": _text(call["id"], f"{at}.id"), "type": "function",
                    "function": {"name": _text(function["name"], f"{at}.function.name"),
                                 "arguments": _text(function["arguments"], f"{at}.function.arguments")}})
    return out


def _messages(body: dict, limits: Limits) -> list[dict]:
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
        role = message.get("role")
        if role not in ROLES:
            raise invalid(f"{where}.role", f"{where}.role must be one of {', '.join(ROLES)}, got "
                                           f"{_show(role)}")
        unknown = set(message) - {"role", "content", "name"} - _ROLE_FIELDS.get(role, set())
        if unknown:
            raise invalid(f"{where}.{sorted(unknown)[0]}", f"unknown field '{sorted(unknown)[0]}' in {where}")
        calls = message.get("tool_calls")
        kept = {"role": role, "content": _content(message.get("content"), where, calls is not None)}
        if calls is not None:
            kept["tool_calls"] = _tool_calls(calls, where)
        if role == "tool":
            if not isinstance(message.get("tool_call_id"), str):
                raise invalid(f"{where}.tool_call_id", f"{where}.tool_call_id must be the id of the tool call it "
                                                       f"answers")
            kept["tool_call_id"] = _text(message["tool_call_id"], f"{where}.tool_call_id")
        name = message.get("name")
        if name is not None:
            if not isinstance(name, str):
                raise invalid(f"{where}.name", f"{where}.name must be a string")
            kept["name"] = _text(name, f"{where}.name")
        chars += len(kept["content"]) + len(name or "") + (len(json.dumps(kept["tool_calls"])) if calls else 0)
        if chars > limits.max_chars:
            raise invalid("messages", f"the messages hold more than {limits.max_chars} characters, more than the KV "
                                      f"cache's tokens could take", "context_length_exceeded")
        out.append(kept)
    return out


def _tools(body: dict) -> tuple[list[dict], ToolUse | None]:
    """The request's `tools` (OpenAI's objects, for templates that render them) and how the reply uses them
    (None: no tools, or `tool_choice` "none")."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and type(parallel) is not bool:
        raise invalid("parallel_tool_calls", f"parallel_tool_calls must be a boolean, got {_show(parallel)}")
    if tools is None or tools == []:
        if choice not in (None, "none"):
            raise invalid("tool_choice", "tool_choice needs tools")
        return [], None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise invalid("tools", f"tools must be a list of at most {MAX_TOOLS} tools")
    functions = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        function = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and set(tool) == {"type", "function"} and tool["type"] == "function"
                and isinstance(function, dict)):
            raise invalid(where, f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}}")
        unknown = set(function) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise invalid(f"{where}.function.{sorted(unknown)[0]}", f"unknown field '{sorted(unknown)[0]}' in "
                                                                    f"{where}.function")
        name = function.get("name")
        if not (isinstance(name, str) and TOOL_NAME.fullmatch(name)):
            raise invalid(f"{where}.function.name", f"{where}.function.name must be 1 to 64 letters, digits, _ or "
                                                    f"-, got {_show(name)}")
        if name in (f["name"] for f in functions):
            raise invalid(f"{where}.function.name", f"two tools are named '{name}'")
        if not isinstance(function.get("description", ""), str):
            raise invalid(f"{where}.function.description", f"{where}.function.description must be a string")
        _text(function.get("description", ""), f"{where}.function.description")
        if not isinstance(function.get("parameters", {}), dict):
            raise invalid(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON schema "
                                                          f"(an object)")
        try:  # (its names and texts go into the prompt)
            json.dumps(function.get("parameters", {}), ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise invalid(f"{where}.function.parameters", f"{where}.function.parameters holds a lone surrogate, "
                                                          f"which is not Unicode text") from None
        except RecursionError:  # (refused where the schema is compiled, with its own message)
            pass
        if function.get("strict") is not None and type(function["strict"]) is not bool:
            raise invalid(f"{where}.function.strict", f"{where}.function.strict must be a boolean")
        functions.append({k: function[k] for k in ("name", "description", "parameters") if k in function})
    if choice is None:
        choice = "auto"
    elif isinstance(choice, dict):
        named = choice.get("function") if choice.get("type") == "function" else None
        if not (set(choice) == {"type", "function"} and isinstance(named, dict) and set(named) == {"name"}
                and named["name"] in (f["name"] for f in functions)):
            raise invalid("tool_choice", f"tool_choice must name one of the tools: {{\"type\": \"function\", "
                                         f"\"function\": {{\"name\": ...}}}}, got {_show(choice)}")
        choice = named["name"]
    elif choice not in ("auto", "none", "required"):
        raise invalid("tool_choice", f"tool_choice must be \"auto\", \"none\", \"required\" or a named function, "
                                     f"got {_show(choice)}")
    return tools, None if choice == "none" else ToolUse(tuple(functions), choice, parallel is not False)


def _max_tokens(body: dict, names: tuple[str, ...], least: int) -> tuple[str, int | None]:
    given = [(name, body[name]) for name in names if body.get(name) is not None]
    if len(given) > 1 and given[0][1] != given[1][1]:
        raise invalid(given[1][0], f"{given[0][0]} and {given[1][0]} disagree")
    if not given:
        return names[0], None
    name, value = given[0]
    if not _is_int(value) or value < least:
        raise invalid(name, f"{name} must be an integer >= {least}, got {_show(value)}")
    return name, value


def json_object(raw: bytes) -> dict:
    """A request body's JSON object, or a 400: not JSON (or not UTF-8), nested too deeply, not an object."""
    try:
        body = json.loads(raw)
    except ValueError as e:  # not UTF-8, not JSON, an integer beyond Python's 4300 digits
        raise invalid(None, f"the request body is not valid JSON: {printable(e, 200)}", "invalid_json") from None
    except RecursionError:
        raise invalid(None, "the request body is nested too deeply", "invalid_json") from None
    if not isinstance(body, dict):
        raise invalid(None, "the request body must be a JSON object")
    return body


class RequestParser:
    """Request bodies → `Job`s for one served model (`names`: what `model` may say), its codec and limits;
    `check_prompt` is the engine's check of a prompt's tokens (`CapacityError` when they do not fit);
    `max_choices`: the most choices (`n`) one request may ask for (each an engine request: those beyond the
    free slots wait in the queue, and reuse the prompt its first choice left in a slot's cache)."""

    def __init__(self, codec: TextCodec, limits: Limits, capacity: int, name: str, names: set[str],
                 check_prompt: Callable[[list[int], bool], None], max_choices: int = 1):
        self.codec, self.limits, self.capacity = codec, limits, capacity
        self.name, self.names = name, names
        self.check_prompt = check_prompt
        self.max_choices = max_choices
        self.vocabulary = codec.tokenizer.get_vocab_size()
        self.grammars: OrderedDict[tuple[str, str], Grammar] = OrderedDict()  # the last GRAMMAR_CACHE compiled
        self.grammars_lock = threading.Lock()

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
        echo = body.get("echo")
        if echo is not None and type(echo) is not bool:
            raise invalid("echo", f"echo must be a boolean, got {_show(echo)}")
        job = self._job(body, "completions", ids, ("max_tokens",), COMPLETION_MAX_TOKENS, self._grammar(body, None),
                        least=0 if echo else 1)
        if echo:
            job.echo = prompt if isinstance(prompt, str) else self.codec.decode(ids)
        return job

    def chat(self, raw: bytes) -> Job:
        """A `/v1/chat/completions` body's job: its messages rendered with the chat template and tokenized."""
        body = self._body(raw, "chat")
        messages = _messages(body, self.limits)
        tools, use = _tools(body)
        if not self.codec.chat_template:
            raise invalid("messages", "this model has no chat template; use /v1/completions", "no_chat_template")
        text = self._render(messages, tools, use)
        job = self._job(body, "chat", self._encode(text, "messages"), ("max_tokens", "max_completion_tokens"), None,
                        self._grammar(body, use))
        job.tools = use
        return job

    def _render(self, messages: list[dict], tools: list[dict], use: ToolUse | None) -> str:
        """The prompt text of `messages` through the chat template, with the tools: passed to a template that
        renders `tools`, told in the system message otherwise (`llmc.runtime.tools`); tool results in the
        template's "tool" role, or as user messages where the template refuses that role."""
        try:
            native = bool(tools) and "tools" in template_variables(self.codec.chat_template, self.codec.limits)
            if use is not None and not native:
                messages = with_system_text(messages, use.system_text())
            render = (lambda m: self.codec.render_chat(m, tools=tools)) if native else self.codec.render_chat
            try:
                return render(history(messages, tool_role=True))
            except LlmcError:
                if not any(m["role"] == "tool" for m in messages):
                    raise
                return render(history(messages, tool_role=False))
        except LlmcError as e:  # the template failed, or ran out of its time or size budget
            raise invalid("messages", str(e), "chat_template_failed") from None

    def _grammar(self, body: dict, tools: ToolUse | None) -> Grammar | None:
        """What the reply must match: the tools' reply format, `response_format`, or the `grammar` extension
        (compiled once per text: the last GRAMMAR_CACHE are kept; a schema's text keeps its properties' order,
        the order the reply writes them in)."""
        response_format, grammar, grammar_format = (body.get(k) for k in ("response_format", "grammar",
                                                                          "grammar_format"))
        if grammar_format is not None and grammar is None:
            raise invalid("grammar_format", "grammar_format needs a grammar")
        if response_format is None or response_format == {"type": "text"}:
            kind, param, text = None, None, ""
        else:
            kind, schema = _response_format(response_format)
            param, text = "response_format", json.dumps(schema) if schema is not None else ""
        if grammar is not None:
            if kind is not None:
                raise invalid("grammar", "grammar cannot be combined with a response_format")
            if not isinstance(grammar, str) or not grammar.strip():
                raise invalid("grammar", "grammar must be a grammar's text (GBNF, or Lark with \"grammar_format\": "
                                         "\"lark\")")
            if grammar_format not in (None, *GRAMMAR_FORMATS):
                raise invalid("grammar_format", f"grammar_format must be one of {', '.join(GRAMMAR_FORMATS)}, got "
                                                f"{_show(grammar_format)}")
            kind, param, text = grammar_format or "gbnf", "grammar", _text(grammar, "grammar")
        if tools is not None:
            if kind is not None:
                raise invalid(param, f"{param} cannot be combined with tools (the reply is the tools' JSON format)")
            try:
                kind, param, text = "json_schema", "tools", json.dumps(tools.schema())
            except RecursionError:
                raise invalid("tools", "a function's parameters are nested too deeply") from None
        return None if kind is None else self._compiled(kind, text, param)

    def _compiled(self, kind: str, text: str, param: str) -> Grammar:
        from llmc.runtime.grammar import Grammar, GrammarError  # (llguidance: the serve extra)

        key = (kind, text)
        with self.grammars_lock:
            if key in self.grammars:
                self.grammars.move_to_end(key)
                return self.grammars[key]
        try:
            if kind == "json_object":
                grammar = Grammar.json_object(self.codec)
            elif kind == "json_schema":
                grammar = Grammar.json_schema(self.codec, json.loads(text))
            else:
                grammar = getattr(Grammar, kind)(self.codec, text)
        except GrammarError as e:
            raise invalid(param, f"{param}: {e}", "invalid_grammar") from None
        with self.grammars_lock:
            self.grammars[key] = grammar
            while len(self.grammars) > GRAMMAR_CACHE:
                self.grammars.popitem(last=False)
        return grammar

    def _body(self, raw: bytes, kind: str) -> dict:
        body = json_object(raw)
        _check_fields(body, kind)
        self.check_model(body.get("model"))
        user = body.get("user")  # (an end user's id, for abuse monitoring at OpenAI: here only checked)
        if user is not None and not isinstance(user, str):
            raise invalid("user", f"user must be a string, got {_show(user)}")
        return body

    def _job(self, body: dict, kind: str, prompt: list[int], max_names: tuple[str, ...], default_max: int | None,
             grammar: Grammar | None, least: int = 1) -> Job:
        """The job of a `kind` ("completions", "chat") request for `prompt`, with at least `least` tokens to
        generate."""
        prompt_param = "messages" if kind == "chat" else "prompt"
        max_name, max_tokens = _max_tokens(body, max_names, least)
        try:
            self.check_prompt(prompt, max_tokens != 0)  # (scoring alone may fill the cache)
        except CapacityError as e:
            raise invalid(prompt_param, str(e), "context_length_exceeded") from None
        except ValueError as e:
            raise invalid(prompt_param, str(e)) from None
        room = self.capacity - len(prompt)
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
        elif max_tokens > room:
            raise invalid(max_name, f"{max_name} is {_show(max_tokens)}, but the KV cache holds {self.capacity} "
                                    f"tokens per sequence and the prompt takes {len(prompt)}: at most {room} remain",
                          "context_length_exceeded")
        n = body.get("n")
        if n is not None and not (_is_int(n) and 1 <= n <= self.max_choices):
            raise invalid("n", f"n must be an integer in [1, {self.max_choices}], got {_show(n)}")
        stream, include_usage = _stream(body)
        return Job(prompt, max_tokens, _sampling(body, kind, self.vocabulary), _stop(body), stream, include_usage,
                   n or 1, grammar=grammar)

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


def _response_format(value: object) -> tuple[str, dict | None]:
    """A `response_format` other than text: ("json_object", None) or ("json_schema", the schema)."""
    kind = value.get("type") if isinstance(value, dict) else None
    if kind == "json_object" and set(value) == {"type"}:
        return "json_object", None
    spec = value.get("json_schema") if kind == "json_schema" else None
    if not (isinstance(spec, dict) and set(value) == {"type", "json_schema"}):
        raise invalid("response_format", "response_format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                                         "{\"type\": \"json_schema\", \"json_schema\": {\"name\", \"schema\", ...}}")
    unknown = set(spec) - {"name", "schema", "strict", "description"}
    if unknown:
        raise invalid("response_format", f"unknown field '{sorted(unknown)[0]}' in response_format.json_schema")
    if not isinstance(spec.get("name"), str) or not isinstance(spec.get("schema", {}), dict):
        raise invalid("response_format", "response_format.json_schema needs a \"name\" (a string) and a \"schema\" "
                                         "(an object)")
    if spec.get("strict") is not None and type(spec["strict"]) is not bool:
        raise invalid("response_format", "response_format.json_schema.strict must be a boolean")
    if "schema" not in spec:
        return "json_object", None
    try:  # (strict: OpenAI's strict mode takes no property a schema does not name)
        return "json_schema", closed(spec["schema"]) if spec.get("strict") else spec["schema"]
    except RecursionError:
        raise invalid("response_format", "response_format.json_schema.schema is nested too deeply") from None
