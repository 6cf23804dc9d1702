"""`a16`: activations quantized to int16 per 32 values, stored as two int8 planes (`hi`, `lo`) and
multiplied by the int8 dot products of `a8`, `(dot(codes, hi) << 8) + dot(codes, lo)`.

numpy first (`quantize_rows(x, 16)`, the planes, the int16 reference product), then the kernels
against it on the same quantized data (rows bit for bit; products within float rounding of the
integer reference), every instruction path compiled, and a tiny model with every projection a16
against the `llm` interpreter's a16 logits and against fp32.
"""

from __future__ import annotations

import ctypes
import itertools
import re
import uuid
from pathlib import Path

import host
import numpy as np
import pytest
from kernel_harness import IDX, Kernel, Machine, assert_close, f32, kernel_op, qrows_of, rand, read_qrows
from llvmlite import ir
from test_cpu_kernels import ISA_INSTRUCTIONS, check_swiglu_rows, matmul_op, swiglu_op, weight_of
from tiny_models import TinySpec
from xdsl.context import Context
from xdsl.parser import Parser

from llmc.backends.cpu import KernelLibrary, compile_to_assembly, compile_to_object, link_shared, target_machine
from llmc.backends.cpu.target import cpu_target, integer_isa, target_machine_for, tiles_layout
from llmc.frontend import import_model, load_model
from llmc.ir import find_function, llm, tgt
from llmc.ir.formats import FORMATS, QMAX, Storage, integer_matmul, join_planes, quantize_rows, slice_sums, split_planes
from llmc.ir.interpreter import KVCache, forward_logits
from llmc.ir.layouts import Layout, QRowLayout
from llmc.ir.tgt_interpreter import KernelWeights, cache_for, run_entry
from llmc.passes.pipeline import PHASES, CompileOptions, run_phase
from llmc.verify import teacher_forced

# numpy ---------------------------------------------------------------------------------------


def test_quantize_rows_16_round_trips_within_half_a_step():
    rng = np.random.default_rng(0)
    x = rand(rng, 5, 100, scale=3.0)
    x[0, :32] = 0.0  # an all-zero block: scale 0, values 0
    x[1, :4] = [3e4, -3e4, 1e-30, 0.5]
    qs, d, s = quantize_rows(x, 16)
    assert qs.dtype == np.int16 and qs.shape == (5, 128) and d.shape == s.shape == (5, 8)
    assert np.abs(qs).max() == QMAX[16] and not qs[:, 100:].any() and not qs[0, :32].any()
    step = np.repeat(d, 16, axis=1)[:, :100]
    assert (np.abs(qs[:, :100] * step - x) <= step / 2 * (1 + 1e-5)).all()
    np.testing.assert_array_equal(s, d * qs.reshape(5, 8, 16).astype(np.int32).sum(-1).astype(f32))
    q8, d8, _ = quantize_rows(x)  # the int8 rows are 256 times coarser
    np.testing.assert_allclose(d8, d * f32(QMAX[16] / QMAX[8]), rtol=1e-6)
    assert q8.dtype == np.int8


def test_int16_values_split_into_two_int8_planes_and_back():
    q = np.arange(-QMAX[16], QMAX[16] + 1, dtype=np.int16)
    planes = split_planes(q)
    hi, lo = planes[0].astype(int), planes[1].astype(int)
    assert planes.dtype == np.int8 and (-127 <= hi).all() and (hi <= 127).all() and lo.min() == -128
    np.testing.assert_array_equal(256 * hi + lo, q)
    np.testing.assert_array_equal(join_planes(planes), q)


@pytest.mark.parametrize("storage", [Storage.Q4_1, Storage.Q8_0, Storage.Q6_K], ids=str)
def test_the_int16_product_is_exact_where_float32_sums_would_not_be(storage):
    """Products of codes and int16 values pass 2^24 (float32's exact integers): the reference sums them
    exactly, so it equals the product computed from the two planes, each exact in float32."""
    rng = np.random.default_rng(1)
    qt = FORMATS[storage].quantize(rand(rng, 48, 256))
    qs, d, s = quantize_rows(rand(rng, 3, 256, scale=4.0), 16)
    hi, lo = (np.ascontiguousarray(p) for p in np.moveaxis(split_planes(qs), -2, 0))
    two = 256 * integer_matmul(hi, d, np.zeros_like(s), qt).astype(np.float64) + \
        integer_matmul(lo, d, s, qt).astype(np.float64)
    assert_close(integer_matmul(qs, d, s, qt), two, rtol=1e-6)


