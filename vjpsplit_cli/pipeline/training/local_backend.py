"""The Trainer's workers in this process: one ``StageTrainer`` per stage, kept across steps, each on its device.

A step is dispatched from one long-lived helper thread (``runtime.untimed.run_untimed``: the
caller waits with ``step_timeout`` and Ctrl-C), then each stage's step is finished
(``stage_trainer.finish_stages``) as soon as it can be. A timed step runs the same, with a watcher
per device that times each operation (``runtime.timed.run_timed``).
"""

from __future__ import annotations

import time
from typing import Callable, Mapping, Sequence, TypeVar, cast

import jax
import numpy as np

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ...treetypes import Leaf, PyTree
from ..runtime.devices import Devices
from ..runtime.dispatch import Order, order_of
from ..runtime.evaluation import evaluate_here, host, joined, loss_and_aux
from ..runtime.inprocess import RUNNER
from ..runtime.model import Microbatch
from ..runtime.replicas import check_split, reductions
from ..runtime.result import PipelineResult, aux_per_microbatch, step_loss, step_result
from ..runtime.offload import Offload
from ..runtime.stepwatch import Watch
from ..runtime.timed import Timeline, run_timed
from ..runtime.untimed import Dispatched, dispatch, run_untimed
from ..runtime.worker import StageWorker
from ..runtime.workerthreads import WorkerThreads
from ..schedules.ops import Op
from ..schedules.stepplans import Resolved
from ..stages.evalprograms import EvalProgram
from ..schedules.timeline import Phase
from .clipping import Squares, clip_scale
from .device_memory import DeviceMemory, memory_records
from .measured import measure_copy_seconds
from .ownership import Ownership, Snapshot
from .stage_trainer import RESTORE_HINT, StageTrainer, finish_stages
from .zero1 import ReplicaTrainer


T = TypeVar("T")


def stage_trainers(
    ownership: Ownership,
    arts: Sequence[Artifact],
    where: Sequence[Devices],
    programs: Sequence[bytes],
    states: Sequence[Mapping[str, Leaf] | None],
    offload: Offload | None = None,
) -> list[StageTrainer]:
    """Per stage, its ``StageTrainer`` on its device (``where``), with its exported optimizer ``programs``;
    ``offload``: its residuals off the device between F and B."""
    own, S = ownership, len(arts)
    workers = [StageWorker(a, p, i, S, g[0], offload) for i, (a, p, g) in enumerate(zip(arts, own.stage_params, where))]
    return [
        StageTrainer(w, own.names[s], programs[s], own.holders[s], own.counted[s], states[s])
        for s, w in enumerate(workers)
    ]


