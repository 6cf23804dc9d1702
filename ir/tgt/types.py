"""The `tgt` dialect's attributes and types: the target, instruction sets, weight layouts,
`!tgt.weight` and `!tgt.qrows`; and the buffer helpers (shapes, byte sizes, KV cache rows).

```mlir
builtin.module attributes {tgt.target = #tgt.target<cpu, "x86_64", "sapphirerapids", ["avx2", "avx512vnni"]>} {...}
%wq = tgt.weight @blk.0.attn_q : !tgt.weight<576x576, q4_1, tiles>
%h = tgt.alloc offset 2304 : !tgt.qrows<1x576>
```
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

from xdsl.dialects.builtin import (
    ArrayAttr,
    Float32Type,
    IntAttr,
    MemRefType,
    StringAttr,
)
from xdsl.dialects.utils.enum_attribute import EnumAttribute
from xdsl.ir import Attribute, ParametrizedAttribute, SpacedOpaqueSyntaxAttribute, SSAValue, TypeAttribute
from xdsl.irdl import (
    AnyOf,
    BaseAttr,
    irdl_attr_definition,
    param_def,
)
from xdsl.parser import AttrParser
from xdsl.printer import Printer
from xdsl.utils.exceptions import VerifyException

from llmc.abi import ELEMENT_BYTES, kv_q8_row_bytes
from llmc.ir.formats import FORMATS, Storage
from llmc.ir.layouts import Layout, QRowLayout, weight_nbytes

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
ATTENTION_SPLIT_ROWS = 4  # up to this many rows, attention's threads share cache positions
SCREEN_COLUMNS = 2048  # a screened matmul's blocks of columns (`tgt.matmul … screen M`): each judged on its own


# ------------------------------------------------------------------ types


class Isa(StrEnum):
    """The instructions a matmul kernel is built on, chosen by `pack` from the target: the integer
    dot product of an `a8` or `a16` kernel (and by the entry point's rows, `amx` for prefill and score
    where the target has AMX-INT8), or on CUDA, tensor cores for the float-row prefill and score GEMMs."""

    AMX = "amx"  # AMX-INT8 tiles for blocks of 16 rows, VNNI-512 for the rest
    VNNI512 = "vnni512"  # AVX-512 VNNI vpdpbusd on 512-bit vectors
    VNNI256 = "vnni256"  # AVX-VNNI vpdpbusd on 256-bit vectors
    AVX2 = "avx2"  # pmaddubsw + pmaddwd (8-bit codes and int16 rows: pmaddwd on 16-bit words)
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


def kv_row_width(head_dim: int, element: Attribute) -> int:
    """Elements of one cache row: `head_dim`, or for an i8 (q8_0) cache the int8 values
    followed by one f32 scale per 32 (`llmc.abi.kv_q8_row_bytes`)."""
    return kv_q8_row_bytes(head_dim) if str(element) == "i8" else head_dim


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


def is_quantized(value: SSAValue) -> bool:
    return isinstance(value.type, QRowsType)


Activations = AnyOf((BaseAttr(MemRefType), BaseAttr(QRowsType)))
