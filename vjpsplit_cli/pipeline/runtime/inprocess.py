"""The in-process runner: one thread per worker, one mailbox per activation or cotangent.

Each mailbox has its own event, and each worker its own queue of operations, so
a message wakes only the thread that reads it: the cost of an operation does not
grow with the number of stages.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Any, Callable, Sequence

from ..schedules.ops import Op, split_ops
from ..schedules.plans import resolve
from ..stages.directory import Stages
from .devices import stage_devices
from .dispatch import Submit, progress_bar, walk
from .model import Microbatch, model_of
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
) -> PipelineResult:
    """Run one training step in this process: one thread per worker, mailboxes between stages.

    ``schedule`` (plans, e.g. from ``read_schedule``) runs instead of ``schedule_name``, once checked.

    Sharded stages run on their device groups (``devices``, one per stage; by
    default consecutive groups of this host's devices where there are enough);
    activations and cotangents are moved onto the next stage's shardings. A
    ``Stages`` takes the whole ``params`` and the batch tuple as ``x``, and its
    gradients come back in ``params``' structure.
    """
    model = model_of(artifacts, params)
    S = model.num_stages
    name, plans, _ = resolve(schedule_name, schedule, S, microbatches)
    arts = stage_devices(model.artifacts, devices)
    model.check_plans(name, plans)
    mbs = model.microbatches(x, side, microbatches)
    workers = [StageWorker(a, p, i, S) for i, (a, p) in enumerate(zip(arts, model.stage_params))]
    step_time = run_threads(workers, plans, mbs, microbatches, progress=progress)
    return step_result(
        schedule=name,
        plans=plans,
        num_stages=S,
        microbatches=microbatches,
        runner=RUNNER,
        step_time=step_time,
        losses=workers[-1].losses,
        grads=model.gather([st.grads for st in workers]),
        events=[e for st in workers for e in st.events],
    )


def run_threads(
    workers: Sequence[StageWorker],
    plans: Sequence[Sequence[Op]],
    mbs: Sequence[Microbatch],
    microbatches: int,
    *,
    progress: bool = False,
    tail: Callable[[int, bool], None] | None = None,
) -> float:
    """One step of ``plans`` on the stages' ``workers`` (reset first), one thread per worker; its seconds.

    ``tail(w, failed)`` runs in worker ``w``'s thread after its last operation
    (``failed``: some operation of the step failed); what it raises is the step's error.
    """
    for st in workers:
        st.reset()
    threads = _Threads(plans, workers, split_ops(plans), microbatches, progress, tail)
    t0 = time.monotonic()
    threads.run(lambda submit: walk(plans, len(workers), mbs, submit))
    return time.monotonic() - t0


class _Threads:
    """One thread per worker, each running its list of operations, in order, from its inbox."""

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

    def run(self, drive: Callable[[Submit], Any]) -> None:
        """Start the threads, ``drive(submit)`` hands them the step, wait; the first error is raised here."""
        threads = [threading.Thread(target=self._worker, args=(w,), name=f"worker-{w}") for w in range(len(self.plans))]
        for t in threads:
            t.start()
        try:
            drive(self.submit)
        except BaseException:
            for w, box in enumerate(self.inboxes):  # let every thread drain its list and end
                for _ in self.plans[w]:
                    box.put((None, _FAILED, [], _Mailbox()))
            raise
        finally:
            for t in threads:
                t.join()
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
