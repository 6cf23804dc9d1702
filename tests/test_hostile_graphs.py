"""Crafted ONNX and `.pt2` files that cost huge time or memory, escape the model's folder or
crashed the importers: each is refused cleanly (see `hostile.py`: one line naming the file,
within 1 s of CPU and 256 MB traced; `llmc compile` exits 2)."""

from __future__ import annotations

import io
import json
import os
import pickle
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from hostile import MAX_EXTRA_BYTES, assert_cli_rejects, assert_rejected

from llmc.errors import ModelFormatError
from llmc.frontend import load_model

onnx = pytest.importorskip("onnx")
torch = pytest.importorskip("torch")

from onnx import TensorProto, helper  # noqa: E402

from llmc.frontend.onnx_loader import MAX_DEPTH, MAX_FIELDS, MAX_NODES  # noqa: E402
from llmc.frontend.pt2_loader import MAX_EXPONENT, expression_problem, load_pt2  # noqa: E402

# ------------------------------------------------------------------ ONNX

EMBED = np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32)
HEAD = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)


def decoder(*middle: onnx.NodeProto, head: TensorProto | None = None, out: str = "h") -> onnx.ModelProto:
    """`logits = embed[input_ids] · head`, with `middle` nodes between (from `h` to `out`)."""
    nodes = [helper.make_node("Gather", ["embed", "input_ids"], ["h"], name="embed_tokens"), *middle,
             helper.make_node("MatMul", [out, "head"], ["logits"], name="lm_head")]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, "T"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, "T", 16])],
        [onnx.numpy_helper.from_array(EMBED, "embed"), head or onnx.numpy_helper.from_array(HEAD, "head")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _field(number: int, body: bytes) -> bytes:
    """A length-delimited protobuf field."""
    return _varint(number << 3 | 2) + _varint(len(body)) + body


def with_graph_fields(extra: bytes) -> bytes:
    """The tiny decoder with `extra` GraphProto fields merged into its graph (protobuf merges repeats)."""
    return decoder().SerializeToString() + _field(7, extra)


def relu_chain(count: int) -> bytes:
    """`count` Relu nodes, each reading the one before: `h → r1 → … → r{count}`."""
    nodes = (_field(1, f"r{i}".encode() if i else b"h") + _field(2, f"r{i + 1}".encode()) + _field(4, b"Relu")
             for i in range(count))
    return b"".join(_field(1, node) for node in nodes)


def nested_graphs(depth: int) -> bytes:
    """A node whose attribute holds a graph whose node's attribute holds a graph, … `depth` times."""
    body = b""
    for _ in range(depth):
        attribute = _field(1, b"g") + _varint(20 << 3) + _varint(5) + _field(6, body)  # name, type GRAPH, g
        body = _field(1, _field(4, b"Relu") + _field(5, attribute))  # GraphProto.node
    return _field(1, _field(4, b"Relu") + _field(2, b"z") + _field(5, _field(1, b"g") + _field(6, body)))


def external(location: str, offset: int = 0, length: int = HEAD.nbytes) -> TensorProto:
    t = TensorProto(name="head", data_type=TensorProto.FLOAT, dims=HEAD.shape, data_location=TensorProto.EXTERNAL)
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        t.external_data.add(key=key, value=value)
    return t


def _fifo(d: Path) -> None:
    os.mkfifo(d / "head.bin")  # opening it for reading would wait for a writer forever


def _dev_zero_link(d: Path) -> None:
    os.symlink("/dev/zero", d / "head.bin")


def _folder(d: Path) -> None:
    (d / "head.bin").mkdir()


ONNX_CORPUS: dict[str, tuple[Callable[[Path], bytes], list[str]]] = {
    "nested-subgraphs": (lambda d: with_graph_fields(nested_graphs(MAX_DEPTH + 2)), ["nested more than"]),
    "name-not-utf8": (lambda d: with_graph_fields(_field(13, _field(1, b"\xff\xfe"))), ["not a valid ONNX"]),
    "field-past-end": (lambda d: decoder().SerializeToString() + _field(7, b"\x0a\x7f"), ["not a valid ONNX"]),
    "split-into-1e9": (lambda d: decoder(helper.make_node("Split", ["h"], ["x"], axis=-1, num_outputs=10**9),
                                         out="x").SerializeToString(), ["num_outputs 1000000000"]),
    "past-of-2**40-heads": (lambda d: _with_input(helper.make_tensor_value_info(
        "past_key_values.0.key", TensorProto.FLOAT, [1, 2**40, "P", 2**40])), ["impossible dimensions"]),
    "external-data-folder": (lambda d: _external(d, _folder), ["not a regular file"]),
    "external-data-fifo": (lambda d: _external(d, _fifo), ["not a regular file"]),
    "external-data-link-to-dev-zero": (lambda d: _external(d, _dev_zero_link), ["resolves outside"]),
    "external-data-dev-zero": (lambda d: decoder(head=external("/dev/zero")).SerializeToString(),
                               ["not a path relative"]),
    "external-data-nul": (lambda d: decoder(head=external("head.bin\0x")).SerializeToString(),
                          ["not a path relative"]),
    "external-data-offset-digits": (lambda d: _external(d, lambda d: (d / "head.bin").write_bytes(HEAD.tobytes()),
                                                        offset="9" * 5000), ["malformed external data offset"]),
}


def _with_input(value: onnx.ValueInfoProto) -> bytes:
    model = decoder()
    model.graph.input.append(value)
    return model.SerializeToString()


def _external(d: Path, make: Callable[[Path], None], offset: int | str = 0) -> bytes:
    make(d)
    model = decoder(head=external("head.bin"))
    for entry in model.graph.initializer[1].external_data:
        if entry.key == "offset":
            entry.value = str(offset)
    return model.SerializeToString()


def write_onnx(name: str, tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    path = folder / "model.onnx"
    path.write_bytes(ONNX_CORPUS[name][0](folder))
    return path


@pytest.mark.parametrize("name", sorted(ONNX_CORPUS))
def test_crafted_onnx_is_refused(name: str, tmp_path: Path) -> None:
    assert_rejected(write_onnx(name, tmp_path), ONNX_CORPUS[name][1])


BIG_ONNX: dict[str, tuple[Callable[[], bytes], str]] = {
    # 20 MB of empty nodes: 1.75 GB of protobuf objects before the importer could count them
    "empty-nodes-20MB": (lambda: with_graph_fields(b"\x0a\x00" * (10 * 2**20)), f"more than {MAX_NODES} nodes"),
    # a chain of 10^5 nodes: over a minute of import and passes
    "chain-of-100k-nodes": (lambda: with_graph_fields(relu_chain(100_000)), f"more than {MAX_NODES} nodes"),
    "empty-inputs-of-one-node": (lambda: with_graph_fields(_field(1, _field(4, b"Relu") + b"\x0a\x00" * (
        MAX_FIELDS + 1))), f"more than {MAX_FIELDS} fields"),
}


BIG_FILE_SECONDS = 3.0  # of CPU for a file of up to 20 MB, scanned in Python (0.4 s alone, 1.3 s on a loaded host)


def _status_kib(field: str) -> int:
    return int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith(field)).split()[1])


