"""LLVM IR → object code → shared library, for the host (or a named x86 CPU).

    tm = target_machine()                      # the host CPU and its features
    obj = compile_to_object(module, tm)        # parse, verify, O3, emit (or the kernel cache's copy)
    link_shared([obj], "build/kernels-3f2a.so")
    objs, cached = compile_objects([module, Deferred("matmul_k64 ...", build)], tm)  # build() only on a miss

llvmlite keeps one global LLVM context, so parsing, optimising and emitting are
serialised by a lock; targets are initialised once, on first use. `compile_objects`
compiles the modules the kernel cache lacks in `$LLMC_JOBS` processes (`llmc compile
--jobs N`, default every CPU this process may run on; a program calling the compiler gets
one unless it sets `$LLMC_JOBS`, since workers import its main module): this one and
workers, where two or more miss and they are big enough to pay for a worker's start; the workers compile the
modules built first while this process builds the IR of the others. Each worker builds the
same target machine from its description, so the objects are those of the serial path.
The system C compiler (`$CC`, else `cc`) links the objects; libm is linked (kernels may
call `cos`/`sin`).
"""

from __future__ import annotations

import bisect
import functools
import multiprocessing
import os
import queue
import shlex
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

from llvmlite import ir

from llmc import cache
from llmc.backends import kernel_cache
from llmc.backends.kernel_cache import llvm  # (llvmlite's bindings, loaded there: one error where they cannot be)
from llmc.errors import LlmcError


class ToolchainError(LlmcError):
    """The native toolchain is missing or failed (no C compiler, link error)."""


_init_lock = threading.Lock()
_initialized = False
# llvmlite parses into LLVM's global context: one compilation at a time.
_llvm_lock = threading.RLock()


def _ensure_llvm() -> None:
    global _initialized
    if _initialized:
        return
    with _init_lock:
        if not _initialized:
            llvm.initialize_all_targets()
            llvm.initialize_all_asmprinters()
            _initialized = True


def host_cpu() -> tuple[str, str]:
    """The host's LLVM CPU name and feature string."""
    _ensure_llvm()
    return llvm.get_host_cpu_name(), llvm.get_host_cpu_features().flatten()


def target_machine(cpu: str = "native", *, features: str | None = None, opt: int = 3,
                   triple: str | None = None) -> llvm.TargetMachine:
    """A position-independent target machine: "native" is the host CPU with its
    features; any other name is an LLVM CPU (e.g. "x86-64-v3", "znver4") with that
    CPU's default features, or `features` when given ("+avx2,+fma")."""
    _ensure_llvm()
    with _llvm_lock:
        try:
            target = llvm.Target.from_triple(triple) if triple else llvm.Target.from_default_triple()
        except RuntimeError as e:
            raise ToolchainError(f"no LLVM target for triple {triple!r}: {str(e).strip()}") from None
        if cpu == "native":
            name, feats = host_cpu()
        else:
            name, feats = cpu, ""
        if features is not None:
            feats = features
        try:
            tm = target.create_target_machine(cpu=name, features=feats, opt=opt, reloc="pic", codemodel="default")
        except RuntimeError as e:
            raise ToolchainError(f"cannot create a target machine for cpu {cpu!r}: {e}") from None
        tm.llmc_machine = (tm.triple, name, feats, opt)  # what a worker process builds the same machine from
        tm.llmc_description = (tm.triple, name, feats, f"codegen O{opt}")  # what its code depends on
        return tm


@functools.cache
def _machine(triple: str, cpu: str, features: str, opt: int) -> llvm.TargetMachine:
    return target_machine(cpu, features=features, opt=opt, triple=triple)


JOBS = "LLMC_JOBS"  # how many processes compile kernel modules
# the least LLVM IR (characters) among the modules to compile that starts worker processes: below it (about a
# second of O3 on one core) a worker's start (half a second, importing llmc) costs more than it saves
PARALLEL_IR = 2_000_000


