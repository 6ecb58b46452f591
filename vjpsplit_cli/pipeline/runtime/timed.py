"""A timed step: each worker runs its list of operations in a thread of its own and waits for each one.

``run_threads`` hands the step to ``WorkerThreads`` (kept across steps): the driver
walks the plans' execution order (``dispatch.walk``) and queues each operation on
its worker's inbox; the worker waits for the value it reads, runs the operation,
waits for its results, and records its ``Event``, so the events are compute times.
Each mailbox has its own event, and each worker its own queue of operations, so a
message wakes only the thread that reads it: the cost of an operation does not grow
with the number of stages. A step past its ``Watch``'s timeout, or interrupted, is
one error naming what each worker is doing.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from typing import Callable, Sequence

from ...errors import VjpsplitError
from ..schedules.ops import Op, dependencies, received
from ..schedules.timeline import Phase
from .dispatch import Order, Submit, placed_microbatches, progress_bar, walk
from .hang_report import DONE, FINISH, NEXT, RUNS, WAITS, Now, StepInterrupted, clause, compile_aware, idle
from .model import Microbatch
from .stepwatch import GRACE, Watch, stop_report, worker_rings
from .stageops import RunsOps, run_op
from .workerthreads import Job, WorkerThreads, wait_for
from ...treetypes import Leaf


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
    scales: Sequence[float] | None = None,
) -> None:
    """One timed step of ``plans`` on the stages' ``workers`` (reset first), worker w in ``pool``'s thread w.

    Each operation waits for its results and records its ``Event``. ``tail(w,
    failed)`` runs in worker ``w``'s thread after its last operation (``failed``:
    some operation of the step failed, or handing the step out did); what it
    raises is the step's error. ``order``: ``dispatch.order_of(plans)``, if kept.
    ``watch``: the step's timeout and hang report (``Watch``; default: neither). A step past its timeout
    is one ``VjpsplitError`` naming what each worker is doing; Ctrl-C, a ``StepInterrupted`` saying the same.
    ``scales``: per microbatch, the last stage's starting cotangent (``StageWorker.reset``); None: equal.
    """
    for st in workers:
        st.reset(timed=True, plans=plans, scales=scales)
    mbs = placed_microbatches(mbs, workers)
    threads = _Threads(plans, workers, microbatches, progress, tail)
    threads.run(pool, lambda submit: walk(plans, len(workers), mbs, submit, order), watch or Watch())


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
        self.nows: list[Now] = [idle() for _ in plans]  # what each worker does now (hang_report)
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
                    if not wait_for(d.event, deadline):
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

    def _stop(self, pool: WorkerThreads, done: Sequence[Job], watch: Watch, reason: str, t0: float) -> str:
        """Stop a step that is stuck or interrupted: what each worker does, its last operations written
        (``hang_report.write_hang_report``), every wait released; threads still stuck after ``GRACE`` are left behind."""
        # As the step stopped, before anything is released; a worker's thread inside JAX's compiler: compiling.
        nows = [compile_aware(now, t.ident) for now, t in zip(self.nows, pool.threads)] or list(self.nows)
        rings = worker_rings(self.plans, self.workers)
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
        return stop_report(reason, nows, rings, t0, self.worker_of, watch, left)

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
