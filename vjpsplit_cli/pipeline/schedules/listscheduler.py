"""The list scheduler: plans built by simulating time under F, B, W and send costs, one ``Policy`` at a time.

The worker whose clock is earliest chooses next: the B whose cotangent has arrived,
else an F whose activation has arrived and that memory allows, else a W if one fits
before the next input arrives, else it waits for that input (``auto``'s docstring
tells the whole method). Owns ``Policy``, the family ``policies`` plays, one run of
the scheduler and ``search``, the fastest plans over the family; ``auto`` builds on it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from ...errors import VjpsplitError
from .costs import Costs
from .ops import Kind, Op

INF = math.inf


@dataclass(frozen=True)
class Policy:
    """How the list scheduler chooses; ``policies`` searches over a few values of each knob.

    ``ahead``: worker ``s`` runs at most ``S - s + ahead`` forwards whose B has not
    run (0: 1F1B's ``S - s``); ``held_ahead`` bounds the same way the forwards
    whose W has not run; ``None``: only the memory limit bounds them.
    ``forward_first``: a ready F runs before a ready B (while the bounds allow).
    ``paired`` (with ``ahead``): a B waits until those forwards are all in flight,
    1F1B's order of F and B (ZB-H1's, with each W placed by the real costs).
    ``tolerance``: a W may start when it delays the next input by at most this
    share of its own time (0: only where it delays nothing; 1: wherever the
    worker would wait).
    ``f_tolerance``: a ready F may start when it delays a B whose cotangent is
    already on its way by at most this share of the F's time (1: always; 0: the
    worker waits for that B instead). Where memory binds, a B held up on one
    worker holds up the round trip every earlier worker's memory waits for.
    """

    ahead: int | None = None
    held_ahead: int | None = None
    forward_first: bool = False
    tolerance: float = 1.0
    paired: bool = False
    f_tolerance: float = 1.0


def policies(stages: int) -> list[Policy]:
    """The policies ``auto_schedule`` tries for ``stages`` stages."""
    caps = [Policy()] + [Policy(ahead=k) for k in range(4)] + [Policy(held_ahead=k) for k in range(3)]
    out = []
    for tolerance in (0.0, 0.5, 1.0):
        for forward_first in (False, True):
            for p in caps:
                out.append(Policy(p.ahead, p.held_ahead, forward_first, tolerance))
        for k in range(3):
            out.append(Policy(ahead=k, tolerance=tolerance, paired=True))
    for f_tolerance in (0.5, 0.0):  # a ready F yields to a cotangent on its way, while Ws fill only idle time
        for p in caps:
            out.append(Policy(p.ahead, p.held_ahead, False, 0.0, f_tolerance=f_tolerance))
    return out if stages > 1 else [Policy()]


class _Stuck(Exception):
    """A policy whose rules leave every worker waiting for another (the search drops it)."""


class _Builder:
    """One run of the list scheduler: per worker, counts of F, backwards (B or I) and W so far, clocks, and when
    each op ends."""

    def __init__(self, costs: Costs, microbatches: int, limits: Sequence[int], split: Sequence[bool], policy: Policy):
        S, m = costs.num_stages, microbatches
        self.S, self.m, self.costs, self.limits, self.split, self.policy = S, m, costs, limits, split, policy
        self.nf, self.nb, self.nw = [0] * S, [0] * S, [0] * S  # nw: microbatches let go (their W, or whole B)
        self.f_end = [[INF] * m for _ in range(S)]
        self.b_end = [[INF] * m for _ in range(S)]
        self.clock = [0.0] * S  # when worker s next chooses
        self.free = [0.0] * S  # when worker s's last operation ends
        self.makespan = 0.0
        # Unless stuck, some operation runs or some value travels at every moment: nothing ends later than this.
        work = sum(costs.forward) + sum(costs.backward) + sum(costs.weight) + 2 * S * costs.comm
        self.horizon = (m * work + 1.0) * (1.0 + 1e-9)
        self.plans: list[list[Op]] = [[] for _ in range(S)]
        # Zero-time operations let a worker wait without its clock moving: it then yields to the others at
        # that time, the one stalled last going last (stalled: when, 0 if not), and more waits in a row than
        # two rounds of every worker, with nothing run between them, mean every worker is stuck.
        self.stalled = [0] * S
        self.stalls = self.stamp = 0

    def build(self) -> list[list[Op]]:
        """Choose until every worker has run all its operations; the plans, one list per worker.

        ``makespan`` is then the plans' time under the costs, as ``modeled_makespan`` plays them.
        """
        while True:
            s, key = -1, (INF, 0)
            for k in range(self.S):
                if self.nw[k] < self.m and (self.clock[k], self.stalled[k]) < key:
                    s, key = k, (self.clock[k], self.stalled[k])
            if s < 0:
                self.makespan = max(self.free)
                return self.plans
            if key[0] > self.horizon or self.stalls > 2 * self.S:
                raise _Stuck(self.policy)
            self._choose(s, key[0])

    def _b_arrival(self, s: int) -> tuple[float, float]:
        """When stage s's next B can start: (known time or INF, a lower bound while the next stage is undecided)."""
        if self.nb[s] >= self.nf[s]:
            return INF, INF
        i = self.nb[s]
        if s == self.S - 1:
            return self.f_end[s][i], INF
        if self.b_end[s + 1][i] < INF:
            return self.b_end[s + 1][i] + self.costs.comm, INF
        return INF, self.clock[s + 1] + self.costs.backward[s + 1] + self.costs.comm

    def _f_arrival(self, s: int) -> tuple[float, float]:
        """When stage s's next F can start (ignoring memory), as ``_b_arrival``."""
        if self.nf[s] >= self.m:
            return INF, INF
        i = self.nf[s]
        if s == 0:
            return 0.0, INF
        if self.f_end[s - 1][i] < INF:
            return self.f_end[s - 1][i] + self.costs.comm, INF
        return INF, self.clock[s - 1] + self.costs.forward[s - 1] + self.costs.comm

    def _forward_allowed(self, s: int) -> tuple[bool, bool]:
        """(memory lets stage s run another F, the policy lets it too)."""
        p, held = self.policy, self.nf[s] - self.nw[s]
        memory = self.nf[s] < self.m and held < self.limits[s]
        ok = memory
        if p.ahead is not None:
            ok = ok and self.nf[s] - self.nb[s] < self.S - s + p.ahead
        if p.held_ahead is not None:
            ok = ok and held < self.S - s + p.held_ahead
        return memory, ok

    def _b_allowed(self, s: int, memory: bool) -> bool:
        """``paired``: a B waits for the F that 1F1B pairs with it (all forwards in flight), unless memory stops that F.

        No more forwards are awaited than every worker up to s may hold (more could never come before this B).
        """
        p = self.policy
        if not p.paired or p.ahead is None or self.nf[s] >= self.m:
            return True
        if self.nf[s] - self.nb[s] >= min(self.S - s + p.ahead, *self.limits[: s + 1]):
            return True
        return not memory and self.nw[s] == self.nb[s]  # no W can free the memory the F waits for

    def _choose(self, s: int, t: float) -> None:
        b_at, b_bound = self._b_arrival(s)
        f_at, f_bound = self._f_arrival(s)
        memory, allowed = self._forward_allowed(s)
        if not self._b_allowed(s, memory):
            b_at = b_bound = INF  # it waits for its F, whose arrival the worker waits for instead
        b_ready, f_ready = b_at <= t, f_at <= t and allowed
        if f_ready and not b_ready and b_at < INF and self.policy.f_tolerance < 1.0:
            if b_at < max(self.free[s], f_at) + self.costs.forward[s] * (1.0 - self.policy.f_tolerance):
                f_ready = allowed = False  # the F would hold up a cotangent already on its way: wait for it
        w_ready = self.nw[s] < self.nb[s]
        if b_ready and not (f_ready and self.policy.forward_first):
            return self._put(s, "B", b_at, t)
        if f_ready:
            return self._put(s, "F", f_at, t)
        if w_ready and f_at <= t and not memory and self.nf[s] < self.m:
            return self._put(s, "W", 0.0, t)  # the forward waits for memory: a W frees it
        nxt = min(b_at, b_bound, f_at if allowed else INF, f_bound if allowed else INF)
        if w_ready and (nxt == INF or nxt >= self.free[s] + self.costs.weight[s] * (1.0 - self.policy.tolerance)):
            return self._put(s, "W", 0.0, t)
        if not nxt < INF:
            raise VjpsplitError(f"internal: the list scheduler found worker {s} with nothing to wait for")
        if nxt <= t:
            self.stalls += 1
            self.stamp += 1
            self.stalled[s] = self.stamp
        else:
            self.stalled[s] = 0
        self.clock[s] = max(nxt, t)

    def _put(self, s: int, kind: str, ready: float, t: float) -> None:
        """Append ``kind`` to worker s's list, timed as the runners play it: once the worker is free and it is ready."""
        c = self.costs
        start = max(self.free[s], ready)
        if kind == "F":
            op = Op(Kind.F, self.nf[s], s)
            self.f_end[s][op.mb] = start + c.forward[s]
            self.nf[s] += 1
        elif kind == "B":
            op = Op(Kind.I if self.split[s] else Kind.B, self.nb[s], s)  # the input part where the stage splits
            self.b_end[s][op.mb] = start + c.duration(op)
            self.nb[s] += 1
            self.nw[s] += not self.split[s]  # a whole backward lets its microbatch go
        else:
            op = Op(Kind.W, self.nw[s], s)
            self.nw[s] += 1
        d = c.duration(op)
        self.plans[s].append(op)
        self.stalled[s], self.stalls = 0, 0
        self.free[s] = start + d
        self.clock[s] = max(t, start + d)  # decisions go on in time order, even after a W timed into the past


def search(
    costs: Costs, microbatches: int, limits: Sequence[int], split: Sequence[bool]
) -> tuple[list[list[Op]], float, Policy]:
    """The fastest plans the list scheduler finds over ``policies``: (plans, modeled makespan, the policy)."""
    best: tuple[list[list[Op]], float, Policy] | None = None
    for policy in policies(costs.num_stages):
        builder = _Builder(costs, microbatches, limits, split, policy)
        try:
            plans = builder.build()
        except _Stuck:
            continue
        span = builder.makespan
        if best is None or span < best[1] - 1e-12:
            best = (plans, span, policy)
    if best is None:
        raise VjpsplitError("internal: every policy of the list scheduler got stuck")  # Policy() cannot
    return best
