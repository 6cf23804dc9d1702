"""CPU backend: kernels emitted with llvmlite.ir, compiled by LLVM, linked by the system C compiler."""

from llmc.backends.cpu.kernels import KernelLibrary
from llmc.backends.cpu.toolchain import (
    ToolchainError,
    build_shared,
    c_compiler,
    compile_to_assembly,
    compile_to_object,
    host_cpu,
    link_shared,
    optimize,
    optimized_ir,
    target_machine,
)

__all__ = [
    "KernelLibrary",
    "ToolchainError",
    "build_shared",
    "c_compiler",
    "compile_to_assembly",
    "compile_to_object",
    "host_cpu",
    "link_shared",
    "optimize",
    "optimized_ir",
    "target_machine",
]
