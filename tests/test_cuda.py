"""The CUDA target without a GPU: PTX that ptxas accepts, launch plans that match the kernels, and the
kernels' numerics on the CPU emulator (the same LLVM IR built for the host) against the interpreters.

Tests marked `gpu` run the same artifacts on a real GPU through the driver and skip without one.
"""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_batch import assert_rows_are_each_sequence_alone
from test_compile import QSPECS, SPECS, TOKENS, _close, _reference, _stage_logits
from test_families import FAMILIES
from tiny_models import TinySpec

from llmc.backends.cuda import kernels as cuda_kernels
from llmc.backends.cuda.emulator import EmulatedDevice
from llmc.backends.cuda.toolchain import parse_report
from llmc.cli import main
from llmc.driver import BackendOptions, compile_model, run_phases, target_attr
from llmc.errors import LlmcError
from llmc.frontend import import_model, load_model
from llmc.ir import find_function
from llmc.ir.interpreter import KVCache, forward_logits
from llmc.package import weight_layout
from llmc.passes.pipeline import CompileOptions
from llmc.runtime.artifact import ArtifactError, load_manifest
from llmc.runtime.cuda import CudaSession, Driver, NoGpuError
from llmc.verify import teacher_forced

needs_ptxas = pytest.mark.skipif(shutil.which("ptxas") is None, reason="ptxas is not on PATH")
CUDA = BackendOptions(target="cuda", gpu="sm_80")  # PTX for sm_80, as by default; one cubin (ptxas) per artifact


def _gpu_present() -> bool:
    try:
        Driver().close()
        return True
    except (NoGpuError, LlmcError):
        return False


@pytest.fixture(scope="module")
def cuda_artifact(tiny, tmp_path_factory) -> Callable[..., tuple[Path, EmulatedDevice]]:
    """`cuda_artifact(spec, chunk=4, group=True, form="gguf", **options)` → (a CUDA artifact, the emulator
    loaded with the host build of its kernels), built once (f32 KV cache unless `kv_type` says otherwise)."""
    root = tmp_path_factory.mktemp("cuda")
    built: dict[tuple, tuple[Path, EmulatedDevice]] = {}

    def build(spec: TinySpec, chunk: int = 4, group: bool = True, form: str = "gguf",
              **options) -> tuple[Path, EmulatedDevice]:
        key = (spec, chunk, group, form, tuple(sorted(options.items())))
        if key not in built:
            out = root / f"a{len(built)}"
            compile_options = CompileOptions(**{"prefill_chunk": chunk, "max_seq": 32, "group": group,
                                                "kv_type": "f32", **options})
            compile_model(str(tiny(spec, form)), out, compile_options, CUDA, progress=lambda _: None)
            model = load_model(str(tiny(spec, form)))
            module = run_phases(model, compile_options, "lower", None, lambda _: None, target_attr(CUDA))
            built[key] = out, EmulatedDevice(module, weight_layout(module).offsets, root)
        return built[key]

    return build


def _session(cuda_artifact, spec: TinySpec, **options) -> CudaSession:
    directory, device = cuda_artifact(spec, **options)
    return CudaSession(load_manifest(directory), device=device)


def _teacher_forced(session: CudaSession) -> np.ndarray:
    return teacher_forced(lambda chunk, start: session.feed(chunk), TOKENS)


# numerics on the emulator ----------------------------------------------------------------


@pytest.mark.parametrize("group", [True, False], ids=["grouped", "no-group"])
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_emulated_kernels_match_the_interpreter(tiny, cuda_artifact, spec: TinySpec, group: bool) -> None:
    """Prefill, prefill_kv and decode launch plans, teacher-forced, equal the `llm` interpreter's logits."""
    _close(_teacher_forced(_session(cuda_artifact, spec, group=group)), _reference(tiny, spec, TOKENS))


FAMILY_CHECKS = ["llama-gelu", "qwen3", "mistral-window4", "phi3-gqa-partial-longrope-window5", "gemma2",
                 "gemma3-linear-global"]


@pytest.mark.parametrize("chunk", [4, 16], ids=["gemv", "tensor-cores"])
@pytest.mark.parametrize("group", [True, False], ids=["grouped", "no-group"])
@pytest.mark.parametrize("name", FAMILY_CHECKS)
def test_emulated_families_match_the_interpreter(tiny, cuda_artifact, name: str, group: bool, chunk: int) -> None:
    """The families' features on the device: scaled and partial RoPE, per-head q/k norms, sliding windows
    (13 tokens past windows of 4 and 5), Gemma's scaled embedding, GeGLU, sandwich norms and soft-capping
    (in the GEMV and tensor-core epilogues), teacher-forced against the `llm` interpreter."""
    spec = FAMILIES[name]
    session = _session(cuda_artifact, spec, group=group, chunk=chunk, form="hf")
    model = load_model(str(tiny(spec, "hf")))
    expected = forward_logits(import_model(model), model.weights, TOKENS)
    (_close if chunk == 4 else _close_f16)(_teacher_forced(session), expected)


