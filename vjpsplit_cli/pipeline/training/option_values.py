"""The Trainer's options as typed values, apart from its state: one value for each thing it is told.

``Trainer(stages, params, optimizer=tx, microbatches=8, schedule=..., runner=..., observe=...)``:

* ``schedule``: a built-in schedule's name or a ``Schedule`` (``schedules.catalog``'s:
  ``"auto"`` with its memory limit, or plans, ``read_schedule``'s form, as ``Schedule(plans=)``);
* ``runner``: ``"inprocess"``/``"ray"``/``"distributed"``, or ``InProcess(devices=, data_parallel=)``
  / ``Ray(address=, runtime_env=, actor_options=, schedule_timeout=)`` / ``Distributed(devices=, data_parallel=)``;
* ``observe``: ``Observe(progress=, timeline=, trace_dir=, trace_every=,
  step_timeout=, hang_report=)``, what the Trainer shows and records of its steps;
* ``stages``: a ``Stages``, or the per-stage form's artifacts (``PerStage(artifacts,
  tied=...)`` where stages share leaves).

Each value checks its fields when made. ``options`` gathers them (``Options``).
"""

from __future__ import annotations

import math
import numbers
import os
from dataclasses import dataclass
from typing import ClassVar, Mapping, Sequence

import jax

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ...safeio.outputs import check_directory_option
from ..runtime.offload import Offload, offload_of
from ..runtime.ray.pipeline import STEP_TIMEOUT
from ..runtime.ray.setup import SCHEDULE_TIMEOUT
from ..schedules.catalog import Plans as Plans
from ..schedules.catalog import Schedule as Schedule
from ...files.sizes import plain
from .crosshost import check_distributed, checked_devices
from .ownership import Tied

PathLike = str | os.PathLike[str]


