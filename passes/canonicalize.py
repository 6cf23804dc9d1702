"""`canonicalize`: local simplifications that leave one canonical spelling of a graph.

- a reshape of a reshape is one reshape:
  `%b = llm.reshape %a : tensor<?x576xf32> -> tensor<?x9x64xf32>` of
  `%a = llm.reshape %x : tensor<?x9x64xf32> -> tensor<?x576xf32>` becomes a reshape of `%x`;
- a reshape to its own type is its input.

The reshapes left without uses are erased by `dce`.
"""

from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.passes import ModulePass
from xdsl.pattern_rewriter import (
    GreedyRewritePatternApplier,
    PatternRewriter,
    PatternRewriteWalker,
    RewritePattern,
    op_type_rewrite_pattern,
)

from llmc.ir import llm


class FoldReshapeChain(RewritePattern):
    """reshape(reshape(x)) → reshape(x)."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: llm.ReshapeOp, rewriter: PatternRewriter) -> None:
        producer = op.input.owner
        if isinstance(producer, llm.ReshapeOp):
            rewriter.replace(op, llm.ReshapeOp(producer.input, llm.shape_of(op.result)))


class EraseIdentityReshape(RewritePattern):
    """reshape(x) to x's own type → x."""

    @op_type_rewrite_pattern
    def match_and_rewrite(self, op: llm.ReshapeOp, rewriter: PatternRewriter) -> None:
        if op.input.type == op.result.type:
            rewriter.replace(op, [], [op.input])


@dataclass(frozen=True)
class CanonicalizePass(ModulePass):
    name = "canonicalize"

    def apply(self, ctx: Context, op: ModuleOp) -> None:
        patterns = GreedyRewritePatternApplier([EraseIdentityReshape(), FoldReshapeChain()])
        PatternRewriteWalker(patterns).rewrite_module(op)
