"""Named phases and the runner that applies them, with IR dumps after every pass.

| phase    | passes                            | IR after it                                  |
|----------|-----------------------------------|----------------------------------------------|
| import   | (the frontend builds it)          | `llm`, `@forward`                            |
| optimize | verify, canonicalize, raise-*, dce, verify | `llm`, exported graphs raised       |
| quantize | quantize, verify                  | `llm`, storage and compute mode chosen       |
| split    | split                             | `llm`, prefill/prefill_kv/decode/score/verify |
| group    | group (none with `--no-group`)    | `llm` with fused ops                         |
| lower    | lower, pack, fuse-norm, screen-logits, plan-memory, verify | `tgt`               |

The module records the last phase it went through in its `llm.phase` attribute, and
the target it is compiled for in `tgt.target` (set before any phase runs). A phase's last
pass but `verify` ends it (`dce`, `quantize`, `split`, `group`, `plan-memory`): passes run
one by one (`llmc opt -p split,group`) move the module's phase on as the phases would.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from xdsl.dialects.builtin import ModuleOp, StringAttr
from xdsl.passes import ModulePass

from llmc.errors import UsageError
from llmc.ir.text import context, print_module
from llmc.ir.weights import WeightStore
from llmc.passes.base import PHASE_ORDER, module_phase
from llmc.passes.registry import get_pass, pass_class


@dataclass(frozen=True)
class CompileOptions:
    """Options of the phases that take any."""

    prefill_chunk: int = 0  # 0: 128, at most max_seq
    max_seq: int = 0  # 0: the model's context length, capped at 4096
    group: bool = True
    fuse_norm: bool = True  # decode's projections normalize and quantize their own rows (`fuse-norm`)
    exact_logits: bool = False  # decode's LM head all int16 products (no `screen-logits`)
    quant: str = ""  # storage of the matmul weights ("" keeps the model's)
    quant_output: str = ""  # storage of the token embedding and LM head ("" follows the policy)
    requantize: bool = False  # convert tensors that are already quantized too
    compute: str = "auto"  # a32, a8, a16, or auto: a8/a16 per matmul from a calibration, within a decode budget
    calibrate: str = ""  # auto's calibration text: a UTF-8 file ("" the built-in set)
    kv_type: str = "f16"  # element type of the KV cache: f32 or f16
    max_batch: int = 1  # sequences the cache holds (decode's rows)
    speculate: int = 8  # drafted tokens the `verify` entry point checks at once (0: no `verify`)
    no_raise: tuple[str, ...] = ()  # raising passes turned off (`--no-raise rms-norm`: the pass raise-rms-norm)


# the raising passes of `optimize`, in order (an exported graph's primitive subgraphs → `llm` ops)
RAISINGS = ("embedding", "linear", "rms-norm", "swiglu", "rope", "attention", "lm-head")


PHASES: dict[str, tuple[str, ...]] = {
    "import": (),
    "optimize": ("verify", "refine-shapes", "canonicalize", "raise-embedding", "raise-linear", "canonicalize",
                 "raise-rms-norm", "raise-swiglu", "raise-rope", "raise-attention", "canonicalize", "raise-lm-head",
                 "dce", "verify"),
    "quantize": ("quantize", "verify"),
    "split": ("split",),
    "group": ("group",),
    "lower": ("lower", "pack", "fuse-norm", "screen-logits", "plan-memory", "verify"),
}
assert tuple(PHASES) == PHASE_ORDER
# the pass that ends each phase that has passes: its last one but `verify`
PHASE_ENDED_BY = {[name for name in passes if name != "verify"][-1]: phase
                  for phase, passes in PHASES.items() if passes}


def check_raisings(options: CompileOptions) -> None:
    unknown = sorted(set(options.no_raise) - set(RAISINGS))
    if unknown:
        raise UsageError(f"--no-raise {unknown[0]}: no such raising (raisings: {', '.join(RAISINGS)})")


def phase_passes(phase: str, options: CompileOptions, weights: WeightStore | None = None,
                 tokens: Sequence[int] = ()) -> list[ModulePass]:
    """The passes of `phase`; `weights` lets the raising passes evaluate subgraphs that read weights,
    and `quantize` calibrate on `tokens` (`calibrate.calibration_tokens`)."""
    check_raisings(options)
    passes: list[ModulePass] = []
    for name in PHASES[phase]:
        if name == "refine-shapes" or name.startswith("raise-"):
            if name.removeprefix("raise-") not in options.no_raise:
                passes.append(pass_class(name)(weights=weights))  # type: ignore[call-arg]
        elif name == "split":
            from llmc.passes.split import SplitPass

            passes.append(SplitPass(prefill_chunk=options.prefill_chunk, max_seq=options.max_seq,
                                    kv_type=options.kv_type, max_batch=options.max_batch,
                                    speculate=options.speculate))
        elif name == "quantize":
            from llmc.passes.quantize import QuantizePass

            passes.append(QuantizePass(quant=options.quant, quant_output=options.quant_output,
                                       requantize=options.requantize, compute=options.compute, weights=weights,
                                       tokens=tuple(tokens)))
        elif (name == "group" and not options.group) or (name == "fuse-norm" and not options.fuse_norm) \
                or (name == "screen-logits" and options.exact_logits):
            continue
        else:
            passes.append(get_pass(name))
    return passes


def phases_through(last: str) -> list[str]:
    """The phases from the first through `last`."""
    if last not in PHASES:
        raise UsageError(f"unknown phase '{last}' (phases: {', '.join(PHASES)})")
    names = list(PHASES)
    return names[: names.index(last) + 1]


class IRDumper:
    """Called after every pass: prints the IR to a stream and/or writes numbered files."""

    def __init__(self, print_to: Callable[[str], None] | None = None, directory: Path | None = None):
        self.print_to = print_to
        self.directory = directory
        self.count = 0
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    def __call__(self, label: str, module: ModuleOp) -> None:
        if self.print_to is None and self.directory is None:
            return
        text = print_module(module)
        if self.print_to is not None:
            self.print_to(f"// -----// IR Dump After {label} //----- //\n{text}")
        if self.directory is not None:
            (self.directory / f"{self.count:02d}-{label.replace(' ', '-')}.mlir").write_text(text)
        self.count += 1


def record_phase(module: ModuleOp, phase: str) -> None:
    """Set the module's `llm.phase` to `phase` unless it is at a later one already."""
    current = module_phase(module)
    if current not in PHASE_ORDER or PHASE_ORDER.index(current) <= PHASE_ORDER.index(phase):
        module.attributes["llm.phase"] = StringAttr(phase)


def run_passes(module: ModuleOp, passes: Sequence[ModulePass], dump: IRDumper | None = None) -> None:
    """Apply `passes` in order; a pass that ends a phase records it (`PHASE_ENDED_BY`)."""
    ctx = context()
    for p in passes:
        p.apply(ctx, module)
        if p.name in PHASE_ENDED_BY:
            record_phase(module, PHASE_ENDED_BY[p.name])
        if dump:
            dump(p.name, module)


def run_phase(module: ModuleOp, phase: str, dump: IRDumper | None = None,
              options: CompileOptions = CompileOptions(), weights: WeightStore | None = None,
              tokens: Sequence[int] = ()) -> None:
    """Apply one phase's passes in place, record the phase on the module, dump its IR (`tokens`:
    `quantize`'s calibration, with `weights`)."""
    run_passes(module, phase_passes(phase, options, weights, tokens), dump)
    module.attributes["llm.phase"] = StringAttr(phase)
    if dump:
        dump(f"phase-{phase}", module)
