"""The `llmc` command line.

    llmc ir MODEL [--phase import|optimize] [-o FILE]     print a model's IR
    llmc opt FILE.mlir [-p PASS,PASS] [--print-ir-after-all]   parse, verify, run passes, print
    llmc verify MODEL [--prompt TEXT] [--quant T]          compare every stage with the source model
    llmc compile MODEL [--target cpu|cuda] [-o DIR]        compile to an artifact directory
    llmc run DIR -p TEXT [-n N] [--chat] [sampling]       generate text with an artifact
    llmc serve DIR [--port P] [--max-batch N] [--queue N] an OpenAI-compatible HTTP API over an artifact
    llmc chat DIR [--system TEXT] [-n N] [sampling]       chat with an artifact in the terminal
    llmc tokenize MODEL TEXT [--ids] [--jsonl FILE]       a text's tokens, as llama-tokenize prints them
    llmc bench DIR [--depth D,D] [--vs PEER,PEER]         prefill and decode tokens/s, next to peers
    llmc perplexity MODEL|DIR --text FILE [--ctx 512]     perplexity (and KL divergence) on a text

MODEL is a `.gguf` file, a Hugging Face directory, or a known name (`smollm2-135m`).
Errors in the input or options print one line and exit with code 2; `--debug` shows
the traceback instead.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from dataclasses import replace
from pathlib import Path

from llmc import __version__
from llmc.errors import LlmcError, UsageError, printable

EXIT_USAGE = 2


def _out(text: str, path: str | None) -> None:
    if path is None or path == "-":
        sys.stdout.write(text)
    else:
        Path(path).write_text(text)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _dumper(args: argparse.Namespace):
    from llmc.passes.pipeline import IRDumper

    return IRDumper(
        print_to=(lambda s: print(s, file=sys.stderr, end="")) if args.print_ir_after_all else None,
        directory=Path(args.dump_ir) if getattr(args, "dump_ir", None) else None,
    )


def _add_dump_options(p: argparse.ArgumentParser, to_directory: bool = True) -> None:
    p.add_argument("--print-ir-after-all", action="store_true", help="print the IR to stderr after every pass")
    if to_directory:
        p.add_argument("--dump-ir", metavar="DIR", help="write the IR after every pass to DIR as numbered .mlir files")


def cmd_ir(args: argparse.Namespace) -> int:
    from llmc.driver import BackendOptions, target_attr
    from llmc.frontend import import_model, load_model
    from llmc.ir import tgt
    from llmc.ir.text import print_module
    from llmc.passes.pipeline import phases_through, run_phase

    dump = _dumper(args)
    model = load_model(args.model, args.allow_pickle, args.tokenizer)
    module = import_model(model)
    module.attributes[tgt.TARGET] = target_attr(BackendOptions(cpu=args.cpu))
    for phase in phases_through(args.phase):
        run_phase(module, phase, dump, weights=model.weights)
    _out(print_module(module, generic=args.generic), args.output)
    return 0


def cmd_opt(args: argparse.Namespace) -> int:
    from llmc.ir.text import parse_module, print_module, verify_module
    from llmc.passes.pipeline import run_passes
    from llmc.passes.registry import get_pass

    if args.file == "-":
        text, source = sys.stdin.read(), "<stdin>"
    else:
        try:
            text, source = Path(args.file).read_text(), args.file
        except (OSError, UnicodeDecodeError) as e:
            raise UsageError(f"cannot read {args.file}: {e}") from e
    passes = [get_pass(name.strip()) for name in args.passes.split(",") if name.strip()] if args.passes else []
    module = parse_module(text, source)
    verify_module(module)
    dump = _dumper(args)
    run_passes(module, passes, dump)
    _out(print_module(module, generic=args.generic), args.output)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    os.environ.setdefault("TQDM_DISABLE", "1")  # before tqdm is imported: transformers' GGUF loading draws bars
    from llmc.verify import verify_model

    artifact = Path(args.artifact) if args.artifact else None
    reference = Path(args.reference) if args.reference else None
    ok = verify_model(args.model, args.prompt, args.tolerance, artifact, print, _progress, args.allow_pickle,
                      compile_options(args), args.cpu, reference, args.tokenizer, args.per_layer)
    if not ok:
        print("FAILED: a stage's cosine is below what it needs", file=sys.stderr)
    return 0 if ok else 1


def _compile_options_given(args: argparse.Namespace) -> bool:
    return bool(args.quant or args.quant_output or args.requantize or args.compute != "auto" or args.calibrate
                or args.cpu != "native"
                or args.max_seq or args.prefill_chunk or args.no_group or args.kv_type != "f16" or args.max_batch != 1)


def cmd_perplexity(args: argparse.Namespace) -> int:
    import tempfile

    from llmc.runtime.artifact import MANIFEST
    from llmc.runtime.codec import TextCodec
    from llmc.runtime.perplexity import chunk_tokens, perplexity
    from llmc.runtime.session import Conversation, open_session

    try:
        text = Path(args.text).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"cannot read --text {args.text}: {e}") from e
    text = text[:-1] if text.endswith("\n") else text  # as llama-perplexity -f does
    with tempfile.TemporaryDirectory(prefix="llmc-perplexity-") as tmp:

        def session_of(spec: str, name: str) -> Conversation:
            path = Path(spec)
            if path.is_dir() and (path / MANIFEST).exists():
                if _compile_options_given(args):
                    _progress(f"note: {spec} is an artifact; the compile options do not apply to it")
            else:
                try:
                    from llmc.driver import BackendOptions, compile_model
                except ImportError as e:
                    raise UsageError(f"{spec} is not an artifact directory, and compiling it needs the compiler "
                                     f"({e.name} is not installed)") from e
                _progress(f"compiling {spec} (--ctx {args.ctx})")
                options = replace(compile_options(args), max_seq=max(args.ctx, args.max_seq or 0),
                                  prefill_chunk=args.prefill_chunk or min(128, args.ctx))
                path = compile_model(spec, Path(tmp) / name, options, BackendOptions(cpu=args.cpu),
                                     progress=_progress, allow_pickle=args.allow_pickle, tokenizer=args.tokenizer)
            return open_session(path, threads=args.threads)

        session = session_of(args.model, "model")
        base = session_of(args.kl_base, "base") if args.kl_base else None
        if base is not None and base.vocab_size != session.vocab_size:
            raise UsageError(f"--kl-base has a vocabulary of {base.vocab_size}, the model {session.vocab_size}: "
                             f"KL divergence needs the same vocabulary")
        codec = TextCodec.from_artifact(session.manifest)
        chunks = chunk_tokens(codec.encode(text), args.ctx, args.chunks, codec.bos_id, codec.add_bos)
        _progress(f"{sum(c.size for c in chunks)} tokens in {len(chunks)} chunks of {args.ctx}")
        result = perplexity(session, chunks, base, _progress)
        print(result.report())
        session.close()
        if base is not None:
            base.close()
    return 0


class _Parser(argparse.ArgumentParser):
    """Bad options end in one line, like every other llmc error."""

    def error(self, message: str) -> None:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _positive(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _non_negative(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"must be in (0, 3600] seconds, got {text}")
    return value


def _port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be in 0..65535, got {text}")
    return value


# the storage types of `llmc.ir.formats.Storage` (not imported here: `llmc run` needs no compiler)
QUANT_TYPES = ("f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k, int4-g32, int4-g64, int4-g128, "
               "int4-g256")


def _add_quant_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cpu", default="native", metavar="NAME",
                   help="CPU to generate code for: 'native' (this machine) or a CPU name such as x86-64-v3, "
                        "sapphirerapids, znver4")
    p.add_argument("--quant", metavar="TYPE",
                   help=f"storage of the matmul weights ({QUANT_TYPES}); applies to float tensors, and to "
                        "quantized ones with --requantize (default: the model's own types)")
    p.add_argument("--quant-output", metavar="TYPE",
                   help="storage of the token embedding and the LM head (default: --quant, but not below q8_0)")
    p.add_argument("--requantize", action="store_true",
                   help="let --quant convert tensors that the model file already stores quantized")
    p.add_argument("--compute", choices=["auto", "a32", "a8", "a16"], default="auto",
                   help="matmul compute mode: a8 (int8 activations, integer dot products), a16 (int16 "
                        "activations as two int8 planes: near a32's accuracy, decode near a8's speed), a32 (float "
                        "activations), or auto (default): a8 or a16 per matmul, from a calibration, keeping "
                        "decode within 20%% and prefill within 25%% of all-a8")
    p.add_argument("--calibrate", metavar="FILE",
                   help="--compute auto: calibrate on the first 128 tokens of this UTF-8 text (default: a built-in "
                        "set of chat conversations in the model's template and plain text)")


def _add_kv_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kv-type", choices=["f32", "f16", "q8_0"], default="f16",
                   help="element type of the KV cache: f16 (default) reads half the bytes of f32, q8_0 "
                        "(int8 and a scale per 32) 0.56 of f16")


def _add_compile_options(p: argparse.ArgumentParser) -> None:
    _add_quant_options(p)
    _add_kv_option(p)
    p.add_argument("--no-group", action="store_true", help="skip layer grouping: one kernel per op (to compare)")
    p.add_argument("--max-seq", type=_positive, metavar="N",
                   help="KV cache capacity in tokens (default: the model's context length, at most 4096)")
    p.add_argument("--prefill-chunk", type=_positive, metavar="N",
                   help="most tokens one prefill call takes; longer prompts go in chunks (default: 128, 512 "
                        "for --target cuda; at most --max-seq)")
    p.add_argument("--max-batch", type=_positive, metavar="B", default=1,
                   help="sequences decoded together: the KV cache holds B of them (each --max-seq tokens) and "
                        "one decode call takes a token of each, reading the weights once (`llmc serve`; "
                        "default 1)")
    _add_raise_option(p)


def _add_raise_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-raise", action="append", metavar="NAME",
                   help="for a .pt2/.onnx graph: leave this pattern unraised, its primitive ops compiled by "
                        "generic kernels (to compare; repeatable; one of embedding, linear, rms-norm, swiglu, "
                        "rope, attention, lm-head)")


def _default_output(model: str) -> Path:
    return Path(Path(model.rstrip("/")).stem + ".llmc")


def compile_options(args: argparse.Namespace):
    from llmc.ir.formats import Storage
    from llmc.passes.pipeline import CompileOptions

    for option, value in (("--quant", args.quant), ("--quant-output", args.quant_output)):
        if value:
            try:
                Storage.parse(value)
            except ValueError as e:
                raise UsageError(f"{option}: {e}") from None
    return CompileOptions(prefill_chunk=getattr(args, "prefill_chunk", None) or 0,
                          max_seq=getattr(args, "max_seq", None) or 0, group=not getattr(args, "no_group", False),
                          quant=args.quant or "", quant_output=args.quant_output or "", requantize=args.requantize,
                          compute=args.compute, calibrate=args.calibrate or "",
                          kv_type=getattr(args, "kv_type", None) or "f16",
                          max_batch=getattr(args, "max_batch", None) or 1,
                          no_raise=tuple(getattr(args, "no_raise", None) or ()))


def cmd_compile(args: argparse.Namespace) -> int:
    from llmc.driver import BackendOptions, compile_model

    options = compile_options(args)
    dump = _dumper(args)
    out = Path(args.output) if args.output else (None if args.compile_to else _default_output(args.model))
    backend = BackendOptions(args.target, args.cpu, args.gpu)
    from llmc.backends import kernel_cache

    with kernel_cache.disabled() if args.no_cache else contextlib.nullcontext():
        result = compile_model(args.model, out, options, backend, args.compile_to, dump,
                               progress=_progress, allow_pickle=args.allow_pickle, tokenizer=args.tokenizer)
    if isinstance(result, str):
        _out(result, args.output)
    return 0


def _sampling(args: argparse.Namespace):
    from llmc.runtime.sampling import SamplingOptions

    options = SamplingOptions(args.temperature, args.top_k, args.top_p, args.seed)
    try:
        options.check()
    except ValueError as e:
        raise UsageError(str(e)) from e
    return options


def cmd_tokenize(args: argparse.Namespace) -> int:
    import json

    from llmc.frontend import load_tokenizer

    if (args.text is None) == (args.jsonl is None):
        raise UsageError("give the TEXT to tokenize, or --jsonl FILE (one JSON string per line), not both")
    codec = load_tokenizer(args.model)

    if args.text is not None:
        ids = codec.encode(args.text, bos=not args.no_bos)
        if args.ids:
            print(json.dumps(ids))
        else:
            for i in ids:
                print(f"{i:6d} -> {codec.piece(i)!r}")
        return 0
    lines = sys.stdin if args.jsonl == "-" else _open_text(args.jsonl)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            text = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{args.jsonl}:{number}: not JSON ({e.msg})") from None
        if not isinstance(text, str):
            raise UsageError(f"{args.jsonl}:{number}: a JSON string per line, got {type(text).__name__}")
        print(json.dumps(codec.encode(text, bos=not args.no_bos)))
    return 0


def _open_text(path: str):
    try:
        return open(path, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None


def _codec(session, args: argparse.Namespace):
    """The artifact's text codec, its chat template rendered within --template-seconds/--template-chars."""
    from llmc.runtime.codec import TextCodec

    codec = TextCodec.from_artifact(session.manifest)
    codec.limits = replace(codec.limits, seconds=args.template_seconds, chars=args.template_chars)
    return codec


