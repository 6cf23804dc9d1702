"""The `llm` dialect: a Llama-family decoder as a graph of tensor ops.

What the model computes, independent of framework, target and quantization scheme.
Activations are `tensor<?xDxf32>` values whose leading dimension is the token count;
weights are symbols into the model's weight store, never dense constants:

```mlir
func.func @forward(%tokens: tensor<?xi32>, %pos: tensor<?xi32>,
                   %kv: !llm.kv_cache<30x3x8192x64xf32>) -> tensor<?x49152xf32> {
  %token_embd = llm.weight @token_embd q8_0 : tensor<49152x576xf32>
  %x = llm.embedding %tokens, %token_embd : (tensor<?xi32>, tensor<49152x576xf32>) -> tensor<?x576xf32>
  ...
  %logits = llm.logits %h, %token_embd : (tensor<?x576xf32>, tensor<49152x576xf32>) -> tensor<?x49152xf32>
  func.return %logits : tensor<?x49152xf32>
}
```

After `quantize`, every weight names its storage type and every matmul its compute
mode (`a32`: float activations; `a8`: activations quantized to int8 per 32 values).
After `group`, fused forms (`llm.swiglu`, matmuls with a `norm` prologue or a
`residual` to add, attention with `rope`) say which ops become one kernel.

Conventions: weight matrices are `[out, in]` (as stored by GGUF and Hugging Face), so
`llm.matmul %x, %w` is `x · wᵀ`; RoPE rotates the two halves of each head
(the Hugging Face / NeoX convention; the GGUF frontend undoes llama.cpp's row
permutation of Q and K so that both frontends meet here).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum
from typing import ClassVar

from xdsl.dialects.builtin import (
    DYNAMIC_INDEX,
    I64,
    ArrayAttr,
    Float32Type,
    FloatAttr,
    FloatData,
    IntAttr,
    IntegerAttr,
    SymbolRefAttr,
    TensorType,
    UnitAttr,
    f16,
    i8,
    i32,
    i64,
)
from xdsl.dialects.utils.enum_attribute import EnumAttribute
from xdsl.ir import (
    Attribute,
    Dialect,
    Operation,
    ParametrizedAttribute,
    SpacedOpaqueSyntaxAttribute,
    SSAValue,
    TypeAttribute,
)
from xdsl.irdl import (
    AnyAttr,
    AttrSizedOperandSegments,
    IRDLOperation,
    VarConstraint,
    irdl_attr_definition,
    irdl_op_definition,
    operand_def,
    opt_operand_def,
    opt_prop_def,
    param_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.parser import AttrParser
from xdsl.printer import Printer
from xdsl.traits import Pure
from xdsl.utils.exceptions import VerifyException

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
    loop is integer dot products."""

    A32 = "a32"
    A8 = "a8"


@irdl_attr_definition
class ComputeAttr(EnumAttribute[Compute], SpacedOpaqueSyntaxAttribute):
    """A matmul's compute mode: `#llm<compute a8>` (just `compute a8` inside the op)."""

    name = "llm.compute"


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


def optional_value(op: Operation, name: str) -> int | float | None:
    """The value of `op`'s optional integer or float property `name`, or None where it is absent."""
    attr = op.properties.get(name)
    return None if attr is None else attr.value.data


SCORING = ("window", "softcap", "scale")  # the optional properties that change attention's scores


def scoring(op: Operation) -> dict[str, int | float | None]:
    """`window`, `softcap` and `scale` of an `llm.attention` or a `tgt.attention` (None where absent)."""
    return {name: optional_value(op, name) for name in SCORING}


# ------------------------------------------------------------------------ ops


