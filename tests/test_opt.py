"""`llmc opt`'s pass lists: phases recorded as phase passes run, pass options, one-line errors.
(What each pass does to IR is in tests/lit, one folder per pass.)"""

from __future__ import annotations

import pytest
from xdsl.dialects.builtin import ModuleOp, StringAttr

from llmc.errors import UsageError
from llmc.passes.base import module_phase
from llmc.passes.pipeline import PHASE_ENDED_BY, record_phase
from llmc.passes.registry import parse_passes


def test_each_phase_is_ended_by_its_last_pass_but_verify() -> None:
    assert PHASE_ENDED_BY == {"dce": "optimize", "quantize": "quantize", "split": "split", "group": "group",
                              "plan-memory": "lower"}


def test_a_recorded_phase_never_goes_back() -> None:
    module = ModuleOp([])
    module.attributes["llm.phase"] = StringAttr("group")
    record_phase(module, "optimize")  # `-p dce` on grouped IR
    assert module_phase(module) == "group"
    record_phase(module, "lower")
    assert module_phase(module) == "lower"


def test_pass_options_in_xdsl_syntax() -> None:
    quantize, split, group = parse_passes("quantize{compute=a16 quant=q8_0}, split{prefill_chunk=4 max_seq=16},group")
    assert (quantize.compute, quantize.quant) == ("a16", "q8_0")
    assert (split.prefill_chunk, split.max_seq) == (4, 16)
    assert group.name == "group"
    assert parse_passes("") == []


@pytest.mark.parametrize(("text", "message"), [
    ("nope", "unknown pass 'nope' (passes: verify, "),
    ("split{max_seq=x}", "pass 'split{max_seq=\"x\"}': Incompatible types"),
    ("quantize{bits=4}", "pass 'quantize{bits=4}': Provided arguments [\"bits\"] not found"),
    ("split,,group", "pass list 'split,,group': Expected pass name here (column 7)"),
])
def test_bad_pass_lists_are_usage_errors(text: str, message: str) -> None:
    with pytest.raises(UsageError) as error:
        parse_passes(text)
    assert str(error.value).startswith(message)
    assert "\n" not in str(error.value)
