"""`split`: one `@forward` becomes the entry points a generation loop calls.

- `@prefill`: a prompt chunk of at most `prefill_chunk` tokens at positions 0.. (no history);
- `@prefill_kv`: a chunk that attends to the history already in the cache;
- `@decode`: one token against the cache (every token shape becomes 1);
- `@score`: a chunk like `@prefill_kv` that returns every row's logits (perplexity,
  KL divergence); generation never pays for the extra rows;
- `@verify` (`speculate K > 0`): up to K + 1 rows (the last accepted token and K drafted ones)
  against the cache, every row's logits: speculative decoding checks a draft in one call, at
  about decode's cost (its few rows take decode's small-row kernels, not prefill's tiles).

All keep the signature `(%tokens, %pos, %kv)` with the KV cache resized to `max_seq`
rows; all but `@score` and `@verify` return only the last token's logits:

```mlir
func.func @decode(%tokens: tensor<1xi32>, %pos: tensor<1xi32>, %kv: !llm.kv_cache<30x3x4096x64xf32>)
    -> tensor<1x49152xf32> attributes {llm.max_tokens = 1 : i64, llm.stage = "decode"} {
  ...
  %last = llm.last_token %final : tensor<?x576xf32> -> tensor<1x576xf32>   // prefill stages only
  %logits = llm.logits %last, %token_embd : (...) -> tensor<1x49152xf32>
```
```mlir
func.func @verify(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %kv: !llm.kv_cache<30x3x4096x64xf32>)
    -> tensor<?x49152xf32> attributes {llm.max_tokens = 9 : i64, llm.stage = "verify"} {
```
The positions of a chunk (and of `@verify`'s rows) are consecutive; the stage attribute tells
later phases whether the cache holds history to read.

With `max_batch B > 1` the cache holds B sequences (`!llm.kv_cache<…, slots B>`) and every
entry point takes each row's slot (`%slots`, passed on to every `llm.attention`): a prompt
chunk's rows are runs of consecutive positions, each run in one slot (`@prefill_kv` feeds
several sequences' prompts in one call); `@decode` takes up to B rows, one token of each of up to B
sequences, and returns every row's logits; `@verify`'s rows may be in several slots, each row
attending within its own slot up to its position as decode's do (the server checks every
sequence's draft in one call):

```mlir
func.func @decode(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %slots: tensor<?xi32>,
                  %kv: !llm.kv_cache<30x3x4096x64xf16, slots 8>) -> tensor<?x49152xf32>
    attributes {llm.max_tokens = 8 : i64, llm.stage = "decode"} {
```
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects import builtin, func
from xdsl.dialects.builtin import DYNAMIC_INDEX, IntegerAttr, ModuleOp, StringAttr, TensorType, i64
from xdsl.ir import Attribute, Block, Region, SSAValue

from llmc.abi import ENTRY_POINTS, OPTIONAL_ENTRY_POINTS
from llmc.errors import UsageError
from llmc.ir import find_function, llm, tgt
from llmc.ir.target import target_description
from llmc.passes.base import LlmcPass

DEFAULT_MAX_SEQ_CAP = 4096
DEFAULT_PREFILL_CHUNK = 128  # without a target (a target's description has its own: `prefill_chunk`)
MAX_BATCH = 64  # sequences a cache may hold (decode's rows; attention's partials scale with it)
DEFAULT_SPECULATE = 8  # drafted tokens `@verify` checks at once (with the last accepted one: 9 rows)
MAX_SPECULATE = MAX_BATCH - 1  # `@verify`'s rows, like decode's, share attention's partials


def check_rows(max_batch: int, drafts: int) -> None:
    """Refuse a `--max-batch` or `--speculate` the entry points cannot take, whatever the model (before a
    compile starts, and in the pass)."""
    if not 1 <= max_batch <= MAX_BATCH:
        raise UsageError(f"--max-batch must be in 1..{MAX_BATCH}, got {max_batch}")
    if not 0 <= drafts <= MAX_SPECULATE:
        raise UsageError(f"--speculate must be in 0..{MAX_SPECULATE}, got {drafts}")


def retyped(function: func.FuncOp, name: str, subst: Callable[[Attribute], Attribute]) -> func.FuncOp:
    """A copy of `function` named `name` whose argument and result types go through `subst`."""
    old_block = function.body.block
    block = Block(arg_types=[subst(a.type) for a in old_block.args])
    mapping: dict[SSAValue, SSAValue] = {}
    for old, new in zip(old_block.args, block.args):
        new.name_hint = old.name_hint
        mapping[old] = new
    for op in old_block.ops:
        new_op = type(op).create(
            operands=[mapping[v] for v in op.operands],
            result_types=[subst(r.type) for r in op.results],
            properties=dict(op.properties),
            attributes=dict(op.attributes),
        )
        for old, new in zip(op.results, new_op.results):
            new.name_hint = old.name_hint
            mapping[old] = new
        block.add_op(new_op)
    outputs = [subst(t) for t in function.function_type.outputs.data]
    return func.FuncOp(name, (block.arg_types, outputs), Region(block))


def _last_token_logits(function: func.FuncOp) -> None:
    """Make `llm.logits` read only the last token's row, and the function return that."""
    for op in list(function.body.block.ops):
        if isinstance(op, llm.LogitsOp):
            last = llm.LastTokenOp(op.input)
            last.result.name_hint = "last"
            function.body.block.insert_op_before(last, op)
            logits = llm.LogitsOp(last.result, op.weight, compute=op.mode, softcap=op.cap)
            logits.result.name_hint = op.result.name_hint
            function.body.block.insert_op_before(logits, op)
            op.result.replace_all_uses_with(logits.result)
            function.body.block.erase_op(op)
    ret = function.body.block.last_op
    assert isinstance(ret, func.ReturnOp)
    function.function_type = builtin.FunctionType.from_lists(
        function.function_type.inputs.data, [v.type for v in ret.operands]
    )


