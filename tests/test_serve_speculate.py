"""Speculative decoding in the batching engine and `llmc serve`: each sequence drafts by prompt lookup and
checks its drafts in a `verify` call of its own, beside the others' batched `decode` rows.

The bar is plain decode's text: every greedy stream, alone or several at once, must be the same token for
token, and end the same way (end of sequence mid-draft, `max_tokens`, the cache's capacity, stop strings).
Tiny random models repeat themselves greedily, so their drafts are accepted.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from test_batch import PROMPTS, SPEC, into
from tiny_models import TinySpec

from llmc.runtime.batch import Engine, Request, _Sequence
from llmc.runtime.sampling import Sampler, SamplingOptions
from llmc.runtime.session import Session
from llmc.runtime.speculate import CallCost, PromptLookup, Speculation

CAPACITY = 64
COPIES = [[5, 17, 42, 9, 5, 17, 42], [100, 150, 7, 100, 150], [3, 4, 5, 6, 3, 4, 5, 6, 3, 4]]


# a served engine's `every_draft` (a `start_server` prelude)
EVERY_DRAFT = ("from llmc.runtime import speculate\nfrom llmc.runtime.batch import Engine\n"
               "speculate.worth_verifying = lambda acceptance, cost, drafted: drafted\n"
               "Engine._worth_verifying = lambda self, drafted, others: len(drafted)")


def _streams(session: Session, requests: list[tuple[list[int], int]], speculate: bool, eos: int | None = None,
             sampling: SamplingOptions = SamplingOptions()) -> tuple[list[tuple[list[int], str]], Engine]:
    """Each request's (tokens, finish reason), all submitted at once to one engine."""
    engine = Engine(session, () if eos is None else {eos}, speculate=speculate)
    out: list[tuple[list[int], list[str]]] = [([], []) for _ in requests]
    for (prompt, max_tokens), (tokens, reasons) in zip(requests, out):
        engine.submit(Request(prompt, max_tokens, sampling, emit=into(tokens), finish=reasons.append))
    while engine.busy:
        engine.step()
    assert all(len(reasons) == 1 for _, reasons in out)
    return [(tokens, reasons[0]) for tokens, reasons in out], engine


@pytest.mark.parametrize("spec", [SPEC, TinySpec(hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=128,
                                                 context_length=64)], ids=["small", "gqa"])
@pytest.mark.parametrize("verify", [8, 0], ids=["verify", "score"])
def test_greedy_streams_with_speculation_are_plain_decodes(artifact, every_draft, spec: TinySpec,
                                                           verify: int) -> None:
    """More requests than slots, several drafting at once beside plain decode rows (in one verify call of every
    slot's rows, or, where `score` stands in for `verify`, a call per draft); then alone. Every draft is verified:
    whether verifying pays is timed (`Engine._worth_verifying`, `Speculation.worth`), and on a loaded machine a
    tiny model's timings could say it never does (4 of 8 runs beside two busy processes verified nothing in some
    case)."""
    session = Session(artifact(spec, max_batch=4, max_seq=CAPACITY, speculate=verify))
    requests = [(prompt, 12 + i) for i, prompt in enumerate(PROMPTS + COPIES)]
    plain, _ = _streams(session, requests, speculate=False)
    speculated, engine = _streams(session, requests, speculate=True)
    assert speculated == plain and engine.together == bool(verify)
    stats = engine.stats()
    assert stats["accepted_tokens"] > 0 and stats["verify_calls"] > 0 and stats["speculate"]
    assert all(reason == "length" and len(tokens) == n for (tokens, reason), (_, n) in zip(plain, requests))
    for request in requests[-3:]:
        assert _streams(session, [request], speculate=True)[0] == _streams(session, [request], speculate=False)[0]
    session.close()


def test_one_verify_call_of_several_slots_is_each_slot_alone(artifact) -> None:
    """What the engine's batched verify stands on: a compiled `verify` takes rows of several slots (each slot's
    at consecutive positions), as `decode` does, and each slot's logits are its own call's."""
    session = Session(artifact(SPEC, max_batch=4, max_seq=CAPACITY))
    prompts = {2: [5, 17, 42, 9, 5], 0: [100, 150, 7], 3: [3, 4, 5, 6, 3, 4, 5]}
    one = np.zeros((1, session.vocab_size), np.float32)
    for slot, prompt in prompts.items():
        session.run("prefill", np.array(prompt, np.int32), np.arange(len(prompt)), np.full(len(prompt), slot), one)
    rows = {2: [7, 8, 9], 0: [11], 3: [12, 13]}
    logits = np.zeros((session.max_verify, session.vocab_size), np.float32)
    alone = {}
    for slot, tokens in rows.items():
        start = len(prompts[slot])
        session.run("verify", np.array(tokens, np.int32), np.arange(start, start + len(tokens)),
                    np.full(len(tokens), slot), logits[: len(tokens)])
        alone[slot] = logits[: len(tokens)].copy()
    tokens = np.array([t for slot in rows for t in rows[slot]], np.int32)
    positions = np.concatenate([np.arange(len(prompts[slot]), len(prompts[slot]) + len(rows[slot])) for slot in rows])
    slots = np.concatenate([np.full(len(rows[slot]), slot) for slot in rows])
    session.run("verify", tokens, positions, slots, logits[: tokens.size])
    np.testing.assert_allclose(logits[: tokens.size], np.concatenate(list(alone.values())), rtol=0, atol=1e-5)
    session.close()


