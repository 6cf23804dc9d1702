"""Gate activations of gated feed-forwards (SwiGLU, GeGLU): one table row each.

A row gives the activation's numpy meaning (both interpreters) and the `KernelBuilder`
method that emits it (CPU and CUDA kernels). From the table, the `llm` and `tgt` dialects
make one elementwise op per activation (`llm.silu`, `tgt.gelu_tanh`), `llm.swiglu` and
`tgt.swiglu` name theirs (silu when none is printed), and a model config names its
family's. Adding an activation is a row here, its builder method, and the frontends'
names for it:

```mlir
%g = llm.gelu_tanh %gate : tensor<?x9216xf32>
%h = llm.swiglu %x, %wg, %wu activation gelu_tanh : (tensor<?x2304xf32>, tensor<9216x2304xf32>, tensor<9216x2304xf32>) -> tensor<?x9216xf32>
```
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from xdsl.ir import Operation


class Activation(StrEnum):
    SILU = "silu"
    GELU_TANH = "gelu_tanh"
    GELU = "gelu"


_ERF = np.frompyfunc(math.erf, 1, 1)


def erf(x: np.ndarray) -> np.ndarray:
    """The error function, elementwise in float64 (libm's, ~0.1 µs an element)."""
    return np.asarray(_ERF(np.asarray(x, np.float64)), np.float64)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (np.float32(1) + np.exp(-x))


def gelu_tanh(x: np.ndarray) -> np.ndarray:
    """GELU's tanh approximation (`gelu_pytorch_tanh`)."""
    inner = np.float32(np.sqrt(2 / np.pi)) * (x + np.float32(0.044715) * x * x * x)
    return (np.float32(0.5) * x * (np.float32(1) + np.tanh(inner))).astype(np.float32)


def gelu(x: np.ndarray) -> np.ndarray:
    """GELU, `x/2 · (1 + erf(x/√2))`, computed in float64, in x's type."""
    x64 = np.asarray(x, np.float64)
    return (0.5 * x64 * (1 + erf(x64 * math.sqrt(0.5)))).astype(np.asarray(x).dtype)


@dataclass(frozen=True)
class ActivationSpec:
    """What an activation is: its formula of x (the ops' docs), numpy meaning, and the name of the
    `KernelBuilder` method that emits it."""

    formula: str
    numpy: Callable[[np.ndarray], np.ndarray]
    builder: str


ACTIVATIONS: dict[Activation, ActivationSpec] = {
    Activation.SILU: ActivationSpec("x · sigmoid(x)", silu, "silu"),
    Activation.GELU_TANH: ActivationSpec("x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³)))", gelu_tanh, "gelu_tanh"),
    Activation.GELU: ActivationSpec("x/2 · (1 + erf(x/√2))", gelu, "gelu"),
}


def activation_of(op: Operation) -> Activation:
    """The gate activation of an `llm.swiglu` or `tgt.swiglu`: its `activation`, silu when it has none."""
    attr = op.properties.get("activation")
    return Activation.SILU if attr is None else attr.data  # type: ignore[attr-defined]
