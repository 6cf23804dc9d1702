"""`group`: rewrite chains of ops that should share a kernel into fused `llm` ops.

Each fused op becomes one `tgt` kernel in `lower`, which then matches one op at a time:

| chain                                         | fused op                                   |
|-----------------------------------------------|--------------------------------------------|
| `mul(silu(matmul(h, wg)), matmul(h, wu))`     | `llm.swiglu %h, %wg, %wu` (any activation) |
| `rope(q)`, `rope(k)` into `attention`         | `llm.attention ... rope <theta …>`         |
| `add(x, matmul(a, w))`, x dead after the add  | `llm.matmul %a, %w residual %x` (in place) |
| `rms_norm(x)` read only by `a32` projections  | `norm %g eps E` on each of them            |

```mlir
// before                                               // after
%g = llm.matmul %h, %wg compute a8 : ...                 %a = llm.swiglu %h, %wg, %wu compute a8 : ...
%s = llm.silu %g : tensor<?x1536xf32>
%u = llm.matmul %h, %wu compute a8 : ...
%a = llm.mul %s, %u : tensor<?x1536xf32>
```
An RMSNorm read by `a8` projections stays: `lower` makes it write quantized rows once
for all its readers. Every fused op has numpy semantics, so grouped IR still runs in
the `llm` interpreter. `--no-group` skips this pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, Operation, SSAValue

from llmc.ir import llm
from llmc.ir.activations import activation_of
from llmc.passes.base import LlmcPass


def users(value: SSAValue) -> list[Operation]:
    return [use.operation for use in value.uses]


def single_user(value: SSAValue) -> Operation | None:
    found = users(value)
    return found[0] if len(found) == 1 else None


def _replace(block: Block, old: Operation, new: Operation, *dead: Operation) -> None:
    """Put `new` where `old` is, give it `old`'s uses and name, erase `old` and `dead` (in order)."""
    block.insert_op_before(new, old)
    new.results[0].name_hint = old.results[0].name_hint
    old.results[0].replace_all_uses_with(new.results[0])
    for op in (old, *dead):
        block.erase_op(op)


def fuse_swiglu(block: Block, mul: llm.MulOp) -> None:
    act, up = mul.lhs.owner, mul.rhs.owner  # silu, or another activation (gelu_tanh: GeGLU)
    if not (isinstance(act, tuple(llm.ACTIVATION_OPS.values())) and isinstance(up, llm.MatmulOp)):
        return
    gate = act.input.owner
    if not isinstance(gate, llm.MatmulOp) or gate.input != up.input or gate.mode is not up.mode:
        return
    if any(m.bias or m.norm or m.residual for m in (gate, up)):
        return
    if not (single_user(gate.result) is act and single_user(act.result) is mul and single_user(up.result) is mul):
        return
    fused = llm.SwigluOp(gate.input, gate.weight, up.weight, compute=gate.mode, activation=act.ACTIVATION)
    _replace(block, mul, fused, act, gate, up)


def fuse_rope(block: Block, attention: llm.AttentionOp) -> None:
    ropes = [attention.query.owner, attention.key.owner]
    if attention.rope is not None or not all(
            isinstance(r, llm.RopeOp) and single_user(r.result) is attention and r.positions == attention.positions
            for r in ropes):
        return
    q_rope, k_rope = ropes
    if q_rope.rope != k_rope.rope:
        return
    fused = llm.AttentionOp(q_rope.input, k_rope.input, attention.value, attention.positions, attention.kv_cache,
                            attention.layer.value.data, rope=q_rope.rope, slots=attention.slots, **attention.options)
    _replace(block, attention, fused, q_rope, k_rope)


def _views(value: SSAValue) -> set[SSAValue]:
    """`value` and every value that shares its buffer after lowering (reshapes, last_token)."""
    out = {value}
    for op in users(value):
        if isinstance(op, (llm.ReshapeOp, llm.LastTokenOp)):
            out |= _views(op.result)
    return out


def fuse_residual(block: Block, add: llm.AddOp, index: dict[Operation, int]) -> None:
    for residual, update in ((add.lhs, add.rhs), (add.rhs, add.lhs)):
        matmul = update.owner
        if not isinstance(matmul, llm.MatmulOp) or matmul.residual is not None or single_user(update) is not add:
            continue
        source = residual.owner
        if not isinstance(source, Operation) or isinstance(source, llm.WeightOp):
            continue  # a function argument or a weight cannot be updated in place
        shared = _views(residual)
        if matmul.input in shared:
            continue  # the matmul would overwrite the rows it reads (a parallel-residual block)
        readers = [u for v in shared for u in users(v) if u is not add and u.results[0] not in shared]
        if any(index[u] > index[add] for u in readers):
            continue  # read after the add: the in-place update would change what it reads
        fused = llm.MatmulOp(matmul.input, matmul.weight, matmul.bias, residual=residual, compute=matmul.mode)
        index[fused] = index[add]
        _replace(block, add, fused, matmul)
        return


def _normalized_readers(norm: llm.RMSNormOp) -> list[tuple[Operation, Operation]] | None:
    """`(reader, projection)` pairs when every reader is an `a32` projection of the norm
    (directly, or through `llm.last_token`); None otherwise."""
    pairs = []
    for reader in users(norm.result):
        projection = reader
        if isinstance(reader, llm.LastTokenOp):
            projection = single_user(reader.result)
        if not (isinstance(projection, llm.Projection) and projection.mode is llm.Compute.A32
                and projection.norm is None and projection.input in (norm.result, reader.results[0])):
            return None
        pairs.append((reader, projection))
    return pairs or None


def fuse_norm(block: Block, norm: llm.RMSNormOp) -> None:
    pairs = _normalized_readers(norm)
    if pairs is None:
        return
    eps = norm.eps.value.data
    for reader, projection in pairs:
        if reader is not projection:  # last_token of the norm: take the last row of its input instead
            last = llm.LastTokenOp(norm.input)
            _replace(block, reader, last)
            source = last.result
        else:
            source = norm.input
        _replace(block, projection, _with_norm(projection, source, norm.weight, eps))
    block.erase_op(norm)


def _with_norm(op: Operation, x: SSAValue, g: SSAValue, eps: float) -> Operation:
    if isinstance(op, llm.MatmulOp):
        return llm.MatmulOp(x, op.weight, op.bias, norm=g, eps=eps, residual=op.residual, compute=op.mode)
    if isinstance(op, llm.SwigluOp):
        return llm.SwigluOp(x, op.gate, op.up, norm=g, eps=eps, compute=op.mode, activation=activation_of(op))
    assert isinstance(op, llm.LogitsOp)
    return llm.LogitsOp(x, op.weight, norm=g, eps=eps, compute=op.mode, softcap=op.cap)


def group_function(function: func.FuncOp) -> None:
    block = function.body.block
    for op in list(block.ops):
        if isinstance(op, llm.MulOp):
            fuse_swiglu(block, op)
    for op in list(block.ops):
        if isinstance(op, llm.AttentionOp):
            fuse_rope(block, op)
    for op in list(block.ops):  # before residuals: a fused norm reads its input where the norm stood
        if isinstance(op, llm.RMSNormOp):
            fuse_norm(block, op)
    index = {op: i for i, op in enumerate(block.ops)}
    for op in list(block.ops):
        if isinstance(op, llm.AddOp):
            fuse_residual(block, op, index)


@dataclass(frozen=True)
class GroupPass(LlmcPass):
    name = "group"
    requires_phase = "split"

    def run(self, ctx: Context, module: ModuleOp) -> None:
        for function in self.functions(module):
            group_function(function)
