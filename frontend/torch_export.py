"""torch.export → `llm`: a causal LM's exported ATen graph as primitive `llm` ops.

`export_decoder` exports a module (a Hugging Face `*ForCausalLM`, or any module whose
`forward(input_ids)` returns logits `[1, T, V]`) with the token dimension dynamic;
`load_pt2` (of `pt2_loader`) reads one saved with `torch.export.save` without running code from the file;
`import_program` maps each FX node of the program, as exported (training IR, where
`aten.linear` and `aten.scaled_dot_product_attention` are still whole), to `llm` ops:

```mlir
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>) -> tensor<?x64xf32> {
  %model_embed_tokens_weight = llm.weight @model.embed_tokens.weight f32 : tensor<64x32xf32>
  %input_ids = llm.reshape %0 : tensor<?xi64> -> tensor<1x?xi64>
  %embedding = llm.gather %model_embed_tokens_weight, %input_ids axis 0
                 : (tensor<64x32xf32>, tensor<1x?xi64>) -> tensor<1x?x32xf32>
  ...
  %1 = llm.transpose %lm_head_weight axes [1, 0] : (tensor<64x32xf32>) -> tensor<32x64xf32>
  %linear_7 = llm.batch_matmul %mul_17, %1 : (tensor<1x?x32xf32>, tensor<32x64xf32>) -> tensor<1x?x64xf32>
  %logits = llm.reshape %linear_7 : tensor<1x?x64xf32> -> tensor<?x64xf32>
  func.return %logits : tensor<?x64xf32>
}
```
Result types come from each node's `meta["val"]` (a symbolic dimension is `?`). SymInt
nodes (`aten.sym_size`, `operator.add`, …) become i64 scalars computed from `llm.shape_of`.
Parameters and float buffers become `llm.weight` entries named by their state-dict key;
integer and boolean tensors become `llm.constant`. Only nodes the logits depend on are
imported, so asserts and unused buffers drop out.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind, OutputKind
from xdsl.dialects.builtin import IntegerType, ModuleOp, TensorType, i1, i64
from xdsl.ir import Operation, SSAValue
from xdsl.utils.exceptions import VerifyException

from llmc.errors import ModelFormatError
from llmc.frontend.graph import GraphBuilder, tensor_type
from llmc.frontend.pt2_loader import load_pt2, target_name
from llmc.ir import llm
from llmc.ir.weights import WeightStore

__all__ = ["export_decoder", "import_program", "load_pt2"]  # load_pt2: from pt2_loader

aten = torch.ops.aten

_DTYPES = {
    torch.float32: np.float32, torch.float16: np.float16, torch.float64: np.float64, torch.int64: np.int64,
    torch.int32: np.int32, torch.int16: np.int16, torch.int8: np.int8, torch.uint8: np.uint8, torch.bool: np.bool_,
}
_END = 2**63 - 1  # torch's "to the end" slice bound


# ------------------------------------------------------------------------ export


class _CausalLMLogits(torch.nn.Module):
    """`forward(input_ids)` → `model(input_ids=input_ids, use_cache=False).logits`, with the
    model's children registered as its own so that parameter names stay the model's."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        object.__setattr__(self, "causal_lm", model)  # not a submodule: no `causal_lm.` prefix
        for name, child in model.named_children():
            self.add_module(name, child)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.causal_lm(input_ids=input_ids, use_cache=False).logits


def export_decoder(module: torch.nn.Module, example_inputs: tuple, max_tokens: int | None = None) -> ExportedProgram:
    """`torch.export` of a decoder whose first input is `input_ids [1, T]`, with T dynamic
    (up to `max_tokens`, by default the config's `max_position_embeddings` or 4096) in it and in
    the other inputs of its shape (`position_ids`, `attention_mask`)."""
    config = getattr(module, "config", None)
    if config is not None and hasattr(module, "generation_config"):  # a transformers model
        module = _CausalLMLogits(module)
    limit = max_tokens or getattr(config, "max_position_embeddings", None) or 4096
    tokens = torch.export.Dim("tokens", min=1, max=limit)
    ids_shape = tuple(example_inputs[0].shape)  # position_ids and an attention_mask share the token dimension
    dynamic = tuple({1: tokens} if getattr(x, "shape", None) == ids_shape else None for x in example_inputs)
    with torch.no_grad():
        return torch.export.export(module.eval(), tuple(example_inputs), dynamic_shapes=dynamic)


