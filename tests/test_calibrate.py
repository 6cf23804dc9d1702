"""Calibration and `--compute auto`'s choice between `a8` and `a16` (issue 21), `llmc verify --per-layer`."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from hostile import hang_guard
from tiny_models import TinySpec

from llmc.backends.cpu import target as cpu
from llmc.backends.cpu.target import a16_cost, cpu_target
from llmc.cli import main
from llmc.frontend import import_model, load_model
from llmc.ir import find_function, llm, tgt
from llmc.ir.interpreter import KVCache, evaluate
from llmc.ir.text import parse_module, print_module
from llmc.passes import calibrate
from llmc.passes.calibrate import MAX_TOKENS, calibration_for, calibration_tokens, measure
from llmc.passes.pipeline import CompileOptions, run_phase
from llmc.passes.quantize import (
    CALIBRATED,
    DECODE_BUDGET,
    ERROR,
    PREFILL_BUDGET,
    choose_wider,
    summary,
    weight_bytes,
    weight_elements,
)

MIXED = TinySpec(hidden=64, heads=2, kv_heads=1, head_dim=32, ffn=128, gguf_storage=(
    ("token_embd", "q8_0"), ("attn_q", "q4_1"), ("attn_k", "q4_0"), ("attn_v", "q8_0"), ("attn_output", "q5_0"),
    ("ffn_gate", "q5_1"), ("ffn_up", "q4_1"), ("ffn_down", "f16")))
FLOAT = TinySpec(hidden=64, heads=2, kv_heads=1, head_dim=32, ffn=128)


def quantized(path: Path, cpu_name: str = "x86-64-v3", calibrate: bool = True, **options):
    model = load_model(str(path))
    module = import_model(model)
    module.attributes[tgt.TARGET] = cpu_target(cpu_name)
    options = CompileOptions(**options)
    for phase in ("import", "optimize"):
        run_phase(module, phase, options=options, weights=model.weights)
    tokens = calibration_for(model, options, module.attributes[tgt.TARGET]) if calibrate else []
    run_phase(module, "quantize", options=options, weights=model.weights, tokens=tokens)
    return model, module


def projections(module) -> list[llm.Projection]:
    return [op for op in find_function(module, "forward").walk() if isinstance(op, llm.Projection)]


def test_the_built_in_text_has_chat_in_the_models_template_and_plain_text(tiny) -> None:
    model = load_model(str(tiny(MIXED, "gguf")))
    codec = model.tokenizer
    tokens = calibration_tokens(codec)
    text = codec.decode(tokens)
    assert len(tokens) == MAX_TOKENS
    assert calibration_for(model, CompileOptions(), cpu_target("x86-64-v3")) == tokens[:model.config.context_length]
    assert calibration_for(model, CompileOptions(compute="a8"), cpu_target("x86-64-v3")) == []
    assert calibration_for(model, CompileOptions(), cpu_target("x86-64")) == []  # no integer dot product
    assert "<|im_start|>user\n" in text and "<|im_start|>assistant\n" in text  # the tiny models' ChatML template
    assert "The baker opened her shop" in text  # and the plain text after the first conversation


def test_the_measured_error_is_the_interpreters_and_a16s_is_far_below_a8s(tiny) -> None:
    """On ≤ 16 tokens every row is measured: the first projection's a8 and a16 errors equal what the
    `llm` interpreter's integer arithmetic (the kernels', in numpy) gives against float."""
    model, module = quantized(tiny(MIXED, "gguf"), compute="a8")
    tokens = calibration_tokens(model.tokenizer)[:12]
    forward = find_function(module, "forward")
    errors = measure(forward, model.weights, tokens)
    measured = [(op, e) for op, e in zip(projections(module), errors, strict=True) if e is not None]
    assert len(measured) == 2 * 7 + 1
    for op, e in measured:
        assert 0 < e[llm.Compute.A16] < e[llm.Compute.A8] / 1000, (op.weight.owner.sym_name, e)
    first = projections(module)[0]
    results = {}
    for mode in (llm.Compute.A32, llm.Compute.A8, llm.Compute.A16):
        first.compute = llm.ComputeAttr(mode)
        args = forward.body.block.args
        known = {args[0]: np.asarray(tokens, np.int32), args[1]: np.arange(len(tokens), dtype=np.int32),
                 args[2]: KVCache.for_type(forward.function_type.inputs.data[2], len(tokens))}
        (results[mode],) = evaluate([first.result], known, model.weights)
    exact = results[llm.Compute.A32].astype(np.float64)
    for mode, rtol in ((llm.Compute.A8, 1e-3), (llm.Compute.A16, 2e-2)):
        interpreted = np.square(results[mode] - exact).sum() / np.square(exact).sum()
        assert errors[0][mode] == pytest.approx(interpreted, rel=rtol)


def test_auto_widens_within_the_decode_budget_and_one_input_gets_one_mode(tiny, monkeypatch) -> None:
    path = tiny(MIXED, "gguf")
    _, cheap = quantized(path)  # AVX2: a16 costs 1.2× a8 in decode, within the 40% budget: every integer matmul
    integer = [op for op in projections(cheap) if not op.weight.owner.storage.data.is_float]
    assert {op.mode for op in integer} == {llm.Compute.A16}
    assert {op.mode for op in projections(cheap)} - {llm.Compute.A16} == {llm.Compute.A32}  # f16 ffn_down
    monkeypatch.setitem(cpu.A16_COST, tgt.Isa.AVX2, (2.5, 2.2))  # a target where a16 costs more: 1/3 of the bytes
    assert a16_cost(cpu_target("x86-64-v3")) == (2.5, 2.2)
    _, dear = quantized(path)
    ops = projections(dear)
    wide = sum(weight_bytes(op) for op in ops if op.mode is llm.Compute.A16)
    assert 0 < 1.2 * wide <= DECODE_BUDGET * sum(weight_bytes(op) for op in ops)
    assert 1.5 * sum(weight_elements(op) for op in ops if op.mode is llm.Compute.A16) \
        <= PREFILL_BUDGET * sum(weight_elements(op) for op in ops)  # and prefill within its budget
    assert {op.mode for op in ops} == {llm.Compute.A8, llm.Compute.A16, llm.Compute.A32}
    by_input: dict = {}
    for op in ops:
        if op.mode.integer:
            by_input.setdefault(op.input, set()).add(op.mode)
    assert any(len(group) == 1 for group in by_input.values())
    assert all(len(modes) == 1 for modes in by_input.values())  # q/k/v and gate/up: one mode per shared input


def test_an_amx_target_keeps_a8_where_a16_costs_more(tiny, monkeypatch) -> None:
    """At `A16_PREFILL_ON_AMX` (1.3×) a8's prefill, a16 fits the budget whole; where it cost 3×,
    the prefill budget would keep most groups a8."""
    _, module = quantized(tiny(MIXED, "gguf"), cpu_name="sapphirerapids")
    assert {op.mode for op in projections(module) if op.mode.integer} == {llm.Compute.A16}
    monkeypatch.setattr(cpu, "A16_PREFILL_ON_AMX", 3.0)
    _, module = quantized(tiny(MIXED, "gguf"), cpu_name="sapphirerapids")
    ops = [op for op in projections(module) if op.mode.integer]
    wide = sum(weight_elements(op) for op in ops if op.mode is llm.Compute.A16)
    assert {op.mode for op in ops} == {llm.Compute.A8, llm.Compute.A16}
    assert 2.0 * wide <= PREFILL_BUDGET * sum(weight_elements(op) for op in projections(module)) * (1 + 1e-9)


def test_the_choice_is_a_knapsack_by_gain_per_cost() -> None:
    assert choose_wider([(3.0, (2.0,)), (1.0, (2.0,)), (0.5, (0.0,))], (3.0,)) == [2, 0]
    assert choose_wider([(1.0, (1.0,)), (5.0, (4.0,)), (0.0, (0.1,))], (5.0,)) == [1, 0]  # no gain: not widened
    assert sorted(choose_wider([(1.0, (0.05,))] * 20, (1.0,))) == list(range(20))  # the budget exactly: all of them
    # two budgets (decode, prefill): the second binds, and ranks by the larger share
    assert choose_wider([(2.0, (1.0, 4.0)), (1.5, (1.0, 1.0)), (1.0, (1.0, 1.0))], (10.0, 4.0)) == [1, 2]


def test_a_measurement_is_kept_and_another_model_or_text_is_measured_again(tiny, tmp_path, monkeypatch) -> None:
    """`measure` keeps its result in the cache: the same function, weights and tokens again run nothing and
    give the same errors; other tokens, or a model of the same shapes with other weights, are measured; a
    damaged entry is measured again."""
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path))
    runs = []
    real = calibrate._measure
    monkeypatch.setattr(calibrate, "_measure", lambda *args: runs.append(1) or real(*args))
    model, module = quantized(tiny(MIXED, "gguf"), compute="a8")
    tokens = calibration_tokens(model.tokenizer)[:12]
    forward = find_function(module, "forward")
    errors = measure(forward, model.weights, tokens)
    assert measure(forward, model.weights, tokens) == errors and len(runs) == 1
    assert measure(forward, model.weights, tokens[:11]) != errors and len(runs) == 2
    other, other_module = quantized(tiny(replace(MIXED, seed=1), "gguf"), compute="a8")
    assert measure(find_function(other_module, "forward"), other.weights, tokens) != errors and len(runs) == 3
    for entry in (tmp_path / calibrate.CACHE_KIND).iterdir():
        entry.write_bytes(entry.read_bytes()[:-1])
    assert measure(forward, model.weights, tokens) == errors and len(runs) == 4


def test_forced_modes_force_and_calibrate_nothing(tiny) -> None:
    for mode in (llm.Compute.A8, llm.Compute.A16, llm.Compute.A32):
        _, module = quantized(tiny(MIXED, "gguf"), compute=mode.value)
        integer = {op.mode for op in projections(module) if not op.weight.owner.storage.data.is_float}
        assert integer == {mode}
        assert all(ERROR not in op.attributes for op in projections(module)) and CALIBRATED not in module.attributes
    _, floats = quantized(tiny(FLOAT, "hf"))  # float weights only: a32, nothing to choose, so nothing measured
    assert {op.mode for op in projections(floats)} == {llm.Compute.A32} and CALIBRATED not in floats.attributes
    _, module = quantized(tiny(MIXED, "gguf"), calibrate=False)  # no calibration tokens (`llmc opt`)
    assert {op.mode for op in projections(module) if op.mode.integer} == {llm.Compute.A16}  # all within the budget
    assert all(ERROR not in op.attributes for op in projections(module)) and "calibrated" not in summary(module)


def test_the_quantize_ir_shows_each_error_and_the_summary_the_estimates(tiny, capsys) -> None:
    assert main(["compile", str(tiny(FLOAT, "hf")), "--quant", "q4_1", "--cpu", "x86-64-v3",
                 "--compile-to", "quantize"]) == 0
    captured = capsys.readouterr()
    module = parse_module(captured.out)
    assert print_module(module).strip() == captured.out.strip()  # the errors print and parse back, as they are
    generic = print_module(module, generic=True)
    assert print_module(parse_module(generic), generic=True) == generic
    ops = projections(module)
    assert all(op.mode is llm.Compute.A16 for op in ops)
    errors = [op.attributes[ERROR] for op in ops]
    assert all(e.data["a16"].value.data < e.data["a8"].value.data for e in errors)
    prefill, decode = a16_cost(cpu_target("x86-64-v3"))
    assert f"a16 ×{len(ops)}; est. decode {decode:.2f}×, prefill {prefill:.2f}× of a8 " \
           "(calibrated on 64 tokens)" in captured.err  # the tiny models' context


@pytest.mark.parametrize("given", ["file", "stdin", "fifo"])
def test_calibrate_file_replaces_the_built_in_text(tiny, tmp_path, capsys, monkeypatch, given: str) -> None:
    """`--calibrate FILE`, `-` or a pipe (`<(…)`): its text is checked before the model loads, then calibrated
    on; standard input and a pipe are read once (was: read again, empty, "the file has no text")."""
    import io
    import threading

    text = "Twinkle, twinkle, little star."
    name = str(tmp_path / "calib.txt")
    if given == "file":
        Path(name).write_text(text, encoding="utf-8")
    elif given == "stdin":
        name = "-"
        monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(text.encode())))
    else:
        os.mkfifo(name)
        threading.Thread(target=lambda: Path(name).write_text(text, encoding="utf-8"), daemon=True).start()
    path = str(tiny(FLOAT, "hf"))
    with hang_guard(60):  # (a pipe read again waits for a writer that has gone)
        assert main(["compile", path, "--quant", "q4_1", "--compile-to", "quantize", "--calibrate", name]) == 0, \
            capsys.readouterr().err
    tokens = len(load_model(path).tokenizer.encode(text))
    assert f"(calibrated on {tokens} tokens)" in capsys.readouterr().err


@pytest.mark.parametrize(("content", "problem"), [
    (None, "cannot read it"), (b"", "the file has no text"), (b" \n\t", "the file has no text"),
    (b"abc\0def", "not a text file (it holds NUL bytes)"), (b"caf\xe9", "not UTF-8 text (byte 3 is 0xe9)")])
def test_a_bad_calibrate_file_is_one_line(tiny, tmp_path, capsys, content: bytes | None, problem: str) -> None:
    bad = tmp_path / "calib.txt"
    if content is not None:
        bad.write_bytes(content)
    assert main(["compile", str(tiny(FLOAT, "hf")), "--compile-to", "quantize", "--calibrate", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--calibrate {bad}: {problem}" in err, err


def test_calibrate_with_a_forced_mode_is_one_line(tiny, tmp_path, capsys) -> None:
    good = tmp_path / "calib.txt"
    good.write_text("text", encoding="utf-8")
    assert main(["compile", str(tiny(FLOAT, "hf")), "--compile-to", "quantize", "--compute", "a8",
                 "--calibrate", str(good)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--calibrate is for --compute auto" in err


@pytest.mark.reference
def test_verify_per_layer_prints_a_row_per_projection(tiny, capsys) -> None:
    pytest.importorskip("transformers")
    assert main(["verify", str(tiny(FLOAT, "hf")), "--quant", "q8_0", "--per-layer", "--cpu", "x86-64-v3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("projection"))
    rows = [line.split() for line in lines[start + 1:]]
    names = [row[0] for row in rows]
    assert names == [f"blk.{i}.{p}" for i in range(2) for p in ("attn_q", "attn_k", "attn_v", "attn_output",
                                                                 "ffn_gate", "ffn_up", "ffn_down")] + ["token_embd"]
    assert all(row[1] == "a16" and float(row[3]) < float(row[2]) for row in rows)
