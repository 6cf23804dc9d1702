"""Tool calling in llama.cpp's generic format: the reply is a JSON object the grammar enforces.

With tools given (and `tool_choice` not "none"), the model's reply is constrained to

    {"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}    (the calls), or
    {"response": "It is sunny."}                                                 ("auto" only: plain text)

`ToolUse.schema()` is that JSON schema (each call's `arguments` by its function's `parameters`, their
objects `closed` to the properties they name unless they say `additionalProperties`),
`ToolUse.system_text()` describes the tools and the format to a template that never mentions
`tools` (templates that do render them natively), `history(messages)` turns OpenAI's tool
messages into ones any template renders, and `read_reply(text)` gives back OpenAI's `content`
and `tool_calls`:

    use = ToolUse([{"name": "get_weather", "parameters": {...}}], "required", parallel=False)
    read_reply('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}]}')
    # (None, [{"id": "call_…", "type": "function", "function": {"name": "get_weather", "arguments": "{…}"}}])
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolUse:
    """The functions a request offers (OpenAI's `function` objects: name, description, parameters) and which
    replies it allows: `choice` is "auto" (calls or a response), "required" (calls), or a function's name
    (calls of that function only); `parallel`: more than one call in a reply."""

    functions: tuple[dict, ...]
    choice: str
    parallel: bool = True

    def schema(self) -> dict:
        """The JSON schema of the reply. A function's parameters that refer to themselves (`$ref` "#…": their
        `$defs`, or "#" itself) are placed in the reply's `$defs` as `tool<i>`, their references moved there."""
        called = [f for f in self.functions if self.choice in ("auto", "required", f["name"])]
        defs: dict[str, dict] = {}
        calls = []
        for i, f in enumerate(called):
            arguments = closed(f.get("parameters") or ANY_OBJECT)
            moved = _moved(arguments, f"#/$defs/tool{i}")
            if moved != arguments:  # (references into the parameters: moved with them)
                defs[f"tool{i}"], arguments = moved, {"$ref": f"#/$defs/tool{i}"}
            calls.append({"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
                          "properties": {"name": {"const": f["name"]}, "arguments": arguments}})
        return {**self._reply(calls), **({"$defs": defs} if defs else {})}

    def _reply(self, calls: list[dict]) -> dict:
        """The reply's schema around the calls' schemas: the calls, or ("auto") them or a response."""
        array = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if not self.parallel:
            array["maxItems"] = 1
        tool_calls = {"type": "object", "additionalProperties": False, "required": ["tool_calls"],
                      "properties": {"tool_calls": array}}
        if self.choice != "auto":
            return tool_calls
        response = {"type": "object", "additionalProperties": False, "required": ["response"],
                    "properties": {"response": {"type": "string"}}}
        return {"anyOf": [tool_calls, response]}

    def system_text(self) -> str:
        """The tools and the reply format, told in words, for a template that does not render `tools`."""
        described = [{k: f[k] for k in ("name", "description", "parameters") if k in f} for f in self.functions]
        call = '{"tool_calls": [{"name": <a tool\'s name>, "arguments": <its arguments, as its parameters say>}]}'
        text = (f"You can call these tools:\n{json.dumps(described, ensure_ascii=False)}\n"
                f"Reply with a JSON object: {call} to call tools")
        if self.choice == "auto":
            return text + ', or {"response": <your answer>} to answer directly.'
        if self.choice != "required":
            return text + f' (call {self.choice}).'
        return text + "."


_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")  # name → schema
_SCHEMA_LISTS = ("anyOf", "allOf", "oneOf", "prefixItems")
_SCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")


def _subschemas(schema: object, change) -> object:
    """`schema` with `change` applied to each of its immediate subschemas (not to `const`, `enum` or other data)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: change(sub) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [change(sub) for sub in value]
        elif key in _SCHEMAS:
            out[key] = change(value)
    return out


def closed(schema: object) -> object:
    """`schema` with every object that names its properties taking no others, unless it says otherwise
    (`additionalProperties: false`, as OpenAI's strict mode and llama.cpp's tool grammars: a small model otherwise
    invents more): `closed({"properties": {"a": {}}})` is `{"properties": {"a": {}}, "additionalProperties": False}`."""
    schema = _subschemas(schema, closed)
    if isinstance(schema, dict) and "properties" in schema and "additionalProperties" not in schema:
        schema["additionalProperties"] = False
    return schema


def _moved(schema: object, base: str) -> object:
    """`schema`, to be placed at `base` ("#/$defs/tool0"), with its references to itself ("#", "#/$defs/x")
    moved below `base`."""
    schema = _subschemas(schema, lambda sub: _moved(sub, base))
    if isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#"):
        schema["$ref"] = base + schema["$ref"][1:]
    return schema


def with_system_text(messages: list[dict], text: str) -> list[dict]:
    """`messages` with `text` at the start of the system message (a new one first where there is none)."""
    if messages and messages[0]["role"] == "system":
        first = messages[0]
        return [{**first, "content": f"{text}\n\n{first['content']}" if first["content"] else text}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def history(messages: list[dict], tool_role: bool) -> list[dict]:
    """OpenAI's conversation with tool calls as a chat template renders it: an assistant message's calls
    become the JSON the model wrote (its content), and a "tool" message keeps its role (`tool_role`), or
    becomes a user message naming the call it answers (for templates that refuse the role)."""
    names = {}  # tool call id → the function's name
    out = []
    for message in messages:
        if message.get("tool_calls"):
            calls = message["tool_calls"]
            names.update((call["id"], call["function"]["name"]) for call in calls)
            written = [{"name": call["function"]["name"], "arguments": json.loads(call["function"]["arguments"])}
                       for call in calls]
            out.append({"role": "assistant", "content": json.dumps({"tool_calls": written}, ensure_ascii=False)})
        elif message["role"] == "tool" and not tool_role:
            call = message["tool_call_id"]
            name = names.get(call, "a tool")
            out.append({"role": "user", "content": f"The result of the tool call {call} ({name}):\n"
                                                   f"{message['content']}"})
        else:
            out.append(message)
    return out


def read_reply(text: str) -> tuple[str | None, list[dict] | None]:
    """OpenAI's `content` and `tool_calls` of a reply in the tool format; text that is not (a reply cut
    short) is content as it is."""
    try:
        reply = json.loads(text)
    except ValueError:
        return text, None
    if isinstance(reply, dict) and isinstance(reply.get("response"), str) and len(reply) == 1:
        return reply["response"], None
    calls = reply.get("tool_calls") if isinstance(reply, dict) else None
    if not (isinstance(calls, list) and calls and all(isinstance(c, dict) and isinstance(c.get("name"), str)
                                                      for c in calls)):
        return text, None
    return None, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                   "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}),
                                                                          ensure_ascii=False)}}
                  for c in calls]
