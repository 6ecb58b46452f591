"""Timelines: an executed (or played) operation as an ``Event``, and the bubble of a set of them.

Events carry seconds on one clock, the driver's ``time.monotonic``: the Ray
runner moves each actor's events onto it by the offset it measured at start.
A played schedule's events carry its own units.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class Event:
    """One executed operation: worker, kind, microbatch, start and end (seconds, one clock), stage."""

    worker: int
    kind: str
    mb: int
    start: float
    end: float
    stage: int

    def shifted(self, offset: float) -> Event:
        """The same operation on a clock that reads ``offset`` seconds less than the one it was recorded on."""
        return Event(self.worker, self.kind, self.mb, self.start - offset, self.end - offset, self.stage)


def makespan(events: Sequence[Event]) -> float:
    """The time from the first start to the last end (0 for no events)."""
    if not events:
        return 0.0
    return max(e.end for e in events) - min(e.start for e in events)


def bubble_ratio(events: Sequence[Event], num_workers: int) -> float:
    """1 - busy time / (workers x makespan)."""
    span = makespan(events)
    if span <= 0:
        return 0.0
    busy = sum(e.end - e.start for e in events)
    return max(0.0, 1.0 - busy / (num_workers * span))
