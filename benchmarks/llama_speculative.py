"""llama.cpp's own speculative decoding on the prompts llmc's speculation is measured on, in one run.

    python benchmarks/llama_speculative.py /tmp/llamacpp/build/bin --threads 2 --tokens 128 --rounds 3

Each prompt is rendered with the model's chat template (as `llmc run --chat` renders it) and
decoded greedily (`--temp 0`) for --tokens tokens by each method, the methods alternating
within a round; a cell is the best of the rounds' decode tokens/s as the tool reports it, as `llmc bench`'s
(`decoded N tokens in S seconds`); its ratio, and its text, are against the same program drafting nothing
on the same prompt (the two programs feed the prompt in different batches, so their greedy texts can differ).

- lookup plain: `llama-lookup --spec-draft-n-max 0`, one token per call
- lookup dK: `llama-lookup --spec-draft-n-max K`, prompt lookup over the prompt and the text so far (n-grams 1-4)
- spec plain: `llama-speculative-simple --spec-type ngram-simple --spec-ngram-simple-size-n 1024`, a key
  that never matches: one token per call
- ngram-simple n3 mK: `llama-speculative-simple --spec-type ngram-simple`, drafting the K tokens that
  followed the last earlier occurrence of the last 3 tokens
- with --llama-defaults, ngram-simple, ngram-map-k, ngram-mod: `llama-speculative-simple --spec-type T` with
  llama.cpp's defaults (ngram-simple: 12-token key, 48-token drafts; ngram-mod: 24-token match, 48-64-token drafts)

`same` says whether the method's text agrees with its plain's as far as both go.
The prompts: `llmc bench --speculate`'s, or --prompts FILE of `### name kind` headers,
each followed by its prompt.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SMOLLM2_GGUF = "smollm2-135m"
SPEC_TYPES = ("ngram-simple", "ngram-map-k", "ngram-mod")


@dataclass
class Prompt:
    name: str
    kind: str  # "grounded" (copies from its input) or "open"
    text: str


@dataclass
class Method:
    command: list[str]  # before the common model, prompt and sampling arguments
    plain: str  # the method it is measured against: the same program, drafting nothing


@dataclass
class Result:
    tokens: int
    seconds: float
    drafted: int
    accepted: int
    text: str


def read_prompts(path: Path) -> list[Prompt]:
    """Prompts from a text file of `### name kind` headers, each followed by its prompt.

    >>> import pathlib, tempfile; f = pathlib.Path(tempfile.mkdtemp()) / "p.txt"
    >>> _ = f.write_text("### sum grounded\\nSummarize: a b c.\\n### tale open\\nTell a story.\\n")
    >>> [(p.name, p.kind, p.text) for p in read_prompts(f)]
    [('sum', 'grounded', 'Summarize: a b c.'), ('tale', 'open', 'Tell a story.')]
    """
    prompts = []
    for block in re.split(r"^### ", path.read_text(), flags=re.M)[1:]:
        header, _, text = block.partition("\n")
        name, kind = header.split()
        prompts.append(Prompt(name, kind, text.strip()))
    return prompts


def methods(bin_dir: Path, draft: int, llama_defaults: bool) -> dict[str, Method]:
    lookup = str(bin_dir / "llama-lookup")
    spec = [str(bin_dir / "llama-speculative-simple"), "--spec-type"]
    simple = [*spec, "ngram-simple", "--spec-ngram-simple-size-n"]
    found = {"lookup plain": Method([lookup, "--spec-draft-n-max", "0"], "lookup plain"),
             f"lookup d{draft}": Method([lookup, "--spec-draft-n-max", str(draft)], "lookup plain"),
             "spec plain": Method([*simple, "1024"], "spec plain"),
             f"ngram-simple n3 m{draft}": Method([*simple, "3", "--spec-ngram-simple-size-m", str(draft)],
                                                 "spec plain")}
    if llama_defaults:
        found.update({t: Method([*spec, t], "spec plain") for t in SPEC_TYPES})
    return found


def number(pattern: str, log: str) -> float:
    match = re.search(pattern, log)
    return float(match.group(1)) if match else 0.0


def run(command: list[str], prompt: str, gguf: Path, threads: int, tokens: int) -> Result:
    """One greedy decode of the rendered `prompt` (`-p`: `-f` drops the template's last newline); its text is
    the tool's standard output (the prompt's echo, then the generated tokens)."""
    done = subprocess.run([*command, "-m", str(gguf), "-p", prompt, "-n", str(tokens), "-t", str(threads),
                           "-c", "2048", "--temp", "0", "--seed", "1"],
                          capture_output=True, text=True, timeout=600)
    if done.returncode:
        sys.exit(f"{' '.join(command)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    log = done.stderr
    decoded = re.search(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds", log)
    if not decoded:
        sys.exit(f"{' '.join(command)} printed no decode time:\n{log[-3000:]}")
    return Result(int(decoded.group(1)), float(decoded.group(2)),
                  int(number(r"n_drafted\s+=\s+(\d+)", log)), int(number(r"n_accept\s+=\s+(\d+)", log)), done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("bin_dir", type=Path, help="llama.cpp's build/bin (llama-lookup, llama-speculative-simple)")
    parser.add_argument("--model", default=SMOLLM2_GGUF, help="a GGUF file or llmc model name (default SmolLM2)")
    parser.add_argument("--prompts", type=Path, help="a prompts file (default: llmc bench --speculate's)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--draft", type=int, default=8, help="most tokens drafted per call")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--llama-defaults", action="store_true",
                        help="also llama.cpp's n-gram speculators with their default sizes (slow where they miss)")
    args = parser.parse_args()

    from llmc.frontend import load_tokenizer, resolve

    gguf = resolve(args.model)
    codec = load_tokenizer(str(gguf))
    prompts = read_prompts(args.prompts) if args.prompts else builtin_prompts()
    found = methods(args.bin_dir, args.draft, args.llama_defaults)
    results: dict[tuple[str, str], list[Result]] = {}
    for prompt in prompts:
        rendered = codec.chat(prompt.text)
        for _ in range(args.rounds):
            for name, method in found.items():
                result = run(method.command, rendered, gguf, args.threads, args.tokens)
                print(f"{prompt.name} {name}: {result.tokens / result.seconds:.1f} tok/s, "
                      f"{result.accepted}/{result.drafted} accepted", file=sys.stderr, flush=True)
                results.setdefault((prompt.name, name), []).append(result)
    print_table(prompts, found, results)


def builtin_prompts() -> list[Prompt]:
    """`llmc bench --speculate`'s prompts (llmc.runtime.speculate_prompts), named g1.. and o1.."""
    from llmc.runtime.speculate_prompts import GROUNDED, OPEN_ENDED

    return [*(Prompt(f"g{i}", "grounded", text) for i, text in enumerate(GROUNDED, 1)),
            *(Prompt(f"o{i}", "open", text) for i, text in enumerate(OPEN_ENDED, 1))]


