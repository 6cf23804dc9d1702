"""The `llmc` command line.

    llmc ir MODEL [--phase import|optimize] [-o FILE]     print a model's IR
    llmc opt FILE.mlir [-p PASS,PASS] [--print-ir-after-all]   parse, verify, run passes, print
    llmc verify MODEL [--prompt TEXT] [--quant T]          compare every stage with the source model
    llmc compile MODEL [--target cpu|cuda] [-o DIR]        compile to an artifact directory
    llmc run DIR (-p TEXT | -f FILE) [-n N] [--stop S]    generate text with an artifact
    llmc serve DIR [--port P] [--max-batch N] [--ctx N]   an OpenAI-compatible HTTP API over an artifact
    llmc chat DIR [--system TEXT] [-n N] [sampling]       chat with an artifact in the terminal
    llmc tokenize MODEL TEXT [--ids] [--jsonl FILE]       a text's tokens, as llama-tokenize prints them
    llmc bench DIR [--depth D,D] [--vs PEER,PEER]         prefill and decode tokens/s, next to peers
    llmc perplexity MODEL|DIR --text FILE [--ctx 512]     perplexity (and KL divergence) on a text

MODEL is a `.gguf` file, a Hugging Face directory, or a known name (`smollm2-135m`).
Errors in the input or options print one line and exit with code 2; `--debug` shows
the traceback instead. `parser.py` holds every command's options and `main`; each command
is a `cmd_*` function of `compiler.py` (ir, opt, verify, compile), `artifact.py` (run,
serve, chat) or `measure.py` (tokenize, bench, perplexity), its docstring its description.
"""

from llmc.cli.parser import build_parser, main

__all__ = ["build_parser", "main"]
