"""A compiled artifact on disk: its manifest, checked before anything is loaded.

```
manifest.json    schema version, model facts, entry points, KV layout, weights table,
                 tokenizer facts, sha256 of every file
weights.bin      packed weights, each aligned to 64 bytes, mmap-able
kernels.so       the CPU code: one exported function per entry point, and `llmc_description`
tokenizer.json   for the `tokenizers` library
```
The kernels describe themselves (what they were compiled for, in the manifest's own fields);
the runtime checks the manifest against that description before any call (`check_description`).
Only numpy and the standard library here: the runtime must work where the compiler
stack is not installed.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from llmc.abi import (
    ARGMAX_TOKEN,
    BATCH_ARGUMENTS,
    DESCRIPTION,
    ENTRY_ARGUMENTS,
    ENTRY_POINTS,
    IMPLICIT_ARGUMENTS,
    KV_DTYPES,
    KV_LAYOUT,
    KV_LAYOUT_SLOTS,
    OPTIONAL_ENTRY_POINTS,
    POINTER,
    entry_arguments,
    entry_symbol,
)
from llmc.errors import LlmcError, printable

SCHEMA_VERSION = 8  # 8: a work counter in `sync` is a word per thread (`llmc.abi.SYNC_WORDS`)
MANIFEST = "manifest.json"
# /proc/cpuinfo flag of each CPU feature a kernel may need
_CPU_FLAGS = {
    "avx2": "avx2", "fma": "fma", "f16c": "f16c", "bmi2": "bmi2", "avx512f": "avx512f", "avx512bw": "avx512bw",
    "avx512vl": "avx512vl", "avx512dq": "avx512dq", "avx512vnni": "avx512_vnni", "avxvnni": "avx_vnni",
    "avx512bf16": "avx512_bf16", "avx512fp16": "avx512_fp16", "amx-tile": "amx_tile", "amx-int8": "amx_int8",
    "amx-bf16": "amx_bf16",
}


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


_MAX_BYTES = 1 << 40
MAX_STOP_IDS = 64  # tokenizer.stop_ids: a model names a few (Llama 3: 3)


_MAX_MANIFEST_BYTES = 1 << 28


def artifact_files(directory: Path) -> set[str] | None:
    """The files the llmc manifest in `directory` lists (a schema version, llmc's version, its files by name), or
    None where `directory` holds no llmc manifest."""
    manifest = directory / MANIFEST
    try:
        if not manifest.is_file() or manifest.is_symlink() or manifest.stat().st_size > _MAX_MANIFEST_BYTES:
            return None
        data = json.loads(manifest.read_text(encoding="utf-8"))
        files = {entry["path"] for entry in data["files"].values()}
        if type(data["schema_version"]) is int and isinstance(data["llmc_version"], str) and all(
                isinstance(name, str) for name in files):
            return files
    except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        pass
    return None


def enclosing_artifact(path: Path) -> Path | None:
    """The llmc artifact folder that `path` (a file or folder to write) lies inside, if any: writing there would
    spoil it (its manifest lists what it holds)."""
    folder = Path(os.path.realpath(path)).parent
    while True:
        if artifact_files(folder) is not None:
            return folder
        if folder == folder.parent:
            return None
        folder = folder.parent


def _check_schema(path: Path, data: dict) -> None:
    """The fields the runtime uses exist and have sane types and sizes."""

    def positive_ints(value: object, count: int | None = None) -> bool:
        return (isinstance(value, list) and (count is None or len(value) == count)
                and all(type(v) is int and 0 < v < _MAX_BYTES for v in value))

    try:
        if data["target"] not in ("cpu", "cuda"):
            raise ValueError(f"unknown target {data['target']!r}")
        for role in ("weights", "kernels", "tokenizer", *data["files"]):
            entry = data["files"][role]
            if not (isinstance(entry["path"], str) and type(entry["bytes"]) is int and isinstance(entry["sha256"], str)):
                raise ValueError(f"files.{role} is malformed")
        cpu = data["target"] == "cpu"
        names = set(data["entry_points"])
        if not set(ENTRY_POINTS) <= names <= {*ENTRY_POINTS, *OPTIONAL_ENTRY_POINTS}:
            raise ValueError(f"entry points {', '.join(sorted(names))}: not {', '.join(ENTRY_POINTS)} "
                             f"(and optionally {', '.join(OPTIONAL_ENTRY_POINTS)})")
        for name in data["entry_points"]:
            entry = data["entry_points"][name]
            if cpu:
                _check_cpu_entry(name, entry)
            else:
                _check_launches(name, entry["launches"])
            rows = entry["max_tokens"] if name in ("score", "decode", "verify") else 1
            if entry["logits"] != [rows, data["model"]["vocab_size"]]:
                raise ValueError(f"entry point {name} writes logits {entry['logits']!r}, not {rows} x vocabulary")
            if not (positive_ints([entry["max_tokens"]]) and type(entry["arena_bytes"]) is int
                    and 0 <= entry["arena_bytes"] < _MAX_BYTES):
                raise ValueError(f"entry point {name} has malformed sizes")
        kv = data["kv_cache"]
        chunks = {data["entry_points"][name]["max_tokens"] for name in ("prefill", "prefill_kv", "score")}
        if len(chunks) != 1 or data["entry_points"]["decode"]["max_tokens"] != kv["slots"]:
            raise ValueError("entry points disagree on the prefill chunk (prefill, prefill_kv, score), or decode's "
                             "rows on the cache's slots")
        batched = positive_ints([kv["slots"]]) and kv["slots"] > 1
        if not (positive_ints([kv["slots"], kv["capacity"]]) and positive_ints(kv["shape"], 5 if batched else 4)
                and kv["shape"][-2] == kv["capacity"] and (not batched or kv["shape"][1] == kv["slots"])):
            raise ValueError("kv_cache.shape must be [layers, kv_heads, capacity, row] ([layers, slots, …] with "
                             "slots), matching kv_cache.capacity and kv_cache.slots")
        if kv["layout"] != (KV_LAYOUT_SLOTS if batched else KV_LAYOUT):
            raise ValueError(f"kv_cache.layout {kv['layout']!r} is not this runtime's for {kv['slots']} slots")
        for name in data["entry_points"]:
            entry = data["entry_points"][name]
            takes = ("slots" in entry["arguments"]) if cpu else any(
                a.get("argument") == "slots" for launch in entry["launches"] for a in launch["args"])
            if takes != batched:
                raise ValueError(f"entry point {name} {'takes' if takes else 'lacks'} the rows' slots, but the cache "
                                 f"holds {kv['slots']} sequences")
        if cpu and not isinstance(data["read_probe"], str):
            raise ValueError("read_probe must be a symbol name")
        if cpu and not (isinstance(data["team_jobs"], list) and all(isinstance(j, str) for j in data["team_jobs"])):
            raise ValueError("team_jobs must be a list of symbol names")
        if cpu and not positive_ints([data["max_threads"]]):
            raise ValueError("max_threads must be a positive integer")
        if kv["dtype"] not in KV_DTYPES:
            raise ValueError(f"kv_cache.dtype must be one of {', '.join(KV_DTYPES)}")
        if not positive_ints([data["model"]["vocab_size"]]):
            raise ValueError("model.vocab_size must be a positive integer")
        if not (isinstance(data["weights"], dict) and all(
                isinstance(w, dict) and positive_ints(w["shape"]) and w["shape"]
                and all(type(w[key]) is int and 0 <= w[key] < _MAX_BYTES for key in ("offset", "bytes"))
                for w in data["weights"].values())):
            raise ValueError("weights must map names to an offset, bytes and a shape each")
        tokenizer = data["tokenizer"]
        if not (isinstance(tokenizer, dict) and type(tokenizer["add_bos"]) is bool
                and all(tokenizer[key] is None or type(tokenizer[key]) is int for key in ("bos_id", "eos_id"))
                and (tokenizer["chat_template"] is None or isinstance(tokenizer["chat_template"], str))):
            raise ValueError("tokenizer must hold bos_id and eos_id (integers or null), add_bos (a boolean) and "
                             "chat_template (a string or null)")
        for key in ("bos_id", "eos_id"):
            if tokenizer[key] is not None and not 0 <= tokenizer[key] < 2**31:
                raise ValueError(f"tokenizer.{key} {tokenizer[key]} is not a token id")
        stops = tokenizer.get("stop_ids", [])  # (artifacts of earlier llmc hold none)
        if not (isinstance(stops, list) and len(stops) <= MAX_STOP_IDS
                and all(type(i) is int and 0 <= i < 2**31 for i in stops)):
            raise ValueError(f"tokenizer.stop_ids must be a list of at most {MAX_STOP_IDS} token ids")
        if tokenizer["add_bos"] and tokenizer["bos_id"] is not None and tokenizer["bos_id"] >= data["model"]["vocab_size"]:
            # (an end-of-text id past the vocabulary is harmless: it is never sampled)
            raise ValueError(f"tokenizer.bos_id {tokenizer['bos_id']}, put before every prompt, is not a token of "
                             f"the model's {data['model']['vocab_size']}")
        if cpu and not (isinstance(data["cpu"]["features"], list)
                        and all(isinstance(f, str) for f in data["cpu"]["features"])):
            raise ValueError("cpu.features must be a list of strings")
        if not cpu and not all(isinstance(arch, str) and role in data["files"]
                               for arch, role in data["gpu"]["cubins"].items()):
            raise ValueError("gpu.cubins must name files of the artifact")
        if not cpu:
            _check_launches("argmax", [data["gpu"]["argmax"]])
    except (KeyError, TypeError, ValueError) as e:
        detail = f"missing field {e}" if isinstance(e, KeyError) else str(e)
        raise ArtifactError(f"{path}: malformed manifest ({detail}); recompile") from e


def _check_cpu_entry(name: str, entry: dict) -> None:
    if entry["symbol"] != entry_symbol(name):
        raise ValueError(f"entry point {name} has symbol {entry['symbol']!r}")
    arguments = entry["arguments"]
    passed = (*entry_arguments(slots=1), *IMPLICIT_ARGUMENTS)
    if not (isinstance(arguments, list) and sorted(set(arguments) - set(BATCH_ARGUMENTS)) == sorted(passed)
            and len(set(arguments)) == len(arguments)):
        raise ValueError(f"entry point {name} takes arguments {arguments!r}; this runtime passes "
                         f"{', '.join(passed)}")


# the buffers a CUDA launch may name: the entry's own, and the argmax's token
_LAUNCH_ARGUMENTS = (*(name for name, kind in ENTRY_ARGUMENTS.items() if kind == POINTER), ARGMAX_TOKEN)
_MAX_GRID = 1 << 31


def _check_launches(name: str, launches: object) -> None:
    """A CUDA entry point's launch plan: kernels by name, sane grids and blocks, arguments by known role."""
    def dim(d: object) -> bool:
        if isinstance(d, dict):
            return set(d) == {"rows_per"} and type(d["rows_per"]) is int and 0 < d["rows_per"] < _MAX_GRID
        return type(d) is int and 0 < d < _MAX_GRID

    def argument(a: object) -> bool:
        if not isinstance(a, dict):
            return False
        if set(a) == {"n"}:
            return a["n"] is True
        if set(a) == {"count"}:
            return type(a["count"]) is int and 0 < a["count"] < _MAX_BYTES
        if set(a) in ({"arena"}, {"weights"}):
            return type(next(iter(a.values()))) is int and 0 <= next(iter(a.values())) < _MAX_BYTES
        return (set(a) == {"argument", "offset"} and a["argument"] in _LAUNCH_ARGUMENTS
                and type(a["offset"]) is int and 0 <= a["offset"] < _MAX_BYTES)

    if not isinstance(launches, list) or not launches:
        raise ValueError(f"entry point {name} has no launch plan")
    for launch in launches:
        if not (isinstance(launch["kernel"], str) and isinstance(launch["grid"], list) and len(launch["grid"]) == 3
                and all(dim(d) for d in launch["grid"]) and isinstance(launch["block"], list)
                and len(launch["block"]) == 3 and all(type(b) is int and 0 < b <= 1024 for b in launch["block"])
                and type(launch["shared_bytes"]) is int and 0 <= launch["shared_bytes"] < (1 << 20)
                and isinstance(launch["args"], list) and all(argument(a) for a in launch["args"])):
            raise ValueError(f"entry point {name} has a malformed launch of {launch.get('kernel')!r}")


def load_manifest(directory: Path | str, check_files: bool = True, verified_later: Collection[str] = ()) -> Manifest:
    """Read and check `manifest.json`: its schema, and every file inside the directory with the size
    the manifest gives; with `check_files`, every file's sha256 too, but those of the roles in
    `verified_later`, which the caller checks on the bytes it reads (`check_sha256`): each read once."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.is_file():
        if not directory.exists():
            raise ArtifactError(f"{directory}: no such artifact directory")
        if path.exists():
            raise ArtifactError(f"{path}: not a file; an llmc artifact's {MANIFEST} is the one 'llmc compile' wrote")
        if directory.is_file():
            raise ArtifactError(f"{directory}: a file; an llmc artifact is the folder 'llmc compile -o' wrote")
        raise ArtifactError(f"{directory}: not an llmc artifact (no {MANIFEST}); build one with 'llmc compile'")
    try:
        inside = path.resolve().parent == directory.resolve()
    except (OSError, RuntimeError):  # (a symlink loop)
        inside = False
    if not inside:  # (its files are named relative to the artifact: the manifest is the artifact's own, as they)
        raise ArtifactError(f"{path}: a link to a manifest outside the artifact directory; refusing to read it")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ArtifactError(f"{path}: unreadable manifest: {e}") from e
    if not isinstance(data, dict) or data.get("schema_version") != SCHEMA_VERSION:
        version = data.get("schema_version") if isinstance(data, dict) else None
        raise ArtifactError(f"{path}: schema version {version!r} is not {SCHEMA_VERSION}; recompile with this llmc")
    _check_schema(path, data)
    manifest = Manifest(directory, data)
    for role, entry in data["files"].items():
        file = directory / entry["path"]
        try:
            inside = file.resolve().parent == directory.resolve()
        except (OSError, ValueError, RuntimeError):  # (a NUL in the name, a symlink loop)
            inside = False
        if not inside:
            raise ArtifactError(f"{path}: file {entry['path']!r} is outside the artifact directory")
        if not file.is_file():
            raise ArtifactError(f"{directory}: {role} file {entry['path']!r} is missing")
        if file.stat().st_size != entry["bytes"]:
            raise ArtifactError(f"{file}: {file.stat().st_size} bytes, not the {entry['bytes']} the manifest says "
                                f"(truncated or modified); recompile")
        if check_files and role not in verified_later and sha256_file(file) != entry["sha256"]:
            raise _modified(file)
    return manifest


def check_description(manifest: Manifest, description: object, kernels: Path) -> None:
    """The manifest says what its kernels say of themselves: `description` holds fields of a
    manifest (what the kernels were compiled for: entry points, sizes, KV cache, threads,
    symbols); each must be the manifest's own. The first that is not is one ArtifactError."""

    def difference(want: object, got: object, field: str) -> str | None:
        if isinstance(want, dict):
            if not isinstance(got, dict):
                return field or "(all)"
            for key, value in want.items():
                inner = f"{field}.{key}" if field else str(key)
                if key not in got:
                    return inner
                found = difference(value, got[key], inner)
                if found is not None:
                    return found
            return None
        return None if _same(want, got) else field

    if not isinstance(description, dict) or not description:
        raise ArtifactError(f"{kernels}: the kernels carry no description of themselves; recompile with this llmc")
    field = difference(description, manifest.data, "")
    if field is not None:
        raise ArtifactError(f"{manifest.directory / MANIFEST}: manifest does not match its kernels: "
                            f"{printable(field, 200)}; recompile")


def _same(a: object, b: object) -> bool:
    """JSON values equal, and of the same types throughout (1 is not 1.0 or true)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(v, b[k]) for k, v in a.items())  # type: ignore[attr-defined,index]
    if isinstance(a, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))  # type: ignore[arg-type]
    return a == b


def parse_description(text: bytes, kernels: Path) -> object:
    """The JSON of a kernels file's description (`DESCRIPTION`), or an ArtifactError."""
    try:
        return json.loads(text.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ArtifactError(f"{kernels}: unreadable description of the kernels ({e}); recompile") from None


def host_cpu_flags() -> set[str] | None:
    """This machine's CPU flags (Linux: /proc/cpuinfo), or None where they cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    return set(flags) if flags is not None else None


def missing_cpu_features(features: Iterable[str]) -> list[str]:
    """Those of `features` (LLVM's names, as a manifest's `cpu.features` lists them) this machine
    lacks (none known: none). The one answer to "can this host run that code", for the runtime and
    the tests that choose which instruction-set paths to execute."""
    have = host_cpu_flags()
    if have is None:
        return []
    return [feat for feat in features if _CPU_FLAGS.get(feat, feat) not in have]


def verified_bytes(manifest: Manifest, role: str) -> bytes:
    """The contents of the artifact's `role` file, read once and checked against its sha256 (so the
    bytes that were hashed are the bytes that are used)."""
    data = manifest.file(role).read_bytes()
    check_sha256(manifest, role, data)
    return data


def check_sha256(manifest: Manifest, role: str, data: bytes | memoryview) -> None:
    """`data`, read from the artifact's `role` file, has the sha256 the manifest gives that file."""
    if hashlib.sha256(data).hexdigest() != manifest.data["files"][role]["sha256"]:
        raise _modified(manifest.file(role))


def _modified(file: Path) -> ArtifactError:
    return ArtifactError(f"{file}: contents do not match the manifest (modified or truncated); recompile")


_PT_LOAD = 1


def check_elf_extents(data: bytes, path: Path) -> None:
    """Refuse a shared library whose segments reach past its end (a truncated file that the manifest's
    size and sha256 were made to match): the loader maps them, and the first read past the end is a
    SIGBUS, not an error. A 64-bit little-endian ELF's header, program headers and loaded segments must
    lie inside `data`."""
    size = len(data)
    if size < 64 or data[:6] != b"\x7fELF\x02\x01":
        raise ArtifactError(f"{path}: not a 64-bit little-endian ELF shared library; recompile")
    phoff, phentsize, phnum = struct.unpack_from("<Q", data, 32)[0], *struct.unpack_from("<HH", data, 54)
    if phentsize != 56 or phoff + phnum * phentsize > size:
        raise ArtifactError(f"{path}: its program headers lie past its end (truncated?); recompile")
    for i in range(phnum):
        kind, _, offset, _, _, filesz = struct.unpack_from("<IIQQQQ", data, phoff + i * phentsize)
        if kind == _PT_LOAD and offset + filesz > size:
            raise ArtifactError(f"{path}: a segment ends at byte {offset + filesz} of {size} (truncated?); recompile")


def load_verified_library(manifest: Manifest, check: bool = True):
    """`kernels.so` loaded with ctypes from a private copy whose sha256 was checked.

    Hashing the file and then loading it by path would leave a window in which the file
    could be swapped; the bytes that were hashed are the bytes that are loaded.
    """
    import ctypes

    path = manifest.file("kernels")
    if not check:
        check_elf_extents(path.read_bytes(), path)
        return ctypes.CDLL(str(path))
    data = verified_bytes(manifest, "kernels")
    check_elf_extents(data, path)
    with tempfile.TemporaryDirectory(prefix="llmc-kernels-") as private:  # mode 0700
        copy = os.path.join(private, path.name)
        with open(copy, "wb") as f:
            f.write(data)
        return ctypes.CDLL(copy)  # the mapping outlives the file


def library_description(library, kernels: Path) -> object:
    """The description a loaded kernels library carries (`DESCRIPTION`), or None if it has none."""
    import ctypes

    try:
        start = ctypes.c_char.in_dll(library, DESCRIPTION)
    except ValueError:
        return None
    return parse_description(ctypes.string_at(ctypes.addressof(start)), kernels)
