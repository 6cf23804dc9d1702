"""A content-addressed cache of compiled kernels, so a second compile of the same code skips LLVM.

    key = cache_key(llvm_ir_text, "x86_64-unknown-linux-gnu", "znver3", "+avx2,...", "O3")
    code = lookup(key)
    if code is None:
        code = store(key, compile_with_llvm())

The key is the sha256 of everything the result depends on: the LLVM IR text, the target
(triple, CPU, features, optimization level) and the versions of llvmlite and LLVM. A kernel can be
keyed before its IR exists, by what its emitter reads (its op) and `compiler_version()` (the source
of the code that emits IR), so a warm compile builds no IR for it. The entries are the `kernels/`
folder of the compiler's cache (`llmc.cache`: atomic writes, checked reads, `LLMC_CACHE_DIR=off`).
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import llvmlite

from llmc import cache
from llmc.errors import LlmcError

try:  # (the first import of LLVM's bindings, for every backend)
    import llvmlite.binding as llvm
except OSError:  # (llvmlite's message: "Could not find/load shared object file …", and no cause)
    raise LlmcError("cannot load LLVM (llvmlite's library): too little memory under the process's limit to map "
                    "it, or a broken llvmlite install") from None

KIND = "kernels"


def cache_key(text: str, *target: str) -> str:
    """The sha256 of the code's text, the target's description and the compiler's versions."""
    digest = hashlib.sha256()
    for part in (llvmlite.__version__, ".".join(map(str, llvm.llvm_version_info)), *target, text):
        digest.update(part.encode())
        digest.update(b"\0")
    return digest.hexdigest()


@functools.cache
def compiler_version() -> str:
    """The digest of the source of the IR, of the code that emits LLVM IR from it (the `llmc.ir` and
    `llmc.backends` packages) and of the ABI constants the kernels use (`llmc.abi`): editing an emitter
    changes every key made with it."""
    import llmc.abi
    import llmc.backends
    import llmc.ir

    folders = (Path(package.__file__).parent for package in (llmc.ir, llmc.backends))
    return cache.source_digest(*folders, Path(llmc.abi.__file__))


def lookup(key: str) -> bytes | None:
    """The cached object of `key`, if any (`llmc.cache.lookup`)."""
    return cache.lookup(KIND, key)


def store(key: str, data: bytes) -> bytes:
    """Keep `data` as the object of `key` (where the cache can be written); returns `data`."""
    return cache.store(KIND, key, data)
