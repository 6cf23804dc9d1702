"""What the `raise-*` passes share: matching primitive subgraphs of an exported graph.

An exported decoder computes RMSNorm, RoPE, attention and its masks from primitive ops
(`llm.pow`, `llm.reduce_mean`, `llm.cos`, `llm.softmax`, …). Each `raise-*` pass finds
one such subgraph by its structure and replaces it with the `llm` op the GGUF and Hugging
Face frontends build. Where the structure leaves a value open — the cos/sin tables of
RoPE, an attention mask — the value must depend only on the token positions (not on the
tokens), and the pass computes it with the `llm` interpreter for a few positions and
checks it is what the raised op implies (`position_only`, `evaluate_at`).

A `RaisePass` runs `raise_function` on every function; `weights` (the model's store)
lets it evaluate subgraphs that read weights, such as a RoPE frequency buffer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Block, BlockArgument, Operation, SSAValue
from xdsl.transforms.dead_code_elimination import region_dce

from llmc.ir import llm
from llmc.ir.interpreter import constant_array, evaluate
from llmc.ir.weights import WeightStore
from llmc.passes.base import LlmcPass


def producer(value: SSAValue, *types: type[Operation]) -> Operation | None:
    """The op producing `value`, if it is one of `types`."""
    op = value.owner
    return op if isinstance(op, types) else None


def operand_pairs(op: Operation) -> Iterator[tuple[SSAValue, SSAValue]]:
    """A commutative binary op's operands in both orders."""
    yield op.operands[0], op.operands[1]
    yield op.operands[1], op.operands[0]


def strip_casts(value: SSAValue) -> SSAValue:
    """`value` before any `llm.cast` between float types of one width (f32 → f32 after export)."""
    while isinstance(value.owner, llm.CastOp) and value.owner.input.type == value.type:
        value = value.owner.input
    return value


def constant_ints(value: SSAValue) -> list[int] | None:
    """The integers of an `llm.constant`, or None."""
    op = value.owner
    if isinstance(op, llm.ConstantOp):
        return [int(v) for v in constant_array(op).reshape(-1)]
    return None


def weight(value: SSAValue, rank: int) -> llm.WeightOp | None:
    """The `llm.weight` of rank `rank` that `value` is, or None."""
    op = value.owner
    return op if isinstance(op, llm.WeightOp) and len(llm.shape_of(op.result)) == rank else None


def position_only(value: SSAValue, tokens: BlockArgument) -> bool:
    """Whether `value` depends on the tokens only through their count (`llm.shape_of`)."""
    seen: set[SSAValue] = set()
    stack = [value]
    while stack:
        v = stack.pop()
        if v in seen:
            continue
        seen.add(v)
        if v is tokens:
            return False
        op = v.owner
        if isinstance(op, Operation) and not isinstance(op, llm.ShapeOfOp):
            stack.extend(op.operands)
    return True


def has_kv_cache(block: Block) -> bool:
    """Whether the function takes a KV cache already: built by a weight-file frontend, or raised."""
    return any(isinstance(a.type, llm.KVCacheType) for a in block.args)


def evaluate_at(values: list[SSAValue], block: Block, count: int, weights: WeightStore | None, start: int = 0
                ) -> list[np.ndarray] | None:
    """`values` for `count` tokens at positions start.. (tokens all 0), or None where they
    cannot be computed (a weight without the store, an op without semantics)."""
    tokens, positions = block.args[0], block.args[1]
    known = {tokens: np.zeros(count, np.int32), positions: np.arange(start, start + count, dtype=np.int32)}
    try:
        with np.errstate(all="ignore"):
            return evaluate(values, known, weights or WeightStore(source=None))  # type: ignore[arg-type]
    except (KeyError, ValueError, NotImplementedError, IndexError, TypeError, ArithmeticError):
        return None


def insert_before(anchor: Operation, *ops: Operation) -> SSAValue:
    """Insert `ops` before `anchor`; the last one's result."""
    block = anchor.parent_block()
    assert block is not None
    for op in ops:
        block.insert_op_before(op, anchor)
    return ops[-1].results[0]


def replace_value(old: SSAValue, new: SSAValue) -> None:
    new.name_hint = new.name_hint or old.name_hint
    old.replace_all_uses_with(new)


def to_rows(value: SSAValue, anchor: Operation) -> SSAValue | None:
    """`value [1, …, ?, …, width]` as `[tokens, width]` (a reshape before `anchor`), or None when
    its only dynamic dimension is not the tokens'."""
    shape = llm.shape_of(value)
    if len(shape) == 2 and shape[0] is None:
        return value
    if not shape or shape[-1] is None or shape[:-1].count(None) != 1 or any(d != 1 for d in shape[:-1] if d):
        return None
    return insert_before(anchor, llm.ReshapeOp(value, (None, shape[-1])))


def heads_first(value: SSAValue) -> tuple[int, int] | None:
    """(heads, head_dim) of a `[1, heads, ?, head_dim]` value, or None."""
    shape = llm.shape_of(value)
    if len(shape) == 4 and shape[0] in (1, None) and shape[2] is None and None not in (shape[1], shape[3]):
        return shape[1], shape[3]  # type: ignore[return-value]
    return None


def rows_of_heads(value: SSAValue, anchor: Operation) -> SSAValue:
    """A `[1, heads, ?, head_dim]` value as `[tokens, heads, head_dim]`."""
    _, heads, _, dim = llm.shape_of(value)
    t = llm.TransposeOp(value, (0, 2, 1, 3))
    return insert_before(anchor, t, llm.ReshapeOp(t.result, (None, heads, dim)))


def heads_back(rows: SSAValue, like: SSAValue, anchor: Operation) -> SSAValue:
    """`[tokens, heads, head_dim]` rows as the `[1, heads, ?, head_dim]` layout of `like`."""
    _, heads, _, dim = llm.shape_of(like)
    r = llm.ReshapeOp(rows, (1, None, heads, dim))
    return insert_before(anchor, r, llm.TransposeOp(r.result, (0, 2, 1, 3)))


@dataclass(frozen=True)
class RaisePass(LlmcPass):
    """A pass that raises one kind of subgraph in every function."""

    weights: WeightStore | None = field(default=None, compare=False, hash=False)

    def run(self, ctx: Context, module: ModuleOp) -> None:
        for function in self.functions(module):
            self.raise_function(function)
            region_dce(function.body)  # what was raised, so that use counts are the live ones

    def raise_function(self, function: func.FuncOp) -> None:
        raise NotImplementedError
