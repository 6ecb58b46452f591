"""``schedule="auto"`` for the Trainer: timed first steps, ``auto_schedule``'s plans for what they measured, then
trial steps that keep whichever of the plans the model rates close runs fastest.

``AutoPlan`` holds the memory limit (microbatches per worker, or bytes per
worker turned into microbatches by the stages' manifests) and decides, step by
step, what runs:

1. The first step runs the best built-in schedule that fits the limit and times
   every stage's W: ZB-H1 where every stage has the split backward, 1F1B where
   none has it; otherwise, or where neither fits the limit, ``auto_schedule``'s
   plans for equal costs (F = B = W), which split exactly the stages that can.
   The backend runs it as a timed step (``timed=True``).
2. From its timeline (``measured.CostSamples``) every stage's F, B and W, and the
   send time measured apart; the candidates (``candidates``): ``auto_schedule``'s
   plans for them within the limit, the same held to 1F1B's microbatches in
   flight, every built-in that fits and the measuring step's plans. The one the
   model rates fastest runs the second step, timed too: a first step is the
   first run of every call, slower than the steps after it even with its
   compiling left out (``measured``).
3. After the second step the candidates are planned again for its costs, and
   1F1B and ZB-H1 (where they fit) and those the model rates within
   ``trials.MARGIN`` of the best race (``trials``):
   each runs ``trial_rounds`` whole steps (default 3), interleaved, those within
   the clock's noise of the fastest up to ``trials.MOST_ROUNDS`` times as many, and
   the one whose median step took least time is kept. The model holds an operation's
   time fixed whatever the plan; on real devices it is not (plans with more
   microbatches in flight slowed each operation by 7-14% on the CPU host of
   docs/performance.md), so the clock decides between plans the model cannot
   tell apart. Trial steps train like any other.
4. Every following step runs the plans kept, untimed; a ``step(batch, timed=True)``
   adds its times to the kept ones and auto plans again: plans no race ran yet
   that the model rates near the best race the kept ones. The history records
   which schedule ran (``"auto"`` from the second step) and its modeled makespan
   under the measured costs (seconds); ``measuring`` marks the timed first
   steps, ``trial`` names the candidate a trial step ran.

A limit in bytes counts what a worker holds per microbatch in flight from its
stage's manifest: the stored residuals from F until B (the "residuals" column of
``vjpsplit inspect DIR``), or, between a split B and its W, the stored residuals
W reads plus the intermediates B hands it, whichever is larger; symbolic dims
sized by the actual microbatch. Parameters, optimizer state and the stage's
inputs (the activation it received, which the backward reads in place) are not
counted.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Callable, Sequence, cast

import jax
import numpy as np

from ...artifact.artifact import Artifact
from ...artifact.leaf import Leaf as ManifestLeaf
from ...errors import VjpsplitError
from ...files import keys
from ...files.dtypes import dtype_from_name
from ...files.dims import solve_shapes
from ...files.shapes import bind_dims, concrete_shape
from ...files.sizes import human_bytes, parse_bytes
from ..runtime.model import Microbatch, side_for
from ..runtime.offload import Offload
from ..schedules.auto import auto_schedule, built_in_candidates
from ..schedules.costs import Costs
from ..schedules.offloading import offload_makespan
from ..schedules.builtins import schedule
from ..schedules.catalog import AUTO
from ..schedules.layout import Layout
from ..schedules.modeled import memory_limits, memory_peaks, modeled_makespan
from ..schedules.ops import Op
from ..schedules.stepplans import Resolved, check_plans
from .measured import MeasuredCosts
from .trials import TRIAL_ROUNDS, Candidate, Trial, contenders

AS_1F1B = "auto, 1f1b's memory"  # auto_schedule's plans held to the microbatches 1F1B keeps in flight
EQUAL_COSTS = "auto, equal costs"  # the measuring step's plans where no built-in fit: auto_schedule's for F = B = W
MEASURING_STEPS = 2  # the timed steps an auto Trainer starts with: the first measures, the second again
UNIT_COSTS = {"F": 1.0, "B": 1.0, "W": 1.0}  # what the measuring step's plans assume, before anything is measured
BYTES_UNSIZED = "memory_limit_bytes cannot count it: give Schedule('auto', memory_limit=...) in microbatches instead"


def _shape(leaf: ManifestLeaf, dims: dict[str, int], stage: int, unsized: str = BYTES_UNSIZED) -> tuple[int, ...]:
    shape = concrete_shape(leaf.shape, dims)
    if shape is None:
        raise VjpsplitError(
            f"stage {stage}'s leaf '{leaf.key}' {list(leaf.shape)} has a dim the batch does not size; {unsized}"
        )
    return shape


def _leaf_bytes(leaf: ManifestLeaf, dims: dict[str, int], stage: int) -> int:
    return int(np.prod(_shape(leaf, dims, stage), dtype=np.int64)) * dtype_from_name(leaf.dtype).itemsize


def _bind(stage: int, leaves: Sequence[ManifestLeaf], shapes: Sequence[tuple[int, ...]], dims: dict[str, int]) -> None:
    dims.update(
        solve_shapes([(f"stage {stage}: input '{leaf.key}'", leaf.shape, s) for leaf, s in zip(leaves, shapes)])
    )
    for leaf, shape in zip(leaves, shapes):
        if not bind_dims(f"stage {stage}: input '{leaf.key}'", leaf.shape, shape, dims):
            raise VjpsplitError(
                f"stage {stage}: input '{leaf.key}' is {list(shape)}, its manifest says {list(leaf.shape)}"
            )


def _stage_dims(artifacts: Sequence[Artifact], mb: Microbatch, unsized: str) -> list[dict[str, int]]:
    """Per stage, its symbolic dims sized by microbatch ``mb``: from the microbatch's arrays and, stage by stage,
    from the shapes each stage's outputs take (what the next stage receives)."""
    x, side = mb
    S, out = len(artifacts), []
    sent: list[tuple[int, ...]] = []
    for s, art in enumerate(artifacts):
        m = art.manifest
        given = [
            tuple(np.shape(v))
            for v in jax.tree_util.tree_leaves((x, *side_for(side, 0, S)) if s == 0 else side_for(side, s, S))
        ]
        inputs = [leaf for leaf in m.inputs if keys.arg_of(leaf.key) != m.arg_names[0]]
        dims: dict[str, int] = {}
        _bind(s, inputs, given if s == 0 else [*sent, *given], dims)
        out.append(dims)
        sent = [_shape(o, dims, s, unsized) for o in _sent_leaves(art)]
    return out


