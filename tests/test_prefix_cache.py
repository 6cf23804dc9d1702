"""Prefix caching and the context limit: a session's `cached` tokens and `reuse`, `limit_context`, and the
batching engine reusing what a free slot's cache holds (llama-server's cache_prompt).

The bar is a fresh start's result: every greedy stream that reuses a cached prefix must be, token for token,
what the same request gives on an empty cache, and its logits the same within float error.
"""

from __future__ import annotations

import numpy as np
import pytest
import test_cuda
from test_batch import QSPEC, SPEC

from llmc.errors import LlmcError
from llmc.runtime.artifact import load_manifest
from llmc.runtime.cuda import CudaSession
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
