"""Compiled artifacts of tiny models against the `llm` interpreter, and the runtime around them."""

from __future__ import annotations

import ctypes
import gc
import json
import re
import shutil
import subprocess
import time
from dataclasses import replace
from pathlib import Path

import host
import numpy as np
import pytest
from runtime_only import runtime_only
from tiny_models import TinySpec

from llmc.abi import AMX_FLAG, SYNC_LINE_WORDS, TEAM_SLEEPERS
from llmc.cli import main
from llmc.driver import BackendOptions, compile_model
from llmc.errors import LlmcError
from llmc.frontend import import_model, load_model
from llmc.ir import find_function, tgt
from llmc.ir.interpreter import KVCache, forward_logits
from llmc.passes.pipeline import PHASES, CompileOptions
from llmc.runtime.artifact import ArtifactError
from llmc.runtime.batch import Engine
from llmc.runtime.session import PAGE, CapacityError, Session
from llmc.verify import teacher_forced

SPECS = {
    "gqa": TinySpec(context_length=64),
    "qwen2-bias-untied-odd-heads": TinySpec(arch="qwen2", heads=3, kv_heads=1, hidden=24, tied=False, context_length=64),
}
TOKENS = [5, 17, 42, 100, 150, 7, 9, 11, 200, 3, 4, 66, 250]


def _reference(tiny, spec: TinySpec, tokens: list[int]) -> np.ndarray:
    model = load_model(str(tiny(spec, "gguf")))
    return forward_logits(import_model(model), model.weights, tokens)


def _close(actual: np.ndarray, expected: np.ndarray) -> None:
    scale = np.abs(expected).max()
    assert np.abs(actual - expected).max() <= 1e-4 * scale
    assert (actual.argmax(-1) == expected.argmax(-1)).all()


@pytest.mark.parametrize("group", [True, False], ids=["grouped", "no-group"])
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_compiled_logits_match_the_interpreter(tiny, artifact, spec: TinySpec, group: bool) -> None:
    """Teacher-forced prefill + decode logits at every position equal the `llm` interpreter's."""
    session = Session(artifact(spec, group=group))
    logits = teacher_forced(lambda chunk, start: session.feed(chunk), TOKENS)
    _close(logits, _reference(tiny, spec, TOKENS))


@pytest.mark.parametrize("kv_type,dtype", [("f16", np.float16), ("q8_0", np.int8)])
@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_kv_types_match_the_interpreter_with_that_cache(tiny, artifact, spec: TinySpec, kv_type, dtype) -> None:
    """`--kv-type f16` (the default) and `q8_0`: the artifact stores keys and values in that
    type, like the interpreter given such a cache; against the f32 cache the logits move measurably."""
    if kv_type == "q8_0":
        spec = replace(spec, head_dim=32, hidden=spec.heads * 32)  # whole 32-blocks per head
    session = Session(artifact(spec, kv_type=kv_type))
    assert session.k_cache.dtype == dtype
    logits = teacher_forced(lambda chunk, start: session.feed(chunk), TOKENS)
    model = load_model(str(tiny(spec, "gguf")))
    module = import_model(model)
    cache_type = find_function(module, "forward").function_type.inputs.data[2]
    shape = (*cache_type.shape[:2], len(TOKENS), cache_type.shape[3])
    rounded = forward_logits(module, model.weights, TOKENS, cache=KVCache.zeros(shape, kv_type))
    _close(logits, rounded)
    assert np.abs(rounded - _reference(tiny, spec, TOKENS)).max() > 0  # the cache's rounding is not a no-op


def test_q8_0_kv_needs_head_dims_of_whole_blocks(tiny, artifact) -> None:
    with pytest.raises(LlmcError, match="--kv-type q8_0 needs a head dimension that is a multiple of 32, got 8"):
        artifact(SPECS["gqa"], kv_type="q8_0")


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_prefill_then_decode_equals_longer_prefill(tiny, artifact, spec: TinySpec) -> None:
    session = Session(artifact(spec, chunk=16))
    n, k = 6, 5
    session.feed(TOKENS[:n])
    for token in TOKENS[n : n + k - 1]:
        session.feed([token])
    stepwise = session.feed([TOKENS[n + k - 1]])
    session.reset()
    whole = session.feed(TOKENS[: n + k])
    assert np.abs(stepwise - whole).max() <= 1e-4 * np.abs(whole).max()
    _close(whole[None], _reference(tiny, spec, TOKENS[: n + k])[-1:])


@pytest.mark.parametrize("spec", SPECS.values(), ids=SPECS.keys())
def test_chunked_prefill_equals_unchunked(artifact, spec: TinySpec) -> None:
    """13 tokens in chunks of 4 (prefill, then prefill_kv ×3) equal one prefill of 16 rows."""
    chunked = Session(artifact(spec, chunk=4)).feed(TOKENS)
    whole = Session(artifact(spec, chunk=16)).feed(TOKENS)
    assert np.abs(chunked - whole).max() <= 1e-5 * np.abs(whole).max()


