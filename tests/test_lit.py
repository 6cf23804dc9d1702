"""The IR tests in tests/lit (one folder per pass, `llmc opt` checked by FileCheck), run by lit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

LIT = Path(__file__).parent / "lit"

pytest.importorskip("lit")
pytest.importorskip("filecheck")


def test_lit() -> None:
    """Every pass has a folder of tests, and they all pass (a failure shows lit's report of it)."""
    from llmc.passes.registry import PASSES

    assert sorted(p.name for p in LIT.iterdir() if p.is_dir() and any(p.glob("*.mlir"))) == sorted(PASSES)
    lit = [sys.executable, "-c", "from lit.main import main; main()"]  # (the package has no __main__)
    run = subprocess.run([*lit, "-v", "-j", "2", str(LIT)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-2000:]
