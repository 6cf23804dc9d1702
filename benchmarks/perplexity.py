"""Perplexity of llmc artifacts next to transformers fp32 and llama.cpp, by one method, in one run.

    python benchmarks/perplexity.py smollm2.llmc smollm2-f32.llmc --model smollm2-135m \
        --llama-perplexity /path/to/llama-perplexity

The method is llama.cpp's (`llmc.runtime.perplexity`): the text without its trailing
newline, tokenized by llmc (the tokenizer the GGUF declares, as llama.cpp's), chunks of
--ctx tokens from an empty cache, the second half of each chunk scored. transformers
fp32 scores the same token ids with the same arithmetic; `llama-perplexity` (given, or
found on PATH) tokenizes and scores the GGUF itself. Ratios are against transformers fp32.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np

os.environ.setdefault("TQDM_DISABLE", "1")  # before transformers is imported: its GGUF loading draws bars


def transformers_perplexity(source: Path, chunks: list[np.ndarray]) -> tuple[float, float]:
    import torch

    from llmc.frontend.reference import reference_model
    from llmc.runtime.perplexity import Perplexity, log_softmax

    model = reference_model(source)
    result = Perplexity(chunks[0].size)
    with torch.no_grad():
        for chunk in chunks:
            logits = model(torch.tensor([chunk.tolist()])).logits[0].numpy()
            first = chunk.size // 2
            logp, targets = log_softmax(logits[first:-1]), chunk[first + 1 :]
            result.nll.append(-logp[np.arange(targets.size), targets])
            result.chunks += 1
    return result.estimate()


def llama_perplexity(binary: str, gguf: Path, text: Path, ctx: int, threads: int) -> tuple[float, float]:
    out = subprocess.run([binary, "-m", str(gguf), "-f", str(text), "-c", str(ctx), "-t", str(threads)],
                         capture_output=True, text=True, check=True)
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out.stdout + out.stderr)
    return float(found[1]), float(found[2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifacts", type=Path, nargs="+", help="artifact directories from 'llmc compile'")
    parser.add_argument("--model", default="smollm2-135m", help="the fp32 reference: a GGUF file, HF dir or name")
    parser.add_argument("--text", type=Path, default=Path("/usr/share/common-licenses/GPL-3"))
    parser.add_argument("--ctx", type=int, default=512)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-perplexity", default=shutil.which("llama-perplexity"),
                        help="llama.cpp's llama-perplexity binary")
    args = parser.parse_args()

    from llmc.frontend import load_model, resolve
    from llmc.runtime.perplexity import chunk_tokens, perplexity
    from llmc.runtime.session import Session

    text = args.text.read_text(encoding="utf-8")
    text = text[:-1] if text.endswith("\n") else text
    model = load_model(args.model)
    codec = model.tokenizer
    chunks = chunk_tokens(codec.encode(text), args.ctx, None, codec.bos_id, codec.add_bos)
    rows = [(f"transformers fp32 ({model.source.name})", *transformers_perplexity(model.source, chunks))]
    for artifact in args.artifacts:
        session = Session(artifact, threads=args.threads)
        rows.append((f"llmc {artifact.name}", *perplexity(session, chunks).estimate()))
        session.close()
    source = resolve(args.model)
    if args.llama_perplexity and source.suffix == ".gguf":
        rows.append((f"llama.cpp ({source.name})", *llama_perplexity(args.llama_perplexity, source, args.text,
                                                                      args.ctx, args.threads)))
    tokens = sum(c.size for c in chunks)
    print(f"| engine | perplexity ({len(chunks)} chunks of {args.ctx}, {tokens} tokens) | vs transformers fp32 |")
    print("|---|---|---|")
    for name, ppl, error in rows:
        print(f"| {name} | {ppl:.4f} ± {error:.4f} | {100 * (ppl / rows[0][1] - 1):+.2f}% |")


if __name__ == "__main__":
    main()
