"""Byte-level builders for crafted (mostly hostile) model files.

`GGUFBuilder` writes a GGUF file field by field — header, metadata, tensor table,
padding, data — and lets a test override any of them (counts, lengths, type ids,
offsets) or splice raw bytes in, so each crafted file differs from a valid tiny model
in one thing. `tiny_gguf()` is that valid tiny model (`gguf_builder_of` reads another family's
valid file into a builder); `Built.where` records the byte offset of every landmark (each
metadata entry, each tensor entry, the data section) so tests can truncate at a chosen
point and check the offsets errors report.

`safetensors_bytes` does the same for the safetensors container (8-byte header
length, JSON header, data).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
from tiny_models import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    TinySpec,
    gguf_name,
    llama_cpp_permute,
    random_weights,
    vocabulary,
)

# GGUF metadata value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
_PACK = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?",
         U64: "<Q", I64: "<q", F64: "<d"}

# ggml tensor types
GGML_F32, GGML_F16, GGML_Q4_0, GGML_Q4_1, GGML_Q8_0 = 0, 1, 2, 3, 8


def u32(v: int) -> bytes:
    return struct.pack("<I", v)


def u64(v: int) -> bytes:
    return struct.pack("<Q", v)


def gstr(s: str | bytes, length: int | None = None) -> bytes:
    """A GGUF string: u64 length, then the bytes (`length` overrides the length field)."""
    raw = s.encode() if isinstance(s, str) else s
    return u64(len(raw) if length is None else length) + raw


@dataclass(frozen=True)
class Arr:
    """An array value: element type and items (items of a nested array are `Arr`s)."""

    elem: int
    items: list
    count: int | None = None  # overrides the element count field


def gvalue(vtype: int, value: Any) -> bytes:
    if vtype in _PACK:
        return struct.pack(_PACK[vtype], value)
    if vtype == STR:
        return gstr(value)
    if vtype == ARR:
        assert isinstance(value, Arr)
        n = len(value.items) if value.count is None else value.count
        return u32(value.elem) + u64(n) + b"".join(gvalue(value.elem, v) for v in value.items)
    raise ValueError(f"no encoding for value type {vtype}")


def gkv(key: str | bytes, vtype: int, value: Any) -> bytes:
    return gstr(key) + u32(vtype) + gvalue(vtype, value)


@dataclass
class Tensor:
    name: str | bytes
    dims: list[int]  # innermost first, as GGUF lists them
    type_id: int
    data: bytes
    offset: int | None = None  # relative to the data section; None: laid out in order, aligned
    n_dims: int | None = None  # overrides the dimension count field


@dataclass
class Built:
    data: bytes
    where: dict[str, int]  # landmark → byte offset


@dataclass
class GGUFBuilder:
    kvs: list[tuple[str | bytes, int, Any] | bytes] = field(default_factory=list)  # bytes: a raw entry
    tensors: list[Tensor] = field(default_factory=list)
    magic: bytes = b"GGUF"
    version: int = 3
    tensor_count: int | None = None
    kv_count: int | None = None
    alignment: int = 32  # the layout the builder uses (general.alignment is whatever kvs say)

    # ---- editing helpers (return self for chaining)

    def copy(self) -> GGUFBuilder:
        return replace(self, kvs=list(self.kvs), tensors=[replace(t) for t in self.tensors])

    def _index(self, key: str) -> int:
        for i, kv in enumerate(self.kvs):
            if isinstance(kv, tuple) and kv[0] == key:
                return i
        raise KeyError(key)

    def set(self, key: str, vtype: int, value: Any) -> GGUFBuilder:
        try:
            self.kvs[self._index(key)] = (key, vtype, value)
        except KeyError:
            self.kvs.append((key, vtype, value))
        return self

    def drop(self, key: str) -> GGUFBuilder:
        del self.kvs[self._index(key)]
        return self

    def value(self, key: str) -> Any:
        return self.kvs[self._index(key)][2]

    def tensor(self, name: str) -> Tensor:
        return next(t for t in self.tensors if t.name == name)

    def drop_tensor(self, name: str) -> GGUFBuilder:
        self.tensors = [t for t in self.tensors if t.name != name]
        return self

    # ---- serialization

    def build(self) -> Built:
        where: dict[str, int] = {}
        out = bytearray(self.magic)
        out += u32(self.version)
        out += u64(len(self.tensors) if self.tensor_count is None else self.tensor_count)
        out += u64(len(self.kvs) if self.kv_count is None else self.kv_count)
        where["metadata"] = len(out)
        for kv in self.kvs:
            if isinstance(kv, bytes):
                where.setdefault("raw kv", len(out))
                out += kv
                continue
            key, vtype, value = kv
            name = key if isinstance(key, str) else key.decode("utf-8", "replace")
            where[f"kv:{name}"] = len(out)
            out += gstr(key) + u32(vtype)
            where[f"value:{name}"] = len(out)
            out += gvalue(vtype, value)
        where["tensor table"] = len(out)
        offsets = []
        cursor = 0  # tensors without an explicit offset are laid out one after another, aligned
        for t in self.tensors:
            if t.offset is None:
                offsets.append(cursor)
                cursor = -(-(cursor + len(t.data)) // self.alignment) * self.alignment
            else:
                offsets.append(t.offset)
        for t, offset in zip(self.tensors, offsets):
            name = t.name if isinstance(t.name, str) else t.name.decode("utf-8", "replace")
            where[f"tensor:{name}"] = len(out)
            n = len(t.dims) if t.n_dims is None else t.n_dims
            out += gstr(t.name) + u32(n) + b"".join(u64(d) for d in t.dims) + u32(t.type_id) + u64(offset)
        data_start = -(-len(out) // self.alignment) * self.alignment
        out += bytes(data_start - len(out))
        where["data"] = data_start
        blob = bytearray(cursor)
        for t, offset in zip(self.tensors, offsets):  # an explicit offset's data goes where it fits, if at all
            name = t.name if isinstance(t.name, str) else t.name.decode("utf-8", "replace")
            where[f"data:{name}"] = data_start + offset
            end = min(offset + len(t.data), cursor)
            if offset < end:
                blob[offset:end] = t.data[: end - offset]
        out += blob
        return Built(bytes(out), where)

    def raw(self) -> bytes:
        return self.build().data


def tiny_gguf(spec: TinySpec = TinySpec(layers=1)) -> GGUFBuilder:
    """The valid tiny model of `tiny_models.write_gguf`, as an editable builder (all f32)."""
    a = spec.arch + "."
    tokens, merges = vocabulary()
    b = GGUFBuilder(kvs=[
        ("general.architecture", STR, spec.arch),
        (a + "block_count", U32, spec.layers),
        (a + "context_length", U32, spec.context_length),
        (a + "embedding_length", U32, spec.hidden),
        (a + "feed_forward_length", U32, spec.ffn),
        (a + "attention.head_count", U32, spec.heads),
        (a + "attention.head_count_kv", U32, spec.kv_heads),
        (a + "rope.dimension_count", U32, spec.head_dim),
        (a + "rope.freq_base", F32, spec.rope_theta),
        (a + "attention.layer_norm_rms_epsilon", F32, spec.rms_eps),
        (a + "vocab_size", U32, len(tokens)),
        ("tokenizer.ggml.model", STR, "gpt2"),
        ("tokenizer.ggml.pre", STR, "smollm"),
        ("tokenizer.ggml.tokens", ARR, Arr(STR, tokens)),
        ("tokenizer.ggml.token_type", ARR, Arr(I32, [3 if t in SPECIAL_TOKENS else 1 for t in tokens])),
        ("tokenizer.ggml.merges", ARR, Arr(STR, merges)),
        ("tokenizer.ggml.bos_token_id", U32, 0),
        ("tokenizer.ggml.eos_token_id", U32, 2),
        ("tokenizer.ggml.add_bos_token", BOOL, False),
        ("tokenizer.chat_template", STR, CHAT_TEMPLATE),
    ])
    for hf, w in random_weights(spec).items():
        name = gguf_name(hf)
        if spec.arch == "llama" and ".attn_q." in name:
            w = llama_cpp_permute(w, spec.heads)
        elif spec.arch == "llama" and ".attn_k." in name:
            w = llama_cpp_permute(w, spec.kv_heads)
        b.tensors.append(Tensor(name, list(reversed(w.shape)), GGML_F32, np.ascontiguousarray(w, "<f4").tobytes()))
    return b


_ARRAY_TYPES = {np.dtype("<u1"): U8, np.dtype("<i4"): I32, np.dtype("<u4"): U32, np.dtype("<f4"): F32,
                np.dtype("<i8"): I64, np.dtype("<u8"): U64, np.dtype("<f8"): F64, np.dtype(bool): BOOL}


def gguf_builder_of(path: Path) -> GGUFBuilder:
    """A valid GGUF file (as `tiny_models.write_gguf` writes for any family) as an editable builder:
    its metadata in the types the values read back as, its tensors as they are."""
    from llmc.frontend.gguf_reader import TENSOR_TYPES, read_gguf

    type_ids = {name: type_id for type_id, (name, *_) in TENSOR_TYPES.items()}
    gguf = read_gguf(path)
    kvs: list = []
    for key, value in gguf.metadata.items():
        if isinstance(value, np.ndarray):
            kvs.append((key, ARR, Arr(_ARRAY_TYPES[value.dtype], value.tolist())))
        elif isinstance(value, list):
            kvs.append((key, ARR, Arr(STR, value)))
        elif type(value) is int:
            kvs.append((key, U32 if 0 <= value < 2**32 else I64, value))
        else:
            kvs.append((key, {bool: BOOL, float: F64, str: STR}[type(value)], value))
    tensors = [Tensor(t.name, list(reversed(t.shape)), type_ids[t.type_name], bytes(t.data))
               for t in gguf.tensors]
    return GGUFBuilder(kvs=kvs, tensors=tensors)


# ------------------------------------------------------------------ safetensors


def safetensors_bytes(header: dict | bytes | str, data: bytes, header_len: int | None = None) -> bytes:
    """8-byte little-endian header length, the JSON header (a dict is dumped), the data."""
    if isinstance(header, dict):
        header = json.dumps(header)
    raw = header.encode() if isinstance(header, str) else header
    return u64(len(raw) if header_len is None else header_len) + raw + data


def safetensors_of(tensors: dict[str, np.ndarray]) -> tuple[dict, bytes]:
    """A header dict and data blob for these arrays (f32), laid out in order."""
    header: dict = {}
    blob = bytearray()
    for name, array in tensors.items():
        raw = np.ascontiguousarray(array, "<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(array.shape), "data_offsets": [len(blob), len(blob) + len(raw)]}
        blob += raw
    return header, bytes(blob)
