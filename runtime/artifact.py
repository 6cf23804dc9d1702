"""A compiled artifact on disk: its manifest, checked before anything is loaded.

```
manifest.json    schema version, model facts, entry points, KV layout, weights table,
                 tokenizer facts, sha256 of every file
weights.bin      packed weights, each aligned to 64 bytes, mmap-able
kernels.so       the CPU code: one exported function per entry point
tokenizer.json   for the `tokenizers` library
```
Only numpy and the standard library here: the runtime must work where the compiler
stack is not installed.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from llmc.errors import LlmcError

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
ENTRY_POINTS = ("prefill", "prefill_kv", "decode")


class ArtifactError(LlmcError):
    """An artifact that is missing, of an unknown schema, or not what its manifest says."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass(frozen=True)
class Manifest:
    """The parsed `manifest.json` of an artifact directory."""

    directory: Path
    data: dict

    @property
    def target(self) -> str:
        return self.data["target"]

    @property
    def entry_points(self) -> dict[str, dict]:
        return self.data["entry_points"]

    @property
    def kv_cache(self) -> dict:
        return self.data["kv_cache"]

    @property
    def tokenizer(self) -> dict:
        return self.data["tokenizer"]

    @property
    def model(self) -> dict:
        return self.data["model"]

    def file(self, role: str) -> Path:
        return self.directory / self.data["files"][role]["path"]


def load_manifest(directory: Path, check_files: bool = True) -> Manifest:
    """Read and check `manifest.json`; with `check_files`, every file's size and sha256 too."""
    path = directory / MANIFEST
    if not path.is_file():
        raise ArtifactError(f"{directory}: not an llmc artifact (no {MANIFEST}); build one with 'llmc compile'")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ArtifactError(f"{path}: unreadable manifest: {e}") from e
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        version = data.get("schema_version") if isinstance(data, dict) else None
        raise ArtifactError(f"{path}: schema version {version!r} is not {SCHEMA_VERSION}; recompile with this llmc")
    manifest = Manifest(directory, data)
    if check_files:
        for role, entry in data["files"].items():
            file = directory / entry["path"]
            if file.resolve().parent != directory.resolve():
                raise ArtifactError(f"{path}: file '{entry['path']}' is outside the artifact directory")
            if not file.is_file():
                raise ArtifactError(f"{directory}: {role} file '{entry['path']}' is missing")
            if file.stat().st_size != entry["bytes"] or sha256_file(file) != entry["sha256"]:
                raise ArtifactError(f"{file}: contents do not match the manifest (modified or truncated); recompile")
    return manifest
