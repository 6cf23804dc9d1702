"""Kernel modules compiled in worker processes (`llmc compile --jobs N`), and codegen's progress lines."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from tiny_models import TinySpec

from llmc.backends.cpu import toolchain
from llmc.cli import main
from llmc.cli.common import progress

SPEC = TinySpec(context_length=64)
BAD = '; ModuleID = "{}"\ndefine i32 @f( {{\n'


@pytest.fixture
def pools(monkeypatch) -> list[int]:
    """The worker counts of the process pools `toolchain` starts."""
    started: list[int] = []
    real = toolchain.ProcessPoolExecutor

    def counted(workers: int, **options):
        started.append(workers)
        return real(workers, **options)

    monkeypatch.setattr(toolchain, "ProcessPoolExecutor", counted)
    return started


def _compiled(model: str, out: Path, *options: str) -> Path:
    assert main(["compile", model, "-o", str(out), "--max-seq", "32", *options]) == 0
    return next(out.glob("kernels-*.so"))


def test_parallel_codegen_gives_the_serial_library(tiny, tmp_path, monkeypatch, pools, capsys) -> None:
    """Cold caches: `--jobs 1` compiles in this process alone, `--jobs 2` with a worker, to the same bytes
    (the same content-named library), and says how far it is; a warm compile starts no pool."""
    model = str(tiny(SPEC, "gguf"))
    monkeypatch.setattr(toolchain, "PARALLEL_IR", 0)  # a tiny model's kernels are too small to pay for a worker
    monkeypatch.setattr(progress, "QUIET", 0.0)
    monkeypatch.setattr(progress, "LOG_EVERY", 0.0)
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "serial-cache"))
    serial = _compiled(model, tmp_path / "serial", "--jobs", "1")
    assert pools == []
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    parallel = _compiled(model, tmp_path / "parallel", "--jobs", "2")
    assert pools == [1]  # this process and one worker
    assert parallel.name == serial.name and parallel.read_bytes() == serial.read_bytes()
    modules = len(list((tmp_path / "cache" / "kernels").iterdir()))
    err = capsys.readouterr().err
    assert f"codegen: {modules} of {modules} modules compiled, 0 from the cache\n" in err  # plain lines in a log

    warm = _compiled(model, tmp_path / "warm", "--jobs", "2")
    assert pools == [1] and warm.read_bytes() == serial.read_bytes()
    assert f"{modules} of {modules} modules from the cache" in capsys.readouterr().err


def test_a_workers_error_is_one_line(monkeypatch) -> None:
    """LLVM's error in a worker process comes back as one line naming the module (this process is held up, so
    the worker takes one)."""
    monkeypatch.setenv("LLMC_CACHE_DIR", "off")
    monkeypatch.setenv(toolchain.JOBS, "2")
    monkeypatch.setattr(toolchain, "PARALLEL_IR", 0)
    monkeypatch.setattr(toolchain, "_compiled", lambda text, tm, level, assembly: time.sleep(2) or b"")
    with pytest.raises(toolchain.ToolchainError) as error:
        toolchain.compile_objects([BAD.format("first"), BAD.format("second")], toolchain.target_machine())
    message = str(error.value)
    assert "\n" not in message and "error: expected type" in message
    assert message.startswith(('codegen of kernel module "first" failed', 'codegen of kernel module "second" failed'))


def test_serial_errors_are_one_line_too(monkeypatch) -> None:
    monkeypatch.setenv("LLMC_CACHE_DIR", "off")
    monkeypatch.setenv(toolchain.JOBS, "1")
    with pytest.raises(toolchain.ToolchainError, match='^codegen of kernel module "only" failed: LLVM IR parsing'):
        toolchain.compile_objects([BAD.format("only")], toolchain.target_machine())


@pytest.mark.parametrize("jobs", ["0", "-2", "x"])
def test_jobs_must_be_positive(tiny, jobs: str, capsys, monkeypatch, tmp_path) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["compile", str(tiny(SPEC, "gguf")), "--jobs", jobs])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1 and "--jobs" in err
    monkeypatch.setenv(toolchain.JOBS, jobs)
    with pytest.raises(toolchain.ToolchainError, match=f"LLMC_JOBS='{jobs}': expected a positive number"):
        toolchain.jobs()
    assert main(["compile", str(tiny(SPEC, "gguf")), "-o", str(tmp_path / "out")]) == 2  # before any phase runs
    err = capsys.readouterr().err
    assert err == f"llmc: error: LLMC_JOBS='{jobs}': expected a positive number of processes\n", err


def test_progress_rewrites_one_line_on_a_terminal(monkeypatch, capsys) -> None:
    """On a terminal an update replaces the last one in place, and the next finished step's line clears it."""
    monkeypatch.setattr("sys.stderr.isatty", lambda: True)
    monkeypatch.setattr(progress, "QUIET", 0.0)
    monkeypatch.setattr(progress, "shown", float("-inf"))
    progress.update("codegen: 1 of 3 modules compiled, 0 from the cache")
    progress.update("codegen: 2 of 3 modules compiled, 0 from the cache")  # within TTY_EVERY: not shown
    progress("codegen      1.00 s")
    assert capsys.readouterr().err == ("\r\033[Kcodegen: 1 of 3 modules compiled, 0 from the cache"
                                       "\r\033[Kcodegen      1.00 s\n")


def test_a_long_step_says_what_it_is_doing_without_more_updates(monkeypatch, capsys) -> None:
    """An update is shown when its step is still under way `QUIET` (in a log `LOG_EVERY`) seconds after the
    step's first update (in a log, a plain line); one made in a step that ends before is never shown, however
    long the command ran before the step began."""
    monkeypatch.setattr(progress, "QUIET", 0.3)
    monkeypatch.setattr(progress, "LOG_EVERY", 0.3)
    monkeypatch.setattr(progress, "shown", float("-inf"))
    progress("lower        0.10 s")
    progress.update("codegen: emitting LLVM IR")
    time.sleep(0.6)
    progress("codegen      0.60 s")
    progress.update("package: writing weights.bin (1.0 MB)")
    progress("package      0.01 s")
    time.sleep(0.4)
    progress.update("load: a file that is not a model")  # (a step beginning late in the command: shown from 0.3 s)
    progress("llmc: error: not a model")
    assert capsys.readouterr().err == ("lower        0.10 s\ncodegen: emitting LLVM IR\ncodegen      0.60 s\n"
                                       "package      0.01 s\nllmc: error: not a model\n")
