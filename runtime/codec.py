"""Text ↔ token ids: a `tokenizers.Tokenizer` with the special ids and chat template.

One class for both sides: the frontends build it from a model file, the runtime loads
it from an artifact (`TextCodec.from_artifact`).
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from llmc.errors import LlmcError, ModelFormatError, printable
from llmc.runtime.artifact import Manifest
from llmc.runtime.templates import DEFAULT_LIMITS, ChatTemplateError, RenderLimits, compile_template, render


class TokenizerError(LlmcError):
    """The model's tokenizer failed on a text or on token ids."""


# what Rust's panic hook writes: the panic line, its message, a backtrace if asked for, the closing note
_PANIC_REPORT = re.compile(rb"\n?thread '[^'\n]*'[^\n]* panicked at .*?(?:\nnote: [^\n]*\n|\Z)", re.S)


class _StderrHeld:
    """File descriptor 2 held in a temporary file while a call into the `tokenizers` library runs,
    then written out without the reports of Rust panics (a panic writes to fd 2 before Python sees
    it: stray lines beside llmc's one-line error). Calls on several threads at once share one hold;
    what other threads write meanwhile comes out when the last call ends."""

    def __init__(self):
        self.lock = threading.Lock()
        self.depth = 0
        self.saved = -1
        self.held = -1  # the temporary file's descriptor, made on first use

    def __enter__(self) -> None:
        with self.lock:
            self.depth += 1  # first: a KeyboardInterrupt below leaves fd 2 as it was, not held for good
            if self.depth == 1:
                if self.held < 0:
                    with tempfile.TemporaryFile() as file:
                        self.held = os.dup(file.fileno())
                self.saved = os.dup(2)
                os.dup2(self.held, 2)

    def __exit__(self, *exc) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth:
                return
            os.dup2(self.saved, 2)
            os.close(self.saved)
            size = os.lseek(self.held, 0, os.SEEK_END)
            if size:
                kept = _PANIC_REPORT.sub(b"", os.pread(self.held, size, 0))
                os.ftruncate(self.held, 0)
                os.lseek(self.held, 0, os.SEEK_SET)
                if kept:
                    os.write(2, kept)


_held_stderr = _StderrHeld()


@contextmanager
def tokenizer_failures(error: Callable[[str], LlmcError], quiet: bool = True) -> Iterator[None]:
    """Errors of the `tokenizers` library inside, and its panics (a Rust panic is a
    `pyo3_runtime.PanicException`, a BaseException: a regular expression that backtracks past
    Oniguruma's limit panics), raised as `error(what went wrong)`; with `quiet`, the panic's
    report on stderr is dropped (`_StderrHeld`: for loading, building and encoding, not for the
    per-token decoding, which runs no regular expression)."""
    try:
        with _held_stderr if quiet else nullcontext():
            yield
    except Exception as e:  # the library raises its own exception types
        raise error(printable(e)) from e
    except BaseException as e:
        if type(e).__module__ != "pyo3_runtime":
            raise
        raise error(f"the tokenizers library panicked: {printable(e)}") from None


MAX_TOKENIZER_BYTES = 128 << 20  # a tokenizer.json: Gemma 3's 262k vocabulary takes 33 MB


def read_tokenizer(path: Path | str) -> Tokenizer:
    """The `tokenizers.Tokenizer` of a `tokenizer.json` file of at most `MAX_TOKENIZER_BYTES`; one larger, one the
    library cannot read, or panics on, is a ModelFormatError."""
    try:
        size = os.stat(path).st_size
    except OSError as e:
        raise ModelFormatError(path, f"cannot read the tokenizer: {e.strerror or e}") from None
    if size > MAX_TOKENIZER_BYTES:
        raise ModelFormatError(path, f"{size} bytes is too large for a tokenizer.json (at most {MAX_TOKENIZER_BYTES})")
    with tokenizer_failures(lambda problem: ModelFormatError(path, f"cannot load tokenizer: {problem}")):
        return Tokenizer.from_file(str(path))


TEMPLATE_FILE_BYTES_PER_CHAR = 4  # UTF-8's longest character: a file of more bytes holds too many characters


