"""The `llmc` argument parser and `main`: each command's options, run by its `cmd_*` function."""

from __future__ import annotations

import argparse
import errno
import os
import signal
import sys

from llmc import __version__
from llmc.cli.artifact import cmd_chat, cmd_run, cmd_serve
from llmc.cli.compiler import cmd_compile, cmd_ir, cmd_opt, cmd_verify
from llmc.cli.measure import cmd_bench, cmd_perplexity, cmd_tokenize
from llmc.errors import LlmcError, printable

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """Bad options end in one line, like every other llmc error."""

    def error(self, message: str) -> None:
        self.exit(EXIT_USAGE, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _name(text: str) -> str:
    """A file, folder or model an option names: not empty (an empty name would read as the option left out, or as
    the current folder)."""
    if not text:
        raise argparse.ArgumentTypeError("an empty name")
    return text


def _host(text: str) -> str:
    """An address to listen on: not empty or blank (uvicorn would listen on every interface)."""
    if not text.strip():
        raise argparse.ArgumentTypeError("an empty address (0.0.0.0 listens on every interface, 127.0.0.1 on this "
                                         "machine only)")
    return text


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


def _seed(text: str) -> int:
    return _int(text) % 2**64


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value <= 3600:
        raise argparse.ArgumentTypeError(f"must be in (0, 3600] seconds, got {text}")
    return value


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _token_bias(text: str) -> tuple[int, float]:
    """`ID=BIAS` (llama.cpp's --logit-bias, OpenAI's logit_bias entry): `15043=-100` → (15043, -100.0)."""
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS such as 15043=-100, got {text!r}") from None


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
                        "decode within 40%% and prefill within 70%% of all-a8")
    p.add_argument("--calibrate", type=_name, metavar="FILE",
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
    p.add_argument("--exact-logits", action="store_true",
                   help="decode's LM head with int16 rows for every logit (by default, on AVX-512 VNNI, where the "
                        "LM head is a third or more of a step's weights: int8 rows first, int16 again wherever a "
                        "logit comes within 2.0 of its block's largest, so greedy choices read exact logits; pass "
                        "`screen-logits`)")
    p.add_argument("--max-seq", type=_positive, metavar="N",
                   help="KV cache capacity in tokens (default: the model's context length, at most 4096)")
    p.add_argument("--prefill-chunk", type=_positive, metavar="N",
                   help="most tokens one prefill call takes; longer prompts go in chunks (default: 128, 512 "
                        "for --target cuda; at most --max-seq)")
    p.add_argument("--max-batch", type=_positive, metavar="B", default=1,
                   help="sequences decoded together: the KV cache holds B of them (each --max-seq tokens) and "
                        "one decode call takes a token of each, reading the weights once (`llmc serve`; "
                        "default 1)")
    p.add_argument("--speculate", type=_non_negative, metavar="K", default=8, dest="verify_drafts",
                   help="add the `verify` entry point: the last token and up to K drafted ones checked in one call "
                        "(speculative decoding; default 8, 0: none); such a call costs 1 to 3 decode calls, more with more "
                        "drafts (SmolLM2 at K = 8: about 2 with AMX, 3 with AVX-512 VNNI)")
    _add_raise_option(p)


def _add_raise_option(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-raise", action="append", metavar="NAME",
                   help="for a .pt2/.onnx graph: leave this pattern unraised, its primitive ops compiled by "
                        "generic kernels (to compare; repeatable; one of embedding, linear, rms-norm, swiglu, "
                        "rope, attention, lm-head)")


def _add_dump_options(p: argparse.ArgumentParser, to_directory: bool = True) -> None:
    p.add_argument("--print-ir-after-all", action="store_true", help="print the IR to stderr after every pass")
    if to_directory:
        p.add_argument("--dump-ir", type=_name, metavar="DIR",
                       help="write the IR after every pass to DIR as numbered .mlir files")


def _add_ir_output_options(p: argparse.ArgumentParser, to_directory: bool = True) -> None:
    """Where the IR a command prints goes, in which form, and the dumps after every pass."""
    p.add_argument("-o", "--output", type=_name, metavar="FILE", help="write the IR to FILE instead of stdout")
    p.add_argument("--generic", action="store_true", help="print the generic op form instead of the custom one")
    _add_dump_options(p, to_directory)


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


def _command(sub, run, parents: list[argparse.ArgumentParser], help: str) -> argparse.ArgumentParser:
    """The subcommand `run` implements (`cmd_bench`: `llmc bench`), its docstring the description."""
    p = sub.add_parser(run.__name__.removeprefix("cmd_"), parents=parents, help=help, description=run.__doc__)
    p.set_defaults(run=run, parser=p)
    return p


def build_parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                        help="show the full traceback on errors")
    model_help = ("a .gguf file, a Hugging Face model directory, an exported graph (.pt2 from torch.export.save, "
                  ".onnx), or a known model name (smollm2-135m)")
    model_args = argparse.ArgumentParser(add_help=False)
    model_args.add_argument("model", type=_name, metavar="MODEL", help=model_help)
    model_args.add_argument("--allow-pickle", action="store_true",
                            help="load pickle checkpoints (*.bin, *.pt) of a Hugging Face directory, through "
                                 "torch's weights-only loader, and .pt2 files whose loading can run code "
                                 "(pickled parts, guard code, compiled packages); without it they are refused")
    model_args.add_argument("--tokenizer", type=_name, metavar="PATH",
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

    p = _command(sub, cmd_ir, [common, model_args], "print a model's IR after a phase")
    p.add_argument("--phase", choices=["import", "optimize"], default="import",
                   help="the last phase to run (default: import; 'llmc compile --compile-to' runs later ones)")
    p.add_argument("--cpu", default="native", metavar="NAME",
                   help="the CPU recorded as the module's target (default: native)")
    _add_ir_output_options(p)

    p = _command(sub, cmd_opt, [common], "parse, verify, transform and print IR")
    p.add_argument("file", type=_name, metavar="FILE.mlir", help="IR text to read ('-' for stdin)")
    p.add_argument("-p", "--passes", metavar="PASS,PASS",
                   help="comma-separated passes to run in order, options in braces as xDSL writes them: "
                        "'canonicalize,dce', 'quantize{compute=a16},split{prefill_chunk=4 max_seq=16},group' "
                        "(an unknown name lists the passes)")
    _add_ir_output_options(p, to_directory=False)

    p = _command(sub, cmd_verify, [common, model_args], "compare every stage's logits with the source model")
    p.add_argument("--prompt", default="The capital of France is", help="text to run (default: %(default)r)")
    p.add_argument("--tolerance", type=float, default=0.9999, metavar="COS",
                   help="lowest acceptable cosine similarity per stage (default: %(default)s)")
    p.add_argument("--artifact", type=_name, metavar="DIR",
                   help="check this compiled artifact of MODEL, with the options it was compiled with "
                        "(default: compile one to a temporary directory)")
    p.add_argument("--reference", type=_name, metavar="DIR",
                   help="take the reference from this Hugging Face directory of the same model (the checkpoint "
                        "a GGUF file was converted from; transformers reads few GGUF features) "
                        "(default: MODEL itself)")
    p.add_argument("--per-layer", action="store_true",
                   help="after the stages, one row per projection: the compute mode quantize chose and the relative "
                        "output error of a8 and a16 activations on the prompt (why a layer was kept wider)")
    _add_quant_options(p)
    _add_kv_option(p)
    _add_raise_option(p)

    p = _command(sub, cmd_compile, [common, model_args], "compile a model to an artifact")
    p.add_argument("--target", default="cpu", choices=["cpu", "cuda"], help="code generation target (default: cpu)")
    p.add_argument("--gpu", metavar="SM[,SM]",
                   help="with --target cuda: GPU architectures (sm_80, sm_86, sm_89, sm_90); PTX for the oldest, "
                        "a cubin for each when ptxas is on PATH (default: sm_80,sm_90)")
    p.add_argument("-o", "--output", type=_name, metavar="DIR",
                   help="artifact directory (default: MODEL's name + .llmc): a new or empty folder, or an artifact, "
                        "replaced once the compile succeeds; with --compile-to, the IR file")
    _add_compile_options(p)
    p.add_argument("--compile-to", metavar="PHASE",
                   choices=["import", "optimize", "quantize", "split", "group", "lower"],
                   help="stop after PHASE and print its IR (to -o FILE if given)")
    p.add_argument("--no-cache", action="store_true",
                   help="compile every kernel with LLVM, neither reading nor writing the kernel cache "
                        "($LLMC_CACHE_DIR, else ~/.cache/llmc; LLMC_CACHE_DIR=off turns it off for good)")
    p.add_argument("--jobs", type=_positive, metavar="N",
                   help="processes that compile the kernels the cache lacks, 1 for none besides this one "
                        "(default: $LLMC_JOBS, else every CPU available)")
    _add_dump_options(p)

    # what every command that runs an artifact takes, and what those that sample take
    artifact_args = argparse.ArgumentParser(add_help=False)
    artifact_args.add_argument("artifact", type=_name, metavar="DIR", help="an artifact directory from 'llmc compile'")
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
    artifact_args.add_argument("--ctx", type=_positive, metavar="N",
                               help="the most tokens a sequence holds, prompt and reply, up to what the artifact "
                                    "was compiled for (--max-seq) (default: all of it)")
    artifact_args.add_argument("--chat-template", type=_name, metavar="FILE",
                               help="render chats with this Jinja chat template instead of the model's own")
    sampling_args = argparse.ArgumentParser(add_help=False)
    sampling_args.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default: 0)")
    sampling_args.add_argument("--top-k", type=_int, default=0, metavar="K",
                               help="sample among the K likeliest (0 = all)")
    sampling_args.add_argument("--top-p", type=float, default=1.0, metavar="P",
                               help="nucleus sampling mass in (0, 1] (default: 1)")
    sampling_args.add_argument("--seed", type=_seed, metavar="S",
                               help="random seed for sampling (any integer, taken modulo 2**64 as the server does)")
    sampling_args.add_argument("--min-p", type=_number, default=0.0, metavar="P",
                               help="drop tokens less likely than P times the likeliest, in [0, 1] (default: 0)")
    sampling_args.add_argument("--presence-penalty", type=_number, default=0.0, metavar="X",
                               help="subtract X from the logit of every token generated already, in [-2, 2] "
                                    "(OpenAI's; default: 0)")
    sampling_args.add_argument("--frequency-penalty", type=_number, default=0.0, metavar="X",
                               help="subtract X times its count from the logit of every token generated already, "
                                    "in [-2, 2] (OpenAI's; default: 0)")
    sampling_args.add_argument("--repeat-penalty", "--repetition-penalty", type=_number, default=1.0, metavar="X",
                               help="divide the positive logits (multiply the negative ones) of the tokens in the "
                                    "prompt and the text so far by X in [0.1, 10] (llama.cpp's and transformers'; default: 1)")
    sampling_args.add_argument("--logit-bias", type=_token_bias, action="append", metavar="ID=BIAS",
                               help="add BIAS in [-100, 100] to token ID's logit (-100 bans it, 100 forces it; "
                                    "repeatable)")
    grammar_args = argparse.ArgumentParser(add_help=False)
    constrained = grammar_args.add_mutually_exclusive_group()
    constrained.add_argument("--json-schema", type=_name, metavar="FILE|JSON",
                             help="generate JSON that this JSON schema (a file, or the schema's text) accepts "
                                  "(constrained decoding: llguidance, from the serve extra)")
    constrained.add_argument("--grammar", type=_name, metavar="FILE",
                             help="generate text this grammar accepts: GBNF (llama.cpp's), or Lark where FILE ends "
                                  "in .lark")
    speculate_args = argparse.ArgumentParser(add_help=False)
    speculate_args.add_argument("--speculate", action=argparse.BooleanOptionalAction, default=None,  # (None: on)
                                help="draft the next tokens by prompt lookup (or --draft) and check them in one "
                                     "verify call: greedy text is unchanged; only as many drafts are checked as "
                                     "the calls' timings say pay, and drafting backs off where they are rejected "
                                     "(default: on)")
    speculate_args.add_argument("--draft", type=_name, metavar="DIR",
                                help="draft with this artifact (a smaller model with the same vocabulary) instead "
                                     "of prompt lookup")

    p = _command(sub, cmd_run, [common, artifact_args, sampling_args, grammar_args, speculate_args],
                 "generate text with a compiled artifact")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("-p", "--prompt", help="the prompt text")
    prompt.add_argument("-f", "--file", type=_name, metavar="FILE",
                        help="read the prompt from this UTF-8 file ('-': standard input), less one final newline")
    p.add_argument("-n", type=_non_negative, default=128, metavar="N", help="most tokens to generate (default: 128)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", metavar="TEXT", help="the system prompt (implies --chat; empty: none)")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="stop before this text, which is not printed (repeatable)")

    p = _command(sub, cmd_serve, [common, artifact_args], "serve an artifact over an OpenAI-compatible HTTP API")
    p.add_argument("--host", type=_host, default="127.0.0.1", help="address to listen on (default: %(default)s)")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on; 0 = any free one "
                                                                     "(default: %(default)s)")
    p.add_argument("--max-batch", type=_positive, metavar="N",
                   help="most sequences generating at once, chosen now up to the slots the artifact's KV cache was "
                        "compiled with ('llmc compile --max-batch') (default: every slot)")
    p.add_argument("--queue", type=_non_negative, default=64, metavar="N",
                   help="requests that may wait for a slot; beyond them the server answers 429 (default: 64)")
    p.add_argument("--speculate", action=argparse.BooleanOptionalAction, default=True,
                   help="draft each sequence's next tokens by prompt lookup and check them in one verify call "
                        "(greedy text is unchanged; only as many drafts are checked as the calls' timings say pay, "
                        "and drafting backs off where they are rejected) (default: on)")
    for part, default, slower in (("head", 10.0, "are disconnected"), ("body", 30.0, "get 408")):
        p.add_argument(f"--{part}-timeout", type=_seconds, default=default, metavar="S",
                       help=f"seconds a client has to send a whole request {part}; slower ones {slower} "
                            "(default: %(default)s)")
    p.add_argument("--api-key", metavar="KEY", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health (default: $LLMC_API_KEY; "
                        "none: open)")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="let browser pages from ORIGIN ('*': any) call the API (repeatable; default: none, CORS off)")
    p.add_argument("--no-access-log", action="store_true", help="leave out the line per request on stderr")

    p = _command(sub, cmd_chat, [common, artifact_args, sampling_args, grammar_args, speculate_args],
                 "chat with an artifact in the terminal")
    p.add_argument("--system", metavar="TEXT", help="the system prompt (empty: none)")
    p.add_argument("-n", type=_positive, default=512, metavar="N", help="most tokens per reply (default: 512)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="after each reply, a line of token counts (reused from the cache, fed, generated)")

    p = _command(sub, cmd_tokenize, [common], "print a text's tokens, as llama-tokenize does")
    p.add_argument("model", type=_name, metavar="MODEL",
                   help="a .gguf file, a Hugging Face or artifact directory, or a known model name (smollm2-135m)")
    p.add_argument("text", metavar="TEXT", nargs="?", help="the text to tokenize")
    p.add_argument("--ids", action="store_true", help="print only the ids, as a JSON list")
    p.add_argument("--jsonl", type=_name, metavar="FILE",
                   help="tokenize each line of FILE (- for standard input), a JSON string")
    p.add_argument("--no-bos", action="store_true", help="leave out the beginning-of-text token")

    p = _command(sub, cmd_bench, [common], "measure prefill and decode speed, next to other engines")
    p.add_argument("artifact", type=_name, metavar="DIR", help="an artifact directory from 'llmc compile'")
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
    p.add_argument("--model", type=_name, metavar="GGUF_OR_HF_DIR",
                   help="the model the peers run (default: the artifact's source, if the manifest records one)")
    p.add_argument("--llama-bench", type=_name, metavar="PATH",
                   help="llama.cpp's llama-bench binary (default: on PATH)")
    p.add_argument("--plot", type=_name, metavar="FILE.png",
                   help="write a bar chart of the tokens/s (needs matplotlib)")
    p.add_argument("--speculate", action="store_true",
                   help="instead: greedy decode tokens/s with speculative decoding against plain decode on "
                        "built-in input-grounded and open-ended chat prompts (--decode-tokens each), acceptance, "
                        "tokens per call")
    p.add_argument("--draft", type=_name, metavar="DIR",
                   help="with --speculate: draft with this artifact, not prompt lookup")

    p = _command(sub, cmd_perplexity, [common, model_args], "perplexity of a model on a text")
    p.add_argument("--text", required=True, type=_name, metavar="FILE", help="UTF-8 text to score")
    p.add_argument("--ctx", type=_positive, default=512, metavar="N", help="tokens per chunk (default: 512)")
    p.add_argument("--chunks", type=_positive, metavar="N", help="score only the first N chunks")
    p.add_argument("--kl-base", type=_name, metavar="MODEL|DIR",
                   help="an artifact (or model) to compare the distributions with")
    p.add_argument("--threads", type=_positive, metavar="N", help="threads to run on (default: every CPU available)")
    _add_compile_options(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # (the command's own help lists what it takes)
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.run(args)
    except LlmcError as e:
        if args.debug:
            raise
        print(f"llmc: error: {printable(e, 1000)}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # (`llmc run … | head`: the reader has gone) quietly, with SIGPIPE's status
        _drop_stdout()
        return 128 + signal.SIGPIPE
    except Exception as e:
        if args.debug:
            raise
        if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):  # (a full disk: not llmc's fault)
            _drop_stdout()  # (what waits in its buffer could not be written at exit either)
            print(f"llmc: error: cannot write: {e.strerror}", file=sys.stderr)
            return 1
        if isinstance(e, MemoryError):  # (the machine's memory, or the process's limit: `ulimit -v`)
            print(f"llmc: error: out of memory{f': {e}' if str(e) else ''} (this needs more memory than the "
                  f"process may use)", file=sys.stderr)
            return 1
        if isinstance(e, RuntimeError) and str(e) == "can't start new thread":  # (its stack not allocated)
            print("llmc: error: cannot start a thread: too little memory, or too many threads, under the "
                  "process's limits", file=sys.stderr)
            return 1
        print(f"llmc: internal error: {type(e).__name__}: {e} (rerun with --debug for the traceback)", file=sys.stderr)
        return 1


def _drop_stdout() -> None:
    """Point standard output at /dev/null: what is left in its buffer goes nowhere at exit, without a second error."""
    try:
        null = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        os.dup2(null, sys.stdout.fileno())
    except (OSError, ValueError):  # (no file descriptor: a test's captured output)
        pass
    finally:
        os.close(null)
