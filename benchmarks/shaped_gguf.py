"""Write a GGUF file of a real model's shapes with random quantized blocks: for speed and agreement
checks where the real file cannot travel (the GPU machine downloads nothing).

    python benchmarks/shaped_gguf.py smollm2-135m /tmp/smollm2-shaped.gguf
    python benchmarks/shaped_gguf.py llama-3.1-8b-q4_0 /tmp/llama8b-q4_0.gguf
    python benchmarks/shaped_gguf.py llama-1b-q4_1 /tmp/llama1b-q4_1.gguf

Codes are uniform random; scales are chosen so weights stay near ±0.04 (activations stay finite
through every layer). The tokenizer is byte-level BPE: specials, the 256 byte symbols, then filler
tokens up to the vocabulary size.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from tiny_models import CHAT_TEMPLATE, SPECIAL_TOKENS, _bytes_to_unicode  # noqa: E402

from llmc.ir.formats import FORMATS, QuantizedTensor, Storage  # noqa: E402

SHAPES = {
    # name: (layers, hidden, ffn, heads, kv_heads, vocab, rope theta, tied, storage of projections, embd, output)
    "smollm2-135m": (30, 576, 1536, 9, 3, 49152, 100000.0, True, "q4_1", "q8_0", None),
    "llama-3.1-8b-q4_0": (32, 4096, 14336, 32, 8, 128256, 500000.0, False, "q4_0", "q4_0", "q6_k"),
    # ~1.1B parameters, 750 MB of weights: larger than a 480 MiB L3, for batched decode from DRAM
    "llama-1b-q4_1": (16, 2048, 8192, 32, 8, 32000, 500000.0, False, "q4_1", "q8_0", "q8_0"),
}
_FIELD_VALUES = {"d": 0.005, "m": -0.04, "dmin": 0.04 / 32, "sc": 32, "mn": 32}


def random_tensor(rng: np.random.Generator, storage: Storage, rows: int, k: int) -> np.ndarray:
    """GGUF block bytes `[rows, row_bytes]` of random codes with fixed-size fields."""
    fmt = FORMATS[storage]
    codes = rng.integers(0, 1 << fmt.bits, (rows, k), dtype=np.uint8)
    fields = {}
    for f in fmt.fields:
        value = _FIELD_VALUES.get(f.name, 1)
        if f.name == "d" and len(fmt.scale) > 1:  # k-quants: d · sc is the scale
            value = 0.005 / 32
        fields[f.name] = np.full((rows, k // f.group), value, f.numpy)
    return FORMATS[storage].to_blocks(QuantizedTensor(storage, codes, fields))


def write(name: str, path: Path, seed: int = 0) -> Path:
    layers, hidden, ffn, heads, kv_heads, vocab, theta, tied, proj, embd, output = SHAPES[name]
    head_dim = hidden // heads
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(theta)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    tokens = SPECIAL_TOKENS + sorted(_bytes_to_unicode().values())
    tokens += [f"<filler_{i}>" for i in range(vocab - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges([])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)

    def quantized(tensor: str, storage: str, rows: int, k: int) -> None:
        s = Storage(storage)
        writer.add_tensor(tensor, random_tensor(rng, s, rows, k), raw_dtype=gguf.GGMLQuantizationType[s.name])

    quantized("token_embd.weight", embd, vocab, hidden)
    if not tied:
        quantized("output.weight", output, vocab, hidden)
    writer.add_tensor("output_norm.weight", np.ones(hidden, np.float32))
    q, kv = heads * head_dim, kv_heads * head_dim
    for i in range(layers):
        for tensor, rows, k in (("attn_q", q, hidden), ("attn_k", kv, hidden), ("attn_v", kv, hidden),
                                ("attn_output", hidden, q), ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden),
                                ("ffn_down", hidden, ffn)):
            quantized(f"blk.{i}.{tensor}.weight", proj, rows, k)
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(hidden, np.float32))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(hidden, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("shape", choices=SHAPES)
    p.add_argument("out", type=Path)
    args = p.parse_args()
    print(write(args.shape, args.out))
