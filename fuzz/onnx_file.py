"""The ONNX loader: the bytes as a `.onnx` graph (a valid tokenizer.json beside it), imported to `llm` IR."""

from __future__ import annotations

from fuzz.common import exercise, outcome, place, tiny_tokenizer
from llmc.frontend import import_model, load_model


def check(data: bytes) -> None:
    place("onnx_file", "tokenizer.json", tiny_tokenizer().to_str().encode())
    path = place("onnx_file", "model.onnx", data)
    with outcome():
        model = load_model(str(path))
        import_model(model)
        exercise(model.tokenizer)