@pytest.mark.parametrize("verify", [8, 0], ids=["verify", "score"])
def test_ends_mid_draft_are_plain_decodes(artifact, every_draft, verify: int) -> None:
    """An end-of-sequence token, `max_tokens` and the cache's capacity each cut a stream where plain decode
    does, whatever the draft beyond them (every draft verified: `every_draft`)."""
    session = Session(artifact(SPEC, max_batch=4, max_seq=CAPACITY, speculate=verify))
    stream, _ = _streams(session, [(COPIES[2], 40)], speculate=False)
    tokens = stream[0][0]
    eos = next(t for t in tokens[3:] if t not in tokens[:3])  # first met a few tokens in
    cut = [(COPIES[2], 40)] + [(COPIES[2], n) for n in (1, 2, 3, 5, 8)] + [(PROMPTS[6], 100), ([9] * 60, 10)]
    for eos_id in (None, eos):
        plain, _ = _streams(session, cut, speculate=False, eos=eos_id)
        speculated, engine = _streams(session, cut, speculate=True, eos=eos_id)
        assert speculated == plain and engine.accepted > 0
    assert plain[0] == (tokens[: tokens.index(eos)], "stop")
    assert [len(t) for t, _ in plain[1:6]] == [1, 2, 3, 5, 8]
    assert plain[6][1] == "length" and len(plain[6][0]) == CAPACITY - len(PROMPTS[6]) + 1  # to the last row
    session.close()


def test_drafts_are_verified_as_far_as_the_call_costs_say_they_pay(artifact) -> None:
    """`_worth_verifying` on fixed call costs, two drafts of 4 (1.94 tokens each expected before any verify: one
    draft in two taken, `Acceptance`) beside 2 plain rows: where rows cost nothing more (a tiny model's calls), both
    drafts in the one verify call; where each row costs a one-row call, neither; in calls of their own (`score`
    standing in for `verify`), a draft pays alone, not beside others whose decode call it adds to."""
    engine = Engine(Session(artifact(SPEC, max_batch=4, max_seq=CAPACITY, speculate=8)), (), speculate=True)
    assert engine.together
    drafted = [(_Sequence(Request([1], 10), slot, Sampler(SamplingOptions()), [],
                          speculation=Speculation(PromptLookup())), [5, 6, 7, 8]) for slot in range(2)]

    def costs(nine_rows: float) -> CallCost:
        """A call of one row taking 1 s, of 9 rows `nine_rows`, and a line through them."""
        cost = CallCost()
        cost.record(1, 1.0)
        cost.record(9, nine_rows)
        return cost

    for nine_rows, verified in ((1.0, 2), (9.0, 0)):
        engine.cost = costs(nine_rows)
        assert engine._worth_verifying(drafted, 2) == verified
    engine.cost, engine.together = costs(1.0), False  # (a call of its own per draft, then a decode of the others)
    assert engine._worth_verifying(drafted, 2) == 0 and engine._worth_verifying(drafted[:1], 0) == 1
    engine.session.close()


def test_sampled_requests_speculate_unless_seeded(artifact, every_draft) -> None:
    """Sampling speculates (the acceptance rule keeps the distribution: tests/test_speculate.py), except with a
    seed, whose text must not depend on what else runs (every draft verified: `every_draft`)."""
    session = Session(artifact(SPEC, max_batch=4, max_seq=CAPACITY))
    requests = [(prompt, 20) for prompt in COPIES]
    for seed in (None, 1):
        sampled, engine = _streams(session, requests, speculate=True, sampling=SamplingOptions(0.5, seed=seed))
        assert [(len(t), r) for t, r in sampled] == [(20, "length")] * 3
        assert all(0 <= t < session.vocab_size for tokens, _ in sampled for t in tokens)
        assert (engine.verify_calls > 0) == (seed is None)
    session.close()


