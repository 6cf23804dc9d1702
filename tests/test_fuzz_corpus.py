"""The fuzzers' findings as regression tests, without atheris.

Every file in `fuzz/corpus/TARGET/` (but the `.txt` notes beside them) is an input that once
made a target fail: it goes through the same `check(data)` the fuzzer called and must end in
success or a clean `LlmcError`, within the fuzzer's per-input timeout and below the hostile
tests' memory bound. The harness itself is checked too: what counts as a finding, and how one is
recorded.
"""

from __future__ import annotations

import importlib
import os
import sys
import time
import tracemalloc
import warnings
from pathlib import Path

import pytest
from hostile import MAX_EXTRA_BYTES, hang_guard

from llmc.errors import ModelFormatError

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `fuzz` as a package

from fuzz import TARGETS  # noqa: E402
from fuzz.common import CORPUS, Printed, Warned, outcome, recording  # noqa: E402

MAX_SECONDS = 10  # the fuzzers' -timeout: CPU seconds (`time.process_time`), whatever else the host runs
NEEDS = {"onnx_file": "onnx", "pt2_file": "torch"}
GARBAGE = b"\x00garbage{%"  # no target's format: refused by each
ENTRIES = sorted(p for p in CORPUS.glob("*/*") if p.suffix != ".txt")


@pytest.mark.parametrize("entry", ENTRIES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_corpus_entry(entry: Path) -> None:
    if entry.parent.name in NEEDS:
        pytest.importorskip(NEEDS[entry.parent.name])
    check = importlib.import_module(f"fuzz.{entry.parent.name}").check
    check(GARBAGE)  # what the importers import on first use (torch, onnx), outside the measured run
    data = entry.read_bytes()
    tracemalloc.start()
    try:
        with hang_guard(2 * MAX_SECONDS):
            start = time.process_time()
            check(data)  # returns on success or an LlmcError; anything else fails the test
            seconds = time.process_time() - start
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert seconds < MAX_SECONDS, f"{entry.name}: {seconds:.1f} s"
    assert peak < MAX_EXTRA_BYTES, f"{entry.name}: peak traced memory {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("target", TARGETS)
def test_target_refuses_garbage_cleanly(target: str) -> None:
    if target in NEEDS:
        pytest.importorskip(NEEDS[target])
    importlib.import_module(f"fuzz.{target}").check(GARBAGE)


def test_outcome_passes_llmc_errors_only() -> None:
    with outcome():
        raise ModelFormatError("x.gguf", "refused")
    with pytest.raises(ValueError), outcome():
        raise ValueError("a bug")
    with pytest.raises(Warned, match="RuntimeWarning at"), outcome():
        warnings.warn("overflow", RuntimeWarning)
    with outcome():  # hidden by Python's default filters: no stray line
        warnings.warn("old", DeprecationWarning)
    with pytest.raises(Printed, match="^thread panicked$"), outcome():
        os.write(2, b"\nthread panicked\nnote: ...\n")  # as native code writes, under Python's sys.stderr


def test_recording_keeps_the_shortest_input_per_signature(tmp_path: Path) -> None:
    def check(data: bytes) -> None:
        if data.startswith(b"!"):
            raise (KeyError if b"k" in data else ValueError)(data)

    run = recording(check, tmp_path)
    for data in (b"ok", b"!long ValueError", b"!short", b"!longer ValueError", b"!k"):
        run(data)
    saved = {(tmp_path / f"{p.name}.txt").read_text().splitlines()[0]: p.read_bytes()
             for p in tmp_path.glob("finding-*") if p.suffix != ".txt"}
    raised_at = f"{Path(__file__).name}:{check.__code__.co_firstlineno + 2}"  # the `raise` line
    assert saved == {f"ValueError at {raised_at}": b"!short", f"KeyError at {raised_at}": b"!k"}
