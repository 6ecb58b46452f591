"""What the always-on ring of each worker's last operations costs an untimed Trainer step.

    python -m benchmarks.ring [--quick]

The train benchmark's tiny stages (``benchmarks/gpt.py``'s ``tiny_stages``: 8 gelu
layers of width 16 cut in two, 16 microbatches of 4 rows, 1F1B, SGD: 64 operations a
step, each of negligible work, so the runner's own costs are all there is), on 2 host
CPU devices. Two candidates on the same Trainer, alternately in blocks of 4 steps,
interleaved round by round (medians of the blocks): the ring as shipped
(``StageWorker._run`` notes each operation's dispatch: two ``time.monotonic`` calls and
a ``deque`` append), and the same method without those three lines.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

from benchmarks.timing import in_child_with_devices


def measure(rounds: int, block: int = 4) -> dict:
    """Median seconds per untimed step with and without the ring, and their ratio."""
    import optax

    from benchmarks.gpt import tiny_stages
    from vjpsplit_cli import pipeline as P
    from vjpsplit_cli.pipeline.runtime.worker import StageWorker

    M = 16
    stages, params, batch, _ = tiny_stages(microbatches=M)
    ringed = StageWorker._run

    def bare(self, worker, kind, mb, args, call, warmup):  # _run before the ring: untimed, it only calls
        if not self.timed:
            return call(*args)
        return ringed(self, worker, kind, mb, args, call, warmup)

    tr = P.Trainer(stages, params, optimizer=optax.sgd(1e-3), microbatches=M)
    for _ in range(5):  # compile, warm
        tr.step(batch)
    samples: dict[str, list[float]] = {"with the ring": [], "without": []}
    for _ in range(rounds):
        for name, method in (("with the ring", ringed), ("without", bare)):
            StageWorker._run = method
            t0 = time.perf_counter()
            for _ in range(block):
                tr.step(batch)
            samples[name].append((time.perf_counter() - t0) / block)
    StageWorker._run = ringed
    tr.close()
    med = {k: statistics.median(v) for k, v in samples.items()}
    # The ring's own work per operation, alone: what the step pays 64 times.
    from collections import deque

    ring: deque = deque(maxlen=256)
    n = 200_000
    t0 = time.perf_counter()
    for _ in range(n):
        a = time.monotonic()
        ring.append(("F", 0, a, time.monotonic(), True))
    per_op = (time.perf_counter() - t0) / n
    return {
        "with": med["with the ring"],
        "without": med["without"],
        "ratio": med["with the ring"] / med["without"],
        "per_op": per_op,
        "ops": 4 * M,
        "rounds": rounds,
        "block": block,
        "load": os.getloadavg()[0],
    }


def table(r: dict) -> str:
    """The measurement as the markdown docs quote it."""
    return "\n".join(
        [
            "| untimed Trainer step (tiny stages, 64 operations) | median |",
            "|---|---:|",
            f"| with the ring | {r['with'] * 1e3:.3f} ms |",
            f"| without | {r['without'] * 1e3:.3f} ms |",
            f"| ratio | {r['ratio']:.4f} |",
            "",
            f"The ring's own work: {r['per_op'] * 1e9:.0f} ns per operation alone ({r['ops']} a step: "
            f"{r['per_op'] * r['ops'] / r['without']:.2%} of the step). {r['rounds']} rounds of "
            f"{r['block']} steps each, interleaved; load average {r['load']:.1f}.",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    """Measure (``--quick``: fewer rounds) and print the table and the JSON row."""
    argv = sys.argv[1:] if argv is None else argv
    code = in_child_with_devices("benchmarks.ring", argv, devices=2)  # JAX must see 2 host devices
    if code is not None:
        return code
    r = measure(10 if "--quick" in argv else 60)
    print(table(r))
    print(json.dumps(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
