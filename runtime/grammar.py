"""Structured output: a JSON schema, any JSON object, a GBNF or a Lark grammar, compiled once with llguidance
into a `Grammar`; each generation gets its own matcher (`Grammar.constraint()`), which the `Sampler` asks for
the tokens allowed next and tells the tokens taken. The end-of-text token is allowed only where the grammar is
complete, so a constrained generation ends with a whole JSON value (or is cut by max_tokens).

    grammar = Grammar.json_schema(codec, {"type": "object", "properties": {"n": {"type": "integer"}}})
    sampler = Sampler(SamplingOptions(), grammar.constraint())   # one constraint per generation
"""

from __future__ import annotations

import re
import threading
import weakref
from typing import Any

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.codec import TextCodec

_SOURCE_LINE = re.compile(r"\d+ \| ")
# between JSON tokens: nothing, a space, or a line break and an indent of at most 20 (llama.cpp's `space` rule):
# unbounded whitespace lets a small model loop on blank lines
JSON_SPACE = r"(\x20|\n[\x20\t]{0,20})?"
INSTALL = "structured output needs llguidance: pip install 'llmc[serve]'"


class GrammarError(LlmcError, ValueError):
    """A schema or grammar llguidance refuses, or a tokenizer it cannot read (one line)."""


def _llguidance():
    try:
        import llguidance
    except ImportError as e:
        raise LlmcError(INSTALL) from e
    return llguidance


def _one_line(message: str) -> str:
    """llguidance's message on one line, without the source lines (`1 | start: foo`) and carets it draws, and
    without the parser's state and grammar it appends: 'at 1(8): unknown name: "foo"'."""
    lines = (line.strip() for line in message.split("<state>", 1)[0].splitlines())
    return " ".join(line for line in lines if line and set(line) != {"^"} and not _SOURCE_LINE.match(line)) or "refused"


_tokenizers: dict[int, tuple[weakref.ref, Any]] = {}  # id(codec) → (the codec, its LLTokenizer)
_tokenizers_lock = threading.Lock()


def llg_tokenizer(codec: TextCodec):
    """The llguidance tokenizer of `codec` (its token byte strings and end-of-text id), built once per codec
    (about 0.2 s for a vocabulary of 49152)."""
    with _tokenizers_lock:
        entry = _tokenizers.get(id(codec))
        if entry is not None and entry[0]() is codec:
            return entry[1]
        if codec.eos_id is None:
            raise GrammarError("structured output needs the model's end-of-text token, and it has none")
        llguidance = _llguidance()
        try:
            tokenizer = llguidance.LLTokenizer(codec.tokenizer.to_str(), eos_token=codec.eos_id)
        except (ValueError, RuntimeError) as e:
            raise GrammarError(f"llguidance cannot read this model's tokenizer: {_one_line(str(e))}") from e
        key = id(codec)
        _tokenizers[key] = (weakref.ref(codec, lambda _: _tokenizers.pop(key, None)), tokenizer)
        return tokenizer


def token_bytes(codec: TextCodec, token: int) -> bytes:
    """The bytes `token` stands for, which may be part of a UTF-8 character (chat logprobs' `bytes`:
    `token_bytes(codec, 23274)` is `b"\\xe6\\x97"`, the first two of 日's three, where its piece is U+FFFD),
    from llguidance's tokenizer; a codec without the end-of-text token that llguidance needs: its piece's."""
    try:
        return llg_tokenizer(codec).decode_bytes([token])
    except GrammarError:
        return codec.piece(token).encode()