@irdl_op_definition
class WeightOp(IRDLOperation, _ShapeChecks):
    """A tensor from the weight store, by symbol, with its storage format.

    ```mlir
    %w = llm.weight @blk.0.attn_q q4_1 : tensor<576x576xf32>
    ```
    The result type is the logical (dequantized) tensor; `storage` says how it is kept.
    """

    name = "llm.weight"
    sym = prop_def(SymbolRefAttr)
    storage = prop_def(StorageAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$sym $storage attr-dict `:` type($result)"

    def __init__(self, sym: str, storage: Storage, shape: Sequence[int]):
        super().__init__(
            properties={"sym": SymbolRefAttr(sym), "storage": StorageAttr(storage)},
            result_types=[tensor(*shape)],
        )
        self.result.name_hint = sym.replace(".", "_")

    @property
    def sym_name(self) -> str:
        return self.sym.root_reference.data

    def verify_(self) -> None:
        shape = shape_of(self.result)
        if None in shape or not shape:
            self._fail(f"weight @{self.sym_name} must have a static, non-empty shape, got tensor<{_dims(shape)}>")
        self._element("result", self.result)


@irdl_op_definition
class EmbeddingOp(IRDLOperation, _ShapeChecks):
    """Rows of an embedding table, one per token id; with `scale S`, times S (Gemma's √hidden).

    ```mlir
    %x = llm.embedding %tokens, %table : (tensor<?xi32>, tensor<49152x576xf32>) -> tensor<?x576xf32>
    %x = llm.embedding %tokens, %table scale 4.800000e+01 : (tensor<?xi32>, tensor<256000x2304xf32>) -> tensor<?x2304xf32>
    ```
    """

    name = "llm.embedding"
    tokens = operand_def(TensorType)
    table = operand_def(TensorType)
    scale = opt_prop_def(FloatAttr[Float32Type])
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$tokens `,` $table (`scale` $scale^)? attr-dict `:` `(` type($tokens) `,` type($table) `)` `->` type($result)"
    )

    def __init__(self, tokens: SSAValue, table: SSAValue, scale: float | None = None):
        t = shape_of(tokens)[0]
        super().__init__(operands=[tokens, table], result_types=[tensor(t, shape_of(table)[1])],
                         properties={} if scale is None else {"scale": FloatAttr(scale, f32)})

    def verify_(self) -> None:
        (t,) = self._rank("tokens", self.tokens, 1)
        self._element("tokens", self.tokens, i32)
        _, d = self._rank("table", self.table, 2)
        rt, rd = self._rank("result", self.result, 2)
        self._same("token count (tokens vs result)", t, rt)
        self._same("embedding width (table vs result)", d, rd)


@irdl_op_definition
class RMSNormOp(IRDLOperation, _ShapeChecks):
    """Root-mean-square normalization over the last dimension, scaled by a weight.

    `y = x / sqrt(mean(x²) + eps) * w`
    ```mlir
    %h = llm.rms_norm %x, %w eps 1.000000e-05 : tensor<?x576xf32>, tensor<576xf32>
    ```
    """

    name = "llm.rms_norm"
    T: ClassVar = VarConstraint("T", AnyAttr())
    input = operand_def(T)
    weight = operand_def(TensorType)
    eps = prop_def(FloatAttr[Float32Type])
    result = result_def(T)
    traits = traits_def(Pure())
    assembly_format = "$input `,` $weight `eps` $eps attr-dict `:` type($input) `,` type($weight)"

    def __init__(self, x: SSAValue, weight: SSAValue, eps: float):
        super().__init__(operands=[x, weight], properties={"eps": FloatAttr(eps, f32)}, result_types=[x.type])

    def verify_(self) -> None:
        x = shape_of(self.input)
        (d,) = self._rank("weight", self.weight, 1)
        if not x:
            self._fail("input must have rank >= 1")
        self._same("normalized width (input vs weight)", x[-1], d)


class Projection(IRDLOperation, _ShapeChecks):
    """What the ops that multiply by a weight matrix share: a compute mode set by
    `quantize`, and a fused RMSNorm prologue that `group` may add (`norm %g eps E`:
    the input is RMS-normalized with weight `g` first)."""

    compute = opt_prop_def(ComputeAttr)

    @property
    def mode(self) -> Compute:
        """The compute mode (`a32` until `quantize` chooses)."""
        return self.compute.data if self.compute is not None else Compute.A32

    def _verify_norm(self, k: int | None) -> None:
        norm = getattr(self, "norm")
        if norm is not None:
            (d,) = self._rank("norm weight", norm, 1)
            self._same("reduction dimension (input vs norm)", k, d)
        if (norm is None) != (getattr(self, "eps") is None):
            self._fail("'norm' and 'eps' go together")


def _norm_props(eps: float | None, compute: Compute | None) -> dict[str, Attribute]:
    props: dict[str, Attribute] = {}
    if eps is not None:
        props["eps"] = FloatAttr(eps, f32)
    if compute is not None:
        props["compute"] = ComputeAttr(compute)
    return props


