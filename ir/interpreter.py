"""Numpy reference semantics for every `llm` op, and a runner for whole functions.

Each op's meaning is one small function registered with `@semantics(OpClass)`; `run`
walks a function's ops in order. This is the yardstick later stages are checked
against (`llmc verify`), so it favours plain float32 numpy over speed.

    logits = forward_logits(module, model.weights, np.array([504, 3575, 282]))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation, SSAValue

from llmc.ir import find_function, llm, named_operands
from llmc.ir.formats import SLICE, integer_matmul, quantize_rows
from llmc.ir.weights import WeightStore


class OpTable(dict):
    """Numpy meanings of ops by op class; `@table.register(OpClass)` adds one."""

    def register(self, op_type: type[Operation]) -> Callable[[Callable], Callable]:
        def add(fn: Callable) -> Callable:
            self[op_type] = fn
            return fn

        return add


_SEMANTICS = OpTable()
semantics = _SEMANTICS.register  # `fn(op, env, *operand_values) -> result`


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


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1) + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation, as `llm.gelu`."""
    inner = np.float32(np.sqrt(2 / np.pi)) * (x + np.float32(0.044715) * x * x * x)
    return (np.float32(0.5) * x * (np.float32(1) + np.tanh(inner))).astype(np.float32)


def soft_capped(x: np.ndarray, cap: float | None) -> np.ndarray:
    """`cap · tanh(x / cap)`, or x without a cap."""
    return x if cap is None else (np.float32(cap) * np.tanh(x / np.float32(cap))).astype(np.float32)


def activation(op: Operation) -> Callable[[np.ndarray], np.ndarray]:
    """The gate's activation of an `llm.swiglu` or `tgt.swiglu`: silu, or gelu with `gelu`."""
    return gelu_tanh if op.properties.get("gelu") is not None else silu


@semantics(llm.RMSNormOp)
def _rms_norm(op: llm.RMSNormOp, env: Env, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    return rms_norm(x, w, op.eps.value.data)


def _operands(op: llm.Projection, values: tuple) -> dict[str, np.ndarray | None]:
    """The operand values of an op with optional operands, by operand name (None when absent)."""
    present = iter(values)
    return {name: (next(present) if value is not None else None) for name, value in named_operands(op).items()}


def _product(op: llm.Projection, env: Env, x: np.ndarray, norm: np.ndarray | None, weight: SSAValue,
             w: np.ndarray) -> np.ndarray:
    """`x · wᵀ` of a projection: the input normalized when a norm is fused; with `a8`, the
    input quantized to int8 and multiplied by the weight's codes as the kernels do it."""
    if norm is not None:
        x = rms_norm(x, norm, op.eps.value.data)
    if op.mode is not llm.Compute.A8:
        return x @ w.T
    source = weight.owner
    assert isinstance(source, llm.WeightOp), f"{op.name}: an a8 weight must be an llm.weight"
    return integer_matmul(*quantize_rows(x), env.weights.quantized(source.sym_name, source.storage.data))


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
    return activation(op)(gate) * _product(op, env, v["input"], v["norm"], op.up, v["up"])


@semantics(llm.ReshapeOp)
def _reshape(op: llm.ReshapeOp, env: Env, x: np.ndarray) -> np.ndarray:
    return x.reshape(x.shape[0], *llm.shape_of(op.result)[1:])


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


@semantics(llm.AddOp)
def _add(op: llm.AddOp, env: Env, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a + b


@semantics(llm.MulOp)
def _mul(op: llm.MulOp, env: Env, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return a * b


@semantics(llm.SiluOp)
def _silu(op: llm.SiluOp, env: Env, x: np.ndarray) -> np.ndarray:
    return silu(x)


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


@semantics(llm.GeluOp)
def _gelu(op: llm.GeluOp, env: Env, x: np.ndarray) -> np.ndarray:
    return gelu_tanh(x)


def run(function: func.FuncOp, weights: WeightStore, *args: object) -> list[np.ndarray]:
    """Execute `function` on numpy arguments (and a `KVCache`); returns its results."""
    env = Env(weights)
    values: dict[SSAValue, object] = dict(zip(function.body.block.args, args, strict=True))
    for op in function.body.block.ops:
        if isinstance(op, func.ReturnOp):
            return [values[v] for v in op.operands]
        impl = _SEMANTICS.get(type(op))
        if impl is None:
            raise NotImplementedError(f"no numpy semantics for {op.name}")
        result = impl(op, env, *(values[v] for v in op.operands))
        values[op.results[0]] = result
    raise ValueError(f"@{function.sym_name.data} has no func.return")


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
