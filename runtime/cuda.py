"""Running a CUDA artifact: weights uploaded once, KV cache and arena on the device, launch plans replayed.

`CudaSession` is a `Conversation` whose entry points are the manifest's launch
plans (`backends/cuda/codegen.py`): each launch's arguments are resolved by role to
device addresses once per entry point and row count, then launched in order on one
stream. Each entry point's launches for a row count are captured once into a CUDA graph
and replayed (decode per token, prefill per chunk); the tokens and their positions are
copied into device memory before each replay. Sampling happens on
the host from the downloaded logits.

The device is anything with `Device`'s methods: `Driver` (the CUDA driver API through
`cuda-bindings`, no toolkit needed; the cubin for this GPU's architecture when the
artifact has one, else the PTX, compiled by the driver) or, in the test suite, the CPU
emulator of `llmc.backends.cuda.emulator`. No torch, no compiler stack.

    session = CudaSession(load_manifest(Path("smollm2.cuda")))
    logits = session.feed(prompt_ids)
"""

from __future__ import annotations

import ctypes
import re
import time
from typing import Protocol

import numpy as np

from llmc.abi import ARGMAX_TOKEN, KV_DTYPES, PTX_DESCRIPTION
from llmc.errors import LlmcError, printable
from llmc.runtime.artifact import (
    ArtifactError,
    Manifest,
    check_description,
    check_sha256,
    parse_description,
    verified_bytes,
)
from llmc.runtime.session import Conversation


class NoGpuError(LlmcError):
    """No usable NVIDIA GPU or driver."""


class Device(Protocol):
    """What a CUDA session needs of a device."""

    name: str
    graphs: bool  # whether `capture` records launches for replay

    def alloc(self, nbytes: int) -> int: ...
    def upload(self, address: int, data: np.ndarray) -> None: ...
    def download(self, address: int, out: np.ndarray) -> None: ...
    def copy(self, dst: int, src: int, nbytes: int) -> None: ...
    def kernels(self, manifest: Manifest, names: set[str], check: bool) -> dict[str, object]: ...
    def launch(self, kernel: object, grid: tuple[int, int, int], block: tuple[int, int, int], shared: int,
               params: ctypes.Array) -> None: ...
    def synchronize(self) -> None: ...
    def time_launches(self, launches) -> list[float]: ...
    def capture(self, launches) -> object: ...
    def replay(self, graph: object) -> None: ...
    def destroy(self, graph: object) -> None: ...
    def close(self) -> None: ...


def _check(result) -> tuple:
    """A cuda-bindings call's `(CUresult, *outs)` → outs, or one-line error."""
    err, *outs = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        from cuda.bindings import driver as cu

        _, name = cu.cuGetErrorName(err)
        raise LlmcError(f"CUDA: {name.decode() if isinstance(name, bytes) else name} ({int(err)})")
    return tuple(outs)


