"""The Trainer on Ray: actors that keep their stages' parameters and optimizer state and apply the update there.

``TrainActor`` extends the pipeline's ``StageActor`` with the step's last three
phases (``stagestate``): its stages' tied gradients, their sums and squared
norms, the update. The driver submits them to each actor right after the
schedule's operations, so an actor runs them after its last W (Ray runs an
actor's calls in submission order); tied gradients go from actor to actor as
object references, and only the squared norms (when clipping needs their sum),
the loss and the timings reach the driver. The optimizer arrives as exported
bytes: an actor imports neither optax nor the user's code. Evaluation
(``evaluate``) chains each microbatch's stage calls actor to actor by object
reference; only the losses (and, when asked, the last stage's inputs) reach the
driver.
"""

from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from ..runtime.evaluation import EvaluatingActor
from ..runtime.offload import Offload
from ..runtime.model import Microbatch, side_for
from ..runtime.ray.actor import StageActor, raise_first_error
from ..runtime.ray.pipeline import RUNNER, RayPipeline
from ..runtime.ray.setup import SCHEDULE_TIMEOUT
from ..runtime.replicas import ReplicaGroup, check_split
from ..runtime.result import PipelineResult, step_result
from ..schedules.catalog import describe
from ..schedules.plans import Resolved
from ..stages.evaluation import EvalProgram
from ..schedules.timeline import Phase
from ...errors import VjpsplitError
from ...files.dtypes import dtype_from_name
from .separable import combine
from .clipping import clip_scale
from .ownership import Ownership, Snapshot
from .replicas import ReplicaTrainer
from .stagestate import RESTORE_HINT, StageTrainer


class TrainActor(StageActor, EvaluatingActor):
    """A pipeline worker's actor that also trains (one ``StageTrainer`` per stage it holds) and evaluates."""

    def setup(self, entries: Sequence[tuple[int, list[str], bytes, dict[str, list[int]], list[str], Any]]) -> None:
        """``(stage, names, optimizer bytes, holders, counted, state or None)`` per stage this actor holds."""
        held = self.stage_workers
        # A stage on replicas (data_parallel) keeps its optimizer state sharded across them (training.replicas).
        self.trainers: dict[int, StageTrainer | ReplicaTrainer] = {
            s: (ReplicaTrainer if isinstance(held[s], ReplicaGroup) else StageTrainer)(
                held[s], names, program, holders, counted, state
            )
            for s, names, program, holders, counted, state in entries
        }

    def optimizer_bytes(self) -> dict[int, tuple[int, int]]:
        """Per stage held on replicas: ``(most bytes of optimizer state on one device, bytes of the whole state)``,
        from its arrays' shards (``ReplicaTrainer.optimizer_bytes``)."""
        return {s: t.optimizer_bytes() for s, t in self.trainers.items() if isinstance(t, ReplicaTrainer)}

    def _phase(self, name: str, fn: Any) -> Any:
        """``guarded(fn)``, recorded as a ``Phase`` of this worker (its trace's slice)."""
        t0 = time.monotonic()
        out = self.guarded(fn)
        self.phases.append(Phase(self.worker, name, t0, time.monotonic()))
        return out

    def tied(self, stage: int) -> Any:
        """Stage ``stage``'s gradients of its tied leaves (host arrays); None after an error."""
        return self._phase("reduce tied", lambda: self.trainers[stage].tied_grads())

    def prepare(self, stage: int, sources: Sequence[int], *parts: Any) -> Any:
        """Sum stage ``stage``'s tied gradients with ``parts`` (the ``tied`` of stages ``sources``); its squared norm."""
        if any(p is None for p in parts):
            return None  # another stage failed: its report says why
        return self._phase("reduce norms", lambda: self.trainers[stage].prepare(dict(zip(sources, parts))))

    def loss(self, stage: int, microbatches: int) -> Any:
        """The step's loss (the mean over microbatches) on stage ``stage``, the last; None after an error."""

        def mean() -> float:
            got = self.stage_workers[stage].fetch_losses()
            return float(np.mean([got[m] for m in range(microbatches)]))

        return self.guarded(mean)

    def shares(self, stage: int, rnd: int, scale: float, value: Any, reduced: Sequence[Any]) -> Any:
        """Stage ``stage``'s shares of the optimizer's reductions over leaves of round ``rnd``; None after an error."""
        if value is None:
            return None  # the loss was not read: its report says why
        return self._phase("reduce optimizer", lambda: self.trainers[stage].shares(rnd, scale, value, reduced))

    def apply(self, stage: int, scale: float, value: Any = 0.0, reduced: Sequence[Any] = ()) -> None:
        """The optimizer step of stage ``stage`` with the clip ``scale``, the loss ``value`` and the reductions."""
        if value is None:
            return  # the loss was not read: its report says why
        self._phase("update", lambda: self.trainers[stage].apply(scale, value, reduced))

    def snapshot(self) -> dict[int, Snapshot]:
        """Per stage held: ``(params, optimizer state)`` as host arrays."""
        return {s: t.snapshot() for s, t in self.trainers.items()}

    def assign(self, parts: dict[int, Snapshot]) -> None:
        """Each stage held: its ``(params, optimizer state)`` of ``parts`` from now on; the last error forgotten."""
        for s, (params, state) in parts.items():
            self.trainers[s].assign(params, state)
        self.error = None


