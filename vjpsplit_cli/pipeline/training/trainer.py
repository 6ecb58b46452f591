"""``Trainer``: pipelined training, the optimizer step where each stage's parameters live.

``Trainer(stages, params, optimizer=optax_tx, ...)`` takes a ``Stages``
(``export_stages``) and the whole parameter pytree. It hands each job to one
piece: ``runtime.model`` cuts the batch, ``ownership.Ownership`` says which stage
holds which leaf, ``backend.open_backend`` exports the optimizer per stage and
starts the workers (threads in this process, or Ray actors) behind one
``Backend`` interface, ``history.History`` keeps the steps, and ``checkpoint``
writes and reads the state. Each worker keeps its stages' parameters and
optimizer state (``stage_trainer.StageTrainer``); only the loss and the stages'
squared gradient norms reach the driver. ``state`` joins the stages' optimizer
states into optax's structure for the whole model (``state.StateMap``), which is
also what ``save`` writes and ``opt_state=`` takes; ``fit`` runs many steps with
checkpoints and restarts (``fit``).

The older per-stage form (a list of artifacts and one parameter pytree per stage,
``PerStage(artifacts, tied=...)`` naming ``(stage, key)`` groups, keys ``"s/k"``) is
accepted too. The options are typed values (``options``); the keywords they replace
still work this release, with a ``DeprecationWarning``.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from typing import Callable, Final, Literal, Mapping, Sequence, Unpack, overload

import jax

import numpy as np

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ...treetypes import Leaf, PyTree
from ..runtime.model import model_of
from ..runtime.offload import Offload, offload_of
from ..runtime.result import PipelineResult
from ..schedules.csvformat import format_schedule, parse_schedule
from ..schedules.stepplans import resolve
from ..stages.directory import Stages
from ..stages.evalprograms import EvalProgram, missing
from .autoplan import AutoPlan
from .backend import Backend, open_backend
from ...files.trees import encode_structure
from .checkpoint import HostCheckpoint, read_checkpoint, save_checkpoint
from .arguments import Optimizer, checked_clip, plain
from .clipping import clip_scale
from .fit import fit as fit_steps
from .history import IN_A_ROW, SLOWER, CheckpointTime, History, RestartRecord, StepRecord, Stragglers, cost_signature
from .optimizer import optimizer_name
from .options import Deprecated, Observe, Options, PerStage, Plans, Runner, Schedule, from_legacy
from .ownership import Ownership
from .resume import restored_model, stage_snapshots
from .optax_state import StateMap, state_map
from .measured import CostSamples, MeasuredCosts, measure_transfer_rates


class _Recorded:
    """``Trainer.restore``'s default for a setting the checkpoint records: the recorded value."""

    def __repr__(self) -> str:
        return "RECORDED"


RECORDED: Final = _Recorded()


