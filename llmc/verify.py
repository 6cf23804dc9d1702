"""`llmc verify`: run every stage on the same tokens and compare its logits with the source model.

One row per stage, like TPU-MLIR's per-stage tensor comparison:

    stage     cosine     max|err|   KL         top-1        step       needs
    source    reference  (transformers 5.24.0 fp32)
    llm       1.000000   7.72e-05   0.000000   5/5 (100%)   1.000000   cos ≥ 0.9999
    quantize  0.998702   0.913      0.004031   5/5 (100%)   0.998702   cos ≥ 0.99 (a8 activations)
    tgt       0.998702   0.913      0.004031   5/5 (100%)   1.000000   cos ≥ 0.99, step ≥ 0.9999
    artifact  0.998231   0.951      0.004102   5/5 (100%)   0.997551   cos ≥ 0.99

`llm` runs the fp32 graph (`@forward` after optimize) on the whole prompt. `quantize`
runs the graph after the quantize phase (the chosen storage types; activations through
int8 for `a8` matmuls, multiplied by the weight codes as the kernels do it), `tgt` the
numpy kernels over the planned arena and the packed weights, `artifact` the compiled
code; these three go teacher-forced, one token at a time (the entry points `prefill`
then `decode`). Every row is compared with the source model: the lowest cosine
similarity over positions, the max abs error, the mean KL divergence from the
source's next-token distribution, and the positions whose arg-max agrees; `step` is
the cosine against the stage before.

The tolerances (`needs`) are stated per mode:

- stages in fp32 (no weight changed type, no activation quantized): cos ≥ 0.9999
  (`--tolerance`), and each step too;
- with `a8` (or `a16`) activations, or weights requantized from float: lower bounds against the
  source (by the coarsest choice); `tgt` must still reproduce `quantize` (step ≥ 0.9999:
  the same integer arithmetic, so lowering, packing and the memory plan are checked
  exactly). The compiled `a8` kernels' last float bits differ from numpy's, and an
  activation one bit from an int8 rounding tie can round the other way, which later
  layers carry on: the artifact's step is shown, and held to the bound against the source.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from llmc.runtime.perplexity import kl_divergence, log_softmax

A8_ACTIVATIONS = 0.99
A16_ACTIVATIONS = 0.999  # int16 activations: a8's error / ~65000, but still not fp32's arithmetic
REQUANTIZED = {8: 0.999, 6: 0.99, 5: 0.99, 4: 0.97}  # by the fewest code bits of a requantized weight
BF16 = 0.9995  # weights rounded to bf16 (8 mantissa bits); f16's 11 bits keep the fp32 bound


@dataclass(frozen=True)
class Agreement:
    """How one stage's logits `[T, vocab]` compare with the reference's."""

    cosine: float
    max_abs_error: float
    kl: float
    top1_agree: int
    positions: int

    @classmethod
    def between(cls, logits: np.ndarray, reference: np.ndarray) -> Agreement:
        a, b = logits.astype(np.float64), reference.astype(np.float64)
        return cls(
            cosine=min_cosine(a, b),
            max_abs_error=float(np.abs(a - b).max()),
            kl=float(kl_divergence(log_softmax(b), log_softmax(a)).mean()),
            top1_agree=int((a.argmax(-1) == b.argmax(-1)).sum()),
            positions=a.shape[0],
        )

    def row(self, stage: str, step: float, needs: str) -> str:
        pct = 100.0 * self.top1_agree / self.positions
        top1 = f"{self.top1_agree}/{self.positions} ({pct:.0f}%)"
        return (f"{stage:<9} {self.cosine:<10.6f} {self.max_abs_error:<10.3g} {self.kl:<10.6f} {top1:<12} "
                f"{step:<10.6f} {needs}")


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    norms = np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1)
    return float((np.sum(a * b, axis=-1) / np.maximum(norms, 1e-30)).min())


@dataclass(frozen=True)
class Stage:
    name: str
    tolerance: float  # lowest cosine against the source
    step_tolerance: float | None  # lowest cosine against the stage before, when it is held to one
    why: str
    compute: Callable[[], np.ndarray]

    @property
    def needs(self) -> str:
        text = f"cos ≥ {self.tolerance}"
        if self.step_tolerance is not None and self.step_tolerance > self.tolerance:
            text += f", step ≥ {self.step_tolerance}"
        return text + (f" ({self.why})" if self.why else "")


def verify_stages(reference: np.ndarray, stages: list[Stage], reference_label: str,
                  emit: Callable[[str], None]) -> bool:
    """Print the table; True when every stage reaches its tolerances."""
    emit(f"{'stage':<9} {'cosine':<10} {'max|err|':<10} {'KL':<10} {'top-1':<12} {'step':<10} needs")
    emit(f"{'source':<9} {'reference':<10} ({reference_label})")
    previous = reference
    ok = True
    for stage in stages:
        logits = stage.compute()
        agreement = Agreement.between(logits, reference)
        step = min_cosine(logits.astype(np.float64), previous.astype(np.float64))
        emit(agreement.row(stage.name, step, stage.needs))
        ok &= agreement.cosine >= stage.tolerance
        ok &= stage.step_tolerance is None or step >= stage.step_tolerance
        previous = logits
    return ok


def teacher_forced(feed: Callable[[list[int], int], np.ndarray], tokens: list[int]) -> np.ndarray:
    """Logits `[T, vocab]` from an entry-point runner: prefill the first token, decode the rest."""
    return np.stack([feed(tokens[:1], 0)] + [feed([t], i) for i, t in enumerate(tokens[1:], 1)])


def quantize_tolerance(module, model, fp32_tolerance: float) -> tuple[float, str]:
    """The tolerance of the quantize stage against fp32, from what `quantize` chose."""
    from llmc.ir import llm
    from llmc.ir.formats import FORMATS, Storage

    tolerance, why = fp32_tolerance, []
    modes = {op.mode for op in module.walk() if isinstance(op, llm.Projection)}
    for mode, bound in ((llm.Compute.A8, A8_ACTIVATIONS), (llm.Compute.A16, A16_ACTIVATIONS)):
        if mode in modes:
            tolerance = min(tolerance, bound)
            why.append(f"{mode} activations")
    changed = [op.storage.data for op in module.walk()
               if isinstance(op, llm.WeightOp) and op.storage.data is not model.weights[op.sym_name].storage]
    if Storage.BF16 in changed:
        tolerance = min(tolerance, BF16)
        why.append("weights rounded to bf16")
    bits = [FORMATS[s].bits for s in changed if not s.is_float]
    if bits:
        tolerance = min(tolerance, REQUANTIZED[min(bits)])
        why.append(f"weights requantized to {min(bits)} bits")
    return tolerance, ", ".join(why)


def graph_reference(source: Path, tokens: list[int], allow_pickle: bool) -> tuple[np.ndarray, str]:
    """An exported graph's own reference logits, and its name: onnxruntime for `.onnx`, torch eager for `.pt2`."""
    from llmc.frontend.reference import onnx_logits, torch_program_logits

    if source.suffix == ".onnx":
        import onnxruntime

        return onnx_logits(source, tokens), f"onnxruntime {onnxruntime.__version__}"
    import torch

    return torch_program_logits(source, tokens, allow_pickle), f"torch {torch.__version__.split('+')[0]} eager"


