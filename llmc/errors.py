"""Errors a user can act on. The CLI prints them as one line and exits with code 2."""

MAX_DETAIL = 400


def printable(text: object, limit: int = MAX_DETAIL) -> str:
    """`text` safe for one terminal line: control characters escaped, length bounded.

    Messages quote names and values from model files, which come from strangers.
    """
    out = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(text))
    return out if len(out) <= limit else out[: limit - 1] + "…"


class LlmcError(Exception):
    """An error caused by the input or the options, not by a bug in llmc."""


class ModelFormatError(LlmcError):
    """A model file or directory that is malformed, inconsistent or unsupported."""

    def __init__(self, source: object, problem: str):
        super().__init__(f"{printable(source)}: {printable(problem)}")
        self.source = source
        self.problem = problem


class UsageError(LlmcError):
    """A bad option value or combination of options."""
