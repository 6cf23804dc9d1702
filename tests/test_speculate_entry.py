"""The runtime's speculation API on tiny artifacts: `verify` (drafted tokens checked in one call), `rewind`
(rejected rows dropped by position) and `max_verify`, through the compiled `verify` entry point or, on an
artifact without one, `score`; the CUDA entry point on the emulator."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import test_cuda
from tiny_models import TinySpec

from llmc.cli import main
from llmc.runtime.artifact import load_manifest
from llmc.runtime.cuda import CudaSession
from llmc.runtime.session import Session, TokenError

SPEC = TinySpec(context_length=64)
PROMPT = [5, 17, 42, 100, 150, 7]
DRAFT = [9, 11, 200, 3]
cuda_artifact = test_cuda.cuda_artifact  # the fixture: CUDA artifacts and the emulator running them


def _close(actual: np.ndarray, expected: np.ndarray) -> None:
    assert np.abs(actual - expected).max() <= 1e-4 * np.abs(expected).max()
    assert (actual.argmax(-1) == expected.argmax(-1)).all()


@pytest.fixture(params=[0, 4], ids=["score-fallback", "verify-entry"])
def session(request, artifact) -> Session:
    """A session on an artifact with `--speculate 0` (no `verify`: `score` stands in) or `--speculate 4`."""
    return Session(artifact(SPEC, chunk=8, speculate=request.param))


def test_verify_returns_what_score_returns(artifact, session: Session) -> None:
    scorer = Session(artifact(SPEC, chunk=8, speculate=0))
    for s in (session, scorer):
        s.feed(PROMPT)
    _close(session.verify(DRAFT), scorer.score(DRAFT))
    assert session.position == scorer.position == len(PROMPT) + len(DRAFT)


def test_rewind_then_refeed_forgets_the_rejected_rows(session: Session) -> None:
    """Rows past the rewound position stay in the cache but are never read: the next call overwrites them,
    and its logits are those of a conversation whose rejected drafts were other tokens."""
    other = Session(session.manifest.directory)
    for s, rejected in ((session, DRAFT[2:]), (other, [250, 251])):
        s.feed(PROMPT)
        s.verify(DRAFT[:2] + rejected)
        s.rewind(len(PROMPT) + 2)  # two drafts accepted
    again = session.verify([77, 78])
    np.testing.assert_array_equal(again, other.verify([77, 78]))
    never = Session(session.manifest.directory)
    never.feed(PROMPT + DRAFT[:2])
    _close(again, never.verify([77, 78]))
    with pytest.raises(ValueError, match="cannot rewind"):
        session.rewind(session.position + 1)


def test_verify_in_a_slot_of_a_batched_cache(artifact) -> None:
    """`--max-batch 2`: `@verify` takes the rows' slot; its rows in slot 1 see only that sequence's cache."""
    batched = Session(artifact(SPEC, chunk=8, speculate=4, max_batch=2))
    assert "slots" in batched.manifest.entry_points["verify"]["arguments"]
    batched.feed([250, 251, 252])  # another sequence in slot 0
    batched.rewind(0)
    batched.slot = 1
    alone = Session(artifact(SPEC, chunk=8, speculate=4))
    for s in (batched, alone):
        s.feed(PROMPT)
    _close(batched.verify(DRAFT), alone.verify(DRAFT))


def test_max_verify_is_the_entry_points_rows(session: Session) -> None:
    """`--speculate K`: the last accepted token and K drafts; without `verify`, score's chunk."""
    want = 5 if "verify" in session.manifest.entry_points else 8
    assert session.max_verify == want
    session.feed(PROMPT)
    with pytest.raises(TokenError, match="to verify"):
        session.verify(list(range(1, want + 2)))


def test_emulated_cuda_verify_returns_what_score_returns(cuda_artifact) -> None:
    """The CUDA `verify` launch plan (GEMVs: 5 rows, under the tensor cores' 16) on the emulator, against
    the same artifact's `score` on the same rows after the same prompt."""
    directory, device = cuda_artifact(SPEC, chunk=8, speculate=4)
    manifest = load_manifest(directory)
    assert manifest.entry_points["verify"]["max_tokens"] == 5
    verifier, scorer = (CudaSession(manifest, device=device) for _ in range(2))
    for s in (verifier, scorer):
        s.feed(PROMPT)
    _close(verifier.verify([*DRAFT, 1]), scorer.score([*DRAFT, 1]))
    verifier.rewind(len(PROMPT) + 1)
    scorer.rewind(len(PROMPT) + 1)
    _close(verifier.verify(DRAFT[1:]), scorer.score(DRAFT[1:]))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: m["entry_points"]["verify"]["logits"].__setitem__(0, 1), "writes logits"),
    (lambda m: m["entry_points"].__setitem__("draft", m["entry_points"]["verify"]), "entry points"),
], ids=["verify-logits-rows", "unknown-entry"])
def test_malformed_verify_entry_is_refused(artifact, tmp_path, capsys, edit, message: str) -> None:
    copy = tmp_path / "copy"
    shutil.copytree(artifact(SPEC, chunk=8, speculate=4), copy)
    manifest = json.loads((copy / "manifest.json").read_text())
    edit(manifest)
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert main(["run", str(copy), "-p", "x"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_bad_speculate_is_one_line(tiny, tmp_path, capsys) -> None:
    assert main(["compile", str(tiny(SPEC, "gguf")), "-o", str(tmp_path / "a"), "--speculate", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--speculate must be in 0..63" in err
