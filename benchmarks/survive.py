"""Training that survives: what a step waits for a checkpoint, and the time from a lost Ray worker to the next step.

    python -m benchmarks --only survive          # by hand; several minutes on 2 cores
    python -m benchmarks.survive [--quick]       # this section alone

The model is a mid-size GPT (width 256, 4 blocks, sequence 64, batch 16 in 8
microbatches, AdamW, 2 stages; ``benchmarks/gpt.py``, the sample's model) on
windows of the repository's docs; ``--quick`` runs the sample's
small GPT (width 32) to prove the section runs. The work runs in a child process
with single-threaded XLA, as do the Ray actors.

* Checkpoints: blocks of steps through ``Trainer.fit`` without checkpoints and
  with ``checkpoint_every=1`` (a fresh directory per block), alternated; per
  step the step time (``history``), and per checkpoint the time the next step
  waited (``checkpoint_times[i].wait``: the copy to host memory) and the time
  the background write took; beside them a synchronous ``trainer.save``.
* Restarts (Ray): ``fit(checkpoint_every=1, max_restarts=...)`` whose callback
  kills worker 1's actor (``ray.kill``) after a step; the time from the kill to
  the end of the next finished step (the lost worker found, replaced, every
  worker back at the last checkpoint, the step run again), with its parts.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.timing import run_section, section_main

MID = {"width": 256, "blocks": 4, "seq": 64, "batch": 16, "microbatches": 8}
SMALL = {"width": 32, "blocks": 2, "seq": 32, "batch": 16, "microbatches": 4}


def model(cfg: dict):
    """``(stages, params, batches(n))`` of the GPT ``cfg`` describes (``benchmarks/gpt.py``), cut into 2 stages
    after half its blocks; ``batches(n)``: n batches of windows of the docs."""
    from benchmarks.gpt import GPT, docs_batches

    g = GPT(width=cfg["width"], blocks=cfg["blocks"], seq=cfg["seq"], stages=2)
    vocab, _ = docs_batches(g.seq, cfg["batch"], 0)
    params = g.init(vocab)
    return g.export(params), params, lambda steps: docs_batches(g.seq, cfg["batch"], steps)[1]


def _checkpoints(trainer, data, blocks: int, per_block: int) -> dict:
    """Alternating blocks of steps without and with a checkpoint after every step; medians."""
    plain, with_ck, waits, writes, saves = [], [], [], [], []
    with tempfile.TemporaryDirectory() as tmp:
        for b in range(blocks):
            s = trainer.step_count
            trainer.fit(data, steps=s + per_block)
            plain += [row.step_time for row in trainer.history[-per_block:]]
            s, seen = trainer.step_count, len(trainer.checkpoint_times)
            trainer.fit(data, steps=s + per_block, checkpoint_dir=os.path.join(tmp, f"ck{b}"), checkpoint_every=1)
            with_ck += [row.step_time for row in trainer.history[-per_block:]]
            waits += [t.wait for t in trainer.checkpoint_times[seen:]]
            writes += [t.write for t in trainer.checkpoint_times[seen:]]
            t0 = time.perf_counter()
            trainer.save(os.path.join(tmp, "sync"))
            saves.append(time.perf_counter() - t0)
        size = sum(f.stat().st_size for f in Path(tmp, "sync").iterdir())
    med = statistics.median
    return {
        "step": med(plain),
        "step_with_checkpoints": med(with_ck),
        "wait": med(waits),
        "write": med(writes),
        "save": med(saves),
        "bytes": size,
        "samples": len(with_ck),
    }


def _restarts(trainer, data, kills: int, every: int) -> dict:
    """Kill worker 1's actor after every ``every``-th step, ``kills`` times; from each kill to the next finished step."""
    import ray

    marks: dict[str, list[float]] = {"kill": [], "next": []}
    killed: set[int] = set()
    start = trainer.step_count

    def callback(step, loss):
        if len(marks["next"]) < len(marks["kill"]):
            marks["next"].append(time.monotonic())  # the first step to finish after the kill
        if step not in killed and len(killed) < kills and (step - start + 1) % every == 0:
            killed.add(step)
            marks["kill"].append(time.monotonic())
            ray.kill(trainer.workers()[1])

    with tempfile.TemporaryDirectory() as tmp:
        trainer.fit(
            data,
            steps=start + every * (kills + 1),
            checkpoint_dir=os.path.join(tmp, "ck"),
            checkpoint_every=1,
            max_restarts=kills,
            callback=callback,
        )
    gaps = [b - a for a, b in zip(marks["kill"], marks["next"])]
    rec = trainer.restarts[-kills:]
    return {
        "to_next_step": statistics.median(gaps),
        "found": statistics.median(r.found_at - k for r, k in zip(rec, marks["kill"])),
        "recovery": statistics.median(r.recovery_time for r in rec),
        "rerun_steps": statistics.median(r.step - r.returned_to for r in rec),
        "kills": len(gaps),
    }


