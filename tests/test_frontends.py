"""The GGUF and Hugging Face frontends: same weights → same IR, quantized storage carried
through, the same tokenizer, lazy weights, and one clear error per malformed input."""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from tiny_models import (
    CHAT_TEMPLATE,
    SPECIAL_TOKENS,
    VOCAB_SIZE,
    TinySpec,
    random_weights,
    vocabulary,
    write_gguf,
    write_hf,
    write_vocab_gguf,
)
from tokenizers import Tokenizer

from llmc.cli import main
from llmc.errors import ModelFormatError
from llmc.frontend import import_model, load_model
from llmc.ir.interpreter import forward_logits
from llmc.ir.text import parse_module, print_module

# Float32 shapes the frontends claim: both must import each to the same graph.
SPECS = {
    "gqa": TinySpec(),
    "mha": TinySpec(heads=4, kv_heads=4),
    "heads3-kv1": TinySpec(hidden=24, heads=3, kv_heads=1),
    "heads5-kv5": TinySpec(hidden=40, heads=5, kv_heads=5),
    "wide-heads": TinySpec(hidden=32, heads=4, kv_heads=2, head_dim=16),  # heads*head_dim != hidden
    "untied": TinySpec(tied=False),
    "qwen2-bias": TinySpec(arch="qwen2"),
}

# Block-quantized GGUF files need rows (input dims) that are multiples of 32.
_Q = dict(hidden=64, ffn=64, head_dim=16, heads=4, kv_heads=2)
_PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
QUANT_SPECS = {
    "smollm-like-q4_1": TinySpec(**_Q, gguf_storage=(("token_embd", "q8_0"), *((k, "q4_1") for k in _PROJ))),
    "all-q4_0": TinySpec(**_Q, gguf_storage=(("token_embd", "q4_0"), *((k, "q4_0") for k in _PROJ))),
    "all-q8_0": TinySpec(**_Q, gguf_storage=(("token_embd", "q8_0"), *((k, "q8_0") for k in _PROJ))),
    "f16-mix": TinySpec(
        **_Q, gguf_storage=(("token_embd", "f16"), ("attn_q", "f16"), ("attn_k", "q8_0"), ("ffn_down", "f16"), ("attn_norm", "f16"))
    ),
    "untied-q8_0-head": TinySpec(**_Q, tied=False, gguf_storage=(("output", "q8_0"), ("attn_v", "q4_1"), ("ffn_up", "q4_0"))),
    "qwen2-bias-q4_1": TinySpec(**_Q, arch="qwen2", gguf_storage=(("attn_q", "q4_1"), ("attn_k", "q4_1"), ("attn_v", "q8_0"))),
}

TOKENS = [0, 1, 17, 42, 100, 150, 200, VOCAB_SIZE - 1, 5, 5, 5, 77]


def _ir(path: Path) -> str:
    return print_module(import_model(load_model(str(path))))


# ------------------------------------------------------------ GGUF == HF


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_gguf_and_hf_import_to_the_same_ir(tiny: Callable[..., Path], spec: TinySpec) -> None:
    g, h = load_model(str(tiny(spec, "gguf"))), load_model(str(tiny(spec, "hf")))

    text = print_module(import_model(g))
    assert text == print_module(import_model(h))
    assert f"heads = {spec.heads}" in text or f"x{spec.heads}x{spec.head_dim}xf32>" in text
    assert ("bias %blk_0_attn_q_bias" in text) == spec.qkv_bias
    assert ("@output " in text) == (not spec.tied)

    # the same hyper-parameters (the GGUF writer always declares `llama`; eps is stored as f32 in GGUF)
    skip = {"rms_eps"} | ({"arch"} if spec.arch != "llama" else set())
    gc, hc = dataclasses.asdict(g.config), dataclasses.asdict(h.config)
    assert {k: v for k, v in gc.items() if k not in skip} == {k: v for k, v in hc.items() if k not in skip}
    assert np.float32(g.config.rms_eps) == np.float32(h.config.rms_eps) == np.float32(spec.rms_eps)
    c = h.config
    assert (c.hidden, c.layers, c.heads, c.kv_heads, c.head_dim, c.ffn, c.vocab_size) == (
        spec.hidden, spec.layers, spec.heads, spec.kv_heads, spec.head_dim, spec.ffn, VOCAB_SIZE
    )
    assert (c.tied_embeddings, c.qkv_bias, c.arch) == (spec.tied, spec.qkv_bias, spec.arch)


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_gguf_and_hf_weights_are_equal_after_unpermuting(tiny: Callable[..., Path], spec: TinySpec) -> None:
    """Structural IR equality says nothing about values: the GGUF frontend must undo
    llama.cpp's Q/K row permutation (biases included) exactly."""
    g, h = load_model(str(tiny(spec, "gguf"))), load_model(str(tiny(spec, "hf")))
    assert sorted(g.weights) == sorted(h.weights)
    for name in h.weights:
        assert g.weights[name].shape == h.weights[name].shape, name
        np.testing.assert_array_equal(g.weights.f32(name), h.weights.f32(name), err_msg=name)


