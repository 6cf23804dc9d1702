"""The `llm` dialect's attributes and types: weight storage, compute modes, the KV cache, RoPE;
and the shape helpers and verifier checks its ops share.

```mlir
%wq = llm.weight @blk.0.attn_q q4_1 : tensor<576x576xf32>
%q = llm.matmul %h, %wq compute a8 : (tensor<?x576xf32>, tensor<576x576xf32>) -> tensor<?x576xf32>
%qr = llm.rope %q3, %pos <theta 100000.0> : tensor<?x9x64xf32>, tensor<?xi32>
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %kv: !llm.kv_cache<30x3x4096x64xf16>)
```
"""


from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

from xdsl.dialects.builtin import (
    DYNAMIC_INDEX,
    ArrayAttr,
    Float32Type,
    FloatData,
    IntAttr,
    TensorType,
    f16,
    i8,
    i64,
)
from xdsl.dialects.utils.enum_attribute import EnumAttribute
from xdsl.ir import (
    Attribute,
    Operation,
    ParametrizedAttribute,
    SpacedOpaqueSyntaxAttribute,
    SSAValue,
    TypeAttribute,
)
from xdsl.irdl import (
    AnyAttr,
    irdl_attr_definition,
    param_def,
)
from xdsl.parser import AttrParser
from xdsl.printer import Printer
from xdsl.utils.exceptions import VerifyException

from llmc.ir.activations import Activation
from llmc.ir.formats import Storage

f32 = Float32Type()


# --------------------------------------------------------------------------- types


@irdl_attr_definition
class StorageAttr(EnumAttribute[Storage], SpacedOpaqueSyntaxAttribute):
    """A weight's storage format: `#llm<storage q4_1>` (just `q4_1` inside `llm.weight`).

    The formats and their meaning are the block-format table, `llmc.ir.formats`.
    """

    name = "llm.storage"


class Compute(StrEnum):
    """How a matmul computes: `a32` reads float activations (weights dequantized in
    registers); `a8` reads activations quantized to int8 per 32 values, so the inner
    loop is integer dot products; `a16` reads them quantized to int16 per 32 values,
    multiplied as two int8 planes (`256·hi + lo`) by the same integer dot products (about
    a32's accuracy at a8's memory traffic)."""

    A32 = "a32"
    A8 = "a8"
    A16 = "a16"

    @property
    def integer(self) -> bool:
        """Whether the mode reads quantized rows (integer dot products)."""
        return self is not Compute.A32

    @property
    def bits(self) -> int:
        """The width of the activations the mode reads: 8, 16 or 32 (float)."""
        return int(self.value[1:])


@irdl_attr_definition
class ComputeAttr(EnumAttribute[Compute], SpacedOpaqueSyntaxAttribute):
    """A matmul's compute mode: `#llm<compute a8>` (just `compute a8` inside the op)."""

    name = "llm.compute"


@irdl_attr_definition
class ActivationAttr(EnumAttribute[Activation], SpacedOpaqueSyntaxAttribute):
    """The gate activation of a gated feed-forward (`llmc.ir.activations`): `activation gelu_tanh` inside
    `llm.swiglu` and `tgt.swiglu`."""

    name = "llm.activation"


KV_TYPES = {"f32": f32, "f16": f16, "q8_0": i8}  # the cache's element types; i8: int8 and a scale per 32


def kv_type_name(element: Attribute) -> str:
    """The `--kv-type` name of a cache's element type (of `!llm.kv_cache` or its `tgt` memref)."""
    for name, t in KV_TYPES.items():
        if element == t:
            return name
    raise ValueError(f"no KV cache type has elements of {element}")


@irdl_attr_definition
class KVCacheType(ParametrizedAttribute, TypeAttribute):
    """The key/value cache of every layer: `!llm.kv_cache<layers x kv_heads x capacity x head_dim x f32>`,
    for one sequence, or for `slots` sequences (`--max-batch`): `!llm.kv_cache<30x3x4096x64xf16, slots 8>`.

    One value of this type is threaded through the forward function; `llm.attention`
    writes the new rows of its layer and attends to the rows before them. The element
    type is one of `KV_TYPES` (i8: q8_0 rows).
    """

    name = "llm.kv_cache"

    layers: IntAttr = param_def(IntAttr)
    kv_heads: IntAttr = param_def(IntAttr)
    capacity: IntAttr = param_def(IntAttr)
    head_dim: IntAttr = param_def(IntAttr)
    element_type: Attribute = param_def(AnyAttr())
    slot_count: IntAttr = param_def(IntAttr)

    def __init__(self, layers: int, kv_heads: int, capacity: int, head_dim: int, element_type: Attribute = f32,
                 slots: int = 1):
        super().__init__(IntAttr(layers), IntAttr(kv_heads), IntAttr(capacity), IntAttr(head_dim), element_type,
                         IntAttr(slots))

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """One sequence's cache: layers, kv heads, capacity, head dimension."""
        return (self.layers.data, self.kv_heads.data, self.capacity.data, self.head_dim.data)

    @property
    def slots(self) -> int:
        """How many sequences the cache holds."""
        return self.slot_count.data

    def print_parameters(self, printer: Printer) -> None:
        printer.print_string("<" + "x".join(str(d) for d in self.shape) + "x")
        printer.print_attribute(self.element_type)
        if self.slots != 1:
            printer.print_string(f", slots {self.slots}")
        printer.print_string(">")

    @classmethod
    def parse_parameters(cls, parser: AttrParser) -> Sequence[Attribute]:
        pos = parser.pos
        parser.parse_punctuation("<")
        dims, element_type = parser.parse_ranked_shape()
        if len(dims) != 4 or any(d < 1 for d in dims):
            parser.raise_error("!llm.kv_cache needs four static dimensions: layers x kv_heads x capacity x head_dim", pos)
        slots = 1
        if parser.parse_optional_punctuation(",") is not None:
            parser.parse_keyword("slots")
            slots = parser.parse_integer(allow_boolean=False, allow_negative=False)
        parser.parse_punctuation(">")
        return (*(IntAttr(d) for d in dims), element_type, IntAttr(slots))

    def verify(self) -> None:
        if any(d < 1 for d in self.shape) or self.slots < 1:
            raise VerifyException(f"!llm.kv_cache dimensions and slots must be positive, got {self.shape}, "
                                  f"{self.slots} slots")


