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
    "refine-shapes": ("llmc.passes.refine_shapes", "RefineShapesPass"),
    "raise-embedding": ("llmc.passes.raise_embedding", "RaiseEmbeddingPass"),
    "raise-linear": ("llmc.passes.raise_linear", "RaiseLinearPass"),
    "raise-rms-norm": ("llmc.passes.raise_rms_norm", "RaiseRmsNormPass"),
    "raise-swiglu": ("llmc.passes.raise_swiglu", "RaiseSwigluPass"),
    "raise-rope": ("llmc.passes.raise_rope", "RaiseRopePass"),
    "raise-attention": ("llmc.passes.raise_attention", "RaiseAttentionPass"),
    "raise-lm-head": ("llmc.passes.raise_lm_head", "RaiseLmHeadPass"),
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
