"""`llmc chat`: a multi-turn conversation in the terminal, its history kept in the KV cache.

Each turn renders the whole conversation with the model's chat template and compares its
tokens with those already in the cache (`Conversation.reuse`): the common prefix stays, and
only the rest is fed (`prefill_kv` from the cache's position). Where the new rendering departs from what the
cache holds (a reply that tokenizes differently when re-encoded, a changed system prompt),
feeding restarts from the first differing token, and the chat says so; where the
conversation outgrows the cache, its oldest turns are dropped and it is fed again.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TextIO

from llmc.errors import LlmcError
from llmc.runtime.codec import TextCodec, not_utf8
from llmc.runtime.generate import Generation
from llmc.runtime.sampling import SamplingOptions
from llmc.runtime.session import CapacityError, Conversation
from llmc.runtime.speculate import Speculation
from llmc.runtime.templates import ChatTemplateError

if TYPE_CHECKING:
    from llmc.runtime.grammar import Grammar


class NotSent(LlmcError):
    """A message the chat template cannot render into the conversation (it fails, or builds past its limits)."""


@dataclass
class Turn:
    """What one reply cost: prompt tokens reused from the cache and fed, tokens generated."""

    reused: int
    fed: int
    generated: int
    reason: str  # "stop" (end of sequence), "length" (-n), "full" (the cache), "interrupted"
    seconds: float
    position: int  # tokens in the cache after the reply

    def line(self, capacity: int) -> str:
        ended = {"stop": "", "length": ", stopped at -n", "full": ", the KV cache is full",
                 "interrupted": ", interrupted"}[self.reason]
        return (f"[{_tokens(self.reused)} reused from the cache, {self.fed} fed; {self.generated} generated in "
                f"{self.seconds:.2f} s{ended}; position {self.position}/{capacity}]")


def _tokens(n: int) -> str:
    return f"{n} token{'' if n == 1 else 's'}"


class Chat:
    """One conversation on `session`: `messages` (the system prompt first, if any), its tokens in the
    session's KV cache (`session.cached`). With `speculation`, replies are drafted and verified several
    tokens at a time (greedy: the same text); with `grammar`, each reply is a text it accepts. A seeded
    `sampling` draws each reply with its own seed (the seed plus the replies before), repeatably.

    >>> chat = Chat(session, codec, system="be brief"); chat.reply("hello", print).generated  # doctest: +SKIP
    """

    def __init__(self, session: Conversation, codec: TextCodec, system: str | None = None,
                 sampling: SamplingOptions = SamplingOptions(), max_tokens: int = 512,
                 note: Callable[[str], None] = lambda text: None, speculation: Speculation | None = None,
                 grammar: Grammar | None = None):
        self.session = session
        self.speculation = speculation
        self.codec = codec
        self.sampling = sampling
        self.grammar = grammar
        self.replies = 0
        self.max_tokens = max_tokens
        self.note = note
        self.system = system
        self.messages: list[dict[str, str]] = []
        self.reset()

    def reset(self) -> None:
        """Forget the conversation (the system prompt stays)."""
        self.messages = [{"role": "system", "content": self.system}] if self.system else []
        self.session.reset()

    def set_system(self, text: str | None) -> None:
        """Replace the system prompt (none if empty); the history stays, and is fed again at the next turn."""
        self.system = text or None
        self.messages = [m for m in self.messages if m["role"] != "system"]
        if self.system:
            self.messages.insert(0, {"role": "system", "content": self.system})

    def _render(self, messages: list[dict[str, str]]) -> list[int]:
        return self.codec.encode(self.codec.render_chat(messages))

    def _prompt(self, user: str) -> list[int]:
        """The tokens of the conversation with `user` appended and the assistant's turn begun;
        drops the oldest turns while it does not fit the cache (with room for a reply)."""
        self.messages.append({"role": "user", "content": user})
        try:
            ids = self._render(self.messages)
        except ChatTemplateError as e:  # (this message made the template fail, or outgrow its limits: not sent)
            self.messages.pop()
            raise NotSent(f"{e}; the message is not sent") from None
        dropped = 0
        capacity = self.session.capacity
        while len(ids) >= capacity:
            first = next((i for i, m in enumerate(self.messages) if m["role"] != "system"), None)
            if first is None or first == len(self.messages) - 1:
                self.messages.pop()
                raise CapacityError(f"the message makes a prompt of {len(ids)} tokens; the KV cache holds "
                                    f"{capacity} ({self.session.larger_capacity})")
            del self.messages[first]
            while first < len(self.messages) - 1 and self.messages[first]["role"] == "assistant":
                del self.messages[first]
            dropped += 1
            ids = self._render(self.messages)
        if dropped:
            self.note(f"[the conversation outgrew the KV cache of {capacity} tokens: its oldest turns were dropped]")
        return ids

    def reply(self, user: str, write: Callable[[str], None],
              interrupted: Callable[[], bool] = lambda: False) -> Turn:
        """Feed the new turn, generate the reply (writing its text as it comes), keep it in the history."""
        start = time.perf_counter()
        ids = self._prompt(user)
        session = self.session
        held = session.position
        keep = session.reuse(ids)  # (what `Generation` keeps too; the rows past it are overwritten)
        if keep < held:
            self.note(f"[the conversation's tokens depart from the cache's at position {keep}: "
                      f"feeding from there again]")
        seed = self.sampling.seed
        sampling = replace(self.sampling, seed=None if seed is None else seed + self.replies)
        self.replies += 1
        generation = Generation(session, self.codec, ids, self.max_tokens, sampling, self.speculation,
                                self.grammar.constraint() if self.grammar else None)
        decoder = self.codec.text_stream(ids)
        generated: list[int] = []
        for token in generation:
            generated.append(token)
            write(decoder.push(token))
            if interrupted():
                session.rewind(min(session.position, len(ids) + len(generated)))  # (drafts past the reply)
                break
        write(decoder.flush())
        self.messages.append({"role": "assistant", "content": self.codec.decode(generated)})
        reason = {"eos": "stop", "length": "length", "full": "full", None: "interrupted"}[generation.reason]
        return Turn(keep, len(ids) - keep, len(generated), reason, time.perf_counter() - start, session.position)


@contextmanager
def _interrupts() -> Iterator[threading.Event]:
    """Ctrl-C sets the event (the reply stops after its current token) instead of raising: a
    native call is never cut in the middle."""
    caught = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield caught
        return
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.set())
    try:
        yield caught
    finally:
        signal.signal(signal.SIGINT, previous)


HELP = "/reset forgets the conversation, /system TEXT sets the system prompt, /quit ends; Ctrl-C stops a reply"


def run_chat(chat: Chat, read: Callable[[str], str] = input, out: TextIO = sys.stdout, err: TextIO = sys.stderr,
             verbose: bool = False) -> None:
    """The terminal loop: read a line at `> `, answer it, until /quit, end of input or Ctrl-C at the prompt."""
    if read is input and hasattr(sys.stdin, "reconfigure"):  # a line that is not UTF-8 is refused below, whatever
        sys.stdin.reconfigure(errors="surrogateescape")        # the locale
    if read is input and sys.stdin.isatty():
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass

    def note(text: str) -> None:
        print(text, file=err, flush=True)

    def write(text: str) -> None:
        if text:
            out.write(text)
            out.flush()

    chat.note = note
    capacity = chat.session.capacity
    note(f"llmc chat: {capacity} tokens of history in the KV cache. {HELP}.")
    while True:
        try:
            line = read("> ")
        except (EOFError, KeyboardInterrupt):
            out.write("\n")
            out.flush()
            return
        text = line.strip()
        if not text:
            continue
        problem = not_utf8(text)
        if problem:  # (before the line joins the conversation)
            note(f"[the line is not UTF-8 text ({problem}): not sent]")
            continue
        if text.startswith("/"):
            command, _, rest = text.partition(" ")
            if command in ("/quit", "/exit"):
                return
            if command == "/reset":
                chat.reset()
                note("[conversation reset]")
            elif command == "/system":
                chat.set_system(rest.strip())
                note(f"[system prompt {'set' if rest.strip() else 'removed'}]")
            elif command == "/help":
                note(HELP)
            else:
                note(f"unknown command {command}: {HELP}")
            continue
        with _interrupts() as caught:
            try:
                turn = chat.reply(line, write, caught.is_set)
            except (CapacityError, NotSent) as e:
                note(f"[{e}]")
                continue
        out.write("\n")
        out.flush()
        if turn.reason == "interrupted":
            note("[reply stopped]")
        elif turn.reason == "full":
            note("[the KV cache is full: /reset to start over]")
        if verbose:
            note(turn.line(capacity))
            if chat.speculation is not None:
                note(f"[speculative decoding so far: {chat.speculation.stats.line()}]")
