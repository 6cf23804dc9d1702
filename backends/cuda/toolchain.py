"""PTX from LLVM modules (llvmlite's NVPTX target), cubins and register reports from `ptxas`.

    text, cached = ptx(llvm_modules, target)             # .version 7.0 / .target sm_80 …, modules from the cache
    report = assemble(Path("kernels.ptx"), "sm_90", Path("kernels.sm_90.cubin"))
    report["matmul_q4_1_a32_k576_n576_r1"]               # KernelResources(registers=40, spill_bytes=0, …)

Both go through the kernel cache (`llmc.backends.kernel_cache`): each module's PTX keyed by its IR and the
target, each cubin and report by the whole PTX, the architecture and ptxas's version, so compiling the same
model again runs neither LLVM nor ptxas, and another model's same kernels skip LLVM.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from llvmlite import ir

from llmc.backends import kernel_cache
from llmc.backends.cpu.toolchain import ToolchainError, compile_objects
from llmc.backends.cuda.target import ptx_target_machine
from llmc.ir.tgt import TargetAttr


@dataclass(frozen=True)
class KernelResources:
    """What `ptxas -v` reports for one kernel."""

    registers: int
    spill_bytes: int  # spill stores + spill loads
    stack_bytes: int
    shared_bytes: int


def ptx(modules: Sequence[ir.Module], target: TargetAttr) -> tuple[str, int]:
    """The PTX of the modules for the target's architecture (O3), each compiled alone and the results
    joined (`join_ptx`), and how many of them the kernel cache held."""
    texts, cached = compile_objects(modules, ptx_target_machine(target), assembly=True)
    return join_ptx([text.decode() for text in texts]), cached


_FUNCTION = re.compile(r"^(?:\.visible |\.weak )?\.(?:entry|func)\b")
_HEADER = (".version", ".target", ".address_size")
_DECLARED = re.compile(r"([A-Za-z_$%][\w$]*)\s*(?:\[\d*\])?\s*(?:=.*)?;$")  # the name a declaration line declares


def join_ptx(texts: Sequence[str]) -> str:
    """One PTX module of several for one target: the first one's header (`.version`, `.target`,
    `.address_size` and the comment above them), every module-scope declaration once (a name declared
    twice must be declared alike: the content-named tables; the comments among them left out), then
    every function in order.

        join_ptx([".version 7.0\\n.target sm_80\\n.address_size 64\\n.visible .entry a(...", ...])
    """
    header: list[str] | None = None
    declared: dict[str, str] = {}
    functions: list[str] = []
    for text in texts:
        lines = text.splitlines()
        start = next((i for i, line in enumerate(lines) if _FUNCTION.match(line)), len(lines))
        head = [line for line in lines[:start] if line.startswith(_HEADER)]
        if header is None:
            header = lines[:lines.index(head[-1]) + 1] if head else []
        elif head != [line for line in header if line.startswith(_HEADER)]:
            raise ToolchainError(f"cannot join the PTX of different targets: {head} and {header}")
        for line in lines[:start]:
            if not line.strip() or line.strip().startswith("//") or line in head:  # (`// .globl name`, …)
                continue
            match = _DECLARED.search(line)
            if not line.startswith(".") or match is None:
                raise ToolchainError(f"cannot join PTX modules: a module-scope line not understood: {line[:80]!r}")
            if declared.setdefault(match.group(1), line) != line:
                raise ToolchainError(f"cannot join PTX modules: two declare {match.group(1)} differently")
        functions.append("\n".join(lines[start:]).strip("\n"))
    return "\n".join([*(header or []), "", *declared.values(), "", "\n\n".join(functions)]) + "\n"


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
    """`ptxas -v -arch=ARCH` the PTX into a cubin at `out`; returns the per-kernel report. The kernel cache's
    cubin and report where the same PTX was assembled for `arch` by the same ptxas before."""
    if not have_ptxas():
        raise ToolchainError("ptxas is not on PATH: install the CUDA toolkit, or build PTX only")
    cmd = ["ptxas", "-v", "-O3", f"-arch={arch}", str(ptx_path), "-o", str(out)]
    text = ptx_path.read_text()
    keys = [kernel_cache.cache_key(text, kind, *cmd[:4], _ptxas_version()) for kind in ("cubin", "report")]
    cubin, report = (kernel_cache.lookup(key) for key in keys)
    if cubin is not None and report is not None:
        out.write_bytes(cubin)
        return parse_report(report.decode())
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        detail = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "no output")
        raise ToolchainError(f"ptxas -arch={arch} failed (exit {proc.returncode}): {detail}")
    kernel_cache.store(keys[0], out.read_bytes())
    kernel_cache.store(keys[1], (proc.stderr + proc.stdout).encode())
    return parse_report(proc.stderr + proc.stdout)


@functools.cache
def _ptxas_version() -> str:
    """`ptxas --version`'s output (what its cubins depend on besides the PTX and the flags)."""
    return subprocess.run(["ptxas", "--version"], capture_output=True, text=True, check=False).stdout
