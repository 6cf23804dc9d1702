"""Hugging Face model directories (config.json + *.safetensors) → `Model`.

Supports `LlamaForCausalLM` (SmolLM2 included; RoPE scaling llama3, linear, YaRN),
`Qwen2ForCausalLM` (Q/K/V bias), `Qwen3ForCausalLM` (per-head q/k RMSNorm),
`MistralForCausalLM` (sliding-window attention), `Phi3ForCausalLM` (fused QKV and
gate-up tensors, LongRoPE, partial rotary), `Gemma2ForCausalLM` and `Gemma3ForCausalLM`
(text; (1 + w) norms folded into their weights at import, GeGLU, sandwich norms,
soft-capping, alternating sliding and global layers with their own RoPE bases).
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
from llmc.frontend.model import (
    MAX_POSITIONS,
    Model,
    ModelConfig,
    check_declared_sizes,
    finite,
    rope_base,
    split_fused,
)
from llmc.frontend.rope_scaling import hf_rope_scaling
from llmc.ir.activations import Activation
from llmc.ir.formats import Storage
from llmc.ir.weights import Weight, WeightStore
from llmc.runtime.artifact import MANIFEST, MAX_STOP_IDS
from llmc.runtime.codec import TextCodec, read_chat_template, read_tokenizer

ARCHITECTURES = {
    "LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral", "Phi3ForCausalLM": "phi3", "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3", "Qwen3MoeForCausalLM": "qwen3moe", "MixtralForCausalLM": "mixtral",
}
GEMMA = ("gemma2", "gemma3")
HF_ACTIVATIONS = {"silu": Activation.SILU, "gelu_pytorch_tanh": Activation.GELU_TANH, "gelu": Activation.GELU}
MOE = ("qwen3moe", "mixtral")

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
    "self_attn.q_norm.weight": "attn_q_norm",
    "self_attn.k_norm.weight": "attn_k_norm",
    "self_attn.qkv_proj.weight": "attn_qkv",  # fused (Phi-3): split by `split_fused`
    "mlp.gate_up_proj.weight": "ffn_gate_up",
}
# Gemma's sandwich norms (llama.cpp's names): its `post_attention_layernorm` follows attention
_GEMMA_LAYER_NAMES = _LAYER_NAMES | {
    "post_attention_layernorm.weight": "post_attention_norm",
    "pre_feedforward_layernorm.weight": "ffn_norm",
    "post_feedforward_layernorm.weight": "post_ffw_norm",
}
# Gemma's RMSNorm scales by (1 + w): the frontend adds the 1 (as llama.cpp's converter does)
_GEMMA_NORMS = ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm", "output_norm", "attn_q_norm",
                "attn_k_norm")
_LAYER = re.compile(r"model\.layers\.(\d{1,6})\.(.+)")
# mixture of experts: the router, and each expert's matrices (Qwen3-MoE's and Mixtral's names on the
# Hub; transformers 5's stacked `experts.gate_up_proj` / `experts.down_proj`), stacked by `_stack_experts`
_MOE_NAMES = {"mlp.gate.weight": "ffn_gate_inp", "block_sparse_moe.gate.weight": "ffn_gate_inp",
              "mlp.experts.gate_up_proj": "ffn_gate_up_exps", "mlp.experts.down_proj": "ffn_down_exps"}
_EXPERT = re.compile(r"(?:mlp|block_sparse_moe)\.experts\.(\d{1,6})\.(gate_proj|up_proj|down_proj|w1|w3|w2)\.weight")
_EXPERT_KINDS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_MAX_HEADER = 16 * 1024 * 1024  # safetensors headers and JSON files; real ones are far smaller


def ir_name(hf_name: str, arch: str = "llama") -> str | None:
    """The IR symbol of a Hugging Face tensor name, or None for tensors the graph does not use."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    names = _GEMMA_LAYER_NAMES if arch in GEMMA else _LAYER_NAMES | _MOE_NAMES if arch in MOE else _LAYER_NAMES
    m = _LAYER.fullmatch(hf_name)
    if m and m.group(2) in names:
        return f"blk.{int(m.group(1))}.{names[m.group(2)]}"
    expert = _EXPERT.fullmatch(m.group(2)) if m and arch in MOE else None
    if expert:  # one expert's matrix: `blk.3.ffn_up_exps.7`
        return f"blk.{int(m.group(1))}.ffn_{_EXPERT_KINDS[expert.group(2)]}_exps.{int(expert.group(1))}"
    return None