class Driver:
    """The CUDA driver API on GPU 0: primary context, one non-blocking stream, graphs."""

    graphs = True

    def __init__(self):
        try:
            from cuda.bindings import driver as cu
        except ImportError:
            raise NoGpuError("running a CUDA artifact needs cuda-bindings: pip install 'llmc[cuda]'") from None
        self.cu = cu
        try:
            err, = cu.cuInit(0)
        except Exception as e:  # the driver library itself is missing
            raise NoGpuError(f"no NVIDIA driver on this machine ({type(e).__name__}); CUDA artifacts need a GPU") \
                from None
        if int(err) != 0:
            raise NoGpuError(f"no usable NVIDIA GPU (cuInit: {err.name if hasattr(err, 'name') else int(err)})")
        (count,) = _check(cu.cuDeviceGetCount())
        if count < 1:
            raise NoGpuError("no NVIDIA GPU found")
        (self.device,) = _check(cu.cuDeviceGet(0))
        (self.context,) = _check(cu.cuDevicePrimaryCtxRetain(self.device))
        _check(cu.cuCtxSetCurrent(self.context))
        (name,) = _check(cu.cuDeviceGetName(64, self.device))
        self.name = name.split(b"\0")[0].decode()
        attr = cu.CUdevice_attribute
        major, = _check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, self.device))
        minor, = _check(cu.cuDeviceGetAttribute(attr.CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, self.device))
        self.arch = f"sm_{major}{minor}"
        (self.stream,) = _check(cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING))
        self._allocations: list = []
        self._modules: list = []

    def alloc(self, nbytes: int) -> int:
        (ptr,) = _check(self.cu.cuMemAlloc(max(nbytes, 1)))
        self._allocations.append(ptr)
        _check(self.cu.cuMemsetD8Async(ptr, 0, max(nbytes, 1), self.stream))
        return int(ptr)

    def upload(self, address: int, data: np.ndarray) -> None:
        # from pageable memory the copy returns once the bytes are staged: `data` may change after it
        data = np.ascontiguousarray(data)
        _check(self.cu.cuMemcpyHtoDAsync(address, data.ctypes.data, data.nbytes, self.stream))

    def download(self, address: int, out: np.ndarray) -> None:
        _check(self.cu.cuMemcpyDtoHAsync(out.ctypes.data, address, out.nbytes, self.stream))
        _check(self.cu.cuStreamSynchronize(self.stream))

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        _check(self.cu.cuMemcpyDtoDAsync(dst, src, nbytes, self.stream))

    def kernels(self, manifest: Manifest, names: set[str], check: bool) -> dict[str, object]:
        """The artifact's cubin for this GPU, else its PTX (JIT-compiled by the driver); with `check`, the
        bytes loaded are the bytes whose sha256 was checked."""
        role = manifest.data["gpu"]["cubins"].get(self.arch, "kernels")
        image = verified_bytes(manifest, role) if check else manifest.file(role).read_bytes()
        if role == "kernels":
            image += b"\0"  # PTX text, NUL-terminated
        (module,) = _check(self.cu.cuModuleLoadData(image))
        self._modules.append(module)
        return {name: _check(self.cu.cuModuleGetFunction(module, name.encode()))[0] for name in names}

    def launch(self, kernel, grid, block, shared, params) -> None:
        _check(self.cu.cuLaunchKernel(kernel, *grid, *block, shared, self.stream, ctypes.addressof(params), 0))

    def synchronize(self) -> None:
        _check(self.cu.cuStreamSynchronize(self.stream))

    def time_launches(self, launches) -> list[float]:
        """Seconds each launch takes alone (events around it, after the ones before it finish)."""
        cu, out = self.cu, []
        start, stop = (_check(cu.cuEventCreate(0))[0] for _ in range(2))
        for launch in launches:
            _check(cu.cuEventRecord(start, self.stream))
            self.launch(*launch)
            _check(cu.cuEventRecord(stop, self.stream))
            _check(cu.cuEventSynchronize(stop))
            out.append(_check(cu.cuEventElapsedTime(start, stop))[0] / 1e3)
        for event in (start, stop):
            cu.cuEventDestroy(event)
        return out

    def capture(self, launches) -> object:
        cu = self.cu
        _check(cu.cuStreamBeginCapture(self.stream, cu.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_GLOBAL))
        for launch in launches:
            self.launch(*launch)
        (graph,) = _check(cu.cuStreamEndCapture(self.stream))
        (exe,) = _check(cu.cuGraphInstantiate(graph, 0))
        return exe

    def replay(self, graph) -> None:
        _check(self.cu.cuGraphLaunch(graph, self.stream))

    def destroy(self, graph) -> None:
        _check(self.cu.cuGraphExecDestroy(graph))

    def close(self) -> None:
        self.synchronize()
        for ptr in self._allocations:
            self.cu.cuMemFree(ptr)
        for module in self._modules:
            self.cu.cuModuleUnload(module)
        self._allocations, self._modules = [], []


COPY_PROBE_BYTES = 1 << 30  # the most weights `read_weights` copies: far past every cache
MAX_GRAPHS = 16  # captured (entry point, rows) pairs kept beyond decode's and verify's (one per row count): chunks


