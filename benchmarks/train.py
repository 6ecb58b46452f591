"""Training steps on 2 host CPU devices: the runner's own cost, and a mid-size GPT against the ideal pipelined step.

    python -m benchmarks --only train            # by hand; 2 to 10 minutes on 2 shared cores
    python -m benchmarks.train [--quick]         # this section alone

The work runs in a child process with 2 host CPU devices
(``--xla_force_host_platform_device_count=2``) and single-threaded XLA per operation,
so each device is one core; the Ray actors get the same flags. Candidates run in
blocks of consecutive steps, interleaved round by round; a block's time over its
steps is one sample, and the tables give medians.

1. **The runner's own cost per scheduled operation**: stages of negligible work (8
   gelu layers of width 16 cut in two, 16 microbatches of 4 rows, 1F1B, SGD), a
   Trainer step's time over its 64 operations: in-process (the default: every
   operation dispatched from one thread, nothing waits) and timed (each operation
   waits, its event a compute time), on Ray (each actor runs its list, results go
   actor to actor) and Ray timed.
2. **A mid-size GPT** (``benchmarks/gpt.py``: width 256, 4 blocks, sequence 64, batch
   16 in 8 microbatches, AdamW, 2 stages on the 2 devices, 1F1B; also widths 64 and
   128): ``t1``, one device's ``jit(value_and_grad)`` + optax step on the whole batch;
   ``s``, the speedup two threads of that step on the two devices get at once,
   measured between the steps (these cores are shared: ``s`` is not 2); the ideal
   ``t1 (1 + (p-1)/m) / s``; the Trainer in-process and on Ray (``--quick``: width 64 with 2 blocks,
   in-process only).
3. **One timed step** of the width-256 GPT in-process as a timeline
   (``docs/train_gpt256_timeline.png``, not with ``--quick``), with the share of the
   step both devices compute at once.
4. **Each runner's step over its lower bound** (``benchmarks/lower_bound.py``): the tiny stages
   and the width-256 GPT (only the tiny stages with ``--quick``) under 1F1B, ZB-H1
   and ``auto``, in-process and on Ray; the lower bound is the modeled makespan of the
   step's plans under the F, B and W its workers measured and the send time
   measured apart (one actor-to-actor delivery on Ray, a device-to-device copy
   in-process).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np

from benchmarks import lower_bound
from benchmarks.timing import run_section, section_main

DOCS = Path(__file__).resolve().parents[1] / "docs"
PNG = DOCS / "train_gpt256_timeline.png"
TARGETS = {"in-process": 100e-6, "Ray": 500e-6}  # per scheduled operation, untimed


def _config(quick: bool) -> dict:
    if quick:
        # Proves the section runs (CI): the GPT of 2 blocks, in-process only (the tiny stages and the lower bound run
        # on Ray too).
        cfg = {
            "tiny_rounds": 3,
            "tiny_block": 2,
            "widths": [64],
            "gpt_rounds": 2,
            "gpt_block": 1,
            "gpt_blocks": 2,
            "gpt_ray": False,
        }
    else:
        cfg = {"tiny_rounds": 12, "tiny_block": 4, "widths": [64, 128, 256], "gpt_rounds": 6, "gpt_block": 2}
    return {**cfg, "lower_bound": lower_bound.config(quick)}


def _blocks(cands: dict, rounds: int, block: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per step of each candidate: ``block`` consecutive steps a sample, interleaved."""
    for _ in range(warmup):
        for fn in cands.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in cands}
    for _ in range(rounds):
        for k, fn in cands.items():
            t0 = time.perf_counter()
            for _ in range(block):
                fn()
            samples[k].append((time.perf_counter() - t0) / block)
    return {k: statistics.median(v) for k, v in samples.items()}


def _trainers(stages, params, tx, microbatches: int, ray: bool) -> dict:
    from vjpsplit_cli import pipeline as P

    runners = ["inprocess", "ray"] if ray else ["inprocess"]
    return {
        r: P.Trainer(stages, params, optimizer=tx, schedule="1f1b", microbatches=microbatches, runner=r)
        for r in runners
    }


