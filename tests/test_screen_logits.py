"""`screen-logits`: decode's LM head (int16 rows of its own, tiles layout) takes its products with int8 rows
first and again with the int16 rows only for the strips of 16 columns near a row's largest result
(`tgt.matmul … screen M`): those results are the unscreened kernel's exactly, the rest within the int8
rows' rounding, and a row's results do not depend on the threads or the other rows."""

from __future__ import annotations

import host
import numpy as np
import pytest
from kernel_harness import IDX, Kernel, Machine, assembly, attention_op, kernel_op, lm_head_op, rand
from test_cpu_kernels import ref_rms_norm
from test_fuse_norm import PROMPT, SPEC, STORAGE
from tiny_models import TinySpec
from xdsl.dialects.builtin import FloatAttr, f32
from xdsl.utils.exceptions import VerifyException

from llmc.backends.cpu.toolchain import target_machine
from llmc.cli import main
from llmc.driver import BackendOptions, run_phases, target_attr
from llmc.frontend import load_model
from llmc.ir import find_function, tgt
from llmc.ir.formats import FORMATS, Storage, integer_matmul, quantize_rows
from llmc.ir.layouts import Layout, pack
from llmc.ir.tgt_interpreter import screen_maxima, screened
from llmc.passes.pipeline import CompileOptions
from llmc.passes.screen_logits import MARGIN
from llmc.runtime.session import Session

VNNI512 = host.ISA_CPUS[tgt.Isa.VNNI512]
# one small layer: the LM head (269 × 64) is half the decode's weights, as Gemma 3 270M's is 63% (SPEC's: 15%)
WIDE = TinySpec(hidden=64, layers=1, heads=2, kv_heads=1, head_dim=32, ffn=32, context_length=64, gguf_storage=STORAGE)
R, K = 8, 256  # (q6_k: whole 256-blocks)
N = 2 * tgt.SCREEN_COLUMNS + 40  # two whole blocks, and 40 columns left over (the last strip 8 wide)


def _types(storage: Storage = Storage.Q8_0) -> list:
    return [tgt.memref(R, K), tgt.WeightType((N, K), storage, Layout.TILES), tgt.memref(R, N), IDX,
            tgt.WeightType((K,), Storage.F32)]


@pytest.mark.parametrize("storage", [Storage.Q8_0, Storage.Q4_1, Storage.Q6_K], ids=str)
def test_screened_results_are_exact_near_the_top_and_int8_elsewhere(tmp_path, storage):
    if not host.runs(VNNI512):
        pytest.skip(host.why_not(VNNI512))
    rng = np.random.default_rng(23)
    w = rand(rng, N, K)
    w[rng.integers(0, N, 12)] *= 3  # a few columns well above the rest: each row's largest results
    qt = FORMATS[storage].quantize(w)
    data = pack(qt, Layout.TILES)
    x, g = rand(rng, R, K, scale=2.0), rand(rng, K)
    margin = 1.0
    machine = Machine(VNNI512, target_machine(VNNI512))
    screen = Kernel(tmp_path, machine, lm_head_op(R, K, margin), _types(storage))
    exact_kernel = Kernel(tmp_path, machine, lm_head_op(R, K), _types(storage))
    xn = ref_rms_norm(x, g, 1e-6).astype(np.float32)
    coarse = integer_matmul(*quantize_rows(xn, 8), qt)
    exact = integer_matmul(*quantize_rows(xn, 16), qt)
    out, unscreened = np.zeros((R, N), np.float32), np.zeros((R, N), np.float32)
    exact_kernel({"x": x, "weight": data, "out": unscreened, "rows": R, "norm": g}, nth=2)
    screen({"x": x, "weight": data, "out": out, "rows": R, "norm": g}, nth=2)
    np.testing.assert_allclose(unscreened, exact, rtol=2e-6, atol=2e-6 * np.abs(exact).max())

    top, best = screen_maxima(coarse)
    tol = 1e-3 * np.abs(coarse).max()  # (a strip this close to the threshold may go either way)
    surely_near = np.repeat(top >= best - margin + tol, 16, axis=1)[:, :N]
    surely_far = np.repeat(top < best - margin - tol, 16, axis=1)[:, :N]
    assert surely_near.mean() < 0.5 and surely_far.any()  # the screen chose: some strips of each kind
    assert (coarse[surely_far] != exact[surely_far]).mean() > 0.9  # (int8 and int16 rows differ there)
    np.testing.assert_array_equal(out[surely_near], unscreened[surely_near])  # the unscreened kernel's bits
    np.testing.assert_allclose(out[surely_far], coarse[surely_far], rtol=0, atol=1e-5 * np.abs(coarse).max())
    for r in range(R):  # each row's largest result is exact
        assert out[r, np.argmax(exact[r])] == unscreened[r, np.argmax(exact[r])]
    reference = screened(coarse, exact, margin)
    sure = surely_near | surely_far
    np.testing.assert_allclose(out[sure], reference[sure], rtol=0, atol=1e-5 * np.abs(exact).max())

    alone = np.zeros((R, N), np.float32)  # the same bits on one thread, for each row alone
    for r in range(R):
        x1 = np.zeros_like(x)
        x1[0] = x[r]
        screen({"x": x1, "weight": data, "out": alone, "rows": 1, "norm": g}, nth=1)
        np.testing.assert_array_equal(alone[0], out[r])


