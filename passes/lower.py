"""`lower`: `llm` entry points → `tgt` kernels over typed buffers, one op at a time.

Each `llm` value gets a buffer (`tgt.alloc`, placed later by `plan-memory`) sized for
the entry point's largest chunk: float rows, or quantized rows when every reader is an
integer projection of one width — all `a8` (int8 rows, `!tgt.qrows<128x576>`) or all
`a16` (int16 rows, `!tgt.qrows<128x576xi16>`) — and the producing kernel can quantize
its output (RMSNorm, SwiGLU, attention). Otherwise the producer writes float rows and
each integer width reading them gets them through one `tgt.quantize` of its own.
Reshapes become views; the token positions become `%positions`, one per row (and their
sequences `%slots`, where the cache holds several); the KV cache becomes `%k_cache` /
`%v_cache` in the layout `tgt.kv_layout` (`llmc.abi.KV_LAYOUT`, or `KV_LAYOUT_SLOTS`), one
`tgt.subview` per layer; logits are written to the `%logits` argument. Weights keep
the storage `quantize` chose, in the `stored` layout (`pack` chooses the target's).

```mlir
// llm                                                    // tgt
%h = llm.rms_norm %x, %g eps 1.0e-05 : ...                 tgt.rms_norm %x, %g -> %h rows %n eps 1.0e-05 : memref<128x576xf32>, ... -> !tgt.qrows<128x576xi16>
%q = llm.matmul %h, %wq compute a16 : ...                  tgt.matmul %h, %wq -> %q rows %n : !tgt.qrows<128x576xi16>, ... -> memref<128x576xf32>
%x1 = llm.matmul %a, %wo residual %x compute a8 : ...      tgt.matmul %a, %wo -> %x rows %n accumulate : ...   // in place
// %a read by a8 and a16 projections: float rows, quantized once per width
%a = llm.swiglu %h, %wg, %wu compute a8 : ...              tgt.swiglu %h, %wg, %wu -> %a rows %n : ... -> memref<128x1536xf32>
                                                           tgt.quantize %a -> %a_q rows %n : memref<128x1536xf32> -> !tgt.qrows<128x1536>
                                                           tgt.quantize %a -> %a_q16 rows %n : memref<128x1536xf32> -> !tgt.qrows<128x1536xi16>
```
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from xdsl.context import Context
from xdsl.dialects import func
from xdsl.dialects.builtin import IndexType, IntegerAttr, ModuleOp, StringAttr, i32, i64
from xdsl.ir import Attribute, Block, Operation, OpResult, Region, SSAValue

from llmc.abi import KV_LAYOUT, KV_LAYOUT_SLOTS, entry_arguments
from llmc.errors import LlmcError
from llmc.ir import llm, tgt
from llmc.ir.activations import activation_of
from llmc.ir.formats import FORMATS
from llmc.ir.interfaces import OpInterface
from llmc.ir.interpreter import scalar
from llmc.ir.layouts import Layout
from llmc.passes.base import LlmcPass
from llmc.passes.group import single_user, users


def _bits(op: llm.Projection) -> int | None:
    """The width of the quantized rows a projection reads: 8 (`a8`), 16 (`a16`), None (float rows)."""
    return op.mode.bits if op.mode.integer else None


def _reads_quantized(value: SSAValue) -> int | None:
    """The one width of quantized rows every reader of `value` wants (through reshapes and
    last_token): 8 when all are `a8` projections, 16 when all are `a16`; else None."""
    readers = users(value)
    widths = set()
    for op in readers:
        if isinstance(op, (llm.ReshapeOp, llm.LastTokenOp)):
            widths.add(_reads_quantized(op.result))
        elif isinstance(op, llm.Projection) and op.input == value:
            widths.add(_bits(op))
        else:
            return None
    return widths.pop() if len(widths) == 1 else None


@dataclass
class _Lowering:
    block: Block
    rows: int
    n: SSAValue
    positions: SSAValue
    slots: SSAValue | None
    split_rows: int  # attention's rows that share the cache positions among threads
    k_cache: SSAValue
    v_cache: SSAValue
    logits: SSAValue
    buffers: dict[SSAValue, SSAValue] = field(default_factory=dict)  # float rows (or any buffer)
    quantized: dict[tuple[SSAValue, int], SSAValue] = field(default_factory=dict)  # (value, bits) → its rows
    weights: dict[str, SSAValue] = field(default_factory=dict)
    layers: dict[int, tuple[SSAValue, SSAValue]] = field(default_factory=dict)

    def emit(self, op: Operation) -> Operation:
        self.block.add_op(op)
        return op

    def _shape(self, value: SSAValue) -> tuple[int, ...]:
        shape = llm.shape_of(value)
        if None in shape[1:]:  # (a graph's op left unraised, as Qwen3's per-head q/k norm in a .pt2 or .onnx)
            owner = value.owner.name if isinstance(value, OpResult) else "an argument"
            shown = "x".join("?" if d is None else str(d) for d in shape)
            raise LlmcError(f"lower: {owner} gives a tensor<{shown}>, whose tokens are not its first dimension: "
                            f"not a shape llmc lowers (this graph's op was not raised to a model op; an HF "
                            f"directory or GGUF file of the model compiles)")
        return (self.rows, *shape[1:]) if shape[0] is None else tuple(shape)  # type: ignore[arg-type]

    def _alloc(self, value: SSAValue, result_type: Attribute) -> SSAValue:
        buf = self.emit(tgt.AllocOp(result_type)).result
        buf.name_hint = value.name_hint
        return buf

    def out(self, value: SSAValue, can_quantize: bool = False) -> SSAValue:
        """A buffer for `value`: quantized rows when its readers all want one width of them and the
        producer can write them."""
        shape = self._shape(value)
        width = math.prod(shape[1:])
        bits = _reads_quantized(value) if can_quantize and width % 32 == 0 else None
        if bits is not None:
            buf = self._alloc(value, tgt.QRowsType(shape[0], width, bits))
            self.quantized[value, bits] = buf
            return buf
        buf = self._alloc(value, tgt.memref(*shape))
        self.buffers[value] = buf
        return buf

    def x(self, op: llm.Projection) -> SSAValue:
        """The rows a projection reads: quantized for `a8` / `a16` (quantizing float rows once per
        width), else float."""
        value, bits = op.input, _bits(op)
        if bits is None:
            return self.buffers[value]
        if (value, bits) not in self.quantized:
            source = self.buffers[value]
            shape = tgt.dims(source)
            buf = self._alloc(value, tgt.QRowsType(shape[0], tgt.row_width(source), bits))
            buf.name_hint = f"{value.name_hint}_q{'' if bits == 8 else bits}" if value.name_hint else None
            self.emit(tgt.QuantizeOp(source, buf, self.n))
            self.quantized[value, bits] = buf
        return self.quantized[value, bits]

    def alias(self, result: SSAValue, source: SSAValue) -> None:
        if source in self.buffers:
            self.buffers[result] = self.buffers[source]
        for bits in (8, 16):
            if (source, bits) in self.quantized:
                self.quantized[result, bits] = self.quantized[source, bits]

    def norm(self, op: llm.Projection) -> dict:
        return {"norm": self.buffers[op.norm], "eps": op.eps.value.data} if op.norm is not None else {}

    def cache_layer(self, layer: int) -> tuple[SSAValue, SSAValue]:
        if layer not in self.layers:
            k, v = (self.emit(tgt.SubviewOp(c, layer)).result for c in (self.k_cache, self.v_cache))
            k.name_hint, v.name_hint = f"k_cache_l{layer}", f"v_cache_l{layer}"
            self.layers[layer] = (k, v)
        return self.layers[layer]


LOWERINGS = OpInterface("lower", "lowering")
lowering = LOWERINGS.implement  # `fn(lo, op)` emits the kernels of `op`


@lowering(llm.WeightOp)
def _weight(lo: _Lowering, op: llm.WeightOp) -> None:
    if op.sym_name not in lo.weights:
        shape = tuple(d for d in llm.shape_of(op.result) if d is not None)
        if len(shape) > 2:  # experts' matrices: their rows stacked, `[experts·out, in]`
            shape = (math.prod(shape[:-1]), shape[-1])
        if len(shape) < 2 and not FORMATS[op.storage.data].is_float:  # (`quantize` makes such vectors f32)
            raise LlmcError(f"lower: weight @{op.sym_name} is a {op.storage.data} vector; kernels read vectors "
                            f"as floats (run `quantize`, or store it f32)")
        weight_type = tgt.WeightType(shape, op.storage.data, Layout.STORED)
        lo.weights[op.sym_name] = lo.emit(tgt.WeightOp(op.sym_name, weight_type)).result
    lo.buffers[op.result] = lo.weights[op.sym_name]


@lowering(llm.EmbeddingOp)
def _embedding(lo: _Lowering, op: llm.EmbeddingOp) -> None:
    lo.emit(tgt.EmbeddingOp(lo.buffers[op.tokens], lo.buffers[op.table], lo.out(op.result), lo.n, op.scale))


@lowering(llm.RMSNormOp)
def _rms_norm(lo: _Lowering, op: llm.RMSNormOp) -> None:
    x, w = lo.buffers[op.input], lo.buffers[op.weight]
    lo.emit(tgt.RMSNormOp(x, w, lo.out(op.result, can_quantize=True), lo.n, op.eps.value.data))


@lowering(llm.MatmulOp)
def _matmul(lo: _Lowering, op: llm.MatmulOp) -> None:
    if op.residual is not None:
        out = lo.buffers[op.residual]  # the residual stream, updated in place
        lo.buffers[op.result] = out
    else:
        out = lo.out(op.result)
    bias = lo.buffers[op.bias] if op.bias is not None else None
    lo.emit(tgt.MatmulOp(lo.x(op), lo.buffers[op.weight], out, lo.n, bias=bias, accumulate=op.residual is not None,
                         **lo.norm(op)))


@lowering(llm.LogitsOp)
def _logits(lo: _Lowering, op: llm.LogitsOp) -> None:
    last_row = isinstance(op.input.owner, llm.LastTokenOp)
    lo.emit(tgt.MatmulOp(lo.x(op), lo.buffers[op.weight], lo.logits, lo.n, last_row=last_row, softcap=op.cap,
                         **lo.norm(op)))


@lowering(llm.SwigluOp)
def _swiglu(lo: _Lowering, op: llm.SwigluOp) -> None:
    out = lo.out(op.result, can_quantize=True)
    lo.emit(tgt.SwigluOp(lo.x(op), lo.buffers[op.gate], lo.buffers[op.up], out, lo.n, activation=activation_of(op),
                         **lo.norm(op)))


@lowering(llm.ReshapeOp)
def _reshape(lo: _Lowering, op: llm.ReshapeOp) -> None:
    if op.input not in lo.buffers:  # quantized rows have one row width, whatever the logical shape
        lo.alias(op.result, op.input)
        return
    view = lo.emit(tgt.ViewOp(lo.buffers[op.input], lo._shape(op.result)))
    view.result.name_hint = op.result.name_hint
    lo.buffers[op.result] = view.result


@lowering(llm.RopeOp)
def _rope(lo: _Lowering, op: llm.RopeOp) -> None:
    # in place: the rotated value takes over its input's buffer
    if single_user(op.input) is not op:
        raise LlmcError(f"lower: the input of {op.name} has other users; in-place RoPE would change them")
    lo.buffers[op.result] = lo.buffers[op.input]
    lo.emit(tgt.RopeOp(lo.buffers[op.input], lo.positions, lo.n, op.rope))


@lowering(llm.AttentionOp)
def _attention(lo: _Lowering, op: llm.AttentionOp) -> None:
    if op.rope is not None and any(single_user(v) is not op for v in (op.query, op.key)):
        raise LlmcError("lower: attention rotates q and k in place, but they have other users")
    k_cache, v_cache = lo.cache_layer(op.layer.value.data)
    head_dim = llm.shape_of(op.query)[2]
    out = lo.out(op.result, can_quantize=head_dim is not None and head_dim % 32 == 0)
    heads = llm.shape_of(op.query)[1]
    partials = lo.emit(tgt.AllocOp(tgt.AttentionOp.partials_type(heads, head_dim, lo.split_rows))).result
    partials.name_hint = f"l{op.layer.value.data}_partials"
    lo.emit(tgt.AttentionOp(lo.buffers[op.query], lo.buffers[op.key], lo.buffers[op.value], k_cache, v_cache, out,
                            lo.positions, partials, lo.n, op.rope, slots=lo.slots, **op.options))


@lowering(llm.MoeOp)
def _moe(lo: _Lowering, op: llm.MoeOp) -> None:
    width = llm.shape_of(op.gate)[1]
    scratch = lo.emit(tgt.AllocOp(tgt.MoeOp.scratch_type(lo.rows, op.top_k.value.data, width))).result
    scratch.name_hint = f"{op.result.name_hint}_scratch" if op.result.name_hint else None
    weights = (lo.buffers[v] for v in (op.router, op.gate, op.up, op.down))
    lo.emit(tgt.MoeOp(lo.buffers[op.input], *weights, lo.out(op.result), scratch, lo.n, op.top_k, op.normalize))


@lowering(llm.LastTokenOp)
def _last_token(lo: _Lowering, op: llm.LastTokenOp) -> None:
    lo.alias(op.result, op.input)  # the head reads the last row itself (`last_row`)


@lowering(*llm.ACTIVATION_OPS.values())
def _activation(lo: _Lowering, op: Operation) -> None:
    kernel = tgt.ACTIVATION_KERNELS[op.ACTIVATION]  # type: ignore[attr-defined]
    lo.emit(kernel(lo.buffers[op.operands[0]], lo.out(op.results[0]), lo.n))


# ---------------------------------------------------- primitive ops left unraised: generic kernels
POWERS = (2.0, 3.0, 1.0, 0.5, -1.0, -0.5)  # the exponents `tgt.scalar "pow"` computes


def _unsupported(op: Operation, why: str) -> LlmcError:
    types = ", ".join(str(v.type) for v in op.operands)
    return LlmcError(f"lower: no generic kernel for {op.name} ({types}): {why}; it was not raised to an llm op "
                     "with a kernel of its own (see --compile-to optimize)")


def _rows_value(op: Operation, value: SSAValue) -> None:
    shape = llm.shape_of(value)
    if len(shape) != 2 or llm.element_type(value) != llm.f32:
        raise _unsupported(op, "generic kernels take f32 [tokens, width] values")


@lowering(llm.ConstantOp)
def _constant(lo: _Lowering, op: llm.ConstantOp) -> None:
    """No buffer: the generic kernels take a constant's single value as an immediate (`tgt.scalar`)."""


