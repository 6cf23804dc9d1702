"""Crafted bad GGUF files: each differs from a valid tiny model in one thing and must be
rejected cleanly (see `hostile.py` for what "cleanly" means).
"""

from __future__ import annotations

import functools
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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
    gguf_builder_of,
    gkv,
    gstr,
    tiny_gguf,
    u32,
    u64,
)
from hostile import N_TOKENS, SPEC, assert_cli_rejects, assert_rejected, base, hf_weights, load_everything
from tiny_models import TinySpec, random_weights, write_gguf, write_hf

from llmc.cli import main
from llmc.errors import ModelFormatError
from llmc.frontend import import_model, load_model

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
    "block-count-0": _with(_A + "block_count", U32, 0, "llama.block_count must be a positive integer, got 0"),
    "block-count-2^32-1": _with(_A + "block_count", U32, 2**32 - 1, "4294967295"),
    "block-count-2^63-i64": _with(_A + "block_count", U64, 2**63, "9223372036854775808"),
    "head-count-kv-is-a-bool": _with(_A + "attention.head_count_kv", BOOL, True, "'llama.attention.head_count_kv'"),
    "block-count-is-a-bool": _with(_A + "block_count", BOOL, True, "got True"),
    "block-count-is-a-string": _with(_A + "block_count", STR, "1", "'llama.block_count' should be an integer, got '"),
    "block-count-is-an-array": _with(_A + "block_count", ARR, Arr(U32, [1]), "'llama.block_count' should be an integer, got an array"),
    "context-length-0": _with(_A + "context_length", U32, 0, "context_length must be a positive integer"),
    "rms-epsilon-nan": _with(_A + "attention.layer_norm_rms_epsilon", F32, float("nan"), "RMSNorm epsilon"),
    "rope-theta-negative": _with(_A + "rope.freq_base", F32, -1.0, "rope theta must be a positive number"),
    "rope-dimension-odd": _with(_A + "rope.dimension_count", U32, 7, "7 rotary dimensions must be even"),
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


# --- other families' files: declared sizes beyond the tensors present, numbers out of range

_GGUF_SPECS = {
    "gemma2": TinySpec(arch="gemma2", hidden=48, heads=3, kv_heads=1, head_dim=16, layers=2, sliding_window=4,
                       layer_types=("sliding_attention", "full_attention"), attn_softcap=5.0, final_softcap=8.0),
    "gemma3": TinySpec(arch="gemma3", heads=4, kv_heads=1, head_dim=16, layers=2, sliding_window=5,
                       layer_types=("sliding_attention", "full_attention")),
    "phi3": TinySpec(arch="phi3", heads=4, kv_heads=4, layers=1),
    "mistral": TinySpec(arch="mistral", layers=1, sliding_window=4),
    "linear-rope": TinySpec(layers=1, rope_scaling=(("rope_type", "linear"), ("factor", 4.0))),
    "qwen3moe": TinySpec(arch="qwen3moe", experts=4, experts_used=2, ffn=16, head_dim=16, layers=1, tied=False),
}


@functools.cache
def _family(name: str) -> GGUFBuilder:
    """The valid tiny GGUF model of `_GGUF_SPECS[name]`, as a builder."""
    spec = _GGUF_SPECS[name]
    with tempfile.TemporaryDirectory() as directory:
        return gguf_builder_of(write_gguf(spec, random_weights(spec), Path(directory) / "model.gguf"))


def _family_with(family: str, key: str, vtype: int, value: object, *details: str) -> Callable[[], Crafted]:
    """The family's file with `{architecture}.{key}` set to `value`."""
    def make() -> Crafted:
        b = _family(family).copy()
        return Crafted(b.set(f"{b.value('general.architecture')}.{key}", vtype, value).raw(), list(details))

    return make


