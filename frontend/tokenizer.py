"""Text ↔ token ids: a `tokenizers.Tokenizer` plus the facts generation needs.

From a GGUF file the tokenizer is rebuilt from `tokenizer.ggml.*` metadata and honours
the pre-tokenizer the file declares (`tokenizer.ggml.pre`): for SmolLM2 (`smollm`)
digits are split one by one before the GPT-2 byte-level split, as in the original
tokenizer and in llama.cpp. From a Hugging Face directory it is `tokenizer.json` as is.
"""

from __future__ import annotations

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from llmc.errors import ModelFormatError
from llmc.runtime.codec import TextCodec

# llama.cpp's split expressions, by GGUF pre-tokenizer name.
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"}
_GPT2 = {"default", "gpt2", "gpt-2", "phi-2", "jina-es", "jina-de", "olmo"}
_SPLIT_THEN_BYTES = {"llama-bpe": _LLAMA3_SPLIT, "llama3": _LLAMA3_SPLIT, "qwen2": _QWEN2_SPLIT}

# GGUF token types (llama.cpp's llama_token_type): control and user-defined tokens are
# matched whole, before the model's own splitting.
_CONTROL, _USER_DEFINED = 3, 4


def supported_pre_tokenizers() -> list[str]:
    return sorted(_DIGITS_THEN_GPT2 | _GPT2 | set(_SPLIT_THEN_BYTES))


def _pre_tokenizer(pre: str, source: object) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
    if pre in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False)
    if pre in _SPLIT_THEN_BYTES:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_SPLIT_THEN_BYTES[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    raise ModelFormatError(
        source, f"unsupported pre-tokenizer '{pre}' (supported: {', '.join(supported_pre_tokenizers())})"
    )


def from_gguf_vocab(
    source: object,
    model: str,
    pre: str,
    tokens: list[str],
    token_types: list[int] | None,
    merges: list[str],
    bos_id: int | None,
    eos_id: int | None,
    add_bos: bool,
    chat_template: str | None,
) -> TextCodec:
    """Rebuild a byte-level BPE tokenizer (`tokenizer.ggml.model = gpt2`) from GGUF metadata."""
    if model != "gpt2":
        raise ModelFormatError(source, f"unsupported tokenizer model '{model}' (supported: gpt2 byte-level BPE)")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelFormatError(source, "tokenizer.ggml.tokens holds duplicate tokens")
    pairs = []
    for merge in merges:
        left, sep, right = merge.partition(" ")
        if not sep or left not in vocab or right not in vocab:
            raise ModelFormatError(source, f"tokenizer.ggml.merges has an invalid entry {merge!r}")
        pairs.append((left, right))
    for name, token_id in (("bos", bos_id), ("eos", eos_id)):
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ModelFormatError(source, f"{name} token id {token_id} is outside the vocabulary of {len(tokens)}")
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False))
    except Exception as e:  # the tokenizers library raises its own exception type
        raise ModelFormatError(source, f"tokenizer.ggml.merges do not form a BPE model: {e}") from e
    tok.pre_tokenizer = _pre_tokenizer(pre, source)
    tok.decoder = decoders.ByteLevel()
    types = token_types or []
    special = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t in (_CONTROL, _USER_DEFINED)]
    tok.add_special_tokens(special)
    return TextCodec(tok, bos_id, eos_id, add_bos, chat_template)
