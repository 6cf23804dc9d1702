"""Shrink a finding to the fewest bytes that still fail the same way, and name it.

    python fuzz/minimize.py TARGET FILE NAME [--seconds 120] [--timeout 10]

Removes chunks of the input (halves, quarters, ... single bytes) while the target's `check`
fails with the same signature (exception type and innermost llmc frame, or "hang" when an input
runs past `--timeout` seconds), then writes `fuzz/corpus/TARGET/NAME` and `NAME.txt` (signature
and traceback). Runs without atheris.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `fuzz` as a package

from fuzz.common import CORPUS, signature  # noqa: E402


class Hang(Exception):
    """An input still running after the timeout."""


def failure(check, data: bytes, timeout: float) -> BaseException | None:
    """How `check(data)` fails (None: it does not)."""

    def expired(signum: int, frame: object) -> None:
        raise Hang(f"still running after {timeout} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    try:
        check(data)
    except KeyboardInterrupt:
        raise
    except BaseException as e:
        return e
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return None


def key(error: BaseException | None) -> str | None:
    return None if error is None else "hang" if isinstance(error, Hang) else signature(error)


def minimize(check, data: bytes, seconds: float, timeout: float) -> tuple[bytes, BaseException]:
    error = failure(check, data, timeout)
    wanted = key(error)
    if wanted is None:
        raise SystemExit("this input does not fail")
    deadline = time.monotonic() + seconds
    chunk = len(data) // 2
    while chunk >= 1 and time.monotonic() < deadline:
        i = 0
        while i < len(data) and time.monotonic() < deadline:
            candidate = data[:i] + data[i + chunk:]
            e = failure(check, candidate, timeout)
            if key(e) == wanted:
                data, error = candidate, e
            else:
                i += chunk
        chunk //= 2
    return data, error


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("target")
    parser.add_argument("file", type=Path)
    parser.add_argument("name", help="the short name it gets in fuzz/corpus/TARGET/")
    parser.add_argument("--seconds", type=float, default=120, help="time to spend shrinking (default: 120)")
    parser.add_argument("--timeout", type=float, default=10, help="seconds after which an input hangs (default: 10)")
    args = parser.parse_args()
    check = importlib.import_module(f"fuzz.{args.target}").check
    before = args.file.read_bytes()
    data, error = minimize(check, before, args.seconds, args.timeout)
    out = CORPUS / args.target / args.name
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(data)
    out.with_name(out.name + ".txt").write_text(f"{key(error)}\n" + "".join(traceback.format_exception(error))[-4000:])
    print(f"{out}: {len(before)} -> {len(data)} bytes, {key(error)}")


if __name__ == "__main__":
    main()
