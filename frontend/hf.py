"""Hugging Face model directories (config.json + *.safetensors) → `Model`.

Supports `LlamaForCausalLM` (SmolLM2 included) and `Qwen2ForCausalLM` (Q/K/V bias).
safetensors files are read with a small reader of their own (8-byte header length,
JSON header, raw data) into numpy memory maps, so nothing is loaded at import and bf16
needs no torch. Tensor names are mapped to the GGUF names the IR uses.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np

from llmc.errors import ModelFormatError
from llmc.frontend.model import Model, ModelConfig
from llmc.frontend.tokenizer import TextTokenizer
from llmc.ir.llm import Storage
from llmc.ir.weights import Weight, WeightStore

ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}

_DTYPES = {"F32": (np.float32, Storage.F32), "F16": (np.float16, Storage.F16), "BF16": (np.uint16, Storage.BF16)}

_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd",
    "model.norm.weight": "output_norm",
    "lm_head.weight": "output",
}
_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm",
    "self_attn.q_proj.weight": "attn_q",
    "self_attn.k_proj.weight": "attn_k",
    "self_attn.v_proj.weight": "attn_v",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output",
    "post_attention_layernorm.weight": "ffn_norm",
    "mlp.gate_proj.weight": "ffn_gate",
    "mlp.up_proj.weight": "ffn_up",
    "mlp.down_proj.weight": "ffn_down",
}
_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
_MAX_HEADER = 100 * 1024 * 1024


def ir_name(hf_name: str) -> str | None:
    """The IR symbol of a Hugging Face tensor name, or None for tensors the graph does not use."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = _LAYER.fullmatch(hf_name)
    if m and m.group(2) in _LAYER_NAMES:
        return f"blk.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}"
    return None


def _read_safetensors(path: Path, store: WeightStore) -> None:
    data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    if data.size < 8:
        raise ModelFormatError(path, "truncated safetensors file (no header)")
    header_len = int(data[:8].view("<u8")[0])
    if header_len > min(_MAX_HEADER, data.size - 8):
        raise ModelFormatError(path, f"safetensors header length {header_len} exceeds the file")
    try:
        header = json.loads(bytes(data[8 : 8 + header_len]))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(path, f"safetensors header is not valid JSON: {e}") from e
    if not isinstance(header, dict):
        raise ModelFormatError(path, "safetensors header is not a JSON object")
    body = data[8 + header_len :]
    for hf_name, info in header.items():
        if hf_name == "__metadata__":
            continue
        name = ir_name(hf_name)
        if name is None:
            if hf_name.endswith("rotary_emb.inv_freq"):  # a buffer some checkpoints save; recomputed from theta
                continue
            raise ModelFormatError(path, f"tensor '{hf_name}' is not part of a supported architecture")
        try:
            dtype, storage = _DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(path, f"tensor '{hf_name}': unsupported or malformed entry {info!r}") from e
        nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
        if not 0 <= begin <= end <= body.size or end - begin != nbytes:
            raise ModelFormatError(path, f"tensor '{hf_name}': data offsets {begin}..{end} do not fit its shape or the file")
        if name in store:
            raise ModelFormatError(path, f"tensor '{hf_name}' appears twice")
        store.add(Weight(name, storage, shape, body[begin:end].view(dtype).reshape(shape)))


def _config(path: Path, cfg: dict) -> ModelConfig:
    archs = cfg.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelFormatError(path, f"unsupported architecture {archs} (supported: {', '.join(ARCHITECTURES)})")
    try:
        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        rope = cfg.get("rope_parameters") or {}
        if cfg.get("rope_scaling") or rope.get("rope_type", "default") != "default":
            raise ModelFormatError(path, "RoPE scaling is not supported yet")
        config = ModelConfig(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden=hidden,
            layers=int(cfg["num_hidden_layers"]),
            heads=heads,
            kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // max(heads, 1)),
            ffn=int(cfg["intermediate_size"]),
            rope_theta=float(cfg.get("rope_theta", rope.get("rope_theta", 10000.0))),
            rms_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            context_length=int(cfg.get("max_position_embeddings", 2048)),
            tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2",
        )
        for flag in ("mlp_bias",) + (("attention_bias",) if arch == "llama" else ()):
            if cfg.get(flag):
                raise ModelFormatError(path, f"config.json sets {flag}, which llmc does not support yet")
    except KeyError as e:
        raise ModelFormatError(path, f"config.json lacks {e.args[0]!r}") from e
    except (TypeError, ValueError) as e:
        raise ModelFormatError(path, f"config.json has a malformed value: {e}") from e
    config.check(path)
    return config


def _tokenizer(directory: Path) -> TextTokenizer:
    from tokenizers import Tokenizer

    file = directory / "tokenizer.json"
    if not file.is_file():
        raise ModelFormatError(directory, "no tokenizer.json in this directory")
    try:
        tokenizer = Tokenizer.from_file(str(file))
    except Exception as e:  # tokenizers raises its own exception types
        raise ModelFormatError(file, f"cannot load tokenizer: {e}") from e
    settings = _json(directory / "tokenizer_config.json") if (directory / "tokenizer_config.json").is_file() else {}

    def special_id(key: str) -> int | None:
        token = settings.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        return tokenizer.token_to_id(token) if isinstance(token, str) else None

    template = settings.get("chat_template")
    return TextTokenizer(
        tokenizer,
        bos_id=special_id("bos_token"),
        eos_id=special_id("eos_token"),
        add_bos=bool(settings.get("add_bos_token", False)),
        chat_template=template if isinstance(template, str) else None,
    )


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelFormatError(path, f"cannot read JSON: {e}") from e
    if not isinstance(value, dict):
        raise ModelFormatError(path, "expected a JSON object")
    return value


def load_hf(directory: Path) -> Model:
    """Read a Hugging Face model directory's config, weights (lazily) and tokenizer."""
    if not (directory / "config.json").is_file():
        raise ModelFormatError(directory, "no config.json in this directory")
    config = _config(directory, _json(directory / "config.json"))
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        raise ModelFormatError(directory, "no *.safetensors files in this directory")
    store = WeightStore(directory)
    for file in files:
        _read_safetensors(file, store)
    return Model(directory, config, store, lambda: _tokenizer(directory))
