"""Other engines measured the way `llmc bench` measures llmc, for `llmc bench --vs llama.cpp,transformers`.

Each peer runs on the artifact's source model (the GGUF file or Hugging Face directory
it was compiled from) with the same prompt lengths, depths, decode steps, repeats and
threads, and returns `EngineSpeeds` (best of the repeats, as for llmc). A peer that is
not installed, or cannot run this model, is skipped with a one-line note.

- llama.cpp through `llama-bench -p P,… -n N -d D,… -t T -r R -o json`, twice: its
  default path (weights repacked into the CPU's extra buffer types, AMX where the CPU
  has it) and `--repack 0` (the generic path). Without llama-bench, through the
  `llama_cpp` Python package (`use_extra_bufts` on and off).
- transformers in float32 (`llmc.frontend.reference`), decoding with `past_key_values`.

Imported only when `--vs` is given; the runtime never imports it.
"""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from llmc.errors import UsageError, printable
from llmc.runtime.artifact import host_cpu_flags
from llmc.runtime.bench import EngineSpeeds

PEERS = ("llama.cpp", "transformers")


@dataclass(frozen=True)
class Plan:
    """What every engine runs: as `llama-bench -p PROMPTS -n DECODE -d DEPTHS -r REPEAT -t THREADS`."""

    prompts: tuple[int, ...]
    depths: tuple[int, ...]
    decode_tokens: int
    repeat: int
    threads: int
    vocab_size: int
    device: str = "cpu"  # where the artifact runs, so where transformers runs: "cpu" or "cuda"

    def tokens(self) -> np.ndarray:
        """The token ids: the context of the deepest test, then the longest prompt (as llmc's)."""
        return np.random.default_rng(0).integers(0, self.vocab_size, max(self.depths) + max(self.prompts),
                                                 dtype=np.int32)


@dataclass
class PeerResult:
    engines: list[EngineSpeeds]
    notes: list[str]  # one line each: what was measured (build, path) or why it was skipped


def source_model(spec: str | None, manifest: dict) -> tuple[Path | None, str]:
    """The model the peers run: `--model`, else the artifact's source; None (and why) when unknown."""
    from llmc.frontend import KNOWN_MODELS, resolve

    if spec:
        from llmc.frontend import load_model

        config = load_model(spec).config  # (None for a graph: the peers skip it, as they cannot run it)
        other = config.other_than(manifest.get("model", {})) if config is not None else None
        if other is not None:
            name, recorded, ours = other
            raise UsageError(f"--model {spec} is another model than the artifact's: its {name} is {ours!r}, the "
                             f"artifact's {recorded!r}")
        return resolve(spec), f"--model {spec}"
    model = manifest.get("model", {})
    recorded = model.get("source_path")
    if isinstance(recorded, str) and Path(recorded).exists():
        return Path(recorded), "the artifact's source"
    name = model.get("source")
    for known, (_, filename, _) in KNOWN_MODELS.items():
        if name == filename:
            try:
                return resolve(known), f"the artifact's source ({known})"
            except UsageError as e:
                return None, f"the artifact's source {known} is not found ({e}); pass --model"
    where = f" ({printable(recorded or name)} is not found)" if recorded or name else ""
    return None, f"the artifact's source model is unknown{where}; pass --model GGUF_OR_HF_DIR"


def measure(peer: str, source: Path, plan: Plan, llama_bench: str | None = None) -> PeerResult:
    if peer == "llama.cpp":
        return llama_cpp_speeds(source, plan, llama_bench)
    if peer == "transformers":
        return transformers_speeds(source, plan)
    raise UsageError(f"unknown peer '{peer}' (peers: {', '.join(PEERS)})")


# ------------------------------------------------------------------ llama.cpp


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return printable(lines[-1], 200) if lines else "no output"


