"""A user's text file, read for an option (`-f`, `--json-schema`, `--grammar`, `--calibrate`): bounded,
UTF-8, every failure one line naming the option and the file. Standard library only (`llmc run` reads with it
and loads no compiler).

    text = read_text("--grammar", "json.gbnf", 1 << 20)   # or UsageError: --grammar json.gbnf: cannot read it: …
"""

from __future__ import annotations

import sys

from llmc.errors import UsageError


def read_text(option: str, name: str, limit: int) -> str:
    """The UTF-8 text of file `name` ('-': standard input) for `option`, at most `limit` bytes."""
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
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"{option} {name}: not UTF-8 text (byte {e.start} is {data[e.start]:#04x})") from None
