"""Concurrent streams through `llmc serve`: each stream's text against the same request alone, and
aggregate decode tokens/s against one stream alone (issue: ≥ 4× with 8 streams).

    .venv/bin/llmc compile smollm2-135m --max-batch 8 -o smollm2-b8.llmc
    .venv/bin/python benchmarks/serve_bench.py smollm2-b8.llmc --streams 8 --tokens 64 [--vs-llama-server B/llama-server]
    .venv/bin/python benchmarks/serve_bench.py smollm2-b8.llmc --streams 4 --prompts copy --speculate

`--speculate` measures the server without speculative decoding and with it (prompt lookup), both
listening at once and measured in turn, and checks the texts are the same; `--prompts copy` sends prompts
whose continuation copies a passage they hold (where drafts are accepted), `open` (the default)
open-ended ones.

It starts `llmc serve` on a free loopback port, sends every prompt alone (streaming, greedy or at
`--temperature` with seed 0, `max_tokens` = --tokens, end of sequence ignored by choosing prompts that run long), then all of
them at once, through the official `openai` client. Decode rate of a stream: its tokens after the
first over the time from its first token to its last; aggregate: all streams' tokens after their
first over the time from the first first-token to the last last-token. With `--vs-llama-server`,
llama.cpp's server (`-np N`, continuous batching, the artifact's GGUF) is measured the same way.
Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

PROMPTS = [
    "The history of the city of Rome begins",
    "Here is a recipe for a simple tomato soup:",
    "The three most important ideas in physics are",
    "Once upon a time, in a small village by the sea,",
    "A short guide to writing clear Python code:",
    "The main causes of the French Revolution were",
    "To plant a vegetable garden, first",
    "The life cycle of a star starts when",
    "An introduction to the theory of computation:",
    "The rules of chess are simple:",
    "Photosynthesis is the process by which",
    "The first computers were built",
    "A travel guide to the mountains of Norway:",
    "The difference between weather and climate is",
    "How to train for a marathon in twelve weeks:",
    "The story of the Silk Road begins",
]
PASSAGES = [
    "The river Wensum rises near the village of Whissonsett and flows east through Fakenham and Norwich, where "
    "it joins the river Yare. Its chalk bed makes it one of the purest lowland rivers in England, home to brown "
    "trout, otters and the rare white-clawed crayfish.",
    "def mean(values):\n    total = 0\n    for value in values:\n        total += value\n    return total / "
    "len(values)\n\n\ndef variance(values):\n    m = mean(values)\n    return sum((v - m) ** 2 for v in values) "
    "/ len(values)\n",
    "Order 4471 was placed on 3 March by Dana Whitfield, 18 Elm Street, Leeds. It holds two boxes of green tea, "
    "one ceramic teapot and a set of six cups, and ships by courier within five working days.",
    "Photosynthesis turns light into chemical energy: chlorophyll in the chloroplasts absorbs light, water is "
    "split into oxygen and hydrogen, and the Calvin cycle fixes carbon dioxide into sugars the plant can use.",
]
# a passage, then the start of it again: the continuation copies the rest (prompt lookup drafts it)
COPY_PROMPTS = [f"{p}\n\nThe same text, word for word:\n\n{p[:40]}" for p in PASSAGES]


@dataclass
class Stream:
    text: str
    tokens: int
    first: float  # seconds since the epoch of the run
    last: float
    start: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, process: subprocess.Popen, timeout: float = 300) -> None:
    import httpx

    deadline = time.time() + timeout
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode}")
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{url} not ready after {timeout:.0f} s")


def one_stream(client, model: str, prompt: str, tokens: int, temperature: float, out: list, index: int) -> None:
    start = time.perf_counter()
    text, count, first, last = [], 0, None, None
    response = client.completions.create(model=model, prompt=prompt, max_tokens=tokens, temperature=temperature,
                                         seed=0, stream=True, stream_options={"include_usage": True})
    for chunk in response:
        now = time.perf_counter()
        if chunk.choices and chunk.choices[0].text:
            text.append(chunk.choices[0].text)
            first = first or now
            last = now
        if chunk.usage is not None:
            count = chunk.usage.completion_tokens
    out[index] = Stream("".join(text), count, first, last, start)


def run_streams(client, model: str, prompts: list[str], tokens: int, temperature: float = 0) -> list[Stream]:
    out: list = [None] * len(prompts)
    threads = [threading.Thread(target=one_stream, args=(client, model, p, tokens, temperature, out, i))
               for i, p in enumerate(prompts)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def decode_rate(streams: list[Stream]) -> float:
    after_first = sum(s.tokens - 1 for s in streams)
    return after_first / (max(s.last for s in streams) - min(s.first for s in streams))


def measure(base_url: str, prompts: list[str], tokens: int, repeat: int, temperature: float) -> dict:
    from openai import OpenAI

    client = OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    run_streams(client, model, prompts, 8)  # warm-up: weights paged in, every slot's cache pages touched
    alone = [[run_streams(client, model, [p], tokens, temperature)[0] for p in prompts] for _ in range(repeat)]
    together = [run_streams(client, model, prompts, tokens, temperature) for _ in range(repeat)]
    alone_rate = statistics.median(decode_rate([s]) for rep in alone for s in rep)
    best = max(together, key=decode_rate)
    same = all(together[r][i].text == alone[0][i].text for r in range(repeat) for i in range(len(prompts)))
    return {"alone": alone_rate, "together": decode_rate(best), "same_text": same, "text": [s.text for s in alone[0]],
            "tokens": [s.tokens for s in best], "wall": max(s.last for s in best) - min(s.start for s in best)}


def measured(servers: list[tuple[subprocess.Popen, str]], prompts: list[str], tokens: int, repeat: int,
             temperature: float) -> list[dict]:
    """`measure` on each server (a process and the URL it listens at) in turn, `repeat` rounds, all listening at
    once (each idle while another runs: a shared machine's noise falls on all alike); the median of each one's
    one-stream rates, its best aggregate, and its `/health` after. The servers are stopped after."""
    import httpx

    try:
        for process, url in servers:
            wait_ready(url + "/health", process)
        rounds = [[measure(url + "/v1", prompts, tokens, 1, temperature) for _, url in servers]
                  for _ in range(repeat)]
        results = []
        for i, (_, url) in enumerate(servers):
            mine = [r[i] for r in rounds]
            same = all(r["same_text"] and r["text"] == mine[0]["text"] for r in mine)
            results.append(max(mine, key=lambda r: r["together"]) | {
                "alone": statistics.median(r["alone"] for r in mine), "same_text": same,
                "health": httpx.get(url + "/health").json()})
        return results
    finally:
        for process, _ in servers:
            process.terminate()
            process.wait(30)


def serve_llmc(artifact: Path, streams: int, threads: int | None, speculate: bool) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [str(Path(sys.executable).parent / "llmc"), "serve", str(artifact), "--port", str(port),
               "--max-batch", str(streams), "--queue", str(4 * streams),
               "--speculate" if speculate else "--no-speculate"]
    if threads:
        command += ["--threads", str(threads)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return process, f"http://127.0.0.1:{port}"


def serve_llama(binary: str, gguf: str, streams: int, threads: int, ctx: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [binary, "-m", gguf, "--port", str(port), "--host", "127.0.0.1", "-np", str(streams),
               "-c", str(ctx * streams), "-t", str(threads), "-tb", str(threads), "--no-webui"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env=os.environ | {"LD_LIBRARY_PATH": str(Path(binary).parent)})
    return process, f"http://127.0.0.1:{port}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path, help="an artifact compiled with --max-batch ≥ --streams")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="each request's temperature (default 0: greedy; sampled streams are seeded, so their texts "
                        "alone and together still compare)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prompts", choices=("open", "copy"), default="open",
                   help="open-ended prompts, or ones that copy a passage they hold (default: open)")
    p.add_argument("--speculate", action="store_true", help="llmc serve without and with speculative decoding")
    p.add_argument("--vs-llama-server", metavar="PATH", help="llama.cpp's llama-server, run on the artifact's GGUF")
    args = p.parse_args()
    prompts = PROMPTS if args.prompts == "open" else COPY_PROMPTS
    if not 0 <= args.temperature <= 2:  # (the API's range, as OpenAI's)
        raise SystemExit(f"--temperature must be in [0, 2], got {args.temperature}")
    if not 1 <= args.streams <= len(prompts):
        raise SystemExit(f"--streams must be in 1..{len(prompts)} with --prompts {args.prompts}")
    prompts = prompts[: args.streams]
    variants = (False, True) if args.speculate else (False,)
    servers = [serve_llmc(args.artifact, args.streams, args.threads, speculate) for speculate in variants]
    rows = [(f"llmc serve {args.artifact.name}{' --speculate' if speculate else ''}", result)
            for speculate, result in zip(variants, measured(servers, prompts, args.tokens, args.repeat, args.temperature))]
    if args.vs_llama_server:
        manifest = json.loads((args.artifact / "manifest.json").read_text())
        threads = args.threads or len(os.sched_getaffinity(0))
        server = serve_llama(args.vs_llama_server, manifest["model"]["source_path"], args.streams, threads, 512)
        result = measured([server], prompts, args.tokens, args.repeat, args.temperature)[0]
        rows.append((f"llama-server -np {args.streams}", result))
    print(f"| server | 1 stream decode tok/s | {args.streams} streams aggregate tok/s | × one stream "
          f"| texts equal alone | tokens per stream | wall s |")
    print("|---|--:|--:|--:|---|---|--:|")
    for name, r in rows:
        tokens = sorted(set(r["tokens"]))
        print(f"| {name} | {r['alone']:.1f} | {r['together']:.1f} | {r['together'] / r['alone']:.2f}x "
              f"| {'yes' if r['same_text'] else 'NO'} | {','.join(map(str, tokens))} | {r['wall']:.2f} |")
    if args.speculate:
        same = rows[0][1]["text"] == rows[1][1]["text"]
        print(f"\nspeculative / plain: 1 stream {rows[1][1]['alone'] / rows[0][1]['alone']:.2f}x, {args.streams} "
              f"streams {rows[1][1]['together'] / rows[0][1]['together']:.2f}x; texts equal: {'yes' if same else 'NO'}")
        health = rows[1][1]["health"]
        print(f"drafts: {health['accepted_tokens']} of {health['drafted_tokens']} accepted in "
              f"{health['verify_calls']} verify calls, beside {health['decode_steps']} decode calls")
        if not same:
            return 1
    return 0 if all(r["same_text"] for name, r in rows if name.startswith("llmc")) else 1


if __name__ == "__main__":
    sys.exit(main())
