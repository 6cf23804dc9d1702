"""How closely builds of one model answer like a reference build (issue 21: fidelity).

    python benchmarks/chat_check.py f32.llmc default.llmc a32.llmc --json fidelity.json

The first directory is the reference (a `--quant f32` build); every other one is compared
with it, on:

- chat: the first 24 greedy tokens after each of `QUESTIONS`, rendered with the artifact's
  chat template (an answer stops early at the end-of-turn token, which counts as a token);
  how many equal the reference's, and where the first difference lies on average (24 where
  the answers agree);
- plain: the same for the first 32 tokens after each of `PLAIN` (story openings, code
  stubs, facts), without a template;
- KL: teacher-forced on each chat prompt followed by the reference's answer, the mean
  KL(reference ‖ build) of the next-token distributions at the rows that predict the
  answer's tokens (nats), each from the entry point generation samples from: the prompt's
  last row from `prefill`, every later one from a `decode` step;
- held-out perplexity: `llmc.runtime.perplexity` (llama.cpp's method) on `heldout.txt`
  beside this script, prose written for this check and in no calibration set (the
  number `llmc perplexity BUILD --text benchmarks/heldout.txt --ctx 256` prints).

A markdown table goes to stdout; `--json FILE` also writes every answer, as token ids and
text, and the per-question results; `--answers FILE` writes the reference's answers as
markdown, each with the builds' answers that differ from it.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from llmc.errors import LlmcError, printable
from llmc.runtime.codec import TextCodec
from llmc.runtime.perplexity import chunk_tokens, kl_divergence, log_softmax, perplexity
from llmc.runtime.session import Conversation, open_session

CHAT_TOKENS = 24
PLAIN_TOKENS = 32
HELD_OUT = Path(__file__).with_name("heldout.txt")

QUESTIONS = [
    # facts
    "What is the capital of France?", "What is the capital of Japan?", "Who wrote Romeo and Juliet?",
    "How many days are in a week?", "What is the largest planet in our solar system?",
    "What color is the sky on a clear day?", "What is 12 times 12?", "What gas do plants absorb from the air?",
    "Who painted the Mona Lisa?", "What is the boiling point of water in Celsius?", "Name three primary colors.",
    "What is the chemical symbol for gold?", "How many continents are there?", "What is the longest river in the world?",
    "What language is spoken in Brazil?", "What does a thermometer measure?",
    "Who was the first person to walk on the moon?", "What is photosynthesis?", "Give me a synonym for happy.",
    "What is the opposite of cold?", "How do I make a cup of tea?", "What is the square root of 81?",
    "Why do leaves change color in autumn?", "What is the tallest mountain on Earth?", "Write a haiku about the sea.",
    "What is an atom?", "How many legs does a spider have?", "What is the freezing point of water in Fahrenheit?",
    "Tell me a fun fact about cats.", "What is the speed of light?", "Explain what a computer is in one sentence.",
    "What is the main ingredient in guacamole?", "Who invented the telephone?", "What is the smallest prime number?",
    "What are the three states of matter?", "Translate 'thank you' into Spanish.", "What is the capital of Italy?",
    "How many hours are in a day?", "What is gravity?", "Suggest a name for a pet dog.",
    "What is the currency of the United Kingdom?", "How many sides does a hexagon have?",
    # arithmetic, definitions, how-to, short creative asks
    "What is 15 plus 27?", "What is 100 divided by 4?", "What does the word 'ubiquitous' mean?", "What is a noun?",
    "How do I boil an egg?", "How can I fall asleep faster?", "Write a two-line poem about rain.",
    "Give me a title for a mystery novel.",
]

PLAIN = [
    "Once upon a time, in a small village by the sea,",
    "def factorial(n):\n    if n == 0:\n        return 1\n    return",
    "The capital of France is", "Water is made of two elements:", "The quick brown fox",
    "In 1492, Christopher Columbus", "import numpy as np\n\ndef mean(values):\n",
    "The three laws of motion were described by", "My favorite recipe for pancakes starts with",
    "The human heart has four chambers:", "Machine learning is a field of", "class Stack:\n    def __init__(self):\n",
    "It was a dark and stormy night, and the captain of the little ship", "for i in range(10):\n",
    "Dear hiring manager,\n\nI am writing to apply for", "The mitochondria is",
]


def greedy_answer(session: Conversation, prompt: list[int], count: int, stop: int | None) -> list[int]:
    """The first `count` greedy tokens after `prompt`, fewer where `stop` comes (kept, last)."""
    session.reset()
    answer = [session.greedy(prompt)]
    while len(answer) < count and answer[-1] != stop:
        answer.append(session.greedy([answer[-1]]))
    return answer


def first_difference(answer: list[int], reference: list[int], count: int) -> int:
    """The position of the first token where `answer` leaves `reference`; `count` where they agree."""
    return next((i for i, (a, b) in enumerate(zip(answer, reference)) if a != b), count)


def answer_log_probs(session: Conversation, prompt: list[int], answer: list[int]) -> np.ndarray:
    """Teacher-forced on `prompt + answer`: the log-probabilities of the rows that predict `answer`, as
    generation gets them (the prompt fed at once, then the answer a `decode` step a token)."""
    session.reset()
    rows = [session.feed(prompt)] + [session.feed([token]) for token in answer[:-1]]
    return log_softmax(np.stack(rows))


class Build:
    """One artifact's session, the prompts tokenized for it, and what it answered."""

    def __init__(self, directory: Path, threads: int):
        self.name = directory.name or str(directory)
        self.session = open_session(directory, threads=threads)
        self.codec = TextCodec.from_artifact(self.session.manifest)
        self.tokenizer = self.session.manifest.data["files"]["tokenizer"]["sha256"]
        self.chat: list[list[int]] = []
        self.plain: list[list[int]] = []
        self.chat_first: list[int] = []
        self.plain_first: list[int] = []
        self.kl: list[np.ndarray] = []
        self.perplexity: tuple[float, float] | None = None

    def close(self) -> None:
        self.session.close()

    def results(self, reference: Build) -> dict:
        same_chat = [a == b for a, b in zip(self.chat, reference.chat)]
        same_plain = [a == b for a, b in zip(self.plain, reference.plain)]
        return {
            "chat_same": sum(same_chat), "chat_count": len(same_chat),
            "plain_same": sum(same_plain), "plain_count": len(same_plain),
            "chat_first_difference": float(np.mean(self.chat_first)) if self.chat_first else None,
            "plain_first_difference": float(np.mean(self.plain_first)) if self.plain_first else None,
            "chat_kl": float(np.concatenate(self.kl).mean()) if self.kl else None,
            "held_out_perplexity": self.perplexity[0], "held_out_perplexity_error": self.perplexity[1],
            "chat_answers": [self.codec.decode(a) for a in self.chat],
            "plain_answers": [self.codec.decode(a) for a in self.plain],
            "chat_ids": self.chat, "plain_ids": self.plain,
            "chat_same_each": same_chat, "plain_same_each": same_plain,
        }


