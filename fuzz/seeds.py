"""Write the seed corpora: small valid inputs of every target, made the way the tests make them.

`python fuzz/seeds.py [TARGET ...]` fills `fuzz/seeds/TARGET/` (generated, not checked in): tiny
GGUF models of each family llmc reads (f32 and block-quantized), vocabulary-only GGUF files (BPE
pre-tokenizers, a SentencePiece vocabulary), `tokenizer.json` files of each model kind, every chat
template of tests/data/chat_templates (SmolLM2's, Llama 3's, ...) with a conversation, and tiny
transformers decoders exported as ONNX and `.pt2` (stateless and with a KV cache).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SEEDS = ROOT / "fuzz" / "seeds"
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the tests' model writers; `fuzz` as a package

CONVERSATION = [{"role": "system", "content": "You are brief."}, {"role": "user", "content": "Hello!"},
                {"role": "assistant", "content": "Hi. 12 + 30 = 42"}, {"role": "user", "content": "Und jetzt? 🤖"}]


def gguf_file(folder: Path) -> None:
    from tiny_models import TinySpec, random_weights, write_gguf

    quantized = (("attn_q", "q8_0"), ("attn_k", "q4_0"), ("ffn_up", "q4_1"), ("attn_v", "q5_0"),
                 ("attn_output", "q5_1"), ("token_embd", "f16"))
    specs = {
        "llama": TinySpec(layers=1),
        "llama-quantized": TinySpec(layers=1, gguf_storage=quantized),
        "llama3-rope": TinySpec(layers=1, rope_scaling=(("rope_type", "llama3"), ("factor", 8.0),
                                                        ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                                                        ("original_max_position_embeddings", 16))),
        "mistral-window": TinySpec(arch="mistral", layers=1, sliding_window=4),
        "qwen2": TinySpec(arch="qwen2", layers=1),
        "qwen3": TinySpec(arch="qwen3", layers=1),
        "phi3": TinySpec(arch="phi3", layers=1, sliding_window=8),
        "gemma2": TinySpec(arch="gemma2", layers=2, layer_types=("sliding_attention", "full_attention"),
                           sliding_window=4, attn_softcap=50.0, final_softcap=30.0),
        "gemma3": TinySpec(arch="gemma3", layers=2, layer_types=("sliding_attention", "full_attention"),
                           sliding_window=4),
        "qwen3moe": TinySpec(arch="qwen3moe", layers=1, experts=4),
        "mixtral": TinySpec(arch="mixtral", layers=1, experts=4),
    }
    for name, spec in specs.items():
        write_gguf(spec, random_weights(spec), folder / f"{name}.gguf")


def gguf_vocab(folder: Path) -> None:
    import gguf
    from tiny_models import write_vocab_gguf

    for pre in ("smollm", "llama-bpe", "qwen2", "gpt-2", "deepseek-llm", "default"):
        write_vocab_gguf(folder / f"bpe-{pre}.gguf", pre=pre)
    # SentencePiece (tokenizer.ggml.model = llama): byte tokens, pieces with scores, a template
    pieces = ["<unk>", "<s>", "</s>", *(f"<0x{b:02X}>" for b in range(256)),
              "▁", "▁H", "el", "lo", "ello", "▁Hello", "▁w", "or", "ld", "▁world", "1", "2", "!"]
    types = [2, 3, 3, *([6] * 256), *([1] * (len(pieces) - 259))]
    writer = gguf.GGUFWriter(str(folder / "spm-llama.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list(pieces)
    writer.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces) - 259)])
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_space_prefix(True)
    writer.add_chat_template("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                             "{% endfor %}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tokenizer_json(folder: Path) -> None:
    from tiny_models import hf_tokenizer_json
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    from fuzz.common import tiny_tokenizer

    (folder / "bpe-byte-level.json").write_text(hf_tokenizer_json())
    (folder / "word-level.json").write_text(tiny_tokenizer().to_str())
    unigram = Tokenizer(models.Unigram([("<unk>", 0.0), ("▁", -1.0), ("▁Hello", -2.0), ("H", -3.0), ("e", -3.0),
                                        ("l", -3.0), ("o", -3.0), ("▁w", -4.0)], unk_id=0, byte_fallback=False))
    unigram.normalizer = normalizers.Sequence([normalizers.NFKC(), normalizers.Replace(" ", "▁")])
    unigram.pre_tokenizer = pre_tokenizers.Metaspace()
    unigram.decoder = decoders.Metaspace()
    (folder / "unigram-metaspace.json").write_text(unigram.to_str())
    wordpiece = Tokenizer(models.WordPiece({"[UNK]": 0, "hello": 1, "world": 2, "##s": 3}, unk_token="[UNK]"))
    wordpiece.normalizer = normalizers.BertNormalizer(lowercase=True)
    wordpiece.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\d{1,3}"), "isolated"),
                                                       pre_tokenizers.BertPreTokenizer()])
    wordpiece.decoder = decoders.WordPiece()
    (folder / "wordpiece-split.json").write_text(wordpiece.to_str())


def chat_template(folder: Path) -> None:
    from fuzz.chat_template import encode

    for template in sorted((ROOT / "tests" / "data" / "chat_templates").glob("*.jinja")):
        (folder / template.stem).write_bytes(encode(template.read_text(), CONVERSATION))


def _graphs(folder: Path, forms: tuple[str, ...]) -> None:
    from graph_models import export, tiny_lm

    for shape in ("llama-gqa", "qwen2-bias"):
        for form in forms:
            export(tiny_lm(shape), folder / f"{shape}-{form}", tokenizer=False)


def onnx_file(folder: Path) -> None:
    _graphs(folder, ("model.onnx", "kv.onnx"))
    for data in folder.glob("*.data"):  # the graphs must carry their weights inside
        raise SystemExit(f"{data}: the seeds need self-contained .onnx files")


def pt2_file(folder: Path) -> None:
    _graphs(folder, ("model.pt2", "kv.pt2"))


WRITERS: dict[str, Callable[[Path], None]] = {f.__name__: f for f in (gguf_file, gguf_vocab, tokenizer_json,
                                                                      chat_template, onnx_file, pt2_file)}


def main(targets: list[str]) -> None:
    for target in targets or WRITERS:
        folder = SEEDS / target
        folder.mkdir(parents=True, exist_ok=True)
        WRITERS[target](folder)
        sizes = sorted(p.stat().st_size for p in folder.iterdir())
        print(f"{target}: {len(sizes)} seeds, {sizes[0]}-{sizes[-1]} bytes in {folder}")


if __name__ == "__main__":
    main(sys.argv[1:])
