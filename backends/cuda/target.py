"""CUDA targets: `--gpu sm_80[,sm_90…]` → the `#tgt.target` the passes choose from.

The PTX is built for the first (oldest) architecture named, so the driver can JIT it
for any later GPU; `ptxas` adds a cubin for each architecture named. The target
records what the oldest one has, the features that change a choice:

    cuda_target("sm_80,sm_90")
    # #tgt.target<cuda, "nvptx64", "sm_80", ["bf16", "cp.async", "dp4a", "mma.m16n8k16.f16", "mma.m16n8k32.s8", "smem=166912"]>

Kernels choose block sizes and shared memory from it (`shared_memory`); `quantize`
keeps float activations (`a32`: weights dequantized in registers, the GEMVs are
bandwidth-bound) and `pack` the `split` layout (coalesced 4-byte code loads per lane,
scales in planes of their own).
"""

from __future__ import annotations

from dataclasses import dataclass

from llmc.errors import UsageError
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
