"""Automatic schedules on issue #37's grid: auto_schedule's modeled makespan vs the best fitting built-in vs a bound.

    python -m benchmarks --only autoschedule          # the table, the planning times, the timelines, measured
    python -m benchmarks.autoschedule [--quick] [--png DIR] [--no-train]

The grid: 2, 4 and 8 stages; S, 2S and 4S microbatches; costs uniform (F = B = W
= 1), "B > F > W" (F = 1, B = 1.5, W = 0.5), "B ≈ W" (F = 1, B = 1.1, W = 0.9)
and "heavy ends" (F = B = W = 2 on the first and last stage, 1 elsewhere); sends
of 0 and 0.25; memory limits S, 2S, none and S/2 microbatches per worker. The
optimum of a cell (over every plan with one stage per worker) is proven where
auto's plans meet ``lower_bound``, else by CP-SAT (``benchmarks.exact_cpsat``,
where ``ortools`` is installed: 10 s per cell, one worker, started from auto's
plans), else, on cells of at most 2 stages and 4 microbatches, by HiGHS
(``schedules.exact``); a cell no solver proves shows "—". Every makespan is modeled (the cost
model of ``vjpsplit_cli.pipeline.costmodel``, time in units of one forward), not
measured: these are plans, compared under the costs they were made for. A
built-in fits when its memory peak (F until W, or until a whole B) is within the
limit. Planning times are CPU seconds (``time.process_time``) of whole
``auto_schedule`` calls, the median of a few. Then, measured: the Trainer with
``schedule="auto"`` against 1F1B and ZB-H1 on a mid-size GPT
(``benchmarks.autotrain``).
"""

from __future__ import annotations

import math
import random
import statistics
import sys
import time
from pathlib import Path

from benchmarks import autotrain, exact_cpsat
from vjpsplit_cli.pipeline import Costs, auto_schedule, plot_timeline, simulate
from vjpsplit_cli.pipeline.schedules.auto import BUILT_INS
from vjpsplit_cli.pipeline.schedules.listscheduler import search
from vjpsplit_cli.pipeline.schedules.exact import optimum
from vjpsplit_cli.pipeline.schedules.modeled import lower_bound, memory_limits, memory_peaks, modeled_makespan
from vjpsplit_cli.pipeline import schedule
from vjpsplit_cli.pipeline.schedules.catalog import LABELS
from vjpsplit_cli.pipeline.schedules.timeline import Event

SHAPES = ("uniform", "B > F > W", "B ≈ W", "heavy ends")
DOCS = Path(__file__).resolve().parents[1] / "docs"


def costs_of(shape: str, S: int, comm: float) -> dict:
    if shape == "uniform":
        return {"F": 1.0, "B": 1.0, "W": 1.0, "comm": comm}
    if shape == "B > F > W":
        return {"F": 1.0, "B": 1.5, "W": 0.5, "comm": comm}
    if shape == "B ≈ W":
        return {"F": 1.0, "B": 1.1, "W": 0.9, "comm": comm}
    heavy = [2.0 if s in (0, S - 1) else 1.0 for s in range(S)]
    return {"F": heavy, "B": heavy, "W": heavy, "comm": comm}


def span(plans, costs) -> float:
    return modeled_makespan(plans, costs)


def cell(S: int, m: int, shape: str, comm: float, limit: int | None) -> dict:
    """One grid cell: auto's makespan (and the list scheduler's alone), the best fitting built-in, the bound."""
    costs = Costs.of(costs_of(shape, S, comm), S)
    limits = memory_limits(limit, S, m)
    plans = auto_schedule(S, m, costs=costs, memory_limit=limit)
    _, raw, _ = search(costs, m, limits, [True] * S)
    fits = {}
    for name in BUILT_INS:
        p = schedule(name, S, m)
        if all(a <= b for a, b in zip(memory_peaks(p), limits)):
            fits[name] = span(p, costs)
    best = min(fits, key=lambda n: fits[n]) if fits else None
    auto, bound = span(plans, costs), lower_bound(costs, m, limits)
    return {
        "auto": auto,
        "raw": raw,
        "best": best,
        "best_span": fits.get(best, math.nan) if best else math.nan,
        "bound": bound,
        "peak": max(memory_peaks(plans)),
        "optimum": proven_optimum(costs, m, limit, plans, auto, bound),
    }


def proven_optimum(costs: Costs, m: int, limit: int | None, plans, auto: float, bound: float) -> float | None:
    """The cell's optimum where the bound, CP-SAT or HiGHS proves it, else None."""
    if auto <= bound + 1e-9:
        return auto
    if exact_cpsat.available():
        value, proven = exact_cpsat.optimum(costs, m, limit, plans)
        return min(value, auto) if proven else None
    if costs.num_stages <= 2 and m <= 4:
        found = optimum(costs, m, limit, time_limit=30)
        return found.makespan if found is not None and found.proven else None
    return None


