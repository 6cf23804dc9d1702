"""Which instruction-set paths the tests execute on each kind of x86 host (`tests/host.py`), asked
as the runtime asks: shown for an AVX2-only host and an AMX host, whichever this one is."""

from __future__ import annotations

import host
import pytest

from llmc.ir.tgt import Isa
from llmc.runtime import amx
from llmc.runtime import artifact as runtime_artifact

AVX2_HOST = {"avx", "avx2", "fma", "f16c", "bmi2"}  # /proc/cpuinfo flags of an AMD EPYC (Zen 2/3)
AMX_HOST = AVX2_HOST | {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx_vnni", "avx512_bf16",
                        "avx512_fp16", "amx_tile", "amx_int8", "amx_bf16"}  # a Sapphire/Emerald Rapids Xeon


@pytest.fixture
def pretend(monkeypatch):
    """`pretend(flags, tiles)`: the host's CPU flags and the kernel's answer to the AMX request, as if."""
    def set_host(flags: set[str], tiles: bool) -> None:
        monkeypatch.setattr(runtime_artifact, "host_cpu_flags", lambda: flags)
        monkeypatch.setattr(amx, "request", lambda: (tiles, "" if tiles else "refused"))
        host.missing.cache_clear()

    yield set_host
    host.missing.cache_clear()


@pytest.mark.parametrize("flags,tiles,executed", [
    (AVX2_HOST, False, {Isa.AVX2, Isa.GENERIC}),
    (AMX_HOST, True, set(host.ISA_CPUS)),
    (AMX_HOST, False, set(host.ISA_CPUS) - {Isa.AMX}),  # a Linux that refuses the tile data
], ids=["avx2-host", "amx-host", "amx-host-tiles-refused"])
def test_each_kind_of_host_executes_the_paths_it_has(pretend, flags, tiles, executed) -> None:
    pretend(flags, tiles)
    assert {isa for isa, cpu in host.ISA_CPUS.items() if host.runs(cpu)} == executed
    for isa, cpu in host.ISA_CPUS.items():
        if isa not in executed:
            assert host.why_not(cpu).startswith("this host lacks ") and "\n" not in host.why_not(cpu)


def test_the_runtime_refuses_what_the_tests_would_skip(pretend) -> None:
    """The tests ask the runtime's own question: an artifact for a CPU the host lacks is refused by it."""
    pretend(AVX2_HOST, False)
    assert runtime_artifact.missing_cpu_features(["avx2", "fma"]) == []
    assert runtime_artifact.missing_cpu_features(["avx2", "avx512vnni", "amx-int8"]) == ["avx512vnni", "amx-int8"]