# ------------------------------------------------------------ quantized GGUF


@pytest.mark.parametrize("spec", QUANT_SPECS.values(), ids=QUANT_SPECS.keys())
def test_quantized_gguf_keeps_storage_and_matches_its_float_twin(tiny: Callable[..., Path], spec: TinySpec) -> None:
    model = load_model(str(tiny(spec, "gguf")))
    module = import_model(model)
    text = print_module(module)
    storage = dict(spec.gguf_storage)
    for kind, fmt in storage.items():
        sym = kind if kind in ("token_embd", "output") else f"blk.0.{kind}"
        assert f"@{sym} {fmt} :" in text, f"@{sym} should be stored as {fmt}"
    for kind in ("attn_norm", "ffn_norm", *_PROJ):
        if kind not in storage:
            assert f"@blk.1.{kind} f32 :" in text
    assert print_module(parse_module(text)) == text  # the storage attribute round-trips

    twin = load_model(str(tiny(spec, "hf-as-gguf")))
    expected = forward_logits(import_model(twin), twin.weights, TOKENS)
    got = forward_logits(module, model.weights, TOKENS)
    assert got.shape == (len(TOKENS), VOCAB_SIZE)
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)


# ------------------------------------------------------------ tokenizer

TEXTS = {
    "space-space-digits": "  2018",
    "digits": "2018",
    "words": "Hello there, the cat apes",
    "chat": "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "unicode": "héllo wörld 😀 ß",
    "whitespace": "tab\there  \n\n end ",
    "empty": "",
}


@pytest.mark.parametrize("text", TEXTS.values(), ids=TEXTS.keys())
def test_gguf_tokenizer_matches_tokenizer_json(tiny: Callable[..., Path], text: str) -> None:
    spec = SPECS["gqa"]
    hf_dir = tiny(spec, "hf")
    from_gguf = load_model(str(tiny(spec, "gguf"))).tokenizer
    from_hf = load_model(str(hf_dir)).tokenizer
    original = Tokenizer.from_file(str(hf_dir / "tokenizer.json")).encode(text, add_special_tokens=False).ids

    ids = from_gguf.encode(text)
    assert ids == from_hf.encode(text) == original
    assert from_gguf.decode(ids) == text
    assert from_hf.decode(from_hf.encode(text)) == text


def test_tokenizer_splits_digits_and_keeps_special_tokens_whole(tiny: Callable[..., Path]) -> None:
    tokens, _ = vocabulary()
    spec = SPECS["gqa"]
    for path in (tiny(spec, "gguf"), tiny(spec, "hf")):
        t = load_model(str(path)).tokenizer
        assert [t.decode([i]) for i in t.encode("2018")] == ["2", "0", "1", "8"]
        assert len(t.encode("  2018")) == 6  # 'Ġ', 'Ġ', then one token per digit ('Ġ2' is in the vocabulary)
        for special in SPECIAL_TOKENS:
            assert t.encode(special) == [tokens.index(special)]
        assert t.encode("<|im_end|>x") == [tokens.index("<|im_end|>"), tokens.index("x")]
        assert t.chat_template == CHAT_TEMPLATE
        assert (t.bos_id, t.eos_id) == (tokens.index("<|endoftext|>"), tokens.index("<|im_end|>"))
        assert t.add_bos is False


