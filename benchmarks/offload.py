"""Residuals off the device: peak live residual bytes per stage, step time and gradients, with and without offload.

    python -m benchmarks --only offload        # by hand; a few minutes on 2 shared cores
    python -m benchmarks.offload [--quick]     # this section alone

The train benchmark's mid GPT (``benchmarks/gpt.py``: width 256, 4 blocks, sequence
64, 2 rows per microbatch, AdamW, 2 stages on 2 host CPU devices, single-threaded
XLA per operation) trained by the Trainer in-process (untimed steps: every operation
dispatched from one thread), without offload, with ``InProcess(offload="host")`` (host NumPy
copies, as on every CPU device) and with ``Offload(to="files")`` (residual files in a
temporary directory). Candidates run in blocks of consecutive steps, interleaved
round by round; the step time is the median block time over its steps. Each
candidate trains on the same batches in the same order, so their parameters after
the run are compared bit for bit. The peak is ``StageWorker.peak_residual_bytes``:
the stored residuals (and W's intermediates) a stage holds on its device, counted
after every operation, the most over one timed step (each operation waits for its
results, so the count is what the device held then); untimed, the driver dispatches
far ahead of the devices and arrays on their way off count until their copy is done
(the "untimed" column). The machine's load average is
given beside the numbers: these cores are shared, so the step's CPU time (this process's, every
thread's, the same blocks) is given too: other processes' load moves it far less than the wall time.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time

from benchmarks.timing import run_section, section_main


OFFLOADS = ("none", "host", "files")  # the candidates, without offload first (the others' baseline)


def _config(quick: bool) -> dict:
    if quick:  # proves the section runs (CI): a small GPT, one schedule (the accelerator's --quick runs GPipe)
        return {"ms": [4], "schedules": ["1f1b"], "rounds": 1, "block": 1, "width": 32, "blocks": 2}
    return {"ms": [8, 16], "schedules": ["1f1b", "zbh1", "gpipe"], "rounds": 5, "block": 1}


def _case(g, stages, params, m: int, schedule: str, cfg: dict, tmp: str) -> dict:
    import jax
    import numpy as np
    import optax

    from benchmarks.gpt import docs_batches
    from vjpsplit_cli import pipeline as P

    _, data = docs_batches(g.seq, 2 * m, 4)
    offloads = {
        "none": None,
        "host": "host",
        "files": P.Offload(to="files", directory=os.path.join(tmp, f"{schedule}-{m}")),
    }
    offloads = {k: v for k, v in offloads.items() if k in cfg.get("offloads", OFFLOADS)}
    trainers = {
        k: P.Trainer(
            stages,
            params,
            optimizer=optax.adamw(1e-3),
            schedule=schedule,
            microbatches=m,
            runner=P.InProcess(offload=o),
        )
        for k, o in offloads.items()
    }
    turns = {k: 0 for k in trainers}

    def stepper(k: str):
        def step() -> None:
            trainers[k].step(data[turns[k] % len(data)])
            turns[k] += 1

        return step

    cands = {k: stepper(k) for k in trainers}
    for _ in range(2):  # warm-up: compiled calls, the offload threads
        for fn in cands.values():
            fn()
    samples: dict[str, list[float]] = {k: [] for k in cands}
    cpu: dict[str, list[float]] = {k: [] for k in cands}
    load = []
    for _ in range(cfg["rounds"]):
        for k, fn in cands.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(cfg["block"]):
                fn()
            samples[k].append((time.perf_counter() - t0) / cfg["block"])
            cpu[k].append((time.process_time() - c0) / cfg["block"])
        load.append(os.getloadavg()[0])
    row: dict = {"schedule": schedule, "microbatches": m, "load": statistics.mean(load)}
    untimed = {k: [t.worker.peak_residual_bytes for t in tr.backend.trainers] for k, tr in trainers.items()}
    for k in cands:  # one timed step each (every operation waits): the peaks as the devices computed them
        trainers[k].step(data[turns[k] % len(data)], timed=True)
        turns[k] += 1
    ref = jax.tree_util.tree_leaves(trainers["none"].params())
    for k, tr in trainers.items():
        got = jax.tree_util.tree_leaves(tr.params())
        row[k] = {
            "step": statistics.median(samples[k]),
            "cpu": statistics.median(cpu[k]),
            "peaks": [t.worker.peak_residual_bytes for t in tr.backend.trainers],
            "peaks_untimed": untimed[k],
            "bitwise": all(np.asarray(a).tobytes() == np.asarray(b).tobytes() for a, b in zip(got, ref)),
        }
        tr.close()
    return row


def measure(quick: bool, platform: str | None = None, cfg: dict | None = None) -> dict:
    """The rows of the section (in the child process with 2 host CPU devices, or on an accelerator's devices).

    ``platform``: the ``jax.export`` platform to export the stages for (default: the default device's);
    ``cfg``: the microbatch counts, schedules and rounds instead of ``_config(quick)``'s (and ``offloads``: the
    candidates of ``OFFLOADS`` to run, ``"none"`` among them; default all).
    """
    import jax

    from benchmarks.gpt import GPT, docs_batches

    cfg = cfg or _config(quick)
    g = GPT(width=cfg.get("width", 256), blocks=cfg.get("blocks", 4), stages=2)
    vocab, _ = docs_batches(g.seq, 16, 1)
    params = g.init(vocab)
    stages = g.export(params, platform or jax.devices()[0].platform)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for m in cfg["ms"]:
            for schedule in cfg["schedules"]:
                rows.append(_case(g, stages, params, m, schedule, cfg, tmp))
    return {"rows": rows, "devices": [str(d) for d in jax.devices()]}


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f}"


def table(data: dict) -> str:
    """The section's markdown: per schedule and m, each stage's peak (MiB), the step and the ratios."""
    out = [
        "| schedule | m | offload | peak stage 0 MiB | peak stage 1 MiB | stage 0 vs none | untimed stage 0 MiB "
        "| step ms | vs none | CPU ms | vs none | bitwise | load |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in data["rows"]:
        base = r["none"]
        for k in (k for k in OFFLOADS if k in r):
            c = r[k]
            out.append(
                f"| {r['schedule']} | {r['microbatches']} | {k} | {_mib(c['peaks'][0])} | {_mib(c['peaks'][1])} "
                f"| {c['peaks'][0] / max(base['peaks'][0], 1):.0%} | {_mib(c['peaks_untimed'][0])} "
                f"| {c['step'] * 1e3:.0f} "
                f"| {c['step'] / base['step']:.2f}x | {c['cpu'] * 1e3:.0f} | {c['cpu'] / base['cpu']:.2f}x "
                f"| {'yes' if c['bitwise'] else 'NO'} | {r['load']:.1f} |"
            )
    return "\n".join(out)


def run(quick: bool) -> tuple[str, list[dict]]:
    """The section, measured in a child process with 2 host CPU devices."""
    return run_section("benchmarks.offload", quick, table, devices=2)


def main(argv=None) -> int:
    return section_main(__doc__, measure, run, argv)


if __name__ == "__main__":
    raise SystemExit(main())