# ------------------------------------------------------------------------ import


def _numpy_dtype(source: Path, node: fx.Node, dtype: torch.dtype) -> np.dtype:
    found = _DTYPES.get(dtype)
    if found is None:
        raise ModelFormatError(source, f"node '{node.name}' has element type {dtype}, which llmc does not import "
                                       "(export the model in float32)")
    return np.dtype(found)


def _probe(arg: object) -> object:
    """A stand-in with `arg`'s dtype and type-promotion category, for `torch.result_type`."""
    if isinstance(arg, fx.Node):
        val = arg.meta.get("val")
        if isinstance(val, torch.Tensor):
            return torch.empty((0,) * min(val.dim(), 1), dtype=val.dtype)
        return {torch.SymInt: 0, torch.SymFloat: 0.0, torch.SymBool: False}.get(type(val), val)
    return arg


class _Importer:
    """The state of one import: the builder, each node's value and each value's shape."""

    def __init__(self, ep: ExportedProgram, source: Path):
        self.ep = ep
        self.source = source
        self.b = GraphBuilder.decoder(source)
        self.values: dict[fx.Node, SSAValue] = {}
        self._shapes: dict[SSAValue, SSAValue] = {}
        self._constants: dict[tuple, SSAValue] = {}
        self._specs = {spec.arg.name: spec for spec in ep.graph_signature.input_specs}

    def fail(self, node: fx.Node, problem: str) -> ModelFormatError:
        return ModelFormatError(self.source, f"node '{node.name}' {problem}")

    # types and operands

    def dtype(self, node: fx.Node) -> np.dtype:
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor):
            return _numpy_dtype(self.source, node, val.dtype)
        if isinstance(val, torch.SymInt | int):
            return np.dtype(np.int64)
        raise self.fail(node, f"has no tensor or integer value ({type(val).__name__})")

    def type_of(self, node: fx.Node) -> TensorType:
        val = node.meta.get("val")
        if not isinstance(val, torch.Tensor):
            return tensor_type((), self.dtype(node))
        return tensor_type([None if isinstance(d, torch.SymInt) else int(d) for d in val.shape], self.dtype(node))

    def promoted(self, *args: object) -> np.dtype:
        return np.dtype(_DTYPES[torch.result_type(*(_probe(a) for a in args[:2]))])

    def add(self, op: Operation) -> SSAValue:
        return self.b.add(op)

    def const(self, value: object, dtype: np.dtype | type) -> SSAValue:
        """A small constant, one op per distinct value."""
        array = np.asarray(value, dtype=dtype)
        key = (array.dtype.str, array.shape, array.tobytes())
        if key not in self._constants:
            self._constants[key] = self.b.constant(array)
        return self._constants[key]

    def tensor(self, arg: object, dtype: np.dtype | None = None) -> SSAValue:
        """The value of a node or Python scalar, converted to `dtype` where given."""
        if not isinstance(arg, fx.Node):
            if dtype is None:
                raise TypeError(f"a scalar {arg!r} needs a dtype")
            return self.const(arg, dtype)
        value = self.values[arg]
        return value if dtype is None else self.tensor_value(value, dtype)

    def vector(self, items: Sequence[object]) -> SSAValue:
        """A 1-D i64 tensor of ints and SymInt nodes (sizes, slice bounds)."""
        parts: list[SSAValue] = []
        run: list[int] = []  # consecutive ints make one constant
        for item in [*items, None]:
            if item is not None and not isinstance(item, fx.Node):
                run.append(int(item))
                continue
            if run:
                parts.append(self.const(run, np.int64))
                run = []
            if item is not None:
                parts.append(self.add(llm.UnsqueezeOp(self.tensor(item), [0])))
        return self.add(llm.ConcatOp(parts, 0)) if len(parts) > 1 else parts[0]

    def shape(self, value: SSAValue) -> SSAValue:
        if value not in self._shapes:
            rank = len(llm.shape_of(value))
            self._shapes[value] = self.add(llm.ShapeOfOp(value, llm.tensor(rank, element_type=i64)))
        return self._shapes[value]

    def dim(self, value: SSAValue, axis: int) -> SSAValue:
        """Dimension `axis` of `value` as an i64 scalar: shape_of, slice, squeeze."""
        one = llm.tensor(1, element_type=i64)
        start, end = self.const([axis], np.int64), self.const([axis + 1], np.int64)
        piece = self.add(llm.SliceOp(self.shape(value), start, end, self.const([0], np.int64),
                                     self.const([1], np.int64), one))
        return self.add(llm.SqueezeOp(piece, [0]))

    def cast_to(self, node: fx.Node, value: SSAValue) -> SSAValue:
        """`value` with `node`'s element type."""
        return self.tensor_value(value, self.dtype(node))

    def tensor_value(self, value: SSAValue, dtype: np.dtype) -> SSAValue:
        if llm.element_type(value) == tensor_type((), dtype).element_type:
            return value
        return self.add(llm.CastOp(value, tensor_type(llm.shape_of(value), dtype)))

    # the program

    def placeholder(self, node: fx.Node) -> SSAValue:
        spec = self._specs[node.name]
        if spec.kind == InputKind.USER_INPUT:
            return self.user_input(node)
        if spec.kind not in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            raise self.fail(node, f"is a {spec.kind.name.lower()} input, which llmc does not import")
        key = spec.target
        found = self.ep.state_dict.get(key, self.ep.constants.get(key))
        if not isinstance(found, torch.Tensor):
            raise self.fail(node, f"names '{key}', which the program has no tensor for")
        self.dtype(node)  # a dtype llmc reads (one line for bf16 and the like), before numpy must convert it
        array = found.detach().cpu().contiguous().numpy()
        if not np.issubdtype(array.dtype, np.floating):
            return self.b.constant(array, key)
        if spec.kind == InputKind.CONSTANT_TENSOR and array.size <= llm.ConstantOp.LIMIT:
            return self.b.constant(array.astype(self.dtype(node)), key)
        value = self.b.weight(key, array)
        return self.cast_to(node, value)  # the store reads f32; an f16 graph computes in f16

    def user_input(self, node: fx.Node) -> SSAValue:
        shape = llm.shape_of(self.type_of(node))
        if node.name.startswith("past") and len(shape) == 4:  # a layer's past keys or values: none
            return self.b.empty_past(shape, self.dtype(node), node.name)
        if node.name == "attention_mask" and len(shape) == 2:  # [1, past + tokens]: the past is empty
            return self.b.attention_mask(self.dtype(node))
        if len(shape) != 2 or shape[0] != 1 or shape[1] is not None:
            raise self.fail(node, f"must be [1, tokens] with a dynamic token dimension (export it with "
                                  f"export_decoder), got {list(shape)}")
        inputs = {"input_ids": self.b.input_ids, "position_ids": self.b.position_ids}
        if node.name not in inputs:
            raise self.fail(node, "is an input llmc cannot feed (only input_ids, position_ids, attention_mask, "
                                  "past keys and values)")
        return self.cast_to(node, inputs[node.name]())

    def run(self) -> tuple[ModuleOp, WeightStore]:
        signature = self.ep.graph_signature
        outputs = next(n for n in self.ep.graph.nodes if n.op == "output").args[0]
        logits = None
        for spec, out in zip(signature.output_specs, outputs):
            if spec.kind != OutputKind.USER_OUTPUT:
                raise ModelFormatError(self.source, f"the program's output '{spec.arg.name}' is a "
                                                    f"{spec.kind.name.lower()}, which llmc does not import")
            if logits is None:
                logits = out
        if not isinstance(logits, fx.Node):
            raise ModelFormatError(self.source, "the program has no tensor output (the logits)")
        live = _live(logits)
        for node in self.ep.graph.nodes:
            if node not in live:
                continue
            value = self.placeholder(node) if node.op == "placeholder" else self.call(node)
            if value.name_hint is None:
                value.name_hint = node.name
            self.values[node] = value
        return self.b.finish_decoder(self.values[logits]), self.b.weights

    def call(self, node: fx.Node) -> SSAValue:
        if node.op != "call_function":
            raise self.fail(node, f"is a {node.op} node, which llmc does not import")
        target = node.target
        mapping = _ATEN.get(target) or _ATEN.get(getattr(target, "overloadpacket", None))
        if mapping is None:
            raise self.fail(node, f"calls {target_name(target)}, which llmc does not import")
        args = _arguments(node) if isinstance(target, torch._ops.OpOverload) else dict(enumerate(node.args))
        try:
            return mapping(self, node, args)
        except (KeyError, TypeError, ValueError, IndexError, VerifyException) as e:  # a malformed graph
            raise self.fail(node, f"calls {target_name(target)} in a way llmc cannot import ({e})") from e


