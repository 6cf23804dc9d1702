"""The `llmc` command line.

    llmc ir MODEL [--phase import|optimize] [-o FILE]     print a model's IR
    llmc opt FILE.mlir [-p PASS,PASS] [--print-ir-after-all]   parse, verify, run passes, print
    llmc verify MODEL [--prompt TEXT] [--tolerance COS]   compare every stage with the source model

MODEL is a `.gguf` file, a Hugging Face directory, or a known name (`smollm2-135m`).
Errors in the input or options print one line and exit with code 2; `--debug` shows
the traceback instead.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from llmc import __version__
from llmc.errors import LlmcError, UsageError

EXIT_USAGE = 2


def _out(text: str, path: str | None) -> None:
    if path is None or path == "-":
        sys.stdout.write(text)
    else:
        Path(path).write_text(text)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_ir(args: argparse.Namespace) -> int:
    from llmc.frontend import import_model, load_model
    from llmc.ir.text import print_module
    from llmc.passes.pipeline import IRDumper, phases_through, run_phase

    dump = IRDumper(
        print_to=(lambda s: print(s, file=sys.stderr, end="")) if args.print_ir_after_all else None,
        directory=Path(args.dump_ir) if args.dump_ir else None,
    )
    module = import_model(load_model(args.model))
    for phase in phases_through(args.phase):
        run_phase(module, phase, dump)
    _out(print_module(module, generic=args.generic), args.output)
    return 0


def cmd_opt(args: argparse.Namespace) -> int:
    from llmc.ir.text import parse_module, print_module, verify_module
    from llmc.passes.pipeline import IRDumper, run_passes
    from llmc.passes.registry import get_pass

    if args.file == "-":
        text, source = sys.stdin.read(), "<stdin>"
    else:
        try:
            text, source = Path(args.file).read_text(), args.file
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read {args.file}: {e}") from e
    passes = [get_pass(name.strip()) for name in args.passes.split(",") if name.strip()] if args.passes else []
    module = parse_module(text, source)
    verify_module(module)
    dump = IRDumper(print_to=lambda s: print(s, file=sys.stderr, end="")) if args.print_ir_after_all else None
    run_passes(module, passes, dump)
    _out(print_module(module, generic=args.generic), args.output)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from llmc.frontend import import_model, load_model
    from llmc.frontend.reference import reference_logits, reference_name
    from llmc.ir.interpreter import forward_logits
    from llmc.passes.pipeline import phases_through, run_phase
    from llmc.verify import verify_stages

    if not 0.0 < args.tolerance <= 1.0:
        raise UsageError(f"--tolerance must be in (0, 1], got {args.tolerance}")
    model = load_model(args.model)
    tokens = model.tokenizer.encode(args.prompt)
    if not tokens:
        raise UsageError("--prompt gives no tokens")
    c = model.config
    print(f"model    {model.source} ({c.arch}, {c.layers} layers, hidden {c.hidden}, vocab {c.vocab_size})")
    print(f"prompt   {args.prompt!r} ({len(tokens)} tokens)")
    start = time.perf_counter()
    reference = reference_logits(model.source, tokens)
    _progress(f"reference computed in {time.perf_counter() - start:.1f} s")
    module = import_model(model)
    for phase in phases_through("optimize"):
        run_phase(module, phase)
    stages = {"llm": lambda: forward_logits(module, model.weights, tokens)}
    ok = verify_stages(reference, stages, args.tolerance, reference_name(), print)
    if not ok:
        print(f"FAILED: a stage has cosine below {args.tolerance}", file=sys.stderr)
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback on errors")
    model_help = "a .gguf file, a Hugging Face model directory, or a known model name (smollm2-135m)"

    parser = argparse.ArgumentParser(
        prog="llmc",
        description="llmc: an ahead-of-time compiler for large language models.",
        epilog="Run 'llmc COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"llmc {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("ir", parents=[common], help="print a model's IR after a phase",
                       description="Import a model and print its IR after the given phase.")
    p.add_argument("model", metavar="MODEL", help=model_help)
    p.add_argument("--phase", choices=["import", "optimize"], default="import",
                   help="the last phase to run (default: import)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the IR to FILE instead of stdout")
    p.add_argument("--generic", action="store_true", help="print the generic op form instead of the custom one")
    p.add_argument("--print-ir-after-all", action="store_true", help="print the IR to stderr after every pass")
    p.add_argument("--dump-ir", metavar="DIR", help="write the IR after every pass to DIR as numbered .mlir files")
    p.set_defaults(run=cmd_ir)

    p = sub.add_parser("opt", parents=[common], help="parse, verify, transform and print IR",
                       description="Parse an .mlir file of llmc's dialects, verify it, run passes, print the result.")
    p.add_argument("file", metavar="FILE.mlir", help="IR text to read ('-' for stdin)")
    p.add_argument("-p", "--passes", metavar="PASS,PASS",
                   help="comma-separated passes to run in order (verify, canonicalize, dce)")
    p.add_argument("--print-ir-after-all", action="store_true", help="print the IR to stderr after every pass")
    p.add_argument("-o", "--output", metavar="FILE", help="write the IR to FILE instead of stdout")
    p.add_argument("--generic", action="store_true", help="print the generic op form instead of the custom one")
    p.set_defaults(run=cmd_opt)

    p = sub.add_parser("verify", parents=[common], help="compare every stage's logits with the source model",
                       description="Run the source model's reference (transformers fp32) and each llmc stage on "
                                   "the same tokens; print cosine similarity, max abs error and top-1 agreement "
                                   "per stage. Exits 1 when a stage's cosine is below the tolerance.")
    p.add_argument("model", metavar="MODEL", help=model_help)
    p.add_argument("--prompt", default="The capital of France is", help="text to run (default: %(default)r)")
    p.add_argument("--tolerance", type=float, default=0.9999, metavar="COS",
                   help="lowest acceptable cosine similarity per stage (default: %(default)s)")
    p.set_defaults(run=cmd_verify)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except LlmcError as e:
        if args.debug:
            raise
        print(f"llmc: error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if args.debug:
            raise
        print(f"llmc: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
