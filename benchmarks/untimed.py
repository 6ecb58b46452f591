"""What running an untimed Trainer step in its helper thread costs, against dispatching it from the caller's.

    python -m benchmarks.untimed [--quick] [--rounds N]

The train benchmark's tiny stages (``benchmarks/gpt.py``'s ``tiny_stages``: 8 gelu
layers of width 16 cut in two, 16 microbatches of 4 rows, 1F1B, SGD: 64 operations a
step, each of negligible work, so the runner's own costs are all there is), on 2 host
CPU devices. Two candidates on the same Trainer (``step_timeout=60``), alternately in
blocks of 4 steps, interleaved round by round, which goes first alternating (medians of
the blocks): the untimed step as shipped (its dispatch, updates and loss fetch in the
backend's kept thread, each operation noted in ``inprocess.Dispatched``, the caller
waiting with ``step_timeout``), and the same step as it was before, from the caller's
thread with nothing noted and no watchdog (``dispatch``, ``_finish``, ``fetch_losses``).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from benchmarks.timing import in_child_with_devices


def measure(rounds: int, block: int = 4) -> dict:
    """Median seconds per untimed step in the helper thread and in the caller's, and their ratio."""
    import optax

    from benchmarks.gpt import tiny_stages
    from vjpsplit_cli import pipeline as P
    from vjpsplit_cli.pipeline.runtime.untimed import dispatch
    from vjpsplit_cli.pipeline.training.local_backend import InProcessBackend

    M = 16
    stages, params, batch, _ = tiny_stages(microbatches=M)
    shipped = InProcessBackend._untimed

    def here(self, mbs, schedule, microbatches, clip):  # the step before the hand-off: all from this thread
        workers = [t.worker for t in self.trainers]
        order, finishing = self._orders(schedule.plans)
        dispatch(workers, schedule.plans, mbs, microbatches, order)
        sums = self._finish(finishing, clip, self._value(microbatches), lambda: None)
        return sums, workers[-1].fetch_losses()

    tr = P.Trainer(stages, params, optimizer=optax.sgd(1e-3), microbatches=M, observe=P.Observe(step_timeout=60))
    for _ in range(5):  # compile, warm
        tr.step(batch)
    samples: dict[str, list[float]] = {"helper thread": [], "caller's thread": []}
    candidates = [("helper thread", shipped), ("caller's thread", here)]
    for i in range(rounds):
        for name, method in candidates if i % 2 == 0 else candidates[::-1]:  # each goes first every other round
            InProcessBackend._untimed = method  # type: ignore[method-assign]
            t0 = time.perf_counter()
            for _ in range(block):
                tr.step(batch)
            samples[name].append((time.perf_counter() - t0) / block)
    InProcessBackend._untimed = shipped  # type: ignore[method-assign]
    tr.close()
    handoff, noting = own_costs()
    med = {k: statistics.median(v) for k, v in samples.items()}
    # Each round's two blocks ran back to back: their ratio cancels the machine's slower drifts.
    paired = sorted(a / b for a, b in zip(samples["helper thread"], samples["caller's thread"]))
    q1, _, q3 = statistics.quantiles(paired, n=4)
    return {
        "helper": med["helper thread"],
        "caller": med["caller's thread"],
        "ratio": med["helper thread"] / med["caller's thread"],
        "paired": statistics.median(paired),
        "paired_iqr": [q1, q3],
        "handoff": handoff,
        "noting": noting,
        "own": (handoff + 4 * M * noting) / med["caller's thread"],
        "ops": 4 * M,
        "rounds": rounds,
        "block": block,
        "load": os.getloadavg()[0],
    }


def own_costs(n: int = 2000) -> tuple[float, float]:
    """The shipped step's own work, alone (steadier than the end-to-end difference on a shared machine):
    seconds of one hand-off to the kept thread and back (``run_untimed`` of an empty body), and seconds
    ``Dispatched`` spends noting one operation (``begin`` and ``end`` of an operation handing on one array)."""
    import jax.numpy as jnp

    from vjpsplit_cli.pipeline.runtime.stepwatch import Watch
    from vjpsplit_cli.pipeline.runtime.untimed import Dispatched, run_untimed
    from vjpsplit_cli.pipeline.runtime.workerthreads import WorkerThreads
    from vjpsplit_cli.pipeline.schedules.ops import Op

    pool = WorkerThreads(1, "vjpsplit-bench")
    empty = Dispatched([[]], 0)
    for _ in range(50):
        run_untimed(pool, lambda: None, empty, [], Watch(60.0))
    t0 = time.perf_counter()
    for _ in range(n):
        run_untimed(pool, lambda: None, empty, [], Watch(60.0))
    handoff = (time.perf_counter() - t0) / n
    pool.close()
    ops = [Op("F", m, 0) for m in range(n)]
    out = jnp.ones(4)
    out.block_until_ready()
    rec = Dispatched([ops], 1)
    t0 = time.perf_counter()
    for op in ops:
        rec.begin(0, op)
        rec.end(0, op, out, None)  # type: ignore[arg-type]  # an array is handed on: the stage is not read
    return handoff, (time.perf_counter() - t0) / n


def table(r: dict) -> str:
    """The measurement as the docs quote it."""
    return "\n".join(
        [
            "| untimed Trainer step (tiny stages, 64 operations) | median |",
            "|---|---:|",
            f"| in the helper thread (shipped) | {r['helper'] * 1e3:.3f} ms |",
            f"| from the caller's thread, nothing noted | {r['caller'] * 1e3:.3f} ms |",
            f"| ratio of the medians | {r['ratio']:.4f} |",
            f"| median of the rounds' ratios (quartiles) | {r['paired']:.4f} ({r['paired_iqr'][0]:.3f}-"
            f"{r['paired_iqr'][1]:.3f}) |",
            f"| own work: one hand-off to the kept thread and back | {r['handoff'] * 1e6:.1f} µs |",
            f"| own work: noting one operation | {r['noting'] * 1e6:.2f} µs |",
            f"| own work per step (hand-off + {r['ops']} operations), of the step | {r['own'] * 100:.2f}% |",
            "",
            f"{r['rounds']} rounds of {r['block']} steps each, interleaved; load average {r['load']:.1f}.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Measure (``--quick``: fewer rounds) and print the table and the JSON row."""
    argv = sys.argv[1:] if argv is None else argv
    code = in_child_with_devices("benchmarks.untimed", argv, devices=2)  # JAX must see 2 host devices
    if code is not None:
        return code
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 60
    r = measure(10 if "--quick" in argv else rounds)
    print(table(r))
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
