"""llama.cpp's vocabulary tests: `models/ggml-vocab-NAME.gguf` (a vocabulary-only GGUF), with
`.gguf.inp` (texts, separated by lines `__ggml_vocab_test__`) and `.gguf.out` (the ids the
model's own Hugging Face tokenizer gives each text, one line per text).

They come from llama.cpp's source as the PyPI sdist of llama-cpp-python ships it (77 MB,
checked against its sha256) and are kept in tests/data/llama-vocabs (git-ignored). Run

    .venv/bin/python tests/llama_vocabs.py [--sdist FILE]

once (setup.sh does); with --sdist a local copy of the sdist is used instead of downloading it.
"""

from __future__ import annotations

import argparse
import hashlib
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SDIST_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MEMBERS = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/"
DIRECTORY = Path(__file__).parent / "data" / "llama-vocabs"
MARKER = DIRECTORY / "SOURCE"  # written last: the sdist the files came from
FETCH = "run `.venv/bin/python tests/llama_vocabs.py` (or `bash setup.sh`) to fetch them"
SEPARATOR = "\n__ggml_vocab_test__\n"


def present() -> bool:
    return MARKER.is_file() and MARKER.read_text().split() == [SDIST, SDIST_SHA256]


def cases(name: str) -> list[tuple[str, list[int]]]:
    """The texts of `ggml-vocab-NAME.gguf.inp` and their ids, read as llama.cpp's
    tests/test-tokenizer-0.cpp reads them."""
    raw = (DIRECTORY / f"ggml-vocab-{name}.gguf.inp").read_text(encoding="utf-8")
    texts = raw.removesuffix(SEPARATOR).split(SEPARATOR)
    ids = (DIRECTORY / f"ggml-vocab-{name}.gguf.out").read_text(encoding="utf-8").splitlines()
    assert len(texts) == len(ids), f"ggml-vocab-{name}: {len(texts)} texts, {len(ids)} id lines"
    return [(text, [int(i) for i in line.split()]) for text, line in zip(texts, ids)]


def fetch(sdist: Path | None = None) -> None:
    """Extract the vocabulary tests from the sdist (downloaded with pip unless given), once."""
    if present():
        return
    with tempfile.TemporaryDirectory() as tmp:
        if sdist is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                            f"llama-cpp-python=={VERSION}", "--dest", tmp], check=True)
            sdist = Path(tmp) / SDIST
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        if digest != SDIST_SHA256:
            sys.exit(f"{sdist}: sha256 {digest}, expected {SDIST_SHA256}")
        DIRECTORY.mkdir(parents=True, exist_ok=True)
        with tarfile.open(sdist) as tar:
            for member in tar:
                name = member.name.removeprefix(MEMBERS)
                if member.isfile() and name != member.name and "/" not in name and name.startswith("ggml-vocab-"):
                    (DIRECTORY / name).write_bytes(tar.extractfile(member).read())
    MARKER.write_text(f"{SDIST} {SDIST_SHA256}\n")
    print(f"llama.cpp's vocabulary tests are in {DIRECTORY}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Fetch llama.cpp's vocabulary tests into tests/data/llama-vocabs.")
    parser.add_argument("--sdist", type=Path, help=f"a local copy of {SDIST}")
    fetch(parser.parse_args().sdist)