def jobs() -> int:
    """How many processes compile kernel modules: `$LLMC_JOBS`, else 1. Worker processes (forkserver or spawn)
    import the main module of the program that starts them, so only programs that ask get them: `llmc compile`
    sets it (`--jobs N`, default `available_cpus()`); a script setting it guards its top-level code with
    `if __name__ == "__main__":`."""
    chosen = os.environ.get(JOBS)
    if chosen:
        if not chosen.isdigit() or int(chosen) < 1:
            raise ToolchainError(f"{JOBS}={chosen!r}: expected a positive number of processes")
        return int(chosen)
    return 1


def available_cpus() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def using_jobs(n: int) -> AbstractContextManager[None]:
    """`n` processes compile kernel modules inside the block (`llmc compile --jobs N`)."""
    return cache.environment(JOBS, str(n))


_status: ContextVar[Callable[[str], None] | None] = ContextVar("llmc_codegen_status", default=None)


@contextmanager
def reporting(status: Callable[[str], None] | None) -> Iterator[None]:
    """`compile_objects` inside the block tells `status` how far it is after each module."""
    token = _status.set(status)
    try:
        yield
    finally:
        _status.reset(token)


def _parse(ir_text_or_module: str | ir.Module, tm: llvm.TargetMachine) -> llvm.ModuleRef:
    text = str(ir_text_or_module)
    mod = llvm.parse_assembly(text)
    mod.triple = tm.triple
    mod.data_layout = str(tm.target_data)
    mod.verify()
    return mod


def optimize(mod: llvm.ModuleRef, tm: llvm.TargetMachine, level: int = 3) -> None:
    """Run LLVM's default `O<level>` pipeline (new pass manager) on `mod` in place."""
    if level <= 0:
        return
    pto = llvm.create_pipeline_tuning_options(speed_level=level)
    pto.loop_vectorization = True
    pto.slp_vectorization = True
    pto.loop_unrolling = True
    pb = llvm.create_pass_builder(tm, pto)
    try:
        pb.getModulePassManager().run(mod, pb)
    finally:
        pb.close()


def optimized_ir(ir_text_or_module: str | ir.Module, tm: llvm.TargetMachine, level: int = 3) -> str:
    """The module's LLVM IR after O`level` (for inspection and tests)."""
    return _emit(ir_text_or_module, tm, level, str)


def compile_to_object(ir_text_or_module: str | ir.Module, tm: llvm.TargetMachine, level: int = 3) -> bytes:
    """Parse, verify, optimise (O3 by default) and emit an ELF object for `tm`; the kernel cache's
    copy where the same text was compiled for the same target before (`llmc.backends.kernel_cache`)."""
    return compile_objects([ir_text_or_module], tm, level)[0][0]


@dataclass(frozen=True)
class Deferred:
    """A module known before it is built by `identity`, everything its text depends on (what its emitter reads,
    `kernel_cache.compiler_version()`): `compile_objects` calls `build` only where the kernel cache lacks it."""
    identity: str
    build: Callable[[], ir.Module]


def compile_objects(modules: Sequence[str | ir.Module | Deferred], tm: llvm.TargetMachine, level: int = 3,
                    assembly: bool = False) -> tuple[list[bytes], int]:
    """`compile_to_object` of each module (with `assembly`, its assembly text, UTF-8: NVPTX's PTX), and how many
    of them the kernel cache held; where two or more miss the cache and their IR is `PARALLEL_IR` or more,
    `jobs()` processes compile them: this one and workers."""
    description = getattr(tm, "llmc_description", None)
    texts = [None if isinstance(module, Deferred) else str(module) for module in modules]
    kind = "assembly" if assembly else "object"
    keys = [None if description is None else kernel_cache.cache_key(
        f"deferred {module.identity}" if isinstance(module, Deferred) else text, kind, *description, f"O{level}")
        for module, text in zip(modules, texts)]
    objects = [None if key is None else kernel_cache.lookup(key) for key in keys]
    missing = [i for i, obj in enumerate(objects) if obj is None]
    cached = len(texts) - len(missing)
    status = _status.get()
    if status is not None:
        status(f"codegen: {cached} of {len(texts)} modules compiled, {cached} from the cache")
    for done, (i, obj) in enumerate(_compiling(modules, texts, missing, tm, level, assembly), cached + 1):
        if keys[i] is not None:
            kernel_cache.store(keys[i], obj)
        objects[i] = obj
        if status is not None:
            status(f"codegen: {done} of {len(texts)} modules compiled, {cached} from the cache")
    return objects, cached  # type: ignore[return-value]