def _rows_buffer(lo: _Lowering, op: Operation, value: SSAValue) -> SSAValue:
    """The float rows of a generic kernel's input: an activation's buffer with the result's rows."""
    buffer = lo.buffers.get(value)
    if buffer is None or isinstance(buffer.type, tgt.WeightType) or \
            llm.shape_of(value)[0] != llm.shape_of(op.results[0])[0]:
        raise _unsupported(op, "its inputs must be activations of its rows, one value per row, or a weight")
    return buffer


def _broadcast_input(lo: _Lowering, op: Operation, value: SSAValue, width: int) -> SSAValue:
    shape = llm.shape_of(value)
    if isinstance(value.owner, llm.WeightOp) and shape == (width,):
        return lo.buffers[value]
    _rows_value(op, value)
    if shape[1] not in (width, 1):
        raise _unsupported(op, "its inputs must be rows of its width, one value per row, or a weight")
    return _rows_buffer(lo, op, value)


@lowering(*llm.BINARY_OPS)
def _binary(lo: _Lowering, op: Operation) -> None:
    if isinstance(op, (llm.AddOp, llm.MulOp)) and op.lhs.type == op.rhs.type == op.result.type:
        kernel = tgt.AddOp if isinstance(op, llm.AddOp) else tgt.MulOp
        lo.emit(kernel(_rows_buffer(lo, op, op.lhs), _rows_buffer(lo, op, op.rhs), lo.out(op.result), lo.n))
        return
    kind = op.KIND
    _rows_value(op, op.result)
    if kind not in tgt.BINARY_KINDS:
        raise _unsupported(op, f"generic kernels compute {', '.join(tgt.BINARY_KINDS)}")
    for x, other, swapped in ((op.lhs, op.rhs, False), (op.rhs, op.lhs, True)):
        value = scalar(other)
        if value is not None and x.type == op.result.type:
            if kind == "pow" and (swapped or value not in POWERS):
                raise _unsupported(op, f"pow has a generic kernel for the exponents {POWERS} only")
            lo.emit(tgt.ScalarOp(kind, _rows_buffer(lo, op, x), value, lo.out(op.result), lo.n, reversed=swapped))
            return
    if kind == "pow":
        raise _unsupported(op, "pow has a generic kernel for a constant exponent only")
    width = llm.shape_of(op.result)[1]
    ins = [_broadcast_input(lo, op, v, width) for v in (op.lhs, op.rhs)]
    lo.emit(tgt.BinaryOp(kind, *ins, lo.out(op.result), lo.n))


