"""RoPE scaling schemes → the per-pair frequency divisors and cos/sin factor of `#llm.rope`.

Every scheme a supported family uses changes only each rotating pair's frequency
`theta^(-2i/dims)` (divided by a factor per pair) and, for YaRN and LongRoPE, scales
cos and sin by an attention factor. So the frontends turn a config's scaling into
`RopeScaling(factors, mscale)` here, and the IR carries those numbers:

    llama3      factor 8, low 1, high 4, original 8192  →  factors [1.0, …, 1.0, 1.7, …, 8.0]
    linear      factor 4                                →  factors [4.0, 4.0, …]
    yarn        factor 4, original 4096                 →  factors ramping 1 → 4, mscale 1.139
    longrope    short_factor [...], original 4096        →  factors short_factor, mscale √(1 + ln s / ln 4096),
                                                            the context capped at 4096

The arithmetic follows Hugging Face's `modeling_rope_utils` (float32 frequencies).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from llmc.errors import ModelFormatError
from llmc.frontend.model import F32_MAX, finite


@dataclass(frozen=True)
class RopeScaling:
    factors: tuple[float, ...] = ()  # empty: no scaling
    mscale: float = 1.0
    context: int | None = None  # the longest context these numbers hold for, where less than the model's


def _base_inv_freq(theta: float, dims: int) -> np.ndarray:
    return (1.0 / (theta ** (np.arange(0, dims, 2, dtype=np.float32) / dims))).astype(np.float32)


def _number(source: object, params: dict, key: str, default: float | None = None) -> float:
    """`params[key]` (or `default`): every scheme's numbers are positive, and float32 must hold them."""
    value = params.get(key, default)
    number = finite(value)
    if number is None or not F32_MAX > number > 0:
        raise ModelFormatError(source, f"RoPE scaling: {key} must be a number in (0, {F32_MAX:.3g}), got {value!r}")
    return number


def _llama3(source: object, params: dict, theta: float, dims: int, max_positions: int) -> RopeScaling:
    factor = _number(source, params, "factor")
    low, high = _number(source, params, "low_freq_factor"), _number(source, params, "high_freq_factor")
    original = _number(source, params, "original_max_position_embeddings")
    if not high > low:
        raise ModelFormatError(source, "RoPE scaling llama3: needs high_freq_factor > low_freq_factor")
    wavelength = 2 * math.pi / _base_inv_freq(theta, dims).astype(np.float64)
    factors = np.where(wavelength < original / high, 1.0, factor)
    medium = (wavelength >= original / high) & (wavelength <= original / low)  # smoothed between 1 and factor
    smooth = (original / wavelength[medium] - low) / (high - low)
    factors[medium] = 1 / ((1 - smooth) / factor + smooth)
    return RopeScaling(tuple(float(f) for f in factors))


def _linear(source: object, params: dict, theta: float, dims: int, max_positions: int) -> RopeScaling:
    return RopeScaling((_number(source, params, "factor"),) * (dims // 2))


def _yarn(source: object, params: dict, theta: float, dims: int, max_positions: int) -> RopeScaling:
    original = _number(source, params, "original_max_position_embeddings")
    factor = _number(source, params, "factor", max_positions / original)
    if not theta > 1:
        raise ModelFormatError(source, f"RoPE scaling yarn: needs a RoPE base above 1, got {theta}")

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("attention_factor") is not None:
        attention = _number(source, params, "attention_factor")
    elif params.get("mscale") and params.get("mscale_all_dim"):
        attention = mscale(factor, _number(source, params, "mscale")) / mscale(factor, _number(source, params, "mscale_all_dim"))
    else:
        attention = mscale(factor)
    # transformers' defaults where they are missing, null or 0
    fast = _number(source, {"beta_fast": params.get("beta_fast") or 32}, "beta_fast")
    slow = _number(source, {"beta_slow": params.get("beta_slow") or 1}, "beta_slow")

    def correction(rotations: float) -> float:
        return dims * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dims - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(dims // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp  # 1: the pair keeps its frequency, 0: divided by the factor
    factors = 1 / ((1 - extrapolation) / factor + extrapolation)
    return RopeScaling(tuple(float(f) for f in factors), attention)


def _longrope(source: object, params: dict, theta: float, dims: int, max_positions: int) -> RopeScaling:
    """LongRoPE (Phi-3): the short factors, which hold up to the original context length (the artifact's
    longest; the long factors, for contexts past it, are not supported yet)."""
    short = params.get("short_factor")
    if not (isinstance(short, list) and len(short) == dims // 2 and all(F32_MAX > (finite(v) or 0) > 0 for v in short)):
        raise ModelFormatError(source, f"RoPE scaling longrope: short_factor must be {dims // 2} positive numbers")
    original = _number(source, params, "original_max_position_embeddings", max_positions)
    if original < 2:
        raise ModelFormatError(source, f"RoPE scaling longrope: original_max_position_embeddings must be at least 2, "
                                       f"got {original}")
    factor = _number(source, params, "factor", max_positions / original)
    if params.get("attention_factor") is not None:
        attention = _number(source, params, "attention_factor")
    else:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    return RopeScaling(tuple(float(v) for v in short), attention, int(original))


_SCHEMES = {"llama3": _llama3, "linear": _linear, "yarn": _yarn, "longrope": _longrope}


def hf_rope_scaling(source: object, params: dict, theta: float, dims: int, max_positions: int) -> RopeScaling:
    """The scaling a Hugging Face config's `rope_scaling` / `rope_parameters` dict asks for."""
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str):
        raise ModelFormatError(source, f"RoPE scaling: rope_type must be a name, got {kind!r}")
    if kind == "default":
        return RopeScaling()
    if kind not in _SCHEMES:
        raise ModelFormatError(source, f"RoPE scaling '{kind}' is not supported "
                                       f"(supported: default, {', '.join(_SCHEMES)})")
    return _SCHEMES[kind](source, params, theta, dims, max_positions)
