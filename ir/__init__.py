"""IR of llmc: the `llm` and `tgt` dialects, the weight store and the numpy references."""

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp

from llmc.errors import LlmcError


def find_function(module: ModuleOp, name: str) -> func.FuncOp:
    """The function `@name` of `module` (an entry point such as `@forward` or `@decode`)."""
    for op in module.ops:
        if isinstance(op, func.FuncOp) and op.sym_name.data == name:
            return op
    raise LlmcError(f"the module has no function @{name}")