@lowering(*llm.UNARY_OPS)
def _unary(lo: _Lowering, op: Operation) -> None:
    kind = op.KIND
    _rows_value(op, op.results[0])
    if kind not in tgt.UNARY_KINDS:
        raise _unsupported(op, f"generic kernels compute {', '.join(tgt.UNARY_KINDS)}")
    lo.emit(tgt.UnaryOp(kind, _rows_buffer(lo, op, op.operands[0]), lo.out(op.results[0]), lo.n))


@lowering(*llm.REDUCE_OPS)
def _reduce(lo: _Lowering, op: Operation) -> None:
    kind = op.KIND
    _rows_value(op, op.input)
    if kind not in tgt.REDUCE_KINDS or op.axis_list != (1,) or op.keepdims is None:
        raise _unsupported(op, f"generic kernels reduce each row ({', '.join(tgt.REDUCE_KINDS)}, keepdims)")
    lo.emit(tgt.ReduceOp(kind, _rows_buffer(lo, op, op.input), lo.out(op.result), lo.n))


@lowering(llm.CastOp)
def _cast(lo: _Lowering, op: llm.CastOp) -> None:
    if op.input.type != op.result.type:
        raise _unsupported(op, "only a cast to the same type has no kernel")
    lo.alias(op.result, op.input)


