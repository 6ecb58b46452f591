"""The in-process runner: every operation dispatched from one thread, or, timed, one thread per worker.

Untimed (``dispatch``), the driver hands each operation to its stage's device in
the one play of plans' order and nothing waits: ``jit`` dispatches asynchronously,
so the devices run side by side while the driver is already further on. Timed
(``run_threads``), each worker runs its list in a thread of its own
(``WorkerThreads``, kept across steps) and waits for each operation's results, so
its events are compute times. A Trainer's untimed step runs its dispatch, in the
same order, in one kept helper thread (``run_untimed``) while the caller waits with
``step_timeout`` and Ctrl-C; ``Dispatched`` records what was handed out, so a
stuck step names each worker's unfinished operation. There each mailbox has its own event, and each
worker its own queue of operations, so a message wakes only the thread that reads
it: the cost of an operation does not grow with the number of stages.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import queue
import threading
import time
import weakref
from typing import TYPE_CHECKING, Callable, Mapping, Sequence, TypeAlias, TypeVar

import jax

from ...errors import VjpsplitError
from ..schedules.ops import Kind, Op, dependencies, received
from ..schedules.stepplans import resolve
from ..schedules.timeline import Phase
from ..stages.directory import StageInputs, Stages
from .devices import placed, placement
from .dispatch import Order, Submit, progress_bar, walk
from .flight import (
    DISPATCHING,
    DONE,
    FINISH,
    FINISHED,
    NEXT,
    PENDING,
    RUNS,
    WAITS,
    Now,
    StepInterrupted,
    clause,
    default_path,
    hang_message,
    idle,
    ring_rows,
    write_flight,
)
from .model import Microbatch, Model, model_of, side_for
from .offload import Offload, offload_of
from .result import PipelineResult, step_result
from .replicas import Parts, ReplicaGroup
from .worker import RunsOps, StageWorker, run_op
from ...treetypes import Leaf, PyTree

if TYPE_CHECKING:
    from ...artifact.artifact import Artifact

# A stage worker's last operations (kind, mb, start, end), oldest first.
Ring: TypeAlias = "list[tuple[str, int, float, float]]"

RUNNER = "in-process"


class _Mailbox:
    """One value handed from one stage to the next, with the event its reader waits on."""

    __slots__ = ("event", "value")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: object = None

    def put(self, value: object) -> None:
        self.value = value
        self.event.set()

    def get(self) -> object:
        self.event.wait()
        return self.value


_FAILED = object()  # posted in place of a value whose operation failed or was skipped


def run_inprocess(
    artifacts: Sequence[Artifact] | Stages,
    params: PyTree,
    x: PyTree,
    side: Mapping[str, Leaf] | Sequence[Leaf] = (),
    *,
    microbatches: int,
    schedule_name: str = "1f1b",
    progress: bool = False,
    devices: Sequence[Sequence[jax.Device]] | None = None,
    schedule: Sequence[Sequence[Op]] | None = None,
    timed: bool = True,
    offload: Offload | str | None = None,
) -> PipelineResult:
    """Run one training step in this process, every stage on its own device where this host has enough.

    ``schedule`` (plans, e.g. from ``read_schedule``) runs instead of ``schedule_name``, once checked.

    ``devices``: one list of devices per stage (one device for an unsharded stage, a
    sharded stage's mesh devices); by default worker k's stages run on
    ``jax.local_devices()[k]`` (the k-th group for sharded stages) where there are
    enough, else all on the default device (``devices.placement``). Parameters and
    residuals stay on their stage's device; activations and cotangents are moved
    device to device. ``timed=True`` (the default) runs one thread per worker and
    waits for each operation, so the result's timeline holds real compute times;
    ``timed=False`` dispatches every operation from this thread without waiting (no
    timeline), as ``Trainer`` does. ``progress=True`` (a bar over operations) times
    the step too. ``offload`` (``"host"`` or an ``offload.Offload``): residuals leave their device between
    F and B (bitwise the same gradients). A ``Stages`` takes the whole ``params`` and the batch tuple as
    ``x``, and its gradients come back in ``params``' structure.

    Args:
        artifacts: A ``Stages``, or one artifact per stage.
        params: The whole parameter pytree for a ``Stages``, else one parameter pytree per stage.
        x: The batch tuple for a ``Stages``, else the first stage's input.
        side: The last stage's side inputs (a ``Stages`` takes none).
        microbatches: How many microbatches to split the batch into.
        schedule_name: The built-in schedule (by default ``"1f1b"``).
        progress: Whether to show a progress bar over operations (the step is then timed).
        devices: One list of devices per stage; ``None`` places them as above.
        schedule: Plans to run instead of ``schedule_name``, once checked; ``None`` for the named schedule.
        timed: Whether to run one thread per worker and time each operation.
        offload: Residuals off their device between F and B: ``"host"`` or an ``offload.Offload``; gradients
            are bitwise those without; ``None``: none.

    Returns:
        The step's ``PipelineResult`` (``runner="in-process"``).

    Raises:
        VjpsplitError: If the schedule or plans cannot run on these stages and
            microbatches, a stage lacks the split backward the plans use, the
            artifacts and parameter sets differ in number, ``devices`` is malformed,
            the batch does not split into ``microbatches`` equal parts, or an
            operation fails (naming its stage).
    """
    model = model_of(artifacts, params)
    name, plans, mbs, workers = _prepared(model, x, side, microbatches, schedule_name, schedule, devices, offload)
    timed = timed or progress
    t0 = time.monotonic()
    _play(workers, plans, mbs, microbatches, timed, progress)
    return _result(model, name, plans, microbatches, workers, t0, timed)


def _prepared(
    model: Model,
    x: PyTree,
    side: Mapping[str, Leaf] | Sequence[Leaf],
    microbatches: int,
    schedule_name: str,
    schedule: Sequence[Sequence[Op]] | None,
    devices: Sequence[Sequence[jax.Device]] | None,
    offload: Offload | str | None,
) -> tuple[str, list[list[Op]], list[Microbatch], list[StageWorker]]:
    """The step's schedule name and plans (checked), its microbatches, and one worker per stage on its devices."""
    S = model.num_stages
    name, plans, layout = resolve(schedule_name, schedule, S, microbatches)
    where = placement(model.artifacts, layout.workers, devices)
    arts = placed(model.artifacts, where)
    model.check_plans(name, plans)
    mbs = model.microbatches(x, side, microbatches)
    spec = offload_of(offload)
    workers = [StageWorker(a, p, i, S, g[0], spec) for i, (a, p, g) in enumerate(zip(arts, model.stage_params, where))]
    return name, plans, mbs, workers


def _play(
    workers: Sequence[StageWorker],
    plans: Sequence[Sequence[Op]],
    mbs: Sequence[Microbatch],
    microbatches: int,
    timed: bool,
    progress: bool,
) -> None:
    """The step itself: timed on worker threads of its own (closed after it), else dispatched from this thread."""
    if timed:
        with WorkerThreads(len(plans)) as pool:
            run_threads(pool, workers, plans, mbs, microbatches, progress=progress)
    else:
        dispatch(workers, plans, mbs, microbatches)


def _result(
    model: Model,
    name: str,
    plans: Sequence[Sequence[Op]],
    microbatches: int,
    workers: Sequence[StageWorker],
    t0: float,
    timed: bool,
) -> PipelineResult:
    """The finished step's ``PipelineResult``: its losses, gradients (in the model's form) and events."""
    grads = [st.grads for st in workers]
    losses = workers[-1].fetch_losses()
    jax.block_until_ready(grads)
    return step_result(
        schedule=name,
        plans=plans,
        num_stages=model.num_stages,
        microbatches=microbatches,
        runner=RUNNER,
        step_time=time.monotonic() - t0,
        losses=losses,
        grads=model.gather(grads),
        events=[e for st in workers for e in st.events],
        timed=timed,
    )


def dispatch(
    workers: Sequence[RunsOps],
    plans: Sequence[Sequence[Op]],
    mbs: Sequence[Microbatch],
    microbatches: int,
    order: Order | None = None,
    record: Dispatched | None = None,
) -> None:
    """One step of ``plans`` on the stages' ``workers`` (reset first), every operation dispatched from this thread.

    Nothing waits: each operation is handed to its stage's device as soon as the
    operations it reads are (the one play of plans' order), and ``jit``'s
    asynchronous dispatch runs the devices side by side. ``order``: ``dispatch.order_of(plans)``, if kept.
    ``record``: notes each operation as it is handed out (``Dispatched``), and stops the step once stopped.
    """
    for st in workers:
        st.reset(timed=False, plans=plans)
    mbs = placed_microbatches(mbs, workers)

    def submit(w: int, op: Op, data: object, side: list[Leaf]) -> PyTree:
        return run_op(workers[op.stage], op, data, side, microbatches, w)

    def noted(w: int, op: Op, data: object, side: list[Leaf]) -> PyTree:
        assert record is not None
        record.begin(w, op)
        out = run_op(workers[op.stage], op, data, side, microbatches, w)
        record.end(w, op, out, workers[op.stage])
        return out

    walk(plans, len(workers), mbs, submit if record is None else noted, order)
    if record is not None:
        record.dispatched()


def run_threads(
    pool: WorkerThreads,
    workers: Sequence[RunsOps],
    plans: Sequence[Sequence[Op]],
    mbs: Sequence[Microbatch],
    microbatches: int,
    *,
    progress: bool = False,
    tail: Callable[[int, bool], None] | None = None,
    order: Order | None = None,
    watch: Watch | None = None,
) -> None:
    """One timed step of ``plans`` on the stages' ``workers`` (reset first), worker w in ``pool``'s thread w.

    Each operation waits for its results and records its ``Event``. ``tail(w,
    failed)`` runs in worker ``w``'s thread after its last operation (``failed``:
    some operation of the step failed, or handing the step out did); what it
    raises is the step's error. ``order``: ``dispatch.order_of(plans)``, if kept.
    ``watch``: the step's timeout and hang report (``Watch``; default: neither). A step past its timeout
    is one ``VjpsplitError`` naming what each worker is doing; Ctrl-C, a ``StepInterrupted`` saying the same.
    """
    for st in workers:
        st.reset(timed=True, plans=plans)
    mbs = placed_microbatches(mbs, workers)
    threads = _Threads(plans, workers, microbatches, progress, tail)
    threads.run(pool, lambda submit: walk(plans, len(workers), mbs, submit, order), watch or Watch())


def placed_microbatches(mbs: Sequence[Microbatch], workers: Sequence[RunsOps]) -> list[Microbatch]:
    """The microbatches' batch inputs on the device of the stage that reads each: one transfer per stage."""
    S = len(workers)
    reads = [[(x if s == 0 else None, side_for(side, s, S)) for x, side in mbs] for s in range(S)]
    moved = [w.to_device(r) for w, r in zip(workers, reads)]
    out: list[Microbatch] = []
    for m, (_, side) in enumerate(mbs):
        placed_side = (
            StageInputs({s: moved[s][m][1] for s in side}) if isinstance(side, StageInputs) else moved[S - 1][m][1]
        )
        out.append((moved[0][m][0], placed_side))
    return out


class _Job:
    """One job handed to a worker thread: ``event`` set when it is over, ``error`` what escaped it."""

    __slots__ = ("event", "error")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.error: BaseException | None = None


# A worker thread's jobs, each with what says it is over; None ends the thread.
JobQueue: TypeAlias = "queue.SimpleQueue[tuple[Callable[[], None], _Job] | None]"


class WorkerThreads:
    """One thread per worker, started once and reused by every step until ``close`` (a Trainer's lifetime).

    A pool dropped without ``close`` ends its threads when it is collected (``weakref.finalize``: the
    threads hold their queues, never the pool), so a Trainer nobody closed leaves no thread behind.
    A job that raises never ends its thread: its error is the job's (``_Job.error``). ``name``: the threads'
    names' prefix (``<name>-<w>``).
    """

    def __init__(self, n: int, name: str = "vjpsplit-worker"):
        self.queues: list[JobQueue] = [queue.SimpleQueue() for _ in range(n)]
        self.threads = [
            threading.Thread(target=_serve, args=(q,), name=f"{name}-{w}", daemon=True)
            for w, q in enumerate(self.queues)
        ]
        for t in self.threads:
            t.start()
        self._stop = weakref.finalize(self, _stop_threads, self.queues)

    def start(self, jobs: Sequence[Callable[[], None]]) -> list[_Job]:
        """Run ``jobs[w]`` in thread ``w``; each returned job's event is set when it is done."""
        if not self.threads:
            raise RuntimeError("these worker threads are closed")
        done = [_Job() for _ in jobs]
        for q, job, d in zip(self.queues, jobs, done):
            q.put((job, d))
        return done

    def close(self) -> None:
        """End the threads (after the jobs they hold)."""
        self._stop()
        for t in self.threads:
            t.join()
        self.threads = []

    def abandon(self) -> None:
        """Tell the threads to end after their jobs, waiting for none: one is stuck in an operation."""
        self._stop()
        self.threads = []

    def __enter__(self) -> WorkerThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _stop_threads(queues: Sequence[JobQueue]) -> None:
    for q in queues:
        q.put(None)


def _serve(jobs: JobQueue) -> None:
    while (item := jobs.get()) is not None:
        job, done = item
        try:
            job()
        except BaseException as e:  # noqa: BLE001 - the step's error (run checks it); the thread serves on
            done.error = e
        finally:
            done.event.set()
            del job, item, done  # hold nothing of a step between steps


def _wait(event: threading.Event, deadline: float | None, tick: Callable[[], None] | None = None) -> bool:
    """``event.wait`` until ``deadline`` (None: for good) in short slices: Ctrl-C reaches the main thread
    between them even where the signal lands on another thread. ``tick()`` runs after each slice that ends
    without the event."""
    while True:
        left = 0.25 if deadline is None else min(deadline - time.monotonic(), 0.25)
        if event.wait(max(left, 0.0)):
            return True
        if deadline is not None and time.monotonic() >= deadline:
            return False
        if tick is not None:
            tick()


def _rings(plans: Sequence[Sequence[Op]], workers: Sequence[RunsOps]) -> list[list[tuple[int, Ring]]]:
    """Per worker, each of its stages' ring as it is now (stage, operations)."""
    return [[(s, list(workers[s].ring)) for s in sorted({o.stage for o in ops})] for ops in plans]


def _report(
    reason: str,
    nows: Sequence[Now],
    rings: Sequence[Sequence[tuple[int, Ring]]],
    t0: float,
    worker_of: dict[int, int],
    watch: Watch,
    left: str,
    after: Sequence[int] | None = None,
) -> str:
    """A stopped step's one-line error, timed or not: every worker's clause, its last operations written to
    ``watch.report_path`` (``flight.write_flight``; the line says so, or that it could not be written)."""
    rows = []
    for w, held in enumerate(rings):
        ops = sorted((r for s, ring in held for r in ring_rows(ring, s, t0)), key=lambda r: r["start_ms"])
        now = clause(w, nows[w], t0, worker_of, None, after[w] if after else 0)
        rows.append({"worker": w, "now": now, "ops": ops})
    path = watch.report_path or default_path()
    message = hang_message(reason, nows, t0, worker_of, path, left, after=after)
    if write_flight(path, message, rows) is None:
        message = hang_message(reason, nows, t0, worker_of, None, f" (could not write {path}){left}", after=after)
    return message


GRACE = 1.0  # seconds the workers get to drain a stopped step before their threads are left behind


class _Threads:
    """One step on the worker threads: each worker runs its list of operations, in order, from its inbox."""

    def __init__(
        self,
        plans: Sequence[Sequence[Op]],
        workers: Sequence[RunsOps],
        microbatches: int,
        progress: bool,
        tail: Callable[[int, bool], None] | None,
    ):
        self.plans, self.workers, self.microbatches, self.tail = plans, workers, microbatches, tail
        # Per worker: (op, its input or the mailbox it arrives in, side inputs, its result's mailbox); no op: drain.
        self.inboxes: list[queue.SimpleQueue[tuple[Op | None, object, list[Leaf], _Mailbox]]] = [
            queue.SimpleQueue() for _ in plans
        ]
        self.errors: list[BaseException] = []
        self.bar = progress_bar(sum(len(p) for p in plans), progress)
        self.bar_lock = threading.Lock()
        self.nows: list[Now] = [idle() for _ in plans]  # what each worker does now (flight)
        self.boxes: list[_Mailbox] = []
        self.worker_of = {op.stage: w for w, ops in enumerate(plans) for op in ops}

    def submit(self, w: int, op: Op, data: object, side: list[Leaf]) -> _Mailbox:
        """Queue ``op`` for worker ``w``; its result arrives in the returned mailbox."""
        box = _Mailbox()
        self.boxes.append(box)
        self.inboxes[w].put((op, data, side, box))
        return box

    def run(self, pool: WorkerThreads, drive: Callable[[Submit[_Mailbox]], object], watch: Watch) -> None:
        """The workers' lists in ``pool``'s threads, ``drive(submit)`` hands them the step; wait; the first error
        is raised here. Past ``watch.step_timeout``, or on Ctrl-C, one error says what each worker is doing."""
        t0 = time.monotonic()
        done = pool.start([functools.partial(self._worker, w) for w in range(len(self.plans))])
        try:
            try:
                drive(self.submit)
            except BaseException as e:
                # Counted as the step's failure, so no worker's tail updates its stages from a partial step.
                self.errors.append(e)
                for w, box in enumerate(self.inboxes):  # let every thread drain its list and end
                    for _ in self.plans[w]:
                        box.put((None, _FAILED, [], _Mailbox()))
                raise
            watch.phases.append(Phase(None, "hand out", t0, time.monotonic()))
            t1 = time.monotonic()
            deadline = None if watch.step_timeout is None else t0 + watch.step_timeout
            try:
                for d in done:
                    if not _wait(d.event, deadline):
                        reason = f"the step did not finish within step_timeout={watch.step_timeout:g} s"
                        raise VjpsplitError(self._stop(pool, done, watch, reason, t0))
            except KeyboardInterrupt as e:
                raise StepInterrupted(self._stop(pool, done, watch, "the step was interrupted", t0)) from e
            watch.phases.append(Phase(None, "wait for the workers", t1, time.monotonic()))
        finally:
            for d in done if pool.threads else []:
                d.event.wait()
            if self.bar is not None:
                self.bar.close()
        for d in done:
            if d.error is not None:
                self.errors.append(d.error)
        if self.errors:
            raise self.errors[0]

    def _stop(self, pool: WorkerThreads, done: Sequence[_Job], watch: Watch, reason: str, t0: float) -> str:
        """Stop a step that is stuck or interrupted: what each worker does, its last operations written
        (``flight.write_flight``), every wait released; threads still stuck after ``GRACE`` are left behind."""
        nows = list(self.nows)  # as the step stopped, before anything is released
        rings = _rings(self.plans, self.workers)
        self.errors.append(VjpsplitError(reason))  # every worker drains the rest of its list
        if watch.on_stop is not None:
            watch.on_stop()
        for box in list(self.boxes):
            if not box.event.is_set():
                box.put(_FAILED)
        end = time.monotonic() + GRACE
        stuck = [w for w, d in enumerate(done) if not d.event.wait(max(end - time.monotonic(), 0.0))]
        if stuck:
            pool.abandon()
            watch.stuck = [clause(w, nows[w], t0, self.worker_of) for w in stuck]
        left = f"; still stuck after {GRACE:g} s: worker {', '.join(map(str, stuck))}{watch.hint}" if stuck else ""
        return _report(reason, nows, rings, t0, self.worker_of, watch, left)

    def _worker(self, w: int) -> None:
        errors, nows = self.errors, self.nows
        for _ in range(len(self.plans[w])):
            op, data, side, box = self.inboxes[w].get()
            try:
                if isinstance(data, _Mailbox) and op is not None:  # a drained entry (no op) holds _FAILED
                    if not data.event.is_set():
                        nows[w] = (WAITS, op, received(op, dependencies(op, len(self.workers))), time.monotonic())
                    data = data.get()
                if errors or data is _FAILED or op is None:  # drain the list without running on missing inputs
                    box.put(_FAILED)
                    continue
                nows[w] = (RUNS, op, None, time.monotonic())
                box.put(run_op(self.workers[op.stage], op, data, side, self.microbatches, w))
                nows[w] = (NEXT, None, None, time.monotonic())
                if self.bar is not None:
                    with self.bar_lock:
                        self.bar.update(1)
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                # Whatever raised (the operation, or the bar), its readers must not wait for it.
                errors.append(e)
                if not box.event.is_set():
                    box.put(_FAILED)
        if self.tail is not None:
            nows[w] = (FINISH, None, None, time.monotonic())
            try:
                self.tail(w, bool(errors))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)
        nows[w] = (DONE, None, None, time.monotonic())