def _arguments(node: fx.Node) -> dict[object, object]:
    """The node's arguments by schema name (defaults filled in) and by position."""
    out: dict[object, object] = {}
    for i, argument in enumerate(node.target._schema.arguments):
        if i < len(node.args):
            value = node.args[i]
        elif argument.name in node.kwargs:
            value = node.kwargs[argument.name]
        else:
            value = argument.default_value if argument.has_default_value() else None
        out[argument.name] = out[i] = value
    return out


def _live(root: fx.Node) -> set[fx.Node]:
    """The nodes `root` depends on, itself included."""
    live, todo = set(), [root]
    while todo:
        node = todo.pop()
        if node not in live:
            live.add(node)
            todo.extend(node.all_input_nodes)
    return live


def import_program(ep: ExportedProgram, source: Path) -> tuple[ModuleOp, WeightStore]:
    """`@forward(%tokens, %pos)` computing the program's logits, and its weights."""
    return _Importer(ep, source).run()


# ----------------------------------------------------------------- op mappings

Mapping = Callable[[_Importer, fx.Node, dict], SSAValue]
_ATEN: dict[object, Mapping] = {}


def _maps(*targets: object) -> Callable[[Mapping], Mapping]:
    def register(fn: Mapping) -> Mapping:
        for target in targets:
            _ATEN[target] = fn
        return fn

    return register


