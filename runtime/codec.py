"""Text ↔ token ids: a `tokenizers.Tokenizer` with the special ids and chat template.

One class for both sides: the frontends build it from a model file, the runtime loads
it from an artifact (`TextCodec.from_artifact`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from llmc.errors import LlmcError
from llmc.runtime.artifact import Manifest


@dataclass
class TextCodec:
    tokenizer: Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    _compiled: tuple[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_artifact(cls, manifest: Manifest) -> TextCodec:
        facts = manifest.tokenizer
        tokenizer = Tokenizer.from_file(str(manifest.file("tokenizer")))
        return cls(tokenizer, facts.get("bos_id"), facts.get("eos_id"), facts.get("add_bos", False),
                   facts.get("chat_template"))

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """The text's ids, after the beginning-of-text token where the model adds one (and `bos`)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if bos and self.add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def piece(self, token: int) -> str:
        """The text `token` adds after other text (llama.cpp's token piece): its decoding as the second
        of two, so a SentencePiece word's leading space, dropped at the start of a text, stays."""
        return self.decode([token, token])[len(self.decode([token])):]

    def text_stream(self, context: Sequence[int] = ()) -> TextStream:
        """An incremental decoder for the tokens that follow `context` (the prompt; see `TextStream`)."""
        return TextStream(self, context)

    def decode_stream(self, tokens: Iterable[int], context: Sequence[int] = ()) -> Iterator[str]:
        """The text of `tokens` after `context` piece by piece, as soon as it is complete UTF-8
        (see `TextStream`)."""
        stream = self.text_stream(context)
        for token in tokens:
            piece = stream.push(token)
            if piece:
                yield piece
        rest = stream.flush()
        if rest:
            yield rest

    def chat(self, user_message: str) -> str:
        """The prompt text for one user turn (`render_chat` of that one message)."""
        return self.render_chat([{"role": "user", "content": user_message}])

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text of a conversation (`messages` of "role" and "content", oldest first),
        rendered with the model's chat template in jinja2's sandbox (templates come from model
        files) as transformers' `apply_chat_template` renders it; `add_generation_prompt` ends it
        where the assistant's reply begins."""
        if not self.chat_template:
            raise LlmcError("this model has no chat template; run without --chat")
        # as transformers: no tools or documents, and only the special tokens the model has
        special = {f"{name}_token": self.tokenizer.id_to_token(i)
                   for name, i in (("bos", self.bos_id), ("eos", self.eos_id)) if i is not None}
        try:
            return self._template().render(messages=messages, tools=None, documents=None,
                                           add_generation_prompt=add_generation_prompt, **special)
        except TemplateError as e:
            raise LlmcError(f"the model's chat template failed: {e}") from e

    def _template(self):
        """The compiled chat template (compiled once per template text)."""
        if self._compiled is None or self._compiled[0] != self.chat_template:
            self._compiled = (self.chat_template, _chat_environment().from_string(self.chat_template))
        return self._compiled[1]


def _chat_environment() -> ImmutableSandboxedEnvironment:
    """jinja2's sandbox with what transformers' chat templates expect: blocks trimmed, loop
    controls (`break`, `continue`), `{% generation %}`, transformers' `tojson`, and the
    globals `raise_exception` and `strftime_now`."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _Generation])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: plain `json.dumps`, non-ASCII kept (jinja2's own escapes HTML
    characters and sorts keys)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Generation(Extension):
    """`{% generation %}…{% endgeneration %}`, which transformers' templates use to mark the
    assistant's text for training masks: renders its body, in a scope of its own."""

    tags = {"generation"}

    def parse(self, parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


class TextStream:
    """Incremental decoding of one sequence of tokens: `push(token)` returns the text that
    token completes ('' while a UTF-8 character is still incomplete), `flush()` whatever is
    left at the end (an incomplete character as U+FFFD).

    Each step decodes only the last few tokens (a little context before the new ones keeps
    word boundaries right), so a long generation costs linear time. The stream starts after
    the end of `context` (the prompt): a SentencePiece vocabulary's word-initial space on the
    first new token is text then, not the start of the sequence that decoding drops.
    """

    def __init__(self, codec: TextCodec, context: Sequence[int] = ()):
        self.codec = codec
        self.window: list[int] = list(context[-4:])  # context tokens, then tokens not yet shown
        if codec.decode(self.window).endswith("\ufffd"):  # a prompt ending inside a character: start fresh
            self.window = []
        self.shown = len(self.window)  # how many of `window` are already written

    def push(self, token: int) -> str:
        self.window.append(token)
        decode = self.codec.decode
        before, after = decode(self.window[: self.shown]), decode(self.window)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.window, self.shown = self.window[-4:], min(4, len(self.window))
            return after[len(before):]
        return ""

    def flush(self) -> str:
        decode = self.codec.decode
        rest = decode(self.window)[len(decode(self.window[: self.shown])):]
        self.window, self.shown = self.window[-4:], min(4, len(self.window))
        return rest
