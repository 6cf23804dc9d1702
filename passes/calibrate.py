"""Calibration: how much error quantizing each projection's activations adds, per compute mode.

`quantize` runs the float `llm` interpreter on calibration tokens (the built-in text of
`calibration_text`, chat conversations rendered with the model's own template, or
`--calibrate FILE`), takes each projection's input (normalized, where a norm is fused)
and measures, on a sample of its rows, the relative output error of each integer mode:

    error(mode) = ‖x̂·Wᵀ − x·Wᵀ‖² / ‖x·Wᵀ‖²,   x̂ = x quantized per 32 values (int8: a8, int16: a16)

with `W` the weight in the storage `quantize` chose (`a32` adds none). `quantize` records
it on each projection, `{llm.error = {a8 = 3.1e-04 : f64, a16 = 5.2e-09 : f64}}`, and
`llmc verify --per-layer` prints it, measured on the verify prompt.

    errors = measure(find_function(module, "forward"), model.weights, calibration_tokens(model.tokenizer))

A measurement is kept in the compiler's cache (`llmc.cache`, `calibration/`) under the digest of all it
reads (`measurement_key`): the function's IR, the bytes of its weights, the tokens and the code that
measures; a second compile of the same model and options measures nothing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections.abc import Sequence
from itertools import zip_longest
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from threadpoolctl import threadpool_limits
from xdsl.dialects import func

from llmc import cache
from llmc.errors import LlmcError, UsageError
from llmc.ir import llm
from llmc.ir.formats import SLICE, quantize_rows
from llmc.ir.interpreter import KVCache, rms_norm, run
from llmc.ir.target import target_description
from llmc.ir.text import print_module
from llmc.ir.weights import WeightStore
from llmc.passes.calibration_text import CONVERSATIONS, PLAIN
from llmc.runtime.codec import TextCodec
from llmc.textfile import read_text

if TYPE_CHECKING:
    from llmc.frontend.model import Model
    from llmc.ir.tgt import TargetAttr
    from llmc.passes.pipeline import CompileOptions

MAX_TOKENS = 128  # SmolLM2-135M's measurement over these: ~1.5 s, half of it dequantizing the weights
MAX_CALIBRATION_BYTES = 256 << 20  # --calibrate: far more text than MAX_TOKENS of it
SAMPLE_ROWS = 16  # rows of each projection's input whose error is measured (positions spread evenly)
MAX_OUTPUTS = 2048  # outputs of a wider projection (an LM head) whose error is measured: 8 blocks of rows
BLOCKS = 8
MODES = (llm.Compute.A8, llm.Compute.A16)


_streamed: dict[str, str] = {}  # the text of a --calibrate that reads once (`-`, a pipe: `<(…)`), by its name


def read_calibration(path: str) -> str:
    """The text of `--calibrate FILE`: readable, UTF-8, not empty (else one line, exit 2). Checked before the
    model loads and read again to calibrate: standard input or a pipe is read the first time only."""
    if path in _streamed:
        return _streamed[path]
    text = read_text("--calibrate", path, MAX_CALIBRATION_BYTES)
    if "\0" in text:
        raise UsageError(f"--calibrate {path}: not a text file (it holds NUL bytes)")
    if not text.strip():
        raise UsageError(f"--calibrate {path}: the file has no text")
    if path == "-" or not os.path.isfile(path):
        _streamed[path] = text
    return text


def _rendered(codec: TextCodec, conversation: tuple[tuple[str, str], ...]) -> str:
    """A conversation in the model's chat template, or as `User: …` lines where it has none
    (or its template refuses these messages)."""
    if codec.chat_template:
        try:
            return codec.render_chat([{"role": r, "content": c} for r, c in conversation], add_generation_prompt=False)
        except LlmcError:
            pass
    return "".join(f"{role.capitalize()}: {content}\n" for role, content in conversation)


def calibration_tokens(codec: TextCodec, path: str = "", limit: int = MAX_TOKENS) -> list[int]:
    """At most `limit` tokens to calibrate on: the first of `path` (`--calibrate`), or of the
    built-in text, a conversation then a plain text in turn, each from the beginning of text."""
    if path:
        return codec.encode(read_calibration(path))[:limit]
    tokens: list[int] = []
    for conversation, plain in zip_longest(CONVERSATIONS, PLAIN):
        for text in ([_rendered(codec, conversation)] if conversation else []) + ([plain] if plain else []):
            if len(tokens) < limit:
                tokens += codec.encode(text)
    return tokens[:limit]


def weight_ops(op: llm.Projection) -> list[llm.WeightOp]:
    """The `llm.weight`s a projection multiplies by (gate and up for `llm.swiglu`); empty where a
    weight is computed (such a projection cannot be integer)."""
    values = [op.gate, op.up] if isinstance(op, llm.SwigluOp) else [op.weight]
    owners = [v.owner for v in values]
    return owners if all(isinstance(o, llm.WeightOp) for o in owners) else []  # type: ignore[return-value]


def fake_quantized(x: np.ndarray, bits: int) -> np.ndarray:
    """`x` after quantizing it per 32 values as the kernels do (`quantize_rows`), back in float."""
    qs, d, _ = quantize_rows(x, bits)
    k = x.shape[-1]
    return qs[:, :k].astype(np.float32) * np.repeat(d, SLICE, axis=1)[:, :k]


def sampled_rows(w: np.ndarray) -> np.ndarray:
    """The rows of float weight `w` an error is measured on: all, or of a matrix of more than
    `MAX_OUTPUTS` rows (an LM head) `BLOCKS` blocks of rows spread over it: the error is a
    ratio, which a sample of outputs estimates."""
    n = w.shape[0]
    if n <= MAX_OUTPUTS:
        return w
    size = MAX_OUTPUTS // BLOCKS
    return np.concatenate([w[s:s + size] for s in np.linspace(0, n - size, BLOCKS).astype(np.int64)])


def measure(function: func.FuncOp, weights: WeightStore, tokens: Sequence[int]) -> list[dict[llm.Compute, float] | None]:
    """The relative output error of `a8` and `a16` for each projection of `function` (walk
    order; None for one whose weight is computed), from a float run (the modes already set are
    ignored) of `@forward`-like `function(tokens, positions, cache)` on `tokens`, which stops
    once the last projection is measured; the cache's copy where the same was measured before.
    It holds one weight in float32 at a time and runs BLAS on one thread: its products
    are small, and BLAS threads spinning against a busy machine's other work (a server, a test
    run) made it 3–7× slower."""
    key = measurement_key(function, weights, tokens)
    kept = cache.lookup(CACHE_KIND, key)
    if kept is not None:
        return [None if e is None else {llm.Compute(m): v for m, v in e.items()} for e in json.loads(kept)]
    with threadpool_limits(limits=1, user_api="blas"):
        errors = _measure(function, weights, tokens)
    cache.store(CACHE_KIND, key, json.dumps([None if e is None else {m.value: v for m, v in e.items()}
                                             for e in errors]).encode())
    return errors


CACHE_KIND = "calibration"


def measurement_key(function: func.FuncOp, weights: WeightStore, tokens: Sequence[int]) -> str:
    """The sha256 of what `measure` reads: `function`'s IR, each of its weights (name, storage, shape, bytes),
    `tokens`, and the code (`measuring_code`) and numpy that measure."""
    digest = hashlib.sha256(f"{measuring_code()}\0{np.__version__}\0{print_module(function)}\0".encode())
    digest.update(np.asarray(tokens, np.int64).tobytes())
    names = sorted({op.sym_name for op in function.walk() if isinstance(op, llm.WeightOp)})
    for name in names:
        weight = weights.entries[name]
        digest.update(f"\0{name}\0{weight.storage.value}\0{weight.shape}\0".encode())
        for array in (weight.data, weight.row_order):
            if array is not None:
                digest.update(np.ascontiguousarray(array).data)
                digest.update(b"\0")
    return digest.hexdigest()


@functools.cache
def measuring_code() -> str:
    """The digest of the source of the IR and its interpreter, and of the passes (this one among them)."""
    import llmc.ir
    import llmc.passes

    return cache.source_digest(*(Path(package.__file__).parent for package in (llmc.ir, llmc.passes)))


def _measure(function: func.FuncOp, weights: WeightStore, tokens: Sequence[int]) -> list[dict[llm.Compute, float] | None]:
    # a store that keeps no float weights: each lives from its `llm.weight` to its last reader
    weights = WeightStore(weights.source, weights.entries, cache=False)
    twin = function.clone()
    for op in twin.walk():
        if isinstance(op, llm.Projection):
            op.properties.pop("compute", None)
    tokens = np.asarray(tokens, np.int32)
    cache_type = twin.function_type.inputs.data[2]
    assert isinstance(cache_type, llm.KVCacheType)
    rows = np.unique(np.linspace(0, tokens.size - 1, min(tokens.size, SAMPLE_ROWS)).round().astype(np.int64))
    errors: list[dict[llm.Compute, float] | None] = []

    projections = sum(isinstance(op, llm.Projection) for op in twin.walk())

    def observe(op, operands: list) -> None:
        if not isinstance(op, llm.Projection):
            return
        errors.append(_errors(op, dict(zip(op.operands, operands, strict=True)), rows) if weight_ops(op) else None)
        if len(errors) == projections:
            raise _Measured  # (the LM head's own product over the whole vocabulary is not needed)

    try:
        run(twin, weights, tokens, np.arange(tokens.size, dtype=np.int32), KVCache.for_type(cache_type, tokens.size),
            observe=observe)
    except _Measured:
        pass
    return errors


def _errors(op: llm.Projection, value: dict, rows: np.ndarray) -> dict[llm.Compute, float]:
    """`op`'s relative output error per integer mode, on `rows` of its input (`value`: its operands')."""
    x = value[op.input][rows]
    norm = getattr(op, "norm", None)
    if norm is not None:
        x = rms_norm(x, value[norm], op.eps.value.data)  # type: ignore[attr-defined]
    stacked = np.concatenate([x] + [fake_quantized(x, mode.bits) - x for mode in MODES])
    energy = np.zeros(1 + len(MODES))
    for w in weight_ops(op):
        y = (stacked @ sampled_rows(value[w.result]).T).astype(np.float64)
        energy += np.square(y).reshape(1 + len(MODES), -1).sum(-1)
    return {mode: float(e / energy[0]) if energy[0] > 0 else 0.0 for mode, e in zip(MODES, energy[1:])}


class _Measured(Exception):
    """Every projection is measured: the run can stop."""


def calibration_for(model: Model, options: CompileOptions, target: TargetAttr) -> list[int]:
    """The tokens `quantize` calibrates on under `options` for `target`: none
    unless `--compute auto` chooses between integer modes there; `model`'s tokenizer encodes them,
    at most `MAX_TOKENS` and the model's context."""
    if options.compute != "auto" or not target_description(target).has_integer_dot():
        return []
    return calibration_tokens(model.tokenizer, options.calibrate, min(MAX_TOKENS, model.config.context_length))
