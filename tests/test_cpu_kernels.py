"""CPU kernels: each emitted alone, compiled at O3, linked, called through ctypes and
compared with numpy (max abs error ≤ 1e-4 · max|ref| + 1e-6)."""

from __future__ import annotations

import ctypes
import itertools
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from llvmlite import ir

from llmc.backends.cpu import KernelLibrary, ToolchainError, compile_to_object, link_shared, target_machine
from llmc.backends.cpu.kernels import FPTR, I64, rope_inv_freq
from llmc.errors import LlmcError

f32 = np.float32


def _host_has(*features: str) -> bool:
    from llmc.backends.cpu import host_cpu

    flags = set(host_cpu()[1].split(","))
    return all(f"+{f}" in flags for f in features)


@pytest.fixture(scope="module", params=["native", "x86-64-v3"])
def tm(request):
    """Every kernel test runs for the host CPU and for AVX2 (x86-64-v3) code."""
    if request.param == "x86-64-v3" and not _host_has("avx2", "fma", "bmi2"):
        pytest.skip("the host cannot run x86-64-v3 code")
    return target_machine(request.param)


class Built:
    """A shared library built from one KernelLibrary; `lib.fn(name)` → callable."""

    def __init__(self, path: Path, functions: list[ir.Function]):
        self.cdll = ctypes.CDLL(str(path))
        self.types = {fn.name: fn.function_type for fn in functions}

    def __call__(self, fn: ir.Function, *args: object) -> None:
        """Call `fn`; kernels that share work among threads get (tid 0, nth 1) when not given."""
        if [a.name for a in fn.args[-2:]] == ["tid", "nth"] and len(args) == len(fn.args) - 2:
            args = (*args, 0, 1)
        cfn = getattr(self.cdll, fn.name)
        cfn.restype = None
        cargs = []
        for ty, a in zip(fn.function_type.args, args, strict=True):
            if isinstance(ty, ir.PointerType):
                if a is None:
                    cargs.append(ctypes.c_void_p(None))
                else:
                    assert isinstance(a, np.ndarray) and a.flags.c_contiguous
                    cargs.append(ctypes.c_void_p(a.ctypes.data))
            else:
                cargs.append(ctypes.c_int64(int(a)))
        cfn(*cargs)


def build(tmp_path: Path, tm, emit: Callable[[KernelLibrary], object], **lib_kw) -> tuple[Built, object]:
    module = ir.Module(name="kernels")
    lib = KernelLibrary(module, **lib_kw)
    result = emit(lib)
    obj = compile_to_object(module, tm)
    path = link_shared([obj], tmp_path / f"k_{uuid.uuid4().hex}.so")
    return Built(path, lib.functions()), result


def assert_close(got: np.ndarray, ref: np.ndarray, rtol: float = 1e-4) -> None:
    ref = np.asarray(ref, np.float64)
    err = float(np.max(np.abs(got.astype(np.float64) - ref))) if ref.size else 0.0
    bound = rtol * float(np.max(np.abs(ref))) + 1e-6
    assert err <= bound, f"max abs error {err:.3g} > {bound:.3g}"


def rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(f32)


# references ------------------------------------------------------------------------