@dataclasses.dataclass
class Watch:
    """How a timed step is watched: ``step_timeout`` (None: no limit), where a stuck step's report goes
    (``report_path``; None: ``flight.default_path``), ``hint`` (what to do when a thread stays stuck, appended to
    the error), ``on_stop``
    (releases waits outside the operations, e.g. a barrier). Filled in: ``phases`` (the driver's) and
    ``stuck`` (after a stop, the workers whose threads were left behind, each in words), ``applied`` (an
    untimed step stopped once its updates had begun)."""

    step_timeout: float | None = None
    report_path: str | None = None
    hint: str = ""
    on_stop: Callable[[], None] | None = None
    phases: list[Phase] = dataclasses.field(default_factory=list)
    stuck: list[str] = dataclasses.field(default_factory=list)
    applied: bool = False  # an untimed step stopped after its first update began: its stages may be half-updated


class _Stopped(Exception):
    """Raised in an untimed step's thread at its next operation (or update) once the step was stopped."""


def _probe(tree: object, array: type[jax.Array]) -> tuple[jax.Array, ...]:
    """What asks ``is_ready`` for the operation that produced ``tree``: one of its arrays (all the outputs of
    one execution are ready at once, so any one tells; the first, to walk no tree where there is none), or
    one per replica for a ``Parts`` (replica r's on its device). ``array``: ``jax.Array``."""
    if isinstance(tree, array):
        return (tree,)
    if isinstance(tree, Parts):
        return tuple(a for part in tree for a in _probe(part, array))
    if isinstance(tree, (tuple, list)) and tree and isinstance(tree[0], array):
        return (tree[0],)
    for leaf in jax.tree_util.tree_leaves(tree):
        if isinstance(leaf, array):
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
        self.array = jax.Array  # what _probe looks for, looked up once
        self.plans, self.num_stages = plans, num_stages
        self.t0 = time.monotonic()
        self.ops: list[collections.deque[tuple[Op, float, Sequence[jax.Array]]]] = [collections.deque() for _ in plans]
        self.count = [0] * len(plans)  # operations handed out per worker (ops drops the finished ones)
        self.limit = [PRUNE] * len(plans)  # how many a worker's ops may hold before its front is pruned again
        self.last = [self.t0] * len(plans)  # when each worker's last operation was handed out
        self.now: tuple[int, Op, float] | None = None
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
        probe = _probe(_handed_on(op, stage) if out is None else out, self.array)
        if out is not None and isinstance(stage, ReplicaGroup) and stage.grads is not None:
            probe += _probe(stage.grads, self.array)  # its last gradient operation: finished once reduced too
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
        return out, after


