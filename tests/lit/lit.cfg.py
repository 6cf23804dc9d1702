# lit's configuration of the IR tests: one folder per pass, each `.mlir` file's `// RUN:` lines run
# `llmc opt` and check its output with FileCheck. `.venv/bin/lit -v tests/lit` (or one folder).
# ruff: noqa: F821  (lit defines `config`)

import os
import sys
import tempfile

import lit.formats

config.name = "llmc"
config.test_format = lit.formats.ShTest(execute_external=False)
config.suffixes = [".mlir"]
config.test_source_root = os.path.dirname(__file__)
# lit's outputs (its test-times file) go outside the source tree
config.test_exec_root = os.path.join(tempfile.gettempdir(), "llmc-lit")
os.makedirs(config.test_exec_root, exist_ok=True)
# the Python lit runs in is the one with llmc and filecheck installed (`.venv/bin/lit`)
config.substitutions.append(("llmc-opt", f"{sys.executable} -m llmc opt"))
config.substitutions.append(("filecheck", f"{sys.executable} -m filecheck"))
if "PYTHONPATH" in os.environ:
    config.environment["PYTHONPATH"] = os.environ["PYTHONPATH"]
