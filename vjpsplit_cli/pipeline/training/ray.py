"""The Trainer on Ray: actors that keep their stages' parameters and optimizer state and apply the update there.

``TrainActor`` extends the pipeline's ``StageActor`` with the step's last three
phases (``trainstage``): its stages' tied gradients, their sums and squared
norms, the update. The driver submits them to each actor right after the
schedule's operations, so an actor runs them after its last W (Ray runs an
actor's calls in submission order); tied gradients go from actor to actor as
object references, and only the squared norms (when clipping needs their sum),
the loss and the timings reach the driver. The optimizer arrives as exported
bytes: an actor imports neither optax nor the user's code.
"""

from __future__ import annotations

import time
from typing import Any, Mapping, Sequence

import numpy as np

from ...errors import VjpsplitError
from .clipping import clip_scale
from ..runtime.dispatch import PreSplit, walk
from ..schedules.plans import describe, resolve, split_ops
from ..runtime.ray.actor import StageActor, picklable
from ..runtime.ray.pipeline import RayPipeline
from ..schedules.timeline import PipelineResult
from .stagestate import StageTrainer


class TrainActor(StageActor):
    """A pipeline worker's actor that also trains: one ``StageTrainer`` per stage it holds."""

    def setup(self, entries) -> None:
        """``(stage, names, optimizer bytes, holders, counted, state or None)`` per stage this actor holds."""
        self.trainers = {
            c: StageTrainer(self.stages[c], names, program, holders, counted, state)
            for c, names, program, holders, counted, state in entries
        }

    def _guarded(self, fn):
        if self.error is not None:
            return None
        try:
            return fn()
        except BaseException as e:  # noqa: BLE001 - handed to the driver by report()
            self.error = picklable(e)
            return None

    def tied(self, chunk: int):
        """Stage ``chunk``'s gradients of its tied leaves (host arrays); None after an error."""
        return self._guarded(lambda: self.trainers[chunk].tied_grads())

    def prepare(self, chunk: int, sources: Sequence[int], *parts):
        """Sum stage ``chunk``'s tied gradients with ``parts`` (the ``tied`` of stages ``sources``); its squared norm."""
        if any(p is None for p in parts):
            return None  # another stage failed: its report says why
        return self._guarded(lambda: self.trainers[chunk].prepare(dict(zip(sources, parts))))

    def apply(self, chunk: int, scale: float) -> None:
        """The optimizer step of stage ``chunk`` with the clip ``scale``."""
        self._guarded(lambda: self.trainers[chunk].apply(scale))

    def report(self) -> dict:
        """The step's losses, timings (this process's clock) and first error; no arrays."""
        return {
            "losses": {m: v for st in self.stages.values() for m, v in st.losses.items()},
            "events": [e for st in self.stages.values() for e in st.events],
            "error": self.error,
        }

    def snapshot(self) -> dict:
        """Per stage held: ``(params, optimizer state)`` as host arrays."""
        return {c: t.snapshot() for c, t in self.trainers.items()}


class TrainPipeline(RayPipeline):
    """A ``RayPipeline`` whose actors are ``TrainActor``s."""

    actor_class = TrainActor


