"""Model families beyond Llama: exact-GELU GeGLU, RoPE scaling (llama3, linear, YaRN, LongRoPE), partial rotary,
head_dim ≠ hidden/heads, Qwen3's per-head q/k norms, sliding-window attention (Mistral,
Phi-3), Phi-3's fused tensors, and Gemma 2/3 ((1 + w) norms, GeGLU, sandwich norms,
soft-capping, query_pre_attn_scalar, alternating local and global layers with their own
RoPE bases). Tiny random-weight models written with transformers'
names, checked against transformers fp32 (interpreter and compiled artifact, through
`llmc verify`), with the KV cache past the window, and as GGUF files against their HF twins."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from numerics import assert_model_reordered
from test_compile import TOKENS as COMPILE_TOKENS
from test_compile import _close
from test_interpreter import TOKENS, _assert_close_to_reference, _logits
from tiny_models import TinySpec

from llmc.cli import main
from llmc.frontend import import_model, load_model
from llmc.ir import find_function
from llmc.ir.interpreter import KVCache, forward_logits
from llmc.runtime.session import Session
from llmc.verify import teacher_forced

LLAMA3 = (("rope_type", "llama3"), ("factor", 8.0), ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
          ("original_max_position_embeddings", 16))  # pair 0 in the smoothed band, pairs 1-3 divided by 8
LONGROPE = (("rope_type", "longrope"), ("short_factor", (1.0, 1.5, 2.0, 4.0)), ("long_factor", (2.0, 3.0, 4.0, 8.0)),
            ("original_max_position_embeddings", 64))  # prompts stay below 64 tokens: the short factors

FAMILIES = {
    "llama3-rope": TinySpec(rope_scaling=LLAMA3, tied=False),
    "linear-rope": TinySpec(rope_scaling=(("rope_type", "linear"), ("factor", 4.0))),
    "yarn-rope": TinySpec(hidden=32, heads=2, kv_heads=1, head_dim=16,
                          rope_scaling=(("rope_type", "yarn"), ("factor", 4.0), ("original_max_position_embeddings", 16))),
    "llama-gelu": TinySpec(hidden_act="gelu"),  # GeGLU with exact GELU (erf)
    "qwen3": TinySpec(arch="qwen3", head_dim=16, tied=False),  # head_dim 16 ≠ 32 / 4 heads
    "qwen3-mha-odd": TinySpec(arch="qwen3", hidden=24, heads=3, kv_heads=3, head_dim=8, layers=3),
    "mistral-window4": TinySpec(arch="mistral", sliding_window=4, tied=False),
    "mistral-gqa1-window6": TinySpec(arch="mistral", heads=4, kv_heads=1, sliding_window=6),
    "phi3": TinySpec(arch="phi3", heads=4, kv_heads=4, tied=False),
    "phi3-gqa-partial-longrope-window5": TinySpec(arch="phi3", hidden=64, heads=4, kv_heads=2, head_dim=16,
                                                  partial_rotary=0.5, rope_scaling=LONGROPE, sliding_window=5,
                                                  context_length=128),
    "gemma2": TinySpec(arch="gemma2", head_dim=16, tied=True, layer_types=("sliding_attention", "full_attention"),
                       sliding_window=4, attn_softcap=5.0, final_softcap=8.0, query_pre_attn_scalar=24),
    "qwen3moe-8x2-normalized": TinySpec(arch="qwen3moe", experts=8, experts_used=2, ffn=24, head_dim=16, tied=False),
    "qwen3moe-4x3-unnormalized": TinySpec(arch="qwen3moe", experts=4, experts_used=3, ffn=16, norm_topk=False,
                                          heads=3, kv_heads=1, hidden=24),
    "mixtral-4x2-window6": TinySpec(arch="mixtral", experts=4, experts_used=2, ffn=40, sliding_window=6, tied=False),
    "gemma2-gguf": TinySpec(arch="gemma2", hidden=48, heads=3, kv_heads=1, head_dim=16, tied=True, layers=4,
                            layer_types=("sliding_attention", "full_attention") * 2, sliding_window=4,
                            attn_softcap=5.0, final_softcap=8.0),
    "gemma3-linear-global": TinySpec(arch="gemma3", heads=4, kv_heads=1, head_dim=16, layers=3, rope_theta=1e6,
                                     layer_types=("sliding_attention", "sliding_attention", "full_attention"),
                                     sliding_window=5, rope_scaling=(("rope_type", "linear"), ("factor", 8.0))),
}
WINDOWED = [k for k, spec in FAMILIES.items() if spec.sliding_window]
# the families llama.cpp converts to GGUF whose features the tiny GGUF writer can express
GGUF_FAMILIES = ["llama3-rope", "linear-rope", "qwen3", "qwen3-mha-odd", "mistral-window4", "phi3", "gemma2-gguf",
                 "gemma3-linear-global", "qwen3moe-8x2-normalized", "mixtral-4x2-window6"]


@pytest.mark.reference
@pytest.mark.parametrize("name", FAMILIES)
def test_interpreter_matches_transformers(tiny: Callable[..., Path], name: str) -> None:
    pytest.importorskip("transformers")
    from llmc.frontend.reference import reference_logits

    path = tiny(FAMILIES[name], "hf")
    _assert_close_to_reference(_logits(path), reference_logits(path, TOKENS))


@pytest.mark.parametrize("split", [3, 9])
@pytest.mark.parametrize("name", WINDOWED + ["qwen3"])
def test_prefill_then_decode_equals_one_forward(tiny: Callable[..., Path], name: str, split: int) -> None:
    """prefill(n) + decode one by one = prefill(all), with the windows passed (14 tokens, windows ≤ 6)."""
    model = load_model(str(tiny(FAMILIES[name], "hf")))
    module = import_model(model)
    full = forward_logits(module, model.weights, TOKENS)
    cache = KVCache.for_type(find_function(module, "forward").function_type.inputs.data[2])
    steps = [forward_logits(module, model.weights, TOKENS[:split], cache=cache)]
    steps += [forward_logits(module, model.weights, [t], start=split + i, cache=cache)
              for i, t in enumerate(TOKENS[split:])]
    assert_model_reordered(np.concatenate(steps), full, FAMILIES[name])  # (numpy's summation order)


def test_the_window_changes_the_result(tiny: Callable[..., Path]) -> None:
    """Not vacuous: the same weights without the window give other logits once past it."""
    spec = FAMILIES["mistral-window4"]
    windowed = _logits(tiny(spec, "hf"))
    unwindowed = _logits(tiny(TinySpec(arch="mistral", tied=False), "hf"))
    np.testing.assert_allclose(windowed[:4], unwindowed[:4], rtol=1e-5, atol=1e-5)
    assert np.abs(windowed[4:] - unwindowed[4:]).max() > 1e-2


@pytest.mark.reference
@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_artifact_passes_verify(tiny: Callable[..., Path], name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`llmc verify` (float weights, compute and KV cache): transformers, the `llm` and `tgt` interpreters and
    the compiled CPU artifact on one prompt (longer than the windows), every stage at cosine ≥ 0.9999
    and 100% top-1 — prefill then teacher-forced decode through the KV cache."""
    pytest.importorskip("transformers")
    assert_float_verify_passes(tiny(FAMILIES[name], "hf"), capsys)


