"""The compiler driver: model → phases → (IR | artifact), with a progress line per phase.

    compile_model("smollm2-135m", Path("out"), CompileOptions(), BackendOptions())

prints

    import       0.03 s
    optimize     0.06 s
    quantize     2.90 s   q4_1 ×210, f32 ×61, q8_0 ×1; a16 ×211; est. decode 1.20×, prefill 1.15× of a8 (calibrated on 128 tokens)
    split        0.08 s   prefill chunk 128, KV capacity 4096
    group        0.05 s
    lower        0.36 s   arena: prefill 0.9 MB, prefill_kv 0.9 MB, decode 0.0 MB, score 0.9 MB
    codegen      3.95 s   kernels-7c9932fe2d970007.so (cpu rocketlake, a16 on vnni512)
    package      0.60 s   out (weights.bin 96.6 MB, 97.0 MB with kernels and manifest)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp

from llmc.errors import UsageError
from llmc.frontend import import_model, load_model
from llmc.frontend.model import Model
from llmc.ir import llm, tgt
from llmc.ir.text import print_module
from llmc.package import check_output_directory
from llmc.passes.pipeline import PHASES, CompileOptions, IRDumper, check_raisings, run_phase
from llmc.passes.quantize import check_calibrate, check_compute, module_target

TARGETS = ("cpu", "cuda")


@dataclass(frozen=True)
class BackendOptions:
    target: str = "cpu"
    cpu: str = "native"  # --cpu, for the cpu target
    gpu: str = "sm_80,sm_90"  # --gpu, for the cuda target


def _arena_report(module: ModuleOp) -> str:
    sizes = []
    for function in module.ops:
        if isinstance(function, func.FuncOp) and "tgt.arena_bytes" in function.attributes:
            size = function.attributes["tgt.arena_bytes"].value.data  # type: ignore[union-attr]
            sizes.append(f"{function.sym_name.data} {size / 1e6:.1f} MB")
    return "arena: " + ", ".join(sizes)


def _split_report(module: ModuleOp) -> str:
    for function in module.ops:
        if isinstance(function, func.FuncOp) and function.sym_name.data == "prefill":
            chunk = function.attributes["llm.max_tokens"].value.data  # type: ignore[union-attr]
            cache = function.function_type.inputs.data[-1]
            assert isinstance(cache, llm.KVCacheType)
            batch = f", {cache.slots} sequences (decode batch)" if cache.slots > 1 else ""
            return f"prefill chunk {chunk}, KV capacity {cache.capacity.data}{batch}"
    return ""


def target_attr(backend: BackendOptions) -> tgt.TargetAttr:
    """The `tgt.target` of the backend options (`--target`, `--cpu`, `--gpu`)."""
    if backend.target == "cuda":
        from llmc.backends.cuda.target import cuda_target

        return cuda_target(backend.gpu)
    from llmc.backends.cpu.target import cpu_target

    return cpu_target(backend.cpu)


def run_phases(model: Model, options: CompileOptions, last: str, dump: IRDumper | None,
               progress: Callable[[str], None], target: tgt.TargetAttr) -> ModuleOp:
    """Import, set the target, and run the phases through `last`, printing each phase's time."""
    from llmc.passes.calibrate import calibration_for
    from llmc.passes.quantize import summary

    start = time.perf_counter()
    module = import_model(model)
    module.attributes[tgt.TARGET] = target
    run_phase(module, "import", dump, options)
    progress(f"{'import':<10} {time.perf_counter() - start:6.2f} s")
    for phase in list(PHASES)[1:]:
        start = time.perf_counter()
        tokens = calibration_for(model, options, target) if phase == "quantize" else []
        run_phase(module, phase, dump, options, model.weights, tokens)
        note = ""
        if phase == "optimize" and model.graph is not None:
            note = describe_graph(model, module, needed=last != "optimize")
        elif phase == "quantize":
            note = summary(module)
        elif phase == "split":
            note = _split_report(module)
        elif phase == "group" and not options.group:
            note = "skipped (--no-group)"
        elif phase == "lower":
            note = _arena_report(module)
        progress(f"{phase:<10} {time.perf_counter() - start:6.2f} s   {note}".rstrip())
        if phase == last:
            break
    return module


