"""``Trainer``: pipelined training, the optimizer step where each stage's parameters live.

``Trainer(stages, params, optimizer=optax_tx, ...)`` takes a ``Stages``
(``export_stages``) and the whole parameter pytree. It hands each job to one
piece: ``runtime.model`` cuts the batch, ``ownership.Ownership`` says which stage
holds which leaf, ``backend.open_backend`` exports the optimizer per stage and
starts the workers (threads in this process, or Ray actors) behind one
``Backend`` interface, ``history.History`` keeps the steps, and ``checkpoint``
writes and reads the state. Each worker keeps its stages' parameters and
optimizer state (``stage_trainer.StageTrainer``); only the loss (with the last
stage's aux, ``step_aux``) and the stages' squared gradient norms reach the driver. ``state`` joins the stages' optimizer
states into optax's structure for the whole model (``state.StateMap``), which is
also what ``save`` writes and ``opt_state=`` takes; ``fit`` runs many steps with
checkpoints and restarts (``fit``).

The older per-stage form (a list of artifacts and one parameter pytree per stage,
``PerStage(artifacts, tied=...)`` naming ``(stage, key)`` groups, keys ``"s/k"``) is
accepted too. The options are typed values (``option_values``).

The Trainer is one class: opening it (``_start``, what ``Trainer(...)`` and ``restore`` both run: every
attribute it keeps, from its options), ``step``, ``evaluate``, ``fit`` and ``restore`` (its settings from the
checkpoint: ``resume.restored_run``), its state (``params``, ``state``, ``save``), what it measured (``history``,
``costs``, ``memory``, stragglers, ``placement``) and ``close``.
"""

from __future__ import annotations

import os
import statistics
import time
import warnings
from typing import Callable, Final, Literal, Mapping, Sequence, Unpack, overload

import jax

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError, one_line
from ...files.sizes import plain
from ...files.trees import encode_structure
from ...safeio.outputs import check_apart
from ...treetypes import Leaf, PyTree
from ..runtime.devices import warn_idle
from ..runtime.model import Microbatch, model_of
from ..runtime.offload import Offload, offload_of
from ..runtime.result import PipelineResult, aux_per_microbatch, step_loss
from ..schedules.catalog import V_SHAPED, describe
from ..schedules.csvformat import format_schedule
from ..schedules.stepplans import Resolved, resolve
from ..stages.directory import Stages
from ..stages.evalprograms import EvalProgram, missing
from ..stages.microbatches import Microbatches
from .arguments import Optimizer, checked_clip, checked_microbatches
from .autoplan import AutoPlan, boundary_values
from .backend import Backend, open_backend, write_checkpoint
from .checkpoint_layout import HostCheckpoint
from .clipping import clip_scale
from .device_memory import DeviceMemory
from .distributed_backend import DistributedBackend
from .fit import fit as fit_steps
from .history import IN_A_ROW, SLOWER, CheckpointTime, History, RestartRecord, StepRecord, Stragglers, cost_signature
from .measured import SEND_PROBES, CostSamples, MeasuredCosts, measure_transfer_rates
from .microbatch_keys import checked_rng, microbatch_keys
from .optax_state import StateMap, state_map
from .optimizer import optimizer_name
from .option_values import InProcess, Observe, PerStage, Plans, Runner, Schedule
from .options import ContractKeywords, Options, options_of
from .ownership import Ownership
from .resume import restored_run, stage_snapshots
from .step_aux import checked_aux, reduced


class _Recorded:
    """``Trainer.restore``'s default for a setting the checkpoint records: the recorded value."""

    def __repr__(self) -> str:
        return "RECORDED"


RECORDED: Final = _Recorded()