def assert_float_verify_passes(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`llmc verify` in float of the model at `path` passes, every stage at 100% top-1."""
    code = main(["verify", str(path), "--quant", "f32", "--compute", "a32", "--kv-type", "f32", "--prompt",
                 "The capital of France is Paris, and 2018 was a year."])
    out = capsys.readouterr().out
    assert code == 0, out
    rows = [re.match(r"(llm|quantize|tgt|artifact) +[0-9.]+ .* (\d+)/(\d+) \(", line) for line in out.splitlines()]
    top1 = {m.group(1): (m.group(2), m.group(3)) for m in rows if m}
    assert set(top1) == {"llm", "quantize", "tgt", "artifact"}, out
    assert all(agree == total for agree, total in top1.values()), out


@pytest.mark.reference
@pytest.mark.parametrize("name", FAMILIES)
def test_compiled_artifact_matches_transformers(tiny: Callable[..., Path], artifact, name: str) -> None:
    """The compiled CPU artifact (float weights and compute), prefill in chunks of 4 then decode, against
    transformers fp32 on the same tokens: max abs error ≤ 1e-4 of the logit scale, identical top-1."""
    pytest.importorskip("transformers")
    from llmc.frontend.reference import reference_logits

    path = tiny(FAMILIES[name], "hf")
    session = Session(artifact(FAMILIES[name], form="hf", compute="a32"))
    logits = teacher_forced(lambda chunk, start: session.feed(chunk), TOKENS)
    _assert_close_to_reference(logits, reference_logits(path, TOKENS))


@pytest.mark.reference
@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_gguf_passes_verify_against_its_hf_twin(tiny: Callable[..., Path], name: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """`llmc verify FILE.gguf --reference HF_DIR`: the GGUF file, every stage down to its compiled artifact,
    against transformers on the checkpoint it was converted from (transformers' own GGUF reading knows
    few of these families' features)."""
    pytest.importorskip("transformers")
    spec = FAMILIES[name]
    code = main(["verify", str(tiny(spec, "gguf")), "--reference", str(tiny(spec, "hf")), "--quant", "f32",
                 "--compute", "a32", "--kv-type", "f32"])
    out = capsys.readouterr().out
    assert code == 0 and "reference " in out and "artifact" in out, out


READ_AS_TRANSFORMERS_READS = {  # config.json keys a family's transformers code reads one way, llmc read another
    "llama-hidden_activation": (TinySpec(), {"hidden_activation": "gelu"}),  # (Llama's MLP: `hidden_act`)
    "gemma2-hidden_act-alone": (FAMILIES["gemma2"], {"hidden_act": "silu", "hidden_activation": None}),  # (Gemma's: the other)
    "llama-layer_types": (TinySpec(), {"layer_types": ["sliding_attention"] * 2, "sliding_window": 3}),  # (not read)
    "rope_scaling-and-rope_parameters": (TinySpec(), {"rope_scaling": {"rope_type": "linear", "factor": 2.0},
                                                   "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "rope_theta-twice": (TinySpec(), {"rope_theta": 500.0, "rope_parameters": {"rope_type": "default",
                                                                             "rope_theta": 10000.0}}),
}


@pytest.mark.reference
@pytest.mark.parametrize("case", READ_AS_TRANSFORMERS_READS)
def test_a_config_is_read_as_transformers_reads_it(tiny: Callable[..., Path], tmp_path: Path, case: str,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """Keys a family's transformers code does not read, or reads first (`rope_scaling` over `rope_parameters`, the
    latter's `rope_theta` over the top-level one), as transformers does: `verify` holds (was: cosines 0.71–0.996)."""
    pytest.importorskip("transformers")
    spec, edits = READ_AS_TRANSFORMERS_READS[case]
    model = Path(shutil.copytree(tiny(spec, "hf"), tmp_path / "m"))
    config = json.loads((model / "config.json").read_text())
    config.update(edits)
    (model / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v is not None}))
    code = main(["verify", str(model), "--quant", "f32", "--compute", "a32", "--kv-type", "f32"])
    out = capsys.readouterr().out
    assert code == 0 and "artifact" in out, out