def cmd_run(args: argparse.Namespace) -> int:
    from llmc.runtime.generate import generate, stream_text
    from llmc.runtime.session import open_session

    sampling = _sampling(args)
    session = open_session(Path(args.artifact), check_files=not args.no_verify, threads=args.threads)
    codec = _codec(session, args)
    prompt = codec.chat(args.prompt) if args.chat else args.prompt
    ids = codec.encode(prompt)
    if not ids:
        raise UsageError("the prompt gives no tokens")
    start = time.perf_counter()
    tokens = stream_text(codec, generate(session, codec, ids, args.n, sampling),
                         lambda s: (sys.stdout.write(s), sys.stdout.flush()), ids)
    elapsed = time.perf_counter() - start
    print()
    _progress(f"[{len(ids)} prompt tokens, {len(tokens)} generated in {elapsed:.2f} s]")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        from llmc.runtime.server import Limits, Server, model_name, serve
    except ImportError as e:
        if e.name not in ("starlette", "uvicorn") and not (e.name or "").startswith(("starlette.", "uvicorn.")):
            raise
        raise UsageError(f"llmc serve needs starlette and uvicorn ({e.name} is not installed): "
                         f"pip install 'llmc[serve]'") from None
    from llmc.runtime.session import open_session

    directory = Path(args.artifact)
    session = open_session(directory, check_files=not args.no_verify, threads=args.threads)
    try:
        codec = _codec(session, args)
        name = model_name(directory)
        limits = Limits.for_capacity(session.capacity, head_seconds=args.head_timeout, body_seconds=args.body_timeout)
        server = Server(session, codec, name, args.queue, args.max_batch, aliases=(directory.resolve().name,),
                        limits=limits)

        def ready(url: str) -> None:
            print(f"llmc serve: listening on {url} (model '{name}', {server.engine.max_active} sequences at once, "
                  f"{args.queue} more may wait, KV capacity {session.capacity} each; Ctrl-C stops)", flush=True)

        try:
            serve(server, args.host, args.port, ready)
        except KeyboardInterrupt:
            pass
        _progress("llmc serve: stopped")
    finally:
        session.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from llmc.runtime.chat import Chat, run_chat
    from llmc.runtime.session import open_session

    sampling = _sampling(args)
    session = open_session(Path(args.artifact), check_files=not args.no_verify, threads=args.threads)
    try:
        codec = _codec(session, args)
        if not codec.chat_template:
            raise UsageError("this model has no chat template; use 'llmc run' for plain completion")
        chat = Chat(session, codec, args.system, sampling, args.n)
        # Ctrl-C at the prompt ends the chat even where SIGINT came ignored from the parent (Python then
        # installs no KeyboardInterrupt handler, and a reply's own handler would restore the ignoring)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        run_chat(chat, verbose=args.verbose)
    finally:
        session.close()
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from llmc.runtime.artifact import load_manifest
    from llmc.runtime.bench import bandwidth_report, benchmark, decode_weight_bytes, fit_defaults, table

    directory = Path(args.artifact)
    if args.plot:
        from llmc.plot import check_matplotlib

        check_matplotlib()
    manifest = load_manifest(directory, check_files=False)  # (the session checks the files)
    prompts, depths, notes = fit_defaults(manifest.kv_cache["shape"][2], args.prompt_tokens, args.depth,
                                          args.decode_tokens)
    for note in notes:
        _progress(f"note: {note}")
    if not args.vs and (args.model or args.llama_bench):
        _progress("note: --model and --llama-bench apply to --vs only")
    if args.vs:  # the peers' model first: a bad --model ends the run before anything is measured
        from llmc import peers

        source, why = peers.source_model(args.model, manifest.data)
    _progress(f"measuring llmc on {directory}")
    result = benchmark(directory, prompts, args.decode_tokens, args.repeat, args.threads, depths)
    engines, notes = [result.speeds], []
    if args.vs:
        plan = peers.Plan(prompts, depths, args.decode_tokens, args.repeat, result.threads, result.vocab_size,
                          device=manifest.target)
        found = peers.measure_all(args.vs, source, why, plan, args.llama_bench, _progress)
        engines += found.engines
        notes = found.notes
    for note in notes:
        print(note)
    print(table(engines, prompts, depths, args.decode_tokens, result.where))
    nbytes, where = decode_weight_bytes(manifest)
    print(bandwidth_report(nbytes, where, result))
    if args.plot:
        from llmc.plot import plot_bench

        plot_bench(Path(args.plot), engines, prompts, depths, args.decode_tokens, result.where,
                   title=f"{directory.name} ({manifest.model.get('source', '')})")
        print(f"plot: {args.plot}")
    return 0


