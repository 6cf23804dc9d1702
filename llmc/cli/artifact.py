"""The commands that run an artifact: `llmc run`, `serve`, `chat`."""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from llmc.cli.common import progress
from llmc.errors import UsageError
from llmc.textfile import read_text

MAX_PROMPT_BYTES = 8 << 20  # -f: far more text than any KV cache holds the tokens of
MAX_GRAMMAR_BYTES = 1 << 20  # --json-schema, --grammar


def _sampling(args: argparse.Namespace):
    """The `SamplingOptions` of the sampling options, checked (UsageError naming the option)."""
    from llmc.runtime.sampling import SamplingOptions

    options = SamplingOptions(args.temperature, args.top_k, args.top_p, args.seed, min_p=args.min_p,
                              presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty,
                              repetition_penalty=args.repeat_penalty, logit_bias=tuple(args.logit_bias or ()))
    try:
        options.check()
    except ValueError as e:
        raise UsageError(str(e)) from e
    if options.temperature == 0:  # (greedy: the options that shape sampling change nothing)
        given = [f"--{name.replace('_', '-')}" for name in ("top_k", "top_p", "min_p", "seed")
                 if getattr(args, name) != args.parser.get_default(name)]
        if given:
            progress(f"note: {', '.join(given)} shape sampling, and --temperature 0 (the default) decodes greedily: "
                     f"give a --temperature above 0 to sample")
    return options


def _prompt(args: argparse.Namespace) -> str:
    """The prompt: -p's text, or -f's file (or standard input) less one final newline, as llama.cpp reads it."""
    if args.prompt is not None:
        return args.prompt
    text = read_text("-f", args.file, MAX_PROMPT_BYTES)
    return text[:-2] if text.endswith("\r\n") else text.removesuffix("\n")


def _grammar_source(args: argparse.Namespace) -> tuple[str, str | dict] | None:
    """What --json-schema or --grammar asks for, read and parsed before the model loads: ("json_schema", the
    schema), ("lark" or "gbnf", the grammar's text), or None."""
    if args.grammar:
        return ("lark" if args.grammar.endswith(".lark") else "gbnf"), read_text("--grammar", args.grammar,
                                                                             MAX_GRAMMAR_BYTES)
    if not args.json_schema:
        return None
    given = args.json_schema
    text = given if given.lstrip().startswith("{") else read_text("--json-schema", given, MAX_GRAMMAR_BYTES)
    try:
        schema = json.loads(text)
    except ValueError as e:
        raise UsageError(f"--json-schema: not JSON ({e})") from None
    if not isinstance(schema, dict):
        raise UsageError(f"--json-schema: a schema is a JSON object, got {type(schema).__name__}")
    return "json_schema", schema


def _grammar(codec, source: tuple[str, str | dict] | None):
    """The compiled `Grammar` of `_grammar_source` for the model's `codec` (None for none)."""
    if source is None:
        return None
    from llmc.runtime.grammar import Grammar, GrammarError

    kind, given = source
    try:
        return getattr(Grammar, kind)(codec, given)
    except GrammarError as e:
        raise UsageError(f"{'--json-schema' if kind == 'json_schema' else '--grammar'}: {e}") from None


@contextmanager
def _loaded(args: argparse.Namespace) -> Iterator[tuple]:
    """The artifact's session (limited to --ctx tokens per sequence) and its text codec (its chat template
    from --chat-template if given, rendered within --template-seconds/--template-chars); closed after."""
    from llmc.runtime.codec import TextCodec, read_chat_template
    from llmc.runtime.session import open_session
    from llmc.runtime.templates import DEFAULT_LIMITS

    limits = replace(DEFAULT_LIMITS, seconds=args.template_seconds, chars=args.template_chars)
    template = read_chat_template(args.chat_template, limits) if args.chat_template else None
    session = open_session(Path(args.artifact), check_files=not args.no_verify, threads=args.threads)
    try:
        if args.ctx:
            session.limit_context(args.ctx)
        codec = TextCodec.from_artifact(session.manifest)
        codec.limits = limits
        if template is not None:
            codec.chat_template = template
        for token, _ in getattr(args, "logit_bias", None) or ():
            if token >= session.vocab_size:
                raise UsageError(f"--logit-bias: token {token} is outside the model's vocabulary of "
                                 f"{session.vocab_size}")
        yield session, codec
    finally:
        session.close()