@irdl_op_definition
class MatmulOp(Projection):
    """Activations times a transposed weight, plus an optional bias: `x · wᵀ + b`.

    ```mlir
    %q = llm.matmul %h, %wq : (tensor<?x576xf32>, tensor<576x576xf32>) -> tensor<?x576xf32>
    %k = llm.matmul %h, %wk bias %bk compute a8 : (tensor<?x896xf32>, tensor<128x896xf32>, tensor<128xf32>) -> tensor<?x128xf32>
    ```
    After `group`: `norm %g eps E` normalizes the input first, and `residual %r` adds
    the product to `r` (a residual connection, updated in place by the kernel):
    ```mlir
    %x1 = llm.matmul %a, %wo residual %x compute a8 : (tensor<?x576xf32>, tensor<576x576xf32> residual tensor<?x576xf32>) -> tensor<?x576xf32>
    ```
    """

    name = "llm.matmul"
    input = operand_def(TensorType)
    weight = operand_def(TensorType)
    bias = opt_operand_def(TensorType)
    norm = opt_operand_def(TensorType)
    residual = opt_operand_def(TensorType)
    eps = opt_prop_def(FloatAttr[Float32Type])
    result = result_def(TensorType)
    traits = traits_def(Pure())
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    assembly_format = (
        "$input `,` $weight (`bias` $bias^)? (`norm` $norm^ `eps` $eps)? (`residual` $residual^)? "
        "(`compute` $compute^)? attr-dict `:` `(` type($input) `,` type($weight) (`,` type($bias)^)? "
        "(`norm` type($norm)^)? (`residual` type($residual)^)? `)` `->` type($result)"
    )

    def __init__(self, x: SSAValue, weight: SSAValue, bias: SSAValue | None = None, *, norm: SSAValue | None = None,
                 eps: float | None = None, residual: SSAValue | None = None, compute: Compute | None = None):
        t = shape_of(x)[0]
        n = shape_of(weight)[0]
        super().__init__(
            operands=[x, weight, [bias] if bias else [], [norm] if norm else [], [residual] if residual else []],
            properties=_norm_props(eps if norm is not None else None, compute),
            result_types=[tensor(t, n)],
        )

    def verify_(self) -> None:
        t, k = self._rank("input", self.input, 2)
        n, wk = self._rank("weight", self.weight, 2)
        rt, rn = self._rank("result", self.result, 2)
        self._same("reduction dimension (input vs weight)", k, wk)
        self._same("token count (input vs result)", t, rt)
        self._same("output width (weight vs result)", n, rn)
        if self.bias is not None:
            (b,) = self._rank("bias", self.bias, 1)
            self._same("output width (weight vs bias)", n, b)
        if self.residual is not None and self.residual.type != self.result.type:
            self._fail(f"residual type {self.residual.type} must equal the result type {self.result.type}")
        self._verify_norm(k)


@irdl_op_definition
class LogitsOp(Projection):
    """The language-model head: next-token scores over the vocabulary, `x · wᵀ`.

    A separate op from `llm.matmul` so that later phases can find the head (decode
    only needs its last row; it is the widest matmul of the model).
    ```mlir
    %logits = llm.logits %h, %token_embd : (tensor<?x576xf32>, tensor<49152x576xf32>) -> tensor<?x49152xf32>
    %logits = llm.logits %last, %token_embd norm %g eps 1.000000e-05 : (tensor<1x576xf32>, tensor<49152x576xf32> norm tensor<576xf32>) -> tensor<1x49152xf32>
    ```
    With `softcap C`, each score `s` becomes `C · tanh(s / C)` (Gemma 2's final soft-capping).
    """

    name = "llm.logits"
    input = operand_def(TensorType)
    weight = operand_def(TensorType)
    norm = opt_operand_def(TensorType)
    eps = opt_prop_def(FloatAttr[Float32Type])
    softcap = opt_prop_def(FloatAttr[Float32Type])
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$input `,` $weight (`norm` $norm^ `eps` $eps)? (`compute` $compute^)? (`softcap` $softcap^)? attr-dict `:` "
        "`(` type($input) `,` type($weight) (`norm` type($norm)^)? `)` `->` type($result)"
    )

    def __init__(self, x: SSAValue, weight: SSAValue, *, norm: SSAValue | None = None, eps: float | None = None,
                 compute: Compute | None = None, softcap: float | None = None):
        props = _norm_props(eps if norm is not None else None, compute)
        if softcap is not None:
            props["softcap"] = FloatAttr(softcap, f32)
        super().__init__(operands=[x, weight, [norm] if norm else []], properties=props,
                         result_types=[tensor(shape_of(x)[0], shape_of(weight)[0])])

    @property
    def cap(self) -> float | None:
        """The soft-capping constant, or None."""
        return optional_value(self, "softcap")

    def verify_(self) -> None:
        t, k = self._rank("input", self.input, 2)
        v, wk = self._rank("weight", self.weight, 2)
        rt, rv = self._rank("result", self.result, 2)
        self._same("hidden width (input vs weight)", k, wk)
        self._same("token count (input vs result)", t, rt)
        self._same("vocabulary size (weight vs result)", v, rv)
        self._verify_norm(k)


