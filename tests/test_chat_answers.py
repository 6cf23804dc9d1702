"""The chat-answer check of issue 21 on the real model: the default build answers like fp32.

A subset of `benchmarks/chat_check.py`'s questions (every fourth: 13 of 50), greedy, first
24 tokens; the benchmark runs all of them, the plain prompts, KL and held-out perplexity.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from test_real_model import compiled  # noqa: F401  (the fixture: SmolLM2 artifacts, built once per name)

from llmc.runtime.codec import TextCodec
from llmc.runtime.session import Session

pytestmark = pytest.mark.real_model

_spec = importlib.util.spec_from_file_location("chat_check", Path(__file__).parents[1] / "benchmarks" / "chat_check.py")
chat_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(chat_check)

QUESTIONS = chat_check.QUESTIONS[::4]


def test_the_default_build_answers_chat_questions_like_fp32(compiled) -> None:  # noqa: F811
    """The first 24 greedy tokens equal the `--quant f32` build's on all but two of the 13 questions
    (the old a8 default: 4). The issue's bound, ≥ 90%, is held by the benchmark over all 50 (48 here);
    on 13, one more near-tie flipped by another CPU's kernels (AVX-512's sums differ in their last
    bits) would fail a 90% assertion about one run in ten."""
    reference, default = Session(compiled("f32", quant="f32")), Session(compiled("default"))
    codec = TextCodec.from_artifact(reference.manifest)
    differ = []
    for question in QUESTIONS:
        prompt = codec.encode(codec.chat(question))
        expected = chat_check.greedy_answer(reference, prompt, chat_check.CHAT_TOKENS, codec.eos_id)
        answer = chat_check.greedy_answer(default, prompt, chat_check.CHAT_TOKENS, codec.eos_id)
        if answer != expected:
            differ.append(f"{question!r}: {codec.decode(answer)!r}, fp32 {codec.decode(expected)!r}")
    reference.close()
    default.close()
    equal = len(QUESTIONS) - len(differ)
    assert equal >= len(QUESTIONS) - 2, f"{equal}/{len(QUESTIONS)} equal; these differ:\n" + "\n".join(differ)
