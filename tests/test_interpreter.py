"""The numpy interpreter of the `llm` dialect: whole models against transformers fp32,
KV-cache consistency, and hand-checkable semantics of single ops."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from numerics import assert_model_reordered
from tiny_models import VOCAB_SIZE, TinySpec

from llmc.frontend import import_model, load_model
from llmc.ir import find_function
from llmc.ir.interpreter import KVCache, forward_logits, run
from llmc.ir.llm import KVCacheType
from llmc.ir.text import parse_module, verify_module
from llmc.ir.weights import WeightStore

SPECS = {
    "gqa": TinySpec(),
    "mha": TinySpec(heads=4, kv_heads=4),
    "heads3-kv1": TinySpec(hidden=24, heads=3, kv_heads=1),
    "heads5-kv5": TinySpec(hidden=40, heads=5, kv_heads=5),
    "wide-heads": TinySpec(hidden=32, heads=4, kv_heads=2, head_dim=16),
    "untied": TinySpec(tied=False),
    "qwen2-bias": TinySpec(arch="qwen2"),
    "qwen2-bias-untied-theta1e5": TinySpec(arch="qwen2", tied=False, rope_theta=1e5, layers=3),
}
_Q = dict(hidden=64, ffn=64, head_dim=16, heads=4, kv_heads=2)
_PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
QUANT_SPECS = {
    "smollm-like-q4_1": TinySpec(**_Q, gguf_storage=(("token_embd", "q8_0"), *((k, "q4_1") for k in _PROJ))),
    "mixed-q4_0-q8_0-f16": TinySpec(
        **_Q, tied=False,
        gguf_storage=(("attn_q", "q4_0"), ("attn_k", "q8_0"), ("attn_v", "f16"), ("ffn_up", "q4_0"), ("output", "q8_0")),
    ),
}

# 14 positions spread over the vocabulary, specials included
TOKENS = [1, 17, 42, 100, 150, 200, VOCAB_SIZE - 1, 5, 5, 5, 77, 0, 260, 33]


def _logits(path: Path, tokens: list[int] = TOKENS) -> np.ndarray:
    model = load_model(str(path))
    return forward_logits(import_model(model), model.weights, np.array(tokens))


def _assert_close_to_reference(got: np.ndarray, reference: np.ndarray) -> None:
    assert got.shape == reference.shape == (len(TOKENS), VOCAB_SIZE)
    scale = np.abs(reference).max()
    err = np.abs(got - reference).max()
    assert err <= 1e-4 * scale, f"max abs error {err:.3g} > 1e-4 x {scale:.3g}"
    np.testing.assert_array_equal(got.argmax(-1), reference.argmax(-1))


# ------------------------------------------------------------ against transformers


@pytest.mark.reference
class TestAgainstTransformers:
    """transformers fp32 on the same files (skipped without the `reference` extra)."""

    @pytest.fixture(autouse=True)
    def _needs_transformers(self) -> None:
        pytest.importorskip("torch")
        pytest.importorskip("transformers")

    @pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
    def test_hf_dir(self, tiny: Callable[..., Path], spec: TinySpec) -> None:
        from llmc.frontend.reference import reference_logits

        path = tiny(spec, "hf")
        _assert_close_to_reference(_logits(path), reference_logits(path, TOKENS))

    @pytest.mark.parametrize("spec", QUANT_SPECS.values(), ids=QUANT_SPECS.keys())
    def test_quantized_gguf(self, tiny: Callable[..., Path], spec: TinySpec) -> None:
        """transformers dequantizes the GGUF and undoes llama.cpp's Q/K permutation itself."""
        pytest.importorskip("accelerate")
        from llmc.frontend.reference import reference_logits

        path = tiny(spec, "gguf")
        _assert_close_to_reference(_logits(path), reference_logits(path, TOKENS))

    def test_odd_heads_gguf(self, tiny: Callable[..., Path]) -> None:
        pytest.importorskip("accelerate")
        from llmc.frontend.reference import reference_logits

        path = tiny(SPECS["heads3-kv1"], "gguf")
        _assert_close_to_reference(_logits(path), reference_logits(path, TOKENS))


# ------------------------------------------------------------ KV cache

CACHE_CASES = {
    "gqa-hf": (SPECS["gqa"], "hf"),
    "heads3-kv1-gguf": (SPECS["heads3-kv1"], "gguf"),
    "qwen2-bias-hf": (SPECS["qwen2-bias"], "hf"),
    "q4_1-gguf": (QUANT_SPECS["smollm-like-q4_1"], "gguf"),
}

def _model(tiny: Callable[..., Path], spec: TinySpec, form: str):
    model = load_model(str(tiny(spec, form)))
    module = import_model(model)
    cache_type = find_function(module, "forward").function_type.inputs.data[2]
    assert isinstance(cache_type, KVCacheType)
    return module, model.weights, cache_type


