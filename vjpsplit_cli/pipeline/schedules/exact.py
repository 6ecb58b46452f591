"""The exact optimum over every plan with one stage per worker, by a mixed-integer program (scipy's HiGHS).

What ``auto_schedule`` is measured against, not what it runs: the program grows
with the square of the microbatches (one binary per pair of one worker's
operations), so it proves optima on small cases (a few stages and microbatches)
and gives up, at its time limit, on larger ones.

The model. Each operation (F and B, or F, I and W where the backward is split, of every
microbatch on every stage; worker ``s`` runs stage ``s``) has a start time. It
starts after what it reads (``ops.dependencies``), a result from another worker
``comm`` later; the operations of one worker never overlap (for each pair one
binary says which goes first); a worker's list is its operations in time order,
and the microbatches it holds when each F starts (the Fs before it, less the Ws,
or whole Bs, before it; ``modeled.memory_peaks``'s rule) stay within its limit.
The makespan is at least every operation's end. Any plan played as ``play``
plays it is such a timing, and the lists of an optimal timing, played, end no
later; so the program's optimum is the optimum over all plans. Worker 0's
forwards go in microbatch order: microbatches have equal costs, so naming them
in that order loses nothing.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from ...errors import VjpsplitError
from .costs import Costs
from .modeled import memory_limits
from .ops import Kind, Op


@dataclass(frozen=True)
class Optimum:
    """The program's answer: the best ``plans`` it found, their ``makespan``, and whether it ``proven`` them optimal.

    ``bound`` is the program's own lower bound (equal to ``makespan`` when proven).
    """

    plans: list[list[Op]]
    makespan: float
    proven: bool
    bound: float


def optimum(
    costs: Costs,
    microbatches: int,
    memory_limit: int | Sequence[int] | None = None,
    *,
    split: bool = True,
    time_limit: float = 60.0,
) -> Optimum | None:
    """The fastest plans with one stage per worker under ``costs`` within ``memory_limit``, by HiGHS.

    Args:
        costs: op times per stage and the send delay.
        microbatches: how many microbatches the step has.
        memory_limit: ``auto_schedule``'s form (an int, one per worker, or None).
        split: whether every backward is split into I and W (else each is a whole B, costing the costs' B + W).
        time_limit: seconds HiGHS may search; past it the best plans found are returned, unproven.

    Returns:
        The ``Optimum``, or None where HiGHS found no plan within the time limit.

    Raises:
        VjpsplitError: if ``scipy`` (which jax installs) is missing.
    """
    try:
        from scipy.optimize import Bounds, LinearConstraint, milp
    except ImportError as e:  # pragma: no cover - jax depends on scipy
        raise VjpsplitError("the exact optimum needs scipy (pip install scipy)") from e
    S, m = costs.num_stages, microbatches
    limits = memory_limits(memory_limit, S, m)
    back = Kind.I if split else Kind.B  # the operation that hands on the cotangent
    kinds = (Kind.F, back, Kind.W) if split else (Kind.F, back)

    def dur(k: Kind, s: int) -> float:
        return costs.duration(Op(k, 0, s))

    ops = [(k, s, i) for s in range(S) for k in kinds for i in range(m)]
    idx = {o: n for n, o in enumerate(ops)}
    # One binary per pair of one worker's operations of different microbatches (a microbatch's own F, B, W
    # go in that order anyway): 1 when the first of the pair runs first.
    pairs = [
        (a, b) for s in range(S) for a, b in itertools.combinations([o for o in ops if o[1] == s], 2) if a[2] != b[2]
    ]
    pair = {p: n for n, p in enumerate(pairs)}
    n_t, n_y = len(ops) + 1, len(pairs)
    n = n_t + n_y
    c = costs.comm
    big = sum(dur(k, s) for k, s, _ in ops) + 2 * S * m * c + 1.0
    rows: list[dict[int, float]] = []
    lows: list[float] = []
    highs: list[float] = []

    def add(coef: dict[int, float], lo: float, hi: float = np.inf) -> None:
        rows.append(coef)
        lows.append(lo)
        highs.append(hi)

    def after(b: tuple[Kind, int, int], a: tuple[Kind, int, int], lag: float) -> None:  # t_b >= t_a + lag
        add({idx[b]: 1.0, idx[a]: -1.0}, lag)

    for s in range(S):
        for i in range(m):
            if s > 0:
                after((Kind.F, s, i), (Kind.F, s - 1, i), dur(Kind.F, s - 1) + c)
            if s < S - 1:
                after((back, s, i), (back, s + 1, i), dur(back, s + 1) + c)
            after((back, s, i), (Kind.F, s, i), dur(Kind.F, s))
            if split:
                after((Kind.W, s, i), (back, s, i), dur(back, s))
            last = kinds[-1]
            add({n_t - 1: 1.0, idx[(last, s, i)]: -1.0}, dur(last, s))  # makespan >= the microbatch's last end
    for (first, second), p in pair.items():
        y = n_t + p
        # y = 1: first runs first, t_2 >= t_1 + d_1 - big (1 - y); y = 0: t_1 >= t_2 + d_2 - big y.
        add({idx[second]: 1.0, idx[first]: -1.0, y: -big}, dur(*first[:2]) - big)
        add({idx[first]: 1.0, idx[second]: -1.0, y: big}, dur(*second[:2]))

    def before(a: tuple[Kind, int, int], b: tuple[Kind, int, int]) -> tuple[int, float, float]:
        """(variable, coefficient, constant): the 0/1 expression 'a runs before b' as coefficient * y + constant."""
        if (a, b) in pair:
            return n_t + pair[(a, b)], 1.0, 0.0
        return n_t + pair[(b, a)], -1.0, 1.0

    release = kinds[-1]  # what lets a microbatch go: its W, or its whole B
    for s in range(S):
        if limits[s] >= m:
            continue
        for i in range(m):
            coef: dict[int, float] = {}
            const = 0.0
            for j in range(m):
                if j == i:
                    continue
                for other, sign in (((Kind.F, s, j), 1.0), ((release, s, j), -1.0)):
                    v, k, k0 = before(other, (Kind.F, s, i))
                    coef[v] = coef.get(v, 0.0) + sign * k
                    const += sign * k0
            add(coef, -np.inf, limits[s] - 1 - const)
    lower = np.zeros(n)
    upper = np.r_[np.full(n_t, np.inf), np.ones(n_y)]
    for i in range(1, m):  # worker 0's forwards in microbatch order
        v, k, _ = before((Kind.F, 0, i - 1), (Kind.F, 0, i))
        lower[v] = upper[v] = 1.0 if k > 0 else 0.0
    matrix = np.zeros((len(rows), n))
    for r, coef in enumerate(rows):
        for v, x in coef.items():
            matrix[r, v] = x
    objective = np.zeros(n)
    objective[n_t - 1] = 1.0
    res = milp(
        objective,
        constraints=LinearConstraint(matrix, np.array(lows), np.array(highs)),
        integrality=np.r_[np.zeros(n_t), np.ones(n_y)],
        bounds=Bounds(lower, upper),
        options={"time_limit": float(time_limit)},
    )
    if res.x is None:
        return None
    starts = res.x[: n_t - 1]
    plans = [
        [Op(k, i, s) for (k, _, i), _t in sorted(((o, starts[idx[o]]) for o in ops if o[1] == s), key=_order)]
        for s in range(S)
    ]
    bound = float(getattr(res, "mip_dual_bound", None) or res.fun)
    return Optimum(plans, float(res.fun), res.status == 0, bound if res.status != 0 else float(res.fun))


def _order(item: tuple[tuple[Kind, int, int], float]) -> tuple[float, int]:
    """A worker's operations by start time; a microbatch's own F, B (or I), W in that order where times tie."""
    (k, _, i), t = item
    return round(t, 9), _RANK[k]


_RANK = {Kind.F: 0, Kind.B: 1, Kind.I: 1, Kind.W: 2}
