"""`llmc serve` for applications, through the official `openai` client: structured output (JSON schema,
JSON object, GBNF and Lark grammars), tool calls round-tripping through a two-turn conversation,
logprobs (their sum over an echoed prompt equals `llmc.runtime.perplexity`'s), `n` choices,
penalties and `logit_bias`.

The server runs as `llmc serve` in a subprocess that cannot import the compiler stack, on a tiny
random-weight artifact: the grammar decides what the answers look like, the weights only choose
among what it allows.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import test_serve
from test_serve import LETTERS, REPEATS
from tiny_models import TinySpec, _bytes_to_unicode

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

from llmc.driver import BackendOptions, compile_model  # noqa: E402
from llmc.passes.pipeline import CompileOptions  # noqa: E402
from llmc.runtime.api_requests import Limits, RequestParser  # noqa: E402
from llmc.runtime.artifact import load_manifest  # noqa: E402
from llmc.runtime.codec import TextCodec  # noqa: E402
from llmc.runtime.perplexity import chunk_tokens, perplexity  # noqa: E402
from llmc.runtime.sampling import SamplingOptions  # noqa: E402
from llmc.runtime.session import Session  # noqa: E402

CAPACITY = 2048
SLOTS = 4
WEATHER = {"type": "function", "function": {  # (no other properties, though it does not say so)
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"enum": ["Paris", "Rome"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["zone"], "properties": {"zone": {"const": "UTC"}}}}}
server, client = test_serve.server, test_serve.client  # the fixtures, on this module's `artifact`
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("serve_apps") / "tiny.llmc"
    options = {"prefill_chunk": 16, "max_seq": CAPACITY, "max_batch": SLOTS}
    compile_model(str(tiny(TinySpec(context_length=CAPACITY), "gguf")), out, CompileOptions(**options),
                  BackendOptions(), progress=lambda _: None)
    return out


@pytest.fixture(scope="module")
def codec(artifact) -> TextCodec:
    return TextCodec.from_artifact(load_manifest(artifact))


def chat(client, messages=ASK, **options):
    return client.chat.completions.create(model="tiny", messages=messages, **{"temperature": 0, **options})


def completion(client, prompt=REPEATS, **options):
    return client.completions.create(model="tiny", prompt=prompt, **{"temperature": 0, **options})


def token_id(codec: TextCodec, text: str) -> int:
    (token,) = codec.encode(text, bos=False)
    return token


# ------------------------------------------------------------------ structured output


def test_json_schema_answers_validate(client) -> None:
    schema = {"type": "object", "additionalProperties": False, "required": ["size", "colour", "ok"],
              "properties": {"size": {"type": "integer", "minimum": 0, "maximum": 9},
                             "colour": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    for seed in range(3):
        answer = chat(client, temperature=1.0, seed=seed, max_tokens=300, response_format=response_format)
        assert answer.choices[0].finish_reason == "stop"
        reply = json.loads(answer.choices[0].message.content)
        jsonschema.validate(reply, schema)
        assert list(reply) == ["size", "colour", "ok"]  # in the schema's order


def test_strict_json_schema_takes_no_property_it_does_not_name(client) -> None:
    """`strict: true` (OpenAI's strict mode): every object of the schema closed to the properties it names, where
    the schema does not say `additionalProperties` (a random model adds keys where it may)."""
    schema = {"type": "object", "required": ["colour", "inner"],
              "properties": {"colour": {"enum": ["red", "blue"]},
                             "inner": {"type": "object", "properties": {"n": {"type": "integer", "maximum": 9}}}}}
    strict = {"type": "json_schema", "json_schema": {"name": "thing", "schema": schema, "strict": True}}
    for seed in range(4):
        answer = chat(client, temperature=1.0, seed=seed, max_tokens=300, response_format=strict)
        reply = json.loads(answer.choices[0].message.content)
        assert set(reply) == {"colour", "inner"} and set(reply["inner"]) <= {"n"}, reply


def test_json_object_and_grammars(client, codec) -> None:
    # any object: a bias towards "}" closes it at once, and then the grammar allows only the end
    closing = {str(token_id(codec, "}")): 20}
    answer = chat(client, max_tokens=30, response_format={"type": "json_object"}, logit_bias=closing)
    assert (json.loads(answer.choices[0].message.content), answer.choices[0].finish_reason) == ({}, "stop")
    # the grammar extension: GBNF (llama-server's `grammar`), and Lark
    for grammar in ({"grammar": 'root ::= ("yes" | "no") "!"'},
                    {"grammar": 'start: ("hot" | "cold") " " ("tea" | "soup")', "grammar_format": "lark"}):
        text = completion(client, max_tokens=20, extra_body=grammar).choices[0].text
        assert text in ("yes!", "no!", "hot tea", "hot soup", "cold tea", "cold soup"), text
    streamed = [c.choices[0].text for c in completion(client, max_tokens=20, stream=True,
                                                      extra_body={"grammar": 'root ::= "n=" [0-9] [0-9] "."'})]
    assert len(streamed) > 2 and re.fullmatch(r"n=[0-9][0-9]\.", "".join(streamed))


# ------------------------------------------------------------------ tools


def test_forced_tool_call_round_trips(client) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    forced = {"tools": [WEATHER, CLOCK], "tool_choice": named, "parallel_tool_calls": False, "max_tokens": 300}
    first = chat(client, **forced)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) in ({"city": "Paris"}, {"city": "Rome"})
    # streamed: the call comes whole in one delta, as OpenAI's chunks spell it
    chunks = list(chat(client, **forced, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or [])]
    assert [(d.index, d.function.name, d.function.arguments) for d in deltas] == [
        (0, "get_weather", call.function.arguments)]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    # the second turn: the call and its result in the conversation, and a reply in words
    turn = [*ASK, choice.message.model_dump(exclude_none=True),
            {"role": "tool", "tool_call_id": call.id, "content": "22 degrees, sunny"}]
    second = chat(client, turn, tools=[WEATHER, CLOCK], tool_choice="none", max_tokens=8)
    assert second.choices[0].message.tool_calls is None and second.choices[0].message.content
    assert second.usage.prompt_tokens > chat(client, max_tokens=1).usage.prompt_tokens + 20  # (the call, its result)
    # "required" with calls in parallel refused: exactly one call, of either tool
    required = chat(client, tools=[WEATHER, CLOCK], tool_choice="required", parallel_tool_calls=False,
                    max_tokens=300, temperature=1.0, seed=3)
    (call,) = required.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time")


def test_a_tools_references_resolve_in_its_own_parameters(client, codec) -> None:
    """A function's parameters with `$defs` (refused: their pointers were resolved in the reply's schema, which
    holds them): each call's arguments follow the function's own schema."""
    parameters = {"type": "object", "$defs": {"colour": {"enum": ["red", "blue"]}}, "required": ["colour"],
                  "properties": {"colour": {"$ref": "#/$defs/colour"}}}
    tool = {"type": "function", "function": {"name": "paint", "parameters": parameters}}
    no_indent = {str(token_id(codec, space)): -100 for space in ("\t", "\n")}  # (the random model likes tabs)
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
        answer = chat(client, tools=[tool], tool_choice="required", parallel_tool_calls=False, max_tokens=300,
                      logit_bias=no_indent, **sampling)
        assert answer.choices[0].finish_reason == "tool_calls", answer.choices[0].message
        for call in answer.choices[0].message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments), parameters)


def test_a_tool_referring_to_itself_means_its_parameters_not_the_reply() -> None:
    """`"$ref": "#"` in a function's parameters is those parameters (it meant the whole reply, which no finite
    reply met); every object is closed to the properties it names (OpenAI's strict mode)."""
    from llmc.runtime.tools import ToolUse

    parameters = {"type": "object", "required": ["name"],
                  "properties": {"name": {"type": "string"}, "next": {"$ref": "#"}}}
    schema = ToolUse(({"name": "chain", "parameters": parameters},), "required").schema()

    def reply(arguments: dict) -> dict:
        return {"tool_calls": [{"name": "chain", "arguments": arguments}]}

    jsonschema.validate(reply({"name": "a", "next": {"name": "b", "next": {"name": "c"}}}), schema)
    for wrong in ({"name": "a", "next": reply({"name": "b"})}, {"name": "a", "next": {"name": "b", "extra": 1}}):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(reply(wrong), schema)


def test_auto_tool_choice_is_a_call_or_an_answer(client) -> None:
    for seed in range(3):
        choice = chat(client, tools=[CLOCK], max_tokens=300, temperature=1.0, seed=seed).choices[0]
        if choice.message.tool_calls:
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            assert json.loads(choice.message.tool_calls[0].function.arguments) == {"zone": "UTC"}
        else:
            assert isinstance(choice.message.content, str) and choice.finish_reason in ("stop", "length")


def test_tools_reach_the_prompt(codec) -> None:
    """A template that never mentions `tools` gets them described in the system message; a tool result is in
    the template's "tool" role, the call as the JSON the model wrote."""
    parser = RequestParser(codec, Limits.for_capacity(CAPACITY), CAPACITY, "tiny", {"tiny"}, lambda ids, generating: None)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}
    body = {"messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees"}], "tools": [WEATHER]}
    job = parser.chat(json.dumps(body).encode())
    prompt = codec.decode(job.prompt)
    assert prompt.startswith("<|im_start|>system\nYou can call these tools:\n") and "The weather in a city" in prompt
    assert '<|im_start|>assistant\n{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Rome"}}]}' in prompt
    assert "<|im_start|>tool\n22 degrees<|im_end|>" in prompt
    assert job.grammar is not None and job.tools.choice == "auto"

    def prompt_with(template: str, body: dict) -> str:
        templated = TextCodec(codec.tokenizer, codec.bos_id, codec.eos_id, codec.add_bos, template)
        parser = RequestParser(templated, Limits.for_capacity(CAPACITY), CAPACITY, "tiny", {"tiny"}, lambda ids, generating: None)
        return codec.decode(parser.chat(json.dumps(body).encode()).prompt)

    # a template that renders tools itself gets them, and no description
    native = "{% for t in tools %}[{{ t.function.name }}]{% endfor %}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert prompt_with(native, {"messages": ASK, "tools": [WEATHER]}) == "[get_weather]What is the weather in Paris?"
    # one that refuses the "tool" role gets the result as a user message naming the call
    refusing = ("{% for m in messages %}{% if m.role == 'tool' %}{{ raise_exception('no tools here') }}{% endif %}"
                "{{ m.role }}: {{ m.content }}\n{% endfor %}")
    assert prompt_with(refusing, body).endswith("user: The result of the tool call call_1 (get_weather):\n22 degrees\n")


