"""The compiler driver: model → phases → (IR | artifact), with a progress line per phase.

    compile_model("smollm2-135m", Path("out"), CompileOptions(), BackendOptions())

prints

    import       0.03 s
    optimize     0.06 s
    quantize     2.90 s   q4_1 ×210, f32 ×61, q8_0 ×1; a16 ×211; est. decode 1.20×, prefill 1.30× of a8 (calibrated on 128 tokens)
    split        0.08 s   prefill chunk 128, KV capacity 4096
    group        0.05 s
    lower        0.36 s   arena: prefill 0.9 MB, prefill_kv 0.9 MB, decode 0.0 MB, score 0.9 MB
    codegen      3.95 s   kernels-7c9932fe2d970007.so (cpu rocketlake, a16 on vnni512)
    package      0.60 s   out (weights.bin 96.6 MB, 97.0 MB with kernels and manifest)
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from xdsl.dialects import func
from xdsl.dialects.builtin import ModuleOp

from llmc.cache import cache_dir, check_location
from llmc.errors import UsageError
from llmc.frontend import import_model, load_model
from llmc.frontend.model import Model
from llmc.ir import llm, tgt
from llmc.ir.target import description_class, module_target, target_description
from llmc.ir.text import print_module
from llmc.package import check_output_directory, check_outside_output
from llmc.passes.pipeline import PHASES, CompileOptions, IRDumper, check_raisings, run_phase
from llmc.passes.quantize import check_calibrate, check_compute


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
    return description_class(backend.target).target_for(backend)


def run_phases(model: Model, options: CompileOptions, last: str, dump: IRDumper | None,
               progress: Callable[[str], None], target: tgt.TargetAttr) -> ModuleOp:
    """Import, set the target, and run the phases through `last`, printing each phase's time."""
    from llmc.passes.calibrate import calibration_for
    from llmc.passes.quantize import summary, unapplied, weight_storages

    with _updates(progress):
        start = time.perf_counter()
        _status(progress, f"import: {model.source}")
        check_raisings_apply(model, options)
        module = import_model(model)
        module.attributes[tgt.TARGET] = target
        target_description(target).check_ops(module)  # an op the target has no kernel for: refused before the work
        run_phase(module, "import", dump, options)
        progress(f"{'import':<10} {time.perf_counter() - start:6.2f} s")
        for phase in list(PHASES)[1:] if last != "import" else []:
            start = time.perf_counter()
            _status(progress, f"{phase}: running")
            tokens = calibration_for(model, options, target) if phase == "quantize" else []
            before = weight_storages(module) if phase == "quantize" else {}
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
            if phase == "quantize":
                for unused in unapplied(module, before, options.compute, options.quant, options.requantize):
                    progress(f"note: {unused}")
            if phase == last:
                break
    return module


def build_artifact(module: ModuleOp, model: Model, out: Path, backend: BackendOptions, compile_options: dict,
                   progress: Callable[[str], None]) -> Path:
    """The artifact of a planned module in `out`: the target's kernels (its description builds them),
    then the weights, tokenizer and manifest, written to a staging folder that becomes `out`."""
    from llmc.backends.cpu.toolchain import reporting
    from llmc.package import describe, staged_directory, weight_layout, write_artifact, write_weights

    start = time.perf_counter()
    layout = weight_layout(module)
    with staged_directory(out) as stage, _updates(progress):
        _status(progress, "codegen: emitting LLVM IR")
        with reporting(getattr(progress, "update", None)):  # then one update per module compiled
            built = target_description(module_target(module)).build(
                module, layout.offsets, lambda facts, entries: describe(module, layout, facts, entries), stage,
                backend)
        progress(f"{'codegen':<10} {time.perf_counter() - start:6.2f} s   {built.note}")
        start = time.perf_counter()
        _status(progress, f"package: writing weights.bin ({layout.size / 1e6:.1f} MB)")
        weights_sha256 = write_weights(model, layout, stage / "weights.bin")
        write_artifact(stage, built.description, model, built.files, compile_options, weights_sha256)
        total = sum(p.stat().st_size for p in stage.iterdir() if p.name != "tokenizer.json")
        progress(f"{'package':<10} {time.perf_counter() - start:6.2f} s   {out} (weights.bin {layout.size / 1e6:.1f} "
                 f"MB, {total / 1e6:.1f} MB with kernels and manifest)")
    return out


def _status(progress: Callable[[str], None], text: str) -> None:
    """`text` as the work under way, where `progress` shows such (`llmc.cli.common.Progress.update`); "" for
    none."""
    update = getattr(progress, "update", None)
    if update is not None:
        update(text)


@contextmanager
def _updates(progress: Callable[[str], None]) -> Iterator[None]:
    """The block's updates end with it, even when it fails (none is shown later, under another command's)."""
    try:
        yield
    finally:
        _status(progress, "")


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


# what the graph frontends' primitive ops are raised to (the ops the GGUF path builds): the model ops, and the
# residuals' and gates' add and mul
RAISED_OPS = {op.name for op in (*llm.MODEL_OPS, llm.AddOp, llm.MulOp)}


def check_backend(options: CompileOptions, backend: BackendOptions, compile_to: str | None,
                  out: Path | None) -> tgt.TargetAttr:
    """The target of `backend`, after checking the options that need no model."""
    target = target_attr(backend)
    check_location()  # ($LLMC_CACHE_DIR)
    check_compute(options.compute, target)  # before the model loads, not after the first phases
    check_calibrate(options)
    check_raisings(options)
    if compile_to is not None and compile_to not in PHASES:
        raise UsageError(f"unknown phase '{compile_to}' (phases: {', '.join(PHASES)})")
    if out is not None and compile_to is None:
        check_output_directory(out)
        if (folder := cache_dir("kernels")) is not None:
            check_outside_output(out, f"the cache folder {folder.parent} ($LLMC_CACHE_DIR)", folder)
    return target


def check_raisings_apply(model: Model, options: CompileOptions) -> None:
    """`--no-raise` names raisings of a graph import (.pt2, .onnx): other models are built of raised ops."""
    if options.no_raise and model.graph is None:
        raise UsageError(f"--no-raise is for a .pt2 or .onnx graph: {model.source.name} is imported as the model "
                         f"ops themselves, with nothing to raise")


def compile_model(spec: str, out: Path | None, options: CompileOptions, backend: BackendOptions,
                  compile_to: str | None = None, dump: IRDumper | None = None,
                  progress: Callable[[str], None] = print, allow_pickle: bool = False,
                  tokenizer: str | None = None) -> Path | str:
    """Compile `spec` to an artifact in `out`; with `compile_to`, return that phase's IR text instead."""
    target = check_backend(options, backend, compile_to, out)
    with _updates(progress):
        _status(progress, f"load: {spec}")
        model = load_model(spec, allow_pickle, tokenizer)
    return compile_loaded(model, out, options, backend, target, compile_to, dump, progress)


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
    model.check_bos()  # (a graph's vocabulary is known once optimize has raised it)
    return build_artifact(module, model, out, backend, asdict(options) | asdict(backend), progress)


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
