"""Shared checks for the hostile-input tests: rejection within time and memory bounds,
one clean error line, the CLI's exit code.

Every crafted file must be rejected with one `ModelFormatError` line that names the
file and the detail (field, byte offset), within 1 s and 256 MB of extra (traced)
memory, without a crash of another kind; `llmc compile` on it must exit 2 with one
`llmc: error:` line and create nothing.
"""

from __future__ import annotations

import functools
import signal
import time
import tracemalloc
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from crafted import GGUFBuilder, tiny_gguf
from tiny_models import VOCAB_SIZE, TinySpec, random_weights

from llmc.cli import main
from llmc.errors import ModelFormatError
from llmc.frontend import import_model, load_model

MAX_SECONDS = 1.0  # of this process's CPU time (`time.process_time`): the work, whatever else the host runs
MAX_EXTRA_BYTES = 256 * 1024 * 1024
HANG_GUARD_SECONDS = 60  # a hang fails the test instead of stalling the run

SPEC = TinySpec(layers=1)
N_TOKENS = VOCAB_SIZE


# ------------------------------------------------------------------ helpers


@contextmanager
def hang_guard(seconds: float = HANG_GUARD_SECONDS) -> Iterator[None]:
    """Raise TimeoutError (not a ModelFormatError) if the body runs longer than `seconds`."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s (hang?)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def load_everything(path: Path, allow_pickle: bool = False) -> None:
    """What a compile reads of a model: config, weights table, IR, and the tokenizer."""
    model = load_model(str(path), allow_pickle)
    import_model(model)
    model.tokenizer  # noqa: B018 — built on first use


def assert_one_clean_line(message: str) -> None:
    """A file's bytes must not reach the terminal raw: no line breaks, escapes or NULs."""
    assert not any(c in message for c in "\n\r\x1b\x00"), repr(message)


def assert_rejected(path: Path, details: list[str], allow_pickle: bool = False) -> str:
    """`path` is refused with one ModelFormatError line naming it and each detail, fast and small."""
    with hang_guard():
        start = time.process_time()
        with pytest.raises(ModelFormatError) as info:
            load_everything(path, allow_pickle)
        seconds = time.process_time() - start
    message = str(info.value)
    assert_one_clean_line(message)
    assert str(path) in message, f"the message does not name {path}: {message}"
    for detail in details:
        assert detail in message, f"{detail!r} not in {message!r}"
    assert seconds < MAX_SECONDS, f"rejected after {seconds:.2f} s: {message}"
    tracemalloc.start()
    try:
        with hang_guard(), pytest.raises(ModelFormatError):
            load_everything(path, allow_pickle)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_EXTRA_BYTES, f"peak traced memory {peak / 2**20:.0f} MiB: {message}"
    return message


def cli_compile(path: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    with hang_guard():
        code = main(["compile", str(path), "--max-seq", "32", "-o", str(out)])
    return code, capsys.readouterr().err


def assert_cli_rejects(path: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = cli_compile(path, out, capsys)
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmc: error:"), err
    assert str(path) in lines[0], err
    assert not out.exists(), f"compile left {sorted(p.name for p in out.iterdir())} in {out}"


@functools.cache
def _base_gguf() -> GGUFBuilder:
    return tiny_gguf(SPEC)


def base() -> GGUFBuilder:
    """A fresh copy of the valid tiny GGUF model (1 layer, f32) to break in one place."""
    return _base_gguf().copy()


@functools.cache
def hf_weights() -> dict[str, np.ndarray]:
    return random_weights(SPEC)