class InProcessBackend:
    """The workers of this process: one ``StageTrainer`` per stage, kept across steps, each on its device.

    A step dispatches every operation and update from one
    thread (started at the first step, kept until ``close``), waiting for
    nothing but each stage's squared norm (fetched before its update, the stages in
    the order they finish, while the others go on computing) and the loss, while the
    caller waits for it with ``step_timeout`` and Ctrl-C. A timed step runs the same operations in the same
    order, with a watcher thread per device (started at the first timed step, kept until ``close``) that waits
    for each operation's results in turn, so the step's events are compute times (``runtime.timed``).
    """

    def __init__(
        self,
        ownership: Ownership,
        trainers: Sequence[StageTrainer | ReplicaTrainer],
        step_timeout: float | None = None,
        hang_report: str | None = None,
        data_parallel: int = 1,
    ):
        self.ownership = ownership
        self.step_timeout, self.hang_report = step_timeout, hang_report
        self.broken: str | None = None  # set when a step left a thread stuck in an operation (or half-updated)
        self.trainers = list(trainers)  # per stage: a StageTrainer, or a ReplicaTrainer of its replicas
        self.data_parallel = data_parallel
        self.timeline: Timeline | None = None  # the timed steps' watchers
        self.driver: WorkerThreads | None = None  # the steps' one thread
        self.orders: tuple[list[list[Op]], Order, list[int]] | None = (
            None  # plans, their dispatch order, the finishing order
        )

    @property
    def placement(self) -> list[tuple[jax.Device | str, ...]]:
        """Per stage, the devices that hold its parameters."""
        return [t.worker.devices for t in self.trainers]

    def send_seconds(self, values: Sequence[PyTree], repeats: int) -> list[float]:
        """Per stage boundary ``s -> s + 1``, ``jax.device_put`` of ``values[s]`` from stage ``s``'s (first) device
        to stage ``s + 1``'s, waited for, as a step hands a result on: the median of ``repeats``."""
        devices = [t.worker.devices[0] for t in self.trainers]
        return [measure_copy_seconds(v, devices[s], devices[s + 1], repeats) for s, v in enumerate(values)]

    def step(
        self,
        mbs: Sequence[Microbatch],
        schedule: Resolved,
        microbatches: int,
        clip: float | None,
        *,
        timed: bool = False,
        scales: Sequence[float] | None = None,
    ) -> tuple[PipelineResult, list[float]]:
        """One step: the schedule, then each stage's update where it lives (``timed``: see the class; ``scales``:
        see ``Backend.step``).

        A step past ``step_timeout`` (or interrupted) is one error saying what each worker is doing, its
        last operations written to ``hang_report``; a thread still stuck then (or an untimed step stopped
        during its updates) ends this backend's steps."""
        if self.broken is not None:
            raise VjpsplitError(self.broken)
        S = len(self.trainers)
        workers = self._workers()
        if self.data_parallel > 1:
            check_split(mbs, self.data_parallel)  # before any operation runs
        t0 = time.monotonic()
        phases: list[Phase] = []
        try:
            sums, losses, aux = self._dispatched(mbs, schedule, microbatches, clip, scales, phases if timed else None)
        except BaseException:
            for w in workers:  # failed or interrupted: its residual files no B read back go
                w.discard_offloaded()
            raise
        step_time = time.monotonic() - t0
        result = step_result(
            schedule=schedule.name,
            plans=schedule.plans,
            num_stages=S,
            microbatches=microbatches,
            runner=RUNNER,
            step_time=step_time,
            losses=losses,
            grads=[None] * S,  # applied where they live
            events=[e for st in workers for e in st.events],
            timed=timed,
            phases=[*phases, *reductions(workers)] if timed else (),
            scales=scales,
            aux=aux_per_microbatch(self.ownership.artifacts[-1], aux, microbatches),
        )
        return result, [sums[s] for s in range(S)]

    def _workers(self) -> list[StageWorker]:
        """Every stage's worker; a stage on replicas has a ``ReplicaGroup``, which runs a schedule's operations
        as a ``StageWorker`` does (``runtime.replicas``), so the runtime's dispatch takes it alike."""
        return cast("list[StageWorker]", [t.worker for t in self.trainers])

    def _orders(self, plans: list[list[Op]]) -> tuple[Order, list[int]]:
        """The plans' dispatch order and the stages' finishing order, worked out once for the same plans."""
        if self.orders is None or self.orders[0] is not plans:  # held here, so their id is not reused
            order = order_of(plans, len(self.trainers))
            last = {op.stage: i for i, (_, op, _) in enumerate(order)}
            self.orders = (plans, order, sorted(last, key=last.__getitem__))
        return self.orders[1], self.orders[2]

    def _value(self, microbatches: int, scales: Sequence[float] | None) -> Callable[[], float]:
        """The step's loss as the result reports it (the mean over microbatches, weighted by ``scales`` where
        given), for an update taking value=."""
        last = self.trainers[-1].worker

        def value() -> float:
            return step_loss(last.fetch_losses(), microbatches, scales)

        return value

    def _dispatched(
        self,
        mbs: Sequence[Microbatch],
        schedule: Resolved,
        microbatches: int,
        clip: float | None,
        scales: Sequence[float] | None,
        phases: list[Phase] | None,
    ) -> tuple[dict[int, float], dict[int, float], dict[int, list[np.ndarray]]]:
        """A step in the kept driver thread (dispatch, updates, losses and aux), waited for here; timed where
        ``phases`` is given (the step's driver phases and each worker's reductions and update go there)."""
        workers = self._workers()
        order, finishing = self._orders(schedule.plans)
        record = Dispatched(schedule.plans, len(workers))
        value = self._value(microbatches, scales)
        if phases is not None and self.timeline is None:
            self.timeline = Timeline()
        timeline = None if phases is None else self.timeline

        def untimed() -> dict[int, float | Squares]:
            dispatch(workers, schedule.plans, mbs, microbatches, order, record, scales)
            return self._finish(finishing, clip, value, record.commit)

        def timed(timeline: Timeline, phases: list[Phase]) -> dict[int, float | Squares]:
            clock = time.monotonic
            with timeline.step(workers):
                t0 = clock()
                run_timed(workers, schedule.plans, mbs, microbatches, order=order, record=record, scales=scales)
                phases.append(Phase(None, "hand out", t0, clock()))
                worker_of = {s: w for w, held in enumerate(schedule.layout.workers) for s in held}
                sums = self._finish(finishing, clip, value, record.commit, phases, worker_of)
                t1 = clock()
            phases.append(Phase(None, "wait for the workers", t1, clock()))
            return sums

        def body() -> tuple[dict[int, float], dict[int, float], dict[int, list[np.ndarray]]]:
            sums = untimed() if timeline is None or phases is None else timed(timeline, phases)
            t0 = time.monotonic()
            losses, aux = workers[-1].fetch_outputs()  # the step's first wait for the devices (without clipping)
            if phases is not None:
                phases.append(Phase(None, "fetch the losses", t0, time.monotonic()))
            return dict(zip(sums, Squares.fetch(list(sums.values())))), losses, aux

        if self.driver is None:
            self.driver = WorkerThreads(1, "vjpsplit-step")
        watch = Watch(self.step_timeout, self.hang_report, RESTORE_HINT)
        try:
            return run_untimed(self.driver, body, record, workers, watch)
        finally:
            if watch.stuck:  # its thread may yet write into a stage: no step runs on them again
                self.driver = None
                if self.timeline is not None:  # a watcher may wait for the stuck operation
                    self.timeline.abandon()
                    self.timeline = None
                self.broken = (
                    f"an earlier step timed out or was interrupted with a thread stuck ({'; '.join(watch.stuck)})"
                    f"{RESTORE_HINT}"
                )
            elif watch.applied:
                self.broken = f"an earlier step was stopped during its stages' updates{RESTORE_HINT}"

    def _finish(
        self,
        finishing: Sequence[int],
        clip: float | None,
        value: Callable[[], float],
        commit: Callable[[], None],
        phases: list[Phase] | None = None,
        worker_of: Mapping[int, int] | None = None,
    ) -> dict[int, float | Squares]:
        """The step's last phases, from its thread: each stage's update as soon as it can go
        (``commit()`` before each: it raises once the step was stopped). The squared sums come back as
        dispatched; without clipping nothing here waits for the devices. A timed step's ``phases`` hear of each
        (``finish_stages``' ``mark``) on the track of the worker that holds the stage (``worker_of``), the
        phases that finish every stage at once on every worker's."""
        own, trainers = self.ownership, self.trainers
        scale = None if clip is None else (lambda v: clip_scale(v, clip)[0])

        def marks(stages: Sequence[int]) -> Callable[[str, float, float], None] | None:
            if phases is None or worker_of is None:
                return None
            held = sorted({worker_of[s] for s in stages})
            return lambda name, a, b: phases.extend(Phase(w, name, a, b) for w in held)

        def exchange(part: Mapping[int, T]) -> Mapping[int, T]:
            commit()
            return part

        program = trainers[0].program
        if own.tied or clip is not None or program.rounds or program.uses_value:  # the others' parts first
            got = finish_stages(trainers, exchange, scale, own.tied, marks(range(len(trainers))), value=value)
            return dict(zip(range(len(trainers)), got))
        sums: dict[int, float | Squares] = {}
        for s in finishing:  # the stage whose last operation comes first updates first
            sums[s] = finish_stages([trainers[s]], exchange, scale, False, marks([s]))[0]
        return sums

    def evaluate(
        self, mbs: Sequence[Microbatch], programs: Sequence[EvalProgram], outputs: bool
    ) -> tuple[list[float], list[list[np.ndarray]], list[PyTree] | None]:
        """Every stage's forward only, dispatched from this thread onto each stage's device (``Backend.evaluate``)."""
        if self.data_parallel > 1:
            check_split(mbs, self.data_parallel)  # before any stage runs, as a step's
        losses, received = evaluate_here([t.worker for t in self.trainers], programs, mbs, keep=outputs)
        got = [loss_and_aux(v) for v in jax.device_get(losses)]
        return (
            [loss for loss, _ in got],
            [aux for _, aux in got],
            ([joined(r) for r in host(received)] if outputs else None),
        )

    def set_offload(self, spec: Offload | None) -> None:
        """From the next step, every stage's residuals off its device between F and B as ``spec`` says (None: none)."""
        for t in self.trainers:
            t.worker.set_offload(spec)

    def snapshots(self) -> list[Snapshot]:
        """Every stage's ``(params, optimizer state)`` as host arrays."""
        return [t.snapshot() for t in self.trainers]

    def load(self, snapshots: Sequence[Snapshot]) -> None:
        """Every stage holds its ``(params, optimizer state)`` of ``snapshots`` from now on."""
        for t, (params, state) in zip(self.trainers, snapshots):
            t.assign(params, state)

    def memory(self) -> list[DeviceMemory]:
        """Per device that holds a stage, its bytes of parameters, optimizer state and residuals (``device_memory``)."""
        return memory_records(self.trainers)

    def report_hangs_to(self, path: str) -> None:
        """Where a stuck or interrupted step's report goes from now on."""
        self.hang_report = path

    def workers(self) -> list[object]:
        """Ray actor handles: none in-process."""
        raise VjpsplitError("workers() gives the Ray actor of each worker; this Trainer runs in-process")

    def replace(self, workers: Sequence[int]) -> None:
        """Replacing lost workers (``Backend.replace``): an in-process worker is a thread of this process, never lost."""
        raise VjpsplitError(
            f"workers {list(workers)} cannot be replaced: this Trainer runs in-process, no worker is lost"
        )

    def close(self) -> None:
        """End the watcher threads of timed steps and the steps' thread, those that ran, and every stage's
        offload (its thread; residual files no B read back are removed)."""
        for t in self.trainers:
            t.worker.set_offload(None)
        if self.timeline is not None:
            self.timeline.close()
            self.timeline = None
        if self.driver is not None:
            self.driver.close()
            self.driver = None