def agree(text: str, other: str) -> bool:
    """Whether two greedy texts agree as far as both go (a speculative run may stop a few tokens past
    --tokens: its last call accepted them)."""
    n = min(len(text), len(other))
    return text[:n] == other[:n]


def print_table(prompts: list[Prompt], found: dict[str, Method], results: dict[tuple[str, str], list[Result]]) -> None:
    print("| prompt | kind | method | tok/s | x its plain | drafted | accepted | accept % | same text |")
    print("|---|---|---|---|---|---|---|---|---|")
    ratios: dict[tuple[str, str], list[float]] = {}
    for prompt in prompts:
        for name, method in found.items():
            runs, plain = results[prompt.name, name], results[prompt.name, method.plain]
            speed = max(r.tokens / r.seconds for r in runs)
            ratio = speed / max(r.tokens / r.seconds for r in plain)
            ratios.setdefault((prompt.kind, name), []).append(ratio)
            drafted, accepted = runs[0].drafted, runs[0].accepted
            accept = f"{100 * accepted / drafted:.0f}" if drafted else "-"
            same = all(agree(r.text, plain[0].text) for r in runs)
            print(f"| {prompt.name} | {prompt.kind} | {name} | {speed:.1f} | {ratio:.2f} | {drafted} | {accepted} "
                  f"| {accept} | {'yes' if same else 'NO'} |")
    print("\nby kind: all prompts' tokens over their best runs' seconds (as llmc bench --speculate), and the "
          "geometric mean of the prompts' ratios to the same program's plain decode")
    for (kind, name), values in ratios.items():
        best = [min(results[p.name, name], key=lambda r: r.seconds) for p in prompts if p.kind == kind]
        speed = sum(r.tokens for r in best) / sum(r.seconds for r in best)
        print(f"  {kind:9} {name:20} {speed:6.1f} tok/s  {statistics.geometric_mean(values):.2f}x")


if __name__ == "__main__":
    main()
