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
import struct
from collections.abc import Sequence
from enum import StrEnum
from typing import ClassVar

from xdsl.dialects.builtin import (
    DYNAMIC_INDEX,
    I64,
    ArrayAttr,
    DenseArrayBase,
    DenseIntOrFPElementsAttr,
    Float32Type,
    FloatAttr,
    FloatData,
    IntAttr,
    IntegerAttr,
    IntegerType,
    SymbolRefAttr,
    TensorType,
    UnitAttr,
    f16,
    i1,
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
    var_operand_def,
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
    """A valid SSA name hint from a source name (`blk.0.attn_q` → `blk_0_attn_q`, `onnx::W_7` → `onnx__W_7`)."""
    name = "".join(c if c.isalnum() or c == "_" else "_" for c in text)
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
        self.result.name_hint = ssa_name(sym)

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
    """The same elements in another shape. At most one result dimension may be dynamic (it
    takes the elements left), unless the shape is given at run time by a 1-D i64 operand
    (`to %shape`, numpy's reshape: -1 takes the rest).

    ```mlir
    %q3 = llm.reshape %q : tensor<?x576xf32> -> tensor<?x9x64xf32>
    %v = llm.reshape %x to %s : tensor<1x?x?xf32> to tensor<2xi64> -> tensor<?x?xf32>
    ```
    """

    name = "llm.reshape"
    input = operand_def(TensorType)
    shape = opt_operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = "$input (`to` $shape^)? attr-dict `:` type($input) (`to` type($shape)^)? `->` type($result)"

    def __init__(self, x: SSAValue, shape: Sequence[int | None], runtime_shape: SSAValue | None = None):
        super().__init__(operands=[x, [runtime_shape] if runtime_shape is not None else []],
                         result_types=[tensor(*shape, element_type=element_type(x))])

    def verify_(self) -> None:
        src, dst = shape_of(self.input), shape_of(self.result)
        if element_type(self.input) != element_type(self.result):
            self._fail("the result has the input's element type")
        if self.shape is not None:
            if shape_of(self.shape) != (len(dst),):
                self._fail(f"the shape operand must be tensor<{len(dst)}xi64>")
            return
        if dst.count(None) > 1:
            self._fail(f"at most one dynamic result dimension without a shape operand: tensor<{_dims(dst)}>")
        if None not in src and None not in dst and math.prod(src) != math.prod(dst):
            self._fail(f"element count differs: tensor<{_dims(src)}> -> tensor<{_dims(dst)}>")
        if (None in src) != (None in dst) and 0 not in src and 0 not in dst:
            self._fail(f"a dynamic dimension cannot appear or vanish: tensor<{_dims(src)}> -> tensor<{_dims(dst)}>")
        if src[:1] == dst[:1] == (None,) and None not in src[1:] + dst[1:] and math.prod(src[1:]) != math.prod(dst[1:]):
            self._fail(f"element count differs: tensor<{_dims(src)}> -> tensor<{_dims(dst)}>")  # rows keep their size



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


# ----------------------------------------------------------------- primitive ops
#
# What a graph frontend (torch.export, ONNX) imports before `optimize` raises the subgraphs
# it knows into the ops above: numpy semantics on tensors of any rank and element type
# (f32, f16, f64, i64, i32, i8, u8, i1), with numpy / ONNX broadcasting. Dimensions the
# source leaves symbolic are `?`; where an op's result shape depends on data (a reshape to
# a computed shape, a range), the data is an operand, as in ONNX.


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


class _TypedOp(IRDLOperation, _ShapeChecks):
    """Ops printed `%r = llm.op %a, %b props : (type(a), type(b)) -> type(r)`, or `: type` when
    every operand and the result have one type."""

    def print(self, printer: Printer) -> None:
        printer.print_string(" ")
        printer.print_list(self.operands, printer.print_operand)
        self._print_props(printer)
        printer.print_op_attributes(self.attributes)
        printer.print_string(" : ")
        types = [v.type for v in self.operands]
        if types and all(t == self.results[0].type for t in types):
            printer.print_attribute(types[0])
            return
        printer.print_string("(")
        printer.print_list(types, printer.print_attribute)
        printer.print_string(") -> ")
        printer.print_attribute(self.results[0].type)

    def _print_props(self, printer: Printer) -> None:
        pass

    @classmethod
    def parse(cls, parser):  # noqa: ANN001, ANN206
        operands = parser.parse_comma_separated_list(parser.Delimiter.NONE, parser.parse_unresolved_operand)
        properties = cls._parse_props(parser)
        attributes = parser.parse_optional_attr_dict()
        parser.parse_punctuation(":")
        if parser.parse_optional_punctuation("(") is not None:
            types = parser.parse_comma_separated_list(parser.Delimiter.NONE, parser.parse_type) \
                if parser.parse_optional_punctuation(")") is None else []
            if types:
                parser.parse_punctuation(")")
            parser.parse_punctuation("->")
            result = parser.parse_type()
        else:
            result = parser.parse_type()
            types = [result] * len(operands)
        values = parser.resolve_operands(operands, types, parser.pos)
        return cls.create(operands=values, result_types=[result], properties=properties, attributes=attributes)

    @classmethod
    def _parse_props(cls, parser) -> dict[str, Attribute]:  # noqa: ANN001
        return {}


class _BinaryOp(_TypedOp):
    """Elementwise ops of two tensors with numpy broadcasting; the result has `lhs`'s element type
    (i1 for comparisons and logic)."""

    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    BOOLEAN: ClassVar[bool] = False  # the result is i1

    def __init__(self, lhs: SSAValue, rhs: SSAValue, result_type: Attribute | None = None):
        if result_type is None:
            element = i1 if self.BOOLEAN else element_type(lhs)
            result_type = tensor(*broadcast(shape_of(lhs), shape_of(rhs)), element_type=element)
        super().__init__(operands=[lhs, rhs], result_types=[result_type])

    def verify_(self) -> None:
        shape = broadcast(shape_of(self.lhs), shape_of(self.rhs))
        result = shape_of(self.result)
        if len(result) != len(shape) or any(a is not None and b is not None and a != b for a, b in zip(shape, result)):
            self._fail(f"result tensor<{_dims(result)}> is not the broadcast shape <{_dims(shape)}>")
        if element_type(self.lhs) != element_type(self.rhs):
            self._fail(f"operand element types differ: {element_type(self.lhs)} vs {element_type(self.rhs)}")
        expected = i1 if self.BOOLEAN else element_type(self.lhs)
        if element_type(self.result) != expected:
            self._fail(f"result element type must be {expected}")


class _PredicateOp(_BinaryOp):
    """Comparisons and logic: binary ops with an i1 result."""

    BOOLEAN: ClassVar[bool] = True


class _LogicOp(_PredicateOp):
    """Logic: binary ops of i1 tensors."""

    def verify_(self) -> None:
        super().verify_()
        if element_type(self.lhs) != i1:
            self._fail(f"operands must be i1, not {element_type(self.lhs)}")


def _named_op(base: type[IRDLOperation], op_name: str, doc: str) -> type[IRDLOperation]:
    """A subclass of `base` named after `op_name` (`llm.less_equal`: `LessEqualOp`) with `doc`;
    its numpy meaning is in `llmc.ir.interpreter`."""
    cls = type(op_name.split(".")[1].title().replace("_", "") + "Op", (base,),
               {"name": op_name, "__doc__": doc, "__module__": __name__})
    return irdl_op_definition(cls)


def _binary(op_name: str, doc: str, boolean: bool = False) -> type[IRDLOperation]:
    base = (_LogicOp if op_name in ("llm.and", "llm.or", "llm.xor") else _PredicateOp) if boolean else _BinaryOp
    return _named_op(base, op_name, doc)


SubOp = _binary("llm.sub", """Elementwise difference, broadcast: `%d = llm.sub %a, %b : (tensor<?x1xf32>, tensor<f32>) -> tensor<?x1xf32>`.""")
DivOp = _binary("llm.div", """Elementwise quotient (integers truncate toward zero): `%q = llm.div %a, %b : tensor<?x8xf32>`.""")
PowOp = _binary("llm.pow", """Elementwise power: `%sq = llm.pow %x, %two : (tensor<1x?x32xf32>, tensor<f32>) -> tensor<1x?x32xf32>`.""")
MaximumOp = _binary("llm.maximum", """Elementwise maximum: `%m = llm.maximum %a, %b : tensor<4xi64>`.""")
MinimumOp = _binary("llm.minimum", """Elementwise minimum: `%m = llm.minimum %a, %b : tensor<4xi64>`.""")
ModOp = _binary("llm.mod", """Elementwise remainder with the sign of the divisor (numpy's, ONNX `fmod=0`):
`%r = llm.mod %a, %b : tensor<4xi64>`.""")
EqualOp = _binary("llm.equal", """Elementwise `a == b` as i1: `%e = llm.equal %a, %b : (tensor<?xi64>, tensor<i64>) -> tensor<?xi1>`.""", True)
LessOp = _binary("llm.less", """Elementwise `a < b` as i1: `%l = llm.less %a, %b : (tensor<?xi64>, tensor<?x1xi64>) -> tensor<?x?xi1>`.""", True)
LessEqualOp = _binary("llm.less_equal", """Elementwise `a <= b` as i1: `%l = llm.less_equal %a, %b : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xi1>`.""", True)
GreaterOp = _binary("llm.greater", """Elementwise `a > b` as i1: `%g = llm.greater %a, %b : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xi1>`.""", True)
GreaterEqualOp = _binary("llm.greater_equal", """Elementwise `a >= b` as i1: `%g = llm.greater_equal %a, %b : (tensor<3xf32>, tensor<3xf32>) -> tensor<3xi1>`.""", True)
AndOp = _binary("llm.and", """Elementwise logical and of i1 tensors: `%m = llm.and %a, %b : tensor<1x1x?x?xi1>`.""", True)
OrOp = _binary("llm.or", """Elementwise logical or of i1 tensors: `%m = llm.or %a, %b : tensor<3xi1>`.""", True)
XorOp = _binary("llm.xor", """Elementwise logical exclusive or of i1 tensors: `%m = llm.xor %a, %b : tensor<3xi1>`.""", True)


class _ConvertOp(_TypedOp):
    """Elementwise ops of one tensor whose result may have another element type."""

    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, result_type: Attribute):
        super().__init__(operands=[x], result_types=[result_type])

    def verify_(self) -> None:
        a, b = shape_of(self.input), shape_of(self.result)
        if len(a) != len(b) or any(x is not None and y is not None and x != y for x, y in zip(a, b)):
            self._fail(f"the result has the input's shape, tensor<{_dims(a)}>, not tensor<{_dims(b)}>")


