"""Text ↔ token ids: a `tokenizers.Tokenizer` plus the facts generation needs.

From a GGUF file the tokenizer is rebuilt from `tokenizer.ggml.*` metadata to give the ids
llama.cpp gives (its `src/llama-vocab.cpp`), as a `tokenizers.Tokenizer` (so an artifact's
`tokenizer.json` needs nothing else):

- byte-level BPE (`tokenizer.ggml.model = gpt2`): the text is cut by the regular expressions
  llama.cpp has for the file's pre-tokenizer (`tokenizer.ggml.pre`), one after the other, then
  each piece is byte-encoded and merged by `tokenizer.ggml.merges`, lowest rank first;
- BPE on UTF-8 text with spaces written '▁' (`gemma4`, and pre-tokenizer `sarvam-moe`);
- SentencePiece (`llama`): a space before the text (`tokenizer.ggml.add_space_prefix`), every
  space written '▁', then adjacent symbols merged best score first (`tokenizer.ggml.scores`);
  a character the vocabulary lacks becomes `<0xXX>` byte tokens. The merges llama.cpp searches
  for at run time are written out as BPE merges ranked by the merged token's score.

Special tokens are matched whole first, as llama.cpp matches them when it parses special
tokens: control, user-defined and unknown tokens, and those it takes by their text for
end-of-generation markers.

From a Hugging Face directory it is `tokenizer.json` as is.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from llmc.errors import ModelFormatError
from llmc.runtime.codec import TextCodec, tokenizer_failures

# the most tokens a vocabulary may hold: four times the largest real ones (Gemma's 262,144);
# building a tokenizer costs seconds per million tokens
MAX_VOCABULARY = 1 << 20
# the most characters deriving SentencePiece merges may slice and look up (real vocabularies
# take 10^6 to 2 * 10^7; this is half a second)
_MAX_MERGE_WORK = 1 << 28

# llama.cpp's split expressions (llm_tokenizer_bpe), written for the `tokenizers` library's
# regex engine (Oniguruma) so that it matches what llama.cpp matches: llama.cpp runs an
# expression with a Unicode class on text whose characters stand for their class, so there
# \p{Lu}, \p{Ll}, \p{Lt}, \p{Lm} and \p{Lo} all mean any letter (\p{L}), and it runs the
# others with std::regex, where \d is [0-9] and $ is the end of the piece (\z).
_CONTRACTIONS = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_LLAMA3 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2 = _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN35 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")
_JAIS2 = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s{512}(?!\S)|\s{256}(?!\S)|\s{128}(?!\S)|\s{64}(?!\S)|\s{32}(?!\S)|\s{16}(?!\S)|\s{8}(?!\S)"
          r"|\s{4}(?!\S)|\s{1,2}(?!\S)|\s{1}")
_DEEPSEEK_LLM = (
    r"[\r\n]",
    r"\s?[A-Za-zµÀ-ÖØ-öø-ƺƼ-ƿǄ-ʓʕ-ʯͰ-ͳͶͷͻ-ͽͿΆΈ-ΊΌΎ-ΡΣ-ϵϷ-ҁҊ-ԯԱ-ՖႠ-ჅᎠ-Ᏽᏸ-ᏽᲐ-ᲺᲽ-Ჿᴀ-ᴫᵫ-ᵷᵹ-ᶚḀ-ἕἘ-Ἕἠ-ὅὈ-Ὅὐ-ὗὙὛὝὟ-\x{1F7D}ᾀ-ᾴᾶ-ᾼ\x{1FBE}ῂ-ῄῆ-ῌῐ-\x{1FD3}ῖ-\x{1FDB}ῠ-Ῥῲ-ῴῶ-ῼℂℇℊ-ℓℕℙ-ℝℤ\x{2126}ℨ\x{212A}-ℭℯ-ℴℹℼ-ℿⅅ-ⅉⅎↃↄⰀ-ⱻⱾ-ⳤⳫ-ⳮⳲⳳꙀ-ꙭꚀ-ꚛꜢ-ꝯꝱ-ꞇꞋ-ꞎꭰ-ꮿﬀ-ﬆﬓ-ﬗＡ-Ｚａ-ｚ𐐀-𐑏𐒰-𐓓𐓘-𐓻𐲀-𐲲𐳀-𐳲𑢠-𑣟𞤀-𞥃]+",  # noqa: E501
    r"\s?[!-/:-~！-／：-～‘-‟　-。]+",
    r"\s+\z",
    r"[一-龥ࠀ-一가-퟿]+",
    r"\p{N}+",
)
_DEEPSEEK3 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_SPARK2_5 = (
    r"\p{N}{1,3}",
    r"[一-龥぀-ゟ゠-ヿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+|[\r\n]"
    r"|\s+(?!\S)|\s+",
    r"\p{N}",
)
_YOUTU = (
    r"[가-힣ㄱ-ㆎ]+|[！…“”‘’—：；，、-〿︰-﹏]+|[ㄅ-ㄯ]+|[一-龥぀-ゟ゠-ヿ]+",
    r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]*[\p{L}\p{M}]+" + _CONTRACTIONS + r"?|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+[\p{L}\p{M}]*"
    + _CONTRACTIONS + r"?|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
)
_DEEPSEEK_CODER = (r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", r"[一-龥ࠀ-一가-퟿]+", r"\p{N}")
_FALCON = (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")
_DIGITS_THEN_GPT2 = (r"\p{N}", _GPT2)
_BLOOM = r" ?[^(\s|.,!?…。，、।۔،)]+"
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+"
           r"((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CHAMELEON = (r"<sentinel:[0-9]+>", r"(IMGIMG)((A|B|C|D|E|F|G|H|I){1,4})Z", r"([\t\n]|    |  )", r"\p{N}",
              r"[\p{P}!-/:-@\[-`{-~]", _GPT2)
_GPT4O = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+" + _CONTRACTIONS
          + r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*" + _CONTRACTIONS
          + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GRANITE_EMB_MULTI = (r"[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))*((?=[\p{L}\p{M}])([^A-Z]))+" + _CONTRACTIONS
                      + r"?|[^\r\n\p{L}\p{N}]?((?=[\p{L}\p{M}])([^a-z]))+((?=[\p{L}\p{M}])([^A-Z]))*" + _CONTRACTIONS
                      + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# llama.cpp's own digit grouping (afmoe, tiny_aya): a run of digits in groups of three from the
# right, the text before a run joined to its first group (a Split "merged_with_previous")
_DIGIT_GROUPS = (r"\p{N}{1,3}(?=(?:\p{N}{3})*(?!\p{N}))", "merged_with_previous")
_TINY_AYA = (_DIGIT_GROUPS, r"[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]*[\p{L}\p{M}]+" + _CONTRACTIONS
             + r"?|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+[\p{L}\p{M}]*" + _CONTRACTIONS
             + r"?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_AFMOE = (
    _DIGIT_GROUPS,
    r"[一-鿿㐀-䶿豈-﫿぀-ゟ゠-ヿ･-ﾟ⼀-⿟เ-๿຀-໿ក-៿က-႟ꩠ-ꩿꧠ-꧿가-힯ᄀ-ᇿ]+",
    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+",
)
# kimi-k2: llama.cpp's hand-written splitter, whose Han characters are these ranges
_HAN = r"\x{3400}-\x{4DBF}\x{4E00}-\x{9FFF}\x{F900}-\x{FAFF}\x{20000}-\x{2A6DF}\x{2A700}-\x{2EBEF}\x{2F800}-\x{2FA1F}"
_KIMI_K2 = (rf"[{_HAN}]+|[^\r\n\p{{L}}\p{{N}}]?[\p{{L}}&&[^{_HAN}]]+{_CONTRACTIONS}?|\p{{N}}{{1,3}}"
            r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_BAILINGMOE = (r"'(?:[sSdDmMtT]|[lL][lL]|[vV][eE]|[rR][eE])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]|\s+(?!\S)|\s+")
_SEED_CODER = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+")
_UFAKZEKA = r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_EXAONE_MOE = (_CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?(?:\p{L}\p{M}*(?: \p{L}\p{M}*)*)+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]?"
               r"|\s*[\r\n]|\s+(?!\S)|\s+")
_MINICPM5 = (r"\p{N}{1,3}", _CONTRACTIONS + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}+| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
             r"|\s+(?!\S)|\s+")
_DEFAULT = (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")
_NEWLINES = r"[^\n]+|[\n]+"


@dataclass(frozen=True)
class _Pre:
    """How llama.cpp splits text for one pre-tokenizer: its expressions, applied one after the
    other to every piece (a match and the text between matches each a piece, unless a
    behaviour is given), and what else it sets for it."""

    splits: Sequence[str | tuple[str, str]]
    ignore_merges: bool = False  # a piece that is a whole token is that token, unmerged
    add_bos: bool = False  # llama.cpp's default where the file does not say
    always_bos: bool = False  # llama.cpp adds one whatever the file says
    byte_level: bool = True  # GPT-2's byte-to-character encoding; else UTF-8 with spaces as '▁'


def _names(names: str, pre: _Pre) -> dict[str, _Pre]:
    return dict.fromkeys(names.split(), pre)


_GPT2_PRE = _Pre((_GPT2,))
_LLAMA3_PRE = _Pre((_LLAMA3,))
_QWEN2_PRE = _Pre((_QWEN2,))
_DIGITS_PRE = _Pre(_DIGITS_THEN_GPT2)
_DEEPSEEK3_PRE = _Pre(_DEEPSEEK3)
_GPT4O_PRE = _Pre((_GPT4O,))

# GGUF pre-tokenizer name → llama.cpp's treatment (llama_vocab::impl::load, llm_tokenizer_bpe).
# Left out: the encoder vocabularies that append a separator token (jina-v1-en, jina-v2-code,
# roberta-bpe) and the `whitespace` tokenizer model's pre-tokenizer.
PRE_TOKENIZERS: dict[str, _Pre] = {
    "default": _Pre(_DEFAULT),
    "gpt2": _GPT2_PRE,  # not a llama.cpp name: llmc's own test files say it
    **_names("gpt-2 phi-2 jina-es jina-de gigachat jina-v2-es jina-v2-de a.x-4.0 mellum modern-bert exaone4 mpt olmo "
             "jais trillion granite-docling", _GPT2_PRE),
    **_names("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 jina-v5-nano",
             _Pre((_LLAMA3,), ignore_merges=True, add_bos=True)),
    **_names("dbrx smaug-bpe chatglm-bpe", _LLAMA3_PRE),
    **_names("glm4 glm5", _Pre((_LLAMA3,), ignore_merges=True)),
    "jais-2": _Pre((_JAIS2,)),
    **_names("qwen2 deepseek-r1-qwen kormo f2llmv2 megrez stablelm2 hunyuan solar-open grok-2", _QWEN2_PRE),
    "qwen35": _Pre((_QWEN35,)),
    "deepseek-llm": _Pre(_DEEPSEEK_LLM),
    "deepseek-coder": _Pre(_DEEPSEEK_CODER),
    **_names("deepseek-v3 hunyuan-dense hy_v4 joyai-llm", _DEEPSEEK3_PRE),
    "spark2_5": _Pre(_SPARK2_5),
    "youtu": _Pre(_YOUTU, ignore_merges=True),
    "falcon": _Pre(_FALCON),
    **_names("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", _DIGITS_PRE),
    **_names("poro-chat bloom gpt3-finnish", _Pre((_BLOOM,))),
    "viking": _Pre((_BLOOM, r"\p{N}")),
    "tekken": _Pre((_TEKKEN,), ignore_merges=True, add_bos=True),
    "chameleon": _Pre(_CHAMELEON, add_bos=True),
    **_names("gpt-4o llama4 kanana2 talkie minimax-m2", _GPT4O_PRE),
    "granite-embed-multi-97m": _Pre((_GRANITE_EMB_MULTI,), ignore_merges=True),
    **_names("tiny_aya cohere2moe", _Pre(_TINY_AYA)),
    "superbpe": _Pre((r"\p{N}+", r"(?=([0-9]{3})+(?![0-9]))")),
    **_names("bailingmoe bailingmoe2 llada-moe", _Pre((_BAILINGMOE,))),
    "seed-coder": _Pre((_SEED_CODER,)),
    "kimi-k2": _Pre((_KIMI_K2,)),
    "ufakzeka": _Pre((_UFAKZEKA,)),
    "afmoe": _Pre(_AFMOE),
    "laguna": _Pre((_NEWLINES, _QWEN2)),
    "exaone-moe": _Pre((_EXAONE_MOE,)),
    "minicpm5": _Pre(_MINICPM5, ignore_merges=True),
    **_names("gemma4 granite-embed-multi-311m", _Pre((_NEWLINES,), always_bos=True, byte_level=False)),
    "sarvam-moe": _Pre((_NEWLINES,), byte_level=False),
}

# tokenizer.ggml.model → what it is. Refused: bert (WordPiece) and t5 (Unigram), the encoder
# vocabularies of llama.cpp's tests, and rwkv, plamo2, hybriddna, whitespace.
_MODELS = {"gpt2": "byte-level BPE", "gemma4": "BPE on UTF-8 text", "llama": "SentencePiece"}

# GGUF token types (llama.cpp's llama_token_type): unknown, control and user-defined tokens are
# matched whole, before the model's own splitting.
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4
# ... and so are the tokens llama.cpp takes by their text for end-of-generation markers, whatever
# their type, except `</s>` beside `<|tool_response>` (gemma4), where it is plain text.
_END_OF_GENERATION = frozenset((
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
))
_SPACE = "▁"


def _pre_tokenizer(pre: _Pre) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's splits one after the other, then GPT-2's byte encoding where it has it."""
    splits = [pre_tokenizers.Split(Regex(s), behavior="isolated") if isinstance(s, str)
              else pre_tokenizers.Split(Regex(s[0]), behavior=s[1]) for s in pre.splits]
    if pre.byte_level:
        splits.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False))
    return pre_tokenizers.Sequence(splits)


