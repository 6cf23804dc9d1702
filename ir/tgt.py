"""The `tgt` dialect: kernels over typed buffers, what a backend emits code for.

One `tgt` function is one entry point (`prefill`, `prefill_kv`, `decode`, `score`).
Its ops are kernels in destination-passing style: each reads buffers and writes a
buffer; none returns a value. Types say what the bytes are:

- `memref<128x576xf32>`: float activations (and the logits; the KV cache in f32, f16
  or i8 = q8_0 rows, `kv_row_width`);
- `!tgt.qrows<128x576>`: activation rows quantized to int8 per 32 values, with their
  scales and sums (`llmc.ir.layouts`), written by the kernel that produces them and read
  by integer (`a8`) matmuls; `!tgt.qrows<128x576xi16>`: the same quantized to int16, as
  two int8 planes (read by `a16` matmuls);
- `!tgt.weight<576x576, q4_1, tiles>`: a weight of the artifact in a storage type
  (`llmc.ir.formats`) and a layout (`stored` as in the model file, `split` or `tiles`,
  chosen for the target by the `pack` pass).

Activations live in one arena per entry point (`tgt.alloc`, placed by `plan-memory`),
weights are symbols into the artifact's weight file (`tgt.weight`), the KV cache and
the logits are arguments. Shapes are static except the row count `%n` (tokens in this
call, ≤ `tgt.max_tokens`); row `t` is at position `%positions[t]`. The module carries the
target (`tgt.target`), set before any phase runs.

```mlir
builtin.module attributes {tgt.target = #tgt.target<cpu, "x86_64", "sapphirerapids", ["avx2", "avx512vnni"]>} {
  func.func @decode(%tokens: memref<1xi32>, %positions: memref<1xi32>, %n: index,
                    %k_cache: memref<30x3x4096x64xf16>, %v_cache: memref<30x3x4096x64xf16>,
                    %logits: memref<1x49152xf32>) attributes {...} {
    %x = tgt.alloc offset 0 : memref<1x576xf32>
    %h = tgt.alloc offset 2304 : !tgt.qrows<1x576>
    %wn = tgt.weight @blk.0.attn_norm : !tgt.weight<576, f32, stored>
    tgt.rms_norm %x, %wn -> %h rows %n eps 1.000000e-05 : memref<1x576xf32>, !tgt.weight<576, f32, stored> -> !tgt.qrows<1x576>
    %wq = tgt.weight @blk.0.attn_q : !tgt.weight<576x576, q4_1, tiles>
    tgt.matmul %h, %wq -> %q rows %n isa vnni512 : !tgt.qrows<1x576>, !tgt.weight<576x576, q4_1, tiles> -> memref<1x576xf32>
    ...
```

A kernel's definition is its ABI: the operands it declares, in order, are the
arguments of its compiled function (`Kernel.abi`): the CPU call sites and kernel
signatures are derived from it, the tgt interpreter reads the same named operands, and
a buffer's type alone says how the packager writes it and how kernels read it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum
from typing import ClassVar

from xdsl.dialects.builtin import (
    I64,
    ArrayAttr,
    Float32Type,
    FloatAttr,
    IndexType,
    IntAttr,
    IntegerAttr,
    MemRefType,
    StringAttr,
    SymbolRefAttr,
    UnitAttr,
    i32,
    i64,
)
from xdsl.dialects.utils.enum_attribute import EnumAttribute
from xdsl.ir import Attribute, Dialect, ParametrizedAttribute, SpacedOpaqueSyntaxAttribute, SSAValue, TypeAttribute
from xdsl.irdl import (
    AnyAttr,
    AnyOf,
    AttrSizedOperandSegments,
    BaseAttr,
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

from llmc.ir import named_operands
from llmc.ir.formats import FORMATS, Storage
from llmc.ir.layouts import Layout, QRowLayout, weight_nbytes
from llmc.ir.llm import RopeAttr
from llmc.runtime.artifact import KV_LAYOUT, KV_LAYOUT_SLOTS  # noqa: F401 (the cache's layouts, as the runtime reads them)

f32 = Float32Type()


# ------------------------------------------------------------------ the target


@irdl_attr_definition
class TargetAttr(ParametrizedAttribute):
    """What the code is for: `#tgt.target<cpu, "x86_64", "sapphirerapids", ["avx2", "avx512vnni", …]>`.

    `kind` is `cpu` (later `cuda`), `arch` the architecture, `cpu` the CPU (or GPU)
    name, `features` the features that change the passes' choices. Set on the module as
    `tgt.target` before any phase runs; passes choose from it, codegen builds for it.
    """

    name = "tgt.target"
    kind: StringAttr = param_def(StringAttr)
    arch: StringAttr = param_def(StringAttr)
    cpu: StringAttr = param_def(StringAttr)
    feature_list: ArrayAttr[StringAttr] = param_def(ArrayAttr[StringAttr])

    def __init__(self, kind: str, arch: str, cpu: str, features: Sequence[str]):
        super().__init__(StringAttr(kind), StringAttr(arch), StringAttr(cpu),
                         ArrayAttr([StringAttr(f) for f in sorted(set(features))]))

    @property
    def features(self) -> frozenset[str]:
        return frozenset(f.data for f in self.feature_list.data)

    def has(self, *features: str) -> bool:
        return all(f in self.features for f in features)

    def print_parameters(self, printer: Printer) -> None:
        feats = ", ".join(f'"{f.data}"' for f in self.feature_list.data)
        printer.print_string(f'<{self.kind.data}, "{self.arch.data}", "{self.cpu.data}", [{feats}]>')

    @classmethod
    def parse_parameters(cls, parser: AttrParser) -> Sequence[Attribute]:
        parser.parse_punctuation("<")
        kind = parser.parse_identifier()
        parser.parse_punctuation(",")
        arch = parser.parse_str_literal()
        parser.parse_punctuation(",")
        cpu = parser.parse_str_literal()
        parser.parse_punctuation(",")
        feats = parser.parse_comma_separated_list(parser.Delimiter.SQUARE, parser.parse_str_literal)
        parser.parse_punctuation(">")
        return (StringAttr(kind), StringAttr(arch), StringAttr(cpu), ArrayAttr([StringAttr(f) for f in feats]))


TARGET = "tgt.target"
KV_Q8_SCALES = 4  # bytes of f32 scale per 32 values of a q8_0 cache row
MAX_THREADS = 64  # the most threads an entry point runs on (the runtime caps its team)
ATTENTION_SPLIT_ROWS = 4  # up to this many rows, attention's threads share cache positions


# ------------------------------------------------------------------ types


class Isa(StrEnum):
    """The instructions a matmul kernel is built on, chosen by `pack` from the target: the integer
    dot product of an `a8` kernel (and by the entry point's rows, `amx` for prefill and score where
    the target has AMX-INT8), or on CUDA, tensor cores for the float-row prefill and score GEMMs."""

    AMX = "amx"  # AMX-INT8 tiles for blocks of 16 rows, VNNI-512 for the rest
    VNNI512 = "vnni512"  # AVX-512 VNNI vpdpbusd on 512-bit vectors
    VNNI256 = "vnni256"  # AVX-VNNI vpdpbusd on 256-bit vectors
    AVX2 = "avx2"  # pmaddubsw + pmaddwd
    GENERIC = "generic"  # plain widening multiplies, any target
    MMA_F16 = "mma_f16"  # CUDA tensor cores, mma.sync m16n8k16 f16 → f32 (float rows; prefill and score)


@irdl_attr_definition
class IsaAttr(EnumAttribute[Isa], SpacedOpaqueSyntaxAttribute):
    """`#tgt<isa vnni512>` (just `isa vnni512` inside a kernel)."""

    name = "tgt.isa"


@irdl_attr_definition
class LayoutAttr(EnumAttribute[Layout], SpacedOpaqueSyntaxAttribute):
    """A weight layout: `stored`, `split` or `tiles` (`llmc.ir.layouts`)."""

    name = "tgt.layout"


@irdl_attr_definition
class StorageType(EnumAttribute[Storage], SpacedOpaqueSyntaxAttribute):
    """A storage type inside `!tgt.weight` (the `llm` dialect's storage names)."""

    name = "tgt.storage"


def _parse_dims(parser: AttrParser) -> list[int]:
    pos = parser.pos
    dims = parser.parse_dimension_list()
    if not dims or any(d < 1 for d in dims):
        parser.raise_error("expected static positive dimensions such as 576x576", pos)
    return dims


@irdl_attr_definition
class WeightType(ParametrizedAttribute, TypeAttribute):
    """A weight in the artifact: `!tgt.weight<576x576, q4_1, split>` (shape, storage, layout)."""

    name = "tgt.weight"
    dims: ArrayAttr[IntAttr] = param_def(ArrayAttr[IntAttr])
    storage_attr: StorageType = param_def(StorageType)
    layout_attr: LayoutAttr = param_def(LayoutAttr)

    def __init__(self, shape: Sequence[int], storage: Storage, layout: Layout = Layout.STORED):
        super().__init__(ArrayAttr([IntAttr(d) for d in shape]), StorageType(storage), LayoutAttr(layout))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(d.data for d in self.dims.data)

    @property
    def storage(self) -> Storage:
        return self.storage_attr.data

    @property
    def layout(self) -> Layout:
        return self.layout_attr.data

    @property
    def nbytes(self) -> int:
        return weight_nbytes(self.storage, self.layout, self.shape)

    def print_parameters(self, printer: Printer) -> None:
        printer.print_string(f"<{'x'.join(map(str, self.shape))}, {self.storage.value}, {self.layout.value}>")

    @classmethod
    def parse_parameters(cls, parser: AttrParser) -> Sequence[Attribute]:
        parser.parse_punctuation("<")
        dims = _parse_dims(parser)
        parser.parse_punctuation(",")
        pos = parser.pos
        storage = parser.parse_identifier()
        parser.parse_punctuation(",")
        layout = parser.parse_identifier()
        parser.parse_punctuation(">")
        try:
            return (ArrayAttr([IntAttr(d) for d in dims]), StorageType(Storage(storage)), LayoutAttr(Layout(layout)))
        except ValueError as e:
            parser.raise_error(f"!tgt.weight: {e}", pos)

    def verify(self) -> None:
        fmt = FORMATS[self.storage]
        if not fmt.is_float and len(self.shape) != 2:
            raise VerifyException(f"!tgt.weight: a {self.storage} weight must be a matrix, got {self.shape}")
        if not fmt.fits(self.shape[-1]):
            raise VerifyException(f"!tgt.weight: rows of {self.shape[-1]} are not whole {self.storage} blocks")
        if self.layout is not Layout.STORED and fmt.is_float:
            raise VerifyException(f"!tgt.weight: the {self.layout} layout is for integer formats, not {self.storage}")


@irdl_attr_definition
class QRowsType(ParametrizedAttribute, TypeAttribute):
    """Activation rows quantized per 32 values (rows x width): to int8, `!tgt.qrows<128x576>`
    (read by `a8` kernels), or to int16 as two int8 planes, `!tgt.qrows<128x576xi16>` (`a16`)."""

    name = "tgt.qrows"
    row_count: IntAttr = param_def(IntAttr)
    width_attr: IntAttr = param_def(IntAttr)
    bits_attr: IntAttr = param_def(IntAttr)

    def __init__(self, rows: int, width: int, bits: int = 8):
        super().__init__(IntAttr(rows), IntAttr(width), IntAttr(bits))

    @property
    def rows(self) -> int:
        return self.row_count.data

    @property
    def width(self) -> int:
        return self.width_attr.data

    @property
    def bits(self) -> int:
        return self.bits_attr.data

    @property
    def layout(self) -> QRowLayout:
        return QRowLayout(self.width, self.bits)

    @property
    def nbytes(self) -> int:
        return self.rows * self.layout.row_bytes

    def print_parameters(self, printer: Printer) -> None:
        printer.print_string(f"<{self.rows}x{self.width}{'' if self.bits == 8 else f'xi{self.bits}'}>")

    @classmethod
    def parse_parameters(cls, parser: AttrParser) -> Sequence[Attribute]:
        parser.parse_punctuation("<")
        pos = parser.pos
        dims = _parse_dims(parser)
        if len(dims) != 2:
            parser.raise_error("!tgt.qrows needs rows x width", pos)
        bits = 8
        element = parser.parse_optional_identifier()
        if element is not None:
            if element != "xi16":
                parser.raise_error(f"!tgt.qrows: expected 'xi16' (int16 rows) or '>', got '{element}'", pos)
            bits = 16
        parser.parse_punctuation(">")
        return (IntAttr(dims[0]), IntAttr(dims[1]), IntAttr(bits))

    def verify(self) -> None:
        if self.width % 32:
            raise VerifyException(f"!tgt.qrows: width {self.width} is not a multiple of 32")
        if self.bits not in (8, 16):
            raise VerifyException(f"!tgt.qrows: {self.bits}-bit rows; int8 or int16 only")


def memref(*shape: int, element_type: Attribute = f32) -> MemRefType:
    return MemRefType(element_type, list(shape))


def dims(value: SSAValue | Attribute) -> tuple[int, ...]:
    """The shape of a buffer: memref dimensions, `(rows, width)` of qrows, a weight's shape."""
    t = value.type if isinstance(value, SSAValue) else value
    if isinstance(t, MemRefType):
        return tuple(t.get_shape())
    if isinstance(t, QRowsType):
        return (t.rows, t.width)
    if isinstance(t, WeightType):
        return t.shape
    raise VerifyException(f"expected a buffer, got {t}")


def row_width(value: SSAValue) -> int:
    return math.prod(dims(value)[1:])


ELEMENT_BYTES = {"f32": 4, "i32": 4, "f16": 2, "i8": 1}


def kv_row_width(head_dim: int, element: Attribute) -> int:
    """Elements of one cache row: `head_dim`, or for an i8 (q8_0) cache the int8 values
    followed by one f32 scale per 32 (`head_dim + head_dim / 8` bytes)."""
    return head_dim + head_dim // 32 * KV_Q8_SCALES if str(element) == "i8" else head_dim


def nbytes(t: Attribute) -> int:
    """Bytes of a buffer type."""
    if isinstance(t, MemRefType):
        return math.prod(t.get_shape()) * ELEMENT_BYTES[str(t.element_type)]
    if isinstance(t, (QRowsType, WeightType)):
        return t.nbytes
    raise VerifyException(f"expected a buffer type, got {t}")


def per_row(t: Attribute) -> str:
    """A row buffer's type without its number of rows: `memref<?x576xf32>`, `!tgt.qrows<?x576>`."""
    if isinstance(t, MemRefType):
        return f"memref<?x{'x'.join(map(str, t.get_shape()[1:]))}x{t.element_type}>"
    if isinstance(t, QRowsType):
        return f"!tgt.qrows<?x{t.width}{'' if t.bits == 8 else f'xi{t.bits}'}>"
    return str(t)


def root(value: SSAValue) -> SSAValue:
    """The buffer a value is a view of."""
    while isinstance(value.owner, (ViewOp, SubviewOp)):
        value = value.owner.source
    return value


def is_quantized(value: SSAValue) -> bool:
    return isinstance(value.type, QRowsType)


Activations = AnyOf((BaseAttr(MemRefType), BaseAttr(QRowsType)))


# ------------------------------------------------------------------ buffers


@irdl_op_definition
class AllocOp(IRDLOperation):
    """An activation buffer in the entry point's arena; `offset` (bytes) is set by `plan-memory`.

    ```mlir
    %x = tgt.alloc offset 2304 : memref<128x576xf32>
    %h = tgt.alloc offset 0 : !tgt.qrows<128x576>
    ```
    """

    name = "tgt.alloc"
    offset = opt_prop_def(IntegerAttr[I64])
    result = result_def(Activations)
    traits = traits_def(Pure())
    assembly_format = "(`offset` $offset^)? attr-dict `:` type($result)"

    def __init__(self, result_type: Attribute):
        super().__init__(result_types=[result_type])

    @property
    def nbytes(self) -> int:
        return nbytes(self.result.type)


@irdl_op_definition
class ViewOp(IRDLOperation):
    """The same float buffer in another shape (what `llm.reshape` becomes).

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
        if a[0] != b[0] or math.prod(a) != math.prod(b):
            raise VerifyException(f"tgt.view: {self.source.type} and {self.result.type} differ in rows or elements")


@irdl_op_definition
class SubviewOp(IRDLOperation):
    """One entry of a buffer's leading dimension, e.g. one layer of the KV cache.

    ```mlir
    %k_cache_3 = tgt.subview %k_cache[3] : memref<30x3x4096x64xf32> -> memref<3x4096x64xf32>
    ```
    """

    name = "tgt.subview"
    source = operand_def(MemRefType)
    index = prop_def(IntegerAttr[I64])
    result = result_def(MemRefType)
    traits = traits_def(Pure())
    assembly_format = "$source `[` $index `]` attr-dict `:` type($source) `->` type($result)"

    def __init__(self, source: SSAValue, index: int):
        super().__init__(operands=[source], properties={"index": IntegerAttr(index, i64)},
                         result_types=[memref(*dims(source)[1:], element_type=source.type.element_type)])

    @property
    def byte_offset(self) -> int:
        return self.index.value.data * nbytes(self.result.type)

    def verify_(self) -> None:
        src, dst = dims(self.source), dims(self.result)
        if src[1:] != dst or not 0 <= self.index.value.data < src[0]:
            raise VerifyException(f"tgt.subview: [{self.index.value.data}] of {self.source.type} is not {self.result.type}")


@irdl_op_definition
class WeightOp(IRDLOperation):
    """A weight of the artifact's weight file, by symbol; its type says storage and layout.

    ```mlir
    %wq = tgt.weight @blk.0.attn_q : !tgt.weight<576x576, q4_1, tiles>
    ```
    """

    name = "tgt.weight"
    sym = prop_def(SymbolRefAttr)
    result = result_def(WeightType)
    traits = traits_def(Pure())
    assembly_format = "$sym attr-dict `:` type($result)"

    def __init__(self, sym: str, weight_type: WeightType):
        super().__init__(properties={"sym": SymbolRefAttr(sym)}, result_types=[weight_type])
        self.result.name_hint = sym.replace(".", "_")

    @property
    def sym_name(self) -> str:
        return self.sym.root_reference.data

    @property
    def weight_type(self) -> WeightType:
        assert isinstance(self.result.type, WeightType)
        return self.result.type


# ------------------------------------------------------------------ kernels


class Kernel(IRDLOperation):
    """A kernel: its declared operands, in order, are the arguments of its function.

    Every thread of an entry point calls every kernel, which takes its share of the work
    (it also receives `tid`, `nth`). `ROWS`: the operands it reads
    or writes `rows` rows of, whatever number of rows their buffers hold (so one
    function serves every entry point). `WRITES`: the operands it writes (it may read
    every operand): codegen puts a barrier between two kernels only where one writes
    what the other touches. `SYNCS`: the kernel also receives the entry point's barrier
    (`i64* sync`) and waits on it between phases of its own.
    """

    ROWS: ClassVar[tuple[str, ...]] = ("x", "out")
    WRITES: ClassVar[tuple[str, ...]] = ("out",)
    SYNCS: ClassVar[bool] = False

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

    def _quantized_kernel(self, x: SSAValue, *weights: SSAValue) -> None:
        """An a8 or a16 kernel (quantized input) needs integer weight formats, and in a packed layout
        an isa; AMX tiles read int8 rows only."""
        if not is_quantized(x):
            return
        isa = getattr(self, "isa")
        if isa is not None and isa.data is Isa.AMX and x.type.bits != 8:
            self._fail(f"isa amx reads int8 rows, not {x.type}")
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
class MatmulOp(Kernel):
    """`out[t] (+)= norm?(x[t]) · wᵀ + bias`, for every row or only the last one.

    `x` is float rows (`a32`: weights dequantized in registers) or quantized rows (`a8`, or
    `a16` on `!tgt.qrows<…xi16>`: integer dot products with the `isa` that `pack` chose).
    - `norm %g eps E`: RMS-normalize each row of float `x` with weight `g` first;
    - `accumulate`: add into `out` instead of overwriting it (a fused residual add);
    - `last_row`: compute only row `n-1` of `x`, into row 0 of `out` (the LM head);
    - `softcap C`: each result `y` becomes `C · tanh(y / C)` (Gemma 2's logits).

    ```mlir
    tgt.matmul %h, %wq -> %q rows %n isa amx : !tgt.qrows<128x576>, !tgt.weight<576x576, q4_1, tiles> -> memref<128x576xf32>
    tgt.matmul %x, %wq -> %q rows %n norm %g eps 1.000000e-05 : memref<128x576xf32>, !tgt.weight<576x576, f32, stored> norm !tgt.weight<576, f32, stored> -> memref<128x576xf32>
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
    isa = opt_prop_def(IsaAttr)
    irdl_options = (AttrSizedOperandSegments(as_property=True),)
    assembly_format = (
        "$x `,` $weight `->` $out `rows` $rows (`bias` $bias^)? (`norm` $norm^ `eps` $eps)? "
        "(`accumulate` $accumulate^)? (`last_row` $last_row^)? (`softcap` $softcap^)? (`isa` $isa^)? attr-dict `:` "
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
        self._quantized_kernel(self.x, self.weight)


@irdl_op_definition
class SwigluOp(Kernel):
    """The gated feed-forward input: `out[t] = silu(x[t]·w_gateᵀ) * (x[t]·w_upᵀ)` (with `gelu`:
    GELU's tanh approximation instead of silu), norm optional.

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
    gelu = opt_prop_def(UnitAttr)
    isa = opt_prop_def(IsaAttr)
    assembly_format = (
        "$x `,` $gate `,` $up `->` $out `rows` $rows (`norm` $norm^ `eps` $eps)? (`gelu` $gelu^)? (`isa` $isa^)? "
        "attr-dict `:` type($x) `,` type($gate) `,` type($up) (`norm` type($norm)^)? `->` type($out)"
    )

    def __init__(self, x: SSAValue, gate: SSAValue, up: SSAValue, out: SSAValue, rows: SSAValue, *,
                 norm: SSAValue | None = None, eps: float | None = None, gelu: bool = False):
        props = _eps_props(eps if norm is not None else None)
        if gelu:
            props["gelu"] = UnitAttr()
        super().__init__(operands=[x, gate, up, out, rows, [norm] if norm else []], properties=props)

    def verify_(self) -> None:
        n, k = dims(self.gate)
        self._same("gate vs up shape", (n, k), dims(self.up))
        self._same("reduction dimension (x vs gate)", row_width(self.x), k)
        self._same("output width (gate vs out)", n, row_width(self.out))
        self._float_weight("norm", self.norm, k)
        if self.norm is not None and is_quantized(self.x):
            self._fail("quantized rows cannot be normalized: the producer of the rows normalizes")
        self._quantized_kernel(self.x, self.gate, self.up)


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
    leaves its share of the positions' result for the merge (flash-decoding).

    ```mlir
    tgt.attention %q, %k, %v, %kc, %vc -> %a positions %positions partials %p rows %n rope <theta 100000.0> : memref<128x9x64xf32>, memref<128x3x64xf32>, memref<128x3x64xf32>, memref<3x4096x64xf16>, memref<3x4096x64xf16> -> !tgt.qrows<128x576>, memref<128xi32>, memref<64x4x9x66xf32>
    ```
    """

    name = "tgt.attention"
    ROWS: ClassVar[tuple[str, ...]] = ("q", "k", "v", "out", "positions", "slots")
    WRITES: ClassVar[tuple[str, ...]] = ("q", "k", "k_cache", "v_cache", "out", "partials")  # rope: q, k in place
    SYNCS: ClassVar[bool] = True
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


@irdl_op_definition
class SiluOp(_Unary):
    """`out = x · sigmoid(x)` on the first `rows` rows: `tgt.silu %g -> %s rows %n : memref<128x1536xf32>`."""

    name = "tgt.silu"


@irdl_op_definition
class GeluOp(_Unary):
    """`out = gelu(x)` (tanh approximation) on the first `rows` rows: `tgt.gelu %g -> %s rows %n : memref<128x9216xf32>`."""

    name = "tgt.gelu"


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


# Generic kernels: what `llm`'s primitive ops become where `optimize` raised nothing better.
# One loop per element, no vectors: correct on any rows, and slower than the fused kernels.
BINARY_KINDS = ("add", "sub", "mul", "div", "pow", "maximum", "minimum")
UNARY_KINDS = ("neg", "abs", "sqrt", "rsqrt", "reciprocal", "exp", "tanh", "sigmoid", "relu", "cos", "sin")
REDUCE_KINDS = ("sum", "mean", "max")


def _check_kind(op: Kernel, kinds: tuple[str, ...]) -> None:
    if op.kind.data not in kinds:
        op._fail(f"kind must be one of {', '.join(kinds)}, got {op.kind.data!r}")


def broadcast_operand(op: Kernel, what: str, value: SSAValue, out: SSAValue) -> None:
    """A generic kernel's input: float rows `[rows, width]` or `[rows, 1]` (as many rows as
    `out`), or an f32 weight `[width]`."""
    t = value.type
    rows, width = dims(out)
    if isinstance(t, WeightType):
        if t.storage is not Storage.F32 or t.shape != (width,):
            op._fail(f"{what} must be !tgt.weight<{width}, f32, stored>, got {t}")
    elif not (isinstance(t, MemRefType) and len(dims(value)) == 2 and dims(value)[0] == rows
              and dims(value)[1] in (width, 1) and t.element_type == f32):
        op._fail(f"{what} must be f32 rows memref<{rows}x{width}xf32> or memref<{rows}x1xf32>, or a weight, got {t}")


def _float_rows(op: Kernel, *values: SSAValue) -> None:
    for value in values:
        if len(dims(value)) != 2 or value.type.element_type != f32:
            op._fail(f"generic kernels read and write f32 rows [rows, width], not {value.type}")


@irdl_op_definition
class BinaryOp(Kernel):
    """`out = lhs ⊙ rhs` elementwise on the first `rows` rows (⊙ one of `BINARY_KINDS`), each
    input float rows of `out`'s width, one value per row (`[rows, 1]`), or a weight of one value
    per column.

    ```mlir
    tgt.binary "sub" %x, %m -> %d rows %n : memref<128x64xf32>, memref<128x1xf32> -> memref<128x64xf32>
    ```
    """

    name = "tgt.binary"
    ROWS: ClassVar[tuple[str, ...]] = ("lhs", "rhs", "out")
    kind = prop_def(StringAttr)
    lhs = operand_def(AnyAttr())
    rhs = operand_def(AnyAttr())
    out = operand_def(MemRefType)
    rows = operand_def(IndexType)
    assembly_format = "$kind $lhs `,` $rhs `->` $out `rows` $rows attr-dict `:` type($lhs) `,` type($rhs) `->` type($out)"

    def __init__(self, kind: str, lhs: SSAValue, rhs: SSAValue, out: SSAValue, rows: SSAValue):
        super().__init__(operands=[lhs, rhs, out, rows], properties={"kind": StringAttr(kind)})

    def verify_(self) -> None:
        _check_kind(self, BINARY_KINDS)
        _float_rows(self, self.out)
        for what in ("lhs", "rhs"):
            broadcast_operand(self, what, getattr(self, what), self.out)


@irdl_op_definition
class ScalarOp(Kernel):
    """`out = x ⊙ s` (with `reversed`, `s ⊙ x`) for a constant `s`, on the first `rows` rows.

    ```mlir
    tgt.scalar "add" %m, 1.000000e-06 -> %e rows %n : memref<128x1xf32>
    ```
    """

    name = "tgt.scalar"
    kind = prop_def(StringAttr)
    T: ClassVar = VarConstraint("T", BaseAttr(MemRefType))
    x = operand_def(T)
    value = prop_def(FloatAttr[Float32Type])
    reversed = opt_prop_def(UnitAttr)
    out = operand_def(T)
    rows = operand_def(IndexType)
    assembly_format = "$kind $x `,` $value (`reversed` $reversed^)? `->` $out `rows` $rows attr-dict `:` type($out)"

    def __init__(self, kind: str, x: SSAValue, value: float, out: SSAValue, rows: SSAValue, reversed: bool = False):
        props: dict[str, Attribute] = {"kind": StringAttr(kind), "value": FloatAttr(value, f32)}
        if reversed:
            props["reversed"] = UnitAttr()
        super().__init__(operands=[x, out, rows], properties=props)

    def verify_(self) -> None:
        _check_kind(self, BINARY_KINDS)
        _float_rows(self, self.out)


@irdl_op_definition
class UnaryOp(Kernel):
    """`out = f(x)` elementwise on the first `rows` rows, `f` one of `UNARY_KINDS`.

    ```mlir
    tgt.unary "rsqrt" %e -> %r rows %n : memref<128x1xf32>
    ```
    """

    name = "tgt.unary"
    kind = prop_def(StringAttr)
    T: ClassVar = VarConstraint("T", BaseAttr(MemRefType))
    x = operand_def(T)
    out = operand_def(T)
    rows = operand_def(IndexType)
    assembly_format = "$kind $x `->` $out `rows` $rows attr-dict `:` type($out)"

    def __init__(self, kind: str, x: SSAValue, out: SSAValue, rows: SSAValue):
        super().__init__(operands=[x, out, rows], properties={"kind": StringAttr(kind)})

    def verify_(self) -> None:
        _check_kind(self, UNARY_KINDS)
        _float_rows(self, self.out)


@irdl_op_definition
class ReduceOp(Kernel):
    """One value per row: the sum, mean or maximum of each of the first `rows` rows.

    ```mlir
    tgt.reduce "mean" %sq -> %m rows %n : memref<128x64xf32> -> memref<128x1xf32>
    ```
    """

    name = "tgt.reduce"
    kind = prop_def(StringAttr)
    x = operand_def(MemRefType)
    out = operand_def(MemRefType)
    rows = operand_def(IndexType)
    assembly_format = "$kind $x `->` $out `rows` $rows attr-dict `:` type($x) `->` type($out)"

    def __init__(self, kind: str, x: SSAValue, out: SSAValue, rows: SSAValue):
        super().__init__(operands=[x, out, rows], properties={"kind": StringAttr(kind)})

    def verify_(self) -> None:
        _check_kind(self, REDUCE_KINDS)
        _float_rows(self, self.x, self.out)
        if len(dims(self.out)) != 2 or dims(self.out)[1] != 1 or dims(self.out)[0] != dims(self.x)[0]:
            self._fail(f"out must be memref<{dims(self.x)[0]}x1xf32>, got {self.out.type}")


KERNELS: tuple[type[Kernel], ...] = (
    EmbeddingOp, RMSNormOp, QuantizeOp, MatmulOp, SwigluOp, RopeOp, AttentionOp, AddOp, MulOp, SiluOp, GeluOp,
    MoeOp, BinaryOp, ScalarOp, UnaryOp, ReduceOp,
)

TGT = Dialect(
    "tgt",
    [AllocOp, ViewOp, SubviewOp, WeightOp, *KERNELS],
    [TargetAttr, IsaAttr, LayoutAttr, StorageType, WeightType, QRowsType],
)