def _stack_experts(config: ModelConfig, store: WeightStore) -> None:
    """Each layer's experts as `[experts, out, in]` tensors (`ffn_gate_exps`, …): the Hub's one
    matrix per expert stacked (a copy), transformers 5's stacked `gate_up_proj` split into views."""
    for i in range(config.layers):
        b = f"blk.{i}."
        fused = store.entries.pop(b + "ffn_gate_up_exps", None)
        if fused is not None:
            f = config.expert_ffn
            if fused.shape[1:] != (2 * f, config.hidden):
                raise ModelFormatError(store.source, f"'{b}ffn_gate_up_exps' has shape {fused.shape}, "
                                                     f"the config implies {(config.experts, 2 * f, config.hidden)}")
            for kind, part in (("gate", slice(0, f)), ("up", slice(f, 2 * f))):
                data = fused.rows().reshape(fused.shape)[:, part]
                store.add(Weight(b + f"ffn_{kind}_exps", fused.storage, data.shape, data))
        for kind in ("gate", "up", "down"):
            if f"{b}ffn_{kind}_exps.0" not in store:  # stacked, or missing: strays are named below
                continue
            parts = [store.entries.pop(f"{b}ffn_{kind}_exps.{e}", None) for e in range(config.experts)]
            if any(p is None for p in parts) or len({(p.storage, p.shape) for p in parts}) != 1:
                raise ModelFormatError(store.source, f"layer {i}: the {kind} matrices of its {config.experts} "
                                                     "experts are missing or differ in type or shape")
            stacked = np.stack([np.asarray(p.rows()).reshape(p.shape) for p in parts])
            store.add(Weight(b + f"ffn_{kind}_exps", parts[0].storage, stacked.shape, stacked))
    leftover = [n for n in store if re.fullmatch(r"blk\.\d+\.ffn_\w+_exps\.\d+", n)]
    if leftover:
        raise ModelFormatError(store.source, f"tensor '{leftover[0]}' belongs to no expert of the config")