def _check_count(name: str, value: object, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise VjpsplitError(f"{name}={value!r}: give {what}, an int >= 1")


def _checked_replicas(runner: InProcess | Ray | Distributed) -> None:
    """A runner's ``data_parallel``: None (the recorded count) or an int >= 1, stored as a plain int."""
    if runner.data_parallel is not None:
        object.__setattr__(runner, "data_parallel", plain(runner.data_parallel))
        _check_count("data_parallel", runner.data_parallel, "the number of replicas of every stage")


@dataclass(frozen=True)
class InProcess:
    """Run every stage in this process, dispatched from one thread, each stage on a device of its own.

    Args:
        devices: one list of devices per stage (one device for an unsharded stage, a sharded stage's mesh
            devices). Default: worker k's stages on ``jax.local_devices()[k]`` where there are enough,
            else all on the default device.
        data_parallel: N replicas of every stage, each on a device of its own (worker k's on
            ``jax.local_devices()[k*N : k*N + N]``, or ``devices`` with N devices per stage; a sharded stage's
            replicas each on a group of its mesh's k devices: N x k, replica by replica), each microbatch
            split N ways; gradients reduced once per step per stage, the optimizer state sharded (ZeRO-1).
            None: what the stages' export recorded (``export_stages(data_parallel=N)``), else 1.
        offload: residuals off their device between F and B: ``"host"`` or an ``Offload`` (``runtime.offload``);
            None: none (``Schedule("auto", memory_limit_bytes=...)`` may still plan some).

    Raises:
        VjpsplitError: ``data_parallel`` is not an int >= 1; ``offload`` is not None, ``"host"`` or an ``Offload``.
    """

    name: ClassVar[str] = "inprocess"
    devices: Sequence[Sequence[jax.Device]] | None = None
    data_parallel: int | None = None
    offload: Offload | str | None = None

    def __post_init__(self) -> None:
        _checked_replicas(self)
        object.__setattr__(self, "offload", offload_of(self.offload))


@dataclass(frozen=True)
class Ray:
    """Run every worker as a Ray actor (``ray`` installed; the actors need neither the model's code nor optax).

    Args:
        address: the cluster to join (``ray.init(address=...)``); default: the running one, or a local one.
        runtime_env: Ray's runtime environment for the actors.
        actor_options: one dict of Ray actor options per worker (``num_cpus``, ``num_gpus``, ``resources``,
            ``scheduling_strategy``, ...).
        schedule_timeout: seconds for Ray to place and start every actor.
        data_parallel: N replicas of every stage: each worker's actor runs its stages' N replicas on
            N devices of its own (N x k for a sharded stage of k) (on CPU it starts with ``--xla_force_host_platform_device_count=N``; on GPUs
            give it N in ``actor_options``), each microbatch split N ways, as ``InProcess`` does. None: what the
            stages' export recorded, else 1.
        offload: residuals off their device between F and B, in each actor, as ``InProcess``'s.

    Raises:
        VjpsplitError: ``data_parallel`` is not an int >= 1; ``offload`` is not None, ``"host"`` or an ``Offload``.
    """

    name: ClassVar[str] = "ray"
    address: str | None = None
    runtime_env: Mapping[str, object] | None = None
    actor_options: Sequence[Mapping[str, object]] | None = None
    schedule_timeout: float = SCHEDULE_TIMEOUT
    data_parallel: int | None = None
    offload: Offload | str | None = None

    def __post_init__(self) -> None:
        _checked_replicas(self)
        object.__setattr__(self, "offload", offload_of(self.offload))


@dataclass(frozen=True)
class Distributed:
    """Run on multi-controller JAX: every process runs the same script, after ``jax.distributed.initialize()``.

    Each process runs the stages on its own devices; values go between processes through JAX (``crosshost``);
    every process gets the same losses, ``state()`` and ``params()`` (docs/howto/multi-host.md).

    Args:
        devices: one list per stage of ``data_parallel`` devices of ``jax.devices()``, all of one process.
            Default: worker k's stages on the k-th group of ``data_parallel`` devices (each process's devices
            in groups, process by process).
        data_parallel: N replicas of every stage on devices of the process that runs it, as ``InProcess``'s
            (ZeRO-1; replica r hands replica r). None: what the stages' export recorded, else 1.
        offload: residuals off their device between F and B, in each process, as ``InProcess``'s.

    Raises:
        VjpsplitError: before ``jax.distributed.initialize()``; a jax that cannot move arrays between processes;
            a bad ``data_parallel``, ``devices`` (a stage's replicas on several processes) or ``offload``.
    """

    name: ClassVar[str] = "distributed"
    devices: Sequence[Sequence[jax.Device]] | None = None
    data_parallel: int | None = None
    offload: Offload | str | None = None

    def __post_init__(self) -> None:
        _checked_replicas(self)
        object.__setattr__(self, "offload", offload_of(self.offload))
        check_distributed()
        if self.devices is not None:
            object.__setattr__(self, "devices", checked_devices(self.devices, self.data_parallel))


Runner = InProcess | Ray | Distributed


def runner_of(runner: str | Runner) -> Runner:
    """A runner's name as its value (``"inprocess"``, ``"ray"`` and ``"distributed"`` with their defaults); a value
    as it is.

    Raises:
        VjpsplitError: anything else: a name other than ``inprocess``, ``ray`` and ``distributed``;
            ``"distributed"`` before ``jax.distributed.initialize()``.
    """
    if isinstance(runner, (InProcess, Ray, Distributed)):
        return runner
    if runner == Distributed.name:
        return Distributed()
    if runner not in (InProcess.name, Ray.name):
        raise VjpsplitError(
            f"unknown runner {runner!r}; use inprocess, ray or distributed, or InProcess(...), Ray(...) or "
            "Distributed(...)"
        )
    return Ray() if runner == Ray.name else InProcess()


@dataclass(frozen=True)
class Observe:
    """What the Trainer shows and records of its steps, and how long one may take.

    Args:
        progress: a bar over steps with the loss.
        timeline: time every step (``step(batch, timed=True)`` times one): a watcher per device waits for each
            operation's results, the step dispatched as an untimed one, and ``last_result`` holds their compute
            times.
        trace_dir: every timed step writes its trace there as ``step-<n>.trace.json`` (Chrome/Perfetto
            trace-event JSON; ``n`` counts steps from 1); created if absent. A file, or a path under one, is
            refused; so is a directory that overlaps an offload directory or ``fit``'s ``checkpoint_dir``.
        trace_every: time every k-th step (``fit``'s too), so ``Observe(trace_dir="traces", trace_every=100)``
            traces one step in 100.
        step_timeout: seconds for every step on Ray and every timed step in-process; a step past it, or one
            interrupted by Ctrl-C, is one error naming what each worker is running or waiting for.
        hang_report: where that error writes every worker's last operations as JSON (default: in ``fit`` with a
            ``checkpoint_dir``, ``<checkpoint_dir>.hang.json`` beside it; else a file in the temporary directory).

    Raises:
        VjpsplitError: ``trace_every`` is not an int >= 1; ``trace_dir`` is a file or under one; ``step_timeout`` is
            not a finite number of seconds > 0.
    """

    progress: bool = False
    timeline: bool = False
    trace_dir: PathLike | None = None
    trace_every: int | None = None
    step_timeout: float = STEP_TIMEOUT
    hang_report: PathLike | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "trace_every", plain(self.trace_every))
        if self.trace_every is not None:
            _check_count("trace_every", self.trace_every, "how often to time a step and trace it")
        if self.trace_dir is not None:
            check_directory_option("Observe(trace_dir=...)", self.trace_dir)
        object.__setattr__(self, "step_timeout", _checked_seconds("step_timeout", self.step_timeout))


def _checked_seconds(name: str, value: object) -> float:
    """``value`` as seconds, a float: a real number, finite and > 0.

    Raises:
        VjpsplitError: naming ``name``: a string, a bool, None, NaN, infinity, 0 or less.
    """
    value = plain(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise VjpsplitError(f"{name}={value!r} is a {type(value).__name__}; give seconds, a finite number > 0")
    if not math.isfinite(value) or value <= 0:
        raise VjpsplitError(f"{name}={value!r}: give seconds, a finite number > 0")
    return float(value)


@dataclass(frozen=True)
class PerStage:
    """The per-stage form of a model: one artifact per stage (``params``: one pytree per stage), leaves keyed ``"s/k"``.

    Args:
        artifacts: the stages' artifacts, in order.
        tied: groups of ``(stage, key)`` that are one parameter, e.g. ``[[(0, "w"), (2, "w")]]``: held by each
            of those stages, equal there, their gradients summed.
    """

    artifacts: Sequence[Artifact]
    tied: Tied = ()
