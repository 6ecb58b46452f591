"""GPipe vs 1F1B vs ZB-H1 on a 4-stage MLP, over exported artifacts.

    python samples/pipeline/run.py [--runner ray|inprocess|both] [--steps 3] [--out DIR]
                                   [--address ray://head:10001] [--progress]

For each schedule: one warm-up step, then ``--steps`` measured steps; prints the
median step time, the measured bubble ratio, and the modeled one (the measured op
times replayed as if every stage had a device of its own: on a machine with fewer
cores than stages, stages share cores and the measured ratio mixes in that
contention). Checks every step's loss and gradients against
``jax.value_and_grad`` of the whole model, and writes a timeline PNG per schedule.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stages as model  # noqa: E402

from vjpsplit_cli import pipeline as P  # noqa: E402


def check(result, loss, grads) -> str | None:
    if not np.allclose(result.loss, loss, rtol=1e-4):
        return f"loss {result.loss} != {float(loss)}"
    for a, b in zip(jax.tree_util.tree_leaves(result.grads), jax.tree_util.tree_leaves(grads)):
        if not np.allclose(a, b, rtol=1e-3, atol=1e-5):
            return f"gradients differ by {float(np.max(np.abs(np.asarray(a) - np.asarray(b)))):.2e}"
    return None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runner", choices=["ray", "inprocess", "both"], default="both")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--out", default=None, help="where to write timeline PNGs (default: a temp dir)")
    ap.add_argument("--address", default=None, help="Ray cluster address for multi-host (default: a local Ray)")
    ap.add_argument("--progress", action="store_true", help="show a progress bar per step")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="vjpsplit-pipeline-"))
    out.mkdir(parents=True, exist_ok=True)

    params = model.init()
    arts = model.export_stages(params)
    rng = np.random.default_rng(1)
    x = rng.normal(size=(args.batch, model.WIDTH)).astype(np.float32)
    labels = rng.integers(0, model.CLASSES, args.batch).astype(np.int32)
    loss, grads = jax.value_and_grad(model.whole)(params, x, labels)

    runners = ["inprocess", "ray"] if args.runner == "both" else [args.runner]
    rows = []
    for runner in runners:
        rp = P.RayPipeline(arts, params, address=args.address) if runner == "ray" else None
        try:
            for name in P.SCHEDULES:
                def step():
                    if rp is not None:
                        return rp.run(x, [labels], microbatches=args.microbatches, schedule_name=name,
                                      progress=args.progress)
                    return P.run_inprocess(arts, params, x, [labels], microbatches=args.microbatches,
                                           schedule_name=name, progress=args.progress)

                step()  # warm-up: compiles every module once per process
                results = [step() for _ in range(args.steps)]
                for r in results:
                    bad = check(r, loss, grads)
                    if bad:
                        print(f"FAIL {runner} {name}: {bad}")
                        return 1
                best = sorted(results, key=lambda r: r.step_time)[len(results) // 2]
                png = out / f"timeline_{runner}_{name}.png"
                best.plot(png)
                rows.append((runner, name, statistics.median(r.step_time for r in results),
                             statistics.median(r.bubble_ratio for r in results),
                             statistics.median(r.modeled_bubble_ratio for r in results), png))
        finally:
            if rp is not None:
                rp.close()
    print(f"4 stages, batch {args.batch} in {args.microbatches} microbatches; loss and gradients match "
          f"jax.value_and_grad for every step; {args.steps} measured steps each")
    print()
    print("| runner | schedule | step time (median) | measured bubble | modeled bubble (1 device/stage) |")
    print("|---|---|---:|---:|---:|")
    for runner, name, t, bub, model_bub, _ in rows:
        print(f"| {runner} | {name} | {t * 1e3:.0f} ms | {bub:.0%} | {model_bub:.0%} |")
    print()
    print(f"timelines: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