def per_layer_rows(module, weights, tokens: list[int]) -> list[str]:
    """`--per-layer`: one row per projection of the quantized `module` — its weight, the mode
    `quantize` chose, and the relative output error of `a8` and `a16` measured on `tokens`
    (`calibrate.measure`)."""
    from llmc.ir import find_function, llm
    from llmc.passes.calibrate import measure, weight_ops

    forward = find_function(module, "forward")
    projections = [op for op in forward.walk() if isinstance(op, llm.Projection)]
    rows = [f"{'projection':<24} {'mode':<5} {'a8 error':<10} a16 error"]
    for op, error in zip(projections, measure(forward, weights, tokens), strict=True):
        name = "+".join(w.sym_name for w in weight_ops(op)) or op.name
        errors = ([f"{error[m]:<10.2e}" for m in (llm.Compute.A8, llm.Compute.A16)] if error is not None
                  else ["-", "-"])
        rows.append(f"{name:<24} {op.mode.value:<5} {' '.join(errors)}".rstrip())
    return rows


def verify_model(spec: str, prompt: str, tolerance: float, artifact: Path | None, emit: Callable[[str], None],
                 progress: Callable[[str], None], allow_pickle: bool = False, options=None,
                 cpu: str = "native", reference_source: Path | None = None, tokenizer: str | None = None,
                 per_layer: bool = False) -> bool:
    """Print the model, the prompt and one row per stage; True when every stage passes. The reference
    is transformers on the model's own file, or on `reference_source` (an HF directory of it); for
    an exported graph, torch eager (`.pt2`) or onnxruntime (`.onnx`) on the graph. With `per_layer`,
    then one row per projection (`per_layer_rows`)."""
    from llmc.driver import BackendOptions, build_artifact, check_raisings_apply, describe_graph, target_attr
    from llmc.errors import UsageError
    from llmc.frontend import import_model, load_model
    from llmc.frontend.reference import check_unpickled, reference_logits, reference_name
    from llmc.ir import find_function, tgt
    from llmc.ir.interpreter import KVCache, forward_logits
    from llmc.ir.tgt_interpreter import KernelWeights, cache_for, run_entry
    from llmc.passes.calibrate import calibration_for
    from llmc.passes.pipeline import CompileOptions, run_phase
    from llmc.passes.quantize import check_calibrate, summary
    from llmc.runtime.artifact import load_manifest
    from llmc.runtime.session import open_session

    if not 0.0 < tolerance <= 1.0:
        raise UsageError(f"--tolerance must be in (0, 1], got {tolerance}")
    if reference_source is not None and not (reference_source / "config.json").is_file():
        raise UsageError(f"--reference {reference_source}: not a Hugging Face model directory (no config.json)")
    if reference_source is not None:
        check_unpickled(reference_source, allow_pickle)
    backend = BackendOptions(cpu=cpu)
    target = target_attr(backend)
    if artifact is not None:  # rebuild the stages the artifact was compiled with, for the target it was built for
        manifest = load_manifest(artifact).data
        built = manifest["compile_options"]
        options = CompileOptions(**{k: built[k] for k in CompileOptions.__dataclass_fields__ if k in built})
        if manifest["target"] == "cuda":
            from llmc.backends.cuda.target import ARCH

            target = tgt.TargetAttr("cuda", ARCH, manifest["gpu"]["arch"], manifest["gpu"]["features"])
        else:
            target = tgt.TargetAttr("cpu", target.arch.data, manifest["cpu"]["name"], manifest["cpu"]["features"])
    options = options or CompileOptions()
    check_calibrate(options)
    model = load_model(spec, allow_pickle, tokenizer)
    check_raisings_apply(model, options)
    tokens = model.tokenizer.encode(prompt)
    if not tokens:
        raise UsageError("--prompt gives no tokens")
    if artifact is not None and len(tokens) > manifest["kv_cache"]["capacity"]:
        raise UsageError(f"--prompt is {len(tokens)} tokens; the KV cache of --artifact {artifact} holds "
                         f"{manifest['kv_cache']['capacity']} (a shorter --prompt, or compile with a larger --max-seq)")
    module = import_model(model)
    module.attributes[tgt.TARGET] = target
    for phase in ("import", "optimize"):
        run_phase(module, phase, options=options, weights=model.weights)
    graph_note = f"; {describe_graph(model, module)}" if model.graph is not None else ""
    c = model.config  # (a graph's: from the raised IR)
    if len(tokens) > c.context_length:  # (before the reference)
        raise UsageError(f"--prompt is {len(tokens)} tokens; {model.source.name}'s context is {c.context_length} "
                         f"(a shorter --prompt)")
    if artifact is not None and (other := c.other_than(manifest["model"])):  # (before the reference: another
        name, recorded, ours = other  # model's artifact is a mistake, not a fidelity loss)
        raise UsageError(f"--artifact {artifact} is of another model: its {name} is {recorded!r}, "
                         f"{model.source.name}'s is {ours!r}")
    emit(f"model    {model.source} ({c.arch}, {c.layers} layers, hidden {c.hidden}, vocab {c.vocab_size}{graph_note})")
    emit(f"prompt   {prompt!r} ({len(tokens)} tokens)")
    if reference_source is not None:
        emit(f"reference {reference_source}")
    start = time.perf_counter()
    if model.graph is not None:
        reference, name = graph_reference(model.source, tokens, allow_pickle)
    else:
        reference, name = reference_logits(reference_source or model.source, tokens, allow_pickle), reference_name()
    progress(f"reference computed in {time.perf_counter() - start:.1f} s")

    max_seq = min(c.context_length, max(64, len(tokens)))
    options = replace(options, prefill_chunk=min(128, max_seq), max_seq=max_seq)
    llm_logits = forward_logits(module, model.weights, tokens)
    run_phase(module, "quantize", options=options, weights=model.weights,
              tokens=calibration_for(model, options, target))
    emit(f"quantize {summary(module)}")
    quantized = module.clone()
    cache_type = find_function(quantized, "forward").function_type.inputs.data[2]
    quantized_cache = KVCache.zeros(KVCache.for_type(cache_type, max_seq).keys.shape, options.kv_type)  # as split sets it
    q_tolerance, why = quantize_tolerance(module, model, tolerance)
    for phase in ("split", "group", "lower"):
        run_phase(module, phase, options=options)
    entries = {name: find_function(module, name) for name in ("prefill", "decode")}
    cache = cache_for(next(a for a in entries["decode"].body.block.args if a.name_hint == "k_cache").type)
    weights = KernelWeights(model.weights)

    def tgt_feed(chunk: list[int], start: int) -> np.ndarray:
        entry = entries["prefill" if start == 0 else "decode"]
        return run_entry(entry, weights, np.asarray(chunk, np.int32), start, cache)[0]

    def forward_feed(chunk: list[int], start: int) -> np.ndarray:
        return forward_logits(quantized, model.weights, chunk, start, quantized_cache)[-1]

    exact = q_tolerance >= tolerance  # nothing quantized: every step is held to fp32 agreement
    stages = [
        Stage("llm", tolerance, tolerance, "", lambda: llm_logits),
        Stage("quantize", q_tolerance, None, why, lambda: teacher_forced(forward_feed, tokens)),
        Stage("tgt", q_tolerance, tolerance, why, lambda: teacher_forced(tgt_feed, tokens)),
    ]
    with tempfile.TemporaryDirectory(prefix="llmc-verify-") as tmp:
        if artifact is None:
            artifact = build_artifact(module, model, Path(tmp) / "artifact", backend, {}, progress)
        session = open_session(artifact)
        stages.append(Stage("artifact", q_tolerance, tolerance if exact else None, why,
                            lambda: teacher_forced(lambda chunk, start: session.feed(chunk), tokens)))
        try:
            ok = verify_stages(reference, stages, name, emit)
        finally:
            session.close()
    if per_layer:
        for row in per_layer_rows(quantized, model.weights, tokens):
            emit(row)
    return ok
