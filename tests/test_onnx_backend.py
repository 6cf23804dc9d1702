"""onnx's own node test cases through `LlmcBackend`: import with `llmc.frontend.onnx`, run the `llm` interpreter.

Every case whose graph uses only ops the importer claims (`CLAIMED`, its op table) is a
parameter of `test_node_case`, compared as onnx's runner does (shape, dtype, then
`rtol`/`atol` of the case: 1e-3 and 1e-7 by default). onnx writes each case in the opset
where its op last changed (Xor's in opset 7), so cases older than opset 17 are first
converted with `onnx.version_converter`, which only rewrites ops that changed since.

Cases llmc cannot run (element types it has no type for, training-mode dropout) are
listed in `UNSUPPORTED` (name patterns, a reason each); they must be refused with one
`ModelFormatError` line, never run.
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import onnx
import pytest
from onnx import numpy_helper, version_converter
from onnx.backend.test.case.node import collect_testcases
from onnx.backend.test.case.test_case import TestCase
from onnx.backend.test.runner import Runner

from llmc.errors import ModelFormatError
from llmc.frontend.onnx import OPS, OPSET
from llmc.frontend.onnx_backend import LlmcBackend

CLAIMED = frozenset(OPS)

UNSUPPORTED = {  # case name pattern → why llmc cannot run it
    r"bfloat16|BFLOAT16|_bf16": "bfloat16 has no llm element type",
    r"FLOAT8|FLOAT4|U?INT4|U?INT2": "8-bit floats and 2- and 4-bit integers have no llm element type",
    r"uint(16|32|64)|UINT(16|32|64)": "unsigned integers wider than 8 bits have no llm element type",
    r"_string": "strings are not tensors of numbers",
    r"_sequence$|_opt$": "sequence and optional values are not tensors",
    r"^test_training_dropout": "training-mode dropout is random; llmc imports inference graphs",
}


def _cases() -> list[TestCase]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the generators' own overflow warnings
        cases = collect_testcases(None)
    return [c for c in cases if c.model is not None and {n.op_type for n in c.model.graph.node} <= CLAIMED]


CASES = _cases()
EXCLUDED = [c for c in CASES if any(re.search(p, c.name) for p in UNSUPPORTED)]
INCLUDED = [c for c in CASES if c not in EXCLUDED]


def _array(value: object) -> np.ndarray:
    return numpy_helper.to_array(value) if isinstance(value, onnx.TensorProto) else np.asarray(value)


def _model(case: TestCase) -> onnx.ModelProto:
    opset = {o.domain: o.version for o in case.model.opset_import}.get("", OPSET)
    return version_converter.convert_version(case.model, OPSET) if opset < OPSET else case.model


def run_case(case: TestCase) -> None:
    rep = LlmcBackend.prepare(_model(case))
    for inputs, expected in case.data_sets:
        with np.errstate(all="ignore"):
            outputs = rep.run([_array(v) for v in inputs])
        Runner.assert_similar_outputs([_array(v) for v in expected], outputs, rtol=case.rtol, atol=case.atol)


@pytest.mark.parametrize("case", INCLUDED, ids=[c.name for c in INCLUDED])
def test_node_case(case: TestCase) -> None:
    run_case(case)


@pytest.mark.parametrize("case", EXCLUDED, ids=[c.name for c in EXCLUDED])
def test_unsupported_case_is_refused(case: TestCase) -> None:
    with pytest.raises(ModelFormatError) as info:
        run_case(case)
    assert "\n" not in str(info.value)


def test_every_claimed_op_has_cases() -> None:
    covered = {n.op_type for c in INCLUDED for n in c.model.graph.node}
    assert CLAIMED - covered == set()


def test_unsupported_patterns_are_used() -> None:
    assert [p for p in UNSUPPORTED if not any(re.search(p, c.name) for c in CASES)] == []


def test_node_cases_pass() -> None:
    """The count of passing cases, printed (`pytest -s`): at least 200 must pass."""
    failed = []
    for case in INCLUDED:
        try:
            run_case(case)
        except Exception as e:  # noqa: BLE001 - each failure is reported by test_node_case
            failed.append(f"{case.name}: {type(e).__name__}")
    print(f"\nonnx node cases: {len(INCLUDED) - len(failed)} passed of {len(INCLUDED)} collected "
          f"({len(EXCLUDED)} unsupported ones refused)")
    assert len(INCLUDED) - len(failed) >= 200, failed
