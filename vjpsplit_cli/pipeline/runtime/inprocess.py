"""The in-process runner: one thread per worker, one mailbox per activation or cotangent.

Each mailbox has its own event, and each worker its own queue of operations, so
a message wakes only the thread that reads it: the cost of an operation does not
grow with the number of stages.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Sequence

import numpy as np

from ...errors import VjpsplitError
from .dispatch import progress_bar, walk
from .fromone import run_stages
from ..schedules.plans import resolve, split_ops
from ..schedules.builtins import Op
from .worker import StageWorker, check_stages, run_op, split_batch, stage_devices
from ..stages.directory import is_stages
from ..schedules.timeline import PipelineResult


class _Mailbox:
    """One value handed from one stage to the next, with the event its reader waits on."""

    __slots__ = ("event", "value")

    def __init__(self):
        self.event = threading.Event()
        self.value = None

    def put(self, value) -> None:
        self.value = value
        self.event.set()

    def get(self):
        self.event.wait()
        return self.value


_FAILED = object()  # posted in place of a value whose operation failed or was skipped


def run_inprocess(
    artifacts: Sequence,
    params: Sequence,
    x,
    side=(),
    *,
    microbatches: int,
    schedule_name: str = "1f1b",
    progress: bool = False,
    devices: Sequence[Sequence] | None = None,
    schedule: Sequence[Sequence[Op]] | None = None,
    workers: Sequence[StageWorker] | None = None,
    tail: Callable[[int, bool], None] | None = None,
) -> PipelineResult:
    """Run one training step in this process: one thread per worker, mailboxes between stages.

    ``workers``: the stages' ``StageWorker``s to run on (kept across steps, as a
    ``Trainer`` does; reset here) instead of new ones from ``params``. ``tail(w,
    failed)`` runs in worker ``w``'s thread after its last operation (``failed``:
    some operation of the step failed); what it raises is the step's error.

    ``schedule`` (plans, e.g. from ``read_schedule``) runs instead of ``schedule_name``, once checked.

    Sharded stages run on their device groups (``devices``, one per stage; see
    ``stage_devices`` for the default); activations and cotangents are moved
    onto the next stage's shardings. A ``Stages`` takes the whole ``params`` and the batch tuple as ``x``.
    """
    if is_stages(artifacts):  # grads come back in params' structure
        kw = {"schedule_name": schedule_name, "progress": progress, "devices": devices, "schedule": schedule}
        return run_stages(run_inprocess, artifacts, params, x, microbatches=microbatches, **kw)
    S = len(artifacts)
    if len(params) != S:
        raise VjpsplitError(f"{S} stages but {len(params)} parameter sets")
    artifacts = stage_devices(artifacts, devices)
    schedule_name, plans, _ = resolve(schedule_name, schedule, S, microbatches)
    check_stages(artifacts, schedule_name, plans)
    mbs = split_batch(x, side, microbatches)
    if workers is None:
        stages = [StageWorker(a, p, i, S) for i, (a, p) in enumerate(zip(artifacts, params))]
    else:
        stages = list(workers)
        for st in stages:
            st.reset()
    threads = _Threads(plans, stages, split_ops(plans), microbatches, progress, tail)
    t0 = time.monotonic()
    threads.run(lambda submit: walk(plans, S, mbs, submit))
    step = time.monotonic() - t0
    last = stages[-1]
    return PipelineResult(
        schedule_name,
        float(np.mean([last.losses[m] for m in range(microbatches)])),
        [st.grads for st in stages],
        sorted((e for st in stages for e in st.events), key=lambda e: e.start),
        S,
        microbatches,
        "in-process",
        step,
        plans=plans,
    )


class _Threads:
    """One thread per worker, each running its list of operations, in order, from its inbox."""

    def __init__(self, plans, stages, split, microbatches: int, progress: bool, tail):
        self.plans, self.stages, self.split, self.microbatches, self.tail = plans, stages, split, microbatches, tail
        self.inboxes: list[queue.SimpleQueue] = [queue.SimpleQueue() for _ in plans]
        self.errors: list[BaseException] = []
        self.bar = progress_bar(sum(len(p) for p in plans), progress)
        self.bar_lock = threading.Lock()

    def submit(self, w: int, op, data, side) -> _Mailbox:
        """Queue ``op`` for worker ``w``; its result arrives in the returned mailbox."""
        box = _Mailbox()
        self.inboxes[w].put((op, data, side, box))
        return box

    def run(self, drive: Callable) -> None:
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
                split = (op.chunk, op.mb) in self.split
                box.put(run_op(self.stages[op.chunk], op, data, side, self.microbatches, split, w))
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
