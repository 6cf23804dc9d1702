"""The OpenAPI 3.1 description of `llmc serve`'s routes (served at `GET /openapi.json`).

Written by hand to match what `llmc.runtime.server` accepts (`llmc.runtime.api_requests`) and
answers: request bodies take no other fields (besides OpenAI's, the extensions `top_k`, `min_p`,
`repetition_penalty`, `grammar` and `grammar_format`), OpenAI fields llmc does not implement only
at their neutral values, and every refusal is OpenAI's error body. Fuzzers (schemathesis) generate requests from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from llmc.runtime.sampling import REPETITION_PENALTIES

if TYPE_CHECKING:
    from llmc.runtime.api_requests import Limits


def _nullable(schema: dict) -> dict:
    return {"anyOf": [schema, {"type": "null"}]}


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _errors(*statuses: int) -> dict:
    reasons = {400: "a malformed request (the error names the field)", 404: "an unknown model",
               408: "the body did not arrive in time", 413: "the body is over the size limit",
               429: "every slot is busy and the queue is full", 503: "the server is shutting down"}
    return {str(s): {"description": reasons[s], "content": {"application/json": {"schema": _ref("Error")}}}
            for s in statuses}


def _generation(answer: str, chunk: str) -> dict:
    return {"200": {"description": "the whole answer, or server-sent events of chunks ending with `data: [DONE]` "
                                   "when `stream` is true",
                    "content": {"application/json": {"schema": _ref(answer)},
                                "text/event-stream": {"schema": {"type": "string",
                                                                 "description": f"`data: ` lines of {chunk}"}}}},
            **_errors(400, 404, 408, 413, 429, 503)}


def openapi_schema(model: str, limits: Limits, max_choices: int = 1) -> dict:
    """The schema for a server of `model` under `limits`, answering up to `max_choices` choices a request."""
    integer = {"type": "integer"}
    number = {"type": "number"}
    common = {
        "model": _nullable({"type": "string", "description": f"'{model}' (or omitted)"}),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": 0, "description": "0: no limit"}),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1,
                            "description": "drop tokens below min_p × the likeliest token's probability"}),
        "seed": _nullable(integer),
        "stop": _nullable({"anyOf": [{"type": "string", "minLength": 1},
                                     {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1}}]}),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": max_choices,
                        "description": "choices, each a request of its own (seed + i when a seed is set)"}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "additionalProperties": False,
                                     "properties": {"include_usage": {"type": "boolean"}},
                                     "description": "only with \"stream\": true"}),
        "user": {},
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2}),
        "repetition_penalty": _nullable({"type": "number", "minimum": REPETITION_PENALTIES[0],
                                         "maximum": REPETITION_PENALTIES[1],
                                         "description": "llama.cpp's, over the prompt and the reply (1: none)"}),
        "logit_bias": _nullable({"type": "object", "maxProperties": 1024,
                                 "propertyNames": {"pattern": "^[0-9]+$"},
                                 "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                                 "description": "token id → a bias added to its logit"}),
        "response_format": _nullable({"anyOf": [
            {"type": "object", "required": ["type"], "additionalProperties": False,
             "properties": {"type": {"enum": ["text", "json_object"]}}},
            {"type": "object", "required": ["type", "json_schema"], "additionalProperties": False,
             "properties": {"type": {"const": "json_schema"}, "json_schema": {
                 "type": "object", "required": ["name"], "additionalProperties": False,
                 "properties": {"name": {"type": "string"}, "schema": {"type": "object"},
                                "strict": _nullable({"type": "boolean"}), "description": {"type": "string"}}}}}]}),
        "grammar": _nullable({"type": "string", "minLength": 1,
                              "description": "the reply's grammar: GBNF (llama-server's), or Lark with "
                                             "grammar_format"}),
        "grammar_format": _nullable({"enum": ["gbnf", "lark"]}),
        # OpenAI's fields that llmc does not implement, at their neutral values only
        "best_of": _nullable({"type": "integer", "const": 1}),
        "suffix": {"type": "null"},
    }
    text = {"type": "string", "maxLength": limits.max_chars}
    parts = {"type": "array", "items": {"type": "object", "required": ["type", "text"], "additionalProperties": False,
                                        "properties": {"type": {"const": "text"}, "text": text}}}
    tool_call = {"type": "object", "required": ["id", "function"], "additionalProperties": False,
                 "properties": {"id": {"type": "string"}, "type": {"const": "function"},
                                "function": {"type": "object", "required": ["name", "arguments"],
                                             "additionalProperties": False,
                                             "properties": {"name": {"type": "string"},
                                                            "arguments": {"type": "string",
                                                                          "description": "a JSON object's text"}}}}}
    tool_calls = {"type": "array", "items": {**tool_call, "required": ["id", "type", "function"]}}
    top = {"type": "object", "required": ["token", "logprob", "bytes"],
           "properties": {"token": {"type": "string"}, "logprob": number, "bytes": {"type": "array", "items": integer}}}
    schemas = {
        "Error": {"type": "object", "required": ["error"], "properties": {"error": {
            "type": "object", "required": ["message", "type", "param", "code"],
            "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                           "param": _nullable({"type": "string"}), "code": _nullable({"type": "string"})}}}},
        "CompletionRequest": {
            "type": "object", "required": ["prompt"], "additionalProperties": False,
            "properties": {**common, "prompt": {"anyOf": [
                text,
                {"type": "array", "minItems": 1, "maxItems": 1, "items": text},
                {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0},
                 "description": "token ids"}]},
                "max_tokens": _nullable({"type": "integer", "minimum": 0, "description": "0 only with echo"}),
                "logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 5,
                                       "description": "each token's logprob and this many likeliest"}),
                "echo": _nullable({"type": "boolean", "description": "the answer begins with the prompt (with "
                                                                     "logprobs: its tokens' too)"})}},
        "Message": {
            "type": "object", "required": ["role"], "additionalProperties": False,
            "properties": {
                "role": {"enum": ["system", "user", "assistant", "tool"]},
                "content": _nullable({"anyOf": [text, parts], "description": "null only beside tool_calls"}),
                "name": _nullable({"type": "string"}),
                "tool_calls": {**tool_calls, "minItems": 1, "description": "an assistant's calls"},
                "tool_call_id": {"type": "string", "description": "a tool message's: the call it answers"}}},
        "Tool": {"type": "object", "required": ["type", "function"], "additionalProperties": False,
                 "properties": {"type": {"const": "function"}, "function": {
                     "type": "object", "required": ["name"], "additionalProperties": False,
                     "properties": {"name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"},
                                    "description": {"type": "string"},
                                    "parameters": {"type": "object", "description": "a JSON schema"},
                                    "strict": _nullable({"type": "boolean"})}}}},
        "ChatCompletionRequest": {
            "type": "object", "required": ["messages"], "additionalProperties": False,
            "properties": {**common,
                           "max_tokens": _nullable({"type": "integer", "minimum": 1}),
                           "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
                           "messages": {"type": "array", "minItems": 1, "maxItems": limits.max_messages,
                                        "items": _ref("Message")},
                           "logprobs": _nullable({"type": "boolean"}),
                           "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": 20,
                                                      "description": "with \"logprobs\": true"}),
                           "tools": _nullable({"type": "array", "maxItems": 128, "items": _ref("Tool")}),
                           "tool_choice": _nullable({"anyOf": [
                               {"enum": ["auto", "none", "required"]},
                               {"type": "object", "required": ["type", "function"], "additionalProperties": False,
                                "properties": {"type": {"const": "function"}, "function": {
                                    "type": "object", "required": ["name"], "additionalProperties": False,
                                    "properties": {"name": {"type": "string"}}}}}]}),
                           "parallel_tool_calls": _nullable({"type": "boolean"})}},
        "Usage": {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
                  "properties": {k: integer for k in ("prompt_tokens", "completion_tokens", "total_tokens")}},
        "Completion": _answer("text_completion", "text", {"type": "string"}, _nullable({
            "type": "object", "required": ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
            "properties": {"tokens": {"type": "array", "items": {"type": "string"}},
                           "token_logprobs": {"type": "array", "items": _nullable(number)},
                           "top_logprobs": {"type": "array", "items": _nullable({
                               "type": "object", "additionalProperties": number})},
                           "text_offset": {"type": "array", "items": integer}}})),
        "ChatCompletion": _answer("chat.completion", "message", {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"const": "assistant"}, "content": _nullable({"type": "string"}),
                           "tool_calls": tool_calls}}, _nullable({
            "type": "object", "required": ["content"], "properties": {"content": {"type": "array", "items": {
                **top, "required": ["token", "logprob", "bytes", "top_logprobs"],
                "properties": {**top["properties"], "top_logprobs": {"type": "array", "items": top}}}}}})),
        "Model": {"type": "object", "required": ["id", "object", "created", "owned_by", "max_model_len"],
                  "properties": {"id": {"type": "string"}, "object": {"const": "model"}, "created": integer,
                                 "owned_by": {"type": "string"}, "source": {}, "target": {"type": "string"},
                                 "max_model_len": integer, "slots": integer, "chat_template": {"type": "boolean"}}},
    }
    json_body = {"application/json": {"schema": {"type": "object"}}}
    return {
        "openapi": "3.1.0",
        "info": {"title": "llmc serve", "version": "1",
                 "description": f"An OpenAI-compatible API over the artifact '{model}'. Request bodies: at most "
                                f"{limits.max_body_bytes} bytes, sent within {limits.body_seconds:g} s."},
        "paths": {
            "/v1/completions": {"post": {
                "summary": "a prompt's continuation",
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": _ref("CompletionRequest")}}},
                "responses": _generation("Completion", "text_completion chunks")}},
            "/v1/chat/completions": {"post": {
                "summary": "the reply to messages, rendered with the model's chat template",
                "requestBody": {"required": True,
                                "content": {"application/json": {"schema": _ref("ChatCompletionRequest")}}},
                "responses": _generation("ChatCompletion", "chat.completion.chunk chunks")}},
            "/v1/models": {"get": {"summary": "the one model served", "responses": {"200": {
                "description": "a list of one model", "content": {"application/json": {"schema": {
                    "type": "object", "required": ["object", "data"],
                    "properties": {"object": {"const": "list"},
                                   "data": {"type": "array", "items": _ref("Model")}}}}}}}}},
            "/v1/models/{model}": {"get": {
                "summary": "the model, by its name",
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": {"description": "the model",
                                      "content": {"application/json": {"schema": _ref("Model")}}},
                              **_errors(400, 404)}}},
            "/health": {"get": {"summary": "the engine's state: slots, running and waiting requests, counts",
                                "responses": {"200": {"description": "the state", "content": json_body}}}},
            "/openapi.json": {"get": {"summary": "this description",
                                      "responses": {"200": {"description": "OpenAPI 3.1", "content": json_body}}}},
            "/metrics": {"get": {"summary": "Prometheus metrics (llmc_*): requests, tokens, queue, time to first "
                                            "token, tokens/s, prompt tokens reused",
                                 "responses": {"200": {"description": "Prometheus' text format",
                                                       "content": {"text/plain": {"schema": {"type": "string"}}}}}}},
            "/tokenize": {"post": {
                "summary": "text → token ids (llama-server's shape)",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["content"], "additionalProperties": False,
                    "properties": {"content": text, "add_special": {"type": "boolean"},
                                   "with_pieces": {"type": "boolean"}}}}}},
                "responses": {"200": {"description": "{\"tokens\": [...]}", "content": json_body},
                              **_errors(400, 408, 413)}}},
            "/detokenize": {"post": {
                "summary": "token ids → text",
                "requestBody": {"required": True, "content": {"application/json": {"schema": {
                    "type": "object", "required": ["tokens"], "additionalProperties": False,
                    "properties": {"tokens": {"type": "array", "items": {"type": "integer", "minimum": 0}}}}}}},
                "responses": {"200": {"description": "{\"content\": TEXT}", "content": json_body},
                              **_errors(400, 408, 413)}}},
        },
        "components": {"schemas": schemas},
    }


def _answer(kind: str, field: str, schema: dict, logprobs: dict) -> dict:
    """A whole (not streamed) answer of `kind` whose choices each hold `field` (the text, or the message) and
    `logprobs`."""
    integer = {"type": "integer"}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {
                "id": {"type": "string"}, "object": {"const": kind}, "created": integer,
                "model": {"type": "string"}, "usage": _ref("Usage"),
                "choices": {"type": "array", "items": {
                    "type": "object", "required": ["index", field, "finish_reason"],
                    "properties": {"index": integer, field: schema, "logprobs": logprobs,
                                   "finish_reason": {"enum": ["stop", "length", "tool_calls"]}}}}}}
