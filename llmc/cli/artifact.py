"""The commands that run an artifact: `llmc run`, `serve`, `chat`."""

from __future__ import annotations

import argparse
import signal
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

from llmc.cli.common import progress
from llmc.errors import UsageError


def _sampling(args: argparse.Namespace):
    from llmc.runtime.sampling import SamplingOptions

    options = SamplingOptions(args.temperature, args.top_k, args.top_p, args.seed)
    try:
        options.check()
    except ValueError as e:
        raise UsageError(str(e)) from e
    return options


def _codec(session, args: argparse.Namespace):
    """The artifact's text codec, its chat template rendered within --template-seconds/--template-chars."""
    from llmc.runtime.codec import TextCodec

    codec = TextCodec.from_artifact(session.manifest)
    codec.limits = replace(codec.limits, seconds=args.template_seconds, chars=args.template_chars)
    return codec


@contextmanager
def _speculation(session, args: argparse.Namespace):
    """The run's `Speculation` (None with --no-speculate, or without --draft where the artifact has no
    verify entry: the score fallback is slower than decode); a --draft artifact's session, closed after."""
    from llmc.runtime.session import open_session
    from llmc.runtime.speculate import DraftModel, PromptLookup, Speculation

    if not args.speculate:
        if args.draft:
            raise UsageError("--draft is for speculative decoding; leave out --no-speculate")
        yield None
    elif args.draft:
        draft = open_session(Path(args.draft), check_files=not args.no_verify, threads=args.threads)
        try:
            yield Speculation(DraftModel(draft, session, args.draft))
        finally:
            draft.close()
    else:
        yield Speculation(PromptLookup()) if "verify" in session.manifest.entry_points else None


def cmd_run(args: argparse.Namespace) -> int:
    """Load an artifact and generate text, streaming it as it comes. Greedy decoding speculates by default
    (prompt lookup, or a --draft artifact): the same text, several tokens per call where the drafts hold."""
    from llmc.runtime.generate import generate, stream_text
    from llmc.runtime.session import open_session

    sampling = _sampling(args)
    session = open_session(Path(args.artifact), check_files=not args.no_verify, threads=args.threads)
    codec = _codec(session, args)
    prompt = codec.chat(args.prompt) if args.chat else args.prompt
    ids = codec.encode(prompt)
    if not ids:
        raise UsageError("the prompt gives no tokens")
    with _speculation(session, args) as speculation:
        start = time.perf_counter()
        tokens = stream_text(codec, generate(session, codec, ids, args.n, sampling, speculation),
                             lambda s: (sys.stdout.write(s), sys.stdout.flush()), ids)
        elapsed = time.perf_counter() - start
    print()
    drafts = f"; {speculation.stats.line()}" if speculation else ""
    progress(f"[{len(ids)} prompt tokens, {len(tokens)} generated in {elapsed:.2f} s{drafts}]")
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve an artifact over HTTP: POST /v1/completions and /v1/chat/completions (OpenAI's API, streamed as
    server-sent events or whole), GET /v1/models, GET /health. Requests share the artifact's KV cache slots
    (--max-batch at compile time); the others wait in a bounded queue. Needs the serve extra (pip install
    'llmc[serve]')."""
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
                        limits=limits, speculate=args.speculate)

        def ready(url: str) -> None:
            print(f"llmc serve: listening on {url} (model '{name}', {server.engine.max_active} sequences at once, "
                  f"{args.queue} more may wait, KV capacity {session.capacity} each; Ctrl-C stops)", flush=True)

        try:
            serve(server, args.host, args.port, ready)
        except KeyboardInterrupt:
            pass
        progress("llmc serve: stopped")
    finally:
        session.close()
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    """Interactive multi-turn chat with the model's chat template. The conversation stays in the KV cache:
    each turn feeds only its new tokens. Commands: /reset, /system TEXT, /quit (or end of input). Ctrl-C stops
    a reply; at the prompt it ends the chat."""
    from llmc.runtime.chat import Chat, run_chat
    from llmc.runtime.session import open_session

    sampling = _sampling(args)
    session = open_session(Path(args.artifact), check_files=not args.no_verify, threads=args.threads)
    try:
        codec = _codec(session, args)
        if not codec.chat_template:
            raise UsageError("this model has no chat template; use 'llmc run' for plain completion")
        with _speculation(session, args) as speculation:
            chat = Chat(session, codec, args.system, sampling, args.n, speculation=speculation)
            # Ctrl-C at the prompt ends the chat even where SIGINT came ignored from the parent (Python then
            # installs no KeyboardInterrupt handler, and a reply's own handler would restore the ignoring)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            run_chat(chat, verbose=args.verbose)
    finally:
        session.close()
    return 0