def test_gguf_tokenizer_follows_the_declared_pre_tokenizer(tmp_path: Path) -> None:
    """`tokenizer.ggml.pre = gpt2` does not split digits, so ' 2' merges into 'Ġ2'."""
    tokens, _ = vocabulary()
    spec = SPECS["gqa"]
    plain = load_model(str(write_gguf(spec, random_weights(spec), tmp_path / "gpt2.gguf", pre="gpt2"))).tokenizer
    assert plain.encode("  2018") == [tokens.index(t) for t in ("Ġ", "Ġ2", "0", "1", "8")]

    weird = load_model(str(write_gguf(spec, random_weights(spec), tmp_path / "weird.gguf", pre="no-such-pre")))
    with pytest.raises(ModelFormatError, match="weird.gguf.*no-such-pre"):
        weird.tokenizer


def test_llmc_tokenize_prints_what_the_original_tokenizer_gives(tiny: Callable[..., Path], tmp_path: Path,
                                                                 capsys) -> None:
    """`llmc tokenize` on a GGUF file, a vocabulary-only GGUF, an HF directory and an artifact: ids equal
    to the original tokenizer.json's, pieces as llama-tokenize prints them, `--jsonl` line by line."""
    spec = SPECS["gqa"]
    hf_dir = tiny(spec, "hf")
    original = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    artifact = tmp_path / "artifact"
    assert main(["compile", str(tiny(spec, "gguf")), "-o", str(artifact), "--max-seq", "16"]) == 0
    vocab_only = write_vocab_gguf(tmp_path / "vocab.gguf")
    capsys.readouterr()
    texts = [t for t in TEXTS.values() if t]
    for model in (tiny(spec, "gguf"), vocab_only, hf_dir, artifact):
        for text in texts:
            want = original.encode(text, add_special_tokens=False).ids
            assert main(["tokenize", str(model), text, "--ids"]) == 0
            assert json.loads(capsys.readouterr().out) == want
        assert main(["tokenize", str(model), "Hello 2018"]) == 0
        lines = capsys.readouterr().out.splitlines()
        ids = original.encode("Hello 2018", add_special_tokens=False).ids
        assert lines == [f"{i:6d} -> {original.decode([i])!r}" for i in ids]
    jsonl = tmp_path / "texts.jsonl"
    jsonl.write_text("".join(json.dumps(t) + "\n" for t in texts) + "\n", encoding="utf-8-sig")  # (a BOM: dropped)
    assert main(["tokenize", str(vocab_only), "--jsonl", str(jsonl)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [json.loads(line) for line in out] == [original.encode(t, add_special_tokens=False).ids for t in texts]
    with_bos = write_vocab_gguf(tmp_path / "bos.gguf", add_bos=True)
    assert main(["tokenize", str(with_bos), "hi", "--ids"]) == 0
    assert json.loads(capsys.readouterr().out) == [0, *original.encode("hi").ids]
    assert main(["tokenize", str(with_bos), "hi", "--ids", "--no-bos"]) == 0
    assert json.loads(capsys.readouterr().out) == original.encode("hi").ids


def test_llmc_tokenize_errors_are_one_line(tiny: Callable[..., Path], tmp_path: Path, capsys) -> None:
    vocab_only = write_vocab_gguf(tmp_path / "vocab.gguf")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('"fine"\n{"not": "a string"}\n', encoding="utf-8")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('"fine"\n"unterminated\n', encoding="utf-8")
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'"caf\xe9"\n')
    gap = tmp_path / "gap.jsonl"
    gap.write_text('"a"\n\n"b"\n', encoding="utf-8")  # (skipped, "b"'s ids would be on line 2)
    weird = write_gguf(SPECS["gqa"], random_weights(SPECS["gqa"]), tmp_path / "weird.gguf", pre="no-such-pre")
    for argv, message in (
        ([str(vocab_only)], "give the TEXT to tokenize, or --jsonl FILE"),
        ([str(vocab_only), "x", "--jsonl", str(bad)], "not both"),
        ([str(vocab_only), "--jsonl", str(bad)], "bad.jsonl:2: a JSON string per line, got dict"),
        ([str(vocab_only), "--jsonl", str(broken)], "broken.jsonl:2: not JSON"),
        ([str(vocab_only), "--jsonl", str(latin)], "it is not UTF-8 (character 3 is byte 0xe9)"),
        ([str(vocab_only), "--jsonl", str(gap)], "gap.jsonl:2: an empty line"),
        ([str(vocab_only), "--jsonl", "/dev/zero"], "/dev/zero:1: a line longer than"),  # (was read without end)
        ([str(vocab_only), "--jsonl", str(tmp_path / "missing.jsonl")], "cannot read"),
        ([str(weird), "x"], "unsupported pre-tokenizer 'no-such-pre'"),
        ([str(tmp_path / "nothing.gguf"), "x"], "no such model file"),
    ):
        assert main(["tokenize", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (argv, err)
    assert main(["compile", str(vocab_only), "--compile-to", "import"]) == 2  # no tensors: nothing to compile
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no tensors (a vocabulary-only GGUF?)" in err


# ------------------------------------------------------------ lazy weights


def _mapped_file(a: np.ndarray) -> Path | None:
    """The file an array's memory is mapped from, following `.base`; None for heap memory."""
    while a is not None:
        if isinstance(a, np.memmap) and getattr(a, "filename", None):
            return Path(a.filename)
        a = a.base
    return None


@pytest.mark.parametrize("form", ["gguf", "hf"])
def test_weights_are_views_of_the_mapped_file(tiny: Callable[..., Path], form: str) -> None:
    spec = QUANT_SPECS["smollm-like-q4_1"] if form == "gguf" else SPECS["gqa"]
    path = tiny(spec, form)
    model = load_model(str(path))
    expected_file = path if form == "gguf" else path / "model.safetensors"
    assert len(model.weights) > 0
    for name, w in model.weights.items():
        assert not w.data.flags.owndata, name
        assert _mapped_file(w.data) == expected_file.resolve() or _mapped_file(w.data) == expected_file, name


@pytest.mark.parametrize("form", ["gguf", "hf"])
def test_weights_are_read_when_used_not_when_loaded(tmp_path: Path, form: str) -> None:
    """Overwrite a tensor's bytes after `load_model`: an eager reader would not see it."""
    spec = SPECS["gqa"]
    weights = random_weights(spec)
    path = write_gguf(spec, weights, tmp_path / "m.gguf") if form == "gguf" else write_hf(spec, weights, tmp_path / "m")
    file = path if form == "gguf" else path / "model.safetensors"
    model = load_model(str(path))
    import_model(model)

    stored = weights["model.norm.weight"].tobytes()
    blob = file.read_bytes()
    assert blob.count(stored) == 1
    with open(file, "r+b") as f:
        f.seek(blob.index(stored))
        f.write(np.full(spec.hidden, 7.0, np.float32).tobytes())
    np.testing.assert_array_equal(model.weights.f32("output_norm"), np.full(spec.hidden, 7.0, np.float32))


# ------------------------------------------------------------ malformed input

_BASE = TinySpec()


def _weights_without(hf_name: str) -> dict[str, np.ndarray]:
    w = random_weights(_BASE)
    del w[hf_name]
    return w


def _falcon(tmp: Path) -> Path:
    writer = gguf.GGUFWriter(str(tmp / "falcon.gguf"), "falcon")
    writer.add_block_count(1)
    writer.add_embedding_length(8)
    writer.add_head_count(2)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp / "falcon.gguf"


def _missing_tensor(tmp: Path) -> Path:
    return write_gguf(_BASE, _weights_without("model.layers.1.mlp.up_proj.weight"), tmp / "missing.gguf")


def _wrong_shape(tmp: Path) -> Path:
    w = random_weights(_BASE)
    w["model.layers.1.mlp.up_proj.weight"] = w["model.layers.1.mlp.up_proj.weight"][:32]
    return write_gguf(_BASE, w, tmp / "shape.gguf")


def _heads_do_not_divide(tmp: Path) -> Path:
    spec = TinySpec(heads=4, kv_heads=3)
    return write_gguf(spec, random_weights(spec), tmp / "heads.gguf")


def _bad_magic(tmp: Path) -> Path:
    good = write_gguf(_BASE, random_weights(_BASE), tmp / "good.gguf").read_bytes()
    (tmp / "magic.gguf").write_bytes(b"GGUX" + good[4:])
    return tmp / "magic.gguf"


def _truncated(keep: Callable[[int], int]) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        good = write_gguf(_BASE, random_weights(_BASE), tmp / "good.gguf").read_bytes()
        (tmp / "cut.gguf").write_bytes(good[: keep(len(good))])
        return tmp / "cut.gguf"

    return make


def _hf_with_config(change: Callable[[dict], None], name: str) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        d = write_hf(_BASE, random_weights(_BASE), tmp / name)
        config = json.loads((d / "config.json").read_text())
        change(config)
        (d / "config.json").write_text(json.dumps(config))
        return d

    return make


def _hf_without_config(tmp: Path) -> Path:
    d = write_hf(_BASE, random_weights(_BASE), tmp / "noconfig")
    (d / "config.json").unlink()
    return d


def _safetensors(blob: Callable[[bytes], bytes]) -> Callable[[Path], Path]:
    def make(tmp: Path) -> Path:
        d = write_hf(_BASE, random_weights(_BASE), tmp / "st")
        file = d / "model.safetensors"
        file.write_bytes(blob(file.read_bytes()))
        return file

    return make


def _not_a_model(tmp: Path) -> Path:
    (tmp / "notes.txt").write_text("not a model\n")
    return tmp / "notes.txt"


def _hf_extra_tensor(tmp: Path) -> Path:
    spec = TinySpec()
    weights = random_weights(spec) | {"model.layers.0.self_attn.o_proj.bias": np.zeros(spec.hidden, np.float32)}
    return write_hf(spec, weights, tmp / "o_proj_bias")


def _gguf_rope_scaling(tmp: Path) -> Path:
    path = write_gguf(TinySpec(), random_weights(TinySpec()), tmp / "scaled.gguf")
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(str(tmp / "scaled2.gguf"), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), value_type, sub_type)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)  # linear is supported; YaRN from GGUF is not yet
    writer.add_rope_scaling_factor(4.0)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return tmp / "scaled2.gguf"


# id → (make bad input under tmp_path, what must be in the message besides the file name)
BAD_INPUTS: dict[str, tuple[Callable[[Path], Path], str]] = {
    "gguf-arch-falcon": (_falcon, "falcon"),
    "gguf-missing-tensor": (_missing_tensor, "blk.1.ffn_up"),
    "gguf-wrong-shape": (_wrong_shape, "blk.1.ffn_up"),
    "gguf-heads-not-multiple-of-kv": (_heads_do_not_divide, "KV heads"),
    "gguf-bad-magic": (_bad_magic, "GGUF"),
    "gguf-truncated-in-magic": (_truncated(lambda n: 3), "GGUF"),
    "gguf-truncated-in-header": (_truncated(lambda n: 10), ""),
    "gguf-truncated-in-metadata": (_truncated(lambda n: 200), ""),
    "gguf-truncated-in-tensors": (_truncated(lambda n: n // 2), ""),
    "gguf-truncated-last-byte": (_truncated(lambda n: n - 1), ""),
    "hf-gpt2": (_hf_with_config(lambda c: c.update(architectures=["GPT2LMHeadModel"]), "gpt2"), "GPT2LMHeadModel"),
    "hf-heads-not-multiple-of-kv": (_hf_with_config(lambda c: c.update(num_key_value_heads=3), "kv3"), "KV heads"),
    "hf-no-config": (_hf_without_config, "config.json"),
    "safetensors-header-not-json": (_safetensors(lambda b: struct.pack("<Q", 5) + b"{abc}"), "JSON"),
    "safetensors-header-too-long": (_safetensors(lambda b: struct.pack("<Q", 10**12) + b[8:]), "header"),
    "safetensors-too-short": (_safetensors(lambda b: b[:5]), ""),
    "safetensors-data-cut": (_safetensors(lambda b: b[:-10]), "model.norm.weight"),
    "not-a-model-file": (_not_a_model, "not a GGUF file"),
    "hf-llama-attention-bias": (_hf_with_config(lambda c: c.update(attention_bias=True), "attn_bias"), "attention_bias"),
    "hf-llama-mlp-bias": (_hf_with_config(lambda c: c.update(mlp_bias=True), "mlp_bias"), "mlp_bias"),
    "hf-unsupported-tensor": (_hf_extra_tensor, "o_proj.bias"),
    "gguf-rope-scaling": (_gguf_rope_scaling, "RoPE scaling 'yarn' in a GGUF file is not supported yet"),
}


def _model_arg(bad: Path) -> str:
    """The MODEL argument that reaches a bad file: its directory for a safetensors file."""
    return str(bad.parent if bad.suffix == ".safetensors" else bad)


@pytest.mark.parametrize(("make", "detail"), BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_bad_input_raises_model_format_error_naming_the_file(tmp_path: Path, make: Callable[[Path], Path], detail: str) -> None:
    bad = make(tmp_path)
    with pytest.raises(ModelFormatError) as info:
        import_model(load_model(_model_arg(bad)))
    message = str(info.value)
    assert str(bad) in message
    assert detail in message
    assert "\n" not in message


@pytest.mark.parametrize(("make", "detail"), BAD_INPUTS.values(), ids=BAD_INPUTS.keys())
def test_cli_prints_one_line_for_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], make: Callable[[Path], Path], detail: str
) -> None:
    bad = make(tmp_path)
    model_arg = _model_arg(bad)
    assert main(["ir", model_arg]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1 and err.endswith("\n")
    assert err.startswith("llmc: error: ")
    assert bad.name in err and detail in err
    assert "Traceback" not in err

    for argv in (["ir", model_arg, "--debug"], ["--debug", "ir", model_arg]):
        with pytest.raises(ModelFormatError):
            main(argv)


def test_cli_unknown_model_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    assert main(["ir", "no-such-model"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert len(err.splitlines()) == 1
    assert err.startswith("llmc: error: ") and "no-such-model" in err and "known model names" in err
    assert "smollm2-135m" in err


def test_cli_prints_ir_of_a_good_model(tiny: Callable[..., Path], capsys: pytest.CaptureFixture[str]) -> None:
    path = tiny(QUANT_SPECS["smollm-like-q4_1"], "gguf")
    assert main(["ir", str(path)]) == 0
    out, err = capsys.readouterr()
    assert out.splitlines()[1:] == _ir(path).splitlines()[1:]  # the first line may carry phase attributes
    assert print_module(parse_module(out)) == out
    assert "@blk.0.attn_q q4_1" in out


def test_hf_config_without_tie_flag_is_untied(tmp_path: Path) -> None:
    """transformers' Llama and Qwen2 configs default to untied embeddings; so does llmc."""
    spec = TinySpec(arch="qwen2", tied=False)
    directory = write_hf(spec, random_weights(spec), tmp_path / "qwen2")
    config = json.loads((directory / "config.json").read_text())
    del config["tie_word_embeddings"]
    (directory / "config.json").write_text(json.dumps(config))
    model = load_model(str(directory))
    assert not model.config.tied_embeddings
    assert "llm.logits %final, %output" in print_module(import_model(model))


@pytest.mark.parametrize("text", ["héllo wörld 🙂 in 2018", "the cat\n\n  sat", "日本語のテキスト"])
def test_streamed_text_equals_the_whole_decode(tiny: Callable[..., Path], text: str) -> None:
    """Pieces come out only as complete UTF-8, and together they are the full text."""
    codec = load_model(str(tiny(TinySpec(), "gguf"))).tokenizer
    ids = codec.encode(text)
    pieces = list(codec.decode_stream(iter(ids)))
    assert "".join(pieces) == codec.decode(ids) == text
    assert not any("\ufffd" in piece for piece in pieces)
    assert len(pieces) > 1