@irdl_op_definition
class CastOp(_ConvertOp):
    """Elementwise conversion to the result's element type (floats to integers truncate; to i1: `x != 0`).

    ```mlir
    %f = llm.cast %ids : (tensor<1x?xi64>) -> tensor<1x?xf32>
    ```
    """

    name = "llm.cast"


@irdl_op_definition
class IsNanOp(_ConvertOp):
    """Elementwise `isnan` as i1: `%n = llm.isnan %x : (tensor<1x4x?x?xf32>) -> tensor<1x4x?x?xi1>`."""

    name = "llm.isnan"


def _unary(op_name: str, doc: str) -> type[IRDLOperation]:
    return _named_op(_UnaryOp, op_name, doc)


NegOp = _unary("llm.neg", """Elementwise negation: `%n = llm.neg %x : tensor<1x4x?x4xf32>`.""")
AbsOp = _unary("llm.abs", """Elementwise absolute value: `%a = llm.abs %x : tensor<3xf32>`.""")
SqrtOp = _unary("llm.sqrt", """Elementwise square root: `%s = llm.sqrt %x : tensor<1x?x1xf32>`.""")
RsqrtOp = _unary("llm.rsqrt", """Elementwise `1/sqrt(x)`: `%r = llm.rsqrt %x : tensor<1x?x1xf32>`.""")
ReciprocalOp = _unary("llm.reciprocal", """Elementwise `1/x`: `%r = llm.reciprocal %x : tensor<1x?x1xf32>`.""")
ExpOp = _unary("llm.exp", """Elementwise `e^x`: `%e = llm.exp %x : tensor<3xf32>`.""")
LogOp = _unary("llm.log", """Elementwise natural logarithm: `%l = llm.log %x : tensor<3xf32>`.""")
TanhOp = _unary("llm.tanh", """Elementwise hyperbolic tangent: `%t = llm.tanh %x : tensor<?x8xf32>`.""")
CosOp = _unary("llm.cos", """Elementwise cosine: `%c = llm.cos %angles : tensor<1x?x64xf32>`.""")
SinOp = _unary("llm.sin", """Elementwise sine: `%s = llm.sin %angles : tensor<1x?x64xf32>`.""")
ErfOp = _unary("llm.erf", """Elementwise error function (exact GELU uses it): `%e = llm.erf %x : tensor<?x8xf32>`.""")
SigmoidOp = _unary("llm.sigmoid", """Elementwise `1/(1 + e^-x)`: `%s = llm.sigmoid %x : tensor<1x?x48xf32>`.""")
ReluOp = _unary("llm.relu", """Elementwise `max(x, 0)`: `%r = llm.relu %x : tensor<3xf32>`.""")
FloorOp = _unary("llm.floor", """Elementwise floor: `%f = llm.floor %x : tensor<3xf32>`.""")
CeilOp = _unary("llm.ceil", """Elementwise ceiling: `%c = llm.ceil %x : tensor<3xf32>`.""")
class _NotOp(_UnaryOp):
    def verify_(self) -> None:
        if element_type(self.input) != i1:
            self._fail(f"the operand must be i1, not {element_type(self.input)}")


