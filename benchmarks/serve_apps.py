"""Serving for applications, measured through `llmc serve` with the official `openai` client over loopback:

    .venv/bin/python benchmarks/serve_apps.py --artifact smollm2.llmc [--quick]

(a) prefix cache: time to first token of a request with a ~1000-token prompt, then of a second one sharing
    that prefix with a different ending (goal: ≤ 0.15× the first's); each round's prefix is new (a nonce
    first), after a warm-up of the same length;
(b) structured output: decode tokens/s of JSON-schema-constrained chat replies against unconstrained ones
    of the same length (goal ≥ 0.9×; on the server as it runs, and on one started with --no-speculate,
    where the drafts of a repetitive JSON reply cannot help it), and 50 varied schemas (objects of string,
    integer, number, boolean, enum and array fields, strings bounded by maxLength so that answers end) whose
    answers must all validate (jsonschema);
(c) 8 concurrent streams mixing plain, JSON-mode and tool requests: every one must be served (answered to its
    end without an error; a reply that ends by itself must be whole: JSON mode's parses as an object, a tool
    request's calls name a tool given and their arguments parse; the count of those is printed too).

Prints a Markdown table and the CPU; exits 1 when a goal is missed. `--quick`: fewer rounds, 10 schemas. A
shared machine's noise moves a single rate by ±10%: (b) takes each side's best of 6 rounds, alternating.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import jsonschema
from openai import OpenAI
from serve_bench import free_port, wait_ready

TOPICS = ["a city", "a book", "a river", "a planet", "a recipe", "a bicycle", "a painter", "a mountain", "a song",
          "a computer", "a garden", "a ship", "a festival", "a bird", "a bridge", "a language"]
WORDS = ["name", "title", "color", "owner", "kind", "origin", "status", "label", "country", "material"]
ENUMS = [["red", "green", "blue"], ["small", "medium", "large"], ["new", "used"], ["north", "south", "east", "west"]]
# a varied English text to cut a ~1000-token prefix from (prompt lookup finds no copies to draft in it)
SENTENCES = [
    "The {0} of the old harbour town changed slowly over {1} years.",
    "Merchants from {0} brought spices, cloth and news of distant wars.",
    "In the {1}th year a storm broke the northern wall, and the council met for {0} days.",
    "Children learned to read from a single copy of the almanac kept at the {0} school.",
    "The river carried timber from the {0} forests down to the mills, {1} logs each spring.",
    "A traveller named {0} wrote that the market smelled of salt, tar and oranges.",
    "Every {1} weeks the ferry crossed to the island where the {0} lighthouse stood.",
    "The guild of {0} makers kept its accounts in a ledger bound with red leather.",
]
NAMES = ["Amsel", "Borrow", "Calder", "Dunmore", "Eskdale", "Fenwick", "Garth", "Holloway", "Ivel", "Jarrow"]


def long_text(tokens: int, codec_count, seed: int) -> str:
    """A text of about `tokens` tokens (counted by the server's /tokenize), different for each `seed`."""
    rng = random.Random(seed)
    sentences: list[str] = []
    text = ""
    while codec_count(text) < tokens:
        sentences += [rng.choice(SENTENCES).format(rng.choice(NAMES), rng.randint(2, 90)) for _ in range(8)]
        text = " ".join(sentences)
    return text


def random_schema(rng: random.Random) -> dict:
    """An object schema of 2 to 5 fields of the kinds JSON-schema users ask for, every answer bounded."""
    kinds = {
        "string": lambda: {"type": "string", "maxLength": rng.randint(5, 30)},
        "integer": lambda: {"type": "integer", "minimum": 0, "maximum": rng.choice([10, 100, 5000])},
        "number": lambda: {"type": "number", "minimum": 0, "maximum": 1000},
        "boolean": lambda: {"type": "boolean"},
        "enum": lambda: {"type": "string", "enum": rng.choice(ENUMS)},
        "array": lambda: {"type": "array", "items": rng.choice([{"type": "string", "maxLength": 12},
                                                                {"type": "integer", "minimum": 0, "maximum": 99}]),
                          "maxItems": rng.randint(1, 4)},
    }
    names = rng.sample(WORDS, rng.randint(2, 5))
    properties = {name: kinds[rng.choice(list(kinds))]() for name in names}
    return {"type": "object", "properties": properties, "required": names, "additionalProperties": False}


@dataclass
class Timed:
    """A streamed answer: its text, tokens, finish reason, and when its first and last pieces came."""

    text: str
    tokens: int
    finish: str | None
    first: float  # seconds after the request was sent
    last: float
    tool_calls: list


def streamed(client: OpenAI, model: str, chat: bool, prompt: str, **options) -> Timed:
    start = time.perf_counter()
    first = last = None
    text, tokens, finish, calls = [], 0, None, {}
    if chat:
        chunks = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                                stream=True, stream_options={"include_usage": True}, **options)
    else:
        chunks = client.completions.create(model=model, prompt=prompt, stream=True,
                                           stream_options={"include_usage": True}, **options)
    for chunk in chunks:
        now = time.perf_counter() - start
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        piece = (choice.delta.content if chat else choice.text) or ""
        for call in (choice.delta.tool_calls or []) if chat else []:
            whole = calls.setdefault(call.index, {"name": "", "arguments": ""})
            whole["name"] += call.function.name or ""
            whole["arguments"] += call.function.arguments or ""
        if piece or (chat and choice.delta.tool_calls):
            first = first if first is not None else now
            last = now
            text.append(piece)
        finish = choice.finish_reason or finish
    return Timed("".join(text), tokens, finish, first or 0.0, last or 0.0, [calls[i] for i in sorted(calls)])


