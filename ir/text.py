"""IR text: the context of llmc's dialects, printing and parsing.

Printing and parsing are for dumps, tests and `llmc opt`; the compiler keeps modules in
memory between passes.
"""

from __future__ import annotations

import io
import math
import re

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


MAX_CONSTANT_ELEMENTS = 1 << 24  # a dense constant's elements in IR text (xDSL holds a splat's every element)
_DENSE = re.compile(r"dense<[^>]*>\s*:\s*tensor<((?:\d+x)+)")


def parse_module(text: str, source: str = "<input>") -> ModuleOp:
    """Parse IR text; a syntax error becomes an `LlmcError` naming `file:line:col`, and so does a dense
    constant of more than `MAX_CONSTANT_ELEMENTS` (`dense<1.0> : tensor<100000x1000xf32>`: 30 bytes of
    text, 400 MB as xDSL parses it), which llmc's IR never holds: large tensors are `llm.weight`s."""
    for match in _DENSE.finditer(text):
        elements = math.prod(int(d) for d in match.group(1)[:-1].split("x"))
        if elements > MAX_CONSTANT_ELEMENTS:
            raise LlmcError(f"{source}:{text.count(chr(10), 0, match.start()) + 1}: a dense constant of {elements} "
                            f"elements, more than the {MAX_CONSTANT_ELEMENTS} llmc's IR holds (large tensors are "
                            f"llm.weight ops)")
    try:
        return Parser(context(), text, source).parse_module()
    except ParseError as e:
        lines = str(e).strip().splitlines()
        raise LlmcError(f"{lines[0].strip()}: {lines[-1].strip()}") from e
    except VerifyException as e:  # (an attribute or type checks itself as it is built: `!llm.kv_cache<…>` 0 slots)
        raise LlmcError(f"{source}: {_reason(e)}") from e
    except RecursionError:  # (xDSL's parser recurses per nested region or attribute: a crafted file, not llmc's IR)
        raise LlmcError(f"{source}: the IR is nested too deeply to parse") from None


def _reason(e: VerifyException) -> str:
    """A verifier's message on one line: its first, and the next where the first only introduces it
    ("operand 'source' at position 0 does not verify:"), not the IR it prints after."""
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    if not lines:
        return "invalid"
    return f"{lines[0]} {lines[1]}" if lines[0].endswith(":") and len(lines) > 1 else lines[0]


def verify_module(module: ModuleOp) -> None:
    """Verify every op; a failure becomes an `LlmcError` with the verifier's message."""
    try:
        module.verify()
    except VerifyException as e:
        raise LlmcError(f"IR does not verify: {_reason(e)}") from e
