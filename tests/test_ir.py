"""The `llm` dialect's text form, verifiers and passes: IR in, IR out."""

from __future__ import annotations

import re

import pytest
from test_families import FAMILIES
from tiny_models import TinySpec

from llmc.backends.cpu.target import cpu_target
from llmc.cli import main
from llmc.errors import LlmcError
from llmc.frontend import import_model, load_model
from llmc.ir import tgt
from llmc.ir.text import parse_module, print_module, verify_module
from llmc.passes.pipeline import PHASES, phases_through, run_phase

SPECS = {
    "gqa": TinySpec(),
    "qwen2-bias-untied": TinySpec(arch="qwen2", heads=3, kv_heads=1, hidden=24, tied=False),
}
# (spec, form): the families' ops and attributes (scaled and partial RoPE, windows, soft-caps, GeGLU, MoE)
CASES = {name: (spec, "gguf") for name, spec in SPECS.items()} | {
    name: (FAMILIES[name], "hf") for name in ("phi3-gqa-partial-longrope-window5", "gemma2", "gemma3-linear-global",
                                              "qwen3moe-8x2-normalized")}


@pytest.mark.parametrize("phase", list(PHASES))
@pytest.mark.parametrize(("spec", "form"), CASES.values(), ids=CASES.keys())
def test_every_phase_round_trips(tiny, spec: TinySpec, form: str, phase: str) -> None:
    """Verifies, prints, parses back and prints identically, in custom and generic form."""
    module = import_model(load_model(str(tiny(spec, form))))
    module.attributes[tgt.TARGET] = cpu_target("x86-64-v3")
    for p in phases_through(phase):
        run_phase(module, p)
    verify_module(module)
    text = print_module(module)
    assert f'llm.phase = "{phase}"' in text
    again = parse_module(text)
    verify_module(again)
    assert print_module(again) == text
    generic = print_module(module, generic=True)
    weight = '"tgt.weight"' if phase == "lower" else '"llm.weight"'
    storage = "f32, stored>" if phase == "lower" else "#llm<storage f32>"
    assert weight in generic and storage in generic and '#tgt.target<cpu, "x86_64", "x86-64-v3"' in generic
    from_generic = parse_module(generic)
    assert print_module(from_generic) == text
    assert print_module(from_generic, generic=True) == generic


WELL_FORMED = """\
builtin.module {
  func.func @f(%tokens: tensor<?xi32>, %pos: tensor<?xi32>, %kv: !llm.kv_cache<2x2x16x8xf32>) -> tensor<?x32xf32> {
    %emb = llm.weight @token_embd q8_0 : tensor<40x32xf32>
    %x = llm.embedding %tokens, %emb : (tensor<?xi32>, tensor<40x32xf32>) -> tensor<?x32xf32>
    %nw = llm.weight @blk.0.attn_norm f32 : tensor<32xf32>
    %h = llm.rms_norm %x, %nw eps 1.000000e-05 : tensor<?x32xf32>, tensor<32xf32>
    %wq = llm.weight @blk.0.attn_q q4_1 : tensor<32x32xf32>
    %q = llm.matmul %h, %wq : (tensor<?x32xf32>, tensor<32x32xf32>) -> tensor<?x32xf32>
    %wk = llm.weight @blk.0.attn_k q4_1 : tensor<16x32xf32>
    %bk = llm.weight @blk.0.attn_k.bias f32 : tensor<16xf32>
    %k = llm.matmul %h, %wk bias %bk : (tensor<?x32xf32>, tensor<16x32xf32>, tensor<16xf32>) -> tensor<?x16xf32>
    %q3 = llm.reshape %q : tensor<?x32xf32> -> tensor<?x4x8xf32>
    %k3 = llm.reshape %k : tensor<?x16xf32> -> tensor<?x2x8xf32>
    %qr = llm.rope %q3, %pos <theta 10000.0> : tensor<?x4x8xf32>, tensor<?xi32>
    %a = llm.attention %qr, %k3, %k3, %pos, %kv layer 1 : (tensor<?x4x8xf32>, tensor<?x2x8xf32>, tensor<?x2x8xf32>, tensor<?xi32>, !llm.kv_cache<2x2x16x8xf32>) -> tensor<?x4x8xf32>
    %a2 = llm.reshape %a : tensor<?x4x8xf32> -> tensor<?x32xf32>
    %s = llm.silu %a2 : tensor<?x32xf32>
    %m = llm.mul %s, %h : tensor<?x32xf32>
    %y = llm.add %m, %x : tensor<?x32xf32>
    %l = llm.logits %y, %emb : (tensor<?x32xf32>, tensor<40x32xf32>) -> tensor<?x40xf32>
    %r = llm.reshape %l : tensor<?x40xf32> -> tensor<?x40xf32>
    func.return %y : tensor<?x32xf32>
  }
}
"""