def ssa_name(text: str) -> str:
    """A valid SSA name hint from a source name (`blk.0.attn_q` → `blk_0_attn_q`, `onnx::W_7` → `onnx__W_7`,
    `1` → `v1`, `é` → `_`: xDSL takes ASCII letters, digits and `_` only, not a digit first)."""
    name = "".join(c if (c.isascii() and c.isalnum()) or c == "_" else "_" for c in text)
    return name if name[:1].isalpha() or name[:1] == "_" else f"v{name}"


def float_text(x: float) -> str:
    """`x` as an MLIR float literal that parses back to the same double (`1.0e-05`, `500000.0`)."""
    text = repr(float(x))
    return text.replace("e", ".0e") if "e" in text and "." not in text else text


@irdl_attr_definition
class RopeAttr(ParametrizedAttribute):
    """How RoPE rotates a head: `#llm.rope<theta 10000.0>`, with the optional parts of scaled and
    partial rotary embeddings:

    - `dims N`: only the first N elements of a head rotate (partial rotary); pair `i` is
      element `i` with `i + N/2`; the rest pass through.
    - `factors [f0, f1, …]`: pair `i` turns at `theta^(-2i/N) / f_i`: llama3, linear, YaRN
      and LongRoPE scaling all reduce to these per-pair divisors (llama.cpp's `rope_freqs`).
    - `mscale M`: cos and sin are multiplied by M (YaRN's and LongRoPE's attention factor).

    ```mlir
    #llm.rope<theta 500000.0, factors [1.0, 1.0, 3.21, 8.0]>
    ```
    """

    name = "llm.rope"

    theta: FloatData = param_def(FloatData)
    dims: IntAttr = param_def(IntAttr)  # 0: the whole head
    mscale: FloatData = param_def(FloatData)
    factors: ArrayAttr[FloatData] = param_def(ArrayAttr[FloatData])

    def __init__(self, theta: float, dims: int = 0, mscale: float = 1.0, factors: Sequence[float] = ()):
        super().__init__(FloatData(float(theta)), IntAttr(dims), FloatData(float(mscale)),
                         ArrayAttr([FloatData(float(f)) for f in factors]))

    def rotary_dims(self, head_dim: int) -> int:
        """How many elements of a head of `head_dim` rotate."""
        return self.dims.data or head_dim

    @property
    def frequency_factors(self) -> tuple[float, ...]:
        return tuple(f.data for f in self.factors.data)

    def print_parameters(self, printer: Printer) -> None:
        printer.print_string(f"<theta {float_text(self.theta.data)}")
        if self.dims.data:
            printer.print_string(f", dims {self.dims.data}")
        if self.mscale.data != 1.0:
            printer.print_string(f", mscale {float_text(self.mscale.data)}")
        if self.factors.data:
            printer.print_string(", factors [" + ", ".join(float_text(f) for f in self.frequency_factors) + "]")
        printer.print_string(">")

    @classmethod
    def parse_parameters(cls, parser: AttrParser) -> Sequence[Attribute]:
        parser.parse_punctuation("<")
        parser.parse_keyword("theta")
        theta, dims, mscale, factors = parser.parse_float(), 0, 1.0, []
        while parser.parse_optional_punctuation(",") is not None:
            key = parser.parse_optional_keyword_in(("dims", "mscale", "factors"))
            if key == "dims":
                dims = parser.parse_integer(allow_boolean=False, allow_negative=False)
            elif key == "mscale":
                mscale = parser.parse_float()
            elif key == "factors":
                factors = parser.parse_comma_separated_list(parser.Delimiter.SQUARE, parser.parse_float)
            else:
                parser.raise_error("expected dims, mscale or factors")
        parser.parse_punctuation(">")
        return (FloatData(theta), IntAttr(dims), FloatData(mscale), ArrayAttr([FloatData(f) for f in factors]))

    def verify(self) -> None:
        if not (math.isfinite(self.theta.data) and self.theta.data > 0):
            raise VerifyException(f"#llm.rope: theta must be positive, got {self.theta.data}")
        if self.dims.data < 0 or self.dims.data % 2:
            raise VerifyException(f"#llm.rope: dims must be even, got {self.dims.data}")
        if not (math.isfinite(self.mscale.data) and self.mscale.data > 0):
            raise VerifyException(f"#llm.rope: mscale must be positive, got {self.mscale.data}")
        if not all(math.isfinite(f) and f > 0 for f in self.frequency_factors):
            raise VerifyException("#llm.rope: frequency factors must be positive")

    def check_head(self, head_dim: int) -> str | None:
        """Why this rotation cannot apply to heads of `head_dim`, or None."""
        dims = self.rotary_dims(head_dim)
        if dims > head_dim or dims % 2:
            return f"rotary dims {dims} must be even and at most the head dimension {head_dim}"
        if self.factors.data and len(self.factors.data) != dims // 2:
            return f"{len(self.factors.data)} frequency factors for {dims // 2} rotating pairs"
        return None


