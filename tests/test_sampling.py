"""Sampling (`llmc.runtime.sampling`): each option against a direct numpy computation of its formula, the
logprobs (the raw model distribution), the checks, and greedy speculation with penalties on a tiny model."""

from __future__ import annotations

import numpy as np
import pytest
from test_speculate import _Oracle
from tiny_models import TinySpec

from llmc.abi import WEIGH_GROUP
from llmc.runtime.codec import TextCodec
from llmc.runtime.sampling import SEARCH_BLOCK, Sampler, SamplingOptions, _largest, _search, log_probs
from llmc.runtime.session import Session
from llmc.runtime.speculate import Speculation, step

VOCAB = 5000
RNG = np.random.default_rng(7)
LOGITS = (RNG.standard_normal(VOCAB) * 3).astype(np.float32)


def _softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def _reference(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    """Temperature, top-k, top-p, min-p by a full sort: {id: probability}."""
    probs = _softmax(logits.astype(np.float64) / temperature)
    order = np.argsort(-probs, kind="stable")
    if top_k:
        order = order[:top_k]
    kept = probs[order] / probs[order].sum()
    if top_p < 1:
        order = order[: np.searchsorted(np.cumsum(kept), top_p) + 1]
    if min_p:
        order = order[probs[order] >= min_p * probs[order[0]]]
    return dict(zip(order.tolist(), (probs[order] / probs[order].sum()).tolist()))


def _as_dict(ids: np.ndarray, probs: np.ndarray) -> dict[int, float]:
    return dict(zip(ids.tolist(), probs.tolist()))


@pytest.mark.parametrize("temperature, top_k, top_p, min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 40, 1.0, 0.0), (2.0, 0, 0.9, 0.0), (5.0, 0, 0.95, 0.0),  # (a head grown past 64)
    (1.0, 0, 1.0, 0.05), (3.0, 0, 1.0, 0.001), (1.3, 100, 0.8, 0.02),
])
def test_distribution_is_the_filters_formula(temperature, top_k, top_p, min_p) -> None:
    sampler = Sampler(SamplingOptions(temperature, top_k, top_p, min_p=min_p))
    ids, probs = sampler.distribution(LOGITS)
    expected = _reference(LOGITS, temperature, top_k, top_p, min_p)
    assert set(ids.tolist()) == set(expected)
    got = _as_dict(ids, probs)
    filtered = top_k or top_p < 1 or min_p
    # float64 weights where a filter applies; float32 over the whole vocabulary where none does
    assert max(abs(got[i] - p) for i, p in expected.items()) < (1e-9 if filtered else 1e-8)
    if filtered:
        assert np.all(np.diff(probs) <= 0)  # likeliest first
    if temperature == 5.0:
        assert len(ids) > 64


def test_min_p_drops_tokens_below_its_share_of_the_top() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.1, 0.06, 0.04]))
    ids, probs = Sampler(SamplingOptions(1.0, min_p=0.15)).distribution(logits)
    assert ids.tolist() == [0, 1, 2]  # 0.1 >= 0.15 × 0.5 = 0.075 > 0.06
    assert np.allclose(probs, np.array([0.5, 0.3, 0.1]) / 0.9)


def test_logit_bias_is_added_and_forces_or_bans_a_token() -> None:
    bias = ((3, 2.5), (10, -1.0))
    processed = Sampler(SamplingOptions(1.0, logit_bias=bias)).processed(LOGITS)
    expected = LOGITS.copy()
    expected[3] += 2.5
    expected[10] -= 1.0
    assert np.array_equal(processed, expected)
    assert Sampler(SamplingOptions(logit_bias=((123, 100.0),)))(LOGITS) == 123
    forced = Sampler(SamplingOptions(1.5, seed=0, logit_bias=((123, 100.0),)))
    assert {forced(LOGITS) for _ in range(50)} == {123}
    best = int(np.argmax(LOGITS))
    assert Sampler(SamplingOptions(logit_bias=((best, -100.0),)))(LOGITS) != best
    with pytest.raises(ValueError, match="logit-bias: token 5000 is not in the vocabulary of 5000"):
        Sampler(SamplingOptions(logit_bias=((5000, 1.0),)))(LOGITS)


