"""The one interface the Trainer runs its workers through, in-process, on Ray or on a ``jax.distributed`` job.

A backend owns the workers and, on each, one ``StageTrainer`` per stage it holds;
``step`` runs the schedule and every stage's optimizer update where it lives and
returns the step's result with every stage's squared gradient norm.
"""

from __future__ import annotations

import os
from typing import Mapping, Protocol, Sequence

import jax
import numpy as np

from ...errors import VjpsplitError
from ...files.dtypes import dtype_name
from ...treetypes import Leaf, PyTree
from ..runtime.devices import placed, placement
from ..runtime.model import Microbatch
from ..runtime.offload import Offload, offload_of
from ..runtime.result import PipelineResult
from ..schedules.layout import Layout
from ..schedules.stepplans import Resolved
from ..stages.evalprograms import EvalProgram
from .checkpoint import save_checkpoint
from .checkpoint_layout import HostCheckpoint
from .device_memory import DeviceMemory
from .local_backend import InProcessBackend, stage_trainers
from .optimizer import stage_programs
from .distributed_backend import DistributedBackend, distributed_placement
from .option_values import Distributed, InProcess, Ray, Runner
from .ownership import Ownership, Snapshot
from .ray_backend import RayBackend, RayOptions
from .arguments import Optimizer
from .zero1 import replica_program, replica_trainers
from .optax_state import state_map, whole_optimizer
from .separable import WholeOptimizer


class Backend(Protocol):
    """Where the Trainer's stages live and run: every method the Trainer and ``fit`` call on a backend.

    ``InProcessBackend``, ``RayBackend`` and ``DistributedBackend`` each have every member (structurally: none
    subclasses this)."""

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
        """One optimizer step: ``schedule``'s plans on ``mbs``, then every stage's update; the result and
        each stage's squared sum of the gradients it counts in the global norm (before clipping).

        ``timed``: every operation waits for its results and the result's events are
        their compute times (what measuring a schedule's costs needs); otherwise
        nothing waits that the step does not need, and the result has no events.
        ``scales``: per microbatch, its loss weight over the step's (``Microbatches.scales``): the step's loss
        and gradients are the weighted sum over microbatches; None: the mean."""
        ...

    def evaluate(
        self, mbs: Sequence[Microbatch], programs: Sequence[EvalProgram], outputs: bool
    ) -> tuple[list[float], list[list[np.ndarray]], list[PyTree] | None]:
        """Every stage's forward only on ``mbs``, from its evaluation program where the stage lives: the
        per-microbatch losses, aux leaves (``evaluation.loss_and_aux``; empty lists without aux) and, with
        ``outputs``, what the last stage received per microbatch (host arrays).
        No residual is kept and no parameter or optimizer state changes."""
        ...

    @property
    def placement(self) -> list[tuple[jax.Device | str, ...]]:
        """Per stage, the devices that hold its parameters (``jax.Device``s in-process; on Ray, as each actor's JAX
        names them)."""
        ...

    def send_seconds(self, values: Sequence[PyTree], repeats: int) -> list[float]:
        """Per stage boundary ``s -> s + 1``, one send of ``values[s]`` from stage ``s``'s worker to stage
        ``s + 1``'s as a step makes it, timed apart: the median of ``repeats``. Between steps only."""
        ...

    def set_offload(self, spec: Offload | None) -> None:
        """From the next step, every stage's residuals off its device between F and B as ``spec`` says (None: none)."""
        ...

    def snapshots(self) -> list[Snapshot]:
        """Every stage's ``(params, optimizer state)``, flat by global key, as host arrays."""
        ...

    def memory(self) -> list[DeviceMemory]:
        """Per device that holds a stage, its bytes of parameters, optimizer state and residuals (``device_memory``)."""
        ...

    def load(self, snapshots: Sequence[Snapshot]) -> None:
        """Every stage holds its ``(params, optimizer state)`` of ``snapshots`` from now on (a checkpoint's)."""
        ...

    def workers(self) -> list[object]:
        """The Ray actor handle of each worker (an error in-process)."""
        ...

    def replace(self, workers: Sequence[int]) -> None:
        """New workers in place of ``workers``' lost ones, each holding its stages and optimizer programs as the
        Trainer began (``load`` then sets every stage to a checkpoint); in-process no worker is ever lost, so an error."""
        ...

    def report_hangs_to(self, path: str) -> None:
        """Where a stuck or interrupted step's report (its workers' last operations, as JSON) goes from now on."""
        ...

    def close(self) -> None:
        """End the workers."""
        ...


