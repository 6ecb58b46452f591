"""Pipeline parallelism over artifacts: GPipe, 1F1B, ZB-H1, ZB-V, interleaved 1F1B and DualPipeV, in-process or on Ray.

A model is cut into S stages, one artifact each: from one function with
``stage_boundary`` marks (``export_stages``), or by hand. Stages run on *workers*
(threads or Ray actors), each running its own list of operations in order
(``schedule``): ``F`` (forward, keeping residuals), ``B`` (backward; in ZB-H1,
ZB-V and part of DualPipeV only its input part, which the previous stage waits
for) and ``W`` (the weight part, deferred into what would be idle time).
Residuals never leave their worker; activations and cotangents go between stages.
A schedule can also be data: ``read_schedule``/``write_schedule`` use
torch.distributed.pipelining's CSV, and every runner takes such plans as
``schedule=Schedule(plans=plans)`` after checking them. ``Trainer`` trains the stages, applying the
optimizer where each stage's parameters live, told its options as typed values
(``Schedule``, ``InProcess`` or ``Ray``, ``Observe``; ``PerStage`` for the per-stage
form); its checkpoints are keyed by the model, so another cut, or one process
(``load_checkpoint``), continues the run.

Words: a *layout* is which worker runs which stage (``layout_kind``,
``worker_stages``); *ownership* is which stage holds which parameter leaf (a leaf
several stages read is tied); counts are ``num_stages``, ``num_workers``, indices
``stage``, ``worker``, ``mb``.

The layers, in their dependency order (each imports only the layers before it;
``tests/test_structure.py`` holds it):

* ``schedules/``: operations, the built-in schedules, layouts, the plans'
  execution order (dispatch order, deadlock check, simulation, ZB-H1's W placement),
  plan checks, CSV, timelines and plots;
* ``stages/``: the mark, the cut, the cost model, the balanced cut, the export,
  the ``Stages`` directory with its typed index, the ``inspect`` report;
* ``runtime/``: the stage worker, the model's one form, the one dispatcher, the
  result, the in-process runner and ``ray/``;
* ``training/``: the Trainer, ``run`` (one step on a runner), parameter ownership,
  the backends behind one protocol, per-stage state, the optimizer program,
  clipping, checkpoints.

This module only re-exports what users call; the rest stays in its module
(``schedules.catalog.SCHEDULES``, ``schedules.layout.layout_kind``,
``schedules.plots.plot_loss``, ...).
"""

from __future__ import annotations

from .runtime.devices import SharedDevicesWarning
from .runtime.inprocess import run_inprocess
from .runtime.offload import Offload
from .runtime.ray.pipeline import RayPipeline
from .runtime.result import PipelineResult
from .schedules.auto import auto_schedule
from .schedules.builtins import schedule
from .schedules.catalog import Schedule
from .schedules.csvformat import read_schedule, write_schedule
from .schedules.ops import Kind, Op
from .schedules.play import Costs, simulate
from .schedules.plots import plot_timeline
from .schedules.stepplans import check_plans
from .stages.microbatches import Microbatches
from .training.history import CheckpointTime, RestartRecord, StepRecord
from .training.option_values import Distributed, InProcess, Observe, PerStage, Ray
from .training.resume import load_checkpoint
from .training.runners import run
from .training.trainer import Trainer

__all__ = [
    "CheckpointTime",
    "Costs",
    "Distributed",
    "InProcess",
    "Kind",
    "Microbatches",
    "Observe",
    "Offload",
    "Op",
    "PerStage",
    "PipelineResult",
    "Ray",
    "RayPipeline",
    "RestartRecord",
    "Schedule",
    "SharedDevicesWarning",
    "StepRecord",
    "Trainer",
    "auto_schedule",
    "check_plans",
    "load_checkpoint",
    "plot_timeline",
    "read_schedule",
    "run",
    "run_inprocess",
    "schedule",
    "simulate",
    "write_schedule",
]
