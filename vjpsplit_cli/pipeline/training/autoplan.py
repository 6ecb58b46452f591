"""``schedule="auto"`` for the Trainer: timed first steps, then ``auto_schedule``'s plans for what they measured.

``AutoPlan`` holds the memory limit (microbatches per worker, or bytes per
worker turned into microbatches by the stages' manifests) and decides, step by
step, what runs:

1. The first step runs the best built-in schedule that fits the limit and times
   every stage's W: ZB-H1 where every stage has the split backward, 1F1B where
   none has it; otherwise, or where neither fits the limit, ``auto_schedule``'s
   plans for equal costs (F = B = W), which split exactly the stages that can.
   The backend runs it as a timed step (``timed=True``).
2. From its timeline (``measured.CostSamples``) every stage's F, B and W and the
   send time; ``auto_schedule`` plans for them within the limit. Where the
   measuring step's own plans are faster under those costs, they stay.
3. The second step runs those plans, timed too: a first step is the first run
   of every call, slower than the steps after it even with its compiling left
   out (``measured``). ``auto_schedule`` plans again for the second step's costs.
4. Every following step runs those plans, untimed; a ``step(batch, timed=True)``
   adds its times to the kept ones and auto plans again. The history records
   which schedule ran and its modeled makespan under the measured costs
   (seconds); ``measuring`` marks the two timed steps.

A limit in bytes counts what a worker holds per microbatch in flight from its
stage's manifest: the stored residuals from F until B (the "residuals" column of
``vjpsplit inspect DIR``), or, between a split B and its W, the stored residuals
W reads plus the intermediates B hands it, whichever is larger; symbolic dims
sized by the actual microbatch. Parameters, optimizer state and the stage's
inputs (the activation it received, which the backward reads in place) are not
counted.
"""

from __future__ import annotations

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
from ..schedules.layout import Layout
from ..schedules.modeled import memory_limits, modeled_makespan
from ..schedules.ops import Op
from ..schedules.stepplans import Resolved, check_plans
from .measured import MeasuredCosts

