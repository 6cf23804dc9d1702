"""Prefix caching and the context limit: a session's `cached` tokens and `reuse`, `limit_context`, and the
batching engine reusing what a free slot's cache holds (llama-server's cache_prompt).

The bar is a fresh start's result: every greedy stream that reuses a cached prefix must be, token for token,
what the same request gives on an empty cache, and its logits the same within float error.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import test_cuda
from test_batch import QSPEC, SPEC, into

from llmc.errors import LlmcError
from llmc.runtime import batch
from llmc.runtime.artifact import load_manifest
from llmc.runtime.batch import Engine, Request
from llmc.runtime.codec import TextCodec
from llmc.runtime.cuda import CudaSession
from llmc.runtime.grammar import Grammar
from llmc.runtime.sampling import SamplingOptions, TokenLogprob
from llmc.runtime.session import CapacityError, Session, common_prefix

cuda_artifact = test_cuda.cuda_artifact  # the fixture: CUDA artifacts and the emulator running them
PROMPT = [5, 17, 42, 100, 150, 7, 9, 11, 200, 3]


def _close(actual: np.ndarray, expected: np.ndarray) -> None:
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5 * np.abs(expected).max())


def test_common_prefix() -> None:
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([], [1]) == 0 and common_prefix([7], [8]) == 0


def test_cached_follows_feed_score_verify_rewind_and_reset(artifact) -> None:
    session = Session(artifact(SPEC, speculate=4))
    session.feed(PROMPT[:6])  # two prefill chunks
    session.feed([PROMPT[6]])  # decode
    session.score(PROMPT[7:9])
    session.verify([PROMPT[9], 1, 2])
    assert session.cached == PROMPT + [1, 2] and session.position == 12
    session.rewind(8)
    assert session.cached == PROMPT[:8] and session.position == 8
    session.reset()
    assert session.cached == [] and session.position == 0
    session.close()


@pytest.mark.parametrize("spec", [SPEC, QSPEC], ids=["f32", "a8"])
def test_reuse_feeds_only_what_differs_and_gives_a_fresh_starts_logits(artifact, spec) -> None:
    """A prompt sharing a prefix with the cache (mid-chunk, so `prefill_kv` starts at an odd position and feeds
    partial chunks), a prompt that is a prefix of the cache, one equal to it, and one sharing nothing."""
    session, fresh = (Session(artifact(spec)) for _ in range(2))
    session.feed(PROMPT)
    for prompt, kept in ((PROMPT[:5] + [66, 250, 31], 5), (PROMPT[:3], 2), (PROMPT[:3], 2), ([9, 9], 0)):
        assert session.reuse(prompt) == kept and session.cached == prompt[:kept]
        logits = session.feed(prompt[kept:])
        fresh.reset()
        _close(logits, fresh.feed(prompt))
        assert session.cached == prompt
    assert session.reuse([4]) == 0 and session.position == 0
    session.close()
    fresh.close()


def test_limit_context_bounds_feeding_and_refuses_beyond_the_compiled_capacity(artifact) -> None:
    session = Session(artifact(SPEC))
    assert session.capacity == 32
    session.feed(list(range(1, 21)))
    session.limit_context(16)
    assert session.capacity == 16 and session.cached == list(range(1, 17))  # (what the limit holds)
    with pytest.raises(CapacityError, match="exceed the KV cache capacity of 16 .--ctx up to 32"):
        session.feed([1])
    session.reset()
    session.feed(list(range(1, 17)))
    for bad in (33, 1, 0):
        with pytest.raises(LlmcError, match=rf"--ctx must be in 2..32 .*got {bad}"):
            session.limit_context(bad)
    session.limit_context(32)
    session.feed([1])
    assert session.position == 17
    session.close()


def test_cuda_sessions_keep_cached_through_the_gpus_argmax(cuda_artifact) -> None:
    directory, device = cuda_artifact(SPEC)
    session = CudaSession(load_manifest(directory), device=device)
    first = session.greedy(PROMPT)
    second = session.greedy([first])
    assert session.cached == PROMPT + [first]
    assert session.reuse(PROMPT + [first, second]) == len(PROMPT) + 1
    session.greedy([second])
    assert session.cached == PROMPT + [first, second]
    session.close()


# ------------------------------------------------------------------ the engine


def _run(engine: Engine, *requests: Request) -> None:
    for request in requests:
        engine.submit(request)
    while engine.busy:
        engine.step()


def _stream(engine: Engine, prompt: list[int], max_tokens: int, sampling: SamplingOptions = SamplingOptions()
            ) -> list[int]:
    tokens: list[int] = []
    _run(engine, Request(prompt, max_tokens, sampling, emit=into(tokens)))
    return tokens


def _used(engine: Engine) -> tuple[int, int]:
    stats = engine.stats()
    return stats["prompt_tokens"], stats["reused_tokens"]


@pytest.mark.parametrize("sampling", [SamplingOptions(), SamplingOptions(temperature=8.0, seed=3)],
                         ids=["greedy", "sampled"])
def test_a_request_sharing_a_prefix_reuses_it_and_gives_a_fresh_engines_text(artifact, sampling) -> None:
    """Sharing the whole prompt and its generated tokens (a conversation's next turn), part of the prompt, and
    a prompt that is a prefix of the cache: each fed from where the slot's tokens depart, each stream what
    a fresh engine gives."""
    session, fresh = (Session(artifact(QSPEC, max_batch=2, max_seq=64)) for _ in range(2))
    engine = Engine(session, end_ids=())
    first = _stream(engine, PROMPT, 6, sampling)
    slot = engine.cached[0]
    assert slot == PROMPT + first[:-1] and _used(engine) == (10, 0)  # (the last token is never fed)
    for prompt, reused in ((PROMPT + first[:3] + [8], 13), (PROMPT[:7] + [66, 250, 31], 7), (PROMPT[:4], 3)):
        fed, before = _used(engine)
        got = _stream(engine, prompt, 6, sampling)
        assert _used(engine) == (fed + len(prompt) - reused, before + reused)
        assert got == _stream(Engine(fresh, end_ids=()), prompt, 6, sampling)
    assert engine.free == [1, 0]  # (slot 0 ran them all: it held their prefixes)
    session.close()
    fresh.close()


def test_the_free_slot_with_the_longest_common_prefix_is_taken_and_the_one_free_longest_among_equals(artifact):
    session = Session(artifact(SPEC, max_batch=3, max_seq=64))
    engine = Engine(session, end_ids=())
    a, b = [5, 17, 42, 100, 150, 7], [66, 250, 31, 8, 19, 12]
    _run(engine, Request(a, 2), Request(b, 4))  # a in slot 0, b in slot 1; a ends first
    assert engine.free == [2, 0, 1] and engine.cached[0][:6] == a and engine.cached[1][:6] == b

    def slot_of(prompt: list[int]) -> int:
        _run(engine, Request(prompt, 1))
        return engine.free[-1]  # (the slot it ran in, freed last)

    assert slot_of(b[:4] + [1, 2]) == 1 and engine.stats()["reused_tokens"] == 4
    assert slot_of(a[:3] + [9]) == 0
    assert slot_of([200, 201, 202]) == 2  # nothing shared: the slot free longest (empty), not a held prefix
    assert slot_of([3, 3]) == 1  # then slot 1, free longest, and not slot 0's prefix just used
    assert engine.free == [0, 2, 1]
    session.close()


def test_speculation_counts_only_the_accepted_rows_as_cached(artifact, monkeypatch) -> None:
    """Drafts verify rejects are left in the cache's rows but not among the slot's tokens: the next request
    reuses only what was fed and accepted, and its text is a plain fresh decode's. Drafts are verified however
    unlikely (`MARGIN` 0, in the engine and in `worth_verifying`): whether verifying pays is timed, and a tiny
    model's calls take microseconds, so after the first rejection the engine would otherwise decode plainly on a
    quiet machine."""
    monkeypatch.setattr(batch, "MARGIN", 0.0)
    monkeypatch.setattr("llmc.runtime.speculate.MARGIN", 0.0)
    session, fresh = (Session(artifact(SPEC, max_batch=2, max_seq=64, speculate=8)) for _ in range(2))
    engine = Engine(session, end_ids=(), speculate=True)
    prompt = [150, 150, 7, 9, 11, 150]  # (after 150 150, the drafter proposes 7; the model says 150)
    first = _stream(engine, prompt, 20)
    stats = engine.stats()
    assert stats["drafted_tokens"] > stats["accepted_tokens"] > 0, "some drafts rejected, some accepted"
    assert engine.cached[0] == prompt + first[:-1]
    follow = prompt + first[:12] + [250, 31]
    assert _stream(engine, follow, 10) == _stream(Engine(fresh, end_ids=()), follow, 10)
    assert engine.stats()["reused_tokens"] == len(prompt) + 12
    session.close()
    fresh.close()


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits.astype(np.float64)
    top = logits.max(-1, keepdims=True)
    return logits - top - np.log(np.exp(logits - top).sum(-1, keepdims=True))


def test_echo_gives_each_prompt_tokens_logprobs_from_score_then_generates(artifact) -> None:
    """The prompt runs through `score` in chunks of its rows (4) in slot 1 beside a sequence generating in
    slot 0; each prompt token's logprob (and top 2) is the log-softmax of the row before it in a separate
    session's `score`, and the generated tokens' logprobs are the rows after; no reuse for echo."""
    session, scorer = Session(artifact(SPEC, max_batch=2, max_seq=64)), Session(artifact(SPEC, max_seq=64))
    expected = _log_softmax(scorer.score(PROMPT))
    engine = Engine(session, end_ids=())
    _stream(engine, PROMPT, 2)  # slot 0 holds the prompt: echo does not reuse it
    echoed: list[list[TokenLogprob | None]] = []
    emitted: list[tuple[int, TokenLogprob | None]] = []
    beside = Request([1, 2, 3], 12)
    echo = Request(PROMPT, 3, SamplingOptions(logprobs=2), emit=lambda token, lp: emitted.append((token, lp)),
                   prompt_logprobs=echoed.append)
    _run(engine, beside, echo)
    assert engine.stats()["reused_tokens"] == 0 and engine.stats()["prompt_tokens"] == 10 + 3 + 10
    (logprobs,) = echoed
    assert logprobs[0] is None and [lp.token for lp in logprobs[1:]] == PROMPT[1:]
    for i, lp in enumerate(logprobs[1:]):
        assert lp.logprob == pytest.approx(expected[i, PROMPT[i + 1]], abs=1e-4)
        assert [t for t, _ in lp.top] == list(np.argsort(-expected[i])[:2])
    tokens = [token for token, _ in emitted]
    assert tokens[0] == int(np.argmax(expected[-1]))  # (score's last row is the prompt's next-token logits)
    scorer.reset()
    alone = [scorer.feed(PROMPT)] + [scorer.feed([t]) for t in tokens[:-1]]
    for (token, lp), logits in zip(emitted, alone):
        assert lp.token == token and lp.logprob == pytest.approx(_log_softmax(logits)[token], abs=1e-4)
        assert len(lp.top) == 2 and lp.top[0][0] == token  # (greedy: the likeliest)
    session.close()
    scorer.close()


def test_echo_with_no_tokens_to_generate_ends_after_the_prompts_logprobs(artifact) -> None:
    session = Session(artifact(SPEC, max_batch=2, max_seq=64))
    engine = Engine(session, end_ids=())
    echoed, reasons, emitted = [], [], []
    _run(engine, Request(PROMPT[:3], 0, emit=lambda token, lp: emitted.append(token), finish=reasons.append,
                         prompt_logprobs=echoed.append))
    assert len(echoed) == 1 and len(echoed[0]) == 3 and echoed[0][1].top == () and reasons == ["length"]
    assert emitted == [] and engine.cached[0] == PROMPT[:3]  # (scored into the cache: a later request reuses it)
    with pytest.raises(ValueError, match="max_tokens must be at least 1, got 0"):
        engine.submit(Request(PROMPT, 0))
    with pytest.raises(ValueError, match="max_tokens must be at least 0, got -1"):
        engine.submit(Request(PROMPT, -1, prompt_logprobs=echoed.append))
    session.close()


def test_limit_context_bounds_the_engines_prompts_and_generations(artifact) -> None:
    session = Session(artifact(SPEC, max_batch=2, max_seq=64))
    session.limit_context(16)
    engine = Engine(session, end_ids=())
    with pytest.raises(CapacityError, match=r"the prompt has 16 tokens; the KV cache holds 16 .* \(--ctx up to 64\)"):
        engine.submit(Request(list(range(1, 17)), 1))
    reasons: list[str] = []
    tokens = []
    _run(engine, Request(PROMPT, 20, emit=into(tokens), finish=reasons.append))
    assert reasons == ["length"] and len(tokens) == 16 - len(PROMPT) + 1 and len(engine.cached[0]) == 16
    session.close()


@pytest.mark.parametrize("speculate", [False, True], ids=["decode", "speculate"])
def test_a_constrained_request_keeps_to_its_grammar_beside_a_free_one(artifact, speculate: bool) -> None:
    """A grammar's constraint masks each choice (drafts cut to what it admits, then verified on the masked
    logits); the unconstrained request decoded in the same calls is its text alone."""
    directory = artifact(SPEC, max_batch=2, max_seq=64, speculate=8)
    session, codec = Session(directory), TextCodec.from_artifact(load_manifest(directory))
    prompt = codec.encode("on the the bbb ab the")
    free_alone = _stream(Engine(session, end_ids=codec.end_ids), prompt, 12)
    engine = Engine(session, end_ids=codec.end_ids, speculate=speculate)
    constrained, free, reasons = [], [], []
    grammar = Grammar.lark(codec, "start: /[ab]{3,6}/")
    _run(engine, Request(prompt, 12, emit=into(constrained), finish=reasons.append, constraint=grammar.constraint()),
         Request(prompt, 12, emit=into(free), finish=reasons.append))
    assert re.fullmatch("[ab]{3,6}", codec.decode(constrained)) and reasons[0] == "stop"
    assert free == free_alone and not re.fullmatch("[ab]*", codec.decode(free))
    session.close()


def test_logprobs_of_accepted_drafts_are_the_plain_decodes(artifact) -> None:
    """Each emitted token carries its logprobs, whether it came from a decode row or from a verify call's
    accepted drafts: the same, token for token, as plain decoding's."""
    session = Session(artifact(SPEC, max_batch=2, max_seq=64, speculate=8))
    streams = []
    for speculate in (False, True):
        engine = Engine(session, end_ids=(), speculate=speculate)
        for rows in (1, session.max_verify):  # calls of any size cost alike: every draft is worth verifying
            engine.cost.record(rows, 1.0)  # (the timings of a loaded machine could say otherwise)
        emitted: list[tuple[int, TokenLogprob | None]] = []
        _run(engine, Request([7, 9, 11, 150, 150, 150], 20, SamplingOptions(logprobs=1),
                             emit=lambda token, lp: emitted.append((token, lp))))
        streams.append(emitted)
    plain, speculated = streams
    stats = engine.stats()
    assert stats["accepted_tokens"] > 0, {k: stats[k] for k in ("verify_calls", "drafted_tokens", "decode_steps")}
    assert [t for t, _ in speculated] == [t for t, _ in plain] and all(lp.token == t for t, lp in speculated)
    for (_, a), (_, b) in zip(plain, speculated):
        assert b.logprob == pytest.approx(a.logprob, abs=1e-4) and [t for t, _ in b.top] == [t for t, _ in a.top]
    session.close()