def measure(quick: bool) -> dict:
    """The checkpoint figures in-process and on Ray, and the restart figures on Ray."""
    import optax
    import ray

    from vjpsplit_cli import pipeline as P

    cfg = SMALL if quick else MID
    stages, params, batches = model(cfg)
    blocks, per_block, kills = (1, 2, 1) if quick else (3, 4, 3)
    data = batches(4 + 2 * blocks * per_block + 2 * (kills + 1) + 4)
    # No XLA_FLAGS in the job's runtime_env: the runner gives each actor this process's flags with its own
    # device count, where a job-level XLA_FLAGS would stand as given (each actor seeing this child's 2
    # devices, driving 1: +20% CPU per actor on the GPT, benchmarks/results/2026-history-ray-training-steps.md).
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    kw = dict(optimizer=optax.adamw(3e-3), schedule="1f1b", microbatches=cfg["microbatches"])
    rows = []
    for runner in ("inprocess", "ray"):
        with P.Trainer(stages, params, runner=runner, **kw) as tr:
            tr.fit(data, steps=2)  # compile
            rows.append({"runner": runner, **_checkpoints(tr, data, blocks, per_block)})
            if runner == "ray":
                restart = _restarts(tr, data, kills, 2)
    ray.shutdown()
    return {"config": cfg, "rows": rows, "restart": restart, "load": os.getloadavg()[0]}


def table(data: dict) -> str:
    """The markdown tables of one run."""
    c, r = data["config"], data["restart"]
    lines = [
        f"GPT width {c['width']}, {c['blocks']} blocks, sequence {c['seq']}, batch {c['batch']} in "
        f"{c['microbatches']} microbatches, 2 stages, 1F1B, AdamW; medians over "
        f"{data['rows'][0]['samples']} steps; load average {data['load']:.1f} when done.",
        "",
        "| runner | step | step, checkpoint after each | the step's wait (copy to host) | background write | "
        "`save` (synchronous) | checkpoint size |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in data["rows"]:
        lines.append(
            f"| {row['runner']} | {row['step'] * 1e3:.0f} ms | {row['step_with_checkpoints'] * 1e3:.0f} ms | "
            f"{row['wait'] * 1e3:.1f} ms ({row['wait'] / row['step']:.1%} of a step) | {row['write'] * 1e3:.0f} ms | "
            f"{row['save'] * 1e3:.0f} ms | {row['bytes'] / 1e6:.1f} MB |"
        )
    lines += [
        "",
        f"Ray, worker 1's actor killed after a step ({r['kills']} times, `checkpoint_every=1`): from the kill to the "
        f"end of the next finished step {r['to_next_step']:.2f} s: the loss found after {r['found']:.2f} s (Ray "
        f"reports it), a new actor loaded and every worker back at the checkpoint in {r['recovery']:.2f} s, then "
        f"{r['rerun_steps']:.0f} step(s) run again (the new actor compiling its stages' calls on its first).",
    ]
    return "\n".join(lines)


def run(quick: bool) -> tuple[str, list[dict]]:
    """Measure in a single-threaded child process; return the markdown table and the rows."""
    return run_section("benchmarks.survive", quick, table)


def main(argv=None) -> int:
    """``--child``: measure and print JSON (run by ``run``); otherwise run the section and print its report."""
    return section_main(__doc__, measure, run, argv)


if __name__ == "__main__":
    sys.exit(main())
