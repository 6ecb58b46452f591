"""``schedule="auto"``'s trial steps: the plans the model rates close, raced on the step's own clock.

``auto_schedule`` rates plans by a model that holds each operation's time fixed
whatever the plan. On real devices it is not: plans that keep more microbatches
in flight slow every operation (on the 2-core CPU host of docs/performance.md
the same F, I and W measured 7-14% slower under auto's plans than under ZB-H1's,
where the model rated auto's 1.4% faster). So ``AutoPlan`` does not trust the
model between plans it rates within ``MARGIN`` of each other: it runs each of
them, interleaved, for ``rounds`` whole training steps (``Trial``), and keeps
the one whose median step took least time; 1F1B and ZB-H1 race wherever they
fit (``ALWAYS``). Trial steps are the run's own steps:
they train, with the same losses and parameters whichever plans run them.

May import ``schedules`` only.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Collection, Sequence

from ..schedules.ops import Op

TRIAL_ROUNDS = 3  # the steps each candidate runs in a race: the median drops one outlier (a first, colder run)
MARGIN = 0.10  # candidates modeled this far above the best are not raced: a plan's ops ran up to 14% slower
# ... except these, which race wherever they fit: the schedules users measure auto against. Where each operation
# costs little beside the runner's own, the model misses by far more (stages of negligible work on Ray: 1F1B ran
# fastest, and was not among the plans modeled within 10% of the best; docs/performance.md).
ALWAYS = ("1f1b", "zbh1")


@dataclasses.dataclass(frozen=True)
class Candidate:
    """Plans a race may keep.

    Attributes:
        name: what the history records for its steps: ``"auto"`` (``auto_schedule``'s plans), ``"auto, 1f1b's
            memory"`` (the same held to 1F1B's microbatches in flight) or a built-in's name.
        plans: one list of operations per worker.
        offloaded: the (stage, microbatch) pairs whose residuals these plans offload (under a byte limit).
        modeled: the plans' modeled makespan under the costs they were planned for, seconds.
    """

    name: str
    plans: list[list[Op]]
    offloaded: frozenset[tuple[int, int]]
    modeled: float

    @property
    def key(self) -> tuple[tuple[tuple[Op, ...], ...], tuple[tuple[int, int], ...]]:
        """What makes two candidates the same: their plans (names aside) and what they offload."""
        return tuple(tuple(ops) for ops in self.plans), tuple(sorted(self.offloaded))


def contenders(
    candidates: Sequence[Candidate], margin: float = MARGIN, always: Collection[str] = ALWAYS
) -> list[Candidate]:
    """The distinct ``candidates`` (the first of each plans kept) modeled within ``margin`` of the best, and those
    named in ``always`` however they are modeled; fastest modeled first (ties in the given order)."""
    seen: set[object] = set()
    distinct = []
    for c in candidates:
        if c.key not in seen:
            seen.add(c.key)
            distinct.append(c)
    best = min(c.modeled for c in distinct)
    near = [c for c in distinct if c.modeled <= best * (1.0 + margin) or c.name in always]
    return sorted(near, key=lambda c: c.modeled)


class Trial:
    """A race between ``candidates`` over ``rounds`` steps each, interleaved; the fastest median step wins."""

    def __init__(self, candidates: Sequence[Candidate], rounds: int):
        if not candidates or rounds < 1:
            raise ValueError("a trial needs a candidate and a round")
        self.candidates = list(candidates)
        self.rounds = rounds
        self.seconds: list[list[float]] = [[] for _ in self.candidates]

    @property
    def running(self) -> int:
        """The candidate the next step runs: the one with fewest steps counted (the first such), so that each
        round runs every candidate once and a step left uncounted is run again."""
        return min(range(len(self.candidates)), key=lambda i: len(self.seconds[i]))

    def add(self, candidate: int, seconds: float) -> None:
        """Count one step of ``candidate`` that took ``seconds``."""
        self.seconds[candidate].append(seconds)

    @property
    def done(self) -> bool:
        """Whether every candidate has run its rounds."""
        return all(len(s) >= self.rounds for s in self.seconds)

    def medians(self) -> list[float]:
        """Each candidate's median step seconds (inf before it ran)."""
        return [statistics.median(s) if s else float("inf") for s in self.seconds]

    def winner(self) -> Candidate:
        """The candidate whose median step took least time; on a tie, the one modeled faster (listed first)."""
        medians = self.medians()
        return self.candidates[min(range(len(medians)), key=lambda i: (medians[i], i))]
