"""Numpy reference semantics for every `llm` op, and a runner for whole functions.

Each op's meaning is one small function registered with `@semantics(OpClass)` (the
`SEMANTICS` interface, `llmc.ir.interfaces`); `run`
walks a function's ops in order. This is the yardstick later stages are checked
against (`llmc verify`), so it favours plain float32 numpy over speed.

    logits = forward_logits(module, model.weights, np.array([504, 3575, 282]))
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
from xdsl.dialects import builtin, func
from xdsl.dialects.builtin import DenseIntOrFPElementsAttr, IntegerType, ModuleOp, Signedness, TensorType, i32, i64
from xdsl.ir import Attribute, Operation, SSAValue

from llmc.ir import find_function, llm, named_operands
from llmc.ir.activations import ACTIVATIONS, activation_of, erf, silu
from llmc.ir.formats import SLICE, integer_matmul, quantize_rows
from llmc.ir.interfaces import OpInterface
from llmc.ir.weights import WeightStore

SEMANTICS = OpInterface("llm interpreter", "numpy semantics")
semantics = SEMANTICS.implement  # `fn(op, env, *operand_values) -> result`


@dataclass
class KVCache:
    """Keys and values of every layer: `[layers, kv_heads, capacity, head_dim]` each, or
    `[layers, slots, kv_heads, capacity, head_dim]` for a cache of several sequences.

    `element` is the cache's type: "f32", "f16" (the arrays are float16) or "q8_0" (the
    arrays hold float32 values rounded as q8_0 rows are: int8 per 32 with a scale).
    """

    keys: np.ndarray
    values: np.ndarray
    element: str = "f32"

    @classmethod
    def for_type(cls, cache_type: llm.KVCacheType, positions: int | None = None) -> KVCache:
        """A zeroed cache of `cache_type`, or of its first `positions` rows only."""
        layers, kv_heads, capacity, head_dim = cache_type.shape
        element = llm.kv_type_name(cache_type.element_type)
        slots = (cache_type.slots,) if cache_type.slots > 1 else ()
        return cls.zeros((layers, *slots, kv_heads, min(capacity, positions or capacity), head_dim), element)

    @classmethod
    def zeros(cls, shape: tuple[int, ...], element: str = "f32") -> KVCache:
        dtype = np.float16 if element == "f16" else np.float32
        return cls(np.zeros(shape, dtype), np.zeros(shape, dtype), element)

    def store(self, layer: int, positions: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Write rows `[T, kv_heads, head_dim]` of k and v at `positions` of `layer`, in the cache's type."""
        for table, rows in ((self.keys, k), (self.values, v)):
            rows = rows.transpose(1, 0, 2)
            if self.element == "q8_0":
                qs, d, _ = quantize_rows(rows.reshape(-1, rows.shape[-1]))
                width = rows.shape[-1]
                rows = (qs[:, :width].astype(np.float32) * d[:, :width // SLICE].repeat(SLICE, axis=1)).reshape(rows.shape)
            table[layer][:, positions] = rows


@dataclass
class Env:
    """What op semantics may consult besides their operands."""

    weights: WeightStore


@semantics(llm.WeightOp)
def _weight(op: llm.WeightOp, env: Env) -> np.ndarray:
    return env.weights.f32(op.sym_name, op.storage.data)


@semantics(llm.EmbeddingOp)
def _embedding(op: llm.EmbeddingOp, env: Env, tokens: np.ndarray, table: np.ndarray) -> np.ndarray:
    if tokens.size and (tokens.min() < 0 or tokens.max() >= table.shape[0]):
        raise ValueError(f"token id outside the vocabulary of {table.shape[0]}")
    return table[tokens] if op.scale is None else table[tokens] * np.float32(op.scale.value.data)


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + np.float32(eps)) * w).astype(np.float32)