def read_chat_template(path: Path | str, limits: RenderLimits = DEFAULT_LIMITS, check: bool = True) -> str:
    """The chat template in the file `path` (`--chat-template FILE`; a model directory's
    `chat_template.jinja`): UTF-8 text of at most `limits.chars` characters and, with `check`, a template
    jinja2's sandbox compiles (as `render_chat` will). Anything else is a one-line `ModelFormatError`.

        codec.chat_template = read_chat_template("chatml.jinja")
    """
    most = TEMPLATE_FILE_BYTES_PER_CHAR * limits.chars
    try:
        with open(path, "rb") as file:
            raw = file.read(most + 1)
    except OSError as e:
        raise ModelFormatError(path, f"cannot read the chat template: {e.strerror or e}") from None
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelFormatError(path, f"the chat template is not UTF-8 text (byte {e.start})") from None
    if len(raw) > most or len(text) > limits.chars:
        raise ModelFormatError(path, f"the chat template is longer than {limits.chars} characters")
    if check and not text.strip():
        raise ModelFormatError(path, "the chat template is empty")
    if check:
        try:
            compile_template(text, limits)
        except ChatTemplateError as e:
            raise ModelFormatError(path, str(e)) from None
    return text


def not_utf8(text: str) -> str | None:
    """Where `text` is not UTF-8 ("character 2 is byte 0xff"), or None: bytes that are not UTF-8 arrive from a
    command line or standard input as lone surrogates, and no tokenizer takes them."""
    try:
        text.encode()
        return None
    except UnicodeEncodeError as e:
        code = ord(text[e.start])
        what = f"byte {code - 0xDC00:#04x}" if 0xDC80 <= code <= 0xDCFF else f"a lone surrogate U+{code:04X}"
        return f"character {e.start} is {what}"


@dataclass
class TextCodec:
    tokenizer: Tokenizer
    bos_id: int | None
    eos_id: int | None
    add_bos: bool
    chat_template: str | None
    limits: RenderLimits = field(default=DEFAULT_LIMITS, compare=False)  # of a chat template's rendering
    stop_ids: tuple[int, ...] = ()  # the model's other tokens that end a generation (end of turn, …)
    _compiled: tuple[str, Any] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def from_artifact(cls, manifest: Manifest) -> TextCodec:
        facts = manifest.tokenizer
        tokenizer = read_tokenizer(manifest.file("tokenizer"))
        return cls(tokenizer, facts.get("bos_id"), facts.get("eos_id"), facts.get("add_bos", False),
                   facts.get("chat_template"), stop_ids=tuple(facts.get("stop_ids", ())))

    @property
    def end_ids(self) -> frozenset[int]:
        """The tokens that end a generation, as llama.cpp's end-of-generation set: end of text, and the others
        the model names (`stop_ids`: GGUF's end of turn and end of message, HF's `generation_config.json`)."""
        return frozenset(i for i in (self.eos_id, *self.stop_ids) if i is not None)

    def encode(self, text: str, bos: bool = True) -> list[int]:
        """The text's ids, after the beginning-of-text token where the model adds one (and `bos`)."""
        failed = "the model's tokenizer failed on this text"
        problem = not_utf8(text)
        if problem:
            raise TokenizerError(f"{failed}: it is not UTF-8 ({problem})")
        with tokenizer_failures(lambda problem: TokenizerError(f"{failed}: {problem}")):
            # `encode_batch` releases the GIL while it works (`encode` holds it: a long prompt would stop
            # every other thread, the server's event loop among them)
            ids = self.tokenizer.encode_batch([text], add_special_tokens=False)[0].ids
        return [self.bos_id, *ids] if bos and self.add_bos and self.bos_id is not None else ids

    def decode(self, ids: list[int]) -> str:
        with tokenizer_failures(lambda problem: TokenizerError(f"the model's tokenizer failed on token ids: {problem}"),
                                quiet=False):
            return self.tokenizer.decode(ids, skip_special_tokens=False)

    def piece(self, token: int) -> str:
        """The text `token` adds after other text (llama.cpp's token piece): its decoding as the second
        of two, so a SentencePiece word's leading space, dropped at the start of a text, stays."""
        return self.decode([token, token])[len(self.decode([token])):]

    def text_stream(self, context: Sequence[int] = ()) -> TextStream:
        """An incremental decoder for the tokens that follow `context` (the prompt; see `TextStream`)."""
        return TextStream(self, context)

    def decode_stream(self, tokens: Iterable[int], context: Sequence[int] = ()) -> Iterator[str]:
        """The text of `tokens` after `context` piece by piece, as soon as it is complete UTF-8
        (see `TextStream`)."""
        stream = self.text_stream(context)
        for token in tokens:
            piece = stream.push(token)
            if piece:
                yield piece
        rest = stream.flush()
        if rest:
            yield rest

    def chat(self, user_message: str) -> str:
        """The prompt text for one user turn (`render_chat` of that one message)."""
        return self.render_chat([{"role": "user", "content": user_message}])

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:
        """The prompt text of a conversation (`messages` of "role" and "content", oldest first; an
        assistant's may hold "tool_calls", a "tool" message its "tool_call_id"), rendered with the
        model's chat template in jinja2's sandbox (templates come from model files), within `limits`,
        as transformers' `apply_chat_template` renders it; `add_generation_prompt` ends it where the
        assistant's reply begins, and `tools` (OpenAI's tool objects, `{"type": "function", "function":
        {"name", "description", "parameters"}}`) reach the template as transformers passes them. A template
        that fails or goes past its limits raises `ChatTemplateError`.

            codec.render_chat([{"role": "user", "content": "Hi"}])  # '<|im_start|>user\nHi<|im_end|>\n...'
        """
        if not self.chat_template:
            raise LlmcError("this model has no chat template; run without --chat")
        # as transformers: no documents, and only the special tokens the model has
        special = {f"{name}_token": self.tokenizer.id_to_token(i)
                   for name, i in (("bos", self.bos_id), ("eos", self.eos_id)) if i is not None}
        variables = dict(messages=messages, tools=tools, documents=None,
                         add_generation_prompt=add_generation_prompt, **special)
        return render(self._template(), variables, self.limits)

    def _template(self):
        """The compiled chat template, compiled once per template text (a template that does not
        compile fails each rendering without compiling again)."""
        if self._compiled is None or self._compiled[0] != self.chat_template:
            try:
                self._compiled = (self.chat_template, compile_template(self.chat_template, self.limits))
            except ChatTemplateError as e:
                self._compiled = (self.chat_template, str(e))
        if isinstance(self._compiled[1], str):
            raise ChatTemplateError(self._compiled[1])
        return self._compiled[1]


