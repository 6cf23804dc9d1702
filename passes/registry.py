"""Every pass by name, imported only when asked for (importing this module is cheap), and
`llmc opt -p`'s pass lists: names in order, each with options in xDSL's pipeline syntax,

    quantize{compute=a16},split{prefill_chunk=4 max_seq=16},group
"""

from __future__ import annotations

import importlib
import re

from xdsl.passes import ModulePass
from xdsl.utils.arg_spec import parse_pipeline
from xdsl.utils.exceptions import ArgSpecParseError

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
    "fuse-norm": ("llmc.passes.fuse_norm", "FuseNormPass"),
    "screen-logits": ("llmc.passes.screen_logits", "ScreenLogitsPass"),
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


def parse_passes(text: str) -> list[ModulePass]:
    """The passes of a pass list (`canonicalize, dce` or `split{max_seq=16},group`), options given or default."""
    text = re.sub(r"\s*,\s*", ",", text.strip())
    try:
        specs = list(parse_pipeline(text))
    except ArgSpecParseError as e:  # (a BaseException) "...\npass-pipeline:1:10\n<text>\n<caret>\nmessage"
        lines = str(e).splitlines()
        raise UsageError(f"pass list '{text}': {lines[-1].strip()} (column {lines[1].rsplit(':', 1)[-1]})") from None
    passes = []
    for spec in specs:
        try:
            passes.append(pass_class(spec.name).from_spec(spec))
        except ValueError as e:
            raise UsageError(f"pass '{spec}': {e}") from None
    return passes