def test_penalties_follow_their_formulas_and_counts() -> None:
    prompt = [1, 2, 2, 3]
    generated = [3, 4, 4, 4, 1]
    options = SamplingOptions(1.0, presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.3,
                              logit_bias=((4, 1.0),))
    sampler = Sampler(options, context=prompt)
    sampler.take(generated)
    logits = np.array([1.0, 2.0, -1.0, 0.5, -0.5, 3.0], np.float32)
    expected = logits.copy()
    expected[4] += 1.0  # logit_bias first
    for token in {*prompt, *generated}:  # repetition (HF): over prompt + generated, each distinct token once
        expected[token] = expected[token] / 1.3 if expected[token] > 0 else expected[token] * 1.3
    for token, count in {3: 1, 4: 3, 1: 1}.items():  # presence and frequency (OpenAI): over the generated only
        expected[token] -= 0.5 + 0.25 * count
    assert np.allclose(sampler.processed(logits), expected)
    assert sampler.processed(logits)[0] == logits[0] and sampler.processed(logits)[5] == logits[5]  # unseen
    assert np.allclose(sampler.distribution(logits)[1].sum(), 1.0)
    ids, probs = sampler.distribution(logits)
    assert np.allclose(_as_dict(ids, probs)[5], _softmax(expected.astype(np.float64))[5])


def test_penalties_count_the_chosen_tokens() -> None:
    logits = np.array([5.0, 4.0, 3.0, 0.0], np.float32)
    sampler = Sampler(SamplingOptions(frequency_penalty=2.0))
    chosen = [sampler(logits) for _ in range(4)]
    assert chosen == [0, 1, 0, 2]  # 5 → 3 after one use: 4 wins; then 3 = 3 → 0 (argmax ties: the first); then 2
    assert Sampler(SamplingOptions(repetition_penalty=10.0), context=[0])(logits) == 1


def test_logprobs_are_the_raw_log_softmax() -> None:
    logits = LOGITS
    expected = np.log(_softmax(logits.astype(np.float64)))
    record = log_probs(logits, 17, 5)
    assert record.token == 17 and abs(record.logprob - expected[17]) < 1e-9
    assert [t for t, _ in record.top] == np.argsort(-expected)[:5].tolist()
    assert all(abs(lp - expected[t]) < 1e-9 for t, lp in record.top)
    assert log_probs(logits, 17, 0).top == ()

    # what a sampler records: the raw distribution's, whatever the temperature, bias and penalties did
    sampler = Sampler(SamplingOptions(0.5, seed=1, logit_bias=((17, 30.0),), presence_penalty=1.0, logprobs=3))
    tokens = [sampler(logits) for _ in range(3)]
    records = sampler.taken_logprobs()
    assert [r.token for r in records] == tokens and tokens[0] == 17
    assert all(abs(r.logprob - expected[r.token]) < 1e-9 and len(r.top) == 3 for r in records)
    assert sampler.taken_logprobs() == []  # drained
    quiet = Sampler(SamplingOptions())
    quiet(logits)
    assert quiet.taken_logprobs() == []


def test_draw_is_rng_choice_without_its_checks() -> None:
    ids, probs = Sampler(SamplingOptions(1.0)).distribution(LOGITS)
    mine, numpy = Sampler(SamplingOptions(1.0, seed=3)), np.random.default_rng(3)
    assert [mine.draw(ids, probs) for _ in range(200)] == [int(ids[numpy.choice(len(ids), p=probs)])
                                                           for _ in range(200)]


def test_a_vocabularys_draws_are_rng_choices_of_its_softmax() -> None:
    # a vocabulary past `SEARCH_BLOCK`'s multiples: the draw searches the blocks' sums, then one block
    vocab = 3 * SEARCH_BLOCK + 517
    logits = (np.random.default_rng(11).standard_normal(vocab) * 3).astype(np.float32)
    probs = _softmax(logits.astype(np.float64) / 0.8)
    sampler, numpy = Sampler(SamplingOptions(0.8, seed=5)), np.random.default_rng(5)
    assert [sampler(logits) for _ in range(300)] == [int(numpy.choice(vocab, p=probs)) for _ in range(300)]


