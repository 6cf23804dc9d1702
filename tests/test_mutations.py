"""Property-based mutation tests: valid tiny GGUF, safetensors and config.json files with
random byte-level and field-level edits must load or raise `ModelFormatError`, nothing
else, each within the time bound.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest
from crafted import (
    ARR,
    BOOL,
    F32,
    F64,
    I32,
    STR,
    U8,
    U32,
    U64,
    Arr,
    GGUFBuilder,
    safetensors_bytes,
    safetensors_of,
    tiny_gguf,
)
from hostile import MAX_SECONDS, N_TOKENS, SPEC, assert_one_clean_line, base, hang_guard, hf_weights, load_everything
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from tiny_models import TinySpec, random_weights, write_gguf, write_hf

from llmc.errors import ModelFormatError

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
    """Success, or a one-line ModelFormatError naming the source, in under a second of CPU time (a hang
    is caught by the guard's wall clock); anything else fails."""
    start = time.process_time()
    try:
        with hang_guard(10):
            load_everything(path)
        event("loaded")
    except ModelFormatError as e:
        assert_one_clean_line(str(e))
        assert str(source) in str(e), str(e)
        event("ModelFormatError: " + re.split(r"[:'(\[]| at byte", e.problem)[0].strip())
    seconds = time.process_time() - start
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
    return write_hf(SPEC, hf_weights(), tmp_path_factory.mktemp("hf-mutations") / "model")


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
    header = copy.deepcopy(safetensors_of(hf_weights())[0])
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
    data = safetensors_of(hf_weights())[1]
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
