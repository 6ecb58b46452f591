"""The Trainer on Ray: actors that keep their stages' parameters and optimizer state and apply the update there.

``TrainActor`` extends the pipeline's ``StageActor`` with the step's last three
phases (``stage_trainer``): its stages' tied gradients, their sums and squared
norms, the update. They run inside the step's one call per actor
(``train_step``), right after the worker's list: the parts one actor needs of
another (tied gradients, squared norms when clipping, the loss, the optimizer's
reductions over leaves) go actor to actor through the inboxes that carry the
activations, and every actor joins them as the driver once did, in stage order.
A round between actors costs one delivery (about a millisecond on one host,
docs/performance.md); a round through the driver cost two and a wait there. The
driver waits once per step, for each actor's report (the losses, timings and
squared norms). The optimizer arrives as exported bytes: an actor imports
neither optax nor the user's code. Evaluation (``evaluate``) chains each
microbatch's stage calls actor to actor by object reference; only the losses
(and, when asked, the last stage's inputs) reach the driver. ``RayOptions``: the
``RayPipeline`` keywords a ``Ray`` runner gives the actors.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Sequence, TypedDict, TypeVar, Unpack

import jax
import numpy as np

from ..runtime.evaluation import EvaluatingActor
from ..runtime.flight import DONE, FINISH
from ..runtime.offload import Offload
from ..runtime.model import Microbatch, side_for
from ..runtime.ray.actor import StageActor, raise_first_error
from ..runtime.ray.pipeline import RUNNER, RayPipeline
from ..runtime.ray.setup import SCHEDULE_TIMEOUT
from ..runtime.replicas import ReplicaGroup, check_split
from ..runtime.result import PipelineResult, step_result
from ..schedules.catalog import describe
from ..schedules.stepplans import Resolved
from ..stages.evalprograms import EvalProgram
from ..schedules.timeline import Phase
from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ...treetypes import Leaf, PyTree
from ...files.dtypes import dtype_from_name
from .separable import combine
from .clipping import clip_scale
from .ownership import Ownership, Snapshot
from .zero1 import ReplicaTrainer
from .stage_trainer import RESTORE_HINT, StageTrainer


@dataclasses.dataclass(frozen=True)
class EndOfStep:
    """What every actor needs to finish a step with the others and no driver: every stage's tied keys and
    their holders, the optimizer's reductions over leaves ``(op, dtype, round)`` and whether its update takes
    the step's loss (``separable``)."""

    holders: tuple[dict[str, list[int]], ...]
    reductions: tuple[tuple[str, str, int], ...] = ()
    uses_value: bool = False

    @property
    def rounds(self) -> int:
        """The optimizer's rounds of reductions over leaves."""
        return 1 + max((r for _, _, r in self.reductions), default=-1)

    def sources(self, stage: int) -> list[int]:
        """The other stages whose gradients of ``stage``'s tied leaves it adds (ascending)."""
        return sorted({h for hs in self.holders[stage].values() for h in hs if h != stage})


T = TypeVar("T")

StageEntry = tuple[int, list[str], bytes, dict[str, list[int]], list[str], "Mapping[str, Leaf] | None"]
"""What ``TrainActor.setup`` takes per stage: ``(stage, names, optimizer bytes, holders, counted, state or None)``."""


