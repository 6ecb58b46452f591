"""Forward + backward cost: fused jit(value_and_grad) vs split vs a loaded artifact vs jax.fwd_and_bwd."""

from __future__ import annotations

import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

import vjpsplit_cli as vs
from benchmarks.timing import interleaved, ms
from benchmarks.workloads import ALL

WRT = (0, 1)  # params and the batch input, as a pipeline stage needs both


def candidates(w, tmp: Path) -> dict:
    """The four ways to get value and gradients, each a zero-argument callable."""
    args = jax.device_put(w.args)
    fused = jax.jit(jax.value_and_grad(w.fn, argnums=WRT))
    fwd, bwd = vs.split(w.fn, wrt=WRT)
    specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    vs.export(w.fn, *specs, wrt=WRT).save(tmp / f"{w.name}.vjps")
    art = vs.load(tmp / f"{w.name}.vjps")
    jfwd, jbwd = jax.fwd_and_bwd(w.fn, argnums=WRT)
    one = jnp.float32(1)

    def split_step():
        out, res = fwd(*args)
        return out, bwd(res)

    def artifact_step():
        out, res = art.fwd(*args)
        return out, art.bwd(res)

    def jax_step():
        out, res = jfwd(*args)
        return out, jbwd(res, one)

    return {"fused": lambda: fused(*args), "split": split_step, "artifact": artifact_step, "jax.fwd_and_bwd": jax_step}


def run(quick: bool) -> tuple[str, list[dict]]:
    rounds = 7 if quick else 50
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for make in ALL:
            w = make()
            times = interleaved(candidates(w, Path(d)), rounds)
            base = times["fused"]
            rows.append({"workload": w.name, **{k: v for k, v in times.items()},
                         **{f"{k}/fused": v / base for k, v in times.items()}})
    lines = ["| workload | fused `jit(value_and_grad)` | vjpsplit `split` fwd+bwd | loaded artifact fwd+bwd "
             "| `jax.fwd_and_bwd` |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['workload']} | {ms(r['fused'])} | {ms(r['split'])} ({r['split/fused']:.2f}×) "
                     f"| {ms(r['artifact'])} ({r['artifact/fused']:.2f}×) "
                     f"| {ms(r['jax.fwd_and_bwd'])} ({r['jax.fwd_and_bwd/fused']:.2f}×) |")
    return "\n".join(lines), rows