# ------------------------------------------------------------------ through `llmc serve`

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
from test_serve import LETTERS, REPEATS, SLOTS, complete, start_server, stream  # noqa: E402
from test_serve import SPEC as SERVED_SPEC  # noqa: E402


@pytest.fixture(scope="module")
def served_artifact(tiny, tmp_path_factory) -> Path:
    """test_serve's artifact (served as "tiny"): a long cache, so that tiny prompts' continuations never end."""
    from llmc.driver import BackendOptions, compile_model
    from llmc.passes.pipeline import CompileOptions

    options = CompileOptions(prefill_chunk=16, max_seq=SERVED_SPEC.context_length, max_batch=SLOTS)
    return compile_model(str(tiny(SERVED_SPEC, "gguf")), tmp_path_factory.mktemp("serve") / "tiny.llmc", options,
                         BackendOptions(), progress=lambda _: None)


@pytest.fixture(scope="module")
def clients(served_artifact: Path):
    """{True: a client of a speculating server that verifies every draft (`EVERY_DRAFT`: its timed choice of
    when verifying pays is tested on fixed costs), False: of a plain one} (both greedy-identical by the bar)."""
    servers = {True: start_server(served_artifact, "--speculate", prelude=EVERY_DRAFT),
               False: start_server(served_artifact, "--no-speculate")}
    clients = {speculate: openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=60)
               for speculate, served in servers.items()}
    yield clients, servers
    for speculate, served in servers.items():
        clients[speculate].close()
        if served.process.poll() is None:
            served.stop()


def test_served_text_is_plain_decodes(clients) -> None:
    """Whole and streamed, alone and several at once (more than the slots), with stop strings and
    `max_tokens`: the same text, finish reason and usage; the speculating server reports accepted drafts."""
    clients, servers = clients
    cases = [(REPEATS, {"max_tokens": 40}), (LETTERS, {"max_tokens": 33}), (REPEATS, {"max_tokens": 1}),
             (REPEATS, {"max_tokens": 3}), (LETTERS, {"max_tokens": 30, "stop": ["pa"]}),
             (REPEATS, {"max_tokens": 30, "stop": [" the the the"]}), ("x y x y x", {"max_tokens": 17})]
    for prompt, options in cases:
        with_drafts, without = (complete(clients[s], prompt, **options) for s in (True, False))
        assert with_drafts[:2] == without[:2] and with_drafts[2].completion_tokens == without[2].completion_tokens
        assert stream(clients[True], prompt, **options) == stream(clients[False], prompt, **options)
    with ThreadPoolExecutor(len(cases)) as pool:
        together = list(pool.map(lambda case: complete(clients[True], case[0], **case[1])[:2], cases))
    assert together == [complete(clients[False], prompt, **options)[:2] for prompt, options in cases]
    health = servers[True].health()
    assert health["speculate"] and health["accepted_tokens"] > 0 and health["verify_calls"] > 0
    assert health["drafted_tokens"] >= health["accepted_tokens"]
    plain = servers[False].health()
    assert not plain["speculate"] and plain["verify_calls"] == plain["drafted_tokens"] == 0


# ------------------------------------------------------------------ the real model


@pytest.mark.real_model
def test_smollm2_copying_a_passage_accepts_drafts_and_keeps_its_text(smollm2_path, tmp_path, every_draft) -> None:
    """The real model copying a passage beside a request that does not: drafts accepted, several tokens a verify
    call, the texts plain decode's (every draft verified, `every_draft`: beside two busy processes the timed
    choice verified too few in 1 of 3 runs)."""
    from llmc.driver import BackendOptions, compile_model
    from llmc.passes.pipeline import CompileOptions
    from llmc.runtime.codec import TextCodec

    out = compile_model("smollm2-135m", tmp_path / "s.llmc", CompileOptions(max_seq=1024, max_batch=2),
                        BackendOptions(), progress=lambda _: None)
    session = Session(out)
    codec = TextCodec.from_artifact(session.manifest)
    passage = ("The river Wensum rises near the village of Whissonsett and flows east through Fakenham and "
               "Norwich, where it joins the river Yare. Its chalk bed makes it one of the purest lowland rivers "
               "in England, home to brown trout, otters and the rare white-clawed crayfish.")
    prompt = codec.encode(codec.render_chat([{"role": "user", "content": f"Repeat this text exactly:\n\n{passage}"}]))
    requests = [(prompt, 60), (codec.encode(codec.render_chat([{"role": "user", "content": "Write a poem."}])), 30)]
    plain, _ = _streams(session, requests, speculate=False, eos=codec.eos_id)
    speculated, engine = _streams(session, requests, speculate=True, eos=codec.eos_id)
    assert speculated == plain
    assert engine.accepted > 20 and engine.verify_calls < len(plain[0][0])
    session.close()
