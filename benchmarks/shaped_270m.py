"""`python benchmarks/shaped_270m.py OUT.gguf`: a random GGUF of Gemma 3 270M's shapes and five storage types
(llama architecture): 18 layers, hidden 640, ffn 2048, 4 heads of 256, 1 KV head, 262144 tokens, tied; q8_0
embedding, q5_0 q/k/gate/up, q8_0 v, q4_k attn_output (K 1024), q6_k ffn_down (K 2048), f32 norms (issue 27's
compile-time model)."""
import argparse
import sys
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (shaped_gguf.py beside this file)
from shaped_gguf import CHAT_TEMPLATE, SPECIAL_TOKENS, _bytes_to_unicode, random_tensor  # noqa: E402

from llmc.ir.formats import Storage  # noqa: E402

LAYERS, HIDDEN, FFN, HEADS, KV, HEAD_DIM, VOCAB = 18, 640, 2048, 4, 1, 256, 262144


def main(path: Path) -> None:
    rng = np.random.default_rng(0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(LAYERS); w.add_context_length(4096); w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN); w.add_head_count(HEADS); w.add_head_count_kv(KV)
    w.add_key_length(HEAD_DIM); w.add_value_length(HEAD_DIM); w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(1e6); w.add_layer_norm_rms_eps(1e-6); w.add_vocab_size(VOCAB)
    tokens = SPECIAL_TOKENS + sorted(_bytes_to_unicode().values())
    tokens += ["ĠĠ"] + [f"<filler_{i}>" for i in range(VOCAB - len(tokens) - 1)]  # llama.cpp needs a merge
    w.add_tokenizer_model("gpt2"); w.add_tokenizer_pre("gpt-2"); w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens]); w.add_token_merges(["Ġ Ġ"])
    w.add_bos_token_id(0); w.add_eos_token_id(2); w.add_add_bos_token(False); w.add_chat_template(CHAT_TEMPLATE)

    def q(name, storage, rows, k):
        s = Storage(storage)
        w.add_tensor(name, random_tensor(rng, s, rows, k), raw_dtype=gguf.GGMLQuantizationType[s.name])

    q("token_embd.weight", "q8_0", VOCAB, HIDDEN)
    w.add_tensor("output_norm.weight", np.ones(HIDDEN, np.float32))
    qd, kvd = HEADS * HEAD_DIM, KV * HEAD_DIM
    for i in range(LAYERS):
        for t, s, rows, k in (("attn_q", "q5_0", qd, HIDDEN), ("attn_k", "q5_0", kvd, HIDDEN),
                              ("attn_v", "q8_0", kvd, HIDDEN), ("attn_output", "q4_k", HIDDEN, qd),
                              ("ffn_gate", "q5_0", FFN, HIDDEN), ("ffn_up", "q5_0", FFN, HIDDEN),
                              ("ffn_down", "q6_k", HIDDEN, FFN)):
            q(f"blk.{i}.{t}.weight", s, rows, k)
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(HIDDEN, np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    print(path)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the GGUF file to write (257 MB)")
    main(parser.parse_args().out)