def _add_one_to_norms(store: WeightStore) -> None:
    """Gemma: each norm weight `w` becomes `1 + w` (float32), so `llm.rms_norm` computes Gemma's norm."""
    for name in [n for n in store if n.rsplit(".", 1)[-1] in _GEMMA_NORMS]:
        w = store[name]
        store.add(Weight(name, Storage.F32, w.shape, (w.to_f32() + np.float32(1)).astype(np.float32)))


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    """json `object_pairs_hook`: a key given twice is an error, not a silent overwrite."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def parse_json(path: Path, raw: bytes | str) -> object:
    try:
        return json.loads(raw, object_pairs_hook=_no_duplicates)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # JSONDecodeError is a ValueError
        raise ModelFormatError(path, f"invalid JSON: {e}") from e


def _inside(directory: Path, path: Path) -> Path:
    """`path` resolved, refusing anything (a symlink, say) that leads out of `directory`."""
    resolved = path.resolve()
    if not resolved.is_relative_to(directory.resolve()):
        raise ModelFormatError(path, f"points outside the model directory ({resolved}); refusing to read it")
    return resolved


def _tensor_entry(path: Path, name: str, info: object) -> tuple[np.dtype, Storage, tuple[int, ...], int, int]:
    if not isinstance(info, dict) or set(info) - {"dtype", "shape", "data_offsets"}:
        raise ModelFormatError(path, f"tensor '{name}': malformed header entry")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in _DTYPES:
        raise ModelFormatError(path, f"tensor '{name}': dtype {dtype!r} is not supported (F32, F16, BF16)")
    shape, offsets = info.get("shape"), info.get("data_offsets")
    if not (isinstance(shape, list) and len(shape) <= 8 and all(type(d) is int and 0 <= d < 1 << 40 for d in shape)):
        raise ModelFormatError(path, f"tensor '{name}': malformed shape {shape!r}")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int and o >= 0 for o in offsets)):
        raise ModelFormatError(path, f"tensor '{name}': malformed data_offsets {offsets!r}")
    numpy_type, storage = _DTYPES[dtype]
    return np.dtype(numpy_type), storage, tuple(shape), offsets[0], offsets[1]


def _read_safetensors(path: Path, store: WeightStore, arch: str) -> None:
    size = path.stat().st_size
    if size < 8:
        raise ModelFormatError(path, f"truncated safetensors file ({size} bytes, no header)")
    data = np.memmap(path, dtype=np.uint8, mode="r")
    header_len = int(data[:8].view("<u8")[0])
    if header_len > min(_MAX_HEADER, size - 8):
        raise ModelFormatError(path, f"safetensors header length {header_len} exceeds the file or {_MAX_HEADER} bytes")
    header = parse_json(path, bytes(data[8 : 8 + header_len]))
    if not isinstance(header, dict):
        raise ModelFormatError(path, "safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", {})
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ModelFormatError(path, "safetensors __metadata__ must map strings to strings")
    body = data[8 + header_len :]
    spans = []
    for hf_name, info in header.items():
        dtype, storage, shape, begin, end = _tensor_entry(path, hf_name, info)
        nbytes = int(np.prod(shape, dtype=object)) * dtype.itemsize
        if end - begin != nbytes or end > body.size:
            raise ModelFormatError(
                path, f"tensor '{hf_name}': data offsets {begin}..{end} do not hold {shape} {info['dtype']} "
                      f"or run past the data ({body.size} bytes)")
        spans.append((begin, end, hf_name))
        name = ir_name(hf_name, arch)
        if name is None:
            if hf_name.endswith("rotary_emb.inv_freq"):  # a buffer some checkpoints save; recomputed from theta
                continue
            raise ModelFormatError(path, f"tensor '{hf_name}' is not part of a supported architecture")
        if name in store:
            raise ModelFormatError(path, f"tensor '{hf_name}' appears in more than one file")
        store.add(Weight(name, storage, shape, body[begin:end].view(dtype).reshape(shape)))
    spans.sort()
    for (_, first_end, first), (begin, _, second) in zip(spans, spans[1:]):
        if begin < first_end:
            raise ModelFormatError(path, f"tensors '{first}' and '{second}' overlap (bytes {begin}..{first_end})")


def _int(path: Path, cfg: dict, key: str, default: int | None = None, at_least: int | None = None,
         at_most: int | None = None) -> int:
    value = cfg.get(key)
    value = default if value is None else value
    if value is None:
        raise ModelFormatError(path, f"config.json lacks {key!r}")
    if type(value) is not int:
        raise ModelFormatError(path, f"config.json: {key} must be an integer, got {value!r}")
    if at_least is not None and value < at_least:
        raise ModelFormatError(path, f"config.json: {key} must be at least {at_least}, got {value}")
    if at_most is not None and value > at_most:
        raise ModelFormatError(path, f"config.json: {key} must be at most {at_most}, got {value}")
    return value


def _optional_float(path: Path, cfg: dict, key: str, default: float | None = None) -> float | None:
    """`cfg[key]`, None where it is null, `default` where it is absent."""
    value = cfg.get(key, default)
    return None if value is None else _float(path, {key: value}, key, 0.0)


def _float(path: Path, cfg: dict, key: str, default: float, positive: bool = False) -> float:
    value = cfg.get(key)
    value = default if value is None else value
    number = finite(value)
    if number is None or (positive and not number > 0):
        raise ModelFormatError(path, f"config.json: {key} must be a {'positive ' if positive else ''}number, got {value!r}")
    return number


def _sliding_layers(path: Path, cfg: dict, arch: str, layers: int) -> tuple[int, ...]:
    """The layers whose attention is windowed: `layer_types` where given; else every layer of a
    Mistral or Phi-3 with `sliding_window`, or Qwen2's `use_sliding_window` from `max_window_layers` on."""
    if arch == "llama":  # (transformers' Llama attends to every position: `layer_types`, `sliding_window` unread)
        return ()
    types = cfg.get("layer_types")
    if types is not None:
        kinds = ("full_attention", "sliding_attention")
        if not (isinstance(types, list) and len(types) == layers and all(t in kinds for t in types)):
            raise ModelFormatError(path, f"config.json: layer_types must list {layers} of {', '.join(kinds)}")
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if _window(path, cfg, arch) is None:
        return ()
    if arch in ("mistral", "mixtral", "phi3") or (arch == "qwen3moe" and cfg.get("use_sliding_window")):
        return tuple(range(layers))
    if arch in GEMMA:  # configs from before `layer_types`: every other layer, or 5 of every 6 (0: all)
        pattern = _int(path, cfg, "sliding_window_pattern", 2 if arch == "gemma2" else 6, at_least=0)
        return tuple(i for i in range(layers) if not pattern or (i + 1) % pattern)
    if cfg.get("use_sliding_window"):
        return tuple(range(_int(path, cfg, "max_window_layers", 0, at_least=0), layers))
    return ()