def test_hand_written_ir_round_trips() -> None:
    module = parse_module(WELL_FORMED)
    verify_module(module)
    assert print_module(module) == print_module(parse_module(print_module(module)))
    assert "%k = llm.matmul %h, %wk bias %bk" in print_module(module)


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("tensor<32x32xf32>) -> tensor<?x32xf32>\n    %wk", "tensor<32x32xf32>) -> tensor<?x31xf32>\n    %wk",
         "llm.matmul: output width (weight vs result) mismatch: 32 vs 31"),
        ("tensor<32x32xf32>", "tensor<32x64xf32>", "llm.matmul: reduction dimension (input vs weight) mismatch: 32 vs 64"),
        ("tensor<32x32xf32>", "tensor<32x30xf32>", "llm.weight: weight @blk.0.attn_q: rows of 30 are not whole q4_1 "
                                                   "blocks"),
        ("tensor<32xf32>", "tensor<33xf32>", "llm.rms_norm: normalized width (input vs weight) mismatch: 32 vs 33"),
        ("-> tensor<?x40xf32>\n    func", "-> tensor<?x41xf32>\n    func", "llm.reshape: element count differs"),
        ("tensor<?x2x8xf32>", "tensor<?x1x16xf32>", "llm.attention: head dimension (query vs key) mismatch: 8 vs 16"),
        ("!llm.kv_cache<2x", "!llm.kv_cache<1x", "llm.attention: layer 1 is outside the cache's 1 layers"),
        ("tensor<40x32xf32>", "tensor<40x64xf32>", "llm.embedding: embedding width (table vs result) mismatch: 64 vs 32"),
        ("tensor<?xi32>, !llm", "tensor<?xi64>, !llm", "llm.rope: positions must have element type i32, got i64"),
    ],
    ids=["matmul-result", "matmul-k", "weight-blocks", "rms-norm", "reshape-count", "attention-head-dim", "attention-layer",
         "embedding", "rope-positions"],
)
def test_verifiers_name_the_op_and_dimensions(old: str, new: str, message: str) -> None:
    """Each edit changes a type everywhere it is written, so the text parses and only verification fails."""
    assert old in WELL_FORMED
    text = WELL_FORMED.replace(old, new)
    if "?x31" in new:
        text = text.replace("llm.reshape %q : tensor<?x32xf32>", "llm.reshape %q : tensor<?x31xf32>")
    if "i64" in new:
        text = text.replace("%pos: tensor<?xi32>", "%pos: tensor<?xi64>").replace("tensor<?x4x8xf32>, tensor<?xi32>", "tensor<?x4x8xf32>, tensor<?xi64>")
    with pytest.raises(LlmcError, match="does not verify") as error:
        verify_module(parse_module(text))
    assert message in str(error.value)


def test_gqa_heads_must_divide() -> None:
    text = WELL_FORMED
    for old, new in [("16x32xf32", "24x32xf32"), ("<16xf32>", "<24xf32>"), ("?x16xf32", "?x24xf32"),
                     ("?x2x8xf32", "?x3x8xf32"), ("kv_cache<2x2x16x8xf32>", "kv_cache<2x3x16x8xf32>")]:
        text = text.replace(old, new)
    with pytest.raises(LlmcError) as error:
        verify_module(parse_module(text))
    assert "llm.attention: query heads (4) must be a multiple of kv heads (3)" in str(error.value)


def test_parse_error_names_file_line_and_column() -> None:
    with pytest.raises(LlmcError) as error:
        parse_module(WELL_FORMED.replace("llm.silu", "llm.swish"), "model.mlir")
    assert re.match(r"model\.mlir:17:\d+: ", str(error.value))
    assert "llm.swish" in str(error.value)


def test_canonicalize_and_dce() -> None:
    """The identity reshape `%r` goes; dead weights and logits go; attention stays."""
    module = parse_module(WELL_FORMED)
    run_phase(module, "optimize")
    text = print_module(module)
    assert "%r = llm.reshape" not in text
    assert "llm.logits" not in text  # unused, pure
    assert "llm.attention" in text  # writes the KV cache, so never dead
    assert text.count("llm.reshape") == 3


