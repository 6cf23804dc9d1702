"""The `tgt` dialect: kernels over explicit buffers, what a backend emits code for.

One `tgt` function is one entry point (`prefill`, `prefill_kv`, `decode`). Its ops are
kernels in destination-passing style: each reads buffers and writes a buffer; none
returns a value. Activations live in one arena per entry point (`tgt.alloc`, placed by
the `plan-memory` pass), weights are symbols into the weight store (`tgt.weight`), the
KV cache and the logits are arguments. The same kernels serve every backend: their
shapes are static except the row count `%n` (tokens in this call, ≤ `tgt.max_tokens`),
and the position of the first row is `%start`.

```mlir
func.func @decode(%tokens: memref<1xi32>, %n: index, %start: index,
                  %k_cache: memref<30x3x4096x64xf32>, %v_cache: memref<30x3x4096x64xf32>,
                  %logits: memref<1x49152xf32>)
    attributes {llm.stage = "decode", tgt.arena_bytes = 18432 : i64,
                tgt.kv_layout = "layer,kv_head,position,dim", tgt.max_tokens = 1 : i64} {
  %x = tgt.alloc offset 0 : memref<1x576xf32>
  %token_embd = tgt.weight @token_embd f32 : memref<49152x576xf32>
  tgt.embedding %tokens, %token_embd -> %x rows %n : memref<1xi32>, memref<49152x576xf32> -> memref<1x576xf32>
  %wq = tgt.weight @blk.0.attn_q f32 : memref<576x576xf32>
  tgt.matmul %x, %wq -> %q rows %n norm %g eps 1.000000e-05 : memref<1x576xf32>, memref<576x576xf32> norm memref<576xf32> -> memref<1x576xf32>
  ...
}
```
"""

from __future__ import annotations

from typing import ClassVar

