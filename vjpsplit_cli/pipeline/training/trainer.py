"""``Trainer``: pipelined training, the optimizer step where each stage's parameters live.

``Trainer(stages, params, optimizer=optax_tx, ...)`` takes a ``Stages``
(``export_stages``) and the whole parameter pytree. It hands each job to one
piece: ``runtime.model`` cuts the batch, ``ownership.Ownership`` says which stage
holds which leaf, ``backend.open_backend`` exports the optimizer per stage and
starts the workers (threads in this process, or Ray actors) behind one
``Backend`` interface, ``history.History`` keeps the steps, and ``checkpoint``
writes and reads the state. Each worker keeps its stages' parameters and
optimizer state (``stagestate.StageTrainer``); only the loss and the stages'
squared gradient norms reach the driver.

The older per-stage form (a list of artifacts and one parameter pytree per stage,
``tied=`` naming ``(stage, key)`` groups, keys ``"s/k"``) is accepted too.
"""

from __future__ import annotations

import os
import time
from typing import Any, Mapping, Sequence

from ...errors import VjpsplitError
from ..runtime.model import model_of
from ..runtime.ray.pipeline import STEP_TIMEOUT
from ..runtime.ray.setup import SCHEDULE_TIMEOUT
from ..runtime.result import PipelineResult
from ..runtime.runners import check_runner
from ..schedules.csvformat import format_schedule, parse_schedule
from ..schedules.ops import Op
from ..schedules.plans import resolve
from ..stages.directory import Stages
from .backend import Backend, open_backend
from .checkpoint import load_checkpoint, save_checkpoint
from .clipping import clip_scale
from .history import History
from .ownership import Ownership, Snapshot, Tied, saved_params


class _Recorded:
    """``Trainer.restore``'s default for a setting the checkpoint records: the recorded value."""

    def __repr__(self) -> str:
        return "RECORDED"


RECORDED: Any = _Recorded()


