"""The native thread team: worker threads that stay in the kernels library between calls.

    void llmc_team_work(int64_t *team, int64_t tid);  // thread tid ≥ 1: run jobs until the team stops
    void llmc_team_run(int64_t *team, int64_t job);   // thread 0: run job `job` on every thread, then return

A job is one of the library's exported functions (`team_jobs`: the entry points, then the read
probe), called with the arguments the runtime left in the team's words (`llmc.abi.TEAM_ARGS`
onwards, in the function's own order), each thread passing its own `tid`. `llmc_team_run` bumps
the team's generation, runs the job as thread 0 and waits on a barrier for the others; a
worker watches the generation with `pause` for about `SPIN_CYCLES` after its last job, then
sleeps on a futex until the next. So a decode step costs one native call and two barriers'
worth of cache-line traffic, with no Python, no OS call and no GIL hand-over on the way. A job
of -1 (`TEAM_STOP`) makes every worker return. Where the runtime left rows in `TEAM_ARGMAX_ROWS`, the
threads then take the argmax of those rows of logits (`llmc.abi.ARGMAX`: each thread its share, which its
share of the LM head wrote) between two passes of the done barrier, and thread 0 zeroes the word: greedy
decoding's token costs one more barrier, not a second call. Rows in `TEAM_WEIGH_ROWS` are weighed for a
sampled token's draw the same way and in the same pass (`llmc.abi.WEIGH`), and thread 0 then draws their
tokens where the runtime left a uniform (`llmc.abi.DRAW`).
"""

from __future__ import annotations

from llvmlite import ir

from llmc.abi import (
    TEAM_ARGMAX_OUT,
    TEAM_ARGMAX_ROWS,
    TEAM_ARGS,
    TEAM_DONE,
    TEAM_GENERATION,
    TEAM_JOB,
    TEAM_LOGIT_COUNT,
    TEAM_LOGITS,
    TEAM_RUN,
    TEAM_SLEEPERS,
    TEAM_STOP,
    TEAM_THREADS,
    TEAM_WEIGH_GROUPS,
    TEAM_WEIGH_OUT,
    TEAM_WEIGH_ROWS,
    TEAM_WEIGH_SCALES,
    TEAM_WEIGH_TOKENS,
    TEAM_WEIGH_UNIFORMS,
    TEAM_WORK,
)
from llmc.backends.builder import I32, I64, VOID
from llmc.backends.cpu.kernels import I64PTR, KernelLibrary

SPIN_CYCLES = 1 << 22  # ~1–2 ms of time-stamp counter: a worker spins this long after a job before it sleeps
SYS_FUTEX, FUTEX_WAIT_PRIVATE, FUTEX_WAKE_PRIVATE = 202, 128, 129  # x86-64 Linux


def _word(b: ir.IRBuilder, team: ir.Value, index: int) -> ir.Value:
    return b.gep(team, [ir.Constant(I64, index)])


def _address(b: ir.IRBuilder, team: ir.Value, index: int, param: ir.Argument) -> ir.Value:
    """The address in the team's word `index`, as `param`'s pointer type."""
    return b.inttoptr(b.load(_word(b, team, index)), param.type)


def _futex(module: ir.Module, b: ir.IRBuilder, team: ir.Value, op: int, value: ir.Value) -> None:
    """futex(op) on the generation word's low 32 bits (the team's futex word)."""
    syscall = module.globals.get("syscall") or ir.Function(module, ir.FunctionType(I64, [I64], var_arg=True),
                                                           name="syscall")
    word = b.bitcast(_word(b, team, TEAM_GENERATION), I32.as_pointer())
    b.call(syscall, [ir.Constant(I64, SYS_FUTEX), word, ir.Constant(I64, op), value,
                     ir.Constant(I64.as_pointer(), None)])  # every variadic argument a full register