def _axis(axis: int, rank: int) -> int:
    return axis % max(rank, 1)


def _binary(op_type: type, boolean: bool = False) -> Mapping:
    def mapping(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
        dtype = im.promoted(a[0], a[1]) if boolean else im.dtype(node)
        lhs, rhs = im.tensor(a[0], dtype), im.tensor(a[1], dtype)
        if a.get("alpha") not in (None, 1):
            rhs = im.add(llm.MulOp(rhs, im.const(a["alpha"], dtype)))
        return im.add(op_type(lhs, rhs, im.type_of(node)))

    return mapping


def _logical(op_type: type, bitwise: bool = False) -> Mapping:
    """`logical_*` of any tensors (nonzero is true); bitwise ops of booleans only."""
    def mapping(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
        boolean = np.dtype(np.bool_)
        if bitwise and im.dtype(node) != boolean:
            raise im.fail(node, "is a bitwise operation on integers, which llmc does not import")
        return im.add(op_type(im.tensor(a[0], boolean), im.tensor(a[1], boolean), im.type_of(node)))

    return mapping


for _packets, _op in (
    ((aten.add, operator.add), llm.AddOp), ((aten.sub, operator.sub), llm.SubOp),
    ((aten.mul, operator.mul), llm.MulOp), ((aten.maximum,), llm.MaximumOp), ((aten.minimum,), llm.MinimumOp),
    ((aten.remainder, operator.mod), llm.ModOp), ((aten.pow,), llm.PowOp),
):
    _maps(*_packets)(_binary(_op))
for _packets, _op in (
    ((aten.eq,), llm.EqualOp), ((aten.lt,), llm.LessOp), ((aten.le,), llm.LessEqualOp), ((aten.gt,), llm.GreaterOp),
    ((aten.ge,), llm.GreaterEqualOp),
):
    _maps(*_packets)(_binary(_op, boolean=True))
for _logical_op, _bitwise_ops, _op in (
    (aten.logical_and, (aten.bitwise_and, aten.__and__), llm.AndOp),
    (aten.logical_or, (aten.bitwise_or, aten.__or__), llm.OrOp),
    (aten.logical_xor, (aten.bitwise_xor, aten.__xor__), llm.XorOp),
):
    _maps(_logical_op)(_logical(_op))
    _maps(*_bitwise_ops)(_logical(_op, bitwise=True))


@_maps(aten.rsub)
def _rsub(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    """`other - alpha · self`."""
    dtype = im.dtype(node)
    x = im.tensor(a[0], dtype)
    if a.get("alpha") not in (None, 1):
        x = im.add(llm.MulOp(x, im.const(a["alpha"], dtype)))
    return im.add(llm.SubOp(im.tensor(a[1], dtype), x, im.type_of(node)))


@_maps(aten.ne)
def _not_equal(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    return im.add(llm.NotOp(_binary(llm.EqualOp, boolean=True)(im, node, a)))


def _floor_divide(im: _Importer, lhs: SSAValue, rhs: SSAValue, result: TensorType) -> SSAValue:
    """`⌊a / b⌋`: floats through `llm.floor`; integers as `(a - a mod b) / b`, which divides exactly."""
    if isinstance(result.element_type, IntegerType):
        exact = im.add(llm.SubOp(lhs, im.add(llm.ModOp(lhs, rhs, result)), result))
        return im.add(llm.DivOp(exact, rhs, result))
    return im.add(llm.FloorOp(im.add(llm.DivOp(lhs, rhs, result))))


@_maps(aten.div, aten.floor_divide, operator.floordiv)
def _div(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    dtype, result = im.dtype(node), im.type_of(node)
    lhs, rhs = im.tensor(a[0], dtype), im.tensor(a[1], dtype)
    mode = "floor" if node.target in (aten.floor_divide.default, aten.floor_divide.Scalar, operator.floordiv) \
        else a.get("rounding_mode")
    if mode == "floor":
        return _floor_divide(im, lhs, rhs, result)
    quotient = im.add(llm.DivOp(lhs, rhs, result))
    if mode == "trunc" and not np.issubdtype(dtype, np.integer):
        negative = im.add(llm.LessOp(quotient, im.const(0, dtype)))
        return im.add(llm.WhereOp(negative, im.add(llm.CeilOp(quotient)), im.add(llm.FloorOp(quotient))))
    return quotient


@_maps(torch.sym_max, torch.sym_min)
def _sym_extreme(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    op_type = llm.MaximumOp if node.target is torch.sym_max else llm.MinimumOp
    i64 = np.dtype(np.int64)
    return im.add(op_type(im.tensor(a[0], i64), im.tensor(a[1], i64)))


@_maps(operator.neg)
def _sym_neg(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    return im.add(llm.NegOp(im.tensor(a[0], np.dtype(np.int64))))


def _unary(op_type: type) -> Mapping:
    def mapping(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
        return im.add(op_type(im.tensor(a[0], im.dtype(node))))

    return mapping


for _packets, _op in (
    ((aten.neg,), llm.NegOp), ((aten.abs,), llm.AbsOp), ((aten.sqrt,), llm.SqrtOp), ((aten.rsqrt,), llm.RsqrtOp),
    ((aten.reciprocal,), llm.ReciprocalOp), ((aten.exp,), llm.ExpOp), ((aten.log,), llm.LogOp),
    ((aten.tanh,), llm.TanhOp), ((aten.cos,), llm.CosOp), ((aten.sin,), llm.SinOp), ((aten.erf,), llm.ErfOp),
    ((aten.sigmoid,), llm.SigmoidOp), ((aten.relu,), llm.ReluOp), ((aten.floor,), llm.FloorOp),
    ((aten.ceil,), llm.CeilOp), ((aten.silu,), llm.SiluOp), ((aten.logical_not, aten.bitwise_not), llm.NotOp),
):
    _maps(*_packets)(_unary(_op))


@_maps(aten.isnan)
def _isnan(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    return im.add(llm.IsNanOp(im.tensor(a[0]), im.type_of(node)))


@_maps(aten.gelu)
def _gelu(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    if a["approximate"] == "tanh":
        return im.add(llm.GeluOp(x))
    dtype = im.dtype(node)  # exact: x/2 · (1 + erf(x/√2))
    erf = im.add(llm.ErfOp(im.add(llm.MulOp(x, im.const(1 / math.sqrt(2), dtype)))))
    half = im.add(llm.MulOp(x, im.const(0.5, dtype)))
    return im.add(llm.MulOp(half, im.add(llm.AddOp(erf, im.const(1, dtype)))))


@_maps(aten.alias, aten.clone, aten.contiguous, aten.detach, aten.detach_, aten.lift_fresh_copy, aten._to_copy, aten.to,
       aten.type_as)
def _convert(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    """Copies, aliases and `.to(…)`: the value itself, cast where the dtype changes."""
    return im.cast_to(node, im.tensor(a[0]))


@_maps(aten.dropout)
def _dropout(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    if a["train"]:
        raise im.fail(node, "is a dropout in training mode (export the model after .eval())")
    return im.tensor(a["input"])


@_maps(aten.embedding)
def _embedding(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    return im.add(llm.GatherOp(im.tensor(a["weight"]), im.tensor(a["indices"]), 0, im.type_of(node)))


@_maps(aten.linear)
def _linear(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    """`x · Wᵀ (+ b)` as `batch_matmul(x, transpose[1, 0](W))`, the shape `optimize` raises."""
    weight = im.add(llm.TransposeOp(im.tensor(a["weight"]), (1, 0)))
    y = im.add(llm.BatchMatmulOp(im.tensor(a["input"]), weight, im.type_of(node)))
    if a["bias"] is None:
        return y
    return im.add(llm.AddOp(y, im.tensor(a["bias"]), im.type_of(node)))


@_maps(aten.mm, aten.bmm, aten.matmul)
def _matmul(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    dtype = im.dtype(node)
    return im.add(llm.BatchMatmulOp(im.tensor(a[0], dtype), im.tensor(a[1], dtype), im.type_of(node)))


def _reduce(op_type: type, boolean: bool = False) -> Mapping:
    def mapping(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
        x = im.tensor(a[0], np.dtype(np.bool_) if boolean else im.dtype(node))
        rank = len(llm.shape_of(x))
        dims = a.get("dim")
        if dims is None or dims == []:
            dims = range(rank)
        elif isinstance(dims, int):
            dims = [dims]
        keep = bool(a.get("keepdim", False))
        return im.add(op_type(x, [_axis(d, rank) for d in dims], keep, im.type_of(node)))

    return mapping


_maps(aten.mean)(_reduce(llm.ReduceMeanOp))
_maps(aten.sum)(_reduce(llm.ReduceSumOp))
_maps(aten.amax)(_reduce(llm.ReduceMaxOp))
_maps(aten.amin)(_reduce(llm.ReduceMinOp))
_maps(aten.prod)(_reduce(llm.ReduceProdOp))
_maps(aten.any)(_reduce(llm.ReduceMaxOp, boolean=True))
_maps(aten.all)(_reduce(llm.ReduceMinOp, boolean=True))


@_maps(aten.softmax, aten._softmax)
def _softmax(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    return im.add(llm.SoftmaxOp(im.tensor(a[0], im.dtype(node)), a[1]))


@_maps(aten.cumsum)
def _cumsum(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    return im.add(llm.CumsumOp(im.tensor(a["self"], im.dtype(node)), a["dim"]))


@_maps(aten.diff)
def _diff(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    """`x[1:] - x[:-1]` along `dim` of `cat(prepend, x, append)` (xor for booleans)."""
    if a["n"] != 1:
        raise im.fail(node, f"is a diff of order {a['n']}, which llmc does not import")
    dtype, result = im.dtype(node), im.type_of(node)
    parts = [im.tensor(a[k], dtype) for k in ("prepend", "self", "append") if a[k] is not None]
    axis = _axis(a["dim"], len(llm.shape_of(parts[0])))
    x = im.add(llm.ConcatOp(parts, axis)) if len(parts) > 1 else parts[0]
    axes, steps = im.const([axis], np.int64), im.const([1], np.int64)
    hi = im.add(llm.SliceOp(x, im.const([1], np.int64), im.const([_END], np.int64), axes, steps, result))
    lo = im.add(llm.SliceOp(x, im.const([0], np.int64), im.const([-1], np.int64), axes, steps, result))
    return im.add((llm.XorOp if dtype == np.bool_ else llm.SubOp)(hi, lo, result))


@_maps(aten.cat)
def _cat(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    dtype = im.dtype(node)
    rank = len(llm.shape_of(im.type_of(node)))
    # torch.cat skips empty 1-D tensors (a cache layer's keys before its first update)
    parts = [p for t in a["tensors"] if not (llm.shape_of(p := im.tensor(t, dtype)) == (0,) and rank > 1)]
    return im.add(llm.ConcatOp(parts, _axis(a["dim"], rank), im.type_of(node)))


@_maps(aten.slice)
def _slice(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    start = 0 if a["start"] is None else a["start"]
    end = _END if a["end"] is None else a["end"]
    axis = _axis(a["dim"], len(llm.shape_of(x)))
    return im.add(llm.SliceOp(x, im.vector([start]), im.vector([end]), im.const([axis], np.int64),
                              im.const([a["step"]], np.int64), im.type_of(node)))


@_maps(aten.select)
def _select(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    index = im.tensor(a["index"], np.dtype(np.int64))
    return im.add(llm.GatherOp(x, index, _axis(a["dim"], len(llm.shape_of(x))), im.type_of(node)))


@_maps(aten.unsqueeze)
def _unsqueeze(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    return im.add(llm.UnsqueezeOp(x, [_axis(a["dim"], len(llm.shape_of(x)) + 1)]))


@_maps(aten.squeeze)
def _squeeze(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    shape = llm.shape_of(x)
    dims = a.get("dim")
    dims = range(len(shape)) if dims is None else [dims] if isinstance(dims, int) else dims
    axes = sorted({_axis(d, len(shape)) for d in dims if shape[_axis(d, len(shape))] == 1})
    return im.add(llm.SqueezeOp(x, axes)) if axes else x


@_maps(aten.view, aten.reshape, aten._unsafe_view, aten.flatten, aten.unflatten)
def _reshape(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
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
def _transpose(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    rank = len(llm.shape_of(x))
    perm = list(range(rank))
    i, j = _axis(a["dim0"], rank), _axis(a["dim1"], rank)
    perm[i], perm[j] = perm[j], perm[i]
    return im.add(llm.TransposeOp(x, perm))


@_maps(aten.permute)
def _permute(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    return im.add(llm.TransposeOp(x, [_axis(d, len(llm.shape_of(x))) for d in a["dims"]]))


@_maps(aten.t)
def _t(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    return im.add(llm.TransposeOp(x, (1, 0))) if len(llm.shape_of(x)) == 2 else x


@_maps(aten.expand)
def _expand(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    """ONNX-style Expand: torch's `-1` (keep the size) is a broadcasting 1."""
    x = im.tensor(a["self"])
    result = im.type_of(node)
    if result == x.type:
        return x
    sizes = [1 if isinstance(s, int) and s == -1 else s for s in a["size"]]
    return im.add(llm.ExpandOp(x, im.vector(sizes), result))


@_maps(aten.arange)
def _arange(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    dtype = im.dtype(node)
    start, end, step = (0, a["end"], 1) if "start" not in a else (a["start"], a["end"], a.get("step", 1))
    bounds = [im.tensor(v, dtype) for v in (start, end, step)]
    return im.add(llm.RangeOp(*bounds, im.type_of(node)))


def _filled(im: _Importer, node: fx.Node, value: object, shape: SSAValue | Sequence[object]) -> SSAValue:
    """A tensor of `node`'s type with every element `value`: a constant where the shape is
    static and small, else `llm.fill` of `shape` (a shape tensor or a list of sizes)."""
    dtype, result = im.dtype(node), im.type_of(node)
    static = llm.shape_of(result)
    if None not in static and math.prod(static) <= llm.ConstantOp.LIMIT and not isinstance(value, fx.Node):
        return im.const(np.full(static, value, dtype), dtype)
    shape = shape if isinstance(shape, SSAValue) else im.vector(shape)
    return im.add(llm.FillOp(shape, im.tensor(value, dtype), result))


@_maps(aten.full, aten.ones, aten.zeros, aten.new_full, aten.new_ones, aten.new_zeros)
def _full(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    packet = node.target.overloadpacket
    value = {aten.ones: 1, aten.new_ones: 1, aten.zeros: 0, aten.new_zeros: 0}.get(packet, a.get("fill_value"))
    return _filled(im, node, value, a["size"])


@_maps(aten.full_like, aten.ones_like, aten.zeros_like)
def _full_like(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    value = {aten.ones_like: 1, aten.zeros_like: 0}.get(node.target.overloadpacket, a.get("fill_value"))
    return _filled(im, node, value, im.shape(im.tensor(a["self"])))


@_maps(aten.scalar_tensor)
def _scalar_tensor(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    return im.tensor(a["s"], im.dtype(node))


@_maps(aten.where)
def _where(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    dtype = im.dtype(node)
    condition = im.tensor(a["condition"], np.dtype(np.bool_))
    return im.add(llm.WhereOp(condition, im.tensor(a["self"], dtype), im.tensor(a["other"], dtype),
                              im.type_of(node)))


@_maps(aten.masked_fill)
def _masked_fill(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    dtype = im.dtype(node)
    mask = im.tensor(a["mask"], np.dtype(np.bool_))
    return im.add(llm.WhereOp(mask, im.tensor(a["value"], dtype), im.tensor(a["self"], dtype), im.type_of(node)))


@_maps(aten.triu, aten.tril)
def _trilu(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    upper = node.target.overloadpacket is aten.triu
    return im.add(llm.TriluOp(im.tensor(a["self"]), im.tensor(a["diagonal"], np.dtype(np.int64)), upper))


@_maps(aten.index)
def _index(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
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


def _max_shape(im: _Importer, indices: Sequence[SSAValue]) -> SSAValue:
    """The broadcast shape of same-rank tensors at run time: the elementwise maximum of their shapes."""
    sizes = im.shape(indices[0])
    for i in indices[1:]:
        sizes = im.add(llm.MaximumOp(sizes, im.shape(i)))
    return sizes


@_maps(aten.sym_size)
def _sym_size(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    x = im.tensor(a["self"])
    return im.dim(x, _axis(a["dim"], len(llm.shape_of(x))))


@_maps(aten.scaled_dot_product_attention)
def _attention(im: _Importer, node: fx.Node, a: dict) -> SSAValue:
    """`softmax(q·kᵀ·scale + mask)·v`; a boolean mask adds 0 or -inf, `is_causal` keeps the lower
    triangle, and with `enable_gqa` each key/value head serves `heads / kv_heads` query heads."""
    if a["dropout_p"]:
        raise im.fail(node, "is an attention with dropout (export the model after .eval())")
    q, k, v = (im.tensor(a[n]) for n in ("query", "key", "value"))
    dtype = im.dtype(node)
    qs, ks = llm.shape_of(q), llm.shape_of(k)
    heads, kv_heads = qs[-3] if len(qs) > 2 else 1, ks[-3] if len(ks) > 2 else 1
    if a["enable_gqa"] and heads != kv_heads:
        if heads is None or kv_heads is None or heads % kv_heads:
            raise im.fail(node, f"groups {heads} query heads over {kv_heads} key/value heads")
        served = im.const(np.arange(heads) // (heads // kv_heads), np.int64)
        k, v = (im.add(llm.GatherOp(t, served, len(ks) - 3)) for t in (k, v))
    rank = len(llm.shape_of(k))
    swap = list(range(rank - 2)) + [rank - 1, rank - 2]
    scores = im.add(llm.BatchMatmulOp(q, im.add(llm.TransposeOp(k, swap))))
    scale = a["scale"] if a["scale"] is not None else 1 / math.sqrt(qs[-1])
    scores = im.add(llm.MulOp(scores, im.const(scale, dtype)))
    zero, minus_inf = im.const(0, dtype), im.const(-np.inf, dtype)
    if a["is_causal"]:
        last_two = im.add(llm.SliceOp(im.shape(scores), im.const([-2], np.int64), im.const([_END], np.int64),
                                      im.const([0], np.int64), im.const([1], np.int64),
                                      llm.tensor(2, element_type=i64)))
        square = llm.tensor(*llm.shape_of(scores)[-2:], element_type=i1)
        ones = im.add(llm.FillOp(last_two, im.const(True, np.bool_), square))
        lower = im.add(llm.TriluOp(ones, im.const(0, np.int64), upper=False))
        scores = im.add(llm.AddOp(scores, im.add(llm.WhereOp(lower, zero, minus_inf))))
    if a["attn_mask"] is not None:
        mask = im.tensor(a["attn_mask"])
        if llm.element_type(mask) == i1:
            mask = im.add(llm.WhereOp(mask, zero, minus_inf))
        scores = im.add(llm.AddOp(scores, im.tensor_value(mask, dtype)))
    weights = im.add(llm.SoftmaxOp(scores, -1))
    return im.add(llm.BatchMatmulOp(weights, v, im.type_of(node)))
