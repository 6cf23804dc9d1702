"""Hostile and broken model files: a crafted corpus and mutation tests.

Model files come from strangers. Every crafted GGUF file, safetensors file and Hugging
Face directory here differs from a valid tiny model in one thing, and each must be
rejected with one `ModelFormatError` line that names the file and the detail (field,
byte offset), within 1 s and 256 MB of extra (traced) memory, without a crash of another
kind; `llmc compile` on it must exit 2 with one `llmc: error:` line and create nothing.
The hypothesis tests mutate valid tiny files at random: the only allowed outcomes are
success and `ModelFormatError`.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pickle
import re
import shutil
import signal
import time
import tracemalloc
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
from crafted import (
    ARR,
    BOOL,
    F32,
    F64,
    GGML_F32,
    GGML_Q4_1,
    I32,
    STR,
    U8,
    U32,
    U64,
    Arr,
    GGUFBuilder,
    Tensor,
    gkv,
    gstr,
    safetensors_bytes,
    safetensors_of,
    tiny_gguf,
    u32,
    u64,
)
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tiny_models import VOCAB_SIZE, TinySpec, random_weights, write_gguf, write_hf

from llmc.cli import main
from llmc.errors import ModelFormatError
from llmc.frontend import import_model, load_model

MAX_SECONDS = 1.0
MAX_EXTRA_BYTES = 256 * 1024 * 1024
HANG_GUARD_SECONDS = 30  # a hang fails the test instead of stalling the run

SPEC = TinySpec(layers=1)
N_TOKENS = VOCAB_SIZE


# ------------------------------------------------------------------ helpers


@contextmanager
def hang_guard(seconds: float = HANG_GUARD_SECONDS) -> Iterator[None]:
    """Raise TimeoutError (not a ModelFormatError) if the body runs longer than `seconds`."""

    def expired(signum: int, frame: object) -> None:
        raise TimeoutError(f"still running after {seconds} s (hang?)")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def load_everything(path: Path, allow_pickle: bool = False) -> None:
    """What a compile reads of a model: config, weights table, IR, and the tokenizer."""
    model = load_model(str(path), allow_pickle)
    import_model(model)
    model.tokenizer  # noqa: B018 — built on first use


def assert_one_clean_line(message: str) -> None:
    """A file's bytes must not reach the terminal raw: no line breaks, escapes or NULs."""
    assert not any(c in message for c in "\n\r\x1b\x00"), repr(message)


def assert_rejected(path: Path, details: list[str], allow_pickle: bool = False) -> str:
    """`path` is refused with one ModelFormatError line naming it and each detail, fast and small."""
    with hang_guard():
        start = time.perf_counter()
        with pytest.raises(ModelFormatError) as info:
            load_everything(path, allow_pickle)
        seconds = time.perf_counter() - start
    message = str(info.value)
    assert_one_clean_line(message)
    assert str(path) in message, f"the message does not name {path}: {message}"
    for detail in details:
        assert detail in message, f"{detail!r} not in {message!r}"
    assert seconds < MAX_SECONDS, f"rejected after {seconds:.2f} s: {message}"
    tracemalloc.start()
    try:
        with hang_guard(), pytest.raises(ModelFormatError):
            load_everything(path, allow_pickle)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MAX_EXTRA_BYTES, f"peak traced memory {peak / 2**20:.0f} MiB: {message}"
    return message