def test_qrows_types_print_and_parse_their_width():
    ctx = Context()
    ctx.load_dialect(tgt.TGT)
    for text, bits in (("!tgt.qrows<4x96>", 8), ("!tgt.qrows<4x96xi16>", 16)):
        t = Parser(ctx, text).parse_type()
        assert isinstance(t, tgt.QRowsType) and t.bits == bits and str(t) == text
        assert t.nbytes == 4 * QRowLayout(96, bits).row_bytes
    assert tgt.QRowsType(4, 96, 16).nbytes > tgt.QRowsType(4, 96).nbytes + 4 * 96  # a second plane
    with pytest.raises(Exception, match="xi16"):
        Parser(ctx, "!tgt.qrows<4x96xi8>").parse_type()


# kernels -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def native() -> Machine:
    return Machine("native", target_machine("native"))


@pytest.mark.parametrize("D", [64, 160])
def test_kernels_write_int16_rows_bit_for_bit(tmp_path, native, D):
    """`tgt.quantize` writes the planes, scales and sums of `quantize_rows(x, 16)` exactly; an RMSNorm
    into int16 rows the same up to its float rounding (a value may land on the other side of a tie)."""
    rng = np.random.default_rng(D)
    x = rand(rng, 6, D, scale=2.0)
    x[0, :32] = 0.0
    x[1, :3] = [1e-30, -3e4, 0.5]
    k = Kernel(tmp_path, native, tgt.QuantizeOp, [tgt.memref(6, D), tgt.QRowsType(6, D, 16), IDX])
    buf = np.full(6 * QRowLayout(D, 16).row_bytes, 0xFF, np.uint8)  # garbage where the padding goes
    k({"x": x, "out": buf, "rows": 5})
    planes, d, s, n = (v[:5] for v in QRowLayout(D, 16).views(buf, 6))
    rq, rd, rs = quantize_rows(x[:5], 16)
    np.testing.assert_array_equal(planes, split_planes(rq))
    np.testing.assert_array_equal(n, slice_sums(rq))
    np.testing.assert_array_equal(d, rd)
    np.testing.assert_array_equal(s, rs)

    w = rand(rng, D)
    k = Kernel(tmp_path, native, lambda x, w, o, n: tgt.RMSNormOp(x, w, o, n, 1e-5),
               [tgt.memref(6, D), tgt.WeightType((D,), Storage.F32), tgt.QRowsType(6, D, 16), IDX])
    k({"x": x, "weight": w, "out": buf, "rows": 4})
    qs, d, _, sums = read_qrows(buf, 6, D, 4, 16)
    np.testing.assert_array_equal(sums, slice_sums(qs))
    x64 = x[:4].astype(np.float64)
    rq, rd, _ = quantize_rows((x64 / np.sqrt(np.mean(x64 * x64, -1, keepdims=True) + 1e-5) * w).astype(f32), 16)
    assert np.abs(qs.astype(int) - rq).max() <= 1 and (qs != rq).mean() < 0.01
    np.testing.assert_allclose(d, rd, rtol=1e-6)


