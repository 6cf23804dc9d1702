"""`llmc bench --speculate --draft` on a tiny-model pair (random weights, the tests' tokenizer): a 4-layer
256-wide target in f32, drafted by its own q4_0 copy and by an unrelated 1-layer model.

    .venv/bin/python benchmarks/speculate_tiny_pair.py [DIR]   # (default DIR: /tmp/llmc-tiny-pair)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from tiny_models import TinySpec, random_weights, write_gguf  # noqa: E402

from llmc.cli import main  # noqa: E402

TARGET = TinySpec(hidden=256, layers=4, heads=8, kv_heads=4, head_dim=32, ffn=512, tied=False, context_length=2048)
OTHER = TinySpec(hidden=64, layers=1, heads=4, kv_heads=2, head_dim=16, ffn=128, tied=False, context_length=2048,
                 seed=3)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dir", type=Path, nargs="?", default=Path("/tmp/llmc-tiny-pair"),
                        help="where the models and artifacts go (default /tmp/llmc-tiny-pair)")
    root = parser.parse_args().dir
    root.mkdir(parents=True, exist_ok=True)
    for spec, name in ((TARGET, "target"), (OTHER, "other")):
        write_gguf(spec, random_weights(spec), root / f"{name}.gguf")
    for name, source, options in (("target", "target", ["--quant", "f32", "--requantize"]),
                                  ("draft-q4", "target", ["--quant", "q4_0", "--requantize"]),
                                  ("other", "other", [])):
        main(["compile", str(root / f"{source}.gguf"), "-o", str(root / name), "--max-seq", "2048", *options])
    for draft in ("draft-q4", "other"):
        main(["bench", str(root / "target"), "--speculate", "--draft", str(root / draft), "--decode-tokens", "64",
              "--repeat", "2", "--threads", "2"])
