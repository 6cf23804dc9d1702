"""`raise-rope`: rotate-half RoPE written out becomes `llm.rope` at the entry point's positions.

```mlir
%lo = llm.slice %q, ... : ... -> tensor<1x4x?x4xf32>          // q[..., :half]
%hi = llm.slice %q, ... : ... -> tensor<1x4x?x4xf32>          // q[..., half:]
%n = llm.neg %hi : tensor<1x4x?x4xf32>
%rot = llm.concat %n, %lo axis 3 : (...) -> tensor<1x4x?x8xf32>
%a = llm.mul %q, %cos : (tensor<1x4x?x8xf32>, tensor<1x1x?x8xf32>) -> tensor<1x4x?x8xf32>
%b = llm.mul %rot, %sin : (tensor<1x4x?x8xf32>, tensor<1x1x?x8xf32>) -> tensor<1x4x?x8xf32>
%y = llm.add %a, %b : tensor<1x4x?x8xf32>
// becomes (the transposes cancel against the graph's own in `canonicalize`)
%t = llm.transpose %q axes [0, 2, 1, 3] : (tensor<1x4x?x8xf32>) -> tensor<1x?x4x8xf32>
%r = llm.reshape %t : tensor<1x?x4x8xf32> -> tensor<?x4x8xf32>
%rr = llm.rope %r, %pos <theta 10000.0> : tensor<?x4x8xf32>, tensor<?xi32>
...                                                            // back to tensor<1x4x?x8xf32>
```
`%cos` and `%sin` must depend on the positions only. They are computed for 64 positions
and the `#llm.rope` that reproduces them is fitted (base, per-pair frequency factors,
attention factor) and checked to within 1e-4; otherwise nothing is raised.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from xdsl.dialects import func
from xdsl.ir import Block, SSAValue

from llmc.ir import llm
from llmc.ir.interpreter import rope_inv_freq
from llmc.ir.weights import WeightStore
from llmc.passes.raising import (
    RaisePass,
    constant_ints,
    evaluate_at,
    heads_back,
    heads_first,
    insert_before,
    operand_pairs,
    position_only,
    producer,
    replace_value,
    rows_of_heads,
)

TABLE_POSITIONS = 64
TOLERANCE = 1e-4


def _slice_bounds(value: SSAValue) -> tuple[SSAValue, int, int] | None:
    """(input, start, end) of a unit-step slice of the last axis."""
    s = producer(value, llm.SliceOp)
    if s is None:
        return None
    rank = len(llm.shape_of(s.input))
    starts, ends, axes, steps = (constant_ints(v) for v in (s.starts, s.ends, s.slice_axes, s.steps))
    if None in (starts, ends, axes, steps) or len(axes) != 1 or axes[0] % rank != rank - 1 or steps != [1]:
        return None
    return s.input, starts[0], ends[0]  # type: ignore[index]


def rotated_half(value: SSAValue) -> SSAValue | None:
    """`x` where `value` is `concat(-x[..., half:], x[..., :half])`."""
    cat = producer(value, llm.ConcatOp)
    if cat is None or len(cat.inputs) != 2 or cat.axis_index != len(llm.shape_of(value)) - 1:
        return None
    neg = producer(cat.inputs[0], llm.NegOp)
    hi = _slice_bounds(neg.input) if neg is not None else None
    lo = _slice_bounds(cat.inputs[1])
    if hi is None or lo is None or hi[0] is not lo[0]:
        return None
    x = lo[0]
    d = llm.shape_of(x)[-1]
    if d is None or d % 2 or lo[1:] != (0, d // 2) or hi[1] != d // 2 or hi[2] < d:
        return None
    return x


def fit_rope(cos: np.ndarray, sin: np.ndarray) -> llm.RopeAttr | None:
    """The `#llm.rope` whose tables at positions 0..n-1 are `cos`, `sin` `[n, head_dim]`, or None."""
    n, d = cos.shape
    half = d // 2
    if half < 2 or n < 3 or not (np.allclose(cos[:, :half], cos[:, half:], atol=1e-6)
                                 and np.allclose(sin[:, :half], sin[:, half:], atol=1e-6)):
        return None
    mscale = float(np.hypot(cos[0, 0], sin[0, 0]))
    first = np.arctan2(sin[1, :half], cos[1, :half]).astype(np.float64)
    last = np.arctan2(sin[n - 1, :half], cos[n - 1, :half]).astype(np.float64)
    turns = np.round((first * (n - 1) - last) / (2 * math.pi))
    inv_freq = (last + 2 * math.pi * turns) / (n - 1)
    if not (mscale > 0 and inv_freq[1] > 0):
        return None
    theta = float(inv_freq[1] ** (-half))
    if abs(theta - round(theta)) < 1e-4 * theta:
        theta = float(round(theta))
    base = rope_inv_freq(d, llm.RopeAttr(theta)).astype(np.float64)
    factors = base / inv_freq
    if np.allclose(factors, 1.0, rtol=1e-4):
        factors = np.ones(0)
    rope = llm.RopeAttr(theta, 0, round(mscale, 6), [float(f) for f in factors])
    angles = np.arange(n, dtype=np.float32)[:, None] * rope_inv_freq(d, rope)[None, :]
    if np.abs(np.cos(angles) * mscale - cos[:, :half]).max() > TOLERANCE or \
            np.abs(np.sin(angles) * mscale - sin[:, :half]).max() > TOLERANCE:
        return None
    return rope


def _tables(block: Block, x: SSAValue, cos: SSAValue, sin: SSAValue, weights: WeightStore | None
            ) -> tuple[np.ndarray, np.ndarray] | None:
    """cos and sin as `[positions, head_dim]`, one table for every head, or None."""
    if not (position_only(cos, block.args[0]) and position_only(sin, block.args[0])):
        return None
    found = evaluate_at([cos, sin], block, TABLE_POSITIONS, weights)
    if found is None:
        return None
    shape = [TABLE_POSITIONS if d is None else d for d in llm.shape_of(x)]
    token_axis = llm.shape_of(x).index(None)
    tables = []
    for table in found:
        try:
            full = np.moveaxis(np.broadcast_to(table, shape), token_axis, 0).reshape(TABLE_POSITIONS, -1, shape[-1])
        except ValueError:
            return None
        if not np.array_equal(full, np.broadcast_to(full[:, :1], full.shape)):
            return None  # the heads rotate differently
        tables.append(full[:, 0].astype(np.float64))
    return tables[0], tables[1]


@dataclass(frozen=True)
class RaiseRopePass(RaisePass):
    name = "raise-rope"

    def raise_function(self, function: func.FuncOp) -> None:
        block = function.body.block
        for op in list(block.ops):
            if isinstance(op, llm.AddOp) and op.lhs.type == op.rhs.type:
                self._match(block, op)

    def _match(self, block: Block, add: llm.AddOp) -> None:
        for a, b in operand_pairs(add):
            ma, mb = producer(a, llm.MulOp), producer(b, llm.MulOp)
            if ma is None or mb is None:
                continue
            for rot, sin in operand_pairs(mb):
                x = rotated_half(rot)
                if x is None:
                    continue
                for xx, cos in operand_pairs(ma):
                    if xx is x and x.type == add.result.type and self._rewrite(block, add, x, cos, sin):
                        return

    def _rewrite(self, block: Block, add: llm.AddOp, x: SSAValue, cos: SSAValue, sin: SSAValue) -> bool:
        shape = llm.shape_of(x)
        if len(shape) != 4 or shape.count(None) != 1 or not (heads_first(x) or shape[1] is None):
            return False
        tables = _tables(block, x, cos, sin, self.weights)
        rope = fit_rope(*tables) if tables is not None else None
        if rope is None:
            return False
        positions = block.args[1]
        if heads_first(x):
            rotated = llm.RopeOp(rows_of_heads(x, add), positions, rope)
            out = heads_back(insert_before(add, rotated), x, add)
        else:  # [1, tokens, heads, head_dim]
            rows = insert_before(add, llm.ReshapeOp(x, (None, shape[2], shape[3])))
            rotated = llm.RopeOp(rows, positions, rope)
            out = insert_before(add, rotated, llm.ReshapeOp(rotated.result, shape))
        replace_value(add.result, out)
        return True
