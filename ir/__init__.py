"""IR of llmc: the `llm` and `tgt` dialects, the weight store and the numpy references."""

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue

from llmc.errors import LlmcError


def named_operands(op: Operation) -> dict[str, SSAValue | None]:
    """An op's operands by the names its definition gives them, in definition order
    (None for an optional operand that is absent)."""
    return {name: getattr(op, name) for name, _ in op.get_irdl_definition().operands}


def entry_functions(module: ModuleOp) -> dict[str, func.FuncOp]:
    """The lowered entry points of `module` by stage (`llm.stage`: prefill, prefill_kv, decode, score)."""
    from xdsl.dialects.builtin import StringAttr

    out = {}
    for op in module.ops:
        if isinstance(op, func.FuncOp):
            stage = op.attributes.get("llm.stage")
            if not isinstance(stage, StringAttr):
                raise LlmcError(f"@{op.sym_name.data} is not a lowered entry point (run the phases through lower)")
            out[stage.data] = op
    return out


def find_function(module: ModuleOp, name: str) -> func.FuncOp:
    """The function `@name` of `module` (an entry point such as `@forward` or `@decode`)."""
    for op in module.ops:
        if isinstance(op, func.FuncOp) and op.sym_name.data == name:
            return op
    raise LlmcError(f"the module has no function @{name}")
