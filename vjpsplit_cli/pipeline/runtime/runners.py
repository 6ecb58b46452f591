"""``run``: one pipelined training step on the runner named, in-process or on a Ray pipeline made for it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Mapping, Sequence

from ...errors import VjpsplitError
from ..schedules.ops import Op
from ..schedules.stepplans import layout_for
from ..stages.directory import Stages
from .inprocess import run_inprocess
from .ray.pipeline import RayPipeline
from .result import PipelineResult
from ...treetypes import Leaf, PyTree

if TYPE_CHECKING:
    import jax

    from ...artifact.artifact import Artifact

RUNNERS = ("inprocess", "ray")


def check_runner(runner: str) -> None:
    """Refuse a runner name other than ``inprocess`` and ``ray``."""
    if runner not in RUNNERS:
        raise VjpsplitError(f"unknown runner {runner!r}; use inprocess or ray")


def run(
    artifacts: Sequence[Artifact] | Stages,
    params: PyTree,
    x: PyTree,
    side: Mapping[str, Leaf] | Sequence[Leaf] = (),
    *,
    microbatches: int,
    schedule_name: str = "1f1b",
    runner: str = "inprocess",
    address: str | None = None,
    progress: bool = False,
    schedule: Sequence[Sequence[Op]] | None = None,
    devices: Sequence[Sequence[jax.Device]] | None = None,
    timed: bool = True,
) -> PipelineResult:
    """One pipelined training step: ``runner`` is ``inprocess`` (default) or ``ray``.

    ``artifacts`` is a ``Stages`` (then ``params`` is the whole parameter pytree and
    ``x`` the batch tuple; ``grads`` come back in ``params``' structure) or one
    artifact per stage with one parameter pytree each, ``x`` the first stage's input
    and ``side`` the last stage's. ``schedule`` (plans, e.g. from ``read_schedule``)
    runs instead of ``schedule_name``, once checked. In-process, ``devices`` gives
    one list of devices per stage (see ``run_inprocess``); a Ray worker runs on the
    devices its actor sees. ``timed`` (default): the result's timeline holds each
    operation's compute time; ``timed=False`` waits for no operation and records none.

    Args:
        artifacts: A ``Stages``, or one artifact per stage.
        params: The whole parameter pytree for a ``Stages``, else one parameter pytree per stage.
        x: The batch tuple for a ``Stages``, else the first stage's input.
        side: The last stage's side inputs (a ``Stages`` takes none).
        microbatches: How many microbatches to split the batch into.
        schedule_name: The built-in schedule (by default ``"1f1b"``).
        runner: ``"inprocess"`` (default) or ``"ray"``.
        address: For ``ray``, the cluster address; ``None`` starts (or joins) a local instance.
        progress: Whether to show a progress bar.
        schedule: Plans to run instead of ``schedule_name``, once checked; ``None`` for the named schedule.
        devices: In-process only: one list of devices per stage; ``None`` places them
            as ``run_inprocess`` does.
        timed: Whether to time each operation.

    Returns:
        The step's ``PipelineResult``.

    Raises:
        VjpsplitError: If ``runner`` is unknown, ``devices`` is given for ``ray``, or
            as ``run_inprocess`` and ``RayPipeline`` raise.
    """
    check_runner(runner)
    if runner == "inprocess":
        return run_inprocess(
            artifacts,
            params,
            x,
            side,
            devices=devices,
            microbatches=microbatches,
            schedule_name=schedule_name,
            progress=progress,
            schedule=schedule,
            timed=timed,
        )
    if devices is not None:
        raise VjpsplitError(
            "devices= places the stages of this process; a Ray worker runs on the devices its actor sees"
        )
    layout = layout_for(schedule_name, schedule, len(artifacts))
    with RayPipeline(artifacts, params, address=address, layout=layout.workers) as rp:
        return rp.run(
            x,
            side,
            microbatches=microbatches,
            schedule_name=schedule_name,
            progress=progress,
            schedule=schedule,
            timed=timed,
        )
