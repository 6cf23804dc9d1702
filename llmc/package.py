"""The `package` phase: write the artifact directory the runtime loads (after codegen).

The weight file holds every weight the entry points read, each at a 64-byte aligned
offset; the layout is decided before code generation so kernels can address weights as
constant offsets from one base pointer. The manifest records what the runtime needs and
the sha256 of every file (see `llmc.runtime.artifact`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, ModuleOp, StringAttr

from llmc import __version__
from llmc.errors import UsageError
from llmc.frontend.model import Model
from llmc.ir import tgt
from llmc.runtime.artifact import MANIFEST, SCHEMA_VERSION, sha256_file

ALIGN = 64


@dataclass(frozen=True)
class WeightLayout:
    """Where each weight lives in `weights.bin`: `{name: (offset, shape)}`, and the file size."""

    entries: dict[str, tuple[int, tuple[int, ...]]]
    size: int

    @property
    def offsets(self) -> dict[str, int]:
        return {name: offset for name, (offset, _) in self.entries.items()}


def weight_layout(module: ModuleOp) -> WeightLayout:
    """Every `tgt.weight` of every entry point, once, in first-use order."""
    entries: dict[str, tuple[int, tuple[int, ...]]] = {}
    size = 0
    for op in module.walk():
        if isinstance(op, tgt.WeightOp) and op.sym_name not in entries:
            shape = tgt.dims(op.result)
            entries[op.sym_name] = (size, shape)
            size += -(-4 * int(np.prod(shape)) // ALIGN) * ALIGN
    return WeightLayout(entries, size)


def write_weights(model: Model, layout: WeightLayout, path: Path) -> None:
    """Dequantize each weight to f32 and write it at its offset."""
    with open(path, "wb") as f:
        for name, (offset, shape) in layout.entries.items():
            f.seek(offset)
            f.write(np.ascontiguousarray(model.weights[name].to_f32(), dtype="<f4").reshape(shape).tobytes())
        f.truncate(layout.size)


def _file_entry(path: Path) -> dict:
    return {"path": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _int(attr: object) -> int:
    assert isinstance(attr, IntegerAttr)
    return attr.value.data


def write_artifact(directory: Path, module: ModuleOp, model: Model, kernels: Path, target: str,
                   layout: WeightLayout, compile_options: dict) -> Path:
    """Complete `directory` (which already holds `kernels` and `weights.bin`) with tokenizer and manifest."""
    tokenizer = model.tokenizer
    (directory / "tokenizer.json").write_text(tokenizer.tokenizer.to_str())
    entry_points = {}
    kv_shape = None
    for function in module.ops:
        if not isinstance(function, func.FuncOp):
            continue
        stage = function.attributes["llm.stage"]
        assert isinstance(stage, StringAttr)
        tokens, _, _, k_cache, _, logits = function.body.block.args
        kv_shape = list(tgt.dims(k_cache))
        entry_points[stage.data] = {
            "symbol": f"llmc_{stage.data}",
            "max_tokens": tgt.dims(tokens)[0],
            "arena_bytes": _int(function.attributes["tgt.arena_bytes"]),
            "logits": list(tgt.dims(logits)),
        }
    c = model.config
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "llmc_version": __version__,
        "target": target,
        "model": {
            "source": model.source.name, "arch": c.arch, "layers": c.layers, "hidden": c.hidden, "heads": c.heads,
            "kv_heads": c.kv_heads, "head_dim": c.head_dim, "vocab_size": c.vocab_size,
            "context_length": c.context_length,
        },
        "compile_options": compile_options,
        "entry_points": entry_points,
        "kv_cache": {"layout": tgt.KV_LAYOUT, "shape": kv_shape, "dtype": "f32", "tensors": ["keys", "values"]},
        "weights": {name: {"offset": o, "shape": list(s), "storage": "f32"} for name, (o, s) in layout.entries.items()},
        "tokenizer": {
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "add_bos": tokenizer.add_bos,
            "chat_template": tokenizer.chat_template,
        },
        "files": {
            "weights": _file_entry(directory / "weights.bin"),
            "kernels": _file_entry(kernels),
            "tokenizer": _file_entry(directory / "tokenizer.json"),
        },
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return directory


def content_name(stem: str, data: bytes, suffix: str) -> str:
    """A file name unique to its content (ctypes returns a cached library for a seen path)."""
    return f"{stem}-{hashlib.sha256(data).hexdigest()[:16]}{suffix}"


def check_output_directory(directory: Path) -> None:
    """Refuse an output path that is a file, or a non-empty directory that is not an artifact."""
    if directory.exists():
        if not directory.is_dir():
            raise UsageError(f"{directory} exists and is not a directory; choose another -o")
        if any(directory.iterdir()) and not (directory / MANIFEST).exists():
            raise UsageError(f"{directory} is not empty and holds no llmc artifact; choose another -o")


def clear_directory(directory: Path) -> None:
    """Make `directory` empty; only a previous artifact is ever deleted."""
    check_output_directory(directory)
    if directory.exists():
        for entry in directory.iterdir():
            shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
    directory.mkdir(parents=True, exist_ok=True)