class _Built:
    """The modules built and not yet taken by a process to compile, longest first."""

    def __init__(self, texts: list[str | None]):
        self.texts = texts
        self.waiting: list[int] = []
        self.building = True
        self.changed = threading.Condition()

    def put(self, i: int) -> None:
        with self.changed:
            bisect.insort(self.waiting, i, key=lambda j: -len(self.texts[j]))
            self.changed.notify()

    def take(self, wait: bool) -> int | None:
        """The longest module waiting; with `wait`, waits for one while modules are being built."""
        with self.changed:
            while wait and self.building and not self.waiting:
                self.changed.wait()
            return self.waiting.pop(0) if self.waiting else None

    def close(self, drop: bool = False) -> None:
        """No more modules will be built (with `drop`, those waiting are given up)."""
        with self.changed:
            self.building = False
            if drop:
                self.waiting.clear()
            self.changed.notify_all()


def _compiling(modules: Sequence[str | ir.Module | Deferred], texts: list[str | None], which: list[int],
               tm: llvm.TargetMachine, level: int, assembly: bool) -> Iterator[tuple[int, bytes]]:
    """(i, the object of module i) for each i of `which` as it is done. This process builds the deferred modules
    one after another; once the IR built reaches `PARALLEL_IR`, worker processes (`jobs()` in all, at most one per
    module) start compiling the longest module built so far while this process builds the rest, then compiles
    with them. A worker's error is a `ToolchainError` of one line."""
    built = _Built(texts)
    done: queue.SimpleQueue = queue.SimpleQueue()  # (i, object or the worker's exception)
    workers = min(jobs(), len(which)) - 1 if hasattr(tm, "llmc_machine") else 0
    pool: ProcessPoolExecutor | None = None
    size, left = 0, len(which)

    def feed() -> None:  # one thread per worker process: the next module to it, its object back
        while (i := built.take(wait=True)) is not None:
            try:
                done.put((i, pool.submit(_compile_in_worker, texts[i], tm.llmc_machine, level, assembly).result()))
            except Exception as e:
                done.put((i, e))
                return

    def checked(i: int, result: bytes | Exception) -> tuple[int, bytes]:
        if isinstance(result, ToolchainError):
            raise result
        if isinstance(result, Exception):  # the worker process died, or could not start
            raise ToolchainError(f"a codegen worker process failed on kernel module {_name(texts[i])}: "
                                 f"{_first_lines(result)}")
        return i, result

    try:
        for i in which:
            module = modules[i]
            if isinstance(module, Deferred):
                texts[i] = str(module.build())
            size += len(texts[i])
            built.put(i)
            if pool is None and workers > 0 and size >= PARALLEL_IR:
                context = multiprocessing.get_context(
                    "forkserver" if "forkserver" in multiprocessing.get_all_start_methods()
                    else "spawn")  # never fork: this process holds LLVM's state
                pool = ProcessPoolExecutor(workers, mp_context=context)
                for _ in range(workers):
                    threading.Thread(target=feed, daemon=True).start()
            while not done.empty():
                left -= 1
                yield checked(*done.get())
        built.close()
        while left:
            mine = built.take(wait=False) if done.empty() else None
            left -= 1
            yield checked(*((mine, _compiled(texts[mine], tm, level, assembly)) if mine is not None
                            else done.get()))
    finally:
        built.close(drop=True)
        if pool is not None:
            pool.shutdown(cancel_futures=True)


def _compile_in_worker(text: str, machine: tuple, level: int, assembly: bool) -> bytes:
    return _compiled(text, _machine(*machine), level, assembly)


