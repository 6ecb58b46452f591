"""The cost model automatic schedules are planned under: per-stage F, B, W and send times, memory, bounds.

``Costs`` holds, per stage, the time of its forward (F), of its backward's input part
(B) and of its weight part (W), and ``comm``, the time of one send between two
workers. A whole backward (a B with no W after it in the plans) costs B + W. A
worker holds a microbatch of a stage from its F until its W (or its whole B); the
most it holds at once is its memory peak. ``modeled_times`` plays any plans (one
list of operations per worker) under these costs: each operation starts when its
worker is free and its inputs exist, a value made on another worker arriving
``comm`` after it was made.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import VjpsplitError
from .schedules import Op, dependencies

Key = tuple[str, int, int]  # (kind, microbatch, stage), as schedules.dependencies names operations


@dataclass(frozen=True)
class Costs:
    """Per stage: ``F``, ``B`` (the backward's input part) and ``W`` (its weight part); ``comm``: one send."""

    F: tuple[float, ...]
    B: tuple[float, ...]
    W: tuple[float, ...]
    comm: float

    @property
    def stages(self) -> int:
        """How many stages the costs describe."""
        return len(self.F)


def _number(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise VjpsplitError(f"costs[{where}] is {value!r}; give a finite time >= 0 (any unit, the same for all)")
    return float(value)


def _per_stage(value: object, key: str, stages: int) -> tuple[float, ...]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (_number(value, repr(key)),) * stages
    if not isinstance(value, Sequence) or isinstance(value, str) or len(value) != stages:
        raise VjpsplitError(
            f"costs[{key!r}] must be one time per stage ({stages}) or one number for every stage, not {value!r}"
        )
    return tuple(_number(v, f"{key!r}][{s}") for s, v in enumerate(value))


def as_costs(costs: Costs | Mapping[str, object], stages: int) -> Costs:
    """``costs`` as ``Costs`` for ``stages`` stages: ``{"F": [...], "B": [...], "W": [...], "comm": c}``.

    Each of F, B and W is one time per stage or a number meaning every stage; a
    missing ``W`` means the backwards are whole (B is all of each); a missing
    ``comm`` means sends take no time.
    """
    if isinstance(costs, Costs):
        if costs.stages != stages:
            raise VjpsplitError(f"the costs describe {costs.stages} stages, the pipeline has {stages}")
        return costs
    if not isinstance(costs, Mapping):
        raise VjpsplitError(f"costs must be a dict with keys F, B, W and comm, not {type(costs).__name__}")
    unknown = set(costs) - {"F", "B", "W", "comm"}
    if unknown:
        raise VjpsplitError(f"costs has unknown keys {sorted(map(str, unknown))}; use F, B, W and comm")
    for key in ("F", "B"):
        if key not in costs:
            raise VjpsplitError(f"costs has no {key!r}: give the time of each stage's {key}")
    return Costs(
        F=_per_stage(costs["F"], "F", stages),
        B=_per_stage(costs["B"], "B", stages),
        W=_per_stage(costs.get("W", 0.0), "W", stages),
        comm=_number(costs.get("comm", 0.0), "'comm'"),
    )


def memory_limits(limit: int | Sequence[int] | None, workers: int, microbatches: int) -> tuple[int, ...]:
    """One limit per worker (microbatches held at once); ``None``: ``microbatches``, which never binds."""
    if limit is None:
        return (microbatches,) * workers
    values = [limit] * workers if isinstance(limit, int) and not isinstance(limit, bool) else limit
    if not isinstance(values, Sequence) or len(values) != workers:
        raise VjpsplitError(f"memory_limit must be an int or one int per worker ({workers}), not {limit!r}")
    out = []
    for w, v in enumerate(values):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise VjpsplitError(
                f"memory_limit for worker {w} is {v!r}; a worker must hold at least 1 microbatch (give an int >= 1)"
            )
        out.append(min(v, microbatches))
    return tuple(out)


def memory_peaks(plans: Sequence[Sequence[Op]]) -> list[int]:
    """Per worker, the most microbatches it holds at once: each from its F until its W, or its whole B."""
    split = {(o.chunk, o.mb) for ops in plans for o in ops if o.kind == "W"}
    peaks = []
    for ops in plans:
        held = peak = 0
        for o in ops:
            if o.kind == "F":
                held += 1
                peak = max(peak, held)
            elif o.kind == "W" or (o.kind == "B" and (o.chunk, o.mb) not in split):
                held -= 1
        peaks.append(peak)
    return peaks


def duration(op: Op, costs: Costs, split: bool) -> float:
    """The time of ``op`` under ``costs``; ``split``: whether its B is the input part (a W follows)."""
    s = op.chunk
    if op.kind == "F":
        return costs.F[s]
    if op.kind == "W":
        return costs.W[s]
    return costs.B[s] if split else costs.B[s] + costs.W[s]


def modeled_times(plans: Sequence[Sequence[Op]], costs: Costs) -> dict[Key, tuple[float, float]]:
    """Start and end of every operation when ``plans`` play under ``costs``, from time 0.

    Each worker runs its list in order; an operation starts when its worker is free
    and its inputs exist, an input made on another worker ``comm`` later. Raises
    ``VjpsplitError`` if the lists deadlock.
    """
    split = {(o.chunk, o.mb) for ops in plans for o in ops if o.kind == "W"}
    home = {o.chunk: w for w, ops in enumerate(plans) for o in ops}
    times: dict[Key, tuple[float, float]] = {}
    free = [0.0] * len(plans)
    idx = [0] * len(plans)
    moved = True
    while moved:
        moved = False
        for w, ops in enumerate(plans):
            while idx[w] < len(ops):
                op = ops[idx[w]]
                start = free[w]
                deps = dependencies(op, costs.stages, True)
                if any(d not in times for d in deps):
                    break
                for d in deps:
                    start = max(start, times[d][1] + (costs.comm if home[d[2]] != w else 0.0))
                end = start + duration(op, costs, (op.chunk, op.mb) in split)
                times[(op.kind, op.mb, op.chunk)] = (start, end)
                free[w] = end
                idx[w] += 1
                moved = True
    if any(idx[w] < len(ops) for w, ops in enumerate(plans)):
        raise VjpsplitError("the schedule deadlocks: some operation waits for one that runs after it")
    return times


def modeled_makespan(plans: Sequence[Sequence[Op]], costs: Costs | Mapping[str, object]) -> float:
    """When the last operation of ``plans`` ends under ``costs`` (``as_costs``' form), every worker starting at 0."""
    stages = 1 + max((o.chunk for ops in plans for o in ops), default=-1)
    times = modeled_times(plans, as_costs(costs, stages))
    return max((end for _, end in times.values()), default=0.0)


def lower_bound(costs: Costs, microbatches: int, limits: Sequence[int]) -> float:
    """A time no plan with one stage per worker beats under ``costs`` and ``limits`` (per worker).

    Worker ``s`` starts no earlier than the first microbatch's forwards reach it
    (``head``) and has ``m (F + B + W)`` to do. Before its first B it can run only
    forwards, at most its limit of them, while that B waits for the round trip
    through the stages after it. One microbatch's path through every F and B is
    a bound too.
    """
    S, m, c = costs.stages, microbatches, costs.comm
    best = sum(costs.F) + sum(costs.B) + 2 * (S - 1) * c + costs.W[0]
    for s in range(S):
        head = sum(costs.F[:s]) + s * c
        trip = sum(costs.F[k] + costs.B[k] for k in range(s + 1, S)) + 2 * (S - 1 - s) * c
        wait = max(0.0, costs.F[s] + trip - min(m, limits[s]) * costs.F[s])
        best = max(best, head + m * (costs.F[s] + costs.B[s] + costs.W[s]) + wait)
    return best
