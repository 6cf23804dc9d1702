"""ONNX ops that compute: arithmetic, comparisons, activations, reductions, normalizations,
softmax and matrix products, each mapped to `llm` primitive ops (one function per op in
`OPS`); ops llmc has no primitive for are composed (Gemm is transposes, a `batch_matmul`, a
`mul` and an `add`; HardSwish is `x · clip(x/6 + 1/2, 0, 1)`):

```mlir
%0 = llm.transpose %W axes [1, 0] : (tensor<3x4xf32>) -> tensor<4x3xf32>      // Gemm(X, W, transB=1)
%Y = llm.batch_matmul %X, %0 : (tensor<?x4xf32>, tensor<4x3xf32>) -> tensor<?x3xf32>
```
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from xdsl.dialects.builtin import i1
from xdsl.ir import SSAValue

from llmc.frontend.graph import registrar, tensor_type
from llmc.frontend.onnx_graph import OnnxGraph, OpMapping, Shape, attr, dtype_of, node_name
from llmc.frontend.onnx_loader import element_dtype
from llmc.ir import llm

OPS: dict[str, OpMapping] = {}  # ONNX op type → the function adding its ops
_maps = registrar(OPS)

_BINARY = {"Add": llm.AddOp, "Sub": llm.SubOp, "Mul": llm.MulOp, "Div": llm.DivOp, "Equal": llm.EqualOp,
           "Less": llm.LessOp, "LessOrEqual": llm.LessEqualOp, "Greater": llm.GreaterOp,
           "GreaterOrEqual": llm.GreaterEqualOp, "And": llm.AndOp, "Or": llm.OrOp, "Xor": llm.XorOp}
_UNARY = {"Neg": llm.NegOp, "Sqrt": llm.SqrtOp, "Reciprocal": llm.ReciprocalOp, "Exp": llm.ExpOp, "Log": llm.LogOp,
          "Tanh": llm.TanhOp, "Cos": llm.CosOp, "Sin": llm.SinOp, "Erf": llm.ErfOp, "Sigmoid": llm.SigmoidOp,
          "Relu": llm.ReluOp, "Abs": llm.AbsOp, "Floor": llm.FloorOp, "Ceil": llm.CeilOp, "Not": llm.NotOp}
_REDUCE = {"ReduceSum": llm.ReduceSumOp, "ReduceMean": llm.ReduceMeanOp, "ReduceMax": llm.ReduceMaxOp,
           "ReduceMin": llm.ReduceMinOp, "ReduceProd": llm.ReduceProdOp}


def _binary_op(g: OnnxGraph, node: onnx.NodeProto, op_type: type, a: SSAValue, b: SSAValue) -> SSAValue:
    """`op_type` of `a` and `b`, typed as the node's output."""
    shape = llm.broadcast(llm.shape_of(a), llm.shape_of(b))
    dtype = np.dtype(np.bool_) if op_type.BOOLEAN else dtype_of(a)
    return g.emit(op_type(a, b, g.result_type(node, 0, shape, dtype)))