def grid(quick: bool = False) -> list[tuple[tuple, dict]]:
    """The docs' grid of cells (quick: its rows of 2 and 4 stages with S microbatches, what CI runs to prove the
    section works)."""
    out = []
    for S in (2, 4) if quick else (2, 4, 8):
        for m in (S,) if quick else (S, 2 * S, 4 * S):
            for shape in SHAPES:
                for comm in (0.0, 0.25):
                    for limit in (S, 2 * S, None, max(1, S // 2)):
                        out.append(((S, m, shape, comm, limit), cell(S, m, shape, comm, limit)))
    return out


def _entry(r: dict) -> str:
    opt = "—" if r["optimum"] is None else f"{r['optimum']:g}"
    if r["best"] is None:
        return f"**{r['auto']:g}** · none fits · {r['bound']:g} · {opt}"
    return f"**{r['auto']:g}** · {r['best_span']:g} {LABELS[r['best']]} · {r['bound']:g} · {opt}"


def table(rows: list[tuple[tuple, dict]]) -> str:
    by_key: dict[tuple, dict] = {}
    for (S, m, shape, comm, limit), r in rows:
        by_key.setdefault((S, m, shape, comm), {})[
            "none" if limit is None else ("S/2" if limit < S else limit // S)
        ] = r
    lines = [
        "| S | m | costs | send | limit S | limit 2S | no limit | limit S/2 |",
        "|---:|---:|---|---:|---|---|---|---|",
    ]
    for (S, m, shape, comm), r in by_key.items():
        cells = " | ".join(_entry(r[k]) for k in (1, 2, "none", "S/2"))
        lines.append(f"| {S} | {m} | {shape} | {comm:g} | {cells} |")
    return "\n".join(lines)


def summary(rows: list[tuple[tuple, dict]]) -> list[str]:
    fit = [(k, r) for k, r in rows if r["best"] is not None]
    ratios = [r["auto"] / r["best_span"] for _, r in fit]
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    bound = math.exp(sum(math.log(r["bound"] / r["best_span"]) for _, r in fit) / len(fit))
    worst = max(fit, key=lambda kr: kr[1]["auto"] / kr[1]["best_span"])
    net = sum(r["raw"] > r["best_span"] + 1e-9 for _, r in fit)
    better = sum(x < 1 - 1e-9 for x in ratios)
    at_bound = sum(abs(r["auto"] - r["bound"]) < 1e-9 for _, r in rows)
    within = all(r["peak"] <= (k[4] or k[1]) for k, r in rows)
    proven = [(k, r) for k, r in rows if r["optimum"] is not None]
    gap = [r["auto"] / r["optimum"] for _, r in proven]
    worst_fit = max(((r["auto"] / r["optimum"], k) for k, r in proven if r["best"] is not None), key=lambda t: t[0])
    worst_none = max(
        ((r["auto"] / r["optimum"], k) for k, r in proven if r["best"] is None), key=lambda t: t[0], default=(1.0, None)
    )
    on_target = sum(r["auto"] <= r["optimum"] * (1.005 if r["best"] is not None else 1.02) + 1e-9 for _, r in proven)
    return [
        f"- a proven optimum in {len(proven)} of {len(rows)} cells ({sum(r['auto'] <= r['bound'] + 1e-9 for _, r in rows)}"
        f" by the bound); there auto / optimum: geometric mean {math.exp(sum(map(math.log, gap)) / len(gap)):.4f}, "
        f"worst with a fitting built-in {worst_fit[0]:.4f} {worst_fit[1]}, worst without {worst_none[0]:.4f} "
        f"{worst_none[1]}; within 0.5% (a built-in fits) or 2% (none does): {on_target} of {len(proven)}",
        f"- cells: {len(rows)}; with a fitting built-in: {len(fit)}; every plan within its limit: {within}",
        f"- geometric mean of auto / best fitting built-in: **{geo:.4f}**; of the lower bound / best: {bound:.4f}",
        f"- auto strictly faster in {better} cells, equal in {len(fit) - better}; at the lower bound in {at_bound}",
        f"- worst cell (auto / best): {worst[0]} at {worst[1]['auto'] / worst[1]['best_span']:.4f}",
        f"- the safety net (a built-in beating the list scheduler's own plans): {net} of {len(fit)} cells",
    ]


def random_costs(trials: int = 300, seed: int = 0) -> str:
    """Off the grid: random per-stage costs; how often a built-in beats the list scheduler, and by how much."""
    rng = random.Random(seed)
    ratios, net, worst = [], 0, 1.0
    for _ in range(trials):
        S = rng.choice([2, 3, 4, 6, 8])
        m = rng.choice([S, 2 * S, 3 * S, 4 * S])
        c = {
            "F": [rng.uniform(0.5, 2) for _ in range(S)],
            "B": [rng.uniform(0.5, 3) for _ in range(S)],
            "W": [rng.uniform(0.1, 1.5) for _ in range(S)],
            "comm": rng.choice([0, 0.1, 0.3, 1.0]),
        }
        limit = rng.choice([S, 2 * S, None, max(1, S // 2)])
        costs, limits = Costs.of(c, S), memory_limits(limit, S, m)
        _, raw, _ = search(costs, m, limits, [True] * S)
        fits = [span(p, costs) for n in BUILT_INS if max(memory_peaks(p := schedule(n, S, m))) <= (limit or m)]
        if fits:
            net += raw > min(fits) + 1e-9
            worst = max(worst, raw / min(fits))
            ratios.append(min(raw, min(fits)) / min(fits))
    geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
    return (
        f"- random costs (seed {seed}: F in [0.5, 2], B in [0.5, 3], W in [0.1, 1.5] per stage, sends 0 to 1, "
        f"S in 2..8, the same limits): {len(ratios)} cases with a fitting built-in; geometric mean {geo:.4f}; "
        f"the safety net wins {net}, the list scheduler then at most {worst:.4f} of the built-in"
    )


PLANNED = [(4, 16), (8, 32), (8, 64)]  # (stages, microbatches) of the planning times


def planning_times(repeats: int, cases: list[tuple[int, int]] = PLANNED) -> list[str]:
    out = []
    for S, m in cases:
        for limit in (S, None):
            times = []
            for _ in range(repeats):
                t0 = time.process_time()
                auto_schedule(S, m, costs=costs_of("B > F > W", S, 0.25), memory_limit=limit)
                times.append(time.process_time() - t0)
            out.append(f"| {S} | {m} | {limit or 'none'} | {statistics.median(times):.2f} s |")
    return ["| S | m | limit | CPU time of `auto_schedule` (median) |", "|---:|---:|---|---:|", *out]


def timelines(directory: Path) -> list[str]:
    """PNG timelines of one case (4 stages, 8 microbatches, B > F > W, sends 0.25): ZB-H1 and auto's plans."""
    S, m = 4, 8
    costs = Costs.of(costs_of("B > F > W", S, 0.25), S)
    cases = {
        "zbh1": ("ZB-H1", schedule("zbh1", S, m)),
        "auto8": ("auto, limit 8 (2S)", auto_schedule(S, m, costs=costs, memory_limit=8)),
        "auto4": ("auto, limit 4 (S, ZB-H1's)", auto_schedule(S, m, costs=costs, memory_limit=4)),
        "auto1": ("auto, limit 1", auto_schedule(S, m, costs=costs, memory_limit=1)),
    }
    out = []
    for key, (label, plans) in cases.items():
        # plot_timeline draws seconds as ms: one forward (the time unit here) is drawn as 1 "ms".
        events = [Event(e.worker, e.kind, e.mb, e.start / 1e3, e.end / 1e3, e.stage) for e in simulate(plans, S, costs)]
        path = directory / f"autoschedule_{key}.png"
        title = (
            f"{label}: 4 stages, 8 microbatches, F=1 B=1.5 W=0.5, sends 0.25; makespan "
            f"{span(plans, costs):g} (x axis: units of one F); peak {max(memory_peaks(plans))}"
        )
        plot_timeline(events, S, path, title)
        out.append(f"![{label}]({path.name})")
    return out


def run(quick: bool, png: Path | None = DOCS, train: bool = True) -> tuple[str, list[dict]]:
    rows = grid(quick)
    parts = ["auto · best fitting built-in · lower bound · optimum (modeled makespan, units of one F):", ""]
    parts += [table(rows), ""]
    parts += summary(rows) + [random_costs(30 if quick else 300), ""]
    parts += planning_times(1, PLANNED[:2]) if quick else planning_times(5)
    if png is not None and not quick:  # quick leaves the docs' figures as the full run drew them
        parts += [""] + timelines(png)
    records = [dict(zip(("S", "m", "costs", "comm", "limit"), k), **r) for k, r in rows]
    if not train:
        return "\n".join(parts), records
    measured, _ = autotrain.run(quick)
    parts += ["", 'Measured: `Trainer(schedule="auto")` against 1F1B and ZB-H1 (`benchmarks/autotrain.py`):', ""]
    parts += [measured]
    return "\n".join(parts), records


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    png = Path(sys.argv[sys.argv.index("--png") + 1]) if "--png" in sys.argv else None
    print(run(quick, png, train="--no-train" not in sys.argv)[0])