def test_reshape_chain_folds() -> None:
    text = WELL_FORMED.replace(
        "%a2 = llm.reshape %a : tensor<?x4x8xf32> -> tensor<?x32xf32>",
        "%a1 = llm.reshape %a : tensor<?x4x8xf32> -> tensor<?x2x16xf32>\n"
        "    %a2 = llm.reshape %a1 : tensor<?x2x16xf32> -> tensor<?x32xf32>",
    )
    module = parse_module(text)
    run_phase(module, "optimize")
    out = print_module(module)
    assert "tensor<?x2x16xf32>" not in out
    assert "llm.reshape %a : tensor<?x4x8xf32> -> tensor<?x32xf32>" in out


def test_opt_cli_runs_passes_and_prints_after_each(tmp_path, capsys) -> None:
    src = tmp_path / "in.mlir"
    src.write_text(WELL_FORMED)
    assert main(["opt", str(src), "-p", "canonicalize,dce", "--print-ir-after-all"]) == 0
    captured = capsys.readouterr()
    assert "// -----// IR Dump After canonicalize //----- //" in captured.err
    assert "// -----// IR Dump After dce //----- //" in captured.err
    assert "llm.logits" not in captured.out
    parse_module(captured.out)


def test_opt_cli_without_passes_prints_input_back(tmp_path, capsys) -> None:
    src = tmp_path / "in.mlir"
    src.write_text(print_module(parse_module(WELL_FORMED)))
    assert main(["opt", str(src)]) == 0
    assert capsys.readouterr().out == src.read_text()


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["opt", "missing.mlir"], "llmc opt missing.mlir: cannot read it"),
        (["opt", "{bad}", "-p", "nope"], "unknown pass 'nope'"),
    ],
)
def test_opt_cli_errors_are_one_line(tmp_path, capsys, argv: list[str], expected: str) -> None:
    argv = [str(tmp_path / a[1:-1]) if a == "{bad}" else a for a in argv]
    (tmp_path / "bad").write_text(WELL_FORMED)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expected in err and "Traceback" not in err


def test_ir_nested_too_deeply_is_one_line(tmp_path, capsys) -> None:
    for name, text in (("modules", "builtin.module {\n" * 400 + "}\n" * 400),
                       ("attribute", "builtin.module attributes {a = " + "[" * 100_000 + "]" * 100_000 + "} {\n}\n")):
        src = tmp_path / f"{name}.mlir"
        src.write_text(text)
        assert main(["opt", str(src)]) == 2
        err = capsys.readouterr().err
        assert err == f"llmc: error: {src}: the IR is nested too deeply to parse\n", err


