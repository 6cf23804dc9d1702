"""`fuse-norm`: decode's projections RMS-normalize and quantize their own rows (`quantize` on
`tgt.matmul` / `tgt.swiglu`, and `tgt.qkv` for an attention's three), each thread into rows of its
own, instead of waiting at a barrier for a `tgt.rms_norm`'s: the same bytes, so the same logits,
with fewer barriers."""

from __future__ import annotations

import re

import host
import numpy as np
import pytest
from tiny_models import TinySpec
from xdsl.dialects.builtin import DenseArrayBase, i32
from xdsl.utils.exceptions import VerifyException

from llmc.backends.cpu.target import cpu_target
from llmc.driver import BackendOptions, compile_model, run_phases, target_attr
from llmc.frontend import load_model
from llmc.ir import find_function, tgt
from llmc.ir.text import parse_module, print_module
from llmc.ir.tgt import Isa
from llmc.passes.fuse_norm import MAX_ROWS
from llmc.passes.pipeline import CompileOptions
from llmc.runtime.session import Session

# integer projections (q4_1, the LM head q8_0: quantized rows), a head dimension of 32, GQA
STORAGE = (("token_embd", "q8_0"), *((k, "q4_1") for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                             "ffn_up", "ffn_down")))
SPEC = TinySpec(hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=128, context_length=64, gguf_storage=STORAGE)
# Gemma 3: norms after attention and the feed-forward too (into float rows: not fused), q/k norms, GELU
GEMMA3 = TinySpec(arch="gemma3", hidden=64, heads=4, kv_heads=1, head_dim=32, ffn=128, context_length=64,
                  layer_types=("sliding_attention", "full_attention"), sliding_window=5, gguf_storage=STORAGE)
# Qwen2: q, k and v biased
QWEN2 = TinySpec(arch="qwen2", hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=128, context_length=64,
                 gguf_storage=STORAGE)
PROMPT, DECODED, DRAFT = [5, 17, 42, 100, 7], [150, 9, 11, 200], [3, 31, 8]


def _lowered(tiny, spec: TinySpec = SPEC, **options):
    """Prefill chunks of 32 rows: more than `fuse_norm.MAX_ROWS`."""
    model = load_model(str(tiny(spec, "gguf")))
    options = CompileOptions(max_seq=64, prefill_chunk=32, kv_type="f32", compute="a8", **options)
    return run_phases(model, options, "lower", None, lambda _: None, target_attr(BackendOptions(cpu="native")))


def _kernels(module, stage: str) -> list:
    return [op for op in find_function(module, stage).body.block.ops if isinstance(op, tgt.Kernel)]


def test_decode_norms_fold_into_their_projections_and_prefill_keeps_them(tiny):
    module = _lowered(tiny)
    decode = _kernels(module, "decode")
    assert not any(isinstance(op, tgt.RMSNormOp) for op in decode)
    fused = [op for op in decode if isinstance(op, tgt.Projection) and op.quantize is not None]
    assert len(fused) == 2 * SPEC.layers + 1  # q/k/v, gate/up per layer; the LM head
    assert sum(isinstance(op, tgt.QkvOp) for op in fused) == SPEC.layers
    assert MAX_ROWS < 32
    assert all(not tgt.is_quantized(op.x) and op.norm is not None for op in fused)
    prefill = _kernels(module, "prefill")
    assert sum(isinstance(op, tgt.RMSNormOp) for op in prefill) == 2 * SPEC.layers + 1
    assert not any(getattr(op, "quantize", None) is not None for op in prefill)
    unfused = _kernels(_lowered(tiny, fuse_norm=False), "decode")
    assert sum(isinstance(op, tgt.RMSNormOp) for op in unfused) == 2 * SPEC.layers + 1