def build_cpu_artifact(module: ModuleOp, model: Model, out: Path, backend: BackendOptions, compile_options: dict,
                       progress: Callable[[str], None]) -> Path:
    from llmc.backends.cpu.codegen import ENTRY_PREFIX, emit_module
    from llmc.backends.cpu.target import target_machine_for
    from llmc.backends.cpu.toolchain import compile_objects, link_shared
    from llmc.package import content_name, cpu_facts, describe, staged_directory, weight_layout

    start = time.perf_counter()
    target = module_target(module)
    layout = weight_layout(module)
    description = describe(module, layout, *cpu_facts(module))
    llvm_modules, barriers = emit_module(module, layout.offsets, description)
    objects, cached = compile_objects(llvm_modules, target_machine_for(target))
    with staged_directory(out) as stage:
        kernels = link_shared(objects, stage / content_name("kernels", b"".join(objects), ".so"), exports=ENTRY_PREFIX)
        progress(f"{'codegen':<10} {time.perf_counter() - start:6.2f} s   {kernels.name} (cpu {target.cpu.data}"
                 f"{_isa_note(module)}; {len(objects) - 1} kernels, {cached} of {len(objects)} modules from the cache; "
                 f"barriers per call: decode {barriers.get('decode', 0)})")
        _package(stage, out, model, layout, description, {"kernels": kernels}, compile_options, progress)
    return out


def _package(stage: Path, out: Path, model: Model, layout, description: dict, kernel_files: dict[str, Path],
             compile_options: dict, progress: Callable[[str], None]) -> None:
    """The weights, tokenizer and manifest beside the kernels already in `stage` (which becomes `out`)."""
    from llmc.package import write_artifact, write_weights

    start = time.perf_counter()
    write_weights(model, layout, stage / "weights.bin")
    write_artifact(stage, description, model, kernel_files, compile_options)
    total = sum(p.stat().st_size for p in stage.iterdir() if p.name != "tokenizer.json")
    progress(f"{'package':<10} {time.perf_counter() - start:6.2f} s   {out} (weights.bin {layout.size / 1e6:.1f} MB, "
             f"{total / 1e6:.1f} MB with kernels and manifest)")


def build_cuda_artifact(module: ModuleOp, model: Model, out: Path, backend: BackendOptions, compile_options: dict,
                        progress: Callable[[str], None]) -> Path:
    """PTX for the oldest `--gpu` architecture and, with ptxas on PATH, a cubin for each."""
    from llmc.backends.cuda.codegen import described, emit_module
    from llmc.backends.cuda.target import parse_gpus
    from llmc.backends.cuda.toolchain import assemble, have_ptxas, ptx
    from llmc.package import content_name, describe, staged_directory, weight_layout

    start = time.perf_counter()
    target = module_target(module)
    layout = weight_layout(module)
    llvm_module, plans, argmax = emit_module(module, layout.offsets)
    facts = {"target": "cuda", "gpu": {"arch": target.cpu.data, "features": sorted(target.features), "argmax": argmax}}
    description = describe(module, layout, facts, {stage: {"launches": plan} for stage, plan in plans.items()})
    text = described(ptx(llvm_module, target), description).encode()
    with staged_directory(out) as stage:
        kernels = stage / content_name("kernels", text, ".ptx")
        kernels.write_bytes(text)
        files, cubins, notes = {"kernels": kernels}, {}, []
        if have_ptxas():
            for arch in parse_gpus(backend.gpu):
                cubin = stage / f"{kernels.stem}.{arch}.cubin"
                report = assemble(kernels, arch, cubin)
                files[f"cubin_{arch}"] = cubin
                cubins[arch] = f"cubin_{arch}"
                most = max(r.registers for r in report.values())
                spills = sum(r.spill_bytes for r in report.values())
                notes.append(f"{arch}: ≤{most} registers, {spills} spill bytes")
        else:
            notes.append("no ptxas on PATH: PTX only, the driver compiles it at load")
        kernel_count = sum(not fn.is_declaration for fn in llvm_module.functions)
        progress(f"{'codegen':<10} {time.perf_counter() - start:6.2f} s   {kernels.name} (cuda {target.cpu.data}, "
                 f"{kernel_count} kernels; {'; '.join(notes)}; launches per decode: {len(plans['decode'])})")
        manifest_facts = {**description, "gpu": {**description["gpu"], "cubins": cubins}}
        _package(stage, out, model, layout, manifest_facts, files, compile_options, progress)
    return out


def _isa_note(module: ModuleOp) -> str:
    """`, a16+a8 on avx2`: the integer modes of the kernels (by the width of the rows they read), and the
    dot product they use."""
    isa, modes = "", set()
    for op in module.walk():
        if isinstance(op, (tgt.MatmulOp, tgt.SwigluOp)) and op.isa is not None:
            isa = isa or op.isa.data.value
            rows = op.operands[0].type
            modes.add(f"a{rows.bits}" if isinstance(rows, tgt.QRowsType) else "a8")
    return f", {'+'.join(sorted(modes, reverse=True))} on {isa}" if isa else ""


