"""The `.pt2` loader: the bytes as a saved torch.export program (a valid tokenizer.json beside it),
loaded without pickles and imported to `llm` IR."""

from __future__ import annotations

from fuzz.common import exercise, outcome, place, tiny_tokenizer
from llmc.frontend import import_model, load_model


def check(data: bytes) -> None:
    place("pt2_file", "tokenizer.json", tiny_tokenizer().to_str().encode())
    path = place("pt2_file", "model.pt2", data)
    with outcome():
        model = load_model(str(path))
        import_model(model)
        exercise(model.tokenizer)