def tiny(cfg: dict, ray: bool, platform: str) -> dict:
    """The runner's own cost: Trainer steps on stages of negligible work, per scheduled operation."""
    import optax

    from benchmarks.gpt import tiny_stages
    from vjpsplit_cli import pipeline as P

    import jax

    M = 16
    stages, params, batch, _ = tiny_stages(microbatches=M, platform=platform)
    trainers = _trainers(stages, params, optax.sgd(1e-3), M, ray)
    devs = jax.local_devices()
    d0, d1 = devs[0], devs[1 % len(devs)]
    shared = P.Trainer(
        stages, params, optimizer=optax.sgd(1e-3), microbatches=M, runner=P.InProcess(devices=[[d0], [d0]])
    )
    hand, hand_shared = HandLoop(stages, params, M, 1e-3, [d0, d1]), HandLoop(stages, params, M, 1e-3, [d0, d0])
    label = {"inprocess": "in-process", "ray": "Ray"}
    cands = {"by hand (the floor)": lambda: hand.step(batch), "by hand, one device": lambda: hand_shared.step(batch)}
    for r, tr in trainers.items():
        cands[label[r]] = lambda tr=tr: tr.step(batch)
        cands[f"{label[r]}, timed"] = lambda tr=tr: tr.step(batch, timed=True)
        if r == "inprocess":
            cands["in-process, both stages on one device"] = lambda: shared.step(batch)
    t = _blocks(cands, cfg["tiny_rounds"], cfg["tiny_block"])
    for tr in [*trainers.values(), shared]:
        tr.close()
    ops = sum(len(p) for p in P.schedule("1f1b", 2, M))
    rows = [{"runner": k, "step": v, "per_op": v / ops} for k, v in t.items()]
    return {"ops": ops, "rows": rows}


class HandLoop:
    """The floor under any runner: the same step written by hand, with nothing but its calls.

    The stages' jitted calls (``StageWorker.calls``), in the same order as the runner
    dispatches them (``dispatch.order_of``), each microbatch's inputs and each
    activation and cotangent moved with ``jax.device_put``, one jitted SGD update per
    stage and one fetch of the losses: what a user's own loop over these artifacts
    would have to do.
    """

    def __init__(self, stages, params, M: int, lr: float, devices):
        import jax

        from vjpsplit_cli import pipeline as P
        from vjpsplit_cli.pipeline.runtime.dispatch import order_of
        from vjpsplit_cli.pipeline.runtime.worker import StageWorker

        S = len(stages.artifacts)
        self.stages, self.M = stages, M
        self.w = [
            StageWorker(a, p, s, S, devices[s])
            for s, (a, p) in enumerate(zip(stages.artifacts, stages.stage_params(params)))
        ]
        self.sh = [jax.sharding.SingleDeviceSharding(d) for d in devices]
        self.order = order_of(P.schedule("1f1b", S, M), S)
        self.sgd = jax.jit(lambda p, g: jax.tree_util.tree_map(lambda a, b: a - lr * b, p, g))
        self.one = np.float32(1 / M)

    def step(self, batch) -> float:
        import jax

        w, sh, S = self.w, self.sh, len(self.w)
        mbs = self.stages.stage_batch(batch, self.M)
        xs = jax.device_put([x for x, _ in mbs], sh[0])
        sides = jax.device_put([side[S - 1] for _, side in mbs], sh[S - 1])
        sent, res, grads, losses = {}, [{} for _ in w], [None] * S, []
        for _, op, src in self.order:
            st, s, m = w[op.stage], op.stage, op.mb
            c = st.calls
            if op.kind == "F":
                x = xs[m] if s == 0 else jax.device_put(sent.pop(src), sh[s])
                out, res[s][m] = c.forward(st.params, x, *(sides[m] if s == S - 1 else []))
                if s == S - 1:
                    losses.append(out)
            else:
                ct = self.one if s == S - 1 else jax.device_put(sent.pop(src), sh[s])
                r = res[s].pop(m)
                grads[s], out = c.backward(r, ct) if grads[s] is None else c.backward_acc(grads[s], r, ct)
            sent[op.key] = out
        for st, g in zip(w, grads):
            st.params = self.sgd(st.params, g)
        return float(np.mean(jax.device_get(losses)))


