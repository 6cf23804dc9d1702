"""The `package` phase: write the artifact directory the runtime loads (after codegen).

The weight file holds every weight the entry points read, in the storage type and
layout its `!tgt.weight` type names (`quantize` chose the type, `pack` the layout),
each at a 64-byte aligned offset; the offsets are decided before code generation so
kernels can address weights as constant offsets from one base pointer. The manifest
records each weight's storage and layout, what the runtime needs, and the sha256 of
every file (see `llmc.runtime.artifact`).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from xdsl.dialects.builtin import IntegerAttr, ModuleOp

from llmc import __version__
from llmc.backends.cpu.codegen import READ_PROBE, entry_arguments, entry_symbol
from llmc.errors import UsageError
from llmc.frontend.model import Model
from llmc.ir import entry_functions, llm, tgt
from llmc.ir.formats import QuantizedTensor
from llmc.ir.layouts import Layout, align, pack
from llmc.runtime.artifact import MANIFEST, SCHEMA_VERSION, sha256_file


@dataclass(frozen=True)
class WeightLayout:
    """Where each weight lives in `weights.bin`: `{name: (offset, type)}`, and the file size."""

    entries: dict[str, tuple[int, tgt.WeightType]]
    size: int

    @property
    def offsets(self) -> dict[str, int]:
        return {name: offset for name, (offset, _) in self.entries.items()}


def weight_layout(module: ModuleOp) -> WeightLayout:
    """Every `tgt.weight` of every entry point, once, in first-use order."""
    entries: dict[str, tuple[int, tgt.WeightType]] = {}
    size = 0
    for op in module.walk():
        if isinstance(op, tgt.WeightOp):
            if op.sym_name in entries:
                if entries[op.sym_name][1] != op.weight_type:
                    raise UsageError(f"weight @{op.sym_name} is used as {entries[op.sym_name][1]} and "
                                     f"{op.weight_type}; one artifact stores one of them")
                continue
            entries[op.sym_name] = (size, op.weight_type)
            size += align(op.weight_type.nbytes)
    return WeightLayout(entries, size)


def weight_bytes(encoded: np.ndarray | QuantizedTensor, weight_type: tgt.WeightType) -> bytes:
    """A weight's bytes in the artifact: `Weight.encode`'s result in the type's layout."""
    if isinstance(encoded, QuantizedTensor):  # integer formats: in the layout `pack` chose
        assert weight_type.layout is not Layout.STORED, f"{weight_type} is not packed"
        return pack(encoded, weight_type.layout).tobytes()
    return np.ascontiguousarray(encoded).tobytes()  # float formats, little-endian as the kernels read them


def write_weights(model: Model, layout: WeightLayout, path: Path) -> None:
    """Each weight in its storage type and layout, at its offset."""
    with open(path, "wb") as f:
        for name, (offset, weight_type) in layout.entries.items():
            data = weight_bytes(model.weights.encode(name, weight_type.storage), weight_type)
            assert len(data) == weight_type.nbytes, (name, len(data), weight_type.nbytes)
            f.seek(offset)
            f.write(data)
        f.truncate(layout.size)


def _file_entry(path: Path) -> dict:
    return {"path": path.name, "bytes": path.stat().st_size, "sha256": sha256_file(path)}


def _int(attr: object) -> int:
    assert isinstance(attr, IntegerAttr)
    return attr.value.data


def cpu_manifest(module: ModuleOp, kernels: Path) -> tuple[dict, dict[str, dict]]:
    """The CPU parts of a manifest: the target facts, and each entry point's exported symbol."""
    target = module.attributes[tgt.TARGET]
    assert isinstance(target, tgt.TargetAttr)
    entries = {stage: {"symbol": entry_symbol(stage), "arguments": entry_arguments(function)}
               for stage, function in entry_functions(module).items()}
    facts = {"target": "cpu", "cpu": {"name": target.cpu.data, "features": sorted(target.features)},
             "max_threads": tgt.MAX_THREADS, "read_probe": READ_PROBE, "files": {"kernels": kernels}}
    return facts, entries


def write_artifact(directory: Path, module: ModuleOp, model: Model, target_facts: dict, entries: dict[str, dict],
                   layout: WeightLayout, compile_options: dict) -> Path:
    """Complete `directory` (which already holds the kernels and `weights.bin`) with tokenizer and manifest.

    `target_facts` is the target's part of the manifest (`cpu_manifest`, or the CUDA
    backend's), with `files`: the kernel files by role; `entries` each entry point's
    target part (a symbol, or a launch plan)."""
    tokenizer = model.tokenizer
    (directory / "tokenizer.json").write_text(tokenizer.tokenizer.to_str())
    entry_points = {}
    kv: dict = {}
    for stage, function in entry_functions(module).items():
        args = {arg.name_hint: arg for arg in function.body.block.args}  # passes.lower.ENTRY_ARGUMENTS
        tokens, k_cache, logits = args["tokens"], args["k_cache"], args["logits"]
        kv_layout, shape = function.attributes["tgt.kv_layout"].data, list(tgt.dims(k_cache))
        kv = {"layout": kv_layout, "shape": shape, "dtype": llm.kv_type_name(k_cache.type.element_type),
              "slots": shape[1] if kv_layout == tgt.KV_LAYOUT_SLOTS else 1, "capacity": shape[-2],
              "tensors": ["keys", "values"]}
        entry_points[stage] = {
            **entries[stage],
            "max_tokens": tgt.dims(tokens)[0],
            "arena_bytes": _int(function.attributes["tgt.arena_bytes"]),
            "logits": list(tgt.dims(logits)),
        }
    c = model.config
    facts = dict(target_facts)
    kernel_files = facts.pop("files")
    manifest = {
        "schema_version": SCHEMA_VERSION,
        "llmc_version": __version__,
        **facts,
        "model": {
            "source": model.source.name, "source_path": str(model.source.resolve()),  # (for `llmc bench --vs`)
            "arch": c.arch, "layers": c.layers, "hidden": c.hidden, "heads": c.heads, "kv_heads": c.kv_heads,
            "head_dim": c.head_dim, "vocab_size": c.vocab_size, "context_length": c.context_length,
        },
        "compile_options": compile_options,
        "entry_points": entry_points,
        "kv_cache": kv,
        "weights": {
            name: {"offset": o, "bytes": t.nbytes, "shape": list(t.shape), "storage": t.storage.value,
                   "layout": t.layout.value}
            for name, (o, t) in layout.entries.items()
        },
        "tokenizer": {
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "add_bos": tokenizer.add_bos,
            "chat_template": tokenizer.chat_template,
        },
        "files": {
            "weights": _file_entry(directory / "weights.bin"),
            **{role: _file_entry(path) for role, path in kernel_files.items()},
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