def test_grouping_fuses_kernels(tiny, artifact) -> None:
    grouped = json.loads((artifact(SPECS["gqa"]) / "manifest.json").read_text())
    plain = json.loads((artifact(SPECS["gqa"], group=False) / "manifest.json").read_text())
    assert grouped["compile_options"]["group"] and not plain["compile_options"]["group"]
    ir_grouped = compile_model(str(tiny(SPECS["gqa"], "gguf")), None, CompileOptions(prefill_chunk=4, max_seq=32),
                               BackendOptions(), compile_to="lower", progress=lambda _: None)
    ir_plain = compile_model(str(tiny(SPECS["gqa"], "gguf")), None,
                             CompileOptions(prefill_chunk=4, max_seq=32, group=False), BackendOptions(),
                             compile_to="lower", progress=lambda _: None)
    assert "tgt.swiglu" in ir_grouped and "accumulate" in ir_grouped and "tgt.rms_norm" not in ir_grouped
    assert "tgt.swiglu" not in ir_plain and "tgt.rms_norm" in ir_plain and "tgt.rope" in ir_plain
    assert ir_grouped.count("tgt.") < ir_plain.count("tgt.")


def test_run_cli_generates_and_streams(artifact, capsys) -> None:
    directory = artifact(SPECS["gqa"])
    assert main(["run", str(directory), "-p", "the cat", "-n", "6", "--temperature", "0.8", "--seed", "3"]) == 0
    first = capsys.readouterr()
    assert main(["run", str(directory), "-p", "the cat", "-n", "6", "--temperature", "0.8", "--seed", "3"]) == 0
    assert capsys.readouterr().out == first.out  # seeded sampling is reproducible
    assert "prompt tokens" in first.err