@pytest.mark.parametrize("split", [1, 5, len(TOKENS) - 1])
@pytest.mark.parametrize(("spec", "form"), CACHE_CASES.values(), ids=CACHE_CASES.keys())
def test_prefill_then_continue_equals_full_forward(tiny: Callable[..., Path], spec: TinySpec, form: str, split: int) -> None:
    module, weights, cache_type = _model(tiny, spec, form)
    full = forward_logits(module, weights, TOKENS)

    cache = KVCache.for_type(cache_type)
    first = forward_logits(module, weights, TOKENS[:split], cache=cache)
    rest = forward_logits(module, weights, TOKENS[split:], start=split, cache=cache)
    # a different token count changes numpy's summation order, nothing else may differ
    assert_model_reordered(first, full[:split], spec)
    assert_model_reordered(rest, full[split:], spec)
    assert np.abs(rest - full[:1]).max() > 1e-3  # the comparison is not vacuous: positions matter


@pytest.mark.parametrize(("spec", "form"), CACHE_CASES.values(), ids=CACHE_CASES.keys())
def test_token_by_token_decode_equals_full_forward(tiny: Callable[..., Path], spec: TinySpec, form: str) -> None:
    module, weights, cache_type = _model(tiny, spec, form)
    full = forward_logits(module, weights, TOKENS)
    cache = KVCache.for_type(cache_type)
    steps = [forward_logits(module, weights, [t], start=i, cache=cache) for i, t in enumerate(TOKENS)]
    assert_model_reordered(np.concatenate(steps), full, spec)


def test_reused_cache_is_overwritten_from_the_restart_position(tiny: Callable[..., Path]) -> None:
    """A second prompt at position 0 in a used cache must not see the first prompt's rows."""
    module, weights, cache_type = _model(tiny, SPECS["gqa"], "hf")
    other = TOKENS[::-1]
    cache = KVCache.for_type(cache_type)
    forward_logits(module, weights, TOKENS, cache=cache)
    again = forward_logits(module, weights, other[:6], cache=cache)
    assert_model_reordered(again, forward_logits(module, weights, other)[:6], SPECS["gqa"])


def test_position_outside_the_cache_is_refused(tiny: Callable[..., Path]) -> None:
    spec = SPECS["gqa"]
    module, weights, _ = _model(tiny, spec, "hf")
    with pytest.raises(ValueError, match="capacity"):
        forward_logits(module, weights, [1], start=spec.context_length)


# ------------------------------------------------------------ single ops


def _run_op(op_line: str, arg_types: list[str], result_type: str, *args: object) -> np.ndarray:
    """Parse a one-op function `%r = <op_line>`, verify it, and interpret it on `args`."""
    params = ", ".join(f"%a{i}: {t}" for i, t in enumerate(arg_types))
    text = f"func.func @forward({params}) -> {result_type} {{\n  %r = {op_line}\n  func.return %r : {result_type}\n}}\n"
    module = parse_module(text)
    verify_module(module)
    (out,) = run(find_function(module, "forward"), WeightStore(Path("<none>")), *args)
    return np.asarray(out)


def test_rms_norm() -> None:
    x = np.array([[2.0, -2.0, 2.0, -2.0], [3.0, 4.0, 0.0, 0.0]], np.float32)
    w = np.array([1.0, 2.0, 3.0, 4.0], np.float32)
    y = _run_op("llm.rms_norm %a0, %a1 eps 1.0e-02 : tensor<?x4xf32>, tensor<4xf32>",
                ["tensor<?x4xf32>", "tensor<4xf32>"], "tensor<?x4xf32>", x, w)
    # mean(x²) is 4 and 6.25
    expected = np.array([[2, -4, 6, -8] / np.sqrt(4.01), [3, 8, 0, 0] / np.sqrt(6.26)], np.float32)
    assert y.dtype == np.float32
    np.testing.assert_allclose(y, expected, rtol=1e-6)


