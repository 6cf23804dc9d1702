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
import os
import shutil
import tempfile
import uuid
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from xdsl.dialects.builtin import IntegerAttr, ModuleOp

from llmc import __version__
from llmc.abi import KV_LAYOUT_SLOTS
from llmc.errors import UsageError, printable
from llmc.frontend.model import Model
from llmc.ir import entry_functions, llm, tgt
from llmc.ir.formats import QuantizedTensor
from llmc.ir.layouts import Layout, align, pack
from llmc.runtime.artifact import MANIFEST, SCHEMA_VERSION, artifact_files, enclosing_artifact, sha256_file
from llmc.textfile import at_or_inside

PACK_THREADS = 4  # threads encoding and packing the weights as `write_weights` writes them …
PACK_AHEAD_BYTES = 512 << 20  # … holding up to this many packed bytes (or one weight) not yet written


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


def weight_bytes(encoded: np.ndarray | QuantizedTensor, weight_type: tgt.WeightType) -> np.ndarray:
    """A weight's bytes in the artifact (a contiguous array): `Weight.encode`'s result in the type's layout."""
    if isinstance(encoded, QuantizedTensor):  # integer formats: in the layout `pack` chose
        assert weight_type.layout is not Layout.STORED, f"{weight_type} is not packed"
        return pack(encoded, weight_type.layout)
    return np.ascontiguousarray(encoded)  # float formats, little-endian as the kernels read them


def write_weights(model: Model, layout: WeightLayout, path: Path) -> str:
    """Each weight in its storage type and layout, at its offset, written in order from its array (not
    copied); the sha256 of the file, taken as it is written. The weights are encoded and packed on up to
    `PACK_THREADS` cores (numpy lets go of the GIL), up to `PACK_AHEAD_BYTES` of them ahead of the one being
    written."""
    digest = hashlib.sha256()

    def packed(name: str, weight_type: tgt.WeightType) -> np.ndarray:
        data = weight_bytes(model.weights.encode(name, weight_type.storage), weight_type)
        assert data.nbytes == weight_type.nbytes, (name, data.nbytes, weight_type.nbytes)
        return data

    with open(path, "wb") as f, ThreadPoolExecutor(max(1, min(PACK_THREADS, os.cpu_count() or 1))) as pool:

        def put(data) -> None:
            digest.update(data)
            f.write(data)

        ahead: deque[tuple[int, int, Future]] = deque()  # (offset, bytes, packing) of the weights in flight

        def write_oldest() -> None:
            offset, _, data = ahead.popleft()
            put(bytes(offset - f.tell()))  # (the alignment before it)
            put(memoryview(data.result()).cast("B"))

        for name, (offset, weight_type) in layout.entries.items():
            while ahead and sum(n for _, n, _ in ahead) + weight_type.nbytes > PACK_AHEAD_BYTES:
                write_oldest()
            ahead.append((offset, weight_type.nbytes, pool.submit(packed, name, weight_type)))
        while ahead:
            write_oldest()
        put(bytes(layout.size - f.tell()))
    return digest.hexdigest()


def _file_entry(path: Path, sha256: str | None = None) -> dict:
    return {"path": path.name, "bytes": path.stat().st_size, "sha256": sha256 or sha256_file(path)}


def _int(attr: object) -> int:
    assert isinstance(attr, IntegerAttr)
    return attr.value.data


def describe(module: ModuleOp, layout: WeightLayout, target_facts: dict, entries: dict[str, dict]) -> dict:
    """What the kernels are compiled for, in the manifest's own fields: the target's facts
    (`backends/cpu/codegen.py`'s `cpu_facts`, or the CUDA backend's), each entry point (its target part from `entries`: a
    symbol and arguments, or a launch plan; rows, arena bytes, logits), the KV cache, where each
    weight is and the size of `weights.bin`. The kernels embed it and the runtime checks the manifest against it
    (`llmc.runtime.artifact.check_description`)."""
    entry_points = {}
    kv: dict = {}
    for stage, function in entry_functions(module).items():
        args = {arg.name_hint: arg for arg in function.body.block.args}  # llmc.abi.ENTRY_ARGUMENTS
        tokens, k_cache, logits = args["tokens"], args["k_cache"], args["logits"]
        kv_layout, shape = function.attributes["tgt.kv_layout"].data, list(tgt.dims(k_cache))
        kv = {"layout": kv_layout, "shape": shape, "dtype": llm.kv_type_name(k_cache.type.element_type),
              "slots": shape[1] if kv_layout == KV_LAYOUT_SLOTS else 1, "capacity": shape[-2],
              "tensors": ["keys", "values"]}
        entry_points[stage] = {
            **entries[stage],
            "max_tokens": tgt.dims(tokens)[0],
            "arena_bytes": _int(function.attributes["tgt.arena_bytes"]),
            "logits": list(tgt.dims(logits)),
        }
    weights = {name: {"offset": o, "bytes": t.nbytes, "shape": list(t.shape), "storage": t.storage.value,
                      "layout": t.layout.value}
               for name, (o, t) in layout.entries.items()}
    return {**target_facts, "entry_points": entry_points, "kv_cache": kv, "weights": weights,
            "files": {"weights": {"bytes": layout.size}}}