def _sent_leaves(art: Artifact) -> list[ManifestLeaf]:
    """What stage ``art`` sends the next stage: its forward's outputs the next stage reads."""
    return [o for o in art.manifest.outputs if o.key in art.manifest.out_keys]


def microbatch_bytes(artifacts: Sequence[Artifact], mb: Microbatch) -> list[int]:
    """Per stage, the bytes one microbatch ``mb`` in flight holds (see the module docstring); symbolic dims sized
    by the microbatch (``_stage_dims``)."""
    out = []
    for s, (art, dims) in enumerate(zip(artifacts, _stage_dims(artifacts, mb, BYTES_UNSIZED))):
        m = art.manifest
        stored = {r.key: _leaf_bytes(r, dims, s) for r in m.stored_residuals}
        held = sum(stored.values())
        if m.splits_backward:
            w_part = sum(stored[k] for k in m.weight_residuals) + sum(_leaf_bytes(c, dims, s) for c in m.intermediates)
            held = max(held, w_part)
        out.append(held)
    return out


def microbatch_shapes(mb: Microbatch) -> tuple[tuple[int, ...], ...]:
    """The shapes of microbatch ``mb``'s batch leaves (stage 0's input and every stage's side inputs), in order."""
    x, side = mb
    sides = [side[s] for s in sorted(side)] if isinstance(side, dict) else list(side)
    return tuple(tuple(np.shape(v)) for v in jax.tree_util.tree_leaves((x, sides)))


def _most_bytes(artifacts: Sequence[Artifact], mbs: Sequence[Microbatch]) -> list[int]:
    """Per stage, the most bytes one of ``mbs`` in flight holds (``microbatch_bytes``), each shape counted once."""
    distinct = {microbatch_shapes(mb): mb for mb in mbs}
    per = [microbatch_bytes(artifacts, mb) for mb in distinct.values()]
    return [max(col) for col in zip(*per)]


def boundary_values(artifacts: Sequence[Artifact], mb: Microbatch) -> list[list[np.ndarray]] | None:
    """Per stage boundary ``s -> s + 1``, host zeros shaped as what stage ``s`` sends for microbatch ``mb`` (its
    backward sends a cotangent of the same shapes back): what a send-time probe delivers. None where a dim of
    what is sent is one the microbatch does not size."""
    try:
        dims = _stage_dims(artifacts, mb, "")
    except VjpsplitError:
        return None
    return [
        [np.zeros(_shape(o, d, s), dtype_from_name(o.dtype)) for o in _sent_leaves(art)]
        for s, (art, d) in enumerate(zip(artifacts[:-1], dims))
    ]


