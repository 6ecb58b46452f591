"""GPipe, 1F1B, ZB-H1, ZB-V, interleaved 1F1B and DualPipeV on an 8-layer MLP over 4 workers, over artifacts.

    python samples/pipeline/run.py [--runner ray|inprocess|both] [--steps 3] [--out DIR]
                                   [--address ray://head:10001] [--progress] [--schedules zbv,dualpipev]

GPipe, 1F1B and ZB-H1 cut the model into 4 stages of 2 layers, one per worker;
ZB-V and DualPipeV cut it into 8 stages of 1 layer, two per worker in a V, and
interleaved 1F1B into the same 8, two per worker round robin. For each schedule:
one warm-up step, then ``--steps`` measured steps; prints the median step time,
the measured bubble ratio, and the modeled one (the measured op times replayed
as if every worker had a device of its own: on a machine with fewer cores than
workers, workers share cores and the measured ratio mixes in that contention).
Checks every step's loss and gradients against ``jax.value_and_grad`` of the
whole model, and writes a timeline PNG per schedule.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import stages as model  # noqa: E402

from vjpsplit_cli import pipeline as P  # noqa: E402
from vjpsplit_cli.pipeline.schedules.catalog import LABELS, SCHEDULES  # noqa: E402
from vjpsplit_cli.pipeline.schedules.layout import layout_kind  # noqa: E402

# The measured columns run every worker on this host's one device, sharing its cores, and the modeled
# column replays them as one device per worker: the sharing is meant, so its warning is not shown.
warnings.filterwarnings("ignore", category=P.SharedDevicesWarning)

WORKERS = 4
RUNNERS = {"inprocess": "in-process", "ray": f"Ray, {WORKERS} actors"}  # as docs/performance.md labels them


def note(msg: str) -> None:
    """Progress on stderr, so a long run is never silent and stdout stays the report."""
    print(f"... {msg}", file=sys.stderr, flush=True)


def check(result, loss, grads) -> str | None:
    if not np.allclose(result.loss, loss, rtol=1e-4):
        return f"loss {result.loss} != {float(loss)}"
    for a, b in zip(jax.tree_util.tree_leaves(result.grads), jax.tree_util.tree_leaves(grads), strict=True):
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
    ap.add_argument("--schedules", default=",".join(SCHEDULES), help="comma-separated schedule names (default: all)")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="vjpsplit-pipeline-"))
    out.mkdir(parents=True, exist_ok=True)

    runners = ["inprocess", "ray"] if args.runner == "both" else [args.runner]
    if "ray" in runners:  # one Ray for every schedule's actors; each RayPipeline then joins it
        import logging
        import os

        import ray

        # Before JAX starts its threads: Ray forks while starting, which JAX warns about
        # once it runs. Ray's own notices (its token setup, its start) are not this sample's output.
        note("starting a local Ray" if not args.address else f"connecting to Ray at {args.address}")
        ray.init(
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
            **({"address": args.address} if args.address else {"num_cpus": max(2 * WORKERS, os.cpu_count() or 1)}),
        )

    note(f"exporting the {WORKERS} and {2 * WORKERS} stage artifacts")
    params = model.init()
    cuts = {n: model.export_stages(params, n) for n in (WORKERS, 2 * WORKERS)}  # one function, cut at its marks
    rng = np.random.default_rng(1)
    x = rng.normal(size=(args.batch, model.WIDTH)).astype(np.float32)
    labels = rng.integers(0, model.CLASSES, args.batch).astype(np.int32)
    loss, grads = jax.value_and_grad(model.whole)(params, x, labels)

    rows = []
    for runner in runners:
        for name in args.schedules.split(","):
            note(f"{RUNNERS[runner]}, {LABELS[name]}: a warm-up step, then {args.steps} measured")
            stages = cuts[WORKERS if layout_kind(name) == "stage" else 2 * WORKERS]
            rp = P.RayPipeline(stages, params, layout=layout_kind(name)) if runner == "ray" else None
            try:

                def step():
                    if rp is not None:
                        return rp.run(
                            (x, labels), microbatches=args.microbatches, schedule=name, progress=args.progress
                        )
                    return P.run_inprocess(
                        stages,
                        params,
                        (x, labels),
                        microbatches=args.microbatches,
                        schedule=name,
                        progress=args.progress,
                    )

                step()  # warm-up: compiles every module once per worker
                results = [step() for _ in range(args.steps)]
            finally:
                if rp is not None:
                    rp.close()
            for r in results:
                bad = check(r, loss, grads)
                if bad:
                    print(f"FAIL {runner} {name}: {bad}")
                    return 1
            best = sorted(results, key=lambda r: r.step_time)[len(results) // 2]
            png = out / f"timeline_{runner}_{name}.png"
            best.plot(png)
            rows.append(
                (
                    runner,
                    name,
                    len(stages),
                    statistics.median(r.step_time for r in results),
                    statistics.median(r.bubble_ratio for r in results),
                    statistics.median(r.modeled_bubble_ratio for r in results),
                )
            )
    if "ray" in runners:
        import ray

        ray.shutdown()
    print(
        f"{model.LAYERS}-layer MLP on {WORKERS} workers, batch {args.batch} in {args.microbatches} microbatches; "
        f"loss and gradients match jax.value_and_grad for every step; {args.steps} measured "
        f"step{'' if args.steps == 1 else 's'} each"
    )
    print()
    print(
        f"| runner | schedule | stages | step time (median of {args.steps}) | measured bubble "
        "| modeled bubble (1 device/worker) |"
    )
    print("|---|---|---:|---:|---:|---:|")
    for runner, name, n, t, bub, model_bub in rows:
        print(f"| {RUNNERS[runner]} | {LABELS[name]} | {n} | {t * 1e3:.0f} ms | {bub:.0%} | {model_bub:.0%} |")
    print()
    print(f"timelines: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
