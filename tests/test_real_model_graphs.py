"""The real model through the graph frontends: SmolLM2 (transformers, from the GGUF) exported with
`torch.onnx.export(dynamo=True)` and `torch.export`, compiled like the GGUF file.

Both are raised to the GGUF path's ops: compiled with that path's storage (`--quant q4_1
--quant-output q8_0`, the file's own types, which requantizing the dequantized weights
reproduces) they generate the GGUF artifact's greedy tokens (up to 32), and `llmc verify` holds
every stage of the ONNX form to onnxruntime.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from llmc.cli import main
from llmc.driver import BackendOptions, compile_model
from llmc.passes.pipeline import CompileOptions
from llmc.runtime.codec import TextCodec
from llmc.runtime.generate import generate
from llmc.runtime.sampling import SamplingOptions
from llmc.runtime.session import Session

pytestmark = [pytest.mark.real_model, pytest.mark.filterwarnings("ignore")]
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def graphs(smollm2_path, tmp_path_factory) -> dict[str, Path]:
    """SmolLM2 exported once, saved as `.onnx` (without onnxscript's optimizer, for time: the tiny
    models' tests cover the optimized form) and `.pt2`."""
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    from real_models import write_smollm2_graphs

    paths = write_smollm2_graphs(tmp_path_factory.mktemp("smollm2-graphs"), "onnx", "pt2", onnx_optimize=False)
    return {path.suffix[1:]: path for path in paths}


@pytest.fixture(params=["onnx", "pt2"])
def graph(request, graphs) -> Path:
    return graphs[request.param]


@pytest.fixture(scope="module")
def gguf_tokens(smollm2_path, tmp_path_factory) -> tuple[list[int], Path]:
    """The GGUF artifact's greedy tokens (up to 32), and the artifact."""
    out = compile_model(str(smollm2_path), tmp_path_factory.mktemp("smollm2-gguf") / "a", CompileOptions(max_seq=256),
                        BackendOptions(), progress=lambda _: None)
    assert isinstance(out, Path)
    return _greedy(out), out


def _greedy(artifact: Path) -> list[int]:
    session = Session(artifact)
    codec = TextCodec.from_artifact(session.manifest)
    tokens = list(generate(session, codec, codec.encode(PROMPT), 32, SamplingOptions()))
    session.close()
    return tokens


def test_graph_artifact_generates_the_gguf_artifacts_tokens(graph, gguf_tokens, tmp_path) -> None:
    expected, gguf = gguf_tokens
    progress: list[str] = []
    ours = compile_model(str(graph), tmp_path / "graph", CompileOptions(max_seq=256, quant="q4_1", quant_output="q8_0"),
                         BackendOptions(), progress=progress.append)
    assert isinstance(ours, Path)
    optimize = next(line for line in progress if line.startswith("optimize"))
    assert "raised 30 attention, 60 rope, 61 rms_norm, 210 matmul" in optimize and "left" not in optimize
    assert len(expected) >= 16  # (32, or fewer where the text ends: the default build's ends after 29)
    assert _greedy(ours) == expected
    if graph.suffix == ".onnx":  # the same weights, packed the same way
        assert (ours / "weights.bin").read_bytes() == (gguf / "weights.bin").read_bytes()


def test_verify_holds_every_stage_to_the_graph_runtime(graphs, capsys) -> None:
    """On the ONNX export (onnxruntime as the reference); `llmc verify` of `.pt2` files against torch
    eager is checked on the tiny models (tests/test_graph_compile.py)."""
    assert main(["verify", str(graphs["onnx"]), "--compute", "a32", "--kv-type", "f32"]) == 0
    out = capsys.readouterr().out
    assert "(onnxruntime " in out
    assert "raised 30 attention, 60 rope, 61 rms_norm, 210 matmul" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.split()}
    for stage in ("llm", "quantize", "tgt", "artifact"):
        assert float(rows[stage][1]) >= 0.9999 and "(100%)" in rows[stage][5], rows[stage]
