"""Timelines: an executed (or played) operation as an ``Event``, and the bubble of a set of them.

Events carry seconds on one clock, the driver's ``time.monotonic``: the Ray
runner moves each actor's events onto it by the offset it measured at start.
A played schedule's events carry its own units.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Event:
    """One executed operation: worker, kind, microbatch, start and end (seconds, one clock), stage.

    ``own``: where the operation's call was cold (it traced, compiled or ran its checked first path), the
    seconds one warm run of the same call took, measured right after it; None where ``end - start`` is warm.
    ``replica``: on a stage with replicas (``data_parallel``), the one that ran it (each replica's copy of an
    operation is an event); None on a stage without.

    Attributes:
        worker: The worker that ran it.
        kind: ``"F"``, ``"B"`` (a whole backward), ``"I"`` (its input part) or ``"W"`` (its weight part).
        mb: The microbatch.
        start: When it started, in seconds on the driver's clock (a played schedule's own units).
        end: When it ended, on the same clock.
        stage: The stage it ran.
        own: Where the call was cold, the seconds of one warm run of it; else ``None``.
        replica: The stage's replica that ran it; ``None`` without replicas.
    """

    worker: int
    kind: str
    mb: int
    start: float
    end: float
    stage: int
    own: float | None = None
    replica: int | None = None

    def shifted(self, offset: float) -> Event:
        """The same operation on a clock that reads ``offset`` seconds less than the one it was recorded on.

        Args:
            offset: The seconds to subtract from ``start`` and ``end``.

        Returns:
            A new ``Event``.
        """
        return dataclasses.replace(self, start=self.start - offset, end=self.end - offset)


@dataclass(frozen=True)
class Phase:
    """A span of a step that is not an operation: the driver's phases (``worker`` None) and a worker's
    reductions and optimizer update; seconds on the events' clock."""

    worker: int | None
    name: str
    start: float
    end: float

    def shifted(self, offset: float) -> Phase:
        """The same span on a clock that reads ``offset`` seconds less."""
        return Phase(self.worker, self.name, self.start - offset, self.end - offset)


def op_name(kind: str, stage: int, mb: int, replica: int | None = None) -> str:
    """An operation as a trace names it (its slice, its ``jax.profiler.TraceAnnotation``): ``B s1 mb3``, and
    replica 1's copy of it on a stage with replicas ``B s1 mb3 r1``."""
    return f"{kind} s{stage} mb{mb}" + ("" if replica is None else f" r{replica}")


def one_per_op(events: Sequence[Event]) -> list[Event]:
    """``events`` less the copies of replicas other than the first: one event per operation of the schedule
    (what a replay or a send's gap reads: a stage's replicas each run the same operation on their part of
    the microbatch, on their own devices)."""
    return [e for e in events if not e.replica]


def makespan(events: Sequence[Event]) -> float:
    """The time from the first start to the last end (0 for no events)."""
    if not events:
        return 0.0
    return max(e.end for e in events) - min(e.start for e in events)


def bubble_ratio(events: Sequence[Event], num_workers: int) -> float:
    """1 - busy time / (workers x makespan).

    Args:
        events: The operations of one step (or schedule's play).
        num_workers: How many workers ran them.

    Returns:
        The idle fraction, in [0, 1]; 0 for no events.
    """
    span = makespan(events)
    if span <= 0:
        return 0.0
    busy = sum(e.end - e.start for e in events)
    return max(0.0, 1.0 - busy / (num_workers * span))