def _take_slots(function: func.FuncOp) -> None:
    """Add `%slots` (each row's sequence) after `%pos`, and give it to every `llm.attention`."""
    block = function.body.block
    positions = block.args[1]
    slots = block.insert_arg(positions.type, 2)
    slots.name_hint = "slots"
    for op in list(block.ops):
        if isinstance(op, llm.AttentionOp):
            new = llm.AttentionOp(op.query, op.key, op.value, op.positions, op.kv_cache, op.layer.value.data, op.rope,
                                  slots=slots, **op.options)
            new.result.name_hint = op.result.name_hint
            block.insert_op_before(new, op)
            op.result.replace_all_uses_with(new.result)
            block.erase_op(op)
    function.function_type = builtin.FunctionType.from_lists(block.arg_types, function.function_type.outputs.data)


@dataclass(frozen=True)
class SplitPass(LlmcPass):
    name = "split"
    requires_phase = "quantize"
    last_phase = "quantize"

    prefill_chunk: int = 0  # 0: the target's default (`TargetDescription.prefill_chunk`), at most max_seq
    max_seq: int = 0  # 0: the model's context length, capped at DEFAULT_MAX_SEQ_CAP
    kv_type: str = "f32"  # the cache's element type: f32, f16 or q8_0
    max_batch: int = 1  # sequences the cache holds, and decode's rows
    speculate: int = DEFAULT_SPECULATE  # drafted tokens `@verify` takes (0: no `@verify`)

    def run(self, ctx: Context, module: ModuleOp) -> None:
        forward = find_function(module, "forward")
        cache = forward.function_type.inputs.data[2]
        assert isinstance(cache, llm.KVCacheType)
        layers, kv_heads, context_length, head_dim = cache.shape
        max_seq = self.max_seq or min(context_length, DEFAULT_MAX_SEQ_CAP)
        if not 2 <= max_seq <= context_length:  # (a prompt token and one generated)
            raise UsageError(f"--max-seq must be in 2..{context_length} (the model's context length), got {max_seq}")
        target = module.attributes.get(tgt.TARGET)
        default = target_description(target).prefill_chunk if isinstance(target, tgt.TargetAttr) \
            else DEFAULT_PREFILL_CHUNK
        chunk = self.prefill_chunk or min(default, max_seq)
        if not 1 <= chunk <= max_seq:
            raise UsageError(f"--prefill-chunk must be in 1..{max_seq} (--max-seq), got {chunk}")
        if self.kv_type not in llm.KV_TYPES:
            raise UsageError(f"--kv-type must be one of {', '.join(llm.KV_TYPES)}, got '{self.kv_type}'")
        if self.kv_type == "q8_0" and head_dim % 32:
            raise UsageError(f"--kv-type q8_0 needs a head dimension that is a multiple of 32, got {head_dim}")
        check_rows(self.max_batch, self.speculate)
        batched = self.max_batch > 1
        rows = {"prefill": chunk, "prefill_kv": chunk, "decode": self.max_batch, "score": chunk,
                "verify": min(self.speculate + 1, max_seq)}
        assert set(rows) == {*ENTRY_POINTS, *OPTIONAL_ENTRY_POINTS}
        new_cache = llm.KVCacheType(layers, kv_heads, max_seq, head_dim, llm.KV_TYPES[self.kv_type], self.max_batch)

        for stage in ENTRY_POINTS + (("verify",) if self.speculate else ()):
            tokens = 1 if stage == "decode" and not batched else None

            def subst(t: Attribute, tokens: int | None = tokens) -> Attribute:
                if t == cache:
                    return new_cache
                if isinstance(t, TensorType) and DYNAMIC_INDEX in t.get_shape():
                    return llm.tensor(*[tokens if d == DYNAMIC_INDEX else d for d in t.get_shape()],
                                      element_type=t.element_type)
                return t

            entry = retyped(forward, stage, subst)
            if stage in ("prefill", "prefill_kv"):
                _last_token_logits(entry)
            if batched:
                _take_slots(entry)
            entry.attributes["llm.stage"] = StringAttr(stage)
            entry.attributes["llm.max_tokens"] = IntegerAttr(rows[stage], i64)
            module.body.block.insert_op_before(entry, forward)
        module.body.block.erase_op(forward)
