"""Automatic schedules: plans built for measured F, B, W and send times under a memory limit.

``auto_schedule`` is list scheduling that simulates time as it builds, in the
family of the Zero Bubble paper's heuristic for ZB-1p/ZB-2p (Qi et al., *Zero
Bubble Pipeline Parallelism*, ICLR 2024, section 3): the worker whose clock is
earliest chooses next. It takes the B whose cotangent has arrived (the previous
stage waits for it), else an F whose activation has arrived and that memory
allows (the next stage waits for it), else a W if one fits before the next
input arrives, else it waits for that input. A forward that memory stops makes
a W run first, freeing a microbatch. Each operation is timed as the runners
play the lists: once its worker is free and its inputs exist.

A ``Policy`` sets how far forwards run ahead of their backwards, whether a ready
F goes before a ready B (or a B waits for the F 1F1B pairs it with), and how
much a W may delay an arriving input, or an F an arriving cotangent; ``policies``
is the family played, and the fastest plans win. The built-in ``gpipe``,
``1f1b`` and ``zbh1`` that fit the memory limit are a safety net: under the same
costs the result is never slower than any of them. Where the best of these is
above ``lower_bound`` (so possibly not optimal), ``refine``'s local search moves
single operations while that makes the plans end sooner, within a budget of
operations played (not of seconds: the plans are the same on every machine).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence, Sized

from ...errors import VjpsplitError
from .costs import Costs
from .modeled import lower_bound, memory_limits, memory_peaks, modeled_makespan
from .stepplans import check_plans
from .builtins import schedule
from .catalog import SPLIT_BACKWARD
from .offloading import OffloadPlans, choose_offload, offload_makespan
from .ops import Kind, Op
from .refine import refine

BUILT_INS = ("gpipe", "1f1b", "zbh1")  # the one-stage-per-worker schedules the result never loses to
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


def _stage_count(stages: object) -> int:
    if isinstance(stages, int) and not isinstance(stages, bool):
        n = stages
    elif isinstance(stages, Sized) and not isinstance(stages, (str, bytes)):
        n = len(stages)
    else:
        raise VjpsplitError(f"stages must be a count or the stages (a Stages, or artifacts), not {stages!r}")
    if n < 1:
        raise VjpsplitError(f"a pipeline needs at least one stage, not {n}")
    return n


def _split_stages(stages: object, costs: Mapping[str, object] | Costs, n: int) -> tuple[bool, ...]:
    """Whose backwards the plans split into I and W: every stage whose artifact has the split (all, for a count).

    Costs without ``W`` make every backward whole.
    """
    if not isinstance(costs, Costs) and isinstance(costs, Mapping) and "W" not in costs:
        return (False,) * n
    if not isinstance(stages, Iterable):
        return (True,) * n
    return tuple(bool(getattr(getattr(a, "manifest", None), "weights", True)) for a in stages)


def built_in_candidates(
    stages: int, microbatches: int, limits: Sequence[int], split: Sequence[bool] | None = None
) -> dict[str, list[list[Op]]]:
    """The built-in schedules (``BUILT_INS``) whose memory peak fits ``limits`` on every worker.

    ``split``: per stage, whether it has the split backward; where one lacks it, the schedules
    that need it (``SPLIT_BACKWARD``) are left out.
    """
    out = {}
    for name in BUILT_INS:
        if split is not None and not all(split) and name in SPLIT_BACKWARD:
            continue
        plans = schedule(name, stages, microbatches)
        if all(p <= lim for p, lim in zip(memory_peaks(plans), limits)):
            out[name] = plans
    return out


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


def auto_schedule(
    stages: object,
    microbatches: int,
    *,
    costs: Mapping[str, object] | Costs,
    memory_limit: int | Sequence[int] | None = None,
    memory_limit_bytes: int | Sequence[int] | None = None,
    microbatch_bytes: Sequence[int] | None = None,
) -> list[list[Op]]:
    """Plans for ``stages`` fastest under ``costs`` within ``memory_limit``.

    ``stages`` is a count, or a ``Stages`` or artifacts (then its length).

    ``costs``: ``{"F": [...], "B": [...], "W": [...], "comm": c}``, per stage the time
    of its forward, of its backward's input part and of its weight part (any unit; a
    whole backward costs B + W; a number means every stage), ``comm`` the time of one
    send between stages. ``memory_limit``: the most microbatches a worker may hold
    at once, from a stage's F until its W (or its B where that backward is whole);
    an int, one per worker, or ``None`` for no limit. Returns one list of ``Op`` per
    worker, worker ``w`` holding stage ``w``, in the form ``read_schedule`` returns
    (any runner takes it as ``schedule=``); checked, within the limit, and under
    ``costs`` no slower than any of ``gpipe``, ``1f1b`` and ``zbh1`` that fits it.
    Stages whose artifact lacks the split backward (or costs without ``W``) get whole
    backwards. The plans depend only on the arguments (no clock, no randomness).

    Args:
        stages: The stage count, or the stages themselves (a ``Stages`` or a sequence
            of artifacts), whose artifacts say which have the split backward.
        microbatches: The microbatches per step.
        costs: Per stage the times of F, B (the input part) and W, and ``comm``: a
            ``Costs`` or a dict as ``Costs.of`` takes it.
        memory_limit: The most microbatches a worker may hold at once: an int, one
            int per worker, or ``None`` for no limit.
        memory_limit_bytes: Instead of ``memory_limit``: bytes per worker (an int or one per
            worker), with ``microbatch_bytes``; plans within those bytes, offloading residuals where
            ``costs["transfer"]`` (bytes per second off the device and back: one number, or
            ``{"out": .., "back": ..}``) lets more microbatches be in flight and the plans end sooner
            (``offloading``).
        microbatch_bytes: Per stage, the bytes one microbatch in flight holds.

    Returns:
        One list of ``Op`` per worker (worker ``w`` holding stage ``w``), checked; with
        ``memory_limit_bytes`` an ``OffloadPlans``, whose ``offloaded`` names the (stage, microbatch)
        pairs whose residuals leave their device.

    Raises:
        VjpsplitError: If ``stages`` is neither a count >= 1 nor stages,
            ``microbatches`` is not an int >= 1, the costs are malformed (see
            ``Costs.of``), or ``memory_limit`` is not an int >= 1 or one per worker; a byte
            limit below one microbatch's bytes of its stage (no plan fits it, offload or not:
            the message names the smallest limit that fits).
    """
    S = _stage_count(stages)
    if isinstance(microbatches, bool) or not isinstance(microbatches, int) or microbatches < 1:
        raise VjpsplitError(f"microbatches must be an int >= 1, not {microbatches!r}")
    split = _split_stages(stages, costs, S)
    c = Costs.of(costs, S)
    if memory_limit_bytes is not None or microbatch_bytes is not None:
        if memory_limit is not None:
            raise VjpsplitError("give memory_limit (microbatches) or memory_limit_bytes, not both")
        return _within_bytes(c, microbatches, split, memory_limit_bytes, microbatch_bytes)
    return _plans(c, microbatches, memory_limits(memory_limit, S, microbatches), split)


def _plans(c: Costs, microbatches: int, limits: Sequence[int], split: Sequence[bool]) -> list[list[Op]]:
    S = c.num_stages
    plans, span, _ = search(c, microbatches, limits, split)
    for built in built_in_candidates(S, microbatches, limits, split).values():
        other = modeled_makespan(built, c)
        if other < span - 1e-9:
            plans, span = built, other
    if span > lower_bound(c, microbatches, limits) + 1e-9:  # at the bound the plans are already optimal
        plans, span = refine(plans, c, microbatches, limits)
    check_plans(plans, S, microbatches)
    return plans


def smallest_byte_limit(nbytes: Sequence[int]) -> list[int]:
    """Per worker, the smallest byte limit any plan fits: one microbatch's bytes of its stage (see ``offloading``)."""
    return [int(b) for b in nbytes]


