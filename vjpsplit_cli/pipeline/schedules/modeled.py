"""What automatic schedules are held to: memory per worker, the makespan under ``Costs``, a lower bound.

A worker holds a microbatch of a stage from its F until its W (or its whole B);
the most it holds at once is its memory peak (``memory_peaks``), checked against a
limit per worker (``memory_limits``). ``modeled_makespan`` is when plans end as
``play`` plays them under ``Costs``; ``lower_bound`` is a time no plan with one
stage per worker beats.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from ...errors import VjpsplitError
from .costs import Costs
from .ops import RELEASES, Kind, Op
from .play import play


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
    peaks = []
    for ops in plans:
        held = peak = 0
        for o in ops:
            if o.kind == Kind.F:
                held += 1
                peak = max(peak, held)
            elif o.kind in RELEASES:
                held -= 1
        peaks.append(peak)
    return peaks


def modeled_makespan(plans: Sequence[Sequence[Op]], costs: Costs | Mapping[str, object]) -> float:
    """When the last operation of ``plans`` ends under ``costs`` (``Costs.of``'s form), every worker starting at 0."""
    num_stages = 1 + max((o.stage for ops in plans for o in ops), default=-1)
    return max((e.end for e in play(plans, num_stages, Costs.of(costs, num_stages)).events), default=0.0)


def lower_bound(costs: Costs, microbatches: int, limits: Sequence[int]) -> float:
    """A time no plan with one stage per worker beats under ``costs`` and ``limits`` (per worker).

    Worker ``s`` starts no earlier than the first microbatch's forwards reach it
    (``head``) and has ``m (F + B + W)`` to do. Before its first B it can run only
    forwards, at most its limit of them, while that B waits for the round trip
    through the stages after it. One microbatch's path through every F and B is
    a bound too.
    """
    S, m, c = costs.num_stages, microbatches, costs.comm
    best = sum(costs.forward) + sum(costs.backward) + 2 * (S - 1) * c + costs.weight[0]
    for s in range(S):
        head = sum(costs.forward[:s]) + s * c
        trip = sum(costs.forward[k] + costs.backward[k] for k in range(s + 1, S)) + 2 * (S - 1 - s) * c
        wait = max(0.0, costs.forward[s] + trip - min(m, limits[s]) * costs.forward[s])
        best = max(best, head + m * (costs.forward[s] + costs.backward[s] + costs.weight[s]) + wait)
    return best