for _op_type in (llm.IsNanOp, llm.SoftmaxOp, llm.CumsumOp, llm.ConcatOp, llm.GatherOp, llm.GatherNdOp,
                 llm.TransposeOp, llm.UnsqueezeOp, llm.SqueezeOp, llm.SliceOp, llm.ShapeOfOp, llm.ExpandOp, llm.FillOp,
                 llm.RangeOp, llm.TriluOp, llm.WhereOp, llm.BatchMatmulOp):
    LOWERINGS.refuse(_op_type, "(a primitive op without a generic kernel: it must be raised into an llm op with "
                               "a kernel of its own; see --compile-to optimize)")


@lowering(func.ReturnOp)
def _return(lo: _Lowering, op: func.ReturnOp) -> None:
    lo.emit(func.ReturnOp())


def _split_entry(function: func.FuncOp) -> tuple[StringAttr, int, llm.KVCacheType]:
    """The stage, rows and KV cache of an entry point as `split` leaves it; IR edited by hand without
    them is one error, not a crash."""
    name, stage = function.sym_name.data, function.attributes.get("llm.stage")
    max_tokens, args = function.attributes.get("llm.max_tokens"), function.body.block.args
    if not isinstance(stage, StringAttr):
        raise LlmcError(f"lower: @{name} has no string llm.stage (what split gives each entry point)")
    if not (isinstance(max_tokens, IntegerAttr) and max_tokens.value.data >= 1):
        raise LlmcError(f"lower: @{name} has no positive integer llm.max_tokens (what split gives each entry point)")
    if len(args) < 3 or not isinstance(args[-1].type, llm.KVCacheType):
        raise LlmcError(f"lower: @{name} does not take tokens, positions and the !llm.kv_cache last")
    return stage, max_tokens.value.data, args[-1].type


