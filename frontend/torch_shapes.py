"""ATen ops that move data or make tensors: `cat`, `slice`, `select`, views and reshapes,
transposes, `expand`, `index`, `arange`, `full`/`zeros`/`ones`, `triu`/`tril`, `sym_size`;
each mapped to `llm` primitive ops. A reshape to at most one dynamic dimension is static;
more take the sizes computed at run time:

```mlir
%view = llm.reshape %x : tensor<1x?x32xf32> -> tensor<1x?x4x8xf32>                   // aten.view
```
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import fx
from xdsl.dialects.builtin import i1, i64
from xdsl.ir import SSAValue

from llmc.frontend.graph import registrar
from llmc.frontend.torch_importer import SLICE_END, AtenMapping, ProgramImporter, axis_index
from llmc.ir import llm

aten = torch.ops.aten
ATEN: dict[object, AtenMapping] = {}  # ATen op (overload or packet) → its mapping
_maps = registrar(ATEN)


@_maps(aten.cat)
def _cat(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    dtype = im.dtype(node)
    rank = len(llm.shape_of(im.type_of(node)))
    # torch.cat skips empty 1-D tensors (a cache layer's keys before its first update)
    parts = [p for t in a["tensors"] if not (llm.shape_of(p := im.tensor(t, dtype)) == (0,) and rank > 1)]
    return im.add(llm.ConcatOp(parts, axis_index(a["dim"], rank), im.type_of(node)))


@_maps(aten.slice)
def _slice(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    start = 0 if a["start"] is None else a["start"]
    end = SLICE_END if a["end"] is None else a["end"]
    axis = axis_index(a["dim"], len(llm.shape_of(x)))
    return im.add(llm.SliceOp(x, im.vector([start]), im.vector([end]), im.const([axis], np.int64),
                              im.const([a["step"]], np.int64), im.type_of(node)))


@_maps(aten.select)
def _select(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    index = im.tensor(a["index"], np.dtype(np.int64))
    return im.add(llm.GatherOp(x, index, axis_index(a["dim"], len(llm.shape_of(x))), im.type_of(node)))


@_maps(aten.unsqueeze)
def _unsqueeze(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    return im.add(llm.UnsqueezeOp(x, [axis_index(a["dim"], len(llm.shape_of(x)) + 1)]))


@_maps(aten.squeeze)
def _squeeze(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    shape = llm.shape_of(x)
    dims = a.get("dim")
    dims = range(len(shape)) if dims is None else [dims] if isinstance(dims, int) else dims
    axes = sorted({axis_index(d, len(shape)) for d in dims if shape[axis_index(d, len(shape))] == 1})
    return im.add(llm.SqueezeOp(x, axes)) if axes else x


@_maps(aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten)
def _reshape(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    """A static reshape where the result has at most one `?`; otherwise to the sizes at run time."""
    x = im.tensor(a["self"])
    shape = llm.shape_of(im.type_of(node))
    if im.type_of(node) == x.type:
        return x
    if shape.count(None) <= 1:
        return im.add(llm.ReshapeOp(x, shape))
    if "size" not in a:
        raise im.fail(node, "reshapes to several dynamic dimensions that llmc cannot compute")
    return im.add(llm.ReshapeOp(x, shape, im.vector(a["size"])))


@_maps(aten.transpose)
def _transpose(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    rank = len(llm.shape_of(x))
    perm = list(range(rank))
    i, j = axis_index(a["dim0"], rank), axis_index(a["dim1"], rank)
    perm[i], perm[j] = perm[j], perm[i]
    return im.add(llm.TransposeOp(x, perm))


@_maps(aten.permute)
def _permute(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    return im.add(llm.TransposeOp(x, [axis_index(d, len(llm.shape_of(x))) for d in a["dims"]]))


@_maps(aten.t)
def _t(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    return im.add(llm.TransposeOp(x, (1, 0))) if len(llm.shape_of(x)) == 2 else x


@_maps(aten.expand)
def _expand(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    """ONNX-style Expand: torch's `-1` (keep the size) is a broadcasting 1."""
    x = im.tensor(a["self"])
    result = im.type_of(node)
    if result == x.type:
        return x
    sizes = [1 if isinstance(s, int) and s == -1 else s for s in a["size"]]
    return im.add(llm.ExpandOp(x, im.vector(sizes), result))