def _per_worker(value: int | str | Sequence[int | str], n: int, what: str) -> list[int | str]:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise VjpsplitError(f"{what} must be one value or one per worker ({n}), not {len(value)} values")
        return list(value)
    return [cast("int | str", value)] * n  # one value for every worker (a list or tuple gives one each)


class AutoPlan:
    """What an ``auto`` Trainer runs: timed measuring steps, trial steps, then the plans that ran fastest."""

    def __init__(
        self,
        artifacts: Sequence[Artifact],
        microbatches: int,
        memory_limit: int | Sequence[int] | None,
        memory_limit_bytes: int | str | Sequence[int | str] | None,
        trial_rounds: int | None = None,
        every_step_timed: bool = False,
    ):
        self.artifacts = list(artifacts)
        S = self.num_stages = len(self.artifacts)
        self.microbatches = microbatches
        if memory_limit is not None and memory_limit_bytes is not None:
            raise VjpsplitError("give memory_limit (microbatches) or memory_limit_bytes, not both")
        self.memory_limit, self.memory_limit_bytes = memory_limit, memory_limit_bytes
        self.trial_rounds = trial_rounds
        self.rounds = TRIAL_ROUNDS if trial_rounds is None else trial_rounds
        # A race compares steps of the kind the Trainer runs: untimed ones, or timed ones where it times every step.
        self.every_step_timed = every_step_timed
        self.limits: tuple[int, ...] | None = None
        if memory_limit_bytes is None:
            self.limits = memory_limits(memory_limit, S, microbatches)  # a bad limit is refused now
            self.byte_limits: list[int] = []
        else:
            self.byte_limits = [parse_bytes(v) for v in _per_worker(memory_limit_bytes, S, "memory_limit_bytes")]
        self.split = [a.manifest.splits_backward for a in self.artifacts]
        self.layout = Layout.of_schedule("1f1b", S)  # worker w runs stage w
        self.plans: list[list[Op]] | None = None  # what the next step runs, once measured
        self.makespan: float | None = None  # ... its modeled makespan under the latest costs, seconds
        self.offloaded: frozenset[tuple[int, int]] = frozenset()  # ... what it offloads (a limit in bytes)
        self.measured_with: Resolved | None = None
        self.steps_timed = 0
        self.held: list[int] | None = None  # per stage, one microbatch's bytes (a limit in bytes)
        self.chosen: Candidate | None = None  # what auto runs outside a race: the model's best, then a race's winner
        self.trial: Trial | None = None  # the race under way
        self.raced: set[object] = set()  # the candidates' keys every race so far ran
        self.races: list[dict[str, float]] = []  # per race, each candidate's median step seconds
        self.shapes_seen: set[tuple[tuple[int, ...], ...]] = set()  # every microbatch's leaf shapes so far
        self.fresh = False  # the step under way has a microbatch of shapes no step had (its calls compile)
        self.warned = False  # a microbatch held more bytes than the byte limits were worked out for (said once)

    @property
    def offload(self) -> Offload | None:
        """The offload the next step's plans run (to host memory, only the pairs they name), or None."""
        return Offload(pairs=self.offloaded) if self.offloaded else None

    @property
    def no_offload_reason(self) -> str | None:
        """Why the next step's plans offload nothing, in words; None where they offload."""
        if self.offloaded:
            return None
        if self.memory_limit_bytes is None:
            return "auto offloads only within memory_limit_bytes; this limit counts microbatches (memory_limit)"
        if self.plans is None:
            return "auto plans from the first step's measured costs: no plan yet"
        own = getattr(self, "planned_reason", None) or "auto_schedule's plans offload nothing"
        running = self.chosen if self.trial is None else self.trial.candidates[self.trial.running]
        if running is not None and running.name != AUTO:
            how = "on a trial step" if self.trial is not None else "kept"
            return f"auto runs the plans of {running.name!r} ({how}), which offload nothing; its own: {own}"
        return own

    @property
    def current(self) -> Resolved:
        """The Trainer's plan: named ``auto``, the plans the next step runs once measured (none before)."""
        return Resolved(AUTO, self.plans or [], self.layout)

    @property
    def choice(self) -> str | None:
        """Which plans auto keeps: ``"auto"`` (``auto_schedule``'s), ``"auto, 1f1b's memory"`` or a built-in's
        name; None before the first plan."""
        return None if self.chosen is None else self.chosen.name

    def next_step(self, mbs: Sequence[Microbatch]) -> tuple[Resolved, bool]:
        """What the next step runs on ``mbs`` (a trial step too, as ``"auto"``), and whether it is a timed
        measuring step. Notes whether some microbatch has shapes no step had before (``fresh``: its calls
        compile in this step); under a byte limit, warns once where such a microbatch holds more than the
        limits were worked out for."""
        shapes = {microbatch_shapes(mb) for mb in mbs}
        self.fresh = not shapes <= self.shapes_seen
        self.shapes_seen |= shapes
        if self.plans is None:
            return self.measuring(*mbs), True
        if self.fresh and self.held is not None and not self.warned:
            self._check_held(mbs)
        return self.current, self.steps_timed < MEASURING_STEPS

    def _check_held(self, mbs: Sequence[Microbatch]) -> None:
        """Warn where a microbatch of ``mbs`` holds more bytes on some stage than the limits were worked out for."""
        assert self.held is not None  # a limit in bytes, worked out at the first step
        now = _most_bytes(self.artifacts, mbs)
        over = [s for s, (b, h) in enumerate(zip(now, self.held)) if b > h]
        if over:
            self.warned = True
            s = over[0]
            warnings.warn(
                f"memory_limit_bytes: a microbatch of this step holds {now[s]} bytes ({human_bytes(now[s])}) on stage "
                f"{s}, more than the {self.held[s]} of the first step's largest, which auto's plans were held to; "
                "they may pass the limit: give the first step the largest microbatches, or a limit in microbatches "
                "(memory_limit=)",
                UserWarning,
                stacklevel=4,
            )

    def after(
        self, ran: Resolved, costs: Callable[[], MeasuredCosts], timed: bool, seconds: float
    ) -> tuple[str, float | None, bool, str | None]:
        """The history's entries for the step that ran ``ran`` in ``seconds``: its schedule, its modeled makespan
        (seconds, under the measured costs), whether it was a timed measuring step, and on a trial step the
        candidate it ran. A trial step counts toward its race where it is of the kind the Trainer runs
        (untimed, or timed where every step is). After a timed step outside a race, auto plans again for the
        costs ``costs()`` gives (medians over the timed steps kept): the model's best until the measuring steps
        are done, then a race where it plans something not raced before."""
        trial = self.trial
        name = None if trial is None else trial.candidates[trial.running].name
        if timed:
            measured = costs()
            measuring = self.steps_timed < MEASURING_STEPS
            self.steps_timed += 1
            row: tuple[str, float | None, bool, str | None] = (
                ran.name,
                modeled_makespan(ran.plans, measured),
                measuring,
                name,
            )
        else:
            row = ran.name, self.makespan, False, name
        if trial is not None:
            if timed == self.every_step_timed and not self.fresh:  # a step that compiled is run again
                trial.add(trial.running, seconds)
            if trial.done:
                self.chosen, self.trial = trial.winner(), None
                self.races.append({c.name: m for c, m in zip(trial.candidates, trial.medians())})
        elif timed:
            self.plan_again(measured)
        self._next()
        return row

    def limits_for(self, *mbs: Microbatch) -> tuple[int, ...]:
        """Per worker, the most microbatches it may hold: the limit given, or bytes over what one microbatch holds
        (the largest of ``mbs`` on each stage)."""
        if self.limits is None:
            held = self.held = _most_bytes(self.artifacts, mbs)
            counts = []
            for s, (limit, b) in enumerate(zip(self.byte_limits, held)):
                if b > limit:
                    raise VjpsplitError(
                        f"memory_limit_bytes={limit} ({human_bytes(limit)}) on worker {s}: one microbatch of stage {s} "
                        f"holds {b} bytes ({human_bytes(b)}) at the end of its F, offloaded or not; no plan fits. The "
                        f"smallest limit that fits every worker is memory_limit_bytes={max(held)} "
                        f"({human_bytes(max(held))}); per worker, memory_limit_bytes={held} fits; or give more "
                        "(smaller) microbatches"
                    )
                counts.append(self.microbatches if b == 0 else min(self.microbatches, limit // b))
            self.limits = tuple(counts)
        return self.limits

    def measuring(self, *mbs: Microbatch) -> Resolved:
        """The first step's schedule: the best built-in that fits and times every W, else auto for equal costs
        (a byte limit counted for the largest of ``mbs``)."""
        S, m = self.num_stages, self.microbatches
        limits = self.limits_for(*mbs)
        fits = built_in_candidates(S, m, limits, self.split)
        name = "zbh1" if all(self.split) else ("1f1b" if not any(self.split) else None)
        if name in fits:
            plans = schedule(name, S, m)
        else:
            name, plans = AUTO, auto_schedule(self.artifacts, m, costs=UNIT_COSTS, memory_limit=list(limits))
        self.measured_with = Resolved(name, plans, self.layout)
        return self.measured_with

    def candidates(self, costs: MeasuredCosts) -> list[Candidate]:
        """The plans auto may keep for the measured ``costs``, within the limit, each with its modeled makespan:
        ``auto_schedule``'s (under a byte limit, with the offload it plans), ``auto_schedule``'s held to 1F1B's
        microbatches in flight, every built-in that fits, and the measuring step's plans (named ``EQUAL_COSTS``
        where they were auto's for equal costs). Plans twice: up to 0.7 s each on 8 stages and 64 microbatches."""
        assert self.limits is not None and self.measured_with is not None  # the measuring step ran
        S, m = self.num_stages, self.microbatches
        out = []
        if self.held is not None:  # a limit in bytes: auto may offload where that ends sooner
            planned = auto_schedule(
                self.artifacts, m, costs=costs, memory_limit_bytes=self.byte_limits, microbatch_bytes=self.held
            )
            offloaded: frozenset[tuple[int, int]] = planned.offloaded  # type: ignore[attr-defined]
            self.planned_reason: str | None = planned.reason  # type: ignore[attr-defined]
            plans = [list(ops) for ops in planned]
            out.append(Candidate(AUTO, plans, offloaded, self.modeled(plans, offloaded, costs)))
        else:
            plans = auto_schedule(self.artifacts, m, costs=costs, memory_limit=list(self.limits))
            out.append(Candidate(AUTO, plans, frozenset(), modeled_makespan(plans, costs)))
        as_1f1b = [min(n, p) for n, p in zip(self.limits, memory_peaks(schedule("1f1b", S, m)))]
        if as_1f1b != list(self.limits):
            plans = auto_schedule(self.artifacts, m, costs=costs, memory_limit=as_1f1b)
            out.append(Candidate(AS_1F1B, plans, frozenset(), modeled_makespan(plans, costs)))
        for name, plans in built_in_candidates(S, m, self.limits, self.split).items():
            out.append(Candidate(name, plans, frozenset(), modeled_makespan(plans, costs)))
        ran = self.measured_with  # a built-in (then the same plans as its candidate above), or auto's for equal costs
        name = EQUAL_COSTS if ran.name == AUTO else ran.name
        out.append(Candidate(name, ran.plans, frozenset(), modeled_makespan(ran.plans, costs)))
        for c in out:
            check_plans(c.plans, S, m)
        return out

    def modeled(self, plans: list[list[Op]], offloaded: frozenset[tuple[int, int]], costs: MeasuredCosts) -> float:
        """``plans``' modeled makespan under ``costs``, their offload's copies included."""
        if not offloaded:
            return modeled_makespan(plans, costs)
        assert self.held is not None  # only plans under a byte limit offload
        c = Costs.of(costs, self.num_stages)
        return offload_makespan(plans, c, self.held, offloaded, c.transfer)

    def plan_again(self, costs: MeasuredCosts) -> None:
        """Plan for the measured ``costs``: while measuring (or with no trial rounds), the model's best
        candidate; after, a race between the candidates modeled near the best that no race ran yet and the
        plans kept (``trials``); with none new, the plans kept stay."""
        field = contenders(self.candidates(costs))
        if self.steps_timed < MEASURING_STEPS or self.rounds == 0:
            self.chosen = field[0]
            return
        if self.raced:
            kept = self.chosen
            assert kept is not None  # a race kept one
            kept = dataclasses.replace(kept, modeled=self.modeled(kept.plans, kept.offloaded, costs))
            field = [kept, *(c for c in field if c.key not in self.raced and c.key != kept.key)]
        self.raced.update(c.key for c in field)
        if len(field) == 1:
            self.chosen = field[0]
        else:
            self.trial = Trial(field, self.rounds)

    def _next(self) -> None:
        """Point ``plans``, ``makespan`` and ``offloaded`` at what the next step runs: the race's candidate, or
        the plans kept."""
        running = self.chosen if self.trial is None else self.trial.candidates[self.trial.running]
        assert running is not None  # planned after the first step
        self.plans, self.makespan, self.offloaded = running.plans, running.modeled, running.offloaded

    def record(self) -> dict[str, object]:
        """What a checkpoint records to go on: the limit and trial rounds as given (``restore`` measures again)."""
        return {
            "memory_limit": self.memory_limit,
            "memory_limit_bytes": self.memory_limit_bytes,
            "trial_rounds": self.trial_rounds,
        }
