"""Tokenizers from strangers: a `tokenizer.json` whose expression backtracks past Oniguruma's
limit (the Rust library panics: a BaseException), files the library cannot read, and GGUF
vocabularies built to cost more than their size — each one `llmc: error:` line, exit 2, fast."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from hostile import assert_one_clean_line, hang_guard
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from llmc.cli import main
from llmc.errors import ModelFormatError
from llmc.frontend import load_tokenizer
from llmc.frontend.tokenizer import MAX_VOCABULARY, from_gguf_vocab
from llmc.runtime.codec import TokenizerError, read_tokenizer

MAX_SECONDS = 1.5
BACKTRACKING = "a" * 40 + "b"  # (a+)+$ tries 2^40 ways to fail on it


def _hf_directory(path: Path) -> Path:
    """A Hugging Face tokenizer directory whose pre-tokenizer splits by `(a+)+$`."""
    tokenizer = Tokenizer(models.BPE(vocab={"a": 0, "b": 1}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("(a+)+$"), behavior="isolated")
    path.mkdir()
    (path / "tokenizer.json").write_text(tokenizer.to_str())
    return path


def _timed(action) -> tuple[Exception, float]:
    with hang_guard():
        start = time.process_time()
        try:
            action()
        except Exception as e:  # noqa: BLE001 — the caller checks what it is
            return e, time.process_time() - start
    raise AssertionError("no error")


def test_panic_while_encoding_is_one_line(tmp_path: Path, capfd) -> None:
    """The error is one line, and the panic's own report (Rust writes it to file descriptor 2) is dropped."""
    directory = _hf_directory(tmp_path / "hf")
    codec = load_tokenizer(str(directory))
    assert codec.encode("ab", bos=False) == [0, 1]  # the expression works where it does not backtrack
    error, seconds = _timed(lambda: codec.encode(BACKTRACKING))
    assert isinstance(error, TokenizerError), repr(error)
    assert_one_clean_line(str(error))
    assert str(error).startswith("the model's tokenizer failed on this text: the tokenizers library panicked: ")
    assert "retry-limit-in-match" in str(error)
    assert seconds < MAX_SECONDS
    assert capfd.readouterr().err == ""
    assert main(["tokenize", str(directory), BACKTRACKING]) == 2
    err = capfd.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("llmc: error: the model's tokenizer failed"), err


@pytest.mark.parametrize("content", [b"{not json", b'{"version": "1.0", "model": 3}', b"\xff\xfe", b""],
                         ids=["not JSON", "not a tokenizer", "not UTF-8", "empty"])
def test_unreadable_tokenizer_json_is_one_line(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "tokenizer.json"
    path.write_bytes(content)
    error, _ = _timed(lambda: read_tokenizer(path))
    assert isinstance(error, ModelFormatError), repr(error)
    assert_one_clean_line(str(error))
    assert str(error).startswith(f"{path}: cannot load tokenizer: ")


def _sentencepiece(tokens: list[str]):
    tokens = ["<unk>", "<s>", "</s>", *tokens]
    return from_gguf_vocab("vocab.gguf", "llama", "default", tokens, None, [], [-float(len(t)) for t in tokens],
                           None, None, None, None, None)


def test_one_very_long_sentencepiece_token_costs_its_length() -> None:
    """A token of 300,000 characters (real vocabularies' longest are a few hundred) beside
    short ones: merges are looked for only where a token's first part has the length of a
    token, so it costs a few times its length, and the tokenizer is llama.cpp's."""
    long = "▁" + "ab" * 150_000
    start = time.process_time()
    codec = _sentencepiece(["▁", "a", "b", "ab", "▁a", "▁ab", long, "b" + long[1:]])
    assert time.process_time() - start < MAX_SECONDS
    pieces = [codec.tokenizer.id_to_token(i) for i in codec.encode("ab ab", bos=False)]
    assert pieces == ["▁ab", "▁ab"]


def test_sentencepiece_vocabulary_of_thousands_of_lengths_is_refused() -> None:
    """Tokens of every length up to 6000 make merge derivation cost their lengths squared."""
    error, seconds = _timed(lambda: _sentencepiece(["a" * n for n in range(1, 6001)]))
    assert isinstance(error, ModelFormatError), repr(error)
    assert "tokens of 6000 different lengths, up to 6000 characters, are more than a SentencePiece vocabulary " \
           "holds" in str(error)
    assert seconds < MAX_SECONDS


def test_merge_making_a_token_the_vocabulary_lacks_is_refused() -> None:
    """The tokenizers library panics on it (an index out of range): refused before."""
    error, _ = _timed(lambda: from_gguf_vocab("vocab.gguf", "gpt2", "gpt2", ["a", "b"], None, ["a b"], None, None,
                                              None, None, None, None))
    assert isinstance(error, ModelFormatError), repr(error)
    assert str(error) == "vocab.gguf: tokenizer.ggml.merges has 'a b', which makes a token the vocabulary lacks"


def test_vocabulary_beyond_any_model_is_refused() -> None:
    tokens = [f"t{i}" for i in range(MAX_VOCABULARY + 1)]
    error, seconds = _timed(lambda: from_gguf_vocab("vocab.gguf", "gpt2", "gpt2", tokens, None, [], None, None, None,
                                                    None, None, None))
    assert isinstance(error, ModelFormatError), repr(error)
    assert str(error) == (f"vocab.gguf: tokenizer.ggml.tokens holds {MAX_VOCABULARY + 1} tokens, more than any "
                          f"model's vocabulary (at most {MAX_VOCABULARY} here)")
    assert seconds < MAX_SECONDS
