"""Data parallel x pipeline on 8 CPU devices: collectives per step, per-device optimizer bytes, step times.

    python -m benchmarks.data_parallel [--quick]

The model: an MLP (width 256, 8 layers, GELU, softmax cross-entropy; ``tests/stage_models.mlp``'s
form) cut into 2 stages (``export_stages(..., stages=2)``), Adam, batch 128 in 4 microbatches,
on 8 host CPU devices (a child process with
``XLA_FLAGS=--xla_force_host_platform_device_count=8``: the 8 "devices" share this machine's cores).
Three ways to train it, interleaved round by round (medians):

* ``Trainer(..., data_parallel=4)``: PP 2 x DP 4, one reduce-scatter per stage per step;
* the same with every replica group's ``per_microbatch`` set: the reduction also after every
  microbatch's gradient (m per step, the results unchanged), as a data-parallel stage program
  that reduces inside its backward does;
* one ``jit(value_and_grad)`` + optax update as an SPMD program over the 8 devices (the batch
  sharded over them, the parameters replicated: XLA all-reduces the gradients).

Collectives are counted from the compiled programs' HLO text (each stage's reduction program, times
how often it ran in a step); optimizer bytes from the state arrays' addressable shards.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import sys
import time
from pathlib import Path

from benchmarks.timing import run_child

ROOT = Path(__file__).resolve().parents[1]
_REDUCTION = re.compile(r"\b(all-reduce|reduce-scatter)(-start)?\(")


def _child(quick: bool) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from jax import export as jexport
    from jax.sharding import NamedSharding, PartitionSpec

    sys.path.insert(0, str(ROOT / "tests"))
    from stage_models import mlp, mlp_params

    import vjpsplit_cli as vs
    from vjpsplit_cli import pipeline as P
    from vjpsplit_cli.pipeline.runtime.reduction import AXIS

    width, classes, batch, m, n = 256, 16, 128, 4, 4
    params = mlp_params(width=width, classes=classes, layers=8)
    rng = np.random.default_rng(0)
    batches = [
        (rng.normal(size=(batch, width)).astype(np.float32), rng.integers(0, classes, batch).astype(np.int32))
        for _ in range(4)
    ]
    (b,) = jexport.symbolic_shape("b")
    S = jax.ShapeDtypeStruct
    specs = jax.tree_util.tree_map(lambda a: S(np.shape(a), a.dtype), params)
    stages = vs.export_stages(
        mlp, specs, S((b, width), jnp.float32), S((b,), jnp.int32), wrt="params", stages=2, platforms="cpu"
    )
    tx = optax.adam(1e-3)

    once = P.Trainer(stages, params, optimizer=tx, microbatches=m, runner=P.InProcess(data_parallel=n))
    every = P.Trainer(stages, params, optimizer=tx, microbatches=m, runner=P.InProcess(data_parallel=n))
    for t in every.backend.trainers:
        t.worker.per_microbatch = True

    mesh = jax.sharding.Mesh(np.asarray(jax.devices()), ("d",))
    rep, rows = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("d"))

    def spmd_step(p, state, x, y):
        loss, g = jax.value_and_grad(mlp)(p, x, y)
        u, state = tx.update(g, state, p)
        return optax.apply_updates(p, u), state, loss

    spmd = jax.jit(spmd_step, in_shardings=(rep, rep, rows, rows), out_shardings=(rep, rep, rep))
    sp = jax.device_put(params, rep)
    ss = jax.device_put(tx.init(params), rep)
    spmd_args = [jax.device_put(bt, rows) for bt in batches]

    def run_spmd(i):
        nonlocal sp, ss
        sp, ss, loss = spmd(sp, ss, *spmd_args[i % len(spmd_args)])
        return float(loss)

    cands = {
        "once": lambda i: once.step(batches[i % len(batches)]),
        "every": lambda i: every.step(batches[i % len(batches)]),
        "spmd": run_spmd,
    }
    for f in cands.values():  # compile
        f(0)
        f(1)
    before = {k: [t.worker.reductions for t in tr.backend.trainers] for k, tr in (("once", once), ("every", every))}
    once.step(batches[0])
    every.step(batches[0])
    per_step = {
        k: [t.worker.reductions - b0 for t, b0 in zip(tr.backend.trainers, before[k])]
        for k, tr in (("once", once), ("every", every))
    }
    times: dict[str, list[float]] = {k: [] for k in cands}
    for r in range(3 if quick else 12):
        for k, f in cands.items():
            t0 = time.perf_counter()
            f(r)
            jax.block_until_ready(jax.live_arrays()[:1])
            times[k].append(time.perf_counter() - t0)

    stage_rows = []
    for t in once.backend.trainers:
        g = t.worker
        red = g.reducer
        args = [
            S((n * s[0], *s[1:]) if s else (n,), a.dtype, sharding=NamedSharding(g.mesh, PartitionSpec(AXIS)))
            for s, a in zip(red.shapes, jax.tree_util.tree_leaves(g.params))
        ]
        hlo = red.program.lower(*args).compile().as_text()
        per_dev, whole = t.optimizer_bytes()
        grad_bytes = sum(
            int(np.prod(s)) * a.dtype.itemsize for s, a in zip(red.shapes, jax.tree_util.tree_leaves(g.params))
        )
        stage_rows.append(
            {
                "stage": t.stage_index,
                "collectives_in_reduction": len(_REDUCTION.findall(hlo)),
                "reductions_per_step_once": per_step["once"][t.stage_index],
                "reductions_per_step_every": per_step["every"][t.stage_index],
                "gradient_bytes": grad_bytes,
                "opt_bytes_per_device": per_dev,
                "opt_bytes_whole": whole,
            }
        )
    spmd_hlo = spmd.lower(sp, ss, *spmd_args[0]).compile().as_text()
    once.close()
    every.close()
    return {
        "stages": stage_rows,
        "spmd_reductions": len(_REDUCTION.findall(spmd_hlo)),
        "ms": {k: statistics.median(v) * 1e3 for k, v in times.items()},
        "rounds": len(times["once"]),
        "load": os.getloadavg(),
    }


def run(quick: bool = False) -> tuple[str, dict]:
    """The markdown tables and the raw figures, measured in a child process with 8 CPU devices."""
    v = run_child("benchmarks.data_parallel", quick, devices=8, single_thread=False)
    lines = [
        "| stage | reduce-scatters in its reduction program | reductions per step: once (this design) / "
        "per microbatch (m = 4) | gradient bytes reduced per reduction | optimizer state per device / whole |",
        "| --- | --- | --- | --- | --- |",
    ]
    for s in v["stages"]:
        lines.append(
            f"| {s['stage']} | {s['collectives_in_reduction']} | {s['reductions_per_step_once']} / "
            f"{s['reductions_per_step_every']} | {s['gradient_bytes'] / 2**10:.0f} KiB | "
            f"{s['opt_bytes_per_device'] / 2**10:.1f} / {s['opt_bytes_whole'] / 2**10:.1f} KiB |"
        )
    ms = v["ms"]
    lines += [
        "",
        "| step (PP 2 x DP 4 on 8 host CPU devices, medians of interleaved rounds) | ms | / one SPMD program |",
        "| --- | ---: | ---: |",
        f"| Trainer, data_parallel=4: one reduction per stage per step | {ms['once']:.1f} | {ms['once'] / ms['spmd']:.2f}x |",
        f"| the same, reducing after every microbatch | {ms['every']:.1f} | {ms['every'] / ms['spmd']:.2f}x |",
        f"| one jit(value_and_grad) + optax SPMD program over 8 devices ({v['spmd_reductions']} all-reduce op(s)) | "
        f"{ms['spmd']:.1f} | 1.00x |",
        "",
        f"{v['rounds']} rounds; load average during the run {v['load'][0]:.1f} (1 min) on {os.cpu_count()} cores.",
    ]
    return "\n".join(lines), v


if __name__ == "__main__":
    if "--child" in sys.argv:
        print(json.dumps(_child("--quick" in sys.argv)))
    else:
        print(run("--quick" in sys.argv)[0])
