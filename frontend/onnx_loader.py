"""Reading an ONNX file that came from a stranger, in work and memory proportional to it.

protobuf turns every message of a file into an object of ~200 bytes however few bytes the
file spends on it: 20 MB of empty nodes (2 bytes each) become 1.75 GB before llmc could
count them, and each node costs the import and the passes milliseconds. `count_items`
walks the file's wire format first (no objects made, messages entered through onnx's own
descriptors) and `load_model` refuses a file with more nodes, messages or fields than any
exported decoder has, or nesting deeper than protobuf parses, in one line.

What the file declares is checked before it is used: `check_opset` refuses opsets older than
llmc reads, `element_dtype` element types it does not import, and `tensor_array` reads a
tensor only after its declared size (at most 2**40 elements) matches its data; external data
must be a regular file inside the model's directory, read through a bounds-checked memory map.
"""

from __future__ import annotations

import math
import os
import stat
from pathlib import Path

import numpy as np
import onnx
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import DecodeError
from onnx import TensorProto, numpy_helper

from llmc.errors import ModelFormatError

PROTOBUF_LIMIT = 2**31  # bytes: protobuf cannot parse a larger message
MAX_NODES = 2**16  # SmolLM2-135M (30 layers) exported unoptimized has 5,955
MAX_MESSAGES = 2**19  # nodes, attributes, tensors, value infos, dimensions, … (SmolLM2: 60,000)
MAX_FIELDS = 2**20  # every field of every message, names and dimensions included (SmolLM2: 175,000)
MAX_DEPTH = 64  # nested messages (protobuf refuses 100); subgraphs of subgraphs of …
OPSET = 17  # the oldest default-domain opset llmc reads
MAX_ELEMENTS = 2**40  # more elements than any tensor llmc could hold

DTYPES = {  # the element types llmc imports
    TensorProto.FLOAT: np.float32, TensorProto.FLOAT16: np.float16, TensorProto.DOUBLE: np.float64,
    TensorProto.INT64: np.int64, TensorProto.INT32: np.int32, TensorProto.INT16: np.int16,
    TensorProto.INT8: np.int8, TensorProto.UINT8: np.uint8, TensorProto.BOOL: np.bool_,
}


_TEXT = "text"  # a string field: protobuf hands invalid UTF-8 to Python as bytes, so it is refused here


def _nested_fields(descriptor: Descriptor) -> dict[int, Descriptor | str]:
    """A message's fields that the scan enters (messages) or checks (text), by number."""
    return {f.number: f.message_type if f.type == FieldDescriptor.TYPE_MESSAGE else _TEXT for f in descriptor.fields
            if f.type in (FieldDescriptor.TYPE_MESSAGE, FieldDescriptor.TYPE_STRING)}


_FIELDS: dict[Descriptor, dict[int, Descriptor | str]] = {}


def count_items(data: bytes | memoryview) -> tuple[int, int, int]:
    """How many nodes, messages and fields a serialized ModelProto holds, counted until one
    passes its limit. Raises ValueError where the wire format is broken or nests too deep."""
    nodes = messages = fields = 0
    node = onnx.NodeProto.DESCRIPTOR
    todo = [(0, len(data), onnx.ModelProto.DESCRIPTOR, 0)]
    while todo:
        pos, end, descriptor, depth = todo.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"messages nested more than {MAX_DEPTH} deep")
        nested = _FIELDS.get(descriptor)
        if nested is None:
            nested = _FIELDS[descriptor] = _nested_fields(descriptor)
        while pos < end:
            fields += 1
            if fields > MAX_FIELDS:
                return nodes, messages, fields
            key = data[pos]
            if key < 0x80:
                pos += 1
            else:
                key, pos = _varint(data, pos)
            wire = key & 7
            if wire == 2:
                size = data[pos]
                if size < 0x80:
                    pos += 1
                else:
                    size, pos = _varint(data, pos)
                if pos + size > end:
                    raise ValueError("a field runs past its message's end")
                inner = nested.get(key >> 3)
                if inner is _TEXT:
                    if size:
                        str(data[pos:pos + size], "utf-8")  # UnicodeDecodeError is a ValueError
                elif inner is not None:
                    messages += 1
                    nodes += inner is node
                    if messages > MAX_MESSAGES or nodes > MAX_NODES:
                        return nodes, messages, fields
                    todo.append((pos, pos + size, inner, depth + 1))
                pos += size
            elif wire == 0:
                _, pos = _varint(data, pos)
            elif wire == 1:
                pos += 8
            elif wire == 5:
                pos += 4
            else:
                raise ValueError(f"wire type {wire} (groups are not ONNX)")
        if pos != end:
            raise ValueError("a field runs past its message's end")
    return nodes, messages, fields


def _varint(data: bytes | memoryview, pos: int) -> tuple[int, int]:
    byte = data[pos]
    if byte < 0x80:
        return byte, pos + 1
    value, shift = byte & 0x7F, 7
    while True:
        pos += 1
        if shift > 63:
            raise ValueError("a varint longer than 10 bytes")
        byte = data[pos]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos + 1
        shift += 7


