"""A second compile of the same model: kernels keyed before their IR exists (no IR emitted on a warm cache),
the calibration kept, the artifact byte for byte the cold one's; anything that changes the code is a miss."""

from __future__ import annotations

from pathlib import Path

import pytest
from tiny_models import TinySpec

from llmc import cache
from llmc.backends import kernel_cache
from llmc.backends.cpu import kernels
from llmc.cli import main

SPEC = TinySpec(hidden=64, heads=2, kv_heads=1, head_dim=32, ffn=128, context_length=64, gguf_storage=(
    ("token_embd", "q8_0"), ("attn_q", "q4_1"), ("attn_k", "q4_0"), ("attn_v", "q8_0"), ("attn_output", "q5_0"),
    ("ffn_gate", "q5_1"), ("ffn_up", "q4_1"), ("ffn_down", "q8_0")))


@pytest.fixture
def emitted(monkeypatch) -> list[str]:
    """The names of the kernel functions whose LLVM IR is built."""
    names: list[str] = []
    real = kernels.KernelLibrary._emit

    def counted(self, key, op, name):
        names.append(name)
        return real(self, key, op, name)

    monkeypatch.setattr(kernels.KernelLibrary, "_emit", counted)
    return names


def _artifact(model: str, out: Path, *options: str) -> dict[str, bytes]:
    assert main(["compile", model, "-o", str(out), "--max-seq", "32", *options]) == 0
    return {p.name: p.read_bytes() for p in out.iterdir()}


@pytest.mark.parametrize("cpu", ["native", "x86-64-v3"])
def test_a_warm_compile_builds_no_kernel_ir_and_writes_the_same_artifact(tiny, tmp_path, monkeypatch, emitted,
                                                                        cpu) -> None:
    """Cold: every kernel's IR is built, and the calibration measured; warm: neither, and every file of the
    artifact (the content-named library, weights.bin, the manifest) is the same bytes; `--no-cache` builds all
    again, to the same artifact (on the native target)."""
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    model = str(tiny(SPEC, "gguf"))
    cold = _artifact(model, tmp_path / "cold", "--cpu", cpu)
    kernels_built = len(emitted)
    assert kernels_built > 3 and list((tmp_path / "cache" / "calibration").iterdir())
    emitted.clear()
    measured = []
    monkeypatch.setattr("llmc.passes.calibrate._measure", lambda *args: measured.append(args))
    assert _artifact(model, tmp_path / "warm", "--cpu", cpu) == cold
    assert emitted == [] and measured == []
    if cpu == "native":  # (`--no-cache` skips the cache whatever the target: checked on one)
        monkeypatch.undo()
        monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
        assert _artifact(model, tmp_path / "uncached", "--cpu", cpu, "--no-cache") == cold


def test_another_compiler_version_or_a_damaged_entry_is_compiled_again(tiny, tmp_path, monkeypatch, emitted) -> None:
    """A kernel's key holds the digest of the compiler's source (`compiler_version`): with another, every
    kernel is built again; a damaged entry is compiled again, not read (its kernels only)."""
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    model = str(tiny(SPEC, "gguf"))
    cold = _artifact(model, tmp_path / "cold")
    kernels_built = len(emitted)
    emitted.clear()
    entries = tmp_path / "cache" / "kernels"
    before = set(entries.iterdir())
    monkeypatch.setattr(kernels, "compiler_version", lambda: "an edited emitter")
    assert _artifact(model, tmp_path / "edited") == cold and len(emitted) == kernels_built
    emitted.clear()
    entry = min(set(entries.iterdir()) - before)  # one the edited emitter's compile wrote
    entry.write_bytes(entry.read_bytes()[:-1])  # cut short
    assert _artifact(model, tmp_path / "damaged") == cold and 0 < len(emitted) < kernels_built  # that entry's


def test_the_compiler_version_is_the_digest_of_its_source(tmp_path) -> None:
    """`source_digest` changes with a file's bytes and with its name, of a folder or a file given alone;
    `compiler_version` is that of `llmc.ir`, `llmc.backends` and `llmc.abi`."""
    import llmc.abi
    import llmc.backends
    import llmc.ir

    (tmp_path / "emit.py").write_text("X = 1\n")
    first = cache.source_digest(tmp_path)
    (tmp_path / "emit.py").write_text("X = 2\n")
    edited = cache.source_digest(tmp_path)
    (tmp_path / "emit.py").rename(tmp_path / "other.py")
    assert len({first, edited, cache.source_digest(tmp_path)}) == 3
    alone = cache.source_digest(tmp_path / "other.py")
    (tmp_path / "other.py").write_text("X = 3\n")
    assert cache.source_digest(tmp_path / "other.py") != alone
    assert kernel_cache.compiler_version() == cache.source_digest(Path(llmc.ir.__file__).parent,
                                                                  Path(llmc.backends.__file__).parent,
                                                                  Path(llmc.abi.__file__))
