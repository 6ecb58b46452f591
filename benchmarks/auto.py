"""policy="auto" against every fixed policy: split fwd+bwd side by side; auto must be within 3% of the best."""

from __future__ import annotations

import os

import jax

import vjpsplit_cli as vs
from benchmarks.timing import interleaved, ms
from benchmarks.workloads import PERF
from vjpsplit_cli.tracing.policies import POLICIES

WRT = (0, 1)


def run(quick: bool) -> tuple[str, list[dict]]:
    """Markdown table and rows: per workload, fwd+bwd of each fixed policy and of auto (and its pick)."""
    rounds = 5 if quick else 40
    rows = []
    for make in PERF[:1] if quick else PERF:  # quick (CI proves the section runs): the MLP alone
        w = make()
        args = jax.device_put(w.args)
        steps, chosen = {}, None
        for p in (*POLICIES, "auto"):
            fwd, bwd = vs.split(w.fn, wrt=WRT, policy=p)

            def step(fwd=fwd, bwd=bwd):
                out, res = fwd(*args)
                return out, bwd(res)

            steps[p] = step
        t = interleaved(steps, rounds)
        specs = jax.tree_util.tree_map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
        chosen = vs.choose_auto(w.fn, *specs, wrt=WRT).policy  # remembered from split's own choice
        best = min(POLICIES, key=t.get)
        rows.append({"workload": w.name, **t, "chosen": chosen, "best": best, "auto/best": t["auto"] / t[best]})
    lines = [
        f"`split` fwd+bwd, medians of {rounds} interleaved rounds; load average {os.getloadavg()[0]:.1f} "
        "when done. Target: auto / best fixed ≤ 1.03×.",
        "",
        "| workload | everything | dots | nothing | auto (chose) | auto / best fixed |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['workload']} | {ms(r['everything'])} | {ms(r['dots'])} | {ms(r['nothing'])} "
            f"| {ms(r['auto'])} ({r['chosen']}) | {r['auto/best']:.2f}× (best: {r['best']}) |"
        )
    return "\n".join(lines), rows
