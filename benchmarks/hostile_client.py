"""`llmc serve` under a hostile client, beside a well-behaved one (issue 20's numbers).

    .venv/bin/llmc compile smollm2-135m --max-batch 4 -o smollm2.llmc
    .venv/bin/python benchmarks/hostile_client.py smollm2.llmc --seconds 60

The artifact is served from a copy (hard links, but its own `manifest.json`) whose chat
template hangs (a loop of 10^10 steps) when the last message is "hang", and renders the
model's own template otherwise. The good client repeats one small greedy chat request:
first alone (`--unloaded` times: its text and latency), then for `--seconds` while another
process attacks with five threads at once:

- big prompts: a 4 MB prompt, and one of the server's character limit (tokenized, refused);
- many messages: 400,000 messages, and the server's limit of messages (rendered, refused);
- a hanging template: chats ending in "hang" (the template's time budget ends each);
- slow clients: `--slow-connections` connections trickling header lines, and bodies that
  never complete;
- malformed bodies: lone surrogates, 5000-digit integers, 100k-deep JSON, non-UTF-8,
  non-objects, wrong types.

Reported: the share of good requests answered 200 with the unloaded text, their worst latency
against 2x the unloaded median + 1 s, the server's resident memory before the attack, at its
peak and after (within 100 MB of the start), how the hostile requests were answered (every
one 4xx, or its connection closed by a timeout), how long a slow connection was held, and
any traceback in the server's log. Exit status 1 if any of those targets is missed.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

import httpx

HANG = "hang"
GOOD_MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
GOOD_TOKENS = 16
WORDS = "the of a river city music light stone garden winter machine letter ocean market".split()
MALFORMED = [  # (path, body)
    ("completions", b'{"prompt": "a\\ud800b"}'),
    ("completions", b'{"prompt": "\xed\xa0\x80"}'),
    ("chat/completions", b'{"messages": [{"role": "user", "content": "\\udfff"}]}'),
    ("completions", b'{"prompt": "x", "model": "\\ud800"}'),
    ("completions", b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}"),
    ("completions", b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("chat/completions", b'{"messages": ' + b"{\"a\": " * 50_000 + b"1" + b"}" * 50_000 + b"}"),
    ("completions", b'\xff\xfe{"prompt": 1}'),
    ("completions", b"[1, 2]"),
    ("completions", b"null"),
    ("completions", b'{"prompt": "x", "temperature": NaN, "top_p": 1e999}'),
    ("completions", b'{"prompt": [1.5, true, null]}'),
    ("chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}'),
    ("chat/completions", b'{"messages": [null, 1, "x"]}'),
    ("completions", b'{"prompt": "x", "stop": [[]], "seed": {"a": []}, "n": 2}'),
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def hostile_copy(artifact: Path, directory: Path) -> Path:
    """`artifact` hard-linked into `directory`, its chat template hanging on a last message of "hang"."""
    copy = directory / artifact.name
    copy.mkdir()
    for file in artifact.iterdir():
        if file.name != "manifest.json":
            os.link(file, copy / file.name)
    manifest = json.loads((artifact / "manifest.json").read_text())
    template = manifest["tokenizer"]["chat_template"]
    if not template:
        raise SystemExit(f"{artifact} has no chat template")
    manifest["tokenizer"]["chat_template"] = (
        f"{{% if messages[-1]['content'] == '{HANG}' %}}{{% for i in range(100000) %}}{{% for j in range(100000) %}}"
        f"{{% endfor %}}{{% endfor %}}{{% endif %}}{template}")
    (copy / "manifest.json").write_text(json.dumps(manifest))
    return copy


def start(artifact: Path, threads: int | None) -> tuple[subprocess.Popen, str, list[str]]:
    port = free_port()
    command = [str(Path(sys.executable).parent / "llmc"), "serve", str(artifact), "--port", str(port)]
    if threads:
        command += ["--threads", str(threads)]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stderr: list[str] = []
    threading.Thread(target=lambda: stderr.extend(process.stderr), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"llmc serve exited with {process.returncode}: {''.join(stderr)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return process, url, stderr
        except httpx.HTTPError:
            time.sleep(0.3)
    raise SystemExit("llmc serve did not start")


def good_request(http: httpx.Client) -> tuple[float, int, str]:
    """(seconds, status, text) of the good client's request."""
    start = time.perf_counter()
    response = http.post("/v1/chat/completions",
                         json={"messages": GOOD_MESSAGES, "max_tokens": GOOD_TOKENS, "temperature": 0})
    seconds = time.perf_counter() - start
    text = response.json()["choices"][0]["message"]["content"] if response.status_code == 200 else response.text
    return seconds, response.status_code, text