@contextmanager
def _speculation(session, args: argparse.Namespace):
    """The run's `Speculation` (None with --no-speculate, or without --draft where the artifact has no
    verify entry: the score fallback is slower than decode); a --draft artifact's session, closed after."""
    from llmc.runtime.session import open_session
    from llmc.runtime.speculate import DraftModel, PromptLookup, Speculation

    if args.speculate is False:
        if args.draft:
            raise UsageError("--draft is for speculative decoding; leave out --no-speculate")
        yield None
    elif args.draft:
        draft = open_session(Path(args.draft), check_files=not args.no_verify, threads=args.threads)
        try:
            yield Speculation(DraftModel(draft, session, args.draft))
        finally:
            draft.close()
    elif "verify" in session.manifest.entry_points:
        yield Speculation(PromptLookup())
    else:
        if args.speculate:  # (asked for, not the default)
            progress("note: this artifact has no verify entry point (compiled with --speculate 0): prompt lookup "
                     "would check its drafts through the slower score path, so decoding is plain; --draft DIR still "
                     "speculates")
        yield None


def _closing_line(generation, generated: int, seconds: float, stopped: str, speculation) -> str:
    """`[5 prompt tokens at 410 tok/s; 29 generated at 210 tok/s; stopped: end of text; <speculation>]`: the
    prompt's tokens over the time to the first token, the rest over the time after it."""
    fed = len(generation.prompt) - generation.reused
    prompt = f"{fed} prompt tokens at {fed / max(generation.prompt_seconds, 1e-9):.0f} tok/s"
    after = seconds - generation.prompt_seconds
    rate = f" at {(generated - 1) / after:.0f} tok/s" if generated > 1 and after > 0 else ""
    drafts = f"; {speculation.stats.line()}" if speculation else ""
    return f"[{prompt}; {generated} generated{rate}; stopped: {stopped}{drafts}]"


def cmd_run(args: argparse.Namespace) -> int:
    """Load an artifact and generate text, streaming it as it comes. Greedy decoding speculates by default
    (prompt lookup, or a --draft artifact): the same text, several tokens per call where the drafts hold."""
    from llmc.runtime.generate import StopStrings, generate, stream_text

    sampling = _sampling(args)
    prompt = _prompt(args)
    source = _grammar_source(args)
    if any(not stop for stop in args.stop or ()):
        raise UsageError("--stop: a stop string cannot be empty")
    if args.chat_template and not args.chat and args.system is None:
        raise UsageError("--chat-template renders chats: add --chat (or --system) to render the prompt as one")
    with _loaded(args) as (session, codec):
        if args.system is not None and not codec.chat_template:
            raise UsageError("--system needs the model's chat template, and this model has none "
                             "(give one with --chat-template FILE)")
        if args.chat or args.system is not None:  # (an empty --system is none, as chat's `/system`)
            system = [{"role": "system", "content": args.system}] if args.system else []
            prompt = codec.render_chat([*system, {"role": "user", "content": prompt}])
        ids = codec.encode(prompt)
        if not ids:
            raise UsageError("the prompt gives no tokens")
        grammar = _grammar(codec, source)
        with _speculation(session, args) as speculation:
            generation = generate(session, codec, ids, args.n, sampling, speculation,
                                  grammar.constraint() if grammar else None)
            stops = StopStrings(args.stop or ())
            start = time.perf_counter()
            tokens = stream_text(codec, generation, lambda s: (sys.stdout.write(s), sys.stdout.flush()), ids, stops)
            seconds = time.perf_counter() - start
        print()
        stopped = (f"stop string {json.dumps(stops.found, ensure_ascii=False)}" if stops.found else
                   {"eos": "end of text", "length": f"length (-n {args.n})",
                    "full": f"context full ({session.capacity} tokens)"}[generation.reason])
        progress(_closing_line(generation, len(tokens), seconds, stopped, speculation))
    return 0