@irdl_op_definition
class SwigluOp(Projection):
    """The gated feed-forward input, fused by `group`: `silu(x · w_gateᵀ) * (x · w_upᵀ)`;
    with `gelu`, GeGLU: `gelu(x · w_gateᵀ) * (x · w_upᵀ)` (`llm.gelu`'s tanh approximation).

    ```mlir
    %h = llm.swiglu %x, %wg, %wu compute a8 : (tensor<?x576xf32>, tensor<1536x576xf32>, tensor<1536x576xf32>) -> tensor<?x1536xf32>
    %h = llm.swiglu %x, %wg, %wu gelu : (tensor<?x2304xf32>, tensor<9216x2304xf32>, tensor<9216x2304xf32>) -> tensor<?x9216xf32>
    ```
    """

    name = "llm.swiglu"
    input = operand_def(TensorType)
    gate = operand_def(TensorType)
    up = operand_def(TensorType)
    norm = opt_operand_def(TensorType)
    eps = opt_prop_def(FloatAttr[Float32Type])
    gelu = opt_prop_def(UnitAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$input `,` $gate `,` $up (`norm` $norm^ `eps` $eps)? (`compute` $compute^)? (`gelu` $gelu^)? attr-dict `:` "
        "`(` type($input) `,` type($gate) `,` type($up) (`norm` type($norm)^)? `)` `->` type($result)"
    )

    def __init__(self, x: SSAValue, gate: SSAValue, up: SSAValue, *, norm: SSAValue | None = None,
                 eps: float | None = None, compute: Compute | None = None, gelu: bool = False):
        props = _norm_props(eps if norm is not None else None, compute)
        if gelu:
            props["gelu"] = UnitAttr()
        super().__init__(operands=[x, gate, up, [norm] if norm else []], properties=props,
                         result_types=[tensor(shape_of(x)[0], shape_of(gate)[0])])

    def verify_(self) -> None:
        t, k = self._rank("input", self.input, 2)
        n, gk = self._rank("gate", self.gate, 2)
        self._same("gate vs up shape", (n, gk), shape_of(self.up))
        self._same("reduction dimension (input vs gate)", k, gk)
        rt, rn = self._rank("result", self.result, 2)
        self._same("token count (input vs result)", t, rt)
        self._same("output width (gate vs result)", n, rn)
        self._verify_norm(k)


@irdl_op_definition
class ReshapeOp(IRDLOperation, _ShapeChecks):
    """The same elements in another shape; the token dimension stays first.

    ```mlir
    %q3 = llm.reshape %q : tensor<?x576xf32> -> tensor<?x9x64xf32>
    ```
    """

    name = "llm.reshape"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input attr-dict `:` type($input) `->` type($result)"

    def __init__(self, x: SSAValue, shape: Sequence[int | None]):
        super().__init__(operands=[x], result_types=[tensor(*shape)])

    def verify_(self) -> None:
        src, dst = shape_of(self.input), shape_of(self.result)
        if not src or not dst:
            self._fail("input and result must have rank >= 1")
        self._same("leading (token) dimension", src[0], dst[0])
        inner_src, inner_dst = src[1:], dst[1:]
        if None in inner_src or None in inner_dst:
            self._fail(f"only the leading dimension may be dynamic: tensor<{_dims(src)}> -> tensor<{_dims(dst)}>")
        if math.prod(inner_src) != math.prod(inner_dst):
            self._fail(f"element count differs: tensor<{_dims(src)}> -> tensor<{_dims(dst)}>")