def decode_rate(answer: Timed) -> float:
    return (answer.tokens - 1) / (answer.last - answer.first) if answer.last > answer.first else 0.0


# ------------------------------------------------------------------ (a) prefix cache


def first_token_seconds(client: OpenAI, model: str, prompt: str) -> float:
    """Seconds from sending a greedy completion of one token to its answer (whose first and only token it is)."""
    start = time.perf_counter()
    client.completions.create(model=model, prompt=prompt, max_tokens=1, temperature=0)
    return time.perf_counter() - start


def prefix_cache(client: OpenAI, model: str, url: str, count, rounds: int) -> dict:
    """Time to first token of a ~1000-token prompt, then of one sharing its prefix (median of `rounds`), and
    the tokens the second took from the cache."""
    def reused() -> int:
        return httpx.get(f"{url}/health").json()["reused_tokens"]

    first_token_seconds(client, model, long_text(1000, count, seed=0) + "\n\nIn short,")  # warm-up
    firsts, seconds, taken = [], [], []
    for r in range(rounds):
        prefix = f"[{uuid.uuid4().hex}] " + long_text(1000, count, seed=r + 1)
        firsts.append(first_token_seconds(client, model, prefix + "\n\nQuestion: who wrote about the market?"))
        before = reused()
        seconds.append(first_token_seconds(client, model, prefix + "\n\nQuestion: what broke the northern wall?"))
        taken.append(reused() - before)
    return {"prompt_tokens": count(prefix), "first": statistics.median(firsts), "second": statistics.median(seconds),
            "ratio": statistics.median(b / a for a, b in zip(firsts, seconds)), "reused": min(taken)}


# ------------------------------------------------------------------ (b) structured output


def constrained_rate(client: OpenAI, model: str, tokens: int, rounds: int) -> dict:
    """Decode tokens/s of a JSON-schema reply of `tokens` tokens against an unconstrained one as long (best of
    `rounds` each, alternating)."""
    schema = {"type": "object", "properties": {"cities": {"type": "array", "items": {"type": "string",
                                                                                     "maxLength": 24},
                                                          "minItems": 64, "maxItems": 64}},
              "required": ["cities"], "additionalProperties": False}
    ask = "List cities of the world."
    response_format = {"type": "json_schema", "json_schema": {"name": "cities", "schema": schema, "strict": True}}
    free, bound = [], []
    for _ in range(rounds):
        json_answer = streamed(client, model, True, ask, max_tokens=tokens, temperature=0,
                               response_format=response_format)
        plain_answer = streamed(client, model, True, "Write a long story about cities of the world.",
                                max_tokens=json_answer.tokens, temperature=0)
        bound.append(json_answer)
        free.append(plain_answer)
    best_bound, best_free = max(bound, key=decode_rate), max(free, key=decode_rate)
    return {"constrained": decode_rate(best_bound), "unconstrained": decode_rate(best_free),
            "tokens": (best_bound.tokens, best_free.tokens),
            "ratio": decode_rate(best_bound) / decode_rate(best_free)}