@pytest.mark.parametrize("bits", [8, 16])
@pytest.mark.parametrize("storage", [Storage.Q4_1, Storage.Q4_K, Storage.Q5_0, Storage.Q5_1, Storage.Q6_K], ids=str)
def test_avx2_pair_sums_stay_exact_at_their_largest(tmp_path, native, storage, bits):
    """AVX2 sums each quad's `vpmaddubsw` pairs in 16 bits over `pair_quads(bits)` quads: with nearly every
    code at its format's largest and every value at the rows' (all −1: int8 −127, `hi` −127), the kernels
    of one row and of 8 still equal the integer reference (one quad more a sum overflows for 5- and 6-bit
    codes, whose sums run over 4 and 2 quads)."""
    K, N, R = 256, 32, 8
    w = np.ones((N, K), f32)
    w[:, ::16] = -1.0  # (each 16-slice's one negative value: every format's other codes at their largest)
    qt = FORMATS[storage].quantize(w)
    assert (qt.codes == qt.codes.max()).mean() > 0.9
    buf, rows = qrows_of(np.full((R, K), -1.0, f32), R, bits)
    wtype, data, _ = weight_of(storage, w, Layout.TILES_AVX2)
    k = Kernel(tmp_path, native, matmul_op(isa=tgt.Isa.AVX2), [tgt.QRowsType(R, K, bits), wtype, tgt.memref(R, N), IDX])
    for n in (1, R):
        out = np.zeros((R, N), f32)
        k({"x": buf, "weight": data, "out": out, "rows": n})
        assert_close(out[:n], integer_matmul(*rows.values(0, n), qt), rtol=2e-6)


@pytest.mark.parametrize("K,R", [(256, 5), (4352, 9)])
@pytest.mark.parametrize("storage", [Storage.Q4_1, Storage.Q8_0, Storage.Q6_K], ids=str)
def test_matmul_a16_equals_the_integer_reference(tmp_path, native, storage, K, R):
    """Every integer path this host runs (its own, AVX2's, generic; the tiles layout on all but generic), on
    the same int16 rows as the reference; `last_row` too. The kernel rounds each lane's int32 sum
    of 4 products (up to 2^25) to float, the reference each slice's exact sum: within 2e-6 at K 256,
    × √(K / 256) for longer rows. (K 4352: AVX2's rows as words, for q8_0, take tiles of 4 rows, not 8,
    within `WORDS_BYTES` of stack.)"""
    rng = np.random.default_rng(13)
    N = 48
    w = rand(rng, N, K)
    w[:, :64] *= 20
    qt = FORMATS[storage].quantize(w)
    buf, rows = qrows_of(rand(rng, R, K, scale=3.0), R, 16)
    own = integer_isa(cpu_target("native"))
    isas = sorted({own, tgt.Isa.AVX2, tgt.Isa.GENERIC}, key=list(tgt.Isa).index)
    paths = [(isa, Layout.SPLIT) for isa in isas] + \
        [(isa, tiles) for isa in isas if isa is not tgt.Isa.GENERIC for tiles in (Layout.TILES, Layout.TILES_AVX2)]
    for isa, layout in paths:
        wtype, data, _ = weight_of(storage, w, layout)
        for last_row in (False, True):
            k = Kernel(tmp_path, native, matmul_op(last_row=last_row, isa=isa),
                       [tgt.QRowsType(R, K, 16), wtype, tgt.memref(R, N), IDX])
            for n in (1, R):
                out = np.zeros((R, N), f32)
                k({"x": buf, "weight": data, "out": out, "rows": n})
                ref = integer_matmul(*rows.values(n - 1 if last_row else 0, n), qt)
                assert_close(out[: ref.shape[0]], ref, rtol=2e-6 * (K / 256) ** 0.5)  # (float sums of K / 32 blocks)
                assert not out[ref.shape[0]:].any()


def _emulated_vpdpbusd(lanes: int) -> str:
    """`llvm.x86.avx512.vpdpbusd.{32·lanes}` in plain LLVM IR: per lane, the accumulator plus 4
    unsigned bytes × 4 signed bytes (what the instruction computes, for a host without it)."""
    n = 4 * lanes
    picks = ["shufflevector <{n} x i32> %p, <{n} x i32> undef, <{l} x i32> <{m}>".format(
        n=n, l=lanes, m=", ".join(f"i32 {4 * i + k}" for i in range(lanes))) for k in range(4)]
    body = "\n".join(f"  %p{k} = {pick}" for k, pick in enumerate(picks))
    return (f"define internal <{lanes} x i32> @\"emulated.vpdpbusd.{lanes}\"(<{lanes} x i32> %acc, <{n} x i8> %a, "
            f"<{n} x i8> %b) alwaysinline {{\n  %za = zext <{n} x i8> %a to <{n} x i32>\n"
            f"  %sb = sext <{n} x i8> %b to <{n} x i32>\n  %p = mul <{n} x i32> %za, %sb\n{body}\n"
            f"  %s0 = add <{lanes} x i32> %acc, %p0\n  %s1 = add <{lanes} x i32> %s0, %p1\n"
            f"  %s2 = add <{lanes} x i32> %s1, %p2\n  %s3 = add <{lanes} x i32> %s2, %p3\n"
            f"  ret <{lanes} x i32> %s3\n}}")


