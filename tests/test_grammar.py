"""Structured output (`llmc.runtime.grammar`): generations under a JSON schema, GBNF and Lark grammars on a
tiny random model and on SmolLM2 (the text parses and validates), refused grammars, the matcher's rollback,
and greedy speculation under a grammar."""

from __future__ import annotations

import json
import re
import sys
import time

import llama_vocabs
import numpy as np
import pytest
from test_speculate import _Oracle
from tiny_models import TinySpec

from llmc.runtime.codec import TextCodec
from llmc.runtime.grammar import Grammar, GrammarError
from llmc.runtime.sampling import Sampler, SamplingOptions
from llmc.runtime.session import Session
from llmc.runtime.speculate import Speculation, step

jsonschema = pytest.importorskip("jsonschema")
pytest.importorskip("llguidance")

SPEC = TinySpec(context_length=512, tied=False)
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
                   "pet": {"enum": ["cat", "dog", "none"]}, "tags": {"type": "array", "items": {"type": "boolean"},
                                                                     "maxItems": 3}},
    "required": ["name", "age", "pet", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def session(artifact) -> Session:
    return Session(artifact(SPEC, chunk=8, max_seq=512), threads=1)


@pytest.fixture(scope="module")
def codec(session) -> TextCodec:
    return TextCodec.from_artifact(session.manifest)


def _generate(session: Session, codec: TextCodec, prompt: list[int], sampler: Sampler, n: int,
              speculation: Speculation | None = None) -> tuple[list[int], bool]:
    """Up to `n` tokens after `prompt` (through `speculate.step`) and whether the end-of-text token ended them."""
    session.reset()
    if speculation is not None:
        speculation.start(session, [])
    out = step(session, sampler, prompt, n, speculation)
    while len(out) < n and codec.eos_id not in out:
        out += step(session, sampler, out[-1:], n - len(out), speculation)
    if codec.eos_id in out:
        return out[: out.index(codec.eos_id)], True
    return out[:n], False


@pytest.mark.parametrize("options", [SamplingOptions(), SamplingOptions(1.0, seed=1), SamplingOptions(0.8, seed=2,
                                     top_p=0.9, presence_penalty=1.0)])
def test_json_schema_output_parses_and_validates(session, codec, options) -> None:
    grammar = Grammar.json_schema(codec, PERSON)
    for text in ("a person:", "the cat sat on"):
        tokens, ended = _generate(session, codec, codec.encode(text), Sampler(options, grammar.constraint()), 480)
        assert ended, codec.decode(tokens)  # the grammar closed the object and then allowed only end-of-text
        value = json.loads(codec.decode(tokens))
        jsonschema.validate(value, PERSON)


def test_unconstrained_random_model_does_not_write_json(session, codec) -> None:
    tokens, _ = _generate(session, codec, codec.encode("a person:"), Sampler(SamplingOptions()), 40)
    with pytest.raises(ValueError):  # (so the test above shows the grammar at work)
        json.loads(codec.decode(tokens))


def test_json_object_allows_any_object_and_ends_only_after_it(codec) -> None:
    constraint = Grammar.json_object(codec).constraint()
    assert {codec.decode([int(t)]) for t in np.flatnonzero(constraint.allowed())} <= {"{", " {", "\n{", "\t{"}
    text = codec.encode('{"a": [1, 2.5, {"b": null}], "c": "x"}', bos=False)
    assert constraint.admissible(text) == len(text)
    assert constraint.admissible(codec.encode("[1]", bos=False)) == 0
    constraint.consume(text[:-1])
    assert not constraint.allowed()[codec.eos_id] and not constraint.complete
    constraint.consume(text[-1:])
    assert constraint.complete and np.flatnonzero(constraint.allowed()).tolist() == [codec.eos_id]
    constraint.consume([codec.eos_id])  # (taken after the grammar stopped)


def test_gbnf_and_lark_grammars_shape_the_text(session, codec) -> None:
    gbnf = Grammar.gbnf(codec, 'root ::= answer " " [0-9] [0-9]?\nanswer ::= "yes" | "no"')
    lark = Grammar.lark(codec, 'start: WORD "-" NUMBER\nWORD: /[a-c]{3}/\nNUMBER: /[0-9]{2}/')
    for grammar, pattern in ((gbnf, r"(yes|no) [0-9]{1,2}"), (lark, r"[a-c]{3}-[0-9]{2}")):
        for options in (SamplingOptions(), SamplingOptions(1.0, seed=5)):
            tokens, ended = _generate(session, codec, codec.encode("x"), Sampler(options, grammar.constraint()), 30)
            assert ended and re.fullmatch(pattern, codec.decode(tokens)), codec.decode(tokens)


@pytest.mark.parametrize("make, message", [
    (lambda c: Grammar.json_schema(c, {"type": "strin"}), "JSON schema: Invalid type: strin"),
    (lambda c: Grammar.json_schema(c, {"$ref": "#/nowhere"}), "JSON schema: Pointer '/nowhere' does not exist"),
    (lambda c: Grammar.json_schema(c, {"type": "string", "pattern": "(["}), "JSON schema: regex parse error"),
    (lambda c: Grammar.json_schema(c, ["a"]), "a JSON schema must be an object, got list"),
    (lambda c: Grammar.lark(c, "start: foo"), 'Lark grammar: at 1\\(8\\): unknown name: "foo"'),
    (lambda c: Grammar.gbnf(c, "root ::= missing"), "GBNF grammar: Rule 'missing' not found"),
    # grammars that no text matches: refused when compiled, not when the first token is sampled
    (lambda c: Grammar.gbnf(c, "root ::= root"), "GBNF grammar: no text matches it"),
    (lambda c: Grammar.lark(c, "start: start"), "Lark grammar: no text matches it"),
    (lambda c: Grammar.json_schema(c, {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}),
     "JSON schema: no text matches it"),
])
def test_refused_grammars_raise_one_line_errors(codec, make, message) -> None:
    with pytest.raises(GrammarError, match=message) as caught:
        make(codec)
    assert "\n" not in str(caught.value)


def test_rollback_restores_the_mask_and_admissible_counts_a_prefix(codec) -> None:
    constraint = Grammar.json_schema(codec, PERSON).constraint()
    text = codec.encode('{"name": "ab", "age": 7', bos=False)
    constraint.consume(text[:3])
    before = constraint.allowed().copy()
    constraint.consume(text[3:])
    assert not np.array_equal(constraint.allowed(), before)
    constraint.rollback(len(text) - 3)
    assert np.array_equal(constraint.allowed(), before)
    wrong = codec.encode('"pet": 3', bos=False)
    assert constraint.admissible(text[3:] + wrong) == len(text) - 3 + 0  # a key where a value belongs: none of it
    assert constraint.admissible(text[3:]) == len(text) - 3  # (and nothing was consumed by asking)
    with pytest.raises(GrammarError, match="the grammar does not allow the tokens") as caught:
        Grammar.lark(codec, 'start: "a"').constraint().consume(codec.encode("b", bos=False))
    assert "\n" not in str(caught.value) and "<state>" not in str(caught.value)  # (llguidance appends its state)


def test_greedy_speculation_under_a_grammar_gives_the_plain_tokens(session, codec, every_draft) -> None:
    grammar = Grammar.json_schema(codec, PERSON)
    prompt = codec.encode("a person:")
    plain, ended = _generate(session, codec, prompt, Sampler(SamplingOptions(), grammar.constraint()), 480)
    assert ended
    truth = prompt + plain + [codec.eos_id]
    for wrong in (2, 3, 1000):  # drafts every `wrong`-th token off by one: rejected, cut by the grammar, or right
        speculation = Speculation(_Oracle(truth, wrong))
        sampler = Sampler(SamplingOptions(), grammar.constraint())
        fast, ended = _generate(session, codec, prompt, sampler, 480, speculation)
        assert fast == plain and ended
        assert speculation.stats.accepted > 0 and speculation.stats.verify_calls > 0
        assert sampler.constraint.complete  # the matcher followed exactly the tokens taken


@pytest.mark.skipif(not llama_vocabs.present(), reason=llama_vocabs.FETCH)
@pytest.mark.parametrize("name", ["llama-spm", "qwen2", "gemma-4"])
def test_other_tokenizer_families_end_the_json_they_start(name) -> None:
    """SentencePiece (a word's leading space in its token) and byte-level BPE vocabularies from GGUF files:
    taking the likeliest allowed token of a fixed preference order, the text is one whole JSON value."""
    from llmc.frontend.gguf import load_gguf_tokenizer

    codec = load_gguf_tokenizer(llama_vocabs.DIRECTORY / f"ggml-vocab-{name}.gguf")
    constraint = Grammar.json_schema(codec, PERSON).constraint()
    preference = np.random.default_rng(0).permutation(codec.tokenizer.get_vocab_size())
    taken = []
    for _ in range(400):
        allowed = constraint.allowed()
        token = int(preference[allowed[preference]][0])  # the first allowed in a random order of the vocabulary
        if token == codec.eos_id:
            break
        constraint.consume([token])
        taken.append(token)
    assert token == codec.eos_id and constraint.complete
    jsonschema.validate(json.loads(codec.decode(taken)), PERSON)


@pytest.fixture(scope="module")
def smollm2(smollm2_path, tmp_path_factory) -> Session:
    from llmc.driver import BackendOptions, compile_model
    from llmc.passes.pipeline import CompileOptions

    directory = compile_model("smollm2-135m", tmp_path_factory.mktemp("smol") / "s", CompileOptions(max_seq=512),
                              BackendOptions(), progress=lambda _: None)
    return Session(directory)


@pytest.mark.real_model
def test_smollm2_writes_valid_json_under_a_schema(smollm2) -> None:
    codec = TextCodec.from_artifact(smollm2.manifest)
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                               "city": {"type": "string"}},
              "required": ["name", "age", "city"], "additionalProperties": False}
    grammar = Grammar.json_schema(codec, schema)
    prompt = codec.encode(codec.chat("Describe a person as JSON with name, age and city."))
    for options in (SamplingOptions(), SamplingOptions(0.7, top_p=0.9, seed=3)):
        sampler = Sampler(options, grammar.constraint())
        tokens, ended = _generate(smollm2, codec, prompt, sampler, 100)
        assert ended
        jsonschema.validate(json.loads(codec.decode(tokens)), schema)

    # the mask's cost per token, replaying a long object (what a constrained decode step adds)
    text = codec.encode(json.dumps({"name": "Alexandra Montgomery", "age": 42, "city": "San Francisco"}), bos=False)
    constraint = grammar.constraint()
    start = time.perf_counter()
    for token in text:
        constraint.allowed()
        constraint.consume([token])
    per_token = (time.perf_counter() - start) / len(text)
    print(f"mask: {per_token * 1e3:.3f} ms per token over {smollm2.vocab_size} tokens")  # with -s
    assert per_token < 2e-3


def test_without_llguidance_the_error_names_the_extra(codec, monkeypatch) -> None:
    from llmc.errors import LlmcError

    monkeypatch.setitem(sys.modules, "llguidance", None)  # (an import of it fails)
    with pytest.raises(LlmcError, match=r"structured output needs llguidance: pip install 'llmc\[serve\]'"):
        Grammar.json_object(codec)


def test_the_mask_covers_a_model_vocabulary_larger_than_the_tokenizers(codec) -> None:
    """A model whose logits are padded past the tokenizer's ids: the padding is never chosen under a grammar."""
    constraint = Grammar.lark(codec, 'start: "yes" | "no"').constraint()
    size = codec.tokenizer.get_vocab_size()
    logits = np.zeros(size + 32, np.float32)
    logits[size:] = 50.0  # the padding the likeliest
    processed = Sampler(SamplingOptions(), constraint).processed(logits)
    assert np.all(processed[size:] == -np.inf)
    assert {codec.decode([int(t)]) for t in np.flatnonzero(processed > -np.inf)} == {"y", "n"}  # (no "ye", "no")
    assert Sampler(SamplingOptions(1.0, seed=0), constraint)(logits) < size
