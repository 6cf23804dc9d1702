"""Chat templates of the supported families render in llmc's sandbox exactly as in transformers.

Each template (copies in tests/data/chat_templates/, sources in its README.md) renders the
same conversations through `TextCodec.render_chat` and through transformers'
`apply_chat_template(tokenize=False)`, with the family's bos/eos tokens; the strings must be
identical, and where a template refuses a conversation (a system turn for Gemma 2 or the old
Mistral template) both must fail with the template's message.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, models

from llmc.errors import LlmcError
from llmc.runtime.codec import TextCodec

pytestmark = pytest.mark.reference

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"

LLAMA3 = ("<|begin_of_text|>", "<|eot_id|>")
DEEPSEEK = ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>")
QWEN = (None, "<|im_end|>")
MISTRAL = ("<s>", "</s>")
GEMMA = ("<bos>", "<eos>")
PHI3 = ("<s>", "<|endoftext|>")

# template file → (bos token, eos token, whether it accepts a system turn)
FAMILIES = {
    "meta-llama-Llama-3.1-8B-Instruct": (*LLAMA3, True),
    "meta-llama-Llama-3.2-3B-Instruct": (*LLAMA3, True),
    "meta-llama-Llama-3.3-70B-Instruct": (*LLAMA3, True),
    "qwen2-chatml": (*QWEN, True),
    "Qwen-Qwen2.5-7B-Instruct": (*QWEN, True),
    "Qwen-Qwen3-0.6B": (*QWEN, True),
    "mistral-v1": (*MISTRAL, True),
    "mistral-v1-no-system": (*MISTRAL, False),
    "mistral-v3": (*MISTRAL, True),
    "mistralai-Mistral-Nemo-Instruct-2407": (*MISTRAL, True),
    "Mistral-Small-3.2-24B-Instruct-2506": (*MISTRAL, True),
    "google-gemma-2-2b-it": (*GEMMA, False),
    "google-gemma-3": (*GEMMA, True),
    "phi-3-mini-2404": (*PHI3, True),
    "phi-3-mini": (*PHI3, True),
    "microsoft-Phi-3.5-mini-instruct": (*PHI3, True),
    "HuggingFaceTB-SmolLM2-135M-Instruct": ("<|im_start|>", "<|im_end|>", True),
    "deepseek-ai-DeepSeek-R1-Distill-Llama-8B": (*DEEPSEEK, True),
    "deepseek-ai-DeepSeek-R1-Distill-Qwen-32B": (*DEEPSEEK, True),
}

SYSTEM = {"role": "system", "content": "You are a terse assistant. Réponds en français si on te parle français."}
PADDED = "  \n Sure: ½ cup, 200 °C — done.  \n\n"  # an assistant turn with leading and trailing whitespace

CONVERSATIONS = {
    "one user turn": [{"role": "user", "content": "Hello!"}],
    "multi-turn": [
        {"role": "user", "content": "Grüß dich! Wie heißt du?"},
        {"role": "assistant", "content": "Ich bin ein Assistent. 😊"},
        {"role": "user", "content": "日本語で答えてください：空はなぜ青い？"},
    ],
    "padded reply": [
        {"role": "user", "content": "How much sugar, and how hot?"},
        {"role": "assistant", "content": PADDED},
        {"role": "user", "content": "  Thanks!  "},
    ],
    "markup and braces": [
        {"role": "user", "content": "Is <b>&amp;</b> \"quoted\" {{ not_a_variable }} {% raw %} safe?"},
        {"role": "assistant", "content": "</think>Yes: it's only text. <|im_end|> stays text too."},
        {"role": "user", "content": "Привет, мир! مرحبا"},
    ],
}
CONVERSATIONS |= {f"system, {name}": [SYSTEM, *turns] for name, turns in list(CONVERSATIONS.items())}


def _tokenizer(bos: str | None, eos: str) -> Tokenizer:
    """A tiny word-level tokenizer that knows only the family's special tokens."""
    specials = ["<unk>", *([bos] if bos else []), eos]
    return Tokenizer(models.WordLevel({token: i for i, token in enumerate(specials)}, unk_token="<unk>"))


def _ours(template: str, bos: str | None, eos: str) -> TextCodec:
    tokenizer = _tokenizer(bos, eos)
    return TextCodec(tokenizer, tokenizer.token_to_id(bos) if bos else None, tokenizer.token_to_id(eos), False,
                     template)


def _theirs(template: str, bos: str | None, eos: str):
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=_tokenizer(bos, eos), eos_token=eos, chat_template=template, **({"bos_token": bos} if bos else {}))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request) -> tuple[str, TextCodec, object, bool]:
    name = request.param
    bos, eos, takes_system = FAMILIES[name]
    template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return name, _ours(template, bos, eos), _theirs(template, bos, eos), takes_system


@pytest.mark.parametrize("generation_prompt", [True, False], ids=["generation prompt", "no generation prompt"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_renders_as_transformers(family, conversation: str, generation_prompt: bool) -> None:
    name, ours, theirs, takes_system = family
    messages = CONVERSATIONS[conversation]
    if messages[0]["role"] == "system" and not takes_system:
        with pytest.raises(Exception) as expected:
            theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        with pytest.raises(LlmcError, match="the model's chat template failed") as got:
            ours.render_chat(messages, add_generation_prompt=generation_prompt)
        assert str(expected.value) in str(got.value)
        return
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    assert ours.render_chat(messages, add_generation_prompt=generation_prompt) == expected


def test_chat_is_one_user_turn_with_the_generation_prompt(family) -> None:
    """`TextCodec.chat`, the one-shot prompt, is transformers' rendering of that turn."""
    _, ours, theirs, _ = family
    expected = theirs.apply_chat_template([{"role": "user", "content": "¿Qué tal?"}], tokenize=False,
                                          add_generation_prompt=True)
    assert ours.chat("¿Qué tal?") == expected


def test_every_template_file_is_tested() -> None:
    assert sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(FAMILIES)


@pytest.mark.parametrize("source", [
    "{{ messages | tojson }}",
    "{{ messages[0] | tojson(indent=2) }}",
    "{{ {'b': 1, 'a': '<&>'} | tojson }}",
    "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}",
    "{% for m in messages %}{% if m.role == 'user' %}{% continue %}{% endif %}{{ m.content }}{% endfor %}",
    "{{ strftime_now('%Y') }}|{{ tools is none }}|{{ documents is none }}|{{ date_string is defined }}",
    "{{ bos_token is defined }}|{{ eos_token }}|{{ unk_token is defined }}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}",
    "{{ dict(a=1) | tojson }}",
    "{% for m in messages %}\n  {%- generation -%}\n {{ m.content }} {% endgeneration %}\n{% endfor %}",
    "{% set x = 'outer' %}{% generation %}{% set x = 'inner' %}{{ x }}{% endgeneration %}{{ x }}",
], ids=["tojson", "tojson indent", "tojson order and markup", "break", "continue", "globals", "special tokens",
        "namespace", "dict", "generation", "generation scope"])
def test_environment_matches_transformers(source: str) -> None:
    """The jinja features templates use beyond plain jinja2: transformers' `tojson` (no HTML
    escaping, keys in order, non-ASCII kept), loop controls, `strftime_now`, `tools`/`documents`
    as none, only the special tokens the model has, and `{% generation %}` blocks."""
    messages = [{"role": "user", "content": "Ünïcode <tag> & \"quotes\""}, {"role": "assistant", "content": "ok"}]
    ours, theirs = _ours(source, None, "</s>"), _theirs(source, None, "</s>")
    expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours.render_chat(messages) == expected
