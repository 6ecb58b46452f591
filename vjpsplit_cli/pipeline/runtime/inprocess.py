"""The in-process runner: every operation dispatched from one thread, or, timed, one thread per worker.

Untimed (``dispatch``), the driver hands each operation to its stage's device in
the one play of plans' order and nothing waits: ``jit`` dispatches asynchronously,
so the devices run side by side while the driver is already further on. Timed
(``run_threads``), each worker runs its list in a thread of its own
(``WorkerThreads``, kept across steps) and waits for each operation's results, so
its events are compute times. There each mailbox has its own event, and each
worker its own queue of operations, so a message wakes only the thread that reads
it: the cost of an operation does not grow with the number of stages.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from typing import Any, Callable, Sequence

from ..schedules.ops import Op, split_ops
from ..schedules.plans import resolve
from ..stages.directory import PerStage, Stages
from .devices import placed, placement
from .dispatch import Order, Submit, progress_bar, walk
from .model import Microbatch, model_of, side_for
from .result import PipelineResult, step_result
from .worker import StageWorker, run_op

RUNNER = "in-process"


class _Mailbox:
    """One value handed from one stage to the next, with the event its reader waits on."""

    __slots__ = ("event", "value")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = None

    def put(self, value: Any) -> None:
        self.value = value
        self.event.set()

    def get(self) -> Any:
        self.event.wait()
        return self.value


_FAILED = object()  # posted in place of a value whose operation failed or was skipped


def run_inprocess(
    artifacts: Sequence[Any] | Stages,
    params: Any,
    x: Any,
    side: Any = (),
    *,
    microbatches: int,
    schedule_name: str = "1f1b",
    progress: bool = False,
    devices: Sequence[Sequence[Any]] | None = None,
    schedule: Sequence[Sequence[Op]] | None = None,
    timed: bool = True,
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
    the step too. A ``Stages`` takes the whole ``params`` and the batch tuple as
    ``x``, and its gradients come back in ``params``' structure.
    """
    model = model_of(artifacts, params)
    S = model.num_stages
    name, plans, layout = resolve(schedule_name, schedule, S, microbatches)
    where = placement(model.artifacts, layout.workers, devices)
    arts = placed(model.artifacts, where)
    model.check_plans(name, plans)
    mbs = model.microbatches(x, side, microbatches)
    workers = [StageWorker(a, p, i, S, g[0]) for i, (a, p, g) in enumerate(zip(arts, model.stage_params, where))]
    timed = timed or progress
    t0 = time.monotonic()
    if timed:
        with WorkerThreads(len(plans)) as pool:
            run_threads(pool, workers, plans, mbs, microbatches, progress=progress)
    else:
        dispatch(workers, plans, mbs, microbatches)
    grads = [st.grads for st in workers]
    losses = workers[-1].fetch_losses()
    import jax

    jax.block_until_ready(grads)
    return step_result(
        schedule=name,
        plans=plans,
        num_stages=S,
        microbatches=microbatches,
        runner=RUNNER,
        step_time=time.monotonic() - t0,
        losses=losses,
        grads=model.gather(grads),
        events=[e for st in workers for e in st.events],
        timed=timed,
    )


def dispatch(
    workers: Sequence[StageWorker],
    plans: Sequence[Sequence[Op]],
    mbs: Sequence[Microbatch],
    microbatches: int,
    order: Order | None = None,
) -> None:
    """One step of ``plans`` on the stages' ``workers`` (reset first), every operation dispatched from this thread.

    Nothing waits: each operation is handed to its stage's device as soon as the
    operations it reads are (the one play of plans' order), and ``jit``'s
    asynchronous dispatch runs the devices side by side. ``order``: ``dispatch.order_of(plans)``, if kept.
    """
    for st in workers:
        st.reset(timed=False)
    split = split_ops(plans)
    mbs = placed_microbatches(mbs, workers)

    def submit(w: int, op: Op, data: Any, side: list[Any]) -> Any:
        return run_op(workers[op.stage], op, data, side, microbatches, (op.stage, op.mb) in split, w)

    walk(plans, len(workers), mbs, submit, order)


def run_threads(
    pool: WorkerThreads,
    workers: Sequence[StageWorker],
    plans: Sequence[Sequence[Op]],
    mbs: Sequence[Microbatch],
    microbatches: int,
    *,
    progress: bool = False,
    tail: Callable[[int, bool], None] | None = None,
    order: Order | None = None,
) -> None:
    """One timed step of ``plans`` on the stages' ``workers`` (reset first), worker w in ``pool``'s thread w.

    Each operation waits for its results and records its ``Event``. ``tail(w,
    failed)`` runs in worker ``w``'s thread after its last operation (``failed``:
    some operation of the step failed, or handing the step out did); what it
    raises is the step's error. ``order``: ``dispatch.order_of(plans)``, if kept.
    """
    for st in workers:
        st.reset(timed=True)
    mbs = placed_microbatches(mbs, workers)
    threads = _Threads(plans, workers, split_ops(plans), microbatches, progress, tail)
    threads.run(pool, lambda submit: walk(plans, len(workers), mbs, submit, order))


