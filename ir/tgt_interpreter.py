"""Numpy reference semantics for the `tgt` kernels, over a real byte arena.

Buffers are views of one `uint8` arena at the offsets `plan-memory` chose, so running
an entry point here also checks the memory plan: two live buffers that overlapped
would corrupt each other and the logits would disagree with the `llm` interpreter.

    logits = run_entry(function, weights, tokens, start, cache)
"""

from __future__ import annotations

import numpy as np
from xdsl.dialects import func
from xdsl.dialects.builtin import FloatAttr, IntegerAttr
from xdsl.ir import SSAValue

from llmc.ir import tgt
from llmc.ir.interpreter import KVCache, OpTable, attention, rms_norm, rope, silu
from llmc.ir.weights import WeightStore

_KERNELS = OpTable()
kernel = _KERNELS.register  # `fn(op, get)`: `get(value)` gives a value's array; writes its `out`


class _State:
    """The arrays of an entry point's values, and this call's row count and start position."""

    def __init__(self, n: int, start: int):
        self.n, self.start = n, start
        self.values: dict[SSAValue, object] = {}

    def __call__(self, value: SSAValue) -> np.ndarray:
        return self.values[value]  # type: ignore[return-value]


def _norm_input(get: _State, x: SSAValue, norm: SSAValue | None, eps: FloatAttr | None) -> np.ndarray:
    """The rows a matmul reads: `x[:n]` flattened per row, RMS-normalized when a norm is fused."""
    rows = get(x)[: get.n]
    rows = rows.reshape(rows.shape[0], -1)
    return rms_norm(rows, get(norm), eps.value.data) if norm is not None else rows


@kernel(tgt.EmbeddingOp)
def _embedding(op: tgt.EmbeddingOp, get: _State) -> None:
    tokens = get(op.tokens)[: get.n]
    table = get(op.table)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= table.shape[0]):
        raise ValueError(f"token id outside the vocabulary of {table.shape[0]}")
    get(op.out)[: get.n] = table[tokens].reshape(get(op.out)[: get.n].shape)


@kernel(tgt.RMSNormOp)
def _rms_norm(op: tgt.RMSNormOp, get: _State) -> None:
    get(op.out)[: get.n] = rms_norm(get(op.x)[: get.n], get(op.weight), op.eps.value.data)


@kernel(tgt.MatmulOp)
def _matmul(op: tgt.MatmulOp, get: _State) -> None:
    x = _norm_input(get, op.x, op.norm, op.eps)
    if op.last_row is not None:
        x = x[-1:]
    y = x @ get(op.weight).T
    if op.bias is not None:
        y = y + get(op.bias)
    out = get(op.out)[: y.shape[0]]
    out[...] = out + y if op.accumulate is not None else y


@kernel(tgt.SwigluOp)
def _swiglu(op: tgt.SwigluOp, get: _State) -> None:
    x = _norm_input(get, op.x, op.norm, op.eps)
    get(op.out)[: get.n] = silu(x @ get(op.gate).T) * (x @ get(op.up).T)


def _positions(get: _State) -> np.ndarray:
    return np.arange(get.start, get.start + get.n, dtype=np.int32)


@kernel(tgt.RopeOp)
def _rope(op: tgt.RopeOp, get: _State) -> None:
    x = get(op.x)
    x[: get.n] = rope(x[: get.n], _positions(get), op.theta.value.data)


@kernel(tgt.AttentionOp)
def _attention(op: tgt.AttentionOp, get: _State) -> None:
    q, k, v = get(op.q)[: get.n], get(op.k)[: get.n], get(op.v)[: get.n]
    if op.rope is not None:
        q[...] = rope(q, _positions(get), op.rope.value.data)
        k[...] = rope(k, _positions(get), op.rope.value.data)
    cache = KVCache(get(op.k_cache), get(op.v_cache))
    get(op.out)[: get.n] = attention(q, k, v, _positions(get), cache, op.layer.value.data)


@kernel(tgt.AddOp)
def _add(op: tgt.AddOp, get: _State) -> None:
    get(op.out)[: get.n] = get(op.lhs)[: get.n] + get(op.rhs)[: get.n]


@kernel(tgt.MulOp)
def _mul(op: tgt.MulOp, get: _State) -> None:
    get(op.out)[: get.n] = get(op.lhs)[: get.n] * get(op.rhs)[: get.n]


@kernel(tgt.SiluOp)
def _silu(op: tgt.SiluOp, get: _State) -> None:
    get(op.out)[: get.n] = silu(get(op.x)[: get.n])


def arena_bytes(function: func.FuncOp) -> int:
    size = function.attributes["tgt.arena_bytes"]
    assert isinstance(size, IntegerAttr)
    return size.value.data


def run_entry(function: func.FuncOp, weights: WeightStore, tokens: np.ndarray, start: int,
              cache: KVCache) -> np.ndarray:
    """Run one entry point on `tokens` at positions `start..`; returns its logits `[1, vocab]`."""
    tokens_arg, n_arg, start_arg, k_arg, v_arg, logits_arg = function.body.block.args
    arena = np.zeros(arena_bytes(function), np.uint8)
    state = _State(len(tokens), start)
    capacity = tgt.dims(tokens_arg)[0]
    if not 1 <= len(tokens) <= capacity:
        raise ValueError(f"@{function.sym_name.data} takes 1..{capacity} tokens, got {len(tokens)}")
    padded = np.zeros(capacity, np.int32)
    padded[: len(tokens)] = tokens
    logits = np.zeros(tgt.dims(logits_arg), np.float32)
    state.values |= {tokens_arg: padded, k_arg: cache.keys, v_arg: cache.values, logits_arg: logits}
    for op in function.body.block.ops:
        if isinstance(op, tgt.AllocOp):
            assert op.offset is not None, "run plan-memory first"
            offset = op.offset.value.data
            state.values[op.result] = arena[offset : offset + op.nbytes].view(np.float32).reshape(tgt.dims(op.result))
        elif isinstance(op, tgt.ViewOp):
            state.values[op.result] = state(op.source).reshape(tgt.dims(op.result))
        elif isinstance(op, tgt.WeightOp):
            state.values[op.result] = weights.f32(op.sym_name)
        elif isinstance(op, func.ReturnOp):
            break
        else:
            _KERNELS[type(op)](op, state)
    return logits