def schema_answers(client: OpenAI, model: str, count: int) -> dict:
    """`count` varied schemas, one request each: how many answers parse and validate; the failures' reasons."""
    rng = random.Random(23)
    valid, failures, tokens = 0, [], 0
    for i in range(count):
        schema, topic = random_schema(rng), rng.choice(TOPICS)
        answer = client.chat.completions.create(
            model=model, max_tokens=400, temperature=0,
            messages=[{"role": "user", "content": f"Describe {topic} as a JSON record."}],
            response_format={"type": "json_schema", "json_schema": {"name": f"record_{i}", "schema": schema,
                                                                    "strict": True}})
        tokens += answer.usage.completion_tokens
        content = answer.choices[0].message.content
        try:
            jsonschema.validate(json.loads(content), schema)
            valid += 1
        except (ValueError, jsonschema.ValidationError) as e:
            failures.append(f"schema {i} ({answer.choices[0].finish_reason}): {str(e).splitlines()[0][:100]}")
    return {"count": count, "valid": valid, "failures": failures, "tokens": tokens}


# ------------------------------------------------------------------ (c) mixed concurrent streams

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather now in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
MIXED_TOKENS = 300  # the most tokens of a JSON-mode or tool reply in (c)
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                   "required": ["city"], "additionalProperties": False}}}


def mixed_request(client: OpenAI, model: str, kind: str, i: int) -> tuple[str, bool, bool, str]:
    """One stream of `kind` (plain, json, tools): (kind, served, whole, what went wrong). Served: answered to
    its end without an error; whole: a reply that ended by itself (JSON mode's parses as an object, a tool
    request's calls name a tool given with arguments that parse); one cut by max_tokens is served, not whole."""
    try:
        if kind == "plain":
            answer = streamed(client, model, True, f"Tell me about {TOPICS[i % len(TOPICS)]}.", max_tokens=48)
            return kind, answer.finish in ("stop", "length") and answer.tokens > 0, answer.finish == "stop", ""
        if kind == "json":
            answer = streamed(client, model, True, f"Describe {TOPICS[i % len(TOPICS)]} as a JSON object with a "
                              "name and a color.", max_tokens=MIXED_TOKENS, temperature=0,
                              response_format={"type": "json_object"})
            if answer.finish == "stop" and not isinstance(json.loads(answer.text), dict):
                return kind, False, False, f"not an object: {answer.text[:100]}"
            return kind, answer.finish in ("stop", "length"), answer.finish == "stop", f"finish {answer.finish}"
        answer = streamed(client, model, True, f"What is the weather in {NAMES[i % len(NAMES)]}?",
                          max_tokens=MIXED_TOKENS, temperature=0, tools=[WEATHER, TIME], tool_choice="required",
                          parallel_tool_calls=False)
        if answer.finish == "tool_calls":
            whole = bool(answer.tool_calls) and all(
                c["name"] in ("get_weather", "get_time") and isinstance(json.loads(c["arguments"]), dict)
                for c in answer.tool_calls)
            return kind, whole, whole, f"calls {answer.tool_calls}"
        return kind, answer.finish == "length", False, f"finish {answer.finish}"
    except Exception as e:  # an error answered (or a broken stream) is this request's failure
        return kind, False, False, f"{type(e).__name__}: {str(e)[:200]}"


def mixed_streams(client: OpenAI, model: str, streams: int) -> dict:
    kinds = [("plain", "json", "tools")[i % 3] for i in range(streams)]
    started = time.perf_counter()
    with ThreadPoolExecutor(streams) as pool:
        results = list(pool.map(lambda ik: mixed_request(client, model, ik[1], ik[0]), enumerate(kinds)))
    return {"streams": streams, "served": sum(served for _, served, _, _ in results),
            "whole": sum(whole for _, _, whole, _ in results), "seconds": time.perf_counter() - started,
            "failures": [f"{kind}: {why}" for kind, served, _, why in results if not served]}


# ------------------------------------------------------------------ running it