def test_big_onnx_files_are_refused_in_time_and_memory(tmp_path: Path) -> None:
    """protobuf's memory is not Python's (tracemalloc cannot see it): the process's peak resident
    size (Linux's VmHWM, reset first) grows less than the 256 MB budget over each file."""
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident size
    except OSError:
        pytest.skip("needs Linux's /proc/self/clear_refs")
    for name, (make, detail) in BIG_ONNX.items():
        path = tmp_path / f"{name}.onnx"
        path.write_bytes(make())
        Path("/proc/self/clear_refs").write_text("5")
        before, start = _status_kib("VmRSS"), time.process_time()
        with pytest.raises(ModelFormatError) as info:
            load_model(str(path))
        seconds, grown = time.process_time() - start, (_status_kib("VmHWM") - before) * 1024
        assert detail in str(info.value) and str(path) in str(info.value), info.value
        assert seconds < BIG_FILE_SECONDS, f"{name}: refused after {seconds:.2f} s"
        assert grown < MAX_EXTRA_BYTES, f"{name}: peak resident size grew {grown / 2**20:.0f} MiB"


@pytest.mark.parametrize("name", ["external-data-folder", "split-into-1e9"])
def test_cli_compile_of_crafted_onnx_prints_one_line(name: str, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    assert_cli_rejects(write_onnx(name, tmp_path), tmp_path / "out", capsys)


def test_cli_compile_of_20MB_of_empty_nodes_prints_one_line(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "empty-nodes.onnx"
    path.write_bytes(BIG_ONNX["empty-nodes-20MB"][0]())
    assert_cli_rejects(path, tmp_path / "out", capsys)


def test_the_onnx_base_model_imports(tmp_path: Path) -> None:
    from llmc.frontend.onnx import import_decoder

    path = tmp_path / "model.onnx"
    path.write_bytes(with_graph_fields(b""))
    module, weights = import_decoder(path)
    assert weights["head"].shape == (16, 8)


def test_weights_named_alike_are_numbered_in_linear_time(tmp_path: Path) -> None:
    """1000 weights whose names all become `w_` in the IR: `w_`, `w__1`, `w__2`, …, not names
    growing one `_` at a time (quadratic)."""
    from llmc.frontend.onnx import import_graph

    names = [f"w{chr(0x100 + i)}" for i in range(1000)]
    graph = helper.make_graph(
        [helper.make_node("Concat", names, ["y"], axis=0)], "alike", [],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2 * len(names)])],
        [onnx.numpy_helper.from_array(np.full(2, i, np.float32), name) for i, name in enumerate(names)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    _, weights = import_graph(model, tmp_path / "alike.onnx")
    assert len(weights) == 1000 and "w_" in weights and "w__999" in weights
    assert max(len(name) for name in weights) == len("w__999")


# ------------------------------------------------------------------ .pt2


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    from test_torch_frontend import PlainDecoder, example_ids

    from llmc.frontend.torch_export import export_decoder

    path = tmp_path_factory.mktemp("pt2") / "plain.pt2"
    torch.export.save(export_decoder(PlainDecoder().eval(), (example_ids(4),), max_tokens=64), path)
    return path.read_bytes()


def _rewrite(data: bytes, edit: Callable[[str, bytes], bytes | None], extra: dict[str, bytes] | None = None) -> bytes:
    """The archive with each member's body replaced by `edit(name under the root, body)` (None: kept)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        root = src.namelist()[0].split("/", 1)[0]
        for info in src.infolist():
            body = src.read(info)
            dst.writestr(info, edit(info.filename.split("/", 1)[1], body) or body)
        for name, body in (extra or {}).items():
            dst.writestr(f"{root}/{name}", body)
    return out.getvalue()


def _program(edit: Callable[[dict], object]) -> Callable[[bytes], bytes]:
    def make(data: bytes) -> bytes:
        def change(name: str, body: bytes) -> bytes | None:
            if name != "models/model.json":
                return None
            tree = json.loads(body)
            edit(tree)
            return json.dumps(tree).encode()

        return _rewrite(data, change)

    return make


def _member(member: str, body: bytes) -> Callable[[bytes], bytes]:
    return lambda data: _rewrite(data, lambda name, old: body if name == member else None)


def _size_expr(text: str) -> Callable[[dict], None]:
    def edit(tree: dict) -> None:
        (value,) = tree["graph_module"]["graph"]["sym_int_values"].values()
        value["as_expr"]["expr_str"] = text

    return edit


def _deflated_bomb(data: bytes) -> bytes:
    """`archive_format` inflating to 128 MiB of zeros (from ~130 kB)."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            if info.filename.endswith("/archive_format"):
                bomb = zipfile.ZipInfo(info.filename)
                bomb.compress_type = zipfile.ZIP_DEFLATED
                with dst.open(bomb, "w") as f:
                    zeros = bytes(2**20)
                    for _ in range(128):
                        f.write(zeros)
            else:
                dst.writestr(info, src.read(info))
    return out.getvalue()


def _lying_size(data: bytes) -> bytes:
    """`models/model.json` deflated, the central directory declaring 16 bytes fewer than it inflates to."""
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(data)) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            body = src.read(info)
            if info.filename.endswith("models/model.json"):
                info.compress_type = zipfile.ZIP_DEFLATED
            dst.writestr(info, body)
        victim = next(i for i in dst.infolist() if i.filename.endswith("models/model.json"))
        victim.file_size -= 16  # written into the central directory on close
    return out.getvalue()


