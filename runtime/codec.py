"""Text ↔ token ids: a `tokenizers.Tokenizer` with the special ids and chat template.

One class for both sides: the frontends build it from a model file, the runtime loads
it from an artifact (`TextCodec.from_artifact`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from jinja2 import TemplateError
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

    def text_stream(self) -> TextStream:
        """An incremental decoder for one sequence of tokens (see `TextStream`)."""
        return TextStream(self)

    def decode_stream(self, tokens: Iterable[int]) -> Iterator[str]:
        """The text of `tokens` piece by piece, as soon as it is complete UTF-8 (see `TextStream`)."""
        stream = self.text_stream()
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
        files); `add_generation_prompt` ends it where the assistant's reply begins."""
        if not self.chat_template:
            raise LlmcError("this model has no chat template; run without --chat")
        special = lambda i: self.tokenizer.id_to_token(i) if i is not None else ""  # noqa: E731
        try:
            return self._template().render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=special(self.bos_id), eos_token=special(self.eos_id),
            )
        except TemplateError as e:
            raise LlmcError(f"the model's chat template failed: {e}") from e

    def _template(self):
        """The compiled chat template (compiled once per template text)."""
        if self._compiled is None or self._compiled[0] != self.chat_template:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_exception  # as transformers' templates expect
            self._compiled = (self.chat_template, env.from_string(self.chat_template))
        return self._compiled[1]


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


class TextStream:
    """Incremental decoding of one sequence of tokens: `push(token)` returns the text that
    token completes ('' while a UTF-8 character is still incomplete), `flush()` whatever is
    left at the end (an incomplete character as U+FFFD).

    Each step decodes only the last few tokens (a little context before the new ones keeps
    word boundaries right), so a long generation costs linear time.
    """

    def __init__(self, codec: TextCodec):
        self.codec = codec
        self.window: list[int] = []  # context tokens, then tokens not yet shown
        self.shown = 0  # how many of `window` are already written

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