def soft_capped(x: np.ndarray, cap: float | None) -> np.ndarray:
    """`cap · tanh(x / cap)`, or x without a cap."""
    return x if cap is None else (np.float32(cap) * np.tanh(x / np.float32(cap))).astype(np.float32)


def gate_activation(op: Operation) -> Callable[[np.ndarray], np.ndarray]:
    """The numpy meaning of the gate activation of an `llm.swiglu` or `tgt.swiglu`."""
    return ACTIVATIONS[activation_of(op)].numpy


@semantics(llm.RMSNormOp)
def _rms_norm(op: llm.RMSNormOp, env: Env, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return rms_norm(x, w, op.eps.value.data)


def _operands(op: llm.Projection, values: tuple) -> dict[str, np.ndarray | None]:
    """The operand values of an op with optional operands, by operand name (None when absent)."""
    present = iter(values)
    return {name: (next(present) if value is not None else None) for name, value in named_operands(op).items()}


def _product(op: llm.Projection, env: Env, x: np.ndarray, norm: np.ndarray | None, weight: SSAValue,
             w: np.ndarray) -> np.ndarray:
    """`x · wᵀ` of a projection: the input normalized when a norm is fused; with `a8` (`a16`),
    the input quantized to int8 (int16) and multiplied by the weight's codes as the kernels do it."""
    if norm is not None:
        x = rms_norm(x, norm, op.eps.value.data)
    if not op.mode.integer:
        return x @ w.T
    source = weight.owner
    assert isinstance(source, llm.WeightOp), f"{op.name}: an {op.mode} weight must be an llm.weight"
    bits = 16 if op.mode is llm.Compute.A16 else 8
    return integer_matmul(*quantize_rows(x, bits), env.weights.quantized(source.sym_name, source.storage.data))


@semantics(llm.MatmulOp)
def _matmul(op: llm.MatmulOp, env: Env, *values: np.ndarray) -> np.ndarray:
    v = _operands(op, values)
    y = _product(op, env, v["input"], v["norm"], op.weight, v["weight"])
    if v["bias"] is not None:
        y = y + v["bias"]
    return y if v["residual"] is None else v["residual"] + y


@semantics(llm.LogitsOp)
def _logits(op: llm.LogitsOp, env: Env, *values: np.ndarray) -> np.ndarray:
    v = _operands(op, values)
    return soft_capped(_product(op, env, v["input"], v["norm"], op.weight, v["weight"]), op.cap)


@semantics(llm.SwigluOp)
def _swiglu(op: llm.SwigluOp, env: Env, *values: np.ndarray) -> np.ndarray:
    v = _operands(op, values)
    gate = _product(op, env, v["input"], v["norm"], op.gate, v["gate"])
    return gate_activation(op)(gate) * _product(op, env, v["input"], v["norm"], op.up, v["up"])


@semantics(llm.ReshapeOp)
def _reshape(op: llm.ReshapeOp, env: Env, x: np.ndarray, *shape: np.ndarray) -> np.ndarray:
    if shape:
        return x.reshape(tuple(shape[0].tolist()))
    return x.reshape([-1 if d is None else d for d in llm.shape_of(op.result)])


def rope_inv_freq(head_dim: int, rope: llm.RopeAttr) -> np.ndarray:
    """`theta^(-2i/dims) / factor_i` in float32: the rotation speed of each rotating pair."""
    dims = rope.rotary_dims(head_dim)
    base = 1.0 / (rope.theta.data ** (np.arange(0, dims, 2, dtype=np.float32) / dims))
    factors = rope.frequency_factors
    return (base / np.asarray(factors, dtype=np.float32) if factors else base).astype(np.float32)


def rope(x: np.ndarray, positions: np.ndarray, spec: llm.RopeAttr) -> np.ndarray:
    """Rotate-half RoPE of `x [T, heads, head_dim]` at `positions [T]`: the first `dims` elements rotate."""
    dims = spec.rotary_dims(x.shape[-1])
    half = dims // 2
    angles = positions.astype(np.float32)[:, None] * rope_inv_freq(x.shape[-1], spec)[None, :]
    mscale = np.float32(spec.mscale.data)
    cos, sin = (np.cos(angles) * mscale)[:, None, :], (np.sin(angles) * mscale)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:dims]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin, x[..., dims:]], axis=-1)


