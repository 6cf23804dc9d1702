"""The real model in other forms, written from its GGUF file for tests and benchmarks.

`write_smollm2_hf(directory)` writes SmolLM2-135M-Instruct as a Hugging Face directory
of float32 weights: transformers loads the Q4_1 GGUF (dequantized to float32) and saves
it as safetensors; the tokenizer is llmc's own from the GGUF (transformers' conversion
would drop SmolLM2's digit splitting), so both forms give the same token ids. This is
the float source for `--quant` measurements:

    python tests/real_models.py smollm2-hf /tmp/smollm2-hf
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def write_smollm2_hf(directory: Path) -> Path:
    os.environ.setdefault("TQDM_DISABLE", "1")
    from safetensors.torch import save_file

    from llmc.frontend import load_model, resolve
    from llmc.frontend.reference import reference_model

    gguf = resolve("smollm2-135m")
    model = reference_model(gguf)
    directory.mkdir(parents=True, exist_ok=True)
    # transformers will not save a model it loaded from GGUF: write its tensors and config directly
    tensors = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["torch_dtype"] = "float32"
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    codec = load_model(str(gguf)).tokenizer
    (directory / "tokenizer.json").write_text(codec.tokenizer.to_str())
    vocab = codec.tokenizer
    settings = {"chat_template": codec.chat_template, "add_bos_token": codec.add_bos,
                "bos_token": vocab.id_to_token(codec.bos_id) if codec.bos_id is not None else None,
                "eos_token": vocab.id_to_token(codec.eos_id) if codec.eos_id is not None else None}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "smollm2-hf":
        sys.exit("usage: python tests/real_models.py smollm2-hf DIRECTORY")
    print(write_smollm2_hf(Path(sys.argv[2])))
