"""The GGUF reader and import: the bytes as a `.gguf` model, read up to its config and tokenizer."""

from __future__ import annotations

from fuzz.common import exercise, outcome, place
from llmc.frontend import load_model


def check(data: bytes) -> None:
    path = place("gguf_file", "model.gguf", data)
    with outcome():
        exercise(load_model(str(path)).tokenizer)