def cli_compile(path: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    capsys.readouterr()
    with hang_guard():
        code = main(["compile", str(path), "--max-seq", "32", "-o", str(out)])
    return code, capsys.readouterr().err


def assert_cli_rejects(path: Path, out: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = cli_compile(path, out, capsys)
    assert code == 2, err
    assert "Traceback" not in err, err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("llmc: error:"), err
    assert str(path) in lines[0], err
    assert not out.exists(), f"compile left {sorted(p.name for p in out.iterdir())} in {out}"


# ------------------------------------------------------------ the GGUF corpus


@dataclass
class Crafted:
    data: bytes
    details: list[str] = field(default_factory=list)
    size: int | None = None  # extend to this size with a hole (a sparse file: zeros cost no disk)

    def write(self, path: Path) -> Path:
        with open(path, "wb") as f:
            f.write(self.data)
            if self.size is not None:
                f.truncate(self.size)
        return path


@functools.cache
def _base() -> GGUFBuilder:
    return tiny_gguf(SPEC)


def base() -> GGUFBuilder:
    """A fresh copy of the valid tiny GGUF model (1 layer, f32) to break in one place."""
    return _base().copy()


def _with(key: str, vtype: int, value: object, *details: str) -> Callable[[], Crafted]:
    return lambda: Crafted(base().set(key, vtype, value).raw(), list(details))


def _header(tensors: int = 0, kvs: int = 0, version: int = 3) -> bytes:
    return b"GGUF" + u32(version) + u64(tensors) + u64(kvs)


GGUF_CASES: dict[str, Callable[[], Crafted]] = {}


def gguf_case(name: str) -> Callable[[Callable[[], Crafted]], Callable[[], Crafted]]:
    def register(make: Callable[[], Crafted]) -> Callable[[], Crafted]:
        assert name not in GGUF_CASES, name
        GGUF_CASES[name] = make
        return make

    return register


def _cases(table: dict[str, Callable[[], Crafted]]) -> None:
    for name, make in table.items():
        gguf_case(name)(make)


# --- header: magic, version, empty and tiny files

_cases({
    "bad-magic": lambda: Crafted(b"GGML" + base().raw()[4:], ["not a GGUF file", "magic b'GGML' at byte 0"]),
    "magic-of-other-format": lambda: Crafted(b"\x80\x02}q\x00" + bytes(64), ["not a GGUF file"]),
    "empty-file": lambda: Crafted(b"", ["not a GGUF file (0 bytes)"]),
    "version-1": lambda: Crafted(_header(version=1) + base().raw()[24:],
                                 ["GGUF version 1 is not supported", "at byte 4"]),
    "version-4": lambda: Crafted(_header(version=4) + base().raw()[24:],
                                 ["GGUF version 4 is not supported", "at byte 4"]),
    "version-2^31": lambda: Crafted(_header(version=2**31) + base().raw()[24:],
                                    ["version 2147483648 is not supported"]),
})


# --- truncation at many points

Detail = str | Callable[[dict[str, int]], str]  # a fixed text, or one made from the file's landmarks


def _truncated(at: Callable[[dict[str, int]], int], *details: Detail) -> Callable[[], Crafted]:
    def make() -> Crafted:
        built = base().build()
        cut = at(built.where)
        return Crafted(built.data[:cut], [d(built.where) if callable(d) else d for d in details])

    return make


_KEY = "tokenizer.ggml.bos_token_id"
_cases({
    "truncated-in-magic": _truncated(lambda w: 2, "not a GGUF file (2 bytes)"),
    "truncated-in-version": _truncated(lambda w: 6, "version at byte 4", "truncated"),
    "truncated-in-tensor-count": _truncated(lambda w: 12, "tensor count at byte 8", "truncated"),
    "truncated-in-kv-count": _truncated(lambda w: 20, "metadata count at byte 16", "truncated"),
    "truncated-after-header": _truncated(lambda w: 24, "metadata count at byte 16", "cannot fit"),
    "truncated-in-key-length": _truncated(lambda w: w[f"kv:{_KEY}"] + 3, lambda w: f"at byte {w[f'kv:{_KEY}']}"),
    "truncated-in-key": _truncated(lambda w: w[f"kv:{_KEY}"] + 8 + 5,
                                   "metadata key", lambda w: f"at byte {w[f'kv:{_KEY}']}", "exceeds the file"),
    "truncated-in-value-type": _truncated(lambda w: w[f"value:{_KEY}"] - 2, f"'{_KEY}' type", "truncated"),
    "truncated-in-scalar-value": _truncated(lambda w: w[f"value:{_KEY}"] + 2,
                                            f"'{_KEY}'", lambda w: f"at byte {w[f'value:{_KEY}']}", "truncated"),
    "truncated-in-string-value": _truncated(lambda w: w["value:tokenizer.chat_template"] + 8 + 20,
                                            "'tokenizer.chat_template'",
                                            lambda w: f"at byte {w['value:tokenizer.chat_template']}",
                                            "exceeds the file"),
    "truncated-in-string-array": _truncated(lambda w: w["value:tokenizer.ggml.tokens"] + 400,
                                            "'tokenizer.ggml.tokens'", "exceeds the file"),
    "truncated-in-int-array": _truncated(lambda w: w["value:tokenizer.ggml.token_type"] + 12 + 30,
                                         "'tokenizer.ggml.token_type'", "exceeds the file"),
    "truncated-in-tensor-name": _truncated(lambda w: w["tensor:blk.0.attn_q.weight"] + 12,
                                           "tensor name", lambda w: f"at byte {w['tensor:blk.0.attn_q.weight']}"),
    "truncated-in-tensor-dims": _truncated(lambda w: w["tensor:blk.0.attn_q.weight"] + 8 + 20 + 4 + 4,
                                           "tensor 'blk.0.attn_q.weight' dimension", "truncated"),
    "truncated-in-tensor-offset": _truncated(lambda w: w["tensor:token_embd.weight"] + 8 + 17 + 4 + 16 + 4 + 3,
                                             "tensor 'token_embd.weight' data offset", "truncated"),
    "truncated-at-data-start": _truncated(lambda w: w["data"], "tensor 'token_embd.weight'",
                                          "past the end of the file"),
    "truncated-in-first-tensor-data": _truncated(lambda w: w["data"] + 1000, "tensor 'token_embd.weight'",
                                                 "past the end of the file"),
    "last-tensor-short-by-4-bytes": _truncated(lambda w: w["data:output_norm.weight"] + 32 * 4 - 4,
                                               "tensor 'output_norm.weight'", "past the end of the file"),
})


# --- counts and lengths far beyond the file

_cases({
    "tensor-count-2^63": lambda: Crafted(_header(2**63, 20) + base().raw()[24:],
                                         ["tensor count at byte 8", "9223372036854775808 tensors cannot fit"]),
    "tensor-count-2^64-1": lambda: Crafted(_header(2**64 - 1, 20) + base().raw()[24:], ["tensor count at byte 8"]),
    "kv-count-2^63": lambda: Crafted(_header(11, 2**63) + base().raw()[24:],
                                     ["metadata count at byte 16", "9223372036854775808 entries cannot fit"]),
    "kv-count-one-too-many": lambda: Crafted(_header(11, 21) + base().raw()[24:], ["tensor name"]),
    "key-length-2^63": lambda: Crafted(_header(0, 1) + u64(2**63) + b"general.architecture" + u32(STR) + gstr("llama"),
                                       ["metadata key at byte 24", "9223372036854775808 bytes exceeds the file"]),
    "key-length-64KiB+1": lambda: Crafted(_header(0, 1) + gkv("k" * 65537, STR, "llama"),
                                          ["metadata key at byte 24", "65537 bytes exceeds the limit of 65536"]),
    "string-value-length-2^63": lambda: Crafted(
        _header(0, 1) + gstr("general.architecture") + u32(STR) + u64(2**63) + b"llama",
        ["'general.architecture' at byte 56", "string of 9223372036854775808 bytes exceeds"]),
    # the gguf package's reader loops 2^63 times over this one (49 bytes)
    "u8-array-length-2^63": lambda: Crafted(_header(0, 1) + gstr("a") + u32(ARR) + u32(U8) + u64(2**63),
                                            ["'a' at byte 37",
                                             "array of 9223372036854775808 elements exceeds the file"]),
    "string-array-length-2^63": lambda: Crafted(
        base().set("tokenizer.ggml.tokens", ARR, Arr(STR, ["a", "b"], count=2**63)).raw(),
        ["'tokenizer.ggml.tokens'", "array of 9223372036854775808 elements exceeds the file"]),
    "f64-array-length-2^61": lambda: Crafted(_header(0, 1) + gstr("a") + u32(ARR) + u32(F64) + u64(2**61) + bytes(64),
                                             ["'a'", "exceeds the file"]),
    "tensor-name-length-2^63": lambda: Crafted(
        _header(1, 0) + u64(2**63) + b"token_embd.weight" + u32(1) + u64(32) + u32(0) + u64(0),
        ["tensor name at byte 24", "9223372036854775808 bytes exceeds the file"]),
})


# --- value and element types, nesting, duplicates, encodings

def _raw_kv(raw: bytes, *details: str) -> Callable[[], Crafted]:
    def make() -> Crafted:
        b = base()
        b.kvs.insert(1, raw)
        built = b.build()
        return Crafted(built.data, [d.replace("@", str(built.where["raw kv"])) for d in details])

    return make


def _nested(depth: int) -> bytes:
    """An array of arrays … `depth` levels deep, one element each, innermost empty u8."""
    return b"".join(u32(ARR) + u64(1) for _ in range(depth - 1)) + u32(U8) + u64(0)


_cases({
    "unknown-value-type-13": _raw_kv(gstr("x.y") + u32(13) + u32(0), "'x.y'", "unknown value type 13"),
    "unknown-value-type-2^32-1": _raw_kv(gstr("x.y") + u32(2**32 - 1) + u32(0), "unknown value type 4294967295"),
    "unknown-array-element-type": _raw_kv(gstr("x.y") + u32(ARR) + u32(13) + u64(1) + u32(0), "'x.y'",
                                          "unknown array element type 13"),
    "arrays-nested-3-deep": _raw_kv(gstr("x.y") + u32(ARR) + _nested(3), "'x.y'", "nested deeper than 2"),
    "arrays-nested-1000-deep": _raw_kv(gstr("x.y") + u32(ARR) + _nested(1000), "'x.y'", "nested deeper than 2"),
    "duplicate-metadata-key": _raw_kv(gkv("general.architecture", STR, "qwen2"),
                                      "'general.architecture'", "duplicate key"),
    "non-utf8-key": _raw_kv(gkv(b"general.\xff\xfe", U32, 1), "metadata key at byte @", "not UTF-8"),
    "non-utf8-string-value": lambda: Crafted(base().set("general.architecture", STR, "ll\xe9ama").raw()
                                             .replace(b"ll\xc3\xa9ama", b"ll\xe9ama\x00"),
                                             ["'general.architecture'", "not UTF-8"]),
    "non-utf8-in-string-array": lambda: Crafted(
        base().set("tokenizer.ggml.merges", ARR, Arr(STR, ["a b", "c d"])).raw().replace(b"c d", b"c\xc0d"),
        ["'tokenizer.ggml.merges'[1]", "not UTF-8"]),
})


# --- text from the file must not reach the terminal raw (line breaks, escape sequences)

_cases({
    "key-with-newline-and-escape": _raw_kv(gstr("evil\nkey\x1b[2J") + u32(13) + u32(0), "unknown value type 13"),
    "architecture-with-newline-and-escape": lambda: Crafted(
        base().set("general.architecture", STR, "gpt\n\x1b[2J\rllama").raw(), ["unsupported architecture"]),
    "tensor-name-with-newline": lambda: Crafted(_extra_tensor("blk.0.x\nllmc: ok"), ["unexpected tensor"]),
})


@gguf_case("duplicate-tensor-name")
def _() -> Crafted:
    b = base()
    t = b.tensor("blk.0.ffn_norm.weight")
    b.tensors.append(Tensor(t.name, t.dims, t.type_id, t.data))
    built = b.build()
    return Crafted(built.data, ["tensor 'blk.0.ffn_norm.weight'", "duplicate tensor name"])


@gguf_case("non-utf8-tensor-name")
def _() -> Crafted:
    b = base()
    b.tensor("output_norm.weight").name = b"output_norm.\xffeight"
    return Crafted(b.raw(), ["tensor name", "not UTF-8"])


# --- alignment

_ALIGN = "general.alignment"
_cases({
    "alignment-0": _with(_ALIGN, U32, 0, "should be a power of two ≤ 65536, got 0"),
    "alignment-3": _with(_ALIGN, U32, 3, "should be a power of two ≤ 65536, got 3"),
    "alignment-2^20": _with(_ALIGN, U32, 2**20, "should be a power of two ≤ 65536, got 1048576"),
    "alignment-2^64-1": _with(_ALIGN, U64, 2**64 - 1, "got 18446744073709551615"),
    "alignment-string": _with(_ALIGN, STR, "32", "'32'"),
    "alignment-float": _with(_ALIGN, F32, 32.0, "32.0"),
    "alignment-bool": _with(_ALIGN, BOOL, True, "True"),
    "alignment-long-array": _with(_ALIGN, ARR, Arr(U32, list(range(0, 4096, 32))), "got an array of 128"),
})


# --- tensor table: dimensions, types, offsets, sizes

def _tensor_edit(name: str, edit: Callable[[Tensor], None], *details: Detail) -> Callable[[], Crafted]:
    def make() -> Crafted:
        b = base()
        edit(b.tensor(name))
        built = b.build()
        return Crafted(built.data, [d(built.where) if callable(d) else d for d in details])

    return make


def _set(**fields: object) -> Callable[[Tensor], None]:
    def edit(t: Tensor) -> None:
        for key, value in fields.items():
            setattr(t, key, value)

    return edit


_NORM = "output_norm.weight"
_Q = "blk.0.attn_q.weight"
_cases({
    "n-dims-0": _tensor_edit(_NORM, _set(dims=[]), f"tensor '{_NORM}'", lambda w: f"at byte {w['tensor:' + _NORM]}",
                             "0 dimensions (1..4 allowed)"),
    "n-dims-5": _tensor_edit(_NORM, _set(dims=[32, 1, 1, 1, 1]), f"tensor '{_NORM}'", "5 dimensions (1..4 allowed)"),
    "n-dims-2^32-1": _tensor_edit(_NORM, _set(n_dims=2**32 - 1), f"tensor '{_NORM}'", "4294967295 dimensions"),
    "dimension-0": _tensor_edit(_Q, _set(dims=[32, 0]), f"tensor '{_Q}'", "dimension of size 0"),
    "dims-product-2^96": _tensor_edit(_Q, _set(dims=[2**32, 2**32, 2**32]), f"tensor '{_Q}'",
                                      "past the end of the file"),
    "dims-product-2^192": _tensor_edit(_Q, _set(dims=[2**64 - 1] * 3), f"tensor '{_Q}'", "past the end of the file"),
    "dims-product-wraps-to-small": _tensor_edit(_Q, _set(dims=[32, 2**62 + 1, 4]), f"tensor '{_Q}'",
                                                "past the end of the file"),
    "unknown-tensor-type-99": _tensor_edit(_Q, _set(type_id=99), f"tensor '{_Q}'", "tensor type 99 is not supported"),
    "unknown-tensor-type-2^32-1": _tensor_edit(_Q, _set(type_id=2**32 - 1), "tensor type 4294967295 is not supported"),
    "offset-past-file-end": _tensor_edit(_NORM, _set(offset=2**40), f"tensor '{_NORM}'", "past the end of the file"),
    "offset-2^64-32": _tensor_edit(_NORM, _set(offset=2**64 - 32), f"tensor '{_NORM}'", "past the end of the file"),
    "offset-misaligned": _tensor_edit(_NORM, _set(offset=65536 + 4), f"tensor '{_NORM}'",
                                      "data offset 65540 is not a multiple of the alignment 32"),
    "q4_1-row-of-48-weights": _tensor_edit("blk.0.ffn_down.weight", _set(type_id=GGML_Q4_1, data=bytes(32 * 40)),
                                           "tensor 'blk.0.ffn_down.weight'",
                                           "row of 48 Q4_1 weights is not a whole number of 32-weight blocks"),
    "q4_1-row-of-16-weights": _tensor_edit(_NORM, _set(dims=[16, 2], type_id=GGML_Q4_1, data=bytes(40)),
                                           f"tensor '{_NORM}'", "row of 16 Q4_1 weights"),
})


@gguf_case("overlapping-tensor-data")
def _() -> Crafted:
    b = base()
    b.tensor("blk.0.attn_k.weight").offset = 0  # token_embd's bytes too
    return Crafted(b.raw(), ["'token_embd.weight'", "'blk.0.attn_k.weight'", "overlap"])


@gguf_case("tensor-data-overlapping-by-one-block")
def _() -> Crafted:
    b = base()
    built = b.build()
    k_start = built.where["data:blk.0.attn_k.weight"] - built.where["data"]
    b.tensor("blk.0.attn_v.weight").offset = k_start + 32  # 32 bytes into attn_k
    return Crafted(b.raw(), ["'blk.0.attn_k.weight'", "'blk.0.attn_v.weight'", "overlap"])


# --- hyper-parameters that contradict each other or the tensors

_A = "llama."
_cases({
    "kv-heads-do-not-divide-heads": _with(_A + "attention.head_count_kv", U32, 3, "4 attention heads", "3 KV heads"),
    "qwen2-kv-heads-do-not-divide-heads": lambda: Crafted(
        tiny_gguf(TinySpec(arch="qwen2", layers=1)).set("qwen2.attention.head_count_kv", U32, 3).raw(),
        ["4 attention heads are not a multiple of 3 KV heads"]),
    "embedding-not-multiple-of-heads": lambda: Crafted(
        base().set(_A + "attention.head_count", U32, 5).set(_A + "attention.head_count_kv", U32, 5).raw(),
        ["embedding length 32 is not a multiple of 5 heads"]),
    "head-count-0": _with(_A + "attention.head_count", U32, 0, "0 heads"),
    "ffn-length-contradicts-tensors": _with(_A + "feed_forward_length", U32, 64,
                                            "tensor 'blk.0.ffn_gate' has shape 48x32, the config implies 64x32"),
    "embedding-length-contradicts-tensors": _with(_A + "embedding_length", U32, 64, "the config implies"),
    "block-count-0": _with(_A + "block_count", U32, 0, "layers must be a positive integer, got 0"),
    "block-count-2^32-1": _with(_A + "block_count", U32, 2**32 - 1, "4294967295"),
    "block-count-2^63-i64": _with(_A + "block_count", U64, 2**63, "9223372036854775808"),
    "head-count-kv-is-a-bool": _with(_A + "attention.head_count_kv", BOOL, True, "'llama.attention.head_count_kv'"),
    "block-count-is-a-bool": _with(_A + "block_count", BOOL, True, "got True"),
    "block-count-is-a-string": _with(_A + "block_count", STR, "1", "'llama.block_count' should be an integer, got '"),
    "block-count-is-an-array": _with(_A + "block_count", ARR, Arr(U32, [1]), "'llama.block_count' should be an integer, got an array"),
    "context-length-0": _with(_A + "context_length", U32, 0, "context_length must be a positive integer"),
    "rms-epsilon-nan": _with(_A + "attention.layer_norm_rms_epsilon", F32, float("nan"), "RMSNorm epsilon"),
    "rope-theta-negative": _with(_A + "rope.freq_base", F32, -1.0, "rope theta must be positive"),
    "rope-dimension-odd": _with(_A + "rope.dimension_count", U32, 7, "head dimension 7 must be even"),
    "missing-architecture": lambda: Crafted(base().drop("general.architecture").raw(),
                                            ["missing metadata key 'general.architecture'"]),
    "unsupported-architecture": lambda: Crafted(base().set("general.architecture", STR, "gpt2").raw(),
                                                ["unsupported architecture 'gpt2'"]),
    "missing-tensor": lambda: Crafted(base().drop_tensor("blk.0.ffn_down.weight").raw(),
                                      ["missing tensor 'blk.0.ffn_down'"]),
    "missing-token-embd": lambda: Crafted(base().drop_tensor("token_embd.weight").raw(),
                                          ["missing tensor 'token_embd'"]),
    "tensor-shape-contradicts-config": _tensor_edit(_Q, _set(dims=[16, 64]),
                                                    "tensor 'blk.0.attn_q' has shape 64x16, the config implies 32x32"),
    "unexpected-tensor": lambda: Crafted(_extra_tensor("blk.7.ffn_up.weight"), ["unexpected tensor 'blk.7.ffn_up'"]),
})


def _extra_tensor(name: str) -> bytes:
    b = base()
    b.tensors.append(Tensor(name, [32], GGML_F32, bytes(128)))
    return b.raw()


# --- tokenizer metadata

_T = "tokenizer.ggml."
_cases({
    "bos-id-equals-vocab": _with(_T + "bos_token_id", U32, N_TOKENS, f"id {N_TOKENS} is outside the vocabulary"),
    "eos-id-2^32-1": _with(_T + "eos_token_id", U32, 2**32 - 1, "id 4294967295 is outside the vocabulary"),
    "bos-id-negative": _with(_T + "bos_token_id", I32, -1, "id -1 is outside the vocabulary"),
    "bos-id-is-a-bool": _with(_T + "bos_token_id", BOOL, True, "'tokenizer.ggml.bos_token_id'"),
    "padding-id-past-vocab": _with(_T + "padding_token_id", U32, 10**6, "outside the vocabulary"),
    "token-type-too-short": _with(_T + "token_type", ARR, Arr(I32, [1] * (N_TOKENS - 1)),
                                  f"token_type has {N_TOKENS - 1} entries for {N_TOKENS} tokens"),
    "tokens-are-integers": _with(_T + "tokens", ARR, Arr(I32, list(range(N_TOKENS))), "array of strings"),
    "tokens-fewer-than-embedding-rows": lambda: Crafted(
        base().set(_T + "tokens", ARR, Arr(STR, [f"t{i}" for i in range(N_TOKENS - 1)])).raw(),
        [f"tokenizer has {N_TOKENS - 1} tokens, token_embd has {N_TOKENS} rows"]),
    "tokens-is-a-string": _with(_T + "tokens", STR, "abc", "should be an array of strings, got 'abc'"),
    "duplicate-tokens": lambda: Crafted(
        base().set(_T + "tokens", ARR, Arr(STR, ["same"] * N_TOKENS)).drop(_T + "merges").raw(), ["duplicate tokens"]),
    "merges-are-integers": _with(_T + "merges", ARR, Arr(U32, [1, 2]), "array of strings"),
    "merge-of-unknown-tokens": _with(_T + "merges", ARR, Arr(STR, ["no such"]), "invalid entry 'no such'"),
    "tokenizer-model-unsupported": _with(_T + "model", STR, "llama", "unsupported tokenizer model 'llama'"),
    "pre-tokenizer-unsupported": _with(_T + "pre", STR, "no-such-pre", "unsupported pre-tokenizer 'no-such-pre'"),
    "chat-template-not-a-string": _with("tokenizer.chat_template", U32, 7, "should be a string, got 7"),
    # values of the wrong kind that only the tokenizer builder reads
    "token-type-strings": _with(_T + "token_type", ARR, Arr(STR, ["x"] * N_TOKENS), "token_type"),
    "token-type-nan": _with(_T + "token_type", ARR, Arr(F32, [float("nan")] * N_TOKENS), "token_type"),
    "token-type-nested-arrays": _with(_T + "token_type", ARR, Arr(ARR, [Arr(U8, [])] * N_TOKENS), "token_type"),
    "add-bos-token-is-a-string": _with(_T + "add_bos_token", STR, "yes", "add_bos_token"),
})


# --- bounded work: small (or sparse) files that ask for a lot of parsing or memory

def _sparse(head: bytes, size: int, *details: str) -> Callable[[], Crafted]:
    return lambda: Crafted(head, list(details), size)


_MANY = 500_000
BOUNDED_WORK = {"u8-array-of-300MB", "string-array-of-500k-empty-strings", "array-of-500k-empty-arrays",
                "200k-metadata-entries", "100k-tensor-entries"}
# Only the bounds are asserted here (time, memory, a ModelFormatError naming the file):
# the file may be refused for its size or parsed and refused for what it lacks.
_cases({
    # 300 MB of zeros (a hole, no disk): a u8 array as big as the file, copied into memory
    "u8-array-of-300MB": _sparse(_header(0, 1) + gstr("a") + u32(ARR) + u32(U8) + u64(300_000_000), 300_000_100),
    # 4 MB of zeros read as half a million empty strings
    "string-array-of-500k-empty-strings": _sparse(_header(0, 1) + gstr("a") + u32(ARR) + u32(STR) + u64(_MANY),
                                                  8 * _MANY + 100),
    # 6 MB of zeros read as half a million empty u8 arrays inside one array
    "array-of-500k-empty-arrays": _sparse(_header(0, 1) + gstr("a") + u32(ARR) + u32(ARR) + u64(_MANY),
                                          12 * _MANY + 100),
    # 2.6 MB: 200k one-byte metadata entries
    "200k-metadata-entries": lambda: Crafted(
        _header(0, 200_000) + b"".join(gkv(f"k{i}", U8, 0) for i in range(200_000))),
    # 6.6 MB: 100k 8-float tensors
    "100k-tensor-entries": lambda: Crafted(
        _header(100_000, 0) + b"".join(gstr(f"t{i}") + u32(1) + u64(8) + u32(0) + u64(32 * i) for i in range(100_000))
        + bytes(32 * 100_000 + 64)),
})


# ------------------------------------------------------------------ the GGUF tests


@pytest.fixture(scope="module", autouse=True)
def warm_imports(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Load a valid model of each kind once, so no timed case pays for first imports."""
    directory = tmp_path_factory.mktemp("warm")
    path = directory / "warm.gguf"
    path.write_bytes(base().raw())
    load_everything(path)
    load_everything(write_hf(SPEC, _hf_weights(), directory / "hf"))


def test_the_base_model_is_valid(tmp_path: Path) -> None:
    """Every corpus file differs from this valid file in one thing."""
    path = tmp_path / "base.gguf"
    path.write_bytes(base().raw())
    model = load_model(str(path))
    import_model(model)
    assert model.tokenizer.encode("the cat") and model.config.layers == 1
    assert path.read_bytes() == write_gguf(SPEC, random_weights(SPEC), tmp_path / "writer.gguf").read_bytes()


def test_the_corpus_is_big_enough() -> None:
    assert len(GGUF_CASES) >= 30
    assert len(HF_CASES) >= 12


@pytest.mark.parametrize("name", GGUF_CASES)
def test_crafted_gguf_is_rejected(name: str, tmp_path: Path) -> None:
    crafted = GGUF_CASES[name]()
    path = crafted.write(tmp_path / f"{name}.gguf")
    assert_rejected(path, crafted.details)


# ------------------------------------------------------ the safetensors / HF corpus


@functools.cache
def _hf_weights() -> dict[str, np.ndarray]:
    return random_weights(SPEC)


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf(SPEC, _hf_weights(), tmp_path_factory.mktemp("hf") / "base")


@pytest.fixture
def hf_dir(hf_base: Path, tmp_path: Path) -> Path:
    """A fresh copy of the valid tiny HF directory to break."""
    return Path(shutil.copytree(hf_base, tmp_path / "model"))


def _st(d: Path, header: dict | bytes | str, data: bytes | None = None, header_len: int | None = None) -> Path:
    if data is None:
        data = safetensors_of(_hf_weights())[1]
    path = d / "model.safetensors"
    path.write_bytes(safetensors_bytes(header, data, header_len))
    return d


def _header_edit(edit: Callable[[dict], object]) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        header, data = safetensors_of(_hf_weights())
        header = copy.deepcopy(header)
        edit(header)
        return _st(d, header, data)

    return make


def _entry(name: str, **fields: object) -> Callable[[Path], Path]:
    return _header_edit(lambda h: h[name].update(fields))


def _config_edit(edit: Callable[[dict], object]) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        config = json.loads((d / "config.json").read_text())
        edit(config)
        (d / "config.json").write_text(json.dumps(config))
        return d

    return make


def _write(name: str, raw: bytes | str) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        (d / name).write_bytes(raw.encode() if isinstance(raw, str) else raw)
        return d

    return make


def _remove(name: str) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        (d / name).unlink()
        return d

    return make


def _config_text(edit: Callable[[str], str]) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        (d / "config.json").write_text(edit((d / "config.json").read_text()))
        return d

    return make


_NW = "model.norm.weight"
_L0 = "model.layers.0."
_N_DATA = len(safetensors_of(_hf_weights())[1])


def _rename(old: str, new: str) -> Callable[[dict], object]:
    return lambda h: h.__setitem__(new, h.pop(old))


def _overlap(h: dict) -> None:
    h[_L0 + "self_attn.v_proj.weight"]["data_offsets"] = list(h[_L0 + "self_attn.k_proj.weight"]["data_offsets"])


def _two_files(d: Path) -> Path:
    header, data = safetensors_of({_NW: _hf_weights()[_NW]})
    (d / "model-00002-of-00002.safetensors").write_bytes(safetensors_bytes(header, data))
    return d


def _link_out(name: str) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        outside = d.parent / f"outside-{name}"
        shutil.move(d / name, outside)
        (d / name).symlink_to(outside)
        return d

    return make


def _only_pickle(d: Path) -> Path:
    (d / "model.safetensors").rename(d / "pytorch_model.bin")  # never opened without --allow-pickle
    return d


def _sparse_config(d: Path) -> Path:
    with open(d / "config.json", "r+b") as f:
        f.truncate(300_000_000)  # a hole: no disk, but 300 MB if read whole
    return d


def _huge_json_header(d: Path) -> Path:
    n = 20_000_000  # 40 MB of "0,": valid JSON, 20 M list elements
    return _st(d, b'{"a":[' + b"0," * (n - 1) + b"0]}")


HF_BOUNDED_WORK = {"header-huge-json", "config-300MB-sparse"}  # big files: not repeated through the CLI
HF_CASES: dict[str, tuple[Callable[[Path], Path], list[str]]] = {
    # container
    "file-shorter-than-8-bytes": (_write("model.safetensors", b"\x10\x00\x00"),
                                  ["truncated safetensors file (3 bytes"]),
    "header-length-past-file": (lambda d: _st(d, "{}", b"", header_len=1000), ["header length 1000 exceeds the file"]),
    "header-length-2^63": (lambda d: _st(d, "{}", b"", header_len=2**63), ["header length 9223372036854775808"]),
    "header-length-2^64-1": (lambda d: _st(d, "{}", b"", header_len=2**64 - 1), ["header length 18446744073709551615"]),
    "header-not-json": (lambda d: _st(d, b"{not json"), ["invalid JSON"]),
    "header-not-utf8": (lambda d: _st(d, b'{"\xff": 1}'), ["invalid JSON"]),
    "header-json-array": (lambda d: _st(d, "[1, 2]"), ["header is not a JSON object"]),
    "header-json-nested-100k-deep": (lambda d: _st(d, "[" * 100_000 + "]" * 100_000), ["invalid JSON"]),
    "header-duplicate-keys": (lambda d: _st(d, json.dumps(safetensors_of(_hf_weights())[0])[:-1]
                                            + ', "model.norm.weight": {"dtype": "F32", "shape": [0], '
                                              '"data_offsets": [0, 0]}}'), ["duplicate key 'model.norm.weight'"]),
    "header-huge-json": (_huge_json_header, ["model.safetensors"]),
    # header entries
    "dtype-unknown": (_entry(_NW, dtype="Q9"), [f"tensor '{_NW}'", "dtype 'Q9' is not supported"]),
    "dtype-i64": (_entry(_NW, dtype="I64"), ["dtype 'I64' is not supported"]),
    "dtype-is-a-list": (_entry(_NW, dtype=["F32"]), [f"tensor '{_NW}'", "dtype"]),
    "dtype-is-an-object": (_entry(_NW, dtype={"F32": 1}), [f"tensor '{_NW}'", "dtype"]),
    "shape-negative": (_entry(_NW, shape=[-32]), ["malformed shape [-32]"]),
    "shape-float": (_entry(_NW, shape=[32.0]), ["malformed shape [32.0]"]),
    "shape-string": (_entry(_NW, shape=["32"]), ["malformed shape ['32']"]),
    "shape-bool": (_entry(_NW, shape=[True]), ["malformed shape [True]"]),
    "shape-not-a-list": (_entry(_NW, shape=32), ["malformed shape 32"]),
    "shape-9-dims": (_entry(_NW, shape=[1] * 8 + [32]), ["malformed shape"]),
    "shape-zero-and-2^64": (_entry(_NW, shape=[0, 2**64], data_offsets=[0, 0]), [f"tensor '{_NW}'"]),
    "shape-zero-and-2^62-squared": (_entry(_NW, shape=[0, 2**62, 2**62], data_offsets=[0, 0]), [f"tensor '{_NW}'"]),
    "data-shorter-than-shape": (_entry(_NW, shape=[64]), [f"tensor '{_NW}'", "do not hold (64,) F32"]),
    "offsets-wrong-length": (_entry(_NW, data_offsets=[0]), ["malformed data_offsets [0]"]),
    "offsets-negative": (_entry(_NW, data_offsets=[-128, 0]), ["malformed data_offsets [-128, 0]"]),
    "offsets-reversed": (_entry(_NW, data_offsets=[128, 0]), [f"tensor '{_NW}'", "data offsets 128..0"]),
    "offsets-floats": (_entry(_NW, data_offsets=[0.0, 128.0]), ["malformed data_offsets"]),
    "offsets-past-the-data": (_entry(_NW, data_offsets=[_N_DATA, _N_DATA + 128]), ["run past the data"]),
    "offsets-2^64": (_entry(_NW, data_offsets=[2**64, 2**64 + 128]), ["run past the data"]),
    "data-truncated": (lambda d: _st(d, safetensors_of(_hf_weights())[0], safetensors_of(_hf_weights())[1][:-4]),
                       ["run past the data"]),
    "overlapping-tensors": (_header_edit(_overlap), ["overlap"]),
    "entry-with-extra-field": (_entry(_NW, extra=1), [f"tensor '{_NW}'", "malformed header entry"]),
    "entry-not-an-object": (_header_edit(lambda h: h.__setitem__(_NW, [1, 2])), ["malformed header entry"]),
    "metadata-non-string-value": (_header_edit(lambda h: h.__setitem__("__metadata__", {"format": 1})),
                                  ["__metadata__ must map strings to strings"]),
    "metadata-is-a-list": (_header_edit(lambda h: h.__setitem__("__metadata__", ["pt"])), ["__metadata__"]),
    "unknown-tensor-name": (_header_edit(_rename(_NW, "model.final_norm.weight")),
                            ["'model.final_norm.weight' is not part of a supported architecture"]),
    "layer-index-5000-digits": (_header_edit(_rename(_L0 + "input_layernorm.weight",
                                                     "model.layers." + "9" * 5000 + ".input_layernorm.weight")),
                                ["model.layers.999"]),
    "tensor-name-with-newline": (_header_edit(_rename(_NW, "model.norm\n\x1b[2Jweight")),
                                 ["is not part of a supported architecture"]),
    "tensor-in-two-files": (_two_files, [f"tensor '{_NW}' appears in more than one file"]),
    "missing-tensor": (_header_edit(lambda h: h.pop(_L0 + "mlp.down_proj.weight")),
                       ["missing tensor 'blk.0.ffn_down'"]),
    # config.json
    "config-duplicate-keys": (_config_text(lambda text: text.rstrip().removesuffix("}") + ', "hidden_size": 64}'),
                              ["config.json", "duplicate key 'hidden_size'"]),
    "config-int-is-a-string": (_config_edit(lambda c: c.update(hidden_size="32")), ["hidden_size must be an integer"]),
    "config-int-is-a-float": (_config_edit(lambda c: c.update(num_hidden_layers=1.0)),
                              ["num_hidden_layers must be an integer, got 1.0"]),
    "config-int-is-a-bool": (_config_edit(lambda c: c.update(num_attention_heads=True)),
                             ["num_attention_heads must be an integer, got True"]),
    "config-float-is-a-string": (_config_edit(lambda c: c.update(rms_norm_eps="1e-5")),
                                 ["rms_norm_eps must be a number"]),
    "config-tie-is-a-string": (_config_edit(lambda c: c.update(tie_word_embeddings="yes")),
                               ["tie_word_embeddings must be true or false"]),
    "config-is-a-list": (_write("config.json", "[1, 2]"), ["config.json", "expected a JSON object"]),
    "config-not-json": (_write("config.json", "{'hidden_size': 32}"), ["config.json", "invalid JSON"]),
    "config-unsupported-architecture": (_config_edit(lambda c: c.update(architectures=["GPT2LMHeadModel"])),
                                        ["unsupported architecture"]),
    "config-heads-0": (_config_edit(lambda c: c.update(num_attention_heads=0)),
                       ["num_attention_heads must be positive"]),
    "config-kv-heads-do-not-divide": (_config_edit(lambda c: c.update(num_key_value_heads=3)),
                                      ["4 attention heads are not a multiple of 3 KV heads"]),
    "config-contradicts-tensors": (_config_edit(lambda c: c.update(intermediate_size=64)),
                                   ["tensor 'blk.0.ffn_gate' has shape 48x32, the config implies 64x32"]),
    "config-layers-10^12": (_config_edit(lambda c: c.update(num_hidden_layers=10**12)), ["1000000000000"]),
    "config-300MB-sparse": (_sparse_config, ["config.json"]),
    "no-config": (_remove("config.json"), ["no config.json"]),
    # files outside the directory, pickles
    "safetensors-symlink-outside": (_link_out("model.safetensors"), ["points outside the model directory"]),
    "config-symlink-outside": (_link_out("config.json"), ["config.json", "points outside the model directory"]),
    "tokenizer-symlink-outside": (_link_out("tokenizer.json"),
                                  ["tokenizer.json", "points outside the model directory"]),
    "no-weights": (_remove("model.safetensors"), ["no *.safetensors files"]),
    "only-pytorch-model-bin": (_only_pickle, ["pytorch_model.bin", "--allow-pickle"]),
}


@pytest.mark.parametrize("name", HF_CASES)
def test_crafted_hf_directory_is_rejected(name: str, hf_dir: Path) -> None:
    make, details = HF_CASES[name]
    make(hf_dir)
    assert_rejected(hf_dir, details)


def test_the_hf_base_model_is_valid(hf_dir: Path) -> None:
    model = load_model(str(hf_dir))
    import_model(model)
    assert model.tokenizer.encode("the cat")


# ------------------------------------------------------------------ pickles


class _RunsCode:
    """Unpickling this runs a shell command (what a hostile checkpoint does)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple:
        return os.system, (f"touch {self.marker}",)


def _hostile_pickle(marker: Path) -> bytes:
    return pickle.dumps({"model.norm.weight": _RunsCode(marker)}, protocol=2)


def _hostile_zip_checkpoint(path: Path, marker: Path) -> None:
    """The layout torch.save writes (a zip with archive/data.pkl), with a code-running pickle."""
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", _hostile_pickle(marker))
        z.writestr("archive/byteorder", "little")
        z.writestr("archive/version", "3\n")


@pytest.mark.parametrize("form", ["raw-pickle", "torch-zip"])
def test_pickle_that_runs_code_is_refused_even_with_allow_pickle(hf_dir: Path, tmp_path: Path, form: str) -> None:
    marker = tmp_path / "pwned"
    (hf_dir / "model.safetensors").unlink()
    checkpoint = hf_dir / "pytorch_model.bin"
    if form == "raw-pickle":
        checkpoint.write_bytes(_hostile_pickle(marker))
    else:
        _hostile_zip_checkpoint(checkpoint, marker)
    # sanity: the pickle does run code when unpickled the unsafe way
    probe = tmp_path / "probe"
    pickle.loads(_hostile_pickle(probe))
    assert probe.exists()

    try:
        import torch  # noqa: F401 — imported before the clock starts: its import takes seconds
        have_torch = True
    except ImportError:
        have_torch = False
    message = assert_rejected(hf_dir, ["pytorch_model.bin"], allow_pickle=True)
    assert not marker.exists(), "unpickling the checkpoint ran its code"
    assert ("weights-only" if have_torch else "needs torch") in message

    message = assert_rejected(hf_dir, ["--allow-pickle"])  # and without the flag it is not even opened
    assert not marker.exists()


def test_torch_saved_state_dict_gives_the_same_logits_as_safetensors(hf_base: Path, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    from llmc.ir.interpreter import forward_logits

    directory = Path(shutil.copytree(hf_base, tmp_path / "pickled"))
    (directory / "model.safetensors").unlink()
    torch.save({k: torch.from_numpy(v.copy()) for k, v in _hf_weights().items()}, directory / "pytorch_model.bin")
    with pytest.raises(ModelFormatError, match="--allow-pickle"):
        load_model(str(directory))
    tokens = np.array([0, 5, 17, 42, 100], dtype=np.int32)
    pickled = load_model(str(directory), allow_pickle=True)
    safe = load_model(str(hf_base))
    got = forward_logits(import_model(pickled), pickled.weights, tokens)
    want = forward_logits(import_model(safe), safe.weights, tokens)
    np.testing.assert_array_equal(got, want)


# ---------------------------------------------------------------------- CLI


@pytest.mark.parametrize("name", [n for n in GGUF_CASES if n not in BOUNDED_WORK])
def test_cli_compile_of_crafted_gguf_prints_one_line(name: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    crafted = GGUF_CASES[name]()
    path = crafted.write(tmp_path / f"{name}.gguf")
    assert_cli_rejects(path, tmp_path / "out", capsys)


@pytest.mark.parametrize("name", [n for n in HF_CASES if n not in HF_BOUNDED_WORK])
def test_cli_compile_of_crafted_hf_directory_prints_one_line(name: str, hf_dir: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    HF_CASES[name][0](hf_dir)
    assert_cli_rejects(hf_dir, tmp_path / "out", capsys)


@pytest.mark.parametrize("name", ["bad-magic", "u8-array-length-2^63", "duplicate-tensor-name", "missing-tensor"])
def test_cli_ir_of_crafted_gguf_prints_one_line(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = GGUF_CASES[name]().write(tmp_path / f"{name}.gguf")
    capsys.readouterr()
    assert main(["ir", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"llmc: error: {path}"), captured.err


def test_cli_debug_shows_the_traceback(tmp_path: Path) -> None:
    path = GGUF_CASES["bad-magic"]().write(tmp_path / "bad.gguf")
    with pytest.raises(ModelFormatError):
        main(["ir", str(path), "--debug"])


# ----------------------------------------------------------- mutation tests

_EXTREMES = [0, 1, 2**7, 2**8 - 1, 2**15, 2**16, 2**31 - 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]
_MUTATION_SETTINGS = settings(
    max_examples=int(os.environ.get("LLMC_MUTATION_EXAMPLES", "150")),  # more for a longer local hunt
    deadline=None,  # the per-example limit is checked by the tests (MAX_SECONDS)
    database=None,
    derandomize=bool(os.environ.get("CI")),  # CI runs the same examples every time
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@st.composite
def mutations(draw: st.DrawFn, size: int, hot: int) -> list[tuple]:
    """1–3 edits of a file of `size` bytes, positions mostly in its first `hot` bytes (the structure)."""
    position = st.one_of(st.integers(0, max(hot - 1, 0)), st.integers(0, size - 1))
    ops = []
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "int64", "int32", "truncate", "insert", "delete"]))
        if kind == "flip":
            ops.append(("flip", draw(position), draw(st.integers(1, 255))))
        elif kind in ("int64", "int32"):
            ops.append((kind, draw(position), draw(st.sampled_from(_EXTREMES))))
        elif kind == "truncate":
            ops.append(("truncate", draw(position)))
        elif kind == "insert":
            ops.append(("insert", draw(position), draw(st.binary(min_size=1, max_size=16))))
        else:
            ops.append(("delete", draw(position), draw(st.integers(1, 64))))
    return ops


def mutate(data: bytes, ops: list[tuple]) -> bytes:
    out = bytearray(data)
    for op in ops:
        at = min(op[1], max(len(out) - 1, 0))
        if op[0] == "flip" and out:
            out[at] ^= op[2]
        elif op[0] in ("int64", "int32"):
            width = 8 if op[0] == "int64" else 4
            out[at:at + width] = (op[2] % 2 ** (8 * width)).to_bytes(width, "little")
        elif op[0] == "truncate":
            del out[at:]
        elif op[0] == "insert":
            out[at:at] = op[2]
        elif op[0] == "delete":
            del out[at:at + op[2]]
    return bytes(out)


def _load_or_model_format_error(path: Path, source: Path) -> None:
    """Success, or a one-line ModelFormatError naming the source, in under a second; anything else fails."""
    start = time.perf_counter()
    try:
        with hang_guard(10):
            load_everything(path)
        event("loaded")
    except ModelFormatError as e:
        assert_one_clean_line(str(e))
        assert str(source) in str(e), str(e)
        event("ModelFormatError: " + re.split(r"[:'(\[]| at byte", e.problem)[0].strip())
    seconds = time.perf_counter() - start
    assert seconds < MAX_SECONDS, f"{seconds:.2f} s"


@pytest.fixture(scope="module")
def mutation_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mutations")


_QUANT_SPEC = TinySpec(layers=1, gguf_storage=(("ffn_gate", "q4_1"), ("ffn_up", "q8_0"), ("attn_v", "f16")))


@functools.cache
def _valid_gguf_bytes(directory: Path) -> bytes:
    return write_gguf(_QUANT_SPEC, random_weights(_QUANT_SPEC), directory / "valid.gguf").read_bytes()


_GGUF_HOT = 5600  # header, metadata and tensor table of the tiny model


@_MUTATION_SETTINGS
@given(data=st.data())
def test_mutated_gguf_loads_or_raises_model_format_error(mutation_dir: Path, data: st.DataObject) -> None:
    valid = _valid_gguf_bytes(mutation_dir)
    ops = data.draw(mutations(len(valid), _GGUF_HOT), label="mutations")
    path = mutation_dir / "mutated.gguf"
    path.write_bytes(mutate(valid, ops))
    _load_or_model_format_error(path, path)


@pytest.fixture(scope="module")
def valid_hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf(SPEC, _hf_weights(), tmp_path_factory.mktemp("hf-mutations") / "model")


@_MUTATION_SETTINGS
@given(data=st.data())
def test_mutated_safetensors_loads_or_raises_model_format_error(valid_hf_dir: Path, mutation_dir: Path,
                                                                data: st.DataObject) -> None:
    directory = mutation_dir / "hf"
    if not directory.exists():
        shutil.copytree(valid_hf_dir, directory)
    valid = (valid_hf_dir / "model.safetensors").read_bytes()
    header_end = 8 + int.from_bytes(valid[:8], "little")
    ops = data.draw(mutations(len(valid), header_end), label="mutations")
    (directory / "model.safetensors").write_bytes(mutate(valid, ops))
    _load_or_model_format_error(directory, directory)


@_MUTATION_SETTINGS
@given(data=st.data())
def test_mutated_config_json_loads_or_raises_model_format_error(valid_hf_dir: Path, mutation_dir: Path,
                                                                data: st.DataObject) -> None:
    directory = mutation_dir / "hf-config"
    if not directory.exists():
        shutil.copytree(valid_hf_dir, directory)
    valid = (valid_hf_dir / "config.json").read_bytes()
    ops = data.draw(mutations(len(valid), len(valid)), label="mutations")
    (directory / "config.json").write_bytes(mutate(valid, ops))
    _load_or_model_format_error(directory, directory)


# ------------------------------------------- structure-aware mutation tests
# Byte flips mostly break the first length they hit; these change one field of a
# well-formed file (a metadata value, a tensor's dims/type/offset, a JSON value), so
# the later checks (types, shapes, hyper-parameters, tokenizer) get exercised too.

_INTS = st.one_of(st.sampled_from(_EXTREMES), st.integers(0, 300), st.integers(-(2**70), 2**70))
_RANGES = {U8: (0, 2**8 - 1), 1: (-(2**7), 2**7 - 1), 2: (0, 2**16 - 1), 3: (-(2**15), 2**15 - 1),
           U32: (0, 2**32 - 1), I32: (-(2**31), 2**31 - 1), U64: (0, 2**64 - 1), 11: (-(2**63), 2**63 - 1)}


def _gguf_int(vtype: int) -> st.SearchStrategy:
    low, high = _RANGES[vtype]
    return _INTS.filter(lambda v: low <= v <= high) | st.integers(low, high)


_GGUF_TEXT = st.text(max_size=12) | st.sampled_from(["llama", "qwen2", "gpt2", "smollm", "", "\n\x1b[2J"])


def _gguf_values(depth: int = 0) -> st.SearchStrategy:
    scalars = st.one_of(
        *(st.tuples(st.just(t), _gguf_int(t)) for t in _RANGES),
        st.tuples(st.just(F32), st.floats(width=32)),
        st.tuples(st.just(F64), st.floats()),
        st.tuples(st.just(BOOL), st.booleans()),
        st.tuples(st.just(STR), _GGUF_TEXT),
    )
    if depth >= 1:
        return scalars
    elements = st.one_of(
        st.tuples(st.just(U32), st.lists(_gguf_int(U32), max_size=8)),
        st.tuples(st.just(I32), st.lists(_gguf_int(I32), min_size=N_TOKENS - 1, max_size=N_TOKENS + 1)),
        st.tuples(st.just(F32), st.lists(st.floats(width=32), max_size=8)),
        st.tuples(st.just(STR), st.lists(_GGUF_TEXT, max_size=8)),
        st.tuples(st.just(STR), st.lists(_GGUF_TEXT, min_size=N_TOKENS, max_size=N_TOKENS)),
        st.tuples(st.just(ARR), st.lists(st.builds(Arr, st.just(U8), st.lists(_gguf_int(U8), max_size=3)),
                                         max_size=3)),
    )
    return scalars | st.builds(lambda e: (ARR, Arr(e[0], e[1])), elements)


_BASE_KEYS = [kv[0] for kv in tiny_gguf(SPEC).kvs if isinstance(kv, tuple)]
_BASE_TENSORS = len(random_weights(SPEC))

_GGUF_EDIT = st.one_of(
    st.tuples(st.just("value"), st.sampled_from(_BASE_KEYS + ["general.alignment", "tokenizer.ggml.padding_token_id"]),
              _gguf_values()),
    st.tuples(st.just("drop"), st.integers(0, len(_BASE_KEYS) - 1)),
    st.tuples(st.just("dims"), st.integers(0, _BASE_TENSORS - 1),
              st.lists(st.sampled_from(_EXTREMES) | st.integers(1, 300), max_size=5)),
    st.tuples(st.just("type"), st.integers(0, _BASE_TENSORS - 1),
              st.sampled_from([0, 1, 2, 3, 8, 12, 14, 30, 13, 99, 2**32 - 1])),
    st.tuples(st.just("offset"), st.integers(0, _BASE_TENSORS - 1),
              st.sampled_from(_EXTREMES) | st.integers(0, 2**17).map(lambda o: o * 32)),
    st.tuples(st.just("drop-tensor"), st.integers(0, _BASE_TENSORS - 1)),
)


def edit_gguf(edits: list[tuple]) -> GGUFBuilder:
    """The base model with each edit applied (indices past the end are taken modulo the length)."""
    b = base()
    for what, *args in edits:
        if what == "value":
            key, (vtype, value) = args
            b.set(key, vtype, value)
        elif what == "drop" and b.kvs:
            del b.kvs[args[0] % len(b.kvs)]
        elif b.tensors:
            t = b.tensors[args[0] % len(b.tensors)]
            if what == "dims":
                t.dims = args[1]
            elif what == "type":
                t.type_id = args[1]
            elif what == "offset":
                t.offset = args[1]
            else:
                b.tensors.remove(t)
    return b


@_MUTATION_SETTINGS
@given(edits=st.lists(_GGUF_EDIT, min_size=1, max_size=2))
def test_gguf_with_edited_fields_loads_or_raises_model_format_error(mutation_dir: Path, edits: list[tuple]) -> None:
    path = mutation_dir / "edited.gguf"
    path.write_bytes(edit_gguf(edits).raw())
    _load_or_model_format_error(path, path)


_JSON = st.recursive(
    st.none() | st.booleans() | _INTS | st.floats() | st.text(max_size=8)
    | st.sampled_from(["F32", "F16", "BF16", "I64", "model.norm.weight"]),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def header_edits(draw: st.DrawFn) -> dict:
    header = copy.deepcopy(safetensors_of(_hf_weights())[0])
    for _ in range(draw(st.integers(1, 2))):
        name = draw(st.sampled_from(sorted(header)))
        what = draw(st.sampled_from(["dtype", "shape", "data_offsets", "entry", "nudge", "rename", "metadata"]))
        if what in ("dtype", "shape", "data_offsets") and isinstance(header[name], dict):
            header[name][what] = draw(_JSON)
        elif what == "entry":
            header[name] = draw(_JSON)
        elif what == "nudge" and isinstance(header[name], dict):  # off by a little: offsets, shapes
            field_name = draw(st.sampled_from(["shape", "data_offsets"]))
            values = header[name].get(field_name)
            if isinstance(values, list) and values:
                i = draw(st.integers(0, len(values) - 1))
                if isinstance(values[i], int):
                    values[i] += draw(st.sampled_from([-4, -1, 1, 4, 32, 2**32, 2**63]))
        elif what == "rename":
            header[draw(st.text(max_size=12) | st.just("model.layers.0.self_attn.q_proj.bias"))] = header.pop(name)
        elif what == "metadata":
            header["__metadata__"] = draw(_JSON)
    return header


@_MUTATION_SETTINGS
@given(header=header_edits())
def test_safetensors_with_edited_header_loads_or_raises_model_format_error(valid_hf_dir: Path, mutation_dir: Path,
                                                                           header: dict) -> None:
    directory = mutation_dir / "hf-header"
    if not directory.exists():
        shutil.copytree(valid_hf_dir, directory)
    data = safetensors_of(_hf_weights())[1]
    (directory / "model.safetensors").write_bytes(safetensors_bytes(json.dumps(header), data))
    _load_or_model_format_error(directory, directory)


_CONFIG_KEYS = [
    "architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "rms_norm_eps", "rope_theta", "max_position_embeddings",
    "tie_word_embeddings", "rope_scaling", "rope_parameters", "attention_bias", "mlp_bias",
]


@_MUTATION_SETTINGS
@given(edits=st.lists(st.tuples(st.sampled_from(_CONFIG_KEYS), _JSON | st.just("<drop>")), min_size=1, max_size=2))
def test_config_json_with_edited_values_loads_or_raises_model_format_error(valid_hf_dir: Path, mutation_dir: Path,
                                                                          edits: list) -> None:
    directory = mutation_dir / "hf-config-values"
    if not directory.exists():
        shutil.copytree(valid_hf_dir, directory)
    config = json.loads((valid_hf_dir / "config.json").read_text())
    for key, value in edits:
        if value == "<drop>":
            config.pop(key, None)
        else:
            config[key] = value
    (directory / "config.json").write_text(json.dumps(config))
    _load_or_model_format_error(directory, directory)