class Trainer:
    """Pipelined training: ``step(batch)`` runs the schedule and every stage's optimizer update where it lives.

    ``Trainer(stages, params, optimizer=tx, microbatches=8)``, and what is not the
    state, one value each: ``schedule=`` (a name, plans or a ``Schedule``),
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
    planned again after it: ``autoplan``), within the memory limit.

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
        schedule: str | Plans | Schedule | None = None,
        runner: str | Runner = "inprocess",
        clip_global_norm: float | None = None,
        observe: Observe | None = None,
        opt_state: PyTree = None,
        step_count: int = 0,
        **deprecated: Unpack[Deprecated],
    ):
        """A Trainer for ``stages``, starting from ``params`` (and ``opt_state``, at ``step_count``).

        Args:
            stages: a ``Stages`` (``export_stages``); or the per-stage form, a list of artifacts (``PerStage``
                where stages share leaves), with ``params`` one pytree per stage.
            params: the whole parameter pytree (the function's ``wrt`` argument).
            optimizer: an optax ``GradientTransformation``, exported per stage (the workers need no optax).
            microbatches: how many microbatches each step's batch is cut into.
            schedule: a built-in schedule's name (default ``"1f1b"``), plans (``read_schedule``'s form), or a
                ``Schedule`` (``Schedule("auto", memory_limit=8)``).
            runner: ``"inprocess"`` or ``"ray"``, or ``InProcess(devices=..., data_parallel=...)`` /
                ``Ray(address=..., runtime_env=..., actor_options=..., schedule_timeout=...)``.
            clip_global_norm: clip by the norm over all stages' gradients (a tied leaf counted once), as
                ``optax.chain(optax.clip_by_global_norm(c), optimizer)`` on one device; None: no clipping.
            observe: ``Observe(progress=, timeline=, trace_dir=, trace_every=, step_timeout=, hang_report=)``.
            opt_state: optax's state for the whole model to start from (``tx.init(params)``'s structure: from
                one process, another Trainer's ``state()``, or orbax) instead of ``optimizer.init``.
            step_count: the run's step this state is at (``fit`` goes on from there).
            **deprecated: the keywords these values replace (``schedule_name=``, ``memory_limit=``,
                ``devices=``, ``address=``, ``progress=``, ``tied=``, ...; ``Deprecated``): they work this
                release, each group with a ``DeprecationWarning`` naming what to write instead.

        Raises:
            VjpsplitError: a bad value (named), an old keyword given with the value it goes into, an optimizer
                the stages cannot run as one process does; a bad schedule, before anything is exported.
        """
        options = from_legacy("Trainer", stages, schedule, runner, observe, deprecated)
        self._start(options, params, optimizer, microbatches, clip_global_norm, opt_state, step_count, None)

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
    ) -> None:
        """Open the Trainer: ``restored`` is the per-stage optimizer states an older checkpoint holds (``restore``)."""
        clip_global_norm = checked_clip(clip_global_norm)  # a bad value is refused now, not after the first step
        microbatches, step_count = plain(microbatches), plain(step_count)
        if isinstance(step_count, bool) or not isinstance(step_count, int) or step_count < 0:
            raise VjpsplitError(f"step_count={step_count!r}: give the run's step this state is at, an int >= 0")
        stages, runner, observe = options.stages, options.runner, options.observe
        schedule = Schedule() if options.schedule is None else options.schedule
        tied = stages.tied if isinstance(stages, PerStage) else None
        stages = stages.artifacts if isinstance(stages, PerStage) else stages
        # Not given: what the export recorded (``export_stages(data_parallel=N)``, ``--data-parallel N``), else 1.
        given = runner.data_parallel
        self.data_parallel = given if given is not None else recorded_replicas(stages)
        self.offload = offload_of(runner.offload)  # given by hand; auto's planned offload is apart
        self.stages = stages
        self.model = model_of(stages, params)
        self.ownership = Ownership(self.model, tied)
        S = self.model.num_stages
        self.microbatches, self.schedule, self.schedule_name = microbatches, schedule, schedule.label
        self.auto: AutoPlan | None = None
        if schedule.auto:
            self.auto = AutoPlan(self.model.artifacts, microbatches, schedule.memory_limit, schedule.memory_limit_bytes)
            self.plan = self.auto.current
        else:  # a bad schedule is refused before any export
            self.plan = resolve(schedule.label, schedule.plans, S, microbatches)
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
        self.trace_dir, self.trace_every = observe.trace_dir, observe.trace_every
        self.step_count = step_count
        self._history = History(observe.progress, self.step_count)
        self._samples = CostSamples(self.model.artifacts)
        self._transfer: dict[str, float] | None = None  # measured once, at the first costs()
        self._auto_offload: Offload | None = None
        self._steps_run = 0
        self._signatures = [cost_signature(a) for a in self.model.artifacts]
        self._stragglers: Stragglers | None = None
        self.last_result: PipelineResult | None = None
        self.checkpoint_times: list[CheckpointTime] = []  # fit's: per checkpoint, the step's wait and the write
        self.restarts: list[RestartRecord] = []  # fit's: per lost worker, the step, where it returned, how long

    @property
    def history(self) -> list[StepRecord]:
        """One ``StepRecord`` per step: ``step``, ``loss``, ``grad_norm`` (before clipping), ``step_time``, ``bubble``,
        ``modeled_bubble``; under ``schedule="auto"`` also ``schedule`` (what ran: the measuring step's schedule, then
        ``"auto"``), ``modeled_makespan`` (its plans under the measured costs, seconds) and ``measuring`` (True on the
        two timed first steps); a timed step's row also has ``busy`` (each worker's compute seconds) and
        ``stragglers`` (the workers whose compute was 15% or more above that of the workers whose stages cost the
        same, 3 timed steps in a row); ``fit``'s evaluations set ``eval_loss``. Attributes (``row.loss``);
        ``row["loss"]`` still works, with a ``DeprecationWarning``."""
        return self._history.rows

    @property
    def placement(self) -> list[tuple[jax.Device | str, ...]]:
        """Per stage, the devices that hold its parameters (``jax.Device``s in-process; on Ray, as each
        actor's JAX names them)."""
        return self.backend.placement

    def step(self, batch: tuple[PyTree, ...], *, timed: bool | None = None) -> float:
        """One optimizer step on ``batch``: the schedule over its microbatches, then every stage's update.

        ``costs()`` counts timed steps; ``schedule="auto"`` times its first two steps itself, and plans
        again after each timed step.

        Args:
            batch: the function's batch inputs as a tuple (a 1-tuple for one input), the whole batch; it is
                cut into ``microbatches`` along axis 0.
            timed: True waits for every operation and records its compute time in ``last_result.events`` (for
                its timeline, or to measure the stages' costs); it costs the overlap of dispatch with compute.
                None: the Trainer's ``Observe(timeline=...)`` (and its ``trace_every``).

        Returns:
            The step's loss: the mean over microbatches, as the loss function gives it on the whole batch.

        Raises:
            VjpsplitError: a batch that does not split into the microbatches (or replicas), a step past
                ``step_timeout`` or interrupted (naming what each worker runs or waits for), a lost Ray worker.
        """
        t0 = time.monotonic()
        mbs = self.model.batch_microbatches(batch, self.microbatches)
        plan, measuring = (self.plan, False) if self.auto is None else self.auto.next_step(mbs)
        every = self.trace_every is not None and (self.step_count + 1) % self.trace_every == 0
        timed = (self.timeline or every if timed is None else timed) or measuring
        r, sums = self.backend.step(mbs, plan, self.microbatches, self.clip_global_norm, timed=timed)
        _, norm = clip_scale(sums, None)
        step_time = time.monotonic() - t0
        if timed:
            self._samples.add(r, first=self._steps_run == 0)
        self._steps_run += 1
        auto = None
        if self.auto is not None:
            auto = self.auto.after(plan, self.costs, timed)
            self.plan = self.auto.current
            if self.offload is None and self.auto.offload != self._auto_offload:
                self._auto_offload = self.auto.offload  # auto's plans under a byte limit offload these pairs
                self.backend.set_offload(self._auto_offload)
        self.step_count += 1
        busy = self._busy(r, first=self._steps_run == 1) if timed else None
        self._history.record(self.step_count, r, norm, step_time, auto, busy)
        self.last_result = r
        if timed and self.trace_dir is not None:
            os.makedirs(self.trace_dir, exist_ok=True)
            r.write_trace(os.path.join(os.fspath(self.trace_dir), f"step-{self.step_count}.trace.json"), self.placement)
        return r.loss

    @overload
    def evaluate(
        self, batch: tuple[PyTree, ...], *, microbatches: int | None = None, outputs: Literal[False] = False
    ) -> float: ...

    @overload
    def evaluate(
        self, batch: tuple[PyTree, ...], *, microbatches: int | None = None, outputs: Literal[True]
    ) -> tuple[float, list[PyTree]]: ...

    @overload
    def evaluate(
        self, batch: tuple[PyTree, ...], *, microbatches: int | None = None, outputs: bool
    ) -> float | tuple[float, list[PyTree]]: ...

    def evaluate(
        self, batch: tuple[PyTree, ...], *, microbatches: int | None = None, outputs: bool = False
    ) -> float | tuple[float, list[PyTree]]:
        """The loss on ``batch`` from every stage's forward only: no residuals, no gradients, no update.

        Each stage runs its evaluation program (``export_stages`` writes one beside each artifact: the stage's
        forward without residual outputs) where the stage lives, in-process or on its Ray actor, with the
        parameters it holds now; activations go from stage to stage as in a step. The loss is the mean over the
        microbatches, as a step's is (the function's loss on the whole batch, for a mean loss). Parameters,
        optimizer state, the step count and the history do not change.

        Args:
            batch: the function's batch inputs as a tuple, as ``step`` takes them.
            microbatches: how many microbatches to cut ``batch`` into (default: the Trainer's).
            outputs: also return the model's output: per microbatch, the tuple of arrays the last stage
                received (what the stage before it sends on, e.g. the hidden state before the loss).

        Returns:
            The loss (a float); with ``outputs=True``, ``(loss, outputs)``.

        Raises:
            VjpsplitError: the Trainer runs the per-stage form, or a stage has no evaluation program (a stages
                directory saved by an older vjpsplit, or a sharded stage): the message says how to export again.
        """
        programs = self._eval_programs()
        mbs = self.model.batch_microbatches(batch, self.microbatches if microbatches is None else microbatches)
        losses, received = self.backend.evaluate(mbs, programs, outputs)
        loss = float(np.mean(losses))
        return (loss, received) if outputs and received is not None else loss  # received: given with outputs

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

    def _busy(self, r: PipelineResult, first: bool) -> tuple[tuple[float, ...], tuple[int, ...]]:
        """A timed step's ``busy`` seconds per worker and its ``stragglers`` (warned of when first named); the
        Trainer's first step, which compiles every stage, gives no verdict."""
        busy = tuple(row["F"] + row["B"] + row["I"] + row["W"] for row in r.per_worker())
        if first:
            return busy, ()
        held = self.plan.layout.workers
        groups = [tuple(sorted(self._signatures[s] for s in stages)) for stages in held]
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

        Medians over the microbatches of the last timed steps (``step(batch, timed=True)``, or ``auto``'s first
        two), the Trainer's first step only while no other is timed; see ``measured`` for what is left out, how a
        whole backward splits into B and W and how sends are timed.

        Returns:
            ``{"F": [...], "B": [...], "W": [...], "comm": seconds, "transfer": {"out": .., "back": ..}}``, one
            entry per stage in F, B and W; ``transfer`` the bytes per second of a residual copy off the first
            stage's device and back, as offload copies (``measured.measure_transfer_rates``, timed once, at the first
            call; on Ray, on this process's device).

        Raises:
            VjpsplitError: no timed step has run yet.
        """
        measured = self._samples.costs()
        if self._transfer is None:
            self._transfer = measure_transfer_rates(self.placement[0][0])
        return {**measured, "transfer": self._transfer}

    @property
    def planned_offload(self) -> Offload | None:
        """What ``auto``'s plans offload under ``memory_limit_bytes`` now (the (stage, microbatch) pairs in
        ``Offload.pairs``, to host memory), or None: no offload planned (or ``offload=`` given by hand)."""
        return self._auto_offload

    def params(self) -> PyTree:
        """The parameters now.

        Returns:
            The parameters in the structure the Trainer was given (host arrays; one pytree per stage in the
            per-stage form).
        """
        return self.ownership.gather([p for p, _ in self.backend.snapshots()])

    def plot_loss(self, path: str | os.PathLike[str], title: str | None = None) -> None:
        """A PNG of the loss per step (needs matplotlib), beside ``plot_timeline``'s chart of one step.

        Args:
            path: the PNG file to write.
            title: the chart's title; None: the schedule's and the runner's names.
        """
        self._history.plot(path, title or f"{self.schedule_name}, {self.runner.name}")

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
        save_checkpoint(directory, self.host_checkpoint())

    def load(self, directory: str | os.PathLike[str]) -> None:
        """Set every stage, and the step count, to the checkpoint in ``directory`` (saved by any cut of the same
        function; one an older vjpsplit wrote per stage only by this cut). This Trainer's settings stay.

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

    def workers(self) -> list[object]:
        """The Ray actor handle of each worker.

        Returns:
            One actor handle per worker, in the layout's worker order (runner ``ray``; in-process, none).
        """
        return self.backend.workers()

    def fit(
        self,
        data: Callable[[int], tuple[PyTree, ...]] | Sequence[tuple[PyTree, ...]],
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

        ``data``: ``data(step) -> batch`` or a sequence indexed by step (steps count from 0 of the run).
        With ``checkpoint_dir``, a checkpoint already there is where the run begins (``load``), and one is
        saved after every ``checkpoint_every``-th step and after the last, written by a thread while the next
        steps run (a step waits only for the copy to host memory; a failed write is an error at the next step
        or at the end; the last checkpoint is complete when ``fit`` returns). ``checkpoint_dir`` is checked
        before the first step: a file, a place that cannot be written, or a directory holding files no save
        wrote is refused (a save replaces the whole directory; an empty directory is fine).

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
        )

    @classmethod
    def restore(
        cls,
        directory: str | os.PathLike[str],
        stages: Stages | PerStage | Sequence[Artifact],
        *,
        optimizer: Optimizer,
        microbatches: int | None = None,
        schedule: str | Plans | Schedule | None = None,
        runner: str | Runner = "inprocess",
        clip_global_norm: float | None | _Recorded = RECORDED,
        observe: Observe | None = None,
        opt_state: PyTree = None,
        step_count: int | None = None,
        **deprecated: Unpack[Deprecated],
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
            **deprecated: ``Trainer``'s old keywords, each group with a ``DeprecationWarning``.

        Returns:
            The Trainer, its ``step_count`` the checkpoint's unless given.

        Raises:
            VjpsplitError: ``directory`` is no checkpoint, or lacks what it must record (naming it); a saved
                leaf that does not match the stages; what ``Trainer`` refuses.
        """
        options = from_legacy("Trainer.restore", stages, schedule, runner, observe, deprecated)
        saved = read_checkpoint(directory)
        meta, step = saved.meta.as_dict(), saved.step
        given = options.stages
        arts, tied = (given.artifacts, given.tied) if isinstance(given, PerStage) else (given, None)
        params, saved_state, states = restored_model(saved, arts, optimizer, tied)
        if opt_state is None:
            opt_state = saved_state
        else:  # the caller's state, as Trainer(opt_state=) takes it; an older per-stage checkpoint's is not used
            states = None
        if step_count is not None:
            step = step_count
        if microbatches is None:
            if "microbatches" not in meta:
                raise VjpsplitError(
                    f"{os.fspath(directory)}: this checkpoint does not record its microbatches (an older "
                    "vjpsplit wrote it); pass microbatches= to Trainer.restore"
                )
            microbatches = int(meta["microbatches"])
        chosen = options.schedule
        if chosen is None:
            if "plans" in meta:
                try:
                    chosen = Schedule(plans=parse_schedule(str(meta["plans"])))
                except VjpsplitError as e:
                    raise VjpsplitError(f"{os.fspath(directory)}: its recorded plans: {e}") from e
            else:
                chosen = Schedule(str(meta.get("schedule", "1f1b")))
        if isinstance(clip_global_norm, _Recorded):  # RECORDED, its one instance
            clip_global_norm = meta.get("clip_global_norm")
        if chosen.auto and chosen.memory_limit is None and chosen.memory_limit_bytes is None:
            # The limits as given (None: not recorded); restore measures again, on its own hosts.
            limit, limit_bytes = meta.get("memory_limit"), meta.get("memory_limit_bytes")
            chosen = dataclasses.replace(chosen, memory_limit=limit, memory_limit_bytes=limit_bytes)
        trainer = cls.__new__(cls)
        options = dataclasses.replace(options, schedule=chosen)
        trainer._start(options, params, optimizer, microbatches, clip_global_norm, opt_state, step, states)
        return trainer

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