def test_draws_take_only_allowed_tokens_at_any_temperature() -> None:
    logits = np.full(5000, -np.inf, np.float32)
    allowed = [7, 1900, 4999]
    logits[allowed] = [1.0, 2.0, 0.5]
    drawn = [Sampler(SamplingOptions(1.0, seed=seed))(logits) for seed in range(600)]
    assert set(drawn) == set(allowed)
    counts = np.array([drawn.count(token) for token in allowed]) / len(drawn)
    assert np.abs(counts - _softmax(logits[allowed].astype(np.float64))).max() < 0.06
    for temperature in (1e-30, 1e-40, 1e-50):  # float32: normal, subnormal, 0; every token but the likeliest weighs 0
        assert {Sampler(SamplingOptions(temperature, seed=s))(LOGITS) for s in range(20)} == {int(LOGITS.argmax())}
    assert len({Sampler(SamplingOptions(1e300, seed=s))(LOGITS) for s in range(50)}) > 40  # (all alike: uniform)


@pytest.mark.parametrize("size", [5, 63, 64, 65, 1000, 5000, 70_001])
def test_largest_are_argpartitions(size) -> None:
    """`_largest` finds the k largest, by its own groups' maxima or given the contiguous groups' (the thread
    team's, `WEIGH_GROUP` values each, the last one partial), for k below, at and above the groups' count."""
    values = np.random.default_rng(size).standard_normal(size).astype(np.float32)
    values[::7] = -np.inf  # (tokens a grammar excludes)
    padded = np.concatenate([values, np.full(-size % WEIGH_GROUP, -np.inf, np.float32)])
    maxima = padded.reshape(-1, WEIGH_GROUP).max(axis=1)
    for k in sorted({1, 2, 40, 63, 64, 65, 1000, maxima.size, maxima.size + 1, size // 3, size - 1, size}
                    & set(range(1, size + 1))):
        for given in (None, maxima):
            got = _largest(values, k, given)
            assert got.size == k and np.unique(got).size == k
            assert np.sort(values[got]).tolist() == np.sort(values)[size - k :].tolist()
    assert _largest(values, 0).size == _largest(values, 0, maxima).size == 0
    values[size // 2] = np.nan  # (not a logit; still k indices)
    assert _largest(values, min(3, size)).size == _largest(values, min(3, size), maxima).size == min(3, size)


@pytest.mark.parametrize("size", [1, 5, SEARCH_BLOCK, SEARCH_BLOCK + 1, 4 * SEARCH_BLOCK - 3])
def test_search_is_the_running_sums_searchsorted(size) -> None:
    rng = np.random.default_rng(size)
    weights = rng.random(size).astype(np.float32) ** 4
    weights[rng.random(size) < 0.3] = 0  # (tokens at -inf weigh 0)
    weights[-1] = 0
    weights[0] = max(weights[0], 0.1)
    for leading_zeros in (0, max(0, min(SEARCH_BLOCK, size - 2))):  # (a first block all 0: u = 0 must pass it)
        weights[:leading_zeros] = 0
        weights[leading_zeros] = max(weights[leading_zeros], 0.1)
        running = np.cumsum(weights, dtype=np.float64)
        last = int(np.flatnonzero(weights)[-1])
        for u in [0.0, *rng.random(200), np.nextafter(1.0, 0.0)]:
            got = _search(weights, u)
            assert weights[got] > 0
            expected = min(int(np.searchsorted(running, u * running[-1], side="right")), last)
            assert got == expected, (u, got, expected)


def test_plain_only_where_nothing_is_processed() -> None:
    assert Sampler(SamplingOptions()).plain and Sampler(SamplingOptions(0.8, top_k=1)).plain
    for options in (SamplingOptions(0.8), SamplingOptions(logprobs=0), SamplingOptions(presence_penalty=0.1),
                    SamplingOptions(repetition_penalty=1.1), SamplingOptions(logit_bias=((1, 1.0),))):
        assert not Sampler(options).plain


@pytest.mark.parametrize("options, message", [
    (SamplingOptions(-0.1), "temperature must be a finite number >= 0"),
    (SamplingOptions(top_k=-1), "top-k must be >= 0"),
    (SamplingOptions(top_p=0), r"top-p must be in \(0, 1\]"),
    (SamplingOptions(min_p=1.5), r"min-p must be in \[0, 1\]"),
    (SamplingOptions(presence_penalty=2.5), r"presence-penalty must be in \[-2, 2\]"),
    (SamplingOptions(frequency_penalty=-3), r"frequency-penalty must be in \[-2, 2\]"),
    (SamplingOptions(repetition_penalty=0), r"repetition-penalty must be in \[0.1, 10\]"),
    (SamplingOptions(repetition_penalty=1e-320), r"repetition-penalty must be in \[0.1, 10\]"),
    (SamplingOptions(repetition_penalty=11), r"repetition-penalty must be in \[0.1, 10\]"),
    (SamplingOptions(logit_bias=((-1, 1.0),)), "logit-bias: a token id must be an integer >= 0"),
    (SamplingOptions(logit_bias=((5, 101.0),)), r"logit-bias: the bias of token 5 must be in \[-100, 100\]"),
    (SamplingOptions(logprobs=21), "logprobs must be in 0..20"),
])
def test_check_refuses_values_out_of_range_naming_the_option(options, message) -> None:
    with pytest.raises(ValueError, match=message):
        options.check()
    with pytest.raises(ValueError, match=message):
        Sampler(options)


def _generate(session: Session, prompt: list[int], n: int, options: SamplingOptions,
              speculation: Speculation | None) -> tuple[list[int], Sampler]:
    """`n` tokens after `prompt` through `speculate.step`, with or without drafts."""
    sampler = Sampler(options, context=prompt)
    session.reset()
    if speculation is not None:
        speculation.start(session, [])
    out = step(session, sampler, prompt, n, speculation)
    while len(out) < n and session.position < session.capacity - 1:
        out += step(session, sampler, out[-1:], n - len(out), speculation)
    return out[:n], sampler


def test_greedy_speculation_with_penalties_gives_the_plain_tokens(artifact, every_draft) -> None:
    session = Session(artifact(TinySpec(context_length=128, tied=False), chunk=8, max_seq=128), threads=1)
    codec = TextCodec.from_artifact(session.manifest)
    prompt = codec.encode("one two three one two three one two three one two")
    options = SamplingOptions(repetition_penalty=1.3, presence_penalty=0.3, frequency_penalty=0.2, logprobs=2)
    plain, plain_sampler = _generate(session, prompt, 60, options, None)
    speculation = Speculation(_Oracle(prompt + plain, wrong=4))  # the plain tokens, every 4th off by one
    fast, fast_sampler = _generate(session, prompt, 60, options, speculation)
    assert fast == plain
    fast_records, plain_records = fast_sampler.taken_logprobs(), plain_sampler.taken_logprobs()
    assert [r.token for r in fast_records] == [r.token for r in plain_records] == plain  # one per token, in order
    assert np.allclose([r.logprob for r in fast_records], [r.logprob for r in plain_records], atol=1e-4)
    assert speculation.stats.verify_calls > 0 and 0 < speculation.stats.accepted < speculation.stats.drafted
    unpenalized, _ = _generate(session, prompt, 60, SamplingOptions(), None)
    assert unpenalized != plain  # (the penalties changed the text: the comparison above means something)


def test_the_draws_a_session_may_weigh_where_the_logits_are() -> None:
    """`weighed_draw`: a draw that weighs every token (temperature alone; top-p without top-k, for the total)
    from the raw logits, with nothing to process or record; greedy is `plain`, and top-k and min-p alone find
    their heads without weighing every token."""
    def weighs(**options) -> bool:
        return Sampler(SamplingOptions(**options)).weighed_draw

    assert weighs(temperature=1.0) and weighs(temperature=0.7, top_p=0.9)
    assert weighs(temperature=1.0, top_p=0.9, min_p=0.05)
    assert not weighs() and not weighs(temperature=1.0, top_k=1) and Sampler(SamplingOptions(1.0, top_k=1)).plain
    assert not weighs(temperature=1.0, top_k=40) and not weighs(temperature=1.0, min_p=0.05)
    assert not weighs(temperature=1.0, top_k=40, top_p=0.9)
    assert not weighs(temperature=1.0, presence_penalty=0.5) and not weighs(temperature=1.0, repetition_penalty=1.1)
    assert not weighs(temperature=1.0, logprobs=0) and not weighs(temperature=1.0, logit_bias=((1, 2.0),))
