"""The tokenizer builder from GGUF metadata: the bytes as a (vocabulary-only) `.gguf` file, as
`llmc tokenize` reads it."""

from __future__ import annotations

from fuzz.common import exercise, outcome, place
from llmc.frontend import load_tokenizer


def check(data: bytes) -> None:
    path = place("gguf_vocab", "vocab.gguf", data)
    with outcome():
        exercise(load_tokenizer(str(path)))
