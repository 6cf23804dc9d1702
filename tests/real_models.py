"""The real model in other forms, written from its GGUF file for tests and benchmarks.

`write_smollm2_hf(directory)` writes SmolLM2-135M-Instruct as a Hugging Face directory
of float32 weights: transformers loads the Q4_1 GGUF (dequantized to float32) and saves
it as safetensors; the tokenizer is llmc's own from the GGUF (transformers' conversion
would drop SmolLM2's digit splitting), so both forms give the same token ids. This is
the float source for `--quant` measurements:

    python tests/real_models.py smollm2-hf /tmp/smollm2-hf

`write_smollm2_graphs(directory, "onnx", "pt2")` exports that transformers model as graphs
(`torch.onnx.export(..., dynamo=True)` or `torch.export.save`), with the GGUF's tokenizer as
`tokenizer.json` beside it:

    python tests/real_models.py smollm2-onnx /tmp/smollm2-onnx
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def export_graphs(model, paths: list[Path], vocab_size: int, onnx_optimize: bool = True) -> list[Path]:
    """`model` (a transformers causal LM) exported once, written to each of `paths`: `.onnx`
    (dynamo, opset 18; `onnx_optimize=False` skips onnxscript's graph optimizer, a third of the
    time, and leaves transposes and constant arithmetic for llmc to fold) or `.pt2`."""
    import torch

    from llmc.frontend.torch_export import export_decoder

    example = (torch.arange(7, dtype=torch.long)[None] % vocab_size,)
    program = export_decoder(model.eval(), example)
    for path in paths:
        if path.suffix == ".pt2":
            torch.export.save(program, path)
        else:
            torch.onnx.export(program, example, dynamo=True, opset_version=18, verbose=False,
                              optimize=onnx_optimize).save(str(path))
    return paths


def write_tokenizer(codec, directory: Path) -> None:
    """`tokenizer.json` and `tokenizer_config.json` of a `TextCodec`."""
    (directory / "tokenizer.json").write_text(codec.tokenizer.to_str())
    vocab = codec.tokenizer
    settings = {"chat_template": codec.chat_template, "add_bos_token": codec.add_bos,
                "bos_token": vocab.id_to_token(codec.bos_id) if codec.bos_id is not None else None,
                "eos_token": vocab.id_to_token(codec.eos_id) if codec.eos_id is not None else None}
    (directory / "tokenizer_config.json").write_text(json.dumps(settings, indent=2))


def write_smollm2_graphs(directory: Path, *kinds: str, onnx_optimize: bool = True) -> list[Path]:
    """SmolLM2 from its GGUF through transformers, exported as `directory/smollm2.{kind}` for
    each kind (`onnx`, `pt2`), with the GGUF's tokenizer beside them."""
    os.environ.setdefault("TQDM_DISABLE", "1")
    from llmc.frontend import load_model, resolve
    from llmc.frontend.reference import reference_model

    gguf = resolve("smollm2-135m")
    model = reference_model(gguf)
    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(load_model(str(gguf)).tokenizer, directory)
    return export_graphs(model, [directory / f"smollm2.{kind}" for kind in kinds], model.config.vocab_size,
                         onnx_optimize)


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
    write_tokenizer(load_model(str(gguf)).tokenizer, directory)
    return directory


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] not in ("smollm2-hf", "smollm2-onnx", "smollm2-pt2"):
        sys.exit("usage: python tests/real_models.py smollm2-hf|smollm2-onnx|smollm2-pt2 DIRECTORY")
    kind = sys.argv[1].removeprefix("smollm2-")
    print(write_smollm2_hf(Path(sys.argv[2])) if kind == "hf" else write_smollm2_graphs(Path(sys.argv[2]), kind)[0])