# ------------------------------------------------------------------ the hostile process


def _post(url: str, path: str, body: bytes, counts: Counter, kind: str) -> None:
    try:
        response = httpx.post(f"{url}/v1/{path}", content=body, headers={"Content-Type": "application/json"},
                              timeout=60)
        counts[f"{kind} {response.status_code}"] += 1
    except httpx.TransportError:  # the server answered 413 and closed while the body was still going
        counts[f"{kind} closed while sending"] += 1


def _requests(url: str, deadline: float, kind: str, bodies: list[tuple[str, bytes]], counts: Counter) -> None:
    while time.time() < deadline:
        for path, body in bodies:
            _post(url, path, body, counts, kind)


def _slow(url: str, deadline: float, connections: int, counts: Counter, held: list[float]) -> None:
    """Connections that trickle header lines (one a second each), reopened when the server closes them,
    and bodies that never complete."""
    host, port = url.removeprefix("http://").split(":")
    opened: dict[socket.socket, float] = {}
    while time.time() < deadline:
        while len(opened) < connections:
            raw = socket.create_connection((host, int(port)))
            raw.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            opened[raw] = time.time()
        partial = socket.create_connection((host, int(port)))
        partial.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n{\"pro")
        opened[partial] = -time.time()  # (a body: read, not trickled)
        for raw, since in list(opened.items()):
            try:
                if since < 0:
                    raw.setblocking(False)
                    answer = raw.recv(4096)
                    if answer:
                        counts[f"slow body {answer.split()[1].decode()}"] += 1
                        held.append(time.time() + since)
                        raw.close()
                        del opened[raw]
                else:
                    raw.sendall(b"X-Slow: 1\r\n")
            except BlockingIOError:
                pass
            except OSError:
                counts["slow head closed by the server"] += 1
                held.append(time.time() - since)
                raw.close()
                del opened[raw]
        time.sleep(1)
    for raw in opened:
        raw.close()