def _sentencepiece_merges(source: object, vocab: dict[str, int], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Every pair of tokens that joins into a token, best joined token first: the order in which
    llama.cpp's SentencePiece tokenizer merges adjacent symbols (pairs that make the same token,
    which llama.cpp takes in text order, by where they cut it).

    A token is cut only where its first part has the length of some token: for a token of L
    characters that is min(L, D) cuts of L characters' work, D the number of different token
    lengths (16 to 100 in real vocabularies), so one very long token costs D times its length,
    not its length squared. A vocabulary that would still cost more than `_MAX_MERGE_WORK`
    (thousands of different lengths, crafted) is refused before any of it."""
    lengths = sorted({len(token) for token in vocab} - {0})
    cuts = [bisect_left(lengths, len(token)) for token in vocab]  # how many lengths are shorter than each token
    if sum(n * len(token) for n, token in zip(cuts, vocab)) > _MAX_MERGE_WORK:
        raise ModelFormatError(source, f"tokenizer.ggml.tokens: tokens of {len(lengths)} different lengths, up to "
                                       f"{lengths[-1]} characters, are more than a SentencePiece vocabulary holds")
    found = []
    for (token, i), n in zip(vocab.items(), cuts):
        found += [(-scores[i], i, k) for k in lengths[:n] if token[:k] in vocab and token[k:] in vocab]
    tokens = list(vocab)
    return [(tokens[i][:k], tokens[i][k:]) for _, i, k in sorted(found)]


def from_gguf_vocab(
    source: object,
    model: str,
    pre: str,
    tokens: list[str],
    token_types: list[int] | None,
    merges: list[str],
    scores: Sequence[float] | None,
    bos_id: int | None,
    eos_id: int | None,
    add_bos: bool | None,
    add_space_prefix: bool | None,
    chat_template: str | None,
    name: str | None = None,
    stop_ids: Sequence[int] = (),
) -> TextCodec:
    """The tokenizer a GGUF file's `tokenizer.ggml.*` metadata describes, as llama.cpp builds it;
    `add_bos` and `add_space_prefix` are None where the file does not say; `name` is the model's
    `general.name`; `stop_ids`, its other end-of-generation tokens (end of turn, end of message)."""
    if model not in _MODELS:
        known = ", ".join(f"{m} ({what})" for m, what in _MODELS.items())
        raise ModelFormatError(source, f"unsupported tokenizer model '{model}' (supported: {known})")
    if len(tokens) > MAX_VOCABULARY:
        raise ModelFormatError(source, f"tokenizer.ggml.tokens holds {len(tokens)} tokens, more than any model's "
                                       f"vocabulary (at most {MAX_VOCABULARY} here)")
    vocab = {token: i for i, token in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ModelFormatError(source, "tokenizer.ggml.tokens holds duplicate tokens")
    if model == "llama":  # llama.cpp's default <s> and </s>
        bos_id, eos_id = (d if i is None and d < len(tokens) else i for i, d in ((bos_id, 1), (eos_id, 2)))
    for which, token_id in (("bos", bos_id), ("eos", eos_id)):
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise ModelFormatError(source, f"{which} token id {token_id} is outside the vocabulary of {len(tokens)}")
    special = _special_tokens(vocab, token_types or [])
    if model == "llama":
        tok = _sentencepiece(source, vocab, scores, add_space_prefix is not False)
        add_bos = True if add_bos is None else add_bos
    else:
        pre = "gemma4" if model == "gemma4" else pre  # as llama.cpp: the model implies it
        if pre not in PRE_TOKENIZERS:
            raise ModelFormatError(source, f"unsupported pre-tokenizer '{pre}' (supported: "
                                           f"{', '.join(sorted(PRE_TOKENIZERS))})")
        how = PRE_TOKENIZERS[pre]
        tok = _bpe(source, vocab, merges, how, special)
        add_bos = how.always_bos or (how.add_bos if add_bos is None else add_bos)
    # as llama.cpp for Phi-3 models: their special tokens but three take the whitespace after them along
    phi3 = any(n in (name or "").lower() for n in ("phi-3", "phi3"))
    with tokenizer_failures(lambda problem: ModelFormatError(source, f"cannot build the tokenizer: {problem}")):
        tok.add_special_tokens([AddedToken(text, special=True, normalized=False,
                                           rstrip=phi3 and text not in ("<unk>", "<s>", "<|endoftext|>"))
                                for text in special])
    return TextCodec(tok, bos_id, eos_id, add_bos, chat_template, stop_ids=tuple(sorted(set(stop_ids) - {eos_id})))


def _special_tokens(vocab: dict[str, int], types: list[int]) -> list[str]:
    """The tokens llama.cpp matches whole in a text (with special tokens parsed)."""
    ends = _END_OF_GENERATION - ({"</s>"} if "<|tool_response>" in vocab else set())
    return [token for token, kind in zip(vocab, types or [0] * len(vocab))
            if kind in (_UNKNOWN, _CONTROL, _USER_DEFINED) or token in ends]


def _gpt2_bytes() -> dict[int, str]:
    """GPT-2's byte → character table: printable bytes as themselves, the others from U+0100 on."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    moved = [b for b in range(256) if b not in kept]
    return {**{b: chr(b) for b in kept}, **{b: chr(256 + i) for i, b in enumerate(moved)}}


