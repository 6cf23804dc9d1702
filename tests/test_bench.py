"""`llmc bench`: speeds at a KV depth, the peers (skipped when absent), the table, the plot, bad options."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from tiny_models import TinySpec

from llmc.cli import main
from llmc.cli.common import progress
from llmc.driver import BackendOptions, compile_model
from llmc.passes.pipeline import CompileOptions
from llmc.runtime.artifact import Manifest
from llmc.runtime.bench import EngineSpeeds, benchmark, decode_weight_bytes, fit_defaults, table
from llmc.runtime.session import CapacityError, Session

SPEC = TinySpec(context_length=64)
FAST = ["--prompt-tokens", "4,8", "--depth", "0,8", "--decode-tokens", "4", "--repeat", "1", "--threads", "1"]


@pytest.fixture(scope="module")
def artifact(tiny, tmp_path_factory) -> Callable[[str], Path]:
    """`artifact("gguf" | "hf" | "batched")` → the tiny model compiled from that form (KV capacity 32; "batched":
    the GGUF with `--max-batch 4`), built once."""
    root = tmp_path_factory.mktemp("bench")
    built: dict[str, Path] = {}

    def build(form: str) -> Path:
        if form not in built:
            options = CompileOptions(prefill_chunk=8, max_seq=32, max_batch=4 if form == "batched" else 1)
            built[form] = compile_model(str(tiny(SPEC, "gguf" if form == "batched" else form)), root / form, options,
                                        BackendOptions(), progress=lambda _: None)
        return built[form]

    return build


def _bench(capsys, directory: Path, *options: str) -> tuple[int, str, str]:
    code = main(["bench", str(directory), *FAST, *options])
    out, err = capsys.readouterr()
    return code, out, err


def _rows(out: str, engine: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.splitlines()
            if line.startswith(f"| {engine}")]


def test_benchmark_at_depth_gives_positive_speeds(artifact) -> None:
    result = benchmark(artifact("gguf"), prompts=(4, 8), decode_tokens=4, repeat=1, threads=1, depths=(0, 16))
    assert set(result.speeds.prefill) == {(0, 4), (0, 8), (16, 4), (16, 8)}
    assert set(result.speeds.decode) == {0, 16}
    assert all(v > 0 for v in [*result.speeds.prefill.values(), *result.speeds.decode.values()])
    assert result.capacity == 32 and "llmc gguf" in result.report()


def test_benchmark_refuses_more_than_the_kv_capacity(artifact) -> None:
    with pytest.raises(CapacityError, match="depth 24 \\+ prompt 9 tokens exceed the artifact's KV capacity of 32"):
        benchmark(artifact("gguf"), prompts=(9,), decode_tokens=4, repeat=1, depths=(24,))
    with pytest.raises(CapacityError, match="decode 33"):
        benchmark(artifact("gguf"), prompts=(4,), decode_tokens=33, repeat=1)
    benchmark(artifact("gguf"), prompts=(8,), decode_tokens=8, repeat=1, threads=1, depths=(24,))  # exactly full


def test_defaults_keep_what_fits() -> None:
    assert fit_defaults(4096, None, None, 128)[:2] == ((128, 512, 2048), (0, 2048))
    prompts, depths, notes = fit_defaults(1024, None, None, 128)
    assert (prompts, depths) == ((128, 512), (0,)) and len(notes) == 2
    assert fit_defaults(32, [8], None, 4)[:2] == ((8,), (0,))
    with pytest.raises(CapacityError):
        fit_defaults(32, None, None, 4)  # no default prompt fits: the user is told, not given another length
    with pytest.raises(CapacityError):
        fit_defaults(4096, [2048], [2049], 4)  # given values are checked, never cut


def test_decode_reads_one_row_of_an_untied_embedding() -> None:
    def manifest(names: list[str]) -> Manifest:
        weights = {n: {"bytes": 1000, "shape": [10, 25]} for n in names}
        return Manifest(Path("."), {"weights": weights, "files": {"weights": {"bytes": 4096}}})

    assert decode_weight_bytes(manifest(["token_embd", "blk.0.attn_q"]))[0] == 2000  # tied: the LM head reads it all
    assert decode_weight_bytes(manifest(["token_embd", "blk.0.attn_q", "output"]))[0] == 2100


@pytest.mark.parametrize("threads", [1, 3])
def test_the_read_probe_reads_every_byte_once(artifact, threads) -> None:
    """The kernels' read probe (what `llmc bench` measures the limit with): the xor of what
    the threads read is the xor of every 8-byte word of the buffer's whole 256-byte steps, wherever
    the buffer starts (here 8 bytes past a 64-byte line: the loads may not assume an alignment)."""
    session = Session(artifact("gguf"), threads=threads)
    buffer = np.random.default_rng(1).integers(-2**62, 2**62, (1 << 17) + 13, dtype=np.int64)
    start = (-buffer.ctypes.data % 64 + 8) // 8
    data = buffer[start : start + (1 << 17) + 5]
    assert data.ctypes.data % 64 == 8
    out = session.read(data.ctypes.data, data.nbytes)
    whole = data[: data.nbytes // 256 * 32]
    assert np.bitwise_xor.reduce(out) == np.bitwise_xor.reduce(whole)
    assert session.read_weights() > 0
    session.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_greedy_decode_steps_take_the_thread_teams_argmax(artifact, threads) -> None:
    """A decode step's greedy token comes from the thread team's argmax (`llmc.abi.ARGMAX`), which the call
    then forgets: each is numpy's argmax of the step's logits, the read probe between steps changes nothing."""
    from llmc.abi import TEAM_ARGMAX_ROWS

    session = Session(artifact("gguf"), threads=threads)
    assert session._firsts is not None
    tokens = [session.greedy([1, 2, 3])]
    for _ in range(6):
        tokens.append(session.greedy(tokens[-1:]))
        assert tokens[-1] == int(np.argmax(session.logits[0])) and session.team.words[TEAM_ARGMAX_ROWS] == 0
        session.read_weights()
    session.rewind(0)
    session.feed([1, 2, 3])
    assert [int(np.argmax(session.feed([t]))) for t in tokens[:6]] == tokens[1:]  # numpy's, step by step
    session.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_a_batched_decodes_plain_rows_take_the_thread_teams_argmaxes_and_draws(artifact, threads) -> None:
    """`decode_picks` (the engine's rows): a plain greedy row's token is numpy's argmax of its logits, a row
    drawn by temperature alone or with top-p the draw its sampler makes from those logits (the team's weighing,
    `llmc.abi.WEIGH`, and draw, `llmc.abi.DRAW`), a row whose sampler processes the logits or takes top-k is
    left to the caller (None), for every row count the artifact takes and a few steps of each sampler; a call
    that fails before it runs asks nothing of the next."""
    from llmc.abi import TEAM_ARGMAX_ROWS, TEAM_WEIGH_ROWS
    from llmc.runtime.sampling import Sampler, SamplingOptions

    session = Session(artifact("batched"), threads=threads)
    assert session._firsts is not None and session._scales is not None
    logits = np.zeros((session.batch, session.vocab_size), np.float32)
    kinds = [SamplingOptions(), SamplingOptions(0.9, seed=1), SamplingOptions(1.0, presence_penalty=0.5, seed=2),
             SamplingOptions(1.5, top_p=0.8, seed=3), SamplingOptions(0.7, top_k=5, min_p=0.05, seed=4)]
    for rows in range(1, session.batch + 1):
        options = [kinds[i % len(kinds)] for i in range(rows)]
        ours, twins = ([Sampler(o) for o in options] for _ in range(2))
        slots = np.arange(rows, dtype=np.int32)
        for step in range(3):
            tokens = np.arange(5 + step, 5 + step + rows, dtype=np.int32)
            picks = session.decode_picks(tokens, np.full(rows, rows + step, np.int32), slots, logits, ours)
            for row, (o, twin, pick) in enumerate(zip(options, twins, picks)):
                expected = (int(np.argmax(logits[row])) if o.temperature == 0 else
                            None if o.presence_penalty or o.top_k else twin.draw(*twin.weights(logits[row])))
                assert pick == expected, (rows, step, row)
            assert session.team.words[TEAM_ARGMAX_ROWS] == session.team.words[TEAM_WEIGH_ROWS] == 0
    with pytest.raises(ValueError, match="C-contiguous float32"):
        session.decode_picks(tokens, np.full(rows, 1, np.int32), slots, logits[:, ::2], ours)
    assert session.team.words[TEAM_ARGMAX_ROWS] == session.team.words[TEAM_WEIGH_ROWS] == 0
    session._scales = None  # as a library from before the weighing: its draws are the caller's
    picks = session.decode_picks(tokens, np.full(rows, rows + 3, np.int32), slots, logits, ours)
    assert picks == [int(np.argmax(logits[row])) if o.temperature == 0 else None for row, o in enumerate(options)]
    session.close()


@pytest.mark.parametrize("threads", [1, 3])
def test_a_sampled_decode_step_draws_from_the_thread_teams_weighing(artifact, threads) -> None:
    """`pick` with a sampler drawing by temperature alone or with top-p: a decode step's token is the draw its
    sampler makes from the step's logits (the team's weighing), the prompt's the sampler's own; the read probe
    between steps changes nothing."""
    from llmc.abi import TEAM_WEIGH_ROWS
    from llmc.runtime.sampling import Sampler, SamplingOptions

    session = Session(artifact("gguf"), threads=threads)
    assert session._scales is not None  # (the team weighs)
    for options in (SamplingOptions(1.2, seed=7), SamplingOptions(0.8, top_p=0.9, min_p=0.01, seed=8)):
        session.rewind(0)
        ours, twin = (Sampler(options) for _ in range(2))
        tokens = [session.pick([1, 2, 3], ours)]
        assert tokens[0] == twin.draw(*twin.weights(session.logits[0]))
        for _ in range(8):
            tokens.append(session.pick(tokens[-1:], ours))
            assert tokens[-1] == twin.draw(*twin.weights(session.logits[0]))
            assert session.team.words[TEAM_WEIGH_ROWS] == 0
            session.read_weights()
    session.close()


def test_table_takes_ratios_against_llama_cpps_fastest_path() -> None:
    ours = EngineSpeeds("llmc x", "llmc", {(0, 8): 100.0}, {0: 50.0})
    fast = EngineSpeeds("llama.cpp repack", "llama.cpp", {(0, 8): 200.0}, {0: 20.0})
    slow = EngineSpeeds("llama.cpp --repack 0", "llama.cpp", {(0, 8): 50.0}, {0: 25.0})
    hf = EngineSpeeds("transformers", "transformers", {(0, 8): 400.0}, {0: 10.0})
    text = table([ours, fast, slow, hf], [8], [0], 4, "2 threads")
    assert _rows(text, "llmc x")[0][3:] == ["100.0", "0.50x", "50.0", "2.00x"]  # prefill vs 200, decode vs 25
    assert "against llama.cpp's fastest path per test" in text
    assert "transformers" in table([ours, hf], [8], [0], 4, "2 threads").splitlines()[-1]
    assert "×" not in table([ours], [8], [0], 4, "2 threads")  # nothing to compare with


def test_cli_bench_prints_rows_and_the_bandwidth_limit(artifact, capsys) -> None:
    code, out, _ = _bench(capsys, artifact("gguf"))
    assert code == 0
    rows = _rows(out, "llmc gguf")
    assert [(r[1], r[2]) for r in rows] == [("0", "4"), ("0", "8"), ("8", "4"), ("8", "8")]
    assert float(rows[0][3]) > 0 and float(rows[0][4]) > 0 and rows[1][4] == ""  # decode once per depth
    assert "MB read per decode token" in out and "bandwidth limit ≈" in out and "% of it" in out


def test_cli_bench_says_what_it_is_measuring(artifact, capsys, monkeypatch) -> None:
    """Each test says what it does as it starts, through the progress line (in a log, a plain line on stderr,
    once the bench has run `QUIET` seconds: here at once); none is left after the table."""
    monkeypatch.setattr(progress, "QUIET", 0.0)
    monkeypatch.setattr(progress, "LOG_EVERY", 0.0)
    code, out, err = _bench(capsys, artifact("gguf"))
    assert code == 0 and "bench:" not in out
    lines = err.splitlines()
    for line in ("bench: warm-up (the weights paged in)", "bench: prefill 4 at depth 0, run 1 of 1",
                 "bench: decode 4 at depth 0, run 1 of 1", "bench: filling the KV cache to depth 8",
                 "bench: prefill 8 at depth 8, run 1 of 1",
                     "bench: the read probe, a read of the weights after each of 4 decode steps"):
        assert line in lines, err
    prefill, decode = "bench: prefill 4 at depth 0, run 1 of 1", "bench: decode 4 at depth 0, run 1 of 1"
    assert lines.index(prefill) < lines.index(decode)


def test_vs_llama_cpp_without_llama_bench_is_skipped(artifact, capsys, monkeypatch, tmp_path) -> None:
    directory = artifact("gguf")  # (built first: compiling it needs the C compiler on PATH)
    monkeypatch.setenv("PATH", str(tmp_path))  # no llama-bench on it
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # and the package not importable
    code, out, _ = _bench(capsys, directory, "--vs", "llama.cpp", "--llama-bench", str(tmp_path / "nope"))
    assert code == 0
    assert f"llama.cpp: skipped (no llama-bench at {tmp_path / 'nope'} and llama_cpp not installed)" in out
    assert len(_rows(out, "llmc gguf")) == 4 and not _rows(out, "llama.cpp")
    code, out, _ = _bench(capsys, directory, "--vs", "llama.cpp")
    assert code == 0 and "llama.cpp: skipped (no llama-bench on PATH and llama_cpp not installed)" in out


FAKE_LLAMA_BENCH = textwrap.dedent(
    """\
    #!{python}
    import json, sys
    def arg(flag):
        return sys.argv[sys.argv.index(flag) + 1]
    repack = arg("--repack") == "1"
    build = {{"build_commit": "abc1234", "build_number": 42, "cpu_info": "Fake CPU"}}
    records = []
    for d in map(int, arg("-d").split(",")):
        for p in map(int, arg("-p").split(",")):
            records.append(dict(build, n_prompt=p, n_gen=0, n_depth=d, avg_ts=1.0, samples_ts=[900.0 if repack else 300.0]))
        records.append(dict(build, n_prompt=0, n_gen=int(arg("-n")), n_depth=d, avg_ts=1.0, samples_ts=[90.0 if repack else 60.0]))
    print(json.dumps(records))
    print("load_tensors:          AMX model buffer size =    95.34 MiB" if repack else "", file=sys.stderr)
    print("load_tensors:   CPU_Mapped model buffer size =    92.10 MiB", file=sys.stderr)
    """
)


def test_vs_llama_cpp_reads_llama_benchs_json(artifact, capsys, tmp_path) -> None:
    fake = tmp_path / "llama-bench"
    fake.write_text(FAKE_LLAMA_BENCH.format(python=sys.executable))
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    code, out, _ = _bench(capsys, artifact("gguf"), "--vs", "llama.cpp", "--llama-bench", str(fake))
    assert code == 0
    assert "llama-bench build abc1234 (42), Fake CPU" in out and "AMX, CPU_Mapped buffers" in out
    fast, slow = _rows(out, "llama.cpp repack (AMX)"), _rows(out, "llama.cpp --repack 0 (generic)")
    assert len(fast) == len(slow) == 4
    assert fast[0][3:] == ["900.0", "1.00x", "90.0", "1.00x"] and slow[0][3:] == ["300.0", "0.33x", "60.0", "0.67x"]
    assert _rows(out, "llmc gguf")[0][4].endswith("x")  # against the fastest path


def test_vs_without_a_known_source_asks_for_model(artifact, capsys, tmp_path) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(artifact("gguf"), copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["model"].update(source="elsewhere.gguf", source_path=str(tmp_path / "elsewhere.gguf"))
    (copy / "manifest.json").write_text(json.dumps(manifest))
    code, out, _ = _bench(capsys, copy, "--vs", "llama.cpp,transformers")
    assert code == 0
    assert "llama.cpp: skipped (the artifact's source model is unknown" in out and "pass --model" in out
    assert "transformers: skipped (" in out and len(_rows(out, "llmc copy")) == 4


def test_vs_transformers_measures_a_row(artifact, capsys) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    code, out, _ = _bench(capsys, artifact("hf"), "--vs", "transformers")
    assert code == 0, out
    rows = _rows(out, "transformers")
    assert [(r[1], r[2]) for r in rows] == [("0", "4"), ("0", "8"), ("8", "4"), ("8", "8")]
    assert float(rows[0][3]) > 0 and rows[0][4] == "1.00x" and float(rows[0][5]) > 0
    assert "ratios (×) against transformers" in out


def test_vs_llama_cpp_needs_a_gguf(artifact, tiny, capsys) -> None:
    code, out, _ = _bench(capsys, artifact("hf"), "--vs", "llama.cpp")
    assert code == 0 and "llama.cpp: skipped (it needs a GGUF file" in out
    code, out, _ = _bench(capsys, artifact("gguf"), "--vs", "llama.cpp", "--model", str(tiny(SPEC, "hf")))
    assert code == 0 and "llama.cpp: skipped (it needs a GGUF file" in out


def test_plot_writes_a_png(artifact, capsys, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    code, out, _ = _bench(capsys, artifact("gguf"), "--plot", str(path))
    assert code == 0 and f"plot: {path}" in out
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000


def test_an_unwritable_plot_is_refused_before_measuring(artifact, capsys, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    inside = artifact("gguf") / "manifest.json"  # (a PNG over an artifact's manifest would break it)
    for path, message in [(tmp_path, "it is a folder"), (tmp_path / "missing" / "b.png", "there is no folder"),
                          (tmp_path / "speeds.txt", "name a .png file"), (inside, "it is inside the artifact")]:
        code, out, err = _bench(capsys, artifact("gguf"), "--plot", str(path))
        assert code == 2 and err.count("\n") == 1 and message in err, err
        assert "llmc" not in out  # (no table: nothing was measured)


@pytest.mark.parametrize("options", [
    ["--prompt-tokens", "0"], ["--prompt-tokens", "abc"], ["--prompt-tokens", "4,,8"], ["--depth", "-1"],
    ["--vs", "vllm"], ["--vs", "llama.cpp,bogus"], ["--decode-tokens", "0"],
])
def test_bad_options_are_one_line(artifact, capsys, options: list[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", str(artifact("gguf")), *options])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and ": error: " in err and "--help" in err


@pytest.mark.parametrize("form", ["gguf", "batched"])  # (a batched cache's shape has the slots second)
@pytest.mark.parametrize("options", [
    ["--prompt-tokens", "8", "--depth", "30"], ["--prompt-tokens", "8", "--decode-tokens", "40"],
    ["--prompt-tokens", "4", "--decode-tokens", "4"],  # the default depths that fit: 0 only
])
def test_capacity_is_checked_before_measuring(artifact, capsys, options: list[str], form: str) -> None:
    code = main(["bench", str(artifact(form)), "--repeat", "1", *options])
    out, err = capsys.readouterr()
    if "--depth" in options or "40" in options:
        assert code == 2 and err.count("\n") == 1 and "exceed the artifact's KV capacity of 32" in err and not out
    else:
        assert code == 0 and "depths 2048 left out: the KV capacity is 32" in err


@pytest.mark.parametrize("options", [["--vs", "transformers"], ["--plot", "b.png"], ["--depth", "0", "--model", "m"]])
def test_options_speculate_does_not_take_are_refused(artifact, capsys, options: list[str]) -> None:
    code = main(["bench", str(artifact("gguf")), "--speculate", *options])
    out, err = capsys.readouterr()
    assert code == 2 and err.count("\n") == 1 and "not for --speculate" in err and options[0] in err and not out


def test_missing_or_other_model_for_peers_is_one_line(artifact, tiny, capsys, tmp_path) -> None:
    """A --model that is not there, not a model, or another model than the artifact's (the peers would be timed on
    it: was "0.10x", exit 0): one line before anything is measured."""
    other = tiny(dataclasses.replace(SPEC, layers=SPEC.layers + 1), "gguf")
    (tmp_path / "notes.txt").write_text("not a model")
    for model, message in ((tmp_path / "none", "no such model"), (tmp_path / "notes.txt", "not a GGUF file"),
                           (other, f"is another model than the artifact's: its layers is {SPEC.layers + 1}, the "
                                   f"artifact's {SPEC.layers}")):
        code = main(["bench", str(artifact("gguf")), *FAST, "--vs", "transformers", "--model", str(model)])
        out, err = capsys.readouterr()
        assert code == 2 and err.count("\n") == 1 and message in err and not out, err


def test_the_attention_decode_benchmark_times_the_cpu_kernel() -> None:
    """`benchmarks/attention_decode.py` builds the decode attention kernel and reports its time per layer; a bad
    shape, an unknown CPU or caches too large for memory are one usage error (argparse's usage line, then it)."""
    script = Path(__file__).parents[1] / "benchmarks" / "attention_decode.py"
    run = subprocess.run([sys.executable, str(script), "--shape", "4,2,32", "--depth", "100", "--layers", "2",
                          "--repeat", "2"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    best = float(run.stdout.split("best ")[1].split(" us")[0])
    assert 0 < best < 1e6 and "H 4 KVH 2 D 32, depth 100, 2 layers' caches" in run.stdout
    for options, message in ((["--shape", "9,2,64"], "multiple of kv heads"), (["--shape", "9,3"], "three integers"),
                             (["--cpu", "bogus"], "unknown CPU 'bogus'"), (["--depth", "100000000"], "exceed")):
        bad = subprocess.run([sys.executable, str(script), *options], capture_output=True, text=True, timeout=300)
        last = bad.stderr.strip().splitlines()[-1]
        assert bad.returncode == 2 and last.startswith("attention_decode.py: error:") and message in last, bad.stderr


def test_the_decode_step_benchmark_times_each_artifact_in_turns(artifact) -> None:
    """`benchmarks/decode_step.py` times one decode call of each artifact in alternating turns; rows the artifact's
    cache has no slots for, a depth past its capacity or a missing artifact are one usage error."""
    script = Path(__file__).parents[1] / "benchmarks" / "decode_step.py"
    built = artifact("gguf")
    run = subprocess.run([sys.executable, str(script), str(built), str(built), "--depth", "5", "--turns", "2",
                          "--calls", "3"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == 2 and all(line.startswith(f"{built.name}: 1 row at depth 5: median ") for line in lines)
    assert all(0 < float(line.split("best ")[1].split(" ms")[0]) < 1e4 for line in lines)
    for options, message in ((["--rows", "2"], "need --max-batch 2"), (["--depth", "32"], "--max-seq above 32"),
                             (["--turns", "0"], "must be positive")):
        bad = subprocess.run([sys.executable, str(script), str(built), *options], capture_output=True, text=True,
                             timeout=300)
        last = bad.stderr.strip().splitlines()[-1]
        assert bad.returncode == 2 and last.startswith("decode_step.py: error:") and message in last, bad.stderr
    missing = subprocess.run([sys.executable, str(script), str(built.parent / "none")], capture_output=True,
                             text=True, timeout=300)
    assert missing.returncode == 2 and "none: no such artifact directory" in missing.stderr.strip().splitlines()[-1]


def test_the_aligned_buffers_benchmark_times_both_placements(artifact) -> None:
    """`benchmarks/aligned_buffers.py` fills the cache with `prefill`, then times decode with the runtime's buffers
    from a page and where numpy places them, in turns; a bad placement, rows the cache has no slots for, a depth past
    its capacity or a missing artifact are one usage error."""
    script = Path(__file__).parents[1] / "benchmarks" / "aligned_buffers.py"
    built = artifact("gguf")
    run = subprocess.run([sys.executable, str(script), str(built), "--depth", "5", "--turns", "2", "--calls", "3"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert [line.split(": ")[0] for line in lines] == [f"{built}:numpy", str(built)], lines
    assert all(0 < float(line.split("best ")[1].split(" ms")[0]) < 1e4 for line in lines)
    for options, message in (([str(built) + ":huge"], "must be 'numpy'"), ([str(built), "--rows", "2"],
                             "need --max-batch 2"), ([str(built), "--depth", "32"], "--max-seq above 32"),
                             ([str(built.parent / "none")], "none: no such artifact directory"),
                             ([str(built), "--turns", "0"], "must be at least 1")):
        bad = subprocess.run([sys.executable, str(script), *options], capture_output=True, text=True, timeout=300)
        last = bad.stderr.strip().splitlines()[-1]
        assert bad.returncode == 2 and last.startswith("aligned_buffers.py: error:") and message in last, bad.stderr


def test_the_phase_trace_patch_applies_and_traces_a_decode_step(tiny, tmp_path) -> None:
    """`benchmarks/phase_trace.patch` applies to the sources as they are (a copy of the package, which it patches),
    a model compiled from the patched copy keeps the barriers' time stamps, and `benchmarks/phase_trace.py` finds
    each layer's five phases (q/k/v, attention, o, SwiGLU, down) in every step and three more a step."""
    repo = Path(__file__).parents[1]
    package = tmp_path / "pkg" / "llmc"
    shutil.copytree(repo / "llmc", package, ignore=shutil.ignore_patterns("__pycache__"))
    for part in ("frontend", "ir", "passes", "backends", "runtime"):
        shutil.copytree(repo / part, package / part, ignore=shutil.ignore_patterns("__pycache__"))
    applied = subprocess.run(["git", "apply", "--directory=llmc", str(repo / "benchmarks" / "phase_trace.patch")],
                             cwd=package.parent, capture_output=True, text=True, timeout=60)
    assert applied.returncode == 0, applied.stderr
    # (run from tmp_path: `python -m` puts the working directory first on the path, and the repository's holds `llmc`)
    env = {**os.environ, "PYTHONPATH": str(package.parent), "LLMC_CACHE_DIR": str(tmp_path / "kernels")}
    traced = tmp_path / "traced.llmc"
    built = subprocess.run([sys.executable, "-m", "llmc", "compile", str(tiny(SPEC, "gguf")), "-o", str(traced),
                            "--max-seq", "32"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=600)
    assert built.returncode == 0, built.stderr
    steps = 4
    run = subprocess.run([sys.executable, str(repo / "benchmarks" / "phase_trace.py"), str(traced), "--layers",
                          str(SPEC.layers), "--steps", str(steps), "--depth", "9"],
                         capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0].startswith(f"{5 * SPEC.layers + 3} barriers a step, "), lines
    for place in range(5):
        line = next(line for line in lines if line.startswith(f"layer barrier {place} "))
        assert 0 < float(line.split("phase")[1].split("us")[0]) < 1e6
        assert line.endswith(f"(median of {SPEC.layers * steps})"), line


@pytest.mark.parametrize("script", sorted(p.name for p in (Path(__file__).parents[1] / "benchmarks").glob("*.py")))
def test_each_benchmark_script_answers_help(script, tmp_path) -> None:
    """Every `benchmarks/*.py` script prints argparse's usage for `--help` and writes nothing (three of them once
    took `--help` for the file or folder to write, and wrote a 114 MB model there)."""
    path = Path(__file__).parents[1] / "benchmarks" / script
    helped = subprocess.run([sys.executable, str(path), "--help"], capture_output=True, text=True, cwd=tmp_path,
                            timeout=120)
    assert helped.returncode == 0 and helped.stdout.startswith(f"usage: {script} "), helped.stderr
    assert not list(tmp_path.iterdir())