def test_rope_is_identity_at_position_zero_and_rotates_half_pairs() -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 4)).astype(np.float32)  # 3 tokens, 2 heads, head_dim 4
    line = "llm.rope %a0, %a1 <theta 100.0> : tensor<?x2x4xf32>, tensor<?xi32>"
    types = ["tensor<?x2x4xf32>", "tensor<?xi32>"]

    zeros = _run_op(line, types, "tensor<?x2x4xf32>", x, np.zeros(3, np.int32))
    np.testing.assert_array_equal(zeros, x)

    pos = np.array([0, 1, 7], np.int32)
    y = _run_op(line, types, "tensor<?x2x4xf32>", x, pos)
    # element i pairs with i + 2; angles pos * 100^(-0/4) = pos and pos * 100^(-2/4) = pos / 10
    for t, p in enumerate(pos):
        for i, angle in ((0, p * 1.0), (1, p * 0.1)):
            c, s = math.cos(angle), math.sin(angle)
            a, b = x[t, :, i], x[t, :, i + 2]
            np.testing.assert_allclose(y[t, :, i], a * c - b * s, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(y[t, :, i + 2], b * c + a * s, rtol=1e-5, atol=1e-6)


def test_silu() -> None:
    x = np.array([[0.0, 1.0, -1.0, 30.0, -30.0]], np.float32)
    y = _run_op("llm.silu %a0 : tensor<?x5xf32>", ["tensor<?x5xf32>"], "tensor<?x5xf32>", x)
    s = 1 / (1 + math.exp(-1))
    np.testing.assert_allclose(y, [[0.0, s, -(1 - s), 30.0, 0.0]], rtol=1e-6, atol=1e-6)


def test_matmul_with_bias_and_embedding() -> None:
    x = np.array([[1.0, 2.0]], np.float32)
    w = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]], np.float32)  # [out=3, in=2]
    b = np.array([10.0, 20.0, 30.0], np.float32)
    y = _run_op("llm.matmul %a0, %a1 bias %a2 : (tensor<?x2xf32>, tensor<3x2xf32>, tensor<3xf32>) -> tensor<?x3xf32>",
                ["tensor<?x2xf32>", "tensor<3x2xf32>", "tensor<3xf32>"], "tensor<?x3xf32>", x, w, b)
    np.testing.assert_array_equal(y, [[11.0, 22.0, 33.0]])

    e = _run_op("llm.embedding %a0, %a1 : (tensor<?xi32>, tensor<3x2xf32>) -> tensor<?x2xf32>",
                ["tensor<?xi32>", "tensor<3x2xf32>"], "tensor<?x2xf32>", np.array([2, 0, 2], np.int32), w)
    np.testing.assert_array_equal(e, w[[2, 0, 2]])


_ATTN = ("llm.attention %a0, %a1, %a2, %a3, %a4 layer 0 : (tensor<?x4x4xf32>, tensor<?x2x4xf32>, tensor<?x2x4xf32>, "
         "tensor<?xi32>, !llm.kv_cache<1x2x8x4xf32>) -> tensor<?x4x4xf32>")
_ATTN_TYPES = ["tensor<?x4x4xf32>", "tensor<?x2x4xf32>", "tensor<?x2x4xf32>", "tensor<?xi32>", "!llm.kv_cache<1x2x8x4xf32>"]


def _cache() -> KVCache:
    return KVCache(np.zeros((1, 2, 8, 4), np.float32), np.zeros((1, 2, 8, 4), np.float32))


def test_attention_is_causal_and_groups_heads_by_kv_head() -> None:
    """With zero queries every visible row weighs the same: outputs are running means of V,
    and query heads 0,1 read KV head 0, heads 2,3 read KV head 1."""
    t = 3
    v = np.zeros((t, 2, 4), np.float32)
    v[:, 0] = np.arange(t)[:, None] + 1.0   # KV head 0: rows 1, 2, 3
    v[:, 1] = -10.0 * (np.arange(t)[:, None] + 1.0)
    k = np.random.default_rng(2).standard_normal((t, 2, 4)).astype(np.float32)
    cache = _cache()
    out = _run_op(_ATTN, _ATTN_TYPES, "tensor<?x4x4xf32>", np.zeros((t, 4, 4), np.float32), k, v,
                  np.arange(t, dtype=np.int32), cache)
    running = np.array([1.0, 1.5, 2.0], np.float32)[:, None]
    for head in (0, 1):
        np.testing.assert_allclose(out[:, head], np.broadcast_to(running, (t, 4)), rtol=1e-6)
    for head in (2, 3):
        np.testing.assert_allclose(out[:, head], np.broadcast_to(-10 * running, (t, 4)), rtol=1e-6)
    np.testing.assert_array_equal(cache.keys[0, :, :t], k.transpose(1, 0, 2))
    np.testing.assert_array_equal(cache.values[0, :, :t], v.transpose(1, 0, 2))
    assert not cache.keys[0, :, t:].any()


def test_attention_scales_scores_by_inverse_sqrt_head_dim() -> None:
    """q·k1 = 2a scaled by 1/sqrt(4) gives softmax weights 1/4, 3/4 for a = ln 3."""
    a = math.log(3.0)
    q = np.zeros((2, 4, 4), np.float32)
    q[1, :, 0] = a
    k = np.zeros((2, 2, 4), np.float32)
    k[1, :, 0] = 2.0
    v = np.zeros((2, 2, 4), np.float32)
    v[0], v[1] = 4.0, 8.0
    out = _run_op(_ATTN, _ATTN_TYPES, "tensor<?x4x4xf32>", q, k, v, np.arange(2, dtype=np.int32), _cache())
    np.testing.assert_allclose(out[0], 4.0, rtol=1e-6)
    np.testing.assert_allclose(out[1], 0.25 * 4.0 + 0.75 * 8.0, rtol=1e-6)
