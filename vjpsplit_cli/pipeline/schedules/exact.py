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
from dataclasses import dataclass, field
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


_Key = tuple[Kind, int, int]  # an operation of the program: (kind, stage, microbatch)


@dataclass
class _Program:
    """The mixed-integer program being built: its variables and its rows ``lows <= row . x <= highs``.

    The variables: each operation's start (``idx``), then the makespan (``n_t - 1``), then one binary per pair
    of one worker's operations of different microbatches (``pair``; 1 when the pair's first runs first).
    """

    ops: list[_Key]
    idx: dict[_Key, int]
    pair: dict[tuple[_Key, _Key], int]
    rows: list[dict[int, float]] = field(default_factory=list)
    lows: list[float] = field(default_factory=list)
    highs: list[float] = field(default_factory=list)

    @property
    def n_t(self) -> int:
        """The number of continuous variables: the starts and the makespan."""
        return len(self.ops) + 1

    @property
    def n(self) -> int:
        """The number of variables."""
        return self.n_t + len(self.pair)

    def add(self, coef: dict[int, float], lo: float, hi: float = np.inf) -> None:
        """Add the row ``lo <= coef . x <= hi``."""
        self.rows.append(coef)
        self.lows.append(lo)
        self.highs.append(hi)

    def after(self, b: _Key, a: _Key, lag: float) -> None:
        """Add ``t_b >= t_a + lag``."""
        self.add({self.idx[b]: 1.0, self.idx[a]: -1.0}, lag)

    def before(self, a: _Key, b: _Key) -> tuple[int, float, float]:
        """(variable, coefficient, constant): the 0/1 expression 'a runs before b' as coefficient * y + constant."""
        if (a, b) in self.pair:
            return self.n_t + self.pair[(a, b)], 1.0, 0.0
        return self.n_t + self.pair[(b, a)], -1.0, 1.0


def _variables(num_stages: int, microbatches: int, kinds: Sequence[Kind]) -> _Program:
    """The program's variables for every operation of ``kinds`` on every stage, and no rows yet."""
    ops = [(k, s, i) for s in range(num_stages) for k in kinds for i in range(microbatches)]
    # One binary per pair of one worker's operations of different microbatches (a microbatch's own F, B, W
    # go in that order anyway).
    pairs = [
        (a, b)
        for s in range(num_stages)
        for a, b in itertools.combinations([o for o in ops if o[1] == s], 2)
        if a[2] != b[2]
    ]
    return _Program(ops, {o: n for n, o in enumerate(ops)}, {p: n for n, p in enumerate(pairs)})


def _dur(costs: Costs, k: Kind, s: int) -> float:
    """The time of one operation of kind ``k`` on stage ``s``."""
    return costs.duration(Op(k, 0, s))


def _add_dependencies(program: _Program, costs: Costs, microbatches: int, kinds: Sequence[Kind]) -> None:
    """Each operation starts after what it reads (a result from another worker ``comm`` later); the makespan is
    at least each microbatch's last end."""
    S, c = costs.num_stages, costs.comm
    back = kinds[1]  # the operation that hands on the cotangent
    for s in range(S):
        for i in range(microbatches):
            if s > 0:
                program.after((Kind.F, s, i), (Kind.F, s - 1, i), _dur(costs, Kind.F, s - 1) + c)
            if s < S - 1:
                program.after((back, s, i), (back, s + 1, i), _dur(costs, back, s + 1) + c)
            program.after((back, s, i), (Kind.F, s, i), _dur(costs, Kind.F, s))
            if Kind.W in kinds:
                program.after((Kind.W, s, i), (back, s, i), _dur(costs, back, s))
            last = kinds[-1]
            program.add({program.n_t - 1: 1.0, program.idx[(last, s, i)]: -1.0}, _dur(costs, last, s))