NotOp = _named_op(_NotOp, "llm.not", """Elementwise logical not of an i1 tensor: `%n = llm.not %m : tensor<1x?xi1>`.""")


@irdl_op_definition
class ConstantOp(IRDLOperation, _ShapeChecks):
    """A small tensor given in the IR (shapes, indices, scalars; weights stay in the weight store).

    ```mlir
    %two = llm.constant dense<2.000000e+00> : tensor<f32>
    %perm = llm.constant dense<[1, -1, 4, 8]> : tensor<4xi64>
    ```
    """

    name = "llm.constant"
    value = prop_def(DenseIntOrFPElementsAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    LIMIT: ClassVar[int] = 4096  # the most elements a constant may have; frontends keep bigger ones as weights

    def __init__(self, value: DenseIntOrFPElementsAttr):
        super().__init__(properties={"value": value}, result_types=[value.type])

    def print(self, printer: Printer) -> None:
        printer.print_string(" ")
        values = self.value.get_values()
        if isinstance(self.value.get_element_type(), Float32Type) and not all(math.isfinite(v) for v in values):
            # xDSL parses ±inf and NaN back wrongly from `dense<[0xff800000, …]>`; raw bytes round-trip
            raw = struct.pack(f"<{len(values)}f", *values)
            printer.print_string(f'dense<"0x{raw.hex().upper()}"> : ')
            printer.print_attribute(self.value.type)
        else:
            printer.print_attribute(self.value)
        printer.print_op_attributes(self.attributes)

    @classmethod
    def parse(cls, parser):  # noqa: ANN001, ANN206
        value = parser.parse_attribute()
        attributes = parser.parse_optional_attr_dict()
        if not isinstance(value, DenseIntOrFPElementsAttr):
            parser.raise_error("llm.constant takes a dense<...> : tensor<...> value")
        return cls.create(properties={"value": value}, result_types=[value.type], attributes=attributes)

    def verify_(self) -> None:
        if self.value.type != self.result.type:
            self._fail("the result type is the value's type")


def _axes_prop(axes: Sequence[int]) -> DenseArrayBase:
    return DenseArrayBase.from_list(i64, list(axes))


class _AxesOp(_TypedOp):
    """Ops with an `axes [..]` list (printed after the operands)."""

    axes = prop_def(DenseArrayBase)

    @property
    def axis_list(self) -> tuple[int, ...]:
        return tuple(int(a) for a in self.axes.get_values())

    def _print_props(self, printer: Printer) -> None:
        printer.print_string(" axes [" + ", ".join(str(a) for a in self.axis_list) + "]")
        if self.properties.get("keepdims") is not None:
            printer.print_string(" keepdims")

    @classmethod
    def _parse_props(cls, parser) -> dict[str, Attribute]:  # noqa: ANN001
        parser.parse_keyword("axes")
        axes = parser.parse_comma_separated_list(parser.Delimiter.SQUARE, lambda: parser.parse_integer(False))
        props: dict[str, Attribute] = {"axes": _axes_prop(axes)}
        if parser.parse_optional_keyword("keepdims") is not None:
            props["keepdims"] = UnitAttr()
        return props


class _ReduceOp(_AxesOp):
    """Reductions over `axes` (sorted, non-negative), keeping them as 1s with `keepdims`."""

    input = operand_def(TensorType)
    keepdims = opt_prop_def(UnitAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, axes: Sequence[int], keepdims: bool, result_type: Attribute | None = None):
        shape = shape_of(x)
        axes = sorted({_normalized_axis(a, len(shape)) for a in axes})
        if result_type is None:
            kept = [1 if i in axes else d for i, d in enumerate(shape)] if keepdims else \
                [d for i, d in enumerate(shape) if i not in axes]
            result_type = tensor(*kept, element_type=element_type(x))
        props: dict[str, Attribute] = {"axes": _axes_prop(axes)}
        if keepdims:
            props["keepdims"] = UnitAttr()
        super().__init__(operands=[x], properties=props, result_types=[result_type])

    def verify_(self) -> None:
        rank = len(shape_of(self.input))
        axes = self.axis_list
        if list(axes) != sorted(set(axes)) or any(not 0 <= a < max(rank, 1) for a in axes):
            self._fail(f"axes {list(axes)} must be sorted, distinct and inside rank {rank}")
        expected = rank if self.keepdims is not None else rank - len(axes)
        if len(shape_of(self.result)) != max(expected, 0):
            self._fail(f"the result must have rank {expected}")


def _reduce(op_name: str, doc: str) -> type[IRDLOperation]:
    return _named_op(_ReduceOp, op_name, doc)


ReduceSumOp = _reduce("llm.reduce_sum", """Sum over `axes`: `%s = llm.reduce_sum %x axes [2] keepdims : (tensor<1x?x32xf32>) -> tensor<1x?x1xf32>`.""")
ReduceMeanOp = _reduce("llm.reduce_mean", """Mean over `axes`: `%m = llm.reduce_mean %sq axes [2] keepdims : (tensor<1x?x32xf32>) -> tensor<1x?x1xf32>`.""")
ReduceMaxOp = _reduce("llm.reduce_max", """Maximum over `axes`: `%m = llm.reduce_max %x axes [0, 1] : (tensor<3x4xf32>) -> tensor<f32>`.""")
ReduceMinOp = _reduce("llm.reduce_min", """Minimum over `axes`: `%m = llm.reduce_min %x axes [1] : (tensor<3x4xf32>) -> tensor<3xf32>`.""")
ReduceProdOp = _reduce("llm.reduce_prod", """Product over `axes`: `%p = llm.reduce_prod %x axes [1] : (tensor<3x4xf32>) -> tensor<3xf32>`.""")


class _AxisOp(_TypedOp):
    """Ops with one `axis N` (non-negative)."""

    axis = prop_def(IntegerAttr[I64])

    @property
    def axis_index(self) -> int:
        return self.axis.value.data

    def _print_props(self, printer: Printer) -> None:
        printer.print_string(f" axis {self.axis_index}")
        for flag in self.FLAGS:
            if self.properties.get(flag) is not None:
                printer.print_string(f" {flag}")

    FLAGS: ClassVar[tuple[str, ...]] = ()

    @classmethod
    def _parse_props(cls, parser) -> dict[str, Attribute]:  # noqa: ANN001
        parser.parse_keyword("axis")
        props: dict[str, Attribute] = {"axis": IntegerAttr(parser.parse_integer(False), i64)}
        for flag in cls.FLAGS:
            if parser.parse_optional_keyword(flag) is not None:
                props[flag] = UnitAttr()
        return props

    def _check_axis(self, rank: int) -> None:
        if not 0 <= self.axis_index < max(rank, 1):
            self._fail(f"axis {self.axis_index} is outside rank {rank}")


@irdl_op_definition
class SoftmaxOp(_AxisOp):
    """`exp(x - max) / sum(exp(x - max))` along `axis`.

    ```mlir
    %p = llm.softmax %scores axis 3 : tensor<1x4x?x?xf32>
    ```
    """

    name = "llm.softmax"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, axis: int):
        super().__init__(operands=[x], properties={"axis": IntegerAttr(_normalized_axis(axis, len(shape_of(x))), i64)},
                         result_types=[x.type])

    def verify_(self) -> None:
        self._check_axis(len(shape_of(self.input)))