def _empty_weight_of_huge_size(data: bytes) -> bytes:
    def change(name: str, body: bytes) -> bytes | None:
        if name == "data/weights/weight_0":
            return b""
        if name == "data/weights/model_weights_config.json":
            tree = json.loads(body)
            for payload in tree["config"].values():
                if payload["path_name"] == "weight_0":
                    payload["tensor_meta"]["sizes"] = [{"as_int": 2**20}, {"as_int": 2**20}]
            return json.dumps(tree).encode()
        return None

    return _rewrite(data, change)


class _RunsCode:
    def __reduce__(self) -> tuple:
        return (os.system, ("touch ran-code",))


PT2_CORPUS: dict[str, tuple[Callable[[bytes], bytes], list[str]]] = {
    # sympy would evaluate 2**(2**(2**100)) for ever
    "power-tower-of-integers": (_program(_size_expr("Pow(Integer(2), Pow(Integer(2), Pow(Integer(2), Integer(100))))")),
                                ["symbolic shape expression", "raises to a power"]),
    "power-tower-of-symbols": (_program(_size_expr("Pow(Symbol('s70', integer=True), Pow(Symbol('s70', integer=True), "
                                                   "Symbol('s70', integer=True)))")), ["raises to a power"]),
    "power-of-power": (_program(_size_expr(f"Pow(Pow(Symbol('s70'), Integer({MAX_EXPONENT})), Integer(2))")),
                       ["nests Pow in the base of a power"]),
    "shift-by-2**100": (_program(_size_expr("LShift(Integer(1), Integer(1267650600228229401496703205376))")),
                        ["raises to a power (shifts)"]),
    "python-operator": (_program(_size_expr("Symbol('s70') ** 99999999")), ["holds Python binop syntax"]),
    "huge-integer": (_program(_size_expr("Integer(" + "9" * 4000 + ")")), ["beyond int64"]),
    "many-terms": (_program(_size_expr("Max(" + ", ".join(["Integer(1)"] * 300) + ")")),
                   ["more than 256 terms"]),
    "deep-nesting": (_program(_size_expr("Add(" * 150 + "Integer(1)" + ")" * 150)), ["nest"]),
    "range-of-2**5000": (_program(lambda t: t["range_constraints"].update(s70={"min_val": 1, "max_val": 2**5000})),
                         ["the range of symbol 's70'"]),
    "hint-of-2**200": (_program(lambda t: next(iter(t["graph_module"]["graph"]["sym_int_values"].values()))[
        "as_expr"].update(hint={"as_int": 2**200})), ["hint"]),
    "json-nested-100k-deep": (_member("models/model.json", b"[" * 100_000 + b"]" * 100_000), ["not readable JSON"]),
    "json-of-33MB": (_member("models/model.json", b"[" + b"{}," * (11 * 2**20) + b"{}]"), ["more than the 33554432"]),
    "deflated-bomb-128MiB": (_deflated_bomb, ["inflate to", "a zip bomb"]),
    "member-longer-than-declared": (_lying_size, ["model.json"]),
    "empty-weight-declaring-2**40-elements": (_empty_weight_of_huge_size, ["declares [1048576, 1048576]"]),
}


