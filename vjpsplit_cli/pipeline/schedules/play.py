"""The plans' execution order: every worker runs its list in order, each operation once what it reads exists.

``sweep`` walks the per-worker lists in one global order that keeps each
worker's own order and puts every operation after those it depends on
(``ops.dependencies``, the only statement of that rule), and gives each a start
and an end: it starts when its worker is free and its inputs have arrived, a
result from another worker ``comm`` later. Everything that plays plans is built
on it:

* the dispatcher (``runtime.dispatch.walk``) submits the operations in its order;
* ``check_plans`` learns from it whether user plans deadlock, and where;
* ``simulate`` / ``play`` give the timeline under any op times: a function of the
  operation, or ``Costs`` per stage and kind (a whole backward costs B + W) with a
  delay per send between workers, the form an automatic scheduler evaluates
  plans with;
* ZB-H1 places its W passes with a ``Fill``: a rule that may run another
  operation where the worker would wait.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Protocol, Sequence

from ...errors import VjpsplitError
from .costs import Costs
from .ops import Kind, Op, OpKey, action_name, dependencies
from .timeline import Event, one_per_op

Duration = Callable[[Op], float]
Step = tuple[int, Op, float, float, tuple[OpKey, ...]]  # worker, op, start, end, what it waited for


class Fill(Protocol):
    """A rule that may run another operation on a worker before its next one (ZB-H1's W placement)."""

    def insert(self, worker: int, next_op: Op | None, free: float, ready: float) -> Op | None:
        """The operation to run first on ``worker``, free at ``free``, whose ``next_op`` (None: its list is
        done) could start at ``ready``; None to run ``next_op`` now."""
        ...

    def ran(self, worker: int, op: Op) -> None:
        """``op`` ran on ``worker``."""
        ...


@dataclass(frozen=True)
class Played:
    """Plans played: every operation's ``Event`` in play order, and what each worker ran (with any filled in)."""

    events: list[Event]
    plans: list[list[Op]]


def _zero(op: Op) -> float:
    return 0.0


def _ready(
    deps: Sequence[OpKey], ends: Mapping[OpKey, float], where: Mapping[int, int], w: int, comm: float
) -> float | None:
    """When all of ``deps`` (an operation's dependencies) are on worker ``w``; None while one has not run."""
    t = 0.0
    for d in deps:
        e = ends.get(d)
        if e is None:
            return None
        if comm and where.get(d.stage, w) != w:
            e += comm
        if e > t:
            t = e
    return t


def sweep(
    plans: Sequence[Sequence[Op]],
    num_stages: int,
    duration: Duration = _zero,
    comm: float = 0.0,
    fill: Fill | None = None,
) -> Iterator[Step]:
    """``(worker, op, start, end, deps)`` for every operation, in an order that respects every dependency.

    Each worker's list runs in its order; an operation starts when its worker is free and
    every result it reads exists (plus ``comm`` when that came from another worker).
    ``deps`` is ``ops.dependencies(op)``. Raises one ``VjpsplitError`` naming the rank and
    action where the plans deadlock.
    """
    S, n = num_stages, len(plans)
    where: dict[int, int] = {}
    for w, ops in enumerate(plans):
        for o in ops:
            where.setdefault(o.stage, w)
    deps = [[dependencies(op, S) for op in ops] for ops in plans]
    ends: dict[OpKey, float] = {}
    free = [0.0] * n
    idx = [0] * n

    def place(w: int, op: Op, ready: float, needs: tuple[OpKey, ...]) -> Step:
        start = max(free[w], ready)
        end = start + duration(op)
        ends[op.key] = free[w] = end
        if fill is not None:
            fill.ran(w, op)
        return w, op, start, end, needs

    def filled(f: Fill, w: int, op: Op | None, ready: float) -> Iterator[Step]:
        while (extra := f.insert(w, op, free[w], ready)) is not None:
            needs = dependencies(extra, S)
            r = _ready(needs, ends, where, w, comm)
            if r is None:
                raise VjpsplitError(f"worker {w}: a filled-in {action_name(extra)} runs before its inputs")
            yield place(w, extra, r, needs)

    moved = True
    while moved:
        moved = False
        for w in range(n):
            ops, wdeps = plans[w], deps[w]
            while idx[w] < len(ops):
                op, needs = ops[idx[w]], wdeps[idx[w]]
                ready = _ready(needs, ends, where, w, comm)
                if ready is None:
                    break
                if fill is not None:
                    yield from filled(fill, w, op, ready)
                yield place(w, op, ready, needs)
                idx[w] += 1
                moved = True
    if any(idx[w] < len(plans[w]) for w in range(n)):
        raise _deadlock(plans, S, idx, ends)
    if fill is not None:
        for w in range(n):
            yield from filled(fill, w, None, free[w])


def _deadlock(plans: Sequence[Sequence[Op]], S: int, idx: Sequence[int], ends: Mapping[OpKey, float]) -> VjpsplitError:
    """The error for plans stuck at ``idx``: a rank waiting on its own later action is the cause, else the first."""
    stuck = []
    for r, ops in enumerate(plans):
        if idx[r] < len(ops):
            o = ops[idx[r]]
            need = next(d for d in dependencies(o, S) if d not in ends)
            own = any(x.key == need for x in ops)
            stuck.append((not own, r, o, need))
    _, r, o, need = min(stuck, key=lambda t: (t[0], t[1]))
    # The awaited operation by its own name (a cotangent's producer may be an I), where the plans have it.
    named = next((action_name(x) for ops in plans for x in ops if x.key == need), None)
    return VjpsplitError(
        f"the schedule deadlocks: rank {r}'s action {action_name(o)} waits for "
        f"{named or f'{need.stage}{need.kind}{need.mb}'}, which never runs before it; reorder the plans"
    )


def _duration_of(num_stages: int, costs: Duration | Costs | Mapping[str, object] | None) -> tuple[Duration, float]:
    """A duration function and the send delay from whatever form the times come in."""
    if costs is None:
        return _zero, 0.0
    if callable(costs) and not isinstance(costs, Costs):
        return costs, 0.0
    c = Costs.of(costs, num_stages)
    return c.duration, c.comm


def play(
    plans: Sequence[Sequence[Op]],
    num_stages: int,
    costs: Duration | Costs | Mapping[str, object] | None = None,
    *,
    comm: float | None = None,
    fill: Fill | None = None,
) -> Played:
    """Play ``plans`` on one device per worker; see ``sweep``.

    ``costs``: each operation's time, as a function of the ``Op``, as ``Costs``, or as
    ``{"F": [...], "B": [...], "W": [...], "comm": c}`` per stage (a whole backward costs
    B + W); None: every operation takes no time. ``comm`` (default: the costs' own, else
    0) is the delay of one result sent to another worker. ``fill``: see ``Fill``.
    """
    duration, own_comm = _duration_of(num_stages, costs)
    delay = own_comm if comm is None else float(comm)
    events: list[Event] = []
    ran: list[list[Op]] = [[] for _ in plans]
    for w, op, start, end, _ in sweep(plans, num_stages, duration, delay, fill):
        events.append(Event(w, op.kind, op.mb, start, end, op.stage))
        ran[w].append(op)
    return Played(events, ran)


def simulate(
    plans: Sequence[Sequence[Op]],
    num_stages: int,
    costs: Duration | Costs | Mapping[str, object],
    *,
    comm: float | None = None,
) -> list[Event]:
    """The timeline of ``plans`` with one device per worker (``play``'s events).

    Each op starts when its worker is free and its inputs exist. Raises if the lists deadlock.

    Args:
        plans: One sequence of ``Op`` per worker, in the order it runs them.
        num_stages: The pipeline's stage count.
        costs: Each operation's time: a function of the ``Op``, a ``Costs``, or
            ``{"F": [...], "B": [...], "W": [...], "comm": c}`` per stage (a whole
            backward costs B + W).
        comm: The delay of one result sent to another worker; ``None`` takes the
            costs' own (0 for a function).

    Returns:
        One ``Event`` per operation, in the costs' time unit.

    Raises:
        VjpsplitError: If the plans deadlock (naming the rank and the action that
            waits), or the costs are malformed (see ``Costs.of``).
    """
    return play(plans, num_stages, costs, comm=comm).events


def replay(events: Sequence[Event], plans: Sequence[Sequence[Op]], num_stages: int) -> list[Event]:
    """The timeline ``plans`` would have with one device per worker, given each operation's measured time (on a
    stage with replicas, each on its own device, its first replica's). A B that ran as its input part then its
    weight part (a Ray worker's B that hands its cotangent on early) takes both their times."""
    dur = {(e.stage, e.kind, e.mb): e.end - e.start for e in one_per_op(events)}

    def seconds(op: Op) -> float:
        got = dur.get((op.stage, op.kind, op.mb))
        if got is None and op.kind == Kind.B:
            return dur.get((op.stage, Kind.I, op.mb), 0.0) + dur.get((op.stage, Kind.W, op.mb), 0.0)
        return 0.0 if got is None else got

    return simulate(plans, num_stages, seconds)