# the comment says what each did before its size was checked against the tensors present
_cases({
    "gemma2-block-count-10^9": _family_with("gemma2", "block_count", U32, 10**9,
                                            "gemma2.block_count 1000000000 exceeds the 24 tensors present"),  # hung
    "gemma3-block-count-2^63": _family_with("gemma3", "block_count", U64, 2**63, "gemma3.block_count 9223372036854775808 "
                                                                                 "exceeds"),  # hung
    "phi3-block-count-2^32-1": _family_with("phi3", "block_count", U32, 2**32 - 1, "phi3.block_count 4294967295 exceeds"),
    "mistral-block-count-10^9": _family_with("mistral", "block_count", U32, 10**9,
                                             "llama.block_count 1000000000 exceeds"),  # MemoryError
    "rope-dimension-count-10^9": _family_with("linear-rope", "rope.dimension_count", U32, 10**9,
                                              "llama.rope.dimension_count 1000000000 exceeds"),  # hung
    "rope-dimension-count-2^63": _family_with("linear-rope", "rope.dimension_count", U64, 2**63,
                                              "llama.rope.dimension_count 9223372036854775808 exceeds"),  # MemoryError
    "qwen3moe-expert-count-2^63": _family_with("qwen3moe", "expert_count", U64, 2**63,
                                               "qwen3moe.expert_count 9223372036854775808 exceeds"),
    "qwen3moe-expert-width-0": _family_with("qwen3moe", "expert_feed_forward_length", U32, 0,
                                            "qwen3moe.expert_feed_forward_length must be a positive integer, got 0"),
    "gemma2-key-length-0": _family_with("gemma2", "attention.key_length", U32, 0,
                                        "gemma2.attention.key_length must be a positive integer, got 0"),  # ZeroDivision
    "gemma2-embedding-length-0": _family_with("gemma2", "embedding_length", U32, 0,
                                              "gemma2.embedding_length must be a positive integer, got 0"),  # ZeroDivision
    "gemma3-embedding-length-negative": _family_with("gemma3", "embedding_length", I32, -1,
                                                     "gemma3.embedding_length must be a positive integer, got -1"),
    "rope-freq-base-inf": _family_with("mistral", "rope.freq_base", F64, float("inf"),
                                       "rope theta must be a positive number below"),  # VerifyException
    "rope-freq-base-1e300": _family_with("mistral", "rope.freq_base", F64, 1e300,
                                         "rope theta must be a positive number below"),
    "rope-scaling-factor-inf": _family_with("linear-rope", "rope.scaling.factor", F64, float("inf"),
                                            "RoPE frequency factors must be 4 positive numbers"),  # VerifyException
    "context-length-2^63": _family_with("mistral", "context_length", U64, 2**63,
                                        "context length 9223372036854775808 exceeds 2147483647"),  # accepted
    "sliding-window-2^63": _family_with("mistral", "attention.sliding_window", U64, 2**63,
                                        "sliding window must be an integer in 1..2147483647"),
    "gemma2-softcap-inf": _family_with("gemma2", "attn_logit_softcapping", F64, float("inf"), "attn_softcap"),
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
    "tokenizer-model-unsupported": _with(_T + "model", STR, "rwkv", "unsupported tokenizer model 'rwkv'"),
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
    # 8 MB of zeros: more strings than any vocabulary, refused before decoding them
    "string-array-beyond-2**20-entries": _sparse(_header(0, 1) + gstr("a") + u32(ARR) + u32(STR) + u64(2**20 + 1),
                                                 8 * 2**20 + 108, "strings exceeds"),
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
    load_everything(write_hf(SPEC, hf_weights(), directory / "hf"))


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


@pytest.mark.filterwarnings("error")  # a numpy warning is a stray stderr line
@pytest.mark.parametrize("name", GGUF_CASES)
def test_crafted_gguf_is_rejected(name: str, tmp_path: Path) -> None:
    crafted = GGUF_CASES[name]()
    path = crafted.write(tmp_path / f"{name}.gguf")
    assert_rejected(path, crafted.details)



# ---------------------------------------------------------------------- CLI


@pytest.mark.parametrize("name", [n for n in GGUF_CASES if n not in BOUNDED_WORK])
def test_cli_compile_of_crafted_gguf_prints_one_line(name: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    crafted = GGUF_CASES[name]()
    path = crafted.write(tmp_path / f"{name}.gguf")
    assert_cli_rejects(path, tmp_path / "out", capsys)



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
