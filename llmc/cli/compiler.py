"""The compiler's commands: `llmc ir`, `opt`, `verify`, `compile`."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from pathlib import Path

from llmc.cli.common import compile_options, compile_options_given, progress
from llmc.errors import UsageError
from llmc.runtime.artifact import enclosing_artifact
from llmc.textfile import check_writable, read_text

IR_FILE_BYTES = 1 << 30  # the largest .mlir file `llmc opt` reads


def _out(text: str, path: str | None) -> None:
    if path is None or path == "-":
        sys.stdout.write(text)
        return
    try:
        Path(path).write_text(text)
    except OSError as e:
        raise UsageError(f"cannot write -o {path}: {e.strerror or e}") from None


def _check_out(path: str | None, reads: tuple[str | None, ...] = ()) -> None:
    """An `-o` for IR text (not standard output) checked before any work: not over what the command `reads`."""
    if path is not None and path != "-":
        check_writable("-o", Path(path), "a file for the IR", reads)


def _dumper(args: argparse.Namespace):
    from llmc.passes.pipeline import IRDumper

    directory = getattr(args, "dump_ir", None)
    outer = enclosing_artifact(Path(directory) / "00.mlir") if directory else None
    if outer is not None:
        raise UsageError(f"cannot write --dump-ir {directory}: it is inside the artifact {outer}, which it would spoil")
    try:
        return IRDumper(print_to=(lambda s: print(s, file=sys.stderr, end="")) if args.print_ir_after_all else None,
                        directory=Path(directory) if directory else None)
    except OSError as e:  # (made before any work)
        raise UsageError(f"cannot write --dump-ir {directory}: {e.strerror or e}; name a folder for the IR files") \
            from None


def cmd_ir(args: argparse.Namespace) -> int:
    """Import a model and print its IR after the given phase."""
    from llmc.driver import BackendOptions, target_attr
    from llmc.frontend import import_model, load_model
    from llmc.ir import tgt
    from llmc.ir.text import print_module
    from llmc.passes.pipeline import phases_through, run_phase

    _check_out(args.output, (args.model, args.tokenizer))
    dump = _dumper(args)
    model = load_model(args.model, args.allow_pickle, args.tokenizer)
    module = import_model(model)
    module.attributes[tgt.TARGET] = target_attr(BackendOptions(cpu=args.cpu))
    for phase in phases_through(args.phase):
        run_phase(module, phase, dump, weights=model.weights)
    _out(print_module(module, generic=args.generic), args.output)
    return 0


def cmd_opt(args: argparse.Namespace) -> int:
    """Parse an .mlir file of llmc's dialects, verify it, run passes, print the result. A pass that ends a
    phase moves the module's `llm.phase` on, so phase passes chain: `llmc opt q.mlir -p split,group`."""
    from llmc.ir.text import parse_module, print_module, verify_module
    from llmc.passes.pipeline import run_passes
    from llmc.passes.registry import parse_passes

    text, source = read_text("llmc opt", args.file, IR_FILE_BYTES), "<stdin>" if args.file == "-" else args.file
    passes = parse_passes(args.passes or "")
    _check_out(args.output)
    module = parse_module(text, source)
    verify_module(module)
    dump = _dumper(args)
    run_passes(module, passes, dump)
    _out(print_module(module, generic=args.generic), args.output)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Run the source model's reference (transformers fp32) and each llmc stage on the same tokens; print
    cosine similarity, max abs error and top-1 agreement per stage. Exits 1 when a stage's cosine is below the
    tolerance."""
    os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm is imported: transformers' GGUF loading draws bars
    from llmc.verify import verify_model

    artifact = Path(args.artifact) if args.artifact else None
    if artifact is not None and compile_options_given(args):
        progress(f"note: {artifact} is an artifact; the compile options do not apply to it (its own are checked)")
    reference = Path(args.reference) if args.reference else None
    ok = verify_model(args.model, args.prompt, args.tolerance, artifact, print, progress, args.allow_pickle,
                      compile_options(args), args.cpu, reference, args.tokenizer, args.per_layer)
    if not ok:
        print("FAILED: a stage's cosine is below what it needs", file=sys.stderr)
    return 0 if ok else 1


def _default_output(model: str) -> Path:
    """`NAME.llmc` in the current folder, NAME the model file's stem or its folder's name (`.` too)."""
    return Path(Path(os.path.realpath(model)).stem + ".llmc")


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile a model through every phase into an artifact directory (manifest.json, weights.bin, kernels.so
    or kernels.ptx, tokenizer.json) that 'llmc run' executes."""
    from llmc.driver import BackendOptions, compile_model
    from llmc.package import check_outside_output

    options = compile_options(args)
    if args.compile_to:
        _check_out(args.output, (args.model, args.tokenizer, args.calibrate))
    out = Path(args.output) if args.output else (None if args.compile_to else _default_output(args.model))
    if out is not None and not args.compile_to and args.dump_ir:
        check_outside_output(out, f"--dump-ir {args.dump_ir}", Path(args.dump_ir))
    dump = _dumper(args)
    if args.gpu is not None and args.target != "cuda":
        raise UsageError("--gpu names the GPUs of --target cuda; this compile is for the CPU (add --target cuda)")
    if args.cpu != "native" and args.target == "cuda":
        raise UsageError("--cpu names the CPU of --target cpu; this compile is for the GPU (--gpu names its GPUs)")
    backend = BackendOptions(args.target, args.cpu, args.gpu or BackendOptions.gpu)
    from llmc import cache
    from llmc.backends.cpu.toolchain import JOBS, available_cpus, jobs, using_jobs

    with contextlib.ExitStack() as settings:
        if args.no_cache:
            settings.enter_context(cache.disabled())
        if args.jobs is not None or not os.environ.get(JOBS):
            settings.enter_context(using_jobs(args.jobs or available_cpus()))
        else:
            jobs()  # ($LLMC_JOBS checked before the model loads, not where codegen reads it)
        result = compile_model(args.model, out, options, backend, args.compile_to, dump,
                               progress=progress, allow_pickle=args.allow_pickle, tokenizer=args.tokenizer)
    if isinstance(result, str):
        _out(result, args.output)
    return 0