def test_fault_in_cache_maps_the_rows_of_the_slots_and_positions_in_use(artifact) -> None:
    """`Session.fault_in_cache(slots)` (`llmc serve` calls it before it listens, where `cache_rows_bytes(slots)`
    fit the memory available) maps every 4 KB page of the K and V rows of the first `slots` sequences up to the
    `--ctx` limit (`mincore`: resident), and none of the rows of the positions past the limit's page or of the other
    sequences. The cache's pages are first unmapped (and kept off 2 MB pages, which would map their neighbours
    too)."""
    import ctypes
    from dataclasses import replace

    from llmc.runtime.session import PAGE

    spec = replace(SPEC, context_length=2048)
    session = Session(artifact(spec, max_seq=2048, max_batch=4, kv_type="f16"))
    session.limit_context(600)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    MADV_DONTNEED, MADV_NOHUGEPAGE = 4, 14

    def resident(cache: np.ndarray) -> np.ndarray:
        """Per element of `cache`: whether its page is mapped."""
        pages = np.zeros(-(-cache.nbytes // PAGE), np.uint8)
        assert libc.mincore(cache.ctypes.data, cache.nbytes, pages.ctypes.data) == 0, ctypes.get_errno()
        per_byte = np.repeat(pages & 1, PAGE)[: cache.nbytes].astype(bool)
        return per_byte.reshape(*cache.shape, cache.itemsize)[..., 0]

    whole = [cache.nbytes // PAGE * PAGE for cache in (session.k_cache, session.v_cache)]
    for cache, size in zip((session.k_cache, session.v_cache), whole):  # (the arrays start on a page)
        for advice in (MADV_NOHUGEPAGE, MADV_DONTNEED):
            assert libc.madvise(cache.ctypes.data, size, advice) == 0, ctypes.get_errno()
        assert not resident(cache).reshape(-1)[: size // cache.itemsize].any()
    layers, _, heads, _, width = session.k_cache.shape
    assert session.cache_rows_bytes(2) == 2 * layers * 2 * heads * 600 * width * session.k_cache.itemsize
    session.fault_in_cache(2)
    rows_a_page = PAGE // (session.k_cache.shape[-1] * session.k_cache.itemsize)
    for cache in (session.k_cache, session.v_cache):  # [layers, slots, kv heads, positions, row]
        mapped = resident(cache)
        assert cache.shape[1] == 4 and mapped[:, :2, :, :600].all()
        assert not mapped[:, :2, :, -(-600 // rows_a_page) * rows_a_page :].any() and not mapped[:, 2:].any()
        assert not cache.any()  # (zeros, as before)
    session.close()


def test_available_memory_is_what_linux_can_still_give() -> None:
    """`available_memory` (which `llmc serve` weighs the cache's rows against before it maps them) is Linux's
    `MemAvailable` or a cgroup's smaller room: more than nothing, no more than `MemAvailable`."""
    from llmc.runtime.session import available_memory

    meminfo = dict(line.split(":") for line in Path("/proc/meminfo").read_text().splitlines())
    free = available_memory()
    assert free is not None and 0 < free <= int(meminfo["MemAvailable"].split()[0]) * 1024 * 1.01
