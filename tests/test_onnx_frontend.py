"""The ONNX frontend on exported causal LMs and on hostile files.

Tiny random Llama and Qwen2 models are exported by `torch.onnx.export` (the dynamo exporter
for the logits-only form; the TorchScript one for the Optimum-style KV form, whose
`attention_mask` length is `past + tokens`, which the dynamo exporter cannot say), imported
with `import_decoder`, and the `llm` interpreter's logits are checked against onnxruntime's.
Crafted bad files must each be refused with one `ModelFormatError` line.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from llmc.errors import ModelFormatError
from llmc.frontend.onnx import import_decoder
from llmc.ir import find_function
from llmc.ir.interpreter import run
from llmc.ir.text import parse_module, print_module

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from graph_models import Logits, WithCache  # noqa: E402

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS = 64, 32, 2, 4, 2
HEAD_DIM = HIDDEN // HEADS


def tiny_lm(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=64, num_hidden_layers=LAYERS,
                  num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=128)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()


PAST = [f"past_key_values.{i}.{kind}" for i in range(LAYERS) for kind in ("key", "value")]


def export_logits(family: str, path: Path) -> Path:
    ids = torch.randint(0, VOCAB, (1, 5))
    program = torch.onnx.export(Logits(tiny_lm(family)), (ids,), dynamo=True, opset_version=18,
                                dynamic_shapes={"input_ids": {1: torch.export.Dim("T", min=1, max=128)}})
    program.save(str(path))
    return path


def export_with_cache(family: str, path: Path) -> Path:
    t, p = 5, 3
    args = (torch.randint(0, VOCAB, (1, t)), torch.ones(1, p + t, dtype=torch.int64), torch.arange(p, p + t)[None],
            *(torch.randn(1, KV_HEADS, p, HEAD_DIM) for _ in PAST))
    outputs = ["logits"] + [name.replace("past_key_values", "present") for name in PAST]
    axes = {"input_ids": {1: "tokens"}, "position_ids": {1: "tokens"}, "attention_mask": {1: "total"},
            **{name: {2: "past"} for name in PAST}, **{name: {2: "total"} for name in outputs[1:]}}
    torch.onnx.export(WithCache(tiny_lm(family)), args, str(path), dynamo=False, opset_version=18,
                      input_names=["input_ids", "attention_mask", "position_ids", *PAST], output_names=outputs,
                      dynamic_axes=axes)
    return path


def llmc_logits(path: Path, tokens: np.ndarray) -> np.ndarray:
    module, weights = import_decoder(path)
    module.verify()
    (logits,) = run(find_function(module, "forward"), weights, tokens.astype(np.int32),
                    np.arange(tokens.size, dtype=np.int32))
    return logits


def assert_same_logits(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.shape == theirs.shape
    assert np.abs(ours - theirs).max() <= 1e-4
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()


@pytest.mark.filterwarnings("ignore")  # the exporters' tracer and deprecation warnings
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_exported_logits_match_onnxruntime(family: str, tmp_path: Path) -> None:
    path = export_logits(family, tmp_path / f"{family}.onnx")
    module, _ = import_decoder(path)
    text = print_module(module)
    assert print_module(parse_module(text)) == text
    session = ort.InferenceSession(str(path))
    for count in (1, 7):
        tokens = np.random.default_rng(count).integers(0, VOCAB, count)
        (expected,) = session.run(None, {"input_ids": tokens[None]})
        assert_same_logits(llmc_logits(path, tokens), expected[0])


@pytest.mark.filterwarnings("ignore")  # the exporters' tracer and deprecation warnings
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_exported_kv_form_matches_onnxruntime_with_empty_past(family: str, tmp_path: Path) -> None:
    path = export_with_cache(family, tmp_path / f"{family}-kv.onnx")
    assert [i.name for i in onnx.load(path).graph.input][3:] == PAST
    session = ort.InferenceSession(str(path))
    for count in (1, 6):
        tokens = np.random.default_rng(count).integers(0, VOCAB, count)
        feeds = {"input_ids": tokens[None], "attention_mask": np.ones((1, count), np.int64),
                 "position_ids": np.arange(count)[None],
                 **{name: np.zeros((1, KV_HEADS, 0, HEAD_DIM), np.float32) for name in PAST}}
        expected = session.run(["logits"], feeds)[0]
        assert_same_logits(llmc_logits(path, tokens), expected[0])


# ------------------------------------------------------------------------ hostile files

EMBED = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
HEAD = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)


def decoder(head: TensorProto, opset: int = 18, op: str = "MatMul") -> onnx.ModelProto:
    """`logits = embed[input_ids] · head`, a decoder in miniature."""
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["h"], name="embed_tokens"),
             helper.make_node(op, ["h", "head"], ["logits"], name="lm_head")]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "T"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "T", 16])],
        [onnx.numpy_helper.from_array(EMBED, "embed"), head])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def external(location: str, offset: int = 0, length: int = HEAD.nbytes) -> TensorProto:
    t = TensorProto(name="head", data_type=TensorProto.FLOAT, dims=HEAD.shape,
                    data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        t.external_data.add(key=key, value=value)
    return t


def save(model: onnx.ModelProto, directory: Path) -> Path:
    directory.mkdir(exist_ok=True)
    path = directory / "model.onnx"
    path.write_bytes(model.SerializeToString())
    return path


def assert_refused(path: Path, *details: str) -> None:
    with pytest.raises(ModelFormatError) as info:
        import_decoder(path)
    message = str(info.value)
    assert "\n" not in message and str(path) in message, message
    for detail in details:
        assert detail in message, message


def test_external_data_inside_the_directory_is_read(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "head.bin").write_bytes(b"\0" * 16 + HEAD.tobytes())
    path = save(decoder(external("head.bin", offset=16)), tmp_path / "m")
    tokens = np.array([3, 1, 4, 1, 5])
    assert_same_logits(llmc_logits(path, tokens), EMBED[tokens] @ HEAD)
    _, weights = import_decoder(path)
    assert weights["head"].shape == (16, 8)  # stored [out, in]


def test_truncated_file(tmp_path: Path) -> None:
    path = save(decoder(onnx.numpy_helper.from_array(HEAD, "head")), tmp_path / "m")
    path.write_bytes(path.read_bytes()[: path.stat().st_size - 100])
    assert_refused(path, "not a valid ONNX ModelProto")


def test_random_bytes(tmp_path: Path) -> None:
    path = tmp_path / "noise.onnx"
    path.write_bytes(np.random.default_rng(7).integers(0, 256, 4096, dtype=np.uint8).tobytes())
    assert_refused(path, "not a valid ONNX ModelProto")


def test_file_beyond_protobuf_limit(tmp_path: Path) -> None:
    path = tmp_path / "huge.onnx"
    with path.open("wb") as f:
        f.truncate(2**31)  # sparse: nothing is written
    assert_refused(path, "2 GiB")


def test_old_opset(tmp_path: Path) -> None:
    assert_refused(save(decoder(onnx.numpy_helper.from_array(HEAD, "head"), opset=11), tmp_path / "m"),
                   "opset 11", "opset 17 and later")


def test_unknown_op(tmp_path: Path) -> None:
    path = save(decoder(onnx.numpy_helper.from_array(HEAD, "head"), op="NonMaxSuppression"), tmp_path / "m")
    assert_refused(path, "node 'lm_head' uses ONNX op 'NonMaxSuppression', which llmc does not import")


def test_unknown_graph_input(tmp_path: Path) -> None:
    model = decoder(onnx.numpy_helper.from_array(HEAD, "head"))
    model.graph.input.append(helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, [1, "T"]))
    assert_refused(save(model, tmp_path / "m"), "graph input 'token_type_ids'")


@pytest.mark.parametrize("location, detail", [
    ("../x.bin", "leaves the model's directory"),
    ("sub/../../x.bin", "leaves the model's directory"),
    ("/etc/passwd", "not a path relative to the model's directory"),
])
def test_external_data_outside_the_directory(location: str, detail: str, tmp_path: Path) -> None:
    (tmp_path / "x.bin").write_bytes(HEAD.tobytes())
    assert_refused(save(decoder(external(location)), tmp_path / "m"), detail)


def test_external_data_symlink_outside_the_directory(tmp_path: Path) -> None:
    (tmp_path / "secret.bin").write_bytes(HEAD.tobytes())
    (tmp_path / "m").mkdir()
    os.symlink(tmp_path / "secret.bin", tmp_path / "m" / "head.bin")
    assert_refused(save(decoder(external("head.bin")), tmp_path / "m"), "resolves outside the model's directory")


@pytest.mark.parametrize("offset, length", [(HEAD.nbytes, HEAD.nbytes), (0, 2 * HEAD.nbytes), (-4, HEAD.nbytes)])
def test_external_data_beyond_the_file(offset: int, length: int, tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "head.bin").write_bytes(HEAD.tobytes())
    assert_refused(save(decoder(external("head.bin", offset, length)), tmp_path / "m"), "tensor 'head'",
                   f"offset {offset}, length {length}")


@pytest.mark.parametrize("dims, detail", [([2**20, 2**20, 2], "more than 2**40"), ([8, 1000], "holds 128")])
def test_declared_size_beyond_the_data(dims: list[int], detail: str, tmp_path: Path) -> None:
    head = TensorProto(name="head", data_type=TensorProto.FLOAT, dims=dims, raw_data=HEAD.tobytes())
    assert_refused(save(decoder(head), tmp_path / "m"), "tensor 'head'", detail)
