"""``schedule="auto"``'s trial steps: the plans the model rates close, raced on the step's own clock.

``auto_schedule`` rates plans by a model that holds each operation's time fixed
whatever the plan. On real devices it is not: plans that keep more microbatches
in flight slow every operation (on the 2-core CPU host of docs/performance.md
the same F, I and W measured 7-14% slower under auto's plans than under ZB-H1's,
where the model rated auto's 1.4% faster). So ``AutoPlan`` does not trust the
model between plans it rates within ``MARGIN`` of each other: it runs each of
them, interleaved, for ``rounds`` whole training steps (``Trial``), dropping
those slower than the leader beyond the clock's noise and racing the rest on
(up to ``MOST_ROUNDS`` times as many steps), and keeps the one whose median
step took least time; 1F1B and ZB-H1 race wherever they
fit (``ALWAYS``). Trial steps are the run's own steps:
they train, with the same losses and parameters whichever plans run them.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
from typing import Collection, Sequence

from ..schedules.ops import Op

TRIAL_ROUNDS = 3  # the steps each candidate runs in a race: the median drops one outlier (a first, colder run)
MOST_ROUNDS = 4  # times ``rounds``: how long candidates within the noise of the leader race on
SEPARATED = 2.0  # standard errors of two medians' difference: beyond it, the slower candidate leaves the race
MARGIN = 0.10  # candidates modeled this far above the best are not raced: a plan's ops ran up to 14% slower
# ... except these, which race wherever they fit: the schedules users measure auto against. Where each operation
# costs little beside the runner's own, the model misses by far more (stages of negligible work on Ray: 1F1B ran
# fastest, and was not among the plans modeled within 10% of the best; benchmarks/results/2026-history-ray-training-steps.md).
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
    """A race between ``candidates``, interleaved: each runs at least ``rounds`` steps; those the clock cannot yet
    tell from the leader run on, up to ``most``; the least median step wins.

    After each round from the ``rounds``-th on, a candidate whose median is more than ``SEPARATED`` standard
    errors of the two medians' difference above the leader's leaves the race (``noise``). Candidates that stay
    are within the clock's noise of each other; racing them longer narrows it, so they run until ``most``.
    """

    def __init__(self, candidates: Sequence[Candidate], rounds: int, most: int | None = None):
        if not candidates or rounds < 1:
            raise ValueError("a trial needs a candidate and a round")
        self.candidates = list(candidates)
        self.rounds = rounds
        self.most = max(rounds, MOST_ROUNDS * rounds if most is None else most)
        self.seconds: list[list[float]] = [[] for _ in self.candidates]
        self.out: set[int] = set()  # the candidates that left the race, slower beyond the noise

    @property
    def staying(self) -> list[int]:
        """The candidates still racing, in order."""
        return [i for i in range(len(self.candidates)) if i not in self.out]

    @property
    def running(self) -> int:
        """The candidate the next step runs: the staying one with fewest steps counted (the first such), so that
        each round runs every staying candidate once and a step left uncounted is run again."""
        return min(self.staying, key=lambda i: len(self.seconds[i]))

    def add(self, candidate: int, seconds: float) -> None:
        """Count one step of ``candidate`` that took ``seconds``; at the end of a round from the ``rounds``-th
        on, the candidates slower than the leader beyond the noise leave the race."""
        self.seconds[candidate].append(seconds)
        counts = {len(self.seconds[i]) for i in self.staying}
        if len(counts) == 1 and counts.pop() >= self.rounds:
            medians, noise = self.medians(), self.noise()
            lead = min(self.staying, key=lambda i: (medians[i], i))
            for i in self.staying:
                se = noise * math.hypot(1 / math.sqrt(len(self.seconds[i])), 1 / math.sqrt(len(self.seconds[lead])))
                if medians[i] - medians[lead] > SEPARATED * se:
                    self.out.add(i)

    def noise(self) -> float:
        """The standard error of one candidate's median per ``1/sqrt(steps)``: from the step times' spread
        around their own candidate's median, pooled (the median absolute deviation, scaled to a normal
        law's sigma, times the median's 1.2533 over the mean's error)."""
        medians = self.medians()
        spread = [abs(x - medians[i]) for i, s in enumerate(self.seconds) for x in s]
        return 1.2533 * 1.4826 * statistics.median(spread) if spread else 0.0

    @property
    def done(self) -> bool:
        """Whether the race is over: every staying candidate ran its ``rounds``, and one stays, all ran ``most``,
        or the clock has no noise (equal medians are then equal: more steps would not part them)."""
        counts = [len(self.seconds[i]) for i in self.staying]
        return min(counts) >= self.rounds and (len(counts) == 1 or min(counts) >= self.most or self.noise() == 0)

    def medians(self) -> list[float]:
        """Each candidate's median step seconds (inf before it ran)."""
        return [statistics.median(s) if s else float("inf") for s in self.seconds]

    def winner(self) -> Candidate:
        """The staying candidate whose median step took least time; on a tie, the one modeled faster (listed
        first)."""
        medians = self.medians()
        return self.candidates[min(self.staying, key=lambda i: (medians[i], i))]
