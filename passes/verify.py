"""`verify`: check every op's verifier; fail with the op and the dimensions at fault."""

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass

from llmc.ir.text import verify_module


@dataclass(frozen=True)
class VerifyPass(ModulePass):
    name = "verify"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        verify_module(op)
