"""Each runner's training step against its own lower bound: the modeled makespan of its plans under its measured costs.

Run inside ``benchmarks.train``'s child (2 host CPU devices, single-threaded XLA, Ray started), in the same
run as its other tables. For each workload (the tiny stages; the GPT of width 256, none with ``--quick``) and
each runner (in-process, Ray) and schedule (1F1B, ZB-H1, ``auto``; 1F1B only with ``--quick``), one Trainer:

1. **The costs, measured where they run and when the steps run.** Timed steps (``step(batch, timed=True)``)
   time every stage's F, B and W on its worker (its thread in-process, its actor on Ray); ``trainer.costs()``
   gives their medians over the last 16. One set per runner: its ZB-H1 Trainer's (F, I and W each timed), from
   4 timed steps before the rounds and one after every other round (the 1F1B Trainer's too, not ``auto``'s,
   which would plan again), so the costs are sampled across the window the steps are; every schedule's lower bound on
   that runner uses that set (the same plans, the same lower bound; where ZB-H1 is not run, each Trainer's own).
2. **The send, measured apart.** One actor-to-actor delivery of an activation of the size each boundary sends
   (``RayPipeline.probe_delivery``: through the senders and inboxes a step's results take; the median of many
   round trips, halved); in-process, ``jax.device_put`` of it from one device to the other, waited for (median
   of many).
3. **The lower bound**: ``modeled_makespan`` of the plans the step runs (auto's: the plans its race kept, after
   untimed trial steps until it keeps them) under those F,
   B and W with that send time as ``comm`` (the schedules' simulator). On Ray the plans as its lists run them
   (``runtime.ray.lists.action_lists``): a B whose cotangent goes to another actor, on a stage with the split
   backward, is its I, the send, then its W, so 1F1B's lower bound there is below 1F1B's as scheduled (given beside
   it). The optimizer update, the losses' fetch and the driver's hand-out are not in it: they are part of what
   a runner costs above its lower bound.
4. **The step**: untimed steps of every Trainer interleaved in blocks; the median of the blocks, with its standard
   error (the blocks' MAD scaled to a normal law's sigma, x 1.2533 / sqrt(n)); auto against the faster of 1F1B and
   ZB-H1 with twice the difference's standard error.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

SCHEDULES = ("1f1b", "zbh1", "auto")
SETTLE_STEPS = 100  # at most this many untimed steps for auto's race (k candidates: 3k steps, up to 12k)
LABEL = {"inprocess": "in-process", "ray": "Ray"}


def config(quick: bool) -> dict:
    """The lower bound's settings: widths, schedules, timed steps, rounds, block and delivery round trips."""
    if quick:
        return {
            "widths": [],
            "schedules": ["1f1b"],
            "timed": 1,
            "timed_every": 0,
            "rounds": 2,
            "block": 1,
            "probes": 20,
        }
    return {
        "widths": [256],
        "schedules": list(SCHEDULES),
        "timed": 4,
        "timed_every": 2,
        "rounds": 24,
        "block": 2,
        "probes": 200,
    }


def activations(stages: Any, params: Any, batch: tuple, microbatches: int) -> list[Any]:
    """What each stage boundary sends for one microbatch: stage ``s``'s forward output (its backward sends a
    cotangent of the same shape back), as host arrays."""
    import jax

    from vjpsplit_cli.pipeline.runtime.model import side_for
    from vjpsplit_cli.pipeline.runtime.worker import StageWorker

    S = len(stages.artifacts)
    dev = jax.local_devices()[0]
    x, side = stages.stage_batch(batch, microbatches)[0]
    out = []
    for s, (art, p) in enumerate(zip(stages.artifacts[:-1], stages.stage_params(params))):
        w = StageWorker(art, p, s, S, dev)
        x, _ = w.calls.forward(w.params, x, *side_for(side, s, S))
        out.append(jax.tree_util.tree_map(np.asarray, x))
    return out


def nbytes(value: Any) -> int:
    """The bytes of a pytree of arrays."""
    import jax

    return int(sum(np.asarray(a).nbytes for a in jax.tree_util.tree_leaves(value)))


def copy_time(value: Any, repeats: int) -> float:
    """The median seconds of ``jax.device_put`` of ``value`` from the first host device to the second, waited for
    (what an in-process Trainer's ``costs()["comm"]`` times between its stages' devices)."""
    import jax

    from vjpsplit_cli.pipeline.training.measured import measure_copy_seconds

    d0, d1 = jax.local_devices()[0], jax.local_devices()[1 % len(jax.local_devices())]
    return measure_copy_seconds(value, d0, d1, repeats)