def _within_bytes(
    c: Costs,
    m: int,
    split: Sequence[bool],
    limit: int | Sequence[int] | None,
    nbytes: Sequence[int] | None,
) -> OffloadPlans:
    """Plans within ``limit`` bytes per worker: for each count limit from what fits without offload up to ``m``
    (every worker's raised alike), the plans for it and the offload that brings them within the bytes; the
    soonest to end under ``c`` with the copies back charged (``offloading.offload_makespan``)."""
    S = c.num_stages
    if nbytes is None or limit is None:
        raise VjpsplitError("memory_limit_bytes and microbatch_bytes go together: give both")
    if len(nbytes) != S or any(isinstance(b, bool) or not isinstance(b, int) or b < 0 for b in nbytes):
        raise VjpsplitError(f"microbatch_bytes must be one int >= 0 per stage ({S}), not {nbytes!r}")
    raw = [limit] * S if isinstance(limit, int) and not isinstance(limit, bool) else list(limit)  # type: ignore[arg-type]
    if len(raw) != S or any(isinstance(v, bool) or not isinstance(v, int) or v < 0 for v in raw):
        raise VjpsplitError(f"memory_limit_bytes must be an int or one int per worker ({S}), not {limit!r}")
    need = smallest_byte_limit(nbytes)
    short = [w for w in range(S) if raw[w] < need[w]]
    if short:
        w = short[0]
        raise VjpsplitError(
            f"memory_limit_bytes={raw[w]} on worker {w}: no plan fits, with or without offload (a stage holds one "
            f"microbatch's residuals, {need[w]} bytes, at the end of its F); the smallest limit that fits is "
            f"{need} bytes per worker"
        )
    base = [m if b == 0 else max(1, min(m, lim // b)) for lim, b in zip(raw, nbytes)]
    best: tuple[float, list[list[Op]], frozenset[tuple[int, int]]] | None = None
    candidates = [_plans(c, m, base, split)]  # fits by its counts: no offload
    if c.transfer is not None:  # no transfer cost measured: no offload
        seen = {tuple(base)}
        for k in range(1, m):
            counts = tuple(min(m, x + k) for x in base)
            if counts in seen:
                break
            seen.add(counts)
            candidates.append(_plans(c, m, counts, split))
        # The built-ins too: GPipe's long wait from F to B is what offload serves best.
        candidates += list(built_in_candidates(S, m, (m,) * S, split).values())
    for i, plans in enumerate(candidates):
        chosen = frozenset() if i == 0 else choose_offload(plans, c, nbytes, raw, c.transfer)  # type: ignore[arg-type]
        if chosen is None:
            continue
        span = offload_makespan(plans, c, nbytes, chosen, c.transfer)
        if best is None or span < best[0] - 1e-9:
            best = (span, plans, chosen)
    assert best is not None  # k = 0 fits by its counts
    return OffloadPlans(best[1], best[2])