_GPT2_BYTES = _gpt2_bytes()
# the characters of the bytes UTF-8 never uses; tokens made of them are text of their own
# (DeepSeek's user-defined tokens 'ö', 'ü', 'ø', ...)
_NOT_UTF8 = {_GPT2_BYTES[b] for b in (0xC0, 0xC1, *range(0xF5, 0x100))}


def _byte_level_decoder(special: list[str]) -> decoders.Decoder:
    """GPT-2's byte-level decoding, except that special tokens made of characters of bytes UTF-8
    never uses read as they are written, as llama.cpp reads special tokens."""
    raw = [text for text in special if set(text) <= _NOT_UTF8]
    spelled = [decoders.Replace(text, "".join(_GPT2_BYTES[b] for b in text.encode())) for text in raw]
    return decoders.Sequence([*spelled, decoders.ByteLevel()])


def _bpe(source: object, vocab: dict[str, int], merges: list[str], pre: _Pre, special: list[str]) -> Tokenizer:
    """BPE by the file's merges (ranked by their order; a repeated merge keeps its first rank)."""
    pairs = {}
    for merge in merges:
        cut = merge.find(" ", 1)  # as llama.cpp: the left part may begin with a space
        left, right = merge[:cut], merge[cut + 1:]
        if cut < 0 or left not in vocab or right not in vocab:
            raise ModelFormatError(source, f"tokenizer.ggml.merges has an invalid entry {merge!r}")
        if left + right not in vocab:  # the tokenizers library panics on it
            raise ModelFormatError(source, f"tokenizer.ggml.merges has {merge!r}, which makes a token the vocabulary "
                                           "lacks")
        pairs.setdefault((left, right), None)
    with tokenizer_failures(lambda problem: ModelFormatError(source, f"tokenizer.ggml.merges do not form a BPE "
                                                                     f"model: {problem}")):
        tok = Tokenizer(models.BPE(vocab=vocab, merges=list(pairs), fuse_unk=False, ignore_merges=pre.ignore_merges,
                                   byte_fallback=not pre.byte_level))
    tok.pre_tokenizer = _pre_tokenizer(pre)
    if pre.byte_level:
        tok.decoder = _byte_level_decoder(special)
    else:
        tok.normalizer = normalizers.Replace(" ", _SPACE)
        tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _sentencepiece(source: object, vocab: dict[str, int], scores: Sequence[float] | None,
                   space_prefix: bool) -> Tokenizer:
    """llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm) as a BPE model with byte fallback."""
    if scores is None:
        raise ModelFormatError(source, "a SentencePiece tokenizer (tokenizer.ggml.model = llama) needs "
                                       "tokenizer.ggml.scores, which this file lacks")
    merges = _sentencepiece_merges(source, vocab, scores)
    with tokenizer_failures(lambda problem: ModelFormatError(source, f"cannot build the tokenizer: {problem}")):
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=True, fuse_unk=False))
    # a space before the text, and after every special token (the normalizer runs on the
    # text between them), as llama.cpp's add_space_prefix
    spaces = [normalizers.Prepend(_SPACE)] if space_prefix else []
    tok.normalizer = normalizers.Sequence([*spaces, normalizers.Replace(" ", _SPACE)])
    strip = [decoders.Strip(" ", 1, 0)] if space_prefix else []
    tok.decoder = decoders.Sequence([decoders.Replace(_SPACE, " "), decoders.ByteFallback(), decoders.Fuse(), *strip])
    return tok
