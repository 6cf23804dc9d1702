"""Text ↔ token ids: a `tokenizers.Tokenizer` with the special ids and chat template.

One class for both sides: the frontends build it from a model file, the runtime loads
it from an artifact (`TextCodec.from_artifact`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

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

    @classmethod
    def from_artifact(cls, manifest: Manifest) -> TextCodec:
        facts = manifest.tokenizer
        tokenizer = Tokenizer.from_file(str(manifest.file("tokenizer")))
        return cls(tokenizer, facts.get("bos_id"), facts.get("eos_id"), facts.get("add_bos", False),
                   facts.get("chat_template"))

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def decode_stream(self, tokens: Iterable[int]) -> Iterator[str]:
        """The text of `tokens` piece by piece, as soon as it is complete UTF-8.

        Each step decodes only the last few tokens (a little context before the new ones
        keeps word boundaries right), so a long generation costs linear time.
        """
        window: list[int] = []  # context tokens, then tokens not yet shown
        shown = 0  # how many of `window` are already written
        for token in tokens:
            window.append(token)
            before, after = self.decode(window[:shown]), self.decode(window)
            if len(after) > len(before) and not after.endswith("\ufffd"):
                yield after[len(before):]
                window, shown = window[-4:], min(4, len(window))
        rest = self.decode(window)[len(self.decode(window[:shown])):]
        if rest:
            yield rest

    def chat(self, user_message: str) -> str:
        """The prompt text for one user turn, rendered in a sandbox (templates come from model files)."""
        if not self.chat_template:
            raise LlmcError("this model has no chat template; run without --chat")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        special = lambda i: self.tokenizer.id_to_token(i) if i is not None else ""  # noqa: E731
        try:
            return env.from_string(self.chat_template).render(
                messages=[{"role": "user", "content": user_message}], add_generation_prompt=True,
                bos_token=special(self.bos_id), eos_token=special(self.eos_id),
            )
        except TemplateError as e:
            raise LlmcError(f"the model's chat template failed: {e}") from e
