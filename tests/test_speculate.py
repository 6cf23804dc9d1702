"""Speculative decoding (`llmc.runtime.speculate`): the drafters, greedy text identical to plain decode
(tiny models and SmolLM2), sampled tokens keeping the target distribution, a draft artifact."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
from tiny_models import TinySpec

from llmc.errors import LlmcError
from llmc.runtime import speculate
from llmc.runtime.chat import Chat
from llmc.runtime.codec import TextCodec
from llmc.runtime.generate import generate
from llmc.runtime.sampling import Sampler, SamplingOptions
from llmc.runtime.session import Session
from llmc.runtime.speculate import (
    Acceptance,
    CallCost,
    DraftLength,
    DraftModel,
    PromptLookup,
    Speculation,
    step,
    worth_verifying,
)

TARGET = TinySpec(context_length=64, tied=False)  # (untied: random weights then say varied text, not one token)
OTHER = TinySpec(context_length=64, tied=False, layers=1, seed=3)  # the same vocabulary, other weights
GREEDY = SamplingOptions()


@pytest.fixture(autouse=True)
def _verify_every_draft(every_draft) -> None:
    """Each test here but those of `worth_verifying` itself, which call it directly: every draft verified."""


def _session(artifact, spec: TinySpec = TARGET, **options) -> Session:
    return Session(artifact(spec, chunk=8, max_seq=64, **options), threads=1)


def test_prompt_lookup_drafts_what_followed_the_last_ngram() -> None:
    lookup = PromptLookup(max_ngram=3, min_ngram=1)
    lookup.start([1, 2, 3, 4, 5, 9, 2, 3])
    assert lookup.draft(2) == [4, 5]  # "2 3" was followed by "4 5"
    lookup.extend([7])
    assert lookup.draft(4) == []  # 7 is new
    lookup.extend([1, 2])
    assert lookup.draft(4) == [3, 4, 5, 9]  # "1 2" (the longest match) was followed by "3 4 5 9"
    assert PromptLookup().draft(3) == []


def test_prompt_lookup_prefers_the_longest_and_latest_match() -> None:
    lookup = PromptLookup(max_ngram=2, min_ngram=1)
    lookup.start([5, 1, 6, 8, 1, 7, 5, 1])
    assert lookup.draft(1) == [6]  # "5 1" → 6, though the latest "1" was followed by 7
    lookup.start([1, 6, 1, 7, 1])
    assert lookup.draft(1) == [7]


def test_prompt_lookup_updates_in_constant_work_per_token() -> None:
    class Counting(dict):
        writes = 0

        def __setitem__(self, key, value) -> None:
            Counting.writes += 1
            super().__setitem__(key, value)

    lookup = PromptLookup(max_ngram=4, min_ngram=2)
    lookup.start(list(range(1000)) * 5)
    lookup.index = Counting(lookup.index)
    lookup.extend(list(range(100)))
    assert Counting.writes == 100 * 3  # one write per n-gram length, not a rescan of the 5000 tokens before


def test_draft_length_backs_off_to_plain_decode_and_probes_again() -> None:
    length = DraftLength(8)
    assert length.next() == 8
    for _ in range(4):
        length.update(length.next(), 0)
    assert [length.next() for _ in range(5)] == [0, 0, 0, 0, 1]  # a pause of 4 plain steps, then a probe
    length.update(1, 1)
    assert length.next() == 2
    length.update(2, 1)  # half accepted: the length stays
    assert length.next() == 2


class _Costs(CallCost):
    """Calls whose seconds are `seconds(rows)`, whatever the calls timed (`record` keeps nothing)."""

    def __init__(self, seconds):
        super().__init__()
        self.seconds_of = seconds

    def record(self, rows: int, seconds: float) -> None:
        pass

    def __call__(self, rows: int) -> float:
        return self.seconds_of(rows)


def test_worth_verifying_follows_what_rows_cost_and_how_often_drafts_are_taken() -> None:
    """Where a call's rows cost nothing more, every draft; where each row costs a one-row call, none, however
    likely; between (an AMX Xeon's 2 vCPUs and SmolLM2: 9 rows 4.8 one-row calls), none before drafts have been
    taken, all 8 once they all are, fewer after a draft mostly rejected, and fewer with each one wholly rejected,
    to none. A draft left unverified makes the next likelier (`hope`)."""
    likely, fresh = Acceptance(), Acceptance()
    for _ in range(5):
        likely.record(8, 8)
    assert likely.rate > 0.95 and fresh.rate == 0.5
    flat, per_row, xeon = _Costs(lambda rows: 1.0), _Costs(lambda rows: float(rows)), CallCost()
    xeon.record(1, 2.03)
    xeon.record(9, 9.78)
    assert worth_verifying(fresh, flat, 8) == worth_verifying(likely, flat, 8) == 8
    assert worth_verifying(fresh, per_row, 8) == worth_verifying(likely, per_row, 8) == 0
    assert worth_verifying(fresh, xeon, 8) == 0 and worth_verifying(likely, xeon, 8) == 8
    likely.record(8, 2)
    lengths = [worth_verifying(likely, xeon, 8)]
    for _ in range(5):
        likely.record(8, 0)
        lengths.append(worth_verifying(likely, xeon, 8))
    assert 0 < lengths[0] < 8 and lengths == sorted(lengths, reverse=True) and lengths[-1] == 0
    before = fresh.rate
    fresh.hope()
    assert fresh.rate > before


def test_single_stream_speculation_verifies_only_what_pays(artifact, monkeypatch) -> None:
    """Through `step` (`llmc run`'s path): with rows that each cost a one-row call, the drafts of a text that
    repeats itself are never verified (plain decode steps, the same text); with rows that cost nothing more,
    they are."""
    monkeypatch.setattr(speculate, "worth_verifying", worth_verifying)  # (the module's `every_draft` undone)
    session = _session(artifact)
    codec = TextCodec.from_artifact(session.manifest)
    prompt = codec.encode("one two three one two three one two")
    for cost, verified in ((_Costs(lambda rows: float(rows)), False), (_Costs(lambda rows: 1.0), True)):
        speculation = Speculation(PromptLookup(min_ngram=1), cost=cost)
        plain, fast = _plain_and_speculative(session, codec, prompt, 40, speculation)
        stats = speculation.stats
        assert fast == plain and (stats.verify_calls > 0) == verified and (stats.accepted > 0) == verified
        assert stats.accepted + stats.verify_calls + stats.decode_calls == len(plain) - 1


def _plain_and_speculative(session, codec, prompt: list[int], n: int, speculation: Speculation):
    session.reset()  # (each from an empty cache: `generate` would take the prompt from the cache otherwise)
    plain = list(generate(session, codec, prompt, n, GREEDY))
    session.reset()
    fast = list(generate(session, codec, prompt, n, GREEDY, speculation))
    return plain, fast


@pytest.mark.parametrize("n", [0, 1, 2, 5, 100])
def test_greedy_prompt_lookup_gives_the_plain_tokens(artifact, n) -> None:
    session = _session(artifact)
    codec = TextCodec.from_artifact(session.manifest)
    for text in ("one two three one two three one two", "hello world, hello world, hello", "abc"):
        speculation = Speculation(PromptLookup(min_ngram=1))
        plain, fast = _plain_and_speculative(session, codec, codec.encode(text), n, speculation)
        assert fast == plain
    if n == 100:  # up to the cache's capacity: the random model repeats itself, and the drafts are taken
        assert speculation.stats.accepted > 0 and speculation.stats.verify_calls > 0


class _Oracle:
    """A drafter that knows the text (`truth`, the prompt and the plain tokens) and drafts it, except that
    every `wrong`-th drafted token is off by one."""

    def __init__(self, truth: list[int], wrong: int):
        self.truth, self.wrong, self.seen = truth, wrong, 0

    def start(self, tokens: list[int]) -> None:
        self.seen = len(tokens)

    def extend(self, tokens: list[int]) -> None:
        self.seen += len(tokens)

    def draft(self, k: int) -> list[int]:
        drafts = self.truth[self.seen : self.seen + k]
        return [t + 1 if (self.seen + i) % self.wrong == 0 else t for i, t in enumerate(drafts)]


@pytest.mark.parametrize("n", [1, 3, 20, 100])
@pytest.mark.parametrize("wrong", [2, 5, 1000])
def test_greedy_accepts_up_to_the_first_wrong_draft(artifact, n, wrong) -> None:
    session = _session(artifact)
    codec = TextCodec.from_artifact(session.manifest)
    prompt = codec.encode("the quick brown fox jumps over the lazy dog")
    plain = list(generate(session, codec, prompt, n, GREEDY))
    speculation = Speculation(_Oracle(prompt + plain, wrong))
    session.reset()  # (the whole prompt fed by the first call, as the count below says)
    assert list(generate(session, codec, prompt, n, GREEDY, speculation)) == plain
    stats = speculation.stats
    assert len(set(plain)) > min(n, 10) // 2
    assert stats.accepted + stats.verify_calls + stats.decode_calls == len(plain) - 1  # one token per call, + accepted
    if wrong == 1000 and n > 1:
        assert stats.acceptance == 1


def test_greedy_through_the_verify_entry_and_the_score_fallback(artifact) -> None:
    session = _session(artifact)
    assert session.max_verify >= 2
    codec = TextCodec.from_artifact(session.manifest)
    prompt = codec.encode("the cat sat on the mat, the cat sat on the mat, the cat")
    speculation = Speculation(PromptLookup(min_ngram=1), most=3)
    plain, fast = _plain_and_speculative(session, codec, prompt, 40, speculation)
    assert fast == plain and speculation.stats.drafted <= 2 * speculation.stats.verify_calls


def test_chat_speculates_the_same_replies(artifact) -> None:
    session = _session(artifact)
    codec = TextCodec.from_artifact(session.manifest)
    replies = []
    for speculation in (None, Speculation(PromptLookup(min_ngram=1))):
        chat = Chat(session, codec, "be brief", GREEDY, 10, speculation=speculation)
        replies.append([(chat.reply(text, lambda s: None), chat.messages[-1]) for text in ("hi there", "again")])
    assert [m for _, m in replies[0]] == [m for _, m in replies[1]]
    assert [(t.generated, t.reason) for t, _ in replies[0]] == [(t.generated, t.reason) for t, _ in replies[1]]


class _Fixed:
    """A drafter that always proposes `tokens`."""

    def __init__(self, tokens: list[int]):
        self.tokens = tokens

    def start(self, tokens: list[int]) -> None:
        pass

    def extend(self, tokens: list[int]) -> None:
        pass

    def draft(self, k: int) -> list[int]:
        return self.tokens[:k]


def _sampled_pairs(session, prompt: list[int], last: int, drafts: list[int], options: SamplingOptions,
                   runs: int) -> dict[tuple[int, int | None], int]:
    """How often speculation gives each (first token, second token where the first was drafts[0])."""
    counts: dict[tuple[int, int | None], int] = {}
    for seed in range(runs):
        session.reset()
        session.feed(prompt)
        speculation = Speculation(_Fixed(drafts), most=len(drafts) + 1)
        speculation.start(session, prompt)
        produced = step(session, Sampler(SamplingOptions(**{**options.__dict__, "seed": seed})), [last],
                        len(drafts) + 1, speculation)
        key = (produced[0], produced[1] if produced[0] == drafts[0] else None)
        counts[key] = counts.get(key, 0) + 1
    return counts


def _target_pairs(session, prompt: list[int], last: int, first_draft: int, options: SamplingOptions) -> dict:
    """The exact probabilities of `_sampled_pairs`'s outcomes under the model (plain sampling; the second
    token's penalties count the first)."""
    session.reset()
    ids, probs = Sampler(options).distribution(session.feed([*prompt, last]))
    exact = {(int(t), None): float(p) for t, p in zip(ids, probs) if t != first_draft}
    second = Sampler(options)
    second.take([first_draft])
    after_ids, after = second.distribution(session.feed([first_draft]))
    p_first = float(probs[ids == first_draft].sum())
    exact.update({(first_draft, int(t)): p_first * float(p) for t, p in zip(after_ids, after)})
    return exact


@pytest.mark.parametrize("penalized", [False, True])
def test_sampled_speculation_keeps_the_target_distribution(artifact, monkeypatch, penalized) -> None:
    session = _session(artifact)
    codec = TextCodec.from_artifact(session.manifest)
    prompt, last = codec.encode("one two three"), codec.encode(" four")[-1]
    options = SamplingOptions(temperature=1.5, top_k=4)
    session.feed([*prompt, last])
    ids, probs = Sampler(options).distribution(session.logits[0])
    first = int(ids[1])  # a likely draft that is not the only choice
    if penalized:  # the draft likelier at both rows, less so at the second once the penalty counts it
        options = replace(options, frequency_penalty=2.0, logit_bias=((first, 3.0),))
    session.reset()
    session.feed([*prompt, last, first])
    after_first = Sampler(options)
    after_first.take([first])
    second = int(after_first.distribution(session.logits[0])[0][0])
    exact = _target_pairs(session, prompt, last, first, options)
    runs = 3000

    def distance(counts: dict) -> float:
        keys = set(counts) | set(exact)
        return 0.5 * sum(abs(counts.get(k, 0) / runs - exact.get(k, 0.0)) for k in keys)

    tv = distance(_sampled_pairs(session, prompt, last, [first, second], options, runs))
    assert tv < 0.05, f"total variation {tv:.3f} from the target distribution"

    # a wrong rule (always take the draft) is caught by the same bound
    monkeypatch.setattr(speculate, "accept", lambda sampler, rows, drafts: (len(drafts), sampler(rows[-1])))
    wrong = distance(_sampled_pairs(session, prompt, last, [first, second], options, runs))
    assert wrong > 0.2, f"always accepting is only {wrong:.3f} from the target distribution"
    print(f"total variation from the target distribution: {tv:.3f}; always accepting: {wrong:.3f}")  # with -s


def test_draft_model_gives_the_plain_tokens(artifact) -> None:
    session = _session(artifact)
    codec = TextCodec.from_artifact(session.manifest)
    prompt = codec.encode("the quick brown fox jumps over the lazy dog")
    for spec, least in ((TARGET, 1.0), (OTHER, 0.0)):
        draft = DraftModel(_session(artifact, spec), session)
        speculation = Speculation(draft)
        plain, fast = _plain_and_speculative(session, codec, prompt, 40, speculation)
        assert fast == plain and len(set(plain)) > 3
        stats = speculation.stats
        print(f"draft {spec.layers} layer(s), seed {spec.seed}: {stats.line()}")  # the acceptance, with -s
        assert stats.verify_calls > 0 and stats.acceptance >= least


def test_the_first_token_comes_before_any_draft(artifact) -> None:
    """The prompt's step drafts nothing, even where the cache holds all but the prompt's last token (one token to
    feed, as a decode step's): its token is out as soon as it exists, and the time after it (`llmc bench
    --speculate`'s decode, `llmc run`'s rate) is the generation's (was: held until the first verify ended, and
    the tokens of that verify counted as made in no time)."""
    session = _session(artifact)
    codec = TextCodec.from_artifact(session.manifest)
    prompt = codec.encode("the quick brown fox jumps over the lazy dog")
    plain = list(generate(session, codec, prompt, 12, SamplingOptions()))  # (the prompt in the cache now)
    speculation = Speculation(DraftModel(_session(artifact), session))
    tokens = iter(generate(session, codec, prompt, 12, SamplingOptions(), speculation))
    first = next(tokens)
    assert speculation.stats.verify_calls == 0 and session.position == len(prompt)
    assert [first, *tokens] == plain and speculation.stats.verify_calls > 0


def test_draft_model_refuses_another_vocabulary(artifact, monkeypatch) -> None:
    session = _session(artifact)
    other = _session(artifact, OTHER)
    monkeypatch.setattr(other, "vocab_size", session.vocab_size + 1)
    with pytest.raises(LlmcError, match="cannot draft for this model: a vocabulary of"):
        DraftModel(other, session, "draft")


def test_llmc_run_speculates_and_reports_acceptance(artifact, capsys) -> None:
    from llmc.cli import main

    directory = artifact(TARGET, chunk=8, max_seq=64)
    outputs = []
    for flags in ([], ["--no-speculate"], ["--draft", str(directory)]):
        assert main(["run", str(directory), "-p", "one two three one two three", "-n", "20", *flags]) == 0
        outputs.append(capsys.readouterr())
    assert outputs[0].out == outputs[1].out == outputs[2].out
    assert re.search(r"; (\d+ of \d+ drafted tokens accepted|nothing drafted)\]", outputs[0].err), outputs[0].err
    assert "drafted" not in outputs[1].err
    assert "20 of 20 drafted tokens accepted" in outputs[2].err or "(100%)" in outputs[2].err
    assert main(["run", str(directory), "-p", "one two three", "-n", "1"]) == 0  # (no call after the prompt's)
    assert capsys.readouterr().err.rstrip().endswith("; nothing drafted]")
    assert main(["run", str(directory), "-p", "hi", "--draft", str(directory), "--no-speculate"]) != 0
    assert "--draft is for speculative decoding" in capsys.readouterr().err
    plain = artifact(TARGET, chunk=8, max_seq=64, speculate=0)  # (no verify entry: prompt lookup is not used)
    for flags, noted in (([], False), (["--speculate"], True)):  # (asked for: said why it is not)
        assert main(["run", str(plain), "-p", "one two three", "-n", "3", *flags]) == 0
        err = capsys.readouterr().err
        assert ("has no verify entry point" in err) == noted and "drafted" not in err, err


def test_llmc_bench_speculate_compares_with_plain_decode(artifact, capsys) -> None:
    from llmc.cli import main

    directory = artifact(TinySpec(context_length=2048, tied=False), chunk=64, max_seq=2048)
    assert main(["bench", str(directory), "--speculate", "--decode-tokens", "6", "--repeat", "1"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| input") or
            line.startswith("| open")]
    assert len(rows) == 2 and all(row.endswith("| identical |") for row in rows)


@pytest.mark.real_model
def test_smollm2_greedy_speculation_is_plain_decode(smollm2_path, tmp_path) -> None:
    from llmc.driver import BackendOptions, compile_model
    from llmc.passes.pipeline import CompileOptions

    directory = compile_model("smollm2-135m", tmp_path / "s", CompileOptions(max_seq=512), BackendOptions(),
                              progress=lambda _: None)
    session = Session(directory)
    codec = TextCodec.from_artifact(session.manifest)
    passage = ("def area(width, height):\n    return width * height\n\n"
               "def perimeter(width, height):\n    return 2 * (width + height)\n")
    prompt = codec.encode(codec.chat(f"Add a docstring to each function in this code:\n\n{passage}"))
    speculation = Speculation(PromptLookup())
    plain, fast = _plain_and_speculative(session, codec, prompt, 80, speculation)
    assert fast == plain
    assert speculation.stats.acceptance > 0.5, speculation.stats.line()
    assert speculation.stats.tokens_per_call > 2  # (measured: 5.2, the code copied back)