@_maps(aten.arange)
def _arange(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    dtype = im.dtype(node)
    start, end, step = (0, a["end"], 1) if "start" not in a else (a["start"], a["end"], a.get("step", 1))
    bounds = [im.tensor(v, dtype) for v in (start, end, step)]
    return im.add(llm.RangeOp(*bounds, im.type_of(node)))


def _filled(im: ProgramImporter, node: fx.Node, value: object, shape: SSAValue | Sequence[object]) -> SSAValue:
    """A tensor of `node`'s type with every element `value`: a constant where the shape is
    static and small, else `llm.fill` of `shape` (a shape tensor or a list of sizes)."""
    dtype, result = im.dtype(node), im.type_of(node)
    static = llm.shape_of(result)
    if None not in static and math.prod(static) <= llm.ConstantOp.LIMIT and not isinstance(value, fx.Node):
        return im.const(np.full(static, value, dtype), dtype)
    shape = shape if isinstance(shape, SSAValue) else im.vector(shape)
    return im.add(llm.FillOp(shape, im.tensor(value, dtype), result))


@_maps(aten.full, aten.ones, aten.zeros, aten.new_full, aten.new_ones, aten.new_zeros)
def _full(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    packet = node.target.overloadpacket
    value = {aten.ones: 1, aten.new_ones: 1, aten.zeros: 0, aten.new_zeros: 0}.get(packet, a.get("fill_value"))
    return _filled(im, node, value, a["size"])


@_maps(aten.full_like, aten.ones_like, aten.zeros_like)
def _full_like(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    value = {aten.ones_like: 1, aten.zeros_like: 0}.get(node.target.overloadpacket, a.get("fill_value"))
    return _filled(im, node, value, im.shape(im.tensor(a["self"])))


@_maps(aten.scalar_tensor)
def _scalar_tensor(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    return im.tensor(a["s"], im.dtype(node))


@_maps(aten.triu, aten.tril)
def _trilu(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    upper = node.target.overloadpacket is aten.triu
    return im.add(llm.TriluOp(im.tensor(a["self"]), im.tensor(a["diagonal"], np.dtype(np.int64)), upper))


@_maps(aten.index)
def _index(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    """Advanced indexing by adjacent integer index tensors: `llm.gather` for one, else the
    indices broadcast, stacked and read with `llm.gather_nd` (dimensions moved to the front and back)."""
    x = im.tensor(a["self"])
    given = [i for i, t in enumerate(a["indices"]) if t is not None]
    if not given or given != list(range(given[0], given[-1] + 1)):
        raise im.fail(node, "indexes with non-adjacent index tensors, which llmc does not import")
    indices = [im.tensor(a["indices"][i]) for i in given]
    if any(llm.element_type(i) == i1 for i in indices):
        raise im.fail(node, "indexes with a boolean mask, which llmc does not import")
    first, result = given[0], im.type_of(node)
    if len(indices) == 1:
        return im.add(llm.GatherOp(x, indices[0], first, result))
    shape = llm.shape_of(x)
    if first:
        front = list(range(first, first + len(given)))
        x = im.add(llm.TransposeOp(x, front + [d for d in range(len(shape)) if d not in front]))
    target = llm.broadcast(*(llm.shape_of(i) for i in indices))
    if any(len(llm.shape_of(i)) != len(target) for i in indices):
        raise im.fail(node, "indexes with index tensors of different ranks, which llmc does not import")
    index_type = llm.tensor(*target, element_type=i64)
    full = [i for i in indices if llm.shape_of(i) == target]
    sizes = None
    stacked = []
    for i in indices:
        if llm.shape_of(i) != target:
            if sizes is None:
                sizes = im.shape(full[0]) if full else _max_shape(im, indices)
            i = im.add(llm.ExpandOp(i, sizes, index_type))
        stacked.append(im.add(llm.UnsqueezeOp(i, [len(target)])))
    nd = im.add(llm.ConcatOp(stacked, len(target)))
    rest = [d for i, d in enumerate(llm.shape_of(x)) if i >= len(given)]
    gathered = im.add(llm.GatherNdOp(x, nd, 0, llm.tensor(*target, *rest, element_type=llm.element_type(x))))
    if not first:
        return gathered
    k = len(target)
    perm = list(range(k, k + first)) + list(range(k)) + list(range(k + first, k + len(rest)))
    return im.add(llm.TransposeOp(gathered, perm))


def _max_shape(im: ProgramImporter, indices: Sequence[SSAValue]) -> SSAValue:
    """The broadcast shape of same-rank tensors at run time: the elementwise maximum of their shapes."""
    sizes = im.shape(indices[0])
    for i in indices[1:]:
        sizes = im.add(llm.MaximumOp(sizes, im.shape(i)))
    return sizes


@_maps(aten.sym_size)
def _sym_size(im: ProgramImporter, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    return im.dim(x, axis_index(a["dim"], len(llm.shape_of(x))))