def workload(
    name: str, stages: Any, params: Any, tx: Any, batches: list, microbatches: int, cfg: dict, ray: bool
) -> dict:
    """One workload's rows: per runner and schedule, its step, its lower bound and what the lower bound is made of."""
    from vjpsplit_cli import pipeline as P
    from vjpsplit_cli.pipeline.runtime.ray.lists import action_lists
    from vjpsplit_cli.pipeline.schedules.modeled import modeled_makespan

    runners = ["inprocess", "ray"] if ray else ["inprocess"]
    trainers = {
        (r, sch): P.Trainer(stages, params, optimizer=tx, schedule=sch, microbatches=microbatches, runner=r)
        for r in runners
        for sch in cfg["schedules"]
    }
    turn = {"i": 0}

    def batch() -> tuple:
        turn["i"] += 1
        return batches[turn["i"] % len(batches)]

    try:
        for _ in range(2):  # warm up (auto's two measuring steps among them)
            for tr in trainers.values():
                tr.step(batch())
        for _ in range(cfg["timed"]):  # the costs, on each runner's own workers (during auto's race: no replan)
            for tr in trainers.values():
                tr.step(batch(), timed=True)
        for _ in range(SETTLE_STEPS):  # auto's trial steps, untimed, until each auto Trainer keeps its plans
            racing = [tr for tr in trainers.values() if tr.auto is not None and tr.auto.trial is not None]
            if not racing:
                break
            for tr in racing:
                tr.step(batch())
        sent = activations(stages, params, batches[0], microbatches)
        comm = {"inprocess": statistics.mean(copy_time(a, cfg["probes"]) for a in sent)}
        probes: dict[str, list[float]] = {}
        if ray:
            rp = trainers[("ray", cfg["schedules"][0])].backend.rp
            probes = {
                f"{nbytes(a)}": [statistics.median(rp.probe_delivery(a, cfg["probes"], (s, s + 1)))]
                for s, a in enumerate(sent)
            }
            comm["ray"] = statistics.mean(v[0] for v in probes.values())
        samples: dict[tuple[str, str], list[float]] = {k: [] for k in trainers}
        for i in range(cfg["rounds"]):
            for k, tr in trainers.items():
                t0 = time.perf_counter()
                for _ in range(cfg["block"]):
                    tr.step(batch())
                samples[k].append((time.perf_counter() - t0) / cfg["block"])
            if cfg["timed_every"] and (i + 1) % cfg["timed_every"] == 0:
                for (_, sch), tr in trainers.items():
                    if sch != "auto":  # a timed step makes auto plan again
                        tr.step(batch(), timed=True)
        measured = {r: trainers[(r, "zbh1")].costs() for r in runners if (r, "zbh1") in trainers}
        splits = [a.manifest.splits_backward for a in stages.artifacts]
        rows = []
        for (r, sch), tr in trainers.items():
            mine = tr.costs()
            costs = {k: v for k, v in measured.get(r, mine).items() if k in ("F", "B", "W")}
            # On Ray a B whose cotangent goes to another actor runs as I, send, W: its action lists are the lower bound's.
            plans = action_lists(tr.plan.plans, splits, tr.backend.worker_of) if r == "ray" else tr.plan.plans
            bound = modeled_makespan(plans, {**costs, "comm": comm[r]})
            own = {k: v for k, v in mine.items() if k in ("F", "B", "W")}
            step = statistics.median(samples[(r, sch)])
            spread = statistics.median(abs(x - step) for x in samples[(r, sch)])
            rows.append(
                {
                    "workload": name,
                    "runner": r,
                    "schedule": sch,
                    "step": step,
                    # The median's standard error: the samples' MAD scaled to a normal law's sigma, x 1.2533 / sqrt(n).
                    "step_se": 1.2533 * 1.4826 * spread / len(samples[(r, sch)]) ** 0.5,
                    "race_steps": sum(h.trial is not None for h in tr.history),
                    "lower_bound": bound,
                    # The same plans under this Trainer's own timed steps (what the lower bound was before one set per runner).
                    "own_bound": modeled_makespan(plans, {**own, "comm": comm[r]}),
                    "scheduled_bound": modeled_makespan(tr.plan.plans, {**costs, "comm": comm[r]}),
                    "comm": comm[r],
                    "measured_comm": mine["comm"],
                    "gap": mine["gap"],
                    "kept": sch if tr.auto is None else str(tr.auto.choice),
                    "race": {} if tr.auto is None or not tr.auto.races else tr.auto.races[-1],
                    "work": sum(map(sum, costs.values())) * microbatches,
                    "F": costs["F"],
                    "B": costs["B"],
                    "W": costs["W"],
                }
            )
        return {
            "workload": name,
            "microbatches": microbatches,
            "sizes": [nbytes(a) for a in sent],
            "rows": rows,
            "deliveries": {k: v[0] for k, v in probes.items()},
        }
    finally:
        for tr in trainers.values():
            tr.close()


