"""A loaded artifact ready to run: weights read in, kernels loaded, KV cache and arena allocated once.

`Session.feed(tokens)` runs a prompt through `prefill` (first chunk of an empty cache)
and `prefill_kv` (every later chunk), or one token through `decode`, and returns the
logits of the last token; `Session.score(tokens)` runs them through `score` and returns
every row's logits (perplexity, KL divergence); `Session.verify(tokens)` checks drafted
tokens in one call (speculative decoding) and `Session.rewind(position)` drops the rejected
ones. `Session.cached` lists the tokens the cache holds, and `Session.reuse(ids)` keeps the
longest prefix of them that a new prompt shares, so that only the rest is fed. Each chunk
or token is one native call into `kernels.so` per thread: the threads start once, enter the
entry point together, and synchronise inside native code.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from llmc.abi import (
    ARGMAX,
    KV_DTYPES,
    READ_PROBE_ARGUMENTS,
    READ_PROBE_STEP,
    SYNC_WORDS,
    TEAM_ARGMAX_OUT,
    TEAM_ARGMAX_ROWS,
    TEAM_ARGS,
    TEAM_LOGIT_COUNT,
    TEAM_LOGITS,
    TEAM_RUN,
    TEAM_STOP,
    TEAM_THREADS,
    TEAM_WEIGH_GROUPS,
    TEAM_WEIGH_OUT,
    TEAM_WEIGH_ROWS,
    TEAM_WEIGH_SCALES,
    TEAM_WEIGH_TOKENS,
    TEAM_WEIGH_UNIFORMS,
    TEAM_WORDS,
    TEAM_WORK,
    WEIGH,
    WEIGH_BLOCK,
    WEIGH_GROUP,
)
from llmc.errors import LlmcError
from llmc.runtime import amx
from llmc.runtime.artifact import (
    ArtifactError,
    Manifest,
    check_description,
    check_sha256,
    library_description,
    load_manifest,
    load_verified_library,
    missing_cpu_features,
)

if TYPE_CHECKING:
    from llmc.runtime.sampling import Sampler


def default_threads() -> int:
    """The CPUs this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class _Team:
    """`count` threads that run the library's jobs together (`llmc.abi`'s thread team): the calling
    thread is thread 0, the workers stay inside `llmc_team_work` between calls (spinning for a
    while, then asleep), so a call is one native call with no Python in between. `close()`, or the
    team's garbage collection, stops the workers; until then the team's words stay allocated, since
    the workers watch them."""

    def __init__(self, library: ctypes.CDLL, jobs: list[str], count: int):
        self.jobs = {name: index for index, name in enumerate(jobs)}
        self.words = aligned_zeros(TEAM_WORDS, np.int64)
        self.words[TEAM_THREADS] = count
        self.at = ctypes.c_void_p(self.words.ctypes.data)
        self._run = library[TEAM_RUN]
        self._run.argtypes, self._run.restype = [ctypes.c_void_p, ctypes.c_int64], None
        work = library[TEAM_WORK]
        work.argtypes, work.restype = [ctypes.c_void_p, ctypes.c_int64], None
        self.workers = [threading.Thread(target=work, args=(self.at, tid), daemon=True, name=f"llmc-{tid}")
                        for tid in range(1, count)]
        for worker in self.workers:
            worker.start()
        self.loaded: np.ndarray | None = None  # the argument words `load` last wrote
        self.close = weakref.finalize(self, _Team._stop, self._run, self.at, self.workers, self.words)

    def run(self, job: str, args: Sequence[int]) -> None:
        """Run `job` (a symbol of `team_jobs`) on every thread with `args` (its arguments in order; the
        `tid` one is each thread's own)."""
        self.words[TEAM_ARGS:TEAM_ARGS + len(args)] = args
        self.loaded = None
        self._run(self.at, self.jobs[job])

    def load(self, args: np.ndarray) -> np.ndarray:
        """The team's argument words, holding `args` (written unless they were the last loaded): set the ones
        that change, then `start` a job."""
        if self.loaded is not args:
            self.words[TEAM_ARGS:TEAM_ARGS + len(args)] = args
            self.loaded = args
        return self.words

    def start(self, job: int) -> None:
        """Run job number `job` with the words as they are."""
        self._run(self.at, job)

    @staticmethod
    def _stop(run: Callable, at: ctypes.c_void_p, workers: list[threading.Thread], words: np.ndarray) -> None:
        """End the workers (`words`, which they watch, is held until they have)."""
        if workers:
            run(at, TEAM_STOP)
            for worker in workers:
                worker.join()