@pytest.mark.parametrize("spec", QSPECS.values(), ids=QSPECS.keys())
def test_emulated_quantized_kernels_match_the_quantize_stage(tiny, cuda_artifact, spec: TinySpec) -> None:
    """Every storage type (q4_0, q4_1, q5_0, q5_1, q8_0, q4_k, q5_k, q6_k, f16) dequantized in registers:
    the quantize stage's numbers (the same quantized data) within float rounding."""
    _close(_teacher_forced(_session(cuda_artifact, spec)), _stage_logits(tiny, spec, TOKENS, compute="a32"))


@pytest.mark.parametrize("batch", [2, 8])  # (8: past attention's 4 split rows)
def test_emulated_batched_decode_rows_are_each_sequence_alone(cuda_artifact, batch: int) -> None:
    """`--max-batch`: one decode launch plan over several sequences' rows, each in its own cache slot."""
    spec = QSPECS["mixed"]
    batched, alone = (_session(cuda_artifact, spec, max_batch=batch) for _ in range(2))
    assert batched.slot_count == batch
    prompts = [[5, 17, 42], [100, 150, 7, 9, 11], [4], [66, 250], [12, 13], [200, 201, 202], [7, 7, 7, 7, 7], [90]]
    assert_rows_are_each_sequence_alone(batched, alone, prompts[:batch])  # (8 rows: more than a prefill chunk)


def test_emulated_float_formats_match_the_quantize_stage(tiny, cuda_artifact) -> None:
    spec = TinySpec(hidden=64, heads=2, kv_heads=1, head_dim=32, ffn=96, context_length=64, tied=False,
                    gguf_storage=(("attn_q", "f16"), ("attn_k", "bf16"), ("ffn_down", "bf16"), ("output", "f16")))
    _close(_teacher_forced(_session(cuda_artifact, spec)), _stage_logits(tiny, spec, TOKENS, compute="a32"))


@pytest.mark.parametrize("kv_type", ["f16", "q8_0"])
def test_emulated_kv_types_match_the_interpreter_with_that_cache(tiny, cuda_artifact, kv_type: str) -> None:
    spec = replace(SPECS["gqa"], head_dim=32, hidden=SPECS["gqa"].heads * 32)
    logits = _teacher_forced(_session(cuda_artifact, spec, kv_type=kv_type))
    model = load_model(str(tiny(spec, "gguf")))
    module = import_model(model)
    cache_type = find_function(module, "forward").function_type.inputs.data[2]
    shape = (*cache_type.shape[:2], len(TOKENS), cache_type.shape[3])
    _close(logits, forward_logits(module, model.weights, TOKENS, cache=KVCache.zeros(shape, kv_type)))


MMA_TOLERANCE = 2e-3  # of the logit scale: tensor-core GEMMs multiply f16 operands (f32 sums)


