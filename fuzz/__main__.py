"""`python -m fuzz TARGET [libFuzzer options] [CORPUS_DIR ...]`: one target under atheris.

llmc's modules (and the libraries that parse what a target feeds them, where they are Python)
are instrumented for coverage as they are imported; findings go to `fuzz/corpus/TARGET/`.
Usually started by `fuzz/run.py`, which sets the time, the per-input timeout and the memory limit.
"""

from __future__ import annotations

import importlib
import sys

import atheris

TARGETS = ("gguf_file", "gguf_vocab", "tokenizer_json", "chat_template", "onnx_file", "pt2_file")
# Python libraries whose branches a target's inputs drive, beyond llmc's own (torch, onnx and
# tokenizers parse in native code, which atheris does not see)
INSTRUMENTED = {"chat_template": ["jinja2"]}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: python -m fuzz {{{','.join(TARGETS)}}} [libFuzzer options] [CORPUS_DIR ...]")
    target = sys.argv.pop(1)
    with atheris.instrument_imports(include=["llmc", "fuzz", *INSTRUMENTED.get(target, [])]):
        from fuzz.common import CORPUS, recording  # llmc and jinja2 too: instrumented as they are imported

        module = importlib.import_module(f"fuzz.{target}")
    atheris.Setup(sys.argv, recording(module.check, CORPUS / target))
    atheris.Fuzz()


main()
