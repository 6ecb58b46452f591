"""Pipeline parallelism over artifacts: GPipe, 1F1B, ZB-H1, ZB-V, interleaved 1F1B and DualPipeV, in-process or on Ray.

A model is cut into S stages, one artifact each. Stage ``s`` is a function
``stage(params, x, *side)``: ``x`` is the previous stage's output (the batch input
for stage 0) and ``side`` are per-microbatch inputs such as labels. The last stage
returns the microbatch's scalar loss (a mean over the microbatch); the pipeline's
loss is the mean over microbatches, so its gradients equal ``value_and_grad`` of
the whole model on the whole batch.

Stages run on *workers* (threads or Ray actors). GPipe, 1F1B and ZB-H1 put one
stage on each worker; ZB-V puts two on each, in a V: worker ``w`` of ``p = S/2``
holds stages ``w`` and ``2p-1-w``; DualPipeV uses the same V; interleaved 1F1B puts
``v`` stages on each (stage ``s`` on worker ``s mod p``). A schedule can also be
data: ``read_schedule``/``write_schedule`` use torch.distributed.pipelining's CSV,
and every runner takes such plans as ``schedule=`` after checking them. Each worker runs its own list of operations in
order (``schedule``): ``F`` (forward, keeping residuals), ``B`` (backward; in
ZB-H1 and ZB-V only its input part, which the previous stage waits for) and ``W``
(the weight part, deferred into what would be idle time). Residuals never leave
their worker; activations and cotangents go between stages (through Ray's object
store with the Ray runner).

The package's modules: ``boundary``, ``cut``, ``balance``, ``exporting``, ``stagedir``,
``stagereport`` and ``fromone`` (stages from one function: the mark, the cut, the
balanced cut, the export, the directory, what ``inspect DIR`` shows, the runners'
``Stages`` form); ``schedules`` (pure lists of operations), ``plans`` (schedules as
CSV, and the checks of user plans), ``timeline`` (events, simulation, bubbles,
plots), ``stage`` (one stage's operations), ``dispatch`` (the one walker every runner
hands its operations to), ``inprocess`` and ``ray_runner`` (the runners; ``ray_actor``
is the actor, ``ray_setup`` starts Ray and places actors, ``compiled`` the Compiled
Graph), ``training`` (``Trainer``: the optimizer step where the parameters live;
``trainstage`` its per-stage state, ``ray_train`` its Ray actors, ``optimizer`` the
optimizer as exported programs, ``clipping`` and ``checkpoint``).

May import every layer but ``cli``.
"""

from __future__ import annotations

from typing import Any, Sequence

from ..errors import VjpsplitError
from .runtime.dispatch import progress_bar, walk
from .runtime.inprocess import run_inprocess
from .schedules.plans import check_plans, layout_of, read_schedule, split_ops, write_schedule
from .runtime.ray.actor import StageActor
from .runtime.ray.pipeline import STEP_TIMEOUT, RayPipeline
from .runtime.ray.setup import SCHEDULE_TIMEOUT, placement_group_options
from .schedules.builtins import (
    LABELS,
    SCHEDULES,
    SPLIT_BACKWARD,
    Op,
    check_schedule,
    dependencies,
    layout,
    placement,
    schedule,
)
from .runtime.worker import StageWorker, check_stages, run_op, split_batch, stage_devices
from .schedules.timeline import Event, PipelineResult, bubble_ratio, plot_loss, plot_timeline, replay, simulate
from .training.trainer import Trainer

__all__ = [
    "LABELS",
    "SCHEDULES",
    "SCHEDULE_TIMEOUT",
    "SPLIT_BACKWARD",
    "STEP_TIMEOUT",
    "Event",
    "Op",
    "PipelineResult",
    "RayPipeline",
    "StageActor",
    "StageWorker",
    "Trainer",
    "bubble_ratio",
    "check_plans",
    "check_schedule",
    "check_stages",
    "dependencies",
    "layout",
    "placement",
    "placement_group_options",
    "plot_loss",
    "plot_timeline",
    "progress_bar",
    "read_schedule",
    "replay",
    "run",
    "run_inprocess",
    "run_op",
    "schedule",
    "simulate",
    "split_batch",
    "split_ops",
    "stage_devices",
    "walk",
    "write_schedule",
]


def run(
    artifacts: Sequence,
    params: Sequence,
    x,
    side=(),
    *,
    microbatches: int,
    schedule_name: str = "1f1b",
    runner: str = "inprocess",
    address: str | None = None,
    progress: bool = False,
    schedule: Sequence[Sequence[Op]] | None = None,
) -> PipelineResult:
    """One pipelined training step: ``runner`` is ``inprocess`` (default) or ``ray``.

    ``schedule`` (plans, e.g. from ``read_schedule``) runs instead of ``schedule_name``, once checked.
    """
    kw: dict[str, Any] = {
        "microbatches": microbatches,
        "schedule_name": schedule_name,
        "progress": progress,
        "schedule": schedule,
    }
    if runner == "inprocess":
        return run_inprocess(artifacts, params, x, side, **kw)
    if runner == "ray":
        lay = layout_of(schedule_name, schedule, len(artifacts))
        with RayPipeline(artifacts, params, address=address, layout=lay) as rp:
            return rp.run(x, side, **kw)
    raise VjpsplitError(f"unknown runner {runner!r}; use inprocess or ray")
