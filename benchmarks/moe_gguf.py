"""Write a small Qwen3-MoE GGUF file (random q8_0 weights) to measure the mixture-of-experts kernel
against llama.cpp on the same file: 8 layers, hidden 512, 16 experts of width 512, 2 per token.

    python benchmarks/moe_gguf.py /tmp/qwen3moe-small.gguf
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from tiny_models import TinySpec, random_weights, write_gguf  # noqa: E402

MATRICES = ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
SPEC = TinySpec(arch="qwen3moe", hidden=512, layers=8, heads=8, kv_heads=4, head_dim=64, ffn=512, experts=16,
                experts_used=2, context_length=4096, gguf_storage=tuple((m, "q8_0") for m in MATRICES))

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the GGUF file to write")
    path = write_gguf(SPEC, random_weights(SPEC), parser.parse_args().out)
    print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
