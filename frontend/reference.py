"""The source model's own reference: transformers in float32 on the same file.

transformers dequantizes a GGUF file's tensors to float and undoes llama.cpp's Q/K
permutation itself, so it is an independent check of the GGUF frontend. It needs the
`reference` extra (torch, transformers, accelerate). Token ids are given, not text:
transformers' GGUF tokenizer conversion drops SmolLM2's digit splitting.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError, UsageError

INSTALL_HINT = "pip install 'llmc[reference]' (torch, transformers, accelerate)"


def reference_name() -> str:
    import transformers

    return f"transformers {transformers.__version__} fp32"


def reference_model(source: Path):
    """The transformers model of a GGUF file or HF directory, in float32, for inference."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        import torch
        import transformers
        from transformers import AutoModelForCausalLM
    except ImportError as e:
        raise UsageError(f"the transformers reference is not installed ({e.name} is missing): {INSTALL_HINT}") from e
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        if source.is_dir():
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        else:
            model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many types for files it cannot read
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LlmcError(f"transformers cannot load {source} as the reference ({first}); --reference DIR "
                        "names a Hugging Face directory of the same model") from e
    return model.eval()


def reference_logits(source: Path, tokens: list[int]) -> np.ndarray:
    """Logits `[T, vocab]` of `tokens` at positions 0.. from transformers in float32."""
    import torch

    model = reference_model(source)
    with torch.no_grad():
        out = model(torch.tensor([tokens], dtype=torch.long)).logits[0]
    return out.float().numpy()