@irdl_op_definition
class CumsumOp(_AxisOp):
    """Running sum along `axis`; `exclusive` leaves out each element itself, `reverse` runs from the end.

    ```mlir
    %c = llm.cumsum %x axis 1 : tensor<1x?xi64>
    ```
    """

    name = "llm.cumsum"
    input = operand_def(TensorType)
    exclusive = opt_prop_def(UnitAttr)
    reverse = opt_prop_def(UnitAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())
    FLAGS: ClassVar[tuple[str, ...]] = ("exclusive", "reverse")

    def __init__(self, x: SSAValue, axis: int, exclusive: bool = False, reverse: bool = False):
        props: dict[str, Attribute] = {"axis": IntegerAttr(_normalized_axis(axis, len(shape_of(x))), i64)}
        props |= {k: UnitAttr() for k, on in (("exclusive", exclusive), ("reverse", reverse)) if on}
        super().__init__(operands=[x], properties=props, result_types=[x.type])

    def verify_(self) -> None:
        self._check_axis(len(shape_of(self.input)))


@irdl_op_definition
class ConcatOp(_AxisOp):
    """Tensors joined along `axis`.

    ```mlir
    %c = llm.concat %neg, %lo axis 3 : (tensor<1x4x?x4xf32>, tensor<1x4x?x4xf32>) -> tensor<1x4x?x8xf32>
    ```
    """

    name = "llm.concat"
    inputs = var_operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, inputs: Sequence[SSAValue], axis: int, result_type: Attribute | None = None):
        shape = list(shape_of(inputs[0]))
        axis = _normalized_axis(axis, len(shape))
        if result_type is None:
            sizes = [shape_of(v)[axis] for v in inputs]
            shape[axis] = None if None in sizes else sum(sizes)  # type: ignore[arg-type]
            result_type = tensor(*shape, element_type=element_type(inputs[0]))
        super().__init__(operands=[list(inputs)], properties={"axis": IntegerAttr(axis, i64)},
                         result_types=[result_type])

    def verify_(self) -> None:
        if not self.inputs:
            self._fail("needs at least one input")
        result = shape_of(self.result)
        rank, axis = len(result), self.axis_index
        self._check_axis(rank)
        for v in self.inputs:
            shape = shape_of(v)
            if len(shape) != rank or element_type(v) != element_type(self.result):
                self._fail("inputs must have the result's rank and element type")
            if any(a is not None and b is not None and a != b for i, (a, b) in enumerate(zip(shape, result)) if i != axis):
                self._fail(f"input tensor<{_dims(shape)}> differs from the result tensor<{_dims(result)}> off axis {axis}")
        sizes = [shape_of(v)[axis] for v in self.inputs]
        if None not in sizes and result[axis] is not None and sum(sizes) != result[axis]:  # type: ignore[arg-type]
            self._fail(f"the inputs' sizes along axis {axis} sum to {sum(sizes)}, not {result[axis]}")  # type: ignore[arg-type]


