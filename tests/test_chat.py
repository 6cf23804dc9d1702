"""`llmc chat`: multi-turn chat whose history stays in the KV cache.

`Chat` is checked in process against a conversation fed from scratch; the command itself
runs in a pseudo-terminal (two turns, /reset, /system, Ctrl-C during a reply and at the
prompt), in a process that refuses to import the compiler stack.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import pytest
from runtime_only import runtime_only
from tiny_models import TinySpec

from llmc.driver import BackendOptions, compile_model
from llmc.passes.pipeline import CompileOptions
from llmc.runtime.chat import Chat
from llmc.runtime.codec import TextCodec
from llmc.runtime.sampling import SamplingOptions
from llmc.runtime.session import CapacityError, Session

LONG = TinySpec(context_length=4096)
SHORT = TinySpec(context_length=64)

STATS = re.compile(r"\[(\d+) tokens? reused from the cache, (\d+) fed; (\d+) generated in [\d.]+ s([^;\]]*); "
                   r"position (\d+)/(\d+)\]")


@pytest.fixture(scope="module")
def artifacts(tiny, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("chat")
    out = {}
    for name, spec in (("long", LONG), ("short", SHORT)):
        out[name] = root / name
        compile_model(str(tiny(spec, "gguf")), out[name],
                      CompileOptions(prefill_chunk=16, max_seq=spec.context_length), BackendOptions(),
                      progress=lambda _: None)
    return out


def _chat(directory: Path, **options) -> Chat:
    session = Session(directory, threads=1)
    return Chat(session, TextCodec.from_artifact(session.manifest), **options)


def test_each_turn_feeds_only_its_new_tokens(artifacts) -> None:
    chat = _chat(artifacts["long"], system="be brief", max_tokens=12)
    pieces: list[str] = []
    first = chat.reply("hello", pieces.append)
    render = lambda messages: chat.codec.encode(chat.codec.render_chat(messages))  # noqa: E731
    prompt1 = render(chat.messages[:2])
    assert (first.reused, first.fed) == (0, len(prompt1))
    assert chat.messages[-1] == {"role": "assistant", "content": "".join(pieces)}
    unfed = first.reason != "stop"  # the last token of a reply cut at -n is not fed (an end of sequence never is)
    assert first.position == len(chat.session.cached) == len(prompt1) + first.generated - unfed
    second = chat.reply("and then?", lambda text: None)
    prompt2 = render(chat.messages[:4])
    # the reply re-tokenizes as it was generated
    assert chat.session.cached[: first.position] == prompt2[: first.position]
    assert second.reused == first.position, "the whole history stayed in the cache"
    assert second.fed == len(prompt2) - first.position
    assert 0 < second.fed < second.reused
    # the same conversation fed from scratch gives the same reply (greedy)
    fresh = _chat(artifacts["long"], system="be brief", max_tokens=12)
    fresh.messages = [dict(m) for m in chat.messages[:3]]
    again = fresh.reply("and then?", lambda text: None)
    assert (again.reused, again.fed) == (0, len(prompt2))
    assert fresh.messages[-1] == chat.messages[-1]
    assert fresh.session.cached == chat.session.cached


def test_a_changed_beginning_is_fed_again_from_where_it_departs(artifacts) -> None:
    notes: list[str] = []
    chat = _chat(artifacts["long"], system="be brief", max_tokens=4, note=notes.append)
    chat.reply("hello", lambda text: None)
    chat.set_system("be verbose")
    turn = chat.reply("more", lambda text: None)
    departs = len(chat.codec.encode("<|im_start|>system\nbe "))  # the renderings agree up to "be "
    assert turn.reused == departs
    assert turn.fed == len(chat.codec.encode(chat.codec.render_chat(chat.messages[:4]))) - departs
    assert any(f"depart from the cache's at position {departs}" in n for n in notes)
    chat.reset()
    assert chat.session.position == 0 and chat.messages == [{"role": "system", "content": "be verbose"}]
    assert chat.reply("hello", lambda text: None).reused == 0


def test_a_conversation_outgrowing_the_cache_drops_its_oldest_turns(artifacts) -> None:
    notes: list[str] = []
    chat = _chat(artifacts["short"], max_tokens=6, note=notes.append)
    for i in range(4):
        turn = chat.reply(f"turn {i}", lambda text: None)
        assert turn.position <= 64
    assert any("oldest turns were dropped" in n for n in notes)
    assert chat.messages[0] != {"role": "user", "content": "turn 0"}
    assert chat.messages[-2:][0] == {"role": "user", "content": "turn 3"}
    assert turn.reused < turn.position


def test_a_message_past_the_cache_says_how_to_hold_more(artifacts) -> None:
    """One message longer than the cache: refused, with `--ctx` where the session holds less than the artifact
    (--ctx 16 of 64), a recompile where it holds all of it."""
    for ctx, advice in ((16, "(--ctx up to 64)"), (None, "(compile with a larger --max-seq)")):
        chat = _chat(artifacts["short"], max_tokens=4)
        if ctx:
            chat.session.limit_context(ctx)
        with pytest.raises(CapacityError, match=re.escape(advice)):
            chat.reply("word " * 80, lambda text: None)


def test_an_interrupted_reply_stays_in_the_history(artifacts) -> None:
    chat = _chat(artifacts["long"], max_tokens=100)
    pieces: list[str] = []
    turn = chat.reply("hello", pieces.append, interrupted=lambda: len(chat.session.cached) >= 30)
    assert turn.reason == "interrupted" and 0 < turn.generated < 100
    assert chat.messages[-1] == {"role": "assistant", "content": "".join(pieces)}
    assert chat.reply("go on", lambda text: None).reused == turn.position


class _Foresight:
    """A drafter that knows the reply: it drafts the tokens that follow in `truth`."""

    def __init__(self, truth: list[int]):
        self.truth, self.seen = truth, 0

    def start(self, tokens: list[int]) -> None:
        self.seen = len(tokens)

    def extend(self, tokens: list[int]) -> None:
        self.seen += len(tokens)

    def draft(self, k: int) -> list[int]:
        return self.truth[self.seen : self.seen + k]


def test_an_interrupted_reply_keeps_no_draft_past_its_text(artifacts, every_draft) -> None:
    from llmc.runtime.speculate import Speculation

    plain = _chat(artifacts["long"], max_tokens=20)
    plain.reply("hello", lambda text: None)
    notes: list[str] = []
    chat = _chat(artifacts["long"], max_tokens=20, note=notes.append,
                 speculation=Speculation(_Foresight(plain.session.cached)))
    calls: list[str] = []  # (one write per token)
    turn = chat.reply("hello", calls.append, interrupted=lambda: len(calls) >= 3)
    assert turn.reason == "interrupted" and turn.generated == 3 and chat.speculation.stats.accepted > 3
    assert turn.position == turn.fed + 3  # the drafts accepted past the third token are dropped
    assert chat.reply("go on", lambda text: None).reused == turn.position and not notes


def test_each_reply_follows_the_grammar_and_a_seed_repeats(artifacts) -> None:
    import json

    import jsonschema

    from llmc.runtime.grammar import Grammar

    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    session = Session(artifacts["long"], threads=1)
    codec = TextCodec.from_artifact(session.manifest)
    spaces = tuple((token, -100.0) for token in range(codec.tokenizer.get_vocab_size())
                   if any(c.isspace() for c in codec.decode([token])))  # (else a random model writes them on)
    sampling = SamplingOptions(temperature=1.0, seed=7, logit_bias=spaces)
    chat = Chat(session, codec, sampling=sampling, max_tokens=40, grammar=Grammar.json_schema(codec, schema))
    replies = []
    for user in ("one", "two", "three"):
        assert chat.reply(user, lambda text: None).reason == "stop"
        replies.append(chat.messages[-1]["content"])
        jsonschema.validate(json.loads(replies[-1]), schema)
    again = Chat(session, codec, sampling=sampling, max_tokens=40, grammar=Grammar.json_schema(codec, schema))
    assert [again.reply(user, lambda text: None) and again.messages[-1]["content"]
            for user in ("one", "two", "three")] == replies


# ------------------------------------------------------------------ the command in a terminal


class Terminal:
    """`llmc chat` on a pseudo-terminal that is its controlling terminal (so ^C is SIGINT)."""

    def __init__(self, *args: str, sigint_ignored: bool = False):
        master, slave = os.openpty()

        def controlling_terminal() -> None:
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)
            if sigint_ignored:  # as under a parent that ignores SIGINT (pytest-xdist's workers, nohup)
                signal.signal(signal.SIGINT, signal.SIG_IGN)

        self.process = subprocess.Popen(runtime_only("", "chat", *args), stdin=slave,
                                        stdout=slave, stderr=slave, preexec_fn=controlling_terminal,
                                        env={**os.environ, "TERM": "dumb"})
        os.close(slave)
        self.master = master
        self.output = ""
        self.seen = 0  # how much of `output` expect() has consumed
        self.lock = threading.Lock()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                data = os.read(self.master, 65536)
            except OSError:
                return
            if not data:
                return
            with self.lock:
                self.output += data.decode("utf-8", "replace")

    def send(self, text: str) -> None:
        os.write(self.master, text.encode())

    def expect(self, pattern: str | re.Pattern, timeout: float = 30) -> re.Match:
        pattern = re.compile(pattern) if isinstance(pattern, str) else pattern
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                match = pattern.search(self.output, self.seen)
            if match:
                self.seen = match.end()
                return match
            if self.process.poll() is not None:
                time.sleep(0.1)
                with self.lock:
                    match = pattern.search(self.output, self.seen)
                if match:
                    self.seen = match.end()
                    return match
                break
            time.sleep(0.01)
        raise AssertionError(f"no {pattern.pattern!r} in the terminal's output:\n{self.output[self.seen:][-2000:]}")

    def turn(self, line: str) -> dict:
        self.send(line + "\r")
        m = self.expect(STATS)
        self.expect(r"> ")
        return {"reused": int(m[1]), "fed": int(m[2]), "generated": int(m[3]), "ended": m[4], "position": int(m[5])}

    def close(self) -> int:
        try:
            return self.process.wait(30)
        finally:
            os.close(self.master)


def test_chat_command_turns_reset_and_system(artifacts) -> None:
    term = Terminal(str(artifacts["long"]), "-n", "8", "--verbose", "--threads", "1")
    try:
        term.expect(r"/reset.*\n")
        term.expect(r"> ")
        first = term.turn("tell me a story about the cat in the hat")
        assert first["reused"] == 0 and first["fed"] > 0
        second = term.turn("ok")
        assert second["reused"] == first["position"], "the history stayed in the cache"
        assert 0 < second["fed"] < second["reused"], "only the new turn was fed"
        term.send("/reset\r")
        term.expect(r"\[conversation reset\]")
        again = term.turn("tell me a story about the cat in the hat")
        assert again == first
        term.send("/system be nice\r")
        term.expect(r"\[system prompt set\]")
        changed = term.turn("hi")
        assert 0 < changed["reused"] < again["position"]  # fed again from where the system prompt departs
        assert "depart from the cache's" in term.output
        term.send("/nonsense\r")
        term.expect(r"unknown command /nonsense")
        term.send("/quit\r")
        assert term.close() == 0
    finally:
        if term.process.poll() is None:
            term.process.kill()


@pytest.mark.parametrize("sigint_ignored", [False, True], ids=["sigint-default", "sigint-ignored-by-parent"])
def test_ctrl_c_stops_a_reply_and_at_the_prompt_ends_the_chat(artifacts, sigint_ignored: bool) -> None:
    term = Terminal(str(artifacts["long"]), "-n", "4000", "--verbose", "--threads", "1", "--system", "x",
                    sigint_ignored=sigint_ignored)
    try:
        term.expect(r"> ")
        term.send("hello\r")
        term.expect(r"hello\r?\n.")  # the reply has begun
        term.send("\x03")
        term.expect(r"\[reply stopped\]")
        stopped = term.expect(STATS)
        assert stopped[4] == ", interrupted" and 0 < int(stopped[3]) < 4000
        term.expect(r"> ")
        term.send("/system y\r")  # (the chat goes on)
        term.expect(r"\[system prompt set\]\r?\n> ")
        # at the prompt: the end. (A SIGINT that lands while readline is between its reads, not
        # waiting in select, is seen only at the next key: CPython's readline checks signals on
        # EINTR. So the ^C goes once readline waits.)
        time.sleep(0.3)
        term.send("\x03")
        assert term.close() == 0
        assert "Traceback" not in term.output
    finally:
        if term.process.poll() is None:
            term.process.kill()


def test_end_of_input_ends_the_chat(artifacts) -> None:
    proc = subprocess.run([sys.executable, "-m", "llmc", "chat", str(artifacts["short"]), "-n", "3"],
                          input="hello\n", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("> ") and proc.stdout.count("> ") == 2
    assert "/reset" in proc.stderr


def test_chat_without_a_template_is_one_line(artifacts, tmp_path) -> None:
    import json
    import shutil

    copy = tmp_path / "plain"
    shutil.copytree(artifacts["short"], copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["tokenizer"]["chat_template"] = None
    (copy / "manifest.json").write_text(json.dumps(manifest))
    proc = subprocess.run([sys.executable, "-m", "llmc", "chat", str(copy)], input="", capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip() == ("llmc: error: this model has no chat template (give one with --chat-template FILE, "
                                   "or use 'llmc run' for plain completion)")


def test_sigint_handler_is_restored_after_a_reply(artifacts) -> None:
    chat = _chat(artifacts["short"], max_tokens=2)
    before = signal.getsignal(signal.SIGINT)
    from llmc.runtime.chat import run_chat

    lines = iter(["hello", "/quit"])
    with open(os.devnull, "w") as null:
        run_chat(chat, read=lambda prompt: next(lines), out=null, err=null)
    assert signal.getsignal(signal.SIGINT) is before
    assert [m["role"] for m in chat.messages] == ["user", "assistant"]


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])
def test_a_line_that_is_not_utf8_is_not_sent_and_the_chat_goes_on(artifacts, errors: str) -> None:
    """Whatever the locale makes of standard input's undecodable bytes (`PYTHONIOENCODING` stands in for it)."""
    proc = subprocess.run([sys.executable, "-m", "llmc", "chat", str(artifacts["short"]), "-n", "3"],
                          input=b"\xff\xfe\nhello\n", capture_output=True, timeout=60,
                          env={**os.environ, "PYTHONIOENCODING": f"utf-8:{errors}"})
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr
    assert "[the line is not UTF-8 text (character 0 is byte 0xff): not sent]" in stderr
    assert proc.stdout.decode().count("> ") == 3 and "Traceback" not in stderr  # then "hello" was answered


def test_a_message_the_template_cannot_render_is_not_sent_and_the_chat_goes_on(artifacts) -> None:
    """A line past the template's size limit (`--template-chars`): a note, the message dropped, the next one
    answered (was: the whole chat ended on "the model's chat template builds more than …")."""
    proc = subprocess.run([sys.executable, "-m", "llmc", "chat", str(artifacts["short"]), "-n", "3",
                           "--template-chars", "1000"], input=b"x" * 2000 + b"\nhello\n", capture_output=True,
                          timeout=60)
    stderr = proc.stderr.decode()
    assert proc.returncode == 0, stderr
    assert "builds more than 1000 characters" in stderr and "; the message is not sent]" in stderr, stderr
    assert proc.stdout.decode().count("> ") == 3 and "Traceback" not in stderr  # then "hello" was answered
