"""`llmc run`'s conveniences and the load-time and sampling options of run, chat and serve.

Each runs the command on a tiny artifact (64 tokens of KV cache): the prompt from a file or
standard input, --system, --stop, the closing line's fields, structured output (--json-schema,
--grammar), --ctx, --chat-template, a bad value of each option (exit 2 and one line), serve's
--api-key / --cors-origin / --no-access-log; and `generate` reusing what the session's cache holds.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import jsonschema
import pytest
from runtime_only import runtime_only
from test_serve import start_server
from tiny_models import TinySpec

from llmc.cli import main
from llmc.runtime.codec import TextCodec
from llmc.runtime.generate import StopStrings, generate
from llmc.runtime.sampling import SamplingOptions
from llmc.runtime.session import Session

SPEC = TinySpec(context_length=64)
CAPACITY = 64
CLOSING = re.compile(r"^\[(\d+) prompt tokens at \d+ tok/s; (\d+) generated(?: at \d+ tok/s)?; "
                     r"stopped: ([^;\]]+)(; \d+ of \d+ drafted tokens accepted [^\]]+|; nothing drafted)?\]$", re.M)
SCHEMA = {"type": "object", "properties": {"a": {"type": "boolean"}, "b": {"enum": ["x", "y"]}},
          "required": ["a", "b"], "additionalProperties": False}


@pytest.fixture(scope="module")
def directory(artifact) -> Path:
    return artifact(SPEC, max_seq=CAPACITY)


@pytest.fixture(scope="module")
def codec(directory) -> TextCodec:
    return TextCodec.from_artifact(Session(directory, threads=1).manifest)


def run(capsys, directory: Path, *options: str) -> tuple[int, str, str]:
    """`llmc run DIR *options` in this process: the exit code, stdout, stderr."""
    code = main(["run", str(directory), "--threads", "1", *options])
    out, err = capsys.readouterr()
    return code, out, err


def closing(err: str) -> tuple[int, int, str, str | None]:
    """The closing line's prompt tokens, generated tokens, why it stopped, and the speculation's part."""
    match = CLOSING.search(err)
    assert match, err
    return int(match[1]), int(match[2]), match[3], match[4]


@pytest.mark.parametrize("form", ["gguf", "hf"])
def test_generation_ends_at_every_end_token_the_model_names(capsys, artifact, directory, codec, form) -> None:
    """An end of turn the model names besides its end of text (GGUF's `tokenizer.ggml.eot_token_id`; HF's
    `generation_config.json` `eos_token_id` list, as Llama 3's) ends generation, as in llama.cpp and transformers'
    `generate`: here the token greedy decoding gives first, so nothing is generated (was: only the one eos)."""
    code, _, err = run(capsys, directory, "-p", "the cat", "-n", "4", "--no-speculate")
    first = Session(directory, threads=1)
    try:
        made = list(generate(first, codec, codec.encode("the cat"), 1, SamplingOptions()))
    finally:
        first.close()
    assert code == 0 and closing(err)[1:3] == (4, "length (-n 4)") and made and made[0] not in codec.end_ids
    ended = artifact(dataclasses.replace(SPEC, eot_id=made[0]), max_seq=CAPACITY, form=form)
    assert made[0] in json.loads((ended / "manifest.json").read_text())["tokenizer"]["stop_ids"]
    code, out, err = run(capsys, ended, "-p", "the cat", "-n", "4", "--no-speculate")
    assert code == 0 and out.strip() == "" and closing(err)[1:3] == (0, "end of text"), err


def test_the_prompt_comes_from_a_file_or_standard_input(capsys, directory, codec, tmp_path) -> None:
    code, expected, err = run(capsys, directory, "-p", "the cat", "-n", "6")
    assert code == 0 and closing(err)[:2] == (len(codec.encode("the cat")), 6)
    prompt = tmp_path / "prompt.txt"
    for text in (b"the cat\n", b"the cat\r\n", b"\xef\xbb\xbfthe cat\n"):  # one final newline is dropped, as
        # llama.cpp's -f does, and a byte order mark (some editors begin UTF-8 files with one: it is not text)
        prompt.write_bytes(text)
        assert run(capsys, directory, "-f", str(prompt), "-n", "6")[1] == expected
    prompt.write_bytes(b"the cat\n\n")
    assert closing(run(capsys, directory, "-f", str(prompt), "-n", "6")[2])[0] > len(codec.encode("the cat"))
    piped = subprocess.run(runtime_only("", "run", str(directory), "-f", "-", "-n", "6", "--threads", "1"),
                           input="the cat\n", capture_output=True, text=True, timeout=120)
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == expected


def test_system_renders_the_chat_template(capsys, directory, codec) -> None:
    code, _, err = run(capsys, directory, "-p", "hi", "--system", "be brief", "-n", "2", "--no-speculate")
    rendered = codec.encode(codec.render_chat([{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "hi"}]))
    assert code == 0 and closing(err)[0] == len(rendered)
    assert closing(run(capsys, directory, "-p", "hi", "--chat", "-n", "2")[2])[0] == len(codec.encode(codec.chat("hi")))
    # an empty system prompt is none, as in `llmc chat` (`Chat.set_system`): the prompt of --chat alone
    assert closing(run(capsys, directory, "-p", "hi", "--system", "", "-n", "2")[2])[0] == len(codec.encode(codec.chat("hi")))


def test_chat_template_replaces_the_models(capsys, directory, codec, tmp_path) -> None:
    template = tmp_path / "bare.jinja"
    template.write_text("{% for m in messages %}{{ m['content'] }}|{% endfor %}")
    code, _, err = run(capsys, directory, "-p", "hi", "--system", "sys", "--chat-template", str(template), "-n", "1")
    assert code == 0 and closing(err)[0] == len(codec.encode("sys|hi|"))


def test_stop_ends_the_text_before_the_stop_string(capsys, directory) -> None:
    _, whole, _ = run(capsys, directory, "-p", "the cat", "-n", "20", "--no-speculate")
    stop = whole[4:6]
    code, out, err = run(capsys, directory, "-p", "the cat", "-n", "20", "--stop", "zzz", "--stop", stop)
    assert code == 0 and out == whole[: whole.index(stop)] + "\n"
    assert closing(err)[2] == f"stop string {json.dumps(stop, ensure_ascii=False)}"


def test_stop_strings_hold_back_what_could_begin_one() -> None:
    stops = StopStrings(["END", "xy"])
    assert [stops.push("aE"), stops.push("N"), stops.push("Dx"), stops.found] == ["a", "", "", "END"]
    unfound = StopStrings(["END"])
    assert [unfound.push("aEN"), unfound.push("d"), unfound.flush(), unfound.found] == ["a", "ENd", "", None]
    ending = StopStrings(["END"])
    assert [ending.push("aEN"), ending.flush()] == ["a", "EN"]


def test_any_integer_seed_is_taken_modulo_2_64(capsys, directory) -> None:
    """`--seed -1` samples as `--seed 2**64 - 1` does (the server's rule), not an internal error; another seed
    samples otherwise."""
    texts = {}
    for seed in ("-1", str(2**64 - 1), "7"):
        code, texts[seed], err = run(capsys, directory, "-p", "the cat", "-n", "12", "--temperature", "1.5",
                                     "--seed", seed, "--no-speculate")
        assert code == 0, err
    assert texts["-1"] == texts[str(2**64 - 1)] != texts["7"]


def test_sampling_options_without_a_temperature_are_noted(capsys, directory) -> None:
    """--top-k, --top-p, --min-p or --seed with the greedy default change nothing: a note says so (was: silence);
    with a --temperature, or none of them, no note."""
    greedy = run(capsys, directory, "-p", "the cat", "-n", "4")
    for flags, noted in ((["--top-k", "5", "--seed", "3"], "--top-k, --seed shape sampling"),
                         (["--min-p", "0.1"], "--min-p shape sampling"), (["--temperature", "0.7", "--top-k", "5"], None),
                         ([], None)):
        code, out, err = run(capsys, directory, "-p", "the cat", "-n", "4", *flags)
        assert code == 0 and ("decodes greedily" in err) == (noted is not None) and (noted or "") in err, err
        if "--temperature" not in flags:
            assert out == greedy[1]


def test_closing_line_says_why_it_stopped(capsys, directory, codec) -> None:
    code, _, err = run(capsys, directory, "-p", "the cat", "-n", "5")
    assert code == 0 and closing(err)[1:3] == (5, "length (-n 5)") and closing(err)[3]
    prompt = len(codec.encode("the cat"))
    assert closing(run(capsys, directory, "-p", "the cat", "-n", "100", "--no-speculate")[2])[1:] == (
        CAPACITY - prompt + 1, f"context full ({CAPACITY} tokens)", None)  # the last token generated is never fed
    assert closing(run(capsys, directory, "-p", "the cat", "-n", "100", "--ctx", "12")[2])[1:3] == (
        12 - prompt + 1, "context full (12 tokens)")
    eos = f"--logit-bias={codec.eos_id}=100"
    assert closing(run(capsys, directory, "-p", "the cat", eos)[2])[1:3] == (0, "end of text")


def _no_whitespace(codec: TextCodec) -> list[str]:
    """--logit-bias options banning every token with whitespace (a random model would write JSON's
    optional whitespace until its cache is full)."""
    return [f"--logit-bias={token}=-100" for token in range(codec.tokenizer.get_vocab_size())
            if any(c.isspace() for c in codec.decode([token]))]


def test_json_schema_output_validates(capsys, directory, codec, tmp_path) -> None:
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    for given in (str(schema_file), json.dumps(SCHEMA)):
        code, out, err = run(capsys, directory, "-p", "x", "-n", "28", "--json-schema", given, *_no_whitespace(codec))
        assert code == 0 and closing(err)[2] == "end of text", err
        jsonschema.validate(json.loads(out), SCHEMA)


def test_grammar_gbnf_and_lark(capsys, directory, tmp_path) -> None:
    gbnf, lark = tmp_path / "answer.gbnf", tmp_path / "pair.lark"
    gbnf.write_text('root ::= "yes" | "no"\n')
    lark.write_text('start: ("a" | "b") ("c" | "d")\n')
    code, out, _ = run(capsys, directory, "-p", "x", "--grammar", str(gbnf))
    assert code == 0 and out in ("yes\n", "no\n")
    code, out, _ = run(capsys, directory, "-p", "x", "--grammar", str(lark), "--temperature", "1", "--seed", "2")
    assert code == 0 and re.fullmatch(r"[ab][cd]\n", out)


def refused(capsys, directory: Path, *options: str) -> str:
    """The one line `llmc run DIR *options` ends with, having exited with code 2 (options argparse refuses
    exit through SystemExit)."""
    try:
        code = main(["run", str(directory), *options])
    except SystemExit as e:
        code = e.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--min-p", "2"], "min-p must be in [0, 1]"),
        (["--min-p", "x"], "expected a number, got 'x'"),
        (["--presence-penalty", "3"], "presence-penalty must be in [-2, 2]"),
        (["--frequency-penalty", "-3"], "frequency-penalty must be in [-2, 2]"),
        (["--repeat-penalty", "0"], "repetition-penalty must be in [0.1, 10]"),
        (["--repeat-penalty", "1e-320"], "repetition-penalty must be in [0.1, 10]"),
        (["-p", "ab\udcff"], "tokenizer failed on this text: it is not UTF-8 (character 2 is byte 0xff)"),
        (["--logit-bias", "5=1000"], "the bias of token 5 must be in [-100, 100]"),
        (["--logit-bias", "5"], "expected ID=BIAS"),
        (["--logit-bias", "99999=1"], "token 99999 is outside the model's vocabulary"),
        (["--logit-bias", "5=60", "--logit-bias", "5=60"], "logit-bias: token 5 is given twice"),  # (was: 120)
        (["--temperature", "inf"], "temperature must be a finite number >= 0, got inf"),
        (["--stop", ""], "--stop: a stop string cannot be empty"),
        (["--ctx", "65"], "--ctx must be in 2..64"),
        (["--ctx", "1"], "--ctx must be in 2..64"),
        (["--ctx", "0"], "must be a positive integer"),
        (["--json-schema", '{"type"'], "--json-schema: not JSON"),
        (["--json-schema", "[1]"], "--json-schema [1]: cannot read it: No such file"),
        (["--json-schema", '{"type": 3}'], "--json-schema: JSON schema: type must be"),
        (["--json-schema", "{}", "--grammar", "g.gbnf"], "not allowed with argument"),
        (["--grammar", "missing.gbnf"], "--grammar missing.gbnf: cannot read it"),
        (["-f", "x"], "not allowed with argument -p"),
        (["--chat", "--chat-template", "missing.jinja"], "cannot read the chat template"),
    ],
)
def test_bad_options_are_one_line(capsys, directory, options: list[str], message: str) -> None:
    assert message in refused(capsys, directory, "-p", "x", *options)


def test_bad_prompt_files_are_one_line(capsys, directory, tmp_path, monkeypatch) -> None:
    latin = tmp_path / "latin.txt"
    latin.write_bytes("café".encode("latin-1"))
    bad_gbnf = tmp_path / "bad.gbnf"
    bad_gbnf.write_text("root ::= undefined\n")
    assert "-f missing.txt: cannot read it" in refused(capsys, directory, "-f", "missing.txt")
    assert "one of the arguments -p/--prompt -f/--file is required" in refused(capsys, directory)
    assert "--grammar: GBNF grammar: Rule 'undefined'" in refused(capsys, directory, "-p", "x", "--grammar",
                                                                   str(bad_gbnf))
    monkeypatch.setattr("llmc.cli.artifact.MAX_PROMPT_BYTES", 4)
    assert "not UTF-8 text (byte 3" in refused(capsys, directory, "-f", str(latin))
    latin.write_bytes(b"\xef\xbb\xbf\xe9")
    assert "not UTF-8 text (byte 3 is 0xe9)" in refused(capsys, directory, "-f", str(latin))  # (counted with the BOM)
    assert "larger than 4 bytes" in refused(capsys, directory, "-f", str(bad_gbnf))


def test_structured_output_without_llguidance_is_one_line(directory) -> None:
    proc = subprocess.run(runtime_only("llguidance", "run", str(directory), "-p", "x", "--json-schema", "{}"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "pip install 'llmc[serve]'" in proc.stderr


def test_system_needs_a_chat_template(capsys, directory, tmp_path) -> None:
    copy = tmp_path / "plain"
    shutil.copytree(directory, copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tokenizer"]["chat_template"] = None
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert "--system needs the model's chat template" in refused(capsys, copy, "-p", "hi", "--system", "be brief")
    template = tmp_path / "chatml.jinja"
    template.write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
    assert run(capsys, copy, "-p", "hi", "--system", "be brief", "-n", "1", "--chat-template", str(template))[0] == 0


def test_generate_reuses_the_sessions_cache(directory, codec) -> None:
    session = Session(directory, threads=1)
    prompt = codec.encode("the quick brown fox")
    first = generate(session, codec, prompt, 6, SamplingOptions())
    tokens = list(first)
    assert first.reused == 0 and first.reason == "length"
    longer = prompt + tokens[:3]
    again = generate(session, codec, longer, 6, SamplingOptions())
    fresh = list(generate(Session(directory, threads=1), codec, longer, 6, SamplingOptions()))
    assert list(again) == fresh and fresh[:3] == tokens[3:]
    assert again.reused == len(longer) - 1  # all of it but the token whose logits it needs


def test_serve_options(directory, capsys, monkeypatch) -> None:
    served = start_server(directory, "--api-key", "sekret", "--cors-origin", "https://app.example", "--no-access-log",
                          "--ctx", "16")
    try:
        assert httpx.get(f"{served.url}/v1/models", timeout=10).status_code == 401
        assert served.health()["capacity"] == 16  # (no key needed)
        allowed = httpx.get(f"{served.url}/v1/models", timeout=10, headers={
            "Authorization": "Bearer sekret", "Origin": "https://app.example"})
        assert allowed.status_code == 200
        assert allowed.headers["access-control-allow-origin"] == "https://app.example"
    finally:
        assert served.stop() == 0
    assert not any("/v1/models" in line for line in served.stderr), served.stderr
    env = {**os.environ, "LLMC_API_KEY": "from-env"}
    command = runtime_only("", "serve", str(directory), "--port", "0", "--threads", "1")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        url = re.search(r"listening on (http://\S+)", process.stdout.readline())[1]
        assert httpx.get(f"{url}/v1/models", timeout=10, headers={"Authorization": "Bearer x"}).status_code == 401
        answer = httpx.get(f"{url}/v1/models", timeout=10, headers={"Authorization": "Bearer from-env",
                                                                      "Origin": "https://app.example"})
        assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers  # CORS: off
    finally:
        process.terminate()
        process.communicate(timeout=20)
    for argv, env_key, message in ((["--api-key", ""], None, "--api-key: the key is empty"),
                                   (["--api-key", " "], None, "--api-key: the key is empty"),
                                   ([], "", "$LLMC_API_KEY: the key is empty"),
                                   (["--host", ""], None, "--host: an empty address")):
        if env_key is None:
            monkeypatch.delenv("LLMC_API_KEY", raising=False)
        else:
            monkeypatch.setenv("LLMC_API_KEY", env_key)
        try:
            code = main(["serve", str(directory), "--port", "0", *argv])
        except SystemExit as e:  # (argparse's refusals)
            code = e.code
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1 and message in err, err


LLMC = [sys.executable, "-m", "llmc"]


def test_a_reader_gone_is_quiet_and_a_full_disk_one_line(directory: Path) -> None:
    """`llmc tokenize … | head`: the reader closes the pipe and llmc's next write ends it quietly (SIGPIPE's status
    141, nothing on stderr); standard output on a full disk (/dev/full): one line, not an internal error."""
    reader = subprocess.Popen([*LLMC, "tokenize", str(directory), "--jsonl", "-"], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    reader.stdin.write(b'"hello"\n')
    reader.stdin.flush()
    assert reader.stdout.readline()  # its answer to the first line, then the reader goes away
    reader.stdout.close()
    _, err = reader.communicate(b'"world"\n' * 1000, timeout=60)
    assert reader.returncode == 141 and err == b"", err
    with open("/dev/full", "w") as full:
        done = subprocess.run([*LLMC, "tokenize", str(directory), "hello"], stdout=full, stderr=subprocess.PIPE,
                              text=True, timeout=60)
    assert done.returncode == 1 and done.stderr == "llmc: error: cannot write: No space left on device\n", done.stderr


@pytest.mark.parametrize("options", [["--json-schema", ""], ["--grammar", ""], ["--chat-template", ""], ["-f", ""],
                                     ["--draft", ""]])
def test_an_empty_name_is_refused(directory: Path, capsys, options: list[str]) -> None:
    """An empty file name read as the option left out (unconstrained text, the model's template, prompt lookup):
    refused, as an empty `-o` (which named the default artifact folder) and any other file or folder option."""
    with pytest.raises(SystemExit) as exit_info:
        main(["run", str(directory), *(["-p", "x"] if options[0] != "-f" else []), *options])
    assert exit_info.value.code == 2 and "an empty name" in capsys.readouterr().err


def test_a_chat_template_without_a_chat_is_refused(directory: Path, tmp_path: Path, capsys) -> None:
    """`llmc run --chat-template FILE` without --chat or --system: the template would go unused, without a word."""
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    code, _, err = run(capsys, directory, "-p", "x", "--chat-template", str(template))
    assert code == 2 and "--chat-template renders chats: add --chat" in err
    code, _, err = run(capsys, directory, "-p", "x", "-n", "1", "--chat", "--chat-template", str(template))
    assert code == 0, err
