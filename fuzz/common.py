"""What every fuzz target shares: a scratch folder for the files it writes, the rule that
decides an outcome, and the recording of findings while atheris runs.

A target is a module with `check(data: bytes) -> None`: it writes `data` where an importer
expects a file, calls the real entry point, and returns when the input is accepted or
refused with an `LlmcError`. Anything else escapes `check`: that is a finding.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import os
import re
import shutil
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers

from llmc.errors import LlmcError
from llmc.runtime.codec import TextCodec

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "fuzz" / "corpus"  # findings, checked in and replayed by tests/test_fuzz_corpus.py
# what targets encode and send as a chat message: words, digits, a special token, spaces, non-ASCII,
# and long runs of one character, on which a backtracking regex of a pre-tokenizer takes its time
TEXT = "Hello world! 12345 <|im_start|>user\n  ünï cødé 🤖\t<s> " + "a" * 48 + "!" + "1" * 48 + " " * 48 + "."


# what Python's default filters keep from the terminal
HIDDEN_WARNINGS = (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning)


class Warned(Exception):
    """A warning reached the user's terminal: a stray stderr line beside llmc's one-line error."""

    def __init__(self, warning: warnings.WarningMessage):
        self.where = f"{warning.category.__name__} at {Path(warning.filename).name}:{warning.lineno}"
        super().__init__(f"{self.where}: {warning.message}")


@functools.cache
def scratch() -> Path:
    """This process's folder for the files a target writes (removed at exit)."""
    folder = Path(tempfile.mkdtemp(prefix="llmc-fuzz-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


def place(target: str, name: str, data: bytes) -> Path:
    """`data` as the file `name` in the target's scratch folder (beside what else it holds)."""
    folder = scratch() / target
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_bytes(data)
    return path


@functools.cache
def tiny_tokenizer() -> Tokenizer:
    """A valid word-level tokenizer, for targets whose input is not the tokenizer."""
    words = ["<unk>", "<s>", "</s>", "Hello", "world", "!", "?", "user", "assistant"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer


def exercise(codec: TextCodec) -> None:
    """What llmc does with a tokenizer it built: encode, decode, and render its chat template."""
    codec.decode(codec.encode(TEXT))
    if codec.chat_template:
        codec.chat(TEXT)


def import_graph_file(target: str, name: str, data: bytes) -> None:
    """`data` as the graph file `name` (ONNX, `.pt2`) with a valid tokenizer.json beside it, loaded and
    imported to `llm` IR, its tokenizer exercised."""
    from llmc.frontend import import_model, load_model

    place(target, "tokenizer.json", tiny_tokenizer().to_str().encode())
    path = place(target, name, data)
    with outcome():
        model = load_model(str(path))
        import_model(model)
        exercise(model.tokenizer)


class Printed(Exception):
    """Something wrote to the process's stderr (a Rust panic's message, a library's print): stray
    lines beside llmc's one-line error."""


@contextmanager
def outcome() -> Iterator[None]:
    """The body's end: success or an `LlmcError` return normally; another exception, a warning
    (numpy, torch), or anything written to file descriptor 2 (native code too) escapes."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as written, warnings.catch_warnings(record=True) as caught:
        os.dup2(written.fileno(), 2)
        warnings.simplefilter("always")
        for hidden in HIDDEN_WARNINGS:
            warnings.simplefilter("ignore", hidden)
        try:
            yield
        except LlmcError:
            pass
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
        written.seek(0)
        printed = written.read(400)
    if caught:
        raise Warned(caught[0])
    if printed:
        lines = [line for line in printed.decode("utf-8", "replace").splitlines() if line.strip()]
        raise Printed(lines[0] if lines else "blank lines")


def signature(error: BaseException) -> str:
    """What tells one bug from another: the exception's type and the innermost frame in llmc's
    own code (else the innermost frame)."""
    if isinstance(error, Warned):
        return f"{Warned.__name__}: {error.where}"
    if isinstance(error, Printed):  # its first line, thread ids and line numbers aside
        return f"{Printed.__name__}: {re.sub(r'[0-9]+', 'N', str(error))[:160]}"
    frames = traceback.extract_tb(error.__traceback__)
    ours = [f for f in frames if f"{ROOT}/" in f.filename and "/.venv/" not in f.filename
            and "/fuzz/" not in f.filename]
    frame = (ours or frames or [None])[-1]
    where = f"{Path(frame.filename).name}:{frame.lineno}" if frame else "?"
    return f"{type(error).__name__} at {where}"


def recording(check: Callable[[bytes], None], folder: Path) -> Callable[[bytes], None]:
    """`check` for atheris: a finding is saved in `folder` (the shortest input per signature,
    `finding-<hash>`, with its traceback in `finding-<hash>.txt`) and fuzzing goes on; timeouts,
    memory limits and native crashes stop the process (libFuzzer saves those inputs itself)."""
    folder.mkdir(parents=True, exist_ok=True)
    shortest: dict[str, int] = {}
    for note in folder.glob("finding-*.txt"):  # what earlier runs found
        first = note.read_text().splitlines()[:1]
        data = note.with_suffix("")
        if first and data.is_file():
            shortest[first[0]] = min(shortest.get(first[0], 1 << 62), data.stat().st_size)

    def run(data: bytes) -> None:
        try:
            check(data)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # a PanicException of the tokenizers library is a BaseException
            key = signature(e)
            if len(data) < shortest.get(key, 1 << 62):
                shortest[key] = len(data)
                name = "finding-" + hashlib.sha1(key.encode()).hexdigest()[:10]
                (folder / name).write_bytes(data)
                (folder / f"{name}.txt").write_text(key + "\n" + "".join(traceback.format_exception(e))[-4000:])
                print(f"FINDING {key} ({len(data)} bytes) -> {folder / name}", flush=True)

    return run
