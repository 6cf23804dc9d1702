"""llmc: an ahead-of-time compiler for large language models.

Kept light on purpose: importing `llmc` pulls in nothing heavy. The pieces are
`llmc.frontend` (model files to IR), `llmc.ir` (dialects, weight store, numpy
reference), `llmc.passes` (phases), `llmc.backends` and `llmc.runtime`.
"""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"


def compile(module, example_inputs: tuple, output: str | Path, *, tokenizer: str, target: str = "cpu",  # noqa: A001
            progress=print, **options) -> Path:
    """Compile a torch causal LM to an artifact directory, as `llmc compile` does a file.

    `module` is a Hugging Face `*ForCausalLM` or any module whose `forward(input_ids)` returns
    logits `[1, T, V]`; `example_inputs` is `(input_ids,)` (`[1, T]` int64; the token count is
    exported as dynamic). It goes through torch.export, the `llm` import and the raising of
    `optimize`. `tokenizer` is what `llmc tokenize` takes (a tokenizer.json directory, a .gguf
    file, a known model name); `options` are `CompileOptions` fields (`quant="q8_0"`, `max_seq=…`).

        llmc.compile(model, (torch.tensor([[1, 2, 3]]),), "out.llmc", tokenizer="smollm2-135m")
    """
    from llmc.driver import BackendOptions, compile_torch
    from llmc.passes.pipeline import CompileOptions

    return compile_torch(module, tuple(example_inputs), Path(output), tokenizer, CompileOptions(**options),
                         BackendOptions(target=target), progress)