def _window(path: Path, cfg: dict, arch: str) -> int | None:
    """The config's sliding window, or None; transformers' 4096 where a Gemma config leaves it out."""
    if arch in GEMMA:
        return _int(path, cfg, "sliding_window", 4096)
    return None if cfg.get("sliding_window") is None else _int(path, cfg, "sliding_window")


def _rope(path: Path, cfg: dict, head_dim: int, max_positions: int, arch: str) -> dict:
    """`ModelConfig`'s RoPE fields from `rope_parameters` (transformers 5) or `rope_theta` and
    `rope_scaling` (older configs), with `partial_rotary_factor`; Gemma 3's sliding layers'
    own base from `rope_parameters.sliding_attention` or `rope_local_base_freq`."""
    params = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or {}
    if not isinstance(params, dict) or not isinstance(scaling, dict):
        raise ModelFormatError(path, "config.json: rope_parameters and rope_scaling must be objects")
    local = _float(path, cfg, "rope_local_base_freq", 10000.0) if arch == "gemma3" else None  # transformers' default
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type
        if set(params) - {"full_attention", "sliding_attention"}:
            raise ModelFormatError(path, f"config.json: unknown layer types in rope_parameters: {sorted(params)}")
        sliding = params.get("sliding_attention", {})
        if not isinstance(sliding, dict) or sliding.get("rope_type", "default") != "default":
            raise ModelFormatError(path, "RoPE scaling of the sliding-window layers is not supported yet")
        if "rope_theta" in sliding:
            local = _float(path, sliding, "rope_theta", 0.0)
        params = params.get("full_attention", {})
    params = scaling or params  # (as transformers 5: `rope_scaling`, an older config's, replaces `rope_parameters`)
    # `rope_parameters`' own base first, then the top-level one (transformers fills the first from the second)
    theta = _float(path, params, "rope_theta", _float(path, cfg, "rope_theta", 1e6 if arch == "gemma3" else 10000.0))
    rope_base(path, "config.json: rope_theta", theta)  # before the scaling's frequencies are computed from it
    partial = _float(path, cfg, "partial_rotary_factor", _float(path, params, "partial_rotary_factor", 1.0))
    dims = int(head_dim * partial) if 0 < partial <= 1 else 0
    if dims < 2:
        raise ModelFormatError(path, f"config.json: partial_rotary_factor must be in (0, 1] and leave at least 2 of "
                                     f"head_dim {head_dim} rotating, got {partial}")
    if "original_max_position_embeddings" in cfg:  # (transformers prefers the top-level key)
        params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    scaled = hf_rope_scaling(path, params, theta, dims, max_positions)
    return {"rope_theta": theta, "rope_dims": 0 if dims == head_dim else dims, "rope_factors": scaled.factors,
            "rope_mscale": scaled.mscale, "context_length": min(max_positions, scaled.context or max_positions),
            "local_rope_theta": local}


