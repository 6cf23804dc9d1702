"""The tokenizer builder from a Hugging Face `tokenizer.json`: the bytes as that file."""

from __future__ import annotations

from fuzz.common import exercise, outcome, place
from llmc.frontend import load_tokenizer


def check(data: bytes) -> None:
    path = place("tokenizer_json", "tokenizer.json", data)
    with outcome():
        exercise(load_tokenizer(str(path.parent)))
