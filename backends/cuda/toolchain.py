"""PTX from an LLVM module (llvmlite's NVPTX target), cubins and register reports from `ptxas`.

    text = ptx(llvm_module, target)                      # .version 7.0 / .target sm_80 …
    report = assemble(Path("kernels.ptx"), "sm_90", Path("kernels.sm_90.cubin"))
    report["matmul_q4_1_a32_k576_n576_r1"]               # KernelResources(registers=40, spill_bytes=0, …)
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

from llvmlite import ir

from llmc.backends.cpu.toolchain import ToolchainError, compile_to_assembly
from llmc.backends.cuda.target import ptx_target_machine
from llmc.ir.tgt import TargetAttr


@dataclass(frozen=True)
class KernelResources:
    """What `ptxas -v` reports for one kernel."""

    registers: int
    spill_bytes: int  # spill stores + spill loads
    stack_bytes: int
    shared_bytes: int


def ptx(module: ir.Module, target: TargetAttr) -> str:
    """The module's PTX for the target's architecture (O3)."""
    return compile_to_assembly(module, ptx_target_machine(target))


def have_ptxas() -> bool:
    return shutil.which("ptxas") is not None


_ENTRY = re.compile(r"Compiling entry function '([^']+)'")
_FRAME = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_USED = re.compile(r"Used (\d+) registers(?:.*?(\d+) bytes smem)?")


def parse_report(text: str) -> dict[str, KernelResources]:
    """`ptxas -v` output → resources per kernel."""
    out: dict[str, KernelResources] = {}
    name, frame = None, (0, 0, 0)
    for line in text.splitlines():
        if m := _ENTRY.search(line):
            name, frame = m.group(1), (0, 0, 0)
        elif (m := _FRAME.search(line)) and name:
            frame = (int(m.group(1)), int(m.group(2)), int(m.group(3)))
        elif (m := _USED.search(line)) and name:
            out[name] = KernelResources(int(m.group(1)), frame[1] + frame[2], frame[0], int(m.group(2) or 0))
            name = None
    return out


def assemble(ptx_path: Path, arch: str, out: Path) -> dict[str, KernelResources]:
    """`ptxas -v -arch=ARCH` the PTX into a cubin at `out`; returns the per-kernel report."""
    if not have_ptxas():
        raise ToolchainError("ptxas is not on PATH: install the CUDA toolkit, or build PTX only")
    cmd = ["ptxas", "-v", "-O3", f"-arch={arch}", str(ptx_path), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        detail = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "no output")
        raise ToolchainError(f"ptxas -arch={arch} failed (exit {proc.returncode}): {detail}")
    return parse_report(proc.stderr + proc.stdout)