def test_screen_verifies_its_operands():
    types = _types()

    def with_rows(bits: int, layout: Layout = Layout.TILES, accumulate: bool = False, isa=tgt.Isa.VNNI512):
        def make(x, w, out, n, g):
            op = tgt.MatmulOp(x, w, out, n, norm=g, eps=1e-6, accumulate=accumulate)
            op.quantize = tgt.QRowsType(R, K, bits)
            op.screen = FloatAttr(1.0, f32)
            op.isa = tgt.IsaAttr(isa)
            return op
        return make

    kernel_op(with_rows(16), types)
    with pytest.raises(VerifyException, match="'screen' needs int16 'quantize' rows"):
        kernel_op(with_rows(8), types)
    with pytest.raises(VerifyException, match="neither 'accumulate'"):
        kernel_op(with_rows(16, accumulate=True), types)
    split = [*types[:1], tgt.WeightType((N, K), Storage.Q8_0, Layout.SPLIT), *types[2:]]
    with pytest.raises(VerifyException, match="tiles layout, not split"):
        kernel_op(with_rows(16, Layout.SPLIT), split)
    with pytest.raises(VerifyException, match="'screen' takes isa vnni512"):
        kernel_op(with_rows(16, isa=tgt.Isa.AVX2), types)


def _screened(module) -> dict[str, list[float]]:
    return {stage: [op.screen.value.data for op in find_function(module, stage).body.block.ops
                    if isinstance(op, tgt.MatmulOp) and op.screen is not None]
            for stage in ("prefill", "prefill_kv", "decode", "score", "verify")}


@pytest.mark.parametrize("cpu", [VNNI512, host.ISA_CPUS[tgt.Isa.AMX], host.ISA_CPUS[tgt.Isa.AVX2]])
def test_only_decodes_lm_head_is_screened_where_it_is_a_large_share(tiny, cpu):
    target = target_attr(BackendOptions(cpu=cpu))

    def screened(spec: TinySpec, **options) -> dict[str, list[float]]:
        options = CompileOptions(**{"max_seq": 32, "prefill_chunk": 4, "kv_type": "f32", "compute": "a16",
                                    "max_batch": 2, **options})
        return _screened(run_phases(load_model(str(tiny(spec, "gguf"))), options, "lower", None, lambda _: None,
                                    target))

    avx512 = cpu != host.ISA_CPUS[tgt.Isa.AVX2]
    assert screened(WIDE) == {"prefill": [], "prefill_kv": [], "decode": [MARGIN] * avx512, "score": [], "verify": []}
    assert not any(screened(SPEC).values())  # (its LM head 15% of the step's weights)
    assert not any(screened(WIDE, exact_logits=True).values())
    assert not any(screened(WIDE, compute="a8").values())


def test_the_margin_and_share_are_pass_options(tiny, tmp_path, capsys):
    lowered = tmp_path / "lowered.mlir"
    assert main(["compile", str(tiny(SPEC, "gguf")), "--cpu", VNNI512, "--compute", "a16", "--exact-logits",
                 "--compile-to", "lower", "-o", str(lowered)]) == 0
    assert " screen " not in lowered.read_text()
    out = tmp_path / "screened.mlir"
    assert main(["opt", str(lowered), "-p", "screen-logits{margin=2.5}", "-o", str(out)]) == 0
    assert " screen " not in out.read_text()  # SPEC's LM head: too small a share
    assert main(["opt", str(lowered), "-p", "screen-logits{margin=3 min_share=0.1}", "-o", str(out)]) == 0
    assert out.read_text().count("screen 3.000000e+00") == 1  # (a whole number is a margin too)
    capsys.readouterr()
    assert main(["opt", str(lowered), "-p", "screen-logits{margin=-1.0}", "-o", str(out)]) != 0
    assert "the margin is 0 or more" in capsys.readouterr().err


def _decode_logits(out, threads: int) -> np.ndarray:
    session = Session(out, threads=threads)
    try:
        rows = [session.feed(PROMPT)]
        for token in (150, 9, 11, 200, 3, 31):
            rows.append(session.feed([token]))
        return np.stack(rows[1:])  # (the decode steps')
    finally:
        session.close()


def test_screened_decode_is_exact_at_the_top(artifact):
    """A tiny model's decode steps, screened and exact: the largest logits the same bits, the rest close."""
    if not host.runs(VNNI512):
        pytest.skip(host.why_not(VNNI512))
    for threads in (1, 2):
        exact = _decode_logits(artifact(WIDE, cpu=VNNI512, compute="a16", exact_logits=True), threads)
        got = _decode_logits(artifact(WIDE, cpu=VNNI512, compute="a16"), threads)
        top = exact >= exact.max(axis=1, keepdims=True) - 1.0
        np.testing.assert_array_equal(got[top], exact[top])
        assert (got != exact).any()  # (the screen left some strips at int8)
        np.testing.assert_allclose(got, exact, rtol=0, atol=0.05 * np.abs(exact).max())


@pytest.mark.parametrize("kernel", ["lm_head", "attention"])
def test_maxima_are_vector_trees(kernel):
    """The screened head's strip maxima (8 rows a strip) and decode attention's block maxima take `vmaxps` trees:
    NaN-aware maxima (`vcmpunordss` beside each `vmaxss`, 15 in a row for 16 lanes) made the 270M model's 8-row
    decode step 6% slower. Any host: the assembly for a VNNI-512 CPU."""
    asm = assembly(VNNI512, (lm_head_op(R, K, MARGIN), _types()) if kernel == "lm_head"
                   else attention_op(R, 9, 3, 64, 256))
    assert "vmaxps" in asm
    assert "vcmpunordss" not in asm
