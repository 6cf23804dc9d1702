"""`raise-rms-norm`: RMSNorm written out becomes `llm.rms_norm`.

```mlir
%sq = llm.pow %x, %two : (tensor<1x?x32xf32>, tensor<f32>) -> tensor<1x?x32xf32>      // or x * x
%ms = llm.reduce_mean %sq axes [2] keepdims : (tensor<1x?x32xf32>) -> tensor<1x?x1xf32>
%me = llm.add %ms, %eps : (tensor<1x?x1xf32>, tensor<f32>) -> tensor<1x?x1xf32>
%r = llm.rsqrt %me : tensor<1x?x1xf32>                               // or reciprocal(sqrt), or 1 / sqrt
%n = llm.mul %x, %r : (tensor<1x?x32xf32>, tensor<1x?x1xf32>) -> tensor<1x?x32xf32>
%y = llm.mul %w, %n : (tensor<32xf32>, tensor<1x?x32xf32>) -> tensor<1x?x32xf32>
// becomes
%y = llm.rms_norm %x, %w eps 1.000000e-06 : tensor<1x?x32xf32>, tensor<32xf32>
```
"""

from __future__ import annotations

from dataclasses import dataclass

from xdsl.dialects import func
from xdsl.ir import SSAValue

from llmc.ir import llm
from llmc.ir.interpreter import scalar
from llmc.passes.raising import (
    RaisePass,
    insert_before,
    operand_pairs,
    producer,
    replace_value,
    strip_casts,
    weight,
)


def _inverse_rms(value: SSAValue, x: SSAValue) -> float | None:
    """The epsilon of `1/sqrt(mean(x²) + eps)` over x's last axis, if `value` computes it."""
    r = producer(value, llm.RsqrtOp)
    if r is not None:
        inner = r.input
    else:  # 1 / sqrt, as reciprocal or division
        rec, div = producer(value, llm.ReciprocalOp), producer(value, llm.DivOp)
        denominator = rec.input if rec is not None else div.rhs if div is not None and scalar(div.lhs) == 1.0 else None
        root = producer(denominator, llm.SqrtOp) if denominator is not None else None
        if root is None:
            return None
        inner = root.input
    add = producer(inner, llm.AddOp)
    if add is None:
        return None
    for mean_value, eps_value in operand_pairs(add):
        eps, mean = scalar(eps_value), producer(mean_value, llm.ReduceMeanOp)
        rank = len(llm.shape_of(x))
        if eps is None or mean is None or mean.keepdims is None or mean.axis_list != (rank - 1,):
            continue
        square = producer(mean.input, llm.PowOp, llm.MulOp)
        if isinstance(square, llm.PowOp) and strip_casts(square.lhs) is x and scalar(square.rhs) == 2.0:
            return eps
        if isinstance(square, llm.MulOp) and strip_casts(square.lhs) is x and strip_casts(square.rhs) is x:
            return eps
    return None


@dataclass(frozen=True)
class RaiseRmsNormPass(RaisePass):
    name = "raise-rms-norm"

    def raise_function(self, function: func.FuncOp) -> None:
        for op in list(function.body.block.ops):
            if isinstance(op, llm.MulOp):
                self._match(op)

    @staticmethod
    def _match(op: llm.MulOp) -> None:
        for w_value, normed in operand_pairs(op):
            w = weight(strip_casts(w_value), 1)
            n = producer(strip_casts(normed), llm.MulOp)
            if w is None or n is None:
                continue
            for x, inv in operand_pairs(n):
                x = strip_casts(x)
                eps = _inverse_rms(inv, x)
                if eps is not None and llm.shape_of(x)[-1:] == llm.shape_of(w.result) and x.type == op.result.type:
                    replace_value(op.result, insert_before(op, llm.RMSNormOp(x, w.result, eps)))
                    return
