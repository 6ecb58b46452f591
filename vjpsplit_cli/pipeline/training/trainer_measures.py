"""What the Trainer measured and records of its steps: ``history``, ``costs()``, ``memory()``, stragglers,
``placement``.

``TrainerMeasures`` is the part of ``trainer.Trainer`` that reads its step history
(``history``, ``plot_loss``), the stages' measured costs (``costs``: ``measured``),
what each device holds (``memory``: ``device_memory``), what ``auto``'s plans offload (``planned_offload``,
or why nothing: ``no_offload_reason``), where each stage runs (``placement``) and which workers are stragglers
(``_busy``, from a timed step's compute; ``history.Stragglers``). ``Trainer`` sets the attributes it declares.

May import ``measured``, ``autoplan``, ``history``, ``backend``, ``device_memory`` and ``option_values`` of this
room, ``runtime``, ``schedules``, and the layers below ``pipeline``.
"""

from __future__ import annotations

import os
import statistics
import warnings

import jax

from ..runtime.model import Microbatch
from ..runtime.offload import Offload
from ..runtime.result import PipelineResult
from ..schedules.stepplans import Resolved
from .backend import Backend
from .device_memory import DeviceMemory
from .history import IN_A_ROW, SLOWER, History, StepRecord, Stragglers
from .autoplan import AutoPlan, boundary_values
from .measured import SEND_PROBES, CostSamples, MeasuredCosts, measure_transfer_rates
from .option_values import Runner, Schedule


