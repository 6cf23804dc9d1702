"""A user's text file, read for an option (`-f`, `--json-schema`, `--grammar`, `--calibrate`): bounded,
UTF-8, every failure one line naming the option and the file; and a file an option will write, checked before
the work. No compiler is imported (`llmc run` reads with it).

    text = read_text("--grammar", "json.gbnf", 1 << 20)   # or UsageError: --grammar json.gbnf: cannot read it: …
    check_writable("--plot", Path("a/b.png"), "a .png file")  # or UsageError: … there is no folder a
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

from llmc.errors import UsageError

BOM = b"\xef\xbb\xbf"  # UTF-8's byte order mark


def read_text(option: str, name: str, limit: int) -> str:
    """The UTF-8 text of file `name` ('-': standard input) for `option`, at most `limit` bytes, without a
    leading byte order mark."""
    try:
        if name == "-":
            data = sys.stdin.buffer.read(limit + 1)
        else:
            with open(name, "rb") as f:
                data = f.read(limit + 1)
    except OSError as e:
        raise UsageError(f"{option} {name}: cannot read it: {e.strerror or e}") from None
    if len(data) > limit:
        raise UsageError(f"{option} {name}: larger than {limit} bytes, the most it takes")
    bom = len(BOM) if data.startswith(BOM) else 0  # (some editors begin UTF-8 with it: not part of the text)
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        at = bom + e.start
        raise UsageError(f"{option} {name}: not UTF-8 text (byte {at} is {data[at]:#04x})") from None


def at_or_inside(path: str | Path, folder: str | Path) -> bool:
    """Whether `path` is `folder` or lies inside it, symlinks resolved."""
    real, outer = Path(os.path.realpath(path)), Path(os.path.realpath(folder))
    return real == outer or outer in real.parents


def check_writable(option: str, path: Path, what: str, reads: Sequence[str | None] = ()) -> None:
    """Refuse, before any work, a file `option` names that could not be written: a folder, a file in a
    folder that does not exist (`what` names what to give instead of a folder), a file inside an llmc
    artifact, or one of the files the command `reads` (a model file, or anything inside a model's folder)."""
    if path.is_dir():
        raise UsageError(f"cannot write {option} {path}: it is a folder; name {what}")
    if not path.parent.is_dir():
        raise UsageError(f"cannot write {option} {path}: there is no folder {path.parent}")
    for source in filter(None, reads):
        if at_or_inside(path, source) and (Path(source).is_dir() or at_or_inside(source, path)):
            inside = not at_or_inside(source, path)
            raise UsageError(f"cannot write {option} {path}: it would {'be inside' if inside else 'be'} "
                             f"{source}, which this command reads; choose another {option}")
    from llmc.runtime.artifact import enclosing_artifact

    outer = enclosing_artifact(path)
    if outer is not None:
        raise UsageError(f"cannot write {option} {path}: it is inside the artifact {outer}, which it would spoil")
