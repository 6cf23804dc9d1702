"""`refine-shapes`: the dimensions an exported graph leaves open (`?`) that do not change with
the token count become static, and so does the shape arithmetic that does not.

Exporters leave dimensions open where their shape inference gives up (a reshape to a shape
computed from `Shape` ops, say), though they are fixed numbers: `[1, ?, ?, 8]` queries that
always have 4 heads. The pass computes every value of `@forward` with the `llm` interpreter
for two token counts (5 and 7) and for 5 tokens after 11 others; a `?` that is the same number
in all three becomes that number, one that follows the count stays `?`. A small integer
value (a slice bound computed from `llm.shape_of`, say) that is the same in all three and
does not depend on the tokens becomes an `llm.constant`, so that the raising patterns can
read it (one computed from the positions differs in the third).

```mlir
%q = llm.reshape %x to %s : tensor<1x?x32xf32> to tensor<4xi64> -> tensor<1x?x?x8xf32>
// becomes
%q = llm.reshape %x to %s : tensor<1x?x32xf32> to tensor<4xi64> -> tensor<1x?x4x8xf32>
```
Functions that already take a KV cache (built by a weight-file frontend) are left alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerType, TensorType
from xdsl.rewriter import Rewriter

from llmc.ir import llm
from llmc.ir.interpreter import dense, numpy_dtype
from llmc.passes.raising import RaisePass, evaluate_at, has_kv_cache, position_only

PROBES = ((5, 0), (7, 0), (5, 11))  # (token count, first position)
FOLDED_ELEMENTS = 64  # the most elements of an integer value folded to a constant


@dataclass(frozen=True)
class RefineShapesPass(RaisePass):
    name = "refine-shapes"

    def raise_function(self, function: func.FuncOp) -> None:
        block = function.body.block
        if has_kv_cache(block):
            return
        values = [r for op in block.ops for r in op.results if isinstance(r.type, TensorType)
                  and (None in llm.shape_of(r) or _foldable(r))]
        if not values:
            return
        probes = [evaluate_at(values, block, n, self.weights, start) for n, start in PROBES]
        if any(p is None for p in probes):
            return  # something cannot be computed here: keep the exporter's shapes
        for i, value in enumerate(values):
            found = [p[i] for p in probes]  # type: ignore[index]
            if _foldable(value) and all(f.shape == found[0].shape and np.array_equal(f, found[0]) for f in found) \
                    and position_only(value, block.args[0]):
                constant = llm.ConstantOp(dense(found[0].astype(numpy_dtype(llm.element_type(value)))))
                block.insert_op_before(constant, value.owner)
                value.replace_all_uses_with(constant.result)
                continue
            shapes = [f.shape for f in found]
            old = llm.shape_of(value)
            if any(len(s) != len(old) for s in shapes):
                continue
            new = tuple(d if d is not None or len({s[k] for s in shapes}) > 1 else shapes[0][k]
                        for k, d in enumerate(old))
            if new != old:
                Rewriter.replace_value_with_new_type(value, llm.tensor(*new, element_type=llm.element_type(value)))


def _foldable(value) -> bool:  # noqa: ANN001
    """An integer or boolean value of a few elements, computed by an op other than a constant."""
    shape = llm.shape_of(value)
    return isinstance(llm.element_type(value), IntegerType) and None not in shape \
        and int(np.prod(shape)) <= FOLDED_ELEMENTS and not isinstance(value.owner, llm.ConstantOp)
