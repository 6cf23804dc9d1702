"""The chat-template renderer: the bytes as a template and the messages it renders.

Layout (UTF-8, undecodable bytes kept as lone surrogates, as JSON can carry them):
`TEMPLATE \\0 ROLE \\0 CONTENT \\0 ROLE \\0 CONTENT ...`; an odd number of fields after the
template renders without the generation prompt.
"""

from __future__ import annotations

from fuzz.common import outcome, tiny_tokenizer
from llmc.runtime.codec import TextCodec


def parse(data: bytes) -> tuple[str, list[dict[str, str]], bool]:
    """The template, the messages and `add_generation_prompt` that `data` spells."""
    template, *fields = data.decode("utf-8", "surrogateescape").split("\0")
    messages = [{"role": role, "content": content} for role, content in zip(fields[::2], fields[1::2])]
    return template, messages, len(fields) % 2 == 0


def encode(template: str, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> bytes:
    """The input `parse` reads back as these (a seed)."""
    fields = [template, *(x for m in messages for x in (m["role"], m["content"]))]
    return "\0".join(fields + ([] if add_generation_prompt else [""])).encode("utf-8", "surrogateescape")


def check(data: bytes) -> None:
    template, messages, generation_prompt = parse(data)
    codec = TextCodec(tiny_tokenizer(), bos_id=1, eos_id=2, add_bos=True, chat_template=template)
    with outcome():
        codec.render_chat(messages, add_generation_prompt=generation_prompt)