def _close_f16(actual: np.ndarray, expected: np.ndarray) -> None:
    assert np.abs(actual - expected).max() <= MMA_TOLERANCE * np.abs(expected).max()
    cos = (actual * expected).sum(-1) / np.linalg.norm(actual, axis=-1) / np.linalg.norm(expected, axis=-1)
    assert cos.min() >= 0.9999
    assert (actual.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("spec", [*SPECS.values(), QSPECS["k-quants"], QSPECS["mixed"]],
                         ids=[*SPECS.keys(), "k-quants", "mixed"])
def test_emulated_tensor_core_prefill_matches(tiny, cuda_artifact, spec: TinySpec) -> None:
    """With 16-row chunks, prefill and score run on tensor cores (`isa mma_f16`: mma.sync fragments on
    the emulator): every row's logits against the quantize stage, and against decode step by step
    (GEMVs; positions split over blocks and merged): prefill(n) + decode(k) = prefill(n + k)."""
    directory, _ = cuda_artifact(spec, chunk=16)
    score = load_manifest(directory).entry_points["score"]["launches"]
    assert any(launch["kernel"].endswith("_mma") for launch in score)
    session = _session(cuda_artifact, spec, chunk=16)
    whole = session.score(TOKENS)
    _close_f16(whole, _stage_logits(tiny, spec, TOKENS, compute="a32"))
    session.reset()
    stepwise = _teacher_forced(session)
    _close_f16(stepwise, whole)


def test_every_kernel_kind_is_checked_on_the_emulator(cuda_artifact) -> None:
    """The configurations above launch a kernel of every op the CUDA backend emits: none goes unchecked."""
    launched: Counter[str] = Counter()
    configs = [(SPECS["gqa"], {"group": False}), (SPECS["qwen2-bias-untied-odd-heads"], {"chunk": 16}),
               (FAMILIES["gemma2"], {"group": False, "form": "hf"})]
    for spec, options in configs:
        session = _session(cuda_artifact, spec, **options)
        _teacher_forced(session)
        for launches in session._prepared.values():
            launched.update(next(k for k, f in session.kernels.items() if f is launch[0]) for launch in launches)
    for op in cuda_kernels.EMITTERS.implemented():
        kind = op.name.removeprefix("tgt.")
        assert any(name.startswith(kind + "_") for name in launched), f"no emulated launch of a {kind} kernel"
    for suffix in ("_store", "_attend", "_merge"):  # attention's three kernels: decode splits and merges
        assert any(name.endswith(suffix) for name in launched)
    assert any(name.endswith("_mma") for name in launched)  # the tensor-core GEMM


def test_greedy_decoding_takes_numpys_argmax_on_the_device(cuda_artifact) -> None:
    """`llmc_argmax` over the logits (ties → the first index, as numpy) and greedy generation through it."""
    session = _session(cuda_artifact, SPECS["gqa"])
    vocab = session.vocab_size
    rng = np.random.default_rng(0)
    ties = rng.standard_normal(vocab).astype(np.float32)
    ties[[7, 100, vocab - 1]] = ties.max() + 1
    cases = [rng.standard_normal(vocab).astype(np.float32), ties, np.zeros(vocab, np.float32),
             np.full(vocab, -np.inf, np.float32), -np.arange(vocab, dtype=np.float32)[::-1].copy()]
    for logits in cases:
        session.device.upload(session.buffers["logits"], logits)
        assert session.argmax() == int(np.argmax(logits))
    reference = _session(cuda_artifact, SPECS["gqa"])
    got, want = [session.greedy(TOKENS[:5])], [int(np.argmax(reference.feed(TOKENS[:5])))]
    for _ in range(5):
        got.append(session.greedy([got[-1]]))
        want.append(int(np.argmax(reference.feed([want[-1]]))))
    assert got == want


# PTX, ptxas, launch plans -------------------------------------------------------------------


def _ptx_params(ptx: str) -> dict[str, int]:
    """Kernel name → number of parameters, from the PTX text."""
    out = {}
    for m in re.finditer(r"\.entry\s+(\S+)\s*\(([^)]*)\)", ptx):
        out[m.group(1)] = len(re.findall(r"\.param", m.group(2)))
    return out


def test_launch_plans_agree_with_the_kernel_signatures(cuda_artifact) -> None:
    directory, _ = cuda_artifact(SPECS["qwen2-bias-untied-odd-heads"])
    manifest = load_manifest(directory)
    params = _ptx_params(manifest.file("kernels").read_text())
    assert params
    for name, entry in manifest.entry_points.items():
        for launch in entry["launches"]:
            assert params[launch["kernel"]] == len(launch["args"]), (name, launch["kernel"])
    argmax = manifest.data["gpu"]["argmax"]
    assert params[argmax["kernel"]] == len(argmax["args"])
    launched = {launch["kernel"] for e in manifest.entry_points.values() for launch in e["launches"]}
    assert set(params) == launched | {argmax["kernel"]}


@needs_ptxas
def test_ptxas_accepts_every_kernel_for_sm_80_and_sm_90_without_spills(cuda_artifact) -> None:
    directory, _ = cuda_artifact(QSPECS["k-quants"])
    manifest = load_manifest(directory)
    assert set(manifest.data["gpu"]["cubins"]) == {"sm_80"}  # a cubin per --gpu architecture
    from llmc.backends.cuda.toolchain import assemble

    for arch in ("sm_80", "sm_90"):
        report = assemble(manifest.file("kernels"), arch, directory / f"check.{arch}.cubin")
        assert set(report) == set(_ptx_params(manifest.file("kernels").read_text()))
        assert all(r.spill_bytes == 0 and r.stack_bytes == 0 for r in report.values()), report
        assert all(0 < r.registers <= 255 for r in report.values())


def test_a_second_compile_runs_neither_llvm_nor_ptxas(tiny, tmp_path, monkeypatch, capsys) -> None:
    """Each op's kernels are a module of their own, compiled to PTX alone and cached, the results joined;
    the cubin and ptxas's report are cached by the whole PTX: the same model again takes all from the
    cache (the codegen line says so) and writes the same artifact byte for byte."""
    import subprocess

    from llmc.backends.cpu import toolchain

    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    llvm_runs, ptxas_runs = [], []
    compiled, run = toolchain._compiled, subprocess.run
    monkeypatch.setattr(toolchain, "_compiled", lambda text, *a: llvm_runs.append(text) or compiled(text, *a))
    monkeypatch.setattr(subprocess, "run", lambda argv, **kw: (ptxas_runs.append(argv) if "-arch=sm_80" in argv
                                                               else None) or run(argv, **kw))
    model = str(tiny(QSPECS["mixed"], "gguf"))
    artifacts = []
    for name in ("cold", "warm"):
        llvm_runs.clear()
        ptxas_runs.clear()
        argv = ["compile", model, "--target", "cuda", "--gpu", "sm_80", "--jobs", "1", "-o", str(tmp_path / name)]
        assert main(argv) == 0
        artifacts.append({p.name: p.read_bytes() for p in (tmp_path / name).iterdir()})
        line = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("codegen "))
        modules = int(re.search(r"of (\d+) modules from the cache", line).group(1))
        if name == "cold":
            assert f" 0 of {modules} modules from the cache" in line and len(llvm_runs) == modules > 5
            assert len(ptxas_runs) == (shutil.which("ptxas") is not None)
        else:
            assert f" {modules} of {modules} modules from the cache" in line and llvm_runs == ptxas_runs == []
    assert artifacts[0] == artifacts[1]
    assert _ptx_params(artifacts[0][next(n for n in artifacts[0] if n.endswith(".ptx"))].decode()).keys() == \
        {launch["kernel"] for launches in json.loads(artifacts[0]["manifest.json"])["entry_points"].values()
         for launch in launches["launches"]} | {"llmc_argmax"}


