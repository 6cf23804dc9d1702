"""The source model's own reference: transformers in float32 on the same file.

transformers dequantizes a GGUF file's tensors to float and undoes llama.cpp's Q/K
permutation itself, so it is an independent check of the GGUF frontend. It needs the
`reference` extra (torch, transformers, accelerate). Token ids are given, not text:
transformers' GGUF tokenizer conversion drops SmolLM2's digit splitting.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError, UsageError

INSTALL_HINT = "pip install 'llmc[reference]' (torch, transformers, accelerate)"


def reference_name() -> str:
    import transformers

    return f"transformers {transformers.__version__} fp32"


def check_unpickled(source: Path, allow_pickle: bool) -> None:
    """Refuse an HF directory whose weights transformers could only unpickle (`pytorch_model.bin`), unless
    `allow_pickle`."""
    if source.is_dir() and not allow_pickle and not any(source.glob("*.safetensors")):
        raise UsageError(f"{source} holds no .safetensors weights; pickled weights (pytorch_model.bin) load only "
                         f"with --allow-pickle, since unpickling runs code from the file")


def reference_model(source: Path, allow_pickle: bool = False):
    """The transformers model of a GGUF file or HF directory, in float32, for inference; a directory's weights
    from safetensors files only, unless `allow_pickle` (`check_unpickled`)."""
    check_unpickled(source, allow_pickle)
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
            model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32,
                                                         use_safetensors=None if allow_pickle else True)
        else:
            model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many types for files it cannot read
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise LlmcError(f"transformers cannot load {source} as the reference ({first}); name a Hugging Face "
                        "directory of the same model instead (verify's --reference, bench's --model)") from e
    return model.eval()


def reference_logits(source: Path, tokens: list[int], allow_pickle: bool = False) -> np.ndarray:
    """Logits `[T, vocab]` of `tokens` at positions 0.. from transformers in float32."""
    import torch

    model = reference_model(source, allow_pickle)
    with torch.no_grad():
        out = model(torch.tensor([tokens], dtype=torch.long)).logits[0]
    return out.float().numpy()


def torch_program_logits(path: Path, tokens: Sequence[int], allow_pickle: bool) -> np.ndarray:
    """Logits `[T, vocab]` of `tokens` from a saved torch.export program (`.pt2`), run eagerly: all-ones
    `attention_mask`, `position_ids` 0.., empty past keys and values where the program takes them."""
    import torch

    from llmc.frontend.torch_export import load_pt2

    exported = load_pt2(path, allow_pickle)
    ids = torch.tensor([list(tokens)], dtype=torch.long)
    args = []
    for node in exported.graph.nodes:  # the user inputs, in order: fed as `onnx_logits` feeds an ONNX graph
        if node.op != "placeholder" or node.name not in exported.graph_signature.user_inputs:
            continue
        if node.name == "input_ids":
            args.append(ids)
        elif node.name == "attention_mask":
            args.append(torch.ones_like(ids))
        elif node.name == "position_ids":
            args.append(torch.arange(ids.shape[1])[None])
        elif node.name.startswith("past"):
            _, heads, _, head_dim = node.meta["val"].shape
            args.append(torch.zeros(1, int(heads), 0, int(head_dim), dtype=node.meta["val"].dtype))
        else:
            raise LlmcError(f"{path}: the torch reference cannot feed the input '{node.name}'")
    try:
        with torch.no_grad():
            out = exported.module()(*args)
    except (AssertionError, RuntimeError) as e:  # the program's guards on its input sizes
        raise LlmcError(f"torch cannot run {path} on {len(tokens)} tokens as the reference ({e})") from e
    return (out[0] if isinstance(out, tuple | list) else out)[0].float().numpy()


def onnx_logits(path: Path, tokens: Sequence[int]) -> np.ndarray:
    """Logits `[T, vocab]` of `tokens` from an ONNX model on onnxruntime's CPU provider: all-ones
    `attention_mask`, `position_ids` 0.., empty `past_key_values.*` where the graph takes them."""
    try:
        import onnxruntime
    except ImportError as e:
        raise UsageError(f"the ONNX reference needs onnxruntime ({e.name} is missing): pip install onnxruntime") from e
    try:
        session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime raises its own types for files it cannot load
        raise LlmcError(f"onnxruntime cannot load {path} as the reference ({str(e).strip().splitlines()[0]})") from e
    ids = np.asarray([list(tokens)], dtype=np.int64)
    feeds: dict[str, np.ndarray] = {}
    for arg in session.get_inputs():
        if arg.name == "input_ids":
            feeds[arg.name] = ids
        elif arg.name == "attention_mask":
            feeds[arg.name] = np.ones_like(ids)
        elif arg.name == "position_ids":
            feeds[arg.name] = np.arange(ids.shape[1], dtype=np.int64)[None]
        elif arg.name.startswith("past_key_values"):
            _, heads, _, head_dim = arg.shape
            dtype = np.float16 if arg.type == "tensor(float16)" else np.float32
            feeds[arg.name] = np.zeros((1, heads, 0, head_dim), dtype)
        else:
            raise LlmcError(f"{path}: the ONNX reference cannot feed the input '{arg.name}'")
    names = [o.name for o in session.get_outputs()]
    out = session.run(["logits" if "logits" in names else names[0]], feeds)[0]
    return out[0].astype(np.float32)