@irdl_op_definition
class GatherOp(_AxisOp):
    """Slices of `input` along `axis` at `indices` (negative indices count from the end):
    `result[i..., j..., k...] = input[i..., indices[j...], k...]`.

    ```mlir
    %rows = llm.gather %table, %ids axis 0 : (tensor<64x32xf32>, tensor<1x?xi64>) -> tensor<1x?x32xf32>
    ```
    """

    name = "llm.gather"
    input = operand_def(TensorType)
    indices = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, indices: SSAValue, axis: int, result_type: Attribute | None = None):
        shape = shape_of(x)
        axis = _normalized_axis(axis, len(shape))
        if result_type is None:
            result_type = tensor(*shape[:axis], *shape_of(indices), *shape[axis + 1:], element_type=element_type(x))
        super().__init__(operands=[x, indices], properties={"axis": IntegerAttr(axis, i64)},
                         result_types=[result_type])

    def verify_(self) -> None:
        rank = len(shape_of(self.input))
        self._check_axis(rank)
        if len(shape_of(self.result)) != rank - 1 + len(shape_of(self.indices)):
            self._fail("the result's rank is input rank - 1 + indices rank")
        if not isinstance(element_type(self.indices), IntegerType) or element_type(self.indices) == i1:
            self._fail(f"indices must be integers, not {element_type(self.indices)}")
        if element_type(self.result) != element_type(self.input):
            self._fail("the result has the input's element type")


