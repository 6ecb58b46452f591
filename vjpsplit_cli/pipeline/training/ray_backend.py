"""The Trainer on Ray: ``RayBackend`` drives the actors that keep their stages' parameters and optimizer state.

Its actors are ``train_actor.TrainActor``s (a ``TrainPipeline``): each runs the
step's list and then the end of the step with the other actors, in the step's one
call per actor (``train_step``). A round between actors costs one delivery (about
a millisecond on one host, benchmarks/results/2026-history-ray-training-steps.md); a round through the driver cost
two and a wait there. The driver waits once per step, for each actor's report
(the losses, any aux, timings and squared norms). Evaluation (``evaluate``) chains each
microbatch's stage calls actor to actor by object reference; only the losses and
any aux (and, when asked, the last stage's inputs) reach the driver. ``RayOptions``: the
``RayPipeline`` keywords a ``Ray`` runner gives the actors.

``EndOfStep`` and ``TrainActor`` are also importable from here.
"""

from __future__ import annotations

import statistics
import time
from typing import Mapping, Sequence, TypedDict, Unpack

import jax
import numpy as np

from ..runtime.offload import Offload
from ..runtime.evaluation import joined, loss_and_aux
from ..runtime.model import Microbatch, side_for
from ..runtime.ray.actor import raise_first_error
from ..runtime.ray.pipeline import RUNNER, RayPipeline
from ..runtime.ray.setup import SCHEDULE_TIMEOUT
from ..runtime.replicas import check_split
from ..runtime.result import PipelineResult, aux_per_microbatch, step_result
from ..schedules.catalog import describe
from ..schedules.stepplans import Resolved
from ..stages.evalprograms import EvalProgram
from ..schedules.timeline import Phase
from ...artifact.artifact import Artifact
from ...errors import VjpsplitError
from ...treetypes import Leaf, PyTree
from .device_memory import DeviceMemory
from .ownership import Ownership, Snapshot
from .stage_trainer import RESTORE_HINT
from .train_actor import EndOfStep, StageEntry, TrainActor

CLOSE_GRACE = 5.0  # seconds ``close`` gives the actors to end their offload before it ends them


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

    def send_seconds(self, values: Sequence[PyTree], repeats: int) -> list[float]:
        """Per stage boundary ``s -> s + 1``, one actor-to-actor delivery of ``values[s]`` through the senders and
        inboxes a step's results take (``RayPipeline.probe_delivery``): the median of ``repeats`` round trips
        halved; 0 where both stages are on one worker (nothing goes between actors)."""
        out = []
        for s, v in enumerate(values):
            a, b = self.worker_of[s], self.worker_of[s + 1]
            out.append(0.0 if a == b else statistics.median(self.rp.probe_delivery(v, repeats, (a, b))))
        return out

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
        """One step on the actors: the schedule, then each stage's tied sums, squared norm and update.

        ``timed``, ``scales``: see ``Backend.step``.
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
        lists = rp.start_step(plans, mbs, microbatches, timed, "train_step", (clip, scales))
        t1 = time.monotonic()
        everyone = list(range(rp.layout.num_workers))
        if timed:
            states = rp.fetch(lists, everyone, t0, hint=RESTORE_HINT, watch=lists)
        else:  # the reports as frames on the driver's socket where they can (``reports``)
            states = rp.fetch_reports(lists, everyone, t0, hint=RESTORE_HINT)
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
            scales=scales,
            aux=aux_per_microbatch(self.ownership.artifacts[-1], states[self.worker_of[S - 1]]["aux"], microbatches),
        )
        return result, totals

    def evaluate(
        self, mbs: Sequence[Microbatch], programs: Sequence[EvalProgram], outputs: bool
    ) -> tuple[list[float], list[list[np.ndarray]], list[PyTree] | None]:
        """Every stage's forward only on its actor (``Backend.evaluate``): each microbatch's stage calls chained
        by object reference, so activations go actor to actor; the programs go to each actor once."""
        rp, S = self.rp, self.rp.num_stages
        if self.data_parallel > 1:
            check_split(mbs, self.data_parallel)  # before any stage runs, as a step's
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
        for m, (x, side) in enumerate(mbs):
            value: object = x
            for s in range(S):
                if outputs and s == S - 1:
                    received.append(value)  # only then: a reference here keeps its object alive
                value = self.actor_of[s].eval_op.remote(s, value, side_for(side, s, S), m)
            losses.append(value)
        last = self.worker_of[S - 1]
        refs = [*losses, *(received if S > 1 else [])]
        values: list[object] = rp.fetch(
            refs,  # type: ignore[arg-type]  # refs: Ray's untyped ObjectRefs
            [last] * len(losses) + [self.worker_of[S - 2]] * (len(refs) - len(losses)),
            t0,
        )
        got = [loss_and_aux(v) for v in values[: len(losses)]]
        losses_got, aux = [loss for loss, _ in got], [a for _, a in got]
        if not outputs:
            return losses_got, aux, None
        return losses_got, aux, ([joined(v) for v in values[len(losses) :]] if S > 1 else [tuple(x) for x, _ in mbs])

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

    def memory(self) -> list[DeviceMemory]:
        """Per device of each actor that holds a stage, its bytes (``device_memory``), worker by worker."""
        rp = self.rp
        everyone = list(range(rp.layout.num_workers))
        parts = rp.fetch([a.memory.remote() for a in rp.actors], everyone, time.monotonic())
        return [record for part in parts for record in part]

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
        """End the actors (and a Ray instance the Trainer started); with offload, each actor first ends its stages'
        offload, removing the residual files a failed last step left (an actor still busy after ``CLOSE_GRACE``
        seconds, stuck in a step, is ended with them)."""
        rp = self.rp
        if self.offload is not None and rp.actors:
            ended = [a.offload.remote(None) for a in rp.actors]
            rp.ray.wait(ended, num_returns=len(ended), timeout=CLOSE_GRACE)
        rp.close()
