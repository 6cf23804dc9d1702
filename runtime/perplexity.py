"""Perplexity and KL divergence of an artifact on a text, by llama.cpp's method.

The text (one trailing newline dropped, as `llama-perplexity -f` does) is tokenized
whole and cut into chunks of `ctx` tokens; each chunk runs from an empty cache (its
first token replaced by BOS when the model adds one), and the second half of each
chunk is scored: the logits at positions `ctx/2 … ctx-2` predict the next token. The
estimate is `exp(mean NLL)` with the standard error of the mean NLL, times the
perplexity. With a base session, the same positions give the mean KL divergence
`KL(base ‖ this)`, the share of positions whose top token agrees, and both perplexities.

    chunks = chunk_tokens(codec.encode(text), 512, None, codec.bos_id, codec.add_bos)
    print(perplexity(session, chunks, base=None, progress=print).report())
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from llmc.errors import LlmcError
from llmc.runtime.session import Session


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Log-probabilities of each row's next-token distribution, in float64."""
    x = logits.astype(np.float64)
    x = x - x.max(axis=-1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_divergence(p_log: np.ndarray, q_log: np.ndarray) -> np.ndarray:
    """KL(p ‖ q) per row, from log-probabilities (nats)."""
    return np.sum(np.exp(p_log) * (p_log - q_log), axis=-1)


def _mean_and_error(values: np.ndarray) -> tuple[float, float]:
    mean = float(values.mean())
    spread = float(values.var()) if values.size > 1 else 0.0
    return mean, math.sqrt(spread / (values.size - 1)) if values.size > 1 else 0.0


@dataclass
class Perplexity:
    """The scored positions of a run: NLL per position, and against a base, KL and top-1 agreement."""

    ctx: int
    chunks: int = 0
    nll: list[np.ndarray] = field(default_factory=list)
    base_nll: list[np.ndarray] = field(default_factory=list)
    kl: list[np.ndarray] = field(default_factory=list)
    same_top: list[np.ndarray] = field(default_factory=list)

    @property
    def count(self) -> int:
        return sum(a.size for a in self.nll)

    def estimate(self, nll: list[np.ndarray] | None = None) -> tuple[float, float]:
        """Perplexity and its uncertainty (perplexity × standard error of the mean NLL)."""
        mean, error = _mean_and_error(np.concatenate(nll if nll is not None else self.nll))
        ppl = math.exp(mean)
        return ppl, ppl * error

    def report(self) -> str:
        ppl, error = self.estimate()
        lines = [f"perplexity {ppl:.4f} ± {error:.4f}  ({self.count} tokens scored: {self.chunks} chunks of "
                 f"{self.ctx}, second halves)"]
        if self.kl:
            base, base_error = self.estimate(self.base_nll)
            kl, kl_error = _mean_and_error(np.concatenate(self.kl))
            same = np.concatenate(self.same_top)
            p = float(same.mean())
            lines += [
                f"base       {base:.4f} ± {base_error:.4f}  (ratio {ppl / base:.4f})",
                f"mean KL    {kl:.6f} ± {kl_error:.6f}",
                f"same top   {100 * p:.3f} ± {100 * math.sqrt(p * (1 - p) / max(same.size - 1, 1)):.3f} %",
            ]
        return "\n".join(lines)


def chunk_tokens(tokens: list[int], ctx: int, chunks: int | None, bos_id: int | None, add_bos: bool) -> list[np.ndarray]:
    """The chunks llama.cpp scores: `len // ctx` of them (at most `chunks`), BOS first when the model adds one."""
    if ctx < 4:
        raise LlmcError(f"--ctx must be at least 4, got {ctx}")
    if len(tokens) < 2 * ctx:
        raise LlmcError(f"the text has {len(tokens)} tokens; perplexity at --ctx {ctx} needs at least {2 * ctx}")
    count = len(tokens) // ctx if chunks is None else min(chunks, len(tokens) // ctx)
    out = []
    for i in range(count):
        chunk = np.asarray(tokens[i * ctx : (i + 1) * ctx], np.int32)
        if add_bos and bos_id is not None:
            chunk = chunk.copy()
            chunk[0] = bos_id
        out.append(chunk)
    return out


def _scored(session: Session, chunk: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Log-probabilities of the scored positions of a chunk, and the token each predicts."""
    session.reset()
    logits = session.score(chunk)
    first = chunk.size // 2
    return log_softmax(logits[first:-1]), chunk[first + 1 :]


def perplexity(session: Session, chunks: list[np.ndarray], base: Session | None = None,
               progress: Callable[[str], None] | None = None) -> Perplexity:
    """Score every chunk with `session` (and `base`), reporting the running estimate."""
    ctx = chunks[0].size
    for s in (session, base):
        if s is not None and s.capacity < ctx:
            raise LlmcError(f"the artifact's KV cache holds {s.capacity} tokens; --ctx {ctx} needs at least {ctx} "
                            f"(compile with --max-seq {ctx})")
    result = Perplexity(ctx)
    for i, chunk in enumerate(chunks, 1):
        logp, targets = _scored(session, chunk)
        rows = np.arange(targets.size)
        result.nll.append(-logp[rows, targets])
        if base is not None:
            base_logp, _ = _scored(base, chunk)
            result.base_nll.append(-base_logp[rows, targets])
            result.kl.append(kl_divergence(base_logp, logp))
            result.same_top.append(logp.argmax(-1) == base_logp.argmax(-1))
        result.chunks = i
        if progress is not None:
            ppl, _ = result.estimate()
            extra = f", mean KL {np.concatenate(result.kl).mean():.5f}" if base is not None else ""
            progress(f"[{i}/{len(chunks)}] perplexity {ppl:.4f}{extra}")
    return result