class TrainActor(StageActor, EvaluatingActor):
    """A pipeline worker's actor that also trains (one ``StageTrainer`` per stage it holds) and evaluates.

    ``train_step`` runs the worker's list and then the end of the step with the other actors through their
    inboxes (``lists.Inbox``), not through the driver: tied gradients to the other holders, every stage's
    squared norm (for the clip scale), the loss (for an update that takes it) and each round's shares of
    the optimizer's reductions to every actor, each of which joins them as the driver did (in stage order),
    so every actor computes the same scale and reductions; then the update. A failed actor sends None in
    place of each part, so no actor waits for it; where no part goes from every worker to every other (no
    clipping, no reductions over leaves), the workers exchange whether their step went well before the
    update, so none updates when one failed.
    """

    def setup(self, entries: Sequence[StageEntry], end: EndOfStep) -> None:
        """``(stage, names, optimizer bytes, holders, counted, state or None)`` per stage this actor holds;
        ``end``: what the end of each step exchanges with the other actors."""
        held = self.stage_workers
        # A stage on replicas (data_parallel) keeps its optimizer state sharded across them (training.zero1).
        self.trainers: dict[int, StageTrainer | ReplicaTrainer] = {
            s: (ReplicaTrainer if isinstance(held[s], ReplicaGroup) else StageTrainer)(
                held[s], names, program, holders, counted, state
            )
            for s, names, program, holders, counted, state in entries
        }
        self.end = end

    def optimizer_bytes(self) -> dict[int, tuple[int, int]]:
        """Per stage held on replicas: ``(most bytes of optimizer state on one device, bytes of the whole state)``,
        from its arrays' shards (``ReplicaTrainer.optimizer_bytes``)."""
        return {s: t.optimizer_bytes() for s, t in self.trainers.items() if isinstance(t, ReplicaTrainer)}

    def train_step(
        self,
        step: int,
        ops: Sequence[tuple[str, int, int]],
        batch: dict[tuple[int, int], tuple[PyTree, list[Leaf]]],
        microbatches: int,
        timed: bool,
        clip: float | None,
    ) -> dict[str, object]:
        """Step ``step``: this worker's list (``run_step``), then the end of the step (see the class); its
        ``report`` and ``"sums"``, each held stage's squared norm (None where the step failed)."""
        self.run_step(step, ops, batch, microbatches, timed)
        self.now = (FINISH, None, None, time.monotonic())
        sums = self._finish(step, microbatches, clip)
        self.now = (DONE, None, None, time.monotonic())
        return {**self.report(), "sums": sums}

    def _exchange(self, step: int, tag: str, parts: Mapping[int, Any], peers: Sequence[int]) -> dict[int, Any]:
        """Send ``parts[w]`` (None: this step failed here) to each worker ``w`` of ``parts`` and take what each of
        ``peers`` sent this one under ``tag``: worker -> its part (None where it failed or the step was aborted)."""
        assert self.sender is not None  # connected before any step
        for w, part in parts.items():
            self.sender.send(step, w, (tag, 0, self.worker), part)
        return {w: self.inbox.take(step, (tag, 0, w)) for w in peers}

    def _finish(self, step: int, microbatches: int, clip: float | None) -> dict[int, float | None]:
        """The step's tied sums, norms, clip scale, reductions and update for this worker's stages (see the class).

        Every actor sends and takes the same parts in the same order whether or not its step failed, so that
        none waits for a part that never comes; ``ok`` turns False at the first failure here or a None
        received, and from then on this actor sends None and computes nothing. Its phases: ``reduce tied``
        and ``reduce norms`` (each with its wait for the other workers), ``reduce optimizer`` (the rounds of
        reductions over leaves) and ``update``, as in-process.
        """
        end, me, S, trainers = self.end, self.worker, self.num_stages, self.trainers
        mine, worker_of = sorted(trainers), self.worker_of
        others = sorted(set(worker_of.values()) - {me})
        ok = self.error is None
        at = time.monotonic()

        def mark(name: str) -> None:
            nonlocal at
            now = time.monotonic()
            self.phases.append(Phase(me, name, at, now))
            at = now

        def run(fn: Callable[..., T]) -> T | None:
            return self.guarded(fn) if ok else None

        def joined(got: Mapping[int, Any], own: Mapping[int, Any]) -> dict[int, Any] | None:
            """Every stage's part (this worker's ``own`` and the others' in ``got``); None if one is missing."""
            if not ok or any(v is None for v in own.values()) or any(v is None for v in got.values()):
                return None
            return {**own, **{s: v for part in got.values() for s, v in part.items()}}

        contributions: dict[int, dict[int, Any]] = {s: {} for s in mine}
        if any(end.holders):
            needs = {s: end.sources(s) for s in range(S)}
            own = {s: run(trainers[s].tied_grads) for s in mine if end.holders[s]}
            out = {}  # to each other worker: the tied gradients of this worker's stages that its stages add
            for w in others:
                wanted = sorted({h for t in range(S) if worker_of[t] == w for h in needs[t] if worker_of[h] == me})
                if wanted:
                    out[w] = {h: own[h] for h in wanted} if ok and None not in own.values() else None
            senders = sorted({worker_of[h] for t in mine for h in needs[t]} - {me})
            have = joined(self._exchange(step, "tied", out, senders), own)
            ok = have is not None
            if have is not None:
                contributions = {s: {h: have[h] for h in [*needs[s], *([s] if s in own else [])]} for s in mine}
        sums = {s: run(lambda s=s: trainers[s].prepare(contributions[s])) for s in mine}
        ok = ok and None not in sums.values()
        if any(end.holders):
            mark("reduce tied")
        scale: Any = 1.0
        if clip is not None:
            every = joined(self._exchange(step, "norms", {w: sums if ok else None for w in others}, others), sums)
            ok = every is not None
            scale = run(lambda: clip_scale([float(every[t]) for t in range(S)], clip)[0])  # type: ignore[index]
            ok = ok and scale is not None
        mark("reduce norms")
        value: Any = 0.0
        if end.uses_value:  # the loss, from the last stage's worker
            last = worker_of[S - 1]
            if last == me:
                value = run(lambda: self._loss(S - 1, microbatches))
                self._exchange(step, "loss", {w: value for w in others}, [])
            else:
                value = self._exchange(step, "loss", {}, [last])[last]
            value = None if value is None or not ok else float(value)
            ok = value is not None
        reduced = [np.zeros((), dtype_from_name(dt)) for _, dt, _ in end.reductions]
        for r in range(end.rounds):
            parts = {s: run(lambda s=s: trainers[s].shares(r, scale, value, reduced)) for s in mine}
            ok = ok and None not in parts.values()
            every = joined(
                self._exchange(step, f"shares {r}", {w: parts if ok else None for w in others}, others), parts
            )
            ok = every is not None
            if every is not None:
                mine_r = [i for i, (_, _, rr) in enumerate(end.reductions) if rr == r]
                for pos, i in enumerate(mine_r):
                    op, dt, _ = end.reductions[i]
                    reduced[i] = combine(op, dt, [every[t][pos] for t in range(S)])
        if end.rounds:
            mark("reduce optimizer")
        if clip is None and not end.rounds and others:
            # No exchange above went from every worker to every other (tied sums go between holders, the loss
            # from the last worker): without this one, a worker would update while another's step failed.
            said = self._exchange(step, "ok", {w: True if ok else None for w in others}, others)
            ok = ok and None not in said.values()
            mark("agree")
        for s in mine:
            run(lambda s=s: trainers[s].apply(scale, value, reduced))
        mark("update")
        return sums

    def _loss(self, stage: int, microbatches: int) -> float:
        """The step's loss (the mean over microbatches) on stage ``stage``, the last."""
        got = self.stage_workers[stage].fetch_losses()
        return float(np.mean([got[m] for m in range(microbatches)]))

    def snapshot(self) -> dict[int, Snapshot]:
        """Per stage held: ``(params, optimizer state)`` as host arrays."""
        return {s: t.snapshot() for s, t in self.trainers.items()}

    def assign(self, parts: dict[int, Snapshot]) -> None:
        """Each stage held: its ``(params, optimizer state)`` of ``parts`` from now on; the last error forgotten."""
        for s, (params, state) in parts.items():
            self.trainers[s].assign(params, state)
        self.error = None


