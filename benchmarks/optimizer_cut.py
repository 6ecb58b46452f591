"""The whole model's optimizer update cut by stage (``pipeline/training/separable.py``): what it costs the driver.

Per model size (leaves of f32[64, 64]) and optimizer: the analysis (``WholeOptimizer``: ``make_jaxpr`` of
the whole model's init and update, every value labelled) and tracing one stage's share of the update (a
quarter of the leaves, what ``jax.export`` traces) beside tracing optax's update on that quarter alone
(what a stage's program traced before the cut), interleaved, in CPU seconds of the process.
"""

from __future__ import annotations

import jax
import numpy as np
import optax

import statistics
import time

from benchmarks.timing import interleaved_samples
from vjpsplit_cli.pipeline.training.separable import WholeOptimizer
from vjpsplit_cli.pipeline.training.optax_state import StateMap

OPTIMIZERS = {
    "adamw": lambda: optax.adamw(1e-3),
    "chain(clip_by_global_norm, adamw)": lambda: optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
    "dowg": lambda: optax.contrib.dowg(),
}


def _model(leaves: int) -> tuple[dict, list[list[str]]]:
    spec = jax.ShapeDtypeStruct((64, 64), np.float32)
    params = {f"l{i:04d}": spec for i in range(leaves)}
    keys = sorted(params)
    q = max(1, leaves // 4)
    return params, [keys[i : i + q] for i in range(0, leaves, q)]


def run(quick: bool) -> tuple[str, list[dict]]:
    """Markdown table and rows."""
    rounds = 3 if quick else 10
    rows = []
    for leaves in (16, 128) if quick else (16, 128, 512):
        params, names = _model(leaves)
        keys = {k: k for k in params}
        for label, make in OPTIMIZERS.items():
            tx = make()

            def analysis(tx=tx, params=params, keys=keys, names=names, label=label):
                """What the Trainer builds once (state.whole_optimizer): the state map and the labelled programs."""
                smap = StateMap(tx, params, keys, names)
                where: dict = {}
                for j, at in enumerate(smap.whole):
                    where.setdefault(at, []).append(j)
                index = [[where[at] for at in ats] for _, ats in smap.stages]
                owners = [at.key for at in smap.whole]
                return WholeOptimizer(tx, params, keys, names, label, owners, smap.entries, index)

            whole = analysis()
            share = whole.stage(0)
            mine = {k: params[k] for k in names[0]}
            sstate = jax.eval_shape(tx.init, mine)
            reduced = [np.zeros((), r.dtype) for r in whole.roots()]

            def stage_share(share=share, mine=mine, sstate=sstate, reduced=reduced):
                p = list(mine.values())
                s = jax.tree_util.tree_leaves(sstate)
                jax.make_jaxpr(lambda p, s, g: share.update(p, s, g, np.float32(1), np.float32(0), reduced))(p, s, p)

            def optax_alone(tx=tx, mine=mine, sstate=sstate):
                jax.make_jaxpr(lambda g, s, p: tx.update(g, s, p))(mine, sstate, mine)

            # CPU seconds of this process (a shared machine's load inflates wall time, not these).
            cands = {"analysis": analysis, "stage": stage_share, "optax": optax_alone}
            samples = interleaved_samples(cands, rounds, clock=time.process_time)
            t = {k: statistics.median(v) for k, v in samples.items()}
            rows.append(
                {
                    "leaves": leaves,
                    "optimizer": label,
                    "analysis_ms": round(t["analysis"] * 1e3, 1),
                    "stage_trace_ms": round(t["stage"] * 1e3, 1),
                    "optax_trace_ms": round(t["optax"] * 1e3, 1),
                    "reductions": len(whole.roots()),
                }
            )
    head = "| leaves | optimizer | analysis (ms) | a stage's share traced (ms) | optax on its leaves traced (ms) | reductions |"
    lines = [head, "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['leaves']} | {r['optimizer']} | {r['analysis_ms']} | {r['stage_trace_ms']} | "
            f"{r['optax_trace_ms']} | {r['reductions']} |"
        )
    return "\n".join(lines), rows


if __name__ == "__main__":
    print(run(quick=True)[0])
