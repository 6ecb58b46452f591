"""The Trainer's workers as threads of this process: one ``StageTrainer`` per stage, kept across steps.

After each worker's last operation, its thread finishes its stages' step
(``stagestate.finish_stages``), swapping tied gradients and squared sums with the
other threads at a barrier.
"""

from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Mapping, Sequence

from ...errors import VjpsplitError
from ..runtime.inprocess import RUNNER, run_threads
from ..runtime.model import Microbatch
from ..runtime.result import PipelineResult, step_result
from ..schedules.plans import Resolved
from ..runtime.worker import StageWorker
from .clipping import clip_scale
from .ownership import Ownership, Snapshot
from .stagestate import StageTrainer, finish_stages


class _Rendezvous:
    """In-process: the workers' threads swap small dicts (tied gradients, squared sums) at a barrier."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n)
        self.rounds: list[dict[int, Any]] = []
        self.lock = threading.Lock()

    def exchanger(self) -> Callable[[Mapping[int, Any]], dict[int, Any]]:
        count = itertools.count()

        def exchange(part: Mapping[int, Any]) -> dict[int, Any]:
            i = next(count)
            with self.lock:
                while len(self.rounds) <= i:
                    self.rounds.append({})
                self.rounds[i].update(part)
            self.barrier.wait()
            return self.rounds[i]

        return exchange


class InProcessBackend:
    """The workers as threads of this process: one ``StageTrainer`` per stage, kept across steps."""

    def __init__(self, ownership: Ownership, arts: Sequence[Any], programs: Sequence[bytes], states: Sequence[Any]):
        self.ownership = own = ownership
        S = len(arts)
        workers = [StageWorker(a, p, i, S) for i, (a, p) in enumerate(zip(arts, own.stage_params))]
        self.trainers = [
            StageTrainer(w, own.names[s], programs[s], own.holders[s], own.counted[s], states[s])
            for s, w in enumerate(workers)
        ]

    def step(
        self,
        mbs: Sequence[Microbatch],
        schedule: Resolved,
        microbatches: int,
        clip: float | None,
        progress: bool,
        *,
        timed: bool = False,
    ) -> tuple[PipelineResult, list[float]]:
        """One step: the schedule in the workers' threads, each finishing with its stages' updates.

        ``timed`` asks for events that are compute times. Every operation here waits for its result
        before the next is dispatched, so every step already is one: the flag is for a runtime that
        does not wait (issue #35), which must honour it.
        """
        S = len(self.trainers)
        held = schedule.layout.workers
        rv, sums = _Rendezvous(len(held)), {}

        def tail(w: int, failed: bool) -> None:
            if failed:
                rv.barrier.abort()  # the others stop waiting; the failed operation is the step's error
                return
            mine = [self.trainers[s] for s in held[w]]
            try:
                got = finish_stages(mine, rv.exchanger(), lambda v: clip_scale(v, clip)[0], self.ownership.tied)
            except threading.BrokenBarrierError:
                return  # another worker failed: its error is the step's
            except BaseException:
                rv.barrier.abort()
                raise
            sums.update({t.stage_index: v for t, v in zip(mine, got)})

        workers = [t.worker for t in self.trainers]
        step_time = run_threads(workers, schedule.plans, mbs, microbatches, progress=progress, tail=tail)
        result = step_result(
            schedule=schedule.name,
            plans=schedule.plans,
            num_stages=S,
            microbatches=microbatches,
            runner=RUNNER,
            step_time=step_time,
            losses=workers[-1].losses,
            grads=[None] * S,  # applied where they live
            events=[e for st in workers for e in st.events],
        )
        return result, [sums[s] for s in range(S)]

    def snapshots(self) -> list[Snapshot]:
        """Every stage's ``(params, optimizer state)`` as host arrays."""
        return [t.snapshot() for t in self.trainers]

    def load(self, snapshots: Sequence[Snapshot]) -> None:
        """Every stage holds its ``(params, optimizer state)`` of ``snapshots`` from now on."""
        for t, (params, state) in zip(self.trainers, snapshots):
            t.assign(params, state)

    def workers(self) -> list[Any]:
        """Ray actor handles: none in-process."""
        raise VjpsplitError("workers() gives the Ray actor of each worker; this Trainer runs in-process")

    def close(self) -> None:
        """Nothing to end in-process."""