@irdl_op_definition
class GatherNdOp(_TypedOp):
    """ONNX GatherND: `indices`' last dimension indexes the leading dimensions of `input`,
    after `batch_dims` shared leading dimensions.

    ```mlir
    %g = llm.gather_nd %x, %idx batch_dims 0 : (tensor<1x?xi64>, tensor<1x1x?x1x2xi64>) -> tensor<1x1x?x1xi64>
    ```
    """

    name = "llm.gather_nd"
    input = operand_def(TensorType)
    indices = operand_def(TensorType)
    batch_dims = prop_def(IntegerAttr[I64])
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, indices: SSAValue, batch_dims: int, result_type: Attribute):
        super().__init__(operands=[x, indices], properties={"batch_dims": IntegerAttr(batch_dims, i64)},
                         result_types=[result_type])

    def verify_(self) -> None:
        x, idx, b = shape_of(self.input), shape_of(self.indices), self.batch_dims.value.data
        if not idx or not isinstance(element_type(self.indices), IntegerType):
            self._fail("indices must be an integer tensor of rank >= 1")
        depth = idx[-1]
        if not 0 <= b < len(idx) or (depth is not None and b + depth > len(x)):
            self._fail(f"indices of depth {depth} after {b} batch dimensions do not fit tensor<{_dims(x)}>")
        if depth is not None and len(shape_of(self.result)) != len(idx) - 1 + len(x) - b - depth:
            self._fail("the result's rank is indices' rank - 1 + the input's rank - batch_dims - depth")

    def _print_props(self, printer: Printer) -> None:
        printer.print_string(f" batch_dims {self.batch_dims.value.data}")

    @classmethod
    def _parse_props(cls, parser) -> dict[str, Attribute]:  # noqa: ANN001
        parser.parse_keyword("batch_dims")
        return {"batch_dims": IntegerAttr(parser.parse_integer(False), i64)}


@irdl_op_definition
class TransposeOp(_AxesOp):
    """Dimensions permuted: result dimension `i` is input dimension `axes[i]`.

    ```mlir
    %t = llm.transpose %q axes [0, 2, 1, 3] : (tensor<1x?x4x8xf32>) -> tensor<1x4x?x8xf32>
    ```
    """

    name = "llm.transpose"
    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, perm: Sequence[int]):
        shape = shape_of(x)
        super().__init__(operands=[x], properties={"axes": _axes_prop(perm)},
                         result_types=[tensor(*(shape[p] for p in perm), element_type=element_type(x))])

    def verify_(self) -> None:
        shape, perm = shape_of(self.input), self.axis_list
        if sorted(perm) != list(range(len(shape))):
            self._fail(f"axes {list(perm)} is not a permutation of rank {len(shape)}")
        if shape_of(self.result) != tuple(shape[p] for p in perm):
            self._fail("the result shape is the permuted input shape")


class _ReshapeLikeOp(_AxesOp):
    """Unsqueeze and squeeze: the same elements with size-1 dimensions added or removed at `axes`."""

    input = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, axes: Sequence[int]):
        super().__init__(operands=[x], properties={"axes": _axes_prop(sorted(axes))},
                         result_types=[tensor(*self.reshaped(shape_of(x), sorted(axes)), element_type=element_type(x))])

    def verify_(self) -> None:
        try:
            expected = self.reshaped(shape_of(self.input), self.axis_list)
        except (ValueError, IndexError) as e:
            self._fail(str(e))
        if shape_of(self.result) != expected:
            self._fail(f"the result must be tensor<{_dims(expected)}>")


@irdl_op_definition
class UnsqueezeOp(_ReshapeLikeOp):
    """Size-1 dimensions inserted so that they are at `axes` of the result.

    ```mlir
    %u = llm.unsqueeze %cos axes [1] : (tensor<1x?x8xf32>) -> tensor<1x1x?x8xf32>
    ```
    """

    name = "llm.unsqueeze"

    @staticmethod
    def reshaped(shape: Sequence[int | None], axes: Sequence[int]) -> tuple[int | None, ...]:
        out = list(shape)
        rank = len(shape) + len(axes)
        for a in sorted(a % rank for a in axes):
            out.insert(a, 1)
        return tuple(out)


@irdl_op_definition
class SqueezeOp(_ReshapeLikeOp):
    """Size-1 dimensions at `axes` removed.

    ```mlir
    %s = llm.squeeze %x axes [0] : (tensor<1xi64>) -> tensor<i64>
    ```
    """

    name = "llm.squeeze"

    @staticmethod
    def reshaped(shape: Sequence[int | None], axes: Sequence[int]) -> tuple[int | None, ...]:
        axes = [a % max(len(shape), 1) for a in axes]
        if any(shape[a] not in (1, None) for a in axes):
            raise ValueError(f"squeezed axes {axes} must have size 1 in tensor<{_dims(shape)}>")
        return tuple(d for i, d in enumerate(shape) if i not in axes)