def _llama_bench_run(binary: Path, gguf: Path, plan: Plan, repack: bool) -> tuple[list[dict], list[str]]:
    """llama-bench's JSON records and the buffer types its weights were loaded into (from `-v`)."""
    cmd = [str(binary), "-m", str(gguf), "-p", ",".join(map(str, plan.prompts)), "-n", str(plan.decode_tokens),
           "-d", ",".join(map(str, plan.depths)), "-t", str(plan.threads), "-r", str(plan.repeat), "-o", "json",
           "-v", "--repack", "1" if repack else "0"]
    env = dict(os.environ)  # its shared libraries sit next to it in a build tree
    env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(binary.resolve().parent), env.get("LD_LIBRARY_PATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"llama-bench exited with {proc.returncode}: {_last_line(proc.stderr)}")
    try:
        records = json.loads(proc.stdout)
    except json.JSONDecodeError as e:
        raise RuntimeError(f"llama-bench printed no JSON ({e})") from None
    buffers = re.findall(r"load_tensors:\s+(\S+) model buffer size", proc.stderr)
    return records, [b for b in dict.fromkeys(buffers)]


def _speeds_of_records(name: str, records: list[dict]) -> EngineSpeeds:
    speeds = EngineSpeeds(name, "llama.cpp")
    for r in records:
        best = max(r.get("samples_ts") or [r["avg_ts"]])  # best of the repetitions, as for llmc
        if r["n_gen"] == 0:
            speeds.prefill[r["n_depth"], r["n_prompt"]] = best
        elif r["n_prompt"] == 0:
            speeds.decode[r["n_depth"]] = best
    return speeds


def _path_name(repack: bool, buffers: list[str]) -> str:
    extra = [b for b in buffers if b not in ("CPU", "CPU_Mapped", "CPU_REPACK_NONE")]
    if not repack:
        return "--repack 0 (generic)"
    if extra:
        return f"repack ({', '.join(extra)})"
    return "repack (none applied)"


def llama_bench_binary(given: str | None) -> tuple[Path | None, str]:
    if given:
        path = Path(given)
        if path.is_file() and os.access(path, os.X_OK):
            return path, ""
        return None, f"no llama-bench at {printable(given)}"
    found = shutil.which("llama-bench")
    return (Path(found), "") if found else (None, "no llama-bench on PATH")


def llama_cpp_speeds(gguf: Path, plan: Plan, llama_bench: str | None = None) -> PeerResult:
    if gguf.is_dir() or gguf.suffix != ".gguf":
        return PeerResult([], ["llama.cpp: skipped (it needs a GGUF file; the model is a Hugging Face directory: "
                               "pass --model FILE.gguf)"])
    binary, missing = llama_bench_binary(llama_bench)
    if binary is None:
        try:
            import llama_cpp  # noqa: F401
        except ImportError:
            return PeerResult([], [f"llama.cpp: skipped ({missing} and llama_cpp not installed)"])
        return _llama_cpp_python(gguf, plan, missing)
    engines, notes = [], []
    for repack in (True, False):
        try:
            records, buffers = _llama_bench_run(binary, gguf, plan, repack)
        except (OSError, RuntimeError, KeyError, TypeError) as e:
            notes.append(f"llama.cpp {'default' if repack else '--repack 0'}: failed ({printable(e, 300)})")
            continue
        engines.append(_speeds_of_records(f"llama.cpp {_path_name(repack, buffers)}", records))
        if records and repack:
            r = records[0]
            notes.append(f"llama.cpp: llama-bench build {r.get('build_commit')} ({r.get('build_number')}), "
                         f"{r.get('cpu_info')}, {binary}; default path: weights in "
                         f"{', '.join(buffers) or 'unknown'} buffers{'' if 'amx_int8' in (host_cpu_flags() or ()) else ' (no AMX on this CPU)'}")
    return PeerResult(engines, notes)


def _llama_cpp_python(gguf: Path, plan: Plan, missing: str) -> PeerResult:
    """Through the `llama_cpp` package: the default model parameters, then `use_extra_bufts=False`."""
    import llama_cpp
    from llama_cpp import llama_cpp as lib

    tokens = plan.tokens().tolist()
    engines = []
    context = max(plan.depths) + max(max(plan.prompts), plan.decode_tokens)
    for extra_bufts in (True, False):
        default_params = lib.llama_model_default_params

        def params(default_params=default_params, extra_bufts=extra_bufts):
            p = default_params()
            p.use_extra_bufts = extra_bufts
            return p

        lib.llama_model_default_params = params  # the Llama class reads its model parameters from here
        try:
            llm = llama_cpp.Llama(str(gguf), n_ctx=context, n_batch=2048, n_ubatch=512, n_threads=plan.threads,
                                  n_threads_batch=plan.threads, verbose=False)
        finally:
            lib.llama_model_default_params = default_params
        name = "llama.cpp via llama_cpp, " + ("repack (extra buffer types)" if extra_bufts
                                              else "use_extra_bufts=False (generic)")
        speeds = EngineSpeeds(name, "llama.cpp")
        llm.eval(tokens[: min(512, max(plan.prompts))])  # warm-up, as llama-bench's
        for depth in plan.depths:
            llm.reset()
            if depth:
                llm.eval(tokens[:depth])
            for prompt in plan.prompts:
                best = float("inf")
                for _ in range(plan.repeat):
                    llm.n_tokens = depth  # eval drops the cache after n_tokens
                    start = time.perf_counter()
                    llm.eval(tokens[depth : depth + prompt])
                    best = min(best, time.perf_counter() - start)
                speeds.prefill[depth, prompt] = prompt / best
            best = float("inf")
            for _ in range(plan.repeat):
                llm.n_tokens = depth
                start = time.perf_counter()
                for i in range(plan.decode_tokens):  # as llama-bench's tg test: a token per step, no sampling
                    llm.eval([tokens[(depth + i) % len(tokens)]])
                best = min(best, time.perf_counter() - start)
            speeds.decode[depth] = plan.decode_tokens / best
        llm.close()
        engines.append(speeds)
    system = printable(lib.llama_print_system_info().decode(errors="replace"), 200)
    return PeerResult(engines, [f"llama.cpp: {missing}; measured through llama_cpp {llama_cpp.__version__} ({system})"])


# ------------------------------------------------------------------ transformers


def transformers_speeds(source: Path, plan: Plan) -> PeerResult:
    os.environ.setdefault("TQDM_DISABLE", "1")  # before transformers is imported: its GGUF loading draws bars
    try:
        import torch

        from llmc.frontend.reference import reference_model, reference_name
    except ImportError as e:
        return PeerResult([], [f"transformers: skipped ({e.name} is not installed: pip install 'llmc[reference]')"])
    try:
        model = reference_model(source)
    except Exception as e:  # a model transformers cannot load is a note, not the end of the run
        return PeerResult([], [f"transformers: skipped (cannot load {source.name}: {printable(e, 300)})"])
    torch.set_num_threads(plan.threads)
    if plan.device == "cuda":
        if not torch.cuda.is_available():
            return PeerResult([], ["transformers: skipped (torch sees no CUDA GPU)"])
        model = model.to("cuda")
    vocab = min(plan.vocab_size, model.config.vocab_size)
    ids = torch.tensor([(plan.tokens() % vocab).tolist()], dtype=torch.long, device=plan.device)
    where = f", {torch.cuda.get_device_name()}" if plan.device == "cuda" else ""
    speeds = EngineSpeeds(f"{reference_name()} (torch {torch.__version__}{where})", "transformers")
    sync = torch.cuda.synchronize if plan.device == "cuda" else (lambda: None)
    # the KV cache argument: `cache` since transformers 5.x, `past_key_values` before; the last row's logits
    # only, as generate() asks (and as llmc and llama.cpp compute)
    parameters = inspect.signature(model.forward).parameters
    cache_arg = "cache" if "cache" in parameters else "past_key_values"
    options = {"logits_to_keep": 1} if "logits_to_keep" in parameters else {}

    def run(tokens, cache):
        out = model(tokens, use_cache=True, **{cache_arg: cache}, **options)
        return out.logits, getattr(out, cache_arg)

    with torch.no_grad():
        run(ids[:, : min(512, max(plan.prompts))], None)  # warm-up, as llama-bench's
        for depth in plan.depths:
            context = run(ids[:, :depth], None)[1] if depth else None

            def fresh():  # a cache holding the context only (a test appends to the one it is given)
                return copy.deepcopy(context)

            for prompt in plan.prompts:
                best = float("inf")
                for _ in range(plan.repeat):
                    cache = fresh()
                    start = time.perf_counter()
                    run(ids[:, depth : depth + prompt], cache)
                    sync()
                    best = min(best, time.perf_counter() - start)
                speeds.prefill[depth, prompt] = prompt / best
            best = float("inf")
            for _ in range(plan.repeat):
                cache, token = fresh(), ids[:, depth : depth + 1]
                start = time.perf_counter()
                for _ in range(plan.decode_tokens):
                    logits, cache = run(token, cache)
                    token = logits[:, -1:].argmax(-1)
                sync()
                best = min(best, time.perf_counter() - start)
            speeds.decode[depth] = plan.decode_tokens / best
    return PeerResult([speeds], [])


def measure_all(peers: Sequence[str], source: Path | None, why: str, plan: Plan, llama_bench: str | None,
                progress) -> PeerResult:
    """Every peer asked for, in order; without a source model each is skipped with `why`."""
    result = PeerResult([], [])
    for peer in peers:
        if source is None:
            result.notes.append(f"{peer}: skipped ({why})")
            continue
        progress(f"measuring {peer} on {source}")
        one = measure(peer, source, plan, llama_bench)
        result.engines += one.engines
        result.notes += one.notes
    return result
