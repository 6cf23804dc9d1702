"""Target descriptions (`llmc.ir.target`): every registered backend answers every question the passes
and the driver ask, an unknown kind is one clear error, the passes import no backend, and an op a
target has no kernel for is refused in one line before the long work."""

from __future__ import annotations

import inspect
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_models import TinySpec

from llmc.cli import main
from llmc.driver import BackendOptions, run_phases
from llmc.errors import UsageError
from llmc.frontend import load_model
from llmc.ir import llm, tgt
from llmc.ir.layouts import Layout
from llmc.ir.target import TARGETS, TargetDescription, description_class, target_description
from llmc.passes.pipeline import CompileOptions

ROOT = Path(__file__).resolve().parent.parent
# one target of each kind per feature that changes an answer: no integer dot, AVX2, AVX-512 VNNI with AMX; two GPUs
BACKENDS = [BackendOptions(cpu="x86-64"), BackendOptions(cpu="x86-64-v3"), BackendOptions(cpu="sapphirerapids"),
            BackendOptions(target="cuda", gpu="sm_80"), BackendOptions(target="cuda", gpu="sm_90")]
QUANTIZED = TinySpec(hidden=64, heads=2, kv_heads=1, head_dim=32, ffn=128, context_length=64, gguf_storage=(
    ("token_embd", "q8_0"), ("attn_q", "q4_1"), ("attn_k", "q4_0"), ("attn_v", "q8_0"), ("attn_output", "q5_0"),
    ("ffn_gate", "q5_1"), ("ffn_up", "q4_1"), ("ffn_down", "f16")))
MOE = TinySpec(arch="qwen3moe", experts=4, experts_used=2, ffn=16, head_dim=16, tied=False)


def _readers(module) -> dict[str, list[tgt.Kernel]]:
    """The kernels that read each integer weight, over every entry point."""
    readers: dict[str, list[tgt.Kernel]] = {}
    for op in module.walk():
        if isinstance(op, tgt.WeightOp) and not op.weight_type.storage.is_float:
            readers.setdefault(op.sym_name, []).extend(use.operation for use in op.result.uses)
    return readers


# each question of the interface → how the test asks it of a description `d` and a lowered module `m`
def _ask_integer_isa(d: TargetDescription, m) -> None:
    assert isinstance(d.integer_isa(), tgt.Isa)
    assert d.has_integer_dot() == (d.integer_isa() is not tgt.Isa.GENERIC)


def _ask_check_compute(d: TargetDescription, m) -> None:
    for compute in ("auto", "a32"):
        d.check_compute(compute)  # every target runs float activations
    for compute in ("a8", "a16"):
        try:
            d.check_compute(compute)
        except UsageError as e:
            assert "\n" not in str(e) and compute in str(e)


def _ask_a16_cost(d: TargetDescription, m) -> None:
    prefill, decode = d.a16_cost()
    assert prefill >= 1.0 and decode >= 1.0
    assert d.has_integer_dot() or (prefill, decode) == (1.0, 1.0)


def _ask_weight_layout(d: TargetDescription, m) -> None:
    layouts = {name: d.weight_layout(kernels) for name, kernels in _readers(m).items()}
    assert layouts and all(layout is not Layout.STORED for layout in layouts.values())
    packed = {op.sym_name: op.weight_type.layout for op in m.walk() if isinstance(op, tgt.WeightOp)}
    assert all(packed[name] is layout for name, layout in layouts.items())  # what `pack` chose


def _ask_kernel_isa(d: TargetDescription, m) -> None:
    for function in m.ops:
        rows = function.attributes["tgt.max_tokens"].value.data
        for op in function.body.block.ops:
            if isinstance(op, tgt.Kernel):
                isa = d.kernel_isa(op, rows)
                assert isa is None or isa is op.isa.data  # what `pack` gave it


def _ask_kernels(d: TargetDescription, m) -> None:
    kernels = d.kernels()
    assert kernels and kernels <= set(tgt.KERNELS)
    assert {type(op) for op in m.walk() if isinstance(op, tgt.Kernel)} <= kernels  # a llama's lowered kernels


def _ask_refused_ops(d: TargetDescription, m) -> None:
    ops = {op.name for op in llm.LLM.operations}
    for name, what in d.refused_ops.items():
        assert name in ops and what


QUESTIONS = {
    "integer_isa": _ask_integer_isa, "check_compute": _ask_check_compute, "a16_cost": _ask_a16_cost,
    "weight_layout": _ask_weight_layout, "kernel_isa": _ask_kernel_isa, "kernels": _ask_kernels,
}
# asked elsewhere: `target_for` by every compile here, `build` by every artifact test (test_compile, test_cuda)
ASKED_ELSEWHERE = {"target_for", "build"}


def test_the_test_asks_every_question() -> None:
    assert set(QUESTIONS) | ASKED_ELSEWHERE == TargetDescription.__abstractmethods__


@pytest.mark.parametrize("backend", BACKENDS, ids=lambda b: f"{b.target}-{b.cpu if b.target == 'cpu' else b.gpu}")
def test_every_target_answers_every_question(tiny, backend: BackendOptions) -> None:
    cls = description_class(backend.target)
    assert cls.kind == backend.target and not inspect.isabstract(cls)
    assert isinstance(cls.prefill_chunk, int) and cls.prefill_chunk > 0
    model = load_model(str(tiny(QUANTIZED, "gguf")))
    options = CompileOptions(compute="auto" if backend.target == "cpu" else "a32", max_seq=32)
    module = run_phases(model, options, "lower", None, lambda _: None, cls.target_for(backend))
    description = target_description(cls.target_for(backend))
    for ask in (*QUESTIONS.values(), _ask_refused_ops):
        ask(description, module)


def test_an_unknown_target_kind_is_one_clear_error() -> None:
    with pytest.raises(UsageError, match=r"^unknown target 'tpu' \(targets: cpu, cuda\)$"):
        target_description(tgt.TargetAttr("tpu", "tpu", "v5", []))
    assert list(TARGETS) == ["cpu", "cuda"]


def test_passes_import_no_backend() -> None:
    """Every module of `llmc.passes` imported in a fresh interpreter loads no `llmc.backends` module;
    no pass tests a target's name."""
    code = ("import pkgutil, importlib, sys, llmc.passes as p\n"
            "for m in pkgutil.iter_modules(p.__path__): importlib.import_module(f'llmc.passes.{m.name}')\n"
            "print(sorted(n for n in sys.modules if n.startswith('llmc.backends')))")
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
    for path in (ROOT / "passes").glob("*.py"):
        text = path.read_text()
        assert "import llmc.backends" not in text and "from llmc.backends" not in text, path
        assert '== "cuda"' not in text and '== "cpu"' not in text, path


def test_an_op_without_a_kernel_is_refused_before_the_work(tiny, tmp_path, capsys) -> None:
    path = str(tiny(MOE, "gguf"))
    assert main(["compile", path, "--target", "cuda", "-o", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.err == ("llmc: error: target cuda has no kernel for llm.moe (mixture of experts); "
                            "use --target cpu\n")
    assert "quantize" not in captured.out  # refused right after import
    assert not (tmp_path / "out").exists()