from xdsl.dialects.builtin import (
    I64,
    Float32Type,
    FloatAttr,
    IndexType,
    IntegerAttr,
    MemRefType,
    SymbolRefAttr,
    UnitAttr,
    i64,
)
from xdsl.ir import Attribute, Dialect, SSAValue
from xdsl.irdl import (
    AttrSizedOperandSegments,
    BaseAttr,
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
from xdsl.utils.exceptions import VerifyException

from llmc.ir.llm import Storage, StorageAttr

f32 = Float32Type()
KV_LAYOUT = "layer,kv_head,position,dim"


def memref(*shape: int, element_type: Attribute = f32) -> MemRefType:
    return MemRefType(element_type, list(shape))


def dims(value: SSAValue) -> tuple[int, ...]:
    t = value.type
    if not isinstance(t, MemRefType):
        raise VerifyException(f"expected a memref, got {t}")
    return tuple(t.get_shape())


class _Kernel(IRDLOperation):
    """Verifier helpers for kernels: messages name the op and the dimensions."""

    def _fail(self, message: str) -> None:
        raise VerifyException(f"{self.name}: {message}")

    def _same(self, what: str, a: int, b: int) -> None:
        if a != b:
            self._fail(f"{what} mismatch: {a} vs {b}")

    def _row_width(self, what: str, value: SSAValue) -> int:
        shape = dims(value)
        if len(shape) < 2:
            self._fail(f"{what} must be [rows, ...], got {value.type}")
        width = 1
        for d in shape[1:]:
            width *= d
        return width


# ------------------------------------------------------------------ buffers


@irdl_op_definition
class AllocOp(IRDLOperation):
    """An activation buffer in the entry point's arena; `offset` (bytes) is set by `plan-memory`.

    ```mlir
    %x = tgt.alloc offset 2304 : memref<128x576xf32>
    ```
    """

    name = "tgt.alloc"
    offset = opt_prop_def(IntegerAttr[I64])
    result = result_def(MemRefType)
    traits = traits_def(Pure())
    assembly_format = "(`offset` $offset^)? attr-dict `:` type($result)"

    def __init__(self, shape: tuple[int, ...]):
        super().__init__(result_types=[memref(*shape)])

    @property
    def nbytes(self) -> int:
        size = 4
        for d in dims(self.result):
            size *= d
        return size


@irdl_op_definition
class ViewOp(IRDLOperation):
    """The same buffer in another shape (what `llm.reshape` becomes).

    ```mlir
    %q_heads = tgt.view %q : memref<128x576xf32> -> memref<128x9x64xf32>
    ```
    """

    name = "tgt.view"
    source = operand_def(MemRefType)
    result = result_def(MemRefType)
    traits = traits_def(Pure())
    assembly_format = "$source attr-dict `:` type($source) `->` type($result)"

    def __init__(self, source: SSAValue, shape: tuple[int, ...]):
        super().__init__(operands=[source], result_types=[memref(*shape)])

    def verify_(self) -> None:
        a, b = dims(self.source), dims(self.result)
        if a[0] != b[0] or _count(a) != _count(b):
            raise VerifyException(f"tgt.view: {self.source.type} and {self.result.type} differ in rows or elements")


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@irdl_op_definition
class WeightOp(IRDLOperation):
    """A weight of the artifact's weight file, by symbol, in the storage the kernels read.

    ```mlir
    %wq = tgt.weight @blk.0.attn_q f32 : memref<576x576xf32>
    ```
    """

    name = "tgt.weight"
    sym = prop_def(SymbolRefAttr)
    storage = prop_def(StorageAttr)
    result = result_def(MemRefType)
    traits = traits_def(Pure())
    assembly_format = "$sym $storage attr-dict `:` type($result)"

    def __init__(self, sym: str, storage: Storage, shape: tuple[int, ...]):
        super().__init__(
            properties={"sym": SymbolRefAttr(sym), "storage": StorageAttr(storage)}, result_types=[memref(*shape)]
        )
        self.result.name_hint = sym.replace(".", "_")

    @property
    def sym_name(self) -> str:
        return self.sym.root_reference.data


# ------------------------------------------------------------------ kernels


@irdl_op_definition
class EmbeddingOp(_Kernel):
    """`out[t] = table[tokens[t]]` for `t < n`.

    ```mlir
    tgt.embedding %tokens, %table -> %x rows %n : memref<128xi32>, memref<49152x576xf32> -> memref<128x576xf32>
    ```
    """

    name = "tgt.embedding"
    tokens = operand_def(MemRefType)
    table = operand_def(MemRefType)
    out = operand_def(MemRefType)
    rows = operand_def(IndexType)
    assembly_format = (
        "$tokens `,` $table `->` $out `rows` $rows attr-dict `:` type($tokens) `,` type($table) `->` type($out)"
    )

    def __init__(self, tokens: SSAValue, table: SSAValue, out: SSAValue, rows: SSAValue):
        super().__init__(operands=[tokens, table, out, rows])

    def verify_(self) -> None:
        self._same("embedding width (table vs out)", dims(self.table)[1], self._row_width("out", self.out))


@irdl_op_definition
class RMSNormOp(_Kernel):
    """`out[t] = x[t] / sqrt(mean(x[t]²) + eps) * w`.

    ```mlir
    tgt.rms_norm %x, %w -> %h rows %n eps 1.000000e-05 : memref<128x576xf32>, memref<576xf32> -> memref<128x576xf32>
    ```
    """

    name = "tgt.rms_norm"
    x = operand_def(MemRefType)
    weight = operand_def(MemRefType)
    out = operand_def(MemRefType)
    rows = operand_def(IndexType)
    eps = prop_def(FloatAttr[Float32Type])
    assembly_format = (
        "$x `,` $weight `->` $out `rows` $rows `eps` $eps attr-dict `:` type($x) `,` type($weight) `->` type($out)"
    )

    def __init__(self, x: SSAValue, weight: SSAValue, out: SSAValue, rows: SSAValue, eps: float):
        super().__init__(operands=[x, weight, out, rows], properties={"eps": FloatAttr(eps, f32)})

    def verify_(self) -> None:
        width = self._row_width("x", self.x)
        self._same("width (x vs weight)", width, dims(self.weight)[0])
        self._same("width (x vs out)", width, self._row_width("out", self.out))


@irdl_op_definition
class MatmulOp(_Kernel):
    """`out[t] (+)= norm?(x[t]) · wᵀ + bias`, for every row or only the last one.

    - `norm %g eps E`: RMS-normalize each row of `x` with weight `g` first (a fused RMSNorm);
    - `accumulate`: add into `out` instead of overwriting it (a fused residual add);
    - `last_row`: compute only row `n-1` of `x`, into row 0 of `out` (the LM head).

    ```mlir
    tgt.matmul %x, %wq -> %q rows %n norm %g eps 1.000000e-05 : memref<128x576xf32>, memref<576x576xf32> norm memref<576xf32> -> memref<128x576xf32>
    tgt.matmul %a, %wo -> %x rows %n accumulate : memref<128x576xf32>, memref<576x576xf32> -> memref<128x576xf32>
    ```
    """

    name = "tgt.matmul"
    x = operand_def(MemRefType)
    weight = operand_def(MemRefType)
    out = operand_def(MemRefType)
    rows = operand_def(IndexType)
    bias = opt_operand_def(MemRefType)
    norm = opt_operand_def(MemRefType)
    eps = opt_prop_def(FloatAttr[Float32Type])
    accumulate = opt_prop_def(UnitAttr)
    last_row = opt_prop_def(UnitAttr)
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    assembly_format = (
        "$x `,` $weight `->` $out `rows` $rows (`bias` $bias^)? (`norm` $norm^ `eps` $eps)? "
        "(`accumulate` $accumulate^)? (`last_row` $last_row^)? attr-dict `:` type($x) `,` type($weight) "
        "(`bias` type($bias)^)? (`norm` type($norm)^)? `->` type($out)"
    )

    def __init__(self, x: SSAValue, weight: SSAValue, out: SSAValue, rows: SSAValue, *,
                 bias: SSAValue | None = None, norm: SSAValue | None = None, eps: float | None = None,
                 accumulate: bool = False, last_row: bool = False):
        props: dict[str, Attribute] = {}
        if norm is not None:
            props["eps"] = FloatAttr(eps, f32)
        if accumulate:
            props["accumulate"] = UnitAttr()
        if last_row:
            props["last_row"] = UnitAttr()
        super().__init__(
            operands=[x, weight, out, rows, [bias] if bias else [], [norm] if norm else []], properties=props
        )

    def verify_(self) -> None:
        n, k = dims(self.weight)
        self._same("reduction dimension (x vs weight)", self._row_width("x", self.x), k)
        self._same("output width (weight vs out)", n, self._row_width("out", self.out))
        if self.bias is not None:
            self._same("output width (weight vs bias)", n, dims(self.bias)[0])
        if self.norm is not None:
            self._same("reduction dimension (x vs norm)", k, dims(self.norm)[0])
        if (self.norm is None) != (self.eps is None):
            self._fail("'norm' and 'eps' go together")


@irdl_op_definition
class SwigluOp(_Kernel):
    """The gated feed-forward input: `out[t] = silu(x[t]·w_gateᵀ) * (x[t]·w_upᵀ)`, norm optional.

    ```mlir
    tgt.swiglu %x, %wg, %wu -> %h rows %n norm %g eps 1.000000e-05 : memref<128x576xf32>, memref<1536x576xf32>, memref<1536x576xf32> norm memref<576xf32> -> memref<128x1536xf32>
    ```
    """

    name = "tgt.swiglu"
    x = operand_def(MemRefType)
    gate = operand_def(MemRefType)
    up = operand_def(MemRefType)
    out = operand_def(MemRefType)
    rows = operand_def(IndexType)
    norm = opt_operand_def(MemRefType)
    eps = opt_prop_def(FloatAttr[Float32Type])
    assembly_format = (
        "$x `,` $gate `,` $up `->` $out `rows` $rows (`norm` $norm^ `eps` $eps)? attr-dict `:` "
        "type($x) `,` type($gate) `,` type($up) (`norm` type($norm)^)? `->` type($out)"
    )

    def __init__(self, x: SSAValue, gate: SSAValue, up: SSAValue, out: SSAValue, rows: SSAValue, *,
                 norm: SSAValue | None = None, eps: float | None = None):
        props = {"eps": FloatAttr(eps, f32)} if norm is not None else {}
        super().__init__(operands=[x, gate, up, out, rows, [norm] if norm else []], properties=props)

    def verify_(self) -> None:
        n, k = dims(self.gate)
        self._same("gate vs up shape", (n, k), dims(self.up))
        self._same("reduction dimension (x vs gate)", self._row_width("x", self.x), k)
        self._same("output width (gate vs out)", n, self._row_width("out", self.out))


@irdl_op_definition
class RopeOp(_Kernel):
    """Rotate-half RoPE in place on `x [rows, heads, head_dim]`, row `t` at position `start + t`.

    ```mlir
    tgt.rope %q rows %n start %start theta 1.000000e+05 : memref<128x9x64xf32>
    ```
    """

    name = "tgt.rope"
    x = operand_def(MemRefType)
    rows = operand_def(IndexType)
    start = operand_def(IndexType)
    theta = prop_def(FloatAttr[Float32Type])
    assembly_format = "$x `rows` $rows `start` $start `theta` $theta attr-dict `:` type($x)"

    def __init__(self, x: SSAValue, rows: SSAValue, start: SSAValue, theta: float):
        super().__init__(operands=[x, rows, start], properties={"theta": FloatAttr(theta, f32)})

    def verify_(self) -> None:
        if len(dims(self.x)) != 3 or dims(self.x)[2] % 2:
            self._fail(f"x must be [rows, heads, even head_dim], got {self.x.type}")


@irdl_op_definition
class AttentionOp(_Kernel):
    """Causal GQA of one layer: write `k`, `v` rows at `start..start+n-1` into the cache, attend.

    With `rope theta T`, `q` and `k` are rotated first (in place): RoPE and the KV-cache
    write fused into the attention kernel. Cache layout: `tgt.kv_layout` of the function.

    ```mlir
    tgt.attention %q, %k, %v, %k_cache, %v_cache -> %a rows %n start %start layer 0 rope 1.000000e+05 : ...
    ```
    """

    name = "tgt.attention"
    q = operand_def(MemRefType)
    k = operand_def(MemRefType)
    v = operand_def(MemRefType)
    k_cache = operand_def(MemRefType)
    v_cache = operand_def(MemRefType)
    out = operand_def(MemRefType)
    rows = operand_def(IndexType)
    start = operand_def(IndexType)
    layer = prop_def(IntegerAttr[I64])
    rope = opt_prop_def(FloatAttr[Float32Type])
    assembly_format = (
        "$q `,` $k `,` $v `,` $k_cache `,` $v_cache `->` $out `rows` $rows `start` $start `layer` $layer "
        "(`rope` $rope^)? attr-dict `:` type($q) `,` type($k) `,` type($v) `,` type($k_cache) `,` "
        "type($v_cache) `->` type($out)"
    )

    def __init__(self, q: SSAValue, k: SSAValue, v: SSAValue, k_cache: SSAValue, v_cache: SSAValue,
                 out: SSAValue, rows: SSAValue, start: SSAValue, layer: int, rope: float | None = None):
        props: dict[str, Attribute] = {"layer": IntegerAttr(layer, i64)}
        if rope is not None:
            props["rope"] = FloatAttr(rope, f32)
        super().__init__(operands=[q, k, v, k_cache, v_cache, out, rows, start], properties=props)

    def verify_(self) -> None:
        _, heads, d = dims(self.q)
        _, kv_heads, kd = dims(self.k)
        layers, ckh, _, cd = dims(self.k_cache)
        self._same("k vs v shape", dims(self.k), dims(self.v))
        self._same("k_cache vs v_cache shape", dims(self.k_cache), dims(self.v_cache))
        self._same("head dimension (q vs k)", d, kd)
        self._same("kv heads (k vs cache)", kv_heads, ckh)
        self._same("head dimension (k vs cache)", kd, cd)
        if heads % kv_heads:
            self._fail(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
        if not 0 <= self.layer.value.data < layers:
            self._fail(f"layer {self.layer.value.data} is outside the cache's {layers} layers")


class _Elementwise(_Kernel):
    T: ClassVar = VarConstraint("T", BaseAttr(MemRefType))
    lhs = operand_def(T)
    rhs = operand_def(T)
    out = operand_def(T)
    rows = operand_def(IndexType)
    assembly_format = "$lhs `,` $rhs `->` $out `rows` $rows attr-dict `:` type($out)"

    def __init__(self, lhs: SSAValue, rhs: SSAValue, out: SSAValue, rows: SSAValue):
        super().__init__(operands=[lhs, rhs, out, rows])

    def verify_(self) -> None:
        if not dims(self.lhs) == dims(self.rhs) == dims(self.out):
            self._fail(f"operands must have one shape: {self.lhs.type}, {self.rhs.type}, {self.out.type}")


@irdl_op_definition
class AddOp(_Elementwise):
    """`out = lhs + rhs` on the first `rows` rows: `tgt.add %a, %b -> %c rows %n : memref<128x576xf32>`."""

    name = "tgt.add"


@irdl_op_definition
class MulOp(_Elementwise):
    """`out = lhs * rhs` on the first `rows` rows: `tgt.mul %a, %b -> %c rows %n : memref<128x1536xf32>`."""

    name = "tgt.mul"


@irdl_op_definition
class SiluOp(_Kernel):
    """`out = x · sigmoid(x)` on the first `rows` rows: `tgt.silu %g -> %s rows %n : memref<128x1536xf32>`."""

    name = "tgt.silu"
    T: ClassVar = VarConstraint("T", BaseAttr(MemRefType))
    x = operand_def(T)
    out = operand_def(T)
    rows = operand_def(IndexType)
    assembly_format = "$x `->` $out `rows` $rows attr-dict `:` type($out)"

    def __init__(self, x: SSAValue, out: SSAValue, rows: SSAValue):
        super().__init__(operands=[x, out, rows])

    def verify_(self) -> None:
        self._same("shape (x vs out)", dims(self.x), dims(self.out))


KERNELS: tuple[type[IRDLOperation], ...] = (
    EmbeddingOp, RMSNormOp, MatmulOp, SwigluOp, RopeOp, AttentionOp, AddOp, MulOp, SiluOp,
)

TGT = Dialect("tgt", [AllocOp, ViewOp, WeightOp, *KERNELS], [])
