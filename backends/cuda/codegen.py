"""`tgt` entry points → LLVM modules of CUDA kernels (one per op) and a launch plan per entry point.

An entry point becomes the list of launches its kernel ops need, in program order
(one stream: each launch sees the writes of the ones before it). Each launch names a
kernel, its grid (numbers, or `{"rows_per": R}`: `ceil(n / R)` blocks), its block, and
its arguments by role, one per operand of the op (`tgt.Kernel.abi`):

    {"kernel": "matmul_q4_1_a32_k576_n576_norm_r1", "grid": [144, {"rows_per": 1}, 1], "block": [128, 1, 1],
     "shared_bytes": 0,
     "args": [{"arena": 0}, {"weights": 1048576}, {"arena": 3200}, {"n": true}, {"weights": 64}]}

A buffer is an offset into the arena (`plan-memory`), into the weights (the
artifact's weight layout), or into an entry argument (`{"argument": "k_cache",
"offset": 442368}`: a layer's `tgt.subview`); `{"n": true}` is the row count. The
runtime turns each into a device address or integer and launches; nothing here or
there knows a kernel's signature.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

from llvmlite import ir
from xdsl.dialects import func
from xdsl.dialects.builtin import IndexType, ModuleOp
from xdsl.ir import SSAValue

from llmc.abi import ARGMAX_TOKEN, PTX_DESCRIPTION
from llmc.backends.cuda.device import Emulated, Ptx
from llmc.backends.cuda.kernels import KernelLibrary, Launch, PerRows
from llmc.errors import LlmcError
from llmc.ir import entry_functions, tgt
from llmc.ir.target import Built, Describe, content_name, module_target


def _dim(d: int | PerRows) -> int | dict:
    return {"rows_per": d.per} if isinstance(d, PerRows) else d


class _Plan:
    """The launches of one entry point, with every buffer resolved to its role and offset."""

    def __init__(self, lib: KernelLibrary, function: func.FuncOp, weight_offsets: Mapping[str, int]):
        self.lib = lib
        self.weight_offsets = weight_offsets
        self.where: dict[SSAValue, dict] = {}
        for i, arg in enumerate(function.body.block.args):
            name = arg.name_hint or f"arg{i}"
            self.where[arg] = {"n": True} if isinstance(arg.type, IndexType) else {"argument": name, "offset": 0}
        self.launches: list[dict] = []

    def emit(self, op) -> None:
        w = self.where
        if isinstance(op, tgt.AllocOp):
            assert op.offset is not None, "run plan-memory before codegen"
            w[op.result] = {"arena": op.offset.value.data}
        elif isinstance(op, tgt.ViewOp):
            w[op.result] = w[op.source]
        elif isinstance(op, tgt.SubviewOp):
            source = w[op.source]
            if "argument" not in source:
                raise LlmcError("cuda codegen: a subview of something other than an entry argument")
            w[op.result] = {"argument": source["argument"], "offset": source["offset"] + op.byte_offset}
        elif isinstance(op, tgt.WeightOp):
            w[op.result] = {"weights": self.weight_offsets[op.sym_name]}
        elif isinstance(op, tgt.Kernel):
            args = [w[value] for _, value in op.abi()]
            for launch in self.lib.launches(op):
                self.launches.append(_launch_entry(launch, args))
        elif not isinstance(op, func.ReturnOp):
            raise LlmcError(f"cuda codegen: no emitter for {op.name}")


def _launch_entry(launch: Launch, args: list[dict]) -> dict:
    return {"kernel": launch.kernel, "grid": [_dim(d) for d in launch.grid], "block": [launch.block, 1, 1],
            "shared_bytes": 0, "args": args}


def emit_module(module: ModuleOp, weight_offsets: Mapping[str, int], emulated: bool = False
                ) -> tuple[list[ir.Module], dict[str, list[dict]], dict]:
    """The LLVM modules of the kernels the entry points launch (one per op, `KernelLibrary`), for the
    GPU (or, `emulated`, for the CPU emulator), each entry point's launch plan, and the launch of
    greedy decoding's argmax over the logits (into `{"argument": "token"}`: 4 bytes)."""
    lib = KernelLibrary(Emulated() if emulated else Ptx())
    plans: dict[str, list[dict]] = {}
    for stage, function in entry_functions(module).items():
        plan = _Plan(lib, function, weight_offsets)
        for op in function.body.block.ops:
            plan.emit(op)
        plans[stage] = plan.launches
    vocab = tgt.dims(function.body.block.args[-1])[1]  # the logits of any entry point
    args = [{"argument": "logits", "offset": 0}, {"argument": ARGMAX_TOKEN, "offset": 0}, {"count": vocab}]
    argmax = _launch_entry(lib.argmax(), args)
    return lib.modules, plans, argmax


def described(ptx: str, description: dict) -> str:
    """The PTX with its `description` (what its kernels and launch plans were compiled for: the
    manifest's own fields, `llmc.package.describe`) as a last comment line, for the runtime to check
    the manifest against before any launch (`llmc.runtime.cuda.check_kernels`)."""
    return f"{ptx.rstrip()}\n{PTX_DESCRIPTION}{json.dumps(description, sort_keys=True)}\n"


def build(module: ModuleOp, weight_offsets: Mapping[str, int], describe: Describe, stage: Path, options) -> Built:
    """PTX for the oldest `--gpu` architecture (`options.gpu`) and, with ptxas on PATH, a cubin for each."""
    from llmc.backends.cuda.target import parse_gpus
    from llmc.backends.cuda.toolchain import assemble, have_ptxas, ptx

    target = module_target(module)
    llvm_modules, plans, argmax = emit_module(module, weight_offsets)
    facts = {"target": "cuda", "gpu": {"arch": target.cpu.data, "features": sorted(target.features), "argmax": argmax}}
    description = describe(facts, {name: {"launches": plan} for name, plan in plans.items()})
    joined, cached = ptx(llvm_modules, target)
    text = described(joined, description).encode()
    kernels = stage / content_name("kernels", text, ".ptx")
    kernels.write_bytes(text)
    files, cubins, notes = {"kernels": kernels}, {}, []
    if have_ptxas():
        for arch in parse_gpus(options.gpu):
            cubin = stage / f"{kernels.stem}.{arch}.cubin"
            report = assemble(kernels, arch, cubin)
            files[f"cubin_{arch}"] = cubin
            cubins[arch] = f"cubin_{arch}"
            most = max(r.registers for r in report.values())
            spills = sum(r.spill_bytes for r in report.values())
            notes.append(f"{arch}: ≤{most} registers, {spills} spill bytes")
    else:
        notes.append("no ptxas on PATH: PTX only, the driver compiles it at load")
    kernel_count = sum(not fn.is_declaration for m in llvm_modules for fn in m.functions)
    note = (f"{kernels.name} (cuda {target.cpu.data}, {kernel_count} kernels, {cached} of {len(llvm_modules)} modules "
            f"from the cache; {'; '.join(notes)}; "
            f"launches per decode: {len(plans['decode'])})")
    return Built({**description, "gpu": {**description["gpu"], "cubins": cubins}}, files, note)