def _ready(probe: Sequence[jax.Array]) -> bool:
    for a in probe:
        if not a.is_ready():  # type: ignore[attr-defined]  # public, not in jax.Array's stub
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
    """``body()`` (an untimed step: ``dispatch`` with ``record``, then what follows it) in ``pool``'s one thread,
    while this one waits: past ``watch.step_timeout``, or on Ctrl-C, one error names what each worker is doing
    (as ``run_threads``' does) and the step's thread ends at its next operation; one still stuck after ``GRACE``
    is left behind (``watch.stuck``).

    Args:
        pool: a ``WorkerThreads`` of one thread, kept across steps.
        body: the step; it must hand ``record`` every operation it dispatches (``dispatch(..., record)``) and
            call ``record.commit()`` before each stage's update.
        record: what the report is read off.
        workers: the stages' workers, whose rings the report writes.
        watch: ``step_timeout``, where the report goes and what to append to the error; filled in with
            ``stuck`` and ``applied``.

    Returns:
        What ``body`` returns.

    Raises:
        VjpsplitError: the step passed ``watch.step_timeout`` (what each worker does, the report's path).
        StepInterrupted: Ctrl-C during the step (the same line; also a ``KeyboardInterrupt``).
        Exception: what ``body`` raised.
    """
    out: list[T] = []
    (job,) = pool.start([lambda: out.append(body())])
    deadline = None if watch.step_timeout is None else record.t0 + watch.step_timeout
    try:
        if not _wait(job.event, deadline, record.prune):
            reason = f"the step did not finish within step_timeout={watch.step_timeout:g} s"
            raise VjpsplitError(_stop_untimed(pool, job, record, workers, watch, reason))
    except KeyboardInterrupt as e:
        raise StepInterrupted(_stop_untimed(pool, job, record, workers, watch, "the step was interrupted")) from e
    if job.error is not None:
        raise job.error
    return out[0]


def _stop_untimed(
    pool: WorkerThreads, job: _Job, record: Dispatched, workers: Sequence[RunsOps], watch: Watch, reason: str
) -> str:
    """Stop an untimed step: what each worker does (before anything moves on), its last operations written;
    the step's thread told to end, and left behind if it does not within ``GRACE``."""
    nows, after = record.nows()
    rings = _rings(record.plans, workers)
    t0, worker_of = record.t0, record.worker_of
    watch.applied = record.stop()
    stuck = not job.event.wait(GRACE)
    left = ""
    if stuck:
        pool.abandon()
        held = [w for w, n in enumerate(nows) if n[0] in (DISPATCHING, PENDING)]
        watch.stuck = [clause(w, nows[w], t0, worker_of, None, after[w]) for w in held] or ["the step's thread"]
        inside = [w for w, n in enumerate(nows) if n[0] == DISPATCHING]
        # Where the thread is: inside an operation's dispatch (a CPU host callback can run there), else in a
        # fetch (a stage's squared sum, the loss) that waits for an unfinished operation, or for an update.
        pending = any(n[0] == PENDING for n in nows)
        where = (
            f"in worker {inside[0]}'s dispatch"
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
    return _report(reason, nows, rings, t0, worker_of, watch, left, after)
