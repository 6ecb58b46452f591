"""Cutting a function without marks into N stages of balanced estimated cost, where few bytes cross.

The simplest honest form of Alpa's automatic layer construction, over the
top-level equation sequence: first the smallest achievable largest-stage cost
``B`` (FLOP estimates, ``cut.eqn_cost``); then, allowing stages up to
``B * (1 + TOLERANCE)``, the smallest byte count that every cut can keep to
(bytes live across a cut: values made before it and read after; parameters
and batch inputs are read where needed, so they never cross); then each stage
is filled as far as those two bounds allow, which puts cuts at the ends of
layers rather than inside them.
"""

from __future__ import annotations

from typing import Sequence

from jax.extend import core as jcore

from ...errors import VjpsplitError
from .costmodel import eqn_cost, nbytes
from .cut import Traced

TOLERANCE = 0.0  # how far above the best largest-stage cost a cut may go to cross fewer bytes


def crossing_bytes(traced: Traced) -> list[int]:
    """Bytes live after each top-level equation: made at or before it, read after it."""
    eqns = traced.closed.jaxpr.eqns
    made = {v: i for i, e in enumerate(eqns) for v in e.outvars}
    last: dict = {}
    for i, e in enumerate(eqns):
        for v in e.invars:
            if not isinstance(v, jcore.Literal) and v in made:
                last[v] = i
    for v in traced.closed.jaxpr.outvars:
        if not isinstance(v, jcore.Literal) and v in made:
            last[v] = len(eqns)
    delta = [0] * (len(eqns) + 1)
    for v, i in made.items():
        if v in last and last[v] > i:
            b = nbytes(v.aval)
            delta[i] += b
            delta[last[v]] -= b
    out, live = [], 0
    for i in range(len(eqns)):
        live += delta[i]
        out.append(live)
    return out


def _fill(costs: Sequence[float], allowed: Sequence[bool], bound: float, n: int) -> list[int] | None:
    """Ends of at most ``n`` stages, each filled as far as ``bound`` allows, cut only where ``allowed``."""
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    ends: list[int] = []
    start, last = 0, len(costs)
    while prefix[last] - prefix[start] > bound:
        if len(ends) == n - 1:
            return None
        end = None
        for e in range(start, last - 1):
            if prefix[e + 1] - prefix[start] > bound:
                break
            if allowed[e]:
                end = e
        if end is None:
            return None
        ends.append(end)
        start = end + 1
    return ends


def balanced_ends(traced: Traced, n: int) -> list[int]:
    """The equations after which ``n`` balanced stages end (``n - 1`` of them)."""
    eqns = traced.closed.jaxpr.eqns
    if not isinstance(n, int) or n < 1:
        raise VjpsplitError(f"stages={n!r}: pass a positive number of stages")
    if n > len(eqns):
        raise VjpsplitError(f"stages={n} but the function has only {len(eqns)} operations; use fewer stages")
    if n == 1:
        return []
    costs = [max(eqn_cost(e), 1.0) for e in eqns]
    cross = crossing_bytes(traced)
    anywhere = [True] * len(eqns)
    lo, hi = max(costs), sum(costs)
    for _ in range(60):  # bisection on the largest-stage cost
        mid = (lo + hi) / 2
        if _fill(costs, anywhere, mid, n) is not None:
            hi = mid
        else:
            lo = mid
    bound = hi * (1 + TOLERANCE)
    ends = None
    for limit in sorted(set(cross)):
        ends = _fill(costs, [b <= limit for b in cross], bound, n)
        if ends is not None:
            break
    if ends is None:  # pragma: no cover - the last limit allows every point, which the bisection found feasible
        ends = _fill(costs, anywhere, hi, n) or []
    while len(ends) < n - 1:  # fewer stages filled the bound: split the costliest further
        bounds = [-1, *ends, len(eqns) - 1]
        spans = [(sum(costs[a + 1 : b + 1]), a, b) for a, b in zip(bounds, bounds[1:]) if b - a > 1]
        if not spans:
            raise VjpsplitError(f"cannot cut {len(eqns)} operations into {n} non-empty stages")
        _, a, b = max(spans)
        mid = min(range(a + 1, b), key=lambda i: (abs(sum(costs[a + 1 : i + 1]) - sum(costs[i + 1 : b + 1])), cross[i]))
        ends = sorted([*ends, mid])
    return ends