@irdl_op_definition
class RopeOp(IRDLOperation, _ShapeChecks):
    """Rotary position embedding of each head at each token's position, as `#llm.rope` says.

    Pairs element `i` with element `i + dims/2` (the rotate-half convention) and rotates
    them by `pos · theta^(-2i/dims) / factor_i`.
    ```mlir
    %qr = llm.rope %q3, %pos <theta 100000.0> : tensor<?x9x64xf32>, tensor<?xi32>
    ```
    """

    name = "llm.rope"
    T: ClassVar = VarConstraint("T", AnyAttr())
    input = operand_def(T)
    positions = operand_def(TensorType)
    rope = prop_def(RopeAttr)
    result = result_def(T)
    traits = traits_def(Pure())
    assembly_format = "$input `,` $positions $rope attr-dict `:` type($input) `,` type($positions)"

    def __init__(self, x: SSAValue, positions: SSAValue, rope: RopeAttr):
        super().__init__(operands=[x, positions], properties={"rope": rope}, result_types=[x.type])

    def verify_(self) -> None:
        t, _, d = self._rank("input", self.input, 3)
        (p,) = self._rank("positions", self.positions, 1)
        self._element("positions", self.positions, i32)
        self._same("token count (input vs positions)", t, p)
        if d is not None and (problem := self.rope.check_head(d)):
            self._fail(problem)


@irdl_op_definition
class AttentionOp(IRDLOperation, _ShapeChecks):
    """Causal grouped-query attention of one layer, through the KV cache.

    Writes `k` and `v` into the cache rows of layer `layer` at `positions`, then each
    query attends to the cached rows `0..position` of its KV head
    (`kv_head = head / (heads / kv_heads)`), its scores scaled by `1/sqrt(head_dim)`. With
    `rope <…>` (fused by `group`), `q` and `k` are rotated first as `llm.rope` would.
    Optional: `window W` attends to the last W positions only (sliding-window attention,
    `position - W < p <= position`); `softcap C` maps each scaled score `s` to
    `C · tanh(s / C)`; `scale S` replaces `1/sqrt(head_dim)`.
    ```mlir
    %a = llm.attention %q, %k, %v, %pos, %kv layer 0 : (tensor<?x9x64xf32>, tensor<?x3x64xf32>,
           tensor<?x3x64xf32>, tensor<?xi32>, !llm.kv_cache<30x3x8192x64xf32>) -> tensor<?x9x64xf32>
    ```
    A cache of several sequences (`slots N`) takes each row's slot too: row `t` is written
    to and attends within sequence `slots[t]` only (batched decode: one row per sequence).
    ```mlir
    %a = llm.attention %q, %k, %v, %pos slots %slots, %kv layer 0 : (tensor<8x9x64xf32>, tensor<8x3x64xf32>,
           tensor<8x3x64xf32>, tensor<8xi32> slots tensor<8xi32>, !llm.kv_cache<30x3x4096x64xf16, slots 8>) -> ...
    ```
    Not pure: it writes the cache.
    """

    name = "llm.attention"
    query = operand_def(TensorType)
    key = operand_def(TensorType)
    value = operand_def(TensorType)
    positions = operand_def(TensorType)
    slots = opt_operand_def(TensorType)
    kv_cache = operand_def(KVCacheType)
    layer = prop_def(IntegerAttr[I64])
    rope = opt_prop_def(RopeAttr)
    window = opt_prop_def(IntegerAttr[I64])
    softcap = opt_prop_def(FloatAttr[Float32Type])
    scale = opt_prop_def(FloatAttr[Float32Type])
    result = result_def(TensorType)
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    assembly_format = (
        "$query `,` $key `,` $value `,` $positions (`slots` $slots^)? `,` $kv_cache `layer` $layer (`rope` $rope^)? "
        "(`window` $window^)? (`softcap` $softcap^)? (`scale` $scale^)? "
        "attr-dict `:` `(` type($query) `,` type($key) `,` type($value) `,` type($positions) "
        "(`slots` type($slots)^)? `,` type($kv_cache) `)` `->` type($result)"
    )

    def __init__(self, q: SSAValue, k: SSAValue, v: SSAValue, positions: SSAValue, kv_cache: SSAValue, layer: int,
                 rope: RopeAttr | None = None, slots: SSAValue | None = None, **options: Attribute):
        props: dict[str, Attribute] = {"layer": IntegerAttr(layer, i64), **options}
        if rope is not None:
            props["rope"] = rope
        super().__init__(operands=[q, k, v, positions, [slots] if slots is not None else [], kv_cache],
                         properties=props, result_types=[q.type])

    @staticmethod
    def scoring_properties(window: int | None = None, softcap: float | None = None, scale: float | None = None
                           ) -> dict[str, Attribute]:
        """The optional properties that change the scores, for `__init__`'s `options`."""
        found = {"window": None if window is None else IntegerAttr(window, i64),
                 "softcap": None if softcap is None else FloatAttr(softcap, f32),
                 "scale": None if scale is None else FloatAttr(scale, f32)}
        return {k: v for k, v in found.items() if v is not None}

    @property
    def options(self) -> dict[str, Attribute]:
        """This op's scoring properties, to build a rewritten attention with."""
        return {k: v for k in SCORING if (v := self.properties.get(k)) is not None}

    def verify_(self) -> None:
        t, h, d = self._rank("query", self.query, 3)
        kt, kh, kd = self._rank("key", self.key, 3)
        vt, vh, vd = self._rank("value", self.value, 3)
        (p,) = self._rank("positions", self.positions, 1)
        self._element("positions", self.positions, i32)
        for what, dim in (("key", kt), ("value", vt), ("positions", p)):
            self._same(f"token count (query vs {what})", t, dim)
        self._same("kv heads (key vs value)", kh, vh)
        self._same("head dimension (query vs key)", d, kd)
        self._same("head dimension (query vs value)", d, vd)
        if None in (h, kh) or kh == 0 or h % kh:
            self._fail(f"query heads ({h}) must be a multiple of kv heads ({kh})")
        if self.result.type != self.query.type:
            self._fail(f"result type {self.result.type} must equal the query type {self.query.type}")
        cache = self.kv_cache.type
        assert isinstance(cache, KVCacheType)
        layers, ckh, _, cd = cache.shape
        self._same("kv heads (key vs kv_cache)", kh, ckh)
        self._same("head dimension (key vs kv_cache)", kd, cd)
        if not 0 <= self.layer.value.data < layers:
            self._fail(f"layer {self.layer.value.data} is outside the cache's {layers} layers")
        if self.rope is not None and d is not None and (problem := self.rope.check_head(d)):
            self._fail(problem)
        if self.window is not None and self.window.value.data < 1:
            self._fail(f"window must be positive, got {self.window.value.data}")
        for what in ("softcap", "scale"):
            value = self.properties.get(what)
            if value is not None and not (math.isfinite(value.value.data) and value.value.data > 0):
                self._fail(f"{what} must be positive, got {value.value.data}")
        if (self.slots is not None) != (cache.slots > 1):
            self._fail("a cache of several sequences needs each row's slot (`slots %s`), and only such a cache")
        if self.slots is not None:
            (st,) = self._rank("slots", self.slots, 1)
            self._element("slots", self.slots, i32)
            self._same("token count (query vs slots)", t, st)


