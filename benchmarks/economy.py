"""Residual economy: stored bytes per policy vs raw jax.vjp leaves, backward time vs `everything`."""

from __future__ import annotations

import jax
import numpy as np

import vjpsplit_cli as vs
from benchmarks.timing import interleaved, ms
from benchmarks.workloads import ALL

POLICIES = ("everything", "dots", "nothing")


def raw_vjp_bytes(fn, args) -> int:
    """Bytes of every leaf plain jax.vjp keeps (inputs and weights included), under jit."""
    leaves = jax.eval_shape(lambda *a: jax.tree_util.tree_leaves(jax.vjp(fn, *a)[1]), *args)
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize for s in leaves)


def run(quick: bool) -> tuple[str, list[dict]]:
    """Markdown table and rows."""
    rounds = 5 if quick else 30
    rows = []
    for make in ALL:
        w = make()
        raw = raw_vjp_bytes(w.fn, w.args)
        bwds, stored = {}, {}
        for p in POLICIES:
            fwd, bwd = vs.split(w.fn, policy=p)
            _, res = fwd(*w.args)
            ct = None
            stored[p] = (sum(np.asarray(a).nbytes for a in res.stored.values()), len(res.stored))
            bwds[p] = lambda bwd=bwd, res=res, ct=ct: bwd(res, ct)
        times = interleaved(bwds, rounds)
        for p in POLICIES:
            rows.append(
                {
                    "workload": w.name,
                    "policy": p,
                    "stored_bytes": stored[p][0],
                    "stored_arrays": stored[p][1],
                    "raw_vjp_bytes": raw,
                    "ratio_vs_raw": stored[p][0] / raw,
                    "bwd_s": times[p],
                    "bwd_vs_everything": times[p] / times["everything"],
                }
            )
    head = (
        "| workload | policy | stored residuals | raw `jax.vjp` leaves | stored / raw | backward (median) "
        "| backward / `everything` |\n|---|---|---:|---:|---:|---:|---:|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {r['policy']} | {r['stored_bytes'] / 2**20:.2f} MiB ({r['stored_arrays']} arrays) "
            f"| {r['raw_vjp_bytes'] / 2**20:.2f} MiB | {r['ratio_vs_raw']:.2f}× | {ms(r['bwd_s'])} "
            f"| {r['bwd_vs_everything']:.2f}× |"
        )
    return "\n".join(lines), rows
