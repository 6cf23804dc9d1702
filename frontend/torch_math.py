"""ATen ops that compute: arithmetic, comparisons, logic, activations, reductions, softmax,
`where`, and the model-level ops the exported training IR keeps whole (`aten.embedding`,
`aten.linear`, `aten.scaled_dot_product_attention`), each mapped to `llm` primitive ops:

```mlir
%1 = llm.transpose %lm_head_weight axes [1, 0] : (tensor<64x32xf32>) -> tensor<32x64xf32>   // aten.linear
%linear_7 = llm.batch_matmul %mul_17, %1 : (tensor<1x?x32xf32>, tensor<32x64xf32>) -> tensor<1x?x64xf32>
```
"""

from __future__ import annotations

import math
import operator

import numpy as np
import torch
from torch import fx
from xdsl.dialects.builtin import IntegerType, TensorType, i1, i64
from xdsl.ir import SSAValue

from llmc.frontend.graph import registrar
from llmc.frontend.torch_importer import SLICE_END, AtenMapping, ProgramImporter, axis_index
from llmc.ir import llm

aten = torch.ops.aten
ATEN: dict[object, AtenMapping] = {}  # ATen op (overload or packet) or Python operator → its mapping
_maps = registrar(ATEN)


def _binary(op_type: type, boolean: bool = False) -> AtenMapping:
    def mapping(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
        dtype = im.promoted(a[0], a[1]) if boolean else im.dtype(node)
        lhs, rhs = im.tensor(a[0], dtype), im.tensor(a[1], dtype)
        if a.get("alpha") not in (None, 1):
            rhs = im.add(llm.MulOp(rhs, im.const(a["alpha"], dtype)))
        return im.add(op_type(lhs, rhs, im.type_of(node)))

    return mapping


def _logical(op_type: type, bitwise: bool = False) -> AtenMapping:
    """`logical_*` of any tensors (nonzero is true); bitwise ops of booleans only."""
    def mapping(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
        boolean = np.dtype(np.bool_)
        if bitwise and im.dtype(node) != boolean:
            raise im.fail(node, "is a bitwise operation on integers, which llmc does not import")
        return im.add(op_type(im.tensor(a[0], boolean), im.tensor(a[1], boolean), im.type_of(node)))

    return mapping


for _packets, _op in (
    ((aten.add, operator.add), llm.AddOp), ((aten.sub, operator.sub), llm.SubOp),
    ((aten.mul, operator.mul), llm.MulOp), ((aten.maximum,), llm.MaximumOp), ((aten.minimum,), llm.MinimumOp),
    ((aten.remainder, operator.mod), llm.ModOp), ((aten.pow,), llm.PowOp),
):
    _maps(*_packets)(_binary(_op))
for _packets, _op in (
    ((aten.eq,), llm.EqualOp), ((aten.lt,), llm.LessOp), ((aten.le,), llm.LessEqualOp), ((aten.gt,), llm.GreaterOp),
    ((aten.ge,), llm.GreaterEqualOp),
):
    _maps(*_packets)(_binary(_op, boolean=True))
for _logical_op, _bitwise_ops, _op in (
    (aten.logical_and, (aten.bitwise_and, aten.__and__), llm.AndOp),
    (aten.logical_or, (aten.bitwise_or, aten.__or__), llm.OrOp),
    (aten.logical_xor, (aten.bitwise_xor, aten.__xor__), llm.XorOp),
):
    _maps(_logical_op)(_logical(_op))
    _maps(*_bitwise_ops)(_logical(_op, bitwise=True))


@_maps(aten.rsub)
def _rsub(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    """`other - alpha · self`."""
    dtype = im.dtype(node)
    x = im.tensor(a[0], dtype)
    if a.get("alpha") not in (None, 1):
        x = im.add(llm.MulOp(x, im.const(a["alpha"], dtype)))
    return im.add(llm.SubOp(im.tensor(a[1], dtype), x, im.type_of(node)))


@_maps(aten.ne)
def _not_equal(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    return im.add(llm.NotOp(_binary(llm.EqualOp, boolean=True)(im, node, a)))


def _floor_divide(im: ProgramImporter, lhs: SSAValue, rhs: SSAValue, result: TensorType) -> SSAValue:
    """`⌊a / b⌋`: floats through `llm.floor`; integers as `(a - a mod b) / b`, which divides exactly."""
    if isinstance(result.element_type, IntegerType):
        exact = im.add(llm.SubOp(lhs, im.add(llm.ModOp(lhs, rhs, result)), result))
        return im.add(llm.DivOp(exact, rhs, result))
    return im.add(llm.FloorOp(im.add(llm.DivOp(lhs, rhs, result))))


@_maps(aten.div, aten.floor_divide, operator.floordiv)
def _div(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    dtype, result = im.dtype(node), im.type_of(node)
    lhs, rhs = im.tensor(a[0], dtype), im.tensor(a[1], dtype)
    mode = "floor" if node.target in (aten.floor_divide.default, aten.floor_divide.Scalar, operator.floordiv) \
        else a.get("rounding_mode")
    if mode == "floor":
        return _floor_divide(im, lhs, rhs, result)
    quotient = im.add(llm.DivOp(lhs, rhs, result))
    if mode == "trunc" and not np.issubdtype(dtype, np.integer):
        negative = im.add(llm.LessOp(quotient, im.const(0, dtype)))
        return im.add(llm.WhereOp(negative, im.add(llm.CeilOp(quotient)), im.add(llm.FloorOp(quotient))))
    return quotient


@_maps(torch.sym_max, torch.sym_min)
def _sym_extreme(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    op_type = llm.MaximumOp if node.target is torch.sym_max else llm.MinimumOp
    i64 = np.dtype(np.int64)
    return im.add(op_type(im.tensor(a[0], i64), im.tensor(a[1], i64)))


@_maps(operator.neg)
def _sym_neg(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    return im.add(llm.NegOp(im.tensor(a[0], np.dtype(np.int64))))


def _unary(op_type: type) -> AtenMapping:
    def mapping(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
        return im.add(op_type(im.tensor(a[0], im.dtype(node))))

    return mapping


for _packets, _op in (
    ((aten.neg,), llm.NegOp), ((aten.abs,), llm.AbsOp), ((aten.sqrt,), llm.SqrtOp), ((aten.rsqrt,), llm.RsqrtOp),
    ((aten.reciprocal,), llm.ReciprocalOp), ((aten.exp,), llm.ExpOp), ((aten.log,), llm.LogOp),
    ((aten.tanh,), llm.TanhOp), ((aten.cos,), llm.CosOp), ((aten.sin,), llm.SinOp), ((aten.erf,), llm.ErfOp),
    ((aten.sigmoid,), llm.SigmoidOp), ((aten.relu,), llm.ReluOp), ((aten.floor,), llm.FloorOp),
    ((aten.ceil,), llm.CeilOp), ((aten.silu,), llm.SiluOp), ((aten.logical_not, aten.bitwise_not), llm.NotOp),
):
    _maps(*_packets)(_unary(_op))


@_maps(aten.isnan)
def _isnan(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    return im.add(llm.IsNanOp(im.tensor(a[0]), im.type_of(node)))


@_maps(aten.gelu)
def _gelu(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    tanh = a["approximate"] == "tanh"
    return im.add(llm.ACTIVATION_OPS[llm.Activation.GELU_TANH if tanh else llm.Activation.GELU](im.tensor(a["self"])))


@_maps(aten.alias, aten.clone, aten.contiguous, aten.detach, aten.detach_, aten.lift_fresh_copy, aten._to_copy, aten.to,
       aten.type_as)
def _convert(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    """Copies, aliases and `.to(…)`: the value itself, cast where the dtype changes."""
    return im.cast_to(node, im.tensor(a[0]))


@_maps(aten.dropout)
def _dropout(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    if a["train"]:
        raise im.fail(node, "is a dropout in training mode (export the model after .eval())")
    return im.tensor(a["input"])


@_maps(aten.embedding)
def _embedding(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    return im.add(llm.GatherOp(im.tensor(a["weight"]), im.tensor(a["indices"]), 0, im.type_of(node)))


@_maps(aten.linear)
def _linear(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    """`x · Wᵀ (+ b)` as `batch_matmul(x, transpose[1, 0](W))`, the shape `optimize` raises."""
    weight = im.add(llm.TransposeOp(im.tensor(a["weight"]), (1, 0)))
    y = im.add(llm.BatchMatmulOp(im.tensor(a["input"]), weight, im.type_of(node)))
    if a["bias"] is None:
        return y
    return im.add(llm.AddOp(y, im.tensor(a["bias"]), im.type_of(node)))


@_maps(aten.mm, aten.bmm, aten.matmul)
def _matmul(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    dtype = im.dtype(node)
    return im.add(llm.BatchMatmulOp(im.tensor(a[0], dtype), im.tensor(a[1], dtype), im.type_of(node)))


def _reduce(op_type: type, boolean: bool = False) -> AtenMapping:
    def mapping(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
        x = im.tensor(a[0], np.dtype(np.bool_) if boolean else im.dtype(node))
        rank = len(llm.shape_of(x))
        dims = a.get("dim")
        if dims is None or dims == []:
            dims = range(rank)
        elif isinstance(dims, int):
            dims = [dims]
        keep = bool(a.get("keepdim", False))
        return im.add(op_type(x, [axis_index(d, rank) for d in dims], keep, im.type_of(node)))

    return mapping


_maps(aten.mean)(_reduce(llm.ReduceMeanOp))
_maps(aten.sum)(_reduce(llm.ReduceSumOp))
_maps(aten.amax)(_reduce(llm.ReduceMaxOp))
_maps(aten.amin)(_reduce(llm.ReduceMinOp))
_maps(aten.prod)(_reduce(llm.ReduceProdOp))
_maps(aten.any)(_reduce(llm.ReduceMaxOp, boolean=True))
_maps(aten.all)(_reduce(llm.ReduceMinOp, boolean=True))


@_maps(aten.softmax, aten._softmax)
def _softmax(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    return im.add(llm.SoftmaxOp(im.tensor(a[0], im.dtype(node)), a[1]))


@_maps(aten.cumsum)
def _cumsum(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    return im.add(llm.CumsumOp(im.tensor(a["self"], im.dtype(node)), a["dim"]))


@_maps(aten.diff)
def _diff(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    """`x[1:] - x[:-1]` along `dim` of `cat(prepend, x, append)` (xor for booleans)."""
    if a["n"] != 1:
        raise im.fail(node, f"is a diff of order {a['n']}, which llmc does not import")
    dtype, result = im.dtype(node), im.type_of(node)
    parts = [im.tensor(a[k], dtype) for k in ("prepend", "self", "append") if a[k] is not None]
    axis = axis_index(a["dim"], len(llm.shape_of(parts[0])))
    x = im.add(llm.ConcatOp(parts, axis)) if len(parts) > 1 else parts[0]
    axes, steps = im.const([axis], np.int64), im.const([1], np.int64)
    hi = im.add(llm.SliceOp(x, im.const([1], np.int64), im.const([SLICE_END], np.int64), axes, steps, result))
    lo = im.add(llm.SliceOp(x, im.const([0], np.int64), im.const([-1], np.int64), axes, steps, result))
    return im.add((llm.XorOp if dtype == np.bool_ else llm.SubOp)(hi, lo, result))


@_maps(aten.where)
def _where(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    dtype = im.dtype(node)
    condition = im.tensor(a["condition"], np.dtype(np.bool_))
    return im.add(llm.WhereOp(condition, im.tensor(a["self"], dtype), im.tensor(a["other"], dtype),
                              im.type_of(node)))


@_maps(aten.masked_fill)
def _masked_fill(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    dtype = im.dtype(node)
    mask = im.tensor(a["mask"], np.dtype(np.bool_))
    return im.add(llm.WhereOp(mask, im.tensor(a["value"], dtype), im.tensor(a["self"], dtype), im.type_of(node)))


@_maps(aten.scaled_dot_product_attention)
def _attention(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    """`softmax(q·kᵀ·scale + mask)·v`; a boolean mask adds 0 or -inf, `is_causal` keeps the lower
    triangle, and with `enable_gqa` each key/value head serves `heads / kv_heads` query heads."""
    if a["dropout_p"]:
        raise im.fail(node, "is an attention with dropout (export the model after .eval())")
    q, k, v = (im.tensor(a[n]) for n in ("query", "key", "value"))
    dtype = im.dtype(node)
    qs, ks = llm.shape_of(q), llm.shape_of(k)
    heads, kv_heads = qs[-3] if len(qs) > 2 else 1, ks[-3] if len(ks) > 2 else 1
    if a["enable_gqa"] and heads != kv_heads:
        if heads is None or kv_heads is None or heads % kv_heads:
            raise im.fail(node, f"groups {heads} query heads over {kv_heads} key/value heads")
        served = im.const(np.arange(heads) // (heads // kv_heads), np.int64)
        k, v = (im.add(llm.GatherOp(t, served, len(ks) - 3)) for t in (k, v))
    rank = len(llm.shape_of(k))
    swap = list(range(rank - 2)) + [rank - 1, rank - 2]
    scores = im.add(llm.BatchMatmulOp(q, im.add(llm.TransposeOp(k, swap))))
    scale = a["scale"] if a["scale"] is not None else 1 / math.sqrt(qs[-1])
    scores = im.add(llm.MulOp(scores, im.const(scale, dtype)))
    zero, minus_inf = im.const(0, dtype), im.const(-np.inf, dtype)
    if a["is_causal"]:
        last_two = im.add(llm.SliceOp(im.shape(scores), im.const([-2], np.int64), im.const([SLICE_END], np.int64),
                                      im.const([0], np.int64), im.const([1], np.int64),
                                      llm.tensor(2, element_type=i64)))
        square = llm.tensor(*llm.shape_of(scores)[-2:], element_type=i1)
        ones = im.add(llm.FillOp(last_two, im.const(True, np.bool_), square))
        lower = im.add(llm.TriluOp(ones, im.const(0, np.int64), upper=False))
        scores = im.add(llm.AddOp(scores, im.add(llm.WhereOp(lower, zero, minus_inf))))
    if a["attn_mask"] is not None:
        mask = im.tensor(a["attn_mask"])
        if llm.element_type(mask) == i1:
            mask = im.add(llm.WhereOp(mask, zero, minus_inf))
        scores = im.add(llm.AddOp(scores, im.tensor_value(mask, dtype)))
    weights = im.add(llm.SoftmaxOp(scores, -1))
    return im.add(llm.BatchMatmulOp(weights, v, im.type_of(node)))
