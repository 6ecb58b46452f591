"""Trainer(schedule="auto") against 1F1B and ZB-H1 on a mid-size GPT, measured side by side.

    python -m benchmarks --only autoschedule        # runs this after the modeled grid
    python -m benchmarks.autotrain [--quick]        # this part alone

The model: a character GPT on this repository's docs (tied embedding, width 256,
4 blocks of causal attention and an MLP, sequence 64), batch 16 in 8
microbatches, AdamW, cut into 2 stages after block 1 (2 workers, one core each:
the work runs in a child process with single-threaded XLA). The Trainers
(1F1B, ZB-H1, auto with no limit, auto within ZB-H1's memory of S microbatches)
step on the same batches, interleaved round by round; the auto ones run first in
round 0, so their timed first step is a first step (every call compiles). The
warm-up rounds are the auto Trainers' two timed steps and their trial steps
(untimed, until each keeps the plans that ran fastest). Reported: median step
times of the rounds after them, the plans each ran modeled under the costs of 3
later timed steps of the auto Trainer, and its costs as measured in its first
step, in its second (what it planned for) and in those later steps. Every
candidate's losses are checked against the others' (one computation, several
schedules).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

from benchmarks.timing import run_section, section_main


RACE_STEPS_AT_MOST = 64  # an auto Trainer's trial steps: 5 candidates at most, 3 steps each by default


def _config(quick: bool) -> dict:
    if quick:  # proves the section runs (CI): a small GPT, each close plan raced for one step
        return {
            "width": 32,
            "blocks": 2,
            "seq": 16,
            "batch": 8,
            "microbatches": 4,
            "rounds": 3,
            "heads": 4,
            "trial_rounds": 1,
        }
    return {"width": 256, "blocks": 4, "seq": 64, "batch": 16, "microbatches": 8, "rounds": 25, "heads": 4}


def _model(c: dict):
    """``(stages, params, batches)``: the mid GPT (``benchmarks/gpt.py``) cut after half its blocks, its
    parameters, and an endless iterator over batches of windows of the docs (the auto Trainers' trial steps
    take as many more steps as their races need)."""
    import itertools

    from benchmarks.gpt import GPT, docs_batches

    g = GPT(width=c["width"], blocks=c["blocks"], seq=c["seq"], heads=c["heads"], stages=2)
    vocab, batches = docs_batches(g.seq, c["batch"], 2 + c["rounds"] + 4)
    params = g.init(vocab)
    return g.export(params), params, itertools.cycle(batches)


def measure(quick: bool) -> dict:
    """Step times of each Trainer (interleaved rounds), the auto Trainer's costs, each schedule's modeled makespan."""
    import numpy as np
    import optax

    from vjpsplit_cli import pipeline as P
    from vjpsplit_cli.pipeline.schedules.modeled import modeled_makespan

    c = _config(quick)
    stages, params, batches = _model(c)
    S, m = len(stages), c["microbatches"]
    kw = dict(optimizer=optax.adamw(1e-3), microbatches=m)
    trials = c.get("trial_rounds")  # None: the Trainer's default
    trainers = {
        "auto": P.Trainer(stages, params, schedule=P.Schedule("auto", trial_rounds=trials), **kw),
        f"auto, limit {S}": P.Trainer(
            stages, params, schedule=P.Schedule("auto", memory_limit=S, trial_rounds=trials), **kw
        ),
        "1F1B": P.Trainer(stages, params, schedule="1f1b", **kw),
        "ZB-H1": P.Trainer(stages, params, schedule="zbh1", **kw),
    }
    rounds = c["rounds"]
    times: dict[str, list[float]] = {k: [] for k in trainers}
    losses: dict[str, list[float]] = {k: [] for k in trainers}
    measured = {}
    i = timed = 0
    while timed < rounds:
        if i > 2 + RACE_STEPS_AT_MOST + rounds:
            raise RuntimeError(f"the auto Trainers were still racing after {i} steps")
        x = next(batches)
        # Timed from when the auto Trainers have measured (2 steps) and raced the plans they rate close.
        warm = i >= 2 and all(tr.auto is None or tr.auto.trial is None for tr in trainers.values())
        for k, tr in trainers.items():
            t0 = time.perf_counter()
            losses[k].append(tr.step(x))
            if warm:
                times[k].append(time.perf_counter() - t0)
        if i < 2:  # the auto Trainer's two timed steps: it planned for the second's costs
            measured["first step" if i == 0 else "second step"] = trainers["auto"].costs()
        i, timed = i + 1, timed + warm
    warmup = i - rounds
    kept = ", ".join(f"{k}: {tr.auto.choice}" for k, tr in trainers.items() if tr.auto is not None)
    ran = {k: tr.last_result.plans for k, tr in trainers.items()}
    auto = trainers["auto"]
    for _ in range(3):  # later timed steps: times without compiling; auto plans again for them
        auto.step(next(batches), timed=True)
    later = measured["later timed steps"] = auto.costs()
    one = trainers["1F1B"]
    one.step(next(batches), timed=True)  # its whole backwards, against the split ones' B + W
    whole = [
        statistics.median(e.end - e.start for e in one.last_result.events if e.stage == s and e.kind == "B")
        for s in range(S)
    ]
    for k in losses:
        np.testing.assert_allclose(losses[k], losses["1F1B"], rtol=1e-4)
    rows = [
        {
            "candidate": k,
            "step": statistics.median(times[k]),
            "modeled": modeled_makespan(ran[k], later),
        }
        for k in trainers
    ]
    replanned = modeled_makespan(auto.plan.plans, later)
    for tr in trainers.values():
        tr.close()
    return {
        "config": {**c, "stages": S},
        "rows": rows,
        "costs": measured,
        "replanned": replanned,
        "whole": whole,
        "load": os.getloadavg()[0],
        "warmup": warmup,
        "kept": kept,
    }


def _ms(v: float) -> str:
    return f"{v * 1e3:.2f}"


def table(data: dict) -> str:
    """The markdown report of one run."""
    c = data["config"]
    base = next(r for r in data["rows"] if r["candidate"] == "1F1B")
    lines = [
        f"Char GPT (width {c['width']}, {c['blocks']} blocks, sequence {c['seq']}, tied embedding), batch "
        f"{c['batch']} in {c['microbatches']} microbatches, AdamW, {c['stages']} stages on 2 workers of one core "
        f"each; medians of {c['rounds']} interleaved steps after {data['warmup']} warm-up rounds (the auto "
        f"Trainers' two timed steps and their trial steps, which kept {data['kept']}); load average "
        f"{data['load']:.1f} when done.",
        "",
        "| candidate | step time | vs 1F1B | modeled makespan (costs of 3 later timed steps) | vs 1F1B |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        lines.append(
            f"| {r['candidate']} | {_ms(r['step'])} ms | {r['step'] / base['step']:.2f}× | {_ms(r['modeled'])} ms | "
            f"{r['modeled'] / base['modeled']:.2f}× |"
        )
    lines += [
        "",
        f"The auto Trainer planned again after 3 later timed steps: {_ms(data['replanned'])} ms modeled under "
        "their costs.",
    ]
    lines += [
        "",
        "| costs (ms) | stage | F | B | W | send | a whole backward (1F1B's, timed at the end) |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for when, costs in data["costs"].items():
        for s in range(c["stages"]):
            send = _ms(costs["comm"]) if s == 0 else ""
            fused = _ms(data["whole"][s]) if when == "later timed steps" else ""
            lines.append(
                f"| {when} | {s} | {_ms(costs['F'][s])} | {_ms(costs['B'][s])} | {_ms(costs['W'][s])} | {send} | "
                f"{fused} |"
            )
    return "\n".join(lines)


def run(quick: bool) -> tuple[str, list[dict]]:
    """Measure in a single-threaded child process; return the markdown report and the rows."""
    return run_section("benchmarks.autotrain", quick, table)


def main(argv=None) -> int:
    """``--child``: measure and print JSON (run by ``run``); otherwise run the section and print its report."""
    return section_main(__doc__, measure, run, argv)


if __name__ == "__main__":
    sys.exit(main())
