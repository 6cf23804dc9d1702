"""What a target is to the passes and the driver: one `TargetDescription` per backend, found by the kind of
the module's `#tgt.target` (`target_description`), imported only when asked for.

Passes ask the description, never a backend: `quantize` which `--compute` modes run and what `a16` costs,
`split` the prompt chunk, `pack` each weight's layout and each kernel's instructions; the driver asks it for
the target of the command line's options, the llm ops it has no kernel for, and to build the kernels:

    d = target_description(module_target(module))        # e.g. backends/cpu/target.py's CpuTarget
    d.integer_isa()                                      # Isa.VNNI512
    d.weight_layout(readers)                             # Layout.TILES
    d.kernel_isa(matmul, rows=128)                       # Isa.AMX
"""

from __future__ import annotations

import hashlib
import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from xdsl.dialects.builtin import ModuleOp

from llmc.errors import LlmcError, UsageError
from llmc.ir import tgt
from llmc.ir.layouts import Layout

# kind → "module:class" of its description, imported on first use
TARGETS: dict[str, str] = {
    "cpu": "llmc.backends.cpu.target:CpuTarget",
    "cuda": "llmc.backends.cuda.target:CudaTarget",
}

# (target facts, entry points' target parts) → the manifest's description (`llmc.package.describe`)
Describe = Callable[[dict, dict[str, dict]], dict]


@dataclass(frozen=True)
class Built:
    """What a backend's `build` wrote into the artifact's staging folder."""

    description: dict  # the manifest's fields of what the kernels were compiled for (`llmc.package.describe`)
    files: dict[str, Path]  # the kernel files by role (`kernels`, `cubin_sm_80`, …)
    note: str  # codegen's progress note: `kernels-….so (cpu rocketlake, a8 on avx2; 20 kernels, …)`


class TargetDescription(ABC):
    """One backend's answers about one `#tgt.target`."""

    kind: ClassVar[str]  # the target attribute's kind: `cpu`, `cuda`
    prefill_chunk: ClassVar[int]  # `split`'s default prompt chunk (at most --max-seq)
    refused_ops: ClassVar[Mapping[str, str]]  # llm ops it has no kernel for → what they are, in words

    def __init__(self, target: tgt.TargetAttr):
        self.target = target

    @staticmethod
    @abstractmethod
    def target_for(options) -> tgt.TargetAttr:
        """The target attribute of the command line's backend options (`--cpu`, `--gpu`)."""

    @abstractmethod
    def integer_isa(self) -> tgt.Isa:
        """The integer dot product of `a8` kernels (`GENERIC`: none: `a8` is not the faster mode)."""

    def has_integer_dot(self) -> bool:
        """Whether `a8` is the faster mode here (an integer dot-product instruction)."""
        return self.integer_isa() is not tgt.Isa.GENERIC

    @abstractmethod
    def check_compute(self, compute: str) -> None:
        """Refuse a `--compute` mode its kernels do not run (a `UsageError`)."""

    @abstractmethod
    def a16_cost(self) -> tuple[float, float]:
        """`a16`'s cost as a multiple of `a8`'s, (prefill, decode); (1, 1) where no integer mode runs."""

    @abstractmethod
    def weight_layout(self, readers: Sequence[tgt.Kernel]) -> Layout:
        """The layout `pack` gives an integer weight that the kernels `readers` read."""

    @abstractmethod
    def kernel_isa(self, op: tgt.Kernel, rows: int) -> tgt.Isa | None:
        """The instructions `pack` gives kernel `op` of an entry point of `rows` rows; None: as lowered."""

    @abstractmethod
    def kernels(self) -> frozenset[type[tgt.Kernel]]:
        """The `tgt` kernels it has an emitter for."""

    @abstractmethod
    def build(self, module: ModuleOp, weight_offsets: Mapping[str, int], describe: Describe, stage: Path,
              options) -> Built:
        """Compile the entry points of a planned `tgt` module into kernel files in `stage`, for the command
        line's backend `options` (`--gpu`: the architectures to assemble)."""

    def check_ops(self, module: ModuleOp) -> None:
        """Refuse, in one line, an imported module with an llm op it has no kernel for."""
        for op in module.walk():
            if op.name in self.refused_ops:
                others = ", ".join(kind for kind in TARGETS if kind != self.kind)
                raise UsageError(f"target {self.kind} has no kernel for {op.name} ({self.refused_ops[op.name]}); "
                                 f"use --target {others}")


def description_class(kind: str) -> type[TargetDescription]:
    """The description of target kind `kind`; one clear error for an unknown one."""
    if kind not in TARGETS:
        raise UsageError(f"unknown target '{kind}' (targets: {', '.join(TARGETS)})")
    module, name = TARGETS[kind].split(":")
    return getattr(importlib.import_module(module), name)


def target_description(target: tgt.TargetAttr) -> TargetDescription:
    """What the backend of `target` answers for it."""
    return description_class(target.kind.data)(target)


def module_target(module: ModuleOp) -> tgt.TargetAttr:
    """The module's `#tgt.target`."""
    target = module.attributes.get(tgt.TARGET)
    if not isinstance(target, tgt.TargetAttr):
        raise LlmcError("the module has no tgt.target attribute: compile with --target, or add one to the IR")
    return target


def content_name(stem: str, data: bytes, suffix: str) -> str:
    """A kernel file's name, unique to its content (ctypes returns a cached library for a seen path)."""
    return f"{stem}-{hashlib.sha256(data).hexdigest()[:16]}{suffix}"
