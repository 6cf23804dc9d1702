"""What this host executes, asked as the runtime asks (`llmc.runtime.artifact.missing_cpu_features`
and `llmc.runtime.amx.request`), for the tests whose path depends on the CPU.

A path the host runs is executed and compared numerically; a path it cannot run (AMX or
AVX-512 on an AVX2 host) is still compiled for the named CPU of `ISA_CPUS` and its IR,
layout and instructions are checked, so every path is tested on every host:

    if not host.runs("sapphirerapids"):
        pytest.skip(host.why_not("sapphirerapids"))   # one line: what the host lacks
"""

from __future__ import annotations

from functools import cache

import pytest

from llmc.backends.cpu.target import cpu_target, integer_isa
from llmc.ir.tgt import Isa
from llmc.runtime import amx
from llmc.runtime.artifact import missing_cpu_features

# a named CPU whose best integer dot product is each of the kernels' paths
ISA_CPUS = {Isa.AMX: "sapphirerapids", Isa.VNNI512: "icelake-server", Isa.VNNI256: "alderlake",
            Isa.AVX2: "x86-64-v3", Isa.GENERIC: "x86-64"}


@cache
def missing(cpu: str) -> tuple[str, ...]:
    """The features of `cpu`'s code (`--cpu cpu`) this host lacks; for AMX code, the tile permission too."""
    features = cpu_target(cpu).features
    lacks = sorted(missing_cpu_features(features))
    if not lacks and "amx-int8" in features and not amx.request()[0]:
        lacks.append("the AMX tile permission")
    return tuple(lacks)


def runs(cpu: str) -> bool:
    """Whether code compiled with `--cpu cpu` runs here, on the path it was compiled for."""
    return not missing(cpu)


def why_not(cpu: str) -> str:
    """The one-line skip reason of a test that would run `cpu`'s code here."""
    return f"this host lacks {', '.join(missing(cpu))}: {cpu} code is compiled and checked, not run"


def skip_unless_another_path(cpu: str) -> None:
    """Skip a test of `cpu`'s code (beside the same test of `native` code) where the host cannot run
    it, or where it takes the host's own integer path: that one is tested as `native` already."""
    if not runs(cpu):
        pytest.skip(why_not(cpu))
    isa = integer_isa(cpu_target(cpu))
    if isa is integer_isa(cpu_target("native")):
        pytest.skip(f"the host's own integer path is {cpu}'s ({isa}): run once, as native")