class RayOptions(TypedDict, total=False):
    """``RayPipeline``'s keywords a ``Ray`` runner gives the Trainer's actors (``backend.open_backend``)."""

    address: str | None
    runtime_env: Mapping[str, object] | None
    actor_options: Sequence[Mapping[str, object]] | None
    layout: str | Sequence[Sequence[int]]
    schedule_timeout: float
    step_timeout: float


class TrainPipeline(RayPipeline):
    """A ``RayPipeline`` whose actors are ``TrainActor``s; ``data_parallel=N``: each actor runs N replicas of
    each of its stages on N devices of its own."""

    actor_class = TrainActor

    def __init__(
        self,
        artifacts: Sequence[Artifact],
        params: Sequence[PyTree],
        *,
        data_parallel: int = 1,
        **options: Unpack[RayOptions],
    ):
        self.replicas = int(data_parallel)
        super().__init__(artifacts, params, **options)


class RayBackend:
    """The Trainer's workers as Ray actors (``RayPipeline``'s layout, timeouts and dead-actor reports)."""

    def __init__(
        self,
        ownership: Ownership,
        programs: Sequence[bytes],
        states: Sequence[Mapping[str, Leaf] | None],
        reductions: Sequence[tuple[str, str, int]] = (),
        uses_value: bool = False,
        data_parallel: int = 1,
        *,
        hang_report: str | None = None,
        offload: Offload | None = None,
        **options: Unpack[RayOptions],
    ):
        """``options``: ``RayPipeline``'s keyword arguments; ``hang_report``: where a stuck step's report goes;
        ``offload``: every stage's residuals off its device between F and B;
        ``reductions`` (op, dtype, round) and ``uses_value``: what the optimizer programs exchange across stages
        and take from the step (``separable``); ``data_parallel=N``: every stage on N replicas in its actor
        (``programs`` then exported over their mesh, ``replicas.replica_program``)."""
        self.ownership, self.programs = ownership, list(programs)
        self.data_parallel = int(data_parallel)
        self.reductions = [(str(o), str(d), int(r)) for o, d, r in reductions]
        self.uses_value = bool(uses_value)
        self.end = EndOfStep(tuple(ownership.holders), tuple(self.reductions), self.uses_value)
        self.schedule_timeout = float(options.get("schedule_timeout", SCHEDULE_TIMEOUT))
        self.offload = offload
        self.rp = rp = TrainPipeline(
            ownership.artifacts, ownership.stage_params, data_parallel=self.data_parallel, **options
        )
        rp.hang_report = hang_report
        try:
            rp.get([a.setup.remote(self._entries(w, states), self.end) for w, a in enumerate(rp.actors)])
            if self.offload is not None:
                rp.get([a.offload.remote(self.offload) for a in rp.actors])
        except BaseException:
            rp.close()
            raise
        self.worker_of = rp.layout.worker_of()
        self.actor_of = {s: rp.actors[w] for s, w in self.worker_of.items()}
        self.evaluating: set[int] = set()  # the workers whose actors hold their stages' evaluation programs

    def _entries(self, worker: int, states: Sequence[Mapping[str, Leaf] | None]) -> list[StageEntry]:
        """What ``TrainActor.setup`` takes for ``worker``'s stages."""
        own = self.ownership
        return [
            (s, own.names[s], self.programs[s], own.holders[s], own.counted[s], states[s])
            for s in self.rp.layout.workers[worker]
        ]

    @property
    def placement(self) -> list[tuple[jax.Device | str, ...]]:
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
        # One call per actor: its list, then the end of the step with the other actors (TrainActor.train_step).
        lists = rp.start_step(plans, mbs, microbatches, timed, "train_step", (clip,))
        t1 = time.monotonic()
        everyone = list(range(rp.layout.num_workers))
        states = rp.fetch(lists, everyone, t0, hint=RESTORE_HINT, watch=lists)
        t2 = time.monotonic()
        step_time = t2 - t0
        raise_first_error(states)
        sums = {s: v for st in states for s, v in st["sums"].items()}
        totals = [sums[s] for s in range(S)]
        phases = [Phase(None, "hand out", t0, t1), Phase(None, "wait for the workers", t1, t2)]
        phases += [p.shifted(off) for st, off in zip(states, rp.clock_offsets) for p in st["phases"]]
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
        return result, totals

    def evaluate(
        self, mbs: Sequence[Microbatch], programs: Sequence[EvalProgram], outputs: bool
    ) -> tuple[list[float], list[PyTree] | None]:
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
        losses: list[object] = []  # Ray object refs (the stages' eval_op results)
        received: list[object] = []
        for x, side in mbs:
            value: object = x
            for s in range(S):
                if outputs and s == S - 1:
                    received.append(value)  # only then: a reference here keeps its object alive
                value = self.actor_of[s].eval_op.remote(s, value, side_for(side, s, S))
            losses.append(value)
        last = self.worker_of[S - 1]
        refs = [*losses, *(received if S > 1 else [])]
        values: list[object] = rp.fetch(
            refs,  # type: ignore[arg-type]  # refs: Ray's untyped ObjectRefs
            [last] * len(losses) + [self.worker_of[S - 2]] * (len(refs) - len(losses)),
            t0,
        )
        got = [float(np.asarray(v)) for v in values[: len(losses)]]
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

    def workers(self) -> list[object]:
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
        rp.get([rp.actors[w].setup.remote(self._entries(w, [None] * S), self.end) for w in workers])
        if self.offload is not None:
            rp.get([rp.actors[w].offload.remote(self.offload) for w in workers])
        rp.connect()  # every actor sends its results to the new handles from now on
        self.actor_of = {s: rp.actors[w] for s, w in self.worker_of.items()}
        self.evaluating -= set(workers)  # a new actor gets the evaluation programs at its first evaluate

    def close(self) -> None:
        """End the actors (and a Ray instance the Trainer started)."""
        rp = self.rp
        rp.close()