def test_joined_ptx_has_one_header_each_declaration_once_and_every_function() -> None:
    from llmc.backends.cpu.toolchain import ToolchainError
    from llmc.backends.cuda.toolchain import join_ptx

    def module(name: str, target: str = "sm_80", table: str = "{1, 2}") -> str:
        return (f"//\n// Generated by LLVM NVPTX Back-End\n//\n\n.version 7.0\n.target {target}\n.address_size 64\n\n"
                f"\t// .globl\t{name}\n// {name}_$_a has been demoted\n.global .align 4 .b8 table_c4[8] = {table};\n\n"
                f".visible .entry {name}(\n\t.param .u64 {name}_param_0\n)\n.maxntid 128\n{{\n\tret;\n\n}}\n")

    joined = join_ptx([module("a"), module("b")])
    assert joined.count(".version 7.0") == 1 and joined.count(".global .align 4 .b8 table_c4") == 1
    assert joined.index(".global") < joined.index(".visible .entry a(") < joined.index(".visible .entry b(")
    assert joined.startswith("//\n// Generated by LLVM NVPTX Back-End") and "demoted" not in joined
    for texts, message in (([module("a"), module("b", target="sm_90")], "different targets"),
                           ([module("a"), module("b", table="{1, 3}")], "two declare table_c4 differently"),
                           ([module("a").replace(".global", ".extern .func (\n.global")], "not understood")):
        with pytest.raises(ToolchainError, match=message):
            join_ptx(texts)


def test_ptxas_report_is_parsed() -> None:
    text = """ptxas info    : Compiling entry function 'gemv_r1' for 'sm_90'
ptxas info    : Function properties for gemv_r1
    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
ptxas info    : Used 40 registers, used 1 barriers, 528 bytes smem"""
    r = parse_report(text)["gemv_r1"]
    assert (r.registers, r.spill_bytes, r.stack_bytes, r.shared_bytes) == (40, 8, 8, 528)


def test_compile_to_lower_shows_the_cuda_choices(tiny, capsys) -> None:
    path = str(tiny(QSPECS["mixed"], "gguf"))
    assert main(["compile", path, "--target", "cuda", "--gpu", "sm_90", "--compile-to", "lower"]) == 0
    ir = capsys.readouterr().out
    assert '#tgt.target<cuda, "nvptx64", "sm_90"' in ir
    assert "q4_1, split>" in ir and "tiles>" not in ir  # the split layout, a32 kernels
    assert "isa mma_f16" in ir and "isa vnni" not in ir  # prefill and score matmuls on tensor cores
    assert "!tgt.qrows" not in ir


