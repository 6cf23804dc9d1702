"""CPU targets: `--cpu native|x86-64-v3|NAME` → the `#tgt.target` the passes choose from.

The attribute records the CPU name and the features that change a choice (integer dot
products, vector width, bf16, AMX). `native` reads the host through LLVM; other names
come from the table below. Code generation builds for exactly what was recorded: the
CPU name's defaults, with every feature of `FEATURES` switched on or off as recorded.

    cpu_target("x86-64-v3")   # #tgt.target<cpu, "x86_64", "x86-64-v3", ["avx2", "bmi2", "f16c", "fma"]>

`CpuTarget` is what the passes and the driver ask (`llmc.ir.target`): the integer dot product of
`a8` kernels, `a16`'s cost, the weight layouts and kernel instructions `pack` gives, and the build.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from xdsl.dialects.builtin import ModuleOp

from llmc.errors import UsageError
from llmc.ir import tgt
from llmc.ir.layouts import Layout
from llmc.ir.target import Built, Describe, TargetDescription
from llmc.ir.tgt import Isa, TargetAttr

if TYPE_CHECKING:
    from llmc.backends.cpu.kernels import Tuning

# The features recorded in a CPU target (LLVM's names).
FEATURES = (
    "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512vnni", "avxvnni",
    "avx512bf16", "avx512fp16", "amx-tile", "amx-int8", "amx-bf16",
)

_V3 = ("avx2", "fma", "f16c", "bmi2")
_V4 = (*_V3, "avx512f", "avx512bw", "avx512vl", "avx512dq")
_ICELAKE = (*_V4, "avx512vnni")
_SAPPHIRE = (*_ICELAKE, "avxvnni", "avx512bf16", "avx512fp16", "amx-tile", "amx-int8", "amx-bf16")
_ALDER = (*_V3, "avxvnni")
_ZEN4 = (*_ICELAKE, "avx512bf16")

CPUS: dict[str, tuple[str, ...]] = {
    "x86-64": (), "x86-64-v2": (), "x86-64-v3": _V3, "x86-64-v4": _V4,
    "haswell": _V3, "broadwell": _V3, "skylake": _V3, "skylake-avx512": _V4, "cascadelake": _ICELAKE,
    "icelake-client": _ICELAKE, "icelake-server": _ICELAKE, "tigerlake": _ICELAKE, "rocketlake": _ICELAKE,
    "sapphirerapids": _SAPPHIRE, "emeraldrapids": _SAPPHIRE, "graniterapids": _SAPPHIRE,
    "alderlake": _ALDER, "raptorlake": _ALDER, "meteorlake": _ALDER, "arrowlake": _ALDER,
    "znver2": _V3, "znver3": _V3, "znver4": _ZEN4, "znver5": _ZEN4,
}


def cpu_target(cpu: str = "native") -> TargetAttr:
    """The target for `--cpu`: this machine (`native`) or a CPU of the table."""
    if cpu == "native":
        from llmc.backends.cpu.toolchain import host_cpu

        name, features = host_cpu()
        present = {f[1:] for f in features.split(",") if f.startswith("+")}
        return TargetAttr("cpu", "x86_64", name, [f for f in FEATURES if f in present])
    if cpu not in CPUS:
        raise UsageError(f"unknown CPU '{cpu}' (known: native, {', '.join(CPUS)})")
    return TargetAttr("cpu", "x86_64", cpu, CPUS[cpu])


def llvm_features(target: TargetAttr) -> str:
    """The LLVM feature string for a recorded target: each known feature on or off."""
    return ",".join(("+" if f in target.features else "-") + f for f in FEATURES)


def tiles_layout(isa: Isa) -> Layout:
    """The tiles layout `isa`'s kernels read best: `tiles` (its high-bit masks in byte order, one `kmovq`) with
    AVX-512, `tiles_avx2` (transposed: one shift a 64-bit lane) without."""
    return Layout.TILES if isa in (Isa.VNNI512, Isa.AMX) else Layout.TILES_AVX2


def integer_isa(target: TargetAttr) -> Isa:
    """The best integer dot product the target has, for `a8` kernels."""
    if target.has("avx512vnni", "avx512bw", "avx512vl"):
        return Isa.VNNI512
    if target.has("avxvnni", "avx2"):
        return Isa.VNNI256
    if target.has("avx2"):
        return Isa.AVX2
    return Isa.GENERIC


def target_machine_for(target: TargetAttr):
    """An LLVM target machine for exactly the recorded CPU and features."""
    from llmc.backends.cpu.toolchain import target_machine

    if target.kind.data != "cpu":
        raise UsageError(f"the CPU backend cannot build for a '{target.kind.data}' target")
    return target_machine(target.cpu.data, features=llvm_features(target))


# `a16`'s time over `a8`'s per matmul, (prefill, decode), by the integer dot product of the
# `a8` kernels: SmolLM2-135M all-a16 against all-a8, each a16 run right after its a8 run (`llmc
# bench --prompt-tokens 128,512 --decode-tokens 64`, 3 rounds, medians). AVX2 and VNNI-256 in the
# tiles layout, with `--cpu x86-64-v3` and `--cpu alderlake` on a 2-core AMD EPYC (Zen 5, 2 threads):
# AVX2 prefill 0.61–0.68×, decode 0.83× (each plane's `vpmaddubsw`, its 16-bit pairs summed over a
# block before one `vpmaddwd`, as int8 rows take it: two where int8 rows take one; decode from
# `benchmarks/decode_step.py`'s medians, 2.056 against 1.711 ms a step); VNNI-256 prefill 0.60–0.64×,
# decode 0.73× (two `vpdpbusd` a plane where int8 rows take one). VNNI-512: measured on a 2-core AMX
# Xeon, the same command at --repeat 5 with `--cpu icelake-server`: prefill 0.78–0.81×, decode 0.95×.
# AMX (prefill on tiles, a16 a tile product per plane): prefill 0.72–0.74× of a8 at 128 tokens, 0.79–0.80× at
# 512, decode 1.0× (both VNNI-512), on the same Xeon (sapphirerapids features, 2 threads); before a16 took the
# tiles, its prefill ran on VNNI-512 at 0.65–0.68× of a8's on tiles.
A16_COST = {Isa.AVX2: (1.55, 1.2), Isa.VNNI256: (1.65, 1.4), Isa.VNNI512: (1.25, 1.05)}
A16_PREFILL_ON_AMX = 1.3


def a16_cost(target: TargetAttr) -> tuple[float, float]:
    """`a16`'s cost as a multiple of `a8`'s on `target`: (prefill, decode).

        a16_cost(cpu_target("x86-64-v3"))   # (1.55, 1.2)
    """
    isa = integer_isa(target)
    prefill, decode = A16_COST[isa]
    amx = isa is Isa.VNNI512 and target.has("amx-tile", "amx-int8")  # where `pack` gives prefill AMX tiles
    return (A16_PREFILL_ON_AMX if amx else prefill), decode


# How far ahead (bytes of weight codes) a tiles kernel of fewer than 4 rows prefetches into L1, by CPU name: a
# core's read rate times DRAM's latency. `gemm.PREFETCH_BYTES` (4 KB) elsewhere: on Zen 4, 2 and 8 KB were no
# faster. Zen 5 reads about 69 GB/s a core, twice Zen 4's: 8 KB made SmolLM2's one-row decode step 5% faster there
# (1.54 → 1.46 ms), 12 and 16 KB slower, into L2 16 or 32 KB ahead 11–17% slower. (The AVX2 split layout keeps
# `PREFETCH_BYTES` on every CPU: 1–16 KB could not be told apart there.)
NEAR_PREFETCH_BYTES = {"znver5": 8192}
# And into L2 as well, this far ahead, by CPU name: where the weights come from a large L3 at a core's rate. The AMX
# Xeon of issue 27's twenty-fifth round (480 MiB L3 holding the weights; LLVM names its VM's CPU `rocketlake`):
# 16 KB made SmolLM2's one-row decode step 3–4% faster (2.269 → 2.187, 2.290 → 2.213 ms a call) and the 270M
# model's 4.5% (9.120 → 8.710); 8 KB the same within the noise, 32 KB only 1.6–3% faster, 64 KB 2% slower; L2
# alone (no L1), 8 or 16 KB ahead, no faster.
NEAR_L2_PREFETCH_BYTES = {"rocketlake": 16384}


def near_prefetch_bytes(target: TargetAttr) -> int:
    """The one-row tiles kernels' prefetch distance on `target` (`gemm.PREFETCH_BYTES` unless the table says)."""
    from llmc.backends.cpu.gemm import PREFETCH_BYTES

    return NEAR_PREFETCH_BYTES.get(target.cpu.data, PREFETCH_BYTES)