@pytest.mark.reference
def test_a_reference_transformers_cannot_load_is_one_line(tiny: Callable[..., Path], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    assert main(["verify", str(tiny(FAMILIES["qwen3"], "gguf"))]) != 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llmc:")]  # (in-process: tqdm's bars too)
    assert len(err) == 1 and "transformers cannot load" in err[0] and "verify's --reference" in err[0], err
    assert main(["verify", str(tiny(FAMILIES["qwen3"], "gguf")), "--reference", str(tmp_path)]) != 0
    assert "not a Hugging Face model directory" in capsys.readouterr().err


@pytest.mark.reference
def test_a_pickled_reference_loads_only_with_allow_pickle(tiny: Callable[..., Path], tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """`--reference DIR` whose weights are only `pytorch_model.bin` (a pickle transformers would load): refused in
    one line before any work; with --allow-pickle, the reference it is."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from safetensors.torch import load_file

    spec, pickled = FAMILIES["qwen3"], tmp_path / "pickled"
    shutil.copytree(tiny(FAMILIES["qwen3"], "hf"), pickled)
    for weights in pickled.glob("*.safetensors"):
        torch.save(load_file(weights), pickled / "pytorch_model.bin")
        weights.unlink()
    argv = ["verify", str(tiny(spec, "gguf")), "--reference", str(pickled), "--quant", "f32", "--compute", "a32",
            "--kv-type", "f32"]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("llmc: error: ") and err.count("\n") == 1 and "--allow-pickle" in err, err
    assert main([*argv, "--allow-pickle"]) == 0, capsys.readouterr()


@pytest.mark.parametrize("group", [True, False], ids=["grouped", "no-group"])
@pytest.mark.parametrize("name", ["qwen3", "phi3-gqa-partial-longrope-window5", "gemma2", "gemma3-linear-global"])
def test_compiled_artifact_matches_the_interpreter(tiny: Callable[..., Path], artifact, name: str,
                                                   group: bool) -> None:
    """The compiled CPU kernels, fused (`group`) or one op at a time (`--no-group`: the standalone RoPE,
    per-head norm, GeLU and elementwise kernels), teacher-forced in chunks of 4 then decode, against
    the `llm` interpreter."""
    spec = FAMILIES[name]
    session = Session(artifact(spec, group=group, form="hf"))
    model = load_model(str(tiny(spec, "hf")))
    expected = forward_logits(import_model(model), model.weights, COMPILE_TOKENS)
    _close(teacher_forced(lambda chunk, start: session.feed(chunk), COMPILE_TOKENS), expected)


@pytest.mark.parametrize("name", GGUF_FAMILIES)
def test_gguf_imports_like_its_hf_twin(tiny: Callable[..., Path], name: str) -> None:
    """The same weights as a GGUF file with llama.cpp's names, metadata and tensors (`rope_freqs`,
    fused `attn_qkv` / `ffn_up`, `attention.key_length`, `attention.sliding_window`) compute what
    the HF directory computes."""
    spec = FAMILIES[name]
    g, h = load_model(str(tiny(spec, "gguf"))), load_model(str(tiny(spec, "hf")))
    assert (g.config.qk_norm, g.config.sliding_layers, g.config.head_dim, g.config.rope_dims) == (
        h.config.qk_norm, h.config.sliding_layers, h.config.head_dim, h.config.rope_dims)
    np.testing.assert_allclose(g.config.rope_factors, h.config.rope_factors, rtol=1e-6)
    np.testing.assert_allclose(forward_logits(import_model(g), g.weights, TOKENS),
                               forward_logits(import_model(h), h.weights, TOKENS), rtol=1e-5, atol=1e-5)


def test_ir_names_the_family_features(tiny: Callable[..., Path]) -> None:
    from llmc.ir.text import parse_module, print_module

    text = print_module(import_model(load_model(str(tiny(FAMILIES["phi3-gqa-partial-longrope-window5"], "hf")))))
    assert "<theta 10000.0, dims 8, mscale " in text and "factors [1.0, 1.5, 2.0, 4.0]" in text
    assert "window 5" in text
    assert print_module(parse_module(text)) == text
    qwen3 = print_module(import_model(load_model(str(tiny(FAMILIES["qwen3"], "hf")))))
    assert "llm.rms_norm %l0_q_heads, %blk_0_attn_q_norm" in qwen3


@pytest.mark.parametrize(("name", "old", "new", "message"), [
    ("phi3-gqa-partial-longrope-window5", "window 5 ", "window 0 ", "llm.attention: window must be positive, got 0"),
    ("phi3-gqa-partial-longrope-window5", "factors [1.0, 1.5, 2.0, 4.0]", "factors [1.0, 1.5]",
     "2 frequency factors for 4 rotating pairs"),
    ("phi3-gqa-partial-longrope-window5", "dims 8,", "dims 18,", "rotary dims 18 must be even and at most"),
    ("gemma2", "softcap 5.000000e+00", "softcap -5.000000e+00", "llm.attention: softcap must be positive"),
    ("qwen3moe-8x2-normalized", "top_k 2", "top_k 9", "llm.moe: top_k must be in 1..8 experts, got 9"),
], ids=["window", "factors", "rotary-dims", "softcap", "top-k"])
def test_family_verifiers_name_the_problem(tiny: Callable[..., Path], name: str, old: str, new: str,
                                           message: str) -> None:
    from llmc.errors import LlmcError
    from llmc.ir.text import parse_module, print_module, verify_module

    text = print_module(import_model(load_model(str(tiny(FAMILIES[name], "hf")))))
    assert old in text
    with pytest.raises(LlmcError, match="does not verify") as error:
        verify_module(parse_module(text.replace(old, new, 1)))
    assert message in str(error.value)


REFUSED = {
    "dynamic-rope": ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic' is not supported"),
    "llama-relu": ({"hidden_act": "relu"}, "activation 'relu' is not supported for llama"),
    "partial-rotary-zero": ({"partial_rotary_factor": 0.0}, "partial_rotary_factor must be in (0, 1]"),
    "llama3-no-factor": ({"rope_scaling": {"rope_type": "llama3", "low_freq_factor": 1.0}}, "factor must be a number"),
    "bad-layer-types": ({"architectures": ["MistralForCausalLM"], "model_type": "mistral",  # (Llama's unread)
                         "layer_types": ["sliding_attention"], "sliding_window": 4}, "layer_types must list 2"),
    "gemma3-multimodal": ({"architectures": ["Gemma3ForConditionalGeneration"]}, "unsupported architecture"),
}


@pytest.mark.parametrize("name", REFUSED)
def test_unsupported_configs_are_one_line(tiny: Callable[..., Path], tmp_path: Path, name: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    import json
    import shutil

    change, message = REFUSED[name]
    directory = shutil.copytree(tiny(TinySpec(), "hf"), tmp_path / name)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | change))
    assert main(["ir", str(directory)]) != 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err


MOE_SPARSE = TinySpec(arch="qwen3moe", experts=16, experts_used=2, ffn=24, tied=False)  # 3 tokens use at most 6 of 16


def test_compiled_moe_reads_only_the_chosen_experts(tiny: Callable[..., Path], artifact,  # noqa: F811
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The weight rows of the experts no token is routed to are overwritten with NaN in `weights.bin`:
    the compiled artifact's logits do not change (nothing reads them); poisoning one chosen expert does."""
    from llmc.driver import BackendOptions, run_phases, target_attr
    from llmc.ir import interpreter
    from llmc.package import weight_layout
    from llmc.passes.pipeline import CompileOptions

    tokens = [5, 17, 42]
    model = load_model(str(tiny(MOE_SPARSE, "hf")))
    chosen: list[set[int]] = []  # per layer, in the order the interpreter routes them
    route = interpreter.route
    monkeypatch.setattr(interpreter, "route", lambda *a: (r := route(*a), chosen.append(set(r[0].ravel().tolist())))[0])
    forward_logits(import_model(model), model.weights, tokens)
    assert len(chosen) == MOE_SPARSE.layers and all(len(c) < MOE_SPARSE.experts for c in chosen)

    directory = artifact(MOE_SPARSE, form="hf")
    options = CompileOptions(prefill_chunk=4, max_seq=32, kv_type="f32")
    layout = weight_layout(run_phases(model, options, "lower", None, lambda _: None, target_attr(BackendOptions())))
    clean = Session(directory).feed(tokens)
    weights = (directory / "weights.bin").read_bytes()

    def poisoned(experts_of_layer: Callable[[int], set[int]]) -> np.ndarray:
        data = np.frombuffer(weights, np.uint8).copy()
        for layer in range(MOE_SPARSE.layers):
            for kind in ("gate", "up", "down"):
                offset, wtype = layout.entries[f"blk.{layer}.ffn_{kind}_exps"]
                assert wtype.storage.value == "f32" and wtype.layout.value == "stored"
                rows = wtype.shape[0] // MOE_SPARSE.experts
                matrix = data[offset: offset + wtype.nbytes].view(np.float32).reshape(MOE_SPARSE.experts, rows, -1)
                matrix[sorted(experts_of_layer(layer))] = np.nan
        (directory / "weights.bin").write_bytes(data.tobytes())
        try:
            return Session(directory, check_files=False).feed(tokens)
        finally:
            (directory / "weights.bin").write_bytes(weights)

    unused = poisoned(lambda layer: set(range(MOE_SPARSE.experts)) - chosen[layer])
    np.testing.assert_array_equal(unused, clean)
    assert np.isnan(poisoned(lambda layer: {min(chosen[layer])} if layer == 0 else set())).all()


@pytest.mark.parametrize("quant", ["q8_0", "q4_k"])
def test_compiled_moe_with_quantized_experts_matches_the_quantize_stage(tiny: Callable[..., Path], artifact,  # noqa: F811
                                                                        quant: str) -> None:
    """Experts stored as `--quant` (rows dequantized from the packed layout in the kernel) against the
    interpreter on the same quantized weights."""
    from test_compile import _stage_logits

    spec = TinySpec(arch="mixtral", experts=4, experts_used=2, hidden=64, ffn=256, head_dim=16, tied=False)
    session = Session(artifact(spec, form="hf", quant=quant, compute="a32"))
    logits = teacher_forced(lambda chunk, start: session.feed(chunk), COMPILE_TOKENS)
    _close(logits, _stage_logits(tiny, spec, COMPILE_TOKENS, form="hf", quant=quant, compute="a32"))


def test_moe_on_cuda_is_one_line(tiny: Callable[..., Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The CUDA backend has no mixture-of-experts kernel yet: compiling for it says so in one line."""
    assert main(["compile", str(tiny(MOE_SPARSE, "hf")), "--target", "cuda", "-o", str(tmp_path / "a")]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "llmc: error: target cuda has no kernel for llm.moe (mixture of experts); use --target cpu"


# configs as older checkpoints or other writers leave them: what is absent takes transformers' defaults
CONFIG_VARIANTS = {
    "gemma3-legacy-rope": ("gemma3-linear-global", {"rope_theta": 1e6, "rope_scaling": {"rope_type": "linear",
                                                                                        "factor": 8.0}},
                           ["rope_parameters"]),  # the sliding layers' base: 10000 without rope_local_base_freq
    "gemma2-defaults": ("gemma2", {}, ["attn_logit_softcapping", "final_logit_softcapping", "query_pre_attn_scalar",
                                       "sliding_window", "layer_types"]),  # 50, 30, 256, 4096, alternating
    "qwen3moe-window": ("qwen3moe-8x2-normalized", {"use_sliding_window": True, "sliding_window": 4,
                                                    "max_window_layers": 2}, []),  # every layer's, as transformers
}


@pytest.mark.reference
@pytest.mark.parametrize("name", CONFIG_VARIANTS)
def test_config_defaults_follow_transformers(tiny: Callable[..., Path], tmp_path: Path, name: str) -> None:
    import json
    import shutil

    pytest.importorskip("transformers")
    from llmc.frontend.reference import reference_logits

    family, change, drop = CONFIG_VARIANTS[name]
    directory = shutil.copytree(tiny(FAMILIES[family], "hf"), tmp_path / name)
    config = json.loads((directory / "config.json").read_text()) | change
    (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k not in drop}))
    _assert_close_to_reference(_logits(directory), reference_logits(directory, TOKENS))


def test_longrope_caps_the_context_at_the_original(tiny: Callable[..., Path]) -> None:
    """LongRoPE's short factors hold up to `original_max_position_embeddings`: the artifact's context stops
    there (the long factors, for longer ones, are not supported yet)."""
    spec = FAMILIES["phi3-gqa-partial-longrope-window5"]
    assert spec.context_length == 128
    assert load_model(str(tiny(spec, "hf"))).config.context_length == 64


def test_the_experts_router_stays_f32(tiny: Callable[..., Path], tmp_path: Path) -> None:
    """As llama.cpp's quantizer: top-k routing is discontinuous, so `--quant` leaves `ffn_gate_inp` f32."""
    out = tmp_path / "moe.mlir"
    assert main(["compile", str(tiny(MOE_SPARSE, "hf")), "--quant", "q8_0", "--compile-to", "quantize",
                 "-o", str(out)]) == 0
    text = out.read_text()
    assert "@blk.0.ffn_gate_inp f32 :" in text and "@blk.0.attn_q q8_0 :" in text
