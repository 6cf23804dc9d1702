"""Batched decode (`--max-batch`): the IR, the interpreters, the compiled kernels and the scheduler.

Every check compares a batch against the same sequences run one at a time: each row of a
batched `decode` must be what that sequence alone gives.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import pytest
from tiny_models import TinySpec

from llmc.cli import main
from llmc.driver import BackendOptions, run_phases, target_attr
from llmc.errors import LlmcError
from llmc.frontend import load_model
from llmc.ir import find_function, llm
from llmc.ir.interpreter import KVCache, forward_logits, run
from llmc.ir.text import parse_module, print_module
from llmc.ir.tgt_interpreter import KernelWeights, cache_for, run_entry
from llmc.passes.pipeline import CompileOptions
from llmc.runtime.batch import Engine, QueueFull, Request
from llmc.runtime.sampling import Sampler, SamplingOptions, TokenLogprob
from llmc.runtime.session import Conversation, Session

SPEC = TinySpec(context_length=64)
# a8 integer kernels (q8_0 and q4_1 weights), a head dimension of 32, GQA
QSPEC = TinySpec(hidden=64, heads=4, kv_heads=2, head_dim=32, ffn=128, context_length=64, gguf_storage=(
    ("token_embd", "q8_0"), *((k, "q4_1") for k in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                                      "ffn_up", "ffn_down"))))
PROMPTS = [[5, 17, 42], [100, 150, 7, 9, 11, 200, 3], [4], [66, 250, 31, 8, 19], [12, 13], [200, 201, 202, 203],
           [7, 7, 7, 7, 7, 7, 7, 7, 7], [90, 1]]


def into(tokens: list[int]) -> Callable[[int, TokenLogprob | None], None]:
    """A request's `emit` that appends each token to `tokens` (and drops its logprobs)."""
    return lambda token, logprob: tokens.append(token)


def _split(tiny, spec: TinySpec, phase: str = "split", **options):
    model = load_model(tiny(spec, "gguf"))
    module = run_phases(model, CompileOptions(max_seq=32, prefill_chunk=4, kv_type="f32", **options), phase,
                        None, lambda _: None, target_attr(BackendOptions()))
    return model, module


def test_batched_split_has_slots_everywhere_and_round_trips(tiny) -> None:
    for phase in ("split", "group", "lower"):
        _, module = _split(tiny, SPEC, phase, max_batch=4)
        text = print_module(module)
        assert print_module(parse_module(text)) == text
        decode = find_function(module, "decode")
        if phase == "lower":
            names = [a.name_hint for a in decode.body.block.args]
            assert names == ["tokens", "positions", "slots", "n", "k_cache", "v_cache", "logits"]
            assert decode.attributes["tgt.kv_layout"].data == "layer,slot,kv_head,position,dim"
            assert "slots %slots" in text and "memref<2x4x2x32x8xf32>" in text
        else:
            cache = decode.function_type.inputs.data[-1]
            assert isinstance(cache, llm.KVCacheType) and cache.slots == 4
            assert decode.attributes["llm.max_tokens"].value.data == 4
            assert "slots 4>" in text
            attentions = [op for op in decode.body.block.ops if isinstance(op, llm.AttentionOp)]
            assert attentions and all(op.slots is decode.body.block.args[2] for op in attentions)
    _, plain = _split(tiny, SPEC)
    assert "slots" not in print_module(plain)  # B = 1 keeps today's IR


def test_attention_without_slots_on_a_batched_cache_is_refused(tiny) -> None:
    _, module = _split(tiny, SPEC, max_batch=4)
    op = next(op for op in find_function(module, "decode").body.block.ops if isinstance(op, llm.AttentionOp))
    alone = llm.AttentionOp(op.query, op.key, op.value, op.positions, op.kv_cache, 0)
    with pytest.raises(Exception, match="several sequences needs each row's slot"):
        alone.verify()
    _, plain = _split(tiny, SPEC)
    op = next(op for op in find_function(plain, "decode").body.block.ops if isinstance(op, llm.AttentionOp))
    with pytest.raises(Exception, match="and only such a cache"):
        llm.AttentionOp(op.query, op.key, op.value, op.positions, op.kv_cache, 0, slots=op.positions).verify()


