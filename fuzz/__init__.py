"""Coverage-guided fuzzing of llmc's readers of untrusted input (see benchmarks/README.md, Fuzzing).

Each target is a module of this package with `check(data: bytes)`.
"""

TARGETS = ("gguf_file", "gguf_vocab", "tokenizer_json", "chat_template", "onnx_file", "pt2_file")