class EmulatedVnniKernel(Kernel):
    """A kernel op compiled for this host with its VNNI instructions (`vpdpbusd`, 512 and 256 bits)
    replaced by their plain-IR equivalents: the VNNI paths' own loops, layouts and int16 planes run
    and are checked on a host without AVX-512 VNNI (their instructions: `test_every_integer_path_compiles_a16`)."""

    def __init__(self, tmp_path: Path, make, types):
        self.op = kernel_op(make, types)
        module = ir.Module(name="kernels")
        self.fn = KernelLibrary(module).kernel(self.op)
        text = str(module)
        for bits, lanes in ((512, 16), (256, 8)):
            name = f'@"llvm.x86.avx512.vpdpbusd.{bits}"'
            if name in text:
                text = re.sub(rf"declare [^\n]*{re.escape(name)}[^\n]*", _emulated_vpdpbusd(lanes), text)
                text = text.replace(name, f'@"emulated.vpdpbusd.{lanes}"')
        assert "vpdpbusd" not in text.replace("emulated.vpdpbusd", "")
        path = link_shared([compile_to_object(text, target_machine("native"))], tmp_path / f"e_{uuid.uuid4().hex}.so")
        self.library = ctypes.CDLL(str(path))
        self.c = getattr(self.library, self.fn.name)
        self.c.restype = None


def test_vnni_paths_equal_the_integer_reference_with_vpdpbusd_emulated(tmp_path):
    """a16 in the tiles layout (`vpdpbusd` chains per strip on broadcast quads of each plane: VNNI-512, and
    VNNI-256 on each half of the strip) and in the split layout with VNNI-512 and VNNI-256, on the same rows as
    the integer reference."""
    rng = np.random.default_rng(7)
    N, K, R = 40, 192, 5
    w = rand(rng, N, K)
    qt = FORMATS[Storage.Q4_1].quantize(w)
    x = rand(rng, R, K, scale=3.0)
    buf, rows = qrows_of(x, R, 16)
    for isa, layout in itertools.product((tgt.Isa.VNNI512, tgt.Isa.VNNI256), (Layout.TILES, Layout.SPLIT)):
        wtype, data, _ = weight_of(Storage.Q4_1, w, layout)
        k = EmulatedVnniKernel(tmp_path, matmul_op(isa=isa), [tgt.QRowsType(R, K, 16), wtype, tgt.memref(R, N), IDX])
        out = np.zeros((R, N), f32)
        k({"x": buf, "weight": data, "out": out, "rows": R})
        assert_close(out, integer_matmul(*rows.values(0, R), qt), rtol=2e-6)


@pytest.mark.parametrize("layout", [Layout.SPLIT, Layout.TILES], ids=str)
def test_swiglu_a16_reads_and_writes_int16_rows(tmp_path, native, layout):
    """int16 rows in, the silu(gate)·up product quantized to int16 rows out (32 columns at a time),
    equal to the integer reference quantized (a value may land on the other side of a tie). The
    tiles layout is read with the host's own integer path (VNNI-512 emulated where it has none)."""
    own = integer_isa(cpu_target("native"))
    rng = np.random.default_rng(4)
    N, K, R, n = 96, 128, 4, 3
    wg, wu = rand(rng, N, K, scale=0.3), rand(rng, N, K, scale=0.3)
    qg, qu = (FORMATS[Storage.Q4_1].quantize(w) for w in (wg, wu))
    (gtype, gdata, _), (utype, udata, _) = (weight_of(Storage.Q4_1, w, layout) for w in (wg, wu))
    buf, rows = qrows_of(rand(rng, R, K, scale=2.0), R, 16)
    types = [tgt.QRowsType(R, K, 16), gtype, utype, tgt.QRowsType(R, N, 16), IDX]
    if layout is Layout.SPLIT or own is not tgt.Isa.GENERIC:
        k = Kernel(tmp_path, native, swiglu_op(isa=own), types)
    else:
        k = EmulatedVnniKernel(tmp_path, swiglu_op(isa=tgt.Isa.VNNI512), types)
    out = np.full(R * QRowLayout(N, 16).row_bytes, 0xFF, np.uint8)
    k({"x": buf, "gate": gdata, "up": udata, "out": out, "rows": n})
    check_swiglu_rows(out, rows, qg, qu, R, N, n, 16)


