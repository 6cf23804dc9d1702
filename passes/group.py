"""`group`: partition each entry point into fusion groups, each to become one kernel or a few.

A group is recorded on its member ops as `llm.group = "<kind>.<n>"`, so dumps show it:

| kind        | members                                              | becomes                         |
|-------------|------------------------------------------------------|---------------------------------|
| `norm_proj` | `rms_norm` + the matmuls that read it (Q, K, V)      | matmuls with a norm prologue    |
| `swiglu`    | `rms_norm`? + gate and up matmuls + `silu` + `mul`   | one `tgt.swiglu`                |
| `attention` | `rope` of Q and K + `attention`                      | attention with RoPE and KV write|
| `residual`  | matmul + the `add` of its result to the residual     | matmul accumulating in place    |
| `head`      | final `rms_norm` + `last_token` + `logits`           | last-row matmul with norm       |

```mlir
%l0_attn_in = llm.rms_norm %x, %w eps 1.000000e-05 {llm.group = "norm_proj.0"} : ...
%l0_q = llm.matmul %l0_attn_in, %wq {llm.group = "norm_proj.0"} : ...
```
Grouping only records decisions that are legal (single uses, a residual that is dead
after its add); `lower` turns them into fused kernels. `--no-group` skips this pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.ir import Operation, SSAValue

from llmc.ir import llm
from llmc.passes.base import LlmcPass

GROUP = "llm.group"


def users(value: SSAValue) -> list[Operation]:
    return [use.operation for use in value.uses]


def group_of(op: Operation) -> str | None:
    """The kind of `op`'s group (`"swiglu"`, …), or None when it is not grouped."""
    attr = op.attributes.get(GROUP)
    return attr.data.split(".")[0] if isinstance(attr, StringAttr) else None


def single_user(value: SSAValue) -> Operation | None:
    found = users(value)
    return found[0] if len(found) == 1 else None


class _Grouper:
    def __init__(self, function: func.FuncOp):
        self.ops = list(function.body.block.ops)
        self.index = {op: i for i, op in enumerate(self.ops)}
        self.count = 0

    def free(self, *ops: Operation) -> bool:
        return all(GROUP not in op.attributes for op in ops)

    def mark(self, kind: str, *ops: Operation) -> None:
        name = StringAttr(f"{kind}.{self.count}")
        self.count += 1
        for op in ops:
            op.attributes[GROUP] = name

    def swiglu(self, mul: llm.MulOp) -> None:
        silu, up = mul.lhs.owner, mul.rhs.owner
        if not (isinstance(silu, llm.SiluOp) and isinstance(up, llm.MatmulOp)):
            return
        gate = silu.input.owner
        if not (isinstance(gate, llm.MatmulOp) and gate.input == up.input and gate.bias is None and up.bias is None):
            return
        if not (single_user(gate.result) is silu and single_user(silu.result) is mul and single_user(up.result) is mul):
            return
        members: list[Operation] = [gate, up, silu, mul]
        norm = gate.input.owner
        if isinstance(norm, llm.RMSNormOp) and set(users(norm.result)) == {gate, up}:
            members.insert(0, norm)
        if self.free(*members):
            self.mark("swiglu", *members)

    def norm_proj(self, norm: llm.RMSNormOp) -> None:
        readers = users(norm.result)
        if readers and all(isinstance(r, llm.MatmulOp) for r in readers) and self.free(norm, *readers):
            self.mark("norm_proj", norm, *readers)

    def head(self, logits: llm.LogitsOp) -> None:
        members: list[Operation] = [logits]
        source = logits.input.owner
        if isinstance(source, llm.LastTokenOp) and single_user(source.result) is logits:
            members.append(source)
            source = source.input.owner
        if isinstance(source, llm.RMSNormOp) and single_user(source.result) is members[-1]:
            members.append(source)
        if len(members) > 1 and self.free(*members):
            self.mark("head", *reversed(members))

    def attention(self, attention: llm.AttentionOp) -> None:
        ropes = [attention.query.owner, attention.key.owner]
        if all(isinstance(r, llm.RopeOp) and single_user(r.result) is attention for r in ropes):
            if self.free(attention, *ropes):
                self.mark("attention", *ropes, attention)

    def residual(self, add: llm.AddOp) -> None:
        for residual, update in ((add.lhs, add.rhs), (add.rhs, add.lhs)):
            matmul = update.owner
            if not isinstance(matmul, llm.MatmulOp) or single_user(matmul.result) is not add:
                continue
            if not isinstance(residual.owner, Operation) or isinstance(residual.owner, llm.WeightOp):
                continue  # a function argument or a weight cannot be updated in place
            later = [u for u in users(residual) if u is not add and self.index[u] > self.index[add]]
            if not later and self.free(matmul, add):
                self.mark("residual", matmul, add)
                return


@dataclass(frozen=True)
class GroupPass(LlmcPass):
    name = "group"
    requires_phase = "split"

    def run(self, ctx: Context, module: ModuleOp) -> None:
        for function in self.functions(module):
            g = _Grouper(function)
            for kind, handler in (
                (llm.MulOp, g.swiglu),
                (llm.LogitsOp, g.head),
                (llm.RMSNormOp, g.norm_proj),
                (llm.AttentionOp, g.attention),
                (llm.AddOp, g.residual),
            ):
                for op in g.ops:
                    if isinstance(op, kind):
                        handler(op)
