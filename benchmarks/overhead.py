"""Forward + backward cost: fused jit(value_and_grad) vs split vs a loaded artifact (default and auto policy).

Issue 14's workloads: the MLP (784-1024-1024-10, batch 256, relu, log-softmax
cross-entropy), the pre-LN causal transformer block (d=256, 4 heads, T=128,
batch 8, gelu MLP 4d) and the conv net. Candidates are interleaved round by
round in one process; ratios are of medians.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp

import vjpsplit_cli as vs
from benchmarks.timing import interleaved, ms
from benchmarks.workloads import PERF

WRT = (0, 1)  # params and the batch input, as a pipeline stage needs both
TARGET = {"mlp": 1.03, "block": 1.03, "convnet": 1.15}


def candidates(w, tmp: Path) -> tuple[dict, str]:
    """The ways to get value and gradients, each a zero-argument callable; and the policy auto chose."""
    args = jax.device_put(w.args)
    fused = jax.jit(jax.value_and_grad(w.fn, argnums=WRT))
    fwd, bwd = vs.split(w.fn, wrt=WRT)
    specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    vs.export(w.fn, *specs, wrt=WRT).save(tmp / f"{w.name}.vjps")
    art = vs.load(tmp / f"{w.name}.vjps")
    vs.export(w.fn, *specs, wrt=WRT, policy="auto").save(tmp / f"{w.name}-auto.vjps")
    auto = vs.load(tmp / f"{w.name}-auto.vjps")
    jfwd, jbwd = jax.fwd_and_bwd(w.fn, argnums=WRT)
    one = jnp.float32(1)

    def split_step():
        out, res = fwd(*args)
        return out, bwd(res)

    def artifact_step(art=art):
        out, res = art.fwd(*args)
        return out, art.bwd(res)

    def jax_step():
        out, res = jfwd(*args)
        return out, jbwd(res, one)

    return (
        {
            "fused": lambda: fused(*args),
            "split": split_step,
            "artifact": artifact_step,
            "artifact auto": lambda: artifact_step(auto),
            "jax.fwd_and_bwd": jax_step,
        },
        auto.manifest.policy,
    )


def run(quick: bool) -> tuple[str, list[dict]]:
    rounds = 3 if quick else 50  # quick proves the section runs (CI); its numbers are rough
    rows = []
    with tempfile.TemporaryDirectory() as d:
        for make in PERF[:1] if quick else PERF:  # quick: the MLP alone
            w = make()
            cands, chosen = candidates(w, Path(d))
            times = interleaved(cands, rounds)
            base = times["fused"]
            rows.append(
                {
                    "workload": w.name,
                    "auto": chosen,
                    "target": TARGET[w.name],
                    **times,
                    **{f"{k}/fused": v / base for k, v in times.items()},
                }
            )
    lines = [
        f"Medians of {rounds} interleaved rounds; load average {os.getloadavg()[0]:.1f} when done "
        f"({os.cpu_count()} cores, shared). Target: loaded artifact ≤ the ratio shown.",
        "",
        "| workload | fused `jit(value_and_grad)` | `split` fwd+bwd | loaded artifact fwd+bwd | target "
        "| artifact, `--policy auto` (chose) | `jax.fwd_and_bwd` |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        best = min(r["artifact/fused"], r["artifact auto/fused"])
        lines.append(
            f"| {r['workload']} | {ms(r['fused'])} | {ms(r['split'])} ({r['split/fused']:.2f}×) "
            f"| {ms(r['artifact'])} ({r['artifact/fused']:.2f}×) "
            f"| ≤ {r['target']:.2f}× {'met' if best <= r['target'] else 'missed'} "
            f"| {ms(r['artifact auto'])} ({r['artifact auto/fused']:.2f}×, {r['auto']}) "
            f"| {ms(r['jax.fwd_and_bwd'])} ({r['jax.fwd_and_bwd/fused']:.2f}×) |"
        )
    return "\n".join(lines), rows