@semantics(llm.RopeOp)
def _rope(op: llm.RopeOp, env: Env, x: np.ndarray, positions: np.ndarray) -> np.ndarray:
    return rope(x, positions, op.rope)


def attention(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, cache: KVCache,
              layer: int, window: int | None = None, softcap: float | None = None,
              scale: float | None = None) -> np.ndarray:
    """Write `k`, `v` into the cache rows of `layer` at `positions`, then causal GQA of `q`
    (over the last `window` positions only, scores `softcap·tanh(s/softcap)`, scaled by `scale`)."""
    capacity = cache.keys.shape[2]
    if positions.size and (positions.min() < 0 or positions.max() >= capacity):
        raise ValueError(f"position outside the KV cache capacity of {capacity}")
    cache.store(layer, positions, k, v)
    span = int(positions.max()) + 1 if positions.size else 0
    keys = cache.keys[layer][:, :span]  # [kv_heads, S, D]
    values = cache.values[layer][:, :span]
    t, heads, d = q.shape
    group = heads // keys.shape[0]
    qg = q.transpose(1, 0, 2).reshape(keys.shape[0], group, t, d)  # [kv_heads, group, T, D]
    scores = np.einsum("hgtd,hsd->hgts", qg, keys) * np.float32(1 / np.sqrt(d) if scale is None else scale)
    scores = soft_capped(scores, softcap)
    masked = np.arange(span)[None, :] > positions[:, None]  # [T, S]: the future
    if window is not None:
        masked |= np.arange(span)[None, :] <= positions[:, None] - window
    scores = np.where(masked, -np.inf, scores)
    scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
    probs = scores / scores.sum(axis=-1, keepdims=True)
    out = np.einsum("hgts,hsd->hgtd", probs, values)  # [kv_heads, group, T, D]
    return out.reshape(heads, t, d).transpose(1, 0, 2).astype(np.float32)


def attention_in_slots(q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                       cache: KVCache, layer: int, **options: float | int | None) -> np.ndarray:
    """`attention` in a cache of several sequences (`[layers, slots, …]`): row t in sequence `slots[t]`."""
    count = cache.keys.shape[1]
    if slots.size and (slots.min() < 0 or slots.max() >= count):
        raise ValueError(f"slot outside the KV cache's {count} sequences")
    out = np.empty_like(q)
    for slot in np.unique(slots):
        rows = slots == slot
        one = KVCache(cache.keys[:, slot], cache.values[:, slot], cache.element)
        out[rows] = attention(q[rows], k[rows], v[rows], positions[rows], one, layer, **options)
    return out


@semantics(llm.AttentionOp)
def _attention(op: llm.AttentionOp, env: Env, q: np.ndarray, k: np.ndarray, v: np.ndarray, positions: np.ndarray,
               *slots_and_cache: object) -> np.ndarray:
    *slots, cache = slots_and_cache
    assert isinstance(cache, KVCache)
    if op.rope is not None:
        q, k = rope(q, positions, op.rope), rope(k, positions, op.rope)
    if slots:
        return attention_in_slots(q, k, v, positions, slots[0], cache, op.layer.value.data, **llm.scoring(op))
    return attention(q, k, v, positions, cache, op.layer.value.data, **llm.scoring(op))


@semantics(llm.LastTokenOp)
def _last_token(op: llm.LastTokenOp, env: Env, x: np.ndarray) -> np.ndarray:
    return x[-1:]


