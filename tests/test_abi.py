"""`llmc.abi`, the contract between compiler and runtime: dependency-free, and the runtime imports
no compiler module."""

import json
import pkgutil
import subprocess
import sys

from llmc import abi
from llmc.ir import llm, tgt

COMPILER = ("llmc.ir", "llmc.passes", "llmc.backends", "llmc.frontend", "llmc.driver", "llmc.package")


def _imported(*modules: str) -> set[str]:
    """The modules a fresh interpreter holds after importing `modules`."""
    code = f"import json, sys\nimport {', '.join(modules)}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out))


def _runtime_modules() -> list[str]:
    import llmc.runtime

    return [m.name for m in pkgutil.iter_modules(llmc.runtime.__path__, "llmc.runtime.")]


def _under(names: set[str], prefixes: tuple[str, ...]) -> list[str]:
    return sorted(n for n in names if any(n == p or n.startswith(p + ".") for p in prefixes))


def test_abi_imports_only_the_standard_library() -> None:
    loaded = _imported("llmc.abi")
    assert not _under(loaded, (*COMPILER, "llmc.runtime", "numpy", "xdsl", "llvmlite"))


def test_the_runtime_imports_no_compiler_module() -> None:
    """Every module of `llmc.runtime` at once: artifacts run where xdsl and llvmlite are not installed."""
    modules = _runtime_modules()
    assert {"llmc.runtime.artifact", "llmc.runtime.session", "llmc.runtime.cuda", "llmc.runtime.server"} <= set(modules)
    loaded = _imported(*modules)
    assert "llmc.abi" in loaded
    assert not _under(loaded, (*COMPILER, "xdsl", "llvmlite"))


def test_entry_arguments_follow_the_cache() -> None:
    assert abi.entry_arguments(1) == ("tokens", "positions", "n", "k_cache", "v_cache", "logits")
    assert abi.entry_arguments(8) == ("tokens", "positions", "slots", "n", "k_cache", "v_cache", "logits")
    assert [abi.argument_kind(a) for a in ("n", "tid", "nth")] == [abi.INT64] * 3
    assert abi.entry_symbol("decode") == "llmc_decode"


def test_the_compiler_writes_the_abi() -> None:
    """The IR's cache rows, element sizes and `--kv-type` names are the ABI's."""
    assert abi.kv_q8_row_bytes(64) == 64 + 2 * 4 == tgt.kv_row_width(64, llm.KV_TYPES["q8_0"])
    assert abi.kv_q8_head_dim(abi.kv_q8_row_bytes(128)) == 128
    assert tgt.kv_row_width(64, llm.KV_TYPES["f16"]) == 64
    assert tgt.nbytes(tgt.memref(2, 3, element_type=llm.KV_TYPES["f16"])) == 2 * 3 * abi.ELEMENT_BYTES["f16"]
    assert set(llm.KV_TYPES) == set(abi.KV_DTYPES)
