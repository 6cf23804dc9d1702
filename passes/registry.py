"""Every pass by name, imported only when asked for (importing this module is cheap)."""

from __future__ import annotations

import importlib

from xdsl.passes import ModulePass

from llmc.errors import UsageError

# name → (module, class): imported on first use
PASSES: dict[str, tuple[str, str]] = {
    "verify": ("llmc.passes.verify", "VerifyPass"),
    "canonicalize": ("llmc.passes.canonicalize", "CanonicalizePass"),
    "dce": ("llmc.passes.dce", "DeadCodeEliminationPass"),
    "quantize": ("llmc.passes.quantize", "QuantizePass"),
    "split": ("llmc.passes.split", "SplitPass"),
    "group": ("llmc.passes.group", "GroupPass"),
    "lower": ("llmc.passes.lower", "LowerPass"),
    "pack": ("llmc.passes.pack", "PackPass"),
    "plan-memory": ("llmc.passes.plan_memory", "PlanMemoryPass"),
}


def pass_class(name: str) -> type[ModulePass]:
    if name not in PASSES:
        raise UsageError(f"unknown pass '{name}' (passes: {', '.join(PASSES)})")
    module, cls = PASSES[name]
    return getattr(importlib.import_module(module), cls)


def get_pass(name: str) -> ModulePass:
    """A pass by name, with its default options."""
    return pass_class(name)()