class Trainer:
    """Pipelined training: ``step(batch)`` runs the schedule and every stage's optimizer update where it lives.

    ``Trainer(stages, params, optimizer=tx, microbatches=8)``, and what is not the state, one value each:
    ``schedule=`` (a name or a ``Schedule``), ``runner=`` (``"inprocess"``, ``"ray"``, ``InProcess(...)``,
    ``Ray(...)``), ``clip_global_norm=`` and ``observe=Observe(...)``; where the state starts: ``opt_state=`` and
    ``step_count=`` (``__init__`` says each). An optimizer update the stages cannot compute as one process does is
    refused here (``separable``). ``history`` keeps per step the loss, the gradients' global norm (before clipping),
    the step time and the measured and modeled bubble (NaN for an untimed step).

    ``Schedule("auto", ...)`` plans from the measured costs and keeps the fastest on the clock (``autoplan``);
    ``runner`` options place the stages, offload residuals between F and B (bitwise the same gradients) and run
    ``data_parallel`` replicas (losses, parameters and checkpoints those of ``data_parallel=1``). Every step past
    ``Observe(step_timeout=...)``, or interrupted by Ctrl-C, is one error naming what each worker runs or waits for.
    Threads end with ``close()``, ``with Trainer(...) as tr:``, or when a Trainer nobody closed is collected.
    docs/howto/training.md, schedules.md, offload.md and data-parallel.md say the rest.
    """

    def __init__(
        self,
        stages: Stages | PerStage | Sequence[Artifact],
        params: PyTree,
        *,
        optimizer: Optimizer,
        microbatches: int,
        schedule: str | Schedule | Plans | None = None,
        runner: str | Runner = "inprocess",
        clip_global_norm: float | None = None,
        observe: Observe | None = None,
        opt_state: PyTree = None,
        step_count: int = 0,
        rng: jax.Array | None = None,
        aux: str | None = None,
        **keywords: Unpack[ContractKeywords],
    ):
        """A Trainer for ``stages``, starting from ``params`` (and ``opt_state``, at ``step_count``).

        Args:
            stages: A ``Stages`` (``export_stages``), or the per-stage form: a list of artifacts (``PerStage`` if tied).
            params: The whole parameter pytree (the function's ``wrt`` argument); one per stage in the per-stage form.
            optimizer: An optax ``GradientTransformation``, exported per stage (the workers need no optax).
            microbatches: How many microbatches each step's batch is cut into.
            schedule: A built-in schedule's name (default ``"1f1b"``) or a ``Schedule`` (``"auto"``, plans, limits).
            runner: ``"inprocess"``, ``"ray"`` or ``"distributed"``, or ``InProcess``/``Ray``/``Distributed(...)``.
            clip_global_norm: Clip by the global norm over every stage's gradients (a tied leaf once); None: no clip.
            observe: ``Observe(...)``: progress, timeline, traces, ``step_timeout`` and ``hang_report``.
            opt_state: Optax's state for the whole model to start from (``tx.init(params)``'s structure).
            step_count: The run's step this state is at (``fit`` goes on from there).
            rng: A key for a loss that takes one: microbatch ``i`` of step ``t`` gets ``fold_in(fold_in(rng, t), i)``.
            aux: With ``has_aux`` stages: ``"mean"`` (default, each leaf over the microbatches) or ``"per_microbatch"``.
            **keywords: The contract's keywords for a schedule's and a runner's fields (``ContractKeywords``).

        Raises:
            VjpsplitError: A bad value (named; docs/howto/training.md says each), or an optimizer update the stages
                cannot compute as one process does.
        """
        options = options_of(stages, schedule, runner, observe, keywords)
        self._start(options, params, optimizer, microbatches, clip_global_norm, opt_state, step_count, None, rng, aux)

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
        auto, self.plan = self._planned(schedule, runner, observe.timeline)
        self.auto: AutoPlan | None = auto
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

    def _planned(self, schedule: Schedule, runner: Runner, every_step_timed: bool) -> tuple[AutoPlan | None, Resolved]:
        """The first step's plans: ``"auto"``'s (it times its first steps), else the schedule's, resolved before any
        export (a bad schedule is refused here; a V schedule leaving this host's devices idle warns). On
        ``Distributed`` every process plans alike: from every process's costs (``costs``) and, in a race, the
        slowest process's time of each trial step (``step``)."""
        if schedule.auto:
            auto = AutoPlan(
                self.model.artifacts,
                self.microbatches,
                schedule.memory_limit,
                schedule.memory_limit_bytes,
                trial_rounds=schedule.trial_rounds,
                every_step_timed=every_step_timed,
            )
            return auto, auto.current
        plan = resolve(schedule, self.model.num_stages, self.microbatches)
        if schedule.label in V_SHAPED and isinstance(runner, InProcess) and runner.devices is None:
            warn_idle(describe(schedule.label), plan.layout.workers, self.data_parallel)
        return None, plan

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

    def step(
        self, batch: tuple[PyTree, ...] | Microbatches, *, timed: bool | None = None
    ) -> float | tuple[float, PyTree]:
        """One optimizer step on ``batch``: the schedule over its microbatches, then every stage's update.

        ``costs()`` counts timed steps; ``schedule="auto"`` times its first two steps itself and races the plans
        it rates close over the next (trial) steps. docs/howto/variable-lengths.md says ``Microbatches``.

        Args:
            batch: The function's batch inputs as a tuple (a 1-tuple for one input), the whole batch, cut into
                ``microbatches`` along axis 0; or ``Microbatches``, as many as the Trainer's, each as it is.
            timed: True waits for every operation and records its compute time in ``last_result.events`` (it costs the
                overlap of dispatch with compute); None: the Trainer's ``Observe(timeline=...)`` (and ``trace_every``).

        Returns:
            The step's loss: the mean over microbatches (with ``Microbatches``, their weighted mean); for stages whose
            function returns ``(loss, aux)``, ``(loss, aux)``, the aux as ``aux=`` says (host arrays).

        Raises:
            VjpsplitError: A batch that does not split into the microbatches (or replicas), ``Microbatches`` of another
                count or a shape the export does not take, a step past ``step_timeout`` or interrupted (naming what each
                worker runs or waits for), a lost Ray worker.
        """
        t0 = time.monotonic()
        scales = self._scales(batch)
        keys = None if self.rng is None else microbatch_keys(self.rng, self.step_count, self.microbatches)
        mbs = self.model.batch_microbatches(batch, self.microbatches, self.data_parallel, keys)
        plan, measuring = (self.plan, False) if self.auto is None else self.auto.next_step(mbs)
        every = self.trace_every is not None and (self.step_count + 1) % self.trace_every == 0
        timed = (self.timeline or every if timed is None else timed) or measuring
        t_run = time.monotonic()
        if isinstance(self.backend, DistributedBackend):
            self.backend.step_count = self.step_count  # the step a lost process's error names
        r, sums = self.backend.step(mbs, plan, self.microbatches, self.clip_global_norm, timed=timed, scales=scales)
        ran_for = time.monotonic() - t_run  # what auto's trial steps compare: the schedule, sends and updates
        if isinstance(self.backend, DistributedBackend) and self.auto is not None and self.auto.trial is not None:
            ran_for = self.backend.slowest(ran_for)  # every process's race compares the same times: they agree
        _, norm = clip_scale(sums, None)
        step_time = time.monotonic() - t0
        if timed:
            self._samples.add(r, first=self._steps_run == 0)
            if self._sent_by is None:
                self._sent_by = mbs[0]
        self._steps_run += 1
        auto = None
        if self.auto is not None:
            auto = self.auto.after(plan, self.costs, timed, ran_for)
            self.plan = self.auto.current
            if self.offload is None and self.auto.offload != self._auto_offload:
                self._auto_offload = self.auto.offload  # auto's plans under a byte limit offload these pairs
                self.backend.set_offload(self._auto_offload)
        self.step_count += 1
        busy = self._busy(r, first=self._steps_run == 1) if timed else None
        aux = None if self.aux is None or r.aux is None else reduced(r.aux, self.aux)
        self._history.record(self.step_count, r, norm, step_time, auto, busy, aux)
        self.last_result = r
        if timed and self.trace_dir is not None:
            self._write_trace(r, self.trace_dir)
        return r.loss if self.aux is None else (r.loss, aux)

    def _scales(self, batch: tuple[PyTree, ...] | Microbatches) -> list[float] | None:
        """``Microbatches``' scales (their count checked against ``microbatches``); None for a whole batch."""
        if not isinstance(batch, Microbatches):
            return None
        if len(batch) != self.microbatches:
            raise VjpsplitError(
                f"Microbatches: {len(batch)} batches for a Trainer of microbatches={self.microbatches}, whose "
                f"schedule runs {self.microbatches}; give {self.microbatches} batches, or a Trainer of "
                f"microbatches={len(batch)}"
            )
        return batch.scales

    def _write_trace(self, r: PipelineResult, directory: str | os.PathLike[str]) -> None:
        """The step's trace as ``step-<n>.trace.json`` in ``directory`` (``Observe(trace_dir=)``), made if absent.

        Raises:
            VjpsplitError: it cannot be written (naming the file); the step itself was applied, and says its loss.
        """
        path = os.path.join(os.fspath(directory), f"step-{self.step_count}.trace.json")
        try:
            os.makedirs(directory, exist_ok=True)
            r.write_trace(path, self.placement)
        except (OSError, VjpsplitError) as e:
            raise VjpsplitError(
                f"Observe(trace_dir=...): {path}: the trace of step {self.step_count} was not written ({one_line(e)}); "
                f"the step was applied (loss {r.loss}, in history): fix the directory and step on"
            ) from e

    @overload
    def evaluate(
        self,
        batch: tuple[PyTree, ...] | Microbatches,
        *,
        microbatches: int | None = None,
        outputs: Literal[False] = False,
    ) -> float | tuple[float, PyTree]: ...

    @overload
    def evaluate(
        self, batch: tuple[PyTree, ...] | Microbatches, *, microbatches: int | None = None, outputs: Literal[True]
    ) -> tuple[float, list[PyTree]] | tuple[float, PyTree, list[PyTree]]: ...

    @overload
    def evaluate(
        self, batch: tuple[PyTree, ...] | Microbatches, *, microbatches: int | None = None, outputs: bool
    ) -> float | tuple[float, PyTree] | tuple[float, PyTree, list[PyTree]]: ...

    def evaluate(
        self, batch: tuple[PyTree, ...] | Microbatches, *, microbatches: int | None = None, outputs: bool = False
    ) -> float | tuple[float, PyTree] | tuple[float, PyTree, list[PyTree]]:
        """The loss on ``batch`` from every stage's forward only: no residuals, no gradients, no update.

        Each stage runs its evaluation program where it lives, with the parameters it holds now; the loss is the
        mean over the microbatches, as a step's is. Parameters, optimizer state, step count and history do not change.

        Args:
            batch: The function's batch inputs as a tuple, as ``step`` takes them; or ``Microbatches``.
            microbatches: How many microbatches to cut ``batch`` into (default: the Trainer's; not with Microbatches).
            outputs: Also return the model's output: per microbatch, the tuple of arrays the last stage received.

        Returns:
            The loss (a float); with ``outputs=True``, ``(loss, outputs)``. For stages whose function returns
            ``(loss, aux)``: ``(loss, aux)``, or ``(loss, aux, outputs)``, the aux as a step's.

        Raises:
            VjpsplitError: ``microbatches`` is not an int >= 1, or given with ``Microbatches``; the Trainer runs the
                per-stage form, or a stage has no evaluation program (the message says how to export again).
        """
        m = self.microbatches if microbatches is None else checked_microbatches(microbatches)
        scales = None
        if isinstance(batch, Microbatches):
            if microbatches is not None:
                raise VjpsplitError("evaluate: Microbatches are the microbatches; give no microbatches= with them")
            m, scales = len(batch), batch.scales
        programs = self._eval_programs()
        keys = None if self.rng is None else microbatch_keys(self.rng, self.step_count, m)
        mbs = self.model.batch_microbatches(batch, m, self.data_parallel, keys)
        losses, aux_leaves, received = self.backend.evaluate(mbs, programs, outputs)
        loss = step_loss(dict(enumerate(losses)), m, scales)
        per = aux_per_microbatch(self.model.artifacts[-1], dict(enumerate(aux_leaves)), m)
        if self.aux is None or per is None:
            return (loss, received) if outputs and received is not None else loss  # received: given with outputs
        aux = reduced(per, self.aux)
        return (loss, aux, received) if outputs and received is not None else (loss, aux)

    def _eval_programs(self) -> list[EvalProgram]:
        if not isinstance(self.stages, Stages):
            raise VjpsplitError(
                "evaluate runs the evaluation programs of a Stages (export_stages); this Trainer runs a list of "
                "artifacts: train a Stages to evaluate"
            )
        lacking = [s for s, p in enumerate(self.stages.evaluation) if p is None]
        if lacking:
            raise VjpsplitError(missing(self.stages.index.function, lacking))
        return [p for p in self.stages.evaluation if p is not None]

    def fit(
        self,
        data: Callable[[int], tuple[PyTree, ...] | Microbatches] | Sequence[tuple[PyTree, ...] | Microbatches],
        steps: int,
        *,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | None = None,
        max_restarts: int = 0,
        callback: Callable[..., object] | None = None,
        stop_on_nonfinite: bool = True,
        eval_data: tuple[PyTree, ...] | Callable[[int], tuple[PyTree, ...]] | None = None,
        eval_every: int | None = None,
    ) -> list[float]:
        """Run the steps ``step_count`` ... ``steps - 1`` of a run; return their losses.

        Args:
            data: ``data(step) -> batch`` or a sequence indexed by step (steps count from 0 of the run).
            steps: The run's total number of steps (a Trainer at step k runs k ... steps - 1).
            checkpoint_dir: Where checkpoints go, and where an existing one is the run's start; ``None``: none.
            checkpoint_every: Save after every n-th step (and after the last); ``None``: after the last only.
            max_restarts: How many lost Ray workers the run replaces (every worker back to the last checkpoint).
            callback: ``callback(step, loss)`` after each step (``rerun=True`` for a step run again, if it takes it).
            stop_on_nonfinite: Stop with an error at a loss or gradient norm that is not finite.
            eval_data: A batch tuple, or ``eval_data(step) -> batch``, to ``evaluate``; ``None``: no evaluation.
            eval_every: How often to evaluate (steps); the loss goes into ``history`` as ``eval_loss``.

        Returns:
            The losses of the steps this call ran, in order.

        Raises:
            VjpsplitError: A bad ``checkpoint_dir`` or option before the first step; a failed background write; a loss
                that is not finite; more lost workers than ``max_restarts``.
        """
        if checkpoint_dir is not None and not self._hang_named:  # a stuck step's report beside the checkpoints
            self.backend.report_hangs_to(os.fspath(checkpoint_dir).rstrip("/" + os.sep) + ".hang.json")
        return fit_steps(
            self,
            data,
            steps,
            checkpoint_dir=checkpoint_dir,
            checkpoint_every=checkpoint_every,
            max_restarts=max_restarts,
            callback=callback,
            stop_on_nonfinite=stop_on_nonfinite,
            eval_data=eval_data,
            eval_every=eval_every,
            apart=self._directories(),
        )

    @classmethod
    def restore(
        cls,
        directory: str | os.PathLike[str],
        stages: Stages | PerStage | Sequence[Artifact],
        *,
        optimizer: Optimizer,
        microbatches: int | None = None,
        schedule: str | Schedule | Plans | None = None,
        runner: str | Runner = "inprocess",
        clip_global_norm: float | None | _Recorded = RECORDED,
        observe: Observe | None = None,
        opt_state: PyTree = None,
        step_count: int | None = None,
        rng: jax.Array | None = None,
        aux: str | None = None,
        **keywords: Unpack[ContractKeywords],
    ) -> Trainer:
        """A Trainer continuing the run saved in ``directory``, at its step, with its parameters and optimizer state.

        Args:
            directory: A checkpoint ``save`` (or ``fit``) wrote; one that is not, or lacks a record, is refused by name.
            stages: Any ``Stages`` of the run's function (an older per-stage checkpoint: its own), each saved leaf's
                dtype and shape checked against them (a mismatch is refused naming the leaf).
            optimizer: The run's optax ``GradientTransformation``.
            microbatches: Default: the checkpoint's (one written before they were recorded needs it given).
            schedule: As ``Trainer``'s; default: the checkpoint's (its plans, or ``"auto"``'s memory limit too).
            runner: As ``Trainer``'s (not recorded: a run goes on anywhere).
            clip_global_norm: Default: the checkpoint's (none for one written before it was recorded).
            observe: As ``Trainer``'s.
            opt_state: Optax's whole-model state to start from instead of the checkpoint's; None: the checkpoint's.
            step_count: The run's step instead of the checkpoint's; None: the checkpoint's.
            rng: The run's PRNG key (not recorded): the same key goes on with the same microbatch keys.
            aux: As ``Trainer``'s (not recorded).
            **keywords: As ``Trainer``'s (a bad value is refused as ``Trainer`` refuses it).

        Returns:
            The Trainer, its ``step_count`` the checkpoint's unless given.
        """
        options = options_of(stages, schedule, runner, observe, keywords, "Trainer.restore")
        run = restored_run(
            directory,
            options,
            optimizer,
            microbatches=microbatches,
            clip_global_norm=None if isinstance(clip_global_norm, _Recorded) else clip_global_norm,
            clip_recorded=isinstance(clip_global_norm, _Recorded),  # RECORDED, its one instance
            opt_state=opt_state,
            step_count=step_count,
        )
        trainer = cls.__new__(cls)
        trainer._start(
            run.options,
            run.params,
            optimizer,
            run.microbatches,
            run.clip_global_norm,
            run.opt_state,
            run.step_count,
            run.states,
            rng,
            aux,
        )
        return trainer

    def params(self) -> PyTree:
        """The parameters now.

        Returns:
            The parameters in the structure the Trainer was given (host arrays; one pytree per stage in the
            per-stage form).
        """
        return self.ownership.gather([p for p, _ in self.backend.snapshots()])

    def state(self) -> tuple[PyTree, PyTree]:
        """The training state now, in the form a one-process optax loop (or orbax) keeps it.

        Returns:
            ``(params, opt_state)``: ``params`` as ``params()`` gives them, ``opt_state`` optax's own state for
            the whole model, as ``optimizer.init(params)`` and the same updates give it in one process (its
            structure, its values; a value tied to no parameter, such as a step count, once). Host arrays.

        Raises:
            VjpsplitError: a tied leaf's state differs between the stages that hold it.
        """
        snaps = self.backend.snapshots()
        return self.ownership.gather([p for p, _ in snaps]), self._states().gather([st for _, st in snaps])

    def _states(self) -> StateMap:
        if self._state_map is None:
            self._state_map = state_map(self.optimizer, self.ownership)
        return self._state_map

    def host_checkpoint(self) -> HostCheckpoint:
        """What ``save`` writes, copied to host memory (the copy ``fit`` waits for before writing in the background).

        Returns:
            A ``HostCheckpoint``: the parameters by key, ``state()``'s ``opt_state``, the step count and the
            settings ``restore`` uses.
        """
        snaps = self.backend.snapshots()
        flat = self.ownership.flat([p for p, _ in snaps])
        params = self.ownership.gather([p for p, _ in snaps])
        smap = self._states()
        opt_state = smap.gather([st for _, st in snaps])
        return HostCheckpoint(flat, smap.leaf_keys, encode_structure(params), opt_state, self.step_count, self._meta())

    def _meta(self) -> dict[str, object]:
        meta: dict[str, object] = {
            "schedule": self.plan.name,
            "optimizer": self.optimizer_name,
            "structure": self.ownership.structure,
            "microbatches": self.microbatches,
            "clip_global_norm": self.clip_global_norm,
        }
        if self.schedule.plans is not None:
            meta["plans"] = format_schedule(self.plan.plans)
        if self.auto is not None:
            meta.update(self.auto.record())  # restore measures again, on its own hosts
        return meta

    def save(self, directory: str | os.PathLike[str]) -> None:
        """Write the parameters, optax's whole-model optimizer state and the step count to ``directory`` (all or
        nothing), keyed by the model's parameter paths, not by stage: any ``Stages`` of the same function
        restores it (``restore``), and so does a one-process loop (``load_checkpoint``).

        The checkpoint also records what ``restore`` needs to go on: the schedule (its plans,
        when they were the caller's), the microbatches and ``clip_global_norm``. A save replaces the whole
        directory, so a ``directory`` holding files no save wrote is refused (naming one), never emptied.

        Args:
            directory: the checkpoint directory (created, or replaced whole).

        Raises:
            VjpsplitError: ``directory`` is a file, cannot be written, or holds files no save wrote.
        """
        write_checkpoint(self.backend, directory, self.host_checkpoint())

    def _load(self, directory: str | os.PathLike[str]) -> None:
        """Set every stage, and the step count, to the checkpoint in ``directory`` (saved by any cut of the same
        function; one an older vjpsplit wrote per stage only by this cut). This Trainer's settings stay. ``fit``
        resumes with it (``checkpoint_dir=``, and after a lost worker); users restore with ``Trainer.restore``.

        Every saved parameter is checked against the dtype and shape this Trainer holds first: a mismatch is
        one error naming the leaf, and the Trainer keeps its parameters.

        Args:
            directory: a checkpoint ``save`` (or ``fit``) wrote.

        Raises:
            VjpsplitError: a missing or damaged checkpoint (naming the file or field), a leaf of another dtype
                or shape, a leaf missing or unexpected, an optimizer state of another structure.
        """
        snapshots, step = stage_snapshots(directory, self.ownership, self._states(), self.optimizer)
        self.backend.load(snapshots)
        self.step_count = step
        self._history.rewind(step)

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
        Trainer's first step, which compiles every stage, gives no verdict. A worker with no event in the step (on
        jax.distributed, another process's) is no worker's peer."""
        busy = tuple(row["F"] + row["B"] + row["I"] + row["W"] for row in r.per_worker())
        if first:
            return busy, ()
        held = self.plan.layout.workers
        ran = {e.worker for e in r.events}
        groups: list[tuple[object, ...]] = [
            tuple(sorted(self._signatures[s] for s in stages)) if w in ran else ("elsewhere", w)
            for w, stages in enumerate(held)
        ]
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
        over the boundaries; on ``Distributed`` (every process calls it, each process's samples gathered) ``gap``.
        ``gap``: the timed steps' wait from a result to the next worker starting on it (``comm`` where no send ran).

        Returns:
            ``{"F": [...], "B": [...], "W": [...], "comm": seconds, "gap": seconds, "transfer": {"out": ..,
            "back": ..}}``, one entry per stage in F, B and W; ``transfer`` the bytes per second of a residual
            copy off the first stage's device and back, as offload copies (``measured.measure_transfer_rates``,
            timed once, at the first call; on Ray, on this process's device; on Distributed, the first stage's).

        Raises:
            VjpsplitError: no timed step has run yet.
        """
        if isinstance(self.backend, DistributedBackend):
            timeline = self._samples.costs(self.backend.costs_samples(self._samples.kept()))
            if self._transfer is None:
                self._transfer = self.backend.transfer_rates()
            return {**timeline, "comm": timeline["gap"], "transfer": self._transfer}
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

    def workers(self) -> list[object]:
        """The Ray actor handle of each worker.

        Returns:
            One actor handle per worker, in the layout's worker order (runner ``ray``; in-process, none).
        """
        return self.backend.workers()

    def close(self) -> None:
        """End the workers (Ray actors) and the progress bar."""
        self._history.close()
        self.backend.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
