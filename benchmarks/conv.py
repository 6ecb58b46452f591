"""The conv gap: what fused jit(value_and_grad) does that split's two programs cannot, measured.

For the conv net (and the MLP for contrast), side by side in one process: the
fused program, the forward alone (``jit(fn)``, the floor of any forward), and
split's forward and backward under each policy: wall and CPU time (CPU/wall > 1
means XLA ran thunks of one program on both cores at once) and stored residual
bytes. benchmarks/results/2026-history-single-calls.md ("Forward + backward") has what the optimized HLO of each shows.
"""

from __future__ import annotations

import os
import resource
import statistics
import time

import jax

import vjpsplit_cli as vs
from benchmarks.workloads import convnet, mlp

WRT = (0, 1)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _measure(cands: dict, rounds: int) -> dict:
    for fn in cands.values():
        jax.block_until_ready(fn())
    wall: dict = {k: [] for k in cands}
    cpu: dict = {k: [] for k in cands}
    for _ in range(rounds):
        for k, fn in cands.items():
            c0, t0 = _cpu(), time.perf_counter()
            jax.block_until_ready(fn())
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(_cpu() - c0)
    return {k: (statistics.median(wall[k]), statistics.median(cpu[k])) for k in cands}


def run(quick: bool) -> tuple[str, list[dict]]:
    """Markdown table and rows."""
    rounds = 9 if quick else 40
    rows = []
    for make in (convnet, mlp):
        w = make()
        args = jax.device_put(w.args)
        fused = jax.jit(jax.value_and_grad(w.fn, argnums=WRT))
        fonly = jax.jit(w.fn)
        cands = {"fused": lambda: fused(*args), "forward alone": lambda: fonly(*args)}
        info: dict = {}
        for p in ("everything", "dots"):
            fwd, bwd = vs.split(w.fn, wrt=WRT, policy=p)
            _, res = fwd(*args)

            def step(fwd=fwd, bwd=bwd):
                out, r = fwd(*args)
                return out, bwd(r)

            cands[f"{p}: fwd"] = lambda fwd=fwd: fwd(*args)
            cands[f"{p}: bwd"] = lambda bwd=bwd, res=res: bwd(res)
            cands[f"{p}: fwd+bwd"] = step
            info[f"{p}: fwd+bwd"] = {"bytes": res.stored_nbytes, "arrays": len(res.stored)}
        t = _measure(cands, rounds)
        base = t["fused"][0]
        for k, (wall, cpu) in t.items():
            rows.append(
                {
                    "workload": w.name,
                    "candidate": k,
                    "wall": wall,
                    "cpu": cpu,
                    "vs_fused": wall / base,
                    **info.get(k, {}),
                }
            )
    lines = [
        f"Medians of {rounds} interleaved rounds; load average {os.getloadavg()[0]:.1f} when done.",
        "",
        "| workload | candidate | wall | / fused | CPU time | CPU / wall | stored residuals |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        stored = f"{r['bytes'] / 2**20:.2f} MiB ({r['arrays']} arrays)" if r.get("bytes") is not None else ""
        lines.append(
            f"| {r['workload']} | {r['candidate']} | {r['wall'] * 1e3:.2f} ms | {r['vs_fused']:.2f}× "
            f"| {r['cpu'] * 1e3:.2f} ms | {r['cpu'] / r['wall']:.2f} | {stored} |"
        )
    return "\n".join(lines), rows
