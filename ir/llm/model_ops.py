"""The `llm` dialect's model-level ops: what a Llama-family decoder is made of (weights, embedding,
RMSNorm, the projections, SwiGLU, RoPE, attention, logits, mixtures of experts).

```mlir
%h = llm.rms_norm %x, %w eps 1.000000e-05 : tensor<?x576xf32>, tensor<576xf32>
%q = llm.matmul %h, %wq : (tensor<?x576xf32>, tensor<576x576xf32>) -> tensor<?x576xf32>
```
"""


from __future__ import annotations

import math
from collections.abc import Sequence
from typing import ClassVar

from xdsl.dialects.builtin import (
    I64,
    Float32Type,
    FloatAttr,
    IntegerAttr,
    SymbolRefAttr,
    TensorType,
    UnitAttr,
    i32,
    i64,
)
from xdsl.ir import (
    Attribute,
    SSAValue,
)
from xdsl.irdl import (
    AnyAttr,
    AttrSizedOperandSegments,
    IRDLOperation,
    VarConstraint,
    irdl_op_definition,
    operand_def,
    opt_operand_def,
    opt_prop_def,
    prop_def,
    result_def,
    traits_def,
)
from xdsl.traits import Pure

from llmc.ir.activations import ACTIVATIONS, Activation
from llmc.ir.formats import FORMATS, Storage
from llmc.ir.llm.attributes import (
    SCORING,
    ActivationAttr,
    Compute,
    ComputeAttr,
    KVCacheType,
    RopeAttr,
    StorageAttr,
    _dims,
    _ShapeChecks,
    element_type,
    f32,
    optional_value,
    shape_of,
    ssa_name,
    tensor,
)

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
        storage = FORMATS[self.storage.data]  # (a quantized vector is valid: `quantize` makes it f32)
        if not storage.fits(shape[-1]):
            self._fail(f"weight @{self.sym_name}: rows of {shape[-1]} are not whole {storage.storage} blocks")


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
    """The gated feed-forward input, fused by `group`: `silu(x · w_gateᵀ) * (x · w_upᵀ)`; with an
    `activation`, that one instead of silu (`gelu_tanh`: Gemma's GeGLU).

    ```mlir
    %h = llm.swiglu %x, %wg, %wu compute a8 : (tensor<?x576xf32>, tensor<1536x576xf32>, tensor<1536x576xf32>) -> tensor<?x1536xf32>
    %h = llm.swiglu %x, %wg, %wu activation gelu_tanh : (tensor<?x2304xf32>, tensor<9216x2304xf32>, tensor<9216x2304xf32>) -> tensor<?x9216xf32>
    ```
    """

    name = "llm.swiglu"
    input = operand_def(TensorType)
    gate = operand_def(TensorType)
    up = operand_def(TensorType)
    norm = opt_operand_def(TensorType)
    eps = opt_prop_def(FloatAttr[Float32Type])
    activation = opt_prop_def(ActivationAttr)  # none: silu
    result = result_def(TensorType)
    traits = traits_def(Pure())
    assembly_format = (
        "$input `,` $gate `,` $up (`norm` $norm^ `eps` $eps)? (`compute` $compute^)? (`activation` $activation^)? "
        "attr-dict `:` "
        "`(` type($input) `,` type($gate) `,` type($up) (`norm` type($norm)^)? `)` `->` type($result)"
    )

    def __init__(self, x: SSAValue, gate: SSAValue, up: SSAValue, *, norm: SSAValue | None = None,
                 eps: float | None = None, compute: Compute | None = None,
                 activation: Activation = Activation.SILU):
        props = _norm_props(eps if norm is not None else None, compute)
        if activation is not Activation.SILU:
            props["activation"] = ActivationAttr(activation)
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


class _ActivationOp(_UnaryOp):
    """A gate activation, elementwise: one op per row of `llmc.ir.activations.ACTIVATIONS`."""

    ACTIVATION: ClassVar[Activation]


def _activation_op(activation: Activation) -> type[_ActivationOp]:
    """`llm.<activation>` (`llm.gelu_tanh`: `GeluTanhOp`), documented by its table row."""
    doc = f"""The {activation} activation, `{ACTIVATIONS[activation].formula}`; `group` fuses it into `llm.swiglu`.

    ```mlir
    %g = llm.{activation} %gate : tensor<?x1536xf32>
    ```
    """
    cls = type(activation.title().replace("_", "") + "Op", (_ActivationOp,),
               {"name": f"llm.{activation}", "ACTIVATION": activation, "__doc__": doc, "__module__": __name__,
                "__annotations__": {"ACTIVATION": ClassVar[Activation]}})
    return irdl_op_definition(cls)


ACTIVATION_OPS = {activation: _activation_op(activation) for activation in Activation}
SiluOp = ACTIVATION_OPS[Activation.SILU]

MODEL_OPS = (
    WeightOp, EmbeddingOp, RMSNormOp, MatmulOp, LogitsOp, SwigluOp, ReshapeOp, RopeOp, AttentionOp, LastTokenOp,
    *ACTIVATION_OPS.values(), MoeOp,
)