def measure(cfg: dict, ray: bool, platform: str) -> list[dict]:
    """The tiny stages (16 microbatches, SGD) and the GPT at ``cfg["widths"]`` (8 microbatches, AdamW)."""
    import optax

    from benchmarks.gpt import GPT, docs_batches, tiny_stages

    M = 16
    stages, params, batch, _ = tiny_stages(microbatches=M, platform=platform)
    out = [workload("tiny stages", stages, params, optax.sgd(1e-3), [batch], M, cfg, ray)]
    for width in cfg["widths"]:
        g = GPT(width=width, blocks=4, stages=2)
        vocab, data = docs_batches(g.seq, 16, 8)
        prm = g.init(vocab)
        out.append(workload(f"GPT width {width}", g.export(prm, platform), prm, optax.adamw(1e-3), data, 8, cfg, ray))
    return out


def auto_versus(rows: list[dict], runner: str) -> str:
    """On ``runner``, auto's step minus the faster of 1F1B's and ZB-H1's, with twice the difference's standard
    error, and whether auto is slower beyond it; "" where the rows lack one of them."""
    by = {r["schedule"]: r for r in rows if r["runner"] == runner}
    if "auto" not in by or not {"1f1b", "zbh1"} & set(by):
        return ""
    best = min((by[s] for s in ("1f1b", "zbh1") if s in by), key=lambda r: r["step"])
    diff = by["auto"]["step"] - best["step"]
    noise = 2 * (by["auto"]["step_se"] ** 2 + best["step_se"] ** 2) ** 0.5
    verdict = "faster" if diff < 0 else ("slower beyond the noise" if diff > noise else "slower within the noise")
    return (
        f"{by['auto']['workload']}, {LABEL[runner]}: {diff * 1e3:+.2f} ms against {best['schedule']} "
        f"(± {noise * 1e3:.2f} ms): {verdict}"
    )


def table(parts: list[dict], cfg: dict) -> str:
    """One row per workload, runner and schedule: the step, its lower bound, their ratio, what the lower bound assumed."""
    costs = (
        "one set per runner: its ZB-H1 Trainer's medians over the last 16 of "
        f"{cfg['timed']} timed steps before the blocks and one after every {cfg['timed_every']} rounds of them"
        if "zbh1" in cfg["schedules"] and cfg["timed_every"]
        else f"each Trainer's own medians over {cfg['timed']} timed steps"
    )
    lines = [
        "Each runner's step over its lower bound: the modeled makespan of the plans it runs (auto: the plans its race kept; "
        "on Ray as its lists run them, a B whose cotangent goes to another actor as I, send, W; the plans as scheduled "
        f"beside it) under the F, B and W the runner's workers measured ({costs}) and the send time measured apart (Ray: one "
        "actor-to-actor delivery of each activation size through the step's senders and inboxes, the median of "
        f"{cfg['probes']} round trips halved; in-process: jax.device_put from one device to the other). Steps: "
        f"untimed, medians of {cfg['rounds']} blocks of {cfg['block']}, all Trainers interleaved. costs()' comm: the "
        "send each Trainer timed apart itself (what auto plans with); costs()' gap: the wait from a result to the "
        "next worker starting on it in its timed steps' timelines.",
        "",
        "| workload | runner | schedule | plans run | step (± 2 SE) | lower bound | step / lower bound | lower bound as scheduled | "
        "lower bound (its own costs) | send in the lower bound | costs()' comm | costs()' gap |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for part in parts:
        for r in part["rows"]:
            lines.append(
                f"| {r['workload']} | {LABEL[r['runner']]} | {r['schedule']} | {r['kept']} | {r['step'] * 1e3:.2f} "
                f"(± {2 * r['step_se'] * 1e3:.2f}) ms | "
                f"{r['lower_bound'] * 1e3:.2f} ms | {r['step'] / r['lower_bound']:.2f}× | {r['scheduled_bound'] * 1e3:.2f} ms | "
                f"{r['own_bound'] * 1e3:.2f} ms | "
                f"{r['comm'] * 1e6:.0f} µs | "
                f"{r['measured_comm'] * 1e6:.0f} µs | {r['gap'] * 1e6:.0f} µs |"
            )
    races = [
        f"{r['workload']}, {LABEL[r['runner']]} ({r['race_steps']} steps): "
        + ", ".join(f"{name} {sec * 1e3:.2f} ms" for name, sec in sorted(r["race"].items(), key=lambda kv: kv[1]))
        for part in parts
        for r in part["rows"]
        if r["race"]
    ]
    if races:
        lines += [
            "",
            "auto's race (median untimed trial step of each candidate; the fastest kept): " + "; ".join(races) + ".",
        ]
    versus = [auto_versus(part["rows"], runner) for part in parts for runner in LABEL]
    if any(versus):
        lines += ["", "auto against the faster of 1F1B and ZB-H1 (± 2 standard errors of the difference): "]
        lines[-1] += "; ".join(v for v in versus if v) + "."
    sizes = "; ".join(
        f"{p['workload']}: " + ", ".join(f"{int(k)} B in {v * 1e6:.0f} µs" for k, v in p["deliveries"].items())
        for p in parts
        if p["deliveries"]
    )
    if sizes:
        lines += ["", f"One actor-to-actor delivery on Ray (median): {sizes}."]
    return "\n".join(lines)
