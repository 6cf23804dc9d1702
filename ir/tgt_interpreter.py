"""Numpy reference semantics for the `tgt` kernels, over a real byte arena and packed weights.

Buffers are views of one `uint8` arena at the offsets `plan-memory` chose, so running
an entry point here also checks the memory plan: two live buffers that overlapped
would corrupt each other and the logits would disagree with the `llm` interpreter.
Weights in the `split` layout are packed to bytes and read back (`llmc.ir.layouts`),
so the layout is checked too. Integer (`a8`, `a16`) matmuls are computed the way the
kernels compute them, from the int8 (int16) rows and the weight codes: exact integer dot
products per 16-weight slice, then the scales; the quantized rows themselves are
bit-identical to what the kernels write (`formats.quantize_rows`, int16 rows as their
two int8 planes).

    weights = KernelWeights(model.weights)
    logits = run_entry(function, weights, tokens, start, cache)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import IntegerAttr, MemRefType
from xdsl.ir import SSAValue

from llmc.abi import kv_q8_head_dim
from llmc.ir import llm, tgt
from llmc.ir.activations import ACTIVATIONS
from llmc.ir.formats import QuantizedTensor, integer_matmul, join_planes, quantize_rows, slice_sums, split_planes
from llmc.ir.interfaces import OpInterface
from llmc.ir.interpreter import (
    BINARY,
    REDUCE,
    UNARY,
    KVCache,
    attention,
    attention_in_slots,
    gate_activation,
    moe,
    rms_norm,
    rope,
    soft_capped,
)
from llmc.ir.layouts import STRIP, Layout, pack, unpack
from llmc.ir.weights import WeightStore

SEMANTICS = OpInterface("tgt interpreter", "numpy semantics")
kernel = SEMANTICS.implement  # `fn(op, get)`: `get(value)` gives a value's array; writes its `out`

@dataclass
class QRows:
    """Quantized rows in the arena (`QRowLayout.views`): `qs` int8 `[R, Wp]`, or for int16 rows
    the planes int8 `[R, 2, Wp]`; `d f32[R, Wp/16]`, `s f32[R, Wp/16]`, `n i32[R, Wp/16]`."""

    qs: np.ndarray
    d: np.ndarray
    s: np.ndarray
    n: np.ndarray

    @property
    def bits(self) -> int:
        return 8 * (self.qs.ndim - 1)

    def values(self, first: int, rows: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows `first..rows` as `quantize_rows` returns them (int16 values joined from their planes)."""
        qs = self.qs[first:rows]
        return (join_planes(qs) if self.bits == 16 else qs), self.d[first:rows], self.s[first:rows]

    def write(self, rows: np.ndarray) -> None:
        qs, d, s = quantize_rows(rows, self.bits)
        n = rows.shape[0]
        self.qs[:n], self.d[:n], self.s[:n] = (split_planes(qs) if self.bits == 16 else qs), d, s
        self.n[:n] = slice_sums(qs)


@dataclass(frozen=True)
class Matrix:
    """A weight as the kernels see it: float values, and for integer formats the codes per slice."""

    f32: np.ndarray
    quantized: QuantizedTensor | None = None


class KernelWeights:
    """The weights of a model in the types and layouts the `tgt` IR names, prepared once."""

    def __init__(self, store: WeightStore):
        self.store = store
        self._prepared: dict[tuple[str, tgt.WeightType], Matrix] = {}

    def __call__(self, name: str, weight_type: tgt.WeightType) -> Matrix:
        key = (name, weight_type)
        if key not in self._prepared:
            storage = weight_type.storage
            if storage.is_float:
                self._prepared[key] = Matrix(self.store.f32(name, storage))
            else:
                quantized = self.store.quantized(name, storage)
                if weight_type.layout is not Layout.STORED:  # through the bytes the artifact holds
                    layout = weight_type.layout
                    quantized = unpack(pack(quantized, layout), storage, layout, quantized.shape)
                self._prepared[key] = Matrix(quantized.dequantize().reshape(weight_type.shape), quantized)
        return self._prepared[key]


