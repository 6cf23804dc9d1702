"""The contract between the compiler and the runtime: what an artifact's entry points are called,
what they take, how their KV cache is laid out, and what the kernels library exports besides.

The compiler writes artifacts to it (`lower` names the entry arguments, codegen emits the
functions, the probe and the description, the interpreters read the cache rows) and the runtime
reads them by it (`runtime.artifact` checks a manifest against it, the sessions pass arguments
by it). Each fact is here once. This module must stay dependency-free (the standard library
only): the runtime imports it where the compiler stack (xdsl, llvmlite) is not installed.

A CPU entry point, as exported by `kernels.so` (`slots` only where the cache holds several sequences):

```c
void llmc_decode(int32_t *tokens, int32_t *positions, int32_t *slots, int64_t n, void *k_cache, void *v_cache,
                 float *logits, uint8_t *arena, uint8_t *weights, int64_t tid, int64_t nth, int64_t *sync);
```
"""

from __future__ import annotations

# ---------------------------------------------------------------- entry points

ENTRY_POINTS = ("prefill", "prefill_kv", "decode", "score")  # every artifact has each
OPTIONAL_ENTRY_POINTS = ("verify",)  # an artifact may have these (`--speculate 0` and older artifacts: no `verify`)
ENTRY_PREFIX = "llmc_"  # what a kernels library exports: entry points, the read probe, the AMX flag, its description

# An argument's kind: an int64 by value, or a pointer (to what, for the reader; the call passes an address).
INT64, POINTER = "i64", "ptr"

# The arguments of every lowered entry point, in order: the tgt function's own (`BATCH_ARGUMENTS`
# only where the cache holds several sequences) ...
ENTRY_ARGUMENTS: dict[str, str] = {
    "tokens": POINTER,  # int32 token ids, one per row
    "positions": POINTER,  # int32 cache position of each row
    "slots": POINTER,  # int32 cache slot (sequence) of each row
    "n": INT64,  # the rows in this call
    "k_cache": POINTER,  # the caches, `KV_LAYOUT` or `KV_LAYOUT_SLOTS`, rows of the cache's type
    "v_cache": POINTER,
    "logits": POINTER,  # float32 [rows, vocabulary]
}
BATCH_ARGUMENTS = ("slots",)
# ... then, on the CPU, what every entry point also takes.
IMPLICIT_ARGUMENTS: dict[str, str] = {
    "arena": POINTER,  # the activations' arena (`arena_bytes`)
    "weights": POINTER,  # the mapped weights file
    "tid": INT64,  # this thread's index, of
    "nth": INT64,  # this many threads (at most `max_threads`)
    "sync": POINTER,  # the threads' barrier and work counters: `SYNC_WORDS` int64, zeroed once
}
# The most threads an entry point runs on: the manifest's `max_threads`, the runtime's cap on its team, and the
# rows of `tgt.attention`'s partials (one per CPU thread or CUDA block sharing a row's cache positions).
MAX_THREADS = 64
# `sync`: the barrier's two words (arrivals, generation) in the first 64-byte line, then the work counters,
# a word per thread each. A kernel that deals its work (`tgt.Kernel.DEALS`) counts each thread's reserve of
# chunks in that thread's word (or, one-row decode attention, which thread finishes last in the first word);
# codegen gives each such kernel between two barriers its own counter, and the last thread to arrive at a
# barrier zeroes the ones used before it (so each starts at zero).
SYNC_LINE_WORDS = 8
WORK_COUNTERS = 8
WORK_COUNTER_WORDS = MAX_THREADS
SYNC_WORDS = SYNC_LINE_WORDS + WORK_COUNTERS * WORK_COUNTER_WORDS
ARGMAX_TOKEN = "token"  # CUDA: the int32 the decoding argmax writes (a launch argument besides the entry's own)


def entry_symbol(stage: str) -> str:
    """The exported function of entry point `stage` (`llmc_decode`)."""
    return f"{ENTRY_PREFIX}{stage}"


def entry_arguments(slots: int) -> tuple[str, ...]:
    """The own arguments of an entry point whose cache holds `slots` sequences, in order."""
    return tuple(name for name in ENTRY_ARGUMENTS if name not in BATCH_ARGUMENTS or slots > 1)


