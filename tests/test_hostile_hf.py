"""Crafted bad safetensors files and Hugging Face directories, and pickles: each must be
rejected cleanly (see `hostile.py`); a pickle never runs code, even with --allow-pickle.
"""

from __future__ import annotations

import copy
import json
import math
import os
import pickle
import shutil
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from crafted import (
    safetensors_bytes,
    safetensors_of,
)
from hostile import SPEC, assert_cli_rejects, assert_rejected, cli_compile, hf_weights
from tiny_models import TinySpec, random_weights, write_hf

from llmc.errors import ModelFormatError
from llmc.frontend import import_model, load_model

# ------------------------------------------------------ the safetensors / HF corpus


@pytest.fixture(scope="module")
def hf_base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_hf(SPEC, hf_weights(), tmp_path_factory.mktemp("hf") / "base")


@pytest.fixture
def hf_dir(hf_base: Path, tmp_path: Path) -> Path:
    """A fresh copy of the valid tiny HF directory to break."""
    return Path(shutil.copytree(hf_base, tmp_path / "model"))


def _st(d: Path, header: dict | bytes | str, data: bytes | None = None, header_len: int | None = None) -> Path:
    if data is None:
        data = safetensors_of(hf_weights())[1]
    path = d / "model.safetensors"
    path.write_bytes(safetensors_bytes(header, data, header_len))
    return d


def _header_edit(edit: Callable[[dict], object]) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        header, data = safetensors_of(hf_weights())
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
_N_DATA = len(safetensors_of(hf_weights())[1])


def _rename(old: str, new: str) -> Callable[[dict], object]:
    return lambda h: h.__setitem__(new, h.pop(old))


def _overlap(h: dict) -> None:
    h[_L0 + "self_attn.v_proj.weight"]["data_offsets"] = list(h[_L0 + "self_attn.k_proj.weight"]["data_offsets"])


def _two_files(d: Path) -> Path:
    header, data = safetensors_of({_NW: hf_weights()[_NW]})
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


def _sparse(name: str) -> Callable[[Path], Path]:
    def make(d: Path) -> Path:
        with open(d / name, "r+b") as f:
            f.truncate(300_000_000)  # a hole: no disk, but 300 MB if read whole
        return d

    return make


def _huge_json_header(d: Path) -> Path:
    n = 20_000_000  # 40 MB of "0,": valid JSON, 20 M list elements
    return _st(d, b'{"a":[' + b"0," * (n - 1) + b"0]}")