def route(x: np.ndarray, router: np.ndarray, top_k: int, normalize: bool) -> tuple[np.ndarray, np.ndarray]:
    """Each row's `top_k` experts (most probable first; ties to the lower index) and their weights."""
    logits = x @ router.T
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    p = p / p.sum(axis=-1, keepdims=True)
    chosen = np.argsort(-p, axis=-1, kind="stable")[:, :top_k]
    weights = np.take_along_axis(p, chosen, axis=-1)
    if normalize:
        weights = weights / weights.sum(axis=-1, keepdims=True)
    return chosen, weights.astype(np.float32)


def moe(op: Operation, x: np.ndarray, router: np.ndarray, gate: Callable[[int], np.ndarray],
        up: Callable[[int], np.ndarray], down: Callable[[int], np.ndarray]) -> np.ndarray:
    """`llm.moe` / `tgt.moe` on rows `x`, an expert's matrices given by `gate(e)`, `up(e)`, `down(e)`."""
    chosen, weights = route(x, router, op.top_k.value.data, op.normalize is not None)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for e, w in zip(chosen[t], weights[t]):
            out[t] += w * ((silu(gate(e) @ x[t]) * (up(e) @ x[t])) @ down(e).T)
    return out


@semantics(llm.MoeOp)
def _moe(op: llm.MoeOp, env: Env, x: np.ndarray, router: np.ndarray, gate: np.ndarray, up: np.ndarray,
         down: np.ndarray) -> np.ndarray:
    return moe(op, x, router, lambda e: gate[e], lambda e: up[e], lambda e: down[e])


@semantics(*llm.ACTIVATION_OPS.values())
def _activation(op: Operation, env: Env, x: np.ndarray) -> np.ndarray:
    return ACTIVATIONS[op.ACTIVATION].numpy(x)  # type: ignore[attr-defined]


# ------------------------------------------------------------ primitive ops' numpy meaning


def numpy_dtype(element: Attribute) -> np.dtype:
    """The numpy dtype of a tensor element type (i1 is bool)."""
    if isinstance(element, IntegerType):
        if element.width.data == 1:
            return np.dtype(np.bool_)
        unsigned = element.signedness.data == Signedness.UNSIGNED
        return np.dtype(f"{'u' if unsigned else ''}int{element.width.data}")
    return np.dtype({16: np.float16, 32: np.float32, 64: np.float64}[element.bitwidth])


_ELEMENTS = {
    np.dtype(np.float32): llm.f32, np.dtype(np.float16): builtin.f16, np.dtype(np.float64): builtin.f64,
    np.dtype(np.int64): i64, np.dtype(np.int32): i32, np.dtype(np.int8): builtin.i8,
    np.dtype(np.uint8): builtin.IntegerType(8, builtin.Signedness.UNSIGNED), np.dtype(np.int16): builtin.i16,
    np.dtype(np.bool_): builtin.i1,
}


def element_of(dtype: np.dtype) -> Attribute:
    """The `llm` element type of a numpy dtype."""
    found = _ELEMENTS.get(np.dtype(dtype))
    if found is None:
        raise ValueError(f"no llm element type for {np.dtype(dtype)}")
    return found


def tensor_type(shape: Sequence[int | None], dtype: np.dtype) -> TensorType:
    return llm.tensor(*shape, element_type=element_of(dtype))


def dense(array: np.ndarray) -> DenseIntOrFPElementsAttr:
    """`array` as a `dense<…>` attribute of its own tensor type."""
    t = tensor_type(array.shape, array.dtype)
    values = array.reshape(-1).tolist()
    if array.size and all(v == values[0] for v in values):
        values = values[:1]  # a splat
    return DenseIntOrFPElementsAttr.from_list(t, [int(v) for v in values] if array.dtype == np.bool_ else values)

def _typed(op: Operation, x: np.ndarray) -> np.ndarray:
    """`x` as an array of `op`'s result element type."""
    return np.asarray(x).astype(numpy_dtype(llm.element_type(op.results[0])), copy=False)


def _divide(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.integer):
        return np.trunc(a / b).astype(a.dtype)
    return a / b




