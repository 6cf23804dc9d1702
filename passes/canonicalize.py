"""`canonicalize`: local simplifications that leave one canonical spelling of a graph.

- an elementwise op of small constants is the constant it computes;
- a reshape to a run-time shape that its result type spells (at most one `?`) is a plain
  reshape; a reshape of a reshape is one reshape, and a reshape, cast or transpose to its
  own type is its input:
  `%b = llm.reshape %a : tensor<?x576xf32> -> tensor<?x9x64xf32>` of
  `%a = llm.reshape %x : tensor<?x9x64xf32> -> tensor<?x576xf32>` becomes a reshape of `%x`;
- a transpose of a transpose is one transpose (none when they cancel);
- `llm.unsqueeze` / `llm.squeeze` with at most one dynamic dimension are reshapes;
- reshapes move below elementwise ops, RMSNorm and last-axis reductions that keep the
  last dimension, so that the raised ops of an exported graph (which reshape to
  `[tokens, width]` and back) meet in `[tokens, width]` form and their reshapes cancel:
  `llm.silu(llm.reshape %m : tensor<?x48xf32> -> tensor<1x?x48xf32>)` becomes
  `llm.reshape(llm.silu %m)`;
- a transpose spelled as reshape → swap of the last two → reshape back (what ONNX
  exporters write for `k.transpose(-2, -1)`) is that transpose;
- a concatenation with an empty tensor (an exported graph's empty past keys) is the other operand.

The ops left without uses are erased by `dce`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)

from llmc.ir import llm
from llmc.ir.interpreter import constant_array, dense, evaluate

# elementwise ops a reshape may move below (any element type, one result of the operands' shape)
_UNARY = (llm._UnaryOp, llm.CastOp, llm.IsNanOp)


def _plain_reshape(value: SSAValue) -> llm.ReshapeOp | None:
    """The reshape producing `value`, when its result shape is static but for the tokens."""
    op = value.owner
    return op if isinstance(op, llm.ReshapeOp) and op.shape is None else None


def _same_last(a: SSAValue, b: SSAValue) -> bool:
    sa, sb = llm.shape_of(a), llm.shape_of(b)
    return bool(sa) and bool(sb) and sa[-1] is not None and sa[-1] == sb[-1]


def _reshaped(value: SSAValue, like: SSAValue) -> llm.ReshapeOp:
    return llm.ReshapeOp(value, llm.shape_of(like))


class FoldConstants(RewritePattern):
    """An elementwise op of constants (at most `FOLDED` elements) → the constant it computes:
    `llm.sqrt` of `dense<1.250000e-01>` becomes `dense<0.353553385>`."""

    FOLDED = 64

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if not isinstance(op, (*_UNARY, llm._BinaryOp)) or not op.operands or \
                not all(isinstance(v.owner, llm.ConstantOp) for v in op.operands):
            return
        shape = llm.shape_of(op.results[0])
        if None in shape or int(np.prod(shape)) > self.FOLDED:
            return
        (value,) = evaluate([op.results[0]], {}, None)  # type: ignore[arg-type]
        rewriter.replace(op, llm.ConstantOp(dense(np.asarray(value))))


class StaticReshape(RewritePattern):
    """reshape(x) to a run-time shape whose result type says it (at most one `?`) → a reshape to that type."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: llm.ReshapeOp, rewriter: PatternRewriter) -> None:
        if op.shape is not None and llm.shape_of(op.result).count(None) <= 1:
            rewriter.replace(op, llm.ReshapeOp(op.input, llm.shape_of(op.result)))


class FoldReshapeChain(RewritePattern):
    """reshape(reshape(x)) → reshape(x)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: llm.ReshapeOp, rewriter: PatternRewriter) -> None:
        producer = op.input.owner
        if isinstance(producer, llm.ReshapeOp) and op.shape is None:
            rewriter.replace(op, llm.ReshapeOp(producer.input, llm.shape_of(op.result)))


class EraseIdentity(RewritePattern):
    """reshape, cast or transpose of x to x's own type → x (a transpose only when it permutes nothing)."""

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if isinstance(op, llm.CastOp) and op.input.type == op.result.type:
            rewriter.replace(op, [], [op.input])
        elif isinstance(op, llm.ReshapeOp) and op.shape is None and op.input.type == op.result.type \
                and llm.shape_of(op.result).count(None) <= 1:  # two `?`s of one type may still trade places
            rewriter.replace(op, [], [op.input])
        elif isinstance(op, llm.TransposeOp) and op.axis_list == tuple(range(len(op.axis_list))):
            rewriter.replace(op, [], [op.input])


