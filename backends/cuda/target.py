"""CUDA targets: `--gpu sm_80[,sm_90…]` → the `#tgt.target` the passes choose from.

The PTX is built for the first (oldest) architecture named, so the driver can JIT it
for any later GPU; `ptxas` adds a cubin for each architecture named. The target
records what the oldest one has, the features that change a choice:

    cuda_target("sm_80,sm_90")
    # #tgt.target<cuda, "nvptx64", "sm_80", ["bf16", "cp.async", "dp4a", "mma.m16n8k16.f16", "mma.m16n8k32.s8", "smem=166912"]>

Kernels choose block sizes and shared memory from it (`shared_memory`); `quantize`
keeps float activations (`a32`: weights dequantized in registers, the GEMVs are
bandwidth-bound) and `pack` the `split` layout (coalesced 4-byte code loads per lane,
scales in planes of their own). `CudaTarget` gives those answers to the passes and the driver
(`llmc.ir.target`), and builds the PTX and cubins.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from xdsl.dialects.builtin import ModuleOp

from llmc.errors import UsageError
from llmc.ir import tgt
from llmc.ir.layouts import Layout
from llmc.ir.target import Built, Describe, TargetDescription
from llmc.ir.tgt import TargetAttr

ARCH = "nvptx64"
TRIPLE = f"{ARCH}-nvidia-cuda"


@dataclass(frozen=True)
class Gpu:
    """What one SM architecture has."""

    ptx: str  # the PTX ISA version LLVM emits for it
    shared_memory: int  # bytes of shared memory a block may use (opt-in maximum)
    features: tuple[str, ...]


_AMPERE = ("dp4a", "mma.m16n8k16.f16", "mma.m16n8k32.s8", "bf16", "cp.async")
GPUS: dict[str, Gpu] = {
    "sm_80": Gpu("+ptx70", 163 * 1024, _AMPERE),
    "sm_86": Gpu("+ptx71", 99 * 1024, _AMPERE),
    "sm_89": Gpu("+ptx78", 99 * 1024, (*_AMPERE, "mma.f8")),
    "sm_90": Gpu("+ptx80", 227 * 1024, (*_AMPERE, "mma.f8", "tma", "wgmma")),
}
DEFAULT_GPUS = "sm_80,sm_90"


def parse_gpus(text: str) -> list[str]:
    """`sm_80,sm_90` → the architectures, oldest first; one clear error for an unknown one."""
    names = [t.strip().lower() for t in text.split(",") if t.strip()]
    if not names:
        raise UsageError(f"--gpu needs an architecture ({', '.join(GPUS)})")
    for name in names:
        if name not in GPUS:
            raise UsageError(f"unknown GPU architecture '{name}' (known: {', '.join(GPUS)})")
    return sorted(set(names), key=lambda n: int(n[3:]))


def cuda_target(gpus: str = DEFAULT_GPUS) -> TargetAttr:
    """The target for `--gpu`: the oldest architecture named, with what it has."""
    oldest = parse_gpus(gpus)[0]
    gpu = GPUS[oldest]
    return TargetAttr("cuda", ARCH, oldest, [*gpu.features, f"smem={gpu.shared_memory}"])


def shared_memory(target: TargetAttr) -> int:
    """Bytes of shared memory a block may use on the target."""
    return next(int(f[5:]) for f in target.features if f.startswith("smem="))


def ptx_target_machine(target: TargetAttr):
    """The LLVM NVPTX target machine for the recorded architecture."""
    from llmc.backends.cpu.toolchain import target_machine

    if target.kind.data != "cuda":
        raise UsageError(f"the CUDA backend cannot build for a '{target.kind.data}' target")
    return target_machine(target.cpu.data, features=GPUS[target.cpu.data].ptx, triple=TRIPLE)


MMA_MIN_ROWS = 16  # entry points of at least this many rows get tensor-core GEMMs


class CudaTarget(TargetDescription):
    """An NVIDIA GPU: float activations only (`a32`), every integer weight in the `split` layout, tensor
    cores for the matmuls of entry points of `MMA_MIN_ROWS` rows or more, a larger prompt chunk."""

    kind = "cuda"
    prefill_chunk = 512  # a GPU fills its SMs with more rows, and a chunk is one graph replay
    refused_ops: Mapping[str, str] = {"llm.moe": "mixture of experts"}

    @staticmethod
    def target_for(options) -> TargetAttr:
        return cuda_target(options.gpu)

    def integer_isa(self) -> tgt.Isa:
        return tgt.Isa.GENERIC  # (the kernels take float rows)

    def check_compute(self, compute: str) -> None:
        if compute in ("a8", "a16"):
            raise UsageError(f"--compute {compute} is for CPU targets: the CUDA kernels take float activations (a32)")

    def a16_cost(self) -> tuple[float, float]:
        return 1.0, 1.0

    def weight_layout(self, readers: Sequence[tgt.Kernel]) -> Layout:
        """`split`: a lane reads one 4-byte word of codes, a warp 128 consecutive bytes (`weights.py`)."""
        return Layout.SPLIT

    def kernel_isa(self, op: tgt.Kernel, rows: int) -> tgt.Isa | None:
        """`mma_f16` (tensor cores) for the matmuls of prefill and score; GEMVs (as lowered) otherwise."""
        if isinstance(op, (tgt.MatmulOp, tgt.SwigluOp)) and getattr(op, "last_row", None) is None \
                and rows >= MMA_MIN_ROWS and self.target.has("mma.m16n8k16.f16"):
            return tgt.Isa.MMA_F16
        return None

    def kernels(self) -> frozenset[type[tgt.Kernel]]:
        from llmc.backends.cuda.kernels import EMITTERS

        return EMITTERS.implemented()

    def build(self, module: ModuleOp, weight_offsets: Mapping[str, int], describe: Describe, stage: Path,
              options) -> Built:
        from llmc.backends.cuda.codegen import build

        return build(module, weight_offsets, describe, stage, options)
