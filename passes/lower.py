"""`lower`: `llm` entry points → `tgt` kernels over explicit buffers.

Each `llm` value gets a buffer (`tgt.alloc`, placed later by `plan-memory`) sized for
the entry point's largest chunk; reshapes become views; the token positions become
`%start` (chunks are consecutive); the KV cache becomes the `%k_cache` / `%v_cache`
arguments in the layout `tgt.kv_layout`; logits are written to the `%logits` argument.
Groups recorded by `group` become fused kernels:

```mlir
// llm (grouped residual)                         // tgt
%o = llm.matmul %a, %wo {llm.group = "residual.7"}   tgt.matmul %a, %wo -> %x rows %n accumulate : ...
%x1 = llm.add %x, %o {llm.group = "residual.7"}      // %x1 is %x's buffer, updated in place
```
Weights are read as f32 here (the artifact stores them dequantized); a quantize phase
will choose other storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import (
    IndexType,
    IntegerAttr,
    ModuleOp,
    StringAttr,
    i32,
    i64,
)
from xdsl.ir import Block, Operation, Region, SSAValue

from llmc.errors import LlmcError
from llmc.ir import llm, tgt
from llmc.ir.llm import Storage
from llmc.passes.base import LlmcPass
from llmc.passes.group import group_of, single_user, users


@dataclass
class _Norm:
    """An RMSNorm fused into its consumers: they read `x` and normalize it themselves."""

    x: SSAValue
    weight: SSAValue
    eps: float


@dataclass
class _Lowering:
    block: Block
    rows: int
    n: SSAValue
    start: SSAValue
    k_cache: SSAValue
    v_cache: SSAValue
    logits: SSAValue
    buffers: dict[SSAValue, SSAValue] = field(default_factory=dict)
    norms: dict[SSAValue, _Norm] = field(default_factory=dict)
    weights: dict[str, SSAValue] = field(default_factory=dict)

    def emit(self, op: Operation) -> Operation:
        self.block.add_op(op)
        return op

    def alloc(self, value: SSAValue) -> SSAValue:
        shape = llm.shape_of(value)
        buf = self.emit(tgt.AllocOp((self.rows, *shape[1:]) if shape[0] is None else tuple(shape))).result
        buf.name_hint = value.name_hint
        self.buffers[value] = buf
        return buf

    def source(self, value: SSAValue) -> tuple[SSAValue, _Norm | None]:
        """The buffer a consumer reads for `value`, and the norm to apply when it is fused."""
        if value in self.norms:
            norm = self.norms[value]
            return self.buffers[norm.x], norm
        return self.buffers[value], None

    def weight(self, op: llm.WeightOp) -> None:
        if op.sym_name not in self.weights:
            shape = tuple(d for d in llm.shape_of(op.result) if d is not None)
            self.weights[op.sym_name] = self.emit(tgt.WeightOp(op.sym_name, Storage.F32, shape)).result
        self.buffers[op.result] = self.weights[op.sym_name]

    def matmul(self, x: SSAValue, w: SSAValue, out: SSAValue, *, bias: SSAValue | None = None,
               accumulate: bool = False, last_row: bool = False) -> None:
        xbuf, norm = self.source(x)
        self.emit(tgt.MatmulOp(
            xbuf, self.buffers[w], out, self.n,
            bias=self.buffers[bias] if bias is not None else None,
            norm=norm.weight if norm else None, eps=norm.eps if norm else None,
            accumulate=accumulate, last_row=last_row,
        ))


def _lower_op(lo: _Lowering, op: Operation) -> None:
    kind = group_of(op)
    if isinstance(op, llm.WeightOp):
        lo.weight(op)
    elif isinstance(op, llm.EmbeddingOp):
        lo.emit(tgt.EmbeddingOp(lo.buffers[op.tokens], lo.buffers[op.table], lo.alloc(op.result), lo.n))
    elif isinstance(op, llm.RMSNormOp):
        if kind is not None:
            lo.norms[op.result] = _Norm(op.input, lo.buffers[op.weight], op.eps.value.data)
        else:
            x, w = lo.buffers[op.input], lo.buffers[op.weight]
            lo.emit(tgt.RMSNormOp(x, w, lo.alloc(op.result), lo.n, op.eps.value.data))
    elif isinstance(op, llm.MatmulOp):
        if kind == "swiglu":
            return  # emitted with its `llm.mul`
        if kind == "residual":
            (add,) = users(op.result)
            assert isinstance(add, llm.AddOp)
            residual = add.rhs if add.lhs == op.result else add.lhs
            out = lo.buffers[residual]
            lo.buffers[add.result] = out
            lo.matmul(op.input, op.weight, out, bias=op.bias, accumulate=True)
        else:
            lo.matmul(op.input, op.weight, lo.alloc(op.result), bias=op.bias)
    elif isinstance(op, llm.SiluOp):
        if kind != "swiglu":
            lo.emit(tgt.SiluOp(lo.buffers[op.input], lo.alloc(op.result), lo.n))
    elif isinstance(op, llm.MulOp):
        if kind == "swiglu":
            silu, up = op.lhs.owner, op.rhs.owner
            assert isinstance(silu, llm.SiluOp) and isinstance(up, llm.MatmulOp)
            gate = silu.input.owner
            assert isinstance(gate, llm.MatmulOp)
            x, norm = lo.source(gate.input)
            lo.emit(tgt.SwigluOp(x, lo.buffers[gate.weight], lo.buffers[up.weight], lo.alloc(op.result), lo.n,
                                 norm=norm.weight if norm else None, eps=norm.eps if norm else None))
        else:
            lo.emit(tgt.MulOp(lo.buffers[op.lhs], lo.buffers[op.rhs], lo.alloc(op.result), lo.n))
    elif isinstance(op, llm.AddOp):
        if kind != "residual":
            lo.emit(tgt.AddOp(lo.buffers[op.lhs], lo.buffers[op.rhs], lo.alloc(op.result), lo.n))
    elif isinstance(op, llm.ReshapeOp):
        shape = llm.shape_of(op.result)
        view = lo.emit(tgt.ViewOp(lo.buffers[op.input], (lo.rows if shape[0] is None else shape[0], *shape[1:])))
        view.result.name_hint = op.result.name_hint
        lo.buffers[op.result] = view.result
    elif isinstance(op, llm.RopeOp):
        # in place: the rotated value takes over its input's buffer
        if single_user(op.input) is not op:
            raise LlmcError(f"lower: the input of {op.name} has other users; in-place RoPE would change them")
        lo.buffers[op.result] = lo.buffers[op.input]
        if kind != "attention":
            lo.emit(tgt.RopeOp(lo.buffers[op.input], lo.n, lo.start, op.theta.value.data))
    elif isinstance(op, llm.AttentionOp):
        theta = None
        if kind == "attention":
            rope = op.query.owner
            assert isinstance(rope, llm.RopeOp)
            theta = rope.theta.value.data
        lo.emit(tgt.AttentionOp(
            lo.buffers[op.query], lo.buffers[op.key], lo.buffers[op.value], lo.k_cache, lo.v_cache,
            lo.alloc(op.result), lo.n, lo.start, op.layer.value.data, theta,
        ))
    elif isinstance(op, llm.LastTokenOp):
        if op.input in lo.norms:
            lo.norms[op.result] = lo.norms[op.input]
        else:
            lo.buffers[op.result] = lo.buffers[op.input]
    elif isinstance(op, llm.LogitsOp):
        last_row = isinstance(op.input.owner, llm.LastTokenOp)
        lo.matmul(op.input, op.weight, lo.logits, last_row=last_row)
    elif isinstance(op, func.ReturnOp):
        lo.emit(func.ReturnOp())
    else:
        raise LlmcError(f"lower: no lowering for {op.name}")


def lower_function(function: func.FuncOp) -> func.FuncOp:
    stage = function.attributes["llm.stage"]
    max_tokens = function.attributes["llm.max_tokens"]
    assert isinstance(max_tokens, IntegerAttr)
    rows = max_tokens.value.data
    tokens_arg, _, kv_arg = function.body.block.args
    kv = kv_arg.type
    assert isinstance(kv, llm.KVCacheType)
    (logits_type,) = function.function_type.outputs.data
    cache = tgt.memref(*kv.shape)
    block = Block(arg_types=[
        tgt.memref(rows, element_type=i32), IndexType(), IndexType(), cache, cache,
        tgt.memref(*(d for d in llm.shape_of(logits_type) if d is not None)),
    ])
    for arg, name in zip(block.args, ("tokens", "n", "start", "k_cache", "v_cache", "logits")):
        arg.name_hint = name
    tokens, n, start, k_cache, v_cache, logits = block.args
    lo = _Lowering(block, rows, n, start, k_cache, v_cache, logits)
    lo.buffers[tokens_arg] = tokens
    for op in function.body.block.ops:
        _lower_op(lo, op)
    lowered = func.FuncOp(function.sym_name.data, (block.arg_types, []), Region(block))
    lowered.attributes |= {
        "llm.stage": stage,
        "tgt.max_tokens": IntegerAttr(rows, i64),
        "tgt.kv_layout": StringAttr(tgt.KV_LAYOUT),
    }
    return lowered


@dataclass(frozen=True)
class LowerPass(LlmcPass):
    name = "lower"
    requires_phase = "split"

    def run(self, ctx: Context, module: ModuleOp) -> None:
        for function in self.functions(module):
            lowered = lower_function(function)
            module.body.block.insert_op_before(lowered, function)
            module.body.block.erase_op(function)