@irdl_op_definition
class SliceOp(_TypedOp):
    """ONNX Slice: along each of `axes`, elements `starts:ends:steps` (negative values count from
    the end; bounds are clamped). The four lists are 1-D i64 operands, usually constants.

    ```mlir
    %lo = llm.slice %q, %c0, %c4, %c3, %c1 : (tensor<1x4x?x8xf32>, tensor<1xi64>, tensor<1xi64>, tensor<1xi64>,
            tensor<1xi64>) -> tensor<1x4x?x4xf32>
    ```
    """

    name = "llm.slice"
    input = operand_def(TensorType)
    starts = operand_def(TensorType)
    ends = operand_def(TensorType)
    slice_axes = operand_def(TensorType)
    steps = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, starts: SSAValue, ends: SSAValue, axes: SSAValue, steps: SSAValue,
                 result_type: Attribute):
        super().__init__(operands=[x, starts, ends, axes, steps], result_types=[result_type])

    def verify_(self) -> None:
        if len(shape_of(self.result)) != len(shape_of(self.input)) or element_type(self.result) != element_type(
                self.input):
            self._fail("the result has the input's rank and element type")
        counts = set()
        for what in ("starts", "ends", "slice_axes", "steps"):
            value = getattr(self, what)
            if len(shape_of(value)) != 1 or element_type(value) not in (i64, i32):
                self._fail(f"{what} must be a 1-D i64 or i32 tensor, got {value.type}")
            counts.add(shape_of(value)[0])
        if len(counts - {None}) > 1:
            self._fail("starts, ends, axes and steps must have one length")


@irdl_op_definition
class ShapeOfOp(_ConvertOp):
    """The dimensions of a tensor as a 1-D i64 tensor (ONNX Shape).

    ```mlir
    %s = llm.shape_of %ids : (tensor<1x?xi64>) -> tensor<2xi64>
    ```
    """

    name = "llm.shape_of"

    def verify_(self) -> None:
        if shape_of(self.result) != (len(shape_of(self.input)),) or element_type(self.result) != i64:
            self._fail(f"the result must be tensor<{len(shape_of(self.input))}xi64>")


@irdl_op_definition
class ExpandOp(_TypedOp):
    """`input` broadcast with a tensor of the 1-D i64 `shape` (ONNX Expand: both ways).

    ```mlir
    %e = llm.expand %k, %shape : (tensor<1x2x1x?x8xf32>, tensor<5xi64>) -> tensor<1x2x2x?x8xf32>
    ```
    """

    name = "llm.expand"
    input = operand_def(TensorType)
    shape = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, shape: SSAValue, result_type: Attribute):
        super().__init__(operands=[x, shape], result_types=[result_type])

    def verify_(self) -> None:
        (n,) = self._rank("shape", self.shape, 1)
        self._element("shape", self.shape, i64)
        if n is not None and len(shape_of(self.result)) != max(n, len(shape_of(self.input))):
            self._fail("the result's rank is the larger of the input's and the shape's length")
        if element_type(self.input) != element_type(self.result):
            self._fail("the result has the input's element type")


@irdl_op_definition
class FillOp(_TypedOp):
    """A tensor of the 1-D i64 `shape`, every element the scalar `value` (ONNX ConstantOfShape).

    ```mlir
    %ones = llm.fill %shape, %one : (tensor<2xi64>, tensor<i64>) -> tensor<1x?xi64>
    ```
    """

    name = "llm.fill"
    shape = operand_def(TensorType)
    value = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, shape: SSAValue, value: SSAValue, result_type: Attribute):
        super().__init__(operands=[shape, value], result_types=[result_type])

    def verify_(self) -> None:
        (n,) = self._rank("shape", self.shape, 1)
        self._element("shape", self.shape, i64)
        if n is not None and len(shape_of(self.result)) != n:
            self._fail(f"the result's rank must be the shape's length {n}")
        if int(math.prod(d or 1 for d in shape_of(self.value))) != 1 or element_type(self.value) != element_type(
                self.result):
            self._fail("the value is one element of the result's element type")


@irdl_op_definition
class RangeOp(_TypedOp):
    """`start, start + delta, …` below `limit` (scalar operands), as ONNX Range and `torch.arange`.

    ```mlir
    %p = llm.range %c0, %t, %c1 : (tensor<i64>, tensor<i64>, tensor<i64>) -> tensor<?xi64>
    ```
    """

    name = "llm.range"
    start = operand_def(TensorType)
    limit = operand_def(TensorType)
    delta = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, start: SSAValue, limit: SSAValue, delta: SSAValue, result_type: Attribute):
        super().__init__(operands=[start, limit, delta], result_types=[result_type])

    def verify_(self) -> None:
        if len(shape_of(self.result)) != 1:
            self._fail("the result is 1-D")


@irdl_op_definition
class TriluOp(_TypedOp):
    """The upper (`upper`) or lower triangle of the last two dimensions, from diagonal `k` (a scalar).

    ```mlir
    %m = llm.trilu %x, %k upper : (tensor<?x?xf32>, tensor<i64>) -> tensor<?x?xf32>
    ```
    """

    name = "llm.trilu"
    input = operand_def(TensorType)
    k = operand_def(TensorType)
    upper = opt_prop_def(UnitAttr)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, x: SSAValue, k: SSAValue, upper: bool):
        super().__init__(operands=[x, k], properties={"upper": UnitAttr()} if upper else {}, result_types=[x.type])

    def _print_props(self, printer: Printer) -> None:
        if self.upper is not None:
            printer.print_string(" upper")

    @classmethod
    def _parse_props(cls, parser) -> dict[str, Attribute]:  # noqa: ANN001
        return {"upper": UnitAttr()} if parser.parse_optional_keyword("upper") is not None else {}

    def verify_(self) -> None:
        if len(shape_of(self.input)) < 2:
            self._fail("the input must have rank >= 2")