def check(reference: Build, builds: list[Build], questions: list[str], plain: list[str], text: str, ctx: int,
          progress=lambda line: None) -> dict:
    """Every measurement of the module docstring, for `builds` against `reference`: {name: results}."""
    codec = reference.codec
    chunks = chunk_tokens(codec.encode(text), ctx, None, codec.bos_id, codec.add_bos)  # first: a bad --ctx fails early
    for build in [reference, *builds]:
        build.perplexity = perplexity(build.session, chunks).estimate()
    progress("held-out perplexity done")
    eos = codec.eos_id
    for i, question in enumerate(questions, 1):
        prompt = codec.encode(codec.chat(question))
        answer = greedy_answer(reference.session, prompt, CHAT_TOKENS, eos)
        reference.chat.append(answer)
        base = answer_log_probs(reference.session, prompt, answer)
        for build in builds:
            mine = greedy_answer(build.session, prompt, CHAT_TOKENS, eos)
            build.chat.append(mine)
            build.chat_first.append(first_difference(mine, answer, CHAT_TOKENS))
            build.kl.append(kl_divergence(base, answer_log_probs(build.session, prompt, answer)))
        if i % 10 == 0:
            progress(f"chat {i}/{len(questions)}")
    for opening in plain:
        prompt = codec.encode(opening)
        answer = greedy_answer(reference.session, prompt, PLAIN_TOKENS, None)
        reference.plain.append(answer)
        for build in builds:
            mine = greedy_answer(build.session, prompt, PLAIN_TOKENS, None)
            build.plain.append(mine)
            build.plain_first.append(first_difference(mine, answer, PLAIN_TOKENS))
    progress("plain prompts done")
    return {build.name: build.results(reference) for build in [reference, *builds]}


