"""The quantize phase (storage and compute choices, from the target) and the group phase (fused ops)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import pytest
from numerics import assert_model_reordered
from tiny_models import TinySpec, random_weights, write_gguf

from llmc.backends.cpu.target import cpu_target
from llmc.cli import main
from llmc.errors import LlmcError, UsageError
from llmc.frontend import import_model, load_model
from llmc.ir import find_function, llm, tgt
from llmc.ir.formats import Storage
from llmc.ir.interpreter import KVCache, forward_logits, run
from llmc.ir.text import parse_module, print_module
from llmc.passes.pipeline import CompileOptions, run_phase
from llmc.passes.quantize import QuantizePass

_PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
MIXED = TinySpec(hidden=64, heads=2, kv_heads=1, head_dim=32, ffn=128, gguf_storage=(
    ("token_embd", "q8_0"), ("attn_q", "q4_1"), ("attn_k", "q4_0"), ("attn_v", "q8_0"), ("attn_output", "q5_0"),
    ("ffn_gate", "q5_1"), ("ffn_up", "q4_1"), ("ffn_down", "f16")))
FLOAT = TinySpec(hidden=64, heads=2, kv_heads=1, head_dim=32, ffn=128)
TOKENS = [5, 17, 42, 100, 150, 7, 9, 11]


def quantized(path: Path, cpu: str = "native", **options) -> tuple:
    model = load_model(str(path))
    module = import_model(model)
    module.attributes[tgt.TARGET] = cpu_target(cpu)
    for phase in ("import", "optimize", "quantize"):
        run_phase(module, phase, options=CompileOptions(**options))
    return model, module


def storages(module) -> dict[str, Storage]:
    return {op.sym_name: op.storage.data for op in module.walk() if isinstance(op, llm.WeightOp)}


def modes(module) -> list[llm.Compute]:
    return [op.mode for op in module.walk() if isinstance(op, (llm.MatmulOp, llm.LogitsOp))]


def test_gguf_types_are_kept_and_integer_weights_compute_a16(tiny: Callable[..., Path]) -> None:
    _, module = quantized(tiny(MIXED, "gguf"), "x86-64-v3")
    s = storages(module)
    assert s["blk.0.attn_q"] is Storage.Q4_1 and s["blk.1.attn_output"] is Storage.Q5_0
    assert s["token_embd"] is Storage.Q8_0 and s["blk.0.ffn_down"] is Storage.F16 and s["output_norm"] is Storage.F32
    by_weight = {op.weight.owner.sym_name: op.mode for op in module.walk() if isinstance(op, (llm.MatmulOp, llm.LogitsOp))}
    # auto: a16 costs decode 35% on AVX2's integer dot products, within the budget: every integer weight
    assert by_weight["blk.0.attn_q"] is llm.Compute.A16 and by_weight["token_embd"] is llm.Compute.A16
    assert by_weight["blk.0.ffn_down"] is llm.Compute.A32  # f16 weights: float activations


@pytest.mark.parametrize(("cpu", "chosen"), [
    ("sapphirerapids", {llm.Compute.A16}),  # a16 on AMX tiles too: prefill 1.3× a8's, within the budget
    ("x86-64-v3", {llm.Compute.A16}), ("x86-64", {llm.Compute.A32})])
def test_the_default_mode_follows_the_targets_integer_dot_product(tiny, cpu: str, chosen: set) -> None:
    _, module = quantized(tiny(MIXED, "gguf"), cpu)
    integer = [m for m, op in zip(modes(module), (o for o in module.walk() if isinstance(o, (llm.MatmulOp, llm.LogitsOp))))
               if not op.weight.owner.storage.data.is_float]
    assert integer and set(integer) == chosen


def test_compute_can_be_forced_where_the_weights_allow(tiny) -> None:
    _, a32 = quantized(tiny(MIXED, "gguf"), compute="a32")
    assert set(modes(a32)) == {llm.Compute.A32}
    _, a8 = quantized(tiny(FLOAT, "gguf"), compute="a8")  # float weights: a8 is impossible, a32 it stays
    assert set(modes(a8)) == {llm.Compute.A32}
    with pytest.raises(UsageError, match="--compute must be one of"):
        quantized(tiny(MIXED, "gguf"), compute="a4")


def test_float_sources_take_quant_with_llama_cpps_policy(tiny) -> None:
    path = tiny(FLOAT, "hf")
    _, q8 = quantized(path, quant="q8_0")
    s = storages(q8)
    assert s["blk.0.attn_q"] is Storage.Q8_0 and s["token_embd"] is Storage.Q8_0
    assert s["blk.0.attn_norm"] is Storage.F32 and s["output_norm"] is Storage.F32
    _, q4 = quantized(path, quant="q4_0")
    assert storages(q4)["blk.0.ffn_down"] is Storage.Q4_0
    assert storages(q4)["token_embd"] is Storage.Q8_0  # the embedding and LM head stay at q8_0 or above
    _, asked = quantized(path, quant="q4_0", quant_output="q4_1")
    assert storages(asked)["token_embd"] is Storage.Q4_1
    _, f16 = quantized(path, quant="f16")
    assert storages(f16)["blk.0.attn_q"] is Storage.F16 and storages(f16)["token_embd"] is Storage.F16


def test_rows_that_are_not_whole_blocks_fall_back(tiny) -> None:
    """q4_k needs rows of 256: 64-wide rows fall back to q5_0, as llama.cpp does."""
    _, module = quantized(tiny(FLOAT, "hf"), quant="q4_k")
    assert storages(module)["blk.0.attn_q"] is Storage.Q5_0
    odd = TinySpec(hidden=24, heads=3, kv_heads=1, head_dim=8, ffn=48)
    _, module = quantized(tiny(odd, "hf"), quant="q4_0")
    assert storages(module)["blk.0.attn_q"] is Storage.F32  # 24 is no multiple of 32: stays as it was


def test_quantized_tensors_are_requantized_only_when_asked(tiny) -> None:
    path = tiny(MIXED, "gguf")
    _, kept = quantized(path, quant="q8_0")
    assert storages(kept)["blk.0.attn_q"] is Storage.Q4_1  # already quantized
    assert storages(kept)["blk.0.ffn_down"] is Storage.Q8_0  # f16: a float tensor, so --quant applies
    _, asked = quantized(path, quant="q8_0", requantize=True)
    assert storages(asked)["blk.0.attn_q"] is Storage.Q8_0
    _, f32 = quantized(path, quant="f32")  # dequantizing is always allowed
    assert set(storages(f32).values()) == {Storage.F32}


def test_storage_for_is_the_policy() -> None:
    p = QuantizePass(quant="int4-g128")
    assert p.storage_for("blk.0.attn_q", Storage.F32, (576, 576)) is Storage.INT4_G32  # 576 % 128 != 0
    assert p.storage_for("blk.0.ffn_down", Storage.F32, (576, 1536)) is Storage.INT4_G128
    assert p.storage_for("output", Storage.BF16, (49152, 576), output=True) is Storage.Q8_0
    assert p.storage_for("blk.0.attn_norm", Storage.F16, (576,)) is Storage.F32
    with pytest.raises(UsageError, match="--quant: unknown storage type 'q3'"):
        QuantizePass(quant="q3").storage_for("x", Storage.F32, (32, 32))


def test_the_llm_interpreter_computes_with_the_chosen_types(tiny) -> None:
    """After quantize, the graph's weights are the quantized ones and a8 activations go through int8."""
    model, f32 = quantized(tiny(FLOAT, "gguf"))
    _, q8 = quantized(tiny(FLOAT, "hf"), quant="q8_0", compute="a8")
    _, q8_a32 = quantized(tiny(FLOAT, "hf"), quant="q8_0", compute="a32")
    full = forward_logits(f32, model.weights, TOKENS)
    hf_model = load_model(str(tiny(FLOAT, "hf")))
    a8 = forward_logits(q8, hf_model.weights, TOKENS)
    a32 = forward_logits(q8_a32, hf_model.weights, TOKENS)
    assert 0 < np.abs(a32 - full).max() < 0.05 * np.abs(full).max()
    assert np.abs(a8 - a32).max() > 0  # int8 activations change the numbers …
    assert (a8.argmax(-1) == full.argmax(-1)).mean() >= 0.75  # … but not the predictions much


