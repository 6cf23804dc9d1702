"""Artifacts and output folders, tried as an attacker and as a careless user would.

An artifact is a program, but its manifest must not turn the kernels against the user: every
crafted manifest below ends in one `ArtifactError` line (`llmc run`: exit 2), quickly, with or
without `--no-verify` (which skips hashing only). `llmc compile -o` replaces only an artifact or
an empty folder, refuses anything else (or an unwritable place) before compiling, and writes
beside the old artifact so that a failed compile leaves it as it was.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from hostile import MAX_SECONDS, assert_one_clean_line, hang_guard
from test_compile import SPECS
from tiny_models import TinySpec

from llmc.cli import main
from llmc.driver import BackendOptions, compile_model
from llmc.passes.pipeline import CompileOptions
from llmc.runtime.artifact import MANIFEST, ArtifactError, load_manifest
from llmc.runtime.cuda import check_kernels
from llmc.runtime.session import HUGE_PAGE, Session, load_weights, open_session

SPEC = SPECS["gqa"]  # (the artifact test_compile.py builds too: one compile for both)


def _copy(source: Path, to: Path) -> Path:
    shutil.copytree(source, to)
    return to


def _edit_manifest(directory: Path, edit: Callable[[dict], object]) -> None:
    path = directory / MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))


def _snapshot(directory: Path) -> dict[str, bytes]:
    """Every file under `directory` (names relative to it) with its bytes."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def _refused(argv: list[str], capsys: pytest.CaptureFixture[str], *details: str) -> str:
    """`llmc argv` ends in exit 2 and one clean `llmc: error:` line holding each detail, within the time bound."""
    capsys.readouterr()
    start = time.process_time()
    with hang_guard():
        code = main(argv)
    seconds = time.process_time() - start
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmc: error:"), err
    assert_one_clean_line(lines[0])
    for detail in details:
        assert detail in lines[0], lines[0]
    assert seconds < MAX_SECONDS, f"refused after {seconds:.2f} s: {lines[0]}"
    return lines[0]


# crafted manifests of a CPU artifact ---------------------------------------------------------


def _every_entry(**fields) -> Callable[[dict], None]:
    return lambda m: [entry.update(fields) for entry in m["entry_points"].values()]


def _swap_first_arguments(m: dict) -> None:
    arguments = m["entry_points"]["decode"]["arguments"]
    arguments[0], arguments[1] = arguments[1], arguments[0]


def _longer_chunk(m: dict) -> None:
    for name in ("prefill", "prefill_kv", "score"):
        m["entry_points"][name]["max_tokens"] = 8
    m["entry_points"]["score"]["logits"][0] = 8


def _longer_cache(m: dict) -> None:
    m["kv_cache"]["capacity"] = m["kv_cache"]["shape"][-2] = 64


def _larger_vocabulary(m: dict) -> None:
    m["model"]["vocab_size"] += 1
    for entry in m["entry_points"].values():
        entry["logits"][1] += 1


def _truncated_weights(consistent: bool) -> Callable[[Path, dict], None]:
    """weights.bin cut in half; `consistent`: the manifest's size of it too."""

    def edit(directory: Path, m: dict) -> None:
        weights = directory / "weights.bin"
        half = weights.stat().st_size // 2
        os.truncate(weights, half)
        if consistent:
            m["files"]["weights"]["bytes"] = half

    return edit