_BINARY: dict[type[Operation], Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    llm.AddOp: np.add, llm.SubOp: np.subtract, llm.MulOp: np.multiply, llm.DivOp: _divide, llm.PowOp: np.power,
    llm.MaximumOp: np.maximum, llm.MinimumOp: np.minimum, llm.ModOp: np.mod, llm.EqualOp: np.equal,
    llm.LessOp: np.less, llm.LessEqualOp: np.less_equal, llm.GreaterOp: np.greater,
    llm.GreaterEqualOp: np.greater_equal, llm.AndOp: np.logical_and, llm.OrOp: np.logical_or,
    llm.XorOp: np.logical_xor,
}
_UNARY: dict[type[Operation], Callable[[np.ndarray], np.ndarray]] = {
    llm.NegOp: np.negative, llm.AbsOp: np.abs, llm.SqrtOp: np.sqrt, llm.RsqrtOp: lambda x: 1 / np.sqrt(x),
    llm.ReciprocalOp: lambda x: 1 / x, llm.ExpOp: np.exp, llm.LogOp: np.log, llm.TanhOp: np.tanh, llm.CosOp: np.cos,
    llm.SinOp: np.sin, llm.ErfOp: erf, llm.SigmoidOp: lambda x: 1 / (1 + np.exp(-x)),
    llm.ReluOp: lambda x: np.maximum(x, 0), llm.FloorOp: np.floor, llm.CeilOp: np.ceil, llm.NotOp: np.logical_not,
}
_REDUCE: dict[type[Operation], Callable[..., np.ndarray]] = {
    llm.ReduceSumOp: np.sum, llm.ReduceMeanOp: np.mean, llm.ReduceMaxOp: np.max, llm.ReduceMinOp: np.min,
    llm.ReduceProdOp: np.prod,
}


def by_kind(table: dict[type[Operation], Callable[..., np.ndarray]]) -> dict[str, Callable[..., np.ndarray]]:
    """A table of numpy meanings keyed by the ops' `KIND` (`sub`, `mean`): the `kind` of `tgt`'s
    generic kernels (`tgt.binary "sub"`, `tgt.reduce "mean"`)."""
    return {op_type.KIND: fn for op_type, fn in table.items()}  # type: ignore[attr-defined]


BINARY, UNARY, REDUCE = by_kind(_BINARY), by_kind(_UNARY), by_kind(_REDUCE)


