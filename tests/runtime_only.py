"""Running `llmc` commands in a process where the compiler stack cannot be imported.

`runtime_only(extra_blocked, *argv)` is the command line: `llmc *argv` in a fresh Python whose
imports of xDSL, llvmlite, torch, transformers, gguf and llmc's compiler packages (and of the
comma-separated `extra_blocked`, to play a missing optional package) fail, and which checks at
exit that none of them was loaded: what runs an artifact (`run`, `serve`, `chat`) needs none.
A `prelude` (Python source: a test's patch of the runtime) runs first, under the same blocking.
"""

from __future__ import annotations

import sys
import textwrap

_SCRIPT = textwrap.dedent(
    """
    import sys
    from importlib.abc import MetaPathFinder

    BLOCKED = ("xdsl", "llvmlite", "torch", "transformers", "gguf",
               "llmc.frontend", "llmc.ir", "llmc.passes", "llmc.backends", "llmc.driver") + tuple(sys.argv[1].split(","))

    class Block(MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if any(name == b or name.startswith(b + ".") for b in BLOCKED if b):
                raise ImportError(f"blocked: {name}", name=name)
            return None

    sys.meta_path.insert(0, Block())
    exec(sys.argv[2])
    from llmc.cli import main
    code = main(sys.argv[3:])
    assert not any(m.startswith(("xdsl", "llvmlite", "torch")) for m in sys.modules)
    sys.exit(code)
    """
)


def runtime_only(extra_blocked: str, *argv: str, prelude: str = "") -> list[str]:
    """The command line of `llmc *argv` with the compiler stack (and `extra_blocked`) unimportable, after
    `prelude`."""
    return [sys.executable, "-c", _SCRIPT, extra_blocked, prelude, *argv]
