"""Every pass by name, imported only when asked for (importing this module is cheap)."""

from __future__ import annotations

from collections.abc import Callable

from xdsl.passes import ModulePass

from llmc.errors import UsageError


def _verify() -> type[ModulePass]:
    from llmc.passes.verify import VerifyPass

    return VerifyPass


def _canonicalize() -> type[ModulePass]:
    from llmc.passes.canonicalize import CanonicalizePass

    return CanonicalizePass


def _dce() -> type[ModulePass]:
    from llmc.passes.dce import DeadCodeEliminationPass

    return DeadCodeEliminationPass


PASSES: dict[str, Callable[[], type[ModulePass]]] = {
    "verify": _verify,
    "canonicalize": _canonicalize,
    "dce": _dce,
}


def get_pass(name: str) -> ModulePass:
    if name not in PASSES:
        raise UsageError(f"unknown pass '{name}' (passes: {', '.join(PASSES)})")
    return PASSES[name]()()