class _State:
    """The arrays of an entry point's values, and this call's row count."""

    def __init__(self, n: int):
        self.n = n
        self.values: dict[SSAValue, object] = {}

    def __call__(self, value: SSAValue):
        v = self.values[value]
        return v.f32 if isinstance(v, Matrix) else v

    def matrix(self, value: SSAValue) -> Matrix:
        return self.values[value]  # type: ignore[return-value]


def _store(get: _State, out: SSAValue, rows: np.ndarray) -> None:
    """Write float results to `out`: float rows as they are, quantized rows through int8."""
    dst = get(out)
    if isinstance(dst, QRows):
        dst.write(rows.reshape(rows.shape[0], -1))
    else:
        dst[: rows.shape[0]] = rows.reshape(dst[: rows.shape[0]].shape)


def _project(get: _State, op: tgt.Projection, weight: SSAValue, rows: int,
             last_row: bool = False) -> np.ndarray:
    """`x · wᵀ` for the rows a matmul reads (normalized first when a norm is fused, then quantized with
    `quantize`)."""
    x = get(op.x)
    if isinstance(x, QRows):
        return integer_matmul(*x.values(rows - 1 if last_row else 0, rows), get.matrix(weight).quantized)
    x = x[:rows].reshape(rows, -1)
    if last_row:
        x = x[-1:]
    if op.norm is not None:
        x = rms_norm(x, get(op.norm), op.eps.value.data)
    if op.quantize is not None:
        exact = integer_matmul(*quantize_rows(x, op.quantize.bits), get.matrix(weight).quantized)
        screen = getattr(op, "screen", None)
        if screen is None:
            return exact
        return screened(integer_matmul(*quantize_rows(x, 8), get.matrix(weight).quantized), exact,
                        screen.value.data)
    return x @ get(weight).T


def screened(coarse: np.ndarray, exact: np.ndarray, margin: float) -> np.ndarray:
    """`tgt.matmul … screen M`'s results from its int8-row ones and its int16-row ones: the exact result in
    every strip of 16 columns whose largest int8 result is within `margin` of the largest in its block of
    `tgt.SCREEN_COLUMNS`, the int8 one elsewhere."""
    top, best = screen_maxima(coarse)
    near = np.repeat(top >= best - np.float32(margin), STRIP, axis=1)[:, : coarse.shape[1]]
    return np.where(near, exact, coarse)


