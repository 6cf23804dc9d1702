"""GGUF tokenizers against llama.cpp's own vocabulary tests and llama.cpp's ids: every case
of each decoder vocabulary's `.inp` file gives the ids of its `.out` file (made by the model's
Hugging Face tokenizer, an implementation of its own), texts of our own give the ids llama.cpp
gives, decoding gives the text back, and what is not supported is refused in one line.

The vocabulary files come from llama.cpp's source (tests/llama_vocabs.py fetches them).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import gguf
import llama_vocabs
import pytest
from tokenizers import Tokenizer
from tokenizers.pre_tokenizers import ByteLevel

from llmc.cli import main
from llmc.errors import ModelFormatError
from llmc.frontend import load_tokenizer
from llmc.frontend.tokenizer import PRE_TOKENIZERS, from_gguf_vocab
from llmc.runtime.codec import TextCodec, TextStream

# llama.cpp's test vocabularies of decoder models, all supported
DECODER_VOCABS = ("command-r", "deepseek-coder", "deepseek-llm", "falcon", "gemma-4", "gpt-2", "llama-bpe",
                  "llama-spm", "mpt", "phi-3", "qwen2", "qwen35", "refact", "starcoder")
# ... and those without test cases, which load too
UNTESTED_VOCABS = ("aquila", "baichuan", "gpt-neox")
# encoder vocabularies, refused
ENCODER_VOCABS = {"bert-bge": "unsupported tokenizer model 'bert'", "nomic-bert-moe": "unsupported tokenizer model 't5'"}


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    if not llama_vocabs.present():
        pytest.fail(f"llama.cpp's vocabulary tests are missing from {llama_vocabs.DIRECTORY}: {llama_vocabs.FETCH}")
    return llama_vocabs.DIRECTORY


@pytest.fixture(scope="module")
def tokenizer(vocab_dir: Path) -> Callable[[str], TextCodec]:
    """`tokenizer(name)`: the tokenizer of ggml-vocab-NAME.gguf, loaded once in this module."""
    return functools.cache(lambda name: load_tokenizer(str(vocab_dir / f"ggml-vocab-{name}.gguf")))


@pytest.mark.parametrize("name", DECODER_VOCABS)
def test_llama_cpp_vocabulary_cases(tokenizer: Callable[[str], TextCodec], name: str) -> None:
    """As llama.cpp's tests/test-tokenizer-0.cpp: no BOS, special tokens not added; the same from
    the tokenizer as an artifact's tokenizer.json holds it; decoding gives each text back."""
    codec = tokenizer(name)
    saved = Tokenizer.from_str(codec.tokenizer.to_str())
    cases = llama_vocabs.cases(name)
    wrong = [(text, ids, codec.encode(text, bos=False)) for text, ids in cases]
    wrong = [case for case in wrong if case[1] != case[2]]
    assert not wrong, f"{name}: {len(cases) - len(wrong)}/{len(cases)} cases equal; first wrong {wrong[0]}"
    for text, ids in cases:
        assert saved.encode(text, add_special_tokens=False).ids == ids, text
        assert codec.decode(ids) == text


