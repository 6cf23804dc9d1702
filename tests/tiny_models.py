"""Tiny random-weight decoders written by the tests, as GGUF files and as HF directories.

`TinySpec` fixes the shapes; `random_weights` draws one set of weights (Hugging Face
names, `[out, in]` matrices); `write_hf` and `write_gguf` store the same weights the way
each ecosystem does (GGUF with llama.cpp's Q/K row permutation and optional block
quantization), so both frontends can be checked against each other and against
transformers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
from safetensors.numpy import save_file

from llmc.frontend.hf import ir_name
from llmc.ir.formats import FORMATS, Storage


@dataclass(frozen=True)
class TinySpec:
    arch: str = "llama"  # a key of HF_ARCHITECTURES
    hidden: int = 32
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 8
    ffn: int = 48
    tied: bool = True
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5
    context_length: int = 64
    seed: int = 0
    # GGUF storage per tensor kind ("attn_q", "token_embd", ...); f32 when absent
    gguf_storage: tuple[tuple[str, str], ...] = ()
    # the config's RoPE scaling (`rope_scaling` items, e.g. (("rope_type", "llama3"), ("factor", 8.0), ...))
    rope_scaling: tuple[tuple[str, object], ...] = ()
    partial_rotary: float = 1.0
    sliding_window: int | None = None  # Mistral and Phi-3: every layer; Gemma: the `sliding_attention` layers
    layer_types: tuple[str, ...] = ()  # Gemma: "sliding_attention" / "full_attention" per layer
    attn_softcap: float | None = None  # Gemma 2
    final_softcap: float | None = None
    query_pre_attn_scalar: float | None = None
    local_rope_theta: float = 10000.0  # Gemma 3's sliding layers
    experts: int = 0  # Qwen3-MoE, Mixtral: experts per layer, `experts_used` per token, `ffn` wide each
    experts_used: int = 2
    norm_topk: bool = True  # Qwen3-MoE's norm_topk_prob (Mixtral always renormalizes)
    hidden_act: str = "silu"  # the gate's activation, as transformers names it (Gemma: always gelu_pytorch_tanh)
    eot_id: int | None = None  # an end of turn: GGUF's tokenizer.ggml.eot_token_id, HF's generation_config.json

    @property
    def qkv_bias(self) -> bool:
        return self.arch == "qwen2"

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary)


HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                    "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM", "gemma2": "Gemma2ForCausalLM",
                    "gemma3": "Gemma3ForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM"}
GGUF_ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama", "phi3": "phi3",
                      "gemma2": "gemma2", "gemma3": "gemma3", "qwen3moe": "qwen3moe", "mixtral": "llama"}


# ------------------------------------------------------------------ tokenizer


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte → printable character table (byte-level BPE alphabet)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, map(chr, chars)))


SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "Ġ 2", "Ġ c", "a p"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def vocabulary() -> tuple[list[str], list[str]]:
    """Token strings (specials first, then the 256 byte symbols, then merged pairs) and merges."""
    tokens = SPECIAL_TOKENS + sorted(_bytes_to_unicode().values())
    for merge in MERGES:
        tokens.append(merge.replace(" ", ""))
    return tokens, MERGES


VOCAB_SIZE = len(vocabulary()[0])


def hf_tokenizer_json() -> str:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    tokens, merges = vocabulary()
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[tuple(m.split(" ")) for m in merges]))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    return tok.to_str()


# --------------------------------------------------------------------- weights


def random_weights(spec: TinySpec) -> dict[str, np.ndarray]:
    """One set of float32 weights under Hugging Face names."""
    rng = np.random.default_rng(spec.seed)
    q, kv = spec.heads * spec.head_dim, spec.kv_heads * spec.head_dim

    def mat(rows: int, cols: int) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) / np.sqrt(cols)).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n)).astype(np.float32)

    w = {"model.embed_tokens.weight": rng.standard_normal((VOCAB_SIZE, spec.hidden)).astype(np.float32)}
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm(spec.hidden)
        if spec.arch == "phi3":
            w[p + "self_attn.qkv_proj.weight"] = mat(q + 2 * kv, spec.hidden)
        else:
            w[p + "self_attn.q_proj.weight"] = mat(q, spec.hidden)
            w[p + "self_attn.k_proj.weight"] = mat(kv, spec.hidden)
            w[p + "self_attn.v_proj.weight"] = mat(kv, spec.hidden)
        if spec.arch in ("qwen3", "gemma3", "qwen3moe"):
            w[p + "self_attn.q_norm.weight"] = norm(spec.head_dim)
            w[p + "self_attn.k_norm.weight"] = norm(spec.head_dim)
        if spec.arch.startswith("gemma"):
            w[p + "pre_feedforward_layernorm.weight"] = norm(spec.hidden)
            w[p + "post_feedforward_layernorm.weight"] = norm(spec.hidden)
        if spec.qkv_bias:
            for name, n in (("q", q), ("k", kv), ("v", kv)):
                w[p + f"self_attn.{name}_proj.bias"] = (0.1 * rng.standard_normal(n)).astype(np.float32)
        w[p + "self_attn.o_proj.weight"] = mat(spec.hidden, q)
        w[p + "post_attention_layernorm.weight"] = norm(spec.hidden)
        if spec.arch == "phi3":
            w[p + "mlp.gate_up_proj.weight"] = mat(2 * spec.ffn, spec.hidden)
        elif spec.experts:  # the Hub's names: one matrix per expert
            moe, names = ("mlp", ("gate_proj", "up_proj", "down_proj")) if spec.arch == "qwen3moe" \
                else ("block_sparse_moe", ("w1", "w3", "w2"))
            w[p + f"{moe}.gate.weight"] = mat(spec.experts, spec.hidden)
            for e in range(spec.experts):
                w[p + f"{moe}.experts.{e}.{names[0]}.weight"] = mat(spec.ffn, spec.hidden)
                w[p + f"{moe}.experts.{e}.{names[1]}.weight"] = mat(spec.ffn, spec.hidden)
                w[p + f"{moe}.experts.{e}.{names[2]}.weight"] = mat(spec.hidden, spec.ffn)
        else:
            w[p + "mlp.gate_proj.weight"] = mat(spec.ffn, spec.hidden)
            w[p + "mlp.up_proj.weight"] = mat(spec.ffn, spec.hidden)
        if not spec.experts:
            w[p + "mlp.down_proj.weight"] = mat(spec.hidden, spec.ffn)
    w["model.norm.weight"] = norm(spec.hidden)
    if not spec.tied:
        w["lm_head.weight"] = mat(VOCAB_SIZE, spec.hidden)
    return w


def write_hf(spec: TinySpec, weights: dict[str, np.ndarray], directory: Path) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": [HF_ARCHITECTURES[spec.arch]],
        "model_type": spec.arch,
        "hidden_size": spec.hidden,
        "intermediate_size": spec.ffn,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": VOCAB_SIZE,
        "rms_norm_eps": spec.rms_eps,
        "rope_theta": spec.rope_theta,
        "max_position_embeddings": spec.context_length,
        "tie_word_embeddings": spec.tied,
        "hidden_act": spec.hidden_act,
        "torch_dtype": "float32",
        "bos_token_id": 0,
        "eos_token_id": 0,
        "pad_token_id": 0,
    }
    if spec.arch in ("qwen2", "qwen3"):
        config["use_sliding_window"] = False
    if spec.rope_scaling:
        config["rope_scaling"] = {k: list(v) if isinstance(v, tuple) else v for k, v in spec.rope_scaling}
    if spec.partial_rotary != 1.0:
        config["partial_rotary_factor"] = spec.partial_rotary
    if spec.sliding_window is not None:
        config["sliding_window"] = spec.sliding_window
    if spec.arch.startswith("gemma"):
        del config["hidden_act"]
        config |= {"hidden_activation": "gelu_pytorch_tanh", "layer_types": list(spec.layer_types),
                   "query_pre_attn_scalar": spec.query_pre_attn_scalar or spec.head_dim,
                   "attn_logit_softcapping": spec.attn_softcap, "final_logit_softcapping": spec.final_softcap}
    if spec.arch == "gemma3":
        config["model_type"] = "gemma3_text"  # Gemma3ForCausalLM: the text-only model (as gemma-3-1b)
        del config["rope_theta"]
        config["rope_parameters"] = {"sliding_attention": {"rope_type": "default", "rope_theta": spec.local_rope_theta},
                                     "full_attention": {"rope_type": "default", "rope_theta": spec.rope_theta,
                                                        **config.pop("rope_scaling", {})}}
    if spec.arch == "qwen3moe":
        config |= {"model_type": "qwen3_moe", "num_experts": spec.experts, "num_experts_per_tok": spec.experts_used,
                   "moe_intermediate_size": spec.ffn, "norm_topk_prob": spec.norm_topk, "decoder_sparse_step": 1,
                   "mlp_only_layers": []}
    if spec.arch == "mixtral":
        config |= {"num_local_experts": spec.experts, "num_experts_per_tok": spec.experts_used}
    if spec.arch == "phi3":
        config["original_max_position_embeddings"] = dict(spec.rope_scaling).get("original_max_position_embeddings",
                                                                                  spec.context_length)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    save_file(weights, str(directory / "model.safetensors"))
    (directory / "tokenizer.json").write_text(hf_tokenizer_json())
    if spec.eot_id is not None:  # (as Llama 3's: end of text, and of turn)
        (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, spec.eot_id]}))
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": CHAT_TEMPLATE})
    )
    return directory


# ----------------------------------------------------------------------- GGUF

def gguf_name(hf_name: str, arch: str = "llama") -> str:
    """GGUF tensor name (with `.weight` where GGUF has it) of a Hugging Face name (Phi-3's fused
    gate-up is llama.cpp's `ffn_up`)."""
    name = ir_name(hf_name, arch)
    assert name is not None, hf_name
    name = re.sub(r"(_exps)\.0$", r"\1", name.replace(".ffn_gate_up", ".ffn_up"))  # stacked experts
    return name if name.endswith(".bias") else name + ".weight"


def llama3_rope_freqs(spec: TinySpec) -> np.ndarray:
    """llama.cpp's `rope_freqs` tensor for a `llama3` scaling: each pair's frequency divisor."""
    p = dict(spec.rope_scaling)
    dims = spec.rotary_dims
    freqs = 1.0 / spec.rope_theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    wavelength = 2 * np.pi / freqs
    low, high = p["original_max_position_embeddings"] / p["low_freq_factor"], p["original_max_position_embeddings"] / p["high_freq_factor"]
    smooth = (p["original_max_position_embeddings"] / wavelength - p["low_freq_factor"]) / (p["high_freq_factor"] - p["low_freq_factor"])
    factors = [1.0 if wl < high else p["factor"] if wl > low else 1 / ((1 - s) / p["factor"] + s)
               for wl, s in zip(wavelength, smooth)]
    return np.asarray(factors, np.float32)


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter reorders Q/K rows for its interleaved RoPE."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _storage(spec: TinySpec, gguf_tensor: str) -> str:
    if gguf_tensor.endswith(".bias"):
        return "f32"
    kind = gguf_tensor.removesuffix(".weight").split(".")[-1]
    return dict(spec.gguf_storage).get(kind, "f32")


def write_gguf(spec: TinySpec, weights: dict[str, np.ndarray], path: Path, pre: str = "smollm") -> Path:
    """A GGUF file of these weights; tensors listed in `spec.gguf_storage` are quantized."""
    path.parent.mkdir(parents=True, exist_ok=True)
    arch = GGUF_ARCHITECTURES[spec.arch]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(spec.layers)
    writer.add_context_length(spec.context_length)
    writer.add_embedding_length(spec.hidden)
    writer.add_feed_forward_length(spec.ffn)
    writer.add_head_count(spec.heads)
    writer.add_head_count_kv(spec.kv_heads)
    writer.add_rope_dimension_count(spec.rotary_dims)
    if spec.head_dim * spec.heads != spec.hidden:
        writer.add_key_length(spec.head_dim)
        writer.add_value_length(spec.head_dim)
    writer.add_rope_freq_base(spec.rope_theta)
    scaling = dict(spec.rope_scaling)
    if scaling.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(spec))
    elif scaling.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(scaling["factor"])
    else:
        assert not scaling, f"the tiny GGUF writer has no {scaling.get('rope_type')} scaling"
    if spec.sliding_window is not None:
        writer.add_sliding_window(spec.sliding_window)
    if spec.experts:
        writer.add_expert_count(spec.experts)
        writer.add_expert_used_count(spec.experts_used)
        if spec.arch == "qwen3moe":
            assert spec.norm_topk, "llama.cpp renormalizes Qwen3-MoE's expert weights"
            writer.add_expert_feed_forward_length(spec.ffn)
    if spec.arch.startswith("gemma"):
        assert spec.query_pre_attn_scalar in (None, spec.head_dim), "GGUF Gemma scales queries by head_dim"
        pattern = spec.layer_types.index("full_attention") + 1  # one global layer after pattern - 1 sliding ones
        assert spec.layer_types == tuple("full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                                         for i in range(spec.layers)), "a regular pattern, as llama.cpp's"
        writer.add_sliding_window_pattern(pattern)
        if spec.attn_softcap is not None:
            writer.add_attn_logit_softcapping(spec.attn_softcap)
        if spec.final_softcap is not None:
            writer.add_final_logit_softcapping(spec.final_softcap)
        if spec.arch == "gemma3":
            writer.add_rope_freq_base_swa(spec.local_rope_theta)
    writer.add_layer_norm_rms_eps(spec.rms_eps)
    writer.add_vocab_size(VOCAB_SIZE)
    _add_vocabulary(writer, pre)
    if spec.eot_id is not None:
        writer.add_eot_token_id(spec.eot_id)
    for hf, w in _stacked_experts(spec, weights).items():
        name = gguf_name(hf, spec.arch)
        if spec.arch.startswith("gemma") and hf.endswith("norm.weight"):
            w = w + np.float32(1)  # as llama.cpp's converter stores Gemma's (1 + w) norms
        if arch != "llama":
            pass  # Qwen and Phi-3 keep Hugging Face's rotate-half RoPE: no permutation
        elif ".attn_q." in name:
            w = llama_cpp_permute(w, spec.heads)
        elif ".attn_k." in name:
            w = llama_cpp_permute(w, spec.kv_heads)
        storage = _storage(spec, name)
        if storage == "f32":
            writer.add_tensor(name, w)
        elif storage == "f16":
            writer.add_tensor(name, w.astype(np.float16))
        else:
            writer.add_tensor(name, _blocks(storage, w), raw_dtype=gguf.GGMLQuantizationType[storage.upper()])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _stacked_experts(spec: TinySpec, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights with each layer's experts stacked into `[experts, out, in]` tensors, as llama.cpp's
    converter writes them (`ffn_gate_exps`, …; named here by the first expert's matrix)."""
    if not spec.experts:
        return weights
    out = {}
    for hf, w in weights.items():
        m = re.fullmatch(r"(.*\.experts\.)(\d+)(\..*)", hf)
        if m is None:
            out[hf] = w
        elif m.group(2) == "0":
            out[hf] = np.stack([weights[f"{m.group(1)}{e}{m.group(3)}"] for e in range(spec.experts)])
    return out


def _add_vocabulary(writer: gguf.GGUFWriter, pre: str, add_bos: bool = False) -> None:
    tokens, merges = vocabulary()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t in SPECIAL_TOKENS else 1 for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(add_bos)
    writer.add_chat_template(CHAT_TEMPLATE)


def write_vocab_gguf(path: Path, pre: str = "smollm", add_bos: bool = False) -> Path:
    """A vocabulary-only GGUF file (tokenizer metadata, no tensors), as llama.cpp's `ggml-vocab-*.gguf`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    _add_vocabulary(writer, pre, add_bos)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _blocks(storage: str, w: np.ndarray) -> np.ndarray:
    """GGUF blocks of `w`: gguf's quantizer where it has one, llmc's for the k-quants."""
    fmt = FORMATS[Storage(storage)]
    if storage in ("q4_k", "q5_k", "q6_k"):
        return fmt.to_blocks(fmt.quantize(w))
    return gguf.quants.quantize(w, fmt.ggml)


def dequantized_like_gguf(spec: TinySpec, weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The weights after the GGUF storage round trip: what a GGUF import should compute with."""
    out = {}
    for hf, w in weights.items():
        name = gguf_name(hf)
        storage = _storage(spec, name)
        if storage == "f16":
            w = w.astype(np.float16).astype(np.float32)
        elif storage != "f32":
            qtype = gguf.GGMLQuantizationType[storage.upper()]
            w = gguf.quants.dequantize(_blocks(storage, w), qtype).reshape(w.shape)
        out[hf] = w.astype(np.float32)
    return out