def test_qkv_prints_parses_back_and_checks_its_operands(tiny):
    """Qwen2's biased q, k and v as one `tgt.qkv` each layer, through its text form; a `tgt.qkv` whose outputs do
    not fit its weights, or that writes one buffer twice, or biases some outputs only, fails to verify."""
    module = _lowered(tiny, QWEN2)
    qkv = [op for op in _kernels(module, "decode") if isinstance(op, tgt.QkvOp)]
    assert len(qkv) == QWEN2.layers and all(None not in (op.bq, op.bk, op.bv) for op in qkv)
    text = print_module(module)
    assert "tgt.qkv" in text and print_module(parse_module(text)) == text
    op = qkv[0]
    q, k, v = op.q, op.k, op.v
    assert q.type != k.type == v.type  # (4 heads, 2 kv heads)

    def qkv_op(outs, segments=None) -> tgt.QkvOp:
        new = tgt.QkvOp(op.x, (op.wq, op.wk, op.wv), outs, op.rows, biases=(op.bq, op.bk, op.bv), norm=op.norm,
                        eps=op.eps, quantize=op.quantize, isa=op.isa)
        if segments is not None:  # v's bias dropped
            new.operands = [*new.operands[:-2], new.operands[-1]]
            new.properties["operandSegmentSizes"] = DenseArrayBase.from_list(i32, segments)
        return new

    qkv_op((q, k, v)).verify()
    for message, bad in {"output width (weight vs out) mismatch: 128 vs 64": qkv_op((k, q, v)),
                         "q, k and v must be three buffers": qkv_op((q, k, k)),
                         "'bias' takes a bias for each of q, k and v": qkv_op((q, k, v), (1,) * 10 + (0, 1))}.items():
        with pytest.raises(VerifyException, match=re.escape(message)):
            bad.verify()


def _logits(out, threads: int) -> list[np.ndarray]:
    session = Session(out, threads=threads)
    try:
        got = [session.feed(PROMPT)]
        got += [session.feed([token]) for token in DECODED]
        got.append(session.verify([DECODED[-1], *DRAFT]).copy())
        return got
    finally:
        session.close()


PATHS = [(SPEC, cpu, compute) for cpu in ("native", *(host.ISA_CPUS[isa] for isa in (Isa.AVX2, Isa.AMX, Isa.VNNI256)))
         for compute in ("a8", "a16")] + [(GEMMA3, "native", "a8"), (QWEN2, "native", "a16"),
                                          (SPEC, host.ISA_CPUS[Isa.GENERIC], "a16")]


@pytest.mark.parametrize(("spec", "cpu", "compute"), PATHS, ids=lambda v: getattr(v, "arch", v))
def test_fused_decode_gives_the_unfused_logits_bit_for_bit(artifact, spec, cpu, compute):
    """Decode and verify (its 4 rows fused too) on every integer path, int8 and int16 rows, 1 and 2 threads (q, k
    and v in one `tgt.qkv`, biased in Qwen2)."""
    if cpu != "native":
        host.skip_unless_another_path(cpu)
    fused = artifact(spec, cpu=cpu, compute=compute, exact_logits=True)  # (a screened LM head: test_screen_logits)
    unfused = artifact(spec, cpu=cpu, compute=compute, fuse_norm=False)
    for threads in (1, 2):
        for a, b in zip(_logits(fused, threads), _logits(unfused, threads)):
            np.testing.assert_array_equal(a, b)


def test_amx_code_fuses_too(tiny):
    """An AMX target's decode takes the fused projections as well (checked here without running it)."""
    model = load_model(str(tiny(SPEC, "gguf")))
    options = CompileOptions(max_seq=32, prefill_chunk=4, kv_type="f32", compute="a8")
    target = target_attr(BackendOptions(cpu=host.ISA_CPUS[Isa.AMX]))
    assert "amx-int8" in cpu_target(host.ISA_CPUS[Isa.AMX]).features
    decode = _kernels(run_phases(model, options, "lower", None, lambda _: None, target), "decode")
    assert not any(isinstance(op, tgt.RMSNormOp) for op in decode)


def _decode_barriers(tiny, tmp_path, **options) -> int:
    lines: list[str] = []
    compile_model(str(tiny(SPEC, "gguf")), tmp_path / str(len(options)),
                  CompileOptions(max_seq=32, prefill_chunk=4, kv_type="f32", compute="a8", **options),
                  BackendOptions(cpu="native"), progress=lines.append)
    return int(re.search(r"barriers per call: decode (\d+)", "\n".join(lines)).group(1))


def test_each_fused_norm_is_a_barrier_fewer(tiny, tmp_path):
    assert _decode_barriers(tiny, tmp_path, fuse_norm=False) - _decode_barriers(tiny, tmp_path) == 2 * SPEC.layers + 1