def _alone(model, module, prompt: list[int], steps: list[int]) -> list[np.ndarray]:
    """The logits of `prompt` then of each token of `steps`, one sequence (the `llm` interpreter)."""
    cache = KVCache.for_type(find_function(module, "forward").function_type.inputs.data[2], 32)
    out = [forward_logits(module, model.weights, prompt, cache=cache)[-1]]
    for i, token in enumerate(steps):
        out.append(forward_logits(module, model.weights, [token], start=len(prompt) + i, cache=cache)[-1])
    return out


def test_batched_decode_in_the_llm_and_tgt_interpreters_equals_each_sequence_alone(tiny) -> None:
    model, forward = _split(tiny, SPEC, "optimize")
    _, split = _split(tiny, SPEC, max_batch=4)
    _, lowered = _split(tiny, SPEC, "lower", max_batch=4)
    prompts = [PROMPTS[0], PROMPTS[2], PROMPTS[3][:4]]  # (one prefill chunk each)
    steps = [[9, 3], [1, 2], [250, 4]]
    reference = [_alone(model, forward, p, s) for p, s in zip(prompts, steps)]
    # llm: each prompt into its own slot (1, 3, 0), then two decode calls over the three rows
    slots = np.array([1, 3, 0], np.int32)
    cache = KVCache.for_type(find_function(split, "decode").function_type.inputs.data[-1])
    weights = KernelWeights(model.weights)
    tgt_cache = cache_for(find_function(lowered, "decode").body.block.args[4].type)
    for prompt, slot, ref in zip(prompts, slots, reference):
        positions = np.arange(len(prompt), dtype=np.int32)
        (got,) = run(find_function(split, "prefill"), model.weights, np.array(prompt, np.int32), positions,
                     np.full(len(prompt), slot, np.int32), cache)
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-5, atol=1e-5)
        got = run_entry(find_function(lowered, "prefill"), weights, np.array(prompt), positions, tgt_cache,
                        np.full(len(prompt), slot))
        np.testing.assert_allclose(got[0], ref[0], rtol=1e-4, atol=1e-4)
    for i in range(2):
        tokens = np.array([s[i] for s in steps], np.int32)
        positions = np.array([len(p) + i for p in prompts], np.int32)
        (got,) = run(find_function(split, "decode"), model.weights, tokens, positions, slots, cache)
        got_tgt = run_entry(find_function(lowered, "decode"), weights, tokens, positions, tgt_cache, slots)
        for row, ref in enumerate(reference):
            np.testing.assert_allclose(got[row], ref[i + 1], rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(got_tgt[row], ref[i + 1], rtol=1e-4, atol=1e-4)


def assert_rows_are_each_sequence_alone(batched: Conversation, alone: Conversation, prompts: list[list[int]]) -> None:
    """Prompts fed into scattered slots (prefill chunks and prefill_kv), then decode calls over all of them
    at once, against each sequence on its own in slot 0 of `alone` (the same artifact); then the prompts fed
    again as the engine feeds prompts that arrive together: all but their last tokens in `prefill_kv` calls of
    several sequences' runs (as many rows a call as it takes), their last tokens in a decode call. Other calls'
    rows sum in other orders, and an a8 activation can round to the next int8 step: 1e-4 of the largest logit
    there, 1e-5 elsewhere."""
    batch = batched.batch
    slots = np.random.default_rng(batch).permutation(batch)[: len(prompts)].astype(np.int32)
    reference = []
    for prompt in prompts:
        alone.reset()
        rows = [alone.feed(prompt)]
        for token in range(3):
            rows.append(alone.feed([10 + token]))
        reference.append(rows)
    for prompt, slot, rows in zip(prompts, slots, reference):
        batched.reset()
        batched.slot = int(slot)
        first = batched.feed(prompt)
        np.testing.assert_allclose(first, rows[0], rtol=0, atol=1e-5 * np.abs(rows[0]).max())
    logits = np.zeros((batch, batched.vocab_size), np.float32)
    n = len(prompts)
    for step in range(3):
        tokens = np.full(n, 10 + step, np.int32)
        positions = np.array([len(p) + step for p in prompts], np.int32)
        batched.run("decode", tokens, positions, slots, logits[:n])
        for row in range(n):
            expected = reference[row][step + 1]
            np.testing.assert_allclose(logits[row], expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    batched.reset()
    slots = np.roll(slots, 1)  # (each slot holds another prompt's rows now: none right before it is fed)
    runs = [(t, i, slot) for prompt, slot in zip(prompts, slots) for i, t in enumerate(prompt[:-1])]
    chunk = batched.manifest.entry_points["prefill_kv"]["max_tokens"]
    prompt_logits = np.zeros(batched.manifest.entry_points["prefill_kv"]["logits"], np.float32)
    for at in range(0, len(runs), chunk):
        tokens, positions, into = (np.array(column, np.int32) for column in zip(*runs[at : at + chunk]))
        batched.run("prefill_kv", tokens, positions, into, prompt_logits)
    for step in range(4):
        tokens = np.array([p[-1] for p in prompts] if step == 0 else [9 + step] * n, np.int32)
        batched.run("decode", tokens, np.array([len(p) - 1 + step for p in prompts], np.int32), slots, logits[:n])
        for row in range(n):
            expected = reference[row][step]
            np.testing.assert_allclose(logits[row], expected, rtol=0, atol=1e-4 * np.abs(expected).max())


@pytest.mark.parametrize("spec", [SPEC, QSPEC], ids=["f32", "a8"])
@pytest.mark.parametrize("batch", [4, 8])  # up to attention's 4 split rows, and past them
@pytest.mark.parametrize("threads", [1, 2])
def test_each_row_of_a_batched_decode_is_its_sequence_alone(artifact, spec: TinySpec, batch: int,
                                                            threads: int) -> None:
    batched = Session(artifact(spec, max_batch=batch), threads=threads)
    alone = Session(artifact(spec, max_batch=batch), threads=threads)
    assert_rows_are_each_sequence_alone(batched, alone, PROMPTS[:batch])
    rows = np.arange(batch, dtype=np.int32)
    for wrong in (np.zeros((batch - 1, batched.vocab_size), np.float32), np.zeros((batch, 7), np.float32),
                  np.zeros((batch, batched.vocab_size), np.float64),
                  np.zeros((batch, 2 * batched.vocab_size), np.float32)[:, ::2]):
        with pytest.raises(ValueError, match="logits need a C-contiguous float32 array"):
            batched.run("decode", rows, rows, rows, wrong)  # (nothing written through a buffer too small)
    batched.close()
    alone.close()


def test_decode_steps_after_other_jobs_and_into_other_arrays_give_the_same_logits(artifact) -> None:
    """`Session._call` writes an entry point's argument words only when another job's were the last, and takes a
    logits array's address once: steps after the read probe, into views at other addresses and into a new array
    give the logits of plain `feed` steps."""
    plain, mixed = Session(artifact(QSPEC)), Session(artifact(QSPEC))
    prompt = PROMPTS[0]
    expected = [plain.feed(prompt), *(plain.feed([10 + i]) for i in range(4))]
    got = [mixed.feed(prompt)]
    rows = np.zeros((2, mixed.vocab_size), np.float32)
    for i, logits in enumerate((rows[1:], rows[:1], rows[1:], np.zeros((1, mixed.vocab_size), np.float32))):
        if i == 2:
            mixed.read_weights()
        mixed.run("decode", np.array([10 + i], np.int32), np.array([len(prompt) + i], np.int32), np.zeros(1, np.int32),
                  logits)
        got.append(logits[0].copy())
    for a, b in zip(got, expected):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(got[1], got[2])
    plain.close()
    mixed.close()


def test_one_sequence_artifacts_keep_the_one_row_decode(artifact) -> None:
    session = Session(artifact(SPEC, max_batch=1))
    assert session.slot_count == 1 and session.batch == 1
    assert "slots" not in session.manifest.entry_points["decode"]["arguments"]
    assert session.manifest.kv_cache["shape"] == [2, 2, 32, 8]
    session.close()


def _alone_stream(session: Session, prompt: list[int], count: int, sampling: SamplingOptions = SamplingOptions()
                  ) -> list[int]:
    sampler = Sampler(sampling)
    session.reset()
    out = [sampler(session.feed(prompt))]
    while len(out) < count:
        out.append(sampler(session.feed([out[-1]])))
    return out


def test_the_engine_gives_every_request_its_text_alone(artifact) -> None:
    """More requests than slots: they wait, enter as slots free up (continuous batching), and each
    stream is what its prompt gives alone; fewer decode calls than tokens. Sampled with a seed per
    request (tiny random models repeat their last token greedily; sampling reads the whole
    distribution)."""
    session = Session(artifact(QSPEC, max_batch=4))
    sampling = [SamplingOptions(temperature=8.0, seed=i) for i in range(len(PROMPTS))]
    expected = [_alone_stream(session, p, 6, o) for p, o in zip(PROMPTS, sampling)]
    assert len({t for stream in expected for t in stream}) > 20
    engine = Engine(session, ())
    got: dict[int, list[int]] = {i: [] for i in range(len(PROMPTS))}
    reasons: dict[int, str] = {}
    for i, prompt in enumerate(PROMPTS):
        engine.submit(Request(prompt, 6, sampling[i], emit=into(got[i]),
                              finish=lambda r, i=i: reasons.__setitem__(i, r)))
    while engine.busy:
        engine.step()
    assert [got[i] for i in range(len(PROMPTS))] == expected
    assert set(reasons.values()) == {"length"}
    # every token after a stream's first came from a decode call, and some first ones too (prompts fed together
    # whose last token the step's decode fed)
    assert 5 * len(PROMPTS) < engine.decoded_rows < 6 * len(PROMPTS) and engine.steps < engine.decoded_rows / 2
    session.close()


def test_prompts_being_fed_take_turns_chunk_by_chunk(artifact) -> None:
    """A short prompt admitted behind a long one is fed at the next step, not after the long one's seven chunks
    (one client's long prompt does not hold up another's first token), in the call that feeds the long one's next
    chunk; each text stays what it is alone."""
    session = Session(artifact(QSPEC, max_batch=2))
    prompts = [[(7 * i) % 200 + 3 for i in range(28)], PROMPTS[1][:2]]
    expected = [_alone_stream(session, prompt, 3) for prompt in prompts]
    engine = Engine(session, ())
    got: list[list[int]] = [[], []]
    engine.submit(Request(prompts[0], 3, emit=into(got[0])))
    engine.step()  # the long prompt's first chunk of 4
    engine.submit(Request(prompts[1], 3, emit=into(got[1])))
    engine.step()
    # the short prompt came first in the call (its last token held back: the step's decode gave its first token),
    # then two rows of the long one, as far as the call's 4 rows reached
    assert got == [[], expected[1][:1]] and engine.prompt_tokens == 4 + 2 + 2
    while engine.busy:
        engine.step()
    assert got == expected
    session.close()


def test_prompts_arriving_together_are_fed_in_one_call_and_generate_together(artifact) -> None:
    """Four prompts submitted together: one `prefill_kv` call feeds them all (each its own slot's rows), the
    first decode call gives each its first token but the last in the call (whose logits the feeding call
    returned: its second), and from then on every decode call has all four rows; each text stays what its
    prompt gives alone."""
    session = Session(artifact(QSPEC, chunk=16, max_batch=4))
    prompts = PROMPTS[:4]  # 3 + 7 + 1 + 5 tokens: one call's 16 rows
    sampling = [SamplingOptions(temperature=8.0, seed=i) for i in range(len(prompts))]
    expected = [_alone_stream(session, p, 6, o) for p, o in zip(prompts, sampling)]
    engine = Engine(session, ())
    calls: list[tuple[str, int]] = []
    call = session.run
    session.run = lambda entry, tokens, *rest: (calls.append((entry, len(tokens))), call(entry, tokens, *rest))[1]
    got: list[list[int]] = [[] for _ in prompts]
    for prompt, options, out in zip(prompts, sampling, got):
        engine.submit(Request(prompt, 6, options, emit=into(out)))
    engine.step()
    assert calls == [("prefill_kv", 3 - 1 + 7 - 1 + 0 + 5), ("decode", 4)]
    assert [len(out) for out in got] == [1, 1, 1, 2]
    while engine.busy:
        engine.step()
    assert got == expected
    assert calls[2:] == [("decode", 4)] * 4 + [("decode", 3)]
    session.close()


def test_the_engine_ends_at_eos_capacity_and_cancel_and_refuses_beyond_its_queue(artifact) -> None:
    session = Session(artifact(QSPEC, max_batch=2))
    stream = _alone_stream(session, PROMPTS[4], 8)
    eos = next(t for t in stream if t != stream[0])
    engine = Engine(session, {eos}, queue_size=1)
    seen: list[int] = []
    reasons: list[str] = []
    engine.submit(Request(PROMPTS[4], 10, emit=into(seen), finish=reasons.append))
    while engine.busy:
        engine.step()
    assert seen == stream[: stream.index(eos)] and seen and reasons == ["stop"]  # EOS ends it, not emitted

    engine = Engine(session, (), queue_size=1, max_active=1)
    long = Request([1] * 30, 10, finish=reasons.append)
    engine.submit(long)
    engine.step()  # admitted: the queue is empty again
    engine.submit(Request([2], 1, finish=reasons.append))
    with pytest.raises(QueueFull, match="1 slots are busy"):
        engine.submit(Request([3], 1))
    while engine.busy:
        engine.step()
    assert reasons[1:] == ["length", "length"]  # 30 + 2 reach the capacity of 32; the queued one ran after

    cancelled = Request([4, 5], 20, finish=reasons.append)
    engine.submit(cancelled)
    engine.step()
    cancelled.cancel()
    engine.step()
    assert reasons[-1] == "cancelled" and not engine.busy and engine.free == [0]
    for bad, message in ((Request([], 1), "no tokens"), (Request([1] * 32, 1), "KV cache holds 32"),
                         (Request([1], 0), "max_tokens"), (Request([10 ** 6], 1), "vocabulary"),
                         (Request([1], 1, SamplingOptions(top_p=0)), "top-p")):
        with pytest.raises((ValueError, LlmcError), match=message):
            engine.submit(bad)
    with pytest.raises(LlmcError, match=r"--max-batch must be in 1..2"):
        Engine(session, (), max_active=3)
    session.close()


def test_the_engine_admits_free_slots_without_a_queue_and_isolates_failing_receivers(artifact) -> None:
    session = Session(artifact(SPEC, max_batch=2))
    engine = Engine(session, (), queue_size=0)
    reasons: dict[str, str] = {}
    got: list[int] = []

    def broken(token: int, logprob: None) -> None:
        raise RuntimeError("the client went away")

    engine.submit(Request([1, 2], 3, emit=broken, finish=lambda r: reasons.__setitem__("broken", r)))
    engine.submit(Request([3, 4], 3, emit=into(got), finish=lambda r: reasons.__setitem__("fine", r)))
    with pytest.raises(QueueFull):  # both slots taken, no queue
        engine.submit(Request([5], 1))
    while engine.busy:
        engine.step()
    assert reasons == {"broken": "error: the client went away", "fine": "length"} and len(got) == 3
    assert engine.stats() | {"decode_steps": 0, "decoded_tokens": 0} == {
        "slots": 2, "running": 0, "waiting": 0, "queue_size": 0, "decode_steps": 0, "decoded_tokens": 0,
        "prompt_tokens": 4, "reused_tokens": 0,
        "speculate": False, "verify_calls": 0, "drafted_tokens": 0, "accepted_tokens": 0}

    engine = Engine(session, (), queue_size=1, max_active=1)
    engine.submit(Request([1], 5))
    engine.step()
    waiting = Request([2], 1, finish=lambda r: reasons.__setitem__("waiting", r))
    engine.submit(waiting)
    waiting.cancel()  # a cancelled request gives up its place in the queue at once
    engine.submit(Request([3], 1))
    assert "waiting" not in reasons  # (told on the engine's thread, at its next step)
    engine.step()
    assert reasons["waiting"] == "cancelled" and engine.stats()["waiting"] == 1
    session.close()


def test_the_engine_thread_serves_requests_submitted_from_other_threads(artifact) -> None:
    session = Session(artifact(QSPEC, max_batch=4))
    expected = [_alone_stream(session, p, 5) for p in PROMPTS[:4]]
    engine = Engine(session, ())
    engine.start()
    results: dict[int, list[int]] = {}
    done = threading.Barrier(5)

    def client(i: int) -> None:
        tokens: list[int] = []
        finished = threading.Event()
        engine.submit(Request(PROMPTS[i], 5, emit=into(tokens), finish=lambda _: finished.set()))
        assert finished.wait(60)
        results[i] = tokens
        done.wait()

    for i in range(4):
        threading.Thread(target=client, args=(i,)).start()
    done.wait(60)
    engine.close()
    assert [results[i] for i in range(4)] == expected
    session.close()


def test_max_batch_errors_are_one_line(tiny, capsys) -> None:
    model = str(tiny(SPEC, "gguf"))
    with pytest.raises(SystemExit) as exit_:
        main(["compile", model, "--max-batch", "0", "-o", "/tmp/never"])
    assert exit_.value.code == 2
    assert main(["compile", model, "--max-batch", "65", "--compile-to", "split"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert not any(line.startswith("import") for line in err)  # refused before the model loads
    assert any("--max-batch: must be a positive integer, got 0" in line for line in err)
    assert any("--max-batch must be in 1..64, got 65" in line for line in err)