def placed_microbatches(mbs: Sequence[Microbatch], workers: Sequence[StageWorker]) -> list[Microbatch]:
    """The microbatches' batch inputs on the device of the stage that reads each: one transfer per stage."""
    S = len(workers)
    reads = [[(x if s == 0 else None, side_for(side, s, S)) for x, side in mbs] for s in range(S)]
    moved = [w.to_device(r) for w, r in zip(workers, reads)]
    out: list[Microbatch] = []
    for m, (_, side) in enumerate(mbs):
        placed_side = PerStage({s: moved[s][m][1] for s in side}) if isinstance(side, PerStage) else moved[S - 1][m][1]
        out.append((moved[0][m][0], placed_side))
    return out


class WorkerThreads:
    """One thread per worker, started once and reused by every step until ``close`` (a Trainer's lifetime)."""

    def __init__(self, n: int):
        self.queues: list[queue.SimpleQueue[Any]] = [queue.SimpleQueue() for _ in range(n)]
        self.threads = [
            threading.Thread(target=_serve, args=(q,), name=f"vjpsplit-worker-{w}", daemon=True)
            for w, q in enumerate(self.queues)
        ]
        for t in self.threads:
            t.start()

    def start(self, jobs: Sequence[Callable[[], None]]) -> list[threading.Event]:
        """Run ``jobs[w]`` in thread ``w``; each returned event is set when its job is done."""
        if not self.threads:
            raise RuntimeError("these worker threads are closed")
        done = [threading.Event() for _ in jobs]
        for q, job, d in zip(self.queues, jobs, done):
            q.put((job, d))
        return done

    def close(self) -> None:
        """End the threads (after the jobs they hold)."""
        for q in self.queues:
            q.put(None)
        for t in self.threads:
            t.join()
        self.threads = []

    def __enter__(self) -> WorkerThreads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve(jobs: queue.SimpleQueue[Any]) -> None:
    while (item := jobs.get()) is not None:
        job, done = item
        try:
            job()
        finally:
            done.set()
            del job, item  # hold nothing of a step between steps


class _Threads:
    """One step on the worker threads: each worker runs its list of operations, in order, from its inbox."""

    def __init__(
        self,
        plans: Sequence[Sequence[Op]],
        workers: Sequence[StageWorker],
        split: set[tuple[int, int]],
        microbatches: int,
        progress: bool,
        tail: Callable[[int, bool], None] | None,
    ):
        self.plans, self.workers, self.split, self.microbatches, self.tail = plans, workers, split, microbatches, tail
        self.inboxes: list[queue.SimpleQueue[tuple[Any, Any, Any, _Mailbox]]] = [queue.SimpleQueue() for _ in plans]
        self.errors: list[BaseException] = []
        self.bar = progress_bar(sum(len(p) for p in plans), progress)
        self.bar_lock = threading.Lock()

    def submit(self, w: int, op: Op, data: Any, side: list[Any]) -> _Mailbox:
        """Queue ``op`` for worker ``w``; its result arrives in the returned mailbox."""
        box = _Mailbox()
        self.inboxes[w].put((op, data, side, box))
        return box

    def run(self, pool: WorkerThreads, drive: Callable[[Submit], Any]) -> None:
        """The workers' lists in ``pool``'s threads, ``drive(submit)`` hands them the step; wait; the first error is raised here."""
        done = pool.start([functools.partial(self._worker, w) for w in range(len(self.plans))])
        try:
            drive(self.submit)
        except BaseException as e:
            # Counted as the step's failure, so no worker's tail updates its stages from a partial step.
            self.errors.append(e)
            for w, box in enumerate(self.inboxes):  # let every thread drain its list and end
                for _ in self.plans[w]:
                    box.put((None, _FAILED, [], _Mailbox()))
            raise
        finally:
            for d in done:
                d.wait()
            if self.bar is not None:
                self.bar.close()
        if self.errors:
            raise self.errors[0]

    def _worker(self, w: int) -> None:
        errors = self.errors
        for _ in range(len(self.plans[w])):
            op, data, side, box = self.inboxes[w].get()
            if isinstance(data, _Mailbox):
                data = data.get()
            if errors or data is _FAILED:  # drain the list without running on missing inputs
                box.put(_FAILED)
                continue
            try:
                split = (op.stage, op.mb) in self.split
                box.put(run_op(self.workers[op.stage], op, data, side, self.microbatches, split, w))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)
                box.put(_FAILED)
            if self.bar is not None:
                with self.bar_lock:
                    self.bar.update(1)
        if self.tail is not None:
            try:
                self.tail(w, bool(errors))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)
