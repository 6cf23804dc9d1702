#!/usr/bin/env bash
# The CUDA checks and numbers on a GPU machine, in one call of under 8 minutes (benchmarks/cuda_check.py).
# Where pip cannot reach an index (the lent GPU machines), bring wheels in .whl/ (xdsl, gguf, llvmlite:
# see benchmarks/README.md); they and llmc are installed under /tmp. Results: $OUT/cuda_check.md.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/llmc-cuda-check-out}
SITE=/tmp/llmc-site
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" .whl/*.whl || exit 1
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target "$SITE" . || exit 1
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}" PYTHONSAFEPATH=1  # the source tree must not shadow the installed llmc
python3 benchmarks/cuda_check.py "$OUT" "$@"