def open_backend(
    runner: Runner,
    ownership: Ownership,
    optimizer: Optimizer,
    states: Sequence[Mapping[str, Leaf] | None],
    *,
    layout: Layout,
    step_timeout: float,
    data_parallel: int = 1,
    hang_report: str | None = None,
) -> Backend:
    """The backend ``runner`` says, its workers holding the stages of ``ownership`` and each stage's
    exported ``optimizer`` (specs from the stage's parameters where they are placed) and ``states``.

    ``step_timeout``: seconds a step (in-process: a timed step) may take; ``hang_report``: where a stuck step's
    report goes. ``data_parallel=N`` (the runner's, or what the export recorded): every stage on N replicas, its
    optimizer state sharded across them (``replicas``), in-process or in each Ray worker's actor. The runner's
    ``offload``: residuals off the device between F and B (``offload.Offload``; every replica its own)."""
    devices = runner.devices if isinstance(runner, InProcess) else None
    offload = offload_of(runner.offload)
    smap = state_map(optimizer, ownership)
    whole = whole_optimizer(optimizer, ownership, smap)
    refusal = whole.refusal()
    if refusal is not None:
        raise refusal
    if whole.init_whole and any(st is None for st in states):
        # An init that reduces over leaves runs once for the whole model, on the driver, as opt_state= does.
        params = ownership.gather([_host_flat(n, p) for n, p in zip(ownership.names, ownership.stage_params)])
        init = smap.scatter(jax.device_get(jax.jit(optimizer.init)(params)))
        states = [init[s] if st is None else st for s, st in enumerate(states)]
    reductions = [(r.op, dtype_name(np.dtype(r.dtype)), r.round) for r in whole.roots()]
    if isinstance(runner, Distributed):
        return _distributed(runner, ownership, optimizer, states, whole, layout, step_timeout, offload, data_parallel)
    if data_parallel > 1 and isinstance(runner, InProcess):
        trainers = replica_trainers(
            ownership,
            optimizer,
            states,
            whole,
            n=data_parallel,
            workers=layout.workers,
            devices=devices,
            offload=offload,
        )
        return InProcessBackend(ownership, trainers, step_timeout, hang_report, data_parallel)
    if data_parallel > 1:  # on Ray: each actor makes its replicas on its own devices, from programs made here
        programs = [
            replica_program(optimizer, a, p, s, data_parallel, ownership.names[s], whole, ownership.counted[s])
            for s, (a, p) in enumerate(zip(ownership.artifacts, ownership.stage_params))
        ]
    else:
        # On Ray this placement only shapes the optimizer programs: each actor places its stages on its own devices.
        where = placement(ownership.artifacts, layout.workers, devices, warn=isinstance(runner, InProcess))
        arts = placed(ownership.artifacts, where)
        # Specs only: an unsharded stage's parameters go to its own device, never all to the default one first.
        specs = [a.place_arg(0, p) if a.manifest.sharded else _specs(p) for a, p in zip(arts, ownership.stage_params)]
        programs = stage_programs(optimizer, arts, ownership.names, specs, whole, ownership.counted)
        if isinstance(runner, InProcess):
            return InProcessBackend(
                ownership, stage_trainers(ownership, arts, where, programs, states, offload), step_timeout, hang_report
            )
    return RayBackend(
        ownership,
        programs,
        states,
        reductions,
        whole.uses_value,
        data_parallel=data_parallel,
        hang_report=hang_report,
        offload=offload,
        **_ray_options(runner, step_timeout, layout),
    )


def write_checkpoint(backend: Backend, directory: str | os.PathLike[str], ck: HostCheckpoint) -> None:
    """``ck`` written to ``directory`` as ``backend``'s Trainer saves: from this process in-process and on Ray; on
    a ``jax.distributed`` job by its process 0, every process returning once it is written
    (``DistributedBackend.save``).

    Raises:
        VjpsplitError: the checkpoint was not written (naming the directory and why).
    """
    if isinstance(backend, DistributedBackend):
        backend.save(directory, ck)
    else:
        save_checkpoint(directory, ck)


def _distributed(
    runner: Distributed,
    ownership: Ownership,
    optimizer: Optimizer,
    states: Sequence[Mapping[str, Leaf] | None],
    whole: WholeOptimizer,
    layout: Layout,
    step_timeout: float,
    offload: Offload | None,
    n: int,
) -> DistributedBackend:
    """``open_backend``'s ``Distributed`` runner: this process's stages of the job, their programs exported here
    (with ``n`` replicas, each over its replicas' mesh, as in-process).

    Raises:
        VjpsplitError: a sharded stage; ``devices=`` not one list of ``n`` devices per stage.
    """
    S = len(ownership.artifacts)
    if any(a.manifest.sharded for a in ownership.artifacts):
        raise VjpsplitError("runner=Distributed() runs unsharded stages only (a sharded stage is not supported yet)")
    if runner.devices is not None and len(runner.devices) != S:
        raise VjpsplitError(f"Distributed(devices=...): {S} stages but {len(runner.devices)} device lists")
    if runner.devices is not None and len(runner.devices[0]) != n:
        raise VjpsplitError(
            f"Distributed(devices=...): {len(runner.devices[0])} devices per stage for data_parallel={n} (not given: "
            f"what the stages' export recorded, else 1); give {n} per stage, or Distributed(data_parallel=...)"
        )
    devices = distributed_placement(S, layout.workers, n) if runner.devices is None else runner.devices
    own = ownership
    if n > 1:

        def program(s: int) -> bytes:
            return replica_program(
                optimizer, own.artifacts[s], own.stage_params[s], s, n, own.names[s], whole, own.counted[s]
            )

        return DistributedBackend(ownership, devices, program, states, step_timeout, offload)
    specs = [_specs(p) for p in ownership.stage_params]
    programs = stage_programs(optimizer, ownership.artifacts, ownership.names, specs, whole, ownership.counted)
    return DistributedBackend(ownership, devices, programs.__getitem__, states, step_timeout, offload)


def _ray_options(runner: Runner, step_timeout: float, layout: Layout) -> RayOptions:
    """``RayBackend``'s keywords from a ``Ray`` runner (what ``open_backend`` reaches once not in-process)."""
    if not isinstance(runner, Ray):
        raise TypeError(f"a Ray runner expected, got {runner!r}")
    return {
        "address": runner.address,
        "runtime_env": runner.runtime_env,
        "actor_options": runner.actor_options,
        "step_timeout": step_timeout,
        "schedule_timeout": runner.schedule_timeout,
        "layout": layout.workers,
    }


def _specs(tree: PyTree) -> PyTree:
    """The shapes and dtypes of ``tree``'s leaves, as ``jax.device_put`` would make them."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jax.numpy.result_type(a)), tree)


def _host_flat(names: Sequence[str], tree: PyTree) -> dict[str, Leaf]:
    return dict(zip(names, jax.tree_util.tree_leaves(tree)))