# Texts of our own, and the ids llama.cpp gives them (llama_tokenize of llama.cpp 0c1e570, the
# llama.cpp of llama-cpp-python 0.3.36, no BOS, special tokens not parsed).
OWN_TEXTS = (
    "Pi is 3.14159265, not 1234567 or ٣٤٥; call +1-800-555-0199.",
    "  two\tthree\t\tspaces   end  \n\n\n    indented\r\n \n",
    "Wait... what?! (yes) — «quote» [a]{b}<c> don't WE'LL it's",
    "Привет, мир! 你好，世界。こんにちは 안녕하세요 مرحبا שלום नमस्ते Cửa Việt",
    "🦙 llamas 🚀👨‍👩‍👧 ✅ 🇫🇷 😀😀",
)
LLAMA_CPP_IDS = {
    "llama-bpe": (
        "35867 374 220 18 13 9335 20128 2397 11 539 220 4513 10961 22 477 220 117413 124079 124043 26 1650 "
        "489 16 12 4728 12 14148 12 18089 24 13",
        "220 1403 197 28956 197 1942 28438 256 842 80326 262 1280 16243 319 720",
        "14524 1131 1148 27074 320 9891 8 2001 12769 3022 13289 510 64 15731 65 71893 66 29 1541 956 20255 6 "
        "4178 433 596",
        "54745 28089 8341 11 115388 0 118195 53901 3922 102616 1811 90115 96270 124409 111895 103645 88898 "
        "50391 37769 251 100282 88344 79468 100365 35470 356 91163 101798",
        "9468 99 247 9507 29189 11410 248 222 9468 239 101 102470 9468 239 102 102470 9468 239 100 26602 227 "
        "11410 229 104 9468 229 115 91416 76460 222",
    ),
    "qwen35": (
        "34767 374 220 18 13 16 19 16 20 24 17 21 20 11 537 220 16 17 18 19 20 21 22 476 220 149 96 149 97 "
        "149 98 26 1618 488 16 12 23 15 15 12 20 20 20 12 15 16 24 24 13",
        "220 1378 197 27856 197 1903 27338 256 835 79226 262 1257 15864 319 715",
        "14190 1112 1128 25984 320 9693 8 1959 12486 2949 12992 508 64 15370 65 70793 66 29 1513 944 19677 6 "
        "4086 432 594",
        "53645 26991 8178 11 137144 0 220 108386 3837 99489 1773 89015 95170 144370 91145 23364 126860 124671 "
        "124756 123881 14925 101 87244 78368 30484 97 34370 356 90063 128324",
        "149955 9323 28089 11162 248 222 145367 378 235 145233 378 235 145665 25521 227 11162 229 104 145070 "
        "90316 141334",
    ),
    "deepseek-llm": (
        "10632 317 207 18 13 16 19 16 20 24 17 21 20 11 441 207 16 17 18 19 20 21 22 410 207 147 96 147 97 "
        "147 98 26 1282 919 16 12 23 15 15 12 20 20 20 12 15 16 24 24 13",
        "207 984 184 14521 184 184 32835 243 1225 243 185 185 185 300 96272 188 185 207 185",
        "18420 1204 856 22160 334 8711 8 207 1972 5935 21241 5608 825 64 2680 65 30737 66 29 1113 6 83 21934 "
        "6 2369 359 6 82",
        "27281 9207 11 56671 0 207 84313 19304 4997 398 90670 9156 228 45223 7217 94 60145 207 74727 217 165 "
        "214 230 65516 56118 116 71122 229 55993 21437 78930 41737 12241 21507 102 56607 36533 238 207 77982 "
        "96984 80260 52539 97 63087 339 32555 242 64 23708 32555 216 83",
        "10044 99 234 15360 281 12356 95300 10044 226 101 350 222 10044 226 102 350 222 10044 226 100 207 "
        "37103 214 12356 216 104 10044 216 115 89662 71899 209",
    ),
    "falcon": (
        "42785 304 204 30 25 18900 50088 4224 23 416 204 10963 27681 34 379 204 159 108 159 109 159 110 38 "
        "1035 204 22 28 24 6181 24 30525 24 33813 36 25",
        "204 847 192 20878 192 192 1604 1908 258 991 258 38230 730 9328 195 1212 193",
        "17849 951 637 10350 204 19 9109 20 204 791 204 2577 24220 2118 204 70 76 34266 77 104 39 78 41 794 "
        "18 95 13922 18 3015 334 18 94",
        "150 237 9310 18945 122 37770 23 5052 132 7795 9310 12 62116 133 238 3997 133 181 132 218 22602 1258 "
        "5288 225 7568 225 38265 5288 106 46610 28508 227 214 177 211 227 179 227 230 178 210 128 178 232 226 "
        "64951 28996 158 239 59390 15040 24419 114 157 234 57070 235 30483 113 10735 118 10735 128 52672 "
        "10735 109 24469 213 319 19768 239 76 9634 19768 213 95",
        "2571 111 231 22238 277 3346 232 206 33582 113 283 219 33582 114 283 219 33582 112 22438 211 3346 213 "
        "116 40833 127 23836 20589 206",
    ),
    "llama-spm": (
        "7362 338 29871 29941 29889 29896 29946 29896 29945 29929 29906 29953 29945 29892 451 29871 29896 "
        "29906 29941 29946 29945 29953 29955 470 29871 220 166 220 167 220 168 29936 1246 718 29896 29899 "
        "29947 29900 29900 29899 29945 29945 29945 29899 29900 29896 29929 29929 29889",
        "259 1023 12 17536 12 12 22854 259 1095 259 13 13 13 1678 1399 14927 30004 13 29871 13",
        "20340 856 825 29973 29991 313 3582 29897 813 859 1396 30007 518 29874 3199 29890 29913 29966 29883 "
        "29958 1016 29915 29873 399 29923 29915 2208 372 29915 29879",
        "7203 7616 29892 4157 29927 29991 29871 30919 31076 30214 30793 30967 30267 30589 30389 30353 30644 "
        "30449 29871 31734 238 136 152 30944 31578 31527 29871 30159 30156 30240 30177 30112 29871 30294 "
        "30249 30205 30404 29871 30424 30485 30489 30296 30475 30569 315 228 190 176 29874 10630 30529 29873",
        "29871 243 162 169 156 11829 294 29871 243 162 157 131 243 162 148 171 30722 243 162 148 172 30722 "
        "243 162 148 170 29871 31681 29871 243 162 138 174 243 162 138 186 29871 243 162 155 131 243 162 155 "
        "131",
    ),
    "gemma-4": (
        "14762 563 236743 236800 236761 236770 236812 236770 236810 236819 236778 236825 236810 236764 711 "
        "236743 236770 236778 236800 236812 236810 236825 236832 653 223766 242090 242323 236793 2246 900 "
        "236770 236772 236828 236771 236771 236772 236810 236810 236810 236772 236771 236770 236819 236819 "
        "236761",
        "138 13498 255968 19891 255969 35220 139 643 138 109 140 724 16764 251 107 236743 107",
        "20470 1390 1144 26052 568 4443 236768 2192 2789 20263 237167 870 236746 5546 236763 22762 236755 "
        "236813 1537 236789 236745 19716 236789 2182 625 236789 236751",
        "116130 236764 58562 236888 43758 237389 236900 12811 236924 85141 83732 150423 14755 42737 173040 "
        "565 29719 33154",
        "478 397 404 391 236136 236743 242015 243874 237243 243767 237243 244814 113452 236743 246598 242644 "
        "163543 242398",
    ),
}


