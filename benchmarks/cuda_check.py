"""The CUDA backend's checks and numbers on a GPU machine, in one run (`benchmarks/cuda_check.sh` calls it).

1. the test suite's `gpu` tests (tiny models: the GPU against the CPU emulator);
2. a model of SmolLM2-135M's shapes with random blocks (the real GGUF does not travel), compiled
   for CUDA and for the CPU (a32: the same arithmetic): logits over 64 teacher-forced tokens and
   32 greedy tokens, GPU against CPU;
3. `llmc bench` of that artifact against transformers on the same GPU (prefill 512, decode 128);
4. decode of the SmolLM2-shaped model kernel by kernel (time, share, the GEMVs' read bandwidth);
5. batched decode (`--max-batch 8`) of the SmolLM2-shaped model through the engine: 8 greedy
   sequences together against each alone (decode tokens/s, and the same tokens);
6. a model of Llama-3.1-8B's shapes in q4_0: decode tokens/s × bytes read per token against the
   device-to-device copy bandwidth, and its decode kernel by kernel.

Everything it prints is also written to OUT/cuda_check.md. Steps run in order and each reports
its own failure; without a GPU the GPU steps say so and the rest still runs.

    python benchmarks/cuda_check.py OUT [--skip-8b]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
LOG: list[str] = []


def say(text: str) -> None:
    print(text, flush=True)
    LOG.append(text)


def run(cmd: list[str], timeout: int) -> int:
    say(f"$ {' '.join(cmd)}")
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        say(f"(timed out after {timeout} s)")
        return 124
    except OSError as e:
        say(f"(cannot run {cmd[0]}: {e.strerror})")
        return 127
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-40:]
    say("\n".join(tail))
    return proc.returncode


def step(name: str, fn) -> None:
    say(f"\n## {name}\n")
    start = time.perf_counter()
    try:
        fn()
    except Exception:  # a step's failure is reported, and the next steps still run
        say("FAILED:\n" + traceback.format_exc(limit=4))
    say(f"({time.perf_counter() - start:.1f} s)")


def llmc(*args: str) -> list[str]:
    return [sys.executable, "-m", "llmc", *args]


def gpu_tests() -> None:
    run([sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_cuda.py", "-p", "no:cacheprovider"], 300)


def agreement(work: Path) -> None:
    from shaped_gguf import write

    from llmc.runtime.artifact import load_manifest
    from llmc.runtime.cuda import CudaSession
    from llmc.runtime.session import Session

    gguf = write("smollm2-135m", work / "smollm2-shaped.gguf")
    run(llmc("compile", str(gguf), "--target", "cuda", "--gpu", "sm_90", "-o", str(work / "smollm2.cuda")), 300)
    run(llmc("compile", str(gguf), "--compute", "a32", "-o", str(work / "smollm2.cpu")), 300)
    gpu = CudaSession(load_manifest(work / "smollm2.cuda"))
    cpu = Session(work / "smollm2.cpu")
    tokens = np.random.default_rng(1).integers(3, 49152, 64).tolist()
    a = np.stack([gpu.feed([t]) for t in tokens])
    b = np.stack([cpu.feed([t]) for t in tokens])
    cos = (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)
    say(f"teacher-forced 64 tokens: min cosine {cos.min():.7f}, max |Δ| / max |logit| "
        f"{np.abs(a - b).max() / np.abs(b).max():.2e}, same top-1 {np.mean(a.argmax(-1) == b.argmax(-1)):.1%}")
    greedy = {}
    for name, session in (("cuda", gpu), ("cpu", cpu)):
        session.reset()
        logits, out = session.feed(tokens[:8]), []
        for _ in range(32):
            out.append(int(np.argmax(logits)))
            logits = session.feed([out[-1]])
        greedy[name] = out
    same = greedy["cuda"] == greedy["cpu"]
    say(f"32 greedy tokens: {'identical' if same else 'DIFFERENT'}\n  cuda {greedy['cuda']}\n  cpu  {greedy['cpu']}")
    gpu.close()
    cpu.close()


def bench_smollm2(work: Path) -> None:
    run(llmc("bench", str(work / "smollm2.cuda"), "--prompt-tokens", "128,512", "--depth", "0,2048",
             "--decode-tokens", "128", "--repeat", "3", "--vs", "transformers",
             "--model", str(work / "smollm2-shaped.gguf")), 400)


def profile(artifact: Path, depth: int = 512) -> None:
    """Decode launch by launch after `depth` tokens: time per kernel, and the GEMVs' read bandwidth."""
    from collections import defaultdict

    from llmc.runtime.artifact import load_manifest
    from llmc.runtime.cuda import CudaSession

    session = CudaSession(load_manifest(artifact))
    tokens = np.random.default_rng(2).integers(3, session.vocab_size, depth + 1).tolist()
    session.feed(tokens[:depth])
    rows = session.profile("decode", tokens[depth:])
    session.close()
    total = sum(t for _, t, _ in rows)
    by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0, 0])
    for name, t, nbytes in rows:
        entry = by_kernel[name]
        entry[0] += t
        entry[1] += 1
        entry[2] += nbytes
    say(f"decode at depth {depth}, {len(rows)} launches timed one by one: {total * 1e3:.3f} ms in kernels")
    say("| kernel | launches | ms | share | weights GB/s |\n|---|--:|--:|--:|--:|")
    for name, (t, count, nbytes) in sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:12]:
        rate = f"{nbytes / t / 1e9:.0f}" if nbytes else ""
        say(f"| {name} | {count} | {t * 1e3:.3f} | {t / total:.0%} | {rate} |")