def _elementwise(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    def run(op: Operation, env: Env, *values: np.ndarray) -> np.ndarray:
        with np.errstate(all="ignore"):
            return _typed(op, fn(*values))

    return run


def _reduction(fn: Callable[..., np.ndarray]) -> Callable[..., np.ndarray]:
    def run(op: Operation, env: Env, x: np.ndarray) -> np.ndarray:
        axes = tuple(int(a) for a in op.axes.get_values())  # type: ignore[attr-defined]
        return _typed(op, fn(x, axis=axes, keepdims=op.properties.get("keepdims") is not None))

    return run


for _op_type, _fn in _BINARY.items():
    semantics(_op_type)(_elementwise(_fn))
for _op_type, _fn in _UNARY.items():
    semantics(_op_type)(_elementwise(_fn))
for _op_type, _fn in _REDUCE.items():
    semantics(_op_type)(_reduction(_fn))
semantics(llm.IsNanOp)(_elementwise(np.isnan))
semantics(llm.CastOp)(_elementwise(lambda x: x))
semantics(llm.WhereOp)(_elementwise(np.where))
semantics(llm.BatchMatmulOp)(_elementwise(np.matmul))


@semantics(llm.ConstantOp)
def _constant(op: llm.ConstantOp, env: Env) -> np.ndarray:
    return constant_array(op)


def constant_array(op: llm.ConstantOp) -> np.ndarray:
    """The value of an `llm.constant` as a numpy array."""
    shape = llm.shape_of(op.result)
    values = np.asarray(op.value.get_values(), dtype=numpy_dtype(llm.element_type(op.result)))
    if values.size == 1:
        return np.full(shape, values.reshape(()))
    return values.reshape(shape)


def scalar(value: SSAValue) -> float | None:
    """The number a single-element `llm.constant` (through casts and reshapes) holds, or None."""
    op = value.owner
    while isinstance(op, (llm.CastOp, llm.ReshapeOp, llm.UnsqueezeOp, llm.SqueezeOp)):
        op = op.operands[0].owner
    if isinstance(op, llm.ConstantOp) and int(np.prod(llm.shape_of(op.result))) == 1:
        return float(constant_array(op).reshape(()))
    return None

@semantics(llm.SoftmaxOp)
def _softmax(op: llm.SoftmaxOp, env: Env, x: np.ndarray) -> np.ndarray:
    axis = op.axis_index
    with np.errstate(invalid="ignore"):
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        return _typed(op, e / e.sum(axis=axis, keepdims=True))


@semantics(llm.CumsumOp)
def _cumsum(op: llm.CumsumOp, env: Env, x: np.ndarray) -> np.ndarray:
    axis = op.axis_index
    if op.reverse is not None:
        x = np.flip(x, axis)
    out = np.cumsum(x, axis=axis, dtype=x.dtype)
    if op.exclusive is not None:
        out = out - x
    return _typed(op, np.flip(out, axis) if op.reverse is not None else out)


@semantics(llm.ConcatOp)
def _concat(op: llm.ConcatOp, env: Env, *xs: np.ndarray) -> np.ndarray:
    return _typed(op, np.concatenate(xs, axis=op.axis_index))


@semantics(llm.GatherOp)
def _gather(op: llm.GatherOp, env: Env, x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    size = x.shape[op.axis_index]
    if indices.size and (indices.min() < -size or indices.max() >= size):
        raise ValueError(f"{op.name}: index outside the {size} elements of axis {op.axis_index}")
    return np.take(x, np.where(indices < 0, indices + size, indices), axis=op.axis_index)


@semantics(llm.GatherNdOp)
def _gather_nd(op: llm.GatherNdOp, env: Env, x: np.ndarray, indices: np.ndarray) -> np.ndarray:
    b = op.batch_dims.value.data
    batch = x.shape[:b]
    depth = indices.shape[-1]
    out_rows = []
    flat_x = x.reshape(-1, *x.shape[b:]) if b else x[None]
    flat_i = indices.reshape(-1, *indices.shape[b:]) if b else indices[None]
    for xs, ids in zip(flat_x, flat_i):
        idx = ids.reshape(-1, depth)
        idx = np.where(idx < 0, idx + np.array(xs.shape[:depth]), idx)
        out_rows.append(xs[tuple(idx.T)].reshape(*ids.shape[:-1], *xs.shape[depth:]))
    out = np.stack(out_rows)
    return out.reshape(*batch, *out.shape[1:]) if b else out[0]


@semantics(llm.TransposeOp)
def _transpose(op: llm.TransposeOp, env: Env, x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.transpose(op.axis_list))


@semantics(llm.UnsqueezeOp)
@semantics(llm.SqueezeOp)
def _reshape_like(op: Operation, env: Env, x: np.ndarray) -> np.ndarray:
    return x.reshape(op.reshaped(x.shape, op.axis_list))  # type: ignore[attr-defined]


@semantics(llm.SliceOp)
def _slice(op: llm.SliceOp, env: Env, x: np.ndarray, starts: np.ndarray, ends: np.ndarray, axes: np.ndarray,
           steps: np.ndarray) -> np.ndarray:
    index = [slice(None)] * x.ndim
    for start, end, axis, step in zip(starts.tolist(), ends.tolist(), axes.tolist(), steps.tolist(), strict=True):
        if step == 0:
            raise ValueError(f"{op.name}: a step of 0")
        index[axis % x.ndim] = slice(start, None if step < 0 and end < -x.shape[axis % x.ndim] else end, step)
    return x[tuple(index)].copy()


@semantics(llm.ShapeOfOp)
def _shape_of(op: llm.ShapeOfOp, env: Env, x: np.ndarray) -> np.ndarray:
    return np.array(x.shape, dtype=np.int64)


@semantics(llm.ExpandOp)
def _expand(op: llm.ExpandOp, env: Env, x: np.ndarray, shape: np.ndarray) -> np.ndarray:
    return np.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(shape.tolist()))).copy()