@pytest.mark.parametrize("isa", list(host.ISA_CPUS), ids=str)
def test_every_integer_path_compiles_a16(isa):
    """Each integer path's a16 matmul and SwiGLU kernels use its instructions and no wider ones
    (compiled for a CPU that has them, whatever the host): AVX2's `vpmaddubsw` of each plane, AMX's tiles."""
    N, K, R = 64, 256, 32
    layout = Layout.SPLIT if isa is tgt.Isa.GENERIC else tiles_layout(isa)
    wtype = tgt.WeightType((N, K), Storage.Q4_1, layout)
    module = ir.Module(name="kernels")
    library = KernelLibrary(module)
    for make, types in ((matmul_op(isa=isa), [tgt.QRowsType(R, K, 16), wtype, tgt.memref(R, N), IDX]),
                        (swiglu_op(isa=isa), [tgt.QRowsType(R, K, 16), wtype, wtype, tgt.QRowsType(R, N, 16), IDX])):
        library.kernel(kernel_op(make, types))
    asm = compile_to_assembly(module, target_machine_for(cpu_target(host.ISA_CPUS[isa])))
    used, unused = ISA_INSTRUCTIONS[isa]
    assert all(mark in asm for mark in used), [mark for mark in used if mark not in asm]
    assert not any(mark in asm for mark in unused), [mark for mark in unused if mark in asm]


# a model -------------------------------------------------------------------------------------

SPEC = TinySpec(hidden=64, heads=2, kv_heads=1, head_dim=32, ffn=128, context_length=64, gguf_storage=(
    ("token_embd", "q8_0"), ("attn_q", "q4_1"), ("attn_k", "q4_0"), ("attn_v", "q8_0"), ("attn_output", "q5_0"),
    ("ffn_gate", "q5_1"), ("ffn_up", "q4_1"), ("ffn_down", "q4_1")))
TOKENS = [5, 17, 42, 100, 150, 7, 9, 11, 200, 3]
OPTIONS = CompileOptions(prefill_chunk=4, max_seq=32, kv_type="f32", compute="a8")


def phases(model, cpu: str, modes, last: str = "lower", options: CompileOptions = OPTIONS):
    """The model through the phases to `last` for `cpu`, each integer projection's mode set by
    `modes(op)` after `quantize` (a8 where it returns None)."""
    module = import_model(model)
    module.attributes[tgt.TARGET] = cpu_target(cpu)
    for phase in PHASES:
        run_phase(module, phase, options=options, weights=model.weights)
        if phase == "quantize":
            for op in module.walk():
                if isinstance(op, llm.Projection) and op.mode is llm.Compute.A8:
                    op.compute = llm.ComputeAttr(modes(op) or llm.Compute.A8)
        if phase == last:
            return module
    return module


def only_q_a16(op: llm.Projection) -> llm.Compute | None:
    """a16 for the q projections, the others a8."""
    weight = op.gate if isinstance(op, llm.SwigluOp) else op.weight
    return llm.Compute.A16 if weight.owner.sym_name.endswith("attn_q") else None


def stage_logits(model, modes) -> np.ndarray:
    module = phases(model, "native", modes, "quantize")
    cache = KVCache.for_type(find_function(module, "forward").function_type.inputs.data[2], len(TOKENS))
    return teacher_forced(lambda chunk, start: forward_logits(module, model.weights, chunk, start, cache)[-1], TOKENS)


