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


def _split() -> type[ModulePass]:
    from llmc.passes.split import SplitPass

    return SplitPass


def _group() -> type[ModulePass]:
    from llmc.passes.group import GroupPass

    return GroupPass


def _lower() -> type[ModulePass]:
    from llmc.passes.lower import LowerPass

    return LowerPass


def _plan_memory() -> type[ModulePass]:
    from llmc.passes.plan_memory import PlanMemoryPass

    return PlanMemoryPass


PASSES: dict[str, Callable[[], type[ModulePass]]] = {
    "verify": _verify,
    "canonicalize": _canonicalize,
    "dce": _dce,
    "split": _split,
    "group": _group,
    "lower": _lower,
    "plan-memory": _plan_memory,
}


def get_pass(name: str) -> ModulePass:
    if name not in PASSES:
        raise UsageError(f"unknown pass '{name}' (passes: {', '.join(PASSES)})")
    return PASSES[name]()()
