"""`raise-attention`: causal scaled-dot-product attention written out becomes `llm.attention`,
which reads and writes the KV cache; the entry point gains the cache argument `%kv`.

```mlir
%kt = llm.transpose %k axes [0, 1, 3, 2] : (tensor<1x4x?x8xf32>) -> tensor<1x4x8x?xf32>
%s = llm.batch_matmul %q, %kt : (tensor<1x4x?x8xf32>, tensor<1x4x8x?xf32>) -> tensor<1x4x?x?xf32>
%ss = llm.mul %s, %scale : (tensor<1x4x?x?xf32>, tensor<f32>) -> tensor<1x4x?x?xf32>
%sm = llm.add %ss, %mask : (tensor<1x4x?x?xf32>, tensor<1x1x?x?xf32>) -> tensor<1x4x?x?xf32>
%p = llm.softmax %sm axis 3 : tensor<1x4x?x?xf32>
%o = llm.batch_matmul %p, %v : (tensor<1x4x?x?xf32>, tensor<1x4x?x8xf32>) -> tensor<1x4x?x8xf32>
// becomes, with %q, %k, %v as [tokens, heads, head_dim] rows
%a = llm.attention %q3, %k3, %v3, %pos, %kv layer 0 : (...) -> tensor<?x4x8xf32>
```
Matched: the scale on the scores or on q and k (any product of constants; `scale` is set
where it is not `1/sqrt(head_dim)`), the mask added (0 / -inf) or chosen with `llm.where` (a band
of the last W positions becomes `window W`, for W below 1024), NaN rows of the softmax zeroed, and
grouped-query keys and values repeated by unsqueeze → expand → reshape or by a gather of heads (their
shared KV heads are what is cached). The mask must
depend on the positions only, and is computed for a few token counts and checked to be
causal. Layers are numbered in order; all must share KV heads and head dimension.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from xdsl.dialects import builtin, func
from xdsl.ir import Block, SSAValue

from llmc.errors import LlmcError
from llmc.ir import llm
from llmc.ir.interpreter import scalar
from llmc.ir.weights import WeightStore
from llmc.passes.raising import (
    RaisePass,
    constant_ints,
    evaluate_at,
    has_kv_cache,
    heads_back,
    heads_first,
    insert_before,
    operand_pairs,
    position_only,
    producer,
    replace_value,
    rows_of_heads,
)

CACHE_CAPACITY = 4096  # positions of the imported cache; `split` sizes it to --max-seq
MASK_TOKEN_COUNTS = (1, 3, 9, 1024)  # a sliding window narrower than the largest is found


@dataclass
class _Match:
    root: llm.BatchMatmulOp
    q: SSAValue
    k: SSAValue
    v: SSAValue
    scale: float
    window: int | None


def _kv_heads(value: SSAValue) -> SSAValue | None:
    """The `[1, kv_heads, ?, head_dim]` keys or values that `value` repeats per query head
    (reshape(expand(unsqueeze(kv))), or a gather of heads `[0, 0, 1, 1, …]`), or `value` itself."""
    g = producer(value, llm.GatherOp)
    if g is not None and g.axis_index == 1 and heads_first(g.input) and heads_first(value):
        index, kv_heads = constant_ints(g.indices), heads_first(g.input)[0]  # type: ignore[index]
        heads = heads_first(value)[0]  # type: ignore[index]
        if heads % kv_heads == 0 and index == [h // (heads // kv_heads) for h in range(heads)]:
            return g.input
    r = producer(value, llm.ReshapeOp)
    e = producer(r.input, llm.ExpandOp) if r is not None else None
    u = producer(e.input, llm.ReshapeOp, llm.UnsqueezeOp) if e is not None else None
    if u is not None:
        base = u.operands[0]
        b, g = llm.shape_of(base), llm.shape_of(u.results[0])
        if heads_first(base) and len(g) == 5 and g[2] == 1 and (g[0], g[1], g[3], g[4]) == tuple(b):
            return base
    return value if heads_first(value) else None


def _scaled(value: SSAValue) -> tuple[SSAValue, float]:
    """`value` without the constant factors it is multiplied or divided by, and their product."""
    factor = 1.0
    while True:
        op = producer(value, llm.MulOp, llm.DivOp)
        if op is None:
            return value, factor
        if isinstance(op, llm.DivOp):
            c = scalar(op.rhs)
            if c is None or c == 0:
                return value, factor
            value, factor = op.lhs, factor / c
            continue
        for x, c_value in operand_pairs(op):
            c = scalar(c_value)
            if c is not None:
                value, factor = x, factor * c
                break
        else:
            return value, factor


def _window(block: Block, mask: SSAValue, weights: WeightStore | None, additive: bool, seen: dict
            ) -> tuple[bool, int | None]:
    """Whether `mask` (added to the scores, or true where attending) is causal for every token
    count tried, and the sliding window it keeps to (None: every earlier position)."""
    if mask in seen:
        return seen[mask]
    seen[mask] = found = _band(block, mask, weights, additive)
    return found


def _band(block: Block, mask: SSAValue, weights, additive: bool) -> tuple[bool, int | None]:  # noqa: ANN001
    if not position_only(mask, block.args[0]):
        return False, None
    windows = set()
    for n in MASK_TOKEN_COUNTS:
        found = evaluate_at([mask], block, n, weights)
        if found is None or found[0].ndim < 2 or found[0].shape[-2:] not in ((n, n), (1, n)):
            return False, None
        table = found[0].reshape(-1, *found[0].shape[-2:])
        if not np.array_equal(table, np.broadcast_to(table[:1], table.shape)):
            return False, None
        m = np.broadcast_to(table[0], (n, n))
        if additive:
            if not np.all((m == 0) | (m <= -1e30)):
                return False, None
            allowed = m == 0
        else:
            allowed = m.astype(bool)
        width = int(allowed[-1].sum())  # the last row sees the window, or every position
        rows, cols = np.indices((n, n))
        if not np.array_equal(allowed, (cols <= rows) & (cols > rows - width)):
            return False, None
        if width < n:
            windows.add(width)
    if len(windows) > 1:
        return False, None
    return True, windows.pop() if windows else None


def _match(block: Block, root: llm.BatchMatmulOp, weights, seen: dict) -> _Match | None:  # noqa: ANN001
    v = _kv_heads(root.rhs)
    probs = root.lhs
    where = producer(probs, llm.WhereOp)  # NaN rows (fully masked) to 0
    isnan = producer(where.condition, llm.IsNanOp) if where is not None else None
    if isnan is not None and isnan.input is where.rhs and scalar(where.lhs) == 0:
        probs = where.rhs
    softmax = producer(probs, llm.SoftmaxOp)
    if v is None or softmax is None or softmax.axis_index != len(llm.shape_of(probs)) - 1:
        return None
    scores = softmax.input
    add, choose = producer(scores, llm.AddOp), producer(scores, llm.WhereOp)
    window: tuple[bool, int | None] = (False, None)
    if add is not None:
        for s, mask in operand_pairs(add):
            if producer(s, llm.BatchMatmulOp, llm.MulOp, llm.DivOp) is not None and \
                    (window := _window(block, mask, weights, True, seen))[0]:
                scores = s
                break
        else:
            return None
    elif choose is not None and (scalar(choose.rhs) or 0) <= -1e30 and \
            (window := _window(block, choose.condition, weights, False, seen))[0]:
        scores = choose.lhs
    else:
        return None
    scores, factor = _scaled(scores)
    qk = producer(scores, llm.BatchMatmulOp)
    if qk is None:
        return None
    q, q_factor = _scaled(qk.lhs)
    kt, k_factor = _scaled(qk.rhs)
    t = producer(kt, llm.TransposeOp)
    k = _kv_heads(t.input) if t is not None and t.axis_list == (0, 1, 3, 2) else None
    if k is None or not heads_first(q) or llm.shape_of(k) != llm.shape_of(v) or heads_first(q)[1] != heads_first(k)[1]:
        return None
    if heads_first(q)[0] % heads_first(k)[0]:
        return None
    return _Match(root, q, k, v, factor * q_factor * k_factor, window[1])


@dataclass(frozen=True)
class RaiseAttentionPass(RaisePass):
    name = "raise-attention"

    def raise_function(self, function: func.FuncOp) -> None:
        block = function.body.block
        if has_kv_cache(block):
            return
        seen: dict = {}  # each mask's verdict, computed once for all the layers that add it
        matches = [m for op in list(block.ops) if isinstance(op, llm.BatchMatmulOp)
                   if (m := _match(block, op, self.weights, seen)) is not None]
        if not matches:
            return
        shapes = {heads_first(m.k) for m in matches}
        if len(shapes) != 1:
            raise LlmcError(f"raise-attention: the layers' keys differ in (kv heads, head dim): {sorted(shapes)}")
        ((kv_heads, head_dim),) = shapes
        kv = block.insert_arg(llm.KVCacheType(len(matches), kv_heads, CACHE_CAPACITY, head_dim), len(block.args))
        kv.name_hint = "kv"
        function.function_type = builtin.FunctionType.from_lists(block.arg_types, function.function_type.outputs.data)
        for layer, m in enumerate(matches):
            scale = None if math.isclose(m.scale * math.sqrt(head_dim), 1.0, rel_tol=1e-5) else m.scale
            options = llm.AttentionOp.scoring_properties(window=m.window, scale=scale)
            rows = [rows_of_heads(x, m.root) for x in (m.q, m.k, m.v)]
            attention = llm.AttentionOp(*rows, block.args[1], kv, layer, **options)
            replace_value(m.root.result, heads_back(insert_before(m.root, attention), m.q, m.root))
