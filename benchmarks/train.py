"""Training steps: the pipelined Trainer (in-process, Ray) against one process's jit(value_and_grad) + optax update.

    python -m benchmarks --only train            # by hand; a few minutes on 2 cores
    python -m benchmarks.train [--quick]         # this section alone

The model is ``samples/pipeline/train_gpt.py``'s character-level GPT (tied
embedding, 4 stages, AdamW), on its batches of the repository's docs. The work
runs in a child process with single-threaded XLA, as do the Ray actors, so each
worker uses one core as one device per stage would. "modeled" replays the last
step's measured F, B and W times under the schedule with one device per worker
(the update, which runs after each worker's last W, is not in it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import time
from pathlib import Path

from benchmarks.timing import run_section

ROOT = Path(__file__).resolve().parents[1]


def _sample():
    spec = importlib.util.spec_from_file_location("train_gpt", ROOT / "samples" / "pipeline" / "train_gpt.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def measure(quick: bool) -> dict:
    """Median step times of each candidate (interleaved rounds), with the modeled pipelined step."""
    import jax
    import jax.numpy as jnp
    import optax
    from jax import export as jexport

    import vjpsplit_cli as vs
    from vjpsplit_cli import pipeline as P

    g = _sample()
    rounds = 5 if quick else 20
    ids, vocab = g.corpus()
    params = g.init(vocab)
    (b,) = jexport.symbolic_shape("b")
    spec = jax.ShapeDtypeStruct
    tree = jax.tree_util.tree_map(lambda a: spec(a.shape, a.dtype), params)
    stages = vs.export_stages(
        g.loss, tree, spec((b, g.SEQ), jnp.int32), spec((b, g.SEQ), jnp.int32), wrt="params", platforms="cpu"
    )
    data = list(g.batches(ids, rounds + 2))
    tx = optax.adamw(3e-3)

    @jax.jit
    def one(p, s, tokens, labels):
        value, grads = jax.value_and_grad(g.loss)(p, tokens, labels)
        u, s = tx.update(grads, s, p)
        return optax.apply_updates(p, u), s, value

    state = {"p": params, "s": tx.init(params)}

    def single(batch):
        state["p"], state["s"], v = one(state["p"], state["s"], *batch)
        return float(v)

    import ray

    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}},
    )
    trainers = {
        r: P.Trainer(stages, params, optimizer=tx, schedule_name="1f1b", microbatches=g.MICROBATCHES, runner=r)
        for r in ("inprocess", "ray")
    }
    cands = {"one process": single, **{f"Trainer {r}": t.step for r, t in trainers.items()}}
    times: dict[str, list[float]] = {k: [] for k in cands}
    modeled: dict[str, list[float]] = {k: [] for k in trainers}
    for i, batch in enumerate(data):
        for k, fn in cands.items():
            t0 = time.perf_counter()
            fn(batch)
            if i >= 2:  # warm-up steps compile
                times[k].append(time.perf_counter() - t0)
        for r, t in trainers.items():
            res = t.last_result
            ev = res.modeled_timeline()
            if i >= 2:
                modeled[r].append(max(e.end for e in ev) - min(e.start for e in ev))
    for t in trainers.values():
        t.close()
    ray.shutdown()
    rows = [{"candidate": k, "step": statistics.median(v)} for k, v in times.items()]
    for row in rows:
        r = row["candidate"].removeprefix("Trainer ")
        row["modeled"] = statistics.median(modeled[r]) if r in modeled else None
    config = {"width": g.WIDTH, "seq": g.SEQ, "batch": g.BATCH, "microbatches": g.MICROBATCHES, "rounds": rounds}
    return {"config": config, "rows": rows, "load": os.getloadavg()[0]}


def table(data: dict) -> str:
    """The markdown table of one run."""
    c = data["config"]
    base = next(r["step"] for r in data["rows"] if r["candidate"] == "one process")
    lines = [
        f"char GPT (width {c['width']}, sequence {c['seq']}, tied embedding, 4 stages), batch {c['batch']} in "
        f"{c['microbatches']} microbatches, 1F1B, AdamW; medians of {c['rounds']} interleaved steps; "
        f"load average {data['load']:.1f} when done.",
        "",
        "| candidate | step time | vs one process | modeled step (one device per worker) |",
        "|---|---:|---:|---:|",
    ]
    for r in data["rows"]:
        m = "" if r["modeled"] is None else f"{r['modeled'] * 1e3:.1f} ms"
        lines.append(f"| {r['candidate']} | {r['step'] * 1e3:.1f} ms | {r['step'] / base:.2f}× | {m} |")
    return "\n".join(lines)


def run(quick: bool) -> tuple[str, list[dict]]:
    """Measure in a single-threaded child process; return the markdown table and the rows."""
    return run_section("benchmarks.train", quick, table)


def main(argv=None) -> int:
    """``--child``: measure and print JSON (run by ``run``); otherwise run the section and print its table."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.quick)))
        return 0
    print(run(args.quick)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