def argument_kind(name: str) -> str:
    """`INT64` or `POINTER`: how an entry point's argument `name` is passed."""
    return {**ENTRY_ARGUMENTS, **IMPLICIT_ARGUMENTS}[name]


# ---------------------------------------------------------------- the KV cache

KV_LAYOUT = "layer,kv_head,position,dim"  # the KV cache's dimensions
KV_LAYOUT_SLOTS = "layer,slot,kv_head,position,dim"  # a cache of several sequences
KV_DTYPES = {"f32": "float32", "f16": "float16", "q8_0": "int8"}  # `--kv-type` → the cache's numpy element type

# A q8_0 cache row: the head's `head_dim` values as int8, then one float32 scale per block of
# `KV_Q8_BLOCK` values (block b's at byte `head_dim + KV_Q8_SCALE_BYTES * b`); a value is its
# int8 times its block's scale (scale = amax / 127).
KV_Q8_BLOCK = 32
KV_Q8_SCALE_BYTES = 4


def kv_q8_row_bytes(head_dim: int) -> int:
    """Bytes of one q8_0 cache row of `head_dim` values (`head_dim` a multiple of `KV_Q8_BLOCK`)."""
    return head_dim + head_dim // KV_Q8_BLOCK * KV_Q8_SCALE_BYTES


def kv_q8_head_dim(row_bytes: int) -> int:
    """The values a q8_0 cache row of `row_bytes` holds (the inverse of `kv_q8_row_bytes`)."""
    return row_bytes * KV_Q8_BLOCK // (KV_Q8_BLOCK + KV_Q8_SCALE_BYTES)


ELEMENT_BYTES = {"f32": 4, "i32": 4, "f16": 2, "i8": 1}  # bytes of a buffer element, by its IR type

# ---------------------------------------------------------------- what else a kernels library exports

DESCRIPTION = f"{ENTRY_PREFIX}description"  # the library's own description, a NUL-terminated JSON string
PTX_DESCRIPTION = f"// {DESCRIPTION} "  # CUDA: the start of the PTX's last line, which holds the same

# `void llmc_read(uint8_t *p, int64_t bytes, int64_t tid, int64_t nth, int64_t *out)`: thread `tid` of
# `nth` reads its share of `bytes` (whole `READ_PROBE_STEP`s) once and leaves the xor of it in out[tid].
READ_PROBE = f"{ENTRY_PREFIX}read"
READ_PROBE_ARGUMENTS: dict[str, str] = {"p": POINTER, "bytes": INT64, "tid": INT64, "nth": INT64, "out": POINTER}
READ_PROBE_STEP = 256  # bytes per iteration: four 64-byte loads
# `void llmc_argmax(float *logits, int64_t n, int64_t count, int64_t tid, int64_t nth, int64_t *out)`: for each
# of `n` rows of `count` logits, thread `tid` of `nth` leaves in out[row · nth + tid] the first index of the largest
# logit in its share of the row (its share's first where none is above -inf; -1 for an empty share). The thread
# team runs it after a call when the team's words ask (`TEAM_ARGMAX_ROWS`); the runtime takes the largest of the
# threads' firsts (greedy decoding: each thread reads the logits it wrote, in its own caches).
ARGMAX = f"{ENTRY_PREFIX}argmax"
ARGMAX_ARGUMENTS: dict[str, str] = {"logits": POINTER, "n": INT64, "count": INT64, "tid": INT64, "nth": INT64,
                                    "out": POINTER}
# `void llmc_weigh(float *logits, int64_t n, int64_t count, int64_t tid, int64_t nth, float *scales, float *out,
# float *groups)`: for each of `n` rows of `count` logits whose scale (an inverse temperature) is >= 0, thread `tid`
# of `nth` leaves, for each of its share of the row's `WEIGH_BLOCK`-logit blocks b, the block's largest logit m in
# out[2·(row · blocks + b)] and the sum of exp((logit − m) · scale) over the block in the float after it, and the
# largest logit of each `WEIGH_GROUP` of the block's in groups[row · ⌈count / WEIGH_GROUP⌉ + group] (blocks =
# ⌈count / WEIGH_BLOCK⌉). The thread team runs it after a call when the team's words ask (`TEAM_WEIGH_ROWS`); thread
# 0 then draws from the blocks (`DRAW`), or the runtime takes top-p's total from them and its head from the groups
# whose largest reach it (`Sampler.draw_weighed`).
WEIGH = f"{ENTRY_PREFIX}weigh"
WEIGH_ARGUMENTS: dict[str, str] = {"logits": POINTER, "n": INT64, "count": INT64, "tid": INT64, "nth": INT64,
                                   "scales": POINTER, "out": POINTER, "groups": POINTER}
