"""`quantize`: choose each weight's storage type and each matmul's compute mode, from the target.

Storage (`llm.weight @w q4_1`): a GGUF file's quantized tensors keep their stored type;
`--quant T` sets the type of the float tensors, round-to-nearest (a float `T` —
f32, f16, bf16 — applies to quantized tensors too: dequantizing is always allowed; an
integer `T` requantizes them only with `--requantize`), with a per-tensor policy like
llama.cpp's:

- vectors (norms, biases) and the experts' routers (`ffn_gate_inp`) stay f32;
- the token embedding and the LM head (`token_embd`, `output`) stay at q8_0 or above
  unless `--quant-output` says otherwise;
- a tensor whose rows are not whole blocks of `T` falls back (q4_k → q5_0, q5_k → q5_1,
  q6_k → q8_0, int4-gN → int4-g32), else stays in its source type.

Compute (`llm.matmul ... compute a8`): `a8` (activations quantized to int8 per 32
values, integer dot products) for integer-format weights on a target with an integer
dot product (VNNI, or AVX2); `a32` otherwise, and for float weights. `--compute`
forces a mode where the weight allows it. On a CUDA target every matmul is `a32`: the
GEMVs are bandwidth-bound, and dequantizing in registers costs the GPU nothing.

```mlir
%blk_0_attn_q = llm.weight @blk.0.attn_q q4_1 : tensor<576x576xf32>
%l0_q = llm.matmul %l0_attn_in, %blk_0_attn_q compute a8 : (...) -> tensor<?x576xf32>
```
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from xdsl.context import Context
from xdsl.dialects.builtin import ModuleOp
from xdsl.ir import Operation

from llmc.errors import LlmcError, UsageError
from llmc.ir import llm, tgt
from llmc.ir.formats import FORMATS, Storage
from llmc.passes.base import LlmcPass


def output_tensors(function: Operation) -> set[str]:
    """The weights the token embedding and the LM head read (`token_embd`, `output` from GGUF),
    found by the ops that read them, so that every frontend's names are alike."""
    found = set()
    for op in function.walk():
        weight = op.table if isinstance(op, llm.EmbeddingOp) else op.weight if isinstance(op, llm.LogitsOp) else None
        if weight is not None and isinstance(weight.owner, llm.WeightOp):
            found.add(weight.owner.sym_name)
    return found
ROUTERS = (".ffn_gate_inp",)  # a mixture of experts' router: top-k is discontinuous, so it stays f32
FALLBACK = {
    Storage.Q4_K: Storage.Q5_0, Storage.Q5_K: Storage.Q5_1, Storage.Q6_K: Storage.Q8_0,
    Storage.INT4_G64: Storage.INT4_G32, Storage.INT4_G128: Storage.INT4_G32, Storage.INT4_G256: Storage.INT4_G32,
}
COMPUTE_CHOICES = ("auto", "a32", "a8")


def module_target(module: ModuleOp) -> tgt.TargetAttr:
    target = module.attributes.get(tgt.TARGET)
    if not isinstance(target, tgt.TargetAttr):
        raise LlmcError("the module has no tgt.target attribute: compile with --target, or add one to the IR")
    return target


def has_integer_dot(target: tgt.TargetAttr) -> bool:
    """Whether `a8` is the faster mode on `target` (an integer dot-product instruction)."""
    if target.kind.data == "cpu":
        from llmc.backends.cpu.target import integer_isa

        return integer_isa(target) is not tgt.Isa.GENERIC
    return False


def check_compute(compute: str, target: tgt.TargetAttr) -> None:
    """`--compute` for `target`: `a8` needs the CPU's integer kernels (CUDA kernels take float rows)."""
    if target.kind.data == "cuda" and compute == "a8":
        raise UsageError("--compute a8 is for CPU targets: the CUDA kernels take float activations (a32)")


def _parse(text: str, option: str) -> Storage | None:
    if not text:
        return None
    try:
        return Storage.parse(text)
    except ValueError as e:
        raise UsageError(f"{option}: {e}") from None


@dataclass(frozen=True)
class QuantizePass(LlmcPass):
    name = "quantize"
    requires_phase = "optimize"

    quant: str = ""  # storage of the matmul weights; "" keeps the stored types
    quant_output: str = ""  # storage of token_embd / output; "" applies the policy
    requantize: bool = False  # also convert tensors that are already quantized
    compute: str = "auto"

    def storage_for(self, name: str, source: Storage, shape: tuple[int, ...], output: bool = False) -> Storage:
        """The storage a weight gets under this pass's options (`output`: the embedding or LM head's)."""
        quant = _parse(self.quant, "--quant")
        quant_output = _parse(self.quant_output, "--quant-output")
        if len(shape) == 1 or name.endswith(ROUTERS):
            return Storage.F32
        if output:
            wanted = quant_output or (quant if quant is None or quant.is_float or FORMATS[quant].bits == 8
                                else Storage.Q8_0)
        else:
            wanted = quant
        if wanted is None or wanted is source:
            return source
        if not source.is_float and not wanted.is_float and not self.requantize:
            return source  # requantize only when asked
        k = shape[-1]
        while not FORMATS[wanted].fits(k) and wanted in FALLBACK:
            wanted = FALLBACK[wanted]
        return wanted if FORMATS[wanted].fits(k) else source

    def run(self, ctx: Context, module: ModuleOp) -> None:
        if self.compute not in COMPUTE_CHOICES:
            raise UsageError(f"--compute must be one of {', '.join(COMPUTE_CHOICES)}, got '{self.compute}'")
        target = module_target(module)
        check_compute(self.compute, target)
        integer_dot = has_integer_dot(target)
        for function in self.functions(module):
            outputs = output_tensors(function)
            for op in function.walk():
                if isinstance(op, llm.WeightOp):
                    shape = tuple(d for d in llm.shape_of(op.result) if d is not None)
                    op.storage = llm.StorageAttr(self.storage_for(op.sym_name, op.storage.data, shape,
                                                                  op.sym_name in outputs))
            for op in function.walk():
                if isinstance(op, llm.Projection):
                    op.compute = llm.ComputeAttr(self.mode_for(op, integer_dot))

    def mode_for(self, op: llm.Projection, integer_dot: bool) -> llm.Compute:
        weight = op.weight if not isinstance(op, llm.SwigluOp) else op.gate
        owner = weight.owner
        storage = owner.storage.data if isinstance(owner, llm.WeightOp) else Storage.F32
        k = llm.shape_of(op.input)[-1]
        possible = not storage.is_float and k is not None and k % 32 == 0
        wants_a8 = self.compute == "a8" or (self.compute == "auto" and integer_dot)
        return llm.Compute.A8 if possible and wants_a8 else llm.Compute.A32


def summary(module: ModuleOp) -> str:
    """`q4_1 ×210, q8_0 ×1, f32 ×61; a8 ×211`: what `quantize` chose (first function)."""
    storages: Counter[str] = Counter()
    modes: Counter[str] = Counter()
    for function in LlmcPass.functions(module)[:1]:
        for op in function.walk():
            if isinstance(op, llm.WeightOp):
                storages[op.storage.data.value] += 1
            elif isinstance(op, llm.Projection):
                modes[op.mode.value] += 1
    weights = ", ".join(f"{s} ×{c}" for s, c in storages.most_common())
    return f"{weights}; " + ", ".join(f"{m} ×{c}" for m, c in modes.most_common())