@pytest.mark.parametrize("name", LLAMA_CPP_IDS)
def test_own_texts_give_llama_cpp_ids(tokenizer: Callable[[str], TextCodec], name: str) -> None:
    codec = tokenizer(name)
    for text, ids in zip(OWN_TEXTS, LLAMA_CPP_IDS[name], strict=True):
        got = codec.encode(text, bos=False)
        assert got == [int(i) for i in ids.split()], (name, text)
        assert codec.decode(got) == text


# Texts with special tokens, and llama.cpp's ids with special tokens parsed (as llmc always
# parses them): control and user-defined tokens whole, `</s>` too (llama.cpp takes it for an
# end-of-generation marker by its text), the whitespace after Phi-3's taken along.
SPECIAL_CASES = {
    "phi-3": ("<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n </s> x",
              "32010 1724 338 29871 29906 29974 29906 29973 32007 32001 2 921"),
    "qwen2": ("<|im_start|>user\nhi</s><|im_end|>\n<|im_start|>assistant\n",
              "151644 872 198 6023 128247 151645 198 151644 77091 198"),
    "llama-spm": ("<s>Hi</s> there <unk>!", "1 6324 2 29871 727 29871 0 1738"),
}


@pytest.mark.parametrize("name", SPECIAL_CASES)
def test_special_tokens_as_llama_cpp_parses_them(tokenizer: Callable[[str], TextCodec], name: str) -> None:
    text, ids = SPECIAL_CASES[name]
    assert tokenizer(name).encode(text, bos=False) == [int(i) for i in ids.split()]