def write_pt2(name: str, saved: bytes, tmp_path: Path) -> Path:
    path = tmp_path / f"{name}.pt2"
    path.write_bytes(PT2_CORPUS[name][0](saved))
    return path


@pytest.mark.parametrize("name", sorted(PT2_CORPUS))
def test_crafted_pt2_is_refused(name: str, saved: bytes, tmp_path: Path) -> None:
    path = write_pt2(name, saved, tmp_path)
    assert_rejected(path, PT2_CORPUS[name][1])
    if name.startswith(("power", "shift", "huge", "many", "deflated")):  # bounds hold whatever the user trusts
        assert_rejected(path, PT2_CORPUS[name][1], allow_pickle=True)


@pytest.mark.parametrize("name", ["power-tower-of-integers", "deflated-bomb-128MiB"])
def test_cli_compile_of_crafted_pt2_prints_one_line(name: str, saved: bytes, tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    assert_cli_rejects(write_pt2(name, saved, tmp_path), tmp_path / "out", capsys)


@pytest.mark.parametrize("allow_pickle", [False, True])
def test_sample_inputs_are_never_unpickled(saved: bytes, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                           allow_pickle: bool) -> None:
    """A pickle that runs code in place of the sample inputs: the program loads, the code never runs."""
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "sample-inputs.pt2"
    path.write_bytes(_member("data/sample_inputs/model.pt", pickle.dumps(_RunsCode()))(saved))
    program = load_pt2(path, allow_pickle)
    assert any(node.op == "placeholder" for node in program.graph.nodes)
    assert not (tmp_path / "ran-code").exists()


@pytest.mark.parametrize("text", [
    "Symbol('s70', positive=True, integer=True)",
    "Mul(Integer(16), Symbol('s70', positive=True, integer=True))",
    "Add(Mul(Integer(-1), Symbol('s0')), FloorDiv(Symbol('s1'), Integer(2)), Max(Integer(1), Symbol('s2')))",
    "Pow(Symbol('s0', integer=True), Integer(2))",
    "Eq(Mod(Symbol('s0'), Integer(8)), Integer(0))",
])
def test_expressions_torch_writes_pass_the_checker(text: str) -> None:
    assert expression_problem(text, names=True) is None
