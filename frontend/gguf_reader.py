"""A bounded GGUF parser: every count, length, type, offset and size is checked before use.

Model files come from strangers. The `gguf` package's reader trusts them (a 43-byte
file with an array length of 2^63 hangs it, nested arrays recurse without bound,
misaligned tensor data passes), so llmc reads the header, the metadata and the tensor
table itself, against the file size and fixed limits, before allocating or mapping
anything. Errors are `ModelFormatError`s that name the field and its byte offset:

    model.gguf: metadata key 'tokenizer.ggml.tokens' at byte 1234: array of 2^63 elements exceeds the file

Tensor data stays in the file: `GGUFFile.tensors` holds numpy memory-map views.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from llmc.errors import ModelFormatError

MAGIC = b"GGUF"
VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 16
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY_BYTES = 1 << 16
MAX_NAME_BYTES = 1 << 10
MAX_ARRAY_DEPTH = 2  # an array of arrays is allowed; deeper nesting is not
MAX_ENTRIES = 1 << 16  # metadata keys, and tensors: real files have tens and thousands
MAX_STRINGS = 1 << 20  # a string array (vocabularies, merges): real files hold up to ~300k

# GGUF metadata value types: id → (name, struct format or None for string/array)
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "<u1", 10: "<u8", 11: "<i8", 12: "<f8"}

# every ggml tensor type: id → (name, weights per block, bytes per block), from the gguf
# package's constants; which of them llmc computes is the frontend's business
TENSOR_TYPES = {int(t): (t.name, *GGML_QUANT_SIZES[t]) for t in GGMLQuantizationType if t in GGML_QUANT_SIZES}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type_name: str
    shape: tuple[int, ...]  # outermost first (GGUF lists dimensions innermost first)
    data: np.ndarray  # uint8 view of the tensor's bytes, rows × row bytes (1-D for vectors)


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: list[TensorInfo]


_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class _Cursor:
    """Reads little-endian values from the mapped file, never past its end.

    Works on a memoryview with `struct.unpack_from`, and names the field only when it
    fails, so a 300k-entry vocabulary parses in a fraction of a second.
    """

    def __init__(self, path: Path, data: np.ndarray):
        self.path = path
        self.data = data
        self.buf = memoryview(data)
        self.size = data.size
        self.pos = 0

    def fail(self, what: str, problem: str, at: int | None = None) -> ModelFormatError:
        return ModelFormatError(self.path, f"{what} at byte {self.pos if at is None else at}: {problem}")

    def need(self, n: int, what: str) -> None:
        if n > self.size - self.pos:
            raise self.fail(what, f"needs {n} bytes, the file has {self.size - self.pos} left (truncated?)")

    def take(self, n: int, what: str) -> bytes:
        self.need(n, what)
        out = bytes(self.buf[self.pos : self.pos + n])
        self.pos += n
        return out

    def scalar(self, fmt: str, what: str) -> Any:
        size = struct.calcsize(fmt)
        self.need(size, what)
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def u32(self, what: str) -> int:
        self.need(4, what)
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return value

    def u64(self, what: str) -> int:
        self.need(8, what)
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return value

    def string(self, what: str, limit: int) -> str:
        start = self.pos
        length = self.u64(what + " length")
        if length > self.size - self.pos:
            raise self.fail(what, f"string of {length} bytes exceeds the file", start)
        if length > limit:
            raise self.fail(what, f"string of {length} bytes exceeds the limit of {limit}", start)
        try:
            text = str(self.buf[self.pos : self.pos + length], "utf-8")
        except UnicodeDecodeError as e:
            raise self.fail(what, f"string is not UTF-8 ({e.reason})", start) from None
        self.pos += length
        return text

    def strings(self, count: int, what: str) -> list[str]:
        """`count` strings in a row: the hot loop of vocabularies and merges."""
        buf, pos, size, out = self.buf, self.pos, self.size, []
        unpack = _U64.unpack_from
        for i in range(count):
            if size - pos < 8:
                self.pos = pos
                raise self.fail(f"{what}[{i}]", "string length runs past the end of the file (truncated?)")
            (length,) = unpack(buf, pos)
            if length > size - pos - 8:
                raise self.fail(f"{what}[{i}]", f"string of {length} bytes exceeds the file", pos)
            try:
                out.append(str(buf[pos + 8 : pos + 8 + length], "utf-8"))
            except UnicodeDecodeError as e:
                raise self.fail(f"{what}[{i}]", f"string is not UTF-8 ({e.reason})", pos) from None
            pos += 8 + length
        self.pos = pos
        return out

    def value(self, type_id: int, what: str, depth: int = 0) -> Any:
        if type_id in _SCALARS:
            return self.scalar(_SCALARS[type_id], what)
        if type_id == _STRING:
            return self.string(what, self.size)
        if type_id == _ARRAY:
            return self.array(what, depth + 1)
        raise self.fail(what, f"unknown value type {type_id}", self.pos - 4)

    def array(self, what: str, depth: int) -> Any:
        start = self.pos
        if depth > MAX_ARRAY_DEPTH:
            raise self.fail(what, f"arrays nested deeper than {MAX_ARRAY_DEPTH} levels", start)
        element_type = self.u32(what + " element type")
        count = self.u64(what + " element count")
        if element_type in _NUMPY:
            dtype = np.dtype(_NUMPY[element_type])
            if count > (self.size - self.pos) // dtype.itemsize:
                raise self.fail(what, f"array of {count} elements exceeds the file", start)
            values = np.frombuffer(self.buf, dtype, count, self.pos)  # a view of the mapped file
            self.pos += count * dtype.itemsize
            return values.astype(bool) if element_type == 7 else values
        if element_type not in (_STRING, _ARRAY):
            raise self.fail(what, f"unknown array element type {element_type}", start)
        # every string takes at least 8 bytes (its length), every nested array 12
        if count > (self.size - self.pos) // (8 if element_type == _STRING else 12):
            raise self.fail(what, f"array of {count} elements exceeds the file", start)
        if element_type == _STRING:
            if count > MAX_STRINGS:  # decoding each string is Python-level work
                raise self.fail(what, f"array of {count} strings exceeds {MAX_STRINGS}", start)
            return self.strings(count, what)
        if count > MAX_ENTRIES:  # arrays of arrays are rare; bound the Python-level work
            raise self.fail(what, f"array of {count} arrays exceeds {MAX_ENTRIES}", start)
        return [self.array(what, depth + 1) for _ in range(count)]


def _open(path: Path) -> np.ndarray:
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ModelFormatError(path, f"cannot read: {e.strerror}") from e
    if size < 4:
        raise ModelFormatError(path, f"not a GGUF file ({size} bytes)")
    try:
        return np.memmap(path, dtype=np.uint8, mode="r")
    except (OSError, ValueError) as e:
        raise ModelFormatError(path, f"cannot map: {e}") from e


def read_gguf(path: Path) -> GGUFFile:
    """Parse and check a GGUF file; tensor data is mapped, not read."""
    data = _open(path)
    c = _Cursor(path, data)
    magic = c.take(4, "magic")
    if magic != MAGIC:
        raise ModelFormatError(path, f"not a GGUF file (magic {magic!r} at byte 0, expected {MAGIC!r})")
    version = c.u32("version")
    if version not in VERSIONS:
        raise c.fail("version", f"GGUF version {version} is not supported (supported: 2, 3)", 4)
    tensor_count = c.u64("tensor count")
    kv_count = c.u64("metadata count")
    # each metadata entry takes ≥ 13 bytes (key length, ≥1 key byte, type, ≥1 value byte),
    # each tensor entry ≥ 29 (name length, ≥1 name byte, dims count, one dim, type, offset)
    if kv_count > min(MAX_ENTRIES, (c.size - c.pos) // 13):
        raise c.fail("metadata count", f"{kv_count} entries cannot fit in the file or exceed {MAX_ENTRIES}", 16)
    if tensor_count > min(MAX_ENTRIES, (c.size - c.pos) // 29):
        raise c.fail("tensor count", f"{tensor_count} tensors cannot fit in the file or exceed {MAX_ENTRIES}", 8)

    metadata: dict[str, Any] = {}
    for _ in range(kv_count):
        start = c.pos
        key = c.string("metadata key", MAX_KEY_BYTES)
        if key in metadata:
            raise c.fail(f"metadata key '{key}'", "duplicate key", start)
        type_id = c.u32(f"metadata key '{key}' type")
        metadata[key] = c.value(type_id, f"metadata key '{key}'")

    alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
    if type(alignment) is not int or alignment < 1 or alignment > MAX_ALIGNMENT or alignment & (alignment - 1):
        found = f"an array of {len(alignment)}" if isinstance(alignment, (list, np.ndarray)) else repr(alignment)
        raise ModelFormatError(path, f"metadata key 'general.alignment' should be a power of two ≤ 65536, got {found}")

    entries = []
    names: set[str] = set()
    for _ in range(tensor_count):
        start = c.pos
        name = c.string("tensor name", MAX_NAME_BYTES)
        what = f"tensor '{name}'"
        if name in names:
            raise c.fail(what, "duplicate tensor name", start)
        names.add(name)
        n_dims = c.u32(what + " dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise c.fail(what, f"{n_dims} dimensions (1..{MAX_DIMS} allowed)", start)
        dims = [c.u64(what + " dimension") for _ in range(n_dims)]
        type_id = c.u32(what + " type")
        offset = c.u64(what + " data offset")
        entries.append((name, dims, type_id, offset, start))

    data_start = -(-c.pos // alignment) * alignment
    tensors = []
    spans = []
    for name, dims, type_id, offset, start in entries:
        what = f"tensor '{name}'"
        if type_id not in TENSOR_TYPES:
            raise c.fail(what, f"tensor type {type_id} is not supported", start)
        type_name, block, block_bytes = TENSOR_TYPES[type_id]
        if any(d < 1 for d in dims):
            raise c.fail(what, f"dimension of size 0 in {dims}", start)
        if dims[0] % block:
            raise c.fail(what, f"row of {dims[0]} {type_name} weights is not a whole number of {block}-weight blocks",
                         start)
        row_bytes = dims[0] // block * block_bytes
        rows = 1
        for d in dims[1:]:
            rows *= d
        nbytes = rows * row_bytes  # Python integers: no overflow; compared with the file size below
        if offset % alignment:
            raise c.fail(what, f"data offset {offset} is not a multiple of the alignment {alignment}", start)
        begin = data_start + offset
        if nbytes > c.size or begin > c.size - nbytes:
            raise c.fail(what, f"data {begin}..{begin + nbytes} runs past the end of the file ({c.size} bytes)", start)
        spans.append((begin, begin + nbytes, name))
        view = data[begin : begin + nbytes]
        shape = tuple(reversed(dims))
        tensors.append(TensorInfo(name, type_name, shape, view.reshape(rows, row_bytes) if len(dims) > 1 else view))
    spans.sort()
    for (_, end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < end:
            raise ModelFormatError(path, f"tensor data of '{first}' and '{second}' overlap (bytes {begin}..{end})")
    return GGUFFile(path, version, metadata, tensors)
