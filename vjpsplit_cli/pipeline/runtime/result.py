"""One step's result, the same from every runner: loss, gradients, the timeline and the plans that ran.

``step_result`` is the one place a ``PipelineResult`` is built: the runners hand
it what their workers measured (per-microbatch losses, per-stage gradients,
events), and it takes the loss as the mean over microbatches and orders the
events in time.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Mapping, Sequence

import numpy as np

from ...errors import VjpsplitError
from ...files.trees import decode_structure
from ..schedules.catalog import describe
from ..schedules.ops import Op
from ..schedules.play import replay
from ..schedules.plots import plot_timeline
from ..schedules.tracefile import trace_events, write_trace
from ..schedules.timeline import Event, Phase, bubble_ratio
from ...treetypes import PyTree

if TYPE_CHECKING:
    import jax

    from ...artifact.artifact import Artifact


@dataclass
class PipelineResult:
    """Loss, accumulated gradients, and the recorded timeline of one pipelined step.

    Made by the runners (``run``, ``run_inprocess``, ``RayPipeline.run``, ``Trainer.step``); an untimed step (the
    Trainer's default) has no events, and its bubble ratios are NaN.

    Attributes:
        schedule: The schedule's name, or ``"custom"`` for the caller's plans.
        loss: The step's loss (the mean over microbatches).
        grads: Per stage, or in ``params``' structure for a ``Stages`` (``None`` per stage if a Trainer applied them).
        events: The operations' compute times (empty for an untimed step; one per replica on a stage with replicas).
        num_stages: The pipeline's stage count.
        microbatches: The microbatches of the step.
        runner: ``"in-process"`` or ``"ray"``.
        step_time: The step's wall-clock seconds.
        plans: The per-worker lists of ``Op`` that ran.
        extra: What the runner adds (the Ray runner: ``{"compiled": bool}``).
        timed: Whether each operation was waited for: only then do ``events`` hold compute times.
        phases: A timed step's driver phases, reductions (``reduce replicas`` among them) and updates (``write_trace``).
        aux: Per microbatch, the last stage's aux (host arrays; a replicated stage's replica mean); None without aux.
    """

    schedule: str
    loss: float
    grads: PyTree
    events: list[Event]
    num_stages: int
    microbatches: int
    runner: str
    step_time: float
    plans: list[list[Op]]
    extra: dict[str, object] = field(default_factory=dict)
    timed: bool = True  # whether each operation was waited for: only then do ``events`` hold compute times
    phases: list[Phase] = field(default_factory=list)  # a timed step's driver phases, reductions and updates
    aux: list[PyTree] | None = None  # per microbatch, the last stage's aux (has_aux); None without

    @property
    def num_workers(self) -> int:
        """How many workers (threads or actors) ran the stages."""
        return len(self.plans)

    @property
    def bubble_ratio(self) -> float:
        """Idle share of the workers' time between the first start and the last end (NaN untimed)."""
        if not self.timed:
            return math.nan
        return bubble_ratio(self.events, self.num_workers)

    def _need_timeline(self) -> None:
        if not self.timed:
            raise VjpsplitError(
                "this step was not timed, so it has no timeline: run it with timed=True "
                "(trainer.step(batch, timed=True), or Trainer(..., observe=Observe(timeline=True)))"
            )

    def modeled_timeline(self) -> list[Event]:
        """The timeline if every worker had a device of its own: the measured op times, replayed.

        Returns:
            One ``Event`` per operation, on a clock that starts at 0.

        Raises:
            VjpsplitError: If the step was not timed.
        """
        self._need_timeline()
        return replay(self.events, self.plans, self.num_stages)

    @property
    def modeled_bubble_ratio(self) -> float:
        """The bubble ratio if every worker had a device of its own: measured op times, replayed (NaN untimed)."""
        if not self.timed:
            return math.nan
        return bubble_ratio(self.modeled_timeline(), self.num_workers)

    def per_worker(self) -> list[dict[str, float]]:
        """Busy seconds per worker and kind, and idle seconds.

        Returns:
            One dict per worker: ``{"worker": w, "F": s, "B": s, "I": s, "W": s, "idle": s}``
            (``B``: whole backwards, ``I`` and ``W``: split ones' parts), idle being the step's
            span less the busy seconds.

        Raises:
            VjpsplitError: If the step was not timed.
        """
        self._need_timeline()
        t0 = min(e.start for e in self.events)
        t1 = max(e.end for e in self.events)
        rows = []
        for w in range(self.num_workers):
            row = {"worker": w, "F": 0.0, "B": 0.0, "I": 0.0, "W": 0.0}
            for e in self.events:
                if e.worker == w:
                    row[e.kind] += e.end - e.start
            row["idle"] = (t1 - t0) - row["F"] - row["B"] - row["I"] - row["W"]
            rows.append(row)
        return rows

    def plot(self, path: str | os.PathLike[str], title: str | None = None) -> None:
        """Write a PNG timeline (workers as rows; F, B, W coloured; idle left blank); a timed step's only.

        Args:
            path: The PNG to write.
            title: The chart's title; ``None`` says the schedule, stages, workers,
                microbatches, bubble and runner.

        Raises:
            VjpsplitError: If the step was not timed, matplotlib is missing, or the PNG cannot be written.
        """
        self._need_timeline()
        plot_timeline(
            self.events,
            self.num_workers,
            path,
            title
            or f"{describe(self.schedule)}: {self.num_stages} stages on {self.num_workers} workers, "
            f"{self.microbatches} microbatches, bubble {self.bubble_ratio:.0%} ({self.runner})",
        )

    def trace(self, devices: Sequence[Sequence[jax.Device]] | None = None) -> dict[str, object]:
        """The step as a Chrome/Perfetto trace-event document (``schedules.tracefile``); a timed step's only.

        Args:
            devices: per stage, its devices (``Trainer.placement``); a sharded stage gets a track per device, a
                stage with replicas one per replica's device.
                ``None`` names no devices.

        Returns:
            The JSON-ready document: a track per worker and the driver's, a slice per operation, flows for sends.

        Raises:
            VjpsplitError: the step was not timed.
        """
        self._need_timeline()
        names = {s: [str(d) for d in ds] for s, ds in enumerate(devices or ())}
        meta = {"schedule": self.schedule, "runner": self.runner, "microbatches": self.microbatches, "loss": self.loss}
        title = f"vjpsplit step: {describe(self.schedule)}, {self.runner}"
        return trace_events(
            self.events, self.phases, self.num_workers, self.num_stages, title=title, devices=names, meta=meta
        )

    def write_trace(self, path: str | os.PathLike[str], devices: Sequence[Sequence[jax.Device]] | None = None) -> None:
        """Write the step as a trace file (``trace``) that Perfetto's UI, ``chrome://tracing`` and XProf open.

        Args:
            path: the ``.json`` file to write (whole or not at all).
            devices: per stage, its devices, as ``trace`` takes them.

        Raises:
            VjpsplitError: the step was not timed, or the file could not be written.
        """
        write_trace(path, self.trace(devices))


