"""The seed's F1 F2 B2 B1 schedule: vjpsplit residuals vs jax.export's VJP (which recomputes the forward)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import export as jexport

import vjpsplit_cli as vs
from benchmarks.timing import interleaved, ms
from benchmarks.workloads import mlp


def run(quick: bool) -> tuple[str, list[dict]]:
    rounds = 7 if quick else 40
    w = mlp(batch=512)
    params, x, labels = jax.device_put(w.args)
    half = x.shape[0] // 2
    mbs = [(params, x[:half], labels[:half]), (params, x[half:], labels[half:])]
    specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), mbs[0])

    art = vs.export(w.fn, *specs, wrt=0)
    ct = jnp.float32(0.5)

    def vjpsplit_schedule():
        o1, r1 = art.fwd(*mbs[0])
        o2, r2 = art.fwd(*mbs[1])
        g2 = art.bwd(r2, ct)
        g1 = art.bwd(r1, ct)
        return o1, o2, g1, g2

    # jax.export's own VJP: serialize(vjp_order=1); its backward takes the primals
    # and evaluates the forward again inside.
    exp = jexport.deserialize(jexport.export(jax.jit(w.fn))(*specs).serialize(vjp_order=1))
    fwd_call = jax.jit(exp.call)
    vjp_call = jax.jit(exp.vjp().call)
    flat = [jax.tree_util.tree_leaves(mb) for mb in mbs]  # the VJP module takes flat leaves

    def recompute_schedule():
        o1 = fwd_call(*mbs[0])
        o2 = fwd_call(*mbs[1])
        g2 = vjp_call(*flat[1], ct)
        g1 = vjp_call(*flat[0], ct)
        return o1, o2, g1, g2

    a, b = vjpsplit_schedule(), recompute_schedule()
    for ga, gb in zip(jax.tree_util.tree_leaves(a[2]), b[2]):
        np.testing.assert_allclose(ga, gb, rtol=1e-4, atol=1e-6)
    times = interleaved({"vjpsplit": vjpsplit_schedule, "jax.export vjp (recompute)": recompute_schedule}, rounds)
    ratio = times["vjpsplit"] / times["jax.export vjp (recompute)"]
    lines = [
        "| schedule (MLP 784-1024-1024-10, 2 microbatches of 256) | median | ratio |",
        "|---|---:|---:|",
        f"| vjpsplit artifact: F1 F2 B2 B1 from residuals | {ms(times['vjpsplit'])} | {ratio:.2f}× |",
        f"| `jax.export` VJP: backward recomputes the forward | {ms(times['jax.export vjp (recompute)'])} | 1.00× |",
    ]
    return "\n".join(lines), [{"schedule": k, "s": v} for k, v in times.items()]