def ref_rms_norm(x, w, eps):
    x = x.astype(np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def ref_rope(x, positions, theta):
    d = x.shape[-1]
    half = d // 2
    angles = positions.astype(f32)[:, None] * rope_inv_freq(d, theta)[None, :]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(f32)


def ref_attention(q, keys, values, positions):
    """q [T, H, D]; keys/values [KVH, S, D] (the whole layer cache); causal by position."""
    t, heads, d = q.shape
    group = heads // keys.shape[0]
    out = np.zeros((t, heads, d))
    for ti, p in enumerate(positions):
        for h in range(heads):
            k = keys[h // group, : p + 1].astype(np.float64)
            v = values[h // group, : p + 1].astype(np.float64)
            s = k @ q[ti, h].astype(np.float64) / np.sqrt(d)
            e = np.exp(s - s.max())
            out[ti, h] = (e / e.sum()) @ v
    return out


def silu64(x):
    x = np.asarray(x, np.float64)
    return x / (1 + np.exp(-x))


# kernels ---------------------------------------------------------------------------

def test_embedding(tmp_path, tm):
    rng = np.random.default_rng(0)
    D, V = 40, 50
    lib, fn = build(tmp_path, tm, lambda k: k.embedding(D))
    table = rand(rng, V, D)
    tokens = np.array([3, 0, 49, 3, 17, 8, 22], np.int32)
    out = np.full((len(tokens), D), np.nan, f32)
    lib(fn, tokens, len(tokens), table, out)
    np.testing.assert_array_equal(out, table[tokens])


@pytest.mark.parametrize("D", [40, 37, 576])
def test_rms_norm(tmp_path, tm, D):
    rng = np.random.default_rng(D)
    eps = 1e-5
    lib, fn = build(tmp_path, tm, lambda k: k.rms_norm(D, eps))
    x, w = rand(rng, 5, D, scale=3.0), rand(rng, D)
    out = np.zeros_like(x)
    lib(fn, x, 5, w, out)
    assert_close(out, ref_rms_norm(x, w, eps))
    # n=1 leaves the other rows alone; in place (out is x) works
    out2 = np.zeros_like(x)
    lib(fn, x, 1, w, out2)
    assert_close(out2[:1], ref_rms_norm(x[:1], w, eps))
    assert not out2[1:].any()
    y = x.copy()
    lib(fn, y, 5, w, y)
    assert_close(y, ref_rms_norm(x, w, eps))


FLAGS = list(itertools.product([False, True], repeat=4))


@pytest.mark.parametrize("has_norm,has_bias,accumulate,last_row", FLAGS,
                         ids=["".join(c for c, on in zip("nbal", f) if on) or "plain" for f in FLAGS])
def test_matmul_flags(tmp_path, tm, has_norm, has_bias, accumulate, last_row):
    rng = np.random.default_rng(1)
    K, N, eps = 37, 23, 1e-5
    lib, fn = build(tmp_path, tm, lambda k: k.matmul(K, N, has_norm=has_norm, eps=eps, has_bias=has_bias,
                                                     accumulate=accumulate, last_row=last_row))
    w, bias, nw = rand(rng, N, K), rand(rng, N), rand(rng, K)
    for n in (1, 3, 4, 9):
        x = rand(rng, n, K)
        xs = x[-1:] if last_row else x
        xn = ref_rms_norm(xs, nw, eps) if has_norm else xs.astype(np.float64)
        ref = xn @ w.T.astype(np.float64)
        if has_bias:
            ref = ref + bias
        out = rand(rng, n, N)
        before = out.copy()
        if accumulate:
            ref = ref + before[: ref.shape[0]]
        lib(fn, x, n, w, bias if has_bias else None, nw if has_norm else None, out)
        assert_close(out[: ref.shape[0]], ref)
        np.testing.assert_array_equal(out[ref.shape[0]:], before[ref.shape[0]:])


@pytest.mark.parametrize("K,N,n,has_norm", [(576, 192, 1, False), (576, 192, 67, True), (40, 24, 130, True),
                                            (40, 24, 5, False)])
def test_matmul_shapes(tmp_path, tm, K, N, n, has_norm):
    """SmolLM2-like widths, and row counts crossing the 4-row tiles and 64-row blocks."""
    rng = np.random.default_rng(K + N + n)
    lib, fn = build(tmp_path, tm, lambda k: k.matmul(K, N, has_norm=has_norm, eps=1e-5))
    x, w, nw = rand(rng, n, K), rand(rng, N, K, scale=0.05), rand(rng, K)
    out = np.zeros((n, N), f32)
    lib(fn, x, n, w, None, nw if has_norm else None, out)
    xn = ref_rms_norm(x, nw, 1e-5) if has_norm else x.astype(np.float64)
    assert_close(out, xn @ w.T.astype(np.float64))


@pytest.mark.parametrize("has_norm", [False, True])
@pytest.mark.parametrize("K,N,n", [(37, 23, 6), (576, 96, 5)])
def test_swiglu(tmp_path, tm, has_norm, K, N, n):
    rng = np.random.default_rng(2)
    lib, fn = build(tmp_path, tm, lambda k: k.swiglu(K, N, has_norm=has_norm, eps=1e-6))
    x, wg, wu, nw = rand(rng, n, K), rand(rng, N, K, scale=0.3), rand(rng, N, K, scale=0.3), rand(rng, K)
    x[0, :5] *= 40  # large gate values: e**-g far from 1 on both sides
    out = np.zeros((n, N), f32)
    lib(fn, x, n, wg, wu, nw if has_norm else None, out)
    xn = ref_rms_norm(x, nw, 1e-6) if has_norm else x.astype(np.float64)
    g, u = xn @ wg.T.astype(np.float64), xn @ wu.T.astype(np.float64)
    assert_close(out, silu64(g) * u)


@pytest.mark.parametrize("start", [0, 3, 1000, 8000])
def test_rope(tmp_path, tm, start):
    rng = np.random.default_rng(3)
    H, D, theta, n = 4, 8, 10000.0, 5
    lib, fn = build(tmp_path, tm, lambda k: k.rope(H, D, theta))
    x = rand(rng, n, H, D)
    y = x.copy()
    lib(fn, y, n, start)
    assert_close(y, ref_rope(x, np.arange(start, start + n), theta))


def test_rope_smollm_shape(tmp_path, tm):
    rng = np.random.default_rng(4)
    H, D, theta, n, start = 9, 64, 100000.0, 7, 300
    lib, fn = build(tmp_path, tm, lambda k: k.rope(H, D, theta))
    x = rand(rng, n, H, D)
    y = x.copy()
    lib(fn, y, n, start)
    assert_close(y, ref_rope(x, np.arange(start, start + n), theta))


@pytest.mark.parametrize("rope", [False, True])
@pytest.mark.parametrize("H,KVH,D,S", [(4, 2, 8, 32), (4, 4, 8, 32), (6, 1, 6, 24), (9, 3, 64, 64)])
def test_attention(tmp_path, tm, rope, H, KVH, D, S):
    """A 5-row prefill at 0, then 3 more rows at start=5 against a recomputation over
    all 8 rows; the cache holds every (rotated) key and value of this layer only."""
    rng = np.random.default_rng(5)
    L, layer, theta = 3, 1, 10000.0
    lib, fn = build(tmp_path, tm, lambda k: k.attention(H, KVH, D, S, layer, rope=rope, theta=theta))
    total = 8
    q, k, v = rand(rng, total, H, D), rand(rng, total, KVH, D), rand(rng, total, KVH, D)
    kc = rand(rng, L, KVH, S, D)  # other layers and unused positions hold garbage
    vc = rand(rng, L, KVH, S, D)
    kc0, vc0 = kc.copy(), vc.copy()
    pos = np.arange(total)
    qr = ref_rope(q, pos, theta) if rope else q
    kr = ref_rope(k, pos, theta) if rope else k

    for lo, hi in ((0, 5), (5, 8)):
        qa, ka, va = q[lo:hi].copy(), k[lo:hi].copy(), v[lo:hi].copy()
        out = np.zeros((hi - lo, H, D), f32)
        lib(fn, qa, ka, va, hi - lo, lo, kc, vc, out)
        keys = kc0[layer].copy()
        values = vc0[layer].copy()
        keys[:, :hi] = kr[:hi].transpose(1, 0, 2)
        values[:, :hi] = v[:hi].transpose(1, 0, 2)
        assert_close(out, ref_attention(qr[lo:hi], keys, values, pos[lo:hi]))
        assert_close(kc[layer, :, :hi], kr[:hi].transpose(1, 0, 2))
        np.testing.assert_array_equal(vc[layer, :, :hi], v[:hi].transpose(1, 0, 2))
        if rope:  # q and k rotated in place
            assert_close(qa, qr[lo:hi])
            assert_close(ka, kr[lo:hi])
    # untouched: other layers and positions past the last row
    for c, c0 in ((kc, kc0), (vc, vc0)):
        np.testing.assert_array_equal(np.delete(c, layer, axis=0), np.delete(c0, layer, axis=0))
        np.testing.assert_array_equal(c[layer, :, total:], c0[layer, :, total:])
    # one-shot prefill of all 8 rows gives the same outputs as the two chunks
    out_all = np.zeros((total, H, D), f32)
    lib(fn, q.copy(), k.copy(), v.copy(), total, 0, kc, vc, out_all)
    keys, values = kc0[layer].copy(), vc0[layer].copy()
    keys[:, :total], values[:, :total] = kr.transpose(1, 0, 2), v.transpose(1, 0, 2)
    assert_close(out_all, ref_attention(qr, keys, values, pos))


def test_attention_decode_long_and_capacity(tmp_path, tm):
    """Decode near the end of a 256-row cache (large score spread), then rows past the
    capacity are skipped instead of written out of bounds."""
    rng = np.random.default_rng(6)
    H, KVH, D, S = 4, 2, 16, 256
    lib, fn = build(tmp_path, tm, lambda k: k.attention(H, KVH, D, S, 0))
    kc, vc = rand(rng, 1, KVH, S, D, scale=3.0), rand(rng, 1, KVH, S, D)
    q, k, v = rand(rng, 1, H, D, scale=3.0), rand(rng, 1, KVH, D), rand(rng, 1, KVH, D)
    out = np.zeros((1, H, D), f32)
    start = 250
    lib(fn, q, k, v, 1, start, kc, vc, out)
    assert_close(out, ref_attention(q, kc[0], vc[0], np.array([start])))
    big = np.zeros((5, KVH, D), f32)
    kc_before = kc.copy()
    out5 = np.zeros((5, H, D), f32)
    lib(fn, rand(rng, 5, H, D), big, big, 5, S - 2, kc, vc, out5)  # rows at S, S+1, S+2 skipped
    np.testing.assert_array_equal(kc[0, :, : S - 2], kc_before[0, :, : S - 2])
    assert not kc[0, :, S - 2:].any()
    assert not out5[2:].any()


@pytest.mark.parametrize("W", [37, 48, 576])
def test_elementwise(tmp_path, tm, W):
    rng = np.random.default_rng(7)
    lib, (fa, fm, fs) = build(tmp_path, tm, lambda k: (k.add(W), k.mul(W), k.silu(W)))
    n = 3
    a, b = rand(rng, n, W, scale=4.0), rand(rng, n, W)
    a[0, :4] = [-100.0, 100.0, -30.0, 0.0]
    for fn, ref in ((fa, a.astype(np.float64) + b), (fm, a.astype(np.float64) * b)):
        out = np.zeros_like(a)
        lib(fn, a, b, out, n)
        assert_close(out, ref, rtol=1e-6)
        inplace = a.copy()
        lib(fn, inplace, b, inplace, n)
        assert_close(inplace, ref, rtol=1e-6)
    out = np.zeros_like(a)
    lib(fs, a, out, n)
    assert_close(out, silu64(a))
    part = np.zeros_like(a)
    lib(fs, a, part, 2)
    assert not part[2].any()
    inplace = a.copy()
    lib(fs, inplace, inplace, n)
    assert_close(inplace, silu64(a))


def test_exp_accuracy(tmp_path, tm):
    """The inline exp behind silu and softmax, over its whole range: ≤ 2e-7 relative."""
    from llmc.backends.cpu.builder import KernelBuilder as _Body

    module = ir.Module(name="kernels")
    g = ir.Function(module, ir.FunctionType(ir.VoidType(), [FPTR, FPTR, I64]), name="exp_map")
    body = _Body(module, g)
    body.vec_map(g.args[2], [g.args[0]], g.args[1], lambda v: body.exp(v[0]))
    body.finish()
    path = link_shared([compile_to_object(module, tm)], tmp_path / f"e_{uuid.uuid4().hex}.so")
    cdll = ctypes.CDLL(str(path))
    x = np.linspace(-87, 88, 200003).astype(f32)
    y = np.zeros_like(x)
    cdll.exp_map(ctypes.c_void_p(x.ctypes.data), ctypes.c_void_p(y.ctypes.data), ctypes.c_int64(x.size))
    ref = np.exp(x.astype(np.float64))
    assert np.max(np.abs(y / ref - 1)) < 2e-7
    assert np.all(np.isfinite(y))


# the library -----------------------------------------------------------------------

def test_cache_and_names():
    module = ir.Module(name="kernels")
    lib = KernelLibrary(module)
    a = lib.matmul(576, 192, has_norm=True, eps=1e-5, accumulate=True)
    assert lib.matmul(576, 192, has_norm=True, eps=1e-5, accumulate=True) is a
    assert a.name == "matmul_k576_n192_norm_eps1em05_acc"
    assert lib.matmul(576, 192).name == "matmul_k576_n192"
    assert lib.matmul(576, 192, has_bias=True, last_row=True).name == "matmul_k576_n192_bias_last"
    assert lib.rms_norm(576, 1e-5).name != lib.rms_norm(576, 1e-6).name
    assert lib.attention(9, 3, 64, 8192, 2, rope=True, theta=100000.0).name == \
        "attention_h9_kvh3_d64_s8192_l2_rope_theta100000"
    assert lib.rope(9, 64, 100000.0).name == "rope_h9_d64_theta100000"
    assert [lib.add(576).name, lib.mul(576).name, lib.silu(576).name] == ["add_576", "mul_576", "silu_576"]
    names = [f.name for f in lib.functions()]
    assert len(names) == len(set(names)) == 10
    # a second library on the same module never reuses a name
    other = KernelLibrary(module)
    assert other.add(576).name != "add_576"
    noalias = [a for a in lib.matmul(576, 192).args if "noalias" in a.attributes]
    assert len(noalias) == 5


def test_internal_kernels_called_from_an_entry_function(tmp_path, tm):
    """How generated entry points use the library: internal kernels, one exported caller."""
    rng = np.random.default_rng(8)
    module = ir.Module(name="model")
    lib = KernelLibrary(module, linkage="internal")
    D, N = 40, 24
    norm, mm = lib.rms_norm(D, 1e-5), lib.matmul(D, N)
    entry = ir.Function(module, ir.FunctionType(ir.VoidType(), [FPTR, I64, FPTR, FPTR, FPTR, FPTR]), name="entry")
    x, n, nw, w, tmp, out = entry.args
    b = ir.IRBuilder(entry.append_basic_block())
    b.call(norm, [x, n, nw, tmp])
    b.call(mm, [tmp, n, w, ir.Constant(FPTR, None), ir.Constant(FPTR, None), out, ir.Constant(I64, 0),
                ir.Constant(I64, 1)])
    b.ret_void()
    path = link_shared([compile_to_object(module, tm)], tmp_path / f"m_{uuid.uuid4().hex}.so")
    cdll = ctypes.CDLL(str(path))
    assert not hasattr(cdll, mm.name)  # internal: not exported
    xv, nwv, wv = rand(rng, 3, D), rand(rng, D), rand(rng, N, D)
    tv, ov = np.zeros((3, D), f32), np.zeros((3, N), f32)
    cdll.entry(*(ctypes.c_void_p(a.ctypes.data) if i != 1 else ctypes.c_int64(3)
                 for i, a in enumerate([xv, None, nwv, wv, tv, ov])))
    assert_close(ov, ref_rms_norm(xv, nwv, 1e-5) @ wv.T.astype(np.float64))


# the toolchain ---------------------------------------------------------------------

@pytest.mark.parametrize("cpu", ["x86-64-v3", "x86-64", "znver4", "skylake-avx512"])
def test_named_cpus_compile(cpu):
    """Every kernel compiles for named CPUs (what `--target-cpu` would pass), whether or
    not this host could run the result; the kernel tests above run x86-64-v3 code."""
    module = ir.Module(name="kernels")
    lib = KernelLibrary(module)
    lib.embedding(576)
    lib.rms_norm(576, 1e-5)
    lib.matmul(576, 192, has_norm=True, eps=1e-5, has_bias=True, accumulate=True)
    lib.matmul(576, 1000, has_norm=True, eps=1e-5, last_row=True)
    lib.swiglu(576, 1536, has_norm=True, eps=1e-5)
    lib.rope(9, 64, 1e5)
    lib.attention(9, 3, 64, 256, 0, rope=True, theta=1e5)
    lib.attention(9, 3, 64, 256, 1, rope=True, theta=1e5)
    lib.add(576), lib.mul(576), lib.silu(1536)
    obj = compile_to_object(module, target_machine(cpu))
    assert obj[:4] == b"\x7fELF"


def test_unknown_cpu_is_a_clean_error_or_generic():
    # LLVM accepts unknown CPU names with a warning, so only the triple can fail cleanly
    with pytest.raises(ToolchainError):
        target_machine(triple="no-such-arch-unknown-linux")


def test_missing_compiler(tmp_path, tm, monkeypatch):
    module = ir.Module(name="kernels")
    KernelLibrary(module).add(8)
    obj = compile_to_object(module, tm)
    monkeypatch.setenv("CC", "/nonexistent")
    with pytest.raises(ToolchainError) as info:
        link_shared([obj], tmp_path / "k.so")
    assert isinstance(info.value, LlmcError)
    assert "\n" not in str(info.value) and "/nonexistent" in str(info.value)
    assert not (tmp_path / "k.so").exists()


def test_link_failure(tmp_path):
    with pytest.raises(ToolchainError) as info:
        link_shared([b"not an object file"], tmp_path / "k.so")
    assert "\n" not in str(info.value)
    assert not list(tmp_path.glob("*.so")) and not list(tmp_path.glob(".*.tmp"))


@pytest.mark.parametrize("nth", [2, 3, 7])
def test_threads_share_the_work_exactly(tmp_path, tm, nth):
    """Each thread's share, run one after another, gives the single-thread result bit for bit:
    every output element is computed by exactly one thread with the same code."""
    rng = np.random.default_rng(nth)
    K, N, H, KVH, D, S = 40, 23, 6, 3, 8, 16
    lib, (mm, sw, att) = build(tmp_path, tm, lambda k: (k.matmul(K, N, has_norm=True, eps=1e-5, has_bias=True),
                                                        k.swiglu(K, N, has_norm=True, eps=1e-5),
                                                        k.attention(H, KVH, D, S, 0, rope=True)))
    x, w, wu, bias, nw = rand(rng, 5, K), rand(rng, N, K), rand(rng, N, K), rand(rng, N), rand(rng, K)
    for fn, args in ((mm, (x, 5, w, bias, nw)), (sw, (x, 5, w, wu, nw))):
        whole, parts = np.zeros((5, N), f32), np.zeros((5, N), f32)
        lib(fn, *args, whole, 0, 1)
        for tid in range(nth):
            lib(fn, *args, parts, tid, nth)
        np.testing.assert_array_equal(parts, whole)
    q, kk, v = rand(rng, 4, H, D), rand(rng, 4, KVH, D), rand(rng, 4, KVH, D)
    results = []
    for shares in ([(0, 1)], [(tid, nth) for tid in range(nth)]):
        qa, ka, out = q.copy(), kk.copy(), np.zeros((4, H, D), f32)
        kc, vc = np.zeros((1, KVH, S, D), f32), np.zeros((1, KVH, S, D), f32)
        for tid, count in shares:
            lib(att, qa, ka, v, 4, 2, kc, vc, out, tid, count)
        results.append((out, kc, vc, qa))
    for a, b in zip(*results):
        np.testing.assert_array_equal(a, b)