class GrammarConstraint:
    """One generation's matcher (the `Constraint` a `Sampler` takes): the tokens allowed next as a bool mask,
    the tokens taken, rollback, and how many of a draft it would accept.

    >>> constraint = Grammar.lark(codec, 'start: "yes" | "no"').constraint()
    >>> constraint.allowed()[codec.encode("yes", bos=False)[0]]
    True
    """

    def __init__(self, matcher, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.bits = np.zeros((vocab_size + 31) // 32, np.int32)

    def allowed(self) -> np.ndarray:
        matcher = self.matcher
        matcher.unsafe_compute_mask_ptr(self.bits.ctypes.data, self.bits.nbytes)
        if matcher.is_error():
            raise GrammarError(f"the grammar's matcher failed: {_one_line(matcher.get_error())}")
        return np.unpackbits(self.bits.view(np.uint8), count=self.vocab_size, bitorder="little").view(bool)

    def consume(self, tokens: list[int]) -> None:
        # one at a time: `consume_tokens` refuses the end-of-text token after the grammar has stopped
        if not all(self.matcher.consume_token(token) for token in tokens):
            raise GrammarError(f"the grammar does not allow the tokens {tokens}: {_one_line(self.matcher.get_error())}")

    def rollback(self, count: int) -> None:
        if not self.matcher.rollback(count):
            raise GrammarError(f"cannot roll the grammar back {count} tokens: {_one_line(self.matcher.get_error())}")

    def admissible(self, tokens: list[int]) -> int:
        return self.matcher.validate_tokens(tokens)

    @property
    def complete(self) -> bool:
        """Whether the tokens so far make a whole sentence of the grammar (the end-of-text token is allowed)."""
        return self.matcher.is_accepting()


class Grammar:
    """A grammar compiled for one codec's vocabulary, shared by the requests that use it (thread-safe):
    `constraint()` gives each generation a fresh matcher."""

    def __init__(self, codec: TextCodec, grammar: str, what: str):
        llguidance = _llguidance()
        tokenizer = llg_tokenizer(codec)
        self.start = llguidance.LLMatcher(tokenizer, grammar, log_level=0)  # copied, never advanced
        if self.start.is_error():
            raise GrammarError(f"{what}: {_one_line(self.start.get_error())}")
        self.vocab_size = tokenizer.vocab_size
        self.lock = threading.Lock()
        first = self.constraint()  # a grammar that no text matches (`root ::= root`) fails at its first mask
        try:
            first.allowed()
        except GrammarError as e:
            raise GrammarError(f"{what}: no text matches it ({_one_line(first.matcher.get_error())})") from e

    @classmethod
    def json_schema(cls, codec: TextCodec, schema: dict) -> Grammar:
        """JSON text valid under `schema` (always enforced: OpenAI's `strict` changes nothing here; whitespace
        between tokens as `JSON_SPACE` says), e.g.
        `Grammar.json_schema(codec, {"type": "array", "items": {"type": "integer"}, "maxItems": 3})`."""
        if not isinstance(schema, dict):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            grammar = _llguidance().LLMatcher.grammar_from_json_schema(schema, {"whitespace_pattern": JSON_SPACE})
        except (ValueError, TypeError) as e:
            raise GrammarError(f"JSON schema: {_one_line(str(e))}") from e
        return cls(codec, grammar, "JSON schema")

    @classmethod
    def json_object(cls, codec: TextCodec) -> Grammar:
        """Any JSON object (OpenAI's `response_format: {"type": "json_object"}`)."""
        return cls.json_schema(codec, {"type": "object"})

    @classmethod
    def gbnf(cls, codec: TextCodec, text: str) -> Grammar:
        """A llama.cpp GBNF grammar (`root ::= ...`), e.g. `Grammar.gbnf(codec, 'root ::= "yes" | "no"')`."""
        try:
            grammar = _llguidance().grammar_from("gbnf", text)
        except ValueError as e:
            raise GrammarError(f"GBNF grammar: {_one_line(str(e).split(': ', 1)[-1])}") from e
        return cls(codec, grammar, "GBNF grammar")

    @classmethod
    def lark(cls, codec: TextCodec, text: str) -> Grammar:
        """A Lark grammar in llguidance's dialect (`start: ...`, with %json and regexes), e.g.
        `Grammar.lark(codec, 'start: /[0-9]+/ "px"')`."""
        return cls(codec, _llguidance().LLMatcher.grammar_from_lark(text), "Lark grammar")

    def constraint(self) -> GrammarConstraint:
        """A fresh matcher at the grammar's start, for one generation."""
        with self.lock:
            return GrammarConstraint(self.start.deep_copy(), self.vocab_size)
