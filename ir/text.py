"""IR text: the context of llmc's dialects, printing and parsing.

Printing and parsing are for dumps, tests and `llmc opt`; the compiler keeps modules in
memory between passes.
"""

from __future__ import annotations

import io

from xdsl.context import Context
from xdsl.dialects import builtin, func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation
from xdsl.parser import Parser
from xdsl.printer import Printer
from xdsl.utils.exceptions import ParseError, VerifyException

from llmc.errors import LlmcError
from llmc.ir.llm import LLM
from llmc.ir.tgt import TGT


def context() -> Context:
    """A context that knows `builtin`, `func`, `llm` and `tgt`."""
    ctx = Context()
    for dialect in (builtin.Builtin, func.Func, LLM, TGT):
        ctx.load_dialect(dialect)
    return ctx


def print_module(module: Operation, generic: bool = False) -> str:
    """The text of `module` (or of any op: a function alone)."""
    out = io.StringIO()
    Printer(stream=out, print_generic_format=generic).print_op(module)
    return out.getvalue() + "\n"


def parse_module(text: str, source: str = "<input>") -> ModuleOp:
    """Parse IR text; a syntax error becomes an `LlmcError` naming `file:line:col`."""
    try:
        return Parser(context(), text, source).parse_module()
    except ParseError as e:
        lines = str(e).strip().splitlines()
        raise LlmcError(f"{lines[0].strip()}: {lines[-1].strip()}") from e
    except RecursionError:  # (xDSL's parser recurses per nested region or attribute: a crafted file, not llmc's IR)
        raise LlmcError(f"{source}: the IR is nested too deeply to parse") from None


def verify_module(module: ModuleOp) -> None:
    """Verify every op; a failure becomes an `LlmcError` with the verifier's message."""
    try:
        module.verify()
    except VerifyException as e:
        raise LlmcError(f"IR does not verify: {str(e).strip().splitlines()[0]}") from e
