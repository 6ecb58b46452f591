"""Opening a Trainer: every attribute it keeps, made from its typed options, its parameters and its state.

``TrainerSetup._start`` is what ``Trainer(...)`` and ``Trainer.restore`` both run:
it checks the settings, makes the model's one form (``runtime.model``) and who
holds which leaf (``ownership``), resolves the schedule (or ``autoplan`` for
``"auto"``), scatters an optax state given for the whole model to the stages
(``optax_state``), opens the backend (``backend.open_backend``: the optimizer
exported per stage, the workers started) and starts the history and the cost
samples. ``recorded_replicas``: the replicas a ``Stages`` export recorded.

May import ``backend``, ``ownership``, ``autoplan``, ``optax_state``, ``history``, ``measured``, ``optimizer``,
``microbatch_keys``, ``step_aux``, ``options``, ``option_values`` and ``arguments`` of this room, ``runtime``, ``schedules``, ``stages`` and the
layers below ``pipeline``.
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ...safeio.outputs import check_apart
from ...treetypes import Leaf, PyTree
from ..runtime.devices import warn_idle
from ..runtime.model import Microbatch, model_of
from ..runtime.offload import Offload, offload_of
from ..runtime.result import PipelineResult
from ..schedules.catalog import V_SHAPED, describe
from ..schedules.stepplans import resolve
from ..stages.directory import Stages
from ...files.sizes import plain
from .arguments import Optimizer, checked_clip, checked_microbatches
from .autoplan import AutoPlan
from .backend import Backend, open_backend
from .history import CheckpointTime, History, RestartRecord, Stragglers, cost_signature
from .measured import CostSamples
from .microbatch_keys import checked_rng
from .optax_state import state_map
from .optimizer import optimizer_name
from .option_values import InProcess, PerStage, Schedule
from .step_aux import checked_aux
from .options import Options
from .ownership import Ownership


class TrainerSetup:
    """``Trainer``'s opening (the module docstring): the attributes the Trainer and its other parts read."""

    def _start(
        self,
        options: Options,
        params: PyTree,
        optimizer: Optimizer,
        microbatches: int,
        clip_global_norm: float | None,
        opt_state: PyTree,
        step_count: int,
        restored: Sequence[Mapping[str, Leaf] | None] | None,
        rng: object = None,
        aux: object = None,
    ) -> None:
        """Open the Trainer: ``restored`` is the per-stage optimizer states an older checkpoint holds (``restore``);
        ``rng`` the PRNG key of a loss that takes one (``microbatch_keys``); ``aux`` how a step reports the last
        stage's aux (``step_aux``)."""
        clip_global_norm = checked_clip(clip_global_norm)  # a bad value is refused now, not after the first step
        microbatches, step_count = checked_microbatches(microbatches), _checked_step_count(step_count)
        stages, runner, observe = options.stages, options.runner, options.observe
        schedule = Schedule() if options.schedule is None else options.schedule
        tied = stages.tied if isinstance(stages, PerStage) else None
        stages = stages.artifacts if isinstance(stages, PerStage) else stages
        # Not given: what the export recorded (``export_stages(data_parallel=N)``, ``--data-parallel N``), else 1.
        given = runner.data_parallel
        self.data_parallel = given if given is not None else recorded_replicas(stages)
        self.rng = checked_rng(rng, stages, self.data_parallel)  # before any export, as every option
        self.aux = checked_aux(aux, stages.artifacts if isinstance(stages, Stages) else stages)
        self.offload = offload_of(runner.offload)  # given by hand; auto's planned offload is apart
        self.trace_dir, self.trace_every = observe.trace_dir, observe.trace_every
        check_apart(self._directories())  # offload files and traces apart, before any step
        self.stages = stages
        self.model = model_of(stages, params)
        self.ownership = Ownership(self.model, tied)
        S = self.model.num_stages
        self.microbatches, self.schedule = microbatches, schedule
        self.auto: AutoPlan | None = None
        if schedule.auto:
            self.auto = AutoPlan(
                self.model.artifacts,
                microbatches,
                schedule.memory_limit,
                schedule.memory_limit_bytes,
                trial_rounds=schedule.trial_rounds,
                every_step_timed=observe.timeline,
            )
            self.plan = self.auto.current
        else:  # a bad schedule is refused before any export
            self.plan = resolve(schedule, S, microbatches)
            if schedule.label in V_SHAPED and isinstance(runner, InProcess) and runner.devices is None:
                warn_idle(describe(schedule.label), self.plan.layout.workers, self.data_parallel)
        self.clip_global_norm, self.runner = clip_global_norm, runner
        self.optimizer_name = optimizer_name(optimizer)
        self.optimizer, self._state_map = optimizer, None if opt_state is None else state_map(optimizer, self.ownership)
        states: Sequence[Mapping[str, Leaf] | None] = [None] * S if restored is None else list(restored)
        if self._state_map is not None:
            states = self._state_map.scatter(opt_state)
        hang_report = observe.hang_report
        self.backend: Backend = open_backend(
            runner,
            self.ownership,
            optimizer,
            states,
            layout=self.plan.layout,
            step_timeout=observe.step_timeout,
            data_parallel=self.data_parallel,
            hang_report=None if hang_report is None else os.fspath(hang_report),
        )
        self._hang_named = hang_report is not None
        self.observe = observe
        self.timeline = observe.timeline
        self.step_count = step_count
        self._history = History(observe.progress, self.step_count)
        self._samples = CostSamples(self.model.artifacts)
        self._transfer: dict[str, float] | None = None  # measured once, at the first costs()
        self._send: list[float] | None = None  # per stage boundary, one send's seconds: at the first costs() too
        self._sent_by: Microbatch | None = None  # the first timed step's first microbatch: what the send probe sizes
        self._auto_offload: Offload | None = None
        self._steps_run = 0
        self._signatures = [cost_signature(a) for a in self.model.artifacts]
        self._stragglers: Stragglers | None = None
        self.last_result: PipelineResult | None = None
        self.checkpoint_times: list[CheckpointTime] = []  # fit's: per checkpoint, the step's wait and the write
        self.restarts: list[RestartRecord] = []  # fit's: per lost worker, the step, where it returned, how long

    def _directories(self) -> dict[str, str | os.PathLike[str] | None]:
        """The directories the Trainer writes to, by option (None: not given): its offload's and ``trace_dir``.

        Returns:
            ``{option: directory}``, what ``safeio.outputs.check_apart`` keeps apart (``fit`` adds
            ``checkpoint_dir``).
        """
        off = self.offload
        return {
            "Offload(directory=...)": None if off is None else off.directory,
            "Observe(trace_dir=...)": self.trace_dir,
        }


def recorded_replicas(stages: Stages | Sequence[Artifact]) -> int:
    """The replicas of every stage a ``Stages`` export recorded (its index's ``data_parallel``); 1 for artifacts."""
    return stages.index.data_parallel if isinstance(stages, Stages) else 1


def _checked_step_count(step_count: object) -> int:
    """``Trainer(step_count=)`` as an int >= 0.

    Raises:
        VjpsplitError: anything else, naming the option.
    """
    step_count = plain(step_count)
    if isinstance(step_count, bool) or not isinstance(step_count, int) or step_count < 0:
        raise VjpsplitError(f"step_count={step_count!r}: give the run's step this state is at, an int >= 0")
    return step_count