def _grid(dims: list, n: int) -> tuple[int, int, int]:
    return tuple(-(-n // d["rows_per"]) if isinstance(d, dict) else d for d in dims)  # type: ignore[return-value]


_PTX_ENTRY = re.compile(rb"\.entry\s+([\w$]+)\s*\(([^)]*)\)")


def check_kernels(manifest: Manifest, ptx: bytes) -> None:
    """The manifest says what its PTX says of itself (the description on its last line: launch
    plans, sizes, KV cache), and each launch names a kernel of the PTX with as many parameters as
    it passes arguments."""
    path = manifest.file("kernels")
    marker = b"\n" + PTX_DESCRIPTION.encode()
    at = ptx.rfind(marker)
    description = parse_description(ptx[at + len(marker):].split(b"\n", 1)[0], path) if at >= 0 else None
    check_description(manifest, description, path)
    parameters = {m.group(1).decode(): m.group(2).count(b".param") for m in _PTX_ENTRY.finditer(ptx)}
    for launch in [*(launch for entry in manifest.entry_points.values() for launch in entry["launches"]),
                   manifest.data["gpu"]["argmax"]]:
        if parameters.get(launch["kernel"]) != len(launch["args"]):
            raise ArtifactError(f"{path}: the PTX has no kernel {printable(launch['kernel'], 200)} of "
                                f"{len(launch['args'])} parameters, which the manifest launches; recompile")


class CudaSession(Conversation):
    """One conversation's state on a CUDA artifact, on `device` (the GPU's driver by default)."""

    def __init__(self, manifest: Manifest, check_files: bool = True, device: Device | None = None):
        if manifest.target != "cuda":
            raise ArtifactError(f"{manifest.directory}: a '{manifest.target}' artifact, not a CUDA one")
        check_kernels(manifest, verified_bytes(manifest, "kernels") if check_files else
                      manifest.file("kernels").read_bytes())  # before any allocation or launch
        super().__init__(manifest)
        self.device = dev = device if device is not None else Driver()
        self.threads = 1  # (the host's part is one thread: what `llmc bench` gives transformers)
        self.weights = weights = np.memmap(manifest.file("weights"), dtype=np.uint8, mode="r")
        if check_files:  # (`open_session` left the weights' sha256 to the session)
            check_sha256(manifest, "weights", memoryview(weights))
        kv = manifest.kv_cache
        kv_bytes = int(np.prod(kv["shape"])) * np.dtype(KV_DTYPES[kv["dtype"]]).itemsize
        arena = max(e["arena_bytes"] for e in manifest.entry_points.values()) + 64
        self.buffers = {
            "weights": dev.alloc(weights.size), "arena": dev.alloc(arena),
            "k_cache": dev.alloc(kv_bytes), "v_cache": dev.alloc(kv_bytes),
            "tokens": dev.alloc(self.tokens.nbytes), "positions": dev.alloc(self.positions.nbytes),
            "slots": dev.alloc(self.slot_ids.nbytes),
            "logits": dev.alloc(max(int(np.prod(e["logits"])) for e in manifest.entry_points.values()) * 4),
            ARGMAX_TOKEN: dev.alloc(4),
        }
        dev.upload(self.buffers["weights"], weights)
        argmax = manifest.data["gpu"]["argmax"]
        names = {launch["kernel"] for entry in manifest.entry_points.values() for launch in entry["launches"]}
        self.kernels = dev.kernels(manifest, names | {argmax["kernel"]}, check_files)
        self._argmax = self._prepare(argmax, 0)
        self._prepared: dict[tuple[str, int], list] = {}
        self._graphs: dict[tuple[str, int], object] = {}  # (entry point, rows) → captured launches

    def close(self) -> None:
        for graph in self._graphs.values():
            self.device.destroy(graph)
        self._graphs.clear()
        self.device.close()

    def _value(self, arg: dict, n: int):
        if "n" in arg:
            return ctypes.c_int64(n)
        if "count" in arg:
            return ctypes.c_int64(arg["count"])
        if "arena" in arg:
            return ctypes.c_void_p(self.buffers["arena"] + arg["arena"])
        if "weights" in arg:
            return ctypes.c_void_p(self.buffers["weights"] + arg["weights"])
        return ctypes.c_void_p(self.buffers[arg["argument"]] + arg["offset"])

    def _prepare(self, launch: dict, n: int) -> tuple:
        """A launch for `n` rows as the device takes it: kernel, grid, block, shared bytes, parameter array."""
        values = [self._value(arg, n) for arg in launch["args"]]
        params = (ctypes.c_void_p * len(values))(*[ctypes.addressof(v) for v in values])
        params._values = values  # keep the argument values alive with the array
        return (self.kernels[launch["kernel"]], _grid(launch["grid"], n), tuple(launch["block"]),
                launch["shared_bytes"], params)

    def _launches(self, entry: str, n: int) -> list:
        """The entry point's launches for `n` rows (prepared once per row count)."""
        key = (entry, n)
        if key not in self._prepared:
            self._prepared[key] = [self._prepare(launch, n) for launch in self.manifest.entry_points[entry]["launches"]]
        return self._prepared[key]

    def _upload(self) -> None:
        """The staged tokens, their positions and their sequences into device memory."""
        self.device.upload(self.buffers["tokens"], self.tokens)
        self.device.upload(self.buffers["positions"], self.positions)
        if self.slot_count > 1:
            self.device.upload(self.buffers["slots"], self.slot_ids)

    def _call(self, entry: str, n: int, logits: np.ndarray | None) -> None:
        """Run the entry point on the `n` staged rows; download the logits into `logits` (None: leave them
        on the GPU)."""
        self._upload()
        dev = self.device
        launches = self._launches(entry, n)
        if dev.graphs:
            key = (entry, n)
            if key not in self._graphs:
                if len(self._graphs) >= MAX_GRAPHS + self.batch + self.max_verify:  # odd sizes: forget the oldest
                    dev.destroy(self._graphs.pop(next(iter(self._graphs))))
                self._graphs[key] = dev.capture(launches)
            dev.replay(self._graphs[key])
        else:
            for launch in launches:
                dev.launch(*launch)
        if logits is not None:  # (the rows the entry point wrote)
            dev.download(self.buffers["logits"], logits[: min(n, self.logit_rows[entry])])

    def profile(self, entry: str, tokens: list[int] | np.ndarray) -> list[tuple[str, float, int]]:
        """Run `entry` on `tokens` at the current position launch by launch, timing each:
        `(kernel, seconds, weight bytes it reads)` in launch order (the position does not advance)."""
        n = self._stage_here(np.asarray(tokens, dtype=np.int32))
        self._upload()
        sizes = {w["offset"]: w["bytes"] for w in self.manifest.data["weights"].values()}
        plan = self.manifest.entry_points[entry]["launches"]
        seconds = self.device.time_launches(self._launches(entry, n))
        return [(launch["kernel"], t, sum(sizes.get(a.get("weights", -1), 0) for a in launch["args"]))
                for launch, t in zip(plan, seconds)]

    def greedy(self, tokens: list[int] | np.ndarray) -> int:
        """`feed`, then the argmax of the last token's logits, taken on the GPU (4 bytes come back)."""
        tokens = np.asarray(tokens, dtype=np.int32)
        self._check(tokens)
        self._feed(tokens, None)
        return self.argmax()

    def argmax(self) -> int:
        """The argmax of the logits on the device (row 0)."""
        self.device.launch(*self._argmax)
        token = np.zeros(1, np.int32)
        self.device.download(self.buffers[ARGMAX_TOKEN], token)
        return int(token[0])

    @property
    def where(self) -> str:
        return self.device.name

    @property
    def bandwidth_probe(self) -> str:
        return f"a device-to-device copy on {self.device.name}"

    def read_weights(self) -> float:
        """GB/s of a device-to-device copy of the weights (up to 1 GiB of them) into a scratch buffer: what
        decode's reads are measured against. A copy reads and writes each byte; both count."""
        size = min(self.weights.size, COPY_PROBE_BYTES)
        dev = self.device
        if "copy_probe" not in self.buffers:
            self.buffers["copy_probe"] = dev.alloc(size)
        dev.synchronize()
        start = time.perf_counter()
        dev.copy(self.buffers["copy_probe"], self.buffers["weights"], size)
        dev.synchronize()
        return 2 * size / (time.perf_counter() - start) / 1e9