def batched(work: Path, streams: int = 8, tokens: int = 64) -> None:
    """Engine-level continuous batching on the GPU: each sequence alone, then all together."""
    from llmc.runtime.artifact import load_manifest
    from llmc.runtime.batch import Engine, Request
    from llmc.runtime.cuda import CudaSession

    run(llmc("compile", str(work / "smollm2-shaped.gguf"), "--target", "cuda", "--gpu", "sm_90", "--max-seq", "1024",
             "--max-batch", str(streams), "-o", str(work / "smollm2-b8.cuda")), 300)
    session = CudaSession(load_manifest(work / "smollm2-b8.cuda"))
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, session.vocab_size, int(rng.integers(4, 40))).tolist() for _ in range(streams)]

    def generate(group: list[list[int]]) -> tuple[list[list[int]], float]:
        engine = Engine(session, end_ids=())
        out: list[list[int]] = [[] for _ in group]
        for prompt, seq in zip(group, out):
            engine.submit(Request(prompt, tokens, emit=lambda token, _, seq=seq: seq.append(token)))
        while any(s.token is None for s in engine.running) or engine.waiting:  # every prompt fed
            engine.step()
        start, before = time.perf_counter(), engine.decoded_rows
        while engine.busy:
            engine.step()
        return out, (engine.decoded_rows - before) / (time.perf_counter() - start)

    generate(prompts)  # warm-up: graphs captured for every batch size
    alone = [generate([p]) for p in prompts]
    together, rate = generate(prompts)
    one = float(np.median([r for _, r in alone]))
    same = together == [out[0] for out, _ in alone]
    say(f"{streams} sequences × {tokens} greedy tokens: one alone {one:.0f} tok/s, together {rate:.0f} tok/s "
        f"({rate / one:.2f}x); tokens {'identical' if same else 'DIFFERENT'} to each alone")
    session.close()


def llama_8b(work: Path) -> None:
    from shaped_gguf import write

    start = time.perf_counter()
    gguf = write("llama-3.1-8b-q4_0", work / "llama8b-q4_0.gguf")
    say(f"wrote {gguf} ({gguf.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - start:.0f} s")
    run(llmc("compile", str(gguf), "--target", "cuda", "--gpu", "sm_90", "--max-seq", "1024",
             "-o", str(work / "llama8b.cuda")), 600)
    run(llmc("bench", str(work / "llama8b.cuda"), "--prompt-tokens", "512", "--depth", "0",
             "--decode-tokens", "64", "--repeat", "2"), 400)
    profile(work / "llama8b.cuda")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--skip-8b", action="store_true", help="leave out the Llama-3.1-8B-shaped model")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path("/tmp/llmc-cuda-check")
    work.mkdir(parents=True, exist_ok=True)
    say("# llmc CUDA check\n")
    run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv"], 30)
    step("gpu tests", gpu_tests)
    step("SmolLM2-shaped: GPU against CPU", lambda: agreement(work))
    step("SmolLM2-shaped: llmc bench --vs transformers", lambda: bench_smollm2(work))
    step("SmolLM2-shaped: decode kernel by kernel", lambda: profile(work / "smollm2.cuda"))
    step("SmolLM2-shaped: 8 sequences decoded together", lambda: batched(work))
    if not args.skip_8b:
        step("Llama-3.1-8B-shaped q4_0: decode against the copy bandwidth", lambda: llama_8b(work))
    (args.out / "cuda_check.md").write_text("\n".join(LOG) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