def _add_one_at_a_time(program: _Program, costs: Costs, microbatches: int) -> None:
    """A worker's operations never overlap: each pair's binary says which goes first (big-M rows)."""
    S = costs.num_stages
    big = sum(_dur(costs, k, s) for k, s, _ in program.ops) + 2 * S * microbatches * costs.comm + 1.0
    for (first, second), p in program.pair.items():
        y = program.n_t + p
        idx = program.idx
        # y = 1: first runs first, t_2 >= t_1 + d_1 - big (1 - y); y = 0: t_1 >= t_2 + d_2 - big y.
        program.add({idx[second]: 1.0, idx[first]: -1.0, y: -big}, _dur(costs, *first[:2]) - big)
        program.add({idx[first]: 1.0, idx[second]: -1.0, y: big}, _dur(costs, *second[:2]))


def _add_memory_limits(program: _Program, limits: Sequence[int], microbatches: int, release: Kind) -> None:
    """The microbatches a worker holds when each F starts (the Fs before it, less the ``release``s before it)
    stay within its limit."""
    m = microbatches
    for s, limit in enumerate(limits):
        if limit >= m:
            continue
        for i in range(m):
            coef: dict[int, float] = {}
            const = 0.0
            for j in range(m):
                if j == i:
                    continue
                for other, sign in (((Kind.F, s, j), 1.0), ((release, s, j), -1.0)):
                    v, k, k0 = program.before(other, (Kind.F, s, i))
                    coef[v] = coef.get(v, 0.0) + sign * k
                    const += sign * k0
            program.add(coef, -np.inf, limit - 1 - const)


def _bounds(program: _Program, microbatches: int) -> tuple[np.ndarray, np.ndarray]:
    """The variables' bounds: starts non-negative, binaries 0/1, worker 0's forwards fixed in microbatch order."""
    lower = np.zeros(program.n)
    upper = np.r_[np.full(program.n_t, np.inf), np.ones(len(program.pair))]
    for i in range(1, microbatches):
        v, k, _ = program.before((Kind.F, 0, i - 1), (Kind.F, 0, i))
        lower[v] = upper[v] = 1.0 if k > 0 else 0.0
    return lower, upper


def _matrix(program: _Program) -> np.ndarray:
    """The program's rows as a dense matrix."""
    matrix = np.zeros((len(program.rows), program.n))
    for r, coef in enumerate(program.rows):
        for v, x in coef.items():
            matrix[r, v] = x
    return matrix


def _plans(program: _Program, starts: np.ndarray, num_stages: int) -> list[list[Op]]:
    """Each worker's operations in the order of their starts in the solution."""
    return [
        [
            Op(k, i, s)
            for (k, _, i), _t in sorted(((o, starts[program.idx[o]]) for o in program.ops if o[1] == s), key=_order)
        ]
        for s in range(num_stages)
    ]


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
    kinds = (Kind.F, Kind.I, Kind.W) if split else (Kind.F, Kind.B)
    program = _variables(S, m, kinds)
    _add_dependencies(program, costs, m, kinds)
    _add_one_at_a_time(program, costs, m)
    _add_memory_limits(program, limits, m, release=kinds[-1])  # what lets a microbatch go: its W, or its whole B
    lower, upper = _bounds(program, m)
    objective = np.zeros(program.n)
    objective[program.n_t - 1] = 1.0
    res = milp(
        objective,
        constraints=LinearConstraint(_matrix(program), np.array(program.lows), np.array(program.highs)),
        integrality=np.r_[np.zeros(program.n_t), np.ones(len(program.pair))],
        bounds=Bounds(lower, upper),
        options={"time_limit": float(time_limit)},
    )
    if res.x is None:
        return None
    plans = _plans(program, res.x[: program.n_t - 1], S)
    bound = float(getattr(res, "mip_dual_bound", None) or res.fun)
    return Optimum(plans, float(res.fun), res.status == 0, bound if res.status != 0 else float(res.fun))


def _order(item: tuple[tuple[Kind, int, int], float]) -> tuple[float, int]:
    """A worker's operations by start time; a microbatch's own F, B (or I), W in that order where times tie."""
    (k, _, i), t = item
    return round(t, 9), _RANK[k]


_RANK = {Kind.F: 0, Kind.B: 1, Kind.I: 1, Kind.W: 2}