@semantics(llm.FillOp)
def _fill(op: llm.FillOp, env: Env, shape: np.ndarray, value: np.ndarray) -> np.ndarray:
    return _typed(op, np.full(tuple(shape.tolist()), value.reshape(())))


@semantics(llm.RangeOp)
def _range(op: llm.RangeOp, env: Env, start: np.ndarray, limit: np.ndarray, delta: np.ndarray) -> np.ndarray:
    s, lim, d = (v.reshape(()).item() for v in (start, limit, delta))
    count = max(math.ceil((lim - s) / d), 0)
    return _typed(op, s + np.arange(count) * d)


@semantics(llm.TriluOp)
def _trilu(op: llm.TriluOp, env: Env, x: np.ndarray, k: np.ndarray) -> np.ndarray:
    diagonal = int(k.reshape(()))
    return np.triu(x, diagonal) if op.upper is not None else np.tril(x, diagonal)


def run(function: func.FuncOp, weights: WeightStore, *args: object,
        observe: Callable[[Operation, list], None] | None = None) -> list[np.ndarray]:
    """Execute `function` on numpy arguments (and a `KVCache`); returns its results. Each value
    is dropped after its last reader (a weight's floats too, where `weights` keeps none), and
    `observe(op, operand_values)` sees every op before it runs."""
    env = Env(weights)
    values: dict[SSAValue, object] = dict(zip(function.body.block.args, args, strict=True))
    ops = list(function.body.block.ops)
    last_use = {v: i for i, op in enumerate(ops) for v in op.operands}
    for i, op in enumerate(ops):
        operands = [values[v] for v in op.operands]
        if isinstance(op, func.ReturnOp):
            return operands  # type: ignore[return-value]
        if observe is not None:
            observe(op, operands)
        values[op.results[0]] = SEMANTICS.lookup(op)(op, env, *operands)
        for v in op.operands:
            if last_use[v] == i:
                values.pop(v, None)  # (an op may read one value twice)
    raise ValueError(f"@{function.sym_name.data} has no func.return")


def evaluate(targets: list[SSAValue], known: dict[SSAValue, object], weights: WeightStore) -> list[np.ndarray]:
    """The values of `targets`, computing only the ops they depend on, from the `known` values
    (block arguments, usually) and the weights."""
    env = Env(weights)
    values = dict(known)

    def value(v: SSAValue) -> object:
        if v not in values:
            op = v.owner
            if not isinstance(op, Operation):
                raise ValueError(f"no value given for argument %{v.name_hint}")
            values[v] = SEMANTICS.lookup(op)(op, env, *(value(o) for o in op.operands))
        return values[v]

    return [value(t) for t in targets]  # type: ignore[misc]


def forward_logits(module: ModuleOp, weights: WeightStore, tokens: np.ndarray, start: int = 0,
                   cache: KVCache | None = None) -> np.ndarray:
    """Logits of `tokens` placed at positions `start, start+1, …` (a fresh cache by default)."""
    forward = find_function(module, "forward")
    cache_type = forward.function_type.inputs.data[2]
    assert isinstance(cache_type, llm.KVCacheType)
    tokens = np.asarray(tokens, dtype=np.int32)
    if cache is None:  # rows for these positions only, not the model's whole context
        cache = KVCache.for_type(cache_type, start + tokens.size)
    positions = np.arange(start, start + tokens.size, dtype=np.int32)
    (logits,) = run(forward, weights, tokens, positions, cache)
    return logits