def _moe(path: Path, cfg: dict, arch: str) -> tuple[dict, dict[str, int]]:
    """A mixture of experts' fields: Mixtral's experts are `intermediate_size` wide and always
    renormalized; Qwen3-MoE's `moe_intermediate_size`, renormalized with `norm_topk_prob`. And
    their sizes by the config's keys."""
    experts_key = "num_local_experts" if "num_local_experts" in cfg else "num_experts"
    experts = _int(path, cfg, experts_key)
    if arch == "qwen3moe":
        if _int(path, cfg, "decoder_sparse_step", 1) != 1 or cfg.get("mlp_only_layers"):
            raise ModelFormatError(path, "dense layers among the experts' (decoder_sparse_step, mlp_only_layers) "
                                         "are not supported yet")
        normalized = cfg.get("norm_topk_prob", False)
        if not isinstance(normalized, bool):
            raise ModelFormatError(path, f"config.json: norm_topk_prob must be true or false, got {normalized!r}")
        width = _int(path, cfg, "moe_intermediate_size")
    else:
        normalized, width = True, _int(path, cfg, "intermediate_size")
    used = _int(path, cfg, "num_experts_per_tok")
    sizes = {experts_key: experts, "num_experts_per_tok": used,
             "moe_intermediate_size" if arch == "qwen3moe" else "intermediate_size": width}
    return {"experts": experts, "experts_used": used, "expert_ffn": width, "experts_normalized": normalized}, sizes


def _architecture(path: Path, cfg: dict) -> str:
    archs = cfg.get("architectures")
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise ModelFormatError(path, f"config.json: architectures must be a list of names, got {archs!r}")
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise ModelFormatError(path, f"unsupported architecture {archs} (supported: {', '.join(ARCHITECTURES)})")
    return arch