def _serve_options(args: argparse.Namespace):
    """The server's `ServeOptions`: --api-key (else $LLMC_API_KEY), --cors-origin, --no-access-log."""
    from llmc.runtime.operations import ServeOptions

    key = args.api_key if args.api_key is not None else os.environ.get("LLMC_API_KEY")
    if key is not None and not key.strip():
        where = "--api-key" if args.api_key is not None else "$LLMC_API_KEY"
        raise UsageError(f"{where}: the key is empty (unset $LLMC_API_KEY and give no --api-key for an open server)")
    return ServeOptions(api_key=key,
                        cors_origins=tuple(args.cors_origin or ()), access_log=not args.no_access_log)


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve an artifact over HTTP: POST /v1/completions and /v1/chat/completions (OpenAI's API, streamed as
    server-sent events or whole), GET /v1/models, GET /health, GET /metrics, POST /tokenize and /detokenize.
    Requests share the artifact's KV cache slots (--max-batch at compile time), reusing the prefix a slot
    holds; the others wait in a bounded queue. Needs the serve extra (pip install 'llmc[serve]')."""
    try:
        from llmc.runtime.server import Limits, Server, model_name, serve
    except ImportError as e:
        if e.name not in ("starlette", "uvicorn") and not (e.name or "").startswith(("starlette.", "uvicorn.")):
            raise
        raise UsageError(f"llmc serve needs starlette and uvicorn ({e.name} is not installed): "
                         f"pip install 'llmc[serve]'") from None

    options = _serve_options(args)
    directory = Path(args.artifact)
    with _loaded(args) as (session, codec):
        name = model_name(directory)
        limits = Limits.for_capacity(session.capacity, head_seconds=args.head_timeout, body_seconds=args.body_timeout)
        server = Server(session, codec, name, args.queue, args.max_batch, aliases=(directory.resolve().name,),
                        limits=limits, speculate=args.speculate, options=options)
        _map_cache(session, server.engine.max_active)

        def ready(url: str) -> None:
            key = "; an API key is required" if options.api_key else ""
            print(f"llmc serve: listening on {url} (model '{name}', {server.engine.max_active} sequences at once, "
                  f"{args.queue} more may wait, context {session.capacity} tokens each{key}; Ctrl-C stops)",
                  flush=True)

        try:
            serve(server, args.host, args.port, ready)
        except KeyboardInterrupt:
            pass
        progress("llmc serve: stopped")
    return 0


def _map_cache(session, slots: int) -> None:
    """Map the KV cache's rows of the server's `slots` sequences before it listens, not by its first requests
    (`Session.fault_in_cache`), where the memory available holds them (past it, a line says they are mapped as
    requests reach them, as before); a line says so first above 1 GB."""
    from llmc.runtime.session import available_memory

    size, free = session.cache_rows_bytes(slots), available_memory()
    if free is not None and size > free:
        progress(f"llmc serve: the KV cache's rows in use ({size / 1e9:.1f} GB) exceed the memory available "
                 f"({free / 1e9:.1f} GB): requests map them as they reach them")
        return
    if size > 1e9:
        progress(f"llmc serve: mapping the KV cache's rows in use ({size / 1e9:.1f} GB)")
    session.fault_in_cache(slots)


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive multi-turn chat with the model's chat template. The conversation stays in the KV cache:
    each turn feeds only its new tokens. Commands: /reset, /system TEXT, /quit (or end of input). Ctrl-C stops
    a reply; at the prompt it ends the chat."""
    from llmc.runtime.chat import Chat, run_chat

    sampling = _sampling(args)
    source = _grammar_source(args)
    with _loaded(args) as (session, codec):
        if not codec.chat_template:
            raise UsageError("this model has no chat template (give one with --chat-template FILE, or use "
                             "'llmc run' for plain completion)")
        grammar = _grammar(codec, source)
        with _speculation(session, args) as speculation:
            chat = Chat(session, codec, args.system, sampling, args.n, speculation=speculation, grammar=grammar)
            # Ctrl-C at the prompt ends the chat even where SIGINT came ignored from the parent (Python then
            # installs no KeyboardInterrupt handler, and a reply's own handler would restore the ignoring)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            run_chat(chat, verbose=args.verbose)
    return 0
