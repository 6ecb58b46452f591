"""Local search over plans with one stage per worker: moves of single operations that make the plans end sooner.

The list scheduler (``auto``) decides each operation once, by rules; where the
best plans need a choice no rule makes (some workers run all their forwards
first, others interleave; a worker defers its Ws past the next F and B so the
round trip through it is shorter), ``refine`` finds it by trying moves and
playing the result. A move takes one operation of one worker's list and puts
it up to ``reach`` places earlier or later; only operations that waited for
their worker (not for an input) are moved earlier, and the ones before them
later, since only those moves can start something sooner. A move is kept when
the plans stay within the memory limit, do not deadlock, and end sooner, or as
soon with the Bs' ends summed earlier (the cotangents every earlier stage waits
for). The search stops at a local optimum or after ``budget`` operations
played in all: a count, not a time, so the same inputs give the same plans on
every machine.

The timing here is ``play.sweep``'s rule (an operation starts when its worker is
free and its inputs have arrived, a result from another worker ``comm`` later)
on plain lists, since the search plays plans thousands of times.
"""

from __future__ import annotations

from typing import Sequence

from .costs import Costs
from .modeled import modeled_makespan
from .ops import Kind, Op

_F, _B, _W = 0, 1, 2  # _B: the backward, whole (B) or its input part (I), as the stage's ``split`` says
_KIND = {Kind.F: _F, Kind.B: _B, Kind.I: _B, Kind.W: _W}
Plan = list[list[tuple[int, int]]]  # per worker, (kind, microbatch) in order; worker s runs stage s


class _Player:
    """Plays ``Plan`` lists under one set of costs: (makespan, the Bs' ends summed, per worker the delayed positions)."""

    def __init__(self, costs: Costs, microbatches: int, split: Sequence[bool]):
        S = costs.num_stages
        self.S, self.m, self.comm = S, microbatches, costs.comm
        self.dur = [
            (costs.forward[s], costs.backward[s] + (0.0 if split[s] else costs.weight[s]), costs.weight[s])
            for s in range(S)
        ]
        self.played = 0  # operations played so far (the budget counts these)

    def play(self, plan: Plan) -> tuple[float, float, list[list[int]]] | None:
        """None where the lists deadlock."""
        S, m, comm = self.S, self.m, self.comm
        none = None
        end: list[list[list[float | None]]] = [[[none] * m for _ in range(3)] for _ in range(S)]
        delayed: list[list[int]] = [[] for _ in range(S)]
        free, at, size = [0.0] * S, [0] * S, [len(p) for p in plan]
        total_b = 0.0
        moved = True
        while moved:
            moved = False
            for s in range(S):
                ops, mine, dur, j, f = plan[s], end[s], self.dur[s], at[s], free[s]
                while j < size[s]:
                    k, i = ops[j]
                    if k == _F:
                        ready = 0.0
                        if s > 0:
                            e = end[s - 1][_F][i]
                            if e is None:
                                break
                            ready = e + comm
                    elif k == _B:
                        r = mine[_F][i]
                        if r is None:
                            break
                        ready = r
                        if s < S - 1:
                            e = end[s + 1][_B][i]
                            if e is None:
                                break
                            ready = max(ready, e + comm)
                    else:
                        r = mine[_B][i]
                        if r is None:
                            break
                        ready = r
                    if f > ready:
                        delayed[s].append(j)
                        ready = f
                    f = ready + dur[k]
                    mine[k][i] = f
                    if k == _B:
                        total_b += f
                    j += 1
                if j != at[s]:
                    self.played += j - at[s]
                    moved = True
                    at[s], free[s] = j, f
        if any(at[s] < size[s] for s in range(S)):
            return None
        return max(free), total_b, delayed


def _fits(ops: list[tuple[int, int]], limit: int, split: bool) -> bool:
    held = 0
    for k, _ in ops:
        if k == _F:
            held += 1
            if held > limit:
                return False
        elif k == _W or (k == _B and not split):
            held -= 1
    return True


def _keeps_order(ops: list[tuple[int, int]], p: int, q: int) -> bool:
    """Moving ops[p] to q keeps its microbatch's F, B, W in that order on this worker."""
    k, i = ops[p]
    if q < p:
        return all(not (x[1] == i and x[0] < k) for x in ops[q:p])
    return all(not (x[1] == i and x[0] > k) for x in ops[p + 1 : q + 1])


def refine(
    plans: Sequence[Sequence[Op]],
    costs: Costs,
    microbatches: int,
    limits: Sequence[int],
    *,
    budget: int = 600_000,
    reach: int = 6,
) -> tuple[list[list[Op]], float]:
    """Plans at least as fast as ``plans`` (worker ``s`` running stage ``s``), by local search; (plans, makespan).

    Args:
        plans: the starting plans, one stage per worker, within ``limits``.
        costs: op times per stage and the send delay.
        microbatches: how many microbatches the plans run.
        limits: per worker, the most microbatches it may hold at once.
        budget: the most operations played in all (each move tried plays every operation).
        reach: the most places a move shifts one operation.

    Returns:
        The plans and their makespan as ``modeled_makespan`` plays them. Moves keep each
        operation's kind; plans that split only some of a stage's backwards (both B and
        I in one list) come back as they are.
    """
    split = [any(o.kind == Kind.I for o in ops) for ops in plans]
    if any(o.kind == Kind.B for s, ops in enumerate(plans) for o in ops if split[s]):
        return [list(ops) for ops in plans], modeled_makespan(plans, costs)
    player = _Player(costs, microbatches, split)
    plan: Plan = [[(_KIND[o.kind], o.mb) for o in ops] for ops in plans]
    first = player.play(plan)
    if first is None:  # the caller's plans always play; nothing to improve on otherwise
        return [list(ops) for ops in plans], modeled_makespan(plans, costs)
    span, total_b, delayed = first
    improved = True
    while improved and player.played < budget:
        improved = False
        for s in range(costs.num_stages):
            ops, n = plan[s], len(plan[s])
            moves = []
            for b in delayed[s]:
                moves += [(b, q) for q in range(b - 1, max(-1, b - 1 - reach), -1)]  # the delayed one earlier
                moves += [(b - 1, q) for q in range(b, min(n, b + reach))]  # the one it waited for later
            for p, q in moves:
                if player.played >= budget:
                    break
                if not _keeps_order(ops, p, q):
                    continue
                new = ops[:p] + ops[p + 1 :]
                new.insert(q, ops[p])
                if not _fits(new, limits[s], split[s]):
                    continue
                plan[s] = new
                out = player.play(plan)
                if out is not None and (out[0] < span - 1e-9 or (out[0] < span + 1e-9 and out[1] < total_b - 1e-9)):
                    span, total_b, delayed = out
                    improved = True
                    break
                plan[s] = ops
            if improved:
                break
    kinds = [(Kind.F, Kind.I if split[s] else Kind.B, Kind.W) for s in range(costs.num_stages)]
    return [[Op(kinds[s][k], i, s) for k, i in ops] for s, ops in enumerate(plan)], span