def _config(path: Path, cfg: dict, arch: str, weights: WeightStore) -> ModelConfig:
    """The config's `ModelConfig`, its sizes checked against the `weights` present before use."""
    for flag in ("mlp_bias",) + (("attention_bias",) if arch != "qwen2" else ()):
        if cfg.get(flag):
            raise ModelFormatError(path, f"config.json sets {flag}, which llmc does not support yet")
    tied = cfg.get("tie_word_embeddings", arch in GEMMA)
    if not isinstance(tied, bool):
        raise ModelFormatError(path, f"config.json: tie_word_embeddings must be true or false, got {tied!r}")
    hidden, heads = _int(path, cfg, "hidden_size"), _int(path, cfg, "num_attention_heads")
    if heads < 1:
        raise ModelFormatError(path, f"config.json: num_attention_heads must be positive, got {heads}")
    layers = _int(path, cfg, "num_hidden_layers")
    head_dim = _int(path, cfg, "head_dim", hidden // heads)
    kv_heads, ffn, vocab = (_int(path, cfg, "num_key_value_heads", heads), _int(path, cfg, "intermediate_size"),
                            _int(path, cfg, "vocab_size"))
    family, sizes = _moe(path, cfg, arch) if arch in MOE else ({}, {})  # what a family adds to the Llama fields
    check_declared_sizes(path, weights, ("num_hidden_layers", layers), {
        "hidden_size": hidden, "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_attention_heads x head_dim": heads * head_dim, "intermediate_size": ffn, "vocab_size": vocab, **sizes})
    context = _int(path, cfg, "max_position_embeddings", 2048, at_least=1, at_most=MAX_POSITIONS)
    sliding = _sliding_layers(path, cfg, arch, layers)
    # (as transformers' MLPs read it: Gemma's `hidden_activation`, the others' `hidden_act`; the other key ignored)
    act = (cfg.get("hidden_activation") or "gelu_pytorch_tanh") if arch in GEMMA else cfg.get("hidden_act", "silu")
    activation = HF_ACTIVATIONS.get(act) if isinstance(act, str) else None
    if activation is None:
        raise ModelFormatError(path, f"config.json: activation {act!r} is not supported for {arch}")
    family["activation"] = activation
    if arch in GEMMA:
        family |= {"embedding_scale": float(np.float32(hidden ** 0.5)), "post_norms": True,
                 "attn_scale": _float(path, cfg, "query_pre_attn_scalar", 256, positive=True) ** -0.5,  # transformers' defaults
                 "attn_softcap": _optional_float(path, cfg, "attn_logit_softcapping", 50.0 if arch == "gemma2" else None),
                 "final_softcap": _optional_float(path, cfg, "final_logit_softcapping",
                                                  30.0 if arch == "gemma2" else None)}
    config = ModelConfig(
        arch=arch,
        vocab_size=vocab,
        hidden=hidden,
        layers=layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        ffn=ffn,
        rms_eps=_float(path, cfg, "rms_norm_eps", 1e-6),
        tied_embeddings=tied,
        qkv_bias=arch == "qwen2",
        qk_norm=arch in ("qwen3", "gemma3", "qwen3moe"),
        sliding_window=_window(path, cfg, arch) if sliding else None,
        sliding_layers=sliding,
        **_rope(path, cfg, head_dim, context, arch),
        **family,
    )
    config.check(path)
    return config


def load_hf_tokenizer(directory: Path) -> TextCodec:
    """The directory's `tokenizer.json`, with the special ids and chat template of `tokenizer_config.json`;
    a `chat_template.jinja` file (what current transformers writes) is the chat template where there is one."""
    file = directory / "tokenizer.json"
    if not file.is_file():
        raise ModelFormatError(directory, "no tokenizer.json in this directory")
    file = _inside(directory, file)
    tokenizer = read_tokenizer(file)
    settings_file = directory / "tokenizer_config.json"
    settings = _json(_inside(directory, settings_file)) if settings_file.is_file() else {}

    def special_id(key: str) -> int | None:
        token = settings.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        return tokenizer.token_to_id(token) if isinstance(token, str) else None

    eos_id = special_id("eos_token")
    return TextCodec(
        tokenizer,
        bos_id=special_id("bos_token"),
        eos_id=eos_id,
        add_bos=bool(settings.get("add_bos_token", False)),  # (as transformers: any true value, "false" too)
        chat_template=_chat_template(directory, settings),
        stop_ids=tuple(sorted(_end_ids(directory, tokenizer.get_vocab_size(with_added_tokens=True)) - {eos_id})),
    )


def _end_ids(directory: Path, vocab: int) -> set[int]:
    """The ids `eos_token_id` names in `generation_config.json` and `config.json` (an id or a list: Llama 3's
    end of text, of turn and of message), where generation ends as transformers' `generate` ends it."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        file = directory / name
        if not file.is_file():
            continue
        given = _json(_inside(directory, file)).get("eos_token_id")
        listed = given if isinstance(given, list) else [] if given is None else [given]
        if len(listed) > MAX_STOP_IDS or not all(type(i) is int and 0 <= i < vocab for i in listed):
            raise ModelFormatError(file, f"eos_token_id must be a token id or a list of at most {MAX_STOP_IDS} "
                                         f"(of the vocabulary of {vocab}), got {str(given)[:80]}")
        ids.update(listed)
    return ids


def _chat_template(directory: Path, settings: dict) -> str | None:
    """The chat template as transformers finds it: `chat_template.jinja` wins over `tokenizer_config.json`'s
    `chat_template`, a string or a list of named templates (the one named "default")."""
    file = directory / "chat_template.jinja"
    if file.is_file():
        return read_chat_template(_inside(directory, file), check=False)  # (checked when it renders, as the rest)
    template = settings.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    return template if isinstance(template, str) else None


def _json(path: Path) -> dict:
    try:
        size = path.stat().st_size
        if size > _MAX_HEADER:
            raise ModelFormatError(path, f"{size} bytes is too large for this JSON file (at most {_MAX_HEADER})")
        raw = path.read_bytes()
    except OSError as e:
        raise ModelFormatError(path, f"cannot read: {e.strerror}") from e
    value = parse_json(path, raw)
    if not isinstance(value, dict):
        raise ModelFormatError(path, "expected a JSON object")
    return value


PICKLE_SUFFIXES = (".bin", ".pt", ".pth")


def _read_pickle(path: Path, store: WeightStore, arch: str) -> None:
    """Tensors of a PyTorch checkpoint through torch's weights-only unpickler (no code runs)."""
    try:
        import torch
    except ImportError as e:
        raise ModelFormatError(path, "loading pickle weights needs torch: pip install 'llmc[reference]'") from e
    try:
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, … for hostile or broken files
        raise ModelFormatError(path, f"refused by torch's weights-only loader: {str(e).splitlines()[0]}") from e
    if not isinstance(state, dict):
        raise ModelFormatError(path, "the checkpoint is not a dictionary of tensors")
    numpy_of = {torch.float32: np.float32, torch.float16: np.float16}
    for hf_name, tensor in state.items():
        name = ir_name(hf_name, arch) if isinstance(hf_name, str) else None
        if name is None or not isinstance(tensor, torch.Tensor):
            if isinstance(hf_name, str) and hf_name.endswith("rotary_emb.inv_freq"):
                continue
            raise ModelFormatError(path, f"entry {hf_name!r} is not part of a supported architecture")
        if tensor.dtype == torch.bfloat16:
            store.add(Weight(name, Storage.BF16, tuple(tensor.shape), tensor.view(torch.int16).numpy().view(np.uint16)))
        elif tensor.dtype in numpy_of:
            storage = Storage.F32 if tensor.dtype == torch.float32 else Storage.F16
            store.add(Weight(name, storage, tuple(tensor.shape), tensor.numpy()))
        else:
            raise ModelFormatError(path, f"tensor '{hf_name}' has dtype {tensor.dtype}, not f32, f16 or bf16")


SAFETENSORS_INDEX = "model.safetensors.index.json"


def _safetensors_files(directory: Path) -> list[Path]:
    """The weight files: those `model.safetensors.index.json` maps tensors to, where it exists (as transformers
    reads them: a `consolidated.safetensors` beside the shards, Mistral's, holds the same tensors under other
    names), else every `*.safetensors`."""
    index = directory / SAFETENSORS_INDEX
    if not index.is_file():
        return sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    weight_map = _json(_inside(directory, index)).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or \
            not all(isinstance(name, str) for name in weight_map.values()):
        raise ModelFormatError(index, "'weight_map' must map tensor names to file names")
    files = []
    for name in sorted(set(weight_map.values())):
        if Path(name).name != name or not name.endswith(".safetensors"):
            raise ModelFormatError(index, f"'weight_map' names {name!r}, not a .safetensors file of this directory")
        if not (directory / name).is_file():
            raise ModelFormatError(index, f"'weight_map' names {name}, which is not in the directory")
        files.append(directory / name)
    return files


def load_hf(directory: Path, allow_pickle: bool = False) -> Model:
    """Read a Hugging Face model directory's config, weights (lazily) and tokenizer.

    Only files inside `directory` are read (symlinks that lead out are refused); pickle
    checkpoints (`*.bin`, `*.pt`) only with `allow_pickle`, through torch's weights-only loader.
    """
    config_file = directory / "config.json"
    if not config_file.is_file():
        if (directory / MANIFEST).is_file():
            raise ModelFormatError(directory, "an llmc artifact, not a model: give the GGUF file or Hugging Face "
                                              "directory it was compiled from (`llmc run` takes the artifact)")
        raise ModelFormatError(directory, "no config.json in this directory")
    cfg = _json(_inside(directory, config_file))
    arch = _architecture(config_file, cfg)
    store = WeightStore(directory)
    files = _safetensors_files(directory)
    if files:
        for file in files:
            _read_safetensors(_inside(directory, file), store, arch)
    else:
        pickles = sorted(p for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES and p.is_file())
        if not pickles:
            raise ModelFormatError(directory, "no *.safetensors files in this directory")
        if not allow_pickle:
            raise ModelFormatError(
                directory, f"holds only pickle weights ({pickles[0].name}); pickles can run code, so llmc loads "
                           "them only with --allow-pickle (through torch's weights-only loader)")
        for file in pickles:
            _read_pickle(_inside(directory, file), store, arch)
    config = _config(config_file, cfg, arch, store)
    split_fused(config, store)
    if config.experts:
        _stack_experts(config, store)
    if config.arch in GEMMA:
        _add_one_to_norms(store)
    return Model(directory, config, store, lambda: load_hf_tokenizer(directory))