def screen_maxima(coarse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row and strip of 16 columns of `coarse` (`[rows, n]`): the strip's largest value, and the largest of
    its block of `tgt.SCREEN_COLUMNS` (`[rows, strips]` each), what a screen compares."""
    rows, n = coarse.shape
    strips = -(-n // STRIP)
    padded = np.full((rows, strips * STRIP), -np.inf, np.float32)
    padded[:, :n] = coarse
    top = padded.reshape(rows, strips, STRIP).max(axis=2)
    per_block = tgt.SCREEN_COLUMNS // STRIP
    best = np.empty_like(top)
    for lo in range(0, strips, per_block):
        best[:, lo:lo + per_block] = top[:, lo:lo + per_block].max(axis=1, keepdims=True)
    return top, best


@kernel(tgt.EmbeddingOp)
def _embedding(op: tgt.EmbeddingOp, get: _State) -> None:
    tokens = get(op.tokens)[: get.n]
    table = get(op.table)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= table.shape[0]):
        raise ValueError(f"token id outside the vocabulary of {table.shape[0]}")
    _store(get, op.out, table[tokens] if op.scale is None else table[tokens] * np.float32(op.scale.value.data))


@kernel(tgt.RMSNormOp)
def _rms_norm(op: tgt.RMSNormOp, get: _State) -> None:
    x = get(op.x)[: get.n]
    w = get(op.weight)
    _store(get, op.out, rms_norm(x.reshape(x.shape[0], -1, w.shape[0]), w, op.eps.value.data))


@kernel(tgt.QuantizeOp)
def _quantize(op: tgt.QuantizeOp, get: _State) -> None:
    x = get(op.x)[: get.n]
    _store(get, op.out, x.reshape(x.shape[0], -1))


@kernel(tgt.MatmulOp)
def _matmul(op: tgt.MatmulOp, get: _State) -> None:
    y = _project(get, op, op.weight, get.n, last_row=op.last_row is not None)
    if op.bias is not None:
        y = y + get(op.bias)
    y = soft_capped(y, llm.optional_value(op, "softcap"))
    out = get(op.out)[: y.shape[0]]
    out[...] = out + y if op.accumulate is not None else y


@kernel(tgt.QkvOp)
def _qkv(op: tgt.QkvOp, get: _State) -> None:
    for weight, out, bias in op.projections():
        y = _project(get, op, weight, get.n)
        get(out)[: y.shape[0]] = y if bias is None else y + get(bias)


@kernel(tgt.SwigluOp)
def _swiglu(op: tgt.SwigluOp, get: _State) -> None:
    _store(get, op.out, gate_activation(op)(_project(get, op, op.gate, get.n)) * _project(get, op, op.up, get.n))


@kernel(tgt.RopeOp)
def _rope(op: tgt.RopeOp, get: _State) -> None:
    x = get(op.x)
    x[: get.n] = rope(x[: get.n], get(op.positions)[: get.n], op.rope)


@kernel(tgt.AttentionOp)
def _attention(op: tgt.AttentionOp, get: _State) -> None:
    q, k, v = get(op.q)[: get.n], get(op.k)[: get.n], get(op.v)[: get.n]
    positions = get(op.positions)[: get.n]
    if op.rope is not None:
        q[...] = rope(q, positions, op.rope)
        k[...] = rope(k, positions, op.rope)
    cache = KVCache(get(op.k_cache)[None], get(op.v_cache)[None], cache_element(op.k_cache.type))  # one layer
    if op.slots is not None:
        _store(get, op.out, attention_in_slots(q, k, v, positions, get(op.slots)[: get.n], cache, 0, **llm.scoring(op)))
    else:
        _store(get, op.out, attention(q, k, v, positions, cache, 0, **llm.scoring(op)))


@kernel(tgt.AddOp)
def _add(op: tgt.AddOp, get: _State) -> None:
    get(op.out)[: get.n] = get(op.lhs)[: get.n] + get(op.rhs)[: get.n]


@kernel(tgt.MulOp)
def _mul(op: tgt.MulOp, get: _State) -> None:
    get(op.out)[: get.n] = get(op.lhs)[: get.n] * get(op.rhs)[: get.n]


def _broadcast(get: _State, value: SSAValue) -> np.ndarray:
    """A generic kernel's input: its first `n` rows, or a weight's one value per column."""
    array = get(value)
    return array if isinstance(value.type, tgt.WeightType) else array[: get.n]


@kernel(tgt.BinaryOp)
def _binary(op: tgt.BinaryOp, get: _State) -> None:
    _store(get, op.out, BINARY[op.kind.data](_broadcast(get, op.lhs), _broadcast(get, op.rhs)).astype(np.float32))


@kernel(tgt.ScalarOp)
def _scalar(op: tgt.ScalarOp, get: _State) -> None:
    x, s = get(op.x)[: get.n], np.float32(op.value.value.data)
    _store(get, op.out, BINARY[op.kind.data](*((s, x) if op.reversed is not None else (x, s))).astype(np.float32))


@kernel(tgt.UnaryOp)
def _unary(op: tgt.UnaryOp, get: _State) -> None:
    _store(get, op.out, UNARY[op.kind.data](get(op.x)[: get.n]).astype(np.float32))


@kernel(tgt.ReduceOp)
def _reduce(op: tgt.ReduceOp, get: _State) -> None:
    _store(get, op.out, REDUCE[op.kind.data](get(op.x)[: get.n], axis=1, keepdims=True).astype(np.float32))


@kernel(tgt.MoeOp)
def _moe(op: tgt.MoeOp, get: _State) -> None:
    gate, up, down = (get(w).reshape(op.experts, -1, get(w).shape[-1]) for w in (op.gate, op.up, op.down))
    x = get(op.x)[: get.n]
    _store(get, op.out, moe(op, x.reshape(x.shape[0], -1), get(op.router), lambda i: gate[i], lambda i: up[i],
                            lambda i: down[i]))


@kernel(*tgt.ACTIVATION_KERNELS.values())
def _activation(op: tgt.Kernel, get: _State) -> None:
    get(op.out)[: get.n] = ACTIVATIONS[op.ACTIVATION].numpy(get(op.x)[: get.n])  # type: ignore[attr-defined]


def cache_element(memref: MemRefType) -> str:
    """The `KVCache.element` of a cache buffer type."""
    return llm.kv_type_name(memref.element_type)


def cache_for(memref: MemRefType) -> KVCache:
    """A zeroed `KVCache` for an entry point's cache argument (q8_0 rows held as their float values)."""
    *dims, width = tgt.dims(memref)  # layers(, slots), kv_heads, capacity
    element = cache_element(memref)
    head_dim = kv_q8_head_dim(width) if element == "q8_0" else width
    return KVCache.zeros((*dims, head_dim), element)


def arena_bytes(function: func.FuncOp) -> int:
    size = function.attributes["tgt.arena_bytes"]
    assert isinstance(size, IntegerAttr)
    return size.value.data


def _buffer(arena: np.ndarray, alloc: tgt.AllocOp) -> np.ndarray | QRows:
    assert alloc.offset is not None, "run plan-memory first"
    offset = alloc.offset.value.data
    t = alloc.result.type
    if isinstance(t, MemRefType):
        return arena[offset : offset + alloc.nbytes].view(np.float32).reshape(tgt.dims(alloc.result))
    assert isinstance(t, tgt.QRowsType)
    return QRows(*t.layout.views(arena[offset : offset + alloc.nbytes], t.rows))


def run_entry(function: func.FuncOp, weights: KernelWeights, tokens: np.ndarray, start: int | np.ndarray,
              cache: KVCache, slots: np.ndarray | None = None) -> np.ndarray:
    """Run one entry point on `tokens` at positions `start..` (or at the positions `start`, in cache
    `slots` where it holds several sequences); returns its logits `[rows, vocab]`."""
    args = {arg.name_hint: arg for arg in function.body.block.args}  # llmc.abi.ENTRY_ARGUMENTS
    arena = np.zeros(arena_bytes(function), np.uint8)
    n = len(tokens)
    state = _State(n)
    capacity = tgt.dims(args["tokens"])[0]
    if not 1 <= n <= capacity:
        raise ValueError(f"@{function.sym_name.data} takes 1..{capacity} tokens, got {n}")
    ids, positions, slot_ids = (np.zeros(capacity, np.int32) for _ in range(3))
    ids[:n] = tokens
    positions[:n] = np.arange(start, start + n) if np.ndim(start) == 0 else start
    slot_ids[:n] = 0 if slots is None else slots
    logits = np.zeros(tgt.dims(args["logits"]), np.float32)
    state.values |= {args["tokens"]: ids, args["positions"]: positions, args["k_cache"]: cache.keys,
                     args["v_cache"]: cache.values, args["logits"]: logits}
    if "slots" in args:
        state.values[args["slots"]] = slot_ids
    for op in function.body.block.ops:
        if isinstance(op, tgt.AllocOp):
            state.values[op.result] = _buffer(arena, op)
        elif isinstance(op, tgt.ViewOp):
            state.values[op.result] = state(op.source).reshape(tgt.dims(op.result))
        elif isinstance(op, tgt.SubviewOp):
            state.values[op.result] = state(op.source)[op.index.value.data]
        elif isinstance(op, tgt.WeightOp):
            state.values[op.result] = weights(op.sym_name, op.weight_type)
        elif isinstance(op, func.ReturnOp):
            break
        else:
            SEMANTICS.lookup(op)(op, state)
    return logits[: len(tokens)] if logits.shape[0] > 1 else logits