@pytest.mark.parametrize("name", [*DECODER_VOCABS, *UNTESTED_VOCABS])
def test_bos_as_llama_cpp_adds_it(tokenizer: Callable[[str], TextCodec], name: str) -> None:
    """The file's tokenizer.ggml.add_bos_token, else llama.cpp's default (SentencePiece and the
    llama3 pre-tokenizers add one)."""
    codec = tokenizer(name)
    adds = name in ("command-r", "deepseek-coder", "deepseek-llm", "gemma-4", "llama-bpe", "llama-spm", "phi-3",
                    "baichuan")
    assert codec.add_bos is adds
    assert codec.encode("Hi") == ([codec.bos_id] if adds else []) + codec.encode("Hi", bos=False)


def test_sentencepiece_spaces_and_bytes(tokenizer: Callable[[str], TextCodec]) -> None:
    """A space before the text and after a special token, every space a '▁', unknown characters
    as `<0xXX>` byte tokens, and the first space dropped again when decoding."""
    codec = tokenizer("llama-spm")
    pieces = lambda text: [codec.tokenizer.id_to_token(i) for i in codec.encode(text, bos=False)]  # noqa: E731
    assert pieces("Hello world") == ["▁Hello", "▁world"]
    assert pieces("  Hello") == ["▁▁", "▁Hello"]
    assert pieces("</s>Hello") == ["</s>", "▁Hello"]
    assert pieces("𐐀") == ["▁", "<0xF0>", "<0x90>", "<0x90>", "<0x80>"]
    assert codec.decode(codec.encode("  Hello 𐐀", bos=False)) == "  Hello 𐐀"
    assert (codec.bos_id, codec.eos_id) == (1, 2)


@pytest.mark.parametrize("name", ["llama-spm", "gpt-2", "llama-bpe"])
def test_pieces_and_streams_keep_word_spaces(tokenizer: Callable[[str], TextCodec], name: str) -> None:
    """`llmc tokenize` prints each token's piece as llama-tokenize does (' Hello', SentencePiece's '▁'
    a space), and generated text streamed after its prompt keeps the first word's space."""
    codec = tokenizer(name)
    ids = codec.encode(" Hello world", bos=False) if name != "llama-spm" else codec.encode("Hello world", bos=False)
    assert "".join(codec.piece(i) for i in ids) == " Hello world"
    prompt = codec.encode("The capital is")
    assert "".join(codec.decode_stream(ids, prompt)) == " Hello world"



@pytest.mark.parametrize("name", ["llama-spm", "gpt-2", "llama-bpe"])
def test_text_stream_decodes_once_a_token(tokenizer: Callable[[str], TextCodec], name: str, monkeypatch) -> None:
    """A long text with multi-byte characters (its window cut back many times) streams out whole, at one decode
    a token and one more per cut."""
    codec = tokenizer(name)
    text = "Les élèves du 漢 club 🙂 lisent: " * 12
    ids = codec.encode(text, bos=False)
    calls = []
    decode = codec.decode
    monkeypatch.setattr(codec, "decode", lambda window: calls.append(len(window)) or decode(window))
    stream = codec.text_stream()
    pieces = [stream.push(token) for token in ids]
    assert "".join(pieces) + stream.flush() == text
    per_cut = TextStream.WINDOW + 1 - TextStream.CONTEXT  # (tokens shown between two cuts)
    assert len(calls) - 3 <= len(ids) + len(ids) // per_cut + 1  # (besides the start, the flush and its restart)
    assert max(calls) <= TextStream.WINDOW + 4  # (a window grows past WINDOW only inside a character)