def write_artifact(directory: Path, description: dict, model: Model, kernel_files: dict[str, Path],
                   compile_options: dict, weights_sha256: str | None = None) -> Path:
    """Complete `directory` (which already holds the kernels and `weights.bin`) with tokenizer and manifest.

    `description` is what the kernels were compiled for (`describe`, with any further facts of
    the target); `kernel_files` the kernel files by role; `weights_sha256` that of `weights.bin` where
    known (`write_weights`)."""
    tokenizer = model.tokenizer
    (directory / "tokenizer.json").write_text(tokenizer.tokenizer.to_str())
    c = model.config
    facts = {key: value for key, value in description.items()
             if key not in ("entry_points", "kv_cache", "weights", "files")}
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
        "entry_points": description["entry_points"],
        "kv_cache": description["kv_cache"],
        "weights": description["weights"],
        "tokenizer": {
            "bos_id": tokenizer.bos_id, "eos_id": tokenizer.eos_id, "stop_ids": list(tokenizer.stop_ids),
            "add_bos": tokenizer.add_bos,
            "chat_template": tokenizer.chat_template,
        },
        "files": {
            "weights": _file_entry(directory / "weights.bin", weights_sha256),
            **{role: _file_entry(path) for role, path in kernel_files.items()},
            "tokenizer": _file_entry(directory / "tokenizer.json"),
        },
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return directory


def _foreign(directory: Path) -> str | None:
    """Why `directory` (an existing, non-empty folder) is not an llmc artifact alone, or None: an
    artifact has a manifest that says so (a schema version, llmc's version, its files by name)
    and holds nothing but the files it lists."""
    if not (directory / MANIFEST).is_file() or (directory / MANIFEST).is_symlink():
        return "is not empty and holds no llmc artifact"
    files = artifact_files(directory)
    if files is None:
        return f"holds a {MANIFEST} that is not an llmc artifact's"
    for entry in directory.iterdir():
        if entry.name != MANIFEST and (entry.name not in files or entry.is_symlink() or not entry.is_file()):
            return f"holds '{printable(entry.name)}' besides its llmc artifact"
    return None


def check_output_directory(directory: Path) -> None:
    """Refuse, before anything is compiled, an `-o` that compiling must not replace (anything but
    an empty folder or an llmc artifact alone) or could not write."""
    real = Path(os.path.realpath(directory))
    if not real.name:
        raise UsageError(f"-o {directory}: name a folder for the artifact, not the file system's root")
    for link in (directory, *directory.parents):  # (its missing folders would be made wherever the link points)
        if link.is_symlink() and not link.exists():
            raise UsageError(f"-o {directory}: {link} is a symlink to {os.readlink(link)}, which does not exist; "
                             f"create that first, or choose another -o")
    outer = enclosing_artifact(real)
    if outer is not None:
        raise UsageError(f"-o {directory} is inside the artifact {outer}, which it would spoil; choose another -o")
    if at_or_inside(os.getcwd(), real):  # (replaced, it would leave the shell in a deleted folder)
        held = not at_or_inside(real, os.getcwd())
        raise UsageError(f"-o {directory} is the current folder{' or holds it' if held else ''}; the artifact "
                         f"replaces its folder: choose another -o")
    try:
        if real.exists():
            if not real.is_dir():
                raise UsageError(f"{directory} exists and is not a directory; choose another -o")
            if any(real.iterdir()):
                why = _foreign(real)
                if why is not None:
                    raise UsageError(f"{directory} {why}; llmc compile replaces only an artifact or an empty "
                                     f"folder: choose another -o")
                if not os.access(real, os.W_OK | os.X_OK):
                    raise UsageError(f"cannot replace the artifact in {directory}: permission denied")
        ancestor = real.parent
        while not ancestor.exists() and ancestor != ancestor.parent:
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            raise UsageError(f"cannot write {directory}: {ancestor} is not a directory")
        with tempfile.TemporaryDirectory(prefix=".llmc-probe-", dir=ancestor):
            pass
    except OSError as e:
        raise UsageError(f"cannot write {directory}: {e.strerror or e}") from None


def check_outside_output(directory: Path, what: str, path: Path) -> None:
    """Refuse `path` (what the compile writes besides the artifact: `--dump-ir`'s folder, the cache) at or inside
    the artifact's `-o`, which the compile replaces with the artifact alone."""
    if at_or_inside(path, directory):
        inside = not at_or_inside(directory, path)
        raise UsageError(f"{what} is {'inside ' if inside else ''}-o {directory}, which the compile replaces "
                         f"with the artifact; choose a folder outside it")


@contextmanager
def staged_directory(directory: Path) -> Iterator[Path]:
    """An empty folder beside `directory` to write an artifact into. When the body completes it
    takes `directory`'s place (the artifact there, if any, is deleted); when the body fails or is
    interrupted it is deleted, and `directory` is left as it was."""
    directory = Path(os.path.realpath(directory))
    check_output_directory(directory)
    try:
        directory.parent.mkdir(parents=True, exist_ok=True)
        stage = directory.with_name(f".{directory.name}.{uuid.uuid4().hex[:12]}.partial")
        stage.mkdir()
    except OSError as e:
        raise UsageError(f"cannot write {directory}: {e.strerror or e}") from None
    try:
        yield stage
        _replace(directory, stage)
    finally:
        shutil.rmtree(stage, ignore_errors=True)  # (gone already once renamed)


def _replace(directory: Path, stage: Path) -> None:
    """Put `stage` in `directory`'s place: a rename, or two with the old artifact put back if the second fails."""
    check_output_directory(directory)  # (nothing of the user's appeared there meanwhile)
    try:
        if directory.is_dir() and any(directory.iterdir()):
            old = directory.with_name(f".{directory.name}.{uuid.uuid4().hex[:12]}.old")
            os.rename(directory, old)
            try:
                os.rename(stage, directory)
            except BaseException:
                os.rename(old, directory)
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(stage, directory)  # (over an empty folder, or none)
    except OSError as e:
        raise UsageError(f"cannot write {directory}: {e.strerror or e}") from None
