"""`verify`: check every op's verifier; fail with the op and the dimensions at fault."""

from dataclasses import dataclass

from llmc.ir.text import verify_module
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass


@dataclass(frozen=True)
class VerifyPass(ModulePass):
    name = "verify"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        verify_module(op)