HF_BOUNDED_WORK = {"header-huge-json", "config-300MB-sparse", "tokenizer-300MB-sparse"}  # big files: not repeated through the CLI
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
    "header-duplicate-keys": (lambda d: _st(d, json.dumps(safetensors_of(hf_weights())[0])[:-1]
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
    "data-truncated": (lambda d: _st(d, safetensors_of(hf_weights())[0], safetensors_of(hf_weights())[1][:-4]),
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
    "config-300MB-sparse": (_sparse("config.json"), ["config.json"]),
    "tokenizer-300MB-sparse": (_sparse("tokenizer.json"), ["tokenizer.json", "too large for a tokenizer.json"]),
    "no-config": (_remove("config.json"), ["no config.json"]),
    # files outside the directory, pickles
    "safetensors-symlink-outside": (_link_out("model.safetensors"), ["points outside the model directory"]),
    "config-symlink-outside": (_link_out("config.json"), ["config.json", "points outside the model directory"]),
    "tokenizer-symlink-outside": (_link_out("tokenizer.json"),
                                  ["tokenizer.json", "points outside the model directory"]),
    "no-weights": (_remove("model.safetensors"), ["no *.safetensors files"]),
    "only-pytorch-model-bin": (_only_pickle, ["pytorch_model.bin", "--allow-pickle"]),
    # the shards' index
    "index-not-a-map": (_write("model.safetensors.index.json", '{"weight_map": ["model.safetensors"]}'),
                        ["model.safetensors.index.json", "'weight_map' must map tensor names to file names"]),
    "index-names-a-file-outside": (_write("model.safetensors.index.json",
                                          '{"weight_map": {"model.norm.weight": "../model.safetensors"}}'),
                                   ["'weight_map' names '../model.safetensors', not a .safetensors file of this"]),
    "index-names-a-missing-shard": (_write("model.safetensors.index.json",
                                           '{"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}'),
                                    ["names model-00002-of-00002.safetensors, which is not in the directory"]),
}


def test_the_corpus_is_big_enough() -> None:
    assert len(HF_CASES) >= 12


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
    torch.save({k: torch.from_numpy(v.copy()) for k, v in hf_weights().items()}, directory / "pytorch_model.bin")
    with pytest.raises(ModelFormatError, match="--allow-pickle"):
        load_model(str(directory))
    tokens = np.array([0, 5, 17, 42, 100], dtype=np.int32)
    pickled = load_model(str(directory), allow_pickle=True)
    safe = load_model(str(hf_base))
    got = forward_logits(import_model(pickled), pickled.weights, tokens)
    want = forward_logits(import_model(safe), safe.weights, tokens)
    np.testing.assert_array_equal(got, want)



def test_shards_are_the_files_their_index_names(hf_base: Path, tmp_path: Path) -> None:
    """Shards with `model.safetensors.index.json` beside a `consolidated.safetensors` of other tensor names
    (Mistral's repositories): the shards the index names are read, the rest ignored, as transformers does (was:
    every *.safetensors, and the consolidated file's names refused)."""
    from llmc.ir.interpreter import forward_logits

    directory = Path(shutil.copytree(hf_base, tmp_path / "sharded"))
    raw = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").unlink()
    size = int.from_bytes(raw[:8], "little")
    header, data = json.loads(raw[8 : 8 + size]), raw[8 + size :]
    names = [n for n in header if n != "__metadata__"]
    shards = {"model-00001-of-00002.safetensors": names[: len(names) // 2],
              "model-00002-of-00002.safetensors": names[len(names) // 2 :]}
    for shard, part in shards.items():  # (each tensor's own bytes, as written)
        own, blob = {}, b""
        for n in part:
            start, end = header[n]["data_offsets"]
            own[n] = {**header[n], "data_offsets": [len(blob), len(blob) + end - start]}
            blob += data[start:end]
        (directory / shard).write_bytes(safetensors_bytes(own, blob))
    (directory / "consolidated.safetensors").write_bytes(
        safetensors_bytes(*safetensors_of({f"layers.{i}.attention.wq.weight": np.zeros((2, 2)) for i in range(3)})))
    (directory / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": {n: shard for shard, part in shards.items() for n in part}}))
    tokens = np.array([0, 5, 17, 42, 100], dtype=np.int32)
    sharded, whole = load_model(str(directory)), load_model(str(hf_base))
    np.testing.assert_allclose(forward_logits(import_model(sharded), sharded.weights, tokens),  # (the same weights,
                               forward_logits(import_model(whole), whole.weights, tokens),  # summed by BLAS in
                               rtol=1e-5, atol=1e-5)  # another order where their bytes lie at other alignments)


@pytest.mark.parametrize("name", [n for n in HF_CASES if n not in HF_BOUNDED_WORK])
def test_cli_compile_of_crafted_hf_directory_prints_one_line(name: str, hf_dir: Path, tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    HF_CASES[name][0](hf_dir)
    assert_cli_rejects(hf_dir, tmp_path / "out", capsys)


def test_cli_compile_refuses_a_bos_token_outside_the_model(hf_dir: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    """A tokenizer may hold more tokens than the embedding has rows; the one put before every prompt must be
    a row of it (the runtime refuses such an artifact: compile must not write it)."""
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(hf_dir / "tokenizer.json"))
    tokenizer.add_special_tokens([AddedToken("<bos>", special=True, normalized=False)])
    (hf_dir / "tokenizer.json").write_text(tokenizer.to_str())
    settings = json.loads((hf_dir / "tokenizer_config.json").read_text())
    (hf_dir / "tokenizer_config.json").write_text(json.dumps(settings | {"bos_token": "<bos>", "add_bos_token": True}))
    code, err = cli_compile(hf_dir, tmp_path / "out", capsys)
    errors = [line for line in err.splitlines() if line.startswith("llmc: error:")]  # (after the phases' lines)
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert f"token {tokenizer.token_to_id('<bos>')} before every prompt, outside the model's vocabulary of" in err
    assert not (tmp_path / "out").exists()


# ------------------------------------------- config values: sizes the tensors cannot hold, numbers out of range

_YARN = (("rope_type", "yarn"), ("factor", 4.0), ("original_max_position_embeddings", 16))
_LONGROPE = (("rope_type", "longrope"), ("short_factor", (1.0, 1.5, 2.0, 4.0)), ("long_factor", (2.0, 3.0, 4.0, 8.0)),
             ("original_max_position_embeddings", 16))
FAMILY_SPECS = {
    "llama": SPEC,
    "yarn": TinySpec(layers=1, rope_scaling=_YARN),
    "longrope": TinySpec(arch="phi3", layers=1, heads=4, kv_heads=4, rope_scaling=_LONGROPE),
    "gemma2": TinySpec(arch="gemma2", layers=1, head_dim=16, layer_types=("sliding_attention",), sliding_window=4),
    "mistral": TinySpec(arch="mistral", layers=1, sliding_window=4),
    "qwen2": TinySpec(arch="qwen2", layers=1),
    "mixtral": TinySpec(arch="mixtral", layers=1, experts=4, experts_used=2, ffn=16),
    "qwen3moe": TinySpec(arch="qwen3moe", layers=1, experts=4, experts_used=2, ffn=16),
}


def _cfg(**values: object) -> Callable[[dict], object]:
    """Set top-level config values (None: remove the key)."""
    def edit(config: dict) -> None:
        for key, value in values.items():
            config.pop(key, None) if value is None else config.__setitem__(key, value)

    return edit


def _scaling(**values: object) -> Callable[[dict], object]:
    return lambda config: config["rope_scaling"].update(values)


_BIG = 10**400  # json writes and parses it; float() of it overflows
_WINDOWED_QWEN2 = {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}
# name → (family, config edit (the file's text where it returns one), details); the comment says what each did before it was checked
CONFIG_CASES: dict[str, tuple[str, Callable[[dict], object], list[str]]] = {
    # declared sizes beyond the tensors present (hung, or passed 6 GB, before anything was read)
    "gemma2-layers-10^9-by-pattern": ("gemma2", _cfg(layer_types=None, num_hidden_layers=10**9),
                                      ["num_hidden_layers 1000000000 exceeds the 13 tensors present"]),
    "mistral-window-layers-10^9": ("mistral", _cfg(num_hidden_layers=10**9), ["num_hidden_layers 1000000000 exceeds"]),
    "qwen2-window-layers-10^9": ("qwen2", _cfg(**_WINDOWED_QWEN2, num_hidden_layers=10**9),
                                 ["num_hidden_layers 1000000000 exceeds"]),
    "mixtral-experts-10^9": ("mixtral", _cfg(num_local_experts=10**9), ["num_local_experts 1000000000 exceeds"]),
    "qwen3moe-experts-10^9": ("qwen3moe", _cfg(num_experts=10**9), ["num_experts 1000000000 exceeds"]),
    "head-dim-10^9-linear-rope": ("llama", _cfg(head_dim=10**9, rope_scaling={"rope_type": "linear", "factor": 2.0}),
                                  ["head_dim 1000000000 exceeds"]),  # MemoryError
    "head-dim-10^30": ("yarn", _cfg(head_dim=10**30), ["head_dim 1000000000000000000000000000000 exceeds"]),
    "hidden-size-10^400": ("gemma2", _cfg(hidden_size=_BIG), ["hidden_size 1000000"]),  # OverflowError
    "hidden-size-negative": ("gemma2", _cfg(hidden_size=-1), ["hidden_size must be a positive integer, got -1"]),
    "intermediate-size-10^12": ("llama", _cfg(intermediate_size=10**12), ["intermediate_size 1000000000000 exceeds"]),
    "head-dim-0": ("llama", _cfg(head_dim=0), ["head_dim must be a positive integer, got 0"]),
    "max-position-embeddings-10^400": ("yarn", _cfg(max_position_embeddings=_BIG),
                                       ["max_position_embeddings must be at most 2147483647"]),  # OverflowError
    "sliding-window-10^30": ("mistral", _cfg(sliding_window=10**30), ["sliding window must be an integer in 1.."]),
    "max-window-layers-negative": ("qwen2", _cfg(**_WINDOWED_QWEN2 | {"max_window_layers": -5}),
                                   ["max_window_layers must be at least 0, got -5"]),  # accepted: layers -5..-1
    # numbers out of range or of the wrong kind
    "rms-norm-eps-10^400": ("llama", _cfg(rms_norm_eps=_BIG), ["rms_norm_eps must be a number"]),  # OverflowError
    "rope-theta-10^400": ("llama", _cfg(rope_theta=_BIG), ["rope_theta must be a number"]),  # OverflowError
    "rope-theta-1e300": ("llama", _cfg(rope_theta=1e300), ["rope_theta must be a positive number below"]),  # accepted
    "rope-theta-0-llama3": ("llama", _cfg(rope_theta=0, rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                                       "original_max_position_embeddings": 16}),
                            ["rope_theta must be a positive number"]),  # numpy warnings
    "rope-theta-nan-yarn": ("yarn", _cfg(rope_theta=float("nan")), ["rope_theta must be a number, got nan"]),
    "rope-theta-1-yarn": ("yarn", _cfg(rope_theta=1), ["yarn: needs a RoPE base above 1"]),  # ZeroDivisionError
    "rope-type-a-list": ("llama", _cfg(rope_scaling={"rope_type": [], "factor": 2.0}), ["rope_type must be a name"]),
    "yarn-original-0": ("yarn", _scaling(original_max_position_embeddings=0),
                        ["original_max_position_embeddings must be a number in (0,"]),  # ZeroDivisionError
    "yarn-original-negative": ("yarn", _scaling(original_max_position_embeddings=-4096),
                               ["original_max_position_embeddings must be a number in (0,"]),
    "yarn-factor-0": ("yarn", _scaling(factor=0), ["factor must be a number in (0,"]),
    "yarn-factor-1e300": ("yarn", _scaling(factor=1e300), ["factor must be a number in (0,"]),  # overflow warnings
    "yarn-factor-missing-original-missing": ("yarn", lambda c: c.__setitem__("rope_scaling", {"rope_type": "yarn"}),
                                             ["original_max_position_embeddings must be a number"]),
    "yarn-beta-fast-string": ("yarn", _scaling(beta_fast="x"), ["beta_fast must be a number"]),  # TypeError
    "yarn-beta-slow-negative": ("yarn", _scaling(beta_slow=-1), ["beta_slow must be a number"]),  # math domain error
    "yarn-attention-factor-negative": ("yarn", _scaling(attention_factor=-1.0), ["attention_factor must be a number"]),
    "longrope-original-0": ("longrope", _cfg(original_max_position_embeddings=0),
                            ["original_max_position_embeddings must be a number in (0,"]),  # ZeroDivisionError
    "longrope-original-1": ("longrope", _cfg(original_max_position_embeddings=1),
                            ["original_max_position_embeddings must be at least 2"]),  # ZeroDivisionError
    "longrope-original-0.5": ("longrope", _cfg(original_max_position_embeddings=0.5),
                              ["original_max_position_embeddings must be at least 2"]),  # ValueError
    "longrope-short-factor-wrong-length": ("longrope", _scaling(short_factor=[1.0, 2.0]),
                                           ["short_factor must be 4 positive numbers"]),
    "longrope-short-factor-10^400": ("longrope", _scaling(short_factor=[1.0, 2.0, 3.0, _BIG]),
                                     ["short_factor must be 4 positive numbers"]),  # OverflowError
    "query-pre-attn-scalar-0": ("gemma2", _cfg(query_pre_attn_scalar=0),
                                ["query_pre_attn_scalar must be a positive number, got 0"]),  # ZeroDivisionError
    "query-pre-attn-scalar-negative": ("gemma2", _cfg(query_pre_attn_scalar=-1),
                                       ["query_pre_attn_scalar must be a positive number"]),  # TypeError (complex)
    "softcapping-10^400": ("gemma2", _cfg(attn_logit_softcapping=_BIG), ["attn_logit_softcapping must be a number"]),
    "partial-rotary-factor-0.1": ("llama", _cfg(partial_rotary_factor=0.1),
                                  ["partial_rotary_factor must be in (0, 1] and leave at least 2"]),  # accepted: all rotate
    "rms-norm-eps-negative": ("llama", _cfg(rms_norm_eps=-1e-5), ["RMSNorm epsilon must be in (0, 1)"]),
    "config-nested-100k-deep": ("llama", lambda c: json.dumps(c)[:-1] + ', "x": ' + "[" * 10**5 + "]" * 10**5 + "}",
                                ["config.json", "invalid JSON"]),
}


@pytest.fixture(scope="module")
def family_bases(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: write_hf(spec, random_weights(spec), root / name) for name, spec in FAMILY_SPECS.items()}


def _crafted_config(name: str, family_bases: dict[str, Path], tmp_path: Path) -> Path:
    family, edit, _ = CONFIG_CASES[name]
    directory = Path(shutil.copytree(family_bases[family], tmp_path / "model"))
    config = json.loads((directory / "config.json").read_text())
    text = edit(config)
    (directory / "config.json").write_text(text if isinstance(text, str) else json.dumps(config))
    return directory


def test_the_family_bases_are_valid(family_bases: dict[str, Path]) -> None:
    for directory in family_bases.values():
        import_model(load_model(str(directory)))


@pytest.mark.filterwarnings("error")  # a numpy warning is a stray stderr line
@pytest.mark.parametrize("name", CONFIG_CASES)
def test_crafted_config_is_rejected(name: str, family_bases: dict[str, Path], tmp_path: Path) -> None:
    assert_rejected(_crafted_config(name, family_bases, tmp_path), CONFIG_CASES[name][2])


@pytest.mark.parametrize("name", CONFIG_CASES)
def test_cli_compile_of_crafted_config_prints_one_line(name: str, family_bases: dict[str, Path], tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    assert_cli_rejects(_crafted_config(name, family_bases, tmp_path), tmp_path / "out", capsys)


@pytest.mark.filterwarnings("error")
def test_llama3_rope_whose_unused_smoothing_divides_by_zero_warns_nothing(family_bases: dict[str, Path],
                                                                          tmp_path: Path) -> None:
    """Pair 0 (wavelength 2π) lies beyond the smoothed band; the smoothing formula there divides by
    (1 - s) / factor + s = 0 (s = -1): computed for every pair, it printed a numpy warning."""
    scaling = {"rope_type": "llama3", "factor": 2.0, "low_freq_factor": 3.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 4 * math.pi}
    directory = Path(shutil.copytree(family_bases["llama"], tmp_path / "model"))
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config | {"rope_scaling": scaling}))
    model = load_model(str(directory))
    assert model.config.rope_factors[0] == 2.0
