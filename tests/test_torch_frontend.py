"""The torch.export frontend: tiny random Llama and Qwen2 models exported, imported as `llm`
primitive ops and run by the interpreter against torch eager; `.pt2` files saved and
loaded (hostile ones refused in one line); the torch-program and ONNX references."""

from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llmc.errors import ModelFormatError  # noqa: E402
from llmc.frontend.reference import onnx_logits, torch_program_logits  # noqa: E402
from llmc.frontend.torch_export import export_decoder, import_program, load_pt2  # noqa: E402
from llmc.ir import find_function, llm  # noqa: E402
from llmc.ir.interpreter import run  # noqa: E402
from llmc.ir.text import parse_module, print_module  # noqa: E402

VOCAB = 64
SHAPES = {  # (config class, overrides)
    "llama-gqa": ("LlamaConfig", {}),
    "llama-mha-tied": ("LlamaConfig", {"num_key_value_heads": 4, "tie_word_embeddings": True}),
    "qwen2-gqa": ("Qwen2Config", {}),
    "smollm2-like": ("LlamaConfig", {"hidden_size": 48, "num_attention_heads": 6, "tie_word_embeddings": True}),
}


def tiny_model(kind: str, seed: int = 0) -> torch.nn.Module:
    config_name, overrides = SHAPES[kind]
    config = getattr(transformers, config_name)(**{
        "vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # biases are zero at init: draw them too
        for p in model.parameters():
            p.normal_(0, 0.5)
    return model


def example_ids(count: int) -> torch.Tensor:
    return torch.arange(count).reshape(1, count) * 7 % VOCAB


def interpreted(module, weights, tokens: np.ndarray) -> np.ndarray:
    forward = find_function(module, "forward")
    (logits,) = run(forward, weights, tokens.astype(np.int32), np.arange(tokens.size, dtype=np.int32))
    return logits


def eager(model: torch.nn.Module, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        out = model(input_ids=torch.tensor(tokens[None], dtype=torch.long))
    return (out.logits if hasattr(out, "logits") else out)[0].numpy()


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.fixture(scope="module", params=sorted(SHAPES))
def exported(request):
    model = tiny_model(request.param)
    return model, export_decoder(model, (example_ids(5),))


def test_imported_logits_match_eager_for_two_lengths(exported):
    model, ep = exported
    module, weights = import_program(ep, Path("tiny.pt2"))
    module.verify()
    parse_module(print_module(module)).verify()
    for count in (3, 11):
        tokens = np.random.default_rng(count).integers(0, VOCAB, count)
        assert_close(interpreted(module, weights, tokens), eager(model, tokens))


def test_parameters_keep_their_names_and_linears_their_shape(exported):
    model, ep = exported
    module, weights = import_program(ep, Path("tiny.pt2"))
    assert "model.layers.0.self_attn.q_proj.weight" in weights
    assert "model.rotary_emb.original_inv_freq" not in weights  # unused buffers are not imported
    ops = list(find_function(module, "forward").body.block.ops)
    weight = next(op for op in ops if isinstance(op, llm.WeightOp) and op.sym_name == "lm_head.weight")
    (transpose,) = [use.operation for use in weight.result.uses if isinstance(use.operation, llm.TransposeOp)]
    assert transpose.axis_list == (1, 0)  # a tied table also feeds the embedding's llm.gather
    (matmul,) = [use.operation for use in transpose.result.uses]
    assert isinstance(matmul, llm.BatchMatmulOp) and matmul.rhs is transpose.result


def test_pt2_round_trip_and_torch_reference(exported, tmp_path):
    model, ep = exported
    path = tmp_path / "tiny.pt2"
    torch.export.save(ep, path)
    module, weights = import_program(load_pt2(path, allow_pickle=False), path)
    tokens = np.array([5, 1, 60, 33, 7, 2, 9])
    want = eager(model, tokens)
    assert_close(interpreted(module, weights, tokens), want)
    assert_close(torch_program_logits(path, tokens.tolist(), allow_pickle=False), want)


class PlainDecoder(torch.nn.Module):
    """`forward(input_ids)` → logits, with causal grouped-query attention left to sdpa's flags."""

    def __init__(self, op: str = "sdpa"):
        super().__init__()
        torch.manual_seed(1)
        self.op = op
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.q, self.kv = torch.nn.Linear(16, 16), torch.nn.Linear(16, 8, bias=False)
        self.out = torch.nn.Linear(16, VOCAB, bias=False)
        self.positions = torch.nn.Embedding(64, 16)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        x = self.embed(input_ids)
        if position_ids is not None:
            x = x + self.positions(position_ids)
        if self.op == "cumprod":
            x = x.cumprod(-1)
        t = x.shape[1]
        q = self.q(x).view(1, t, 4, 4).transpose(1, 2)
        kv = self.kv(x).view(1, t, 2, 4).transpose(1, 2)
        y = torch.nn.functional.scaled_dot_product_attention(q, kv, kv, is_causal=True, enable_gqa=True)
        return self.out(torch.nn.functional.gelu(y.transpose(1, 2).reshape(1, t, 16)))


def test_plain_module_with_causal_gqa_attention():
    model = PlainDecoder().eval()
    module, weights = import_program(export_decoder(model, (example_ids(4),), max_tokens=64), Path("plain.pt2"))
    module.verify()
    for count in (2, 9):
        tokens = np.random.default_rng(count).integers(0, VOCAB, count)
        assert_close(interpreted(module, weights, tokens), eager(model, tokens))


def test_sdpa_with_gqa_is_raised_to_attention_over_the_kv_heads():
    """sdpa's `enable_gqa` repeats the 2 KV heads by a gather of heads; the cache holds the 2."""
    from llmc.passes.pipeline import run_phase

    model = PlainDecoder().eval()
    module, weights = import_program(export_decoder(model, (example_ids(4),), max_tokens=64), Path("plain.pt2"))
    run_phase(module, "optimize", weights=weights)
    (attention,) = [op for op in module.walk() if isinstance(op, llm.AttentionOp)]
    assert attention.kv_cache.type.shape[1] == 2


def test_plain_module_with_position_ids():
    model = PlainDecoder().eval()
    ep = export_decoder(model, (example_ids(4), torch.arange(4)[None]), max_tokens=64)
    module, weights = import_program(ep, Path("plain.pt2"))
    tokens = np.array([1, 2, 3, 50, 8])
    with torch.no_grad():
        want = model(torch.tensor(tokens[None]), torch.arange(tokens.size)[None])[0].numpy()
    assert_close(interpreted(module, weights, tokens), want)


def test_unknown_op_is_one_line():
    ep = export_decoder(PlainDecoder("cumprod").eval(), (example_ids(4),), max_tokens=64)
    with pytest.raises(ModelFormatError, match=r"node 'cumprod' calls aten\.cumprod, which llmc does not import$"):
        import_program(ep, Path("plain.pt2"))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> bytes:
    path = tmp_path_factory.mktemp("pt2") / "tiny.pt2"
    torch.export.save(export_decoder(PlainDecoder().eval(), (example_ids(4),), max_tokens=64), path)
    return path.read_bytes()


def rewritten(data: bytes, member: str, edit) -> bytes:
    """The archive with the JSON `member` (under its root folder) changed by `edit`."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            body = src.read(info)
            if info.filename.split("/", 1)[1] == member:
                tree = json.loads(body)
                edit(tree)
                body = json.dumps(tree).encode()
            dst.writestr(info, body)
    return out.getvalue()


def _zip_of(members: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for name, body in members.items():
            z.writestr(name, body)
    return out.getvalue()


def with_member(data: bytes, member: str, body: bytes) -> bytes:
    """The archive with one more member under its root folder."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            dst.writestr(info, src.read(info))
        dst.writestr(f"{src.namelist()[0].split('/', 1)[0]}/{member}", body)
    return out.getvalue()


def pickled_weight(tree: dict) -> None:
    next(iter(tree["config"].values()))["use_pickle"] = True


def evaluated_shape(tree: dict) -> None:
    text = json.dumps(tree).replace("Symbol('s", "__import__('os').getpid() + Symbol('s", 1)
    tree.update(json.loads(text))


def guard_code(tree: dict) -> None:
    tree["guards_code"] = ["__import__('os').system('true') == 0"]


@pytest.mark.parametrize("make, message", [
    (lambda data: data[: len(data) // 2], r"is not a \.pt2 archive \(not a zip file, or truncated\)$"),
    (lambda data: np.random.default_rng(0).bytes(4096), r"is not a \.pt2 archive"),
    (lambda data: _zip_of({"a/b": b"x"}), r"is not a torch\.export archive \(no archive_format\)$"),
    (lambda data: rewritten(data, "data/weights/model_weights_config.json", pickled_weight),
     r"has weight '.*' is pickled, which can run code when loaded; llmc loads it only with --allow-pickle$"),
    (lambda data: rewritten(data, "models/model.json", evaluated_shape),
     r"symbolic shape expression '.*' holds Python binop syntax, not a sympy term$"),
    (lambda data: rewritten(data, "models/model.json", guard_code),
     r"guard code .* can run code when loaded; llmc loads it only with --allow-pickle$"),
    # an AOTInductor package: torch dlopens its shared library (its constructor runs) at load
    (lambda data: with_member(data, "data/aotinductor/x/x.wrapper.so", b"\x7fELF"),
     r"archive member '.*data/aotinductor/x/x\.wrapper\.so' that torch may load as code .* --allow-pickle$"),
], ids=["truncated", "random", "not-pt2", "pickled-weight", "evaluated-shape", "guard-code", "aotinductor"])
def test_bad_pt2_files_are_one_line_errors(saved, tmp_path, make, message):
    path = tmp_path / "bad.pt2"
    path.write_bytes(make(saved))
    with pytest.raises(ModelFormatError, match=message) as e:
        load_pt2(path, allow_pickle=False)
    assert "\n" not in str(e.value)


def test_onnx_reference_matches_eager(tmp_path):
    onnx = pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    model = tiny_model("llama-gqa")

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, input_ids):
            return self.model(input_ids=input_ids, use_cache=False).logits

    path = tmp_path / "tiny.onnx"
    program = torch.onnx.export(Logits().eval(), (example_ids(5),), dynamo=True, opset_version=18,
                                dynamic_shapes={"input_ids": {1: torch.export.Dim("T", min=1, max=128)}})
    program.save(str(path))
    onnx.checker.check_model(str(path))
    tokens = np.array([3, 14, 15, 9, 26, 5])
    assert_close(onnx_logits(path, tokens.tolist()), eager(model, tokens))