class FoldTransposeChain(RewritePattern):
    """transpose(transpose(x, p), q) → transpose(x, p∘q)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: llm.TransposeOp, rewriter: PatternRewriter) -> None:
        inner = op.input.owner
        if isinstance(inner, llm.TransposeOp):
            perm = [inner.axis_list[p] for p in op.axis_list]
            rewriter.replace(op, llm.TransposeOp(inner.input, perm))


class UnsqueezeAsReshape(RewritePattern):
    """unsqueeze / squeeze → reshape, where a reshape can say it (at most one dynamic dimension)."""

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if isinstance(op, (llm.UnsqueezeOp, llm.SqueezeOp)) and llm.shape_of(op.result).count(None) <= 1 \
                and llm.shape_of(op.input).count(None) == llm.shape_of(op.result).count(None):
            rewriter.replace(op, llm.ReshapeOp(op.input, llm.shape_of(op.result)))


def _rank0(value: SSAValue) -> SSAValue | None:
    """A single-element constant as a rank-0 constant, to broadcast against any shape."""
    op = value.owner
    if isinstance(op, llm.ConstantOp) and all(d == 1 for d in llm.shape_of(value)):
        return llm.ConstantOp(llm.DenseIntOrFPElementsAttr.from_list(
            llm.tensor(element_type=llm.element_type(value)), [constant_array(op).reshape(()).item()])).result
    return None


class SinkReshape(RewritePattern):
    """op(reshape(x)) → reshape(op(x)) for ops that keep the last dimension (see the module docstring)."""

    def match_and_rewrite(self, op: Operation, rewriter: PatternRewriter) -> None:
        if isinstance(op, _UNARY):
            r = _plain_reshape(op.input)
            if r is not None and _same_last(r.input, op.input):
                result = llm.tensor(*llm.shape_of(r.input), element_type=llm.element_type(op.results[0]))
                inner = type(op).create(operands=[r.input], result_types=[result], properties=dict(op.properties))
                rewriter.replace(op, [inner, _reshaped(inner.results[0], op.results[0])])
        elif isinstance(op, llm.RMSNormOp):
            r = _plain_reshape(op.input)
            if r is not None and _same_last(r.input, op.input):
                inner = llm.RMSNormOp(r.input, op.weight, op.eps.value.data)
                rewriter.replace(op, [inner, _reshaped(inner.result, op.result)])
        elif isinstance(op, llm._ReduceOp) and op.keepdims is not None:
            r = _plain_reshape(op.input)
            rank = len(llm.shape_of(op.input))
            if r is not None and op.axis_list == (rank - 1,) and _same_last(r.input, op.input):
                inner = type(op)(r.input, [-1], True)
                rewriter.replace(op, [inner, _reshaped(inner.results[0], op.result)])
        elif isinstance(op, llm._BinaryOp):
            self._binary(op, rewriter)

    @staticmethod
    def _binary(op: llm._BinaryOp, rewriter: PatternRewriter) -> None:
        a, b = _plain_reshape(op.lhs), _plain_reshape(op.rhs)
        if a is not None and b is not None:
            same = a.input.type == b.input.type and op.lhs.type == op.rhs.type and _same_last(a.input, op.lhs)
            ranks_match = len(llm.shape_of(a.input)) == len(llm.shape_of(b.input))
            if same or (_ones_before(a) and _ones_before(b) and ranks_match):
                inner = type(op)(a.input, b.input)
                rewriter.replace(op, [inner, _reshaped(inner.result, op.result)])
            return
        for reshape, other, first in ((a, op.rhs, True), (b, op.lhs, False)):
            if reshape is None or llm.shape_of(op.result) != llm.shape_of(reshape.result):
                continue
            new: list[Operation] = []
            scalar = _rank0(other)
            if scalar is not None:
                new.append(scalar.owner)  # type: ignore[arg-type]
                other = scalar
            elif not (llm.shape_of(other) == llm.shape_of(reshape.result)[-1:] and _same_last(reshape.input, other)):
                continue
            operands = (reshape.input, other) if first else (other, reshape.input)
            inner = type(op)(*operands)
            rewriter.replace(op, [*new, inner, _reshaped(inner.result, op.result)])
            return


def _ones_before(reshape: llm.ReshapeOp) -> bool:
    """The reshape only puts size-1 dimensions in front (`[?, 1]` → `[1, ?, 1]`)."""
    src, dst = llm.shape_of(reshape.input), llm.shape_of(reshape.result)
    extra = len(dst) - len(src)
    return extra > 0 and dst[extra:] == src and all(d == 1 for d in dst[:extra])


class TransposeThroughReshape(RewritePattern):
    """reshape(x: [..., a, b] → [p, a, b]) → transpose [0, 2, 1] → (times constants) → reshape to
    [..., b, a] is `llm.transpose` of x (reshaped to the result's leading dimensions) swapping its
    last two dimensions, times the constants."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: llm.ReshapeOp, rewriter: PatternRewriter) -> None:
        value, factors = op.input, []
        while isinstance(value.owner, llm.MulOp) and _rank0(value.owner.rhs) is not None:
            factors.append(value.owner.rhs)
            value = value.owner.lhs
        t = value.owner
        if not (isinstance(t, llm.TransposeOp) and t.axis_list == (0, 2, 1)) or op.shape is not None:
            return
        inner = t.input.owner
        if not isinstance(inner, llm.ReshapeOp) or inner.shape is not None:
            return
        x, middle, out = llm.shape_of(inner.input), llm.shape_of(inner.result), llm.shape_of(op.result)
        if len(x) < 2 or len(out) < 3 or not _matches(middle[1:], x[-2:]) or not _matches(out[-2:], x[:-3:-1]):
            return
        lead, out_lead = x[:-2], out[:-2]  # flattened into middle[0], then unflattened: the same elements
        if not _matches(middle[:1], (None,) if None in lead else (int(np.prod(lead)),)) or \
                (None not in lead and None not in out_lead and np.prod(lead) != np.prod(out_lead)) or \
                (None in lead) != (None in out_lead) or out_lead.count(None) > 1:
            return
        new: list[Operation] = []
        source = inner.input
        if lead != out_lead:
            new.append(llm.ReshapeOp(source, (*out_lead, *x[-2:])))
            source = new[-1].results[0]
        rank = len(out)
        new.append(llm.TransposeOp(source, [*range(rank - 2), rank - 1, rank - 2]))
        for factor in reversed(factors):
            scalar = _rank0(factor)
            assert scalar is not None
            new += [scalar.owner, llm.MulOp(new[-1].results[0], scalar)]  # type: ignore[list-item]
        rewriter.replace(op, new)


def _matches(a: tuple[int | None, ...], b: tuple[int | None, ...]) -> bool:
    """Dimensions that may be equal: equal where both are static."""
    return len(a) == len(b) and all(x is None or y is None or x == y for x, y in zip(a, b))


class DropEmptyConcat(RewritePattern):
    """concat(empty, x) → x: an exported graph's past keys, imported with no past positions."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: llm.ConcatOp, rewriter: PatternRewriter) -> None:
        kept = [v for v in op.inputs if llm.shape_of(v)[op.axis_index] != 0]
        if len(kept) == len(op.inputs) or not kept:
            return
        if len(kept) == 1 and kept[0].type == op.result.type:
            rewriter.replace(op, [], [kept[0]])
        elif len(kept) > 1:
            rewriter.replace(op, llm.ConcatOp(kept, op.axis_index, op.result.type))


PATTERNS = (EraseIdentity(), FoldConstants(), StaticReshape(), FoldReshapeChain(), FoldTransposeChain(),
            UnsqueezeAsReshape(), SinkReshape(), TransposeThroughReshape(), DropEmptyConcat())


@dataclass(frozen=True)
class CanonicalizePass(ModulePass):
    name = "canonicalize"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        PatternRewriteWalker(GreedyRewritePatternApplier(list(PATTERNS))).rewrite_module(op)