def tgt_logits(model, module) -> np.ndarray:
    entries = {e: find_function(module, e) for e in ("prefill", "decode")}
    cache = cache_for(entries["decode"].body.block.args[3].type)
    weights = KernelWeights(model.weights)
    return teacher_forced(lambda chunk, start: run_entry(entries["prefill" if start == 0 else "decode"], weights,
                                                         np.asarray(chunk, np.int32), start, cache)[0], TOKENS)


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / np.linalg.norm(a, axis=-1) / np.linalg.norm(b, axis=-1)


def all_a16(op: llm.Projection) -> llm.Compute:
    return llm.Compute.A16


def test_mixed_readers_get_one_quantize_per_width(tiny):
    """q reads the attention norm's output as a16, k and v as a8: the norm writes float rows and
    each width gets its own `tgt.quantize`; the tgt interpreter gives the llm interpreter's logits."""
    model = load_model(str(tiny(SPEC, "gguf")))
    module = phases(model, "native", only_q_a16)
    decode = str(find_function(module, "decode"))
    assert decode.count("tgt.quantize") == 2 * SPEC.layers
    assert "-> !tgt.qrows<1x64xi16>" in decode and "-> !tgt.qrows<1x64>" in decode
    ours, reference = tgt_logits(model, module), stage_logits(model, only_q_a16)
    assert np.abs(ours - reference).max() <= 1e-4 * np.abs(reference).max()


def test_amx_targets_give_a8_and_a16_kernels_tiles(tiny):
    """Compiled for an AMX CPU with 32-row prefill chunks: the a8 and a16 kernels of prefill take the
    tiles (but the LM head's, of one row)."""
    options = CompileOptions(prefill_chunk=32, max_seq=64, kv_type="f32", compute="a8")
    module = phases(load_model(str(tiny(SPEC, "gguf"))), host.ISA_CPUS[tgt.Isa.AMX], only_q_a16, options=options)
    kernels = [op for op in find_function(module, "prefill").body.block.ops
               if isinstance(op, (tgt.MatmulOp, tgt.SwigluOp)) and tgt.is_quantized(op.x)
               and getattr(op, "last_row", None) is None]
    isas = {bits: {op.isa.data for op in kernels if op.x.type.bits == bits} for bits in (8, 16)}
    assert isas == {8: {tgt.Isa.AMX}, 16: {tgt.Isa.AMX}}


def test_a16_model_matches_its_stage_and_is_closer_to_fp32_than_a8(tiny, tmp_path):
    """Every integer projection a16, compiled for this host: the artifact's logits match the llm
    interpreter's a16 logits and the tgt interpreter's; against fp32 (a32 on the same weights) they
    are far closer than a8's."""
    from dataclasses import asdict

    from llmc.driver import BackendOptions, build_artifact
    from llmc.runtime.session import Session

    model = load_model(str(tiny(SPEC, "gguf")))
    module = phases(model, "native", all_a16)
    prefill = str(find_function(module, "prefill"))
    assert "!tgt.qrows<4x64xi16>" in prefill and "!tgt.qrows<4x64>" not in prefill
    a16 = stage_logits(model, all_a16)
    assert np.abs(tgt_logits(model, module) - a16).max() <= 1e-4 * np.abs(a16).max()
    backend = BackendOptions(cpu="native")
    out = build_artifact(module, model, Path(tmp_path) / "a16", backend, asdict(OPTIONS) | asdict(backend),
                         lambda _: None)
    session = Session(out)
    ours = teacher_forced(lambda chunk, start: session.feed(chunk), TOKENS)
    session.close()
    assert cosines(ours, a16).min() > 0.99999
    assert (ours.argmax(-1) == a16.argmax(-1)).all()
    fp32 = stage_logits(model, lambda op: llm.Compute.A32)
    a8 = stage_logits(model, lambda op: None)
    gap16, gap8 = (1 - cosines(ours, fp32)).max(), (1 - cosines(a8, fp32)).max()
    assert gap16 < gap8 / 100, (gap16, gap8)
