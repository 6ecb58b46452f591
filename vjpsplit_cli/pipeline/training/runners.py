"""``run``: one pipelined step (gradients, no optimizer) on the runner given, in-process or on a Ray pipeline."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

import jax

from ...errors import VjpsplitError
from ...treetypes import Leaf, PyTree
from ..runtime.inprocess import run_inprocess
from ..runtime.ray.pipeline import RayPipeline
from ..runtime.result import PipelineResult
from ..schedules.catalog import Plans, Schedule, schedule_of
from ..schedules.stepplans import layout_for
from ..stages.directory import Stages
from .option_values import InProcess, Ray, Runner, runner_of

if TYPE_CHECKING:
    from ...artifact.artifact import Artifact


def run(
    artifacts: Sequence[Artifact] | Stages,
    params: PyTree,
    x: PyTree,
    side: Mapping[str, Leaf] | Sequence[Leaf] = (),
    *,
    microbatches: int,
    schedule: str | Schedule | Plans | None = None,
    runner: str | Runner = "inprocess",
    progress: bool = False,
    timed: bool = True,
    schedule_name: str | None = None,
    devices: Sequence[Sequence[jax.Device]] | None = None,
) -> PipelineResult:
    """One pipelined training step: the gradients and loss, no optimizer (``Trainer`` steps one).

    Args:
        artifacts: A ``Stages`` (``grads`` then come back in ``params``' structure), or one artifact per stage.
        params: The whole parameter pytree for a ``Stages``, else one parameter pytree per stage.
        x: The batch tuple for a ``Stages``, else the first stage's input.
        side: The last stage's side inputs (a ``Stages`` takes none).
        microbatches: How many microbatches to split the batch into.
        schedule: A built-in schedule's name (by default ``"1f1b"``), plans (``read_schedule``'s), a ``Schedule``.
        runner: ``"inprocess"`` (default, ``run_inprocess``), ``"ray"`` (a ``RayPipeline``), ``InProcess`` or ``Ray``.
        progress: Whether to show a progress bar.
        timed: Whether to time each operation (``False``: no timeline, nothing waits).
        schedule_name: The contract's spelling of ``schedule=`` with a name.
        devices: The contract's spelling of ``runner=InProcess(devices=...)``: one list of devices per stage.

    Returns:
        The step's ``PipelineResult``.

    Raises:
        VjpsplitError: An unknown runner or schedule; ``data_parallel`` > 1, Ray offload (the Trainer's); the runners'.
    """
    if schedule_name is not None:
        if schedule is not None:
            raise VjpsplitError("run(schedule_name=) and schedule= say the same thing: give one of them")
        schedule = schedule_name
    if devices is not None:
        if runner != InProcess.name:
            raise VjpsplitError(
                f"run(devices=) places stages in this process: give runner=InProcess(devices=...), not runner={runner!r}"
            )
        runner = InProcess(devices=devices)
    chosen, where = schedule_of(schedule), runner_of(runner)
    if where.data_parallel not in (None, 1):
        raise VjpsplitError(
            f"run takes one replica of every stage, not data_parallel={where.data_parallel}: step a Trainer with "
            f"runner={type(where).__name__}(data_parallel=...) for replicas"
        )
    if isinstance(where, InProcess):
        return run_inprocess(
            artifacts,
            params,
            x,
            side,
            devices=where.devices,
            microbatches=microbatches,
            schedule=chosen,
            progress=progress,
            timed=timed,
            offload=where.offload,
        )
    if not isinstance(where, Ray):
        raise VjpsplitError(f"run takes runner='inprocess' or 'ray', not {where.name!r}: step a Trainer on it")
    if where.offload is not None:
        raise VjpsplitError("run on Ray offloads nothing: give Ray(offload=...) to a Trainer, or run in-process")
    layout = layout_for(chosen, len(artifacts))
    with RayPipeline(
        artifacts,
        params,
        address=where.address,
        runtime_env=where.runtime_env,
        actor_options=where.actor_options,
        schedule_timeout=where.schedule_timeout,
        layout=layout.workers,
    ) as rp:
        return rp.run(x, side, microbatches=microbatches, schedule=chosen, progress=progress, timed=timed)
