"""What several commands share: progress lines and the compile options from the arguments."""

from __future__ import annotations

import argparse
import sys

from llmc.errors import UsageError


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def compile_options(args: argparse.Namespace):
    """The `CompileOptions` of a command's arguments (those it has; the rest default)."""
    from llmc.ir.formats import Storage
    from llmc.passes.pipeline import CompileOptions
    from llmc.passes.split import check_speculate

    for option, value in (("--quant", args.quant), ("--quant-output", args.quant_output)):
        if value:
            try:
                Storage.parse(value)
            except ValueError as e:
                raise UsageError(f"{option}: {e}") from None
    drafts = getattr(args, "verify_drafts", CompileOptions.speculate)
    check_speculate(drafts)
    return CompileOptions(prefill_chunk=getattr(args, "prefill_chunk", None) or 0,
                          max_seq=getattr(args, "max_seq", None) or 0, group=not getattr(args, "no_group", False),
                          quant=args.quant or "", quant_output=args.quant_output or "", requantize=args.requantize,
                          compute=args.compute, calibrate=args.calibrate or "",
                          kv_type=getattr(args, "kv_type", None) or "f16",
                          max_batch=getattr(args, "max_batch", None) or 1,
                          speculate=drafts,
                          no_raise=tuple(getattr(args, "no_raise", None) or ()))