@irdl_op_definition
class WhereOp(_TypedOp):
    """`a` where `condition` (i1) holds, else `b`, broadcast.

    ```mlir
    %m = llm.where %causal, %zero, %ninf : (tensor<1x1x?x?xi1>, tensor<f32>, tensor<f32>) -> tensor<1x1x?x?xf32>
    ```
    """

    name = "llm.where"
    condition = operand_def(TensorType)
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, condition: SSAValue, a: SSAValue, b: SSAValue, result_type: Attribute | None = None):
        if result_type is None:
            shape = broadcast(shape_of(condition), shape_of(a), shape_of(b))
            result_type = tensor(*shape, element_type=element_type(a))
        super().__init__(operands=[condition, a, b], result_types=[result_type])

    def verify_(self) -> None:
        if element_type(self.condition) != i1:
            self._fail("the condition must be i1")
        if element_type(self.lhs) != element_type(self.rhs) or element_type(self.lhs) != element_type(self.result):
            self._fail("both branches and the result have one element type")
        broadcast(shape_of(self.condition), shape_of(self.lhs), shape_of(self.rhs))


@irdl_op_definition
class BatchMatmulOp(_TypedOp):
    """numpy's `matmul`: the last two dimensions multiply, the leading ones broadcast (1-D
    operands are vectors). Unlike `llm.matmul`, both operands are activations or constants.

    ```mlir
    %s = llm.batch_matmul %q, %kt : (tensor<1x4x?x8xf32>, tensor<1x4x8x?xf32>) -> tensor<1x4x?x?xf32>
    ```
    """

    name = "llm.batch_matmul"
    lhs = operand_def(TensorType)
    rhs = operand_def(TensorType)
    result = result_def(TensorType)
    traits = traits_def(Pure())

    def __init__(self, lhs: SSAValue, rhs: SSAValue, result_type: Attribute | None = None):
        if result_type is None:
            a, b = shape_of(lhs), shape_of(rhs)
            if len(a) < 2 or len(b) < 2:
                raise VerifyException("llm.batch_matmul: give 1-D operands their result type")
            result_type = tensor(*broadcast(a[:-2], b[:-2]), a[-2], b[-1], element_type=element_type(lhs))
        super().__init__(operands=[lhs, rhs], result_types=[result_type])

    def verify_(self) -> None:
        a, b = shape_of(self.lhs), shape_of(self.rhs)
        if not a or not b:
            self._fail("operands must have rank >= 1")
        k1, k2 = a[-1], (b[-2] if len(b) > 1 else b[0])
        if k1 is not None and k2 is not None and k1 != k2:
            self._fail(f"reduction dimension mismatch: {k1} vs {k2}")


@irdl_op_definition
class AddOp(_BinaryOp):
    """Elementwise sum, broadcast; e.g. a residual connection.

    ```mlir
    %x1 = llm.add %x0, %attn_out : tensor<?x576xf32>
    ```
    """

    name = "llm.add"


@irdl_op_definition
class MulOp(_BinaryOp):
    """Elementwise product, broadcast; e.g. the gate of a SwiGLU feed-forward.

    ```mlir
    %gu = llm.mul %g, %u : tensor<?x1536xf32>
    ```
    """

    name = "llm.mul"


LLM = Dialect(
    "llm",
    [
        WeightOp, EmbeddingOp, RMSNormOp, MatmulOp, LogitsOp, SwigluOp, ReshapeOp, RopeOp, AttentionOp,
        LastTokenOp, AddOp, MulOp, SiluOp, GeluOp, MoeOp,
        # primitive ops
        SubOp, DivOp, PowOp, MaximumOp, MinimumOp, ModOp, EqualOp, LessOp, LessEqualOp, GreaterOp, GreaterEqualOp,
        AndOp, OrOp, XorOp, CastOp, IsNanOp, NegOp, AbsOp, SqrtOp, RsqrtOp, ReciprocalOp, ExpOp, LogOp, TanhOp, CosOp,
        SinOp, ErfOp, SigmoidOp, ReluOp, FloorOp, CeilOp, NotOp, ConstantOp, ReduceSumOp, ReduceMeanOp, ReduceMaxOp,
        ReduceMinOp, ReduceProdOp, SoftmaxOp, CumsumOp, ConcatOp, GatherOp, GatherNdOp, TransposeOp, UnsqueezeOp,
        SqueezeOp, SliceOp, ShapeOfOp, ExpandOp, FillOp, RangeOp, TriluOp, WhereOp, BatchMatmulOp,
    ],
    [StorageAttr, ComputeAttr, KVCacheType, RopeAttr],
)
