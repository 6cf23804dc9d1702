"""`python -m fuzz TARGET [libFuzzer options] [CORPUS_DIR ...]`: one target under atheris.

llmc's modules (and the libraries that parse what a target feeds them, where they are Python)
are instrumented for coverage as they are imported; findings go to `fuzz/corpus/TARGET/`.
Usually started by `fuzz/run.py`, which sets the time, the per-input timeout and the memory limit.
"""

from __future__ import annotations

import copy
import importlib
import json
import pkgutil
import random
import sys
from collections.abc import Iterator
from pathlib import Path

import atheris

from fuzz import TARGETS

# Python libraries whose branches a target's inputs drive, beyond llmc's own (torch, onnx and
# tokenizers parse in native code, which atheris does not see)
INSTRUMENTED = {"chat_template": ["jinja2"]}


def _positions(node: object) -> Iterator[tuple[dict | list, object]]:
    """Every (container, key) of a JSON document."""
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for key, value in items:
        yield node, key
        yield from _positions(value)


def json_mutator(data: bytes, max_size: int, seed: int) -> bytes:
    """Change one value of a JSON document (a string's text by libFuzzer's mutations, a number, a
    subtree swapped for another), so that most inputs stay JSON and reach past the parser into
    what the document describes (tokenizers' regexes, models, normalizers); other inputs get
    libFuzzer's byte mutations."""
    rng = random.Random(seed)
    try:
        document = json.loads(data)
        places = list(_positions(document))
    except (ValueError, RecursionError):
        places = []
    if not places or rng.random() < 0.1:
        return atheris.Mutate(data, max_size)
    container, key = rng.choice(places)
    value = container[key]
    if isinstance(value, str):
        container[key] = atheris.Mutate(value.encode(), 2 * len(value) + 16).decode("utf-8", "replace")
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        container[key] = rng.choice([0, -1, 1, 2**31, 2**63, value + 1, value * 1000, -value, 0.5])
    else:
        other_container, other_key = rng.choice(places)
        container[key] = copy.deepcopy(other_container[other_key])
    out = json.dumps(document, ensure_ascii=False).encode("utf-8", "surrogatepass")
    return out if len(out) <= max_size else atheris.Mutate(data, max_size)


# targets whose input is JSON
MUTATORS = {"tokenizer_json": json_mutator}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in TARGETS:
        sys.exit(f"usage: python -m fuzz {{{','.join(TARGETS)}}} [libFuzzer options] [CORPUS_DIR ...]")
    target = sys.argv.pop(1)
    with atheris.instrument_imports(include=["llmc", "fuzz", *INSTRUMENTED.get(target, [])]):
        import llmc.frontend
        from fuzz.common import CORPUS, recording  # llmc and jinja2 too: instrumented as they are imported

        module = importlib.import_module(f"fuzz.{target}")
        # every frontend, which llmc imports lazily (inside functions): imported now to be instrumented,
        # and torch's and onnx's import time kept out of the first input's
        for frontend in pkgutil.iter_modules(llmc.frontend.__path__, "llmc.frontend."):
            try:
                importlib.import_module(frontend.name)
            except ImportError:  # an extra not installed: its frontend is not reached either
                pass
    check = recording(module.check, CORPUS / target)
    # one seed before libFuzzer's clock runs: what the importers import on first use (sympy's parser
    # in torch's .pt2 loader: seconds) must not count against the first input's -timeout
    seeds = [f for d in sys.argv[1:] if not d.startswith("-") and Path(d).is_dir() for f in Path(d).iterdir()]
    if seeds:
        check(min(seeds, key=lambda f: f.stat().st_size).read_bytes())
    atheris.Setup(sys.argv, check, custom_mutator=MUTATORS.get(target))
    atheris.Fuzz()


main()