def step_result(
    *,
    schedule: str,
    plans: Sequence[Sequence[Op]],
    num_stages: int,
    microbatches: int,
    runner: str,
    step_time: float,
    losses: Mapping[int, float],
    grads: PyTree,
    events: Sequence[Event],
    extra: Mapping[str, object] | None = None,
    timed: bool = True,
    phases: Sequence[Phase] = (),
    scales: Sequence[float] | None = None,
    aux: list[PyTree] | None = None,
) -> PipelineResult:
    """The step's ``PipelineResult``: the loss is the mean of the last stage's per-microbatch ``losses`` (weighted by
    ``scales``, where given: ``step_loss``); ``aux`` per microbatch (``aux_per_microbatch``), None without aux."""
    return PipelineResult(
        schedule=schedule,
        loss=step_loss(losses, microbatches, scales),
        grads=grads,
        events=sorted(events, key=lambda e: e.start),
        num_stages=num_stages,
        microbatches=microbatches,
        runner=runner,
        step_time=step_time,
        plans=[list(ops) for ops in plans],
        extra=dict(extra or {}),
        timed=timed,
        phases=sorted(phases, key=lambda p: p.start),
        aux=aux,
    )


def step_loss(losses: Mapping[int, float], microbatches: int, scales: Sequence[float] | None = None) -> float:
    """The step's loss from the last stage's per-microbatch ``losses``: their mean, or with ``scales`` (each
    microbatch's loss weight over their sum, ``Microbatches.scales``) their weighted sum."""
    if scales is None:
        return float(np.mean([losses[m] for m in range(microbatches)]))
    return float(math.fsum(scales[m] * losses[m] for m in range(microbatches)))


def aux_per_microbatch(
    last: Artifact, aux: Mapping[int, Sequence[np.ndarray]], microbatches: int
) -> list[PyTree] | None:
    """The aux leaves the last stage's worker fetched (``StageWorker.fetch_outputs``), per microbatch, as the
    function's aux pytree (the structure ``last``'s manifest records); None where ``last`` has no aux."""
    m = last.manifest
    if not m.has_aux:
        return None
    return [decode_structure(m.structure["aux"], iter(aux[k])) for k in range(microbatches)]