def lower_function(function: func.FuncOp) -> func.FuncOp:
    stage, rows, kv = _split_entry(function)
    ids_args = function.body.block.args[:-1]  # tokens, positions (, slots)
    (logits_type,) = function.function_type.outputs.data
    layers, kv_heads, capacity, head_dim = kv.shape
    slot_dims = (kv.slots,) if kv.slots > 1 else ()
    cache = tgt.memref(layers, *slot_dims, kv_heads, capacity, tgt.kv_row_width(head_dim, kv.element_type),
                       element_type=kv.element_type)
    ids = tgt.memref(rows, element_type=i32)
    logits_buffer = tgt.memref(*(d if d is not None else rows for d in llm.shape_of(logits_type)))
    block = Block(arg_types=[*(ids for _ in ids_args), IndexType(), cache, cache, logits_buffer])
    names = entry_arguments(kv.slots)
    for arg, name in zip(block.args, names):
        arg.name_hint = name
    args = dict(zip(names, block.args))
    split_rows = max(tgt.ATTENTION_SPLIT_ROWS, rows) if stage.data in ("decode", "verify") \
        else tgt.ATTENTION_SPLIT_ROWS
    lo = _Lowering(block, rows, args["n"], args["positions"], args.get("slots"), split_rows, args["k_cache"],
                   args["v_cache"], args["logits"])
    for old, new in zip(ids_args, block.args):
        lo.buffers[old] = new
    for op in function.body.block.ops:
        LOWERINGS.lookup(op)(lo, op)
    lowered = func.FuncOp(function.sym_name.data, (block.arg_types, []), Region(block))
    lowered.attributes |= {
        "llm.stage": stage,
        "tgt.max_tokens": IntegerAttr(rows, i64),
        "tgt.kv_layout": StringAttr(KV_LAYOUT_SLOTS if kv.slots > 1 else KV_LAYOUT),
    }
    return lowered


@dataclass(frozen=True)
class LowerPass(LlmcPass):
    name = "lower"
    requires_phase = "split"
    last_phase = "group"

    def run(self, ctx: Context, module: ModuleOp) -> None:
        for function in self.functions(module):
            if "tgt.max_tokens" in function.attributes:  # (a module lowered by `lower` alone is still at 'group')
                raise LlmcError(f"pass 'lower' needs IR of phase 'group' at the latest; @{function.sym_name.data} "
                                f"is lowered already")
            lowered = lower_function(function)
            module.body.block.insert_op_before(lowered, function)
            module.body.block.erase_op(function)
