"""A timed step: the untimed step's dispatch, with a watcher per device that times each operation.

``run_timed`` hands out the step as ``untimed.dispatch`` does (the same operations in
the same order, from one thread, nothing waiting), its workers attached to a
``Timeline``: each operation a worker dispatches goes to the ``Lane`` of its devices
(``watcher``), whose watcher thread waits for the operations' results in dispatch order and records
each one's ``Event``: it starts at the latest of its dispatch, the end of the
operation before it on those devices and its inputs' existence (moved there, the
previous step's update done), and ends when its results exist. So the host's dispatch
overlaps the devices' compute as in an untimed step, and the events are compute times.
A call that is cold (``StageWorker._run``) is still waited for and run again until warm.
"""

from __future__ import annotations

import contextlib
import functools
from typing import TYPE_CHECKING, Iterator, Sequence

from ..schedules.ops import Op
from .dispatch import Order, progress_bar
from .model import Microbatch
from .replicas import ReplicaGroup
from .stageops import RunsOps
from .untimed import Dispatched, dispatch
from .watcher import Lane, watch_lane
from .workerthreads import Job, WorkerThreads

if TYPE_CHECKING:
    from .worker import StageWorker


class Timeline:
    """A timed step's watchers: a ``Lane`` per device its workers run on, each watched by a thread of a
    ``WorkerThreads`` kept across steps (``close`` ends them)."""

    def __init__(self) -> None:
        self.lanes: dict[tuple[object, ...], Lane] = {}
        self.pool: WorkerThreads | None = None

    def attach(self, workers: Sequence[RunsOps]) -> None:
        """Every worker (each replica of a ``ReplicaGroup``) hands its operations to its devices' lane."""
        for one in _each(workers):
            one.lane = self.lanes.setdefault(tuple(one.devices), Lane())

    @contextlib.contextmanager
    def step(self, workers: Sequence[RunsOps]) -> Iterator[None]:
        """``workers`` attached (``attach``), the watchers run for the body of this ``with``; once it ends the workers
        are detached (a later call of theirs outside a timed step, a Ray compiled graph's, is waited for as it runs)
        and the watchers stop after what was handed to them, waited for unless the body raised (the step's error
        then stands; they end as the devices finish)."""
        self.attach(workers)
        if self.pool is None or len(self.pool.threads) != len(self.lanes):
            if self.pool is not None:
                self.pool.close()
            self.pool = WorkerThreads(len(self.lanes), "vjpsplit-watch")
        jobs = self.pool.start([functools.partial(watch_lane, lane) for lane in self.lanes.values()])
        try:
            yield
        finally:
            for one in _each(workers):
                one.lane = None
            for lane in self.lanes.values():
                lane.queue.put(None)
        _wait(jobs)

    def close(self) -> None:
        """End the watcher threads (after what they hold)."""
        if self.pool is not None:
            self.pool.close()
            self.pool = None

    def abandon(self) -> None:
        """Leave the watcher threads behind (one waits for an operation that may never finish: a stuck step)."""
        if self.pool is not None:
            self.pool.abandon()
            self.pool = None


def _each(workers: Sequence[RunsOps]) -> Iterator[StageWorker]:
    """Every ``StageWorker`` of ``workers``: each replica of a ``ReplicaGroup``."""
    for st in workers:
        yield from st.replicas if isinstance(st, ReplicaGroup) else [st]  # type: ignore[misc]  # RunsOps' other class is the group


def _wait(jobs: Sequence[Job]) -> None:
    for job in jobs:
        job.event.wait()
        if job.error is not None:
            raise job.error


def run_timed(
    workers: Sequence[RunsOps],
    plans: Sequence[Sequence[Op]],
    mbs: Sequence[Microbatch],
    microbatches: int,
    *,
    progress: bool = False,
    order: Order | None = None,
    record: Dispatched | None = None,
    scales: Sequence[float] | None = None,
) -> None:
    """One timed step of ``plans`` on the stages' ``workers``: ``untimed.dispatch``'s, the workers timed. Inside
    ``Timeline.step(workers)`` their lanes' watchers time the operations; without one each is waited for.

    ``progress``: a tqdm bar over the operations as they are handed out. ``order``, ``record``, ``scales``: as
    ``untimed.dispatch`` takes them.
    """
    bar = progress_bar(sum(len(p) for p in plans), progress)
    try:
        dispatch(
            workers,
            plans,
            mbs,
            microbatches,
            order,
            record,
            scales,
            timed=True,
            tick=None if bar is None else functools.partial(bar.update, 1),
        )
    finally:
        if bar is not None:
            bar.close()