def test_opt_cli_verifier_error_is_one_line(tmp_path, capsys) -> None:
    src = tmp_path / "bad.mlir"
    src.write_text(WELL_FORMED.replace("%pos: tensor<?xi32>", "%pos: tensor<?xi64>")
                   .replace("tensor<?x4x8xf32>, tensor<?xi32>", "tensor<?x4x8xf32>, tensor<?xi64>")
                   .replace("tensor<?xi32>, !llm", "tensor<?xi64>, !llm"))
    assert main(["opt", str(src)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "llm.rope: positions must have element type i32" in err


SPLIT_AT = 'builtin.module attributes {llm.phase = "split", tgt.target = #tgt.target<cpu, "x86_64", "x86-64-v3", ["avx2"]>} {'
OPTIMIZED_AT = SPLIT_AT.replace('"split"', '"optimize"')


@pytest.mark.parametrize(("edit", "passes", "message"), [
    (lambda t: t.replace("2x2x16x8xf32>", "2x2x16x8xf32, slots 0>"), [], "dimensions and slots must be positive"),
    (lambda t: t.replace("layer 1", "layer 99999999999999999999"), [], "out of range for type i64"),
    (lambda t: t.replace("theta 10000.0", "theta -1.0"), [], "theta must be positive"),
    (lambda t: t.replace("%pos: tensor<?xi32>", "%pos: tensor<?xi64>")
               .replace("tensor<?x4x8xf32>, tensor<?xi32>", "tensor<?x4x8xf32>, tensor<?xi64>")
               .replace("tensor<?xi32>, !llm", "tensor<?xi64>, !llm"), [], "positions must have element type i32"),
    (lambda t: t.replace("    %r = ", "    %c = llm.constant dense<1.0> : tensor<100000x1000xf32>\n    %r = "), [],
     ":21: a dense constant of 100000000 elements"),
    (lambda t: t.replace("builtin.module {", SPLIT_AT), ["-p", "lower"], "@f has no string llm.stage"),
    (lambda t: t.replace("builtin.module {", SPLIT_AT).replace("-> tensor<?x32xf32> {", '-> tensor<?x32xf32> '
                         'attributes {llm.stage = "decode", llm.max_tokens = "x"} {', 1), ["-p", "lower"],
     "@f has no positive integer llm.max_tokens"),
], ids=["kv-slots", "layer-past-i64", "theta", "positions-i64", "huge-splat", "no-stage", "max-tokens-string"])
def test_edited_ir_is_one_line(tmp_path, capsys, edit, passes: list[str], message: str) -> None:
    """IR edited by hand: attributes that check themselves as they are parsed, a constant that would take
    400 MB to parse, and entry points without what `split` gives them: one line, exit 2, not an internal error."""
    src = tmp_path / "edited.mlir"
    src.write_text(edit(WELL_FORMED))
    assert main(["opt", str(src), *passes]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("llmc: error: ") and message in err, err


def test_weights_of_any_name_lower(tmp_path, capsys) -> None:
    """A weight's symbol names its SSA values (`%blk_0_attn_q`): names xDSL does not take as SSA names (empty,
    a digit first, a space, not ASCII) are made valid, not an internal error."""
    for name in ('""', '"1"', '"a b"', '"é"'):
        src = tmp_path / "weights.mlir"
        src.write_text(WELL_FORMED.replace("builtin.module {", OPTIMIZED_AT).replace("@f(", "@forward(")
                       .replace("@blk.0.attn_q ", f"@{name} "))
        assert main(["opt", str(src), "-p", "quantize,split{max_seq=16},group,lower,pack,plan-memory"]) == 0, name
        assert "tgt.weight" in capsys.readouterr().out


def test_a_pass_refuses_ir_it_has_run_on(tiny, tmp_path, capsys) -> None:
    """`split` and `lower` on IR they made end in one line saying so, not in a KeyError: by the module's phase,
    and by the functions themselves where the phase does not tell (`lower` alone leaves the module at 'group')."""
    quantized = tmp_path / "q.mlir"
    assert main(["compile", str(tiny(SPECS["gqa"], "gguf")), "--compile-to", "quantize", "-o", str(quantized)]) == 0
    split = "split{max_seq=16 prefill_chunk=4}"
    lowered = tmp_path / "low.mlir"
    assert main(["opt", str(quantized), "-p", f"{split},group,lower,fuse-norm,pack,plan-memory", "-o", str(lowered)]) == 0
    capsys.readouterr()
    vector = tmp_path / "vector.mlir"  # (valid IR: `quantize` would make the vector f32; after it, lower refuses it)
    vector.write_text(quantized.read_text().replace("@blk.0.attn_norm f32 :", "@blk.0.attn_norm q8_0 :"))
    assert vector.read_text() != quantized.read_text()
    no_phase, bogus_phase = tmp_path / "none.mlir", tmp_path / "bogus.mlir"
    no_phase.write_text(re.sub(r', llm.phase = "quantize"|llm.phase = "quantize", ', "", quantized.read_text()))
    bogus_phase.write_text(quantized.read_text().replace('llm.phase = "quantize"', 'llm.phase = "bogus"'))
    assert "llm.phase" not in no_phase.read_text() and "bogus" in bogus_phase.read_text()
    for source, passes, expected in [
        (quantized, f"{split},split", "pass 'split' needs IR of phase 'quantize' at the latest; this module is at "
                                      "phase 'split'"),
        (quantized, f"{split},group,lower,lower", "pass 'lower' needs IR of phase 'group' at the latest; @prefill is "
                                                  "lowered already"),
        (lowered, "lower", "this module is at phase 'lower' (the pass ran on it already)"),
        (lowered, "pack,lower", "this module is at phase 'lower'"),
        (vector, f"{split},group,lower", "lower: weight @blk.0.attn_norm is a q8_0 vector"),
        (no_phase, f"{split},group,lower", "pass 'split' needs IR after phase 'quantize'; this module records no "
                                            "phase (llm.phase)"),
        (bogus_phase, split, "this module's phase 'bogus' (llm.phase) is not one of llmc's: import, optimize"),
        (quantized, f"{split},group,lower,pack,plan-memory,fuse-norm", "pass 'fuse-norm' runs before plan-memory: "
                                                                        "@prefill's arena is planned already"),
    ]:
        assert main(["opt", str(source), "-p", passes]) == 2, passes
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and expected in err, (passes, err)