class Trainer:
    """Pipelined training: ``step(batch)`` runs the schedule and every stage's optimizer update where it lives.

    ``stages``: a ``Stages`` and ``params`` the whole parameter pytree (or the
    per-stage form: artifacts and one pytree per stage, with ``tied``).
    ``optimizer``: an optax ``GradientTransformation``, exported per stage (the
    workers need no optax). ``clip_global_norm=c`` clips by the norm over all
    stages' gradients (a tied leaf counted once), as ``optax.chain(
    optax.clip_by_global_norm(c), optimizer)`` on one device; a clipping
    transformation inside ``optimizer`` acts per stage. ``runner``: ``inprocess``
    or ``ray`` (then ``address``, ``runtime_env``, ``actor_options``,
    ``step_timeout``, ``schedule_timeout`` as ``RayPipeline`` takes them).
    ``progress=True`` shows a bar over steps with the loss. ``history`` keeps per
    step the loss, the gradients' global norm (before clipping), the step time and
    the measured and modeled bubble (NaN for an untimed step).

    In-process, every stage runs on a device of its own: ``devices`` gives one list
    per stage (one device, or a sharded stage's mesh devices); by default worker k's
    stages go to ``jax.local_devices()[k]`` where there are enough, else all share
    the default device. ``placement`` says where each stage is. ``timeline=True``
    times every step (``step(batch, timed=True)`` one step): each operation waits
    for its results, and ``last_result`` holds their compute times.
    """

    def __init__(
        self,
        stages: Stages | Sequence[Any],
        params: Any,
        *,
        optimizer: Any,
        microbatches: int,
        schedule_name: str = "1f1b",
        runner: str = "inprocess",
        clip_global_norm: float | None = None,
        schedule: Sequence[Sequence[Op]] | None = None,
        progress: bool = False,
        tied: Tied | None = None,
        devices: Sequence[Sequence[Any]] | None = None,
        address: str | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        actor_options: Sequence[Mapping[str, Any]] | None = None,
        step_timeout: float = STEP_TIMEOUT,
        schedule_timeout: float = SCHEDULE_TIMEOUT,
        timeline: bool = False,
        _restored: tuple[Sequence[Snapshot], int] | None = None,
    ):
        clip_scale([], clip_global_norm)  # a bad value is refused now, not after the first step
        check_runner(runner)
        self.stages = stages
        self.model = model_of(stages, params)
        self.ownership = Ownership(self.model, tied)
        S = self.model.num_stages
        self.microbatches, self.schedule_name, self.schedule = microbatches, schedule_name, schedule
        self.plan = resolve(schedule_name, schedule, S, microbatches)  # a bad schedule is refused before any export
        self.clip_global_norm, self.runner = clip_global_norm, runner
        self.optimizer_name = getattr(getattr(optimizer, "init", None), "__qualname__", type(optimizer).__name__)
        states = [None] * S if _restored is None else [st for _, st in _restored[0]]
        self.backend: Backend = open_backend(
            runner,
            self.ownership,
            optimizer,
            states,
            layout=self.plan.layout,
            devices=devices,
            address=address,
            runtime_env=runtime_env,
            actor_options=actor_options,
            step_timeout=step_timeout,
            schedule_timeout=schedule_timeout,
        )
        self.timeline = timeline
        self.step_count = 0 if _restored is None else _restored[1]
        self._history = History(progress, self.step_count)
        self.last_result: PipelineResult | None = None

    @property
    def history(self) -> list[dict[str, float]]:
        """Per step: ``step``, ``loss``, ``grad_norm`` (before clipping), ``step_time``, ``bubble``, ``modeled_bubble``."""
        return self._history.rows

    @property
    def placement(self) -> list[tuple[Any, ...]]:
        """Per stage, the devices that hold its parameters (``jax.Device``s in-process; on Ray, as each
        actor's JAX names them)."""
        return self.backend.placement

    def step(self, batch: tuple[Any, ...], *, timed: bool | None = None) -> float:
        """One optimizer step on ``batch`` (the function's batch inputs as a tuple); returns the step's loss.

        ``timed=True`` waits for every operation and records its compute time in
        ``last_result.events`` (for its timeline, or to measure the stages' costs);
        it costs the overlap of dispatch with compute. Default: the Trainer's ``timeline``.
        """
        t0 = time.monotonic()
        mbs = self.model.batch_microbatches(batch, self.microbatches)
        timed = self.timeline if timed is None else timed
        r, sums = self.backend.step(mbs, self.plan, self.microbatches, self.clip_global_norm, False, timed=timed)
        _, norm = clip_scale(sums, None)
        self.step_count += 1
        self._history.record(self.step_count, r, norm, time.monotonic() - t0)
        self.last_result = r
        return r.loss

    def params(self) -> Any:
        """The parameters now, in ``params``' structure (host arrays; per stage in the per-stage form)."""
        return self.ownership.gather([p for p, _ in self.backend.snapshots()])

    def plot_loss(self, path: str | os.PathLike[str], title: str | None = None) -> None:
        """A PNG of the loss per step (needs matplotlib), beside ``plot_timeline``'s chart of one step."""
        self._history.plot(path, title or f"{self.schedule_name}, {self.runner}")

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write every stage's parameters, optimizer state and the step count to ``directory`` (all or nothing).

        The checkpoint also records what ``restore`` needs to go on: the schedule (its plans,
        when they were the caller's), the microbatches and ``clip_global_norm``.
        """
        meta: dict[str, Any] = {
            "schedule": self.plan.name,
            "optimizer": self.optimizer_name,
            "structure": self.ownership.structure,
            "microbatches": self.microbatches,
            "clip_global_norm": self.clip_global_norm,
        }
        if self.schedule is not None:
            meta["plans"] = format_schedule(self.plan.plans)
        save_checkpoint(directory, self.backend.snapshots(), self.step_count, meta)

    @classmethod
    def restore(
        cls,
        directory: str | os.PathLike[str],
        stages: Stages | Sequence[Any],
        *,
        optimizer: Any,
        microbatches: int | None = None,
        schedule_name: str | None = None,
        schedule: Sequence[Sequence[Op]] | None = None,
        clip_global_norm: float | None = RECORDED,
        **options: Any,
    ) -> Trainer:
        """A Trainer continuing the run saved in ``directory``; takes ``Trainer``'s keyword arguments but ``params``.

        ``microbatches``, the schedule (``schedule_name`` or ``schedule``) and
        ``clip_global_norm`` default to the values the checkpoint recorded; a value
        given here wins. A checkpoint written before they were recorded needs
        ``microbatches`` given (its clipping then defaults to none, as ``Trainer``'s).
        """
        saved, step, meta = load_checkpoint(directory)
        params = saved_params(directory, stages, saved, meta.get("structure"), options.get("tied"))
        if microbatches is None:
            if "microbatches" not in meta:
                raise VjpsplitError(
                    f"{os.fspath(directory)}: this checkpoint does not record its microbatches (an older "
                    "vjpsplit wrote it); pass microbatches= to Trainer.restore"
                )
            microbatches = int(meta["microbatches"])
        if schedule_name is None and schedule is None:
            recorded = str(meta.get("schedule", "1f1b"))
            if "plans" in meta:
                try:
                    schedule = parse_schedule(str(meta["plans"]))
                except VjpsplitError as e:
                    raise VjpsplitError(f"{os.fspath(directory)}: its recorded plans: {e}") from e
            else:
                schedule_name = recorded
        if clip_global_norm is RECORDED:
            clip_global_norm = meta.get("clip_global_norm")
        return cls(
            stages,
            params,
            optimizer=optimizer,
            microbatches=microbatches,
            schedule_name=schedule_name or "1f1b",
            schedule=schedule,
            clip_global_norm=clip_global_norm,
            _restored=(saved, step),
            **options,
        )

    def close(self) -> None:
        """End the workers (Ray actors) and the progress bar."""
        self._history.close()
        self.backend.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
