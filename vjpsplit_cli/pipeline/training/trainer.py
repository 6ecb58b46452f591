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

The Trainer's parts are modules of their own, each a base of ``Trainer``:
``trainer_setup`` (opening it: every attribute it keeps, from its options),
``trainer_state`` (``params``, ``state``, ``save``), ``trainer_measures``
(``history``, ``costs``, stragglers, ``placement``) and ``trainer_evaluation``
(``evaluate``). This module keeps what runs it: ``step``, ``fit``, ``restore``
(its settings from the checkpoint: ``resume.restored_run``) and ``close``.

May import the Trainer's parts and, of this room, ``fit``, ``resume``, ``options``, ``option_values``,
``clipping``, ``microbatch_keys``, ``step_aux`` and ``arguments``; ``stages``; ``runtime.result``; the layers below ``pipeline``.
"""

from __future__ import annotations

import os
import time
from typing import Callable, Final, Sequence, Unpack

import jax

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError, one_line
from ...treetypes import PyTree
from ..runtime.result import PipelineResult
from ..stages.directory import Stages
from ..stages.microbatches import Microbatches
from .arguments import Optimizer
from .clipping import clip_scale
from .distributed_backend import DistributedBackend
from .fit import fit as fit_steps
from .microbatch_keys import microbatch_keys
from .option_values import Observe, PerStage, Plans, Runner, Schedule
from .step_aux import reduced
from .options import ContractKeywords, options_of
from .resume import restored_run
from .trainer_evaluation import TrainerEvaluation
from .trainer_setup import TrainerSetup
from .trainer_measures import TrainerMeasures
from .trainer_state import TrainerState


class _Recorded:
    """``Trainer.restore``'s default for a setting the checkpoint records: the recorded value."""

    def __repr__(self) -> str:
        return "RECORDED"


RECORDED: Final = _Recorded()


