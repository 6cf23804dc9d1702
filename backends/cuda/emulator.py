"""The CPU emulator as a CUDA device: an artifact's kernels, built for the host, run on `emulator.c`.

`EmulatedDevice(module, weight_offsets)` compiles the same `tgt` module the CUDA
artifact was built from with `Emulated` intrinsics (thread ids, barriers and shuffles
as calls into the emulator), links it with `emulator.c`, and implements the runtime's
`Device`: host memory for device memory, `emu_launch` for `cuLaunchKernel`. A
`CudaSession` on it runs the artifact's real launch plans, so the launch plans, the
kernels' numerics and the session are checked without a GPU:

    device = EmulatedDevice(lowered_module, weight_layout(lowered_module).offsets, workdir)
    session = CudaSession(load_manifest(artifact), device=device)
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path

import numpy as np
from xdsl.dialects.builtin import ModuleOp

from llmc.backends.cpu.toolchain import compile_objects, link_shared, target_machine
from llmc.backends.cuda.codegen import emit_module
from llmc.errors import LlmcError

EMULATOR_C = Path(__file__).with_name("emulator.c")
_ERRORS = {-1: "a block of more than 1024 threads", -2: "a deadlock: the block's threads cannot all meet"}


def build_host_kernels(module: ModuleOp, weight_offsets: dict[str, int], out: Path) -> Path:
    """The host build of every kernel of `module` (plus the emulator), as a shared library at `out`."""
    llvm_modules, _, _ = emit_module(module, weight_offsets, emulated=True)
    objects, _ = compile_objects(llvm_modules, target_machine())
    return link_shared([*objects, EMULATOR_C], out)


class EmulatedDevice:
    """The runtime's `Device` on the CPU emulator."""

    name = "CPU emulator"
    graphs = False

    def __init__(self, module: ModuleOp, weight_offsets: dict[str, int], workdir: Path):
        path = build_host_kernels(module, weight_offsets, workdir / f"emulated-{id(self):x}.so")
        self.library = ctypes.CDLL(str(path))
        self.library.emu_launch.argtypes = [ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int] * 6
        self.library.emu_launch.restype = ctypes.c_int
        self._memory: dict[int, np.ndarray] = {}
        self.launches = 0

    def alloc(self, nbytes: int) -> int:
        buffer = np.zeros(max(nbytes, 1) + 64, np.uint8)
        address = (buffer.ctypes.data + 63) // 64 * 64
        self._memory[address] = buffer
        return address

    def upload(self, address: int, data: np.ndarray) -> None:
        data = np.ascontiguousarray(data)
        ctypes.memmove(address, data.ctypes.data, data.nbytes)

    def download(self, address: int, out: np.ndarray) -> None:
        ctypes.memmove(out.ctypes.data, address, out.nbytes)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        ctypes.memmove(dst, src, nbytes)

    def kernels(self, manifest, names: set[str], check: bool) -> dict[str, object]:  # (the host build's)
        return {name: ctypes.cast(getattr(self.library, f"{name}.host"), ctypes.c_void_p) for name in names}

    def launch(self, kernel, grid, block, shared, params) -> None:
        code = self.library.emu_launch(kernel, ctypes.addressof(params), *grid, *block)
        if code != 0:
            raise LlmcError(f"emulator: {_ERRORS.get(code, code)}")
        self.launches += 1

    def synchronize(self) -> None:
        pass

    def time_launches(self, launches) -> list[float]:
        out = []
        for launch in launches:
            start = time.perf_counter()
            self.launch(*launch)
            out.append(time.perf_counter() - start)
        return out

    def capture(self, launches):
        raise NotImplementedError("the emulator replays no graphs")

    def replay(self, graph) -> None:
        raise NotImplementedError("the emulator replays no graphs")

    def destroy(self, graph) -> None:
        raise NotImplementedError("the emulator replays no graphs")

    def close(self) -> None:
        self._memory.clear()