def table(results: dict, reference: str) -> str:
    """The markdown table of `check`'s results (the reference's row: its perplexity only)."""
    lines = ["| build | chat: first 24 same | plain: first 32 same | chat: mean first diff | plain: mean first diff "
             "| chat KL vs ref (nats) | held-out ppl |",
             "|---|--:|--:|--:|--:|--:|--:|"]
    for name, r in results.items():
        ppl = f"{r['held_out_perplexity']:.3f} ± {r['held_out_perplexity_error']:.3f}"
        if name == reference:
            lines.append(f"| {name} (reference) | | | | | | {ppl} |")
            continue
        lines.append(f"| {name} | {r['chat_same']}/{r['chat_count']} | {r['plain_same']}/{r['plain_count']} "
                     f"| {r['chat_first_difference']:.1f} | {r['plain_first_difference']:.1f} "
                     f"| {r['chat_kl']:.3g} | {ppl} |")
    return "\n".join(lines)


def answers_markdown(results: dict, reference: str) -> str:
    """Each question and plain prompt with the reference's answer, then every build's answer that differs."""
    lines = [f"# Greedy answers of {reference}, and where other builds differ (`benchmarks/chat_check.py`)", ""]
    for kind, prompts in (("chat", QUESTIONS), ("plain", PLAIN)):
        for i, prompt in enumerate(prompts):
            lines += [f"- **{prompt!r}**", f"  - {reference}: {results[reference][f'{kind}_answers'][i]!r}"]
            lines += [f"  - {name}: {r[f'{kind}_answers'][i]!r}" for name, r in results.items()
                      if name != reference and not r[f"{kind}_same_each"][i]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("reference", type=Path, help="the reference artifact (compiled with --quant f32)")
    parser.add_argument("builds", type=Path, nargs="+", help="artifacts of the same model to compare with it")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads per session (default 2)")
    parser.add_argument("--text", type=Path, default=HELD_OUT, help="held-out text for perplexity (default: %(default)s)")
    parser.add_argument("--ctx", type=int, default=256, help="perplexity chunk length in tokens (default 256)")
    parser.add_argument("--json", type=Path, help="also write every answer and result to this file")
    parser.add_argument("--answers", type=Path, help="also write the answers as markdown to this file")
    args = parser.parse_args(argv)
    started = time.perf_counter()

    def progress(line: str) -> None:
        print(f"[{time.perf_counter() - started:6.1f} s] {line}", file=sys.stderr)

    try:
        if args.threads < 1:
            raise LlmcError(f"--threads must be at least 1, got {args.threads}")
        try:
            text = args.text.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise LlmcError(f"cannot read --text {args.text}: {e}") from e
        reference = Build(args.reference, args.threads)
        builds = [Build(directory, args.threads) for directory in args.builds]
        names = [reference.name, *(b.name for b in builds)]
        if len(set(names)) < len(names):
            raise LlmcError(f"two artifacts share a directory name ({', '.join(names)}); the table names them by it")
        for build in builds:
            if build.tokenizer != reference.tokenizer:
                raise LlmcError(f"{build.name}: its tokenizer is not the reference's; compare builds of one model")
        results = check(reference, builds, QUESTIONS, PLAIN, text[:-1] if text.endswith("\n") else text, args.ctx,
                        progress)
        for build in [reference, *builds]:
            build.close()
    except LlmcError as e:
        print(f"chat_check: error: {printable(e, 1000)}", file=sys.stderr)
        return 2
    print(table(results, reference.name))
    if args.json:
        document = {"reference": reference.name, "questions": QUESTIONS, "plain": PLAIN, "builds": results}
        args.json.write_text(json.dumps(document, indent=1, ensure_ascii=False))
    if args.answers:
        args.answers.write_text(answers_markdown(results, reference.name))
    return 0


if __name__ == "__main__":
    sys.exit(main())
