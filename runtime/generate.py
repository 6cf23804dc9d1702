"""Text in, text out: tokenize, run the session, sample, detokenize as tokens arrive."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from llmc.errors import LlmcError
from llmc.runtime.sampling import Sampler, SamplingOptions
from llmc.runtime.session import CapacityError, Session


@dataclass
class TextCodec:
    """The artifact's tokenizer and its special tokens."""

    tokenizer: Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None

    @classmethod
    def for_session(cls, session: Session) -> TextCodec:
        facts = session.manifest.tokenizer
        tokenizer = Tokenizer.from_file(str(session.manifest.file("tokenizer")))
        return cls(tokenizer, facts.get("bos_id"), facts.get("eos_id"), facts.get("add_bos", False),
                   facts.get("chat_template"))

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if self.add_bos and self.bos_id is not None else ids

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


def generate(session: Session, codec: TextCodec, prompt_ids: list[int], max_tokens: int,
             sampling: SamplingOptions) -> Iterator[int]:
    """Yield up to `max_tokens` new token ids, stopping after EOS (not yielded) or at capacity."""
    sampler = Sampler(sampling)
    if len(prompt_ids) >= session.capacity:
        raise CapacityError(f"the prompt has {len(prompt_ids)} tokens; the KV cache holds {session.capacity}")
    session.reset()
    logits = session.feed(prompt_ids)
    for _ in range(max_tokens):
        token = sampler(logits)
        if token == codec.eos_id:
            return
        yield token
        if session.position >= session.capacity:
            return
        logits = session.feed([token])


def stream_text(codec: TextCodec, tokens: Iterator[int], write: Callable[[str], None]) -> list[int]:
    """Write the text of `tokens` as it becomes complete UTF-8; returns the tokens."""
    out: list[int] = []
    shown = 0
    for token in tokens:
        out.append(token)
        text = codec.tokenizer.decode(out, skip_special_tokens=False)
        if not text.endswith("\ufffd"):
            write(text[shown:])
            shown = len(text)
    text = codec.tokenizer.decode(out, skip_special_tokens=False)
    write(text[shown:])
    return out
