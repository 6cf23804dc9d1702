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

Compute (`llm.matmul ... compute a8`), for integer-format weights on a target with an
integer dot product (VNNI, or AVX2): `a8` (activations quantized to int8 per 32 values,
integer dot products) or `a16` (int16 per 32, as two int8 planes: twice the dot products,
the same weight bytes); `a32` otherwise, and for float weights. `--compute auto` (the
default) calibrates (`calibrate`: the error each mode adds to each projection's output) and
gives `a16` to the projections where it removes the most error, within a budget:
decode reads every weight once per token, so with `a16` costing `f` times `a8` on the target
(the target description's `a16_cost`), `Σ (f − 1) · weight bytes ≤ 40% · Σ weight bytes` (and
prefill, by multiply-adds, within 70%). It
chooses per group of projections that read one value (q, k and v; gate and up), so one
kernel quantizes the rows they share; the error `a16` removes ranks them (`gain`). Without
calibration tokens and weights (`llmc opt`, or a phase run alone) the ranking is by output
width alone, so where the budget takes every group (AVX2, VNNI) the modes are the same. `--compute a8|a16|a32` forces one mode where the weight allows it. On a
CUDA target every matmul is `a32`: the GEMVs are bandwidth-bound, and dequantizing in
registers costs the GPU nothing.

```mlir
%blk_0_attn_q = llm.weight @blk.0.attn_q q4_1 : tensor<576x576xf32>
%l0_q = llm.matmul %l0_attn_in, %blk_0_attn_q compute a16 {llm.error = {a8 = 3.1e-04 : f64, a16 = 5.2e-09 : f64}} : (...) -> tensor<?x576xf32>
```
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from xdsl.context import Context
from xdsl.dialects.builtin import DictionaryAttr, FloatAttr, IntegerAttr, ModuleOp, f64, i64
from xdsl.ir import Operation, SSAValue

from llmc.errors import UsageError
from llmc.ir import llm, tgt
from llmc.ir.formats import FORMATS, Storage
from llmc.ir.target import TargetDescription, module_target, target_description
from llmc.ir.weights import WeightStore
from llmc.passes.base import LlmcPass
from llmc.passes.calibrate import measure, read_calibration, weight_ops

if TYPE_CHECKING:
    from llmc.passes.pipeline import CompileOptions


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
COMPUTE_CHOICES = ("auto", "a32", "a8", "a16")
# `auto`'s budget over all-a8: decode within 40% and prefill within 70%. The a16 of every x86
# integer path fits whole (AVX2: decode 1.35×, prefill 1.55×; VNNI-256 1.4×, 1.65×; VNNI-512 1.05×,
# 1.25×; AMX, a tile product per plane, prefill 1.3×): on SmolLM2 nothing less answers
# like fp32 (widening 25–90% of the layers, or all layers but the LM head, left 22–31 of 42 chat
# answers equal, against 24 for all-a8 and 41 for all-a16; an AMX default that kept 135 of 211
# projections a8 answered 8 of 13).
DECODE_BUDGET = 0.40
PREFILL_BUDGET = 0.70
ERROR = "llm.error"  # a projection's measured relative output error per mode (discardable)
CALIBRATED = "llm.calibration_tokens"  # on the module: the tokens `auto` calibrated on


def check_compute(compute: str, target: tgt.TargetAttr) -> None:
    """`--compute` for `target`: one of the modes its kernels run (CUDA kernels take float rows)."""
    target_description(target).check_compute(compute)


def check_calibrate(options: CompileOptions) -> None:
    """`--calibrate FILE`: for `--compute auto`, a readable UTF-8 text."""
    if options.calibrate:
        if options.compute != "auto":
            raise UsageError(f"--calibrate is for --compute auto (--compute {options.compute} calibrates nothing)")
        read_calibration(options.calibrate)


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
    weights: WeightStore | None = field(default=None, compare=False, hash=False)  # for calibration
    tokens: tuple[int, ...] = ()  # calibration tokens (`calibrate.calibration_tokens`); none: `auto` ranks by width

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
        target = target_description(module_target(module))
        target.check_compute(self.compute)
        integer_dot = target.has_integer_dot()
        measurable = self.weights is not None and bool(self.tokens)
        auto = self.compute == "auto" and integer_dot
        calibrated = False
        for function in self.functions(module):
            outputs = output_tensors(function)
            for op in function.walk():
                if isinstance(op, llm.WeightOp):
                    shape = tuple(d for d in llm.shape_of(op.result) if d is not None)
                    op.storage = llm.StorageAttr(self.storage_for(op.sym_name, op.storage.data, shape,
                                                                  op.sym_name in outputs))
            projections = [op for op in function.walk() if isinstance(op, llm.Projection)]
            modes = [self.mode_for(op, integer_dot) for op in projections]
            if auto and any(m.integer for m in modes):
                errors = self.calibrate(function, projections) if measurable else [None] * len(projections)
                calibrated |= measurable
                modes = auto_modes(projections, modes, errors, target)
            for op, mode in zip(projections, modes, strict=True):
                op.compute = llm.ComputeAttr(mode)
        if calibrated:  # (float weights only: nothing to choose, nothing measured)
            module.attributes[CALIBRATED] = IntegerAttr(len(self.tokens), i64)

    def mode_for(self, op: llm.Projection, integer_dot: bool) -> llm.Compute:
        """The mode `--compute` gives `op` before `auto` chooses: the one asked where the weight
        allows an integer mode (`auto`: a8 on a target with an integer dot product), else a32."""
        if not integer_possible(op):
            return llm.Compute.A32
        if self.compute == "auto":
            return llm.Compute.A8 if integer_dot else llm.Compute.A32
        return llm.Compute(self.compute)

    def calibrate(self, function, projections: list[llm.Projection]) -> list[dict[llm.Compute, float] | None]:
        """Each projection's measured errors (`calibrate.measure` on the tokens), recorded as `llm.error`."""
        assert self.weights is not None
        errors = measure(function, self.weights, self.tokens)
        for op, error in zip(projections, errors, strict=True):
            if error is not None:
                op.attributes[ERROR] = DictionaryAttr({m.value: FloatAttr(e, f64) for m, e in error.items()})
        return errors


def auto_modes(projections: list[llm.Projection], modes: list[llm.Compute],
               errors: list[dict[llm.Compute, float] | None], target: TargetDescription) -> list[llm.Compute]:
    """`auto`'s modes: `a16` for the groups of integer projections (one group per input value) that
    gain the most (`gain`) within the decode and prefill budgets (decode reads each weight once per
    token; prefill multiplies each once per row), `modes` for the rest."""
    groups: dict[SSAValue, list[int]] = {}
    for i, op in enumerate(projections):
        if modes[i].integer:
            groups.setdefault(op.input, []).append(i)
    prefill, decode = target.a16_cost()
    members = list(groups.values())
    items = [(sum(gain(projections[i], errors[i]) for i in group),
              ((decode - 1) * sum(weight_bytes(projections[i]) for i in group),
               (prefill - 1) * sum(weight_elements(projections[i]) for i in group))) for group in members]
    budgets = (DECODE_BUDGET * sum(weight_bytes(op) for op in projections),
               PREFILL_BUDGET * sum(weight_elements(op) for op in projections))
    wide = {i for g in choose_wider(items, budgets) for i in members[g]}
    return [llm.Compute.A16 if i in wide else mode for i, mode in enumerate(modes)]


def gain(op: llm.Projection, error: dict[llm.Compute, float] | None) -> float:
    """What `a16` removes from `op`'s output, as `auto` ranks it: the drop in relative error times
    the values per row it affects. A relative error is the share of each output value that is
    noise (so wide activations weigh no more than narrow ones); the width counts how many values
    carry that noise on to the next op. Uncalibrated (`error` None), every value counts alike: the
    width alone. (A local measure: the error spreads over all layers, so `auto` widens as much as
    the budget allows rather than only the worst layers.)"""
    drop = 1.0 if error is None else error[llm.Compute.A8] - error[llm.Compute.A16]
    return drop * output_width(op)


def integer_possible(op: llm.Projection) -> bool:
    """Whether `op` can compute on quantized rows: integer-format weights, rows of whole 32-blocks."""
    weights = weight_ops(op)
    k = llm.shape_of(op.input)[-1]
    return bool(weights) and not any(w.storage.data.is_float for w in weights) and k is not None and k % 32 == 0


def output_width(op: llm.Projection) -> int:
    """Values per row `op` writes (gate and up both, for `llm.swiglu`)."""
    return sum(llm.shape_of(w.result)[0] or 0 for w in weight_ops(op))


def weight_bytes(op: llm.Projection) -> int:
    """Bytes of `op`'s weights in their storage (what decode reads per token); 0 where computed."""
    return sum(FORMATS[w.storage.data].nbytes(_shape(w)) for w in weight_ops(op))


def weight_elements(op: llm.Projection) -> int:
    """Multiply-adds per row of `op` (what prefill computes); 0 where its weight is computed."""
    return sum(math.prod(_shape(w)) for w in weight_ops(op))


def _shape(w: llm.WeightOp) -> tuple[int, ...]:
    return tuple(d or 0 for d in llm.shape_of(w.result))


def choose_wider(items: list[tuple[float, tuple[float, ...]]], budgets: tuple[float, ...]) -> list[int]:
    """The items `(gain, costs)` to take within every budget (one per cost), greedily by gain per
    cost (the costs as shares of their budgets, the largest share counting; free items first): a
    knapsack whose items are small against the budgets. Indices, in the order taken.

        choose_wider([(3.0, (2.0,)), (1.0, (2.0,)), (0.5, (0.0,))], (3.0,))   # [2, 0]
    """
    def priority(item: tuple[float, tuple[float, ...]]) -> float:
        value, costs = item
        share = max((c / b if b > 0 else (math.inf if c > 0 else 0.0)) for c, b in zip(costs, budgets, strict=True))
        return value / share if share > 0 else math.inf

    order = sorted(range(len(items)), key=lambda i: -priority(items[i]))
    taken, spent = [], [0.0] * len(budgets)
    for i in order:
        value, costs = items[i]
        # (1 + 1e-9): a16 at exactly the budget's factor, (1.2 − 1) · Σ = 0.2 · Σ, takes everything
        if value > 0 and all(s + c <= b * (1 + 1e-9) for s, c, b in zip(spent, costs, budgets, strict=True)):
            taken.append(i)
            spent = [s + c for s, c in zip(spent, costs, strict=True)]
    return taken


def weight_storages(module: ModuleOp) -> dict[str, Storage]:
    """Each weight's storage (first function), by name: what `quantize` starts from."""
    return {op.sym_name: op.storage.data for function in LlmcPass.functions(module)[:1]
            for op in function.walk() if isinstance(op, llm.WeightOp)}


def unapplied(module: ModuleOp, before: dict[str, Storage], compute: str, quant: str, requantize: bool) -> list[str]:
    """What of `--compute` and `--quant` quantize found nothing to apply to, one note each: an integer `--compute`
    where no projection's weights are integer (a float model without `--quant`), and a `--quant` that left
    quantized weights in their own types (without `--requantize`)."""
    notes = []
    modes = {op.mode for function in LlmcPass.functions(module)[:1] for op in function.walk()
             if isinstance(op, llm.Projection)}
    if compute in ("a8", "a16") and not any(m.integer for m in modes):
        notes.append(f"--compute {compute} is for integer weights, and this model's projections are float: they "
                     f"run a32 (--quant q8_0, say, makes them integer)")
    wanted = _parse(quant, "--quant")
    if wanted is not None and not wanted.is_float and not requantize:
        outputs = set().union(*map(output_tensors, LlmcPass.functions(module)[:1]))  # (--quant-output's)
        kept = sorted({s.value for name, s in weight_storages(module).items()
                       if s is before.get(name) and not s.is_float and s is not wanted and name not in outputs})
        if kept:
            notes.append(f"--quant {quant} converts float weights; this model's {', '.join(kept)} ones keep their "
                         f"types (--requantize converts them too)")
    return notes


def summary(module: ModuleOp) -> str:
    """What `quantize` chose (first function), e.g. `q4_1 ×210, f32 ×61, q8_0 ×1; a16 ×150, a8 ×61;
    est. decode 1.04×, prefill 1.19× of a8 (calibrated on 128 tokens)`: the estimates (where a
    projection is `a16`) weigh each one's `a16_cost` by its weight bytes (decode) and its
    multiply-adds (prefill)."""
    storages: Counter[str] = Counter()
    modes: Counter[str] = Counter()
    projections = []
    for function in LlmcPass.functions(module)[:1]:
        for op in function.walk():
            if isinstance(op, llm.WeightOp):
                storages[op.storage.data.value] += 1
            elif isinstance(op, llm.Projection):
                modes[op.mode.value] += 1
                projections.append(op)
    weights = ", ".join(f"{s} ×{c}" for s, c in storages.most_common())
    text = f"{weights}; " + ", ".join(f"{m} ×{c}" for m, c in modes.most_common())
    target = module.attributes.get(tgt.TARGET)
    if modes[llm.Compute.A16.value] and isinstance(target, tgt.TargetAttr):
        prefill, decode = target_description(target).a16_cost()
        estimates = [f"{what} {_relative(projections, size, factor):.2f}×"
                     for what, size, factor in (("decode", weight_bytes, decode), ("prefill", weight_elements, prefill))]
        text += f"; est. {', '.join(estimates)} of a8"
    calibrated = module.attributes.get(CALIBRATED)
    if isinstance(calibrated, IntegerAttr):
        text += f" (calibrated on {calibrated.value.data} tokens)"
    return text


def _relative(projections: list[llm.Projection], size, factor: float) -> float:
    """The cost of the projections' modes over all-`a8`'s, each weighted by `size(op)`."""
    total = sum(size(op) for op in projections)
    return sum(size(op) * (factor if op.mode is llm.Compute.A16 else 1.0) for op in projections) / max(total, 1)
