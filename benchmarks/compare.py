"""Prefill and decode throughput of llmc artifacts next to llama.cpp and transformers, in one run.

    python benchmarks/compare.py smollm2.llmc smollm2-f32.llmc --model smollm2-135m \
        --llama-bench /path/to/llama-bench

Every engine gets a 512-token prompt, then 128 greedy decode steps with a KV cache, on
the same number of threads; each number is the best of --repeat runs. llama.cpp is
measured through `llama-bench` (given, or found on PATH) on the model's GGUF file, with
its default path (AMX repack where the CPU has it) and with `--repack 0`; transformers
in float32 on the same weights. Prints a Markdown table with each engine's speed as a
ratio of llama.cpp's `--repack 0` path (or, without llama.cpp, of transformers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("TQDM_DISABLE", "1")  # before transformers is imported: its GGUF loading draws bars


def transformers_speed(source: Path, prompt: np.ndarray, decode_tokens: int, repeat: int, threads: int
                       ) -> tuple[float, float]:
    import torch

    from llmc.frontend.reference import reference_model

    torch.set_num_threads(threads)
    model = reference_model(source)
    ids = torch.tensor([prompt.tolist()])
    best_prefill = best_decode = float("inf")
    with torch.no_grad():
        for _ in range(repeat):
            start = time.perf_counter()
            out = model(ids, use_cache=True)
            best_prefill = min(best_prefill, time.perf_counter() - start)
            past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            start = time.perf_counter()
            for _ in range(decode_tokens):
                out = model(token, past_key_values=past, use_cache=True)
                past, token = out.past_key_values, out.logits[:, -1:].argmax(-1)
            best_decode = min(best_decode, time.perf_counter() - start)
    return len(prompt) / best_prefill, decode_tokens / best_decode


def llama_bench_speed(binary: str, gguf: Path, prompt_tokens: int, decode_tokens: int, repeat: int, threads: int,
                      repack: bool) -> tuple[float, float]:
    """pp and tg tokens/s from `llama-bench -o json` (mean of its repetitions)."""
    cmd = [binary, "-m", str(gguf), "-t", str(threads), "-p", str(prompt_tokens), "-n", str(decode_tokens),
           "-r", str(repeat), "-o", "json", "--repack", "1" if repack else "0"]
    result = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    speeds = {("pp" if r["n_gen"] == 0 else "tg"): r["avg_ts"] for r in result}
    return speeds["pp"], speeds["tg"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifacts", type=Path, nargs="+", help="artifact directories from 'llmc compile'")
    parser.add_argument("--model", default="smollm2-135m", help="the source model of the artifacts")
    parser.add_argument("--llama-bench", default=shutil.which("llama-bench"), help="llama.cpp's llama-bench binary")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--no-transformers", action="store_true", help="skip the transformers measurement")
    args = parser.parse_args()

    from llmc.frontend import resolve
    from llmc.runtime.bench import benchmark

    rows: list[tuple[str, float, float]] = []
    vocab = 0
    for artifact in args.artifacts:
        ours = benchmark(artifact, args.prompt_tokens, args.decode_tokens, args.repeat, args.threads)
        vocab = ours.vocab_size
        size = sum(p.stat().st_size for p in artifact.iterdir() if p.name != "tokenizer.json") / 1e6
        rows.append((f"llmc {artifact.name} ({size:.1f} MB)", ours.prefill_tokens_per_s, ours.decode_tokens_per_s))
    source = resolve(args.model)
    baseline = None
    if args.llama_bench and source.suffix == ".gguf":
        for repack in (True, False):
            pp, tg = llama_bench_speed(args.llama_bench, source, args.prompt_tokens, args.decode_tokens, args.repeat,
                                       args.threads, repack)
            rows.append((f"llama.cpp {'default (AMX repack)' if repack else '--repack 0'}", pp, tg))
        baseline = rows[-1]
    if not args.no_transformers:
        import torch

        prompt = np.random.default_rng(0).integers(0, vocab, args.prompt_tokens, dtype=np.int32)
        pp, tg = transformers_speed(source, prompt, args.decode_tokens, args.repeat, args.threads)
        rows.append((f"transformers fp32 (torch {torch.__version__})", pp, tg))
        baseline = baseline or rows[-1]
    baseline = baseline or rows[0]
    print(f"| engine ({args.threads} threads) | prefill {args.prompt_tokens} tok/s | decode {args.decode_tokens} tok/s "
          f"| prefill ratio | decode ratio |")
    print("|---|---|---|---|---|")
    for name, pp, tg in rows:
        print(f"| {name} | {pp:.1f} | {tg:.1f} | {pp / baseline[1]:.2f}x | {tg / baseline[2]:.2f}x |")
    print(f"\nratios against: {baseline[0]}")


if __name__ == "__main__":
    main()
