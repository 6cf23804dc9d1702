"""A content-addressed cache of compiled kernels, so a second compile of the same code skips LLVM.

    key = cache_key(llvm_ir_text, "x86_64-unknown-linux-gnu", "znver3", "+avx2,...", "O3")
    code = lookup(key)
    if code is None:
        code = store(key, compile_with_llvm())

The key is the sha256 of everything the result depends on: the LLVM IR text, the target
(triple, CPU, features, optimization level) and the versions of llvmlite and LLVM. The store is
a folder of files named by their key: `$LLMC_CACHE_DIR`, else `$XDG_CACHE_HOME/llmc`, else
`~/.cache/llmc`, under `kernels/`; `LLMC_CACHE_DIR=off` (or `llmc compile --no-cache`) turns it
off. Entries are written under a temporary name and renamed, so concurrent compiles (several
processes, several test workers) never see half a file; a cache that cannot be written is
skipped silently (the compile goes on). Each entry starts with the sha256 of its bytes, which
`lookup` checks.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

import llvmlite
import llvmlite.binding as llvm

OFF = "off"


def cache_dir() -> Path | None:
    """The cache's folder, or None when it is off."""
    chosen = os.environ.get("LLMC_CACHE_DIR")
    if chosen == OFF:
        return None
    if chosen:
        return Path(chosen) / "kernels"
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "llmc" / "kernels"


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


def cache_key(text: str, *target: str) -> str:
    """The sha256 of the code's text, the target's description and the compiler's versions."""
    digest = hashlib.sha256()
    for part in (llvmlite.__version__, ".".join(map(str, llvm.llvm_version_info)), *target, text):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def lookup(key: str) -> bytes | None:
    """The cached result of `key`, if any (an entry whose bytes no longer match their sha256, such as
    one cut short by a full disk, is no entry)."""
    folder = cache_dir()
    if folder is None:
        return None
    try:
        entry = (folder / key).read_bytes()
    except OSError:
        return None
    digest, data = entry[:32], entry[32:]
    return data if hashlib.sha256(data).digest() == digest else None


def store(key: str, data: bytes) -> bytes:
    """Keep `data` as the result of `key` (where the cache can be written); returns `data`."""
    folder = cache_dir()
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
