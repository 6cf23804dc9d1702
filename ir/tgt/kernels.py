"""The `tgt` dialect's kernels: `Kernel`, whose declared operands are its ABI, and the fused
kernels `group` and `lower` make of the model ops (embedding, RMSNorm, quantize, matmul, q/k/v projections, SwiGLU,
RoPE, attention, add, mul, SiLU, GELU, mixtures of experts).

```mlir
tgt.rms_norm %x, %wn -> %h rows %n eps 1.000000e-05 : memref<1x576xf32>, !tgt.weight<576, f32, stored> -> !tgt.qrows<1x576>
tgt.matmul %h, %wq -> %q rows %n isa vnni512 : !tgt.qrows<1x576>, !tgt.weight<576x576, q4_1, tiles> -> memref<1x576xf32>
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
    UnitAttr,
    i32,
)
from xdsl.ir import Attribute, SSAValue
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
)
from xdsl.utils.exceptions import VerifyException

from llmc.abi import MAX_THREADS
from llmc.ir import named_operands
from llmc.ir.activations import ACTIVATIONS, Activation
from llmc.ir.formats import Storage
from llmc.ir.layouts import Layout
from llmc.ir.llm import ActivationAttr, RopeAttr
from llmc.ir.tgt.buffers import root
from llmc.ir.tgt.types import (
    ATTENTION_SPLIT_ROWS,
    Activations,
    Isa,
    IsaAttr,
    QRowsType,
    WeightType,
    dims,
    f32,
    is_quantized,
    kv_row_width,
    memref,
    row_width,
)


class Kernel(IRDLOperation):
    """A kernel: its declared operands, in order, are the arguments of its function.

    Every thread of an entry point calls every kernel, which takes its share of the work
    (it also receives `tid`, `nth`). `ROWS`: the operands it reads
    or writes `rows` rows of, whatever number of rows their buffers hold (so one
    function serves every entry point). `WRITES`: the operands it writes (it may read
    every operand): codegen puts a barrier between two kernels only where one writes
    what the other touches. `SYNCS`: the kernel also receives the entry point's barrier
    (`i64* sync`) and waits on it between phases of its own. `DEALS`: it also receives a
    work counter (`i64* work`, a word per thread, zero when it starts): each thread counts in
    its word the chunks taken of its share's last part, which threads done first take over (a
    thread slowed down leaves its part to the others), or the threads count in the first word
    which of them finishes last (and does what needs every thread's part).
    """

    ROWS: ClassVar[tuple[str, ...]] = ("x", "out")
    WRITES: ClassVar[tuple[str, ...]] = ("out",)
    SYNCS: ClassVar[bool] = False
    DEALS: ClassVar[bool] = False

    def abi(self) -> list[tuple[str, SSAValue]]:
        """`(name, value)` of every present operand in definition order: the call's arguments."""
        return [(name, value) for name, value in named_operands(self).items() if value is not None]

    def _fail(self, message: str) -> None:
        raise VerifyException(f"{self.name}: {message}")

    def _same(self, what: str, a: object, b: object) -> None:
        if a != b:
            self._fail(f"{what} mismatch: {a} vs {b}")

    def _float_weight(self, what: str, value: SSAValue | None, width: int) -> None:
        if value is None:
            return
        t = value.type
        if not isinstance(t, WeightType) or t.storage is not Storage.F32 or t.shape != (width,):
            self._fail(f"{what} must be !tgt.weight<{width}, f32, stored>, got {t}")

    def _quantized_kernel(self, rows: Attribute, *weights: SSAValue) -> None:
        """An a8 or a16 kernel (quantized input rows: their type) needs integer weight formats, and in a
        packed layout an isa."""
        if not isinstance(rows, QRowsType):
            return
        isa = getattr(self, "isa")
        for w in weights:
            t = w.type
            assert isinstance(t, WeightType)
            if t.storage.is_float:
                self._fail(f"quantized rows need an integer weight format, not {t.storage}")
            if t.layout is not Layout.STORED and isa is None:
                self._fail("a kernel reading quantized rows from packed weights needs an isa (run pack)")


def _positions(op: Kernel, positions: SSAValue, rows: int, what: str = "positions") -> None:
    if positions.type != memref(rows, element_type=i32):
        op._fail(f"{what} must be memref<{rows}xi32>, got {positions.type}")


def _eps_props(eps: float | None) -> dict[str, Attribute]:
    return {"eps": FloatAttr(eps, f32)} if eps is not None else {}


class Projection(Kernel):
    """What the matmul, q/k/v and SwiGLU kernels share: `quantize`, rows normalized and quantized by the kernel itself;
    their output columns dealt to the threads."""

    DEALS: ClassVar[bool] = True

    def rows_type(self) -> Attribute:
        """The type of the rows the dot products read: `x`'s, or with `quantize` the private quantized rows'."""
        quantize = getattr(self, "quantize")
        return quantize if quantize is not None else getattr(self, "x").type

    def _private_rows(self) -> None:
        """`quantize` needs float rows and a norm (`fuse-norm` makes it of an RMSNorm into quantized rows)."""
        quantize, x = getattr(self, "quantize"), getattr(self, "x")
        if quantize is None:
            return
        if is_quantized(x) or getattr(self, "norm") is None:
            self._fail("'quantize' needs float rows and a norm")
        self._same("rows (x vs quantize)", (dims(x)[0], row_width(x)), (quantize.rows, quantize.width))


@irdl_op_definition
class EmbeddingOp(Kernel):
    """`out[t] = table[tokens[t]]` (times `scale`) for `t < n`, dequantizing rows of any storage.

    ```mlir
    tgt.embedding %tokens, %table -> %x rows %n : memref<128xi32>, !tgt.weight<49152x576, q8_0, tiles> -> memref<128x576xf32>
    ```
    """

    name = "tgt.embedding"
    ROWS: ClassVar[tuple[str, ...]] = ("tokens", "out")
    tokens = operand_def(MemRefType)
    table = operand_def(WeightType)
    out = operand_def(MemRefType)
    rows = operand_def(IndexType)
    scale = opt_prop_def(FloatAttr[Float32Type])
    assembly_format = (
        "$tokens `,` $table `->` $out `rows` $rows (`scale` $scale^)? attr-dict `:` type($tokens) `,` type($table) "
        "`->` type($out)"
    )

    def __init__(self, tokens: SSAValue, table: SSAValue, out: SSAValue, rows: SSAValue, scale: FloatAttr | None = None):
        super().__init__(operands=[tokens, table, out, rows], properties={} if scale is None else {"scale": scale})

    def verify_(self) -> None:
        self._same("embedding width (table vs out)", dims(self.table)[1], row_width(self.out))


@irdl_op_definition
class RMSNormOp(Kernel):
    """`out[t] = x[t] / sqrt(mean(x[t]²) + eps) * w`, into float or quantized rows.

    ```mlir
    tgt.rms_norm %x, %w -> %h rows %n eps 1.000000e-05 : memref<128x576xf32>, !tgt.weight<576, f32, stored> -> !tgt.qrows<128x576>
    ```
    A weight narrower than the row normalizes each of the row's groups of its width on its
    own (the per-head q/k norms of Qwen3 and Gemma 3), into float rows:
    ```mlir
    tgt.rms_norm %q, %w -> %q rows %n eps 1.000000e-06 : memref<128x16x128xf32>, !tgt.weight<128, f32, stored> -> memref<128x16x128xf32>
    ```
    """

    name = "tgt.rms_norm"
    x = operand_def(MemRefType)
    weight = operand_def(WeightType)
    out = operand_def(Activations)
    rows = operand_def(IndexType)
    eps = prop_def(FloatAttr[Float32Type])
    assembly_format = (
        "$x `,` $weight `->` $out `rows` $rows `eps` $eps attr-dict `:` type($x) `,` type($weight) `->` type($out)"
    )

    def __init__(self, x: SSAValue, weight: SSAValue, out: SSAValue, rows: SSAValue, eps: float):
        super().__init__(operands=[x, weight, out, rows], properties={"eps": FloatAttr(eps, f32)})

    @property
    def groups(self) -> int:
        """How many groups of the weight's width each row normalizes on its own."""
        return row_width(self.x) // self.weight.type.shape[0]

    def verify_(self) -> None:
        width = row_width(self.x)
        t = self.weight.type
        group = t.shape[0] if isinstance(t, WeightType) and len(t.shape) == 1 and t.shape[0] else width
        if width % group:
            self._fail(f"row width {width} is not a multiple of the weight's {group}")
        self._float_weight("weight", self.weight, group)
        self._same("width (x vs out)", width, row_width(self.out))
        if group != width and is_quantized(self.out):
            self._fail("a norm in groups writes float rows")


@irdl_op_definition
class QuantizeOp(Kernel):
    """`out = x` quantized to int8 (or int16) per 32 values (where no producer kernel could do it).

    ```mlir
    tgt.quantize %g -> %gq rows %n : memref<128x1536xf32> -> !tgt.qrows<128x1536>
    tgt.quantize %g -> %gq16 rows %n : memref<128x1536xf32> -> !tgt.qrows<128x1536xi16>
    ```
    """

    name = "tgt.quantize"
    x = operand_def(MemRefType)
    out = operand_def(QRowsType)
    rows = operand_def(IndexType)
    assembly_format = "$x `->` $out `rows` $rows attr-dict `:` type($x) `->` type($out)"

    def __init__(self, x: SSAValue, out: SSAValue, rows: SSAValue):
        super().__init__(operands=[x, out, rows])

    def verify_(self) -> None:
        self._same("width (x vs out)", row_width(self.x), row_width(self.out))


@irdl_op_definition
class MatmulOp(Projection):
    """`out[t] (+)= norm?(x[t]) · wᵀ + bias`, for every row or only the last one.

    `x` is float rows (`a32`: weights dequantized in registers) or quantized rows (`a8`, or
    `a16` on `!tgt.qrows<…xi16>`: integer dot products with the `isa` that `pack` chose).
    - `norm %g eps E`: RMS-normalize each row of float `x` with weight `g` first;
    - `quantize <R x K (xi16)>`: and quantize them to `!tgt.qrows` of that shape, each thread its own copy,
      read as `a8`/`a16` rows are (the bytes a `tgt.rms_norm` into them writes: `fuse-norm`);
    - `accumulate`: add into `out` instead of overwriting it (a fused residual add);
    - `last_row`: compute only row `n-1` of `x`, into row 0 of `out` (the LM head);
    - `softcap C`: each result `y` becomes `C · tanh(y / C)` (Gemma 2's logits);
    - `screen M` (with int16 `quantize`: decode's LM head, pass `screen-logits`): the dot products are first
      taken with the rows quantized to int8 (`a8`, half the products of `a16`), then again with the int16 rows
      for every strip of 16 columns whose largest int8 result comes within `M` of the largest in its block of
      `SCREEN_COLUMNS` (2048) columns: every result that can be a row's largest (or near it) is `a16`'s exactly, the
      rest carry the int8 rows' rounding (`isa vnni512` only). The blocks are fixed, so the results are the same
      whatever thread takes a block, and a row's the same alone or with others.

    ```mlir
    tgt.matmul %h, %wq -> %q rows %n isa amx : !tgt.qrows<128x576>, !tgt.weight<576x576, q4_1, tiles> -> memref<128x576xf32>
    tgt.matmul %x, %wq -> %q rows %n norm %g eps 1.000000e-05 : memref<128x576xf32>, !tgt.weight<576x576, f32, stored> norm !tgt.weight<576, f32, stored> -> memref<128x576xf32>
    tgt.matmul %x, %wq -> %q rows %n norm %g eps 1.000000e-05 quantize <1x576xi16> isa vnni512 : memref<1x576xf32>, !tgt.weight<576x576, q4_1, tiles> norm !tgt.weight<576, f32, stored> -> memref<1x576xf32>
    tgt.matmul %x, %emb -> %logits rows %n norm %g eps 1.000000e-05 quantize <8x576xi16> screen 1.000000e+00 isa vnni512 : memref<8x576xf32>, !tgt.weight<49152x576, q8_0, tiles> norm !tgt.weight<576, f32, stored> -> memref<8x49152xf32>
    ```
    """

    name = "tgt.matmul"
    x = operand_def(Activations)
    weight = operand_def(WeightType)
    out = operand_def(MemRefType)
    rows = operand_def(IndexType)
    bias = opt_operand_def(WeightType)
    norm = opt_operand_def(WeightType)
    eps = opt_prop_def(FloatAttr[Float32Type])
    accumulate = opt_prop_def(UnitAttr)
    last_row = opt_prop_def(UnitAttr)
    softcap = opt_prop_def(FloatAttr[Float32Type])
    quantize = opt_prop_def(QRowsType)
    screen = opt_prop_def(FloatAttr[Float32Type])
    isa = opt_prop_def(IsaAttr)
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    assembly_format = (
        "$x `,` $weight `->` $out `rows` $rows (`bias` $bias^)? (`norm` $norm^ `eps` $eps)? (`quantize` $quantize^)? "
        "(`screen` $screen^)? (`accumulate` $accumulate^)? (`last_row` $last_row^)? (`softcap` $softcap^)? (`isa` $isa^)? attr-dict `:` "
        "type($x) `,` "
        "type($weight) (`bias` type($bias)^)? (`norm` type($norm)^)? `->` type($out)"
    )

    def __init__(self, x: SSAValue, weight: SSAValue, out: SSAValue, rows: SSAValue, *,
                 bias: SSAValue | None = None, norm: SSAValue | None = None, eps: float | None = None,
                 accumulate: bool = False, last_row: bool = False, softcap: float | None = None):
        props = _eps_props(eps if norm is not None else None)
        if accumulate:
            props["accumulate"] = UnitAttr()
        if last_row:
            props["last_row"] = UnitAttr()
        if softcap is not None:
            props["softcap"] = FloatAttr(softcap, f32)
        super().__init__(
            operands=[x, weight, out, rows, [bias] if bias else [], [norm] if norm else []], properties=props
        )

    def verify_(self) -> None:
        n, k = dims(self.weight)
        self._same("reduction dimension (x vs weight)", row_width(self.x), k)
        self._same("output width (weight vs out)", n, row_width(self.out))
        self._float_weight("bias", self.bias, n)
        self._float_weight("norm", self.norm, k)
        if (self.norm is None) != (self.eps is None):
            self._fail("'norm' and 'eps' go together")
        if self.norm is not None and is_quantized(self.x):
            self._fail("quantized rows cannot be normalized: the producer of the rows normalizes")
        if self.softcap is not None and self.accumulate is not None:
            self._fail("softcap and accumulate do not go together")
        if self.accumulate is not None and root(self.x) is root(self.out):
            self._fail("x and out are one buffer: accumulating would overwrite the rows it reads")
        self._private_rows()
        self._quantized_kernel(self.rows_type(), self.weight)
        if self.screen is not None:
            if self.quantize is None or self.quantize.bits != 16:
                self._fail("'screen' needs int16 'quantize' rows (it takes int8 ones of the same rows first)")
            if self.accumulate is not None or self.last_row is not None:
                self._fail("'screen' goes with neither 'accumulate' nor 'last_row'")
            if self.weight.type.layout is not Layout.TILES:
                self._fail(f"'screen' reads a weight in the tiles layout, not {self.weight.type.layout.value}")
            if self.isa is None or self.isa.data is not Isa.VNNI512:  # (elsewhere int8 rows cost what int16 ones do)
                self._fail("'screen' takes isa vnni512: int8 rows at half the products of int16 ones")
            if not self.screen.value.data >= 0:
                self._fail(f"'screen' needs a margin of 0 or more, not {self.screen.value.data}")


@irdl_op_definition
class SwigluOp(Projection):
    """The gated feed-forward input: `out[t] = silu(x[t]·w_gateᵀ) * (x[t]·w_upᵀ)` (with an `activation`,
    that one instead of silu: `activation gelu_tanh`), norm optional (and `quantize`, as `tgt.matmul`'s).

    Writes float or quantized rows (quantized 32 columns at a time by the thread that
    computed them).
    ```mlir
    tgt.swiglu %h, %wg, %wu -> %a rows %n isa amx : !tgt.qrows<128x576>, !tgt.weight<1536x576, q4_1, tiles>, !tgt.weight<1536x576, q4_1, tiles> -> !tgt.qrows<128x1536>
    ```
    """

    name = "tgt.swiglu"
    x = operand_def(Activations)
    gate = operand_def(WeightType)
    up = operand_def(WeightType)
    out = operand_def(Activations)
    rows = operand_def(IndexType)
    norm = opt_operand_def(WeightType)
    eps = opt_prop_def(FloatAttr[Float32Type])
    activation = opt_prop_def(ActivationAttr)  # none: silu
    quantize = opt_prop_def(QRowsType)
    isa = opt_prop_def(IsaAttr)
    assembly_format = (
        "$x `,` $gate `,` $up `->` $out `rows` $rows (`norm` $norm^ `eps` $eps)? (`quantize` $quantize^)? "
        "(`activation` $activation^)? (`isa` $isa^)? attr-dict `:` type($x) `,` type($gate) `,` type($up) "
        "(`norm` type($norm)^)? `->` type($out)"
    )

    def __init__(self, x: SSAValue, gate: SSAValue, up: SSAValue, out: SSAValue, rows: SSAValue, *,
                 norm: SSAValue | None = None, eps: float | None = None, activation: Activation = Activation.SILU):
        props = _eps_props(eps if norm is not None else None)
        if activation is not Activation.SILU:
            props["activation"] = ActivationAttr(activation)
        super().__init__(operands=[x, gate, up, out, rows, [norm] if norm else []], properties=props)

    def verify_(self) -> None:
        n, k = dims(self.gate)
        self._same("gate vs up shape", (n, k), dims(self.up))
        self._same("reduction dimension (x vs gate)", row_width(self.x), k)
        self._same("output width (gate vs out)", n, row_width(self.out))
        self._float_weight("norm", self.norm, k)
        if self.norm is not None and is_quantized(self.x):
            self._fail("quantized rows cannot be normalized: the producer of the rows normalizes")
        self._private_rows()
        self._quantized_kernel(self.rows_type(), self.gate, self.up)


@irdl_op_definition
class QkvOp(Projection):
    """An attention's three input projections of the same rows in one kernel: `q[t] = x̂[t] · w_qᵀ (+ b_q)`,
    and the same for `k` and `v`, with `x̂` the rows RMS-normalized and quantized once (`norm`, `quantize`: as
    `tgt.matmul`'s), the three weights' columns dealt to the threads as one stream. `fuse-norm` makes it of the
    three matmuls that read one norm's rows at decode-sized entry points.

    ```mlir
    tgt.qkv %x, %wq, %wk, %wv -> %q, %k, %v rows %n norm %g eps 1.000000e-05 quantize <1x576xi16> isa vnni512 : memref<1x576xf32>, !tgt.weight<576x576, q4_1, tiles>, !tgt.weight<192x576, q4_1, tiles>, !tgt.weight<192x576, q4_1, tiles> norm !tgt.weight<576, f32, stored> -> memref<1x576xf32>, memref<1x192xf32>, memref<1x192xf32>
    ```
    """

    name = "tgt.qkv"
    ROWS: ClassVar[tuple[str, ...]] = ("x", "q", "k", "v")
    WRITES: ClassVar[tuple[str, ...]] = ("q", "k", "v")
    OUTPUTS: ClassVar[tuple[tuple[str, str, str], ...]] = (("wq", "q", "bq"), ("wk", "k", "bk"), ("wv", "v", "bv"))
    x = operand_def(MemRefType)
    wq = operand_def(WeightType)
    wk = operand_def(WeightType)
    wv = operand_def(WeightType)
    q = operand_def(MemRefType)
    k = operand_def(MemRefType)
    v = operand_def(MemRefType)
    rows = operand_def(IndexType)
    bq = opt_operand_def(WeightType)
    bk = opt_operand_def(WeightType)
    bv = opt_operand_def(WeightType)
    norm = operand_def(WeightType)
    eps = prop_def(FloatAttr[Float32Type])
    quantize = prop_def(QRowsType)
    isa = opt_prop_def(IsaAttr)
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    assembly_format = (
        "$x `,` $wq `,` $wk `,` $wv `->` $q `,` $k `,` $v `rows` $rows (`bias` $bq^ `,` $bk `,` $bv)? `norm` $norm "
        "`eps` $eps `quantize` $quantize (`isa` $isa^)? attr-dict `:` type($x) `,` type($wq) `,` type($wk) `,` "
        "type($wv) (`bias` type($bq)^ `,` type($bk) `,` type($bv))? `norm` type($norm) `->` type($q) `,` type($k) "
        "`,` type($v)"
    )

    def __init__(self, x: SSAValue, weights: tuple[SSAValue, SSAValue, SSAValue], outs: tuple[SSAValue, SSAValue,
                 SSAValue], rows: SSAValue, *, biases: tuple[SSAValue, SSAValue, SSAValue] | None, norm: SSAValue,
                 eps: FloatAttr, quantize: QRowsType, isa: IsaAttr | None):
        props: dict[str, Attribute] = {"eps": eps, "quantize": quantize}
        if isa is not None:
            props["isa"] = isa
        super().__init__(operands=[x, *weights, *outs, rows, *([[b] for b in biases] if biases else [[]] * 3), norm],
                         properties=props)

    def projections(self) -> list[tuple[SSAValue, SSAValue, SSAValue | None]]:
        """`(weight, out, bias)` of q, k and v."""
        return [(getattr(self, w), getattr(self, o), getattr(self, b)) for w, o, b in self.OUTPUTS]

    def verify_(self) -> None:
        K = row_width(self.x)
        if len({b is None for _, _, b in self.projections()}) != 1:
            self._fail("'bias' takes a bias for each of q, k and v")
        for weight, out, bias in self.projections():
            n, k = dims(weight)
            self._same("reduction dimension (x vs weight)", K, k)
            self._same("output width (weight vs out)", n, row_width(out))
            self._float_weight("bias", bias, n)
            if root(out) is root(self.x):
                self._fail("x and an output are one buffer: writing it would overwrite the rows it reads")
        if len({root(out) for _, out, _ in self.projections()}) != 3:
            self._fail("q, k and v must be three buffers")
        self._float_weight("norm", self.norm, K)
        self._private_rows()
        self._quantized_kernel(self.quantize, self.wq, self.wk, self.wv)


@irdl_op_definition
class RopeOp(Kernel):
    """Rotate-half RoPE (`#llm.rope`) in place on `x [rows, heads, head_dim]`, row `t` at position `positions[t]`.

    ```mlir
    tgt.rope %q positions %positions rows %n <theta 100000.0> : memref<128x9x64xf32>, memref<128xi32>
    ```
    """

    name = "tgt.rope"
    ROWS: ClassVar[tuple[str, ...]] = ("x", "positions")
    WRITES: ClassVar[tuple[str, ...]] = ("x",)
    x = operand_def(MemRefType)
    positions = operand_def(MemRefType)
    rows = operand_def(IndexType)
    rope = prop_def(RopeAttr)
    assembly_format = "$x `positions` $positions `rows` $rows $rope attr-dict `:` type($x) `,` type($positions)"

    def __init__(self, x: SSAValue, positions: SSAValue, rows: SSAValue, rope: RopeAttr):
        super().__init__(operands=[x, positions, rows], properties={"rope": rope})

    def verify_(self) -> None:
        if len(dims(self.x)) != 3:
            self._fail(f"x must be [rows, heads, head_dim], got {self.x.type}")
        if problem := self.rope.check_head(dims(self.x)[2]):
            self._fail(problem)
        _positions(self, self.positions, dims(self.x)[0])


@irdl_op_definition
class AttentionOp(Kernel):
    """Causal GQA of one layer: write each row `t` of `k`, `v` at position `positions[t]` of the layer's
    cache (`[kv_heads, capacity, head_dim]`, a `tgt.subview` of the KV cache), attend. A cache of
    several sequences (`[slots, kv_heads, capacity, head_dim]`) takes `slots %s` too: row `t` is
    written to and attends within sequence `slots[t]`.

    With `rope <…>`, `q` and `k` are rotated first (in place): RoPE and the KV-cache write
    fused into the attention kernel. `window`, `softcap` and `scale` score as `llm.attention` says. Writes float or quantized rows `[rows, heads·head_dim]`.
    The cache holds f32, f16 or q8_0 rows (`--kv-type`; i8, `kv_row_width`). `partials` is scratch where, for up to
    as many rows as it has room for (`ATTENTION_SPLIT_ROWS`, or decode's batch), each thread
    leaves its share of the positions' result for the merge (flash-decoding); with one row, the
    last thread to leave its share (counted on the work counter) merges them.

    ```mlir
    tgt.attention %q, %k, %v, %kc, %vc -> %a positions %positions partials %p rows %n rope <theta 100000.0> : memref<128x9x64xf32>, memref<128x3x64xf32>, memref<128x3x64xf32>, memref<3x4096x64xf16>, memref<3x4096x64xf16> -> !tgt.qrows<128x576>, memref<128xi32>, memref<64x4x9x66xf32>
    ```
    """

    name = "tgt.attention"
    ROWS: ClassVar[tuple[str, ...]] = ("q", "k", "v", "out", "positions", "slots")
    WRITES: ClassVar[tuple[str, ...]] = ("q", "k", "k_cache", "v_cache", "out", "partials")  # rope: q, k in place
    SYNCS: ClassVar[bool] = True
    DEALS: ClassVar[bool] = True  # (one decode row: the last thread to leave its partials merges them)
    q = operand_def(MemRefType)
    k = operand_def(MemRefType)
    v = operand_def(MemRefType)
    k_cache = operand_def(MemRefType)
    v_cache = operand_def(MemRefType)
    out = operand_def(Activations)
    positions = operand_def(MemRefType)
    slots = opt_operand_def(MemRefType)
    partials = operand_def(MemRefType)
    rows = operand_def(IndexType)
    rope = opt_prop_def(RopeAttr)
    window = opt_prop_def(IntegerAttr[I64])
    softcap = opt_prop_def(FloatAttr[Float32Type])
    scale = opt_prop_def(FloatAttr[Float32Type])
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    assembly_format = (
        "$q `,` $k `,` $v `,` $k_cache `,` $v_cache `->` $out `positions` $positions (`slots` $slots^)? "
        "`partials` $partials `rows` $rows (`rope` $rope^)? (`window` $window^)? (`softcap` $softcap^)? "
        "(`scale` $scale^)? attr-dict `:` type($q) `,` type($k) `,` type($v) `,` "
        "type($k_cache) `,` type($v_cache) `->` type($out) `,` type($positions) (`slots` type($slots)^)? `,` "
        "type($partials)"
    )

    def __init__(self, q: SSAValue, k: SSAValue, v: SSAValue, k_cache: SSAValue, v_cache: SSAValue,
                 out: SSAValue, positions: SSAValue, partials: SSAValue, rows: SSAValue, rope: RopeAttr | None = None,
                 slots: SSAValue | None = None, **options: Attribute):
        props = {"rope": rope, **options} if rope is not None else dict(options)
        super().__init__(operands=[q, k, v, k_cache, v_cache, out, positions, [slots] if slots is not None else [],
                                   partials, rows], properties=props)

    @staticmethod
    def partials_type(heads: int, head_dim: int, split_rows: int = ATTENTION_SPLIT_ROWS) -> MemRefType:
        """Where decode's threads leave their partial results (max, sum, weighted values per head) for
        up to `split_rows` rows."""
        return memref(MAX_THREADS, split_rows, heads, head_dim + 2)

    @property
    def split_rows(self) -> int:
        """Up to this many rows the threads share the cache positions (the room in `partials`)."""
        return dims(self.partials)[1]

    def verify_(self) -> None:
        _, heads, d = dims(self.q)
        _, kv_heads, kd = dims(self.k)
        if (self.slots is not None) != (len(dims(self.k_cache)) == 4):
            self._fail("a cache of several sequences ([slots, kv_heads, capacity, width]) needs `slots`, "
                       "and only such a cache")
        if self.slots is not None:
            _positions(self, self.slots, dims(self.q)[0], "slots")
        ckh, _, cd = dims(self.k_cache)[-3:]
        self._same("k vs v shape", dims(self.k), dims(self.v))
        self._same("k_cache vs v_cache shape", dims(self.k_cache), dims(self.v_cache))
        self._same("head dimension (q vs k)", d, kd)
        self._same("kv heads (k vs cache)", kv_heads, ckh)
        self._same("cache row (head dimension and cache type)", kv_row_width(kd, self.k_cache.type.element_type), cd)
        self._same("width (q vs out)", heads * d, row_width(self.out))
        if heads % kv_heads:
            self._fail(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
        if self.rope is not None and (problem := self.rope.check_head(d)):
            self._fail(problem)
        _positions(self, self.positions, dims(self.q)[0])
        self._same("partials", self.partials.type, self.partials_type(heads, d, max(self.split_rows, 1)))
        if self.split_rows < ATTENTION_SPLIT_ROWS:
            self._fail(f"partials must have room for at least {ATTENTION_SPLIT_ROWS} rows")
        if str(self.k_cache.type.element_type) not in ("f32", "f16", "i8"):
            self._fail(f"the cache holds f32, f16 or i8 (q8_0 rows), not {self.k_cache.type.element_type}")
        if str(self.k_cache.type.element_type) == "i8" and d % 32:
            self._fail(f"a q8_0 cache needs a head dimension that is a multiple of 32, got {d}")
        if is_quantized(self.out) and d % 32:
            self._fail(f"quantized output needs a head dimension that is a multiple of 32, got {d}")


class _Elementwise(Kernel):
    ROWS: ClassVar[tuple[str, ...]] = ("lhs", "rhs", "out")
    T: ClassVar = VarConstraint("T", BaseAttr(MemRefType))
    lhs = operand_def(T)
    rhs = operand_def(T)
    out = operand_def(T)
    rows = operand_def(IndexType)
    assembly_format = "$lhs `,` $rhs `->` $out `rows` $rows attr-dict `:` type($out)"

    def __init__(self, lhs: SSAValue, rhs: SSAValue, out: SSAValue, rows: SSAValue):
        super().__init__(operands=[lhs, rhs, out, rows])


@irdl_op_definition
class AddOp(_Elementwise):
    """`out = lhs + rhs` on the first `rows` rows: `tgt.add %a, %b -> %c rows %n : memref<128x576xf32>`."""

    name = "tgt.add"


@irdl_op_definition
class MulOp(_Elementwise):
    """`out = lhs * rhs` on the first `rows` rows: `tgt.mul %a, %b -> %c rows %n : memref<128x1536xf32>`."""

    name = "tgt.mul"


class _Unary(Kernel):
    """Unary elementwise kernels over float rows of one type."""

    T: ClassVar = VarConstraint("T", BaseAttr(MemRefType))
    x = operand_def(T)
    out = operand_def(T)
    rows = operand_def(IndexType)
    assembly_format = "$x `->` $out `rows` $rows attr-dict `:` type($out)"

    def __init__(self, x: SSAValue, out: SSAValue, rows: SSAValue):
        super().__init__(operands=[x, out, rows])


def _activation_kernel(activation: Activation) -> type[_Unary]:
    """`tgt.<activation>` (`tgt.gelu_tanh`: `GeluTanhOp`), documented by its table row."""
    doc = f"""`out = {ACTIVATIONS[activation].formula}` ({activation}) on the first `rows` rows:
    `tgt.{activation} %g -> %s rows %n : memref<128x1536xf32>`."""
    cls = type(activation.title().replace("_", "") + "Op", (_Unary,),
               {"name": f"tgt.{activation}", "ACTIVATION": activation, "__doc__": doc, "__module__": __name__,
                "__annotations__": {"ACTIVATION": ClassVar[Activation]}})
    return irdl_op_definition(cls)


ACTIVATION_KERNELS = {activation: _activation_kernel(activation) for activation in Activation}  # one per table row
SiluOp = ACTIVATION_KERNELS[Activation.SILU]


@irdl_op_definition
class MoeOp(Kernel):
    """A mixture of experts (`llm.moe`) on float rows: route each row, then only its `top_k`
    experts' rows of `gate`, `up` (`[experts·width, hidden]`, stacked) and `down`
    (`[experts·hidden, width]`) are read. `scratch` holds per row and chosen expert the
    gated activations, the weight and the expert's index (`[rows, top_k, width + 2]`).

    ```mlir
    tgt.moe %h, %router, %gate, %up, %down -> %y scratch %s rows %n top_k 2 normalize : memref<128x32xf32>, !tgt.weight<8x32, f32, stored>, !tgt.weight<192x32, q8_0, split>, !tgt.weight<192x32, q8_0, split>, !tgt.weight<256x24, q8_0, split> -> memref<128x32xf32>, memref<128x2x26xf32>
    ```
    """

    name = "tgt.moe"
    ROWS: ClassVar[tuple[str, ...]] = ("x", "out", "scratch")
    WRITES: ClassVar[tuple[str, ...]] = ("out", "scratch")
    SYNCS: ClassVar[bool] = True
    x = operand_def(MemRefType)
    router = operand_def(WeightType)
    gate = operand_def(WeightType)
    up = operand_def(WeightType)
    down = operand_def(WeightType)
    out = operand_def(MemRefType)
    scratch = operand_def(MemRefType)
    rows = operand_def(IndexType)
    top_k = prop_def(IntegerAttr[I64])
    normalize = opt_prop_def(UnitAttr)
    assembly_format = (
        "$x `,` $router `,` $gate `,` $up `,` $down `->` $out `scratch` $scratch `rows` $rows `top_k` $top_k "
        "(`normalize` $normalize^)? attr-dict `:` type($x) `,` type($router) `,` type($gate) `,` type($up) `,` "
        "type($down) `->` type($out) `,` type($scratch)"
    )

    def __init__(self, x: SSAValue, router: SSAValue, gate: SSAValue, up: SSAValue, down: SSAValue, out: SSAValue,
                 scratch: SSAValue, rows: SSAValue, top_k: IntegerAttr, normalize: UnitAttr | None):
        props: dict[str, Attribute] = {"top_k": top_k}
        if normalize is not None:
            props["normalize"] = normalize
        super().__init__(operands=[x, router, gate, up, down, out, scratch, rows], properties=props)

    @property
    def experts(self) -> int:
        return self.router.type.shape[0]

    @property
    def width(self) -> int:
        """An expert's feed-forward width."""
        return self.gate.type.shape[0] // self.experts

    @staticmethod
    def scratch_type(rows: int, top_k: int, width: int) -> MemRefType:
        return memref(rows, top_k, width + 2)

    def verify_(self) -> None:
        experts, hidden = self.router.type.shape
        self._same("router width (x vs router)", row_width(self.x), hidden)
        self._same("gate vs up", self.gate.type.shape, self.up.type.shape)
        self._same("gate shape", self.gate.type.shape, (experts * self.width, hidden))
        self._same("down shape", self.down.type.shape, (experts * hidden, self.width))
        self._same("width (x vs out)", row_width(self.x), row_width(self.out))
        self._same("scratch", dims(self.scratch)[1:], (self.top_k.value.data, self.width + 2))
        if not 1 <= self.top_k.value.data <= experts:
            self._fail(f"top_k must be in 1..{experts}, got {self.top_k.value.data}")