@irdl_op_definition
class LastTokenOp(IRDLOperation, _ShapeChecks):
    """The row of the last token: what generation needs from a prompt chunk.

    ```mlir
    %last = llm.last_token %h : tensor<?x576xf32> -> tensor<1x576xf32>
    ```
    """

    name = "llm.last_token"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input attr-dict `:` type($input) `->` type($result)"

    def __init__(self, x: SSAValue):
        super().__init__(operands=[x], result_types=[tensor(1, *shape_of(x)[1:])])

    def verify_(self) -> None:
        src, dst = shape_of(self.input), shape_of(self.result)
        if len(src) < 1 or dst != (1, *src[1:]):
            self._fail(f"result must be tensor<1x...> of the input's row: tensor<{_dims(src)}> -> tensor<{_dims(dst)}>")


class _ElementwiseOp(IRDLOperation, _ShapeChecks):
    """Binary elementwise ops on tensors of one type."""

    T: ClassVar = VarConstraint("T", AnyAttr())
    lhs = operand_def(T)
    rhs = operand_def(T)
    result = result_def(T)
    traits = traits_def(Pure())
    assembly_format = "$lhs `,` $rhs attr-dict `:` type($result)"

    def __init__(self, lhs: SSAValue, rhs: SSAValue):
        super().__init__(operands=[lhs, rhs], result_types=[lhs.type])


@irdl_op_definition
class AddOp(_ElementwiseOp):
    """Elementwise sum, e.g. a residual connection.

    ```mlir
    %x1 = llm.add %x0, %attn_out : tensor<?x576xf32>
    ```
    """

    name = "llm.add"