def test_top_k_one_is_greedy(artifact, capsys) -> None:
    directory = str(artifact(SPECS["gqa"]))
    main(["run", directory, "-p", "in 2018", "-n", "8"])
    greedy = capsys.readouterr().out
    main(["run", directory, "-p", "in 2018", "-n", "8", "--temperature", "5", "--top-k", "1", "--seed", "1"])
    assert capsys.readouterr().out == greedy


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--top-p", "0"], "top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "top-p must be in (0, 1]"),
        (["--top-k", "-2"], "top-k must be >= 0"),
    ],
)
def test_bad_sampling_options_are_one_line(artifact, capsys, args: list[str], message: str) -> None:
    assert main(["run", str(artifact(SPECS["gqa"])), "-p", "x", *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_prompt_longer_than_the_cache_is_refused(artifact, capsys) -> None:
    directory = artifact(SPECS["gqa"])
    with pytest.raises(CapacityError, match="KV cache"):
        Session(directory).feed(list(range(33)))
    assert main(["run", str(directory), "-p", "the " * 40]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "KV cache holds 32" in err


def test_generation_stops_at_capacity(artifact, capsys) -> None:
    assert main(["run", str(artifact(SPECS["gqa"])), "-p", "the cat", "-n", "100"]) == 0
    assert "generated" in capsys.readouterr().err


def test_modified_artifact_is_refused(artifact, tmp_path, capsys) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(artifact(SPECS["gqa"]), copy)
    weights = copy / "weights.bin"
    data = bytearray(weights.read_bytes())
    data[100] ^= 1
    weights.write_bytes(bytes(data))
    with pytest.raises(ArtifactError, match="do not match the manifest"):
        Session(copy)
    assert main(["run", str(copy), "-p", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "weights.bin" in err


def test_unknown_schema_is_refused(artifact, tmp_path) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(artifact(SPECS["gqa"]), copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["schema_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError, match="schema version 99"):
        Session(copy)


def test_compile_cli_options(tiny, tmp_path, capsys) -> None:
    model = str(tiny(SPECS["gqa"], "gguf"))
    assert main(["compile", model, "--compile-to", "lower", "--prefill-chunk", "4", "--max-seq", "32"]) == 0
    captured = capsys.readouterr()
    assert 'llm.phase = "lower"' in captured.out and "tgt.attention" in captured.out
    assert "lower" in captured.err  # progress per phase
    assert main(["compile", model, "--max-seq", "1000"]) == 2
    assert "--max-seq must be in 2..64" in capsys.readouterr().err
    assert main(["compile", model, "--max-seq", "1"]) == 2  # (no room for a token after the prompt's)
    assert "--max-seq must be in 2..64 (the model's context length), got 1" in capsys.readouterr().err
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    assert main(["compile", model, "-o", str(busy), "--max-seq", "32"]) == 2
    assert "holds no llmc artifact" in capsys.readouterr().err
    assert (busy / "notes.txt").exists()
    dumps = tmp_path / "dumps"
    assert main(["compile", model, "-o", str(tmp_path / "a"), "--max-seq", "32", "--dump-ir", str(dumps)]) == 0
    names = sorted(p.name for p in dumps.iterdir())
    assert names[0] == "00-phase-import.mlir" and any("plan-memory" in n for n in names)


@pytest.mark.parametrize("form", ["gguf", "hf"])
def test_graph_only_options_are_refused_for_other_models(tiny, tmp_path, capsys, form: str) -> None:
    """--no-raise and --tokenizer name a .pt2/.onnx graph's raisings and tokenizer: on a GGUF file or an HF
    directory they would do nothing, so they are refused (compile, verify, perplexity alike)."""
    model = str(tiny(SPECS["gqa"], form))
    text = tmp_path / "t.txt"
    text.write_text("one two three four five six seven eight nine ten")
    for argv, message in [(["compile", model, "--no-raise", "rope", "-o", str(tmp_path / "a")], "--no-raise is for"),
                          (["compile", model, "--tokenizer", model, "-o", str(tmp_path / "a")], "--tokenizer is for"),
                          (["verify", model, "--no-raise", "rope"], "--no-raise is for"),
                          (["perplexity", model, "--text", str(text), "--tokenizer", model], "--tokenizer is for")]:
        assert main(argv) == 2, argv
        errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("llmc: error")]
        assert len(errors) == 1 and message in errors[0] and "graph" in errors[0], errors
    assert not (tmp_path / "a").exists()


def test_compile_to_stops_after_that_phase(tiny, capsys) -> None:
    """`--compile-to P` prints P's IR and runs no phase after it (import included)."""
    model = str(tiny(SPECS["gqa"], "gguf"))
    for i, phase in enumerate(PHASES):
        assert main(["compile", model, "--compile-to", phase, "--prefill-chunk", "4", "--max-seq", "32"]) == 0
        out, err = capsys.readouterr()
        assert f'llm.phase = "{phase}"' in out, phase
        ran = [line.split()[0] for line in err.splitlines() if line.split() and line.split()[0] in PHASES]
        assert ran == list(PHASES)[: i + 1], err


def test_unwritable_ir_outputs_are_refused_before_the_work(tiny, tmp_path, capsys) -> None:
    """An `-o` for IR text that is a folder or lies in no folder, and a `--dump-ir` that is a file, end in one
    line and exit 2 before any phase runs (`llmc ir`, `opt`, `compile --compile-to`)."""
    model = str(tiny(SPECS["gqa"], "gguf"))
    ir_file = tmp_path / "q.mlir"
    assert main(["ir", model, "-o", str(ir_file)]) == 0
    capsys.readouterr()
    folder, a_file, nowhere = tmp_path / "folder", tmp_path / "a_file", tmp_path / "missing" / "x.mlir"
    folder.mkdir()
    a_file.write_text("mine")
    for command, message in [
        (["ir", model, "-o", str(folder)], "it is a folder"),
        (["opt", str(ir_file), "-o", str(folder)], "it is a folder"),
        (["compile", model, "--compile-to", "split", "-o", str(folder)], "it is a folder"),
        (["compile", model, "--compile-to", "split", "-o", str(nowhere)], "there is no folder"),
        (["ir", model, "-o", str(nowhere)], "there is no folder"),
        (["compile", model, "--compile-to", "optimize", "--dump-ir", str(a_file)], "cannot write --dump-ir"),
    ]:
        assert main(command) == 2, command
        out, err = capsys.readouterr()
        assert err.count("\n") == 1 and message in err and "import" not in err, (command, err)
    assert a_file.read_text() == "mine" and not nowhere.parent.exists()


def test_ir_outputs_over_the_model_are_refused(tiny, tmp_path, capsys) -> None:
    """`llmc ir m.gguf -o m.gguf`, `-o` a file inside an HF model's folder, `compile --compile-to … -o` the model:
    refused in one line, the model as it was (was: the IR written over the weights or config.json, exit 0)."""
    gguf_model, hf_model = tmp_path / "m.gguf", tiny(SPECS["gqa"], "hf")
    shutil.copy(tiny(SPECS["gqa"], "gguf"), gguf_model)
    before = {p: p.read_bytes() for p in (gguf_model, *hf_model.iterdir())}
    for command, message in [
        (["ir", str(gguf_model), "-o", str(gguf_model)], f"it would be {gguf_model}, which this command reads"),
        (["compile", str(gguf_model), "--compile-to", "import", "-o", str(gguf_model)], "which this command reads"),
        (["ir", str(hf_model), "-o", str(hf_model / "config.json")], f"it would be inside {hf_model}"),
        (["ir", str(hf_model), "-o", str(hf_model / "new.safetensors")], f"it would be inside {hf_model}"),
    ]:
        assert main(command) == 2, command
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (command, err)
    assert {p: p.read_bytes() for p in (gguf_model, *hf_model.iterdir())} == before


def test_a_second_compile_takes_the_kernels_from_the_cache(tiny, tmp_path, monkeypatch) -> None:
    """Each kernel is compiled and cached alone: the same model compiled again adds no cache entry and
    gives the same library; with another KV capacity only the kernels that changed are compiled (the
    projections' are shared); `--no-cache` neither reads nor writes the cache."""
    monkeypatch.setenv("LLMC_CACHE_DIR", str(tmp_path / "cache"))
    model = str(tiny(SPECS["gqa"], "gguf"))

    def compiled(name: str, *options: str) -> tuple[Path, set[str]]:
        assert main(["compile", model, "-o", str(tmp_path / name), "--max-seq", "32", *options]) == 0
        return next((tmp_path / name).glob("kernels-*.so")), {p.name for p in (tmp_path / "cache" / "kernels").iterdir()}

    first, entries = compiled("a")
    assert len(entries) > 2  # the entry points' module and the kernels', each alone
    again, entries_again = compiled("b")
    assert entries_again == entries and again.name == first.name and again.read_bytes() == first.read_bytes()
    _, entries_longer = compiled("c", "--max-seq", "48")
    assert 0 < len(entries_longer - entries) < len(entries)
    for entry in (tmp_path / "cache" / "kernels").iterdir():
        entry.unlink()
    compiled("d", "--no-cache")
    assert not list((tmp_path / "cache" / "kernels").iterdir())
    compiled("e")  # the cache is back once that compile is done
    assert list((tmp_path / "cache" / "kernels").iterdir())


def test_runtime_runs_without_the_compiler_stack(artifact) -> None:
    directory = artifact(SPECS["gqa"])
    proc = subprocess.run(
        runtime_only("", "run", str(directory), "-p", "the cat", "-n", "4"),
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "4 generated" in proc.stderr or "generated" in proc.stderr
    bench = subprocess.run(
        runtime_only("", "bench", str(directory), "--prompt-tokens", "8", "--decode-tokens", "4", "--repeat", "1"),
        capture_output=True, text=True, timeout=120,
    )
    assert bench.returncode == 0, bench.stderr
    assert "tokens/s" in bench.stdout
    text = directory / "text.txt"  # (not a file of the artifact: its manifest does not list it)
    text.write_text("the cat in the hat " * 10)
    scored = subprocess.run(
        runtime_only("", "perplexity", str(directory), "--text", str(text), "--ctx", "8"),
        capture_output=True, text=True, timeout=120,
    )
    text.unlink()
    assert scored.returncode == 0, scored.stderr
    assert scored.stdout.startswith("perplexity ")


def test_chat_template_renders_in_a_sandbox(artifact, capsys) -> None:
    from llmc.runtime.codec import TextCodec

    codec = TextCodec.from_artifact(Session(artifact(SPECS["gqa"])).manifest)
    assert codec.chat("hi") == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    codec.chat_template = "{{ ''.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(LlmcError, match="chat template failed: .*unsafe"):
        codec.chat("hi")
    assert main(["run", str(artifact(SPECS["gqa"])), "-p", "hi", "--chat", "-n", "3"]) == 0
    assert "prompt tokens" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("edit", "message", "batch"),
    [
        (lambda m: m.pop("kv_cache"), "missing field 'kv_cache'", 1),
        (lambda m: m["entry_points"]["decode"].update(symbol="system"), "has symbol 'system'", 1),
        (lambda m: m["kv_cache"].update(shape=[1, 2, -3, 4]), "kv_cache.shape", 1),
        (lambda m: m["files"]["kernels"].update(path="../elsewhere.so"), "outside the artifact directory", 1),
        (lambda m: m["kv_cache"].update(capacity=2), "matching kv_cache.capacity", 1),
        (lambda m: m["kv_cache"].update(slots=2), "decode's rows on the cache's slots", 1),
        (lambda m: m["kv_cache"].update(layout="layer,slot,kv_head,position,dim"), "kv_cache.layout", 1),
        (lambda m: m["entry_points"]["decode"]["arguments"].append("slots"), "takes the rows' slots", 1),
        (lambda m: m["kv_cache"]["shape"].__setitem__(1, 3), "matching kv_cache.capacity and kv_cache.slots", 4),
        (lambda m: m["entry_points"]["prefill"]["arguments"].remove("slots"), "lacks the rows' slots", 4),
    ],
    ids=["missing-field", "foreign-symbol", "negative-shape", "kernels-outside", "capacity", "slots", "layout",
         "slots-argument", "batched-shape", "batched-without-slots"],
)
def test_malformed_manifest_is_refused(artifact, tmp_path, capsys, edit, message: str, batch: int) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(artifact(SPECS["gqa"], **({"max_batch": batch} if batch > 1 else {})), copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert main(["run", str(copy), "-p", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_more_threads_than_the_kernels_split_for_is_one_line(artifact, capsys) -> None:
    assert main(["run", str(artifact(SPECS["gqa"])), "-p", "x", "-n", "1", "--threads", "65"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--threads must be in 1..64" in err


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("name", ["f32-odd-heads", "a8-mixed", "a8-half-groups"])
def test_threads_give_the_single_thread_logits(artifact, threads: int, name: str) -> None:
    """Threads split each kernel's outputs (and quantize the int8 blocks they computed; the projections deal
    their last columns from work counters, which the barriers zero for the next call); only
    decode's attention sums its positions in another order (each thread's share, merged), so
    the logits agree to rounding, and a run repeats bit for bit: running truly in parallel,
    no thread disturbs another."""
    spec = {"f32-odd-heads": SPECS["qwen2-bias-untied-odd-heads"], "a8-mixed": QSPECS["mixed"],
            "a8-half-groups": QSPECS["half-groups"]}[name]
    directory = artifact(spec, chunk=4)
    one, many = Session(directory, threads=1), Session(directory, threads=threads)
    runs = []
    for _ in range(3):  # repeated: a race would show up now and then
        one.reset(), many.reset()
        got = [many.feed(chunk).copy() for chunk in (TOKENS[:7], TOKENS[7:8], TOKENS[8:])] + [many.score(TOKENS[:5])]
        want = [one.feed(chunk).copy() for chunk in (TOKENS[:7], TOKENS[7:8], TOKENS[8:])] + [one.score(TOKENS[:5])]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=0, atol=1e-3 * np.abs(w).max())
        for session in (one, many):  # every work counter zeroed for the next call (one thread: by no one else)
            assert not session.sync[SYNC_LINE_WORDS:].any()
        runs.append(got)
    for run in runs[1:]:
        for g, first in zip(run, runs[0]):
            np.testing.assert_array_equal(g, first)
    many.close()


def test_the_thread_team_wakes_after_sleeping_and_stops_on_close(artifact) -> None:
    """Workers spin for a while after a call, then sleep on a futex (`backends/cpu/team.py`): a call after
    they all slept wakes them and gives the same logits; closing the session ends them."""
    session = Session(artifact(QSPECS["mixed"], chunk=4), threads=3)
    first = session.feed(TOKENS[:7]).copy()
    deadline = time.monotonic() + 30
    while session.team.words[TEAM_SLEEPERS] < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert session.team.words[TEAM_SLEEPERS] == 2
    session.reset()
    np.testing.assert_array_equal(session.feed(TOKENS[:7]), first)
    workers = session.team.workers
    session.close()
    assert len(workers) == 2 and not any(worker.is_alive() for worker in workers)
    session.close()  # twice is harmless


def test_what_the_kernels_read_through_vectors_starts_on_a_page(artifact) -> None:
    """The session's KV cache, arena, logits, barrier and team words, and an engine's logits, start on a page
    (numpy's own large arrays start 16 bytes past a cache line: a cache row of 128 bytes then spans three lines,
    and the barrier's words share theirs with the work counters), and zeroed."""
    session = Session(artifact(QSPECS["mixed"], chunk=4), threads=2)
    engine = Engine(session, end_ids=())
    arrays = {"k_cache": session.k_cache, "v_cache": session.v_cache, "arena": session.arena, "sync": session.sync,
              "team": session.team.words, "logits": session.logits, "engine logits": engine.logits,
              "verify logits": engine.verify_logits}
    for name, array in arrays.items():
        assert array.ctypes.data % PAGE == 0, name
    assert not session.k_cache.any() and session.arena.size >= session.manifest.entry_points["decode"]["arena_bytes"]
    assert session.k_cache.shape == tuple(session.manifest.kv_cache["shape"])
    session.close()


def test_a_session_dropped_without_close_stops_its_workers(artifact) -> None:
    """The workers watch the team's memory: a session collected without `close()` stops them first
    (they once read freed memory as a new job, and crashed the process)."""
    session = Session(artifact(QSPECS["mixed"], chunk=4), threads=3)
    session.feed(TOKENS[:7])
    workers = session.team.workers
    del session
    gc.collect()
    for worker in workers:
        worker.join(timeout=30)
    assert not any(worker.is_alive() for worker in workers)


@pytest.mark.parametrize("role", ["kernels", "weights"])
def test_files_swapped_after_the_check_are_not_used(artifact, tmp_path, role: str) -> None:
    """The bytes that were hashed are the bytes used: the kernels loaded, and the weights a session has read
    (it hashes its own copy of them)."""
    import shutil

    from llmc.runtime.artifact import load_manifest, load_verified_library

    copy = tmp_path / "copy"
    shutil.copytree(artifact(SPECS["gqa"]), copy)
    manifest = load_manifest(copy)  # every file checks out
    path = manifest.file(role)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))  # swapped between the check and the load
    with pytest.raises(ArtifactError, match=f"{path.name}: contents do not match the manifest"):
        load_verified_library(manifest) if role == "kernels" else Session(manifest)


def test_a_session_hashes_each_file_once(artifact, monkeypatch) -> None:
    """The manifest's check leaves the kernels and the weights to the session, which hashes them as it reads
    them: each file is read once."""
    from llmc.runtime import artifact as artifact_module

    hashed, sha256_file = [], artifact_module.sha256_file
    monkeypatch.setattr(artifact_module, "sha256_file", lambda path: hashed.append(path.name) or sha256_file(path))
    Session(artifact(SPECS["gqa"])).close()
    assert hashed == ["tokenizer.json"], hashed


@pytest.mark.parametrize(
    "argv",
    [["run", "x", "-p", "y", "-n", "-1"], ["compile", "m", "--max-seq", "abc"], ["run"], ["frob"],
     ["bench", "x", "--threads", "0"]],
)
def test_bad_options_are_one_line(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ": error: " in err and "--help" in err


def test_an_unknown_option_points_at_its_commands_help(capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["run", "x", "-p", "y", "--frob"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == "llmc run: error: unrecognized arguments: --frob (see 'llmc run --help')\n"


# quantized artifacts ---------------------------------------------------------------

_PROJ = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
QSPECS = {
    "mixed": TinySpec(hidden=64, heads=2, kv_heads=1, head_dim=32, ffn=128, context_length=64, gguf_storage=(
        ("token_embd", "q8_0"), ("attn_q", "q4_1"), ("attn_k", "q4_0"), ("attn_v", "q8_0"), ("attn_output", "q5_0"),
        ("ffn_gate", "q5_1"), ("ffn_up", "q4_1"), ("ffn_down", "f16"))),
    "k-quants": TinySpec(hidden=256, heads=4, kv_heads=2, head_dim=64, ffn=512, context_length=64, gguf_storage=(
        ("token_embd", "q6_k"), ("attn_q", "q4_k"), ("attn_k", "q5_k"), ("attn_v", "q6_k"), ("attn_output", "q4_k"),
        ("ffn_gate", "q5_k"), ("ffn_up", "q4_k"), ("ffn_down", "q6_k"))),
    "half-groups": TinySpec(hidden=96, heads=3, kv_heads=1, head_dim=32, ffn=160, context_length=64,
                            gguf_storage=(("token_embd", "q8_0"), *((k, "q4_1") for k in _PROJ))),
    "head-dim-16": TinySpec(arch="qwen2", hidden=64, heads=4, kv_heads=2, head_dim=16, ffn=128, context_length=64,
                            gguf_storage=tuple((k, "q8_0") for k in _PROJ)),
}


def _stage_logits(tiny, spec: TinySpec, tokens: list[int], form: str = "gguf", **options) -> np.ndarray:
    """The quantize stage's logits, teacher-forced one token at a time (as the artifact runs)."""
    from llmc.backends.cpu.target import cpu_target
    from llmc.ir.interpreter import KVCache
    from llmc.passes.pipeline import run_phase

    model = load_model(str(tiny(spec, form)))
    module = import_model(model)
    module.attributes[tgt.TARGET] = cpu_target("native")
    for phase in ("import", "optimize", "quantize"):
        run_phase(module, phase, options=CompileOptions(**options))
    cache = KVCache.for_type(find_function(module, "forward").function_type.inputs.data[2], len(tokens))
    return teacher_forced(lambda chunk, start: forward_logits(module, model.weights, chunk, start, cache)[-1], tokens)


def _cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


@pytest.mark.parametrize("spec", QSPECS.values(), ids=QSPECS.keys())
def test_a32_artifacts_compute_the_quantize_stage_exactly(tiny, artifact, spec: TinySpec) -> None:
    """Integer weights dequantized in registers: the same numbers as the graph, within float rounding."""
    session = Session(artifact(spec, compute="a32"))
    _close(teacher_forced(lambda chunk, start: session.feed(chunk), TOKENS),
           _stage_logits(tiny, spec, TOKENS, compute="a32"))


@pytest.mark.parametrize("cpu", ["native", "x86-64-v3"])
@pytest.mark.parametrize("spec", QSPECS.values(), ids=QSPECS.keys())
def test_a8_artifacts_agree_with_the_quantize_stage(tiny, artifact, spec: TinySpec, cpu: str) -> None:
    """Integer dot products (VNNI here, pmaddubsw for x86-64-v3). An activation within a float bit of an
    int8 rounding tie may round the other way in compiled code than in numpy, so the bound is a cosine."""
    if cpu != "native":
        host.skip_unless_another_path(cpu)
    directory = artifact(spec, cpu=cpu)
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["cpu"]["name"] == ("x86-64-v3" if cpu != "native" else manifest["cpu"]["name"])
    session = Session(directory)
    ours = teacher_forced(lambda chunk, start: session.feed(chunk), TOKENS)
    reference = _stage_logits(tiny, spec, TOKENS)
    assert _cosines(ours, reference).min() > 0.999
    assert (ours.argmax(-1) == reference.argmax(-1)).mean() >= 0.9


LONG = [int(t) for t in np.random.default_rng(3).integers(0, 256, 45)]


AMX_SPECS = {name: QSPECS[name] for name in ("mixed", "k-quants", "half-groups")}


@pytest.mark.parametrize("spec", AMX_SPECS.values(), ids=AMX_SPECS.keys())
def test_prefill_for_amx_takes_tiles_and_decode_keeps_vnni(tiny, artifact, spec: TinySpec) -> None:
    """On every host, compiled for a CPU with AMX-INT8 (chunks of 32 rows): the a8 projections of
    prefill and score take `isa amx`, decode keeps VNNI-512; the kernels hold the `llmc_amx` flag
    the runtime sets, and a host without those features refuses the artifact in one line."""
    cpu = host.ISA_CPUS[tgt.Isa.AMX]
    text = compile_model(str(tiny(spec, "gguf")), None, CompileOptions(prefill_chunk=32, max_seq=64, compute="a8"),
                         BackendOptions(cpu=cpu), compile_to="lower", progress=lambda _: None)
    prefill, decode = text[text.index("@prefill("):text.index("@prefill_kv(")], text[text.index("@decode("):text.index("@score(")]
    assert "isa amx" in prefill and "isa amx" not in decode and "isa vnni512" in decode
    directory = artifact(spec, chunk=32, max_seq=64, cpu=cpu, compute="a8")
    manifest = json.loads((directory / "manifest.json").read_text())
    library = ctypes.CDLL(str(directory / manifest["files"]["kernels"]["path"]))  # loading runs no kernel
    assert ctypes.c_int32.in_dll(library, AMX_FLAG).value == 0  # tiles off until the runtime asks
    if not host.runs(cpu):
        with pytest.raises(ArtifactError, match="lacks"):
            Session(directory)


@pytest.mark.parametrize("compute", ["a8", "a16"])
@pytest.mark.parametrize("spec", AMX_SPECS.values(), ids=AMX_SPECS.keys())
def test_prefill_on_amx_tiles_agrees_with_the_quantize_stage(tiny, artifact, spec: TinySpec, compute: str) -> None:
    """Run on an AMX host: prefill and score of int8 or int16 rows on two 16-row tiles (the 13 rows of the
    last chunk on VNNI) as close to the reference as VNNI; with the tiles refused, the same kernels on VNNI
    alone."""
    from llmc.backends.cpu.target import cpu_target
    from llmc.passes.pipeline import run_phase

    if not host.runs(host.ISA_CPUS[tgt.Isa.AMX]):
        pytest.skip(host.why_not(host.ISA_CPUS[tgt.Isa.AMX]))
    session = Session(artifact(spec, chunk=32, max_seq=64, compute=compute))
    assert session.amx
    ours = session.score(LONG)
    model = load_model(str(tiny(spec, "gguf")))
    module = import_model(model)
    module.attributes[tgt.TARGET] = cpu_target("native")
    for phase in ("import", "optimize", "quantize"):
        run_phase(module, phase, options=CompileOptions(compute=compute))
    reference = forward_logits(module, model.weights, LONG)
    assert _cosines(ours, reference).min() > 0.999
    assert (ours.argmax(-1) == reference.argmax(-1)).mean() >= 0.9
    flag = ctypes.c_int32.in_dll(session.library, AMX_FLAG)
    flag.value = 0
    session.reset()
    vnni = session.score(LONG)  # (sums in another order: an int8 rounding may flip, so cosines again)
    assert _cosines(vnni, reference).min() > 0.999
    assert (vnni.argmax(-1) == reference.argmax(-1)).mean() >= 0.9
    session.close()


def test_the_tgt_interpreter_reproduces_the_quantize_stage(tiny) -> None:
    """Lowering, packing and the memory plan change no number: the numpy kernels over the packed
    weights and the planned arena give the quantize stage's logits."""
    from llmc.backends.cpu.target import cpu_target
    from llmc.ir.tgt_interpreter import KernelWeights, cache_for, run_entry
    from llmc.passes.pipeline import PHASES, run_phase

    for name, spec in QSPECS.items():
        model = load_model(str(tiny(spec, "gguf")))
        module = import_model(model)
        module.attributes[tgt.TARGET] = cpu_target("native")
        for phase in PHASES:
            run_phase(module, phase, options=CompileOptions(prefill_chunk=4, max_seq=32, kv_type="f32"))
        entries = {e: find_function(module, e) for e in ("prefill", "decode")}
        cache = cache_for(entries["decode"].body.block.args[3].type)
        weights = KernelWeights(model.weights)
        ours = teacher_forced(lambda chunk, start: run_entry(entries["prefill" if start == 0 else "decode"], weights,
                                                             np.asarray(chunk, np.int32), start, cache)[0], TOKENS)
        reference = _stage_logits(tiny, spec, TOKENS)
        assert np.abs(ours - reference).max() <= 1e-4 * np.abs(reference).max(), name


def test_quantized_artifacts_store_the_chosen_types(tiny, artifact) -> None:
    """The manifest records each weight's storage type and the layout `pack` chose for this host."""
    from llmc.backends.cpu.target import cpu_target, integer_isa, tiles_layout

    directory = artifact(QSPECS["k-quants"])
    manifest = json.loads((directory / "manifest.json").read_text())
    weights = manifest["weights"]
    assert weights["blk.0.attn_q"]["storage"] == "q4_k" and weights["blk.1.ffn_down"]["storage"] == "q6_k"
    own = integer_isa(cpu_target("native"))
    packed = "split" if own is tgt.Isa.GENERIC else tiles_layout(own).value
    assert {w["layout"] for n, w in weights.items() if w["storage"] != "f32"} == {packed}
    assert manifest["entry_points"]["decode"]["arguments"] == ["tokens", "positions", "n", "k_cache", "v_cache",
                                                                "logits", "arena", "weights", "tid", "nth", "sync"]
    stored = sum(load_model(str(tiny(QSPECS["k-quants"], "gguf"))).weights[n].data.nbytes for n in weights)
    assert (directory / "weights.bin").stat().st_size <= 1.05 * stored


@pytest.mark.parametrize("isa", [i for i in tgt.Isa if i in host.ISA_CPUS and i is not tgt.Isa.AMX])
def test_each_cpu_gets_its_integer_path_and_layout(tiny, isa: tgt.Isa) -> None:
    """Whatever the host, compiling for a named CPU chooses that CPU's integer dot product for every
    a8 kernel, and the weight layout it reads: `tiles` wherever it has an integer dot product (`tiles_avx2`
    without AVX-512)."""
    from llmc.backends.cpu.target import tiles_layout

    ir_text = compile_model(str(tiny(QSPECS["k-quants"], "gguf")), None,
                            CompileOptions(prefill_chunk=4, max_seq=32, compute="a8"),  # (a32 is x86-64's default)
                            BackendOptions(cpu=host.ISA_CPUS[isa]), compile_to="lower", progress=lambda _: None)
    packed = "split" if isa is tgt.Isa.GENERIC else tiles_layout(isa).value
    assert f"!tgt.weight<256x256, q4_k, {packed}>" in ir_text and "!tgt.qrows<" in ir_text
    assert set(re.findall(r" isa (\w+)", ir_text)) == {isa.value}


def test_float_models_take_quant(tiny, artifact) -> None:
    spec = QSPECS["mixed"]
    directory = artifact(spec, form="hf", quant="q8_0")
    manifest = json.loads((directory / "manifest.json").read_text())
    assert manifest["weights"]["blk.0.attn_q"]["storage"] == "q8_0"
    assert manifest["compile_options"]["quant"] == "q8_0"
    session = Session(directory)
    ours = teacher_forced(lambda chunk, start: session.feed(chunk), TOKENS)
    reference = _stage_logits(tiny, spec, TOKENS, form="hf", quant="q8_0")
    assert _cosines(ours, reference).min() > 0.999


def test_score_returns_every_rows_logits(tiny, artifact) -> None:
    """The `score` entry point: a prompt's logits at every position, in chunks, from an empty cache."""
    spec = QSPECS["mixed"]
    session = Session(artifact(spec, compute="a32"))
    scores = session.score(TOKENS)
    assert scores.shape == (len(TOKENS), session.vocab_size)
    reference = _stage_logits(tiny, spec, TOKENS, compute="a32")
    _close(scores, reference)
    assert session.position == len(TOKENS)
    session.reset()
    session.feed(TOKENS[:5])  # with history in the cache
    _close(session.score(TOKENS[5:]), reference[5:])


def test_perplexity_cli_on_a_tiny_model(tiny, artifact, tmp_path, capsys) -> None:
    directory = artifact(QSPECS["mixed"])
    text = tmp_path / "text.txt"
    text.write_text("the cat in the hat sat on the mat in 2018 and then the cat ran " * 4 + "\n")
    assert main(["perplexity", str(directory), "--text", str(text), "--ctx", "16", "--kl-base", str(directory)]) == 0
    out = capsys.readouterr().out
    ppl = float(re.search(r"^perplexity (\S+) ± ", out, re.M)[1])
    assert 1 < ppl < float("inf")  # a random-weight model: a poor predictor, but a number
    assert re.search(r"^mean KL\s+0\.000000", out, re.M) and "same top   100.000" in out
    assert main(["perplexity", str(directory), "--text", str(text), "--ctx", "512"]) == 2
    assert "needs at least 1024" in capsys.readouterr().err
    assert main(["perplexity", str(directory), "--text", "/dev/zero"]) == 2  # (was read until memory ran out)
    assert "--text /dev/zero: larger than 268435456 bytes" in capsys.readouterr().err
    for option in (["--speculate", "3"], ["--no-raise", "rope"], ["--tokenizer", "x"], ["--kv-type", "q8_0"]):
        assert main(["perplexity", str(directory), "--text", str(text), "--ctx", "512", *option]) == 2
        assert "the compile options do not apply to it" in capsys.readouterr().err, option  # (not silently ignored)
    model = tiny(QSPECS["mixed"], "gguf")  # (compiled first: --max-seq below --ctx was raised without a word)
    assert main(["perplexity", str(model), "--text", str(text), "--ctx", "16", "--max-seq", "8"]) == 2
    assert "--max-seq 8 is below --ctx 16" in capsys.readouterr().err
    context = QSPECS["mixed"].context_length  # (was: "--max-seq must be in 2..N", an option not given, after a compile)
    assert main(["perplexity", str(model), "--text", str(text), "--ctx", str(context + 1)]) == 2
    err = capsys.readouterr().err
    assert err == f"llmc: error: --ctx {context + 1} is past the context of {model}, {context} tokens; choose a " \
                  f"smaller --ctx\n", err


def test_an_artifact_for_a_cpu_this_machine_lacks_is_refused(artifact, tmp_path, capsys) -> None:
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(artifact(QSPECS["mixed"]), copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["cpu"]["features"].append("avx1024")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert main(["run", str(copy), "-p", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lacks (avx1024)" in err


def test_compute_and_quant_options_that_apply_to_nothing_are_noted(tiny, capsys) -> None:
    """`--compute a8` on float weights runs a32, and `--quant q4_0` on a quantized GGUF keeps its types without
    `--requantize`: each says so in a note (they were silently ignored); with what they apply to, no note."""
    floats, mixed = str(tiny(SPECS["gqa"], "gguf")), str(tiny(QSPECS["mixed"], "gguf"))
    for argv, note in (([floats, "--compute", "a8"], "--compute a8 is for integer weights"),
                       ([floats, "--compute", "a8", "--quant", "q8_0"], None),
                       ([mixed, "--quant", "q4_0"], "this model's q4_1, q5_0, q5_1, q8_0 ones keep their types"),
                       ([mixed, "--quant", "q4_0", "--requantize"], None)):
        assert main(["compile", *argv, "--compile-to", "quantize", "-o", "-"]) == 0
        err = capsys.readouterr().err
        assert ("note:" in err) == (note is not None) and (note or "") in err, (argv, err)