def test_deepseek_user_defined_tokens_decode_as_written(tokenizer: Callable[[str], TextCodec]) -> None:
    """DeepSeek's user-defined tokens 'ö', 'ü', ... are the characters themselves, not the
    byte-level spelling of bytes UTF-8 never uses."""
    codec = tokenizer("deepseek-llm")
    ids = codec.encode("Grüße, schön", bos=False)
    assert codec.tokenizer.token_to_id("ü") in ids
    assert codec.decode(ids) == "Grüße, schön"


@pytest.mark.parametrize("name", sorted(PRE_TOKENIZERS))
def test_every_pre_tokenizer_builds_and_round_trips(name: str) -> None:
    """Each of llama.cpp's pre-tokenizers, on a vocabulary of single bytes alone: its expressions
    compile, its pieces cover the text, and byte-level ones give a token per byte."""
    tokens = sorted(ByteLevel.alphabet()) + ["▁"] + [f"<0x{b:02X}>" for b in range(256)]
    codec = from_gguf_vocab("vocab.gguf", "gpt2", name, tokens, None, [], None, None, None, None, None, None)
    text = "".join(OWN_TEXTS) + " 12345678 <sentinel:1> IMGIMGABZ"
    ids = codec.encode(text)
    assert codec.decode(ids) == text
    assert len(ids) == len(text.encode()) or not PRE_TOKENIZERS[name].byte_level


@pytest.mark.parametrize("name", UNTESTED_VOCABS)
def test_vocabularies_without_cases_load(tokenizer: Callable[[str], TextCodec], name: str) -> None:
    codec = tokenizer(name)
    assert codec.decode(codec.encode(OWN_TEXTS[0], bos=False)) == OWN_TEXTS[0]


def _write_vocab(path: Path, model: str, pre: str | None = None, scores: object = (0.0, 0.0, 0.0, -1.0, -2.0)) -> Path:
    """A vocabulary-only GGUF of five tokens (`scores` None: no tokenizer.ggml.scores)."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(["<unk>", "<s>", "</s>", "▁", "a"])
    if scores is not None:
        writer.add_array("tokenizer.ggml.scores", list(scores))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_unsupported_or_broken_tokenizers_are_one_line(vocab_dir: Path, tmp_path: Path, capsys) -> None:
    cases = [(vocab_dir / f"ggml-vocab-{name}.gguf", message) for name, message in ENCODER_VOCABS.items()]
    cases += [
        (_write_vocab(tmp_path / "rwkv.gguf", "rwkv"), "unsupported tokenizer model 'rwkv' (supported: gpt2 "),
        (_write_vocab(tmp_path / "pre.gguf", "gpt2", "no-such-pre"), "unsupported pre-tokenizer 'no-such-pre' "
                                                                     "(supported: a.x-4.0, afmoe, "),
        (_write_vocab(tmp_path / "spm.gguf", "llama", scores=None), "needs tokenizer.ggml.scores"),
        (_write_vocab(tmp_path / "short.gguf", "llama", scores=[0.0]), "tokenizer.ggml.scores has 1 entries for 5"),
        (_write_vocab(tmp_path / "words.gguf", "llama", scores=["a"] * 5), "'tokenizer.ggml.scores' should be an "
                                                                            "array of numbers"),
    ]
    for path, message in cases:
        with pytest.raises(ModelFormatError, match=path.name):
            load_tokenizer(str(path))
        assert main(["tokenize", str(path), "x"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (path.name, err)
