"""A soak of `llmc serve`: mixed streaming, non-streaming, cancelled and malformed requests for a while,
then whether every valid request succeeded and whether the server's memory stayed flat.

    .venv/bin/llmc compile smollm2-135m --max-batch 8 -o smollm2-b8.llmc
    .venv/bin/python benchmarks/serve_soak.py smollm2-b8.llmc --minutes 3 --clients 12

`--clients` threads send requests in a loop, each drawn at random: a streamed completion, a whole
chat completion, a stream the client drops after a few chunks, or a malformed body (bad JSON, a
wrong type, an unknown field, a prompt longer than the cache). More clients than slots keep the
queue in use (a 429 answer is counted, not failed). The server's resident memory (`/proc/PID/
status`) is read every few seconds; the first third of the run is the warm-up (every slot's cache
pages touched), and the rest must stay within `--rss-slack` MB of the warm-up's peak. Exit status 1
on any failed valid request, any malformed request not answered 400, or memory growth.
"""

from __future__ import annotations

import argparse
import random
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

WORDS = "the of a river city music light stone garden winter machine letter ocean market".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 40)))


def client(url: str, model: str, capacity: int, deadline: float, seed: int, counts: Counter, failures: list) -> None:
    rng = random.Random(seed)
    http = httpx.Client(base_url=url, timeout=120)
    while time.time() < deadline:
        kind = rng.choice(["stream", "whole-chat", "dropped", "malformed"])
        try:
            if kind == "stream":
                body = {"model": model, "prompt": prompt(rng), "max_tokens": rng.randint(1, 48), "stream": True,
                        "temperature": rng.choice([0, 0.8]), "seed": rng.randint(0, 9)}
                with http.stream("POST", "/v1/completions", json=body) as r:
                    lines = [line for line in r.iter_lines() if line]
                if r.status_code == 429:
                    counts["429"] += 1
                    continue
                if r.status_code != 200 or lines[-1] != "data: [DONE]" or '"error"' in "".join(lines):
                    failures.append(f"stream: {r.status_code} {lines[-2:]}")
            elif kind == "whole-chat":
                body = {"model": model, "messages": [{"role": "user", "content": prompt(rng)}],
                        "max_tokens": rng.randint(1, 32), "temperature": 0}
                r = http.post("/v1/chat/completions", json=body)
                if r.status_code == 429:
                    counts["429"] += 1
                    continue
                if r.status_code != 200 or r.json()["choices"][0]["finish_reason"] not in ("stop", "length"):
                    failures.append(f"chat: {r.status_code} {r.text[:200]}")
            elif kind == "dropped":
                body = {"model": model, "prompt": prompt(rng), "max_tokens": 64, "stream": True}
                with http.stream("POST", "/v1/completions", json=body) as r:
                    if r.status_code == 429:
                        counts["429"] += 1
                        continue
                    for i, _ in enumerate(r.iter_lines()):
                        if i >= rng.randint(0, 6):
                            break  # the client goes away mid-stream
            else:
                bad = rng.choice([
                    ("/v1/completions", b"{not json"),
                    ("/v1/completions", b'{"prompt": 5, "max_tokens": "many"}'),
                    ("/v1/chat/completions", b'{"messages": [], "frobnicate": 1}'),
                    ("/v1/completions", ('{"prompt": "%s"}' % ("word " * (capacity + 50))).encode()),
                ])
                r = http.post(bad[0], content=bad[1], headers={"content-type": "application/json"})
                if r.status_code != 400 or "error" not in r.json():
                    failures.append(f"malformed {bad[1][:40]!r}: {r.status_code}")
            counts[kind] += 1
        except Exception as e:  # a valid request that failed outright
            failures.append(f"{kind}: {type(e).__name__}: {e}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("artifact", type=Path)
    p.add_argument("--minutes", type=float, default=3.0)
    p.add_argument("--clients", type=int, default=12)
    p.add_argument("--rss-slack", type=float, default=16.0, help="MB the memory may grow after warm-up")
    args = p.parse_args()
    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "llmc"), "serve", str(args.artifact),
                               "--port", str(port), "--queue", "4"], stdout=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                health = httpx.get(url + "/health", timeout=2).json()
                break
            except httpx.HTTPError:
                time.sleep(0.5)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        start = time.time()
        deadline = start + args.minutes * 60
        counts: Counter = Counter()
        failures: list[str] = []
        threads = [threading.Thread(target=client, args=(url, model, health["capacity"], deadline, i, counts,
                                                         failures)) for i in range(args.clients)]
        for t in threads:
            t.start()
        samples = []
        while any(t.is_alive() for t in threads):
            samples.append((time.time() - start, rss_mb(server.pid)))
            time.sleep(3)
        for t in threads:
            t.join()
        final = httpx.get(url + "/health").json()
    finally:
        server.terminate()
        server.wait(30)
    warm = [r for t, r in samples if t < args.minutes * 20]
    after = [r for t, r in samples if t >= args.minutes * 20]
    growth = max(after) - max(warm) if after and warm else 0.0
    print(f"client side (429: refused while the queue was full): {dict(counts)}")
    print(f"server side: {final['requests']}, {final['generated_tokens']} tokens generated")
    print(f"memory: warm-up peak {max(warm):.1f} MB, after it {min(after):.1f}..{max(after):.1f} MB "
          f"(growth {growth:+.1f} MB over {len(after)} samples)")
    print(f"failures: {len(failures)}" + "".join(f"\n  {f}" for f in failures[:10]))
    ok = not failures and growth <= args.rss_slack and final["running"] == 0 and final["waiting"] == 0
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