class RayBackend:
    """The Trainer's workers as Ray actors (``RayPipeline``'s placement, timeouts and dead-actor reports)."""

    def __init__(self, plan, programs: Sequence[bytes], states: Sequence, **options):
        """``plan``: the Trainer's ``Layout``; ``options``: ``RayPipeline``'s keyword arguments."""
        self.layout = layout = plan
        self.step_timeout = options["step_timeout"]
        self.rp = TrainPipeline(layout.artifacts, layout.stage_params, **options)
        rp = self.rp
        try:
            rp._get(
                [
                    a.setup.remote(
                        [
                            (c, layout.names[c], programs[c], layout.holders[c], layout.counted[c], states[c])
                            for c in chunks
                        ]
                    )
                    for a, chunks in zip(rp.actors, rp.placement)
                ]
            )
        except BaseException:
            rp.close()
            raise
        self.actor_of = {c: rp.actors[w] for w, chunks in enumerate(rp.placement) for c in chunks}
        self.worker_of = {c: w for w, chunks in enumerate(rp.placement) for c in chunks}

    def _wait(self, refs: Mapping[Any, int], t0: float) -> list:
        """The values of ``refs`` (ref -> worker), within what is left of ``step_timeout``; one error naming a stage."""
        ray, rp = self.rp.ray, self.rp
        order = list(refs)
        left = max(t0 + self.step_timeout - time.monotonic(), 0)
        _, pending = ray.wait(order, num_returns=len(order), timeout=left, fetch_local=False)
        if pending:
            late = sorted({refs[r] for r in pending})
            raise VjpsplitError(
                f"{rp._name(late[0])}: the step did not finish within step_timeout={self.step_timeout:g} s; "
                "restore the last checkpoint into a new Trainer to run again"
            )
        return rp._get(order)

    def step(self, mbs: PreSplit, schedule_name: str, schedule, microbatches: int, clip, progress: bool):
        """One step on the actors: the schedule, then each stage's tied sums, squared norm and update."""
        rp, S = self.rp, self.rp.stages
        name, plans, where = resolve(schedule_name, schedule, S, microbatches)
        if [tuple(w) for w in where] != [tuple(w) for w in rp.placement]:
            raise VjpsplitError(
                f"{describe(name)} places the stages as {where}; this Trainer's actors hold {rp.placement}"
            )
        split = split_ops(plans)
        rp._get([a.reset.remote() for a in rp.actors])
        t0 = time.monotonic()

        def submit(w, op, data, side_):
            return rp.actors[w].op.remote(
                op.kind, op.chunk, op.mb, data, side_, microbatches, (op.chunk, op.mb) in split
            )

        walk(plans, S, mbs.mbs, submit)
        holders = self.layout.holders
        tied = {c: self.actor_of[c].tied.remote(c) for c in range(S) if holders[c]}
        sums = []
        for c in range(S):
            sources = sorted({s for hs in holders[c].values() for s in hs if s != c})
            sums.append(self.actor_of[c].prepare.remote(c, sources, *[tied[s] for s in sources]))
        scale = 1.0
        if clip is not None:
            got = self._wait({r: self.worker_of[c] for c, r in enumerate(sums)}, t0)
            if all(v is not None for v in got):
                scale = clip_scale(got, clip)[0]
        applied = [self.actor_of[c].apply.remote(c, scale) for c in range(S)]
        reports = [a.report.remote() for a in rp.actors]
        refs = {r: w for w, r in enumerate(reports)}
        refs.update({r: self.worker_of[c] for c, r in enumerate(sums)})
        refs.update({r: self.worker_of[c] for c, r in enumerate(applied)})
        values = self._wait(refs, t0)
        step_time = time.monotonic() - t0
        states = values[: len(reports)]
        failed = [st["error"] for st in states if st["error"] is not None]
        if failed:
            raise failed[0]
        totals = values[len(reports) : len(reports) + S]
        losses = states[self.worker_of[S - 1]]["losses"]
        events = [e.shifted(off) for st, off in zip(states, rp.clock_offsets) for e in st["events"]]
        result = PipelineResult(
            name,
            float(np.mean([losses[m] for m in range(microbatches)])),
            [None] * S,
            sorted(events, key=lambda e: e.start),
            S,
            microbatches,
            "ray",
            step_time,
            {"compiled": False},
            plans,
        )
        return result, list(totals)

    def snapshots(self) -> list[tuple[dict, dict]]:
        """Every stage's ``(params, optimizer state)``, fetched from its actor."""
        got: dict[int, tuple] = {}
        for part in self.rp._get([a.snapshot.remote() for a in self.rp.actors], self.step_timeout):
            got.update(part)
        return [got[c] for c in range(self.rp.stages)]

    def close(self) -> None:
        """End the actors (and a Ray instance the Trainer started)."""
        self.rp.close()