@_maps(*_BINARY)
def _binary(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    return [_binary_op(g, node, _BINARY[node.op_type], g.input(node, 0), g.input(node, 1))]


@_maps("Pow")
def _pow(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    """`X ** Y` in X's type; an integer X with a float Y is raised in Y's type, then cast back."""
    x, y = g.input(node, 0), g.input(node, 1)
    if np.issubdtype(dtype_of(x), np.integer) and np.issubdtype(dtype_of(y), np.floating):
        power = g.emit(llm.PowOp(g.cast(x, dtype_of(y)), y))
        return [g.cast(power, dtype_of(x))]
    return [_binary_op(g, node, llm.PowOp, x, g.cast(y, dtype_of(x)))]


@_maps("Mod")
def _mod(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    a, b = g.input(node, 0), g.input(node, 1)
    r = _binary_op(g, node, llm.ModOp, a, b)
    if not attr(node, "fmod", 0):
        return [r]
    # C's fmod takes the dividend's sign: numpy's remainder minus the divisor where the signs differ.
    zero = g.scalar(0, a)
    differ = g.emit(llm.XorOp(g.emit(llm.LessOp(a, zero)), g.emit(llm.LessOp(b, zero))))
    nonzero = g.emit(llm.NotOp(g.emit(llm.EqualOp(r, zero))))
    return [g.emit(llm.WhereOp(g.emit(llm.AndOp(differ, nonzero)), g.emit(llm.SubOp(r, b)), r, r.type))]


@_maps(*_UNARY)
def _unary(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    return [g.emit(_UNARY[node.op_type](g.input(node, 0)))]


@_maps("Gelu")
def _gelu(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    tanh = attr(node, "approximate", b"none") in (b"tanh", "tanh")
    return [g.emit(llm.ACTIVATION_OPS[llm.Activation.GELU_TANH if tanh else llm.Activation.GELU](g.input(node, 0)))]


@_maps("Identity")
def _identity(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    return [g.input(node, 0)]


@_maps("Max", "Min", "Sum", "Mean")
def _variadic(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    op_type = {"Max": llm.MaximumOp, "Min": llm.MinimumOp, "Sum": llm.AddOp, "Mean": llm.AddOp}[node.op_type]
    values = [g.input(node, i) for i in range(len(node.input))]
    out = values[0]
    for v in values[1:]:
        out = g.emit(op_type(out, v))
    if node.op_type == "Mean" and len(values) > 1:
        out = g.emit(llm.DivOp(out, g.scalar(len(values), out)))
    return [out]


@_maps("Where")
def _where(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    c, a, b = (g.input(node, i) for i in range(3))
    shape = llm.broadcast(llm.shape_of(c), llm.shape_of(a), llm.shape_of(b))
    return [g.emit(llm.WhereOp(c, a, b, g.result_type(node, 0, shape, dtype_of(a))))]


@_maps("IsNaN")
def _isnan(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    return [g.emit(llm.IsNanOp(x, llm.tensor(*llm.shape_of(x), element_type=i1)))]


@_maps("Cast", "CastLike")
def _cast(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    if node.op_type == "Cast":
        dtype = element_dtype(g.source, attr(node, "to"), f"node '{node_name(node)}' (Cast)'s target")
    else:
        dtype = dtype_of(g.input(node, 1))
    return [g.emit(llm.CastOp(x, tensor_type(llm.shape_of(x), dtype)))]


def _square(g: OnnxGraph, x: SSAValue) -> SSAValue:
    return g.emit(llm.MulOp(x, x))


_COMPOSED_REDUCE: dict[str, tuple[str, Callable[[OnnxGraph, SSAValue], SSAValue] | None, type | None]] = {
    # op type → (the reduction, what is reduced, the elementwise op after)
    "ReduceSumSquare": ("ReduceSum", _square, None), "ReduceL1": ("ReduceSum", lambda g, x: g.emit(llm.AbsOp(x)), None),
    "ReduceL2": ("ReduceSum", _square, llm.SqrtOp), "ReduceLogSum": ("ReduceSum", None, llm.LogOp),
}


@_maps(*_COMPOSED_REDUCE)
def _composed_reduce(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    reduction, before, after = _COMPOSED_REDUCE[node.op_type]
    x = g.input(node, 0)
    (y,) = _reduce(g, node, reduction, x if before is None else before(g, x))
    return [y if after is None else g.emit(after(y))]


@_maps(*_REDUCE)
def _reduce(g: OnnxGraph, node: onnx.NodeProto, op_type: str | None = None,
            x: SSAValue | None = None) -> list[SSAValue]:
    op_type = op_type or node.op_type
    x = g.input(node, 0) if x is None else x
    shape = llm.shape_of(x)
    axes = g.axes(node, 1, len(shape))
    if not axes:
        if attr(node, "noop_with_empty_axes", 0) or not shape:
            return [x]
        axes = list(range(len(shape)))
    keep = bool(attr(node, "keepdims", 1))
    kept = [1 if i in axes else d for i, d in enumerate(shape)] if keep else \
        [d for i, d in enumerate(shape) if i not in axes]
    dtype = dtype_of(x)
    out = g.result_type(node, 0, kept, dtype)
    if any(shape[a] == 0 for a in axes) and op_type in ("ReduceMax", "ReduceMin") and \
            None not in llm.shape_of(out):
        # The maximum of nothing is the type's lowest value (-inf), the minimum its highest.
        low, high = (-np.inf, np.inf) if dtype.kind == "f" else (False, True) if dtype.kind == "b" else \
            (np.iinfo(dtype).min, np.iinfo(dtype).max)
        fill = g.scalar(low if op_type == "ReduceMax" else high, x)
        return [g.emit(llm.FillOp(g.i64s(llm.shape_of(out)), fill, out))]
    return [g.emit(_REDUCE[op_type](x, axes, keep, out))]


def _normalized(g: OnnxGraph, node: onnx.NodeProto, centered: bool) -> list[SSAValue]:
    """LayerNormalization (`centered`) and RMSNormalization over the axes from `axis` on, computed in f32."""
    x, scale, bias = g.input(node, 0), g.input(node, 1), g.optional(node, 2)
    rank = len(llm.shape_of(x))
    axis = attr(node, "axis", -1)
    axes = list(range(axis + rank if axis < 0 else axis, rank))
    dtype = dtype_of(x)
    if attr(node, "stash_type", 1) != 1:
        raise g.error(node, "only stash_type 1 (float32 statistics) is supported")
    x32 = g.cast(x, np.dtype(np.float32))
    mean = g.emit(llm.ReduceMeanOp(x32, axes, True)) if centered else None
    d = x32 if mean is None else g.emit(llm.SubOp(x32, mean))
    var = g.emit(llm.ReduceMeanOp(_square(g, d), axes, True))
    inv = g.emit(llm.RsqrtOp(g.emit(llm.AddOp(var, g.scalar(attr(node, "epsilon", 1e-5), var)))))
    y = g.emit(llm.MulOp(g.cast(g.emit(llm.MulOp(d, inv)), dtype), scale))
    y = y if bias is None else g.emit(llm.AddOp(y, bias))
    return [y, mean, inv] if centered else [y]


@_maps("LayerNormalization")
def _layer_norm(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    return _normalized(g, node, True)


@_maps("RMSNormalization")
def _rms_norm(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    return _normalized(g, node, False)


@_maps("LogSoftmax")
def _log_softmax(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    axis = attr(node, "axis", -1) % len(llm.shape_of(x))
    shifted = g.emit(llm.SubOp(x, g.emit(llm.ReduceMaxOp(x, [axis], True))))
    total = g.emit(llm.ReduceSumOp(g.emit(llm.ExpOp(shifted)), [axis], True))
    return [g.emit(llm.SubOp(shifted, g.emit(llm.LogOp(total))))]


def _activation(fn: Callable[[OnnxGraph, onnx.NodeProto, SSAValue], SSAValue]) -> OpMapping:
    return lambda g, node: [fn(g, node, g.input(node, 0))]


def _where_negative(g: OnnxGraph, x: SSAValue, negative: SSAValue, strict: bool = True) -> SSAValue:
    zero = g.scalar(0, x)
    test = g.emit(llm.LessOp(x, zero) if strict else llm.LessEqualOp(x, zero))
    return g.emit(llm.WhereOp(test, negative, x, x.type))


def _expm1(g: OnnxGraph, x: SSAValue, alpha: float) -> SSAValue:
    """`alpha · (eˣ - 1)`."""
    e = g.emit(llm.SubOp(g.emit(llm.ExpOp(x)), g.scalar(1, x)))
    return g.emit(llm.MulOp(e, g.scalar(alpha, x)))


def _softplus(g: OnnxGraph, x: SSAValue) -> SSAValue:
    return g.emit(llm.LogOp(g.emit(llm.AddOp(g.emit(llm.ExpOp(x)), g.scalar(1, x)))))


def _hard_sigmoid(g: OnnxGraph, x: SSAValue, alpha: float, beta: float) -> SSAValue:
    y = g.emit(llm.AddOp(g.emit(llm.MulOp(x, g.scalar(alpha, x))), g.scalar(beta, x)))
    return g.emit(llm.MaximumOp(g.emit(llm.MinimumOp(y, g.scalar(1, x))), g.scalar(0, x)))


ACTIVATIONS: dict[str, Callable[[OnnxGraph, onnx.NodeProto, SSAValue], SSAValue]] = {
    "LeakyRelu": lambda g, n, x: _where_negative(g, x, g.emit(llm.MulOp(x, g.scalar(attr(n, "alpha", 0.01), x)))),
    "Elu": lambda g, n, x: _where_negative(g, x, _expm1(g, x, attr(n, "alpha", 1.0))),
    "Selu": lambda g, n, x: g.emit(llm.MulOp(
        _where_negative(g, x, _expm1(g, x, attr(n, "alpha", 1.67326319217681884765625)), strict=False),
        g.scalar(attr(n, "gamma", 1.05070102214813232421875), x))),
    "Celu": lambda g, n, x: g.emit(llm.AddOp(g.emit(llm.ReluOp(x)), g.emit(llm.MinimumOp(
        _expm1(g, g.emit(llm.DivOp(x, g.scalar(attr(n, "alpha", 1.0), x))), attr(n, "alpha", 1.0)),
        g.scalar(0, x))))),
    "ThresholdedRelu": lambda g, n, x: g.emit(llm.WhereOp(
        g.emit(llm.GreaterOp(x, g.scalar(attr(n, "alpha", 1.0), x))), x, g.scalar(0, x), x.type)),
    "HardSigmoid": lambda g, n, x: _hard_sigmoid(g, x, attr(n, "alpha", 0.2), attr(n, "beta", 0.5)),
    "HardSwish": lambda g, n, x: g.emit(llm.MulOp(x, _hard_sigmoid(g, x, 1 / 6, 0.5))),
    "Softplus": lambda g, n, x: _softplus(g, x),
    "Softsign": lambda g, n, x: g.emit(llm.DivOp(x, g.emit(llm.AddOp(g.emit(llm.AbsOp(x)), g.scalar(1, x))))),
    "Mish": lambda g, n, x: g.emit(llm.MulOp(x, g.emit(llm.TanhOp(_softplus(g, x))))),
    "Swish": lambda g, n, x: g.emit(llm.MulOp(x, g.emit(llm.SigmoidOp(
        g.emit(llm.MulOp(x, g.scalar(attr(n, "alpha", 1.0), x))))))),
    "Tan": lambda g, n, x: g.emit(llm.DivOp(g.emit(llm.SinOp(x)), g.emit(llm.CosOp(x)))),
}
for _name, _fn in ACTIVATIONS.items():
    _maps(_name)(_activation(_fn))


@_maps("PRelu")
def _prelu(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    return [_where_negative(g, x, g.emit(llm.MulOp(x, g.input(node, 1))))]


@_maps("Clip")
def _clip(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    y, low, high = g.input(node, 0), g.optional(node, 1), g.optional(node, 2)
    if low is not None:
        y = g.emit(llm.MaximumOp(y, low))
    if high is not None:
        y = g.emit(llm.MinimumOp(y, high))
    return [y]


@_maps("Dropout")
def _dropout(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    """Inference: the input as it is, and a mask of ones."""
    training = g.static(node, 2, "training_mode")
    if training is not None and training.any():
        raise g.error(node, "training-mode dropout is random; llmc imports inference graphs")
    x = g.input(node, 0)
    shape = llm.shape_of(x)
    mask = g.emit(llm.FillOp(g.dims(x, 0, len(shape)), g.constant(np.ones((), np.bool_)),
                             llm.tensor(*shape, element_type=i1)))
    return [x, mask]


@_maps("Softmax")
def _softmax(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    return [g.emit(llm.SoftmaxOp(g.input(node, 0), attr(node, "axis", -1)))]


def _matmul_shape(a: Shape, b: Shape) -> Shape:
    if len(a) == 1 and len(b) == 1:
        return ()
    if len(a) == 1:
        return (*b[:-2], b[-1])
    if len(b) == 1:
        return a[:-1]
    return (*llm.broadcast(a[:-2], b[:-2]), a[-2], b[-1])


@_maps("MatMul")
def _matmul(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    a, b = g.input(node, 0), g.input(node, 1)
    shape = _matmul_shape(llm.shape_of(a), llm.shape_of(b))
    return [g.emit(llm.BatchMatmulOp(a, b, g.result_type(node, 0, shape, dtype_of(a))))]


@_maps("Gemm")
def _gemm(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    a, b, c = g.input(node, 0), g.input(node, 1), g.optional(node, 2)
    if attr(node, "transA", 0):
        a = g.emit(llm.TransposeOp(a, (1, 0)))
    if attr(node, "transB", 0):
        b = g.emit(llm.TransposeOp(b, (1, 0)))
    y = g.emit(llm.BatchMatmulOp(a, b))
    alpha, beta = attr(node, "alpha", 1.0), attr(node, "beta", 1.0)
    if alpha != 1:
        y = g.emit(llm.MulOp(y, g.scalar(alpha, y)))
    if c is not None:
        if beta != 1:
            c = g.emit(llm.MulOp(c, g.scalar(beta, c)))
        y = g.emit(llm.AddOp(y, c, y.type))
    return [y]


@_maps("CumSum")
def _cumsum(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    axis = g.static(node, 1, "axis")
    return [g.emit(llm.CumsumOp(g.input(node, 0), int(axis.reshape(())), bool(attr(node, "exclusive", 0)),
                                bool(attr(node, "reverse", 0))))]
