"""Multi-host on jax.distributed: the step on 2 processes against the in-process runner on the same devices.

    python -m benchmarks --only multihost        # by hand; a few minutes on 2 cores
    python -m benchmarks.multihost [--quick]     # this section alone

The GPT of ``benchmarks/gpt.py`` (width 256, 4 blocks, sequence 64, batch 16 in 8
microbatches, AdamW, 4 stages, 1F1B; ``--quick``: width 32, sequence 32, 4 microbatches) trains on 4
CPU devices of this host, single-threaded XLA: in one process with the in-process
runner (4 devices), and as a ``jax.distributed`` job of 2 processes of 2 devices
each (``python -m vjpsplit_cli.pipeline.launch -n 2 --devices 2``) with
``runner=P.Distributed()``, stages 0-1 in the first process and 2-3 in the second.
The two alternate round by round: each round starts a new process (or job), runs
warm-up steps (compiles), then times steps (``history``'s step time; the
distributed job's from process 0); the table gives the medians over the rounds'
steps and their ratio. A CPU figure: the devices are this host's cores, and the
values between the processes go over local sockets.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run by the launcher as a script: `python benchmarks/multihost.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.timing import SINGLE_THREAD  # noqa: E402

MID = {"width": 256, "blocks": 4, "seq": 64, "batch": 16, "microbatches": 8}
SMALL = {"width": 32, "blocks": 4, "seq": 32, "batch": 16, "microbatches": 4}
ROOT = Path(__file__).resolve().parents[1]


def steps(runner: str, quick: bool, out: str) -> None:
    """In a child (one process, or every process of the job): warm-up steps, then timed steps; the step times
    to ``out`` (JSON; in a job, process 0's)."""
    import jax
    import optax

    if runner == "distributed":
        from vjpsplit_cli.pipeline import launch

        launch.initialize()
    from benchmarks.gpt import GPT, docs_batches
    from vjpsplit_cli import pipeline as P

    cfg = SMALL if quick else MID
    g = GPT(width=cfg["width"], blocks=cfg["blocks"], seq=cfg["seq"], stages=4)
    warm, timed = (2, 3) if quick else (3, 8)
    vocab, data = docs_batches(g.seq, cfg["batch"], warm + timed)
    params = g.init(vocab)
    tr = P.Trainer(
        g.export(params),
        params,
        optimizer=optax.adamw(3e-3),
        schedule="1f1b",
        microbatches=cfg["microbatches"],
        runner=runner,
        observe=P.Observe(step_timeout=300),
    )
    tr.fit(data, warm + timed)
    if jax.process_index() == 0:
        with open(out, "w") as f:
            json.dump([row.step_time for row in tr.history[warm:]], f)


def _child(runner: str, quick: bool) -> list[float]:
    """One round of ``runner`` in a new process (in-process: 4 devices) or job (2 processes of 2 devices)."""
    per_process = 2 if runner == "distributed" else 4
    # The device count first: XLA reads no flag after SINGLE_THREAD's bare intra_op_parallelism_threads=1.
    flags = f"--xla_force_host_platform_device_count={per_process} {SINGLE_THREAD}"
    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "steps.json")
        me = [str(Path(__file__).resolve()), "--child", runner, out] + (["--quick"] if quick else [])
        launch = [sys.executable, "-m", "vjpsplit_cli.pipeline.launch", "-n", "2"]
        cmd = [*launch, *me] if runner == "distributed" else [sys.executable, *me]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT, timeout=900)
        if proc.returncode != 0:
            raise RuntimeError(f"{runner} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def measure(quick: bool) -> dict:
    """The rounds, alternated; the medians and their ratio."""
    rounds = 1 if quick else 3
    samples: dict[str, list[float]] = {"inprocess": [], "distributed": []}
    for _ in range(rounds):
        for runner in samples:
            samples[runner] += _child(runner, quick)
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "config": SMALL if quick else MID,
        "step": med,
        "ratio": med["distributed"] / med["inprocess"],
        "samples": len(samples["inprocess"]),
        "rounds": rounds,
        "load": os.getloadavg()[0],
    }


def table(data: dict) -> str:
    """The markdown table of one run."""
    c, s = data["config"], data["step"]
    return "\n".join(
        [
            f"GPT width {c['width']}, {c['blocks']} blocks, sequence {c['seq']}, batch {c['batch']} in "
            f"{c['microbatches']} microbatches, 4 stages on 4 CPU devices, 1F1B, AdamW; medians over "
            f"{data['samples']} steps per runner ({data['rounds']} rounds, alternated); load average "
            f"{data['load']:.1f} when done. A CPU figure.",
            "",
            "| runner | where | step | vs in-process |",
            "|---|---|---:|---:|",
            f"| in-process | 1 process, 4 devices | {s['inprocess'] * 1e3:.0f} ms | 1.00x |",
            f"| `P.Distributed()` | 2 processes of 2 devices (`launch -n 2`) | {s['distributed'] * 1e3:.0f} ms | "
            f"{data['ratio']:.2f}x |",
        ]
    )


def run(quick: bool) -> tuple[str, list[dict]]:
    """Measure (each round in its own process or job); the markdown table and the rows."""
    data = measure(quick)
    return table(data), [data]


def main(argv: list[str] | None = None) -> int:
    """``--child RUNNER OUT``: one round's steps (run by ``measure``); otherwise the section's report."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="the short run CI makes")
    ap.add_argument("--child", nargs=2, metavar=("RUNNER", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        steps(args.child[0], args.quick, args.child[1])
        return 0
    print(run(args.quick)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
