"""Fuzz every target for a set time, then the HTTP server with schemathesis; print what each found.

    python fuzz/run.py [--seconds 600] [--timeout 10] [--rss-limit-mb 2048] [TARGET ... | server]

Each atheris target (`python -m fuzz TARGET`) starts from its seeds (`fuzz/seeds.py` writes
them when missing) and a working corpus in `fuzz/work/TARGET/` that grows across runs. An input
that ends in anything but success or an `LlmcError` is saved in `fuzz/corpus/TARGET/`
(`finding-*`, with its traceback in `finding-*.txt`) and fuzzing goes on; an input slower than
`--timeout` seconds or a process above `--rss-limit-mb` stops libFuzzer, which saves it there
(`timeout-*`, `oom-*`, `crash-*`), and the target restarts until its time is spent.

`server` compiles a tiny model, starts `llmc serve` on a free port and runs `schemathesis run`
against its `/openapi.json` with the `not_a_server_error` check (no 5xx answer) for `--seconds`.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # `fuzz` as a package

from fuzz import TARGETS  # noqa: E402

FUZZ = ROOT / "fuzz"
WORK = FUZZ / "work"
# libFuzzer options per target: tokenizer.json is parsed and run in Rust, which atheris does not see, so
# its inputs look alike to libFuzzer; keep them whole rather than shrunk to the smallest such input
OPTIONS = {"tokenizer_json": ["-reduce_inputs=0"]}
FOUND = ("finding-", "crash-", "timeout-", "oom-", "leak-", "slow-unit-")


@dataclass
class Result:
    target: str
    seconds: float = 0.0
    executions: int = 0
    coverage: int = 0  # libFuzzer's `cov:` (edges) of the last run
    features: int = 0  # `ft:`
    starts: int = 0
    findings: list[str] = field(default_factory=list)

    def row(self) -> str:
        found = "; ".join(self.findings) or "none"
        return (f"| {self.target} | {self.seconds:.0f} | {self.executions} | {self.coverage} | {self.features} | "
                f"{self.starts} | {len(self.findings)}: {found} |")


def found(folder: Path) -> set[Path]:
    return {p for p in folder.glob("*") if p.name.startswith(FOUND) and p.suffix != ".txt"}


def describe(path: Path) -> str:
    note = path.with_name(path.name + ".txt")
    what = note.read_text().splitlines()[0] if note.is_file() else path.name.split("-")[0]
    return f"{path.name} ({what})"


def fuzz_target(target: str, seconds: float, timeout: int, rss_limit_mb: int) -> Result:
    seeds, work, corpus = FUZZ / "seeds" / target, WORK / target, FUZZ / "corpus" / target
    if not seeds.is_dir() or not any(seeds.iterdir()):
        subprocess.run([sys.executable, str(FUZZ / "seeds.py"), target], cwd=ROOT, check=True)
    work.mkdir(parents=True, exist_ok=True)
    corpus.mkdir(parents=True, exist_ok=True)
    before = found(corpus)
    result = Result(target)
    start = time.monotonic()
    deadline = start + seconds
    log = WORK / f"{target}.log"
    with log.open("a") as out:
        while (left := deadline - time.monotonic()) > 5:
            result.starts += 1
            command = [sys.executable, "-m", "fuzz", target, str(work), str(seeds), f"-max_total_time={int(left)}",
                       f"-timeout={timeout}", f"-rss_limit_mb={rss_limit_mb}", f"-artifact_prefix={corpus}/",
                       "-print_final_stats=1", *OPTIONS.get(target, [])]
            if (FUZZ / "dicts" / f"{target}.dict").is_file():  # the input language's words, for text targets
                command.append(f"-dict={FUZZ / 'dicts' / f'{target}.dict'}")
            try:
                text = subprocess.run(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      errors="replace", timeout=left + 120).stdout
            except subprocess.TimeoutExpired as e:  # libFuzzer itself stuck: count what it printed
                text = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
            out.write(text)
            units = re.findall(r"stat::number_of_executed_units: (\d+)", text)
            status = re.findall(r"^#(\d+)\s.*?cov: (\d+) ft: (\d+)", text, re.M)
            result.executions += int(units[-1]) if units else int(status[-1][0]) if status else 0
            if status:
                result.coverage, result.features = int(status[-1][1]), int(status[-1][2])
    result.seconds = time.monotonic() - start
    result.findings = [describe(p) for p in sorted(found(corpus) - before)]
    return result


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fuzz_server(seconds: float) -> int:
    """schemathesis against `llmc serve` of a tiny model; its exit status (0: no failed check)."""
    llmc = str(Path(sys.executable).with_name("llmc"))
    model = FUZZ / "seeds" / "gguf_file" / "llama.gguf"
    if not model.is_file():
        subprocess.run([sys.executable, str(FUZZ / "seeds.py"), "gguf_file"], cwd=ROOT, check=True)
    artifact = WORK / "server" / "tiny.llmc"
    subprocess.run([llmc, "compile", str(model), "--max-seq", "64", "-o", str(artifact)], check=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (WORK / "server" / "serve.log").open("w")
    server = subprocess.Popen([llmc, "serve", str(artifact), "--port", str(port), "--threads", "1"],
                              stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        for _ in range(120):
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except OSError:
                if server.poll() is not None:
                    raise SystemExit(f"llmc serve exited with {server.returncode}; see {log.name}")
                time.sleep(0.5)
        try:
            urllib.request.urlopen(f"{url}/openapi.json", timeout=5).close()
        except OSError as e:
            print(f"server: no schema at {url}/openapi.json ({e}); schemathesis not run")
            return 1
        command = [str(Path(sys.executable).with_name("schemathesis")), "run", f"{url}/openapi.json",
                   "--checks", "not_a_server_error", "--max-time", str(int(seconds)), "--workers", "1",
                   "--request-timeout", "60", "--suppress-health-check", "all",
                   "--report", "junit", "--report-dir", str(WORK / "server")]
        print("$", " ".join(command), flush=True)
        return subprocess.run(command, cwd=ROOT).returncode
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            print("server: still running 10 s after SIGTERM; killed")
            server.wait()
        log.close()
        tail = [line for line in Path(log.name).read_text().splitlines() if "Traceback" in line]
        if tail:
            print(f"server: {len(tail)} tracebacks in {log.name}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", metavar="TARGET", help=f"{', '.join(TARGETS)}, server (default: all)")
    parser.add_argument("--seconds", type=float, default=600, help="time per target (default: 600)")
    parser.add_argument("--timeout", type=int, default=10, help="seconds one input may take (default: 10)")
    parser.add_argument("--rss-limit-mb", type=int, default=2048, help="memory of a target's process (default: 2048)")
    args = parser.parse_args()
    unknown = set(args.targets) - {*TARGETS, "server"}
    if unknown:
        parser.error(f"unknown targets: {', '.join(sorted(unknown))}")
    results = []
    for target in [t for t in args.targets or TARGETS if t != "server"]:
        print(f"== {target}: {args.seconds:.0f} s", flush=True)
        results.append(fuzz_target(target, args.seconds, args.timeout, args.rss_limit_mb))
        print(results[-1].row(), flush=True)
    server = None
    if not args.targets or "server" in args.targets:
        print(f"== server: {args.seconds:.0f} s", flush=True)
        server = fuzz_server(args.seconds)
    print("\n| target | seconds | executions | coverage (edges) | features | starts | findings |")
    print("|---|--:|--:|--:|--:|--:|---|")
    for r in results:
        print(r.row())
    if server is not None:
        print(f"server (schemathesis, not_a_server_error): exit status {server}")
    sys.exit(1 if any(r.findings for r in results) or server else 0)


if __name__ == "__main__":
    main()