class _EntryCall:
    """An entry point's job on a team: its argument words, the session's buffers' addresses filled in once."""

    def __init__(self, team: _Team, symbol: str, names: Sequence[str], buffers: dict[str, int]):
        self.team, self.job = team, team.jobs[symbol]
        self.args = np.array([0 if name in ("n", "logits") else buffers[name] for name in names], np.int64)
        self.n, self.logits = (TEAM_ARGS + list(names).index(name) for name in ("n", "logits"))

    def start(self, n: int, logits: int) -> None:
        """Run it on `n` rows, the logits to address `logits`."""
        words = self.team.load(self.args)
        words[self.n] = n
        words[self.logits] = logits
        self.team.start(self.job)


HUGE_PAGE = 1 << 21
PAGE = 4096


def aligned_zeros(shape: int | Sequence[int], dtype) -> np.ndarray:
    """A zeroed array that starts on a page (numpy's own large arrays start 16 bytes past one). What the kernels
    read and write through vectors (the KV cache's rows, the arena's activations, logits) then lies on whole cache
    lines, and the team's and the barrier's words on the lines `llmc.abi` gives them (one-row decode of SmolLM2 at
    depth 2048 took 2–4% longer with them where numpy put them: `benchmarks/aligned_buffers.py`)."""
    dtype = np.dtype(dtype)
    size = int(np.prod(shape)) * dtype.itemsize
    raw = np.zeros(size + PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE
    return raw[start : start + size].view(dtype).reshape(shape)


def available_memory() -> int | None:
    """The bytes this process can still be given without swapping: Linux's `MemAvailable`, or less where a
    cgroup's limit (v2 `memory.max`, v1 `memory.limit_in_bytes`) leaves less; None where neither is readable."""
    found = []
    try:
        with open("/proc/meminfo") as f:
            found += [int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:")]
    except (OSError, ValueError, IndexError):
        pass
    for limit, used in (("memory.max", "memory.current"), ("memory/memory.limit_in_bytes",
                                                           "memory/memory.usage_in_bytes")):
        try:
            found.append(int(Path("/sys/fs/cgroup", limit).read_text()) - int(Path("/sys/fs/cgroup", used).read_text()))
        except (OSError, ValueError):  # (no such cgroup file, or "max": no limit)
            pass
    return min(found) if found else None


def load_weights(path: Path) -> np.ndarray:
    """`weights.bin` read into memory that Linux backs with 2 MB pages where it can
    (`madvise(MADV_HUGEPAGE)`: transparent huge pages in `madvise` or `always` mode), read-only.

    A decode step reads every weight once; through a file mapping's 4 KB pages each page is a TLB
    miss (SmolLM2: 24 k a token, about 4% of a decode step on an AMD EPYC Zen 4). Where the kernel
    gives no huge pages this is memory as `llama.cpp --no-mmap` reads the weights into."""
    size = path.stat().st_size
    memory = mmap.mmap(-1, size + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (aligned below)
    whole = np.frombuffer(memory, np.uint8)
    start = -whole.ctypes.data % HUGE_PAGE
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE, start, size + HUGE_PAGE - start)
    weights = whole[start : start + size]
    with path.open("rb") as f:
        done = 0
        while done < size and (read := f.readinto(memoryview(weights[done:]))):
            done += read
    if done != size:
        raise LlmcError(f"{path}: {done} bytes read, not {size} (the file changed while it was read)")
    weights.flags.writeable = False
    return weights


def _ptr(a: np.ndarray) -> int:
    return a.ctypes.data


class CapacityError(LlmcError):
    """More tokens than the KV cache holds."""


class TokenError(LlmcError, ValueError):
    """Tokens an artifact cannot run: none, or ids outside its vocabulary (a tokenizer's, or a manifest's
    beginning-of-text id, that the model does not have)."""


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many tokens `a` and `b` share from the start.

    >>> common_prefix([1, 2, 3], [1, 2, 4, 5])
    2
    """
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


class Conversation:
    """What every target's session shares: the position in the cache, prompts cut into chunks,
    the entry point for each call. A target implements `_call` (run one entry point on the `n`
    rows staged in `self.tokens`, `self.positions`, `self.slot_ids`, leave the logits in the
    given array) and `close`.

    The cache holds `slot_count` sequences (`--max-batch`; 1 by default); this conversation's
    is `self.slot`. `run` is the call underneath, for a scheduler of several sequences
    (`llmc.runtime.batch`): `decode` takes up to `batch` rows, one per sequence.

    `cached` is the tokens whose K/V this conversation's slot holds, in order (`position` is their
    number): `feed`, `score` and `verify` append to it, `rewind` and `reset` cut it."""

    def __init__(self, manifest: Manifest):
        self.manifest = manifest
        self.capacity = manifest.kv_cache["capacity"]
        self.slot_count = manifest.kv_cache["slots"]
        self.vocab_size = manifest.model["vocab_size"]
        self.chunk = manifest.entry_points["prefill"]["max_tokens"]
        self.batch = manifest.entry_points["decode"]["max_tokens"]
        self.logits = aligned_zeros((1, self.vocab_size), np.float32)
        self._row_logits: dict[str, np.ndarray] = {}  # every row's logits of `score` and `verify`, when first run
        rows = max(entry["max_tokens"] for entry in manifest.entry_points.values())
        self.tokens = np.zeros(rows, np.int32)
        self.positions = np.zeros(rows, np.int32)
        self.slot_ids = np.zeros(rows, np.int32)
        self.logit_rows = {name: entry["logits"][0] for name, entry in manifest.entry_points.items()}
        self._checked: np.ndarray | None = None  # the last logits array `run` took (its type checked)
        self.cached: list[int] = []
        self.slot = 0

    @property
    def position(self) -> int:
        """The tokens in this conversation's cache: the next one is fed at this position."""
        return len(self.cached)

    def limit_context(self, tokens: int) -> None:
        """Hold at most `tokens` per sequence (prompt and completion), up to what the artifact was compiled for:
        `capacity` reads the limit (`--ctx`). The cache keeps no more than that many of its tokens.

        >>> session.limit_context(2048)  # doctest: +SKIP
        """
        compiled = self.manifest.kv_cache["capacity"]
        if not 2 <= tokens <= compiled:
            raise LlmcError(f"--ctx must be in 2..{compiled} (the tokens per sequence this artifact's KV cache "
                            f"holds; compile with a larger --max-seq), got {tokens}")
        self.capacity = tokens
        del self.cached[tokens:]

    @property
    def larger_capacity(self) -> str:
        """How to hold more tokens per sequence, for an error: `--ctx` up to the compiled capacity, or recompile."""
        compiled = self.manifest.kv_cache["capacity"]
        return f"--ctx up to {compiled}" if self.capacity < compiled else "compile with a larger --max-seq"

    def reuse(self, ids: Sequence[int]) -> int:
        """Rewind to the longest prefix that `cached` shares with `ids`, leaving at least one token of `ids` to
        feed (its logits come from feeding it); returns the prefix's length. Then `feed(ids[kept:])`.

        >>> kept = session.reuse(prompt); logits = session.feed(prompt[kept:])  # doctest: +SKIP
        """
        kept = max(min(common_prefix(self.cached, ids), len(ids) - 1), 0)
        self.rewind(kept)
        return kept

    def cache_rows_bytes(self, slots: int | None = None) -> int:
        """The bytes of the KV cache's rows of its first `slots` sequences (all by default), up to `capacity`
        positions each, that `fault_in_cache` would map: 0 for a target whose cache is mapped when it is
        allocated."""
        return 0

    def fault_in_cache(self, slots: int | None = None) -> None:
        """Have those rows' memory mapped now rather than by the first prompts."""

    def close(self) -> None:
        pass

    def reset(self) -> None:
        """Forget the conversation (the cache rows are overwritten as new tokens arrive)."""
        self.rewind(0)

    def rewind(self, position: int) -> None:
        """Forget the tokens from `position` on: the next ones are fed after the first `position` (their
        cache rows stay and are overwritten; attention never reads past a row's own position).

        >>> logits = session.verify([last, *draft]); session.rewind(start + accepted)  # doctest: +SKIP
        """
        if not 0 <= position <= self.position:
            raise ValueError(f"cannot rewind to {position}: the cache holds {self.position} tokens")
        del self.cached[position:]

    def _call(self, entry: str, n: int, logits: np.ndarray | None) -> None:
        raise NotImplementedError

    def _stage(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray | int) -> int:
        """Put the rows in `self.tokens`, `self.positions`, `self.slot_ids`; returns their number."""
        n = len(tokens)
        self.tokens[:n] = tokens
        self.positions[:n] = positions
        self.slot_ids[:n] = slots
        return n

    def _stage_here(self, tokens: np.ndarray) -> int:
        """`_stage` at this conversation's position and slot."""
        return self._stage(tokens, np.arange(self.position, self.position + tokens.size), self.slot)

    def _entry(self, name: str) -> str:
        """The entry point that runs `name`: `score` stands in for `verify` where the artifact has none."""
        return "score" if name == "verify" and name not in self.manifest.entry_points else name

    def run(self, entry: str, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray,
            logits: np.ndarray | None) -> None:
        """Run `entry` on rows `tokens` at `positions` of cache `slots` (the caller checks them: a chunk's and
        verify's rows are runs of consecutive positions, each run in one slot (`prefill`'s and `score`'s one run),
        decode's rows distinct slots); the logits go to `logits` (None: a target may leave them on the device), a
        C-contiguous float32 array with room for the rows the entry point writes (ValueError otherwise: the kernels
        write through its address)."""
        entry = self._entry(entry)
        if logits is not None:  # (the type checked once an array: a decode loop passes the same one every step)
            rows = min(len(tokens), self.logit_rows[entry])
            if logits is not self._checked and (logits.dtype != np.float32 or not logits.flags.c_contiguous) or \
                    logits.size < rows * self.vocab_size:
                raise ValueError(f"{entry}'s logits need a C-contiguous float32 array of {rows} × {self.vocab_size}, "
                                 f"not {logits.dtype} {list(logits.shape)}")
            self._checked = logits
        self._call(entry, self._stage(tokens, positions, slots), logits)

    def _run_here(self, entry: str, tokens: np.ndarray, logits: np.ndarray | None) -> None:
        """`run` at this conversation's position and slot."""
        self._call(entry, self._stage_here(tokens), logits)

    def _check(self, tokens: np.ndarray) -> None:
        if tokens.size == 0:
            raise TokenError("no tokens to feed")
        self._check_range(tokens.size, int(tokens.min()), int(tokens.max()))

    def _check_range(self, count: int, low: int, high: int) -> None:
        """`count` tokens more, the least id `low` and the largest `high`: room in the cache, ids in the vocabulary."""
        if self.position + count > self.capacity:
            raise CapacityError(f"{self.position + count} tokens exceed the KV cache capacity of "
                                f"{self.capacity} ({self.larger_capacity})")
        if low < 0 or high >= self.vocab_size:
            raise TokenError(f"token id outside the vocabulary of {self.vocab_size}")

    def feed(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """Run `tokens` after the ones already fed; returns the last token's logits (a copy)."""
        return self._last_logits(tokens).copy()

    def greedy(self, tokens: list[int] | np.ndarray) -> int:
        """`feed`, then the most likely next token (a target may take the argmax where the logits are)."""
        return int(np.argmax(self._last_logits(tokens)))

    def pick(self, tokens: list[int] | np.ndarray, sampler: Sampler) -> int:
        """`feed`, then the next token of a `plain` sampler (the argmax) or a `weighed_draw` one (a draw), not taken
        (a target may choose it where the logits are)."""
        return self.greedy(tokens) if sampler.plain else sampler.choose(self._last_logits(tokens))

    def decode_picks(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, logits: np.ndarray,
                     samplers: Sequence[Sampler]) -> list[int | None]:
        """`run("decode", …)`, then the next token of each row whose sampler is `plain` (the argmax, the first
        index of its largest logit) or `weighed_draw` (a draw), not taken; None for the other rows, and for one
        whose choice fails (every logit at -inf, NaN), which the caller's own `sampler(…)` then reports (a target
        may choose where the logits are)."""
        self.run("decode", tokens, positions, slots, logits)
        picks: list[int | None] = []
        for row, sampler in zip(logits, samplers):
            token = None
            if sampler.plain:
                token = int(np.argmax(row))
            elif sampler.weighed_draw and np.isfinite(row.max()):
                token = sampler.choose(row)
            picks.append(None if token is None or row[token] == -np.inf else token)
        return picks

    def _last_logits(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """Run `tokens` after the ones already fed; the last token's logits where the call left them (the next
        call overwrites them)."""
        if len(tokens) == 1 and self.position > 0:  # a decode step: no arrays built
            token = int(tokens[0])
            self._check_range(1, token, token)
            self._step(token, self.logits)
        else:
            tokens = np.asarray(tokens, dtype=np.int32)
            self._check(tokens)
            self._feed(tokens, self.logits)
        return self.logits[0]

    def _step(self, token: int, logits: np.ndarray | None) -> None:
        """Decode `token` at this conversation's position, staged element by element: after a decode step every
        object Python touches is a cache miss (`Session._call`), and a step's arrays built and reduced cost 20 us."""
        self.tokens[0], self.positions[0], self.slot_ids[0] = token, self.position, self.slot
        self._call("decode", 1, logits)
        self.cached.append(token)

    def _feed(self, tokens: np.ndarray, logits: np.ndarray | None) -> None:
        if tokens.size == 1 and self.position > 0:
            self._step(int(tokens[0]), logits)
        else:
            for begin in range(0, tokens.size, self.chunk):
                entry = "prefill" if self.position == 0 else "prefill_kv"
                chunk = tokens[begin : begin + self.chunk]
                self._run_here(entry, chunk, logits)
                self.cached.extend(chunk.tolist())

    def _rows(self, tokens: list[int] | np.ndarray, entry: str) -> np.ndarray:
        """Run `tokens` after the ones already fed through `entry`, in chunks of its rows; every token's logits."""
        tokens = np.asarray(tokens, dtype=np.int32)
        self._check(tokens)
        if entry not in self._row_logits:
            self._row_logits[entry] = aligned_zeros(self.manifest.entry_points[entry]["logits"], np.float32)
        logits, rows = self._row_logits[entry], self.manifest.entry_points[entry]["max_tokens"]
        out = np.empty((tokens.size, self.vocab_size), np.float32)
        for begin in range(0, tokens.size, rows):
            chunk = tokens[begin : begin + rows]
            self._run_here(entry, chunk, logits)
            self.cached.extend(chunk.tolist())
            out[begin : begin + chunk.size] = logits[: chunk.size]
        return out

    def score(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """Run `tokens` after the ones already fed; returns every token's logits `[T, vocab]`."""
        return self._rows(tokens, "score")

    @property
    def max_verify(self) -> int:
        """The most tokens one `verify` call takes: the last accepted token and up to `max_verify - 1` drafts."""
        return self.manifest.entry_points[self._entry("verify")]["max_tokens"]

    def verify(self, tokens: list[int] | np.ndarray) -> np.ndarray:
        """Run up to `max_verify` tokens after the ones already fed in one call; returns every token's logits
        `[n, vocab]` (row i predicts the token after tokens[i]). `rewind` then drops the rejected rows.

        >>> logits = session.verify([last, *draft])  # doctest: +SKIP
        >>> accepted = next((i for i, t in enumerate(draft) if logits[i].argmax() != t), len(draft))  # doctest: +SKIP
        """
        if len(tokens) > self.max_verify:
            raise TokenError(f"{len(tokens)} tokens to verify, more than the artifact's {self.max_verify}")
        return self._rows(tokens, self._entry("verify"))


SESSION_VERIFIED = ("kernels", "weights")  # what a session checks the sha256 of as it reads it, not before


def open_session(directory: Path | str, check_files: bool = True, threads: int | None = None) -> Conversation:
    """A session on the artifact in `directory`, for its target: CPU threads, or the GPU."""
    manifest = load_manifest(directory, check_files, SESSION_VERIFIED)
    if manifest.target == "cuda":
        from llmc.runtime.cuda import CudaSession

        if threads is not None:
            raise LlmcError("--threads is for CPU artifacts; this one runs on the GPU")
        return CudaSession(manifest, check_files=check_files)
    return Session(manifest, check_files=check_files, threads=threads)


class Session(Conversation):
    """One conversation's state on a CPU artifact."""

    def __init__(self, manifest: Manifest | Path | str, check_files: bool = True, threads: int | None = None):
        if not isinstance(manifest, Manifest):
            manifest = load_manifest(manifest, check_files, SESSION_VERIFIED)
        directory, kernels = manifest.directory, manifest.file("kernels")
        if manifest.target != "cpu":
            raise ArtifactError(f"{directory}: a '{manifest.target}' artifact; this runtime runs 'cpu' artifacts")
        missing = missing_cpu_features(manifest.data["cpu"]["features"])
        if missing:
            raise ArtifactError(f"{directory}: compiled for CPU features this machine lacks ({', '.join(missing)}); "
                                f"recompile on this machine, or with --cpu x86-64-v3")
        try:
            self.library = load_verified_library(manifest, check_files)
        except OSError as e:
            raise ArtifactError(f"{kernels}: cannot load: {e}") from e
        check_description(manifest, library_description(self.library, kernels), kernels)  # before any allocation
        super().__init__(manifest)
        most = self.manifest.data["max_threads"]
        self.threads = threads or min(default_threads(), most)
        if not 1 <= self.threads <= most:
            raise LlmcError(f"--threads must be in 1..{most} (what the artifact's kernels split work for), "
                            f"got {self.threads}")
        kv = self.manifest.kv_cache
        arena_bytes = max(e["arena_bytes"] for e in self.manifest.entry_points.values()) + 64
        try:
            self.weights = load_weights(self.manifest.file("weights"))
            if check_files:
                check_sha256(self.manifest, "weights", memoryview(self.weights))  # (the bytes used: hashed once)
            self.k_cache = aligned_zeros(kv["shape"], KV_DTYPES[kv["dtype"]])
            self.v_cache = aligned_zeros(kv["shape"], KV_DTYPES[kv["dtype"]])
            self.arena = aligned_zeros(arena_bytes, np.uint8)
        except (MemoryError, OSError) as e:
            weights = self.manifest.data["files"]["weights"]["bytes"]
            cache = 2 * int(np.prod(kv["shape"])) * np.dtype(KV_DTYPES[kv["dtype"]]).itemsize
            raise ArtifactError(f"{directory}: cannot load it ({weights / 1e6:.1f} MB of weights, a "
                                f"{cache / 1e6:.1f} MB KV cache, {arena_bytes / 1e6:.1f} MB of activations; a smaller "
                                f"cache: compile with a smaller --max-seq): {getattr(e, 'strerror', None) or e}") from None
        self.amx, why = amx.enable(self.library)
        if not self.amx and "failed" in why:
            print(f"llmc: AMX tiles unavailable ({why}): prefill runs on VNNI", file=sys.stderr)
        self.sync = aligned_zeros(SYNC_WORDS, np.int64)
        self.team = _Team(self.library, self.manifest.data["team_jobs"], self.threads)
        self.buffers = {"tokens": _ptr(self.tokens), "positions": _ptr(self.positions), "slots": _ptr(self.slot_ids),
                        "k_cache": _ptr(self.k_cache), "v_cache": _ptr(self.v_cache), "arena": _ptr(self.arena),
                        "weights": self.weights.ctypes.data, "tid": 0, "nth": self.threads, "sync": _ptr(self.sync)}
        self.calls = {name: _EntryCall(self.team, entry["symbol"], entry["arguments"], self.buffers)
                      for name, entry in self.manifest.entry_points.items()}
        self._logits: tuple[np.ndarray | None, int] = (None, 0)  # the last logits array and its address
        rows = max(self.logit_rows.values())
        self._firsts = None  # each thread's first index of the largest logit in its share of each row, where the
        if hasattr(self.library, ARGMAX):  # team takes the argmax (`greedy`; a library from before it cannot)
            self._firsts = aligned_zeros(rows * self.threads, np.int64)
            self.team.words[TEAM_LOGIT_COUNT], self.team.words[TEAM_ARGMAX_OUT] = self.vocab_size, _ptr(self._firsts)
        # where the team weighs the logits for a draw and draws (`pick`; a library from before it cannot): each
        # row's scale, its blocks' (largest, sum), its groups' largest, its uniform and its token
        self._scales = self._blocks = self._groups = self._uniforms = self._tokens = None
        if hasattr(self.library, WEIGH):
            self._scales = aligned_zeros(rows, np.float32)
            self._blocks = aligned_zeros((rows, -(-self.vocab_size // WEIGH_BLOCK), 2), np.float32)
            self._groups = aligned_zeros((rows, -(-self.vocab_size // WEIGH_GROUP)), np.float32)
            self._uniforms = aligned_zeros(rows, np.float64)
            self._tokens = aligned_zeros(rows, np.int64)
            for word, array in ((TEAM_WEIGH_SCALES, self._scales), (TEAM_WEIGH_OUT, self._blocks),
                                (TEAM_WEIGH_GROUPS, self._groups), (TEAM_WEIGH_UNIFORMS, self._uniforms),
                                (TEAM_WEIGH_TOKENS, self._tokens)):
                self.team.words[word] = _ptr(array)

    def _rows_in_use(self, slots: int | None) -> list[np.ndarray]:
        """The K and V cache's rows of the first `slots` sequences, `capacity` positions each."""
        return [(cache[:, :slots] if cache.ndim == 5 else cache)[..., : self.capacity, :]  # ([layers, slots, kv
                for cache in (self.k_cache, self.v_cache)]                                 # heads, positions, row])

    def cache_rows_bytes(self, slots: int | None = None) -> int:
        return sum(rows.size * rows.itemsize for rows in self._rows_in_use(slots))

    def fault_in_cache(self, slots: int | None = None) -> None:
        """The cache's pages mapped now: a zero written every 4 KB of the rows of `capacity` positions (every
        2 MB page where Linux gives them: numpy asks for them for arrays of 4 MB and more). Linux zeroes a page at
        its first write, and a fresh process's first prompt paid for every (layer, kv head)'s first pages:
        SmolLM2, 39 tokens, 37–200 ms where later ones take 24 (`--max-batch 8` too). `llmc serve` calls this
        before it listens, as llama.cpp clears its whole cache when it creates a context."""
        step = max(1, PAGE // (self.k_cache.shape[-1] * self.k_cache.itemsize))  # (positions a 4 KB holds)
        for rows in self._rows_in_use(slots):
            rows[..., ::step, 0] = 0

    def close(self) -> None:
        """Stop the worker threads."""
        self.team.close()

    def _call(self, entry: str, n: int, logits: np.ndarray | None) -> None:
        """The entry point's job with only `n` and the logits' address set anew: after a decode step has streamed
        the weights through the caches, each Python object this touches is a cache miss (the whole `run` took
        55 us a step, 3.7 us warm, with the arguments rebuilt and the address taken every call)."""
        assert logits is not None
        self.calls[entry].start(n, self._address(logits))

    def _address(self, logits: np.ndarray) -> int:
        """The address of `logits`, taken once for the array a decode loop passes every step."""
        if logits is not self._logits[0]:
            self._logits = (logits, _ptr(logits))
        return self._logits[1]

    def greedy(self, tokens: list[int] | np.ndarray) -> int:
        """`feed`, then the most likely next token: a decode step's by the thread team (`_team_picks`)."""
        if self._firsts is None or len(tokens) != 1 or self.position == 0:
            return super().greedy(tokens)
        token = int(tokens[0])
        self._check_range(1, token, token)
        return self._team_picks(self.logits, None, lambda: self._step(token, self.logits))[0]

    def pick(self, tokens: list[int] | np.ndarray, sampler: Sampler) -> int:
        """`feed`, then the next token of a `plain` or `weighed_draw` sampler: a decode step's by the thread team
        (`_team_picks`)."""
        if not sampler.weighed_draw or self._scales is None or len(tokens) != 1 or self.position == 0:
            return super().pick(tokens, sampler)  # (greedy's: `greedy`)
        token = int(tokens[0])
        self._check_range(1, token, token)
        chosen = self._team_picks(self.logits, [sampler], lambda: self._step(token, self.logits))[0]
        return chosen if chosen is not None else sampler.choose(self.logits[0])  # (which says why it cannot)

    def decode_picks(self, tokens: np.ndarray, positions: np.ndarray, slots: np.ndarray, logits: np.ndarray,
                     samplers: Sequence[Sampler]) -> list[int | None]:
        """`run("decode", …)`, each row's pick by the thread team (`_team_picks`)."""
        if self._firsts is None or len(tokens) > max(self.logit_rows.values()):
            return super().decode_picks(tokens, positions, slots, logits, samplers)
        return self._team_picks(logits, samplers, lambda: self.run("decode", tokens, positions, slots, logits))

    def _team_picks(self, logits: np.ndarray, samplers: Sequence[Sampler] | None,
                    call: Callable[[], None]) -> list[int | None]:
        """`call()` (one native call, whose logits go to `logits`), then by the thread team, each thread over
        its share of each row, which its share of the LM head has just written, in its own caches: the argmax
        of every row (`samplers` None: greedy) or of each whose sampler is `plain` (`llmc.abi.ARGMAX`; each
        row's largest of the threads' firsts, the earliest's on ties), and the weighing of each row whose
        sampler is `weighed_draw` (`llmc.abi.WEIGH`), its draw thread 0's (`llmc.abi.DRAW`, by the uniform its
        sampler draws before the call) or, with a filter, `Sampler.draw_weighed`'s. numpy's argmax read every
        logit, half of them from the other core's: 26 us of SmolLM2's 2 ms step, 100 us of the 270M model's
        8 ms; a draw's passes over the logits in numpy took 65 and 300 us warm, ~100 more after a decode step
        (every object Python touches a cache miss). None for other rows, as `decode_picks` (and for a draw
        where the library cannot weigh: one from before `WEIGH`; or where the team's draw failed, after its
        uniform was drawn)."""
        words = self.team.words
        if samplers is None:
            kinds = ["argmax"]
        else:  # (each row's kind once: after the call every attribute Python reads is a cache miss)
            weighs = self._scales is not None
            kinds = ["argmax" if s.plain else ("top-p" if s.filtered else "draw") if weighs and s.weighed_draw
                     else None for s in samplers]
        argmaxes = 1 + max((r for r, kind in enumerate(kinds) if kind == "argmax"), default=-1)
        weighed = 1 + max((r for r, kind in enumerate(kinds) if kind in ("draw", "top-p")), default=-1)
        if weighed:  # (a draw with no filter is the team's: its one uniform drawn now, as `Sampler.draw` would)
            self._scales[:weighed] = [s.scale if kind in ("draw", "top-p") else -1.0
                                      for s, kind in zip(samplers, kinds[:weighed])]
            self._uniforms[:weighed] = [s.rng.random() if kind == "draw" else -1.0
                                        for s, kind in zip(samplers, kinds[:weighed])]
        words[TEAM_LOGITS] = self._address(logits)
        words[TEAM_ARGMAX_ROWS] = argmaxes  # (rows up to the last that asks; the call zeroes both)
        words[TEAM_WEIGH_ROWS] = weighed
        try:
            call()
        except BaseException:
            words[TEAM_ARGMAX_ROWS] = words[TEAM_WEIGH_ROWS] = 0
            raise
        firsts = self._firsts[: argmaxes * self.threads].tolist()
        tokens = self._tokens[:weighed].tolist()
        picks: list[int | None] = []
        for r, kind in enumerate(kinds):
            row, best = logits[r], None
            if kind == "argmax":
                for i in firsts[r * self.threads : (r + 1) * self.threads]:
                    if i >= 0 and (best is None or row[i] > row[best]):
                        best = i
                best = best if samplers is None or (best is not None and row[best] != -np.inf) else None
            elif kind == "top-p":
                best = samplers[r].draw_weighed(row, self._blocks[r], self._groups[r])
            elif kind == "draw" and tokens[r] >= 0:
                best = tokens[r]
            picks.append(best)
        return picks

    @property
    def where(self) -> str:
        return f"{self.threads} threads"

    @property
    def bandwidth_probe(self) -> str:
        return f"the kernels' read probe on {self.threads} threads"

    def read(self, address: int, size: int) -> np.ndarray:
        """The read probe on this session's threads over `size` bytes at `address`: each thread's xor of its share."""
        out = np.zeros(self.threads, np.int64)
        args = {"p": address, "bytes": size, "tid": 0, "nth": self.threads, "out": _ptr(out)}
        self.team.run(self.manifest.data["read_probe"], [args[name] for name in READ_PROBE_ARGUMENTS])
        return out

    def read_weights(self) -> float:
        """GB/s of one read of the weights by the kernels' read probe on this session's threads, as a
        decode step streams them (the probe reads whole `READ_PROBE_STEP`s: only those count)."""
        start = time.perf_counter()
        self.read(self.weights.ctypes.data, self.weights.size)
        return self.weights.size // READ_PROBE_STEP * READ_PROBE_STEP / (time.perf_counter() - start) / 1e9
