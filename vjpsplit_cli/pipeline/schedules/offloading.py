"""Planned offload: which (stage, microbatch) residuals leave their device so plans fit a byte limit soonest.

The model (what ``auto_schedule`` plans under with ``memory_limit_bytes``): a
worker's stage holds ``bytes[s]`` per microbatch from its F until its W (or whole
B), as ``memory_peaks`` counts microbatches, measured at every operation's
boundary. An offloaded microbatch's residuals start leaving when its F ends and
are away once ``bytes[s] / out`` seconds have passed; they start coming back when
the operation before its B starts (the runtime's ``Offloader.before``) and B
cannot start before they are back, ``bytes[s] / back`` seconds later. So it is
away at the boundaries after the operations that end once its copy out is done
and before the operation ahead of its B. A microbatch whose B is its F's next or
second operation is never offloaded (the runtime keeps it too: it would be away at no boundary).
(B here is the microbatch's backward on the stage: the whole one, or its input part I.)

The cost: the copy back lengthens the operation before the B to at least the
copy's time (``play`` has no other way to say "B waits for something that started
with the operation before it"); the copy out runs beside compute. That is
conservative where the operation before the B sends a result (its receiver sees
it later than it would).

No plan holds less than one microbatch's bytes at the boundary after its F (its
residuals are still on the device there), and ``memory_limit=1`` holds exactly
that without offload, so offload never makes a limit feasible that was not: it
lets more microbatches be in flight under the same bytes, which ends sooner.
"""

from __future__ import annotations

from typing import Sequence

from .costs import Costs
from .ops import BACKWARDS, RELEASES, Kind, Op, OpKey
from .play import play
from .timeline import Event


class OffloadPlans(list):  # type: ignore[type-arg]
    """Plans (one list of ``Op`` per worker) and the (stage, microbatch) pairs whose residuals they offload.

    A list like any plans: every runner and ``write_schedule`` take it; ``offloaded`` is what
    ``Offload(pairs=...)`` runs and ``write_schedule`` records in a file beside the CSV (``<csv>.offload.json``).

    Args:
        plans: One list of ``Op`` per worker.
        offloaded: The (stage, microbatch) pairs whose residuals leave their device.
        reason: Where ``offloaded`` is empty, why nothing is offloaded, in words (None: not said).
    """

    offloaded: frozenset[tuple[int, int]]

    def __init__(self, plans: Sequence[Sequence[Op]], offloaded: object = (), reason: str | None = None):
        super().__init__([list(ops) for ops in plans])
        self.offloaded = frozenset((int(s), int(m)) for s, m in offloaded)  # type: ignore[attr-defined]
        self.reason = None if self.offloaded else reason


def _before_b(ops: Sequence[Op]) -> dict[int, int]:
    """Per microbatch of the worker's stage, the index of the operation before its B or I (where the copy back
    starts)."""
    out = {}
    for i, o in enumerate(ops):
        if o.kind in BACKWARDS and i > 0:
            out[o.mb] = i - 1
    return out


def offloadable(ops: Sequence[Op]) -> list[int]:
    """The microbatches of a worker's list that can leave: those whose B (or I) is not its F's next or second
    operation (the runtime keeps those: their copy back would start as soon as they left)."""
    pos = {o.key: i for i, o in enumerate(ops)}  # an I keyed as its B (``ops.OpKey``)
    return [o.mb for o in ops if o.kind == Kind.F and pos.get(_back(o), -1) - pos[o.key] > 2]


def _back(op: Op) -> OpKey:
    """The key of ``op``'s microbatch's backward (B or I) on its stage."""
    return OpKey(Kind.B, op.mb, op.stage)


def byte_peaks(
    plans: Sequence[Sequence[Op]],
    nbytes: Sequence[int],
    offloaded: frozenset[tuple[int, int]],
    costs: Costs,
    rates: tuple[float, float] | None,
) -> list[int]:
    """Per worker, the most bytes its stage's residuals hold on its device at an operation's boundary (see module)."""
    ends = {(e.stage, e.kind, e.mb): e.end for e in _played(plans, costs, nbytes, offloaded, rates)}
    peaks = []
    for ops in plans:
        s = ops[0].stage if ops else 0
        out_time = 0.0 if rates is None else nbytes[s] / rates[0]
        before = _before_b(ops)
        held: set[int] = set()
        peak = 0
        for i, o in enumerate(ops):
            if o.kind == Kind.F:
                held.add(o.mb)
            elif o.kind in RELEASES:
                held.discard(o.mb)
            t = ends[(o.stage, o.kind, o.mb)]

            def away(mb: int) -> bool:
                # Out once its copy is done (never at its own F's boundary), back from the op before its B.
                return (
                    (s, mb) in offloaded
                    and mb in before
                    and not (o.kind == Kind.F and o.mb == mb)
                    and t >= ends[(s, Kind.F, mb)] + out_time - 1e-12
                    and i < before[mb]
                )

            peak = max(peak, nbytes[s] * sum(1 for mb in held if not away(mb)))
        peaks.append(peak)
    return peaks


def _played(
    plans: Sequence[Sequence[Op]],
    costs: Costs,
    nbytes: Sequence[int],
    offloaded: frozenset[tuple[int, int]],
    rates: tuple[float, float] | None,
) -> list[Event]:
    S = costs.num_stages
    longer: dict[tuple[str, int, int], float] = {}
    for ops in plans:
        for mb, i in _before_b(ops).items():
            s = ops[i].stage
            if (s, mb) in offloaded and rates is not None:
                o = ops[i]
                longer[(o.kind, o.mb, o.stage)] = nbytes[s] / rates[1]

    def duration(op: Op) -> float:
        d = costs.duration(op)
        return max(d, longer.get((op.kind, op.mb, op.stage), 0.0))

    return list(play(plans, S, duration, comm=costs.comm).events)


def offload_makespan(
    plans: Sequence[Sequence[Op]],
    costs: Costs,
    nbytes: Sequence[int],
    offloaded: frozenset[tuple[int, int]],
    rates: tuple[float, float] | None,
) -> float:
    """When ``plans`` end under ``costs`` with ``offloaded``'s copies back charged as the module says."""
    return max((e.end for e in _played(plans, costs, nbytes, offloaded, rates)), default=0.0)


def choose_offload(
    plans: Sequence[Sequence[Op]],
    costs: Costs,
    nbytes: Sequence[int],
    limits: Sequence[int],
    rates: tuple[float, float],
) -> frozenset[tuple[int, int]] | None:
    """The pairs to offload so ``plans`` fit ``limits`` (bytes per worker), added one at a time: on each worker
    over its limit, the offloadable microbatch away longest (its F earliest before its B); None if even every
    offloadable one leaves the plans over a limit."""
    chosen: set[tuple[int, int]] = set()
    while True:
        peaks = byte_peaks(plans, nbytes, frozenset(chosen), costs, rates)
        over = [w for w, (p, lim) in enumerate(zip(peaks, limits)) if p > lim]
        if not over:
            return frozenset(chosen)
        added = False
        for w in over:
            ops = plans[w]
            if not ops:
                continue
            s = ops[0].stage
            pos = {o.key: i for i, o in enumerate(ops)}  # an I keyed as its B
            left = [mb for mb in offloadable(ops) if (s, mb) not in chosen]
            if left:
                mb = max(left, key=lambda k: (pos[OpKey(Kind.B, k, s)] - pos[OpKey(Kind.F, k, s)], -k))
                chosen.add((s, mb))
                added = True
        if not added:
            return None
