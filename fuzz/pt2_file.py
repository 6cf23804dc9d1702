"""The `.pt2` loader: the bytes as a saved torch.export program (a valid tokenizer.json beside it),
loaded without pickles and imported to `llm` IR."""

from __future__ import annotations

from fuzz.common import import_graph_file


def check(data: bytes) -> None:
    import_graph_file("pt2_file", "model.pt2", data)