def describe_graph(model: Model, module: ModuleOp, needed: bool = True) -> str:
    """Set an imported graph's config from its raised IR (`graph_config`; an error where it cannot
    be compiled further, if that is `needed`); what was raised, in words."""
    from collections import Counter

    from llmc.errors import ModelFormatError
    from llmc.frontend.graph import graph_config

    try:
        model.config = graph_config(module, model.source)
    except ModelFormatError as e:
        if needed:
            raise
        return e.problem
    counts = Counter(op.name for op in module.walk() if op.name.startswith("llm."))
    raised = ", ".join(f"{counts[name]} {name[4:]}" for name in ("llm.attention", "llm.rope", "llm.rms_norm",
                                                                  "llm.matmul") if counts[name])
    left = sum(n for name, n in counts.items() if name not in RAISED_OPS)
    return f"raised {raised}" + (f"; {left} primitive ops left" if left else "")


# what the graph frontends' primitive ops are raised to (the ops the GGUF path builds)
RAISED_OPS = {"llm.weight", "llm.embedding", "llm.rms_norm", "llm.matmul", "llm.logits", "llm.reshape", "llm.rope",
              "llm.attention", "llm.add", "llm.mul", "llm.silu", "llm.gelu", "llm.swiglu", "llm.last_token"}


def check_backend(options: CompileOptions, backend: BackendOptions, compile_to: str | None,
                  out: Path | None) -> tgt.TargetAttr:
    """The target of `backend`, after checking the options that need no model."""
    if backend.target not in TARGETS:
        raise UsageError(f"unknown target '{backend.target}' (targets: {', '.join(TARGETS)})")
    target = target_attr(backend)
    check_compute(options.compute, target)  # before the model loads, not after the first phases
    check_calibrate(options)
    check_raisings(options)
    if compile_to is not None and compile_to not in PHASES:
        raise UsageError(f"unknown phase '{compile_to}' (phases: {', '.join(PHASES)})")
    if out is not None and compile_to is None:
        check_output_directory(out)
    return target


def compile_model(spec: str, out: Path | None, options: CompileOptions, backend: BackendOptions,
                  compile_to: str | None = None, dump: IRDumper | None = None,
                  progress: Callable[[str], None] = print, allow_pickle: bool = False,
                  tokenizer: str | None = None) -> Path | str:
    """Compile `spec` to an artifact in `out`; with `compile_to`, return that phase's IR text instead."""
    target = check_backend(options, backend, compile_to, out)
    return compile_loaded(load_model(spec, allow_pickle, tokenizer), out, options, backend, target, compile_to,
                          dump, progress)


def compile_loaded(model: Model, out: Path | None, options: CompileOptions, backend: BackendOptions,
                   target: tgt.TargetAttr, compile_to: str | None = None, dump: IRDumper | None = None,
                   progress: Callable[[str], None] = print) -> Path | str:
    """`compile_model` of a model already loaded."""
    if compile_to is None:
        model.tokenizer  # the artifact needs it: a broken tokenizer fails now, not after codegen
    module = run_phases(model, options, compile_to or "lower", dump, progress, target)
    if compile_to is not None:
        return print_module(module)
    assert out is not None
    compile_options = asdict(options) | asdict(backend)
    if backend.target == "cuda":
        return build_cuda_artifact(module, model, out, backend, compile_options, progress)
    return build_cpu_artifact(module, model, out, backend, compile_options, progress)


def compile_torch(module, example_inputs: tuple, out: Path, tokenizer: str, options: CompileOptions,
                  backend: BackendOptions, progress: Callable[[str], None] = print) -> Path:
    """`llmc.compile`: a torch module exported with torch.export, then compiled as a `.pt2` file is."""
    from llmc.frontend.graph import graph_model
    from llmc.frontend.torch_export import export_decoder, import_program

    target = check_backend(options, backend, None, out)
    start = time.perf_counter()
    source = Path(f"{type(module).__name__}.pt2")  # what the manifest names as the source
    graph, weights = import_program(export_decoder(module, example_inputs), source)
    progress(f"{'export':<10} {time.perf_counter() - start:6.2f} s   torch.export")
    result = compile_loaded(graph_model(source, graph, weights, tokenizer), out, options, backend, target,
                            progress=progress)
    assert isinstance(result, Path)
    return result
