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

from ..errors import VjpsplitError
from .dispatch import progress_bar, walk
from .fromone import run_stages
from .plans import resolve, split_ops
from .schedules import Op
from .stage import StageWorker, check_stages, run_op, split_batch, stage_devices
from .stagedir import is_stages
from .timeline import PipelineResult


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
    split = split_ops(plans)
    mbs = split_batch(x, side, microbatches)
    if workers is None:
        stages = [StageWorker(a, p, i, S) for i, (a, p) in enumerate(zip(artifacts, params))]
    else:
        stages = list(workers)
        for st in stages:
            st.reset()
    inboxes = [queue.SimpleQueue() for _ in plans]
    errors: list[BaseException] = []
    bar = progress_bar(sum(len(p) for p in plans), progress)
    bar_lock = threading.Lock()

    def submit(w, op, data, side_):
        box = _Mailbox()
        inboxes[w].put((op, data, side_, box))
        return box

    def run_worker(w):
        for _ in range(len(plans[w])):
            op, data, side_, box = inboxes[w].get()
            if isinstance(data, _Mailbox):
                data = data.get()
            if errors or data is _FAILED:  # drain the list without running on missing inputs
                box.put(_FAILED)
                continue
            try:
                box.put(run_op(stages[op.chunk], op, data, side_, microbatches, (op.chunk, op.mb) in split, w))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)
                box.put(_FAILED)
            if bar is not None:
                with bar_lock:
                    bar.update(1)
        if tail is not None:
            try:
                tail(w, bool(errors))
            except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(e)

    t0 = time.monotonic()
    threads = [threading.Thread(target=run_worker, args=(w,), name=f"worker-{w}") for w in range(len(plans))]
    for t in threads:
        t.start()
    try:
        walk(plans, S, mbs, submit)
    except BaseException:
        for w, box in enumerate(inboxes):  # let every thread drain its list and end
            for _ in plans[w]:
                box.put((None, _FAILED, [], _Mailbox()))
        raise
    finally:
        for t in threads:
            t.join()
        if bar is not None:
            bar.close()
    if errors:
        raise errors[0]
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
