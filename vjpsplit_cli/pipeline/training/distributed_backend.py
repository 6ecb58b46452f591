"""The Trainer on multi-controller JAX: every process runs the same step, each the stages on its own devices.

Every process of a ``jax.distributed`` job builds the same Trainer and calls the
same ``step``; ``DistributedBackend`` holds a ``StageTrainer`` for each stage on
this process's devices. A step walks the plans' execution order in every process alike
(``dispatch.walk``): an operation of a stage here is dispatched as in-process
(``stageops.run_op``), one of another process's stage is skipped, and a value that
one stage hands to another's process goes through ``crosshost.move``, which every
process calls at the same point of the walk (the receivers learn its shapes by
``jax.eval_shape`` of the stage that makes it, as every process holds every stage's
artifact). The end of the step is ``stage_trainer.finish_stages`` on this process's
stages, joined with the others' through ``crosshost.gather`` (tied gradients,
squared norms, the loss, the optimizer's reductions over leaves); every process
then has every stage's squared norm and the losses (and aux), so every process returns the
same result. A timed step walks alike, as in-process: nothing waits, a watcher thread per device
times this process's operations (``timed.Timeline``); the result's events and phases are this
process's. ``evaluate`` walks every microbatch through the stages' evaluation programs in stage
order, moving what each hands on as a step does; the last stage's process sends the losses, aux
and outputs to every process.

With ``data_parallel=N`` a stage of this process runs on N of its devices: a ``runtime.replicas.ReplicaGroup``
with its ``zero1.ReplicaTrainer``, as in-process (each microbatch split N ways, one reduction per step, the
optimizer state sharded across the replicas). What it hands on is a ``Parts``: each replica's part is moved
to the matching replica of the next stage, and the processes without the values learn each part's specs
from ``jax.eval_shape`` on one replica's part of the input. A stage's replicas are all on one process.

A checkpoint (``save``) is the state every process gathered, written by process 0
to a directory the processes share; every process learns how the write went
(``agree``). A step (or a gather) that fails or passes ``step_timeout`` asks the
processes' heartbeats (``crosshost.Heartbeat``) whether one is lost, and names it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable, Mapping, Sequence, TypeVar, cast

import jax
import numpy as np

from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ...files.prng import data_struct, is_key
from ...treetypes import Leaf, PyTree
from ..runtime.dispatch import Order, order_of, placed_microbatches, walk
from ..runtime.evaluation import eval_stage, host, joined, loss_and_aux
from ..runtime.model import Microbatch, side_for
from ..runtime.offload import Offload
from ..runtime.replicas import Parts, ReplicaGroup, check_split, reductions
from ..runtime.result import PipelineResult, aux_per_microbatch, step_loss, step_result
from ..runtime.stageops import run_op
from ..runtime.timed import Timeline
from ..runtime.worker import StageWorker
from ..schedules.ops import Kind, Op
from ..schedules.stepplans import Resolved
from ..schedules.timeline import Phase
from ..stages.evalprograms import EvalProgram
from .checkpoint import save_checkpoint
from .checkpoint_layout import HostCheckpoint
from .clipping import Squares, clip_scale
from .crosshost import abandon, gather, heartbeat, move, specs
from .device_memory import DeviceMemory, memory_records
from .measured import Step, measure_transfer_rates
from .ownership import Ownership, Snapshot
from .stage_trainer import RESTORE_HINT, StageTrainer, finish_stages
from .zero1 import ReplicaTrainer

RUNNER = "distributed"
T = TypeVar("T")


class _Handed:
    """What an operation hands on, as every process knows it: its stage, and its arrays' specs; the arrays
    themselves only in the process that ran it (None elsewhere)."""

    def __init__(self, stage: int, value: PyTree | None, spec: PyTree):
        self.stage, self.value, self.spec = stage, value, spec


def distributed_placement(
    num_stages: int, workers: Sequence[Sequence[int]], n: int = 1
) -> list[tuple[jax.Device, ...]]:
    """Per stage its devices by default: worker k's stages on the k-th group of ``n`` devices of one process (each
    process's devices in groups of ``n``, process by process, by id): with ``n`` 1, ``jax.devices()[k]``.

    Raises:
        VjpsplitError: fewer such groups in the job than workers.
    """
    every = jax.devices()
    groups: list[tuple[jax.Device, ...]] = []
    for p in range(jax.process_count()):
        mine = [d for d in every if d.process_index == p]
        groups += [tuple(mine[i : i + n]) for i in range(0, len(mine) - n + 1, n)]
    if len(groups) < len(workers):
        if n == 1:
            need = f"a device each, the job has {len(every)}"
        else:
            need = (
                f"{n} devices of one process each (data_parallel={n}: a stage's replicas run in one process), "
                f"the job's processes have {len(groups)} such groups"
            )
        more = "" if n == 1 else f" (on CPU: XLA_FLAGS=--xla_force_host_platform_device_count={n} or more each)"
        raise VjpsplitError(
            f"runner=Distributed(): {len(workers)} workers need {need} ({jax.process_count()} processes); start "
            f"more processes, or processes with more devices{more}, or give devices="
        )
    out: dict[int, tuple[jax.Device, ...]] = {}
    for k, held in enumerate(workers):
        for s in held:
            out[s] = groups[k]
    return [out[s] for s in range(num_stages)]


class DistributedBackend:
    """The stages of this process of a ``jax.distributed`` job (the module docstring): one ``StageTrainer`` each,
    or with replicas a ``zero1.ReplicaTrainer`` of the stage's ``ReplicaGroup`` on its devices of this process.

    Args:
        ownership: Who holds which leaf (every stage's artifact and parameters, in every process).
        devices: Per stage its devices (of any process; a stage's replicas', all of one process).
        program: A stage of this process's exported optimizer (over its replicas' mesh where it has several).
        states: Per stage a restored optimizer state, or None.
        step_timeout: Seconds a step may take here before it is one error naming this process.
        offload: Residuals of this process's stages off their device between F and B.

    Raises:
        VjpsplitError: this process holds no stage.
    """

    def __init__(
        self,
        ownership: Ownership,
        devices: Sequence[Sequence[jax.Device]],
        program: Callable[[int], bytes],
        states: Sequence[Mapping[str, Leaf] | None],
        step_timeout: float | None = None,
        offload: Offload | None = None,
    ):
        self.ownership, self.devices = ownership, [tuple(g) for g in devices]
        self.replicas = len(self.devices[0])
        self.step_timeout = step_timeout
        self.hang_report: str | None = None
        self.broken: str | None = None
        self.me = jax.process_index()
        self.step_count = 0  # the run's step the next step is (the Trainer sets it): what a lost process's error names
        S = len(self.devices)
        self.local = [s for s in range(S) if self.devices[s][0].process_index == self.me]
        if not self.local:
            raise VjpsplitError(
                f"runner=Distributed(): process {self.me} holds no stage (the stages are on "
                f"{[[str(d) for d in g] for g in self.devices]}); run as many processes as workers, or give "
                "devices= devices of each process"
            )
        own = ownership
        self.trainers: dict[int, StageTrainer | ReplicaTrainer] = {}
        for s in self.local:
            args = (own.names[s], program(s), own.holders[s], own.counted[s], states[s])
            if self.replicas > 1:
                group = ReplicaGroup(own.artifacts[s], own.stage_params[s], s, S, self.devices[s], offload)
                self.trainers[s] = ReplicaTrainer(group, *args)
            else:
                worker = StageWorker(own.artifacts[s], own.stage_params[s], s, S, self.devices[s][0], offload)
                self.trainers[s] = StageTrainer(worker, *args)
        self.param_specs = [specs(p) for p in own.stage_params]
        self.shapes: dict[tuple[object, ...], PyTree] = {}  # (stage, input signature) -> its forward's output specs
        self.orders: tuple[list[list[Op]], Order] | None = None
        self.heart = heartbeat()  # started with the first backend of this process
        self.timeline = Timeline()  # the timed steps' watchers

    @property
    def placement(self) -> list[tuple[jax.Device | str, ...]]:
        """Per stage, the devices that hold its parameters (of any process; its replicas', in order)."""
        return [tuple(g) for g in self.devices]

    def _order(self, plans: list[list[Op]]) -> Order:
        if self.orders is None or self.orders[0] is not plans:
            self.orders = (plans, order_of(plans, len(self.devices)))
        return self.orders[1]

    def _per_replica(self, x: PyTree, side: Sequence[PyTree], one: Callable[[PyTree, list[PyTree]], PyTree]) -> PyTree:
        """``one(x, side)``: the specs one stage's call hands on for inputs of specs ``x`` and ``side`` (no compute);
        with replicas, a ``Parts`` of each replica's (``x`` a ``Parts`` already, or the microbatch's, cut N ways
        as the replicas cut it, as ``side`` is)."""
        n = self.replicas
        if n == 1:
            return one(x, list(side))
        return Parts([one(x[0] if isinstance(x, Parts) else _cut(x, n), [_cut(v, n) for v in side])] * n)

    def _forward_spec(self, stage: int, x: PyTree, side: Sequence[PyTree]) -> PyTree:
        """The specs of what stage ``stage``'s forward hands on (``_per_replica``)."""
        return self._per_replica(x, side, lambda x1, side1: self._forward_spec_of(stage, x1, side1))

    def _forward_spec_of(self, stage: int, x: PyTree, side: Sequence[PyTree]) -> PyTree:
        """The specs of one forward's output of stage ``stage`` (of one replica) for inputs of specs ``x``, ``side``."""
        ins = [x, *side]
        flat, tree = jax.tree_util.tree_flatten(ins)
        key = (stage, tree, tuple((a.shape, a.dtype) for a in flat))
        got = self.shapes.get(key)
        if got is None:
            art: Artifact = self.ownership.artifacts[stage]
            got = self.shapes[key] = jax.eval_shape(lambda p, *a: art.fwd(p, *a)[0], self.param_specs[stage], *ins)
        return got

    def _eval_spec(self, stage: int, program: EvalProgram, x: PyTree, side: Sequence[PyTree]) -> PyTree:
        """The specs of what stage ``stage``'s evaluation ``program`` hands on, the tuple ``EvalProgram.run``
        returns (``_per_replica``)."""
        return self._per_replica(x, side, lambda x1, side1: self._eval_spec_of(stage, program, x1, side1))

    def _eval_spec_of(self, stage: int, program: EvalProgram, x: PyTree, side: Sequence[PyTree]) -> PyTree:
        """The specs of one evaluation program's outputs (of one replica), its inputs' leaves as ``run`` takes
        them (a typed key as its key data)."""
        ins = jax.tree_util.tree_leaves((self.param_specs[stage], x, *side))
        leaves = [data_struct(a) if is_key(a) else a for a in ins]
        key = ("eval", stage, tuple((a.shape, a.dtype) for a in leaves))
        got = self.shapes.get(key)
        if got is None:
            got = self.shapes[key] = tuple(jax.eval_shape(program.exported.call, *leaves))
        return got

    def _moved(self, handed: _Handed, stage: int) -> PyTree | None:
        """What ``handed`` holds, on stage ``stage``'s devices (``move``, which every process calls alike): with
        replicas, replica r's part to stage ``stage``'s replica r. None in a process that does not run ``stage``."""
        src, dst = self.devices[handed.stage], self.devices[stage]
        if self.replicas == 1:
            return move(handed.value, handed.spec, src[0], dst[0])
        values = [None] * self.replicas if handed.value is None else list(handed.value)
        got = [move(v, sp, a, b) for v, sp, a, b in zip(values, handed.spec, src, dst)]
        return Parts(got) if dst[0].process_index == self.me else None

    def _walk(
        self,
        mbs: Sequence[Microbatch],
        plans: list[list[Op]],
        microbatches: int,
        scales: Sequence[float] | None,
        timed: bool,
    ) -> None:
        """Every process's walk of the step's plans (see the module docstring); ``timed``: each operation here timed
        by its device's watcher into its ``Event``, the batch inputs placed on this process's stages' devices first,
        as in-process."""
        S = len(self.devices)
        ins: dict[tuple[int, int], PyTree] = {}  # (stage, mb) -> the specs of its forward's input

        def submit(w: int, op: Op, data: object, side: list[Leaf]) -> _Handed | None:
            s = op.stage
            if isinstance(data, _Handed):  # another stage's result: moved here where that stage is elsewhere
                spec = data.spec
                data = data.value if data.stage == s else self._moved(data, s)
            else:
                spec = None if data is None else specs(data)  # the batch: every process has it
            if op.kind == Kind.F:
                ins[(s, op.mb)] = spec
            here = s in self.trainers
            out = run_op(self._worker(s), op, data, side, microbatches, w) if here else None
            if op.kind == Kind.W or (op.kind in (Kind.B, Kind.I) and s == 0) or (op.kind == Kind.F and s == S - 1):
                return None  # nothing another stage takes
            if op.kind == Kind.F:
                return _Handed(s, out, specs(out) if here else self._forward_spec(s, spec, specs(side)))
            return _Handed(s, out, ins[(s, op.mb)])  # a cotangent is shaped as the forward's input

        for s in self.trainers:
            self._worker(s).reset(timed=timed, plans=plans, scales=scales)
        if not timed:
            walk(plans, S, mbs, submit, self._order(plans))
            return
        mbs = placed_microbatches(mbs, [self._worker(s) if s in self.trainers else _ELSEWHERE for s in range(S)])
        # Dispatched as an untimed walk: a watcher per device times this process's operations (``timed.Timeline``);
        # the walk ends once they are timed.
        with self.timeline.step([self._worker(s) for s in self.trainers]):
            walk(plans, S, mbs, submit, self._order(plans))

    def _worker(self, stage: int) -> StageWorker:
        """Stage ``stage``'s worker here; a stage on replicas has a ``ReplicaGroup``, which runs a schedule's
        operations as a ``StageWorker`` does (``runtime.replicas``), so the walk takes it alike."""
        return cast("StageWorker", self.trainers[stage].worker)

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
        """One step in every process alike (``Backend.step``): the same losses, aux and squared sums in every
        process. ``timed``: each operation here waited for, the result's events and phases this process's (its
        stages' operations, their reductions and updates, and its wait for the losses)."""
        if self.broken is not None:
            raise VjpsplitError(self.broken)
        if self.replicas > 1:
            check_split(mbs, self.replicas)  # before any operation runs, in every process alike
        S = len(self.devices)
        t0 = time.monotonic()
        phases: list[Phase] = []
        sums, losses, aux = self._watched(
            f"step {self.step_count}", lambda: self._run(mbs, schedule.plans, microbatches, clip, scales, timed, phases)
        )
        workers = [self._worker(s) for s in self.local]
        result = step_result(
            schedule=schedule.name,
            plans=schedule.plans,
            num_stages=S,
            microbatches=microbatches,
            runner=RUNNER,
            step_time=time.monotonic() - t0,
            losses=losses,
            grads=[None] * S,  # applied where they live
            events=[e for w in workers for e in w.events] if timed else [],
            timed=timed,
            phases=[*phases, *reductions(workers)] if timed else (),
            scales=scales,
            aux=aux_per_microbatch(self.ownership.artifacts[-1], aux, microbatches),
        )
        return result, [sums[s] for s in range(S)]

    def _run(
        self,
        mbs: Sequence[Microbatch],
        plans: list[list[Op]],
        microbatches: int,
        clip: float | None,
        scales: Sequence[float] | None,
        timed: bool,
        phases: list[Phase],
    ) -> tuple[dict[int, float], dict[int, float], dict[int, list[np.ndarray]]]:
        """The step's walk and its end: every stage's squared sum, the losses and the aux leaves, the same in every
        process (``timed``: the walk's, the end's and the losses' ``Phase``s into ``phases``)."""
        S = len(self.devices)
        t0 = time.monotonic()
        self._walk(mbs, plans, microbatches, scales, timed)
        phases.append(Phase(None, "run the operations", t0, time.monotonic()))
        last = self.trainers.get(S - 1)
        fetched: tuple[dict[int, float], dict[int, list[np.ndarray]]] | None = None

        def outputs() -> tuple[dict[int, float], dict[int, list[np.ndarray]]]:
            nonlocal fetched
            if fetched is None:
                at = time.monotonic()
                mine = {}
                if last is not None:
                    losses, aux = self._worker(S - 1).fetch_outputs()
                    mine = {S - 1: [np.asarray(_ordered(losses)), [aux[m] for m in sorted(aux)]]}
                got = gather(mine)[S - 1]
                fetched = dict(enumerate(float(v) for v in got[0])), dict(enumerate(list(a) for a in got[1]))
                phases.append(Phase(None, "fetch the losses", at, time.monotonic()))
            return fetched

        def value() -> float:
            return step_loss(outputs()[0], microbatches, scales)

        def mark(name: str, a: float, b: float) -> None:
            phases.append(Phase(None, name, a, b))

        mine = [self.trainers[s] for s in self.local]
        scale = None if clip is None else (lambda v: clip_scale(v, clip)[0])
        got = finish_stages(mine, _exchange, scale, self.ownership.tied, mark, value=value)
        own = dict(zip(self.local, Squares.fetch(got)))
        every = gather({s: np.asarray(v, np.float64) for s, v in own.items()})
        return {s: float(v) for s, v in every.items()}, *outputs()

    def _watched(self, what: str, body: Callable[[], T]) -> T:
        """``body()``, something every process does at the same point (``what``: a step, a gather), under
        ``step_timeout``; once it failed or timed out, the other processes' beats say whether one is lost.

        Raises:
            VjpsplitError: a process is lost: one error naming it, its stages and ``what``; ``what`` did not finish
                within ``step_timeout`` though no process is lost (one is stuck). After either this process exits
                without waiting for the others (``crosshost.abandon``). Any other error of ``body`` as it is.
        """
        try:
            return self._guarded(body)
        except Exception as e:
            lost = [] if self.heart is None else self.heart.lost()
            if not lost:
                if isinstance(e, _TimedOut):
                    abandon()  # the stuck process would hold JAX's shutdown at exit too
                    raise VjpsplitError(
                        f"process {self.me} (stages {self.local}): {what} did not finish within step_timeout="
                        f"{self.step_timeout} s, and every other process still beats: one is stuck{RESTORE_HINT}"
                    ) from e
                raise
            said = "; ".join(f"process {p} (stages {self._stages_of(p)})" for p in lost)
            self.broken = f"{said} of this jax.distributed job was lost at {what}; restart the job"
            abandon()
            raise VjpsplitError(
                f"{said} was lost at {what} (its heartbeat stopped); process {self.me} ends: restart the job (its "
                "launcher), and restore the last checkpoint"
            ) from e

    def _stages_of(self, process: int) -> list[int]:
        """The stages on ``process``'s devices."""
        return [s for s, g in enumerate(self.devices) if g[0].process_index == process]

    def _guarded(self, body: Callable[[], T]) -> T:
        """``body()`` in a thread of its own, waited for ``step_timeout`` seconds: past it, ``_TimedOut``, and no
        step runs on this backend again."""
        box: dict[str, object] = {}

        def run() -> None:
            try:
                box["out"] = body()
            except BaseException as e:  # noqa: BLE001 - raised in the caller's thread below
                box["error"] = e

        thread = threading.Thread(target=run, name="vjpsplit-distributed-step", daemon=True)
        thread.start()
        thread.join(self.step_timeout)
        if thread.is_alive():
            self.broken = f"an earlier step of process {self.me} timed out{RESTORE_HINT}"
            raise _TimedOut(f"process {self.me}: not done within step_timeout={self.step_timeout} s")
        if "error" in box:
            raise box["error"]  # type: ignore[misc]  # a BaseException, stored above
        return box["out"]  # type: ignore[return-value]  # what body returned

    def evaluate(
        self, mbs: Sequence[Microbatch], programs: Sequence[EvalProgram], outputs: bool
    ) -> tuple[list[float], list[list[np.ndarray]], list[PyTree] | None]:
        """Every stage's forward only, each in its process from its evaluation program, what one stage hands the next
        moved as a step's (``Backend.evaluate``): the losses, aux and outputs the same in every process."""
        if self.broken is not None:
            raise VjpsplitError(self.broken)
        if self.replicas > 1:
            check_split(mbs, self.replicas)  # before any stage runs, as a step's
        return self._watched(
            f"the evaluation after step {self.step_count}", lambda: self._evaluate(mbs, programs, outputs)
        )

    def _evaluate(
        self, mbs: Sequence[Microbatch], programs: Sequence[EvalProgram], outputs: bool
    ) -> tuple[list[float], list[list[np.ndarray]], list[PyTree] | None]:
        """``evaluate``'s walk, microbatch by microbatch and stage by stage in every process alike; the last
        stage's process sends every microbatch's loss, aux and (``outputs``) what that stage received to all."""
        S = len(self.devices)
        ends: list[list[object]] = []  # in the last stage's process, per microbatch: [loss, aux leaves, received]
        for m, (x, side) in enumerate(mbs):
            value, spec = x, specs(x)
            for s in range(S):
                if s > 0:
                    value = self._moved(_Handed(s - 1, value, spec), s)
                ins = side_for(side, s, S)
                out = eval_stage(self._worker(s), programs[s], value, ins, m) if s in self.trainers else None
                if s == S - 1:
                    if out is not None:
                        loss, aux = loss_and_aux(jax.device_get(out))
                        ends.append([np.asarray(loss, np.float64), aux, joined(host(value)) if outputs else None])
                elif s in self.trainers:
                    value, spec = out, specs(out)
                else:
                    value, spec = None, self._eval_spec(s, programs[s], spec, specs(ins))
        got = gather({S - 1: ends} if S - 1 in self.trainers else {})[S - 1]
        return [float(v) for v, _, _ in got], [list(a) for _, a, _ in got], [r for _, _, r in got] if outputs else None

    def costs_samples(self, kept: Sequence[Step]) -> list[Step]:
        """Every process's timed steps' samples (``CostSamples.kept``: each process's are its own stages'), merged in
        process order: what ``Trainer.costs`` takes medians over here. Every process calls it at the same point.

        Args:
            kept: This process's samples.

        Returns:
            Every process's, as ``CostSamples.costs`` takes them.
        """
        mine = {
            self.me: [
                [{f"{s}/{k}": np.asarray(v, np.float64) for (s, k), v in ops.items()}, np.asarray(gaps, np.float64)]
                for ops, gaps in kept
            ]
        }
        got = self._watched("the gather of the measured costs", lambda: gather(mine))
        out: list[Step] = []
        for p in sorted(got):
            for ops, gaps in got[p]:
                times = {}
                for key, v in ops.items():
                    stage, _, kind = key.partition("/")
                    times[(int(stage), kind)] = [float(x) for x in v]
                out.append((times, [float(x) for x in gaps]))
        return out

    def slowest(self, seconds: float) -> float:
        """The most of every process's ``seconds`` (a trial step's time, each on its own clock), on every process:
        so that ``schedule="auto"``'s race keeps the same plan everywhere. Every process calls it at the same point.

        Args:
            seconds: This process's figure.

        Returns:
            The largest of all processes' figures.
        """
        got = self._watched("the gather of a trial step's time", lambda: gather({self.me: np.asarray(seconds)}))
        return max(float(v) for v in got.values())

    def transfer_rates(self) -> dict[str, float]:
        """``measured.measure_transfer_rates`` on the first stage's process (its first local device), given to every
        process: one figure for all. Every process calls it at the same point."""
        owner = self.devices[0][0].process_index
        mine: dict[int, PyTree] = {}
        if self.me == owner:  # the others measure nothing: only its figure is kept
            rates = measure_transfer_rates(self.devices[self.local[0]][0])
            mine = {owner: {k: np.asarray(v, np.float64) for k, v in rates.items()}}
        got = self._watched("the gather of the transfer rates", lambda: gather(mine))
        return {k: float(v) for k, v in got[owner].items()}

    def send_seconds(self, values: Sequence[PyTree], repeats: int) -> list[float]:
        """Refused: sends between processes are not timed apart yet (``Trainer.costs`` gives ``gap`` as ``comm``)."""
        raise VjpsplitError(
            "runner=Distributed() does not time sends between processes apart yet: costs() gives comm as the gap"
        )

    def set_offload(self, spec: Offload | None) -> None:
        """From the next step, this process's stages' residuals off their device as ``spec`` says (None: none)."""
        for t in self.trainers.values():
            t.worker.set_offload(spec)

    def snapshots(self) -> list[Snapshot]:
        """Every stage's ``(params, optimizer state)`` as host arrays, in every process (each sends its own)."""
        mine = {s: list(t.snapshot()) for s, t in self.trainers.items()}
        got = self._watched(f"the gather of the state after step {self.step_count}", lambda: gather(mine))
        return [(dict(got[s][0]), dict(got[s][1])) for s in range(len(self.devices))]

    @property
    def writes_checkpoints(self) -> bool:
        """Whether this process writes the job's checkpoints (process 0 does; every process holds the same
        gathered state, so one writes it for all, to a directory they share)."""
        return self.me == 0

    def agree(self, error: str | None) -> str | None:
        """Every process's ``error`` (None: none) of something all of them did at the same point, on every
        process: the first one, naming its process; None when none failed. Every process calls it alike.

        Args:
            error: what failed here, or None.

        Returns:
            ``"process <p>: <its error>"`` of the first process (by index) that failed, the same in every process;
            None if none did.
        """
        mine = {self.me: np.frombuffer((error or "").encode(), np.uint8)}
        said = self._watched(f"the checkpoint after step {self.step_count}", lambda: gather(mine))
        for p in sorted(said):
            text = np.asarray(said[p]).tobytes().decode()
            if text:
                return f"process {p}: {text}"
        return None

    def save(self, directory: str | os.PathLike[str], ck: HostCheckpoint) -> None:
        """``ck`` (the job's whole state, which every process holds) written to ``directory`` by process 0, every
        process returning once it is written (``agree``): a directory the processes share holds it for all.

        Raises:
            VjpsplitError: the write failed (in every process, naming process 0 and its error).
        """
        error: VjpsplitError | None = None
        if self.writes_checkpoints:
            try:
                save_checkpoint(directory, ck)
            except VjpsplitError as e:
                error = e
        said = self.agree(None if error is None else str(error))
        if said is not None:
            raise VjpsplitError(f"the checkpoint was not written ({said})") from error

    def memory(self) -> list[DeviceMemory]:
        """Per device of this process that holds a stage, its bytes (``device_memory``)."""
        return memory_records(self.trainers.values())

    def load(self, snapshots: Sequence[Snapshot]) -> None:
        """This process's stages hold their ``(params, optimizer state)`` of ``snapshots`` from now on."""
        for s, t in self.trainers.items():
            t.assign(*snapshots[s])

    def report_hangs_to(self, path: str) -> None:
        """Where a stuck step's report would go (none is written across processes yet)."""
        self.hang_report = path

    def workers(self) -> list[object]:
        """Ray actor handles: none here."""
        raise VjpsplitError("workers() gives the Ray actor of each worker; this Trainer runs on jax.distributed")

    def replace(self, workers: Sequence[int]) -> None:
        """Refused: a lost process ends the job; its launcher starts it again and ``restore`` resumes."""
        raise VjpsplitError(
            f"workers {list(workers)} cannot be replaced on jax.distributed: restart the job and restore the "
            "last checkpoint"
        )

    def close(self) -> None:
        """End this process's stages' offload and the timed steps' watchers."""
        for t in self.trainers.values():
            t.worker.set_offload(None)
        self.timeline.close()


class _Elsewhere:
    """Another process's stage in ``placed_microbatches``: its batch inputs stay on the host (never read here)."""

    def to_device(self, tree: PyTree) -> PyTree:
        return tree


_ELSEWHERE = cast("StageWorker", _Elsewhere())


class _TimedOut(VjpsplitError):
    """Something every process does together did not finish here within ``step_timeout``."""


def _exchange(part: Mapping[int, T]) -> Mapping[int, T]:
    """``finish_stages``' exchange across processes: squared sums fetched, device arrays to the host, then gathered."""
    sent = {s: _host(v) for s, v in part.items()}
    return {s: _back(v) for s, v in gather(sent).items()}  # type: ignore[misc]  # as handed in, on the host


def _host(v: object) -> object:
    if isinstance(v, Squares):
        return np.asarray(v.value(), np.float64)
    if isinstance(v, float):
        return np.asarray(v, np.float64)
    return jax.tree_util.tree_map(np.asarray, v)


def _back(v: object) -> object:
    """A gathered scalar as the float it was sent as; anything else as it is."""
    if isinstance(v, np.ndarray) and v.shape == () and v.dtype == np.float64:
        return float(v)
    return v


def _cut(tree: PyTree, n: int) -> PyTree:
    """The specs of one of ``n`` replicas' parts of ``tree``'s (specs of) arrays, cut along axis 0 as
    ``replicas.split_parts`` cuts them."""
    return jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct((a.shape[0] // n, *a.shape[1:]), a.dtype), tree)


def _ordered(losses: Mapping[int, float]) -> list[float]:
    return [losses[m] for m in sorted(losses)]