class Trainer(TrainerSetup, TrainerState, TrainerMeasures, TrainerEvaluation):
    """Pipelined training: ``step(batch)`` runs the schedule and every stage's optimizer update where it lives.

    ``Trainer(stages, params, optimizer=tx, microbatches=8)``, and what is not the
    state, one value each: ``schedule=`` (a name or a ``Schedule``),
    ``runner=`` (``"inprocess"``, ``"ray"``, ``InProcess(...)``, ``Ray(...)``),
    ``clip_global_norm=`` and ``observe=Observe(...)``; where the state starts:
    ``opt_state=`` and ``step_count=`` (``__init__`` says each).

    ``clip_global_norm=c`` clips by the norm over all stages' gradients (a tied leaf
    counted once), as ``optax.chain(optax.clip_by_global_norm(c), optimizer)`` on
    one device, and so does a ``clip_by_global_norm`` inside ``optimizer``: an update
    that reduces over all leaves gets the reductions over all stages, one that takes
    ``value=`` the step's loss, and one the stages cannot compute as one process does
    is refused here (``separable``). ``history`` keeps per step the loss, the
    gradients' global norm (before clipping), the step time and the measured and
    modeled bubble (NaN for an untimed step).

    ``Schedule("auto", memory_limit=...)`` times the first step and runs
    ``auto_schedule``'s plans for the measured costs from the second (timed too, and
    planned again after it), within the memory limit; then 1F1B, ZB-H1 and the plans
    the model rates close (its own, the same at 1F1B's memory) each run
    ``trial_rounds`` steps at least (default 3; those within the clock's noise of the fastest run on) and
    the fastest on the clock is kept (``autoplan``).

    In-process, every stage runs on a device of its own (``InProcess(devices=...)``;
    by default worker k's stages on ``jax.local_devices()[k]`` where there are
    enough, else all on the default device); ``placement`` says where each stage is.
    ``Observe(timeline=True)`` times every step (``step(batch, timed=True)`` one
    step): each operation waits for its results, and ``last_result`` holds their
    compute times; ``Observe(trace_dir=..., trace_every=k)`` writes every k-th step's
    trace. Every step, timed or not, in-process or on Ray, past ``Observe(step_timeout=...)``,
    or one interrupted by Ctrl-C, is one error naming what each worker is running or
    waiting for (its report: the error names it). The worker threads of timed steps, and
    the one thread in-process untimed steps run in, end with ``close()``, with
    ``with Trainer(...) as tr:``, or when a Trainer nobody closed is collected.

    ``InProcess(offload=...)`` or ``Ray(offload=...)``: residuals leave their stage's device between a
    microbatch's F and its B and come back one operation ahead of the B: ``"host"`` (host memory:
    an accelerator's ``pinned_host`` memory where it has one; host NumPy on CPU devices and elsewhere)
    or ``Offload(to="host"|"files", directory=..., microbatches=..., stages=..., pairs=...)``
    (``vjpsplit_cli.pipeline.Offload``).
    Gradients and training are bitwise those without offload. ``Schedule("auto",
    memory_limit_bytes=...)`` may offload on its own (``planned_offload``).

    ``InProcess(data_parallel=N)`` or ``Ray(data_parallel=N)`` (unsharded stages) runs
    N replicas of every stage, each microbatch split N ways (so the batch divides by
    ``microbatches * N``); not given, the ``data_parallel`` the stages' export
    recorded (``export_stages(data_parallel=N)``), else 1. Each replica sums its
    gradients over the step's microbatches alone; one reduce-scatter per stage per
    step sums them across the replicas, each device updates its 1/N shard of the
    stage's optimizer state (ZeRO-1), and the new parameters are gathered once.
    Losses, parameters, ``state()`` and checkpoints are those of ``data_parallel=1``
    (a run continues at another N). A timed step runs a stage's replicas one after
    another and records the first replica's operations.
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
            stages: a ``Stages`` (``export_stages``); or the per-stage form, a list of artifacts (``PerStage``
                where stages share leaves), with ``params`` one pytree per stage.
            params: the whole parameter pytree (the function's ``wrt`` argument).
            optimizer: an optax ``GradientTransformation``, exported per stage (the workers need no optax).
            microbatches: how many microbatches each step's batch is cut into.
            schedule: a built-in schedule's name (default ``"1f1b"``) or a ``Schedule`` (``Schedule("auto",
                memory_limit=8)``; plans, ``read_schedule``'s form, as ``Schedule(plans=plans)``).
            runner: ``"inprocess"`` or ``"ray"``, or ``InProcess(devices=..., data_parallel=...)`` /
                ``Ray(address=..., runtime_env=..., actor_options=..., schedule_timeout=...)``.
            clip_global_norm: clip by the norm over all stages' gradients (a tied leaf counted once), as
                ``optax.chain(optax.clip_by_global_norm(c), optimizer)`` on one device; None: no clipping.
            observe: ``Observe(progress=, timeline=, trace_dir=, trace_every=, step_timeout=, hang_report=)``.
            opt_state: optax's state for the whole model to start from (``tx.init(params)``'s structure: from
                one process, another Trainer's ``state()``, or orbax) instead of ``optimizer.init``.
            step_count: the run's step this state is at (``fit`` goes on from there).
            rng: a PRNG key (``jax.random.key(seed)``) for a loss that takes one (a batch argument exported as a
                scalar typed key): microbatch ``i`` of step ``t`` (``step_count`` when the step starts) gets
                ``fold_in(fold_in(rng, t), i)`` on every stage that reads it; the batch is passed without the key.
            aux: for stages whose function returns ``(loss, aux)`` (``export_stages(..., has_aux=True)``), what
                ``step``, ``evaluate`` and ``history`` give of it: ``"mean"`` (the default: each leaf's mean over the
                microbatches) or ``"per_microbatch"`` (the list of each microbatch's aux).
            **keywords: the contract's spellings of a schedule's and a runner's fields (``ContractKeywords``):
                ``schedule_name=``, ``memory_limit=``, ``memory_limit_bytes=`` (``schedule=``'s), ``devices=``
                (``runner="inprocess"``'s), ``address=`` (``runner="ray"``'s).

        Raises:
            VjpsplitError: a bad value (named), an optimizer
                the stages cannot run as one process does; a bad schedule, before anything is exported; no ``rng``
                for stages whose function takes a key, or one for stages whose function takes none; ``aux`` that is
                neither mode, or given for stages whose function returns no aux.
        """
        options = options_of(stages, schedule, runner, observe, keywords)
        self._start(options, params, optimizer, microbatches, clip_global_norm, opt_state, step_count, None, rng, aux)

    def step(
        self, batch: tuple[PyTree, ...] | Microbatches, *, timed: bool | None = None
    ) -> float | tuple[float, PyTree]:
        """One optimizer step on ``batch``: the schedule over its microbatches, then every stage's update.

        ``costs()`` counts timed steps; ``schedule="auto"`` times its first two steps itself, races the
        plans it rates close over the next (trial) steps, and plans again after each later timed step.
        ``Microbatches([b0, b1, ...], weights=[w0, w1, ...])`` gives the microbatches one by one, each of its own
        shape within the stages' symbolic dims: the loss and gradients are the weighted mean over them, each
        new shape compiles once (docs/howto/variable-lengths.md).

        Args:
            batch: the function's batch inputs as a tuple (a 1-tuple for one input), the whole batch; it is
                cut into ``microbatches`` along axis 0. Or ``Microbatches``: as many as the Trainer's
                ``microbatches``, each as it is.
            timed: True waits for every operation and records its compute time in ``last_result.events`` (for
                its timeline, or to measure the stages' costs); it costs the overlap of dispatch with compute.
                None: the Trainer's ``Observe(timeline=...)`` (and its ``trace_every``).

        Returns:
            The step's loss: the mean over microbatches, as the loss function gives it on the whole batch (with
            ``Microbatches``, their weighted mean); for stages whose function returns ``(loss, aux)``,
            ``(loss, aux)``, the aux as ``aux=`` says (by default each leaf's mean over the microbatches; host
            arrays), fetched with the loss at the step's end.

        Raises:
            VjpsplitError: a batch that does not split into the microbatches (or replicas), ``Microbatches`` of
                another count than ``microbatches`` or a shape the export does not take (naming the batch), a step past
                ``step_timeout`` or interrupted (naming what each worker runs or waits for), a lost Ray worker.
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

    def workers(self) -> list[object]:
        """The Ray actor handle of each worker.

        Returns:
            One actor handle per worker, in the layout's worker order (runner ``ray``; in-process, none).
        """
        return self.backend.workers()

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

        ``data``: ``data(step) -> batch`` or a sequence indexed by step (steps count from 0 of the run); a
        batch may be ``Microbatches`` (as ``step`` takes it). With ``checkpoint_dir``, a checkpoint already there is
        where the run begins (logged at INFO
        on ``logging``'s ``vjpsplit_cli.pipeline.training.fit``; a ``UserWarning`` when it, or the Trainer, is
        already at or past ``steps``, so nothing trains), and one is
        saved after every ``checkpoint_every``-th step and after the last, written by a thread while the next
        steps run (a step waits only for the copy to host memory; a failed write is an error at the next step
        or at the end; the last checkpoint is complete when ``fit`` returns). ``checkpoint_dir`` is checked
        before the first step: a file, a place that cannot be written, a directory holding files no save
        wrote, or one that is (or is inside, or holds) the offload directory or ``trace_dir`` is refused (a save
        replaces the whole directory; an empty directory is fine).

        ``callback(step, loss)`` after each step; a callback that takes ``rerun`` (or ``**kwargs``) gets
        ``rerun=True`` for a step this call runs again after returning to a checkpoint (a lost Ray worker), so
        a logger can skip what it saw. A run resumed in a new process (``fit`` begins from the checkpoint)
        runs the steps after the checkpoint again too, which this call cannot know: they come with
        ``rerun=False``. A loss or gradient norm that is not finite stops the run with one error naming the
        step, before any checkpoint after it is written (``stop_on_nonfinite=False`` trains on). On Ray, a worker whose actor dies is replaced (same actor options), every worker returns
        to the last checkpoint and the steps since run again: the losses and parameters are those of a run
        that never failed. More than ``max_restarts`` failures, or none to return to, is one error naming the
        worker and the step. ``checkpoint_times`` and ``restarts`` record what the checkpoints and restarts
        cost. With ``eval_data`` (a batch tuple, or ``eval_data(step) -> batch``) and ``eval_every``, the
        model is evaluated (``evaluate``) after every ``eval_every``-th step and after the last; the loss goes
        into that step's ``history`` row as ``eval_loss``. A stuck step's report (``hang_report``) goes beside
        the checkpoint directory, as ``<checkpoint_dir>.hang.json``, unless the Trainer was given ``hang_report``.

        Args:
            data: ``data(step) -> batch`` or a sequence indexed by step (steps count from 0 of the run).
            steps: the run's total number of steps (a Trainer at step k runs k ... steps - 1).
            checkpoint_dir: where checkpoints go, and where an existing one is the run's start; None: none.
            checkpoint_every: save after every n-th step (and after the last); None: after the last only.
            max_restarts: how many lost Ray workers the run replaces before it gives up.
            callback: ``callback(step, loss)`` after each step (``rerun=`` too where it takes it).
            stop_on_nonfinite: stop with an error at a loss or gradient norm that is not finite.
            eval_data: a batch tuple, or ``eval_data(step) -> batch``, to ``evaluate`` every ``eval_every``
                steps; None: no evaluation.
            eval_every: how often to evaluate (steps).

        Returns:
            The losses of the steps this call ran, in order.

        Raises:
            VjpsplitError: a bad ``checkpoint_dir`` or option (named) before the first step; a failed background
                write; a loss that is not finite; more lost workers than ``max_restarts`` (naming the worker and
                the step).
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

        Each saved parameter's dtype and shape is checked against the stages' export first (one error naming
        the leaf).

        Args:
            directory: a checkpoint ``save`` (or ``fit``) wrote.
            stages: any ``Stages`` of the function the run trained (another number of stages, other marks,
                ``stages=N``); a checkpoint an older vjpsplit wrote per stage, only the stages that wrote it.
            optimizer: the run's optax ``GradientTransformation``.
            microbatches: default: the checkpoint's (one written before they were recorded needs it given).
            schedule: as ``Trainer``'s; default: the checkpoint's (its plans, when they were the caller's; for
                ``"auto"``, its memory limit too, which an ``"auto"`` given without one also takes).
            runner: as ``Trainer``'s (not recorded: a run goes on anywhere).
            clip_global_norm: default: the checkpoint's (none for one written before it was recorded).
            observe: as ``Trainer``'s.
            opt_state: optax's whole-model state to start from instead of the checkpoint's (as ``Trainer``'s);
                None: the checkpoint's.
            step_count: the run's step instead of the checkpoint's (as ``Trainer``'s); None: the checkpoint's.
            rng: the run's PRNG key (as ``Trainer``'s; not recorded): the same key goes on with the same
                microbatch keys from the checkpoint's step.
            aux: as ``Trainer``'s (not recorded).
            **keywords: as ``Trainer``'s.

        Returns:
            The Trainer, its ``step_count`` the checkpoint's unless given.

        Raises:
            VjpsplitError: ``directory`` is no checkpoint, or lacks what it must record (naming it); a saved
                leaf that does not match the stages; what ``Trainer`` refuses.
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

    def close(self) -> None:
        """End the workers (Ray actors) and the progress bar."""
        self._history.close()
        self.backend.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