class TextStream:
    """Incremental decoding of one sequence of tokens: `push(token)` returns the text that
    token completes ('' while a UTF-8 character is still incomplete), `flush()` whatever is
    left at the end (an incomplete character as U+FFFD).

    Each step decodes only a window of the last tokens (a little context before the new ones
    keeps word boundaries right), so a long generation costs linear time; the window's text so
    far is kept, so a token costs one decode (and one more each time the window is cut back
    to its last `CONTEXT` tokens, past `WINDOW`). The stream starts after the end of `context`
    (the prompt): a SentencePiece vocabulary's word-initial space on the first new token is
    text then, not the start of the sequence that decoding drops.
    """

    CONTEXT = 4  # tokens of context kept when the window is cut back …
    WINDOW = 16  # … once it holds more than this many

    def __init__(self, codec: TextCodec, context: Sequence[int] = ()):
        self.codec = codec
        self._restart(list(context[-self.CONTEXT:]))  # (the context's last tokens, shown as it were)
        if self.text.endswith("\ufffd"):  # a prompt ending inside a character: start fresh
            self._restart([])

    def _restart(self, window: list[int]) -> None:
        """Only `window`, all of it shown: `text`, what has been shown of the window, is its decoding."""
        self.window, self.text = window, self.codec.decode(window)

    def push(self, token: int) -> str:
        self.window.append(token)
        after = self.codec.decode(self.window)
        if len(after) > len(self.text) and not after.endswith("\ufffd"):
            new, self.text = after[len(self.text):], after
            if len(self.window) > self.WINDOW:
                self._restart(self.window[-self.CONTEXT:])
            return new
        return ""

    def flush(self) -> str:
        rest = self.codec.decode(self.window)[len(self.text):]
        self._restart(self.window[-self.CONTEXT:])
        return rest
