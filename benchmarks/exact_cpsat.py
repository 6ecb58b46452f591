"""The exact optimum over every plan with one stage per worker, by OR-Tools' CP-SAT (the grid's "optimum" column).

    pip install ortools        # the `exact` extra; without it the grid proves optima by the bound and HiGHS only

The model is ``vjpsplit_cli.pipeline.schedules.exact``'s (see its docstring), in
CP-SAT's terms: an interval per operation, no overlap on a worker, the
precedences of ``ops.dependencies`` with ``comm`` between workers, and the
microbatches a worker holds (each from its F's start to its W's end) as a
cumulative resource of the worker's limit. Times are scaled to integers (costs
here are multiples of 1/``SCALE``). One search worker with a fixed seed, started
from auto's own plans: a proven optimum is the optimum whatever the run; an
unproven one is only the best found in the time limit, and the cell says so.
"""

from __future__ import annotations

from vjpsplit_cli.pipeline import Costs, simulate
from vjpsplit_cli.pipeline.schedules.modeled import memory_limits
from vjpsplit_cli.pipeline.schedules.ops import Op

SCALE = 20


def available() -> bool:
    """Whether ``ortools`` is installed."""
    try:
        import ortools.sat.python.cp_model  # noqa: F401
    except ImportError:
        return False
    return True


def optimum(
    costs: Costs, m: int, limit: int | None, hint: list[list[Op]], time_limit: float = 10.0
) -> tuple[float, bool]:
    """(the best makespan CP-SAT finds, whether it proved it optimal) for split backwards, hinted with ``hint``."""
    from ortools.sat.python import cp_model

    S = costs.num_stages
    q = lambda x: int(round(x * SCALE))  # noqa: E731
    dur = {"F": [q(x) for x in costs.forward], "B": [q(x) for x in costs.backward], "W": [q(x) for x in costs.weight]}
    c = q(costs.comm)
    model = cp_model.CpModel()
    horizon = sum(m * (dur["F"][s] + dur["B"][s] + dur["W"][s]) for s in range(S)) + 2 * S * m * c
    start, box = {}, {}
    for s in range(S):
        for k in "FBW":
            for i in range(m):
                start[k, s, i] = model.NewIntVar(0, horizon, f"{k}{s}_{i}")
                box[k, s, i] = model.NewFixedSizeIntervalVar(start[k, s, i], dur[k][s], f"i{k}{s}_{i}")
    limits = memory_limits(limit, S, m)
    span = model.NewIntVar(0, horizon, "makespan")
    for s in range(S):
        model.AddNoOverlap([box[k, s, i] for k in "FBW" for i in range(m)])
        for i in range(m):
            if s > 0:
                model.Add(start["F", s, i] >= start["F", s - 1, i] + dur["F"][s - 1] + c)
            if s < S - 1:
                model.Add(start["B", s, i] >= start["B", s + 1, i] + dur["B"][s + 1] + c)
            model.Add(start["B", s, i] >= start["F", s, i] + dur["F"][s])
            model.Add(start["W", s, i] >= start["B", s, i] + dur["B"][s])
            model.Add(span >= start["W", s, i] + dur["W"][s])
        if limits[s] < m:
            held = []
            for i in range(m):
                size = model.NewIntVar(0, horizon, "")
                model.Add(size == start["W", s, i] + dur["W"][s] - start["F", s, i])
                held.append(model.NewIntervalVar(start["F", s, i], size, start["W", s, i] + dur["W"][s], ""))
            model.AddCumulative(held, [1] * m, limits[s])
    for i in range(1, m):  # microbatches have equal costs: name them in worker 0's order of forwards
        model.Add(start["F", 0, i] >= start["F", 0, i - 1] + dur["F"][0])
    model.Minimize(span)
    order = {o.mb: j for j, o in enumerate(o for o in hint[0] if o.kind == "F")}
    for e in simulate(hint, S, costs):
        kind = "B" if e.kind == "I" else str(e.kind)  # the model's B is the input part: every backward is split
        model.AddHint(start[kind, e.worker, order[e.mb]], q(e.start))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return float("inf"), False
    return solver.ObjectiveValue() / SCALE, status == cp_model.OPTIMAL