def _compiled(text: str, tm: llvm.TargetMachine, level: int, assembly: bool) -> bytes:
    """The object (or assembly) of one module of `compile_objects`; LLVM's error a `ToolchainError` of one line."""
    try:
        if assembly:
            return _emit(text, tm, level, tm.emit_assembly).encode()
        return _emit(text, tm, level, tm.emit_object)
    except RuntimeError as e:
        raise ToolchainError(f"codegen of kernel module {_name(text)} failed: {_first_lines(e)}") from None


def _name(text: str) -> str:
    return text.partition("\n")[0].removeprefix("; ModuleID = ")


def _first_lines(error: Exception) -> str:
    """LLVM's message and its first detail ("LLVM IR parsing error: <string>:1:17: error: expected type")."""
    return ": ".join([line.strip()[:200] for line in str(error).splitlines() if line.strip()][:2]) or \
        type(error).__name__


def compile_to_assembly(ir_text_or_module: str | ir.Module, tm: llvm.TargetMachine, level: int = 3) -> str:
    """Like `compile_to_object`, but the target's assembly text."""
    return _emit(ir_text_or_module, tm, level, tm.emit_assembly)


def _emit(ir_text_or_module: str | ir.Module, tm: llvm.TargetMachine, level: int, emit):
    _ensure_llvm()
    with _llvm_lock:
        mod = _parse(ir_text_or_module, tm)
        optimize(mod, tm, level)
        return emit(mod)


def c_compiler() -> list[str]:
    """The command line of the C compiler used as linker: `$CC` split like a shell, or `cc`."""
    try:
        argv = shlex.split(os.environ.get("CC") or "cc")
    except ValueError as e:  # (an unclosed quote)
        raise ToolchainError(f"$CC is not a command line: {e}") from None
    if not argv or shutil.which(argv[0]) is None:
        shown = argv[0] if argv else "(empty $CC)"
        raise ToolchainError(f"no C compiler found ({shown}): install gcc or clang, or set CC to one")
    return argv


def link_shared(objects: Sequence[bytes | str | os.PathLike], out_path: str | os.PathLike,
                exports: str | None = None) -> Path:
    """Link objects (bytes, or paths of object files) into the shared library `out_path`; with
    `exports`, only the symbols starting with it are visible outside the library (a version script),
    and calls between the objects stay direct.

    The library is written under a temporary name and renamed, so a reader never sees
    half a file. Give every distinct library a distinct path: `ctypes.CDLL` returns the
    already-loaded library for a path it has seen.
    """
    out = Path(out_path)
    argv = c_compiler()
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmc-link-") as tmp:
        paths = []
        for i, obj in enumerate(objects):
            if isinstance(obj, (bytes, bytearray)):
                p = Path(tmp) / f"obj{i}.o"
                p.write_bytes(obj)
                paths.append(str(p))
            else:
                paths.append(os.fspath(obj))
        partial = out.with_name(f".{out.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        cmd = [*argv, "-shared", "-Wl,-z,noexecstack", "-o", str(partial), *paths, "-lm"]
        if exports is not None:
            script = Path(tmp) / "exports.map"
            script.write_text(f"{{ global: {exports}*; local: *; }};\n")
            cmd.append(f"-Wl,--version-script={script}")
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as e:
            raise ToolchainError(f"cannot run the C compiler {argv[0]}: {e.strerror or e}") from None
        if proc.returncode != 0:
            partial.unlink(missing_ok=True)
            lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
            detail = next((ln for ln in lines if "error" in ln.lower()), lines[0] if lines else "no output")
            raise ToolchainError(f"linking {out.name} with {argv[0]} failed (exit {proc.returncode}): {detail}")
        if not partial.is_file():
            raise ToolchainError(f"linking {out.name}: {argv[0]} exited 0 without writing the library ($CC is not "
                                 f"a C compiler?)")
        os.replace(partial, out)
    return out


def build_shared(module: str | ir.Module, out_path: str | os.PathLike, tm: llvm.TargetMachine | None = None,
                 level: int = 3) -> Path:
    """compile_to_object + link_shared in one call (the host CPU by default)."""
    return link_shared([compile_to_object(module, tm or target_machine(), level)], out_path)
