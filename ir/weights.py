"""The weight store: what `llm.weight @name` refers to.

Frontends fill a `WeightStore` with `Weight` entries that point into the model file
(numpy memory maps, nothing read until used); the IR names them by symbol, and the
interpreter, quantizer and packers ask the store for their data.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, quants

from llmc.ir.llm import Storage

_GGML_TYPE = {
    Storage.Q8_0: GGMLQuantizationType.Q8_0,
    Storage.Q4_0: GGMLQuantizationType.Q4_0,
    Storage.Q4_1: GGMLQuantizationType.Q4_1,
    Storage.Q4_K: GGMLQuantizationType.Q4_K,
    Storage.Q6_K: GGMLQuantizationType.Q6_K,
}


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

    def to_f32(self) -> np.ndarray:
        """The tensor dequantized to float32, in its logical shape."""
        raw = self.rows()
        if self.storage is Storage.F32:
            out = np.asarray(raw, dtype=np.float32)
        elif self.storage is Storage.F16:
            out = np.asarray(raw).astype(np.float32)
        elif self.storage is Storage.BF16:
            out = (np.asarray(raw, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            out = quants.dequantize(np.asarray(raw), _GGML_TYPE[self.storage])
        return out.reshape(self.shape)


@dataclass
class WeightStore(Mapping[str, Weight]):
    """The weights of one model by symbol name, with a cache of dequantized tensors."""

    source: Path
    entries: dict[str, Weight] = field(default_factory=dict)
    _f32: dict[str, np.ndarray] = field(default_factory=dict, repr=False)

    def add(self, weight: Weight) -> None:
        self.entries[weight.name] = weight

    def f32(self, name: str) -> np.ndarray:
        """The dequantized float32 tensor of `name`, computed once."""
        if name not in self._f32:
            self._f32[name] = self.entries[name].to_f32()
        return self._f32[name]

    def __getitem__(self, name: str) -> Weight:
        return self.entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)
