"""The in-process runner: one step in this process, dispatched from this thread, timed or not.

``run_inprocess`` reads the caller's model (``model_of``), checks the plans, places
every stage on its devices and builds one ``StageWorker`` per stage; the step runs
untimed (``untimed.dispatch``, nothing waits) or timed (``timed.run_timed``: the same
dispatch, a watcher thread per device timing each operation), and its losses, gradients and
events come back as one ``PipelineResult``.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Mapping, Sequence

import jax

from ..schedules.catalog import Plans, Schedule, schedule_of
from ..schedules.ops import Op
from ..schedules.stepplans import resolve
from ..stages.directory import Stages
from .devices import placed, placement
from .model import Microbatch, Model, model_of
from .offload import Offload, offload_of
from .result import PipelineResult, aux_per_microbatch, step_result
from .timed import Timeline, run_timed
from .untimed import dispatch
from .worker import StageWorker
from ...treetypes import Leaf, PyTree

if TYPE_CHECKING:
    from ...artifact.artifact import Artifact

RUNNER = "in-process"


def run_inprocess(
    artifacts: Sequence[Artifact] | Stages,
    params: PyTree,
    x: PyTree,
    side: Mapping[str, Leaf] | Sequence[Leaf] = (),
    *,
    microbatches: int,
    schedule: str | Schedule | Plans = "1f1b",
    progress: bool = False,
    devices: Sequence[Sequence[jax.Device]] | None = None,
    timed: bool = True,
    offload: Offload | str | None = None,
) -> PipelineResult:
    """Run one training step in this process, every stage on its own device where this host has enough.

    Args:
        artifacts: A ``Stages``, or one artifact per stage.
        params: The whole parameter pytree for a ``Stages``, else one parameter pytree per stage.
        x: The batch tuple for a ``Stages``, else the first stage's input.
        side: The last stage's side inputs (a ``Stages`` takes none).
        microbatches: How many microbatches to split the batch into.
        schedule: A built-in schedule's name (by default ``"1f1b"``), or a ``Schedule``.
        progress: Whether to show a progress bar over operations (the step is then timed).
        devices: One list of devices per stage; ``None``: worker k's on ``jax.local_devices()[k]`` where enough.
        timed: ``True``: each operation timed by a watcher per device (a timeline); ``False``: no timeline.
        offload: Residuals off their device between F and B: ``"host"`` or an ``offload.Offload``; ``None``: none.

    Returns:
        The step's ``PipelineResult`` (``runner="in-process"``).

    Raises:
        VjpsplitError: If the schedule cannot run these stages and microbatches, the arguments disagree in number or
            shape, or an operation fails (naming its stage).
    """
    model = model_of(artifacts, params)
    name, plans, mbs, workers = _prepared(model, x, side, microbatches, schedule_of(schedule), devices, offload)
    timed = timed or progress
    t0 = time.monotonic()
    try:
        _play(workers, plans, mbs, microbatches, timed, progress)
        return _result(model, name, plans, microbatches, workers, t0, timed)
    finally:
        for st in workers:  # their offload threads end; residual files of a failed step are removed
            st.set_offload(None)


def _prepared(
    model: Model,
    x: PyTree,
    side: Mapping[str, Leaf] | Sequence[Leaf],
    microbatches: int,
    schedule: Schedule,
    devices: Sequence[Sequence[jax.Device]] | None,
    offload: Offload | str | None,
) -> tuple[str, list[list[Op]], list[Microbatch], list[StageWorker]]:
    """The step's schedule name and plans (checked), its microbatches, and one worker per stage on its devices."""
    S = model.num_stages
    name, plans, layout = resolve(schedule, S, microbatches)
    where = placement(model.artifacts, layout.workers, devices)
    arts = placed(model.artifacts, where)
    model.check_plans(name, plans)
    mbs = model.microbatches(x, side, microbatches)
    spec = offload_of(offload)
    workers = [StageWorker(a, p, i, S, g[0], spec) for i, (a, p, g) in enumerate(zip(arts, model.stage_params, where))]
    return name, plans, mbs, workers


def _play(
    workers: Sequence[StageWorker],
    plans: Sequence[Sequence[Op]],
    mbs: Sequence[Microbatch],
    microbatches: int,
    timed: bool,
    progress: bool,
) -> None:
    """The step itself, dispatched from this thread; timed, by watcher threads of its own (closed after it)."""
    if timed:
        timeline = Timeline()
        try:
            with timeline.step(workers):
                run_timed(workers, plans, mbs, microbatches, progress=progress)
        finally:
            timeline.close()
    else:
        dispatch(workers, plans, mbs, microbatches)


def _result(
    model: Model,
    name: str,
    plans: Sequence[Sequence[Op]],
    microbatches: int,
    workers: Sequence[StageWorker],
    t0: float,
    timed: bool,
) -> PipelineResult:
    """The finished step's ``PipelineResult``: its losses, aux (``has_aux``), gradients (in the model's form) and
    events."""
    grads = [st.grads for st in workers]
    losses, aux = workers[-1].fetch_outputs()
    jax.block_until_ready(grads)
    return step_result(
        schedule=name,
        plans=plans,
        num_stages=model.num_stages,
        microbatches=microbatches,
        runner=RUNNER,
        step_time=time.monotonic() - t0,
        losses=losses,
        grads=model.gather(grads),
        events=[e for st in workers for e in st.events],
        timed=timed,
        aux=aux_per_microbatch(model.artifacts[-1], aux, microbatches),
    )
