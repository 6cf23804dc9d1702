"""What a screen of a q8_0 LM head by its codes' high nibbles would read and change, on a real model's states.

    .venv/bin/python benchmarks/lm_head_nibbles.py MODEL.gguf [--text FILE] [--tokens 1024] [--margins 1 2 3 4 6 8]

A question for the decode step, not a feature: the LM head's q8_0 rows are the largest read of a small model's
step (SmolLM2 30 MB of 97, the 270M model 178 MB of 250). Each int8 code q is 16·hi + lo (hi its signed high
nibble, lo 0..15). Stored as two planes, a screen reads the high nibbles and the scales only (about half the
bytes) and takes 16·hi + 7.5 for each code; the strips of 16 logits whose largest screened logit is within a
margin of the row's largest are then taken again from both planes, exactly (integer sums: the q8_0 kernel's).

The script reads the model's q8_0 LM head (`output`, or the tied `token_embd`) with the `gguf` package, the hidden
states after the final norm from transformers (the GGUF in f32, the first `--tokens` tokens of `--text`), and for
each margin prints: the strips taken again, the bytes a decode step's LM head would read, how often the exact
top logit's strip is among them (greedy's token unchanged), and the KL divergence of the softmax with the other
logits screened from the exact one (what sampling would draw from).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

STRIP = 16  # logits a strip: the tiles layout's rows a strip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", type=Path, help="a GGUF file whose LM head is q8_0, of a family transformers reads")
    parser.add_argument("--text", type=Path, default=Path(__file__).parent / "heldout.txt")
    parser.add_argument("--tokens", type=int, default=1024, help="positions scored (default 1024)")
    parser.add_argument("--margins", type=float, nargs="+", default=[1, 2, 3, 4, 6, 8])
    args = parser.parse_args()
    if not args.model.is_file() or not args.text.is_file():
        parser.error("MODEL and --text must be files")
    if args.tokens < 1 or any(m <= 0 for m in args.margins):
        parser.error("--tokens and the margins must be positive")

    import gguf
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        reader = gguf.GGUFReader(args.model)
    except (ValueError, OSError) as e:
        parser.error(f"{args.model}: not a GGUF file this reads ({e})")
    tensors = {t.name: t for t in reader.tensors}
    head = tensors.get("output.weight") or tensors.get("token_embd.weight")
    if head is None or head.tensor_type != gguf.GGMLQuantizationType.Q8_0:
        parser.error("the model's LM head (output or token_embd) is not q8_0")
    K, V = (int(n) for n in head.shape)
    blocks = np.asarray(head.data).reshape(-1).view(np.uint8).reshape(V, K // 32, 34)
    scales = blocks[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32)
    codes = blocks[:, :, 2:].copy().view(np.int8).astype(np.float32)
    high = np.floor(codes / 16)  # the signed high nibble: codes = 16·high + low, low in 0..15
    exact_w = (codes * scales[..., None]).reshape(V, K)
    screen_w = ((16 * high + 7.5) * scales[..., None]).reshape(V, K)
    del codes, high

    model = AutoModelForCausalLM.from_pretrained(args.model.parent, gguf_file=args.model.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(args.model.parent, gguf_file=args.model.name)
    ids = tokenizer(args.text.read_text(), return_tensors="pt").input_ids[:, : args.tokens]
    with torch.no_grad():
        states = model(ids, output_hidden_states=True).hidden_states[-1][0].numpy()
    exact, screened = states @ exact_w.T, states @ screen_w.T
    error = screened - exact
    n = len(states)
    print(f"{args.model.name}: LM head {V} x {K} q8_0, {n} positions of {args.text.name}; logits' std "
          f"{exact.std():.2f}, the screen's error std {error.std():.3f}, largest {np.abs(error).max():.2f}")

    q8_bytes = V * K + V * K // 32 * 2  # codes and f16 scales
    screen_bytes = V * K // 2 + V * K // 32 * 2  # high nibbles and scales
    top_strip = exact.argmax(1) // STRIP
    strip_max = screened.reshape(n, V // STRIP, STRIP).max(-1)

    def log_softmax(x):
        x = x - x.max(1, keepdims=True)
        return x - np.log(np.exp(x).sum(1, keepdims=True))

    exact_lp = log_softmax(exact)
    print(f"q8_0 rows: {q8_bytes / 1e6:.1f} MB a step")
    print("| margin | strips taken again | MB a step | top logit's strip taken | KL mean | KL max |")
    print("|--:|--:|--:|--:|--:|--:|")
    for margin in args.margins:
        taken = strip_max >= strip_max.max(1, keepdims=True) - margin
        mixed = np.where(np.repeat(taken, STRIP, axis=1), exact, screened)
        kl = (np.exp(exact_lp) * (exact_lp - log_softmax(mixed))).sum(1)
        read = screen_bytes + taken.mean() * V * K // 2  # the candidates' low nibbles
        print(f"| {margin:g} | {100 * taken.mean():.2f}% | {read / 1e6:.1f} | "
              f"{100 * taken[np.arange(n), top_strip].mean():.2f}% | {kl.mean():.2e} | {kl.max():.2e} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