@irdl_op_definition
class MulOp(_ElementwiseOp):
    """Elementwise product, e.g. the gate of a SwiGLU feed-forward.

    ```mlir
    %gu = llm.mul %g, %u : tensor<?x1536xf32>
    ```
    """

    name = "llm.mul"


class _UnaryOp(IRDLOperation, _ShapeChecks):
    """Unary elementwise ops: the result has the input's type."""

    T: ClassVar = VarConstraint("T", AnyAttr())
    input = operand_def(T)
    result = result_def(T)
    traits = traits_def(Pure())
    assembly_format = "$input attr-dict `:` type($input)"

    def __init__(self, x: SSAValue):
        super().__init__(operands=[x], result_types=[x.type])


@irdl_op_definition
class SiluOp(_UnaryOp):
    """The SiLU activation, `x · sigmoid(x)`.

    ```mlir
    %g = llm.silu %gate : tensor<?x1536xf32>
    ```
    """

    name = "llm.silu"


@irdl_op_definition
class MoeOp(IRDLOperation, _ShapeChecks):
    """A mixture-of-experts feed-forward: each token's `top_k` experts by router score, their
    gated feed-forwards summed, weighted by the router's probabilities.

    `p = softmax(x · routerᵀ)`; the `top_k` largest `p_e` (with `normalize`, divided by their
    sum) weigh `(silu(x · gate[e]ᵀ) * (x · up[e]ᵀ)) · down[e]ᵀ`. The experts' weights are
    `[experts, out, in]`; only the chosen ones are read.
    ```mlir
    %y = llm.moe %h, %router, %gate, %up, %down top_k 2 normalize : (tensor<?x32xf32>, tensor<8x32xf32>,
           tensor<8x24x32xf32>, tensor<8x24x32xf32>, tensor<8x32x24xf32>) -> tensor<?x32xf32>
    ```
    """

    name = "llm.moe"
    input = operand_def(TensorType)
    router = operand_def(TensorType)
    gate = operand_def(TensorType)
    up = operand_def(TensorType)
    down = operand_def(TensorType)
    top_k = prop_def(IntegerAttr[I64])
    normalize = opt_prop_def(UnitAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$input `,` $router `,` $gate `,` $up `,` $down `top_k` $top_k (`normalize` $normalize^)? attr-dict `:` "
        "`(` type($input) `,` type($router) `,` type($gate) `,` type($up) `,` type($down) `)` `->` type($result)"
    )

    def __init__(self, x: SSAValue, router: SSAValue, gate: SSAValue, up: SSAValue, down: SSAValue, top_k: int,
                 normalize: bool):
        props: dict[str, Attribute] = {"top_k": IntegerAttr(top_k, i64)}
        if normalize:
            props["normalize"] = UnitAttr()
        super().__init__(operands=[x, router, gate, up, down], properties=props, result_types=[x.type])

    def verify_(self) -> None:
        t, d = self._rank("input", self.input, 2)
        e, rd = self._rank("router", self.router, 2)
        ge, f, gd = self._rank("gate", self.gate, 3)
        self._same("gate vs up shape", (ge, f, gd), shape_of(self.up))
        de, dd, df = self._rank("down", self.down, 3)
        for what, a, b in (("experts (router vs gate)", e, ge), ("experts (router vs down)", e, de),
                           ("hidden (input vs router)", d, rd), ("hidden (input vs gate)", d, gd),
                           ("hidden (input vs down)", d, dd), ("expert width (gate vs down)", f, df)):
            self._same(what, a, b)
        if self.result.type != self.input.type:
            self._fail("the result has the input's type")
        if not 1 <= self.top_k.value.data <= (e or 0):
            self._fail(f"top_k must be in 1..{e} experts, got {self.top_k.value.data}")


@irdl_op_definition
class GeluOp(_UnaryOp):
    """GELU, tanh approximation (`gelu_pytorch_tanh`): `x/2 · (1 + tanh(√(2/π)·(x + 0.044715·x³)))`.

    ```mlir
    %g = llm.gelu %gate : tensor<?x9216xf32>
    ```
    """

    name = "llm.gelu"


LLM = Dialect(
    "llm",
    [
        WeightOp, EmbeddingOp, RMSNormOp, MatmulOp, LogitsOp, SwigluOp, ReshapeOp, RopeOp, AttentionOp,
        LastTokenOp, AddOp, MulOp, SiluOp, GeluOp, MoeOp,
    ],
    [StorageAttr, ComputeAttr, KVCacheType, RopeAttr],
)