def gpt_width(width: int, cfg: dict, ray: bool, platform: str, png: Path | None, p: int = 2) -> dict:
    """One width of the GPT on ``p`` stages and devices: t1, s, the ideal, the Trainer in-process and on Ray;
    a timeline when ``png``. With fewer devices than ``p``, the stages share them (and so does ``s``)."""
    import jax
    import optax

    from benchmarks.gpt import GPT, docs_batches

    m = max(8, 2 * p)
    g = GPT(width=width, blocks=max(cfg.get("gpt_blocks", 4), p), stages=p)
    vocab, data = docs_batches(g.seq, 2 * m, 8)
    params = g.init(vocab)
    stages = g.export(params, platform)
    tx = optax.adamw(1e-3)

    @jax.jit
    def one(prm, st, tokens, labels):
        v, grads = jax.value_and_grad(g.loss)(prm, tokens, labels)
        u, st = tx.update(grads, st, prm)
        return optax.apply_updates(prm, u), st, v

    have = jax.local_devices()
    devs = [have[k % len(have)] for k in range(p)]
    states = [[jax.device_put(params, d), jax.device_put(tx.init(params), d)] for d in devs]
    turn = {"i": 0}

    def single(k: int = 0) -> None:
        st = states[k]
        st[0], st[1], v = one(st[0], st[1], *data[turn["i"] % len(data)])
        jax.block_until_ready((st, v))

    def together() -> None:  # p threads of the same step, one on each device
        threads = [threading.Thread(target=single, args=(k,)) for k in range(p)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    trainers = _trainers(stages, params, tx, m, ray)

    def stepper(tr, timed=False):
        def step():
            turn["i"] += 1
            tr.step(data[turn["i"] % len(data)], timed=timed)

        return step

    cands = {"t1": single, "together": together, **{r: stepper(tr) for r, tr in trainers.items()}}
    cands["inprocess_timed"] = stepper(trainers["inprocess"], timed=True)
    t = _blocks(cands, cfg["gpt_rounds"], cfg["gpt_block"])
    s = p * t["t1"] / t["together"]
    row = {"width": width, "stages": p, "blocks": g.blocks, "microbatches": m, "t1": t["t1"], "s": s}
    row["together"] = t["together"]
    row["ideal"] = t["t1"] * (1 + (p - 1) / m) / s
    row.update(
        inprocess=t["inprocess"],
        inprocess_timed=t["inprocess_timed"],
        ray=t.get("ray"),
        placement=[str(d) for (d,) in trainers["inprocess"].placement],
    )
    if png is not None:
        tr = trainers["inprocess"]
        tr.step(data[0], timed=True)
        r = tr.last_result
        row["overlap"] = both_busy(r.events, r.step_time)
        where = ", ".join(row["placement"])
        r.plot(png, f"GPT width {width}, {p} stages on {where}, 1F1B, {m} microbatches: one timed step")
    for tr in trainers.values():
        tr.close()
    return row


def both_busy(events, step_time: float) -> float:
    """The share of ``step_time`` during which two or more workers were computing at once."""
    edges = sorted([(e.start, 1) for e in events] + [(e.end, -1) for e in events])
    busy, depth, last = 0.0, 0, None
    for t, d in edges:
        if depth >= 2 and last is not None:
            busy += t - last
        depth, last = depth + d, t
    return busy / step_time


def measure(
    quick: bool, platform: str = "cpu", ray: bool = True, png: Path | None = None, cfg: dict | None = None
) -> dict:
    """Both parts in this process (the child ``run`` starts, or the accelerator run, without Ray).

    ``cfg["devices"]`` stages and devices for the GPT (default 2: the child's two host devices).
    """
    cfg = cfg or _config(quick)
    if ray:
        import ray as ray_

        # No XLA_FLAGS in the job's runtime_env: the runner gives each actor this process's flags with its own
        # device count, where a job-level XLA_FLAGS would stand as given (each actor seeing this child's 2
        # devices, driving 1: +20% CPU per actor on the GPT, benchmarks/results/2026-history-ray-training-steps.md).
        ray_.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        small = tiny(cfg, ray, platform)
        widths = cfg["widths"]
        p = cfg.get("devices", 2)
        gpt_ray = ray and cfg.get("gpt_ray", True)
        rows = [gpt_width(w, cfg, gpt_ray, platform, png if w == widths[-1] else None, p) for w in widths]
        bounds = lower_bound.measure(cfg["lower_bound"], ray, platform) if "lower_bound" in cfg else []
    finally:
        if ray:
            ray_.shutdown()
    return {"config": cfg, "tiny": small, "rows": rows, "lower_bound": bounds, "load": os.getloadavg()[0]}


def table(data: dict) -> str:
    """The report: the runner's cost per operation, then the GPT at each width."""
    c, t = data["config"], data["tiny"]
    lines = [
        f"Stages of negligible work (8 gelu layers of width 16 in 2 stages, 16 microbatches of 4 rows, 1F1B, SGD): "
        f"a Trainer step over its {t['ops']} operations; medians of {c['tiny_rounds']} blocks of "
        f"{c['tiny_block']} steps, interleaved; load average {data['load']:.1f} when done.",
        "",
        "| runner | step | per operation | target |",
        "|---|---:|---:|---:|",
    ]
    per = {r["runner"]: r["per_op"] for r in t["rows"]}
    lines[-2:] = ["| candidate | step | per operation | the runner's own (above the loop by hand) | target |"]
    lines.append("|---|---:|---:|---:|---:|")
    for r in t["rows"]:
        floor = per["by hand, one device" if "one device" in r["runner"] else "by hand (the floor)"]
        target = TARGETS.get(r["runner"])
        own = "" if r["runner"].startswith("by hand") else f"{(r['per_op'] - floor) * 1e6:.0f} µs"
        mark = (
            ""
            if target is None
            else f"≤ {target * 1e6:.0f} µs ({'met' if r['per_op'] - floor <= target else 'missed'})"
        )
        lines.append(f"| {r['runner']} | {r['step'] * 1e3:.2f} ms | {r['per_op'] * 1e6:.0f} µs | {own} | {mark} |")
    lines += [
        "",
        "By hand: the same jitted calls of the stages in the runner's order, inputs moved with jax.device_put, "
        "one jitted SGD update per stage, one fetch of the losses (benchmarks/train.py's HandLoop).",
    ]
    g = data["rows"][0]
    p, m = g["stages"], g["microbatches"]
    lines += [
        "",
        f"GPT ({g['blocks']} blocks, sequence 64, batch {2 * m} in {m} microbatches, AdamW), {p} stages on "
        f"{', '.join(g['placement'])}, 1F1B; medians of {c['gpt_rounds']} blocks of {c['gpt_block']} steps. "
        f"t1: one device's jit(value_and_grad) + optax step; s: the speedup of that step on the {p} devices at "
        f"once, from {p} threads; ideal: t1 (1 + (p-1)/m) / s; timed: the in-process Trainer's step with "
        "timed=True. Targets: in-process ≤ 1.15× the ideal, Ray ≤ 1.2× in-process.",
        "",
        "| width | t1 | s | ideal | Trainer, in-process | / ideal | / t1 | timed | Trainer, Ray | Ray / in-process |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in data["rows"]:
        ray = "" if r["ray"] is None else f"{r['ray'] * 1e3:.1f} ms | {r['ray'] / r['inprocess']:.2f}×"
        lines.append(
            f"| {r['width']} | {r['t1'] * 1e3:.1f} ms | {r['s']:.2f} | {r['ideal'] * 1e3:.1f} ms | "
            f"{r['inprocess'] * 1e3:.1f} ms | {r['inprocess'] / r['ideal']:.2f}× | {r['inprocess'] / r['t1']:.2f}× | "
            f"{r['inprocess_timed'] * 1e3:.1f} ms | " + (ray or " | ") + " |"
        )
    last = data["rows"][-1]
    if "overlap" in last:
        lines += [
            "",
            f"One timed step at width {last['width']} (stages on {', '.join(last['placement'])}): both devices "
            f"computed at once for {last['overlap']:.0%} of it ({PNG.name}).",
        ]
    if data.get("lower_bound"):
        lines += ["", lower_bound.table(data["lower_bound"], c["lower_bound"])]
    return "\n".join(lines)


def run(quick: bool) -> tuple[str, list[dict]]:
    """Measure in a child with 2 host CPU devices and single-threaded XLA; the markdown tables and the rows."""
    return run_section("benchmarks.train", quick, table, devices=2)


def main(argv=None) -> int:
    """``--child``: measure and print JSON (run by ``run``); otherwise run the section and print its report."""
    return section_main(__doc__, lambda quick: measure(quick, png=None if quick else PNG), run, argv)


if __name__ == "__main__":
    sys.exit(main())
