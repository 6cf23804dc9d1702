"""ONNX ops that move data or compute shapes: reshapes, transposes, slices, gathers,
concatenations, expansions, `Shape`, `Range`, `Constant`; each mapped to `llm` primitive ops
(one function per op in `OPS`). A target shape known while importing makes a static result
type; one computed at run time is passed to `llm.reshape` as a shape operand:

```mlir
%1 = llm.reshape %x : tensor<2x3x4xf32> -> tensor<6x4xf32>                    // Flatten(x, axis=2)
%2 = llm.reshape %y to %shape : tensor<?x4x?xf32> to tensor<2xi64> -> tensor<?x?xf32>  // Reshape(y, shape)
```
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper
from xdsl.ir import SSAValue

from llmc.frontend.graph import registrar, tensor_type
from llmc.frontend.onnx_graph import OnnxGraph, OpMapping, attr, dtype_of
from llmc.frontend.onnx_loader import tensor_array
from llmc.ir import llm

OPS: dict[str, OpMapping] = {}  # ONNX op type → the function adding its ops
_maps = registrar(OPS)


@_maps("Tile")
def _tile(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    """`x [d0, d1]` repeated `[r0, r1]` times: unsqueezed to `[1, d0, 1, d1]`, expanded to
    `[r0, d0, r1, d1]`, reshaped to `[r0·d0, r1·d1]`."""
    x = g.input(node, 0)
    shape = llm.shape_of(x)
    repeats = g.static(node, 1, "repeats")
    if repeats is None or repeats.shape != (len(shape),):
        raise g.error(node, f"repeats must be {len(shape)} integers")
    repeats = repeats.tolist()
    spread = g.emit(llm.UnsqueezeOp(x, [2 * i for i in range(len(shape))]))
    wide = [d for r in repeats for d in (r, 1)]
    expanded = g.emit(llm.ExpandOp(spread, g.i64s(wide), tensor_type(
        [d for r, s in zip(repeats, shape) for d in (r, s)], dtype_of(x))))
    dims = [None if d is None else r * d for r, d in zip(repeats, shape)]

    def runtime() -> SSAValue:
        return g.emit(llm.MulOp(g.dims(x, 0, len(shape)), g.i64s(repeats)))

    return [g.reshape(expanded, g.result_type(node, 0, dims, dtype_of(x)), runtime)]


@_maps("Reshape")
def _reshape(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x, to = g.input(node, 0), g.cast(g.input(node, 1), np.dtype(np.int64))
    src = llm.shape_of(x)
    if len(llm.shape_of(to)) != 1 or llm.shape_of(to)[0] is None:
        raise g.error(node, "the target shape must be a 1-D tensor of static length")
    (n,) = llm.shape_of(to)
    copies = not attr(node, "allowzero", 0)  # a 0 in the target copies the input's dimension
    target = g.known.get(to)
    if target is None:
        def runtime() -> SSAValue:
            if not copies:
                return to
            here = g.dims(x, 0, min(n, len(src)))
            if n > len(src):
                here = g.emit(llm.ConcatOp([here, g.i64s([0] * (n - len(src)))], 0))
            return g.emit(llm.WhereOp(g.emit(llm.EqualOp(to, g.i64s([0] * n))), here, to))

        return [g.reshape(x, g.result_type(node, 0, [None] * n, dtype_of(x)), runtime)]
    target = target.tolist()
    if copies and any(d == 0 and i >= len(src) for i, d in enumerate(target)):
        raise g.error(node, f"target {target} copies a dimension the input tensor<{src}> lacks")
    dims = [src[i] if d == 0 and copies else (None if d == -1 else d) for i, d in enumerate(target)]
    if -1 in target and None not in src and dims.count(None) == 1:
        rest = math.prod(d for d in dims if d is not None)
        dims[target.index(-1)] = math.prod(src) // rest if rest else 0

    def given() -> SSAValue:
        if None not in dims:
            return g.i64s(dims)
        if copies and 0 in target:  # dimensions copied at run time
            parts = [g.dims(x, i, i + 1) if d == 0 else g.i64s([d]) for i, d in enumerate(target)]
            return g.emit(llm.ConcatOp(parts, 0))
        return to

    return [g.reshape(x, g.result_type(node, 0, dims, dtype_of(x)), given)]


@_maps("Flatten")
def _flatten(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    shape = llm.shape_of(x)
    axis = attr(node, "axis", 1)
    axis += len(shape) if axis < 0 else 0
    sides = ((0, axis), (axis, len(shape)))
    dims = [None if None in shape[lo:hi] else math.prod(shape[lo:hi]) for lo, hi in sides]

    def runtime() -> SSAValue:
        parts = [g.i64s([d]) if d is not None else g.emit(llm.ReduceProdOp(g.dims(x, lo, hi), [0], True))
                 for d, (lo, hi) in zip(dims, sides)]
        return g.emit(llm.ConcatOp(parts, 0))

    return [g.reshape(x, g.result_type(node, 0, dims, dtype_of(x)), runtime)]


@_maps("Transpose")
def _transpose(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    perm = attr(node, "perm", list(reversed(range(len(llm.shape_of(x))))))
    return [g.emit(llm.TransposeOp(x, list(perm)))]


@_maps("Unsqueeze")
def _unsqueeze(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    given = g.static(node, 1, "axes")
    if given is None:
        raise g.error(node, "its axes (input 1) are missing")
    return [g.emit(llm.UnsqueezeOp(x, g.axes(node, 1, len(llm.shape_of(x)) + given.size)))]


@_maps("Squeeze")
def _squeeze(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    shape = llm.shape_of(x)
    axes = g.axes(node, 1, len(shape))
    if axes is None:
        if None in shape:
            raise g.error(node, f"without axes, which dimensions of tensor<{shape}> to squeeze is only known at "
                                f"run time")
        axes = [i for i, d in enumerate(shape) if d == 1]
    return [g.emit(llm.SqueezeOp(x, axes))]


@_maps("Slice")
def _slice(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    shape = llm.shape_of(x)
    starts, ends = (g.cast(g.input(node, i), np.dtype(np.int64)) for i in (1, 2))
    (n,) = llm.shape_of(starts)
    axes, steps = (g.optional(node, i) for i in (3, 4))
    if n is None:
        raise g.error(node, "starts must have a static length")
    axes = g.i64s(range(n)) if axes is None else g.cast(axes, np.dtype(np.int64))
    steps = g.i64s([1] * n) if steps is None else g.cast(steps, np.dtype(np.int64))
    values = [g.known.get(v) for v in (starts, ends, axes, steps)]
    out: list[int | None] = list(shape)
    if values[2] is None:
        out = [None] * len(shape)
    else:
        for i, a in enumerate(values[2].tolist()):
            a %= len(shape)
            if shape[a] is None or any(v is None for v in values):
                out[a] = None
                continue
            start, end, step = (int(v[i]) for v in (values[0], values[1], values[3]))
            out[a] = len(range(*slice(start, end, step).indices(shape[a]))) if step else None
    return [g.emit(llm.SliceOp(x, starts, ends, axes, steps, g.result_type(node, 0, out, dtype_of(x))))]


@_maps("Split")
def _split(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    shape = llm.shape_of(x)
    axis = attr(node, "axis", 0) % len(shape)
    sizes = g.static(node, 1, "split")
    count = len(node.output)
    if sizes is None:
        if shape[axis] is None:
            raise g.error(node, f"splitting axis {axis} of tensor<{shape}> needs split sizes, it is dynamic")
        part = -(-shape[axis] // count)
        sizes = [min(part, shape[axis] - i * part) for i in range(count)]
    else:
        sizes = sizes.tolist()
    bounds = np.cumsum([0, *sizes]).tolist()
    return [g.slice(x, axis, lo, hi) for lo, hi in zip(bounds[:-1], bounds[1:])]


@_maps("Concat")
def _concat(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    inputs = [g.input(node, i) for i in range(len(node.input))]
    axis = attr(node, "axis")
    shape = list(llm.shape_of(inputs[0]))
    axis %= len(shape)
    sizes = [llm.shape_of(v)[axis] for v in inputs]
    shape[axis] = None if None in sizes else sum(sizes)
    return [g.emit(llm.ConcatOp(inputs, axis, g.result_type(node, 0, shape, dtype_of(inputs[0]))))]


@_maps("Gather")
def _gather(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x, indices = g.input(node, 0), g.input(node, 1)
    shape = llm.shape_of(x)
    axis = attr(node, "axis", 0) % len(shape)
    out = (*shape[:axis], *llm.shape_of(indices), *shape[axis + 1:])
    return [g.emit(llm.GatherOp(x, indices, axis, g.result_type(node, 0, out, dtype_of(x))))]


@_maps("GatherND")
def _gather_nd(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x, indices = g.input(node, 0), g.input(node, 1)
    batch = attr(node, "batch_dims", 0)
    ishape, xshape = llm.shape_of(indices), llm.shape_of(x)
    out = None if ishape[-1] is None else (*ishape[:-1], *xshape[batch + ishape[-1]:])
    return [g.emit(llm.GatherNdOp(x, indices, batch, g.result_type(node, 0, out, dtype_of(x))))]


def _shape_value(g: OnnxGraph, node: onnx.NodeProto, i: int) -> tuple[SSAValue, list[int | None]]:
    """Input `i`, a 1-D shape, as i64, and the dimensions it says where they are known."""
    s = g.cast(g.input(node, i), np.dtype(np.int64))
    (n,) = llm.shape_of(s)
    if n is None:
        raise g.error(node, "the shape input must have a static length")
    known = g.known.get(s)
    return s, ([None] * n if known is None else known.tolist())


@_maps("Expand")
def _expand(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    s, dims = _shape_value(g, node, 1)
    out = llm.broadcast(llm.shape_of(x), dims)
    return [g.emit(llm.ExpandOp(x, s, g.result_type(node, 0, out, dtype_of(x))))]


@_maps("ConstantOfShape")
def _constant_of_shape(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    s, dims = _shape_value(g, node, 0)
    given = attr(node, "value")
    value = np.zeros((), np.float32) if given is None else tensor_array(given, g.source, g.directory).reshape(())
    return [g.emit(llm.FillOp(s, g.constant(value), g.result_type(node, 0, dims, value.dtype)))]


@_maps("Range")
def _range(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    start, limit, delta = (g.input(node, i) for i in range(3))
    values = [g.known.get(v) for v in (start, limit, delta)]
    count = None
    if all(v is not None for v in values) and values[2].item() != 0:
        count = max(math.ceil((values[1].item() - values[0].item()) / values[2].item()), 0)
    return [g.emit(llm.RangeOp(start, limit, delta, g.result_type(node, 0, [count], dtype_of(start))))]


@_maps("Trilu")
def _trilu(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    k = g.optional(node, 1)
    k = g.constant(np.zeros((), np.int64)) if k is None else k
    return [g.emit(llm.TriluOp(g.input(node, 0), k, bool(attr(node, "upper", 1))))]


@_maps("Shape")
def _shape(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    rank = len(llm.shape_of(x))
    start, end = (max(0, min(rank, (v + rank if v < 0 else v))) for v in (attr(node, "start", 0),
                                                                              attr(node, "end", rank)))
    return [g.dims(x, start, max(start, end))]


@_maps("Size")
def _size(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    x = g.input(node, 0)
    shape = llm.shape_of(x)
    if None not in shape:
        return [g.constant(np.asarray(math.prod(shape), np.int64))]
    return [g.emit(llm.ReduceProdOp(g.dims(x, 0, len(shape)), [0], False))]


@_maps("Constant")
def _constant(g: OnnxGraph, node: onnx.NodeProto) -> list[SSAValue]:
    if len(node.attribute) != 1:
        raise g.error(node, "a constant has exactly one value attribute")
    (a,) = node.attribute
    name = node.output[0]
    if a.name == "value":
        array = tensor_array(a.t, g.source, g.directory)
        if array.size > llm.ConstantOp.LIMIT and array.dtype.kind == "f":
            return [g.weight(name, array)]
        return [g.constant(np.asarray(array), name)]
    forms = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64}
    if a.name not in forms:
        raise g.error(node, f"a constant given as '{a.name}' is not supported")
    return [g.constant(np.asarray(helper.get_attribute_value(a), forms[a.name]), name)]