def _dispatch(b: ir.IRBuilder, team: ir.Value, job: ir.Value, tid: ir.Value, jobs: list[ir.Function]) -> None:
    """Call `jobs[job]` with the team's argument words (this thread's `tid` for the one named so)."""
    fn = b.function
    after = fn.append_basic_block("ran")
    switch = b.switch(job, after)
    for index, target in enumerate(jobs):
        block = fn.append_basic_block(f"job.{target.name}")
        switch.add_case(ir.Constant(I64, index), block)
        b.position_at_end(block)
        args = []
        for i, param in enumerate(target.args):
            if param.name == "tid":
                args.append(tid)
                continue
            word = b.load(_word(b, team, TEAM_ARGS + i))
            args.append(b.inttoptr(word, param.type) if isinstance(param.type, ir.PointerType) else word)
        b.call(target, args)
        b.branch(after)
    b.position_at_end(after)


def _finish(lib: KernelLibrary, b: ir.IRBuilder, team: ir.Value, tid: ir.Value, argmax: ir.Function,
            weigh: ir.Function) -> None:
    """Every thread arrives at the team's done barrier; where `TEAM_ARGMAX_ROWS` or `TEAM_WEIGH_ROWS` ask, each
    then takes its share of those rows' argmax (`argmax`) or weighing (`weigh`) and arrives again."""
    threads = b.load(_word(b, team, TEAM_THREADS))
    rows = b.load(_word(b, team, TEAM_ARGMAX_ROWS))  # (before arriving: thread 0 zeroes them, and the runtime sets
    weighed = b.load(_word(b, team, TEAM_WEIGH_ROWS))  # the next call's, only after every thread has arrived)
    lib.wait(b, _word(b, team, TEAM_DONE), threads)
    zero = ir.Constant(I64, 0)
    with b.if_then(b.icmp_signed(">", b.or_(rows, weighed), zero)):
        count = b.load(_word(b, team, TEAM_LOGIT_COUNT))
        with b.if_then(b.icmp_signed(">", rows, zero)):
            b.call(argmax, [_address(b, team, TEAM_LOGITS, argmax.args[0]), rows, count, tid, threads,
                            _address(b, team, TEAM_ARGMAX_OUT, argmax.args[5])])
        with b.if_then(b.icmp_signed(">", weighed, zero)):
            outputs = zip((TEAM_WEIGH_SCALES, TEAM_WEIGH_OUT, TEAM_WEIGH_GROUPS), weigh.args[5:])
            b.call(weigh, [_address(b, team, TEAM_LOGITS, weigh.args[0]), weighed, count, tid, threads,
                           *(_address(b, team, word, param) for word, param in outputs)])
        lib.wait(b, _word(b, team, TEAM_DONE), threads)


def team_work(lib: KernelLibrary, jobs: list[ir.Function], argmax: ir.Function, weigh: ir.Function) -> ir.Function:
    """`llmc_team_work`: wait for a new generation (spin, then sleep), run its job, arrive at the done barrier
    (`_finish`)."""
    module = lib.module
    fn = ir.Function(module, ir.FunctionType(VOID, [I64PTR, I64]), name=TEAM_WORK)
    team, tid = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    clock = module.declare_intrinsic("llvm.readcyclecounter", fnty=ir.FunctionType(I64, []))
    pause = module.declare_intrinsic("llvm.x86.sse2.pause", fnty=ir.FunctionType(VOID, []))
    generation = _word(b, team, TEAM_GENERATION)
    seen = b.alloca(I64)
    since = b.alloca(I64)
    b.store(ir.Constant(I64, 0), seen)  # the team's first generation: a call made before this thread got here waits for it
    idle, watch, spin, sleep, new = (fn.append_basic_block(n) for n in ("idle", "watch", "spin", "sleep", "new"))
    b.branch(idle)

    b.position_at_end(idle)  # after a job: start the spin clock
    b.store(b.call(clock, []), since)
    b.branch(watch)

    b.position_at_end(watch)
    current = b.load_atomic(generation, "acquire", 8)
    b.cbranch(b.icmp_unsigned("!=", current, b.load(seen)), new, spin)

    b.position_at_end(spin)
    b.call(pause, [])
    waited = b.sub(b.call(clock, []), b.load(since))
    b.cbranch(b.icmp_unsigned("<", waited, ir.Constant(I64, SPIN_CYCLES)), watch, sleep)

    b.position_at_end(sleep)  # announce, look once more, then sleep while the word still holds what we saw
    sleepers = _word(b, team, TEAM_SLEEPERS)
    b.atomic_rmw("add", sleepers, ir.Constant(I64, 1), "seq_cst")
    now = b.load_atomic(generation, "seq_cst", 8)
    asleep, woke = fn.append_basic_block("asleep"), fn.append_basic_block("woke")
    b.cbranch(b.icmp_unsigned("==", now, b.load(seen)), asleep, woke)
    b.position_at_end(asleep)
    _futex(module, b, team, FUTEX_WAIT_PRIVATE, b.and_(now, ir.Constant(I64, 0xFFFFFFFF)))
    b.branch(woke)
    b.position_at_end(woke)
    b.atomic_rmw("sub", sleepers, ir.Constant(I64, 1), "seq_cst")
    b.branch(idle)

    b.position_at_end(new)
    b.store(current, seen)
    job = b.load(_word(b, team, TEAM_JOB))
    stop, run = fn.append_basic_block("stop"), fn.append_basic_block("run")
    b.cbranch(b.icmp_signed("==", job, ir.Constant(I64, TEAM_STOP)), stop, run)
    b.position_at_end(stop)
    b.ret_void()
    b.position_at_end(run)
    _dispatch(b, team, job, tid, jobs)
    _finish(lib, b, team, tid, argmax, weigh)
    b.branch(idle)
    return fn