WEIGH_BLOCK = 1024
WEIGH_GROUP = 64
# `void llmc_draw(float *logits, int64_t n, int64_t count, float *scales, float *out, double *uniforms,
# int64_t *tokens)`: thread 0's after the weighing, for each of `n` rows whose scale is >= 0 and uniform u in
# [0, 1): the token drawn with probability ∝ exp((logit − top) · scale) into tokens[row], found as
# `Sampler.draw` finds it: the block where the running sum of the blocks' masses (each block's sum from `WEIGH`
# times exp((its largest − top) · scale)) passes u times their total, then the logit where the block's running
# sum of weights passes the rest (the block's last weight above 0 where rounding leaves none); -1 where the
# total is not a finite number above 0 (a NaN logit). The runtime draws u before the call.
DRAW = f"{ENTRY_PREFIX}draw"
DRAW_ARGUMENTS: dict[str, str] = {"logits": POINTER, "n": INT64, "count": INT64, "scales": POINTER, "out": POINTER,
                                  "uniforms": POINTER, "tokens": POINTER}
AMX_FLAG = f"{ENTRY_PREFIX}amx"  # an int32 the runtime sets to 1 once the process may use AMX tiles

# The native thread team (`backends/cpu/team.py`): the runtime's workers wait in
# `void llmc_team_work(int64_t *team, int64_t tid)` (tid ≥ 1) and its calling thread runs each call through
# `void llmc_team_run(int64_t *team, int64_t job)`, where `job` indexes the manifest's `team_jobs` (the entry
# points' symbols, then the read probe's) and `team` is `TEAM_WORDS` int64, zeroed once:
TEAM_WORK = f"{ENTRY_PREFIX}team_work"
TEAM_RUN = f"{ENTRY_PREFIX}team_run"
TEAM_GENERATION = 0  # bumped by each call (its low 32 bits are the futex sleeping workers wait on)
TEAM_SLEEPERS = 1  # workers asleep on the futex
TEAM_JOB = 2  # the job of the latest call; `TEAM_STOP` ends the workers
TEAM_THREADS = 3  # the team's size, set once by the runtime
TEAM_ARGMAX_ROWS = 4  # rows of logits to take the argmax of after the next call (`ARGMAX`; the call zeroes it), …
TEAM_LOGITS = 5  # … at this address (the argmax's and the weighing's), …
TEAM_LOGIT_COUNT = 6  # … of this many logits each, …
TEAM_ARGMAX_OUT = 7  # … the threads' firsts to this address
TEAM_DONE = 8  # the done barrier's two words (arrivals, generation), a cache line of their own
TEAM_ARGS = 16  # the job's arguments, in its function's order (every argument an int64 or an address)
TEAM_WEIGH_ROWS = TEAM_ARGS + 16  # rows of logits to weigh after the next call (`WEIGH`; the call zeroes it), …
TEAM_WEIGH_SCALES = TEAM_WEIGH_ROWS + 1  # … with the float32 scales at this address, …
TEAM_WEIGH_OUT = TEAM_WEIGH_ROWS + 2  # … the blocks' (largest, sum) to this address, …
TEAM_WEIGH_GROUPS = TEAM_WEIGH_ROWS + 3  # … the groups' largest to this one; then thread 0 draws (`DRAW`) …
TEAM_WEIGH_UNIFORMS = TEAM_WEIGH_ROWS + 4  # … by the float64 uniforms at this address …
TEAM_WEIGH_TOKENS = TEAM_WEIGH_ROWS + 5  # … the int64 tokens to this one
TEAM_WORDS = TEAM_ARGS + 24
TEAM_STOP = -1