def load_model(path: Path) -> onnx.ModelProto:
    """The ModelProto of `path`, external data not loaded; a file that is too large, too many
    small things or not a model is refused."""
    try:
        size = path.stat().st_size
    except OSError as e:
        raise ModelFormatError(path, f"cannot read the model file: {e.strerror}") from e
    if size >= PROTOBUF_LIMIT:
        raise ModelFormatError(path, f"{size} bytes is more than protobuf's 2 GiB limit for one ONNX file "
                                     f"(large models keep their weights as external data)")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ModelFormatError(path, f"cannot read the model file: {e.strerror}") from e
    try:
        counts = count_items(data)
    except (ValueError, IndexError) as e:
        raise ModelFormatError(path, f"not a valid ONNX ModelProto (truncated or corrupt): {e}") from e
    for what, found, limit in zip(("nodes", "messages", "fields"), counts, (MAX_NODES, MAX_MESSAGES, MAX_FIELDS)):
        if found > limit:
            raise ModelFormatError(path, f"holds more than {limit} {what}, more than any exported decoder llmc "
                                         f"reads (a crafted file?)")
    try:
        model = onnx.ModelProto.FromString(data)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise ModelFormatError(path, f"not a valid ONNX ModelProto (truncated or corrupt): {e}") from e
    if not model.HasField("graph") or model.ir_version <= 0:
        raise ModelFormatError(path, "not an ONNX model (no graph or IR version)")
    return model


def check_opset(model: onnx.ModelProto, source: Path) -> None:
    """Refuse a model whose default-domain opset is missing or older than `OPSET`."""
    versions = {o.domain: o.version for o in model.opset_import}
    opset = versions.get("", versions.get("ai.onnx"))
    if opset is None or opset < OPSET:
        raise ModelFormatError(source, f"opset {opset if opset is not None else 'missing'}: llmc reads opset "
                                       f"{OPSET} and later (re-export, or convert with onnx.version_converter)")


def element_dtype(source: Path, elem: int, what: str) -> np.dtype:
    """The numpy dtype of ONNX element type `elem` (of `what`: a tensor, a value, a Cast's target)."""
    found = DTYPES.get(elem)
    if found is None:
        kind = TensorProto.DataType.Name(elem) if elem in TensorProto.DataType.values() else str(elem)
        raise ModelFormatError(source, f"{what} has element type {kind}, which llmc does not import "
                                       f"(float, float16, double, int8/16/32/64, uint8, bool)")
    return np.dtype(found)


def _inside(source: Path, directory: Path, location: str, name: str) -> Path:
    """The external-data file `location` of tensor `name`, refused unless it is inside `directory`."""
    parts = location.replace("\\", "/").split("/")
    if not location or "\0" in location or os.path.isabs(location) or location.startswith(("/", "\\")) \
            or ":" in parts[0]:
        raise ModelFormatError(source, f"tensor '{name}': external data location '{location}' is not a path "
                                       f"relative to the model's directory; refusing to read it")
    if ".." in parts:
        raise ModelFormatError(source, f"tensor '{name}': external data location '{location}' leaves the model's "
                                       f"directory; refusing to read it")
    root = os.path.realpath(directory)
    resolved = os.path.realpath(os.path.join(root, location))
    if os.path.commonpath([root, resolved]) != root:
        raise ModelFormatError(source, f"tensor '{name}': external data '{location}' resolves outside the model's "
                                       f"directory ({resolved}); refusing to read it")
    return Path(resolved)


def tensor_array(t: TensorProto, source: Path, directory: Path) -> np.ndarray:
    """The values of `t`, its declared size checked against its data (a memory map for external data)."""
    name = t.name or "<unnamed>"
    dtype = element_dtype(source, t.data_type, f"tensor '{name}'")
    if any(d < 0 for d in t.dims):
        raise ModelFormatError(source, f"tensor '{name}' has a negative dimension in {list(t.dims)}")
    count = math.prod(t.dims)
    if count > MAX_ELEMENTS:
        raise ModelFormatError(source, f"tensor '{name}' declares {list(t.dims)} = {count} elements, more than "
                                       f"2**40")
    shape = tuple(t.dims)
    if t.data_location == TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        path = _inside(source, directory, info.get("location", ""), name)
        try:
            offset, length = int(info.get("offset", 0)), int(info.get("length", count * dtype.itemsize))
            found = path.stat()
        except ValueError as e:
            raise ModelFormatError(source, f"tensor '{name}': malformed external data offset or length") from e
        except OSError as e:
            raise ModelFormatError(source, f"tensor '{name}': cannot read external data '{path.name}': "
                                           f"{e.strerror}") from e
        if not stat.S_ISREG(found.st_mode):  # a folder, a FIFO (opening it waits for a writer), a device
            raise ModelFormatError(source, f"tensor '{name}': external data '{path.name}' is not a regular file")
        size = found.st_size
        if offset < 0 or length != count * dtype.itemsize or offset + length > size:
            raise ModelFormatError(source, f"tensor '{name}': external data at offset {offset}, length {length} "
                                           f"does not hold {shape} {dtype} inside '{path.name}' ({size} bytes)")
        if count == 0:
            return np.zeros(shape, dtype)
        try:
            return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)
        except (OSError, ValueError) as e:
            raise ModelFormatError(source, f"tensor '{name}': cannot map external data '{path.name}': {e}") from e
    stored = len(t.raw_data) // dtype.itemsize if t.HasField("raw_data") else _field_count(t)
    if stored != count or (t.HasField("raw_data") and len(t.raw_data) != count * dtype.itemsize):
        raise ModelFormatError(source, f"tensor '{name}' declares {list(t.dims)} = {count} elements but holds "
                                       f"{stored}")
    return numpy_helper.to_array(t).astype(dtype, copy=False).reshape(shape)


def _field_count(t: TensorProto) -> int:
    fields = {TensorProto.FLOAT: t.float_data, TensorProto.DOUBLE: t.double_data, TensorProto.INT64: t.int64_data}
    return len(fields.get(t.data_type, t.int32_data))
