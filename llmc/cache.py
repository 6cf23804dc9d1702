"""The compiler's cache folder: results of slow work stored under the sha256 of what decides them.

    data = lookup("kernels", key)
    if data is None:
        data = store("kernels", key, slow_work())

The folder is `$LLMC_CACHE_DIR`, else `$XDG_CACHE_HOME/llmc`, else `~/.cache/llmc`, with a subfolder per
kind of result (`kernels/`: `llmc.backends.kernel_cache`; `calibration/`: `llmc.passes.calibrate`);
`LLMC_CACHE_DIR=off` (or `llmc compile --no-cache`) turns it off. Entries are written under a temporary
name and renamed, so concurrent compiles (several processes, several test workers) never see half a file;
a cache that cannot be written is skipped silently (the compile goes on). Each entry starts with the
sha256 of its bytes, which `lookup` checks: a damaged entry is no entry (the work is done again).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from llmc.errors import UsageError

OFF = "off"


def cache_dir(kind: str) -> Path | None:
    """The folder of results of `kind`, or None when the cache is off."""
    chosen = os.environ.get("LLMC_CACHE_DIR")
    if chosen is not None and chosen.strip().lower() == OFF:  # (OFF, Off: off too, not a folder of that name)
        return None
    if chosen:
        return Path(chosen) / kind
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llmc" / kind


def check_location() -> None:
    """Refuse a `$LLMC_CACHE_DIR` inside an llmc artifact, before any work: the artifact's manifest lists what
    it holds, and a cache written into it would spoil it."""
    folder = cache_dir("kernels")
    if folder is None:
        return
    from llmc.runtime.artifact import enclosing_artifact

    outer = enclosing_artifact(folder)
    if outer is not None:
        raise UsageError(f"the cache folder {folder.parent} (LLMC_CACHE_DIR={os.environ.get('LLMC_CACHE_DIR', '')}) "
                         f"is inside the artifact {outer}, which the cache would spoil; choose another folder")


@contextmanager
def environment(name: str, value: str) -> Iterator[None]:
    """The environment variable `name` set to `value` inside the block, as it was after it (worker processes
    started inside it inherit it)."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def disabled() -> AbstractContextManager[None]:
    """The cache off inside the block (`llmc compile --no-cache`), as it was after it."""
    return environment("LLMC_CACHE_DIR", OFF)


def source_digest(*roots: Path) -> str:
    """The sha256 of the Python files under `roots` (folders or files; their paths relative to their root,
    and bytes): a version of the code that makes a result, so editing it makes every key anew."""
    digest = hashlib.sha256()
    for n, root in enumerate(roots):
        base, paths = (root.parent, [root]) if root.is_file() else (root, sorted(root.rglob("*.py")))
        for path in paths:
            data = path.read_bytes()
            digest.update(f"{n}/{path.relative_to(base).as_posix()}\0{len(data)}\0".encode() + data)
    return digest.hexdigest()


def lookup(kind: str, key: str) -> bytes | None:
    """The cached result of `key`, if any (an entry whose bytes no longer match their sha256, such as
    one cut short by a full disk, is no entry)."""
    folder = cache_dir(kind)
    if folder is None:
        return None
    try:
        entry = (folder / key).read_bytes()
    except OSError:
        return None
    digest, data = entry[:32], entry[32:]
    return data if hashlib.sha256(data).digest() == digest else None


def store(kind: str, key: str, data: bytes) -> bytes:
    """Keep `data` as the result of `key` (where the cache can be written); returns `data`."""
    folder = cache_dir(kind)
    if folder is None:
        return data
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, partial = tempfile.mkstemp(dir=folder, prefix=f".{key}.")
    except OSError:
        return data
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(hashlib.sha256(data).digest() + data)
        os.replace(partial, folder / key)
    except OSError:
        Path(partial).unlink(missing_ok=True)
    return data