def test_quantize_needs_a_target(tiny) -> None:
    module = import_model(load_model(str(tiny(MIXED, "gguf"))))
    for phase in ("import", "optimize"):
        run_phase(module, phase)
    with pytest.raises(LlmcError, match="no tgt.target"):
        run_phase(module, "quantize")


def test_compile_to_quantize_shows_every_choice(tiny, capsys) -> None:
    assert main(["compile", str(tiny(FLOAT, "hf")), "--quant", "q4_1", "--compile-to", "quantize"]) == 0
    captured = capsys.readouterr()
    assert "llm.weight @blk.0.attn_q q4_1" in captured.out and "compute a16" in captured.out  # calibrated: auto
    assert "q4_1 ×" in captured.err and "a16 ×" in captured.err  # the progress line summarizes
    parse_module(captured.out)  # and the IR parses back
    assert main(["compile", str(tiny(FLOAT, "hf")), "--quant", "q9", "--compile-to", "quantize"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--quant: unknown storage type 'q9'" in err


def test_a_type_llmc_cannot_compute_is_one_line_naming_the_tensor(tmp_path, capsys) -> None:
    spec = TinySpec(hidden=256, heads=2, kv_heads=1, head_dim=128, ffn=256, layers=1)
    path = write_gguf(spec, random_weights(spec), tmp_path / "m.gguf")
    # retag one f32 tensor as Q2_K (rows of 256: whole blocks; its bytes are more than enough)
    data = bytearray(path.read_bytes())
    name = b"blk.0.ffn_up.weight"
    type_at = data.find(name) + len(name) + 4 + 2 * 8  # after the name: dimension count, two dimensions
    data[type_at : type_at + 4] = int(gguf.GGMLQuantizationType.Q2_K).to_bytes(4, "little")
    path.write_bytes(bytes(data))
    assert main(["compile", str(path), "--compile-to", "import"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "tensor 'blk.0.ffn_up.weight' has type Q2_K, which llmc cannot compute" in err


# group -----------------------------------------------------------------------------

def grouped(path: Path, **options):
    model, module = quantized(path, **options)
    run_phase(module, "split", options=CompileOptions(max_seq=32, prefill_chunk=8))
    before = module.clone()
    run_phase(module, "group")
    return model, before, module


def test_group_rewrites_chains_into_fused_ops(tiny) -> None:
    _, _, a8 = grouped(tiny(MIXED, "gguf"), compute="a8")
    text = print_module(a8)
    decode = find_function(a8, "decode")
    kinds = [op.name for op in decode.body.block.ops]
    assert "llm.mul" not in kinds and "llm.silu" not in kinds and "llm.add" not in kinds and "llm.rope" not in kinds
    assert kinds.count("llm.swiglu") == 2 and "rope <theta 10000.0>" in text
    entries = sum(op.name == "func.func" for op in a8.ops)  # prefill, prefill_kv, decode, score, verify
    assert entries == 5 and text.count("residual %") == 2 * 2 * entries  # attention output and down projection, 2 layers
    assert kinds.count("llm.rms_norm") == 2 * 2 + 1  # read by a8 projections: they stay, to write int8 rows once
    _, _, a32 = grouped(tiny(MIXED, "gguf"), compute="a32")
    kinds = [op.name for op in find_function(a32, "decode").body.block.ops]
    assert "llm.rms_norm" not in kinds  # fused into the a32 projections that read them
    assert "norm %" in print_module(a32)


@pytest.mark.parametrize("compute", ["auto", "a32"])
def test_grouped_ir_computes_the_same_logits(tiny, compute: str) -> None:
    model, before, after = grouped(tiny(MIXED, "gguf"), compute=compute)
    for name in ("prefill", "decode"):
        results = []
        for module in (before, after):
            fn = find_function(module, name)
            cache = KVCache.for_type(fn.function_type.inputs.data[2])
            tokens = np.array(TOKENS[:1] if name == "decode" else TOKENS, np.int32)
            (logits,) = run(fn, model.weights, tokens, np.arange(tokens.size, dtype=np.int32), cache)
            results.append(logits)
        assert_model_reordered(results[1], results[0], MIXED)  # fused ops: the same sums, in another order


PARALLEL_RESIDUAL = """\
builtin.module attributes {llm.phase = "split", tgt.target = #tgt.target<cpu, "x86_64", "x86-64-v3", ["avx2"]>} {
  func.func @decode(%tokens: tensor<1xi32>, %pos: tensor<1xi32>, %kv: !llm.kv_cache<1x1x8x8xf32>) -> tensor<1x40xf32> attributes {llm.max_tokens = 1 : i64, llm.stage = "decode"} {
    %e = llm.weight @token_embd f32 : tensor<40x32xf32>
    %x = llm.embedding %tokens, %e : (tensor<1xi32>, tensor<40x32xf32>) -> tensor<1x32xf32>
    %g = llm.weight @n f32 : tensor<32xf32>
    %h = llm.rms_norm %x, %g eps 1.000000e-05 : tensor<1x32xf32>, tensor<32xf32>
    %w = llm.weight @w f32 : tensor<32x32xf32>
    %m = llm.matmul %h, %w compute a32 : (tensor<1x32xf32>, tensor<32x32xf32>) -> tensor<1x32xf32>
    %y = llm.add %x, %m : tensor<1x32xf32>
    %l = llm.logits %y, %e compute a32 : (tensor<1x40xf32>, tensor<40x32xf32>) -> tensor<1x40xf32>
    func.return %l : tensor<1x40xf32>
  }
}
""".replace("(tensor<1x40xf32>, tensor<40x32xf32>)", "(tensor<1x32xf32>, tensor<40x32xf32>)")


def test_a_matmul_never_updates_in_place_the_rows_it_reads() -> None:
    """`x + matmul(rms_norm(x), w)` (a parallel-residual block): the norm fuses into the
    matmul, which then reads x, so the add cannot become an in-place accumulate into x."""
    from llmc.passes.pipeline import run_passes
    from llmc.passes.registry import get_pass

    module = parse_module(PARALLEL_RESIDUAL)
    run_passes(module, [get_pass(p) for p in ("group", "lower", "pack", "plan-memory", "verify")])
    text = print_module(module)
    assert "tgt.add" in text and "accumulate" not in text and "norm %" in text