@pytest.mark.parametrize("argv,message", [
    (["--gpu", "sm_75"], "unknown GPU architecture 'sm_75'"),
    (["--compute", "a8"], "--compute a8 is for CPU targets"),
])
def test_bad_cuda_options_are_one_line(tiny, tmp_path, capsys, argv, message) -> None:
    path = str(tiny(SPECS["gqa"], "gguf"))
    assert main(["compile", path, "--target", "cuda", "-o", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


@pytest.mark.parametrize(("argv", "message"), [
    (["--gpu", "sm_80"], "--gpu names the GPUs of --target cuda"),
    (["--target", "cuda", "--cpu", "znver4"], "--cpu names the CPU of --target cpu"),
    (["--requantize"], "--requantize converts tensors to --quant"),
])
def test_an_option_of_another_target_or_none_is_one_line(tiny, tmp_path, capsys, argv, message) -> None:
    """--gpu on a CPU compile, --cpu on a CUDA one, --requantize without a type: each was ignored without a word."""
    path = str(tiny(SPECS["gqa"], "gguf"))
    assert main(["compile", path, *argv, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err and not (tmp_path / "out").exists()


def test_malformed_launch_plan_is_refused(cuda_artifact, tmp_path) -> None:
    directory, _ = cuda_artifact(SPECS["gqa"])
    copy = tmp_path / "bad"
    shutil.copytree(directory, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["entry_points"]["decode"]["launches"][0]["args"][0] = {"argument": "/etc/passwd", "offset": 0}
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="malformed launch"):
        load_manifest(copy)


@pytest.mark.skipif(_gpu_present(), reason="a GPU is present")
def test_running_without_a_gpu_is_one_line(cuda_artifact, capsys) -> None:
    directory, _ = cuda_artifact(SPECS["gqa"])
    assert main(["run", str(directory), "-p", "hello", "-n", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ("GPU" in err or "cuda-bindings" in err or "driver" in err)


# on a GPU --------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("chunk", [4, 16], ids=["gemv", "tensor-cores"])
@pytest.mark.parametrize("spec", [SPECS["qwen2-bias-untied-odd-heads"], QSPECS["k-quants"], QSPECS["mixed"]],
                         ids=["f32-odd-heads", "k-quants", "mixed"])
def test_gpu_matches_the_emulator(cuda_artifact, spec: TinySpec, chunk: int) -> None:
    """The GPU runs the artifact (each entry point replayed from a CUDA graph; with 16-row chunks prefill
    and score on tensor cores) as the CPU emulator does, which the tests above hold to the interpreters."""
    if not _gpu_present():
        pytest.skip("no NVIDIA GPU")
    directory, _ = cuda_artifact(spec, chunk=chunk)
    gpu = CudaSession(load_manifest(directory))
    try:
        on_gpu = _teacher_forced(gpu)
        gpu.reset()
        scored = gpu.score(TOKENS)
        gpu.reset()
        greedy = [gpu.greedy(TOKENS[:5])]
        for _ in range(4):
            greedy.append(gpu.greedy([greedy[-1]]))
    finally:
        gpu.close()
    emulator = _session(cuda_artifact, spec, chunk=chunk)
    emulated = _teacher_forced(emulator)
    emulator.reset()
    want = [emulator.greedy(TOKENS[:5])]
    for _ in range(4):
        want.append(emulator.greedy([want[-1]]))
    check = _close if chunk == 4 else _close_f16
    check(on_gpu, emulated)
    check(scored, on_gpu)
    assert greedy == want


def test_profile_times_every_decode_launch(cuda_artifact) -> None:
    """`CudaSession.profile` (what benchmarks/cuda_check.py prints per kernel) covers the whole plan."""
    directory, _ = cuda_artifact(QSPECS["mixed"])
    session = _session(cuda_artifact, QSPECS["mixed"])
    session.feed(TOKENS[:5])
    rows = session.profile("decode", TOKENS[5:6])
    plan = load_manifest(directory).entry_points["decode"]["launches"]
    assert [name for name, _, _ in rows] == [launch["kernel"] for launch in plan]
    assert all(t > 0 for _, t, _ in rows)
    weights = load_manifest(directory).data["weights"]
    lm_head = next(b for name, _, b in rows if "n269" in name and name.startswith("matmul"))
    assert lm_head == weights["token_embd"]["bytes"] + weights["output_norm"]["bytes"]  # tied, norm fused