def _int_list(minimum: int):
    """An argparse type: comma-separated integers >= `minimum`, duplicates dropped, order kept."""

    def parse(text: str) -> list[int]:
        values = []
        for part in text.split(","):
            value = _int(part.strip())
            if value < minimum:
                raise argparse.ArgumentTypeError(f"each value must be >= {minimum}, got {part.strip()}")
            values.append(value)
        return list(dict.fromkeys(values))

    return parse


def _peer_list(text: str) -> list[str]:
    from llmc.peers import PEERS

    names = [name.strip().lower() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in PEERS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown peer {unknown[0]!r} (peers: {', '.join(PEERS)})" if unknown
                                         else f"no peer named (peers: {', '.join(PEERS)})")
    return list(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback on errors")
    model_help = ("a .gguf file, a Hugging Face model directory, an exported graph (.pt2 from torch.export.save, "
                  ".onnx), or a known model name (smollm2-135m)")
    model_args = argparse.ArgumentParser(add_help=False)
    model_args.add_argument("model", metavar="MODEL", help=model_help)
    model_args.add_argument("--allow-pickle", action="store_true",
                            help="load pickle checkpoints (*.bin, *.pt) of a Hugging Face directory, through "
                                 "torch's weights-only loader, and .pt2 files whose loading can run code "
                                 "(pickled parts, guard code, compiled packages); without it they are refused")
    model_args.add_argument("--tokenizer", metavar="PATH",
                            help="for a .pt2/.onnx graph: its tokenizer (a tokenizer.json, its directory, a .gguf "
                                 "file or a known model name; default: the tokenizer.json beside the graph)")

    parser = _Parser(
        prog="llmc",
        description="llmc: an ahead-of-time compiler for large language models.",
        epilog="Run 'llmc COMMAND --help' for the options of a command.",
    )
    parser.add_argument("--version", action="version", version=f"llmc {__version__}")
    parser.add_argument("--debug", action="store_true", help="show the full traceback on errors")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("ir", parents=[common, model_args], help="print a model's IR after a phase",
                       description="Import a model and print its IR after the given phase.")
    p.add_argument("--phase", choices=["import", "optimize"], default="import",
                   help="the last phase to run (default: import; 'llmc compile --compile-to' runs later ones)")
    p.add_argument("--cpu", default="native", metavar="NAME",
                   help="the CPU recorded as the module's target (default: native)")
    p.add_argument("-o", "--output", metavar="FILE", help="write the IR to FILE instead of stdout")
    p.add_argument("--generic", action="store_true", help="print the generic op form instead of the custom one")
    _add_dump_options(p)
    p.set_defaults(run=cmd_ir)

    p = sub.add_parser("opt", parents=[common], help="parse, verify, transform and print IR",
                       description="Parse an .mlir file of llmc's dialects, verify it, run passes, print the result.")
    p.add_argument("file", metavar="FILE.mlir", help="IR text to read ('-' for stdin)")
    p.add_argument("-p", "--passes", metavar="PASS,PASS",
                   help="comma-separated passes to run in order (verify, canonicalize, dce, quantize, split, "
                        "group, lower, pack, plan-memory)")
    _add_dump_options(p, to_directory=False)
    p.add_argument("-o", "--output", metavar="FILE", help="write the IR to FILE instead of stdout")
    p.add_argument("--generic", action="store_true", help="print the generic op form instead of the custom one")
    p.set_defaults(run=cmd_opt)

    p = sub.add_parser("verify", parents=[common, model_args], help="compare every stage's logits with the source model",
                       description="Run the source model's reference (transformers fp32) and each llmc stage on "
                                   "the same tokens; print cosine similarity, max abs error and top-1 agreement "
                                   "per stage. Exits 1 when a stage's cosine is below the tolerance.")
    p.add_argument("--prompt", default="The capital of France is", help="text to run (default: %(default)r)")
    p.add_argument("--tolerance", type=float, default=0.9999, metavar="COS",
                   help="lowest acceptable cosine similarity per stage (default: %(default)s)")
    p.add_argument("--artifact", metavar="DIR",
                   help="check this compiled artifact of MODEL, with the options it was compiled with "
                        "(default: compile one to a temporary directory)")
    p.add_argument("--reference", metavar="DIR",
                   help="take the reference from this Hugging Face directory of the same model (the checkpoint "
                        "a GGUF file was converted from; transformers reads few GGUF features) "
                        "(default: MODEL itself)")
    p.add_argument("--per-layer", action="store_true",
                   help="after the stages, one row per projection: the compute mode quantize chose and the relative "
                        "output error of a8 and a16 activations on the prompt (why a layer was kept wider)")
    _add_quant_options(p)
    _add_kv_option(p)
    _add_raise_option(p)
    p.set_defaults(run=cmd_verify)

    p = sub.add_parser("compile", parents=[common, model_args], help="compile a model to an artifact",
                       description="Compile a model through every phase into an artifact directory "
                                   "(manifest.json, weights.bin, kernels.so or kernels.ptx, tokenizer.json) that "
                                   "'llmc run' executes.")
    p.add_argument("--target", default="cpu", choices=["cpu", "cuda"], help="code generation target (default: cpu)")
    p.add_argument("--gpu", default="sm_80,sm_90", metavar="SM[,SM]",
                   help="with --target cuda: GPU architectures (sm_80, sm_86, sm_89, sm_90); PTX for the oldest, "
                        "a cubin for each when ptxas is on PATH (default: %(default)s)")
    p.add_argument("-o", "--output", metavar="DIR",
                   help="artifact directory (default: MODEL's name + .llmc): a new or empty folder, or an artifact, "
                        "replaced once the compile succeeds; with --compile-to, the IR file")
    _add_compile_options(p)
    p.add_argument("--compile-to", metavar="PHASE", choices=["import", "optimize", "quantize", "split", "group", "lower"],
                   help="stop after PHASE and print its IR (to -o FILE if given)")
    p.add_argument("--no-cache", action="store_true",
                   help="compile every kernel with LLVM, neither reading nor writing the kernel cache "
                        "($LLMC_CACHE_DIR, else ~/.cache/llmc; LLMC_CACHE_DIR=off turns it off for good)")
    _add_dump_options(p)
    p.set_defaults(run=cmd_compile)

    # what every command that runs an artifact takes, and what those that sample take
    artifact_args = argparse.ArgumentParser(add_help=False)
    artifact_args.add_argument("artifact", metavar="DIR", help="an artifact directory from 'llmc compile'")
    artifact_args.add_argument("--no-verify", action="store_true",
                               help="skip the sha256 check of the artifact's files (their sizes and places, and "
                                    "the manifest against its kernels, are checked still)")
    artifact_args.add_argument("--threads", type=_positive, metavar="N",
                               help="threads to run on (default: every CPU available)")
    artifact_args.add_argument("--template-seconds", type=_seconds, default=1.0, metavar="S",
                               help="the most time one rendering of the chat template may take; a template "
                                    "that needs more is refused (default: %(default)s)")
    artifact_args.add_argument("--template-chars", type=_positive, default=1_000_000, metavar="N",
                               help="the most characters a rendering of the chat template may write or build "
                                    "(default: %(default)s)")
    sampling_args = argparse.ArgumentParser(add_help=False)
    sampling_args.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default: 0)")
    sampling_args.add_argument("--top-k", type=_int, default=0, metavar="K",
                               help="sample among the K likeliest (0 = all)")
    sampling_args.add_argument("--top-p", type=float, default=1.0, metavar="P",
                               help="nucleus sampling mass in (0, 1] (default: 1)")
    sampling_args.add_argument("--seed", type=_int, metavar="S", help="random seed for sampling")

    p = sub.add_parser("run", parents=[common, artifact_args, sampling_args], help="generate text with a compiled artifact",
                       description="Load an artifact and generate text, streaming it as it comes.")
    p.add_argument("-p", "--prompt", required=True, help="the prompt text")
    p.add_argument("-n", type=_non_negative, default=128, metavar="N", help="most tokens to generate (default: 128)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.set_defaults(run=cmd_run)

    p = sub.add_parser("serve", parents=[common, artifact_args], help="serve an artifact over an OpenAI-compatible HTTP API",
                       description="Serve an artifact over HTTP: POST /v1/completions and /v1/chat/completions "
                                   "(OpenAI's API, streamed as server-sent events or whole), GET /v1/models, GET "
                                   "/health. Requests share the artifact's KV cache slots (--max-batch at compile "
                                   "time); the others wait in a bounded queue. Needs the serve extra "
                                   "(pip install 'llmc[serve]').")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on; 0 = any free one "
                                                                     "(default: %(default)s)")
    p.add_argument("--max-batch", type=_positive, metavar="N",
                   help="most sequences generating at once (default: every slot the artifact's cache holds)")
    p.add_argument("--queue", type=_non_negative, default=64, metavar="N",
                   help="requests that may wait for a slot; beyond them the server answers 429 (default: 64)")
    p.add_argument("--head-timeout", type=_seconds, default=10.0, metavar="S",
                   help="seconds a client has to send a whole request head; slower ones are disconnected "
                        "(default: %(default)s)")
    p.add_argument("--body-timeout", type=_seconds, default=30.0, metavar="S",
                   help="seconds a client has to send a whole request body; slower ones get 408 "
                        "(default: %(default)s)")
    p.set_defaults(run=cmd_serve)

    p = sub.add_parser("chat", parents=[common, artifact_args, sampling_args], help="chat with an artifact in the terminal",
                       description="Interactive multi-turn chat with the model's chat template. The conversation "
                                   "stays in the KV cache: each turn feeds only its new tokens. Commands: /reset, "
                                   "/system TEXT, /quit (or end of input). Ctrl-C stops a reply; at the prompt it "
                                   "ends the chat.")
    p.add_argument("--system", metavar="TEXT", help="the system prompt")
    p.add_argument("-n", type=_positive, default=512, metavar="N", help="most tokens per reply (default: 512)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="after each reply, a line of token counts (reused from the cache, fed, generated)")
    p.set_defaults(run=cmd_chat)

    p = sub.add_parser("tokenize", parents=[common], help="print a text's tokens, as llama-tokenize does",
                       description="Tokenize TEXT with a model's tokenizer and print each token (id and piece), "
                                   "or only the ids (--ids); with --jsonl, each line of FILE is a JSON string and "
                                   "each output line the JSON list of its ids. MODEL is a .gguf file (a "
                                   "vocabulary-only one too: only the tokenizer metadata is read), a Hugging Face "
                                   "directory, an artifact directory, or a known model name. The beginning-of-text "
                                   "token is added where the model says so (--no-bos leaves it out).")
    p.add_argument("model", metavar="MODEL", help="a .gguf file, a Hugging Face or artifact directory, or a known "
                                                  "model name (smollm2-135m)")
    p.add_argument("text", metavar="TEXT", nargs="?", help="the text to tokenize")
    p.add_argument("--ids", action="store_true", help="print only the ids, as a JSON list")
    p.add_argument("--jsonl", metavar="FILE", help="tokenize each line of FILE (- for standard input), a JSON string")
    p.add_argument("--no-bos", action="store_true", help="leave out the beginning-of-text token")
    p.set_defaults(run=cmd_tokenize)

    p = sub.add_parser("bench", parents=[common], help="measure prefill and decode speed, next to other engines",
                       description="Prefill tokens/s of each --prompt-tokens prompt and decode tokens/s over "
                                   "--decode-tokens greedy steps, each with --depth tokens already in the KV cache "
                                   "(as llama-bench's -p, -n, -d), best of --repeat runs; then the weight bytes a "
                                   "decode step reads and the machine's streaming read bandwidth over them. "
                                   "--vs measures llama.cpp (llama-bench, default path and --repack 0; or the "
                                   "llama_cpp package) and transformers fp32 on the artifact's source model, "
                                   "skipping any that is not installed.")
    p.add_argument("artifact", metavar="DIR", help="an artifact directory from 'llmc compile'")
    p.add_argument("--prompt-tokens", type=_int_list(1), metavar="N,N",
                   help="prefill lengths (default: 128,512,2048, those that fit the KV cache)")
    p.add_argument("--depth", type=_int_list(0), metavar="D,D",
                   help="tokens already in the KV cache for each test (default: 0,2048, those that fit)")
    p.add_argument("--decode-tokens", type=_positive, default=128, metavar="N", help="decode steps (default: 128)")
    p.add_argument("--repeat", type=_positive, default=3, metavar="N", help="runs; the best is reported (default: 3)")
    p.add_argument("--threads", type=_positive, metavar="N",
                   help="threads to run on, for every engine (default: every CPU available)")
    p.add_argument("--vs", type=_peer_list, metavar="PEER,PEER",
                   help="also measure these engines: llama.cpp, transformers")
    p.add_argument("--model", metavar="GGUF_OR_HF_DIR",
                   help="the model the peers run (default: the artifact's source, if the manifest records one)")
    p.add_argument("--llama-bench", metavar="PATH", help="llama.cpp's llama-bench binary (default: on PATH)")
    p.add_argument("--plot", metavar="FILE.png", help="write a bar chart of the tokens/s (needs matplotlib)")
    p.set_defaults(run=cmd_bench)

    p = sub.add_parser("perplexity", parents=[common, model_args], help="perplexity of a model on a text",
                       description="Perplexity by llama.cpp's method: the text in chunks of --ctx tokens, each from "
                                   "an empty cache, the second half of each chunk scored. MODEL is an artifact "
                                   "directory, or a model that is compiled first (with the compile options below). "
                                   "--kl-base adds the mean KL divergence and top-token agreement against a base "
                                   "(e.g. the --quant f32 build).")
    p.add_argument("--text", required=True, metavar="FILE", help="UTF-8 text to score")
    p.add_argument("--ctx", type=_positive, default=512, metavar="N", help="tokens per chunk (default: 512)")
    p.add_argument("--chunks", type=_positive, metavar="N", help="score only the first N chunks")
    p.add_argument("--kl-base", metavar="MODEL|DIR", help="an artifact (or model) to compare the distributions with")
    p.add_argument("--threads", type=_positive, metavar="N", help="threads to run on (default: every CPU available)")
    _add_compile_options(p)
    p.set_defaults(run=cmd_perplexity)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except LlmcError as e:
        if args.debug:
            raise
        print(f"llmc: error: {printable(e, 1000)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if args.debug:
            raise
        print(f"llmc: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
