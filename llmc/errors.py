"""Errors a user can act on. The CLI prints them as one line and exits with code 2."""


class LlmcError(Exception):
    """An error caused by the input or the options, not by a bug in llmc."""


class ModelFormatError(LlmcError):
    """A model file or directory that is malformed, inconsistent or unsupported."""

    def __init__(self, source: object, problem: str):
        super().__init__(f"{source}: {problem}")
        self.source = source
        self.problem = problem


class UsageError(LlmcError):
    """A bad option value or combination of options."""