def vector_registers(target: TargetAttr) -> int:
    """The vector registers a kernel on `target` has: 32 with AVX-512, 16 otherwise."""
    return 32 if target.has("avx512f") else 16


def kernel_tuning(target: TargetAttr) -> Tuning:
    """The `kernels.Tuning` of `target`'s kernels."""
    from llmc.backends.cpu.kernels import Tuning

    return Tuning(near_prefetch_bytes(target), vector_registers(target), NEAR_L2_PREFETCH_BYTES.get(target.cpu.data, 0))


AMX_MIN_ROWS = 16  # entry points of at least this many rows get AMX tiles (one tile of rows)


class CpuTarget(TargetDescription):
    """An x86-64 CPU: `a8`/`a16` kernels on its integer dot product; with one (AVX2 or better) the `tiles`
    layout for weights only quantized-row kernels (and the embedding) read, `split` for the rest; AMX tiles
    for the `a8` and `a16` matmuls of entry points of `AMX_MIN_ROWS` rows or more."""

    kind = "cpu"
    prefill_chunk = 128
    refused_ops: Mapping[str, str] = {}  # every llm op has its kernels

    @staticmethod
    def target_for(options) -> TargetAttr:
        return cpu_target(options.cpu)

    def integer_isa(self) -> Isa:
        return integer_isa(self.target)

    def check_compute(self, compute: str) -> None:
        """Every mode runs on a CPU (`a8` and `a16` with generic code where it has no integer dot product)."""

    def a16_cost(self) -> tuple[float, float]:
        return a16_cost(self.target) if self.has_integer_dot() else (1.0, 1.0)

    def weight_layout(self, readers: Sequence[tgt.Kernel]) -> Layout:
        """A tiles layout (`tiles_layout`: `tiles` with AVX-512, `tiles_avx2` without) where the target has an
        integer dot product (AVX2, VNNI-256, VNNI-512) and every reader takes quantized rows (or gathers rows:
        the embedding), `split` otherwise."""
        isa = self.integer_isa()
        if isa is Isa.GENERIC or not all(_reads_tiles(k) for k in readers):
            return Layout.SPLIT
        return tiles_layout(isa)

    def kernel_isa(self, op: tgt.Kernel, rows: int) -> Isa | None:
        """A matmul reading quantized rows: the integer dot product, or `amx` for rows in whole 16-row
        blocks when every weight format's scales are constant over 32-value blocks."""
        from llmc.backends.cpu.amx import supports

        if not (isinstance(op, tgt.Projection) and isinstance(op.rows_type(), tgt.QRowsType)):
            return None
        isa = self.integer_isa()
        amx = isa is Isa.VNNI512 and self.target.has("amx-tile", "amx-int8")
        tiles = amx and rows >= AMX_MIN_ROWS and getattr(op, "last_row", None) is None \
            and all(supports(w.storage) for w in _matrices(op))
        return Isa.AMX if tiles else isa

    def kernels(self) -> frozenset[type[tgt.Kernel]]:
        from llmc.backends.cpu.kernels import EMITTERS

        return EMITTERS.implemented()

    def build(self, module: ModuleOp, weight_offsets: Mapping[str, int], describe: Describe, stage: Path,
              options) -> Built:
        from llmc.backends.cpu.codegen import build

        return build(module, weight_offsets, describe, stage, options)


def _matrices(op: tgt.Kernel) -> list[tgt.WeightType]:
    return [v.type for _, v in op.abi() if isinstance(v.type, tgt.WeightType) and len(v.type.shape) == 2]


def _reads_tiles(op: tgt.Kernel) -> bool:
    """Whether a kernel reads its integer weights in the tiles layout (on a CPU with an integer dot product)."""
    return isinstance(op, tgt.EmbeddingOp) or \
        (isinstance(op, tgt.Projection) and isinstance(op.rows_type(), tgt.QRowsType))
