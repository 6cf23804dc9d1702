"""The commands that measure: `llmc tokenize`, `bench`, `perplexity`."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from llmc.cli.common import compile_options, compile_options_given, progress
from llmc.errors import UsageError
from llmc.textfile import read_text


def cmd_tokenize(args: argparse.Namespace) -> int:
    """Tokenize TEXT with a model's tokenizer and print each token (id and piece), or only the ids (--ids);
    with --jsonl, each line of FILE is a JSON string and each output line the JSON list of its ids. MODEL is a
    .gguf file (a vocabulary-only one too: only the tokenizer metadata is read), a Hugging Face directory, an
    artifact directory, or a known model name. The beginning-of-text token is added where the model says so
    (--no-bos leaves it out)."""
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
    blank = None  # the first blank line: fine at the end of the file, not before a text (the answers would shift)
    for number, line in enumerate(iter(lambda: lines.readline(MAX_JSONL_LINE + 1), ""), 1):
        if len(line) > MAX_JSONL_LINE:
            raise UsageError(f"{args.jsonl}:{number}: a line longer than {MAX_JSONL_LINE} characters, the most it takes")
        if not line.strip():
            blank = blank or number
            continue
        if blank:
            raise UsageError(f'{args.jsonl}:{blank}: an empty line (one JSON string per line; "" for an empty text)')
        try:
            text = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{args.jsonl}:{number}: not JSON ({e.msg})") from None
        if not isinstance(text, str):
            raise UsageError(f"{args.jsonl}:{number}: a JSON string per line, got {type(text).__name__}")
        print(json.dumps(codec.encode(text, bos=not args.no_bos)))
    return 0


MAX_JSONL_LINE = 64 << 20  # characters of a `tokenize --jsonl` line (a text's JSON string)
MAX_TEXT_BYTES = 256 << 20  # `perplexity --text`: wikitext-2's test split is 1.3 MB


def _open_text(path: str):
    try:
        return open(path, encoding="utf-8-sig", errors="surrogateescape")  # (a BOM dropped; bytes not UTF-8: said)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    """Prefill tokens/s of each --prompt-tokens prompt and decode tokens/s over --decode-tokens greedy steps,
    each with --depth tokens already in the KV cache (as llama-bench's -p, -n, -d), best of --repeat runs;
    then the weight bytes a decode step reads and the machine's streaming read bandwidth over them. --vs
    measures llama.cpp (llama-bench, default path and --repack 0; or the llama_cpp package) and transformers
    fp32 on the artifact's source model, skipping any that is not installed."""
    from llmc.runtime.artifact import load_manifest
    from llmc.runtime.bench import bandwidth_report, benchmark, decode_weight_bytes, fit_defaults, table

    directory = Path(args.artifact)
    if args.speculate:
        return _bench_speculation(directory, args)
    if args.draft:
        raise UsageError("--draft is for --speculate")
    if args.plot:
        from llmc.plot import check_plot

        check_plot(Path(args.plot))
    manifest = load_manifest(directory, check_files=False)  # (the session checks the files)
    prompts, depths, notes = fit_defaults(manifest.kv_cache["capacity"], args.prompt_tokens, args.depth,
                                          args.decode_tokens)
    for note in notes:
        progress(f"note: {note}")
    if not args.vs and (args.model or args.llama_bench):
        progress("note: --model and --llama-bench apply to --vs only")
    if args.vs:  # the peers' model first: a bad --model ends the run before anything is measured
        from llmc import peers

        source, why = peers.source_model(args.model, manifest.data)
    progress(f"measuring llmc on {directory}")
    try:
        result = benchmark(directory, prompts, args.decode_tokens, args.repeat, args.threads, depths,
                           status=progress.update)
    finally:
        progress.update("")  # (no update is shown later, under another line)
    engines, notes = [result.speeds], []
    if args.vs:
        plan = peers.Plan(prompts, depths, args.decode_tokens, args.repeat, result.threads, result.vocab_size,
                          device=manifest.target)
        found = peers.measure_all(args.vs, source, why, plan, args.llama_bench, progress)
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


def _bench_speculation(directory: Path, args: argparse.Namespace) -> int:
    """`llmc bench --speculate`: greedy decode with speculation against plain decode, on the built-in prompts."""
    from llmc.runtime.bench import speculation_benchmark, speculation_table
    from llmc.runtime.speculate_prompts import GROUNDED, OPEN_ENDED

    given = [flag for flag, value in (("--prompt-tokens", args.prompt_tokens), ("--depth", args.depth),
                                      ("--vs", args.vs), ("--model", args.model),
                                      ("--llama-bench", args.llama_bench), ("--plot", args.plot))
             if value is not None]
    if given:
        raise UsageError(f"{', '.join(given)}: not for --speculate (it measures llmc alone, on its own prompts, "
                         f"without a plot)")
    progress(f"measuring speculative decoding on {directory} ({len(GROUNDED) + len(OPEN_ENDED)} prompts, up to "
             f"{args.decode_tokens} tokens each, best of {args.repeat}, plain and speculative alternating)")
    draft = Path(args.draft) if args.draft else None
    try:
        runs, where = speculation_benchmark(directory, {"input-grounded": GROUNDED, "open-ended": OPEN_ENDED},
                                            args.decode_tokens, args.repeat, args.threads, draft,
                                            status=progress.update)
    finally:
        progress.update("")
    print(speculation_table(runs, where, f"draft {draft.name}" if draft else "prompt lookup"))
    return 0 if all(r.identical for r in runs) else 1


def cmd_perplexity(args: argparse.Namespace) -> int:
    """Perplexity by llama.cpp's method: the text in chunks of --ctx tokens, each from an empty cache, the
    second half of each chunk scored. MODEL is an artifact directory, or a model that is compiled first (with
    the compile options below). --kl-base adds the mean KL divergence and top-token agreement against a base
    (e.g. the --quant f32 build)."""
    import tempfile

    from llmc.runtime.artifact import MANIFEST
    from llmc.runtime.codec import TextCodec
    from llmc.runtime.perplexity import chunk_tokens, perplexity
    from llmc.runtime.session import Conversation, open_session

    text = read_text("--text", args.text, MAX_TEXT_BYTES)
    text = text[:-1] if text.endswith("\n") else text  # as llama-perplexity -f does
    with tempfile.TemporaryDirectory(prefix="llmc-perplexity-") as tmp:

        def session_of(spec: str, name: str) -> Conversation:
            path = Path(spec)
            if path.is_dir() and (path / MANIFEST).exists():
                if compile_options_given(args):
                    progress(f"note: {spec} is an artifact; the compile options do not apply to it")
            else:
                try:
                    from llmc.driver import BackendOptions, compile_model
                except ImportError as e:
                    raise UsageError(f"{spec} is not an artifact directory, and compiling it needs the compiler "
                                     f"({e.name} is not installed)") from e
                if args.max_seq and args.max_seq < args.ctx:
                    raise UsageError(f"--max-seq {args.max_seq} is below --ctx {args.ctx}: a chunk of --ctx tokens "
                                     f"needs a KV cache of as many")
                from llmc.frontend import load_model

                config = load_model(spec, args.allow_pickle, args.tokenizer).config  # (a graph's: known later)
                context = config.context_length if config is not None else args.ctx
                if args.ctx > context:  # (before compiling: the compile's own check names --max-seq)
                    raise UsageError(f"--ctx {args.ctx} is past the context of {spec}, {context} tokens; "
                                     f"choose a smaller --ctx")
                progress(f"compiling {spec} (--ctx {args.ctx})")
                options = replace(compile_options(args), max_seq=max(args.ctx, args.max_seq or 0),
                                  prefill_chunk=args.prefill_chunk or min(128, args.ctx))
                path = compile_model(spec, Path(tmp) / name, options, BackendOptions(cpu=args.cpu),
                                     progress=progress, allow_pickle=args.allow_pickle, tokenizer=args.tokenizer)
            return open_session(path, threads=args.threads)

        session = session_of(args.model, "model")
        base = session_of(args.kl_base, "base") if args.kl_base else None
        if base is not None and base.vocab_size != session.vocab_size:
            raise UsageError(f"--kl-base has a vocabulary of {base.vocab_size}, the model {session.vocab_size}: "
                             f"KL divergence needs the same vocabulary")
        codec = TextCodec.from_artifact(session.manifest)
        chunks = chunk_tokens(codec.encode(text), args.ctx, args.chunks, codec.bos_id, codec.add_bos)
        progress(f"{sum(c.size for c in chunks)} tokens in {len(chunks)} chunks of {args.ctx}")
        result = perplexity(session, chunks, base, progress)
        print(result.report())
        session.close()
        if base is not None:
            base.close()
    return 0