def attack(url: str, seconds: float, max_chars: int, max_messages: int, connections: int, niceness: int,
           out) -> None:
    """The hostile client: five threads at once for `seconds`; sends its counts and slow-connection times."""
    os.nice(niceness)
    rng = random.Random(0)
    text = " ".join(rng.choice(WORDS) for _ in range(max_chars // 4))
    big = [("completions", json.dumps({"prompt": (text * (4_000_000 // len(text) + 1))[:4_000_000]}).encode()),
           ("completions", json.dumps({"prompt": text[:max_chars]}).encode())]
    many = [("chat/completions", json.dumps({"messages": [{"role": "user", "content": "hi"}] * 400_000}).encode()),
            ("chat/completions", json.dumps({"messages": [{"role": "user", "content": rng.choice(WORDS)}
                                                          for _ in range(max_messages)]}).encode())]
    hang = [("chat/completions", json.dumps({"messages": [{"role": "user", "content": HANG}]}).encode())]
    counts: Counter = Counter()
    held: list[float] = []
    deadline = time.time() + seconds
    threads = [threading.Thread(target=_requests, args=(url, deadline, kind, bodies, counts))
               for kind, bodies in (("big", big), ("messages", many), ("hang", hang), ("malformed", MALFORMED))]
    threads.append(threading.Thread(target=_slow, args=(url, deadline, connections, counts, held)))
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    out.send((dict(counts), held, cpu_seconds(os.getpid())))


# ------------------------------------------------------------------ the run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("artifact", type=Path)
    parser.add_argument("--seconds", type=float, default=60, help="how long the attack lasts (default: 60)")
    parser.add_argument("--unloaded", type=int, default=20, help="good requests alone (default: 20)")
    parser.add_argument("--slow-connections", type=int, default=50, help="slow clients at once (default: 50)")
    parser.add_argument("--threads", type=int, help="the server's --threads")
    parser.add_argument("--attacker-nice", type=int, default=0,
                        help="the hostile process's niceness: its own CPU time, on the server's machine here, "
                             "slows the good client too (default: 0)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        process, url, stderr = start(hostile_copy(args.artifact.resolve(), Path(scratch)), args.threads)
        try:
            return measure(process, url, stderr, args)
        finally:
            process.terminate()
            process.wait(30)


def measure(process: subprocess.Popen, url: str, stderr: list[str], args: argparse.Namespace) -> int:
    from llmc.runtime.server import Limits

    with httpx.Client(base_url=url, timeout=120) as http:
        limits = Limits.for_capacity(http.get("/v1/models").json()["data"][0]["max_model_len"])  # (the defaults)
        for _ in range(3):  # warm-up
            good_request(http)
        alone_cpu = cpu_seconds(process.pid)
        alone = [good_request(http) for _ in range(args.unloaded)]
        alone_cpu = cpu_seconds(process.pid) - alone_cpu
        assert all(status == 200 for _, status, _ in alone), alone
        expected = alone[0][2]
        unloaded = statistics.median(s for s, _, _ in alone)
        before = rss_mb(process.pid)

        receiving, sending = multiprocessing.Pipe(duplex=False)
        hostile = multiprocessing.get_context("spawn").Process(
            target=attack, args=(url, args.seconds, limits.max_chars, limits.max_messages, args.slow_connections,
                                 args.attacker_nice, sending))
        hostile.start()
        time.sleep(1)  # (the attack under way)
        loaded, peak, server_cpu, load = [], before, cpu_seconds(process.pid), os.getloadavg()[0]
        while hostile.is_alive():
            loaded.append(good_request(http))
            peak = max(peak, rss_mb(process.pid))
        counts, held, attacker_cpu = receiving.recv()
        server_cpu = cpu_seconds(process.pid) - server_cpu
        load = max(load, os.getloadavg()[0])
        hostile.join()
        time.sleep(2)
        after = rss_mb(process.pid)
        loaded.append(good_request(http))

    same = sum(status == 200 and text == expected for _, status, text in loaded)
    worst = max(s for s, _, _ in loaded)
    bound = 2 * unloaded + 1
    server_errors = {k: v for k, v in counts.items() if k.split()[-1].startswith("5")}
    tracebacks = "Traceback" in "".join(stderr)
    print(f"server        {url}: {limits.max_chars} characters, {limits.max_messages} messages, "
          f"{limits.max_body_bytes} body bytes, head {limits.head_seconds:g} s, body {limits.body_seconds:g} s")
    print(f"unloaded      {args.unloaded} requests, median {unloaded * 1000:.0f} ms, "
          f"worst {max(s for s, _, _ in alone) * 1000:.0f} ms, server CPU {alone_cpu / args.unloaded:.2f} s each; "
          f"text {expected!r}")
    print(f"under attack  {same}/{len(loaded)} good requests answered 200 with the same text ({100 * same / len(loaded):.1f}%); "
          f"median {statistics.median(s for s, _, _ in loaded) * 1000:.0f} ms, worst {worst * 1000:.0f} ms "
          f"(bound 2 x unloaded + 1 s = {bound * 1000:.0f} ms)")
    print(f"memory        RSS {before:.0f} MB before, {peak:.0f} MB peak, {after:.0f} MB after "
          f"({after - before:+.0f} MB)")
    print(f"hostile       {sum(counts.values())} requests: " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    if held:
        print(f"slow clients  held {min(held):.1f}-{max(held):.1f} s before the server closed them")
    print(f"CPU           server {server_cpu:.0f} s (good requests' share ≈ {alone_cpu / args.unloaded * len(loaded):.0f} "
          f"s), attacker {attacker_cpu:.0f} s in the {args.seconds:g} s attack "
          f"on {os.cpu_count()} CPUs; load average {load:.1f} (other processes included)")
    print(f"server log    {'TRACEBACKS:' if tracebacks else 'no tracebacks'}")
    if tracebacks:
        print("".join(stderr)[-3000:])
    ok = same == len(loaded) and worst <= bound and after - before <= 100 and not server_errors and not tracebacks
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
