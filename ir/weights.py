"""The weight store: what `llm.weight @name` refers to.

Frontends fill a `WeightStore` with `Weight` entries that point into the model file
(numpy memory maps, nothing read until used); the IR names them by symbol, and the
interpreters and the packager ask the store for a weight in a storage type:

    store.f32("blk.0.attn_q")               # as stored, dequantized
    store.encode("blk.0.attn_q", Storage.Q8_0)   # requantized: codes and fields
    store.f32("blk.0.attn_q", Storage.Q8_0)      # what a q8_0 artifact computes with
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from llmc.ir.formats import FORMATS, QuantizedTensor, Storage, float_array, to_float_storage


@dataclass(frozen=True)
class Weight:
    """One tensor of the model as it is stored.

    `shape` is the logical shape, outermost first (`[out, in]` for a matrix). `data` is a
    view of the file: the typed array for f32/f16 (bf16 as uint16), `uint8[rows, row_bytes]`
    for block-quantized types. `row_order`, when set, says which stored row becomes each
    logical row (how the GGUF frontend undoes llama.cpp's Q/K permutation without copying).
    """

    name: str
    storage: Storage
    shape: tuple[int, ...]
    data: np.ndarray
    row_order: np.ndarray | None = None

    def rows(self) -> np.ndarray:
        """The stored data with rows in logical order (still in the storage format)."""
        return self.data if self.row_order is None else self.data[self.row_order]

    def row_slice(self, name: str, start: int, stop: int) -> Weight:
        """Rows `start:stop` of this matrix as a weight of its own (a fused QKV or gate-up tensor's part)."""
        return Weight(name, self.storage, (stop - start, *self.shape[1:]), self.rows()[start:stop])

    def matrix_shape(self) -> tuple[int, int]:
        return (int(np.prod(self.shape[:-1])) if len(self.shape) > 1 else 1, self.shape[-1])

    def to_f32(self) -> np.ndarray:
        """The tensor dequantized to float32, in its logical shape."""
        if self.storage.is_float:
            return float_array(self.storage, self.rows()).reshape(self.shape)
        return self.quantized().dequantize().reshape(self.shape)

    def quantized(self) -> QuantizedTensor:
        """Codes and fields of a block-quantized tensor, rows in logical order."""
        return FORMATS[self.storage].from_blocks(self.rows(), self.matrix_shape())

    def encode(self, storage: Storage) -> np.ndarray | QuantizedTensor:
        """The tensor in `storage`: an array for float types, codes and fields for integer ones.

        The stored data is used as it is when the types agree; otherwise the tensor is
        dequantized and converted (floats) or quantized round-to-nearest.
        """
        if storage is self.storage:
            return np.asarray(self.rows()).reshape(self.shape) if storage.is_float else self.quantized()
        if storage.is_float:
            return to_float_storage(storage, self.to_f32())
        return FORMATS[storage].quantize(self.to_f32().reshape(self.matrix_shape()))


def decoded_f32(encoded: np.ndarray | QuantizedTensor, storage: Storage, shape: tuple[int, ...]) -> np.ndarray:
    """float32 values of `Weight.encode`'s result."""
    if isinstance(encoded, QuantizedTensor):
        return encoded.dequantize().reshape(shape)
    return float_array(storage, encoded).reshape(shape)


@dataclass
class WeightStore(Mapping[str, Weight]):
    """The weights of one model by symbol name, with a cache of dequantized tensors (`cache`
    False: none, each use decodes again, so only the tensors in use take memory)."""

    source: Path
    entries: dict[str, Weight] = field(default_factory=dict)
    cache: bool = True
    _f32: dict[tuple[str, Storage], np.ndarray] = field(default_factory=dict, repr=False)
    _quantized: dict[tuple[str, Storage], QuantizedTensor] = field(default_factory=dict, repr=False)

    def add(self, weight: Weight) -> None:
        self.entries[weight.name] = weight

    def encode(self, name: str, storage: Storage | None = None) -> np.ndarray | QuantizedTensor:
        weight = self.entries[name]
        return weight.encode(storage or weight.storage)

    def quantized(self, name: str, storage: Storage) -> QuantizedTensor:
        """Codes and fields of `name` in the integer format `storage`, computed once."""
        key = (name, storage)
        if key not in self._quantized:
            encoded = self.encode(name, storage)
            assert isinstance(encoded, QuantizedTensor), f"{storage} is not an integer format"
            if not self.cache:
                return encoded
            self._quantized[key] = encoded
        return self._quantized[key]

    def f32(self, name: str, storage: Storage | None = None) -> np.ndarray:
        """The float32 values of `name` kept in `storage` (default: as stored), computed once."""
        weight = self.entries[name]
        storage = storage or weight.storage
        key = (name, storage)
        if key in self._f32:
            return self._f32[key]
        if storage.is_float:
            encoded = weight.rows() if storage is weight.storage else weight.encode(storage)
            values = decoded_f32(encoded, storage, weight.shape)
        else:
            values = self.quantized(name, storage).dequantize().reshape(weight.shape)
        if self.cache:
            self._f32[key] = values
        return values

    def __getitem__(self, name: str) -> Weight:
        return self.entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)
