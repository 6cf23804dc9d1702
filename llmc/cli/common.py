"""What several commands share: progress lines and the compile options from the arguments."""

from __future__ import annotations

import argparse
import shutil
import sys
import threading
import time

from llmc.errors import UsageError


class Progress:
    """Progress on stderr: `progress(line)` for a step done (a phase's line); `progress.update(text)` for the
    work under way, shown once the step (from its first update) has run `QUIET` seconds on a terminal, as one
    line rewritten in place, or `LOG_EVERY` seconds in a log, as a plain line at most every `LOG_EVERY` seconds
    (by a timer if no update comes then): a step that ends, or fails, sooner shows none."""

    QUIET = 2.0
    TTY_EVERY = 0.1
    LOG_EVERY = 5.0

    def __init__(self) -> None:
        self.since, self.shown = time.monotonic(), float("-inf")  # the step's first update; the last shown
        self.active = False  # a step under way: updated since the last line
        self.text = ""  # the latest update, not shown yet
        self.pending = False  # an update on the terminal's line
        self.timer: threading.Timer | None = None
        self.lock = threading.Lock()

    def __call__(self, message: str) -> None:
        with self.lock:
            self._settle()
            print(message, file=sys.stderr, flush=True)

    def update(self, text: str) -> None:
        """`text` as the work under way; "" for none (a step's update is not shown once it has ended)."""
        with self.lock:
            if not text:
                self._settle()
                return
            now = time.monotonic()
            if not self.active:
                self.active, self.since = True, now
            self.text = text
            every = self.TTY_EVERY if sys.stderr.isatty() else self.LOG_EVERY
            quiet = self.QUIET if sys.stderr.isatty() else max(self.QUIET, self.LOG_EVERY)
            wait = max(self.since + quiet, self.shown + every) - now
            if wait <= 0:
                self._show()
            elif self.timer is None:
                self.timer = threading.Timer(wait, self._shown_late)
                self.timer.daemon = True
                self.timer.start()

    def _shown_late(self) -> None:
        with self.lock:
            self.timer = None
            if self.text:
                self._show()

    def _show(self) -> None:
        self.shown = time.monotonic()
        if sys.stderr.isatty():
            width = shutil.get_terminal_size().columns - 1  # a longer line would wrap, and \r not reach its start
            sys.stderr.write(f"\r\033[K{self.text[:width]}")
            sys.stderr.flush()
            self.pending = True
        else:
            print(self.text, file=sys.stderr, flush=True)
        self.text = ""

    def _settle(self) -> None:
        """No update after the step's line: the timer off, the terminal's line cleared."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.text, self.active = "", False
        if self.pending:
            sys.stderr.write("\r\033[K")
            self.pending = False


progress = Progress()


def compile_options_given(args: argparse.Namespace) -> bool:
    """Whether the command line gives any compile option (for a command handed an artifact, which has its own):
    one whose value is not its command's default."""
    names = ("quant", "quant_output", "requantize", "compute", "calibrate", "cpu", "max_seq", "prefill_chunk",
             "no_group", "exact_logits", "kv_type", "max_batch", "verify_drafts", "no_raise", "tokenizer")
    return any(getattr(args, name, None) != args.parser.get_default(name) for name in names)


def compile_options(args: argparse.Namespace):
    """The `CompileOptions` of a command's arguments (those it has; the rest default)."""
    from llmc.ir.formats import Storage
    from llmc.passes.pipeline import CompileOptions
    from llmc.passes.split import check_rows

    if args.requantize and not (args.quant or args.quant_output):
        raise UsageError("--requantize converts tensors to --quant (or --quant-output) TYPE: give one")
    for option, value in (("--quant", args.quant), ("--quant-output", args.quant_output)):
        if value:
            try:
                Storage.parse(value)
            except ValueError as e:
                raise UsageError(f"{option}: {e}") from None
    drafts = getattr(args, "verify_drafts", CompileOptions.speculate)
    max_batch = getattr(args, "max_batch", None) or 1
    check_rows(max_batch, drafts)
    return CompileOptions(prefill_chunk=getattr(args, "prefill_chunk", None) or 0,
                          max_seq=getattr(args, "max_seq", None) or 0, group=not getattr(args, "no_group", False),
                          exact_logits=getattr(args, "exact_logits", False),
                          quant=args.quant or "", quant_output=args.quant_output or "", requantize=args.requantize,
                          compute=args.compute, calibrate=args.calibrate or "",
                          kv_type=getattr(args, "kv_type", None) or "f16",
                          max_batch=max_batch,
                          speculate=drafts,
                          no_raise=tuple(getattr(args, "no_raise", None) or ()))