AUTO = "auto"
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
        if m.weights:
            w_part = sum(stored[k] for k in m.weight_residuals) + sum(_leaf_bytes(c, dims, s) for c in m.intermediates)
            held = max(held, w_part)
        out.append(held)
    return out


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
    """What an ``auto`` Trainer runs: a timed measuring step, then ``auto_schedule``'s plans for its costs."""

    def __init__(
        self,
        artifacts: Sequence[Artifact],
        microbatches: int,
        memory_limit: int | Sequence[int] | None,
        memory_limit_bytes: int | str | Sequence[int | str] | None,
    ):
        self.artifacts = list(artifacts)
        S = self.num_stages = len(self.artifacts)
        self.microbatches = microbatches
        if memory_limit is not None and memory_limit_bytes is not None:
            raise VjpsplitError("give memory_limit (microbatches) or memory_limit_bytes, not both")
        self.memory_limit, self.memory_limit_bytes = memory_limit, memory_limit_bytes
        self.limits: tuple[int, ...] | None = None
        if memory_limit_bytes is None:
            self.limits = memory_limits(memory_limit, S, microbatches)  # a bad limit is refused now
            self.byte_limits: list[int] = []
        else:
            self.byte_limits = [parse_bytes(v) for v in _per_worker(memory_limit_bytes, S, "memory_limit_bytes")]
        self.split = [bool(a.manifest.weights) for a in self.artifacts]
        self.layout = Layout.of_schedule("1f1b", S)  # worker w runs stage w
        self.plans: list[list[Op]] | None = None  # auto's plans, once measured
        self.makespan: float | None = None
        self.measured_with: Resolved | None = None
        self.steps_timed = 0
        self.held: list[int] | None = None  # per stage, one microbatch's bytes (a limit in bytes)
        self.offloaded: frozenset[tuple[int, int]] = frozenset()  # what auto's plans offload (a limit in bytes)

    @property
    def offload(self) -> Offload | None:
        """The offload auto's plans run (to host memory, only the pairs they name), or None where they need none."""
        return Offload(pairs=self.offloaded) if self.offloaded else None

    @property
    def current(self) -> Resolved:
        """The Trainer's plan: named ``auto``, its plans once measured (none before)."""
        return Resolved(AUTO, self.plans or [], self.layout)

    def next_step(self, mbs: Sequence[Microbatch]) -> tuple[Resolved, bool]:
        """What the next step runs on ``mbs``, and whether it is the timed measuring step."""
        if self.plans is None:
            return self.measuring(mbs[0]), True
        return self.current, self.steps_timed < MEASURING_STEPS

    def after(self, ran: Resolved, costs: Callable[[], MeasuredCosts], timed: bool) -> tuple[str, float | None, bool]:
        """The history's entries for the step that ran ``ran``: its schedule, ``modeled_makespan`` (seconds,
        under the measured costs) and whether it was a measuring step. After a timed step (the first, or
        ``step(batch, timed=True)``) auto plans again for the costs ``costs()`` gives (medians over the timed
        steps kept)."""
        if not timed:
            return AUTO, self.makespan, False
        measuring, measured = self.steps_timed < MEASURING_STEPS, costs()
        self.steps_timed += 1
        row = ran.name, modeled_makespan(ran.plans, measured), measuring
        self.choose(measured)
        return row

    def limits_for(self, mb: Microbatch) -> tuple[int, ...]:
        """Per worker, the most microbatches it may hold: the limit given, or bytes over what one microbatch holds."""
        if self.limits is None:
            held = self.held = microbatch_bytes(self.artifacts, mb)
            counts = []
            for s, (limit, b) in enumerate(zip(self.byte_limits, held)):
                if b > limit:
                    raise VjpsplitError(
                        f"memory_limit_bytes={limit} ({human_bytes(limit)}) on worker {s}: one microbatch of stage {s} "
                        f"holds {b} bytes ({human_bytes(b)}) at the end of its F, offloaded or not; no plan fits. The "
                        f"smallest limit that fits is {b} bytes on worker {s} ({held} per worker), or give more "
                        "(smaller) microbatches"
                    )
                counts.append(self.microbatches if b == 0 else min(self.microbatches, limit // b))
            self.limits = tuple(counts)
        return self.limits

    def measuring(self, mb: Microbatch) -> Resolved:
        """The first step's schedule: the best built-in that fits and times every W, else auto for equal costs."""
        S, m = self.num_stages, self.microbatches
        limits = self.limits_for(mb)
        fits = built_in_candidates(S, m, limits, self.split)
        name = "zbh1" if all(self.split) else ("1f1b" if not any(self.split) else None)
        if name in fits:
            plans = schedule(name, S, m)
        else:
            name, plans = AUTO, auto_schedule(self.artifacts, m, costs=UNIT_COSTS, memory_limit=list(limits))
        self.measured_with = Resolved(name, plans, self.layout)
        return self.measured_with

    def choose(self, costs: MeasuredCosts) -> None:
        """``auto_schedule``'s plans for the measured ``costs`` within the limit (the measuring plans if faster)."""
        assert self.limits is not None and self.measured_with is not None  # the measuring step ran
        offloaded: frozenset[tuple[int, int]] = frozenset()
        if self.held is not None:  # a limit in bytes: auto may offload where that ends sooner
            c = Costs.of(costs, self.num_stages)
            planned = auto_schedule(
                self.artifacts,
                self.microbatches,
                costs=costs,
                memory_limit_bytes=self.byte_limits,
                microbatch_bytes=self.held,
            )
            offloaded = planned.offloaded  # type: ignore[attr-defined]
            plans: list[list[Op]] = [list(ops) for ops in planned]
            span = offload_makespan(plans, c, self.held, offloaded, c.transfer)
        else:
            plans = auto_schedule(self.artifacts, self.microbatches, costs=costs, memory_limit=list(self.limits))
            span = modeled_makespan(plans, costs)
        theirs = modeled_makespan(self.measured_with.plans, costs)
        if theirs < span:
            plans, span, offloaded = self.measured_with.plans, theirs, frozenset()
        check_plans(plans, self.num_stages, self.microbatches)
        self.plans, self.makespan, self.offloaded = plans, span, offloaded

    def record(self) -> dict[str, object]:
        """What a checkpoint records to go on: the limit as given (``restore`` measures again)."""
        return {"memory_limit": self.memory_limit, "memory_limit_bytes": self.memory_limit_bytes}