class TrainPipeline(RayPipeline):
    """A ``RayPipeline`` whose actors are ``TrainActor``s; ``data_parallel=N``: each actor runs N replicas of
    each of its stages on N devices of its own."""

    actor_class = TrainActor

    def __init__(self, *args: Any, data_parallel: int = 1, **kwargs: Any):
        self.replicas = int(data_parallel)
        super().__init__(*args, **kwargs)


class RayBackend:
    """The Trainer's workers as Ray actors (``RayPipeline``'s layout, timeouts and dead-actor reports)."""

    def __init__(
        self,
        ownership: Ownership,
        programs: Sequence[bytes],
        states: Sequence[Any],
        reductions: Sequence[tuple[str, str, int]] = (),
        uses_value: bool = False,
        data_parallel: int = 1,
        **options: Any,
    ):
        """``options``: ``RayPipeline``'s keyword arguments, and ``hang_report`` (where a stuck step's report goes);
        ``reductions`` (op, dtype, round) and ``uses_value``: what the optimizer programs exchange across stages
        and take from the step (``separable``); ``data_parallel=N``: every stage on N replicas in its actor
        (``programs`` then exported over their mesh, ``replicas.replica_program``)."""
        self.ownership, self.programs = ownership, list(programs)
        self.data_parallel = int(data_parallel)
        self.reductions = [(str(o), str(d), int(r)) for o, d, r in reductions]
        self.uses_value = bool(uses_value)
        self.rounds = 1 + max((int(r[2]) for r in self.reductions), default=-1)
        self.schedule_timeout = float(options.get("schedule_timeout", SCHEDULE_TIMEOUT))
        hang_report = options.pop("hang_report", None)
        self.offload: Offload | None = options.pop("offload", None)
        self.rp = rp = TrainPipeline(
            ownership.artifacts, ownership.stage_params, data_parallel=self.data_parallel, **options
        )
        rp.hang_report = hang_report
        try:
            rp.get([a.setup.remote(self._entries(w, states)) for w, a in enumerate(rp.actors)])
            if self.offload is not None:
                rp.get([a.offload.remote(self.offload) for a in rp.actors])
        except BaseException:
            rp.close()
            raise
        self.worker_of = rp.layout.worker_of()
        self.actor_of = {s: rp.actors[w] for s, w in self.worker_of.items()}
        self.evaluating: set[int] = set()  # the workers whose actors hold their stages' evaluation programs

    def _entries(self, worker: int, states: Sequence[Any]) -> list[tuple[Any, ...]]:
        """What ``TrainActor.setup`` takes for ``worker``'s stages."""
        own = self.ownership
        return [
            (s, own.names[s], self.programs[s], own.holders[s], own.counted[s], states[s])
            for s in self.rp.layout.workers[worker]
        ]

    @property
    def placement(self) -> list[tuple[str, ...]]:
        """Per stage, the devices that hold its parameters, as its actor's JAX names them."""
        got: dict[int, list[str]] = {}
        for part in self.rp.get([a.placement.remote() for a in self.rp.actors]):
            got.update(part)
        return [tuple(got[s]) for s in range(self.rp.num_stages)]

    def step(
        self,
        mbs: Sequence[Microbatch],
        schedule: Resolved,
        microbatches: int,
        clip: float | None,
        *,
        timed: bool = False,
    ) -> tuple[PipelineResult, list[float]]:
        """One step on the actors: the schedule, then each stage's tied sums, squared norm and update.

        ``timed``: see ``Backend.step``.
        """
        rp, S = self.rp, self.rp.num_stages
        name, plans, layout = schedule
        if layout != rp.layout:
            raise VjpsplitError(
                f"{describe(name)} lays the stages out as {layout.as_lists()}; "
                f"this Trainer's actors hold {rp.layout.as_lists()}"
            )
        if self.data_parallel > 1:
            check_split(mbs, self.data_parallel)  # before any operation runs
        t0 = time.monotonic()
        lists = rp.start_step(plans, mbs, microbatches, timed)
        t1 = time.monotonic()
        holders = self.ownership.holders
        tied = {s: self.actor_of[s].tied.remote(s) for s in range(S) if holders[s]}
        sums = []
        for s in range(S):
            sources = sorted({h for hs in holders[s].values() for h in hs if h != s})
            sums.append(self.actor_of[s].prepare.remote(s, sources, *[tied[h] for h in sources]))
        owners = [self.worker_of[s] for s in range(S)]
        scale = 1.0
        if clip is not None:
            got = rp.fetch(sums, owners, t0, hint=RESTORE_HINT, watch=lists)
            if all(v is not None for v in got):
                scale = clip_scale(got, clip)[0]
        # The loss stays an object reference: Ray hands it from the last stage's actor to the others.
        value: Any = self.actor_of[S - 1].loss.remote(S - 1, microbatches) if self.uses_value else 0.0
        reduced = [np.zeros((), dtype_from_name(dt)) for _, dt, _ in self.reductions]
        for r in range(self.rounds):
            # sums first: the shares are read after the gradients are summed (an actor runs its calls in order)
            parts = rp.fetch(
                [self.actor_of[s].shares.remote(s, r, scale, value, reduced) for s in range(S)],
                owners,
                t0,
                hint=RESTORE_HINT,
                watch=lists,
            )
            if any(p is None for p in parts):
                break  # a stage failed: its report is the step's error
            mine = [i for i, (_, _, rr) in enumerate(self.reductions) if rr == r]
            for pos, i in enumerate(mine):
                op, dt, _ = self.reductions[i]
                reduced[i] = combine(op, dt, [parts[s][pos] for s in range(S)])
        applied = [self.actor_of[s].apply.remote(s, scale, value, reduced) for s in range(S)]
        reports = [a.report.remote() for a in rp.actors]
        everyone = list(range(rp.layout.num_workers))
        values = rp.fetch(
            [*reports, *sums, *applied], [*everyone, *owners, *owners], t0, hint=RESTORE_HINT, watch=lists
        )
        t2 = time.monotonic()
        step_time = t2 - t0
        states = values[: len(reports)]
        raise_first_error(states)
        phases = [Phase(None, "hand out", t0, t1), Phase(None, "wait for the workers", t1, t2)]
        phases += [p.shifted(off) for st, off in zip(states, rp.clock_offsets) for p in st["phases"]]
        totals = values[len(reports) : len(reports) + S]
        result = step_result(
            schedule=name,
            plans=plans,
            num_stages=S,
            microbatches=microbatches,
            runner=RUNNER,
            step_time=step_time,
            losses=states[self.worker_of[S - 1]]["losses"],
            grads=[None] * S,  # applied where they live
            events=rp.driver_events(states),
            extra={"compiled": False},
            timed=timed,
            phases=phases if timed else (),
        )
        return result, list(totals)

    def evaluate(
        self, mbs: Sequence[Microbatch], programs: Sequence[EvalProgram], outputs: bool
    ) -> tuple[list[float], list[Any] | None]:
        """Every stage's forward only on its actor (``Backend.evaluate``): each microbatch's stage calls chained
        by object reference, so activations go actor to actor; the programs go to each actor once."""
        rp, S = self.rp, self.rp.num_stages
        t0 = time.monotonic()
        send = [w for w in range(rp.layout.num_workers) if w not in self.evaluating]
        if send:
            rp.fetch(
                [rp.actors[w].load_eval.remote({s: programs[s].data for s in rp.layout.workers[w]}) for w in send],
                send,
                t0,
            )
            self.evaluating.update(send)
        losses, received = [], []
        for x, side in mbs:
            value: Any = x
            for s in range(S):
                if outputs and s == S - 1:
                    received.append(value)  # only then: a reference here keeps its object alive
                value = self.actor_of[s].eval_op.remote(s, value, side_for(side, s, S))
            losses.append(value)
        last = self.worker_of[S - 1]
        refs = [*losses, *(received if S > 1 else [])]
        values = rp.fetch(refs, [last] * len(losses) + [self.worker_of[S - 2]] * (len(refs) - len(losses)), t0)
        got = [float(v) for v in values[: len(losses)]]
        if not outputs:
            return got, None
        return got, (list(values[len(losses) :]) if S > 1 else [tuple(x) for x, _ in mbs])

    def set_offload(self, spec: Offload | None) -> None:
        """From the next step, every stage's residuals off its device between F and B as ``spec`` says (None: none;
        kept for the actors that replace lost ones)."""
        self.offload = spec
        self.rp.get([a.offload.remote(spec) for a in self.rp.actors])

    def snapshots(self) -> list[Snapshot]:
        """Every stage's ``(params, optimizer state)``, fetched from its actor."""
        rp = self.rp
        got: dict[int, Snapshot] = {}
        everyone = list(range(rp.layout.num_workers))
        for part in rp.fetch([a.snapshot.remote() for a in rp.actors], everyone, time.monotonic()):
            got.update(part)
        return [got[s] for s in range(rp.num_stages)]

    def load(self, snapshots: Sequence[Snapshot]) -> None:
        """Every actor's stages hold their ``(params, optimizer state)`` of ``snapshots`` from now on (after any
        calls still queued on it: Ray runs an actor's calls in order)."""
        rp = self.rp
        rp.get([a.assign.remote({s: snapshots[s] for s in held}) for a, held in zip(rp.actors, rp.layout.workers)])

    def report_hangs_to(self, path: str) -> None:
        """Where a stuck or interrupted step's report goes from now on."""
        self.rp.hang_report = path

    def workers(self) -> list[Any]:
        """The Ray actor handle of each worker, in the layout's order."""
        return list(self.rp.actors)

    def replace(self, workers: Sequence[int]) -> None:
        """New actors, with the same actor options, in place of ``workers``' (dead ones): each loads its stages
        and optimizer programs as this Trainer began; ``load`` then sets every stage to a checkpoint."""
        rp = self.rp
        ray, S = rp.ray, rp.num_stages
        for w in workers:
            try:
                ray.kill(rp.actors[w])  # a worker named dead that still runs must not run on
            except Exception:  # noqa: BLE001 - already gone
                pass
            rp.actors[w] = rp.new_actor(w)
        rp.start_workers(workers, self.schedule_timeout, "the actor replacing its lost one")
        rp.get([rp.actors[w].setup.remote(self._entries(w, [None] * S)) for w in workers])
        if self.offload is not None:
            rp.get([rp.actors[w].offload.remote(self.offload) for w in workers])
        rp.connect()  # every actor sends its results to the new handles from now on
        self.actor_of = {s: rp.actors[w] for s, w in self.worker_of.items()}
        self.evaluating -= set(workers)  # a new actor gets the evaluation programs at its first evaluate

    def close(self) -> None:
        """End the actors (and a Ray instance the Trainer started)."""
        rp = self.rp
        rp.close()