class TrainerMeasures:
    """``Trainer``'s measurements and records of its steps (the module docstring); its attributes are the
    Trainer's."""

    backend: Backend
    plan: Resolved
    schedule: Schedule
    step_count: int
    runner: Runner
    _history: History
    _samples: CostSamples
    _transfer: dict[str, float] | None
    _send: list[float] | None
    _sent_by: Microbatch | None
    _auto_offload: Offload | None
    offload: Offload | None
    auto: AutoPlan | None
    _signatures: list[tuple[tuple[str, tuple[int | str, ...]], ...]]
    _stragglers: Stragglers | None

    @property
    def history(self) -> list[StepRecord]:
        """One ``StepRecord`` per step: ``step``, ``loss``, ``grad_norm`` (before clipping), ``step_time``, ``bubble``,
        ``modeled_bubble``; under ``schedule="auto"`` also ``schedule`` (what ran: the measuring step's schedule, then
        ``"auto"``), ``modeled_makespan`` (its plans under the measured costs, seconds) and ``measuring`` (True on the
        two timed first steps); a timed step's row also has ``busy`` (each worker's compute seconds) and
        ``stragglers`` (the workers whose compute was 15% or more above that of the workers whose stages cost the
        same, 3 timed steps in a row); ``fit``'s evaluations set ``eval_loss``. Attributes (``row.loss``)."""
        return self._history.rows

    @property
    def placement(self) -> list[tuple[jax.Device | str, ...]]:
        """Per stage, the devices that hold its parameters (``jax.Device``s in-process; on Ray, as each
        actor's JAX names them)."""
        return self.backend.placement

    def _busy(self, r: PipelineResult, first: bool) -> tuple[tuple[float, ...], tuple[int, ...]]:
        """A timed step's ``busy`` seconds per worker and its ``stragglers`` (warned of when first named); the
        Trainer's first step, which compiles every stage, gives no verdict."""
        busy = tuple(row["F"] + row["B"] + row["I"] + row["W"] for row in r.per_worker())
        if first:
            return busy, ()
        held = self.plan.layout.workers
        groups = [tuple(sorted(self._signatures[s] for s in stages)) for stages in held]
        if self._stragglers is None or self._stragglers.groups != groups:
            self._stragglers = Stragglers(groups)
        now, new = self._stragglers.see(busy)
        for w in new:
            peers = [v for v, g in enumerate(groups) if v != w and g == groups[w]]
            warnings.warn(
                f"worker {w} (stages {', '.join(map(str, held[w]))}) is a straggler: its compute "
                f"({busy[w] * 1e3:.1f} ms in step {self.step_count}) was at least {SLOWER - 1:.0%} above its peers' "
                f"(worker {', '.join(map(str, peers))}, whose stages cost the same) in {IN_A_ROW} timed steps in a row",
                stacklevel=3,
            )
        return busy, tuple(now)

    def costs(self) -> MeasuredCosts:
        """Every stage's measured F, B and W seconds and the send time, as ``auto_schedule``'s ``costs`` take them.

        F, B and W: medians over the microbatches of the last timed steps (``step(batch, timed=True)``, or
        ``auto``'s first two), the Trainer's first step only while no other is timed; see ``measured`` for what
        is left out and how a whole backward splits into B and W. ``comm``: one send between stages timed apart,
        at the first call, with an activation of the size each stage sends (the first timed step's microbatch):
        in-process ``jax.device_put`` from one stage's device to the next, on Ray one actor-to-actor delivery
        through the step's senders and inboxes; the median of ``measured.SEND_PROBES`` per boundary, the mean
        over the boundaries. ``gap``: what the timed steps' timelines show between a result and the next worker
        starting on it (more than the send; ``comm`` where the send could not be measured).

        Returns:
            ``{"F": [...], "B": [...], "W": [...], "comm": seconds, "gap": seconds, "transfer": {"out": ..,
            "back": ..}}``, one entry per stage in F, B and W; ``transfer`` the bytes per second of a residual
            copy off the first stage's device and back, as offload copies (``measured.measure_transfer_rates``,
            timed once, at the first call; on Ray, on this process's device).

        Raises:
            VjpsplitError: no timed step has run yet.
        """
        timeline = self._samples.costs()
        if self._transfer is None:
            self._transfer = measure_transfer_rates(self.placement[0][0])
        if self._send is None:
            sent = None if self._sent_by is None else boundary_values(self._samples.artifacts, self._sent_by)
            self._send = [] if sent is None else self.backend.send_seconds(sent, SEND_PROBES)
        comm = statistics.mean(self._send) if self._send else timeline["gap"]
        return {**timeline, "comm": comm, "transfer": self._transfer}

    def memory(self) -> list[DeviceMemory]:
        """What each device holds of this Trainer's stages, between steps: one ``DeviceMemory`` per device.

        Per device (on Ray, per actor's device, with its ``worker``): the bytes of its stages' parameters and
        optimizer state (by the device each array's shard is on: with ``data_parallel=N``, each replica's
        device holds about 1/N of its stage's optimizer state, ZeRO-1), the most stored residual bytes its
        stages held at once in the last step (``StageWorker.peak_residual_bytes``), and the bytes in use on
        it in all: the device's ``memory_stats()`` where it has them (GPU, TPU: also the peak since the process
        started), else the live JAX arrays on it (CPU).

        Returns:
            One ``DeviceMemory`` per device that holds a stage, in stage order (on Ray, worker by worker).
        """
        return self.backend.memory()

    @property
    def planned_offload(self) -> Offload | None:
        """What ``auto``'s plans offload under ``memory_limit_bytes`` now (the (stage, microbatch) pairs in
        ``Offload.pairs``, to host memory), or None: no offload planned (or ``offload=`` given by hand)."""
        return self._auto_offload

    @property
    def no_offload_reason(self) -> str | None:
        """Why ``planned_offload`` is None, in words (an ``offload=`` given by hand, no ``"auto"`` within
        ``memory_limit_bytes``, or why auto's plans offload nothing); None where it offloads."""
        if self.offload is not None:
            return "offload= was given to the runner: auto plans no offload of its own"
        if self.auto is None:
            return "only Schedule('auto', memory_limit_bytes=...) plans offload"
        return self.auto.no_offload_reason

    def plot_loss(self, path: str | os.PathLike[str], title: str | None = None) -> None:
        """A PNG of the loss per step (needs matplotlib), beside ``plot_timeline``'s chart of one step.

        Args:
            path: the PNG file to write.
            title: the chart's title; None: the schedule's and the runner's names.
        """
        self._history.plot(path, title or f"{self.schedule.label}, {self.runner.name}")