def _truncated_kernels(directory: Path, m: dict) -> None:
    """The kernels library cut in half, the manifest's size and sha256 of it made to match (the loader would
    map segments past the end: a SIGBUS at the first read)."""
    kernels = directory / m["files"]["kernels"]["path"]
    kernels.write_bytes(kernels.read_bytes()[: kernels.stat().st_size // 2])
    m["files"]["kernels"].update(bytes=kernels.stat().st_size, sha256=hashlib.sha256(kernels.read_bytes()).hexdigest())


def _kernels_elsewhere(how: str) -> Callable[[Path, dict], None]:
    """The kernels entry names a library outside the folder: by absolute path, by `../`, by a symlink."""

    def edit(directory: Path, m: dict) -> None:
        inside = directory / m["files"]["kernels"]["path"]
        outside = directory.parent / f"outside-{inside.name}"
        shutil.copy(inside, outside)
        if how == "absolute":
            m["files"]["kernels"]["path"] = str(outside)
        elif how == "parent":
            m["files"]["kernels"]["path"] = f"../{outside.name}"
        else:
            inside.unlink()
            inside.symlink_to(outside)

    return edit


def _manifest_elsewhere(directory: Path, m: dict) -> None:
    """The manifest a symlink to one outside the folder (its files then named relative to the artifact still)."""
    outside = directory.parent / "outside-manifest.json"
    (directory / MANIFEST).rename(outside)
    (directory / MANIFEST).symlink_to(outside)


def _on_manifest(edit: Callable[[dict], object]) -> Callable[[Path, dict], None]:
    return lambda directory, m: edit(m)


MATCHES = "manifest does not match its kernels: "
CPU_CASES = {
    "arena-0": (_on_manifest(_every_entry(arena_bytes=0)), MATCHES + "entry_points.decode.arena_bytes", []),
    "swapped-arguments": (_on_manifest(_swap_first_arguments), MATCHES + "entry_points.decode.arguments", []),
    "kv-dtype": (_on_manifest(lambda m: m["kv_cache"].update(dtype="f16")), MATCHES + "kv_cache.dtype", []),
    "max-threads": (_on_manifest(lambda m: m.update(max_threads=1000)), MATCHES + "max_threads", ["--threads", "100"]),
    "read-probe": (_on_manifest(lambda m: m.update(read_probe="abort")), MATCHES + "read_probe", []),
    "team-jobs-reordered": (_on_manifest(lambda m: m["team_jobs"].reverse()), MATCHES + "team_jobs", []),
    "team-jobs-missing-one": (_on_manifest(lambda m: m["team_jobs"].pop()), MATCHES + "team_jobs", []),
    "team-jobs-not-names": (_on_manifest(lambda m: m.update(team_jobs=[1])), "team_jobs must be a list", []),
    "cpu-features": (_on_manifest(lambda m: m["cpu"].update(features=[])), MATCHES + "cpu.features", []),
    "chunk": (_on_manifest(_longer_chunk), MATCHES + "entry_points.prefill.max_tokens", []),
    "kv-capacity": (_on_manifest(_longer_cache), MATCHES + "kv_cache.capacity", []),
    "vocabulary": (_on_manifest(_larger_vocabulary), MATCHES + "entry_points.decode.logits", []),
    "weights-table": (_on_manifest(lambda m: m["weights"]["token_embd"].update(offset=1 << 30)),
                      MATCHES + "weights.token_embd.offset", []),
    "weights-truncated": (_truncated_weights(consistent=False), "not the", []),
    "weights-truncated-manifest-too": (_truncated_weights(consistent=True), MATCHES + "files.weights.bytes", []),
    "kernels-truncated-manifest-too": (_truncated_kernels, "a segment ends at byte", []),
    "kernels-absolute": (_kernels_elsewhere("absolute"), "outside the artifact directory", []),
    "kernels-parent": (_kernels_elsewhere("parent"), "outside the artifact directory", []),
    "kernels-symlink": (_kernels_elsewhere("symlink"), "outside the artifact directory", []),
    "manifest-symlink": (_manifest_elsewhere, "a link to a manifest outside the artifact directory", []),
}


@pytest.mark.parametrize("verify", [True, False], ids=["verify", "no-verify"])
@pytest.mark.parametrize("case", CPU_CASES, ids=CPU_CASES.keys())
def test_crafted_cpu_manifest_is_one_line(artifact, tmp_path, capsys, case: str, verify: bool) -> None:
    """Each of these crashed the runtime or loaded code from elsewhere: now one ArtifactError line, before
    any kernel runs; `--no-verify` changes nothing (sizes, places and the kernels' description are
    checked still)."""
    edit, message, options = CPU_CASES[case]  # (the weights are hashed as they are read: after these checks)
    copy = _copy(artifact(SPEC), tmp_path / "copy")
    _edit_manifest(copy, lambda m: edit(copy, m))
    threads = int(options[1]) if options else None
    with pytest.raises(ArtifactError, match=message.replace(".", r"\.")):
        open_session(copy, check_files=verify, threads=threads)
    _refused(["run", str(copy), "-p", "x", "-n", "1", *options, *([] if verify else ["--no-verify"])], capsys,
             message)


TOKENIZER_CASES = {
    "bos-outside-vocabulary": ({"bos_id": 10**6, "add_bos": True}, "tokenizer.bos_id 1000000, put before every "
                                                                     "prompt, is not a token of the model's"),
    "bos-past-int64": ({"bos_id": 2**64, "add_bos": True}, f"tokenizer.bos_id {2**64} is not a token id"),
    "bos-negative": ({"bos_id": -5, "add_bos": True}, "tokenizer.bos_id -5 is not a token id"),
    "eos-negative": ({"eos_id": -1}, "tokenizer.eos_id -1 is not a token id"),
    "eos-past-int32": ({"eos_id": 2**31}, f"tokenizer.eos_id {2**31} is not a token id"),
    "eos-not-an-integer": ({"eos_id": "2"}, "tokenizer must hold"),
    "add-bos-not-a-boolean": ({"add_bos": "yes"}, "tokenizer must hold"),
}


@pytest.mark.parametrize("case", TOKENIZER_CASES, ids=TOKENIZER_CASES.keys())
def test_crafted_tokenizer_facts_are_one_line(artifact, tmp_path, capsys, case: str) -> None:
    facts, message = TOKENIZER_CASES[case]
    copy = _copy(artifact(SPEC), tmp_path / "copy")
    _edit_manifest(copy, lambda m: m["tokenizer"].update(facts))
    _refused(["run", str(copy), "-p", "x", "-n", "1"], capsys, message)


def test_untouched_copy_runs_with_and_without_hashing(artifact, tmp_path, capsys) -> None:
    """The control of the cases above: the same copy, not crafted, runs, named as a `Path` or as a string."""
    copy = _copy(artifact(SPEC), tmp_path / "copy")
    for extra in ([], ["--no-verify"]):
        assert main(["run", str(copy), "-p", "x", "-n", "1", *extra]) == 0, capsys.readouterr().err
    for name in (copy, str(copy)):
        session = open_session(name, threads=1)
        assert session.manifest.directory == copy and 0 <= session.greedy([1, 2, 3]) < session.vocab_size
        session.close()


@pytest.mark.parametrize("size", [0, 1, 4095, (1 << 21) + 77])
def test_weights_are_read_in_whole_read_only_and_on_a_2_mb_boundary(tmp_path: Path, size: int) -> None:
    """`load_weights` (the CPU session's weights, in memory Linux may back with huge pages): the file's
    bytes, all of them, at a 2 MB boundary, and not writable (the file mapping was read-only too)."""
    data = os.urandom(size)
    (tmp_path / "weights.bin").write_bytes(data)
    weights = load_weights(tmp_path / "weights.bin")
    assert weights.tobytes() == data and weights.ctypes.data % HUGE_PAGE == 0
    with pytest.raises(ValueError, match="read-only"):
        weights[:1] = 0


_LOAD_IN_LITTLE_MEMORY = """
import re, resource, sys
import numpy, tokenizers, llmc.runtime.session, llmc.runtime.codec, llmc.runtime.generate, llmc.cli.artifact
from llmc.cli import main
size = int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (8 << 20), resource.RLIM_INFINITY))
sys.exit(main(["run", sys.argv[1], "-p", "x", "-n", "1"]))
"""


def test_an_artifact_larger_than_the_memory_left_is_one_line(artifact) -> None:
    """Weights, KV cache and arena that the process cannot allocate (here a 2 x 16 MB KV cache with 8 MB of address
    space left): one line that says what the artifact needs, not an internal MemoryError or OSError."""
    import subprocess
    import sys

    directory = artifact(TinySpec(context_length=1 << 16), max_seq=1 << 16)
    run = subprocess.run([sys.executable, "-c", _LOAD_IN_LITTLE_MEMORY, str(directory)], capture_output=True,
                         text=True, timeout=120)
    assert run.returncode == 2 and run.stderr.count("\n") == 1 and run.stderr.startswith("llmc: error: "), run.stderr
    assert "cannot load it (" in run.stderr and "MB KV cache" in run.stderr, run.stderr


_COMPILE_IN_LITTLE_MEMORY = """
import re, resource, sys
import numpy, llmc.backends.cpu.codegen, llmc.driver, llmc.frontend.gguf
from llmc.cli import main
size = int(re.search(r"VmSize:\\s+(\\d+)", open("/proc/self/status").read()).group(1)) * 1024
resource.setrlimit(resource.RLIMIT_AS, (size + (int(sys.argv[3]) << 20), resource.RLIM_INFINITY))
sys.exit(main(["compile", sys.argv[1], "--max-seq", "32", "-o", sys.argv[2]]))
"""


def test_a_compile_out_of_memory_is_an_error_not_an_internal_one(tiny, tmp_path) -> None:
    """`ulimit -v` below what a compile needs: a MemoryError, or a thread whose stack cannot be mapped, ends in
    `llmc: error: …`, not an internal error (the libraries were loaded before the limit: see the next test). With 1 MB
    left it fails in Python; with more it can reach LLVM, which crashes on a failed allocation (SIGSEGV: nothing a
    process can catch)."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", _COMPILE_IN_LITTLE_MEMORY, str(tiny(SPEC, "gguf")),
                          str(tmp_path / "out"), "1"], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "LLMC_CACHE_DIR": "off"})
    last = run.stderr.strip().splitlines()[-1]
    assert run.returncode == 1 and "internal error" not in run.stderr, run.stderr
    assert re.search(r"llmc: error: (out of memory|cannot start a thread)", last), run.stderr


def test_llvm_not_loaded_is_one_line(tiny, tmp_path) -> None:
    """LLVM's library that cannot be loaded (its 100+ MB not mapped with 64 MB of address space left): one line
    naming it, not an internal OSError."""
    import subprocess
    import sys

    script = _COMPILE_IN_LITTLE_MEMORY.replace("llmc.backends.cpu.codegen, ", "").replace(
        "from llmc.cli", "assert 'llvmlite.binding' not in sys.modules\nfrom llmc.cli")
    run = subprocess.run([sys.executable, "-c", script, str(tiny(SPEC, "gguf")), str(tmp_path / "out"), "64"],
                         capture_output=True, text=True, timeout=300, env={**os.environ, "LLMC_CACHE_DIR": "off"})
    assert run.returncode == 2 and run.stderr == (
        "llmc: error: cannot load LLVM (llvmlite's library): too little memory under the process's limit to map it, "
        "or a broken llvmlite install\n"), run.stderr


def test_kernels_without_a_description_are_refused(artifact, tmp_path, capsys) -> None:
    """A library that does not describe itself (another llmc's, or not llmc's) is not called."""
    import ctypes.util

    libm = ctypes.util.find_library("m")
    found = next((Path(d) / libm for d in ("/lib/x86_64-linux-gnu", "/usr/lib/x86_64-linux-gnu", "/lib64", "/usr/lib64")
                  if libm and (Path(d) / libm).is_file()), None)
    if found is None:
        pytest.skip("no libm found to stand in for the kernels")
    copy = _copy(artifact(SPEC), tmp_path / "copy")
    shutil.copy(found, copy / "libm.so")
    _edit_manifest(copy, lambda m: m["files"]["kernels"].update(path="libm.so", bytes=found.stat().st_size))
    _refused(["run", str(copy), "-p", "x", "-n", "1", "--no-verify"], capsys, "carry no description")


# crafted manifests of a CUDA artifact (checked before any device is opened) -----------------


@pytest.fixture(scope="module")
def cuda_artifact(tiny, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cuda") / "a"
    compile_model(str(tiny(SPEC, "gguf")), out, CompileOptions(prefill_chunk=4, max_seq=32, kv_type="f32"),
                  BackendOptions(target="cuda", gpu="sm_80"), progress=lambda _: None)
    return out


def _ptx(directory: Path, m: dict) -> Path:
    return directory / m["files"]["kernels"]["path"]


def _edit_ptx(change: Callable[[bytes], bytes]) -> Callable[[Path, dict], None]:
    """The PTX changed (and its size in the manifest: only `--no-verify` then skips the hash)."""

    def edit(directory: Path, m: dict) -> None:
        ptx = _ptx(directory, m)
        ptx.write_bytes(change(ptx.read_bytes()))
        m["files"]["kernels"]["bytes"] = ptx.stat().st_size

    return edit


def _rename_first_kernel(ptx: bytes) -> bytes:
    at = ptx.index(b".entry ") + len(b".entry ")
    return ptx[:at] + b"x" + ptx[at:]


def _wider_block(m: dict) -> None:
    m["entry_points"]["decode"]["launches"][0]["block"][0] //= 2


CUDA_CASES = {
    "launch-plan": (_on_manifest(_wider_block), MATCHES + "entry_points.decode.launches"),
    "arena-0": (_on_manifest(_every_entry(arena_bytes=0)), MATCHES + "entry_points.decode.arena_bytes"),
    "kv-dtype": (_on_manifest(lambda m: m["kv_cache"].update(dtype="f16")), MATCHES + "kv_cache.dtype"),
    "argmax": (_on_manifest(lambda m: m["gpu"]["argmax"]["args"].pop()), MATCHES + "gpu.argmax"),
    "weights-truncated-manifest-too": (_truncated_weights(consistent=True), MATCHES + "files.weights.bytes"),
    "no-description": (_edit_ptx(lambda ptx: ptx[: ptx.rindex(b"\n// llmc_description")] + b"\n"),
                       "carry no description"),
    "kernel-renamed": (_edit_ptx(_rename_first_kernel), "the PTX has no kernel"),
    "ptx-absolute": (_kernels_elsewhere("absolute"), "outside the artifact directory"),
}


@pytest.mark.parametrize("case", CUDA_CASES, ids=CUDA_CASES.keys())
def test_crafted_cuda_manifest_is_one_line(cuda_artifact, tmp_path, capsys, case: str) -> None:
    """The launch plans, sizes and KV cache are checked against the description at the PTX's end, and each
    launch against the PTX's `.entry` kernels and their parameter counts, before a device is opened."""
    edit, message = CUDA_CASES[case]
    copy = _copy(cuda_artifact, tmp_path / "copy")
    _edit_manifest(copy, lambda m: edit(copy, m))
    _refused(["run", str(copy), "-p", "x", "-n", "1", "--no-verify"], capsys, message)


def test_the_cuda_kernels_match_their_own_manifest(cuda_artifact) -> None:
    manifest = load_manifest(cuda_artifact)
    check_kernels(manifest, manifest.file("kernels").read_bytes())


# -o: what compile may replace, and how ---------------------------------------------------------


def _compile_argv(tiny, out: Path) -> list[str]:
    return ["compile", str(tiny(SPEC, "gguf")), "--max-seq", "32", "-o", str(out)]


def _foreign_manifest(folder: Path, artifact) -> None:
    (folder / MANIFEST).write_text('{"name": "my web app", "version": "1.0"}')
    (folder / "index.html").write_text("mine")


def _artifact_and_notes(folder: Path, artifact) -> None:
    shutil.copytree(artifact(SPEC), folder, dirs_exist_ok=True)
    (folder / "notes.txt").write_text("mine")


def _artifact_and_a_folder(folder: Path, artifact) -> None:
    shutil.copytree(artifact(SPEC), folder, dirs_exist_ok=True)
    (folder / "ir").mkdir()
    (folder / "ir" / "00.mlir").write_text("mine")


def _unreadable_manifest(folder: Path, artifact) -> None:
    (folder / MANIFEST).write_bytes(b"\xff not json")


def _no_manifest(folder: Path, artifact) -> None:
    (folder / "notes.txt").write_text("mine")


FOLDERS = {
    "foreign-manifest": (_foreign_manifest, "is not an llmc artifact's"),
    "artifact-and-notes": (_artifact_and_notes, "holds 'notes.txt' besides its llmc artifact"),
    "artifact-and-a-folder": (_artifact_and_a_folder, "holds 'ir' besides its llmc artifact"),
    "unreadable-manifest": (_unreadable_manifest, "is not an llmc artifact's"),
    "no-manifest": (_no_manifest, "holds no llmc artifact"),
}


@pytest.mark.parametrize("case", FOLDERS, ids=FOLDERS.keys())
def test_a_folder_that_is_not_an_artifact_alone_is_refused_untouched(tiny, artifact, tmp_path, capsys,
                                                                       case: str) -> None:
    """One line before anything is compiled (no progress line), and not one byte of the folder changed."""
    fill, message = FOLDERS[case]
    folder = tmp_path / "out"
    folder.mkdir()
    fill(folder, artifact)
    before, around = _snapshot(folder), sorted(os.listdir(tmp_path))
    _refused(_compile_argv(tiny, folder), capsys, str(folder), message)
    assert _snapshot(folder) == before
    assert sorted(os.listdir(tmp_path)) == around


@pytest.mark.parametrize("where", ["a-file", "below-a-file"])
def test_an_unwritable_output_is_one_line_before_compiling(tiny, tmp_path, capsys, where: str) -> None:
    (tmp_path / "file").write_text("mine")
    out = tmp_path / "file" if where == "a-file" else tmp_path / "file" / "sub" / "out"
    _refused(_compile_argv(tiny, out), capsys, "not a directory")
    assert (tmp_path / "file").read_text() == "mine"


def test_verify_of_an_artifact_of_another_model_is_one_line_before_the_reference(tiny, artifact, capsys) -> None:
    """`llmc verify MODEL --artifact DIR` where DIR was compiled from another model: one line saying so, before the
    reference runs (was a broadcast error, or a cosine of -0.04 that read as llmc's accuracy failing)."""
    other = artifact(SPECS["qwen2-bias-untied-odd-heads"])
    _refused(["verify", str(tiny(SPEC, "gguf")), "--artifact", str(other)], capsys,
             f"--artifact {other} is of another model: its arch is 'qwen2'")  # (one line: no progress of a reference)


def test_an_artifact_and_a_model_mistaken_for_each_other_are_named(tiny, artifact, tmp_path, capsys) -> None:
    """An artifact's manifest given to `run`, an artifact given to `compile` or `ir` as the model: one line that says
    what was given (was: "no manifest.json" beside the manifest, "no config.json")."""
    built = artifact(SPEC)
    _refused(["run", str(built / MANIFEST), "-p", "x"], capsys, "a file; an llmc artifact is the folder")
    _refused(["run", str(tmp_path / "nothing"), "-p", "x"], capsys, "nothing: no such artifact directory")
    (tmp_path / "odd" / MANIFEST).mkdir(parents=True)
    _refused(["run", str(tmp_path / "odd"), "-p", "x"], capsys, f"{MANIFEST}: not a file; an llmc artifact's")
    for argv in (_compile_argv(tiny, tmp_path / "out")[:1] + [str(built), "-o", str(tmp_path / "out")],
                 ["ir", str(built)]):
        _refused(argv, capsys, "an llmc artifact, not a model")


def test_verify_of_a_prompt_longer_than_the_artifacts_cache_is_one_line_before_the_reference(tiny, artifact,
                                                                                             capsys) -> None:
    """A --prompt the artifact cannot hold: refused first, naming the prompt's tokens (was: after the reference and
    every stage, naming a count of its own)."""
    from llmc.frontend import load_tokenizer

    model, prompt = str(tiny(SPEC, "gguf")), " ".join(["one two three"] * 40)
    tokens = len(load_tokenizer(model).encode(prompt))
    _refused(["verify", model, "--artifact", str(artifact(SPEC)), "--prompt", prompt], capsys,
             f"--prompt is {tokens} tokens; the KV cache of --artifact", "holds 32")


def test_verify_of_a_prompt_longer_than_the_models_context_is_one_line_before_the_reference(tiny, capsys) -> None:
    """A --prompt past the model's own context (no --artifact): refused first (was: an internal error from the
    interpreter's KV cache, after the reference had run)."""
    from llmc.frontend import load_model

    model = tiny(SPEC, "gguf")
    prompt = " ".join(["one two three"] * 40)
    tokens = len(load_model(str(model)).tokenizer.encode(prompt))
    _refused(["verify", str(model), "--prompt", prompt], capsys,
             f"--prompt is {tokens} tokens; {model.name}'s context is {SPEC.context_length}")


@pytest.mark.reference
def test_verify_of_an_artifact_notes_the_compile_options_it_ignores(tiny, artifact, capsys) -> None:
    """`llmc verify MODEL --artifact DIR --kv-type q8_0`: the artifact's own options are checked; a note says so."""
    pytest.importorskip("transformers")
    main(["verify", str(tiny(SPEC, "gguf")), "--artifact", str(artifact(SPEC)), "--kv-type", "q8_0"])
    assert "the compile options do not apply to it" in capsys.readouterr().err


def test_an_output_inside_an_artifact_is_refused_untouched(tiny, artifact, tmp_path, capsys) -> None:
    """`-o ART/sub` (or deeper) would leave the artifact holding a folder it does not list: refused, the artifact
    as it was; so are a --plot and an IR file inside it, and a $LLMC_CACHE_DIR."""
    outer = _copy(artifact(SPEC), tmp_path / "outer")
    before = _snapshot(outer)
    for out in (outer / "sub", outer / "a" / "b"):
        _refused(_compile_argv(tiny, out), capsys, str(out), f"is inside the artifact {outer}")
    for where in (["-o", str(outer / "manifest.json")], ["--dump-ir", str(outer)], ["--dump-ir", str(outer / "ir")]):
        assert main(["ir", str(tiny(SPEC, "gguf")), *where]) == 2, where
        assert f"it is inside the artifact {outer}" in capsys.readouterr().err
    for cache in (outer, outer / "cache"):  # ($LLMC_CACHE_DIR: kernels and calibrations would be written there)
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("LLMC_CACHE_DIR", str(cache))
            _refused(_compile_argv(tiny, tmp_path / "elsewhere"), capsys, f"is inside the artifact {outer}")
            _refused(["compile", str(tiny(SPEC, "gguf")), "--compile-to", "quantize"], capsys, "LLMC_CACHE_DIR=")
    assert _snapshot(outer) == before


def test_what_a_compile_writes_besides_the_artifact_is_refused_inside_its_output(tiny, tmp_path, capsys,
                                                                               monkeypatch) -> None:
    """`--dump-ir` or `$LLMC_CACHE_DIR` at or inside `-o`: refused before any work, nothing made (was: the IR files
    written, then `-o` refused as not empty after the whole compile, or the dump folder left behind)."""
    out = tmp_path / "out"
    for dump in (out, out / "ir"):
        _refused([*_compile_argv(tiny, out), "--dump-ir", str(dump)], capsys, f"--dump-ir {dump} is ",
                 f"-o {out}, which the compile replaces")
    monkeypatch.setenv("LLMC_CACHE_DIR", str(out / "cache"))
    _refused(_compile_argv(tiny, out), capsys, "($LLMC_CACHE_DIR) is inside -o")
    assert not out.exists()


def test_an_output_through_a_dangling_symlink_is_refused(tiny, tmp_path, capsys) -> None:
    """`-o link` or `-o link/sub`, the link pointing at a folder that does not exist: refused, nothing made where it
    points (was: the target's missing parents made, far from where the user looked)."""
    link, target = tmp_path / "link", tmp_path / "gone" / "deep" / "out"
    link.symlink_to(target)
    for out in (link, link / "sub"):
        _refused(_compile_argv(tiny, out), capsys, f"{link} is a symlink to {target}, which does not exist")
    assert not (tmp_path / "gone").exists()
    target.mkdir(parents=True)  # (a link to a folder that exists: the artifact is written there)
    assert main(_compile_argv(tiny, link)) == 0 and (target / MANIFEST).is_file()


def test_the_current_folder_is_not_replaced_and_a_default_output_is_named(tiny, tmp_path, capsys, monkeypatch) -> None:
    """`-o .` or `-o ..` (the folder the shell is in, or one holding it) is refused: replacing it would leave the shell
    in a deleted folder. `llmc compile .` names its artifact after the folder (was: a hidden `.llmc`)."""
    here = tmp_path / "empty"
    here.mkdir()
    monkeypatch.chdir(here)
    _refused(_compile_argv(tiny, Path(".")), capsys, "-o . is the current folder;")
    _refused(_compile_argv(tiny, Path("..")), capsys, "-o .. is the current folder or holds it")
    assert here.is_dir() and not any(here.iterdir())
    model = tmp_path / "mymodel"
    shutil.copytree(tiny(SPEC, "hf"), model)
    monkeypatch.chdir(model)
    assert main(["compile", ".", "--max-seq", "32"]) == 0
    assert (model / "mymodel.llmc" / MANIFEST).is_file() and not (model / ".llmc").exists()


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_an_output_in_a_read_only_folder_is_one_line_before_compiling(tiny, tmp_path, capsys) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        _refused(_compile_argv(tiny, locked / "out"), capsys, "cannot write", "ermission denied")
        assert not (locked / "out").exists()
    finally:
        locked.chmod(0o755)


NEW_CHUNK = CompileOptions(prefill_chunk=8, max_seq=32, kv_type="f32")  # (the fixture's artifact has chunks of 4)


def test_a_failed_compile_leaves_the_old_artifact(tiny, artifact, tmp_path) -> None:
    """The compile is interrupted once its kernels are written (Ctrl-C at the codegen line): the old
    artifact is as it was, and nothing is left beside it."""
    out = _copy(artifact(SPEC), tmp_path / "out")
    before = _snapshot(out)

    def interrupt(line: str) -> None:
        if line.startswith("codegen"):
            assert any(p.name.endswith(".partial") for p in tmp_path.iterdir())  # (writing had begun)
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        compile_model(str(tiny(SPEC, "gguf")), out, NEW_CHUNK, BackendOptions(), progress=interrupt)
    assert _snapshot(out) == before
    assert os.listdir(tmp_path) == ["out"]


def test_a_finished_compile_replaces_the_old_artifact(tiny, artifact, tmp_path) -> None:
    """The folder then holds the new artifact's files only, nothing is left beside it, and it runs."""
    out = _copy(artifact(SPEC), tmp_path / "out")
    compile_model(str(tiny(SPEC, "gguf")), out, NEW_CHUNK, BackendOptions(), progress=lambda _: None)
    assert os.listdir(tmp_path) == ["out"]
    manifest = load_manifest(out)
    assert manifest.entry_points["prefill"]["max_tokens"] == 8
    assert sorted(os.listdir(out)) == sorted([MANIFEST, *(f["path"] for f in manifest.data["files"].values())])
    session = Session(out)
    assert session.feed([1, 2, 3]).shape == (session.vocab_size,)
    session.close()
