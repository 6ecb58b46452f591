"""An untimed step: every operation dispatched from one thread, nothing waiting, and what was handed out.

``dispatch`` hands each operation to its stage's device in the plans' execution order
and nothing waits: ``jit`` dispatches asynchronously, so the devices run side by side
while the driver is already further on. A Trainer's untimed step runs its dispatch, in
the same order, in one long-lived helper thread (``run_untimed``) while the caller waits
with ``step_timeout`` and Ctrl-C; ``Dispatched`` records what was handed out, so a stuck
step names each worker's unfinished operation (a Ray actor's untimed list keeps one of
its own operations, ``ray.lists``).
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from typing import Callable, Sequence, TypeVar, cast

import jax

from ...errors import VjpsplitError
from ...files.prng import is_ready
from ..schedules.ops import Kind, Op, dependencies, received
from .devicebytes import is_array
from .dispatch import Order, order_of, placed_microbatches, same_shapes, walk, whole_backwards
from .hang_report import (
    COMPILING,
    DISPATCHING,
    FINISHED,
    NEXT,
    PENDING,
    PROGRAM,
    Now,
    StepInterrupted,
    clause,
    compile_aware,
    compiling,
)
from .model import Microbatch
from .program import program_for
from .replicas import Parts, ReplicaGroup
from .stepwatch import GRACE, Watch, stop_report, worker_rings
from .stageops import RunsOps, run_op
from .worker import StageWorker
from .workerthreads import Job, WorkerThreads, wait_for
from ...treetypes import Leaf, PyTree


def dispatch(
    workers: Sequence[RunsOps],
    plans: Sequence[Sequence[Op]],
    mbs: Sequence[Microbatch],
    microbatches: int,
    order: Order | None = None,
    record: Dispatched | None = None,
    scales: Sequence[float] | None = None,
    timed: bool = False,
    tick: Callable[[], object] | None = None,
) -> None:
    """One step of ``plans`` on the stages' ``workers`` (reset first), every operation dispatched from this thread.

    Nothing waits: each operation is handed to its stage's device as soon as the
    operations it reads are (the plans' execution order), and ``jit``'s
    asynchronous dispatch runs the devices side by side. ``order``: ``dispatch.order_of(plans)``, if kept.
    ``record``: notes each operation as it is handed out (``Dispatched``), and stops the step once stopped.
    ``scales``: per microbatch, the last stage's starting cotangent (``StageWorker.reset``); None: equal.
    ``timed``: the workers time their operations (``timed.run_timed``); ``tick()``: after each operation.
    Where every stage runs on one device that runs one program at a time, each split backward runs whole
    (``whole_backwards``), and where those stages are alone (no replicas) and offload nothing, the step runs as
    one compiled program (``program.StepProgram``), timed or not.
    """
    whole = whole_backwards(workers)
    for st in workers:
        st.reset(timed=timed, plans=plans, scales=scales, whole=whole)
    mbs = placed_microbatches(mbs, workers)
    # Microbatches of their own lengths (``Microbatches``) run operation by operation: each call compiles once per
    # length, where the program would compile once per order of lengths.
    if whole and all(_one_program(st) for st in workers) and same_shapes(mbs):
        stages = cast("list[StageWorker]", list(workers))
        order = order_of(plans, len(stages)) if order is None else order
        scaled = [stages[-1].start_cotangent(m, microbatches) for m in range(len(mbs))]
        program_for(stages, order, microbatches).run(stages, order, mbs, scaled, record, timed, tick)
        if record is not None:
            record.dispatched()
        return

    def submit(w: int, op: Op, data: object, side: list[Leaf]) -> PyTree:
        return run_op(workers[op.stage], op, data, side, microbatches, w)

    def noted(w: int, op: Op, data: object, side: list[Leaf]) -> PyTree:
        if record is not None:
            record.begin(w, op)
        out = run_op(workers[op.stage], op, data, side, microbatches, w)
        if record is not None:
            record.end(w, op, out, workers[op.stage])
        if tick is not None:
            tick()
        return out

    walk(plans, len(workers), mbs, submit if record is None and tick is None else noted, order)
    if record is not None:
        record.dispatched()


def _one_program(stage: RunsOps) -> bool:
    """Whether ``stage`` can run in a ``program.StepProgram``: a stage alone (no replicas) that moves no residual
    off its device."""
    return isinstance(stage, StageWorker) and stage.offloader is None


class _Stopped(Exception):
    """Raised in an untimed step's thread at its next operation (or update) once the step was stopped."""


def _probe(tree: object) -> tuple[jax.Array, ...]:
    """What asks ``is_ready`` for the operation that produced ``tree``: one of its arrays (all the outputs of
    one execution are ready at once, so any one tells; the first, to walk no tree where there is none), or
    one per replica for a ``Parts`` (replica r's on its device)."""
    if is_array(tree):
        return (tree,)
    if isinstance(tree, Parts):
        return tuple(a for part in tree for a in _probe(part))
    if isinstance(tree, (tuple, list)) and tree and is_array(tree[0]):
        return (tree[0],)
    for leaf in jax.tree_util.tree_leaves(tree):
        if is_array(leaf):
            return (leaf,)
    return ()


def _handed_on(op: Op, stage: RunsOps) -> object:
    """What an operation that hands on nothing (the first stage's B or I, every W) left in ``stage``: an I's
    intermediates for W, else the summed gradients; a replica group's reduced ones once it reduced (its last
    gradient operation), else each replica's (a ``Parts``)."""
    if isinstance(stage, ReplicaGroup):
        if stage.grads is not None:
            return stage.grads
        return Parts(_handed_on(op, r) for r in stage.replicas)
    inter = stage.inter.get(op.mb) if op.kind == Kind.I else None
    return stage.grads if inter is None else list(inter.arrays.values())


PRUNE = 8  # a worker's held operations before their finished front is dropped (then twice those still held)


class Dispatched:
    """What an untimed step's thread handed out: per worker, each operation with its dispatch time and one
    array per device it produced (``is_ready`` says whether it finished), and the operation being dispatched now.

    ``nows`` reads it while that thread may be stuck; ``stop`` makes the thread end at its next operation or
    update. A worker's operations found finished at the front of its queue are dropped as it grows (each time
    it holds ``PRUNE``, or twice what it held after the last drop), and all found finished once dispatch is over
    and at each look of the waiting caller (``prune``): what is held is one array of each operation not
    finished (whose buffers are alive anyway) and a few more.
    """

    def __init__(self, plans: Sequence[Sequence[Op]], num_stages: int):
        self.plans, self.num_stages = plans, num_stages
        self.t0 = time.monotonic()
        self.ops: list[collections.deque[tuple[Op, float, Sequence[jax.Array]]]] = [collections.deque() for _ in plans]
        self.count = [0] * len(plans)  # operations handed out per worker (ops drops the finished ones)
        self.limit = [PRUNE] * len(plans)  # how many a worker's ops may hold before its front is pruned again
        self.last = [self.t0] * len(plans)  # when each worker's last operation was handed out
        self.now: tuple[int, Op, float] | None = None
        self.program_since: float | None = None  # when the step began to run as one program (``program_step``)
        self.over = False  # dispatch is over: prune may run from the waiting thread
        self.lock = threading.Lock()
        self.stopped = False
        self.committed = False  # an update began

    @functools.cached_property
    def worker_of(self) -> dict[int, int]:
        """Per stage, the worker that holds it (worked out for a report only)."""
        return {op.stage: w for w, ops in enumerate(self.plans) for op in ops}

    def begin(self, w: int, op: Op) -> None:
        """``op`` of worker ``w`` is about to be dispatched (raises once the step is stopped)."""
        if self.stopped:
            raise _Stopped()
        self.now = (w, op, time.monotonic())

    def end(self, w: int, op: Op, out: object, stage: RunsOps) -> None:
        """``op`` was dispatched: ``out`` is what it hands on (the first stage's B and W hand on nothing: theirs
        are in ``stage``, an I's intermediates for W, else the gradients)."""
        now = self.now
        at = now[2] if now is not None else time.monotonic()
        probe = _probe(_handed_on(op, stage) if out is None else out)
        if out is not None and isinstance(stage, ReplicaGroup) and stage.grads is not None:
            probe += _probe(stage.grads)  # its last gradient operation: finished once reduced too
        ops = self.ops[w]
        if len(ops) >= self.limit[w]:  # amortized: an is_ready of a pending array costs more than the rest here
            while ops and _ready(ops[0][2]):  # in order on its devices, mostly: the front is what finished
                ops.popleft()
            self.limit[w] = max(PRUNE, 2 * len(ops))
        ops.append((op, at, probe))
        self.count[w] += 1
        self.last[w] = at
        self.now = None

    def dispatched(self) -> None:
        """Every operation is handed out: drop the finished ones; from now on the waiting thread prunes too."""
        self.prune(force=True)
        self.over = True

    def prune(self, force: bool = False) -> None:
        """Forget the operations that finished (their arrays are not held a moment longer than needed)."""
        if self.over or force:
            self.ops = [collections.deque(e for e in ops if not _ready(e[2])) for ops in self.ops]

    def commit(self) -> None:
        """The step's thread is about to update a stage: raises if the step was stopped, else notes the update."""
        with self.lock:
            if self.stopped:
                raise _Stopped()
            self.committed = True

    def stop(self) -> bool:
        """Stop the step at its next operation or update; whether an update had already begun."""
        with self.lock:
            self.stopped = True
            return self.committed

    def nows(self) -> tuple[list[Now], list[int]]:
        """Per worker its ``Now`` (the op being dispatched; else its first dispatched op not finished, and the
        value it waits for if that is not finished either; else its next op, or finished), and how many of its
        dispatched operations after that one have not finished."""
        now = self.now
        unfinished = [[e for e in list(ops) if not _ready(e[2])] for ops in self.ops]
        waiting = {e[0].key for ops in unfinished for e in ops}
        if now is not None:
            waiting.add(now[1].key)
        out: list[Now] = []
        after: list[int] = []
        for w, ops in enumerate(unfinished):
            if now is not None and now[0] == w:
                out.append((DISPATCHING, now[1], None, now[2]))
                after.append(0)
            elif ops:
                op, at, _ = ops[0]
                src = received(op, dependencies(op, self.num_stages))
                out.append((PENDING, op, src if src is not None and src in waiting else None, at))
                after.append(len(ops) - 1)
            elif self.count[w] < len(self.plans[w]):
                out.append((NEXT, self.plans[w][self.count[w]], None, self.last[w]))
                after.append(0)
            else:
                out.append((FINISHED, None, None, self.last[w]))
                after.append(0)
        since = self.program_since
        if since is not None:  # every operation is in the one call: each worker's first of the step names its part
            firsts = [ops[0] if ops else None for ops in self.plans]
            out = [n if n[0] == FINISHED else (PROGRAM, firsts[w], None, since) for w, n in enumerate(out)]
            after = [0] * len(out)
        return out, after

    def program_step(self) -> None:
        """The step runs as one compiled program (``program.StepProgram``): ``nows`` says so of every worker."""
        self.program_since = time.monotonic()


def _ready(probe: Sequence[jax.Array]) -> bool:
    for a in probe:
        if not is_ready(a):
            return False
    return True


T = TypeVar("T")


def run_untimed(
    pool: WorkerThreads,
    body: Callable[[], T],
    record: Dispatched,
    workers: Sequence[RunsOps],
    watch: Watch,
) -> T:
    """``body()`` (an untimed step) in ``pool``'s one thread, while this one waits for it.

    Past ``watch.step_timeout``, or on Ctrl-C, one error names what each worker is doing (as ``run_threads``' does)
    and the step's thread ends at its next operation; one still stuck after ``GRACE`` is left behind (``watch.stuck``).

    Args:
        pool: A ``WorkerThreads`` of one thread, kept across steps.
        body: The step; it hands ``record`` what it dispatches and calls ``record.commit()`` before each update.
        record: What the report is read off.
        workers: The stages' workers, whose rings the report writes.
        watch: ``step_timeout``, the report's path and the error's tail; filled in with ``stuck`` and ``applied``.

    Returns:
        What ``body`` returns.

    Raises:
        VjpsplitError: The step passed ``watch.step_timeout`` (what each worker does, the report's path).
        StepInterrupted: Ctrl-C during the step (the same line; also a ``KeyboardInterrupt``).
        Exception: What ``body`` raised.
    """
    out: list[T] = []
    (job,) = pool.start([lambda: out.append(body())])
    deadline = None if watch.step_timeout is None else record.t0 + watch.step_timeout
    try:
        if not wait_for(job.event, deadline, record.prune):
            reason = f"the step did not finish within step_timeout={watch.step_timeout:g} s"
            raise VjpsplitError(_stop_untimed(pool, job, record, workers, watch, reason))
    except KeyboardInterrupt as e:
        raise StepInterrupted(_stop_untimed(pool, job, record, workers, watch, "the step was interrupted")) from e
    if job.error is not None:
        raise job.error
    return out[0]


def _stop_untimed(
    pool: WorkerThreads, job: Job, record: Dispatched, workers: Sequence[RunsOps], watch: Watch, reason: str
) -> str:
    """Stop an untimed step: what each worker does (before anything moves on), its last operations written;
    the step's thread told to end, and left behind if it does not within ``GRACE``."""
    nows, after = record.nows()
    thread = pool.threads[0].ident if pool.threads else None  # the step's: a dispatch in JAX's compiler compiles
    nows = [compile_aware(now, thread) for now in nows]
    if record.program_since is not None and record.now is not None and compiling(thread):
        reason += "; the step's thread is compiling the step's program (its first call for these inputs)"
    elif all(n[0] != COMPILING for n in nows) and compiling(thread):  # outside the operations: placing the batch
        reason += "; the step's thread is compiling outside the operations (its first call for these inputs)"
    rings = worker_rings(record.plans, workers)
    t0, worker_of = record.t0, record.worker_of
    watch.applied = record.stop()
    stuck = not job.event.wait(GRACE)
    left = ""
    if stuck:
        pool.abandon()
        held = [w for w, n in enumerate(nows) if n[0] in (DISPATCHING, COMPILING, PENDING, PROGRAM)]
        watch.stuck = [clause(w, nows[w], t0, worker_of, None, after[w]) for w in held] or ["the step's thread"]
        inside = [w for w, n in enumerate(nows) if n[0] in (DISPATCHING, COMPILING)]
        # Where the thread is: inside an operation's dispatch (a CPU host callback can run there), else in a
        # fetch (a stage's squared sum, the loss) that waits for an unfinished operation, or for an update.
        pending = any(n[0] in (PENDING, PROGRAM) for n in nows)
        where = (
            "in the step's program's dispatch"
            if record.program_since is not None and record.now is not None
            else f"in worker {inside[0]}'s dispatch"
            if inside
            else "waiting for a result of the unfinished operations"
            if pending
            else "past its dispatch, in the stages' updates or the loss fetch"
            if record.over
            else "in its dispatch, between operations"
        )
        left = f"; still stuck after {GRACE:g} s: the step's thread ({where}){watch.hint}"
    elif watch.applied:
        left = f"; it was stopped during its stages' updates{watch.hint}"
    return stop_report(reason, nows, rings, t0, worker_of, watch, left, after)
