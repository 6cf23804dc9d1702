"""The ONNX loader: the bytes as a `.onnx` graph (a valid tokenizer.json beside it), imported to `llm` IR."""

from __future__ import annotations

from fuzz.common import import_graph_file


def check(data: bytes) -> None:
    import_graph_file("onnx_file", "model.onnx", data)
