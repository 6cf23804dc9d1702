"""Prefill and decode throughput of an llmc artifact next to transformers fp32, in one run.

    python benchmarks/compare.py smollm2-135m.llmc --model smollm2-135m

Both engines get the same token ids: a 512-token prompt (pseudo-random ids), then 128
greedy decode steps with a KV cache. Each number is the best of --repeat runs. Prints a
Markdown table with llmc's speed as a ratio of the peer's.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np


def transformers_speed(source: Path, prompt: np.ndarray, decode_tokens: int, repeat: int) -> tuple[float, float]:
    os.environ.setdefault("TQDM_DISABLE", "1")
    import torch
    from transformers import AutoModelForCausalLM

    if source.is_dir():
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    model.eval()
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("artifact", type=Path, help="an artifact directory from 'llmc compile'")
    parser.add_argument("--model", default="smollm2-135m", help="the source model of the artifact")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    import torch

    from llmc.frontend import resolve
    from llmc.runtime.bench import benchmark

    ours = benchmark(args.artifact, args.prompt_tokens, args.decode_tokens, args.repeat)
    vocab = ours.vocab_size
    prompt = np.random.default_rng(0).integers(0, vocab, args.prompt_tokens, dtype=np.int32)
    peer_prefill, peer_decode = transformers_speed(resolve(args.model), prompt, args.decode_tokens, args.repeat)
    peer = f"transformers fp32 (torch {torch.__version__}, {torch.get_num_threads()} threads)"
    print(f"| engine | prefill {args.prompt_tokens} tok/s | decode {args.decode_tokens} tok/s |")
    print("|---|---|---|")
    print(f"| llmc ({args.artifact.name}, {ours.threads} threads) | {ours.prefill_tokens_per_s:.1f} "
          f"| {ours.decode_tokens_per_s:.1f} |")
    print(f"| {peer} | {peer_prefill:.1f} | {peer_decode:.1f} |")
    print(f"| ratio llmc / transformers | {ours.prefill_tokens_per_s / peer_prefill:.2f}x "
          f"| {ours.decode_tokens_per_s / peer_decode:.2f}x |")


if __name__ == "__main__":
    main()
