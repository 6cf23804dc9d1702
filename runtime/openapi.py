"""The OpenAPI 3.1 description of `llmc serve`'s routes (served at `GET /openapi.json`).

Written by hand to match what `llmc.runtime.server` accepts (`llmc.runtime.api_requests`) and
answers: request bodies take no other fields, OpenAI fields llmc does not implement only at
their neutral values, and every refusal is OpenAI's error body. Fuzzers (schemathesis) generate requests from it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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


def openapi_schema(model: str, limits: Limits) -> dict:
    """The schema for a server of `model` under `limits`."""
    integer = {"type": "integer"}
    common = {
        "model": _nullable({"type": "string", "description": f"'{model}' (or omitted)"}),
        "temperature": _nullable({"type": "number", "minimum": 0}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": 0, "description": "0: no limit"}),
        "seed": _nullable(integer),
        "max_tokens": _nullable({"type": "integer", "minimum": 1}),
        "stop": _nullable({"anyOf": [{"type": "string", "minLength": 1},
                                     {"type": "array", "maxItems": 4, "items": {"type": "string", "minLength": 1}}]}),
        "n": _nullable({"type": "integer", "const": 1}),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "additionalProperties": False,
                                     "properties": {"include_usage": {"type": "boolean"}},
                                     "description": "only with \"stream\": true"}),
        "user": {},
        # OpenAI's fields that llmc does not implement, at their neutral values only
        "frequency_penalty": _nullable({"const": 0}),
        "presence_penalty": _nullable({"const": 0}),
        "logit_bias": _nullable({"type": "object", "maxProperties": 0}),
        "logprobs": _nullable({"const": False}),
        "top_logprobs": _nullable({"const": 0}),
        "echo": _nullable({"const": False}),
        "best_of": _nullable({"type": "integer", "const": 1}),
        "suffix": {"type": "null"},
        "tools": _nullable({"type": "array", "maxItems": 0}),
        "tool_choice": _nullable({"const": "none"}),
        "parallel_tool_calls": _nullable({"type": "boolean"}),
        "response_format": _nullable({"type": "object", "properties": {"type": {"const": "text"}},
                                      "required": ["type"], "additionalProperties": False}),
    }
    text = {"type": "string", "maxLength": limits.max_chars}
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
                 "description": "token ids"}]}}},
        "Message": {
            "type": "object", "required": ["role", "content"], "additionalProperties": False,
            "properties": {
                "role": {"enum": ["system", "user", "assistant"]},
                "content": {"anyOf": [text, {"type": "array", "items": {
                    "type": "object", "required": ["type", "text"], "additionalProperties": False,
                    "properties": {"type": {"const": "text"}, "text": text}}}]},
                "name": _nullable({"type": "string"})}},
        "ChatCompletionRequest": {
            "type": "object", "required": ["messages"], "additionalProperties": False,
            "properties": {**common, "max_completion_tokens": _nullable({"type": "integer", "minimum": 1}),
                           "messages": {"type": "array", "minItems": 1, "maxItems": limits.max_messages,
                                        "items": _ref("Message")}}},
        "Usage": {"type": "object", "required": ["prompt_tokens", "completion_tokens", "total_tokens"],
                  "properties": {k: integer for k in ("prompt_tokens", "completion_tokens", "total_tokens")}},
        "Completion": _answer("text_completion", "text", {"type": "string"}),
        "ChatCompletion": _answer("chat.completion", "message", {
            "type": "object", "required": ["role", "content"],
            "properties": {"role": {"const": "assistant"}, "content": {"type": "string"}}}),
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
        },
        "components": {"schemas": schemas},
    }


def _answer(kind: str, field: str, schema: dict) -> dict:
    """A whole (not streamed) answer of `kind` whose choices each hold `field` (the text, or the message)."""
    integer = {"type": "integer"}
    return {"type": "object", "required": ["id", "object", "created", "model", "choices", "usage"],
            "properties": {
                "id": {"type": "string"}, "object": {"const": kind}, "created": integer,
                "model": {"type": "string"}, "usage": _ref("Usage"),
                "choices": {"type": "array", "items": {
                    "type": "object", "required": ["index", field, "finish_reason"],
                    "properties": {"index": integer, field: schema, "logprobs": {"type": "null"},
                                   "finish_reason": {"enum": ["stop", "length"]}}}}}}