# ------------------------------------------------------------------ shape helpers


def tensor(*shape: int | None, element_type: Attribute = f32) -> TensorType:
    """`tensor(None, 576)` is `tensor<?x576xf32>`: `None` marks the token dimension."""
    return TensorType(element_type, [DYNAMIC_INDEX if d is None else d for d in shape])


def shape_of(value: SSAValue | Attribute) -> tuple[int | None, ...]:
    """The shape of a tensor value or type, with `None` for a dynamic dimension."""
    t = value.type if isinstance(value, SSAValue) else value
    if not isinstance(t, TensorType):
        raise VerifyException(f"expected a tensor, got {t}")
    return tuple(None if d == DYNAMIC_INDEX else d for d in t.get_shape())


def _dims(shape: Sequence[int | None]) -> str:
    return "x".join("?" if d is None else str(d) for d in shape)


def broadcast(*shapes: Sequence[int | None]) -> tuple[int | None, ...]:
    """The numpy broadcast of shapes with `None` for a dynamic dimension (None with n > 1 is n)."""
    rank = max((len(s) for s in shapes), default=0)
    out: list[int | None] = []
    for i in range(rank):
        dims = {s[len(s) - rank + i] for s in shapes if len(s) - rank + i >= 0}
        known = {d for d in dims if d not in (None, 1)}
        if len(known) > 1:
            raise VerifyException(f"shapes {', '.join('<' + _dims(s) + '>' for s in shapes)} do not broadcast")
        out.append(known.pop() if known else (None if None in dims else 1))
    return tuple(out)


def element_type(value: SSAValue | Attribute) -> Attribute:
    t = value.type if isinstance(value, SSAValue) else value
    assert isinstance(t, TensorType)
    return t.element_type


def _normalized_axis(axis: int, rank: int) -> int:
    if not -max(rank, 1) <= axis < max(rank, 1):
        raise VerifyException(f"axis {axis} is outside a tensor of rank {rank}")
    return axis % max(rank, 1)


class _ShapeChecks:
    """Verifier helpers that name the op and the dimensions in their messages."""

    def _fail(self, message: str) -> None:
        raise VerifyException(f"{self.name}: {message}")

    def _rank(self, what: str, value: SSAValue, rank: int) -> tuple[int | None, ...]:
        shape = shape_of(value)
        if len(shape) != rank:
            self._fail(f"{what} must have rank {rank}, got tensor<{_dims(shape)}>")
        return shape

    def _element(self, what: str, value: SSAValue, element_type: Attribute = f32) -> None:
        t = value.type
        assert isinstance(t, TensorType)
        if t.element_type != element_type:
            self._fail(f"{what} must have element type {element_type}, got {t.element_type}")

    def _same(self, what: str, a: int | None, b: int | None) -> None:
        if a != b:
            self._fail(f"{what} mismatch: {'?' if a is None else a} vs {'?' if b is None else b}")

    def _shape_length(self, value: SSAValue) -> int | None:
        """The length of a shape operand, a 1-D i64 tensor (`llm.expand`, `llm.fill`); None where dynamic."""
        (n,) = self._rank("shape", value, 1)
        self._element("shape", value, i64)
        return n


def optional_value(op: Operation, name: str) -> int | float | None:
    """The value of `op`'s optional integer or float property `name`, or None where it is absent."""
    attr = op.properties.get(name)
    return None if attr is None else attr.value.data


SCORING = ("window", "softcap", "scale")  # the optional properties that change attention's scores


def scoring(op: Operation) -> dict[str, int | float | None]:
    """`window`, `softcap` and `scale` of an `llm.attention` or a `tgt.attention` (None where absent)."""
    return {name: optional_value(op, name) for name in SCORING}