def team_run(lib: KernelLibrary, jobs: list[ir.Function], argmax: ir.Function, weigh: ir.Function,
             draw: ir.Function) -> ir.Function:
    """`llmc_team_run`: publish the job, wake sleeping workers, run it as thread 0, wait for the others
    (`_finish`), draw from the rows weighed (`draw`, thread 0 alone: the workers are done with them), zero the
    argmax's and the weighing's rows (every thread has read them)."""
    module = lib.module
    fn = ir.Function(module, ir.FunctionType(VOID, [I64PTR, I64]), name=TEAM_RUN)
    team, job = fn.args
    b = ir.IRBuilder(fn.append_basic_block("entry"))
    b.store(job, _word(b, team, TEAM_JOB))
    b.atomic_rmw("add", _word(b, team, TEAM_GENERATION), ir.Constant(I64, 1), "seq_cst")
    wake, woken = fn.append_basic_block("wake"), fn.append_basic_block("woken")
    sleepers = b.load_atomic(_word(b, team, TEAM_SLEEPERS), "seq_cst", 8)
    b.cbranch(b.icmp_signed(">", sleepers, ir.Constant(I64, 0)), wake, woken)
    b.position_at_end(wake)
    _futex(module, b, team, FUTEX_WAKE_PRIVATE, ir.Constant(I64, (1 << 31) - 1))
    b.branch(woken)
    b.position_at_end(woken)
    stop, run = fn.append_basic_block("stop"), fn.append_basic_block("run")
    b.cbranch(b.icmp_signed("==", job, ir.Constant(I64, TEAM_STOP)), stop, run)
    b.position_at_end(stop)
    b.ret_void()
    b.position_at_end(run)
    _dispatch(b, team, job, ir.Constant(I64, 0), jobs)
    _finish(lib, b, team, ir.Constant(I64, 0), argmax, weigh)
    weighed = b.load(_word(b, team, TEAM_WEIGH_ROWS))
    with b.if_then(b.icmp_signed(">", weighed, ir.Constant(I64, 0))):
        logits, _, _, scales, out, uniforms, tokens = draw.args
        b.call(draw, [_address(b, team, TEAM_LOGITS, logits), weighed, b.load(_word(b, team, TEAM_LOGIT_COUNT)),
                      *(_address(b, team, word, param) for word, param in ((TEAM_WEIGH_SCALES, scales),
                        (TEAM_WEIGH_OUT, out), (TEAM_WEIGH_UNIFORMS, uniforms), (TEAM_WEIGH_TOKENS, tokens)))])
    b.store(ir.Constant(I64, 0), _word(b, team, TEAM_ARGMAX_ROWS))
    b.store(ir.Constant(I64, 0), _word(b, team, TEAM_WEIGH_ROWS))
    b.ret_void()
    return fn