def test_a_grammar_failing_while_it_generates_is_400(server) -> None:
    """A grammar that compiles but outgrows its matcher's limits once tokens come (llguidance's items): the client's
    grammar, so a 400 `invalid_grammar` (an error event, streamed), not a 500, counted as an error in /health; and
    no slash redirect to a Host."""
    body = {"prompt": "x", "max_tokens": 8, "grammar": 'root ::= "a"{1000000}'}
    before = server.health()["requests"]
    whole = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert whole.status_code == 400, whole.text
    assert whole.json()["error"]["code"] == "invalid_grammar" and "failed while generating" in whole.text
    streamed = httpx.post(f"{server.url}/v1/completions", json=body | {"stream": True}, timeout=60)
    assert streamed.status_code == 200 and '"code":"invalid_grammar"' in streamed.text, streamed.text
    assert server.health()["requests"] == before | {"error": before["error"] + 2}  # (were counted nowhere)
    slash = httpx.post(f"{server.url}/v1/completions/", json=body, timeout=10, headers={"Host": "evil.example"})
    assert slash.status_code == 404 and slash.json()["error"]["code"] == "not_found"
    assert "Traceback" not in "".join(server.stderr)


# ------------------------------------------------------------------ logprobs


def test_chat_logprobs(client) -> None:
    whole = chat(client, max_tokens=10, logprobs=True, top_logprobs=3)
    content = whole.choices[0].logprobs.content
    assert len(content) == whole.usage.completion_tokens == 10
    assert "".join(t.token for t in content) == whole.choices[0].message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode()) and len(entry.top_logprobs) == 3
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True) and entry.logprob == tops[0] <= 0  # greedy: the likeliest
        assert sum(math.exp(p) for p in tops) <= 1 + 1e-6
    streamed = [t for c in chat(client, max_tokens=10, logprobs=True, top_logprobs=3, stream=True)
                if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [(t.token, round(t.logprob, 4)) for t in streamed] == [(t.token, round(t.logprob, 4)) for t in content]


def test_completion_logprobs_and_text_offsets(client) -> None:
    answer = completion(client, max_tokens=8, logprobs=2)
    logprobs = answer.choices[0].logprobs
    assert "".join(logprobs.tokens) == answer.choices[0].text
    assert logprobs.text_offset == [sum(map(len, logprobs.tokens[:i])) for i in range(8)]
    assert all(len(top) <= 2 and max(top.values()) == p for top, p in zip(logprobs.top_logprobs,
                                                                           logprobs.token_logprobs))


def test_logprobs_of_tokens_inside_a_character(client, codec) -> None:
    """Tokens that each hold a part of a UTF-8 character (the tiny vocabulary's bytes): chat's `bytes` join into the
    reply, and a completion's `text_offset` counts the whole characters before each token."""
    text = "日本語 ok"
    whole = chat(client, max_tokens=20, logprobs=True, extra_body={"grammar": f'root ::= "{text}"'})
    content = whole.choices[0].logprobs.content
    assert whole.choices[0].message.content == text and any(t.token == "\ufffd" for t in content)
    assert b"".join(bytes(t.bytes) for t in content) == text.encode()
    answer = completion(client, text + " is", max_tokens=0, echo=True, logprobs=1)
    logprobs = answer.choices[0].logprobs
    ids = codec.encode(text + " is", bos=False)
    byte_of = {char: byte for byte, char in _bytes_to_unicode().items()}
    spelled = [bytes(byte_of[c] for c in codec.tokenizer.id_to_token(i)) for i in ids]  # (byte-level BPE)
    assert logprobs.text_offset == [len(b"".join(spelled[:i]).decode("utf-8", "ignore")) for i in range(len(ids))]
    assert logprobs.text_offset[-1] < len(text + " is")  # (each of 日本語's 9 byte tokens counting 1: past the end)


def test_echoed_prompt_logprobs_sum_to_perplexity_nll(client, artifact, codec) -> None:
    """Completions' echo with logprobs scores the prompt: over the positions `llmc perplexity` scores, the
    prompt tokens' logprobs sum to minus its NLL."""
    ids = codec.encode("the cat sat on the mat and then the dog ran after the cat " * 3, bos=False)
    ctx = len(ids) // 2
    (chunk,) = chunk_tokens(ids, ctx, 1, codec.bos_id, codec.add_bos)
    session = Session(artifact, threads=1)
    try:
        nll = perplexity(session, [chunk]).nll[0]
    finally:
        session.close()
    answer = completion(client, chunk.tolist(), max_tokens=0, echo=True, logprobs=1)
    logprobs = answer.choices[0].logprobs
    assert answer.choices[0].text == codec.decode(chunk.tolist()) and answer.usage.completion_tokens == 0
    assert logprobs.token_logprobs[0] is None and len(logprobs.token_logprobs) == ctx
    assert sum(logprobs.token_logprobs[ctx // 2 + 1:]) == pytest.approx(-nll.sum(), rel=1e-4, abs=1e-4)
    # echo and a continuation: the prompt's text first, then the same greedy continuation as without echo
    echoed = completion(client, LETTERS, max_tokens=6, echo=True).choices[0].text
    assert echoed == LETTERS + completion(client, LETTERS, max_tokens=6).choices[0].text


def test_scoring_a_prompt_that_fills_the_cache(client, codec) -> None:
    """Echo with max_tokens 0 generates nothing, so a prompt of exactly the cache's tokens is scored (its
    tokens' logprobs those of its prefix alone: each depends on the tokens before it); generating after it is
    refused."""
    ids = (codec.encode("the cat sat on the mat and then the dog ran after the cat " * 40, bos=False) * 2)[:CAPACITY]
    assert len(ids) == CAPACITY
    whole = completion(client, ids, max_tokens=0, echo=True, logprobs=1).choices[0].logprobs.token_logprobs
    prefix = completion(client, ids[:40], max_tokens=0, echo=True, logprobs=1).choices[0].logprobs.token_logprobs
    assert len(whole) == CAPACITY and whole[:40] == pytest.approx(prefix, abs=1e-5)
    for prompt, max_tokens in ((ids, 1), (ids + ids[:1], 0)):
        with pytest.raises(openai.BadRequestError) as refused:
            completion(client, prompt, max_tokens=max_tokens, echo=True, logprobs=1)
        assert refused.value.code == "context_length_exceeded"


# ------------------------------------------------------------------ n, penalties, logit_bias


def test_n_choices(client) -> None:
    greedy = completion(client, max_tokens=6, n=3)
    assert [c.index for c in greedy.choices] == [0, 1, 2] and len({c.text for c in greedy.choices}) == 1
    assert greedy.usage.completion_tokens == 18
    sampled = chat(client, max_tokens=12, n=3, temperature=2.0, seed=5, frequency_penalty=2.0)
    again = chat(client, max_tokens=12, n=3, temperature=2.0, seed=5, frequency_penalty=2.0)
    texts = [c.message.content for c in sampled.choices]
    assert texts == [c.message.content for c in again.choices] and len(set(texts)) == 3  # seeds 5, 6, 7
    streamed: dict[int, str] = {}
    for chunk in chat(client, max_tokens=12, n=3, temperature=2.0, seed=5, frequency_penalty=2.0, stream=True):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert [streamed[i] for i in range(3)] == texts
    more = completion(client, max_tokens=4, n=SLOTS + 2, temperature=2.0, seed=1)  # the last two wait for a slot
    assert [c.index for c in more.choices] == list(range(SLOTS + 2))


def test_penalties_and_logit_bias_change_the_text(client, codec) -> None:
    greedy = completion(client, max_tokens=12).choices[0].text  # " the the the ..."
    assert greedy.count(" the") == 12
    for options in ({"frequency_penalty": 2.0}, {"extra_body": {"repetition_penalty": 3.0}}):
        assert completion(client, max_tokens=12, **options).choices[0].text.count(" the") < 12, options
    the = token_id(codec, " the")
    assert " the" not in completion(client, max_tokens=12, logit_bias={str(the): -100}).choices[0].text
    forced = completion(client, LETTERS, max_tokens=5, logit_bias={str(the): 100}).choices[0].text
    assert forced == " the" * 5
    # min_p 1 keeps only the likeliest token: sampling at any temperature is greedy
    assert completion(client, max_tokens=12, temperature=2.0, extra_body={"min_p": 1.0}).choices[0].text == greedy


def test_sampling_options_reach_the_engine(codec) -> None:
    """Each field becomes its `SamplingOptions` (what each does to the logits: tests/test_sampling.py)."""
    parser = RequestParser(codec, Limits.for_capacity(CAPACITY), CAPACITY, "tiny", {"tiny"}, lambda ids, generating: None, 4)
    body = {"prompt": "x", "temperature": 0.5, "top_p": 0.9, "top_k": 7, "min_p": 0.1, "seed": 3, "n": 4,
            "presence_penalty": 1.5, "frequency_penalty": -0.5, "repetition_penalty": 1.2,
            "logit_bias": {"9": -1, "5": 2.5}, "logprobs": 3}
    job = parser.completion(json.dumps(body).encode())
    assert job.sampling == SamplingOptions(0.5, 7, 0.9, 3, min_p=0.1, presence_penalty=1.5, frequency_penalty=-0.5,
                                           repetition_penalty=1.2, logit_bias=((5, 2.5), (9, -1.0)), logprobs=3)
    assert job.n == 4 and [job.choice_sampling(i).seed for i in range(4)] == [3, 4, 5, 6]
    chat_body = {"messages": ASK, "logprobs": True, "top_logprobs": 5}
    assert parser.chat(json.dumps(chat_body).encode()).sampling.logprobs == 5
    assert parser.chat(json.dumps({"messages": ASK, "logprobs": False}).encode()).sampling.logprobs is None


def test_answers_match_the_openapi_schema(server) -> None:
    components = httpx.get(f"{server.url}/openapi.json", timeout=10).json()["components"]["schemas"]
    named = {"type": "function", "function": {"name": "get_time"}}
    cases = [("chat/completions", "ChatCompletionRequest", "ChatCompletion",
              {"messages": ASK, "max_tokens": 3, "logprobs": True, "top_logprobs": 2, "n": 2}),
             ("chat/completions", "ChatCompletionRequest", "ChatCompletion",
              {"messages": ASK, "max_tokens": 300, "tools": [CLOCK], "tool_choice": named, "temperature": 0,
               "parallel_tool_calls": False}),
             ("completions", "CompletionRequest", "Completion",
              {"prompt": LETTERS, "max_tokens": 2, "echo": True, "logprobs": 2, "logit_bias": {"5": 1}})]

    def valid(name: str, value: object) -> bool:
        return jsonschema.Draft202012Validator({"$ref": f"#/components/schemas/{name}", "components": {
            "schemas": components}}).is_valid(value)

    for path, request, response, body in cases:
        answer = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=60)
        assert valid(request, body) and answer.status_code == 200 and valid(response, answer.json()), answer.text


def test_health_and_metrics_count_the_requests(server, client) -> None:
    completion(client, max_tokens=2)
    health = server.health()
    assert health["prompt_tokens"] > 0 and "reused_tokens" in health
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text

    def value(name: str) -> float:
        return float(re.search(rf'^{name}{{endpoint="completions"}} (\S+)$', metrics, re.M).group(1))

    # the hooks ran: each request ended (counted by reason) had its first token timed
    ended = sum(float(n) for n in re.findall(r'^llmc_requests_total{endpoint="completions",reason="\w+"} (\S+)$',
                                            metrics, re.M))
    assert ended >= 1 and value("llmc_time_to_first_token_seconds_count") >= 1
    assert value("llmc_requests_in_progress") == 0