def cpu_name(artifact: Path) -> str:
    """This machine's CPU (/proc/cpuinfo's model name), its cores, and the CPU the artifact was compiled for."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "unknown")
    except OSError:
        name = "unknown"
    compiled_for = json.loads((artifact / "manifest.json").read_text()).get("cpu", {}).get("name", "?")
    return f"{name}, {len(os.sched_getaffinity(0))} cores (the artifact's kernels: {compiled_for})"


def start_server(artifact: Path, log: Path, *options: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    command = [str(Path(sys.executable).parent / "llmc"), "serve", str(artifact), "--port", str(port), *options]
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=stderr)
    return process, f"http://127.0.0.1:{port}"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--artifact", type=Path, required=True, help="the artifact to serve (SmolLM2)")
    p.add_argument("--quick", action="store_true", help="one round each, 10 schemas (default: 3 rounds of (a), "
                   "the best of 6 of each (b) rate, 50 schemas)")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams in (c) (default 8)")
    args = p.parse_args()
    rounds, rate_rounds, schemas = (1, 1, 10) if args.quick else (3, 6, 50)
    logs = Path(f"/tmp/serve_apps-{uuid.uuid4().hex[:8]}")
    # the server as it runs by default, and one drafting nothing (decode tok/s without speculation's help)
    servers = [start_server(args.artifact, logs.with_suffix(".log")),
               start_server(args.artifact, logs.with_suffix(".plain.log"), "--no-speculate")]
    try:
        for process, url in servers:
            wait_ready(f"{url}/health", process)
        (_, url), (_, plain_url) = servers
        client = OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=900)
        plain_client = OpenAI(base_url=f"{plain_url}/v1", api_key="none", max_retries=0, timeout=900)
        model = client.models.list().data[0].id
        counted: dict[str, int] = {}
        lock = threading.Lock()

        def count(text: str) -> int:
            with lock:
                if text not in counted:
                    answer = httpx.post(f"{url}/tokenize", json={"content": text}, timeout=60)
                    counted[text] = len(answer.json()["tokens"])
                return counted[text]

        prefix = prefix_cache(client, model, url, count, rounds)
        tokens = 160 if args.quick else 320
        rates = {"": constrained_rate(client, model, tokens, rate_rounds),
                 ", --no-speculate": constrained_rate(plain_client, model, tokens, rate_rounds)}
        answers = schema_answers(client, model, schemas)
        mixed = mixed_streams(client, model, args.streams)
    finally:
        for process, _ in servers:
            process.terminate()
            process.wait(30)
    goals = {"prefix": prefix["ratio"] <= 0.15, "schemas": answers["valid"] == answers["count"],
             "mixed": mixed["served"] == mixed["streams"]} | {name: r["ratio"] >= 0.9 for name, r in rates.items()}
    mark = {True: "yes", False: "**NO**"}
    print(f"llmc serve {args.artifact.name} on {cpu_name(args.artifact)} (server logs: {logs}.*)\n")
    print("| measure | result | goal | met |")
    print("|---|---|---|---|")
    print(f"| (a) time to first token, {prefix['prompt_tokens']}-token prompt | {prefix['first']:.2f} s | | |")
    print(f"| (a) ... the second, same prefix, new ending ({prefix['reused']} tokens reused) "
          f"| {prefix['second']:.3f} s = {prefix['ratio']:.3f}× | ≤ 0.15× | {mark[goals['prefix']]} |")
    for name, rate in rates.items():
        print(f"| (b) decode tok/s, JSON schema vs free{name} ({rate['tokens'][0]} and {rate['tokens'][1]} tokens) "
              f"| {rate['constrained']:.1f} vs {rate['unconstrained']:.1f} = {rate['ratio']:.2f}× | ≥ 0.9× "
              f"| {mark[goals[name]]} |")
    print(f"| (b) schema answers that validate ({answers['tokens']} tokens) | {answers['valid']} of "
          f"{answers['count']} | all | {mark[goals['schemas']]} |")
    print(f"| (c) concurrent streams (plain, JSON mode, tools) served | {mixed['served']} of {mixed['streams']} "
          f"in {mixed['seconds']:.1f} s ({mixed['whole']} ended by themselves, the rest at max_tokens) | all "
          f"| {mark[goals['mixed']]} |")
    for failure in answers["failures"] + mixed["failures"]:
        print(f"- {failure}")
    return 0 if all(goals.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
