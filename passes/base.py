"""What every llmc pass shares: the phase order, the phase check, finding functions.

A module records the last phase it went through (`llm.phase`); a pass that needs IR of
a later phase refuses an earlier one with a message that says which phase to run:

    llmc: error: pass 'lower' needs IR after phase 'group'; this module is at phase 'optimize'

and a pass that takes IR up to a phase (`last_phase`) refuses a later one:

    llmc: error: pass 'lower' needs IR of phase 'group' at the latest; this module is at phase 'lower' (the pass ran on it already)
"""

from __future__ import annotations

from typing import ClassVar

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.passes import ModulePass

from llmc.errors import LlmcError

PHASE_ORDER = ("import", "optimize", "quantize", "split", "group", "lower")


def module_phase(module: ModuleOp) -> str | None:
    attr = module.attributes.get("llm.phase")
    return attr.data if isinstance(attr, StringAttr) else None


class LlmcPass(ModulePass):
    """A module pass that checks the module's phase before running."""

    requires_phase: ClassVar[str | None] = None
    last_phase: ClassVar[str | None] = None  # the latest phase whose IR the pass takes (None: any)

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        phase = module_phase(op)
        if phase is not None and phase not in PHASE_ORDER:
            raise LlmcError(f"this module's phase '{phase}' (llm.phase) is not one of llmc's: {', '.join(PHASE_ORDER)}")
        if self.requires_phase and (phase is None or PHASE_ORDER.index(phase) < PHASE_ORDER.index(self.requires_phase)):
            raise LlmcError(f"pass '{self.name}' needs IR after phase '{self.requires_phase}'; this module "
                            + ("records no phase (llm.phase)" if phase is None else f"is at phase '{phase}'"))
        if self.last_phase and phase in PHASE_ORDER and PHASE_ORDER.index(phase) > PHASE_ORDER.index(self.last_phase):
            raise LlmcError(f"pass '{self.name}' needs IR of phase '{self.last_phase}' at the latest; this module "
                            f"is at phase '{phase}' (the pass ran on it already)")
        self.run(ctx, op)

    def run(self, ctx: Context, module: ModuleOp) -> None:
        raise NotImplementedError

    @staticmethod
    def functions(module: ModuleOp) -> list[func.FuncOp]:
        return [op for op in module.ops if isinstance(op, func.FuncOp)]
