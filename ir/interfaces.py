"""Op interfaces: what an op means or becomes, registered next to the code that gives it.

An op's class holds its definition (operands, verifier, assembly format); each stage that
handles ops keeps its implementations in an `OpInterface` beside that code, as MLIR's
"external models" do: the `llm` interpreter's numpy meanings (`ir/interpreter.py`), the
`tgt` interpreter's (`ir/tgt_interpreter.py`), the lowering to `tgt`
(`passes/lower.py`), and one emitter table per backend (`backends/cpu/kernels.py`,
`backends/cuda/kernels.py`). An op a stage cannot handle on purpose is `refuse`d there
with the reason, so `tests/test_op_interfaces.py` tells an op that was forgotten from one
that is not meant to be there:

    semantics = OpInterface("llm interpreter", "numpy semantics")

    @semantics.implement(llm.RMSNormOp)
    def _rms_norm(op, env, x, w): ...

    semantics.lookup(op)(op, env, *values)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from xdsl.ir import Operation

from llmc.errors import LlmcError


@dataclass(frozen=True)
class Refusal:
    """An explicit "not here": the op exists, this stage does not take it; `why` ends the error's
    sentence ("yet; --target cpu compiles it")."""

    why: str


class OpInterface:
    """Implementations of one interface by op class. `name` is the stage (`lower`, `cpu`) and
    `what` the thing an op needs from it (`lowering`, `kernel emitter`), as errors say them:
    `cuda: no kernel for tgt.moe yet; --target cpu compiles it`."""

    def __init__(self, name: str, what: str):
        self.name = name
        self.what = what
        self._registry: dict[type[Operation], Callable | Refusal] = {}

    def implement(self, *op_classes: type[Operation]) -> Callable[[Callable], Callable]:
        """Decorator: `fn` implements this interface for each of `op_classes`."""

        def register(fn: Callable) -> Callable:
            for op_class in op_classes:
                self._registry[op_class] = fn
            return fn

        return register

    def refuse(self, op_class: type[Operation], why: str) -> None:
        """Record that this stage does not take `op_class`, and why (the end of the error's sentence)."""
        self._registry[op_class] = Refusal(why)

    def why_not(self, op_class: type[Operation]) -> str | None:
        """The one-line error for an op of `op_class` here (refused or missing); None when implemented."""
        found = self._registry.get(op_class)
        if found is None:
            return f"{self.name}: no {self.what} for {op_class.name}"
        return f"{self.name}: no {self.what} for {op_class.name} {found.why}" if isinstance(found, Refusal) else None

    def lookup(self, op: Operation) -> Callable:
        """The implementation for `op`'s class; an LlmcError when it is refused or missing."""
        error = self.why_not(type(op))
        if error is not None:
            raise LlmcError(error)
        return self._registry[type(op)]  # type: ignore[return-value]

    def implemented(self) -> frozenset[type[Operation]]:
        """The op classes with an implementation (not the refused ones)."""
        return frozenset(c for c, found in self._registry.items() if not isinstance(found, Refusal))

    def missing(self, op_classes: Iterable[type[Operation]]) -> list[str]:
        """The error of each of `op_classes` with neither an implementation nor a refusal."""
        return [f"{self.name}: no {self.what} for {c.name}" for c in op_classes if c not in self._registry]
